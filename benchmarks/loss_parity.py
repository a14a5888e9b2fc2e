"""Padded vs packed fine-tuning of the real SmolLM2 on CHAMP: the same examples in the same steps, side by side.

    python benchmarks/loss_parity.py --help

The code lives in `lit_packing.bench.loss_parity`;
`python -m lit_packing.bench.loss_parity` runs the same.
"""

from lit_packing.bench.loss_parity import main

if __name__ == "__main__":
    main()
