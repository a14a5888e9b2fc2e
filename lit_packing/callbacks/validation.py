"""ValidationSchedule: validation cadence as a fraction of the run, and a validation at the run's last step.

    Trainer(max_steps=10, val_check_interval=0.5, callbacks=[ValidationSchedule()])   # validates at steps 5 and 10

Lightning reads a fractional `val_check_interval` as a fraction of an epoch and validates at the end of an epoch:
a run that `max_steps` stops mid-epoch then validates late or never. This callback makes the same setting mean a
fraction of the steps the run will really take, so one value works from a 2-step epoch to a million examples.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lit_packing.callbacks.progress import planned_steps


class ValidationSchedule(pl.Callback):
    """Fractional `val_check_interval` counted over the run when `max_steps` ends it mid-epoch; validate at the end.

    Args:
        at_end: validate after the last training step when `max_steps` ends the run mid-epoch (the end of an
            epoch validates anyway).
    """

    def __init__(self, at_end: bool = True) -> None:
        self.at_end = at_end

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        interval, steps = trainer.val_check_interval, planned_steps(trainer)
        if not isinstance(interval, float) or trainer.check_val_every_n_epoch is None or steps is None:
            return
        batches = steps * trainer.accumulate_grad_batches
        if batches < trainer.num_training_batches:  # the run ends inside its first epoch
            trainer.val_check_batch = max(1, int(batches * interval))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        last = trainer.max_steps is not None and 0 <= trainer.max_steps <= trainer.global_step
        if self.at_end and last and trainer.limit_val_batches:
            # Lightning validates on the batch where `should_stop` is set (as for early stopping): the run ends here
            # anyway, since `max_steps` is reached.
            trainer.should_stop = True
