"""Peak memory of a training step: the full-logits loss vs the chunked loss, each in its own process, side by side,

    python benchmarks/loss_memory.py --help

The code lives in `lit_packing.bench.loss_memory`;
`python -m lit_packing.bench.loss_memory` runs the same.
"""

from lit_packing.bench.loss_memory import main

if __name__ == "__main__":
    main()
