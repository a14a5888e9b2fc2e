"""The optimizer and schedule `PackedCausalLM` trains with: AdamW without decay on biases, norms and embeddings,
and a warmup-then-decay learning-rate multiplier.

    groups = parameter_groups(model, weight_decay=0.1)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule("cosine", warmup_steps=20, total_steps=1000))
"""

from __future__ import annotations

import math

import torch

from lit_packing.errors import ConfigError


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
