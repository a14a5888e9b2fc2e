"""A checkpoint save's cost, Lightning's writer against `AtomicCheckpointIO`: peak memory above what the process
held before the save (resident set, sampled every 2 ms, and Python allocations by `tracemalloc`), the most it put
in `TMPDIR` at once, and its time, on a real Trainer after one AdamW step of a model of `--mb` MB of fp32 weights.

    python -m benchmarks.checkpoint_save --mb 256     # each writer in a process of its own; prints a table

Each measurement runs in a fresh process, so that one writer's freed memory does not lower the other's peak.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

WRITERS = {"lightning": "TorchCheckpointIO (Lightning's default)", "atomic": "AtomicCheckpointIO"}


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):  # a file renamed away meanwhile
                total += os.path.getsize(os.path.join(root, name))
    return total


def measure(writer: str, megabytes: int, folder: Path) -> dict:
    """One save of a `megabytes` MB model (+ AdamW state) with `writer`, in this process."""
    import torch
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch import LightningModule, Trainer

    from lit_packing.checkpoint_io import AtomicCheckpointIO

    class Wide(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            side = int((megabytes * 1e6 / 4 / 8) ** 0.5)
            self.layers = torch.nn.Sequential(*(torch.nn.Linear(side, side, bias=False) for _ in range(8)))

        def training_step(self, batch, batch_idx):
            return self.layers(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            side = self.layers[0].in_features
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(2, side)), batch_size=2)

    staging = folder / "TMPDIR"
    staging.mkdir()
    os.environ["TMPDIR"] = str(staging)
    tempfile.tempdir = None
    plugin = AtomicCheckpointIO() if writer == "atomic" else TorchCheckpointIO()
    trainer = Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=folder, plugins=[plugin],
    )  # fmt: skip
    model = Wide()
    trainer.fit(model)
    path = folder / "checkpoints" / "last.ckpt"
    peaks = {"rss": 0, "tmpdir": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peaks["rss"] = max(peaks["rss"], resident_bytes())
            peaks["tmpdir"] = max(peaks["tmpdir"], folder_bytes(staging))
            time.sleep(0.002)

    before = resident_bytes()
    sampler = threading.Thread(target=sample)
    tracemalloc.start()
    sampler.start()
    started = time.perf_counter()
    trainer.save_checkpoint(path)
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    python_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "writer": writer, "weights_mb": weights / 1e6, "file_mb": path.stat().st_size / 1e6,
        "rss_above_mb": (peaks["rss"] - before) / 1e6, "python_peak_mb": python_peak / 1e6,
        "tmpdir_peak_mb": peaks["tmpdir"] / 1e6, "seconds": seconds,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="fp32 weights of the model, in MB")
    parser.add_argument("--writer", choices=sorted(WRITERS), help=argparse.SUPPRESS)  # one measurement, here
    args = parser.parse_args(argv)
    if args.writer:
        with tempfile.TemporaryDirectory(dir=os.getcwd(), prefix=".checkpoint_save_") as folder:
            print(json.dumps(measure(args.writer, args.mb, Path(folder))))
        return
    rows = []
    for writer in WRITERS:
        command = [sys.executable, "-m", "benchmarks.checkpoint_save", "--mb", str(args.mb), "--writer", writer]
        output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(output.strip().splitlines()[-1]))
    print("| writer | weights | file | peak RSS above before | Python allocations peak | in TMPDIR at once | time |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {WRITERS[row['writer']]} | {row['weights_mb']:,.0f} MB | {row['file_mb']:,.0f} MB "
            f"| {row['rss_above_mb']:,.0f} MB | {row['python_peak_mb']:,.0f} MB | {row['tmpdir_peak_mb']:,.0f} MB "
            f"| {row['seconds']:.2f} s |"
        )


if __name__ == "__main__":
    main()
