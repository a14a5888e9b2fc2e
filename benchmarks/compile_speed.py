"""Eager vs `compile: true` training steps, side by side: the first step's cost (compilation) and the steady-state

    python benchmarks/compile_speed.py --help

The code lives in `lit_packing.bench.compile_speed`;
`python -m lit_packing.bench.compile_speed` runs the same.
"""

from lit_packing.bench.compile_speed import main

if __name__ == "__main__":
    main()
