"""`compile: true` on CPU (inductor): a few real Trainer steps give the eager losses, and the recompile counter
stops growing once the bucket sizes have been seen."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from lit_packing.data.collate import PackedCollator
from lit_packing.models import PackedCausalLM
from tests.conftest import TINY_CONFIGS
from tests.models.test_attention import make_examples

# Real lengths differ every step (and so does the number of examples); the buckets make T one of two sizes.
STEPS = [[30, 50, 20], [90, 100], [10, 40, 35, 25], [120, 70], [15, 15, 15, 15, 15]]
BUCKETS = [128, 256]


class Record(Callback):
    def __init__(self):
        self.losses, self.recompiles = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        self.recompiles.append(float(trainer.callback_metrics.get("train/recompiles", -1)))


def fit(compile: bool) -> Record:
    torch.manual_seed(0)
    lm = PackedCausalLM(model_config=dict(TINY_CONFIGS["llama"], vocab_size=1000), compile=compile, lr=1e-3)
    collate = PackedCollator(bucket_sizes=BUCKETS)
    batches = [collate(make_examples(lengths, seed=i)) for i, lengths in enumerate(STEPS)]
    record = Record()
    trainer = Trainer(
        accelerator="cpu",
        max_steps=len(batches),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[record],
    )
    trainer.fit(lm, DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
    return record


@pytest.mark.slow
def test_compiled_training_matches_eager_and_recompiles_are_bounded():
    torch._dynamo.reset()
    eager, compiled = fit(False), fit(True)
    torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(eager.losses), rtol=1e-4, atol=1e-5)
    assert eager.recompiles == [-1] * len(STEPS)  # not logged without compile
    first_bucket_again = 2  # steps 0 and 1 are 128 and 256 tokens; every later step reuses one of the two
    assert compiled.recompiles[0] == 0
    assert compiled.recompiles[first_bucket_again:] == [compiled.recompiles[first_bucket_again - 1]] * 3
