"""What verifying the tokenization cache costs: the size + XXH3-128 check against a load from cache, on full CHAMP.

    python benchmarks/cache_check.py --help

The code lives in `lit_packing.bench.cache_check`;
`python -m lit_packing.bench.cache_check` runs the same.
"""

from lit_packing.bench.cache_check import main

if __name__ == "__main__":
    main()
