"""The streaming pipeline alone: time to the first step (20k vs 2M chats), memory over a pass, throughput, shares.

    python benchmarks/stream_pipeline.py --help

The code lives in `lit_packing.bench.stream_pipeline`;
`python -m lit_packing.bench.stream_pipeline` runs the same.
"""

from lit_packing.bench.stream_pipeline import main

if __name__ == "__main__":
    main()
