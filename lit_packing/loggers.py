"""Loggers as the CLI's defaults use them: `LazyWandbLogger` starts its W&B run with training.

LazyWandbLogger(project="lit_packing", save_dir="runs", offline=True)   # no runs/wandb/ folder until step 1
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.loggers import WandbLogger as _LightningWandbLogger
from lightning.pytorch.utilities import rank_zero_only

from lit_packing._compat import detach_wandb_run, dummy_experiment, wandb_init_kwargs, wandb_run


class LazyWandbLogger(_LightningWandbLogger):
    """Lightning's `WandbLogger` (same arguments) that creates the W&B run at the first logged metrics.

    A name of its own, so that `--trainer.logger=WandbLogger` still means Lightning's, unambiguously. The run is
    finished when the trainer finalizes its loggers, so a second fit in the same process (tests, notebooks) gets
    its own run instead of writing into the first one.

    Lightning touches `experiment` and logs hyperparameters before the first step, which creates a run folder
    even for a fit that then fails in its data or model set-up; here, until the first metrics, `experiment` is a
    no-op stand-in and hyperparameters wait, so a run that never trained leaves nothing behind. Lightning's
    unused `anonymous` argument is not passed on (W&B warns that it has no effect).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        init_kwargs = wandb_init_kwargs(self)
        if init_kwargs.get("anonymous") is None:
            init_kwargs.pop("anonymous", None)
        self._pending_hparams: list[dict[str, Any] | Namespace] = []
        self._started = False

    @property
    def experiment(self) -> Any:
        if wandb_run(self) is None and not self._started:
            return dummy_experiment()
        return super().experiment

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace) -> None:
        if not self._started:
            self._pending_hparams.append(params)
            return
        super().log_hyperparams(params)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self._started = True
        pending, self._pending_hparams = self._pending_hparams, []
        for params in pending:
            super().log_hyperparams(params)  # creates the run
        super().log_metrics(metrics, step)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        super().finalize(status)
        run = wandb_run(self)
        if run is not None and hasattr(run, "finish"):
            detach_wandb_run(self)  # its id stays the logger's version: a later stage of the trainer resumes it
            run.finish()
