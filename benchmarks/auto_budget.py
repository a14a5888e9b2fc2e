"""`max_tokens: auto` on the real quickstart: the chosen budget and real steps at it, against the memory limit,

    python benchmarks/auto_budget.py --help

The code lives in `lit_packing.bench.auto_budget`;
`python -m lit_packing.bench.auto_budget` runs the same.
"""

from lit_packing.bench.auto_budget import main

if __name__ == "__main__":
    main()
