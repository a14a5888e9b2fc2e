"""`compile: true` on CPU (inductor): a few real Trainer steps give the eager losses, and `train/recompiles` stays 0
however T changes."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lit_packing.data.collate import PackedCollator
from lit_packing.models import PackedCausalLM
from tests.conftest import TINY_CONFIGS
from tests.helpers import make_examples

# Real lengths differ every step (and so does the number of examples); the buckets make T one of two sizes.
STEPS = [[30, 50, 20], [90, 100], [10, 40, 35, 25], [120, 70], [15, 15, 15, 15, 15]]
BUCKETS = [128, 256]


def fit(compile: bool, buckets: list[int] | None, save_dir) -> dict[str, list[float]]:
    """Train 5 steps; the logged per-step `train/loss` and `train/recompiles`, read back from the CSV log."""
    torch.manual_seed(0)
    lm = PackedCausalLM(model_config=dict(TINY_CONFIGS["llama"], vocab_size=1000), compile=compile, lr=1e-3)
    collate = PackedCollator(bucket_sizes=buckets)
    batches = [collate(make_examples(lengths, seed=i)) for i, lengths in enumerate(STEPS)]
    logger = CSVLogger(save_dir, name=f"compile_{compile}_{buckets}")
    trainer = Trainer(
        accelerator="cpu",
        max_steps=len(batches),
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(lm, DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return {key: [float(r[key]) for r in rows if r.get(key)] for key in ("train/loss", "train/recompiles")}


@pytest.mark.slow
def test_compiled_training_matches_eager_and_does_not_recompile_per_shape(tmp_path):
    """Five steps of 2-5 examples each: T varies every step (100, 190, 110, 190, 75 tokens), or takes two bucket
    sizes. After the first step (which compiles, and recompiles once for the isolation self-test's shorter
    sample: automatic dynamic shapes then make T symbolic) no step compiles a graph again, buckets or not.

    Run in a fresh interpreter, so that a compiled kernel that corrupts memory cannot reach other tests: on AVX-512
    CPUs torch 2.13's inductor compiled these graphs into 512-bit kernels that wrote past a buffer (NaN logits in
    the compiled fit's self-test, or the process aborted), which is why `compile: true` on a CPU now compiles with
    256-bit vectors. The checks are `compiled_matches_eager`'s."""
    root = Path(__file__).resolve().parents[2]
    code = f"from tests.models.test_compile import compiled_matches_eager; compiled_matches_eager({str(tmp_path)!r})"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stderr[-4000:]


def compiled_matches_eager(tmp_path: str) -> None:
    """The test's checks, in this process."""
    torch._dynamo.reset()
    eager = fit(False, None, tmp_path)
    assert len(eager["train/loss"]) == len(STEPS) and eager["train/recompiles"] == []  # logged only when compiling
    for buckets in (None, BUCKETS):
        compiled = fit(True, buckets, tmp_path)
        torch.testing.assert_close(
            torch.tensor(compiled["train/loss"]), torch.tensor(eager["train/loss"]), rtol=1e-4, atol=1e-5
        )
        assert compiled["train/recompiles"] == [0.0] * len(STEPS)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it did compile
