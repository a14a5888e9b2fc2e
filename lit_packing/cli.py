"""LightningCLI for lit_packing: `python main.py fit --config configs/quickstart.yaml`.

    cli_main(["fit", "--config", "configs/quickstart.yaml", "--trainer.fast_dev_run=true"])  # in-process, as tests do

Every value is overridable on the command line (`--data.sampler.init_args.max_tokens=4096`); samplers, collators
and sources are swapped by class_path, the attention backend by name (`--model.attn_backend=sdpa_mask`).
A `LitPackingError` (bad setting, bad data, a diverged or empty run) is printed alone and exits with status 2.
Defaults chosen for a first run: each fit in a folder of its own (`runs/<run_name>/version_<N>/`, `lit_packing.runs`)
holding the resolved config, the CSV metrics and one `checkpoints/last.ckpt` rewritten atomically
(`AtomicCheckpointIO`); W&B offline; a preemption signal ending the fit at a step's end with a checkpoint and a SLURM
requeue (`PreemptionCheckpoint`); `--ckpt_path=last` resuming the run's newest complete checkpoint in its folder (for
`validate` and `test`: evaluating it); progress bounded by `max_steps` (plain lines
when output is not a terminal), validation cadence as a fraction of the run, and third-party tips and
known-harmless warnings off.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import re
import shlex
import sys
import time
import warnings
from pathlib import Path
from typing import NoReturn

import datasets
import transformers
from jsonargparse import ArgumentParser, Namespace
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_packing._compat import (
    cli_setting,
    last_saved_checkpoint,
    launched_ranks,
    parser_options,
    quiet_process_observer,
    set_default_root_dir,
)
from lit_packing.callbacks import PackingMonitor, TokenThroughputMonitor
from lit_packing.callbacks.checkpoint import LastCheckpoint
from lit_packing.callbacks.preemption import PreemptionCheckpoint
from lit_packing.callbacks.progress import progress_callback
from lit_packing.callbacks.validation import ValidationSchedule
from lit_packing.checkpoint_io import AtomicCheckpointIO, clear_leftovers
from lit_packing.data import PackingDataModule
from lit_packing.errors import ConfigError, LitPackingError, TrainingError
from lit_packing.models import PackedCausalLM
from lit_packing.models.materialize import deferred_weights
from lit_packing.models.quantize import compute_dtype
from lit_packing.preflight import (
    Position,
    check_left_to_train,
    launch_shape,
    preflight,
    read_position,
)
from lit_packing.processes import PEER_LOST_STATUS, PeerLost, dead_rank, peer_lost, tie_to_launcher, watch_ranks
from lit_packing.runs import (
    CHOSEN,
    LAST_NAME,
    RunFolder,
    checkpoints_in,
    choose_folder,
    chosen_by_rank_zero,
    is_first_rank,
    launch_id,
    newest_complete,
    run_name,
)
from lit_packing.strategies import (
    LIGHTNING_DDP,
    LIGHTNING_MODEL_PARALLEL,
    TIMEOUT_SETTING,
    DDPStrategy,
    ShardedStrategy,
    process_group_timeout,
)

log = logging.getLogger("lit_packing")
# W&B offline (sync later with `wandb sync runs/wandb/offline-run-*`) plus a CSV file in the run's folder (their
# names and versions are the run's: `place_loggers`).
DEFAULT_LOGGERS = [
    {
        "class_path": "lit_packing.loggers.LazyWandbLogger",
        "init_args": {"project": "lit_packing", "save_dir": "runs", "offline": True},
    },
    {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs", "name": "lit_packing"}},
]
# Settings set through another (`link_arguments`): an error about one is about the setting the user gave.
LINKED = {"data.tokenizer": "model.name_or_path"}
SHARDED = f"{ShardedStrategy.__module__}.{ShardedStrategy.__name__}"
DDP = f"{DDPStrategy.__module__}.{DDPStrategy.__name__}"
# Lightning's strategies as they may be named (a registry name, a class name, a class path), and the toolkit's
# class that runs in their place (`toolkit_strategy`).
TOOLKIT_STRATEGIES = {
    "ddp": DDP,
    "DDPStrategy": DDP,
    LIGHTNING_DDP: DDP,
    "ModelParallelStrategy": SHARDED,
    LIGHTNING_MODEL_PARALLEL: SHARDED,
}
# Lightning's advertising, and messages that our own defaults make harmless (each explained where it is filtered).
QUIET_LOG_MESSAGES = ("💡 Tip:",)
QUIET_WARNINGS = (
    # Our model's host-side batch guard lives in `on_before_batch_transfer` on purpose (it must see every batch,
    # whatever data module feeds it); Lightning warns whenever a module defines that hook next to a data module.
    r".*overridden `on_before_batch_transfer` in `LightningModule`",
    # LastCheckpoint rewrites its last.ckpt by design, and a resumed fit saves into its run's folder.
    r"Checkpoint directory .* exists and is not empty",
    # Lightning calls a torch pytree API that torch 2.13 deprecates; nothing to change on our side.
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # Our samplers are the batch samplers; the loader's own `num_workers=0` is the right default on a CPU.
    r".*does not have many workers which may be a bottleneck",
)


class _DropMessages(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(QUIET_LOG_MESSAGES)


class _StdoutHandler(logging.StreamHandler):
    """A handler writing to whatever `sys.stdout` is when a record comes (pytest and notebooks replace it): every
    line of the toolkit's, and Lightning's own, on the one stream that `| tee run.log` keeps."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        """The stream is always the current `sys.stdout`."""


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
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(lambda record: rank_zero_only.rank == 0)  # one copy of each line, however many ranks
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False
    for name in ("lightning.pytorch", "lightning.fabric"):  # Lightning's own lines, on the same stream as ours
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
            logger.removeHandler(handler)
            replacement = _StdoutHandler()
            replacement.setFormatter(handler.formatter)
            logger.addHandler(replacement)
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


class PackingArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, whose errors are one line: a mistyped key ends with the nearest valid one, a wrong
    choice or type names what is accepted; no usage dump above it. The one place that words jsonargparse's own
    errors for a user."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:  # jsonargparse probing a value: it catches this itself
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        print(f"error: {explain_parse_error(message, parser)}", flush=True)
        raise SystemExit(2)


def explain_parse_error(message: str, parser: ArgumentParser) -> str:
    """jsonargparse's message for a bad command line or config, as one line that names the fix."""
    options = sorted(o for o in parser_options(parser) if o.startswith("--"))
    flat = " ".join(message.split())
    unknown = re.search(r"unrecognized arguments: (--[\w.\-]+)", flat) or re.search(
        r"does not accept (?:nested )?(?:option|key) '([\w.\-]+)'", flat
    )
    if unknown:
        key = unknown[1] if unknown[1].startswith("--") else f"--{unknown[1]}"
        near = difflib.get_close_matches(key, options, n=1, cutoff=0.6)
        prog = parser.prog.replace(" [options]", "")
        hint = f"did you mean {near[0]}?" if near else f"`{prog} --help` lists the settings"
        return f"{key.removeprefix('--')} is not a setting here: {hint}"
    choice = re.search(r'Parser key "([\w.\-]+)": Expected a (?:typing\.)?Literal\[(.*?)\]\. Got value: (\S+)', flat)
    if choice:
        accepted = ", ".join(v.strip(" '\"") for v in choice[2].split(","))
        return f"{choice[1]}: {choice[3]!r} is not one of: {accepted}"
    typed = re.search(r"Parser key \"([\w.\-]+)\": Expected a <class '(\w+)'>\. Got value: (\S+)", flat)
    if typed:
        return f"{typed[1]}: {typed[3]!r} is not {'an' if typed[2][0] in 'aeiou' else 'a'} {typed[2]}"
    return flat


class PackingCLI(LightningCLI):
    """LightningCLI with the packing callbacks always on and run-time values linked from data to model.

    Before anything loads, `preflight` checks the settings against this machine and the checkpoint (an accelerator
    it lacks, a missing `--ckpt_path`, a resumed fit with nothing left to train). `validate` and `test` print their
    metrics and write no run folder unless `--trainer.logger` is given.
    """

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Lightning's but `predict`: a causal LM's packed rows have no prediction of their own to write (the
        evaluation's per-token losses are `validate` and `test`)."""
        return {name: keys for name, keys in LightningCLI.subcommands().items() if name != "predict"}

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        # As Lightning's, without its warning when `sys.argv` holds arguments too: a caller that passes `args` (the
        # packing report, the benchmark, tests) has parsed its own command line and built these from it.
        is_object = isinstance(args, (dict, Namespace))
        self.config = parser.parse_object(args) if is_object else parser.parse_args(args)
        subcommand = self.config.get("subcommand")
        settings = self.config[subcommand] if subcommand else self.config
        if "trainer" in settings:
            settings.trainer.strategy = toolkit_strategy(settings.trainer.get("strategy"))
            for key, value in launch_shape(settings.trainer, os.environ).items():
                settings.trainer[key] = value  # the launcher's shape where the config leaves it open
        if "model" in settings and settings.model.get("quantization_dtype") == "auto":
            precision = settings.get("trainer", {}).get("precision")
            settings.model.quantization_dtype = compute_dtype("auto", precision)  # bf16 under bf16-mixed
        if subcommand is None:
            return
        self.run_folder = place_run(parser, subcommand, settings)
        self.checkpoint = preflight(
            subcommand, settings.get("trainer", {}), settings.get("ckpt_path"), settings.get("data", {})
        )
        if subcommand == "fit" and self.run_folder.resumed:  # --ckpt_path=last: nothing left to train stops here
            trainer = settings.get("trainer", {})
            position = read_position(str(self.run_folder.checkpoint))
            check_left_to_train(position, trainer.get("max_steps"), trainer.get("max_epochs"))
        given = sys.argv[1:] if args is None else [str(a) for a in args] if isinstance(args, (list, tuple)) else []
        if subcommand in ("validate", "test") and not any(a.startswith("--trainer.logger") for a in given):
            settings.trainer.logger = False  # the metrics are printed; a run folder is made only when asked

    def instantiate_classes(self) -> None:
        """As Lightning's; under a sharded strategy the model is built on the meta device (`deferred_weights`) and
        filled once sharded, each rank its shards only."""
        settings = self.config[self.subcommand] if self.subcommand else self.config
        strategy = settings.get("trainer", {}).get("strategy")
        sharded = isinstance(strategy, Namespace) and strategy.get("class_path") == SHARDED
        with deferred_weights() if sharded else contextlib.nullcontext():
            super().instantiate_classes()

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(PackingMonitor, "packing_monitor")
        parser.add_lightning_class_args(TokenThroughputMonitor, "throughput_monitor")
        parser.add_lightning_class_args(ValidationSchedule, "validation_schedule")
        parser.add_argument("--run_name", type=str | None, default=None,
                            help="the run's folder under trainer.default_root_dir (default: the --config names "
                            "joined by '-'); --ckpt_path=last resumes this run")  # fmt: skip
        # One name chooses the model and its tokenizer; what the tokenizer turns out to be crosses at run time.
        parser.link_arguments("model.name_or_path", "data.tokenizer")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")

    def before_fit(self) -> None:
        """`--ckpt_path=last`, or a launch continuing its own run's folder (a requeued SLURM job: `runs.py`): the
        newest complete checkpoint in the run's folder (what a save killed part-way left undone first), or a fresh
        start when there is none. Lightning's own SLURM auto-resume, which would take `hpc_ckpt_<N>.ckpt` even when a
        `last.ckpt` is newer, is not left to choose."""
        settings = self.config_init[self.subcommand]
        asked = settings.get("ckpt_path")
        folder = self.run_folder
        if asked != "last" and not folder.resumed:
            log.info(f"run folder: {folder.path} (run {folder.name!r})")
            return
        path = newest_checkpoint(self.trainer)
        settings.ckpt_path = None if path is None else str(path)
        if path is None:
            log.info(f"--ckpt_path=last: no checkpoint of run {folder.name!r} yet under {folder.path.parent}: "
                     f"training from the start in {folder.path}")  # fmt: skip
            return
        self.checkpoint = read_position(str(path))
        log.info(f"resuming from {path}, the newest complete checkpoint of this run: optimizer step "
                 f"{self.checkpoint.global_step:,} (epoch {self.checkpoint.epoch})")  # fmt: skip
        check_left_to_train(self.checkpoint, self.trainer.max_steps, self.trainer.max_epochs)

    def after_fit(self) -> None:
        """A fit that was asked to train and took no optimizer step is an error, not a success. A resume whose
        checkpoint had finished the epochs `trainer.max_epochs` allows (which `preflight` cannot see when it was
        saved inside the epoch's last validation) is named as `preflight` names it."""
        trainer = self.trainer
        asked = trainer.max_steps != 0 and trainer.max_epochs != 0 and trainer.limit_train_batches != 0
        resumed = getattr(self, "checkpoint", None)
        if asked and resumed is not None and trainer.global_step == resumed.global_step:
            done = Position(resumed.path, resumed.global_step, resumed.epoch, trainer.current_epoch)
            check_left_to_train(done, trainer.max_steps, trainer.max_epochs)
        if asked and trainer.global_step == 0:
            raise TrainingError(
                "fit took no optimizer step (no training batch): check the data report above, "
                "trainer.limit_train_batches and trainer.accumulate_grad_batches"
            )
        folder = self.run_folder
        resume = (
            "; the same command with --ckpt_path=last resumes its newest checkpoint"
            if self.trainer.checkpoint_callbacks
            else ""
        )
        log.info(f"run folder: {folder.path} (run {folder.name!r}){resume}")

    def _run_subcommand(self, subcommand: str) -> None:
        """Lightning's; when a rank this process launched died, the collective that failed here (gloo's "Connection
        closed by peer") is left unsaid: `RankWatch` is ending the run with one line. A collective that failed
        because a rank another launcher started is gone (torchrun, srun) ends this rank with one line instead of a
        traceback (`end_for_lost_peer`)."""
        try:
            super()._run_subcommand(subcommand)
        except Exception as error:
            if isinstance(error, LitPackingError):
                raise
            procs = launched_ranks(self.trainer)
            if procs and dead_rank(procs, wait=2):
                time.sleep(10)  # RankWatch polls every 0.2 s, prints and exits
            elif (lost := peer_lost(error)) and self.trainer.world_size > 1:
                end_for_lost_peer(self.trainer, lost)
            raise

    def instantiate_trainer(self, **kwargs) -> Trainer:
        """Add the progress display and the checkpoint policy, unless the config turns them off or brings its own
        `ModelCheckpoint`."""
        trainer_config = cli_setting(self, self.config_init, "trainer", default={})
        configured = trainer_config.get("callbacks") or []
        callbacks = list(configured) if isinstance(configured, list) else [configured]
        if trainer_config.get("enable_progress_bar", True) is not False:
            callbacks.append(progress_callback())
        chose_checkpoints = any(isinstance(cb, ModelCheckpoint) for cb in callbacks)  # e.g. configs/multinode.yaml
        checkpointing = trainer_config.get("enable_checkpointing", True) is not False
        if checkpointing and not chose_checkpoints:
            callbacks.append(LastCheckpoint())
        callbacks.append(RankWatch())
        callbacks.append(SameRunFolder())
        if checkpointing and not any(isinstance(cb, PreemptionCheckpoint) for cb in callbacks):
            callbacks.append(PreemptionCheckpoint())  # after the ModelCheckpoints: see its docstring
        plugins = trainer_config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, list) else [plugins]
        if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
            plugins.append(AtomicCheckpointIO())
        return super().instantiate_trainer(**kwargs, callbacks=callbacks, plugins=plugins)


class RankWatch(Callback):
    """On the process that launched the other ranks (Lightning's DDP launcher): a rank that dies (killed, out of
    memory, crashed) ends the run in one line saying which rank, how, the last checkpoint and the command that
    resumes from it; status 1, every rank ended (`processes.watch_ranks`)."""

    def setup(self, trainer: Trainer, pl_module, stage: str) -> None:
        procs = launched_ranks(trainer)
        if procs:
            quiet_process_observer()  # Lightning's own ends everything silently, 5 s later
            watch_ranks(procs, lambda died: rank_died(trainer, died))


def rank_died(trainer: Trainer, died: str) -> str:
    """`died` ("rank 1 (pid 4242) was killed by SIGKILL") with the step, the newest checkpoint of this launch and
    the command that resumes from it."""
    saved = last_saved_checkpoint(trainer)
    if saved is None:
        return f"{died} at optimizer step {trainer.global_step:,}; no checkpoint was saved in this launch"
    argv = sys.argv
    kept = [arg for i, arg in enumerate(argv) if not arg.startswith("--ckpt_path") and argv[i - 1] != "--ckpt_path"]
    command = shlex.join(["python", *kept, resume_setting(trainer, saved)])
    return f"{died} at optimizer step {trainer.global_step:,}; the last checkpoint: {saved}; resume with: {command}"


def resume_setting(trainer: Trainer, saved: str) -> str:
    """`--ckpt_path=last` where that finds `saved` (a checkpoint in the run's folder), else its path."""
    own = Path(saved) in checkpoints_in(Path(trainer.default_root_dir))
    return "--ckpt_path=last" if own else f"--ckpt_path={saved}"


def peer_left(trainer: Trainer, lost: PeerLost) -> str:
    """One line for a rank whose collective failed because another rank is gone: which one where this rank can
    know (of 2 ranks, the other), the backend's words (gloo's name the peer's address), the step, the newest
    checkpoint of this launch and the setting that resumes from it."""
    rank, world = trainer.global_rank, trainer.world_size
    peer = f"rank {1 - rank} (its only peer)" if world == 2 else f"a peer rank (of {world})"
    timeout = getattr(trainer.strategy, "timeout", None)  # the toolkit's strategies' (`lit_packing.strategies`)
    waited = f" within {TIMEOUT_SETTING}={timeout.total_seconds():g} s" if timeout is not None else ""
    what = f"did not answer{waited}" if lost.timed_out else "left the process group"
    line = f"rank {rank}: {peer} {what} ({lost.said}) at optimizer step {trainer.global_step:,}"
    saved = last_saved_checkpoint(trainer)
    if saved is None:
        return f"{line}; no checkpoint was saved in this launch"
    return f"{line}; the last checkpoint: {saved}; resume: the same launch with {resume_setting(trainer, saved)}"


def end_for_lost_peer(trainer: Trainer, lost: PeerLost) -> NoReturn:
    """End this rank, whose collective failed because another rank is gone: the first rank of each node prints
    `peer_left` as one `error:` line, every rank exits with `PEER_LOST_STATUS` (a launcher that reports statuses,
    torchrun's summary or `RankWatch`, then tells the dead rank from those it stopped). At once, without the
    interpreter's exit: the process group's threads may still wait on the peer (gloo aborts the process at exit)."""
    if trainer.local_rank == 0:
        print(f"error: {peer_left(trainer, lost)}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(PEER_LOST_STATUS)


def toolkit_strategy(strategy):
    """Lightning's `ModelParallelStrategy` and `DDPStrategy`, named by class path (`configs/fsdp2.yaml`), by class
    name (`--trainer.strategy=ModelParallelStrategy`, which Lightning's Trainer would refuse as a strategy name) or
    as `ddp`, as the toolkit's (`strategies.ShardedStrategy`, `strategies.DDPStrategy`) with the same settings:
    atomic distributed checkpoints, and the toolkit's process-group timeout. Any other strategy is returned as it
    is (`auto`: Lightning's choice, with Lightning's timeout where it launches several processes).

    Raises:
        ConfigError: a timeout that is no duration (here: raised while jsonargparse builds the strategy, it would
            be one more of a union's errors, in a traceback).
    """
    if isinstance(strategy, str) and strategy in (*TOOLKIT_STRATEGIES, SHARDED, DDP):
        return Namespace(class_path=TOOLKIT_STRATEGIES.get(strategy, strategy), init_args=Namespace())
    if isinstance(strategy, Namespace) and strategy.get("class_path") in TOOLKIT_STRATEGIES:
        strategy.class_path = TOOLKIT_STRATEGIES[strategy.class_path]
    if isinstance(strategy, Namespace) and strategy.get("class_path") in (SHARDED, DDP):
        timeout = (strategy.get("init_args") or Namespace()).get("timeout")
        if timeout is not None:
            process_group_timeout(timeout)
    return strategy


def place_run(parser: LightningArgumentParser, subcommand: str, settings: Namespace) -> RunFolder:
    """Choose this launch's folder (`runs.choose_folder`; a rank Lightning's launcher started takes rank 0's) and
    point the trainer (`default_root_dir`) and the default loggers at it; for `validate` and `test`,
    `--ckpt_path=last` becomes the run's newest complete checkpoint.

    Raises:
        ConfigError: `validate`/`test --ckpt_path=last` for a run that has no checkpoint.
    """
    trainer = settings.get("trainer") or Namespace()
    root = Path(trainer.get("default_root_dir") or "runs")
    name = run_name(settings.get("run_name"), settings.get("config") or [])
    asked = settings.get("ckpt_path")
    fit = subcommand == "fit"
    folder = chosen_by_rank_zero(os.environ) if fit else None
    if folder is None:
        claim = fit and is_first_rank(os.environ)
        folder = choose_folder(root, name, asked == "last", launch_id(os.environ) if fit else None, claim)
        if claim:
            os.environ[CHOSEN] = folder.to_environ()  # for the ranks Lightning's launcher starts; `cli_main` clears it
    if not fit:
        if asked == "last":
            if not folder.resumed:
                raise ConfigError("--ckpt_path", f"last: run {name!r} has no checkpoint under {root / name}",
                                  "give the checkpoint's path, or the run's --config files or --run_name")  # fmt: skip
            settings.ckpt_path = str(folder.checkpoint)
        return folder
    if "trainer" in settings:
        settings.trainer.default_root_dir = str(folder.path)
        defaults = parser._subcommands_action._name_parser_map[subcommand].get_defaults()  # noqa: SLF001
        if settings.trainer.get("logger") == defaults.trainer.get("logger"):
            settings.trainer.logger = place_loggers(root, folder)
    return folder


def place_loggers(root: Path, folder: RunFolder) -> list[dict]:
    """The default loggers, writing for `folder`: the CSV file (and the config) in it, W&B's run under `<root>/wandb`
    named after it, offline unless `WANDB_MODE=online` (after `wandb login`)."""
    wandb, csv = (dict(logger, init_args=dict(logger["init_args"])) for logger in DEFAULT_LOGGERS)
    wandb["init_args"].update(save_dir=str(root), name=f"{folder.name}/{folder.path.name}",
                              offline=os.environ.get("WANDB_MODE") != "online")  # fmt: skip
    csv["init_args"].update(save_dir=str(root), name=folder.name, version=folder.launch)
    return [wandb, csv]


class SameRunFolder(Callback):
    """Once the process group exists, every rank's run folder is rank 0's (ranks that torchrun or srun started chose
    theirs alone: one that started late may have seen rank 0's new version and taken the next)."""

    def setup(self, trainer: Trainer, pl_module, stage: str) -> None:
        if trainer.world_size > 1:
            set_default_root_dir(trainer, trainer.strategy.broadcast(trainer.default_root_dir))


def newest_checkpoint(trainer: Trainer) -> Path | None:
    """The newest (by modification time) checkpoint of the run that reads as complete, or None if there is none.

    The candidates: those of the run's folder (`default_root_dir`: `checkpoints/last*.ckpt`, `hpc_ckpt_<N>.ckpt`)
    and `last*.ckpt` in the folder of each other `ModelCheckpoint` with a folder of its own (its `dirpath`). A
    damaged one (empty, cut short, unreadable) is skipped with a line naming it and what is wrong. What a save
    killed part-way left is undone first (`checkpoint_io.clear_leftovers`): a partial file or folder
    (`.<name>.ckpt.partial`) is removed, a previous distributed checkpoint that had stepped aside is put back.
    """
    root = Path(trainer.default_root_dir)
    folders = [root, root / "checkpoints"]
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            folders.append(Path(callback.dirpath))
    for folder in {f for f in folders if f.is_dir()}:
        for path in clear_leftovers(folder):  # what saves killed part-way left
            log.info(f"--ckpt_path=last: {path} put back: a save was killed while the new one took its name")
    candidates = checkpoints_in(root)
    for folder in (f for f in folders[2:] if f.is_dir()):
        candidates |= {path for path in folder.iterdir() if LAST_NAME.fullmatch(path.name)}
    return newest_complete(candidates, lambda path, problem: log.info(f"--ckpt_path=last: skipping {path}: {problem}"))


def cli_main(args: ArgsType = None, run: bool = True) -> PackingCLI:
    """Build (and by default run) the CLI; `args` as a list runs in-process, e.g. from tests. A `--config` value
    may name a packaged config (`--config quickstart`, see `lit_packing.configs`)."""
    from lit_packing.configs import resolve_config_args

    quiet_defaults()
    tie_to_launcher()  # a rank that Lightning or torchrun started ends with its launcher, even on SIGKILL
    finished = False
    try:
        if args is None:
            resolve_config_args()  # rewrites sys.argv[1:] in place: LightningCLI reads it (args and argv both warn)
        elif isinstance(args, (list, tuple)):
            args = resolve_config_args(list(args))
        cli = PackingCLI(
            PackedCausalLM,
            PackingDataModule,
            save_config_callback=LogConfigCallback,
            parser_class=PackingArgumentParser,
            save_config_kwargs={"overwrite": True},
            trainer_defaults={
                # Our samplers split the data across ranks themselves (and keep their state for resume).
                "use_distributed_sampler": False,
                # The model's own start-up line says its parameters and FLOPs; Lightning's table has FLOPs 0.
                "enable_model_summary": False,
                "logger": DEFAULT_LOGGERS,
                "default_root_dir": "runs",
            },
            seed_everything_default=42,
            args=args,
            run=run,
        )
        finished = True
        return cli
    except LitPackingError as error:
        if isinstance(error, ConfigError):
            error = error.under(LINKED)
        if rank_zero_only.rank == 0:  # every rank stops with the same error; one copy of it
            print(f"error: {error}", flush=True)  # the message names the fix; a traceback would bury it
        raise SystemExit(2) from None
    finally:
        if "LOCAL_RANK" not in os.environ and CHOSEN in os.environ:  # the process that claimed this launch's folder
            claimed = RunFolder.from_environ(os.environ.pop(CHOSEN))
            if not finished:
                claimed.discard_if_unused()  # a fit that stopped before training leaves no folder
