"""LightningCLI for lit_packing: `python main.py fit --config configs/quickstart.yaml`.

    cli_main(["fit", "--config", "configs/quickstart.yaml", "--trainer.fast_dev_run=true"])  # in-process, as tests do

Every value is overridable on the command line (`--data.sampler.init_args.max_tokens=4096`); samplers, collators
and sources are swapped by class_path, the attention backend by name (`--model.attn_backend=sdpa_mask`).
A `LitPackingError` (bad setting, bad data, a diverged or empty run) is printed alone and exits with status 2.
Defaults chosen for a first run: W&B (offline) + CSV logs and the resolved config in the run's folder, one
`runs/checkpoints/last.ckpt` overwritten by each fit, progress bounded by `max_steps` (plain lines when output is
not a terminal), validation cadence as a fraction of the run, and third-party tips and known-harmless warnings off.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import datasets
import transformers
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger

from lit_packing.callbacks import PackingMonitor, TokenThroughputMonitor
from lit_packing.callbacks.checkpoint import LastCheckpoint
from lit_packing.callbacks.progress import progress_callback
from lit_packing.callbacks.validation import ValidationSchedule
from lit_packing.data import PackingDataModule
from lit_packing.errors import LitPackingError, TrainingError
from lit_packing.models import PackedCausalLM

# W&B offline (sync later with `wandb sync runs/wandb/offline-run-*`) plus a CSV file; both under runs/.
DEFAULT_LOGGERS = [
    {
        "class_path": "lit_packing.loggers.LazyWandbLogger",
        "init_args": {"project": "lit_packing", "save_dir": "runs", "offline": True},
    },
    {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs", "name": "lit_packing"}},
]
# Lightning's advertising, and messages that our own defaults make harmless (each explained where it is filtered).
QUIET_LOG_MESSAGES = ("💡 Tip:",)
QUIET_WARNINGS = (
    # Our model's host-side batch guard lives in `on_before_batch_transfer` on purpose (it must see every batch,
    # whatever data module feeds it); Lightning warns whenever a module defines that hook next to a data module.
    r".*overridden `on_before_batch_transfer` in `LightningModule`",
    # LastCheckpoint overwrites runs/checkpoints/last.ckpt by design.
    r"Checkpoint directory .* exists and is not empty",
    # Lightning calls a torch pytree API that torch 2.13 deprecates; nothing to change on our side.
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # Our samplers are the batch samplers; the loader's own `num_workers=0` is the right default on a CPU.
    r".*does not have many workers which may be a bottleneck",
)


class _DropMessages(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(QUIET_LOG_MESSAGES)


class _StderrHandler(logging.StreamHandler):
    """A handler writing to whatever `sys.stderr` is when a record comes (pytest and notebooks replace it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        """The stream is always the current `sys.stderr`."""


def quiet_defaults() -> None:
    """Filter third-party tips and known-harmless warnings; show lit_packing's own INFO lines (e.g. the one-time
    model conversion); no colour codes when output is not a terminal."""
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropMessages) for f in rank_zero.filters):
        rank_zero.addFilter(_DropMessages())
    ours = logging.getLogger("lit_packing")
    if not ours.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False
    os.environ.setdefault("WANDB_SILENT", "true")  # W&B's banner; `wandb sync` is printed in our README and config
    if not sys.stdout.isatty():
        os.environ.setdefault("NO_COLOR", "1")  # rich and W&B honour it
        # Carriage-return bars (weight loading, tokenization) are one garbled line in a log; our own lines announce
        # the slow steps instead.
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()


class LogConfigCallback(SaveConfigCallback):
    """Save the resolved config as `config.yaml` in the run's own folder (the CSV logger's `version_N`) and send
    it, as nested keys, to every logger: once training starts, so that a fit that fails earlier leaves nothing."""

    def setup(self, trainer: Trainer, pl_module, stage: str) -> None:
        """Nothing before training starts (Lightning's version writes `<log_dir>/config.yaml` here)."""

    def on_train_start(self, trainer: Trainer, pl_module) -> None:
        if self.already_saved:
            return
        csv_dirs = [lg.log_dir for lg in trainer.loggers if isinstance(lg, CSVLogger)]
        run_dir = csv_dirs[0] if csv_dirs else trainer.log_dir  # `trainer.log_dir` broadcasts: every rank asks
        if trainer.is_global_zero:
            os.makedirs(run_dir, exist_ok=True)
            path = os.path.join(run_dir, self.config_filename)
            self.parser.save(self.config, path, skip_none=False, overwrite=True, multifile=self.multifile)
            config = self.config.clone()
            config.pop("config", None)  # the paths of the --config files, not settings
            for logger in trainer.loggers:
                logger.log_hyperparams(config.as_dict())
        self.already_saved = True


class PackingCLI(LightningCLI):
    """LightningCLI with the packing callbacks always on and run-time values linked from data to model."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(PackingMonitor, "packing_monitor")
        parser.add_lightning_class_args(TokenThroughputMonitor, "throughput_monitor")
        parser.add_lightning_class_args(ValidationSchedule, "validation_schedule")
        # One name chooses the model and its tokenizer; what the tokenizer turns out to be crosses at run time.
        parser.link_arguments("model.name_or_path", "data.tokenizer")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")

    def after_fit(self) -> None:
        """A fit that was asked to train and took no optimizer step is an error, not a success."""
        trainer = self.trainer
        asked = trainer.max_steps != 0 and trainer.max_epochs != 0 and trainer.limit_train_batches != 0
        if asked and trainer.global_step == 0:
            raise TrainingError(
                "fit took no optimizer step (no training batch): check the data report above, "
                "trainer.limit_train_batches and trainer.accumulate_grad_batches"
            )

    def instantiate_trainer(self, **kwargs) -> Trainer:
        """Add the progress display and the checkpoint policy, unless the config turns them off or brings its own
        `ModelCheckpoint`."""
        trainer_config = self._get(self.config_init, "trainer", default={})
        configured = trainer_config.get("callbacks") or []
        callbacks = list(configured) if isinstance(configured, list) else [configured]
        if trainer_config.get("enable_progress_bar", True) is not False:
            callbacks.append(progress_callback())
        chose_checkpoints = any(isinstance(cb, ModelCheckpoint) for cb in callbacks)  # e.g. configs/multinode.yaml
        if trainer_config.get("enable_checkpointing", True) is not False and not chose_checkpoints:
            callbacks.append(LastCheckpoint())
        return super().instantiate_trainer(**kwargs, callbacks=callbacks)


def cli_main(args: ArgsType = None, run: bool = True) -> PackingCLI:
    """Build (and by default run) the CLI; `args` as a list runs in-process, e.g. from tests. A `--config` value
    may name a packaged config (`--config quickstart`, see `lit_packing.configs`)."""
    from lit_packing.configs import resolve_config_args

    quiet_defaults()
    try:
        if args is None:
            resolve_config_args()  # rewrites sys.argv[1:] in place: LightningCLI reads it (args and argv both warn)
        elif isinstance(args, (list, tuple)):
            args = resolve_config_args(list(args))
        return PackingCLI(
            PackedCausalLM,
            PackingDataModule,
            save_config_callback=LogConfigCallback,
            save_config_kwargs={"overwrite": True},
            trainer_defaults={
                # Our samplers split the data across ranks themselves (and keep their state for resume).
                "use_distributed_sampler": False,
                "logger": DEFAULT_LOGGERS,
                "default_root_dir": "runs",
            },
            seed_everything_default=42,
            args=args,
            run=run,
        )
    except LitPackingError as error:
        print(f"error: {error}", file=sys.stderr)  # the message names the fix; a traceback would bury it
        raise SystemExit(2) from None
