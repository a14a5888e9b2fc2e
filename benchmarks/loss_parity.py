"""Padded vs packed fine-tuning of the real SmolLM2 on CHAMP: the same examples in the same steps, side by side.

    python -m benchmarks.loss_parity --steps 8 --batch_size 4 --max_length 512 [--out runs/loss_parity]
    python -m benchmarks.loss_parity --max_length 2048 --model.model_config='{...}'  # any CLI override

Runs the benchmark's `padding` and `minibatch_packing` variants (the `paper` config with either delta: identical but
for the collator) through the real CLI in one process, then prints per-step train loss of both, their largest
difference, validation loss, and effective tokens/s with the packed/padded ratio; writes a PNG of both loss curves.
Mini-batch packing keeps the optimizer steps of padding, so with `loss_normalization: token` the two curves must
coincide up to float rounding.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from benchmarks.variants import BASELINE, PAPER_METHOD, VARIANTS
from lit_packing.cli import cli_main

COMPARED = (BASELINE, PAPER_METHOD)  # padding, mini-batch packing: the same mini-batches


def run_variant(name: str, out: Path, args: argparse.Namespace, extra: list[str]) -> dict[str, list[float]]:
    """Fit one of the benchmark's variants with a CSV logger under `out/<name>`; return its logged columns."""
    logger = f'{{"class_path": "CSVLogger", "init_args": {{"save_dir": "{out}", "name": "{name}"}}}}'
    cli_main(
        [
            "fit", *VARIANTS[name].config_args(), f"--trainer.logger={logger}",
            f"--trainer.max_steps={args.steps}", "--trainer.log_every_n_steps=1", "--trainer.accelerator=cpu",
            f"--trainer.val_check_interval={args.steps}", f"--trainer.limit_val_batches={args.val_batches}",
            "--trainer.num_sanity_val_steps=0", "--trainer.enable_checkpointing=false",
            f"--data.limit={args.limit}", f"--data.val_split={args.val_examples}",
            f"--data.max_length={args.max_length}", f"--data.sampler.init_args.batch_size={args.batch_size}",
            "--model.warmup_steps=0", f"--model.lr={args.lr}", *extra,
        ]
    )  # fmt: skip
    metrics = sorted(out.glob(f"{name}/version_*/metrics.csv"))[-1]
    columns: dict[str, list[float]] = {}
    with open(metrics) as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value:
                    columns.setdefault(key, []).append(float(value))
    return columns


def main(argv: list[str] | None = None) -> dict[str, dict[str, list[float]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--limit", type=int, default=200, help="CHAMP chats drawn (seeded)")
    parser.add_argument("--val_examples", type=int, default=16)
    parser.add_argument("--val_batches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--out", type=Path, default=Path("runs/loss_parity"))
    args, extra = parser.parse_known_args(argv)  # anything else (e.g. --model.model_config=...) goes to both runs
    results = {VARIANTS[name].label: run_variant(name, args.out, args, extra) for name in COMPARED}

    padded, packed = results.values()
    print(f"\n{'step':>4} {'padding loss':>13} {'packed loss':>13} {'abs diff':>10}")
    for step, (a, b) in enumerate(zip(padded["train/loss"], packed["train/loss"])):
        print(f"{step:>4} {a:>13.6f} {b:>13.6f} {abs(a - b):>10.2e}")
    diff = max(abs(a - b) for a, b in zip(padded["train/loss"], packed["train/loss"]))
    print(f"max |train loss difference| over {len(padded['train/loss'])} steps: {diff:.2e}")
    for name, cols in results.items():
        rate, pads = cols["train/effective_tokens_per_sec"][-1], cols["train/padding_ratio"]
        print(f"{name:>20}: val/loss {cols['val/loss'][-1]:.6f}  effective tokens/s (last window) {rate:.1f}  "
              f"padding ratio (mean) {sum(pads) / len(pads):.3f}")  # fmt: skip
    speedup = packed["train/effective_tokens_per_sec"][-1] / padded["train/effective_tokens_per_sec"][-1]
    print(f"packed / padded effective tokens/s: {speedup:.2f}x")
    plot(results, args.out / "loss_parity.png")
    return results


def plot(results: dict[str, dict[str, list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for (name, cols), style in zip(results.items(), ("-o", "--x")):
        left.plot(cols["train/loss"], style, label=name)
        right.plot(cols["train/effective_tokens_per_sec"], style, label=name)
    left.set(title="train loss per optimizer step", xlabel="step", ylabel="token-mean loss")
    right.set(title="effective (real) tokens/s", xlabel="step", ylabel="tokens/s")
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
