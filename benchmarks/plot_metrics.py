"""Plot the curves a run logged to CSV: loss, padding ratio, effective tokens/s.

    python benchmarks/plot_metrics.py --help

The code lives in `lit_packing.bench.plot_metrics`;
`python -m lit_packing.bench.plot_metrics` runs the same.
"""

from lit_packing.bench.plot_metrics import main

if __name__ == "__main__":
    main()
