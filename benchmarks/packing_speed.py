"""Planning speed and fill of the packing samplers, side by side with TRL's ``pack_dataset(strategy="bfd")``.

    python benchmarks/packing_speed.py --help

The code lives in `lit_packing.bench.packing_speed`;
`python -m lit_packing.bench.packing_speed` runs the same.
"""

from lit_packing.bench.packing_speed import main

if __name__ == "__main__":
    main()
