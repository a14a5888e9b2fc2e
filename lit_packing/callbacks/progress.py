"""Progress that tells the truth: a bar bounded by `max_steps`, or plain log lines when output is not a terminal.

    Trainer(callbacks=[progress_callback()])   # StepProgressBar in a terminal, ProgressLog when piped

A piped run (`| tee run.log`, CI) gets one line per logging step instead of a carriage-return bar that prints
nothing until the epoch ends: `step 3/10  pad 0.0000  train/loss 0.9120  tok/s 82.1  elapsed 0:00:31  eta 0:01:12`.
"""

from __future__ import annotations

import datetime
import sys
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.trainer.states import TrainerFn

from lit_packing._compat import ready_batches
from lit_packing.text import count


def planned_steps(trainer: pl.Trainer) -> int | None:
    """The global step this fit will end at: `max_steps`, or epochs x steps per epoch, whichever comes first.

    Counted over the whole run: a fit resumed from a step-10 checkpoint with `max_steps=15` plans 15 (this launch
    runs the 5 steps after `trainer.global_step`). None when nothing bounds the run.
    """
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
        done = ready_batches(trainer)  # > 0 after a mid-epoch resume
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
        self._checkpoint_step: int | None = None  # the global step of the checkpoint this stage loaded

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def print(self, *args: Any, **kwargs: Any) -> None:
        print(*args, **kwargs, flush=True)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._checkpoint_step = None  # Lightning restores a checkpoint after `setup`: a new stage, a new checkpoint

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        # `fit` restores the checkpoint's step into `trainer.global_step`; `validate` and `test` do not.
        self._checkpoint_step = checkpoint.get("global_step")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._train_start, self._first_step = time.monotonic(), trainer.global_step
        if self._enabled and trainer.is_global_zero:
            self.print(f"training: {launch_plan(trainer.global_step, planned_steps(trainer))}")

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
        self.print("  ".join([step, *(f"{name} {_number(name, value)}" for name, value in metrics.items()), times]))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._print_eval(trainer, "val/", "validation")

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._print_eval(trainer, "test/", "test")

    def model_step(self, trainer: pl.Trainer) -> int | None:
        """The optimizer steps the evaluated weights were trained for: the global step in `fit`, the checkpoint's
        in `validate` / `test` with `ckpt_path`, else the steps of an earlier `fit` of this trainer; None when
        unknown (e.g. weights loaded from `model.name_or_path`)."""
        if trainer.state.fn == TrainerFn.FITTING:
            return trainer.global_step
        if self._checkpoint_step is not None:
            return self._checkpoint_step
        return trainer.global_step or None

    def _print_eval(self, trainer: pl.Trainer, prefix: str, title: str) -> None:
        if self._enabled and trainer.is_global_zero:
            step = self.model_step(trainer)
            metrics = {k: v for k, v in trainer.callback_metrics.items() if k.startswith(prefix)}
            where = f" at step {step:,}" if step is not None else ""
            self.print(f"{title}{where}: " + "  ".join(f"{k} {_number(k, v)}" for k, v in metrics.items()))

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the logger's version: noise in a log line
        return {name: value for name, value in metrics.items() if not name.startswith("val/")}  # printed apart


def launch_plan(first: int, last: int | None) -> str:
    """What a launch will train, in words.

    >>> launch_plan(0, 10), launch_plan(0, 1), launch_plan(10, 15)
    ('10 optimizer steps', '1 optimizer step', '5 optimizer steps, from step 10 to 15')
    >>> launch_plan(0, None)
    'unknown number of optimizer steps'
    """
    if last is None:
        return "unknown number of optimizer steps" + (f", from step {first:,}" if first else "")
    return count(last - first, "optimizer step") + (f", from step {first:,} to {last:,}" if first else "")


def _number(name: str, value: Any) -> str:
    """A metric as the log lines show it: a rate (`tok/s`, `..._per_sec`) with one decimal, anything else (losses,
    ratios, perplexity, accuracy) with four."""
    value = float(value)
    return f"{value:,.1f}" if name.endswith(("/s", "_per_sec")) else f"{value:,.4f}"


def progress_callback(stream=None) -> ProgressBar:
    """`StepProgressBar` when `stream` (default stdout) is a terminal, else `ProgressLog`."""
    stream = stream if stream is not None else sys.stdout
    return StepProgressBar() if stream.isatty() else ProgressLog()
