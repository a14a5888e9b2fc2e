"""Every private attribute of another library that lit_packing relies on, one small function each.

    trained = _compat.trained_batches(trainer)   # not trainer.fit_loop.epoch_loop.batch_progress.current.processed

Lightning, torch, transformers, datasets and jsonargparse offer no public way to do these things. Keeping each
access here, documented with the library, the private name and the versions it was checked on, means an upgrade
that moves one breaks one function, and `tests/test_compat.py` (one test per function, on real objects) says
which one: "lightning 2.7.0 moved trainer._logger_connector.should_update_logs: update lit_packing/_compat.py". A
function whose attribute is gone raises `CompatError` with the same message instead of a bare `AttributeError`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any, NamedTuple

import torch
from torch.utils.data import Sampler

from lit_packing.errors import LitPackingError

__all__ = [
    "CompatError",
    "accumulates",
    "attached_trainer",
    "attn_implementation_of",
    "batch_sampler_with_epoch",
    "can_set_attn_implementation",
    "checkpoint_position",
    "checkpoint_renaming",
    "cli_setting",
    "compiled_graphs",
    "dataset_fingerprint",
    "detach_wandb_run",
    "flatten_mesh",
    "dummy_experiment",
    "foreach_norm",
    "model_parallel_sizes",
    "moved",
    "packaged_builders",
    "parser_options",
    "ready_batches",
    "set_model_parallel",
    "should_update_logs",
    "supports_sdpa",
    "trained_batches",
    "validate_after_batch",
    "wandb_init_kwargs",
    "wandb_run",
]


class CompatError(LitPackingError, RuntimeError):
    """A library upgrade moved a private attribute that `lit_packing._compat` reads."""


def moved(library: str, what: str) -> str:
    """The message for a moved private attribute: the library, its installed version, the name, the fix.

    Args:
        library: the distribution name (`lightning`, `torch`, ...).
        what: the private attribute, as the code spells it.

    Returns:
        e.g. "lightning 2.7.0 moved fit_loop.epoch_loop.batch_progress: update lit_packing/_compat.py".
    """
    try:
        installed = version(library)
    except PackageNotFoundError:
        installed = "(not installed)"
    return f"{library} {installed} moved {what}: update lit_packing/_compat.py"


def _get(library: str, what: str, read: Callable[[], Any]) -> Any:
    """`read()`, with an `AttributeError` (the attribute moved) turned into a `CompatError` naming it."""
    try:
        return read()
    except AttributeError as error:
        raise CompatError(moved(library, what)) from error


# ----------------------------------------------------------------------------------------------------------------
# Lightning


def should_update_logs(trainer: Any) -> bool:
    """Whether the training step under way sends its `on_step` metrics to the loggers.

    Lightning's own test (`log_every_n_steps`, or the run stopping), so a callback that logs an expensive metric
    (a collective over ranks) computes it only where it is logged.

    Lightning: `trainer._logger_connector.should_update_logs`; checked on 2.5.0 and 2.6.6.

    Args:
        trainer: a `lightning.pytorch.Trainer` that is fitting.

    Returns:
        True when this step's metrics reach the loggers.
    """
    return bool(
        _get(
            "lightning", "trainer._logger_connector.should_update_logs", lambda: trainer._logger_connector
        ).should_update_logs
    )


def trained_batches(trainer: Any) -> int:
    """Training batches of the current epoch that were trained (processed by the model), not just fetched.

    What a resumable sampler saves as its position: the DataLoader's workers prefetch ahead of it. Restored by
    Lightning from a checkpoint, so it counts the batches before a mid-epoch resume too.

    Lightning: `trainer.fit_loop.epoch_loop.batch_progress.current.processed`; checked on 2.5.0 and 2.6.6.

    Args:
        trainer: a `lightning.pytorch.Trainer`.

    Returns:
        The count; in `on_train_batch_end` of batch `i` of an epoch (and in a checkpoint saved there), `i + 1`.
    """
    progress = _get(
        "lightning", "fit_loop.epoch_loop.batch_progress", lambda: trainer.fit_loop.epoch_loop.batch_progress
    )
    return int(
        _get("lightning", "fit_loop.epoch_loop.batch_progress.current.processed", lambda: progress.current.processed)
    )


def ready_batches(trainer: Any) -> int:
    """Training batches of the current epoch that the loop has fetched so far, batches before a resume included.

    Lightning: `trainer.fit_loop.epoch_loop.batch_progress.current.ready`; checked on 2.5.0 and 2.6.6.

    Args:
        trainer: a `lightning.pytorch.Trainer`.

    Returns:
        The count; after a mid-epoch resume, at `on_train_start`, the batches trained before it.
    """
    progress = _get(
        "lightning", "fit_loop.epoch_loop.batch_progress", lambda: trainer.fit_loop.epoch_loop.batch_progress
    )
    return int(_get("lightning", "fit_loop.epoch_loop.batch_progress.current.ready", lambda: progress.current.ready))


class DataParallel(NamedTuple):
    """Where a process stands among those that train different batches."""

    rank: int
    size: int


def data_parallel(trainer: Any) -> DataParallel:
    """This process's data-parallel rank and their number: what the data is dealt by. Under `ModelParallelStrategy`
    the data-parallel dim of its mesh (tensor-parallel peers train the same batches), under DDP and FSDP every
    process, in one process (0, 1).

    Lightning: `trainer.distributed_sampler_kwargs` (`num_replicas`, `rank`), what it gives its own
    `DistributedSampler`; None for a single-device strategy. Checked on 2.6.6.
    """
    kwargs = getattr(trainer, "distributed_sampler_kwargs", None) or {}
    return DataParallel(
        int(kwargs.get("rank", trainer.global_rank)), int(kwargs.get("num_replicas", trainer.world_size))
    )


def accumulates(trainer: Any) -> bool:
    """Whether the training batch under way (from `on_train_batch_start` on) only accumulates its gradients: not
    the last micro-batch of its optimizer step (Lightning steps on an epoch's final batch whatever the count).

    Lightning: `trainer.fit_loop._should_accumulate()`, the loop's own test; checked on 2.6.6.
    """
    return bool(_get("lightning", "fit_loop._should_accumulate", lambda: trainer.fit_loop._should_accumulate)())


def move_epoch_position(trainer: Any, batches: int) -> None:
    """Make the fit loop count `batches` training batches of the current epoch as done, from `on_train_start`.

    After a resume onto another layout (world size x accumulation) the sampler continues at the first optimizer
    step not completed, counted in micro-batches of the new layout; Lightning restored its count in the old
    layout. Every counter of the epoch's batch progress (and of the run's total) is shifted by the same amount, so
    that the next batch gets index `batches`, gradient accumulation steps the optimizer after every
    `accumulate_grad_batches` batches from there, and the epoch ends at the sampler's length.

    Lightning: `trainer.fit_loop.epoch_loop.batch_progress.{current,total}.{ready,started,processed,completed}`,
    read by `_accumulated_batches_reached`, `batch_idx` and the epoch's end; checked on 2.5.0 and 2.6.6.
    """
    progress = _get(
        "lightning", "fit_loop.epoch_loop.batch_progress", lambda: trainer.fit_loop.epoch_loop.batch_progress
    )
    shift = int(batches) - ready_batches(trainer)
    for tracker in (progress.current, progress.total):
        for name in ("ready", "started", "processed", "completed"):
            value = _get("lightning", f"batch_progress.{name}", lambda t=tracker, n=name: getattr(t, n))
            setattr(tracker, name, value + shift)


def set_accumulate_grad_batches(trainer: Any, accumulate: int) -> None:
    """Set the trainer's gradient accumulation after it was built (from a `setup` hook, before
    `configure_optimizers`): the data module derives it from the global batch and the world size it gets.

    Lightning: the attribute `Trainer.accumulate_grad_batches`, read on every batch and by
    `estimated_stepping_batches`; checked on 2.5.0 and 2.6.6.
    """
    _get("lightning", "Trainer.accumulate_grad_batches", lambda: trainer.accumulate_grad_batches)
    trainer.accumulate_grad_batches = int(accumulate)


def validate_after_batch(trainer: Any, validate: bool) -> None:
    """From `on_train_batch_end`: whether Lightning validates after this training batch, in place of its cadence.

    Lightning validates after batch `i` when `(i + 1) % trainer.val_check_batch == 0` (`i` counted in the epoch, or
    over the fit when `check_val_every_n_epoch` is None), and reads `val_check_batch` after the `on_train_batch_end`
    hooks: writing `i + 1` there validates after this batch, `i + 2` does not. Lightning offers no setter, and its
    cadence is a period counted from the epoch's start, which cannot put validations at given steps of a launch that
    resumed mid-epoch. A stop (`trainer.should_stop`, e.g. early stopping) still validates.

    Lightning: writing `trainer.val_check_batch` against `fit_loop.epoch_loop.batch_idx` / `total_batch_idx`
    (read in `_TrainingEpochLoop._should_check_val_fx`); checked on 2.6.6.

    Args:
        trainer: a `lightning.pytorch.Trainer`, from `on_train_batch_end`.
        validate: validate after this batch.
    """
    loop = _get("lightning", "fit_loop.epoch_loop", lambda: trainer.fit_loop.epoch_loop)
    if trainer.check_val_every_n_epoch is None:
        index = _get("lightning", "fit_loop.epoch_loop.total_batch_idx", lambda: loop.total_batch_idx)
    else:
        index = _get("lightning", "fit_loop.epoch_loop.batch_idx", lambda: loop.batch_idx)
    _get("lightning", "trainer.val_check_batch", lambda: trainer.val_check_batch)
    trainer.val_check_batch = index + 1 if validate else index + 2


def dummy_experiment() -> Any:
    """Lightning's no-op stand-in for a logger's experiment: every method call, item and attribute does nothing.

    Lightning: `lightning.fabric.loggers.logger._DummyExperiment`; checked on 2.5.0 and 2.6.6.

    Returns:
        A fresh stand-in (what a logger's `experiment` is on ranks other than 0).
    """
    try:
        from lightning.fabric.loggers.logger import _DummyExperiment
    except ImportError as error:
        raise CompatError(moved("lightning", "lightning.fabric.loggers.logger._DummyExperiment")) from error
    return _DummyExperiment()


class _EpochForwardingBatchSampler(Sampler[list]):
    """A batch sampler whose `.sampler` is the packing sampler it yields from (see `batch_sampler_with_epoch`)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]


def batch_sampler_with_epoch(sampler: Sampler) -> Sampler:
    """`sampler` (a batch sampler with `set_epoch`) wrapped so that Lightning calls its `set_epoch` every epoch.

    Lightning calls `set_epoch(epoch)` at every epoch start on `dataloader.sampler` and on
    `dataloader.batch_sampler.sampler`, never on the batch sampler itself; the wrapper yields `sampler`'s batches
    and exposes it as `.sampler`, where Lightning looks. Use as `DataLoader(ds, batch_sampler=...)`.

    Lightning: `lightning.fabric.utilities.data._set_sampler_epoch` (called by `_FitLoop.on_advance_start`);
    checked on 2.5.0 and 2.6.6.

    Args:
        sampler: the batch sampler (it yields lists of indices) whose `set_epoch` must be called.

    Returns:
        A batch sampler with the same batches and length.
    """
    return _EpochForwardingBatchSampler(sampler)


def attached_trainer(module: Any) -> Any:
    """The `Trainer` a LightningModule is attached to, or None (where `module.trainer` raises).

    Lightning: `LightningModule._trainer`; checked on 2.5.0 and 2.6.6.

    Args:
        module: a `lightning.pytorch.LightningModule`.

    Returns:
        The trainer, or None before `fit` / `validate` / `test` attaches one.
    """
    return _get("lightning", "LightningModule._trainer", lambda: module._trainer)


def cli_setting(cli: Any, config: Any, key: str, default: Any = None) -> Any:
    """A top-level setting of a `LightningCLI` config, found under the subcommand (`fit`, ...) when there is one.

    Lightning: `LightningCLI._get(config, key, default)`; checked on 2.5.0 and 2.6.6.

    Args:
        cli: the `LightningCLI` (its `subcommand`).
        config: `cli.config` or `cli.config_init`.
        key: e.g. `"trainer"`.
        default: returned when the key is absent.

    Returns:
        The value (a `Namespace` for a section).
    """
    return _get("lightning", "LightningCLI._get", lambda: cli._get)(config, key, default=default)


def wandb_init_kwargs(logger: Any) -> dict[str, Any]:
    """The keyword arguments a Lightning `WandbLogger` will pass to `wandb.init` (the live dict: edits apply).

    Lightning: `WandbLogger._wandb_init`; checked on 2.5.0 and 2.6.6.

    Args:
        logger: a `lightning.pytorch.loggers.WandbLogger`.

    Returns:
        The dict (`project`, `dir`, `mode`, `id`, `resume`, ...).
    """
    return _get("lightning", "WandbLogger._wandb_init", lambda: logger._wandb_init)


def wandb_run(logger: Any) -> Any:
    """The W&B run a Lightning `WandbLogger` has created, or None before its `experiment` is first used.

    Lightning: `WandbLogger._experiment`; checked on 2.5.0 and 2.6.6.

    Args:
        logger: a `lightning.pytorch.loggers.WandbLogger`.

    Returns:
        The `wandb` run, or None; never creates one (`logger.experiment` does).
    """
    return _get("lightning", "WandbLogger._experiment", lambda: logger._experiment)


def detach_wandb_run(logger: Any) -> Any:
    """Detach the logger's W&B run (for the caller to finish) and keep its id as the logger's `version`.

    The next use of `logger.experiment` creates a new run; `logger.version` still names the detached one.

    Lightning: `WandbLogger._experiment` and `WandbLogger._id`; checked on 2.5.0 and 2.6.6.

    Args:
        logger: a `lightning.pytorch.loggers.WandbLogger`.

    Returns:
        The run that was attached, or None when there was none (nothing changes then).
    """
    run = wandb_run(logger)
    if run is not None:
        _get("lightning", "WandbLogger._id", lambda: logger._id)
        logger._id = run.id
        logger._experiment = None
    return run


def launched_ranks(trainer: Any) -> list[Any]:
    """The `subprocess.Popen` of every rank this process launched (ranks 1..N-1 of Lightning's DDP launcher, in
    order); empty where another launcher (torchrun, SLURM) started the ranks, or on any rank but the launcher.

    Lightning: `strategy.launcher.procs` (`_SubprocessScriptLauncher`); checked on 2.6.6."""
    launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
    return list(getattr(launcher, "procs", None) or [])


def quiet_process_observer() -> None:
    """Stop Lightning's child-process observer from acting: it SIGKILLs every rank, this one included, 5 s after
    a launched rank died, without a word (`cli.RankWatch` says which and how, then ends them the same way).

    Lightning: the `child-process-observer` thread's `_run` (`_ChildProcessObserver`); checked on 2.6.6."""
    import threading

    for thread in threading.enumerate():
        if thread.name == "child-process-observer":
            _get("lightning", "_ChildProcessObserver._run", lambda t=thread: t._run)
            thread._run = lambda: True  # its loop ends at its next wake


def last_saved_checkpoint(trainer: Any) -> str | None:
    """The newest checkpoint the run's `ModelCheckpoint` callbacks saved in this launch (None if none did).

    Lightning: `ModelCheckpoint._last_checkpoint_saved`; checked on 2.6.6."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
    saved = _get("lightning", "ModelCheckpoint._last_checkpoint_saved",
                 lambda: [cb._last_checkpoint_saved for cb in callbacks])  # fmt: skip
    saved = [path for path in saved if path and os.path.exists(path)]
    return max(saved, key=os.path.getmtime) if saved else None


def set_default_root_dir(trainer: Any, path: str) -> None:
    """Point a built Trainer's `default_root_dir` elsewhere (it has no setter).

    Lightning: `Trainer._default_root_dir`; checked on 2.6.6.
    """
    _get("lightning", "Trainer._default_root_dir", lambda: trainer._default_root_dir)
    trainer._default_root_dir = path


def model_parallel_sizes(strategy: Any) -> tuple[Any, Any]:
    """A `ModelParallelStrategy`'s configured (data_parallel_size, tensor_parallel_size), `auto` or ints.

    Lightning: `strategy._data_parallel_size`, `strategy._tensor_parallel_size`; checked on 2.6.6.
    """
    return _get("lightning", "ModelParallelStrategy._data_parallel_size",
                lambda: (strategy._data_parallel_size, strategy._tensor_parallel_size))  # fmt: skip


def set_model_parallel(strategy: Any, data_parallel_size: int, tensor_parallel_size: int, mesh: Any = None) -> None:
    """Set a `ModelParallelStrategy`'s sizes (what its `setup_environment` builds the mesh of) and, given, its device
    mesh, also where its LightningModule reads it (`configure_model`'s `self.device_mesh`).

    Lightning: `strategy._data_parallel_size`, `_tensor_parallel_size`, `_device_mesh` and the module's
    `_device_mesh`; checked on 2.6.6.
    """
    model_parallel_sizes(strategy)  # the names are still there
    strategy._data_parallel_size, strategy._tensor_parallel_size = data_parallel_size, tensor_parallel_size
    if mesh is not None:
        _get("lightning", "ModelParallelStrategy._device_mesh", lambda: strategy._device_mesh)
        strategy._device_mesh = strategy.lightning_module._device_mesh = mesh


# ----------------------------------------------------------------------------------------------------------------
# torch


def flatten_mesh(mesh: Any, dims: tuple[str, ...], name: str) -> Any:
    """The 1-D device mesh of `mesh`'s `dims` taken together (their ranks in row-major order), named `name`: the
    ranks FSDP2 shards over when they span two dims of the mesh.

    torch: `DeviceMesh._flatten`; checked on 2.13.0.
    """
    sub = mesh[dims]
    return _get("torch", "DeviceMesh._flatten", lambda: sub._flatten)(name)


def shard_box(shape: Sequence[int], mesh: Any, placements: Sequence[Any], coordinate: Sequence[int] | None = None):
    """(local shape, global offset): the box of a tensor of `shape` that mesh `coordinate` (default: this rank's)
    holds under DTensor `placements`, by DTensor's own shard arithmetic (nested `Shard`s, FSDP2's strided shards
    over tensor parallel's and `Replicate` each hold a box of the whole).

    torch: `torch.distributed.tensor._utils._compute_local_shape_and_global_offset`; checked on 2.13.0.
    """
    from torch.distributed.tensor import _utils

    compute = _get("torch", "tensor._utils._compute_local_shape_and_global_offset",
                   lambda: _utils._compute_local_shape_and_global_offset)  # fmt: skip
    where = list(mesh.get_coordinate() if coordinate is None else coordinate)
    return compute(tuple(shape), mesh.shape, where, list(placements))


def compiled_graphs() -> int:
    """Graphs `torch.compile` has compiled in this process so far (every recompilation adds one).

    torch: `torch._dynamo.utils.counters["stats"]["unique_graphs"]`; checked on 2.13.0.

    Returns:
        The count; 0 before anything was compiled.
    """
    import torch._dynamo.utils

    counters = _get("torch", "torch._dynamo.utils.counters", lambda: torch._dynamo.utils.counters)
    return int(counters["stats"]["unique_graphs"])


def foreach_norm(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The 2-norm of each tensor, in one fused kernel per device and dtype (what gradient clipping uses).

    torch: `torch._foreach_norm`; checked on 2.13.0.

    Args:
        tensors: tensors of any shapes, devices and floating dtypes.

    Returns:
        One 0-d tensor per input, in order, in its dtype.
    """
    return list(_get("torch", "torch._foreach_norm", lambda: torch._foreach_norm)(list(tensors)))


# ----------------------------------------------------------------------------------------------------------------
# transformers


def attn_implementation_of(model: Any) -> str | None:
    """The attention implementation a transformers model runs now (`"sdpa"`, `"eager"`, `"flash_attention_2"`,
    a registered kernel's name), as `model.set_attn_implementation` set it.

    transformers: `PretrainedConfig._attn_implementation`; checked on 5.0.0 and 5.24.0.

    Args:
        model: a `transformers.PreTrainedModel`.

    Returns:
        The name, or None where the config has not resolved one.
    """
    return _get("transformers", "PretrainedConfig._attn_implementation", lambda: model.config._attn_implementation)


def supports_sdpa(model: Any) -> bool:
    """Whether a transformers model's architecture implements PyTorch SDPA attention.

    transformers: the class attribute `PreTrainedModel._supports_sdpa`; checked on 5.0.0 and 5.24.0.

    Args:
        model: a `transformers.PreTrainedModel` (not a PEFT wrapper: pass `get_base_model()`).

    Returns:
        The architecture's flag.
    """
    return bool(_get("transformers", "PreTrainedModel._supports_sdpa", lambda: type(model)._supports_sdpa))


def can_set_attn_implementation(model: Any) -> bool:
    """Whether a transformers model's attention goes through `AttentionInterface` (so a packing-aware attention
    function can be set), as transformers judges it from the source of the model's module.

    transformers: the classmethod `PreTrainedModel._can_set_attn_implementation`; checked on 5.0.0 and 5.24.0.

    Args:
        model: a `transformers.PreTrainedModel` (not a PEFT wrapper: pass `get_base_model()`).

    Returns:
        The architecture's answer (a module without an `*Attention*(nn.Module)` class counts as True).
    """
    check = _get(
        "transformers",
        "PreTrainedModel._can_set_attn_implementation",
        lambda: type(model)._can_set_attn_implementation,
    )
    return bool(check())


def checkpoint_renaming(model: Any) -> Callable[[str], tuple[str, bool]]:
    """How transformers renames a checkpoint's tensors when it loads them into `model` (GPT-NeoX's `embed_out.` ->
    `lm_head.`, legacy names): a function from a stored name to (the model's name for it, whether a converter that
    merges, splits or reshapes tensors applies to it as well).

    transformers: `conversion_mapping.get_model_conversion_mapping`, `core_model_loading.WeightRenaming` and
    `core_model_loading.rename_source_key` (modules with no public API); checked on 5.24.0.

    Args:
        model: a `transformers.PreTrainedModel` (not a PEFT wrapper: pass `get_base_model()`).
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError as error:
        raise CompatError(moved("transformers", "core_model_loading.rename_source_key")) from error
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]

    def renamed(key: str) -> tuple[str, bool]:
        name, converter = rename_source_key(key, renamings, converters)
        return name, converter is not None

    return renamed


class MixerKernel(NamedTuple):
    """A kernel a transformers mixer calls, and whether its package loads here (else it runs a PyTorch path that
    refuses packing boundaries)."""

    function: str  # the kernel's own name, e.g. `causal_conv1d_fn`, `chunk_gated_delta_rule`
    package: str  # its import name: `causal_conv1d`, `mamba_ssm`, `fla`
    installed: bool


def mixer_kernels(module: Any) -> list[MixerKernel]:
    """The packed-capable kernels of a token mixer's modeling module: the functions transformers wraps with its
    fallback decorator (the package's kernel where installed, else the PyTorch path), which take packing
    boundaries (`seq_idx`, `cu_seqlens`) only when the package is there. Empty for a module without them.

    transformers: the closure of `integrations.hub_kernels.use_kernel_func_from_hub_with_fallback`'s wrapper
    (`is_new_implementation`, `package`, `func_name`); checked on 5.24.0.
    """
    found = {}
    for value in vars(sys.modules[type(module).__module__]).values():
        code = getattr(value, "__code__", None)
        if code is None or "is_new_implementation" not in code.co_freevars or not value.__closure__:
            continue
        cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in value.__closure__)))
        try:
            kernel = MixerKernel(str(cells["func_name"]), str(cells["package"]), bool(cells["is_new_implementation"]))
        except KeyError as error:
            raise CompatError(moved("transformers", "use_kernel_func_from_hub_with_fallback's wrapper")) from error
        found[kernel.function] = kernel
    return list(found.values())


# ----------------------------------------------------------------------------------------------------------------
# datasets


def packaged_builders() -> frozenset[str]:
    """The names of the builders `datasets` ships (`json`, `parquet`, `arrow`, `csv`, ...): a `load_dataset` path
    that names one reads `data_files`, not a folder or a Hub dataset.

    datasets: `datasets.packaged_modules._PACKAGED_DATASETS_MODULES`; checked on 3.0.0 and 5.2.0.
    """
    import datasets.packaged_modules as packaged

    return frozenset(_get("datasets", "packaged_modules._PACKAGED_DATASETS_MODULES",
                          lambda: packaged._PACKAGED_DATASETS_MODULES))  # fmt: skip


def dataset_fingerprint(dataset: Any) -> str:
    """A `datasets.Dataset`'s fingerprint: the hash of its source and transforms, the key of its map caches.

    The same data loaded again (from the same files) has the same fingerprint; `map(..., new_fingerprint=f)`
    gives the result the fingerprint `f`.

    datasets: `Dataset._fingerprint`; checked on 3.0.0 and 5.2.0.

    Args:
        dataset: a `datasets.Dataset`.

    Returns:
        The fingerprint.
    """
    return str(_get("datasets", "Dataset._fingerprint", lambda: dataset._fingerprint))


def checkpoint_position(checkpoint: Mapping[str, Any]) -> tuple[int, int, int]:
    """`(global_step, epoch, epochs completed)` of a loaded Lightning checkpoint (`preflight.read_checkpoint`).

    Lightning keeps no public reader of a checkpoint's loop state. Lightning: top-level `global_step` and `epoch`,
    and `loops.fit_loop.epoch_progress.current.processed` (an epoch's training done: already 1 in a checkpoint
    saved at the end of epoch 0, whose `completed` is still 0); checked on 2.6.6.

    Args:
        checkpoint: the checkpoint's contents.
    """
    try:
        completed = checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"]
        return int(checkpoint["global_step"]), int(checkpoint["epoch"]), int(completed)
    except (KeyError, TypeError) as error:
        raise CompatError(moved("lightning", "checkpoint['loops']['fit_loop']['epoch_progress']")) from error


def parser_options(parser: Any) -> set[str]:
    """Every option string a parser accepts (`--data.max_length`, ...): what a mistyped key is matched against.

    argparse (which jsonargparse extends) keeps them on `parser._actions`; checked on Python 3.11 and 3.12 with
    jsonargparse 4.53.0.
    """
    actions = _get("jsonargparse", "ArgumentParser._actions", lambda: parser._actions)
    return {option for action in actions for option in action.option_strings}
