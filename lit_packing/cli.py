"""LightningCLI for lit_packing: `python main.py fit --config configs/quickstart.yaml`.

    cli_main(["fit", "--config", "configs/quickstart.yaml", "--trainer.fast_dev_run=true"])  # in-process, as tests do

Every value is overridable on the command line (`--data.sampler.init_args.max_tokens=4096`); samplers, collators
and sources are swapped by class_path, the attention backend by name (`--model.attn_backend=sdpa_mask`).
A `LitPackingError` (bad setting, bad data, a diverged or empty run) is printed alone and exits with status 2.
"""

from __future__ import annotations

import sys
import warnings

from lightning.pytorch import Trainer
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI, SaveConfigCallback

from lit_packing.callbacks import PackingMonitor, TokenThroughputMonitor
from lit_packing.data import PackingDataModule
from lit_packing.errors import LitPackingError, TrainingError
from lit_packing.models import PackedCausalLM

# W&B offline (sync later with `wandb sync runs/wandb/offline-run-*`) plus a CSV file; both under runs/.
DEFAULT_LOGGERS = [
    {
        "class_path": "lightning.pytorch.loggers.WandbLogger",
        "init_args": {"project": "lit_packing", "save_dir": "runs", "offline": True},
    },
    {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs"}},
]


class LogConfigCallback(SaveConfigCallback):
    """Save the resolved config next to the run, and send it to every logger (W&B shows it as the run's config)."""

    def save_config(self, trainer: Trainer, pl_module, stage: str) -> None:
        config = self.parser.dump(self.config, skip_none=False, format="json_indented")
        for logger in trainer.loggers:
            logger.log_hyperparams({"config": config})


class PackingCLI(LightningCLI):
    """LightningCLI with the packing callbacks always on and run-time values linked from data to model."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(PackingMonitor, "packing_monitor")
        parser.add_lightning_class_args(TokenThroughputMonitor, "throughput_monitor")
        # One name chooses the model and its tokenizer; what the tokenizer turns out to be crosses at run time.
        parser.link_arguments("model.model", "data.tokenizer")
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


def cli_main(args: ArgsType = None, run: bool = True) -> PackingCLI:
    """Build (and by default run) the CLI; `args` as a list runs in-process, e.g. from tests."""
    # The model's host-side batch guard lives in `on_before_batch_transfer` on purpose (it must see every batch,
    # whatever data module feeds it); Lightning warns whenever a module defines that hook next to a data module.
    warnings.filterwarnings("ignore", message=r".*overridden `on_before_batch_transfer` in `LightningModule`")
    try:
        return PackingCLI(
            PackedCausalLM,
            PackingDataModule,
            save_config_callback=LogConfigCallback,
            save_config_kwargs={"overwrite": True},
            trainer_defaults={
                # Our samplers split the data across ranks themselves (and keep their state for resume).
                "use_distributed_sampler": False,
                "logger": DEFAULT_LOGGERS,
            },
            seed_everything_default=42,
            args=args,
            run=run,
        )
    except LitPackingError as error:
        print(f"error: {error}", file=sys.stderr)  # the message names the fix; a traceback would bury it
        raise SystemExit(2) from None
