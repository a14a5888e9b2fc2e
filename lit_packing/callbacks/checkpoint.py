"""LastCheckpoint: keep only what resuming needs, in one known place: `<default_root_dir>/checkpoints/last.ckpt`.

    Trainer(default_root_dir="runs/quickstart/version_0", callbacks=[LastCheckpoint()])   # .../checkpoints/last.ckpt

The CLI points `default_root_dir` at the run's own folder (`lit_packing.runs`), so each run keeps its own.

Lightning's default keeps a checkpoint per run under each logger's run folder (`runs/<project>/<id>/checkpoints`),
so every fit that validates adds model + optimizer state (1.6 GB for SmolLM2-135M in fp32 with AdamW). Here
each save replaces the one before; with LoRA only the trainable (adapter) weights and their optimizer state are
written, the frozen base model is rebuilt from `model.name_or_path` when resuming.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

OURS = {"filename": "last", "save_top_k": 1, "monitor": None, "enable_version_counter": False}
_LIGHTNING_DEFAULTS = {key: inspect.signature(ModelCheckpoint).parameters[key].default for key in OURS}


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
