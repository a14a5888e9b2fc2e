"""ValidationSchedule: validation cadence as a fraction of the launch, and a validation at the run's last step.

    Trainer(max_steps=10, val_check_interval=0.5, callbacks=[ValidationSchedule()])   # validates at steps 5 and 10

Lightning reads a fractional `val_check_interval` as a fraction of an epoch, counted from the epoch's first batch:
a run that `max_steps` stops mid-epoch then validates late or never, and a run resumed mid-epoch validates where
the uninterrupted epoch would have, not where its own steps fall. This callback makes the same setting mean a
fraction of the optimizer steps this launch will really take, so one value works from a 2-step epoch to a million
examples, and from a fresh start as from a checkpoint.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lit_packing._compat import ready_batches, validate_after_batch
from lit_packing.callbacks.progress import planned_steps


def validation_steps(first: int, last: int, interval: float) -> list[int]:
    """The optimizer steps at which a launch from step `first` to step `last` validates under a fractional interval.

    One validation at every `interval` of the launch's `last - first` steps (rounded down to a whole step, never
    the first), so `interval=0.5` validates half-way and at the end, wherever the launch starts.

    >>> validation_steps(0, 10, 0.5), validation_steps(10, 15, 0.5), validation_steps(0, 10, 0.3)
    ([5, 10], [12, 15], [3, 6, 9])

    Args:
        first: the global step the launch starts from (0 for a fresh run, the checkpoint's step for a resumed one).
        last: the global step it ends at.
        interval: `trainer.val_check_interval`, a fraction in (0, 1].

    Returns:
        The steps, ascending, each in `(first, last]`.
    """
    steps = last - first
    # The epsilon keeps float error (3 * 0.1 * 10 = 3.0000000000000004, 0.7 * 10 = 6.999999999999999) from
    # moving a validation to the step before.
    points = {int(k * interval * steps + 1e-9) for k in range(1, int(1 / interval + 1e-9) + 1)}
    return sorted(first + point for point in points if point > 0)


class ValidationSchedule(pl.Callback):
    """A fractional `val_check_interval` counted over this launch's optimizer steps; a validation at the end.

    When this launch (`trainer.fit`, fresh or resumed from `ckpt_path`) ends inside the epoch it starts in, a
    fractional `val_check_interval` places validations at every such fraction of the launch's steps, counted from
    the step it starts at (`validation_steps`): with `val_check_interval=0.5`, a fresh 10-step run validates at
    steps 5 and 10, and the same run resumed from its step-10 checkpoint with `max_steps=15` at steps 12 and 15
    (Lightning's own cadence, counted from the epoch's start, would give 14 and 15). A launch that runs past its
    epoch keeps Lightning's cadence, a fraction of each epoch; an int interval (batches) is left to Lightning.

    Args:
        at_end: validate after the last training step when `max_steps` ends the run mid-epoch (whatever the
            cadence says about that step).
    """

    def __init__(self, at_end: bool = True) -> None:
        self.at_end = at_end
        self._due: set[int] | None = None  # the steps to validate at; None: Lightning's own cadence
        self._step = 0  # the global step at the last batch end (a step is completed where it grows)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._due, self._step = None, trainer.global_step
        interval, last = trainer.val_check_interval, planned_steps(trainer)
        if not isinstance(interval, float) or trainer.check_val_every_n_epoch is None or last is None:
            return
        launch = max(last - trainer.global_step, 0) * trainer.accumulate_grad_batches
        if ready_batches(trainer) + launch <= trainer.num_training_batches:  # the launch ends inside this epoch
            self._due = set(validation_steps(trainer.global_step, last, interval))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stepped, self._step = trainer.global_step > self._step, trainer.global_step
        if self._due is not None:
            # Decided at every batch: a micro-batch that completes no optimizer step never validates.
            validate_after_batch(trainer, stepped and trainer.global_step in self._due)
        last = trainer.max_steps is not None and 0 <= trainer.max_steps <= trainer.global_step
        if self.at_end and last and trainer.limit_val_batches:
            # Lightning validates on the batch where `should_stop` is set (as for early stopping): the run ends here
            # anyway, since `max_steps` is reached.
            trainer.should_stop = True
