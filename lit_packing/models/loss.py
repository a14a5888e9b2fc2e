"""Causal-LM loss as sums (the caller divides by a count gathered over the whole optimizer step), from logits or
straight from the last hidden states, chunk by chunk, so the (T, V) logits never exist.

    parts = causal_lm_loss(HeadInputs(hidden, lm_head), batch, normalization="token")   # or causal_lm_loss(logits, ...)

Why sums: a mean per micro-batch, averaged again over micro-batches and ranks, weights a token by how many other
tokens share its micro-batch (transformers#34242). Summing here and dividing once by the step's global count gives
the same gradient however the examples are packed, split into micro-batches or spread over ranks.

Shift: logits[:, t] predicts labels[:, t + 1]. In a packed row each example's first label is -100, so the last
token of one example never predicts the first token of the next:

    labels   [-100 a1 a2 | -100 b1]  ->  targets of positions 0..3: [a1 a2 -100 b1]

Memory: full logits cost T x V x (model dtype + 3 fp32 copies: upcast, log-softmax, gradient), 2.4 GB at 4,096
tokens and a 49k vocabulary, ~80 GB at 32k tokens and Qwen2.5's 152k. `HeadInputs` gathers the hidden states of
the label positions only and runs LM head + cross-entropy on `chunk_size` of them at a time under activation
checkpointing: one chunk's (chunk_size, V) logits exist at a time, in the forward and again in the backward.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lit_packing.batch import (
    CU_SEQ_LENS_Q,
    IGNORE_INDEX,
    LABELS,
    PROMPTS,
    SEQ_IDX,
    STEP,
    continuation_prompts,
    is_packed,
)
from lit_packing.errors import ConfigError, DataError, check_range

LossNormalization = Literal["token", "sequence"]
LossImpl = Literal["chunked", "full", "liger"]


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


@dataclass
class HeadInputs:
    """What the loss needs instead of logits: the last hidden states and the LM head that maps them to logits.

    Attributes:
        hidden: (B, T, H) final hidden states (after the final norm).
        head: the output embedding module, (N, H) -> (N, V); tied or not, LoRA-wrapped or not.
        softcap: the model's final logit soft-capping (gemma2: `cap * tanh(logits / cap)`), or None.
        chunk_size: label tokens per LM-head + cross-entropy chunk.
        impl: `chunked` (exact, any device) or `liger` (Liger-Kernel's fused linear cross-entropy, CUDA, token sums).
    """

    hidden: torch.Tensor
    head: torch.nn.Module
    softcap: float | None = None
    chunk_size: int = 1024
    impl: Literal["chunked", "liger"] = "chunked"

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of (N, H) hidden states, in the head's compute dtype, exactly as the model's forward makes them."""
        logits = self.head(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32, or fp64 for fp64 logits


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy in fp32 (fp64 for fp64 logits), with the shift.

    Args:
        logits: (B, T, V), any float dtype.
        labels: (B, T), -100 where no loss is taken.

    Returns:
        losses (B, T - 1) fp32 (0 where ignored), mask (B, T - 1) bool, targets (B, T - 1).
    """
    targets = labels[:, 1:]
    shifted = logits[:, :-1].to(_loss_dtype(logits.dtype))
    losses = F.cross_entropy(
        shifted.reshape(-1, shifted.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view_as(targets)
    return losses, targets != IGNORE_INDEX, targets


def _chunk_losses(inputs: HeadInputs, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = inputs.logits(hidden)  # (chunk, V): the only logits alive
    return F.cross_entropy(logits.to(_loss_dtype(logits.dtype)), targets, reduction="none")


def _label_rows(inputs: HeadInputs, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states (N, H) of the positions that predict a label, their targets (N,), and the (B, T - 1) mask.

    Boolean indexing waits for the mask on the host once per micro-batch (N decides the shapes).
    """
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    return inputs.hidden[:, :-1][mask], targets[mask], mask


def _chunks(n: int, size: int) -> range:
    return range(0, max(n, 1), max(1, size))  # at least one (maybe empty) chunk keeps the graph connected


def _chunked_losses(inputs: HeadInputs, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy (N,) of `targets` from the (N, H) hidden states that predict them, `inputs.chunk_size` at a
    time; each chunk is recomputed in the backward instead of kept."""
    compute = functools.partial(_chunk_losses, inputs)
    if torch.is_grad_enabled() and hidden.requires_grad:
        compute = functools.partial(checkpoint, compute, use_reentrant=False)
    size = inputs.chunk_size
    return torch.cat([compute(hidden[i : i + size], targets[i : i + size]) for i in _chunks(len(targets), size)])


def predicted_losses(outputs: torch.Tensor | HeadInputs, sources: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy (N,) of `targets` (N,) each predicted from position `sources` (N,) of a one-row batch, from
    logits (1, T, V) or `HeadInputs` (chunked: no (T, V) logits). A position may predict several targets (a shared
    prompt's last: both continuations' first tokens); its gradient then sums theirs."""
    if isinstance(outputs, HeadInputs):
        return _chunked_losses(outputs, outputs.hidden[0].index_select(0, sources), targets)
    logits = outputs[0].index_select(0, sources)
    return F.cross_entropy(logits.to(_loss_dtype(logits.dtype)), targets, reduction="none")


def label_sources(batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions (N,) of a one-row batch's label tokens and the positions (N,) that predict them: the one
    before, except a continuation's first token after a shared prompt (`PROMPTS`), predicted from its prompt's last
    position (not the token before it in the row, another continuation's last), so that position predicts several.

    >>> batch = {"labels": torch.tensor([[-100, -100, 7, 8, 9]]), "cu_seq_lens_q": torch.tensor([0, 2, 4, 5]),
    ...          "prompts": torch.tensor([0]), "completions": torch.tensor([1, 2]), "groups": torch.tensor([0, 0])}
    >>> [t.tolist() for t in label_sources(batch)]
    [[2, 3, 4], [1, 2, 1]]
    """
    labels = batch[LABELS][0]
    sources = torch.arange(-1, len(labels) - 1, device=labels.device)  # position 0 is never a label
    if PROMPTS in batch:
        cu = batch[CU_SEQ_LENS_Q].to(labels.device).long()
        continued, prompt_of = (t.to(labels.device) for t in continuation_prompts(batch))
        sources[cu[:-1][continued]] = cu[1:][prompt_of] - 1
    where = torch.nonzero(labels != IGNORE_INDEX).reshape(-1)
    return where, sources[where]


def head_token_losses(inputs: HeadInputs, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`token_losses` from hidden states: the same (B, T - 1) losses, mask and targets, computed on the label
    positions only, `inputs.chunk_size` at a time; each chunk is recomputed in the backward instead of kept."""
    hidden, targets, mask = _label_rows(inputs, labels)
    flat = _chunked_losses(inputs, hidden, targets)
    losses = flat.new_zeros(mask.shape).masked_scatter(mask, flat)  # (B, T - 1): label losses in place, 0 elsewhere
    return losses, mask, labels[:, 1:]


def batch_segments(batch: Mapping[str, Any]) -> torch.Tensor:
    """Example index of every token, (B, T) int64: `seq_idx` when packed, the row index when padded."""
    labels = batch[LABELS]
    if SEQ_IDX in batch:
        return batch[SEQ_IDX].long()
    if is_packed(batch):
        cu = batch[CU_SEQ_LENS_Q].long()
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
    if SEQ_IDX in batch:
        return batch[SEQ_IDX].shape[1]
    if is_packed(batch):
        return batch[CU_SEQ_LENS_Q].shape[0] - 1
    return batch[LABELS].shape[0]


def check_loss_settings(loss_impl: str, chunk_size: int | None, normalization: str) -> None:
    """Raise a `ConfigError` naming the parameter when the loss options cannot work (the one check of each;
    `PackedCausalLM` runs it at construction, `causal_lm_loss` on every call)."""
    if loss_impl not in ("chunked", "full", "liger"):
        raise ConfigError("loss_impl", f"{loss_impl!r} is not a choice", "use chunked, full or liger")
    if normalization not in ("token", "sequence"):
        raise ConfigError("loss_normalization", f"{normalization!r} is not a choice", "use token or sequence")
    check_range("loss_chunk_size", chunk_size, 1)
    if loss_impl == "liger" and normalization != "token":
        raise ConfigError(
            "loss_impl", "liger sums token losses only", "use {loss_normalization}=token or {loss_impl}=chunked"
        )


def causal_lm_loss(
    outputs: torch.Tensor | HeadInputs, batch: Mapping[str, Any], normalization: LossNormalization = "token"
) -> LossParts:
    """The loss sums of one micro-batch (packed or padded); see `LossParts`.

    Args:
        outputs: the (B, T, V) logits, or `HeadInputs` (hidden states + LM head: the logits are never built).
        batch: the batch (labels, and the example boundaries for `sequence`).
        normalization: `token` or `sequence` (see `LossParts`).
    """
    check_loss_settings(outputs.impl if isinstance(outputs, HeadInputs) else "full", None, normalization)
    if isinstance(outputs, HeadInputs) and outputs.impl == "liger":
        token_loss_sum, label_tokens = liger_token_loss_sum(outputs, batch[LABELS])
        return LossParts(token_loss_sum, label_tokens, token_loss_sum, label_tokens)
    if isinstance(outputs, HeadInputs):
        losses, mask, _ = head_token_losses(outputs, batch[LABELS])
    else:
        losses, mask, _ = token_losses(outputs, batch[LABELS])
    token_loss_sum = losses.sum()
    label_tokens = mask.sum().to(losses.dtype)
    if normalization == "token":
        return LossParts(token_loss_sum, label_tokens, token_loss_sum, label_tokens)
    sums, counts = per_example_losses(losses, mask, batch_segments(batch), num_segments(batch))
    has_labels = counts > 0
    objective = (sums / counts.clamp_min(1)).sum()  # examples without labels add 0
    return LossParts(objective, has_labels.sum().to(losses.dtype), token_loss_sum, label_tokens)


def liger_token_loss_sum(inputs: HeadInputs, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token losses and label count through Liger-Kernel's fused linear cross-entropy (CUDA only).

    A micro-batch without a trained token (an all-prompt pack, the empty pack a spare rank gets) never reaches the
    kernel, which divides by the label count: its loss is 0, still connected to the head and hidden states so that
    every rank runs the same backward."""
    hidden, targets, mask = _label_rows(inputs, labels)
    head = inputs.head
    weight, bias = head.weight, head.bias
    if targets.numel() == 0:
        zero = hidden[:0].sum() + weight[:0].sum() + (bias[:0].sum() if bias is not None else 0.0)  # 0, no NaN
        return zero.float(), mask.sum().float()
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    if torch.is_autocast_enabled(hidden.device.type):  # the kernel sees raw tensors: cast as autocast would
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    out = liger_fused_linear_cross_entropy(
        hidden, weight, targets, bias, ignore_index=IGNORE_INDEX, reduction="sum", softcap=inputs.softcap
    )
    loss = out[0] if isinstance(out, tuple) else out  # some versions also return the z-loss
    return loss.float(), mask.sum().float()


# The strategies whose gradient reduction this loss is tested under: DDP and FSDP1 average gradients over ranks;
# ModelParallelStrategy (FSDP2, `configure_model`) is set to sum them (`sharding.shard_model`). By class name,
# exactly: a subclass may change how gradients are reduced. ShardedStrategy is ModelParallelStrategy with atomic
# checkpoints (`lit_packing.strategies`), which the CLI runs in its place.
TESTED_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy", "FSDPStrategy", "ModelParallelStrategy", "ShardedStrategy")
SUMMING_STRATEGIES = ("ModelParallelStrategy", "ShardedStrategy")


def check_strategy(name: str) -> None:
    """Refuse a Lightning strategy (by class name) that this loss's normalisation is not tested under."""
    if name not in TESTED_STRATEGIES:
        raise ConfigError(
            "trainer.strategy",
            f"{name} is not supported: the loss normalisation is tested under {', '.join(TESTED_STRATEGIES)}",
            "use auto, ddp, ModelParallelStrategy (FSDP2) or fsdp (FSDP1, CUDA GPUs only)",
        )


def gradient_factor(strategy: str, world_size: int, accumulate: int) -> int:
    """What a micro-batch's objective is multiplied by so that the optimizer step's gradient is the sum over every
    micro-batch on every rank (divided by the step's normaliser): Lightning divides by `accumulate` and DDP
    averages over ranks; FSDP2 sums (`sharding.shard_model`).

    >>> gradient_factor("DDPStrategy", 4, 2), gradient_factor("ShardedStrategy", 4, 2)
    (8, 2)
    """
    return (1 if strategy in SUMMING_STRATEGIES else world_size) * accumulate


def step_normalizer(batch: Mapping[str, Any], parts: LossParts, key: str, world_size: int, accumulate: int):
    """What a micro-batch's loss sum is divided by: its optimizer step's global `key` (`label_tokens` or
    `sequences`, from the batch's `STEP` totals), else (one rank, no accumulation) the micro-batch's own.

    Raises:
        DataError: the batch has no step totals while several micro-batches make a step.
    """
    if STEP in batch:
        return max(batch[STEP][key], 1)
    if world_size * accumulate > 1:
        raise DataError(
            f"the batch has no '{STEP}' totals, so with world_size={world_size} and accumulate_grad_batches="
            f"{accumulate} its loss cannot be normalised over the optimizer step: use PackingDataModule's samplers, "
            "or give every micro-batch of a step lit_packing.batch.attach_step(...)"
        )
    return parts.normalizer.detach().clamp_min(1)


def eval_sums(outputs: torch.Tensor | HeadInputs, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Validation sums of one batch: token loss sum, label tokens, correct argmax predictions (0-dim tensors).

    From `HeadInputs` (called under `no_grad`) the logits exist one chunk at a time, in the head's dtype.
    """
    if not isinstance(outputs, HeadInputs):
        losses, mask, targets = token_losses(outputs, labels)
        correct = (outputs[:, :-1].argmax(-1) == targets) & mask
        return losses.sum(), mask.sum(), correct.sum()
    hidden, targets, mask = _label_rows(outputs, labels)
    losses, correct, size = [], targets.new_zeros(()), outputs.chunk_size
    for i in _chunks(len(targets), size):
        logits = outputs.logits(hidden[i : i + size])
        losses.append(F.cross_entropy(logits.to(_loss_dtype(logits.dtype)), targets[i : i + size], reduction="none"))
        correct += (logits.argmax(-1) == targets[i : i + size]).sum()
    return torch.cat(losses).sum(), mask.sum(), correct


class EvalTotals(torch.nn.Module):
    """Each stage's validation sums (`eval_sums`: loss, label tokens or pairs, correct predictions) over every step
    and rank, as torchmetrics sums (exact over steps and ranks; `nan_strategy="disable"` avoids a device sync)."""

    NAMES = ("loss_sum", "tokens", "correct")

    def __init__(self, stages: tuple[str, ...]) -> None:
        import torchmetrics

        super().__init__()
        sums = lambda: torch.nn.ModuleDict({n: torchmetrics.SumMetric(nan_strategy="disable") for n in self.NAMES})  # noqa: E731
        self.stages = torch.nn.ModuleDict({stage: sums() for stage in stages})

    def update(self, stage: str, loss_sum: torch.Tensor, tokens: torch.Tensor, correct: torch.Tensor) -> None:
        for name, value in zip(self.NAMES, (loss_sum, tokens, correct)):
            self.stages[stage][name].update(value)

    def compute(self, stage: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss, accuracy) of the stage over every step and rank; the sums are then reset."""
        metrics = self.stages[stage]
        tokens = metrics["tokens"].compute().clamp_min(1)
        loss, accuracy = metrics["loss_sum"].compute() / tokens, metrics["correct"].compute() / tokens
        for metric in metrics.values():
            metric.reset()
        return loss, accuracy
