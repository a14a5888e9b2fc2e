"""Forward + backward throughput of padding vs packing (per attention backend) on CHAMP-like lengths.

    python benchmarks/attention_throughput.py --help

The code lives in `lit_packing.bench.attention_throughput`;
`python -m lit_packing.bench.attention_throughput` runs the same.
"""

from lit_packing.bench.attention_throughput import main

if __name__ == "__main__":
    main()
