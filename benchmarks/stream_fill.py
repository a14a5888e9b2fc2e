"""Packing in windows (streaming) against packing the whole epoch: the fill that buffered packing loses.

    python benchmarks/stream_fill.py --help

The code lives in `lit_packing.bench.stream_fill`;
`python -m lit_packing.bench.stream_fill` runs the same.
"""

from lit_packing.bench.stream_fill import main

if __name__ == "__main__":
    main()
