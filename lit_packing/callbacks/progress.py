"""Progress that tells the truth: a bar bounded by `max_steps`, or plain log lines when output is not a terminal.

    Trainer(callbacks=[progress_callback()])   # StepProgressBar in a terminal, ProgressLog when piped

A piped run (`| tee run.log`, CI) gets one line per logging step instead of a carriage-return bar that prints
nothing until the epoch ends: `step 3/10  train/loss 0.9120  tok/s 82.1  pad 0.000  elapsed 0:00:31  eta 0:01:12`.
"""

from __future__ import annotations

import datetime
import sys
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar


def planned_steps(trainer: pl.Trainer) -> int | None:
    """Optimizer steps this fit will run: `max_steps`, or epochs x steps per epoch, whichever ends it first."""
    per_epoch = trainer.num_training_batches
    limits = []
    if trainer.max_steps is not None and trainer.max_steps >= 0:
        limits.append(trainer.max_steps)
    if trainer.max_epochs is not None and trainer.max_epochs >= 0 and per_epoch != float("inf"):
        limits.append(trainer.max_epochs * -(-int(per_epoch) // trainer.accumulate_grad_batches))
    return min(limits) if limits else None


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, but its total is the batches this epoch will really run: a fit that stops at
    `max_steps` shows `10/10` and a matching ETA, not `10/238`."""

    @property
    def total_train_batches(self) -> int | float:
        total = super().total_train_batches
        trainer = self.trainer
        if trainer.max_steps is None or trainer.max_steps < 0:
            return total
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready  # > 0 after a mid-epoch resume
        left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
        return min(total, done + left)


class ProgressLog(ProgressBar):
    """Plain, flushed progress lines for output that is not a terminal: one per `every` optimizer steps (default:
    `trainer.log_every_n_steps`), the last step, and each validation.

    Args:
        every: print every this many optimizer steps; None follows `trainer.log_every_n_steps`.
    """

    def __init__(self, every: int | None = None) -> None:
        super().__init__()
        self.every = every
        self._enabled = True
        self._train_start = 0.0
        self._first_step = 0
        self._printed_step = -1
        self._pending: tuple[str, str] | None = None  # a step's line, printed once its metrics are published

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def print(self, *args: Any, **kwargs: Any) -> None:
        print(*args, **kwargs, flush=True)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._train_start, self._first_step = time.monotonic(), trainer.global_step
        total = planned_steps(trainer)
        if self._enabled and trainer.is_global_zero:
            self.print(f"training: {total if total is not None else 'unknown number of'} optimizer steps")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, total = trainer.global_step, planned_steps(trainer)
        every = self.every or max(trainer.log_every_n_steps, 1)
        due = step % every == 0 or step == total or step == self._first_step + 1
        # A micro-batch that completes no optimizer step yet (gradient accumulation) has nothing to report.
        started = step > self._first_step
        if not (self._enabled and trainer.is_global_zero and due and started and step != self._printed_step):
            return
        self._printed_step = step
        elapsed = time.monotonic() - self._train_start
        parts = [f"step {step}/{total}" if total is not None else f"step {step}"]
        eta = f"  eta {_clock(elapsed / (step - self._first_step) * (total - step))}" if total is not None else ""
        # Lightning publishes this step's metrics after the `on_train_batch_end` hooks: print at the next hook.
        self._pending = (parts[0], f"elapsed {_clock(elapsed)}{eta}")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._print_pending(trainer, pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._print_pending(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._print_pending(trainer, pl_module)

    def _print_pending(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending is None:
            return
        (step, times), self._pending = self._pending, None
        metrics = self.get_metrics(trainer, pl_module)
        self.print("  ".join([step, *(f"{name} {_number(value)}" for name, value in metrics.items()), times]))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._print_eval(trainer, "val/", f"validation at step {trainer.global_step}")

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._print_eval(trainer, "test/", "test")

    def _print_eval(self, trainer: pl.Trainer, prefix: str, title: str) -> None:
        if self._enabled and trainer.is_global_zero:
            metrics = {k: v for k, v in trainer.callback_metrics.items() if k.startswith(prefix)}
            self.print(f"{title}: " + "  ".join(f"{k} {_number(v)}" for k, v in metrics.items()))

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the logger's version: noise in a log line
        return {name: value for name, value in metrics.items() if not name.startswith("val/")}  # printed apart


def _number(value: Any) -> str:
    value = float(value)
    return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.4f}"


def progress_callback(stream=None) -> ProgressBar:
    """`StepProgressBar` when `stream` (default stdout) is a terminal, else `ProgressLog`."""
    stream = stream if stream is not None else sys.stdout
    return StepProgressBar() if stream.isatty() else ProgressLog()
