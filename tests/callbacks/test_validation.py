"""ValidationSchedule on real fits of Lightning's `BoringModel` (64 batches per epoch): a fractional interval counted
over each launch's optimizer steps, fresh or resumed mid-epoch, with gradient accumulation."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader

from lit_packing.callbacks import LastCheckpoint
from lit_packing.callbacks.validation import ValidationSchedule, validation_steps


class ValidationSteps(BoringModel):
    """Records the global step of every validation."""

    def __init__(self) -> None:
        super().__init__()
        self.validated_at: list[int] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64))

    def on_validation_start(self) -> None:
        self.validated_at.append(self.trainer.global_step)


def fit(tmp_path, max_steps: int, accumulate: int, ckpt_path=None) -> list[int]:
    """The validation steps of a fit (`runs/checkpoints/last.ckpt` under `tmp_path` saved after each, mid-epoch)."""
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, max_steps=max_steps, accumulate_grad_batches=accumulate,
        val_check_interval=0.5, limit_val_batches=1, num_sanity_val_steps=0,
        callbacks=[ValidationSchedule(), LastCheckpoint()], logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    model = ValidationSteps()
    trainer.fit(model, ckpt_path=ckpt_path)
    return model.validated_at


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_resumed_launch_validates_half_way_through_its_own_steps_and_at_its_end(tmp_path, accumulate):
    """10 steps, then resumed to 15: 5 and 10, then 12 and 15 (Lightning's count from the epoch's start: 14, 15)."""
    assert fit(tmp_path, 10, accumulate) == [5, 10]
    assert fit(tmp_path, 15, accumulate, ckpt_path=tmp_path / "checkpoints" / "last.ckpt") == [12, 15]


def test_validation_steps_are_whole_steps_of_the_launch():
    assert validation_steps(0, 10, 0.1) == list(range(1, 11))  # 0.1 * 7 * 10 = 7.000000000000001, not 6
    assert validation_steps(0, 10, 0.7) == [7]  # 0.7 * 10 = 6.999999999999999: step 7, not 6
    assert validation_steps(0, 3, 0.25) == [1, 2, 3]  # 0.75 step rounds down to none, never the first step
    assert validation_steps(4, 6, 1.0) == [6]
