"""A packed model's weights as a user sees them: the start-up line, a checkpoint of another model named in one
line, an export refused when a weight is not finite.

    log.info(describe_model(model))      # LlamaForCausalLM: 3,219,776 parameters (...); training FLOPs ...
    problem = weights_mismatch(checkpoint["state_dict"], module.state_dict())
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from lit_packing.cost import flop_coefficients, model_shape, weights_in
from lit_packing.errors import AssetError, DataError, TrainingError


def describe_model(model: torch.nn.Module) -> str:
    """One start-up line: the model, its parameters (trainable, frozen) and the training FLOPs the toolkit counts.

    `LlamaForCausalLM: 3,219,776 parameters (3,219,776 trainable, 0 frozen); training FLOPs 19.3M a token + 1,536
    an attended pair`
    """
    unique = {id(p): p for p in model.parameters()}.values()
    trainable = sum(weights_in(p) for p in unique if p.requires_grad)
    frozen = sum(weights_in(p) for p in unique if not p.requires_grad)
    per_token, per_pair = flop_coefficients(model_shape(model))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return (
        f"{type(base).__name__}: {trainable + frozen:,} parameters ({trainable:,} trainable, {frozen:,} frozen); "
        f"training FLOPs {_si(per_token)} a token + {_si(per_pair)} an attended pair"
    )


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:,.0f}"


def weights_mismatch(saved: Mapping[str, Any], here: Mapping[str, torch.Tensor], strict: bool = True) -> str:
    """What differs between a checkpoint's state dict and the model's ('' when they match): shapes first, then
    weights the model lacks, then (`strict`) weights the checkpoint lacks."""
    shape = lambda t: tuple(getattr(t, "shape", ()))  # noqa: E731
    wrong = [(k, shape(saved[k]), shape(t)) for k, t in here.items() if k in saved and shape(saved[k]) != shape(t)]
    extra = [k for k in saved if k not in here]
    missing = [k for k in here if k not in saved] if strict else []
    parts = []
    if wrong:
        key, there, mine = wrong[0]
        parts.append(f"{len(wrong):,} weights of another shape (first: {key}: {list(there)} there, {list(mine)} here)")
    if extra:
        parts.append(f"{len(extra):,} weights this model does not have (first: {extra[0]})")
    if missing:
        parts.append(f"none of {len(missing):,} of this model's weights (first: {missing[0]})")
    return "; ".join(parts)


def check_token_ids(token_id_range: tuple[int, int], model: torch.nn.Module) -> None:
    """Refuse data whose token ids (`token_id_range`: the lowest and highest) fall outside the embedding table."""
    low, high = token_id_range
    rows = model.get_input_embeddings().num_embeddings
    if low < 0 or high >= rows:
        raise DataError(
            f"the tokenized data holds token ids {low:,}..{high:,} but the model has {rows:,} embedding rows: "
            f"data.tokenizer does not match model.name_or_path (use the model's own tokenizer, or "
            f"model.resize_embeddings=true), or the tokenized cache was altered (delete it under data.cache_dir)"
        )


def check_checkpoint_weights(
    saved: Mapping[str, Any], here: Mapping[str, torch.Tensor], strict: bool, path: str | None
) -> None:
    """Refuse a checkpoint of another model in one line, before Lightning loads its weights (a size mismatch would
    otherwise end in a traceback); not `strict`, the model's weights the checkpoint lacks are allowed (a LoRA run's
    checkpoint lacks the frozen weights by design)."""
    problem = weights_mismatch(saved, here, strict)
    if problem:
        raise AssetError(
            "--ckpt_path",
            f"{path or 'the checkpoint'} holds another model than this run builds: {problem}",
            "resume with the model settings it was trained with (model.name_or_path, model.model_config, "
            "model.lora), or start a new run without --ckpt_path",
        )


FINITE_CHECK_ELEMENTS = 1 << 20


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of a floating-point tensor is finite, checked about a million elements at a time:
    `torch.isfinite` of a whole tensor makes temporaries of its size and more (its absolute values and two masks:
    measured, 1.8 x the bytes of an fp32 shard), which an export would hold on top of the model."""
    values = tensor.detach()
    if values.dim() == 0:
        return bool(torch.isfinite(values))
    rows = max(1, FINITE_CHECK_ELEMENTS // max(1, values[0].numel()))
    return all(bool(torch.isfinite(part).all()) for part in values.split(rows))


def check_finite_weights(model: torch.nn.Module, path: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Refuse to export a model holding NaN or inf weights (nothing is written); `state_dict`: the whole weights
    gathered from a sharded model, checked instead of its parameters (each rank's shard)."""
    named = state_dict.items() if state_dict is not None else model.named_parameters()
    broken = [name for name, p in named if p.is_floating_point() and not all_finite(p)]
    if broken:
        raise TrainingError(
            f"not exporting to {path}: {len(broken):,} weight tensors hold NaN or inf (first: {broken[0]}); "
            f"the run diverged: lower model.lr or set trainer.gradient_clip_val, and train again"
        )


def apply_umask(folder: str) -> None:
    """Give every file in `folder` the mode a plain `open()` would (transformers writes weights through a private
    temporary file, mode 0600, so that others who can read the folder could not read `model.safetensors`)."""
    umask = os.umask(0)
    os.umask(umask)
    for entry in os.scandir(folder):
        if entry.is_file():
            os.chmod(entry.path, 0o666 & ~umask)
