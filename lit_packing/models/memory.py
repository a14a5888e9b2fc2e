"""Predict a training step's peak memory before the first step, and stop a fit that cannot fit.

    estimate = estimate_step_memory(lm, step=data.largest_step())   # PackedCausalLM does this at train start
    estimate.check()                                                      # MemoryError naming the knobs

The prediction adds, to what the process already holds (CPU: resident memory; CUDA: allocated memory, the weights
included), AdamW's two states and the half-precision weight copies autocast makes under mixed precision, then the
larger of two moments of the step: the start of the backward (every activation autograd keeps for the step's
largest batch, the loss's logits buffers, the LM head's gradient) and the optimizer step (every gradient plus one
more copy for the foreach temporaries). Activations are measured, not modelled: a forward of the real model on 3
short probes (64, 128, 256 tokens) records what autograd saves (`saved_tensors_hooks`), fitted as
a + b * tokens + c * pairs (pairs: the attention cost, sum(L^2) packed, rows x width^2 padded), then scaled to the
largest step.
Gradient checkpointing keeps each layer's input plus one recomputed layer instead.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lit_packing.batch import (
    ATTENTION_MASK,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    INPUT_IDS,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    POSITION_IDS,
)
from lit_packing.data.collate import StepShape
from lit_packing.errors import StepMemoryError

log = logging.getLogger(__name__)

GiB = 2**30
PROBE_LENGTHS = (64, 128, 256)
# Bytes per logit while the loss runs: the head's output, the fp32 upcast (or the bf16 gradient under autocast),
# the log-softmax kept for backward, its fp32 gradient.
LOGIT_BYTES = 16


@dataclass(frozen=True)
class MemoryEstimate:
    """A step's predicted peak memory (bytes) by part, and what the device has."""

    step: StepShape
    device: str
    resident: int
    optimizer: int
    autocast_weights: int
    activations: int
    logits: int
    head_gradient: int
    gradients: int
    available: int
    loss_impl: str
    gradient_checkpointing: bool

    @property
    def peak(self) -> int:
        backward_start = self.activations + self.logits + self.head_gradient
        optimizer_step = 2 * self.gradients
        return self.resident + self.optimizer + self.autocast_weights + max(backward_start, optimizer_step)

    @property
    def fits(self) -> bool:
        return self.peak - self.resident <= self.available

    def summary(self) -> str:
        parts = ", ".join(
            f"{name} {getattr(self, name) / GiB:.2f}"
            for name in ("resident", "optimizer", "autocast_weights", "activations", "logits", "gradients")
        )
        return (
            f"predicted peak memory {self.peak / GiB:.2f} GiB on {self.device} for the largest step "
            f"({self.step.describe()}): {parts} GiB; available beyond what is held now: {self.available / GiB:.2f} GiB"
        )

    def check(self) -> None:
        """Raise a `StepMemoryError` naming the step size and the settings that shrink it, when it will not fit."""
        if self.fits:
            return
        knobs = [
            "data.sampler.init_args.max_tokens (or batch_size) to take smaller steps",
            "data.max_length to cut long examples",
        ]
        if not self.gradient_checkpointing:
            knobs.append("model.gradient_checkpointing=true (activations: one layer's input per layer)")
        if self.loss_impl == "full":
            knobs.append("model.loss_impl=chunked (the loss never builds the (tokens, vocabulary) logits)")
        elif self.logits > GiB // 4:
            knobs.append("a smaller model.loss_chunk_size")
        raise StepMemoryError(
            f"this fit would run out of memory: {self.summary()}. The step needs "
            f"{(self.peak - self.resident) / GiB:.2f} GiB more than the process holds. Lower it with: "
            + "; ".join(knobs)
            + ". Or skip this check: model.memory_check=false"
        )


def available_bytes(device: torch.device) -> int:
    """Memory this process can still take: CUDA free + reserved-but-unused; CPU available RAM, within the cgroup's
    limit when one is set."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    import psutil  # CPU only: the GPU check's image needs no extra package

    available = psutil.virtual_memory().available
    limit, usage = Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")
    if limit.exists() and usage.exists() and limit.read_text().strip().isdigit():
        available = min(available, int(limit.read_text()) - int(usage.read_text()))
    return int(available)


def resident_bytes(device: torch.device) -> int:
    """What the process holds now: CUDA allocated memory, or CPU resident memory."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    import psutil

    return int(psutil.Process(os.getpid()).memory_info().rss)


def _probe_batch(lm: Any, length: int, padded: bool) -> dict[str, Any]:
    ids = (torch.arange(length, device=lm.device) % 1000 + 3)[None]
    if padded:
        return {INPUT_IDS: ids, ATTENTION_MASK: torch.ones_like(ids)}
    cu = torch.tensor([0, length], dtype=torch.int32, device=lm.device)
    return {
        INPUT_IDS: ids,
        POSITION_IDS: torch.arange(length, device=lm.device)[None],
        CU_SEQ_LENS_Q: cu,
        CU_SEQ_LENS_K: cu,
        MAX_LENGTH_Q: length,
        MAX_LENGTH_K: length,
    }


def saved_activation_bytes(lm: Any, length: int, padded: bool) -> int:
    """Bytes autograd keeps for backward in one forward of the decoder on `length` tokens (weights excluded).

    Runs in eval mode (no dropout; transformers only checkpoints layers in train mode, so this is the full
    activation memory) under the trainer's precision context.
    """
    weights = {p.untyped_storage().data_ptr() for p in lm.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights and tensor.device.type != "meta":
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    batch = _probe_batch(lm, length, padded)
    was_training = lm.hf_model.training
    lm.hf_model.eval()
    try:
        with torch.enable_grad(), lm._forward_context(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lm.head_inputs(batch).hidden.sum()
    finally:
        lm.hf_model.train(was_training)
    return sum(seen.values())


def activation_model(lm: Any, padded: bool) -> np.ndarray:
    """(a, b, c): saved bytes ~= a + b * tokens + c * attention pairs, fitted to the probes."""
    lengths = np.asarray(PROBE_LENGTHS, dtype=np.float64)
    measured = [saved_activation_bytes(lm, int(n), padded) for n in PROBE_LENGTHS]
    design = np.stack([np.ones_like(lengths), lengths, lengths**2], axis=1)
    return np.linalg.lstsq(design, np.asarray(measured, dtype=np.float64), rcond=None)[0]


def estimate_step_memory(lm: Any, step: StepShape, precision: str) -> MemoryEstimate:
    """Predict the peak memory of `lm` training on `step` (see the module docstring)."""
    hf = lm.hf_model
    config = hf.config.get_text_config()
    device = lm.device
    trainable = [p for p in lm.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    mixed = "mixed" in str(precision)
    half = 2 if mixed else 0
    autocast_weights = half * sum(p.numel() for p in lm.parameters() if p.ndim == 2)
    a, b, c = activation_model(lm, step.padded)
    full = max(0.0, a + b * step.slot_tokens + c * step.attn_pairs)
    layers = config.num_hidden_layers
    if lm.hparams.gradient_checkpointing:
        hidden_bytes = 2 if mixed else next(hf.parameters()).element_size()
        activations = layers * step.slot_tokens * config.hidden_size * hidden_bytes + 2 * full / layers
    else:
        activations = full + full / layers  # plus one layer's gradients in flight in the backward
    rows = step.slot_tokens if lm.hparams.loss_impl == "full" else min(step.slot_tokens, lm.hparams.loss_chunk_size)
    head = hf.get_output_embeddings().weight
    head_gradient = head.numel() * head.element_size() if head.requires_grad else 0
    return MemoryEstimate(
        step=step,
        device=str(device),
        resident=resident_bytes(device),
        optimizer=2 * grad_bytes,  # exp_avg, exp_avg_sq
        autocast_weights=autocast_weights,
        activations=int(activations),
        logits=rows * config.vocab_size * LOGIT_BYTES,
        head_gradient=head_gradient,
        gradients=grad_bytes,
        available=available_bytes(device),
        loss_impl=lm.hparams.loss_impl,
        gradient_checkpointing=bool(lm.hparams.gradient_checkpointing),
    )


def check_fit_memory(lm: Any, step: StepShape | None) -> MemoryEstimate | None:
    """At train start: predict the peak memory of the largest step (the data's `largest_step()`), log it, and
    raise when it will not fit.

    Every rank reads the same plan, so every rank reaches the same verdict without a collective.
    """
    trainer = lm.trainer
    if step is None:
        log.info("memory estimate skipped: the training data has no packing plan to read the largest step from")
        return None
    estimate = estimate_step_memory(lm, step, str(trainer.precision))
    log.info(estimate.summary())
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics({"train/predicted_peak_memory_gb": estimate.peak / GiB}, step=0)
    estimate.check()
    return estimate
