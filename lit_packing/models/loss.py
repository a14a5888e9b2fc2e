"""Causal-LM loss from logits, as sums: the caller divides by a count gathered over the whole optimizer step.

    parts = causal_lm_loss(logits, batch["labels"], segments=batch_segments(batch), normalization="token")

Why sums: a mean per micro-batch, averaged again over micro-batches and ranks, weights a token by how many other
tokens share its micro-batch (transformers#34242). Summing here and dividing once by the step's global count gives
the same gradient however the examples are packed, split into micro-batches or spread over ranks.

Shift: logits[:, t] predicts labels[:, t + 1]. In a packed row each example's first label is -100, so the last
token of one example never predicts the first token of the next:

    labels   [-100 a1 a2 | -100 b1]  ->  targets of positions 0..3: [a1 a2 -100 b1]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
LossNormalization = Literal["token", "sequence"]


@dataclass
class LossParts:
    """Sums over one micro-batch; `objective / normalizer`, summed over the step, is what the step minimises.

    Attributes:
        objective: token mode: sum of token losses; sequence mode: sum over examples of each example's mean loss.
        normalizer: token mode: label tokens; sequence mode: examples with at least one label token.
        token_loss_sum: sum of token losses (for the logged per-token mean in both modes).
        label_tokens: number of target tokens (labels != -100 after the shift).
    """

    objective: torch.Tensor
    normalizer: torch.Tensor
    token_loss_sum: torch.Tensor
    label_tokens: torch.Tensor


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy in fp32 (fp64 for fp64 logits), with the shift.

    Args:
        logits: (B, T, V), any float dtype.
        labels: (B, T), -100 where no loss is taken.

    Returns:
        losses (B, T - 1) fp32 (0 where ignored), mask (B, T - 1) bool, targets (B, T - 1).
    """
    targets = labels[:, 1:]
    shifted = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))
    losses = F.cross_entropy(
        shifted.reshape(-1, shifted.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view_as(targets)
    return losses, targets != IGNORE_INDEX, targets


def batch_segments(batch: Mapping[str, Any]) -> torch.Tensor:
    """Example index of every token, (B, T) int64: `seq_idx` when packed, the row index when padded."""
    labels = batch["labels"]
    if "seq_idx" in batch:
        return batch["seq_idx"].long()
    if "cu_seq_lens_q" in batch:
        cu = batch["cu_seq_lens_q"].long()
        n, total = len(cu) - 1, labels.shape[1]
        ids = torch.arange(n, device=labels.device)
        return torch.repeat_interleave(ids, cu[1:] - cu[:-1], output_size=total)[None]
    rows = torch.arange(labels.shape[0], device=labels.device)
    return rows[:, None].expand_as(labels)


def per_example_losses(losses: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor, num_segments: int):
    """Sum of token losses and label-token count of every example (segment): two (num_segments,) fp32 tensors.

    `segments` is the (B, T) example index of each token; a target at position t + 1 belongs to segments[t + 1].
    """
    seg = segments[:, 1:].reshape(-1)
    sums = losses.new_zeros(num_segments).index_add_(0, seg, (losses * mask).reshape(-1))
    counts = losses.new_zeros(num_segments).index_add_(0, seg, mask.reshape(-1).to(losses.dtype))
    return sums, counts


def num_segments(batch: Mapping[str, Any]) -> int:
    """An upper bound on the segment ids of `batch_segments` (host-side: from shapes, never a device sync).

    `seq_idx` numbers examples, which need not match the attention rows of `cu_seq_lens_q` (the contaminated
    fixed-length collator has rows spanning several examples), so it is bounded by T; unused ids count 0 tokens.
    """
    if "seq_idx" in batch:
        return batch["seq_idx"].shape[1]
    if "cu_seq_lens_q" in batch:
        return batch["cu_seq_lens_q"].shape[0] - 1
    return batch["labels"].shape[0]


def causal_lm_loss(
    logits: torch.Tensor, batch: Mapping[str, Any], normalization: LossNormalization = "token"
) -> LossParts:
    """The loss sums of one micro-batch (packed or padded); see `LossParts`."""
    losses, mask, _ = token_losses(logits, batch["labels"])
    token_loss_sum = losses.sum()
    label_tokens = mask.sum().to(losses.dtype)
    if normalization == "token":
        return LossParts(token_loss_sum, label_tokens, token_loss_sum, label_tokens)
    if normalization != "sequence":
        raise ValueError(f"unknown loss_normalization={normalization!r}: use token or sequence")
    sums, counts = per_example_losses(losses, mask, batch_segments(batch), num_segments(batch))
    has_labels = counts > 0
    objective = (sums / counts.clamp_min(1)).sum()  # examples without labels add 0
    return LossParts(objective, has_labels.sum().to(losses.dtype), token_loss_sum, label_tokens)
