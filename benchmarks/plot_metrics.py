"""Plot the curves a run logged to CSV: loss, padding ratio, effective tokens/s; or, for an RL run, the reward (with
its running mean), the completions' length, entropy and clip fraction.

python -m benchmarks.plot_metrics runs/quickstart/version_0/metrics.csv --out docs/quickstart_curves.png
python -m benchmarks.plot_metrics runs/grpo/version_0/metrics.csv --kind rl --out docs/grpo_reward.png
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

PANELS = (
    ("train/loss", "val/loss", "loss (token mean)"),
    ("train/padding_ratio", "train/packing_efficiency", "padding ratio / packing efficiency"),
    ("train/effective_tokens_per_sec", "train/slot_tokens_per_sec", "tokens/s (real vs computed slots)"),
)
RL_PANELS = (
    ("rollout/reward", None, "mean reward of each round (line: running mean of 8)"),
    ("train/completion_length", None, "completion tokens (mean)"),
    ("train/entropy", "train/clip_ratio/region_mean", "entropy / clipped fraction"),
)
RUNNING = 8  # rounds in the reward's running mean


def read_columns(path: Path) -> dict[str, tuple[list[float], list[float]]]:
    """metric -> (steps, values), skipping the rows where the metric was not logged."""
    columns: dict[str, tuple[list[float], list[float]]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value and key != "step":
                    steps, values = columns.setdefault(key, ([], []))
                    steps.append(float(row["step"]))
                    values.append(float(value))
    return columns


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", type=Path, help="a CSVLogger metrics.csv")
    parser.add_argument("--out", type=Path, default=Path("curves.png"))
    parser.add_argument("--kind", choices=("sft", "rl"), default="sft", help="which curves (rl: an RL run's)")
    args = parser.parse_args(argv)
    panels = RL_PANELS if args.kind == "rl" else PANELS
    columns = read_columns(args.metrics)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4))
    for ax, (first, second, title) in zip(axes, panels):
        for name, style in ((first, "-o"), (second, "--s")):
            if name in columns:
                ax.plot(*columns[name], style, label=name, markersize=4)
        if first == "rollout/reward" and first in columns:
            steps, values = columns[first]
            means = [sum(values[max(0, i - RUNNING + 1) : i + 1]) / len(values[max(0, i - RUNNING + 1) : i + 1])
                     for i in range(len(values))]  # fmt: skip
            ax.plot(steps, means, "-", linewidth=2.5, label=f"running mean of {RUNNING}")
        ax.set(title=title, xlabel="optimizer step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(str(args.metrics))
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
