"""The optimizer and schedule `PackedCausalLM` trains with: AdamW without decay on biases, norms and embeddings,
and a warmup-then-decay learning-rate multiplier.

    groups = parameter_groups(model, weight_decay=0.1)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule("cosine", warmup_steps=20, total_steps=1000))
    adamw_and_schedule(lm, lm.hparams)     # PackedCausalLM.configure_optimizers
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lit_packing.errors import ConfigError
from lit_packing.models.quantize import adamw_8bit

log = logging.getLogger(__name__)


def adamw_and_schedule(lm, hp: Mapping[str, Any]) -> dict:
    """What `PackedCausalLM.configure_optimizers` returns: AdamW over `parameter_groups` and its per-step schedule
    (`lr_schedule`) over the trainer's step count."""
    trainer = lm.trainer
    # Fused AdamW unscales inside step(): Lightning's mixed-precision plugin (bf16-mixed and 16-mixed) refuses to
    # clip gradients for such an optimizer, so a clipped mixed-precision run takes the foreach kernel.
    mixed = str(trainer.precision).endswith("-mixed")
    fused = lm.device.type == "cuda" and not (mixed and (trainer.gradient_clip_val or 0) > 0)
    groups, settings = (
        parameter_groups(lm.model, hp["weight_decay"]),
        dict(lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"]),
    )
    if hp.get("optimizer", "adamw") == "adamw8bit":
        if getattr(lm, "shard_count", 1) > 1:
            raise ConfigError("model.optimizer", "adamw8bit keeps its 8-bit states per whole parameter; FSDP2 splits "
                              "them", "use adamw under a sharded strategy")  # fmt: skip
        optimizer = adamw_8bit(groups, **settings)
    else:
        optimizer = torch.optim.AdamW(groups, **settings, fused=fused or None)

    def schedule(total: float) -> Callable[[int], float]:
        kind = hp["scheduler"]
        if not math.isfinite(total) and kind != "constant":
            log.warning("the number of steps is unknown: scheduler=%s becomes constant; set trainer.max_steps", kind)
            total, kind = 0, "constant"
        return lr_schedule(kind, hp["warmup_steps"], max(1, int(total)), hp["min_lr_ratio"])

    if trainer.strategy.restore_checkpoint_after_setup:
        # A strategy that restores a checkpoint after `configure_optimizers` (ModelParallelStrategy): counting the
        # steps now would start the training loader before a resume gives the data module its position.
        first = schedule(hp["warmup_steps"] + 1)(0)  # step 0's multiplier, whatever the count
        multiplier = counted_at_first_step(lambda: schedule(trainer.estimated_stepping_batches), first)
    else:
        multiplier = schedule(trainer.estimated_stepping_batches)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def counted_at_first_step(build: Callable[[], Callable[[int], float]], first: float) -> Callable[[int], float]:
    """A schedule built when it is first asked for a step after 0 (`build`); at step 0, `first`: every schedule's
    multiplier there is the same whatever the step count (warmup's first step, or the start of the decay). A plain
    function, so that `LambdaLR.state_dict` does not try to save it."""
    built: list[Callable[[int], float]] = []

    def multiplier(step: int) -> float:
        if step == 0 and not built:
            return first
        if not built:
            built.append(build())
        return built[0](step)

    return multiplier


def no_decay_parameter_ids(module: torch.nn.Module) -> set[int]:
    """Parameters that take no weight decay: biases, norm weights (anything 1-D) and embeddings."""
    ids = {id(p) for p in module.parameters() if p.ndim < 2}
    for sub in module.modules():
        if isinstance(sub, torch.nn.Embedding):
            ids.update(id(p) for p in sub.parameters())
    return ids


def parameter_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups of the trainable parameters: decayed, and not (`no_decay_parameter_ids`)."""
    params = [p for p in module.parameters() if p.requires_grad]
    no_decay = no_decay_parameter_ids(module)
    groups = [
        {"params": [p for p in params if id(p) not in no_decay], "weight_decay": weight_decay},
        {"params": [p for p in params if id(p) in no_decay], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def lr_schedule(kind: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0):
    """LambdaLR multiplier: linear warmup over `warmup_steps`, then cosine / linear decay to `min_lr_ratio` at
    `total_steps`, or constant."""
    if kind not in ("cosine", "linear", "constant"):
        raise ConfigError("model.scheduler", f"{kind!r} is not a choice", "use cosine, linear or constant")

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if kind == "cosine" else 1 - progress
        return min_lr_ratio + (1 - min_lr_ratio) * decay

    return multiplier
