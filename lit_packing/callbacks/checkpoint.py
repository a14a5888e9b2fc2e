"""LastCheckpoint: keep only what resuming needs, in one known place: `<default_root_dir>/checkpoints/last.ckpt`.

    Trainer(default_root_dir="runs", callbacks=[LastCheckpoint()])   # runs/checkpoints/last.ckpt, overwritten

Lightning's default keeps a checkpoint per run under each logger's run folder (`runs/<project>/<id>/checkpoints`),
so every fit that validates adds model + optimizer state (1.6 GB for SmolLM2-135M in fp32 with AdamW). Here
each save replaces the one before; with LoRA only the trainable (adapter) weights and their optimizer state are
written, the frozen base model is rebuilt from `model.name_or_path` when resuming.

`newest_checkpoint(trainer)` is what `--ckpt_path=last` resumes from: the newest complete checkpoint of the run
among every `ModelCheckpoint`'s `last*.ckpt` and the preemption checkpoint (`<default_root_dir>/hpc_ckpt_<N>.ckpt`),
a damaged one skipped with a line saying why.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_packing.callbacks.preemption import hpc_checkpoints
from lit_packing.checkpoint_io import PARTIAL_SUFFIX
from lit_packing.errors import AssetError
from lit_packing.preflight import read_checkpoint

log = logging.getLogger("lit_packing")
OURS = {"filename": "last", "save_top_k": 1, "monitor": None, "enable_version_counter": False}
_LIGHTNING_DEFAULTS = {key: inspect.signature(ModelCheckpoint).parameters[key].default for key in OURS}
LAST_NAME = re.compile(r"last(-v?\d+)?\.ckpt")  # ModelCheckpoint's `last` file, and its versioned names


class LastCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` keeping one file, `last.ckpt`, rewritten at every save, frozen weights left out.

    Saves where Lightning's default does (after each validation, else at the end of each epoch). It is
    `save_top_k=1` without a monitor under the name `last`, not `save_last=True`: Lightning 2.6 writes the
    `save_last` file only when a top-k checkpoint was written at the same step, so `save_top_k=0` would save only
    at the end of an epoch, and a run stopped mid-way would leave nothing to resume from.

    Args:
        dirpath: where `last.ckpt` goes; None: `<trainer.default_root_dir>/checkpoints`.
        kwargs: any other `ModelCheckpoint` argument (e.g. `every_n_train_steps`).
    """

    def __init__(self, dirpath: str | None = None, **kwargs: Any) -> None:
        # From YAML (`class_path` with `init_args`) jsonargparse passes every `ModelCheckpoint` argument, its defaults
        # included: only a value other than Lightning's default replaces one of ours.
        # (jsonargparse finds the accepted arguments by reading this call: keep it `**kwargs`.)
        kwargs = {**OURS, **{k: v for k, v in kwargs.items() if k not in OURS or v != _LIGHTNING_DEFAULTS[k]}}
        super().__init__(dirpath=dirpath, **kwargs)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = os.path.join(trainer.default_root_dir, "checkpoints")
        if _frozen_keys(pl_module):
            pl_module.strict_loading = False  # a checkpoint without the frozen weights loads over the rebuilt model
        super().setup(trainer, pl_module, stage)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        state = checkpoint.get("state_dict", {})
        for key in _frozen_keys(pl_module):
            state.pop(key, None)


def _frozen_keys(pl_module: pl.LightningModule) -> set[str]:
    """State-dict keys of parameters that do not train (a LoRA base model), tied ones under each of their names."""
    named = pl_module.named_parameters(remove_duplicate=False)
    return {name for name, param in named if not param.requires_grad}


def newest_checkpoint(trainer: pl.Trainer) -> Path | None:
    """The newest (by modification time) checkpoint of the run that reads as complete, or None if there is none.

    The candidates: `last*.ckpt` in the folder of each `ModelCheckpoint` with a known folder (its `dirpath`;
    `<default_root_dir>/checkpoints` for `LastCheckpoint`) and `hpc_ckpt_<N>.ckpt` in `default_root_dir`. A
    damaged one (empty, cut short, unreadable) is skipped with a line naming it and what is wrong. What a save
    killed between its flush and its rename left (`.<name>.ckpt.partial`) is removed from those folders.
    """
    root = Path(trainer.default_root_dir)
    folders = [root]
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            folder = callback.dirpath or (root / "checkpoints" if isinstance(callback, LastCheckpoint) else None)
            folders += [Path(folder)] if folder is not None and Path(folder).is_dir() else []
    candidates = set(hpc_checkpoints(root).values())
    for folder in folders:
        candidates |= {path for path in folder.iterdir() if LAST_NAME.fullmatch(path.name)}
        for partial in folder.glob(f".*.ckpt{PARTIAL_SUFFIX}"):  # a save killed between its flush and its rename
            partial.unlink(missing_ok=True)
    for path in sorted(candidates, key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            read_checkpoint(path)
        except AssetError as error:
            log.info(f"--ckpt_path=last: skipping {path}: {error.problem.removeprefix(str(path)).strip()}")
            continue
        return path
    return None
