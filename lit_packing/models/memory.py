"""Predict a training step's peak memory before the first step and stop a fit that cannot fit; `auto_size` chooses
the largest step that fits (`max_tokens: auto`) from these estimates.

    estimate = estimate_step_memory(lm, data.largest_step(), "32-true")   # PackedCausalLM does this at train start
    estimate.check()                                                      # MemoryError naming the knobs
    memory = memory_model(lm, "32-true", padded=False)                    # the probes, once
    memory.estimate(step).peak                                            # arithmetic only: auto_size's search

The prediction adds, to what the process already holds (CPU: resident memory; CUDA: allocated memory, the weights
included), AdamW's two states and the half-precision weight copies autocast makes under mixed precision, then the
larger of two moments of the step: the start of the backward (every activation autograd keeps for the step's
largest batch, the loss's logits buffers, the LM head's gradient) and the optimizer step (every gradient plus one
more copy for the foreach temporaries). On a CPU the backward's start also counts the heap: the share of the step's
activations and logits glibc keeps after freeing them, less what the gradients then reuse (`CPU_HEAP_RETENTION`,
measured). Activations are measured, not modelled: a forward of the real model on 3
short probes (64, 128, 256 tokens) records what autograd saves (`saved_tensors_hooks`), fitted as
a + b * tokens + c * pairs (pairs: the attention cost, sum(L^2) packed, rows x width^2 padded), then scaled to the
largest step.
Gradient checkpointing keeps each layer's input plus one recomputed layer instead. A vision-language model's images
add what its vision tower and connector keep, measured per image token on documents with images made from its
config (`activations.image_token_bytes`); the plan knows a step's tokens, not which of them hold images, so every
slot of the step counts as an image token (a bound: configs/vlm.yaml's chats hold 80 image tokens in ~133; counted
whole under gradient checkpointing too). Sharded with FSDP2, parameters,
gradients and AdamW's states count this rank's shard only (1/N of each over N data-parallel ranks), plus what is
gathered whole at once: the root's parameters and two decoder layers' (`sharding.gathered_parameter_bytes`); the
start-up line says so; with `cpu_offload` on a GPU, the shards in host memory are not counted on the device (not
measured on a GPU yet). Context parallel over cp ranks, a rank's activations are those of its 1/cp of the pack's
tokens and causal pairs, plus the keys and values each layer gathers (about the whole pack's), and so are
`max_tokens: auto`'s.

The probes are what costs (3 forwards); `memory_model` runs them once and its `estimate(step)` is arithmetic, so
choosing among many step sizes costs no more than one estimate. A step fits when its predicted peak is at most the
limit: what the process holds now plus what the device can still give it, or `model.memory_limit_gb` where that is
lower. Choosing a step size keeps a fraction of the limit free (`model.memory_margin`) for what the prediction does
not model (validation, allocator fragmentation, other processes). The probes are `models.activations`; the estimate
built from them is here; the choice among step sizes, which reads only that estimate, is `models.auto_size`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lit_packing._compat import attached_trainer
from lit_packing.batch import StepShape
from lit_packing.errors import StepMemoryError
from lit_packing.models.activations import activation_model, image_token_bytes
from lit_packing.models.quantize import adamw_8bit_state_bytes, is_quantized
from lit_packing.models.sharding import gathered_numel, gathered_parameter_bytes, gradient_accumulation, local_tensor

log = logging.getLogger(__name__)
# What the value of a sampler setting sized by `largest_fitting` (`auto`) counts, as its log line says it.

GiB = 2**30
# Bytes per logit while the loss runs: the head's output, the fp32 upcast (or the bf16 gradient under autocast),
# the log-softmax kept for backward, its fp32 gradient.
LOGIT_BYTES = 16
# On a CPU, glibc's allocator keeps in the process's heap much of what a step frees (its dynamic mmap threshold
# moves activation-sized blocks from mmap to the heap after their first free), so the resident peak exceeds the live
# tensors: by a share of the step's transient bytes (activations and the loss's logits), less what the step's
# gradients and the optimizer's foreach copies then take from those retained blocks. Measured on SmolLM2-135M's
# 2,048-token packs, 3 steps: 0.73x of the transient bytes kept with LoRA and QLoRA (whose gradients are a few MB),
# more over 10 steps; less the reuse, 0.19x with full weights (0.5 GiB of gradients). See docs/memory_and_compile.md.
# A GPU's caching allocator is read as its live tensors (`memory_allocated`): nothing added there.
CPU_HEAP_RETENTION = 0.75
# glibc's dynamic mmap threshold never rises above this (64-bit: 32 MiB): a block at least this large is mapped on
# its own and unmapped when freed, so the heap never keeps it (a chunk of 1,024 tokens' fp32 logits over a
# 49,152-word vocabulary is 192 MiB).
MMAP_THRESHOLD_MAX = 32 * 2**20


@dataclass(frozen=True)
class MemoryEstimate:
    """A step's predicted peak memory (bytes) by part, what the device has, and the limit the peak must stay under."""

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
    limit: int
    shards: int = 1
    gathered: int = 0
    context: int = 1
    heap: int = 0
    accumulated: int = 0
    vision: int = 0

    @property
    def peak(self) -> int:
        # A later micro-batch's backward runs beside the gradients the earlier ones accumulated.
        backward_start = self.activations + self.vision + self.logits + self.head_gradient + self.heap
        backward_start += self.accumulated
        optimizer_step = 2 * self.gradients
        fixed = self.resident + self.optimizer + self.autocast_weights + self.gathered
        return fixed + max(backward_start, optimizer_step)

    @property
    def capped(self) -> bool:
        """Whether `model.memory_limit_gb` set the limit (below what the process holds plus what it can take)."""
        return self.limit < self.resident + self.available

    @property
    def fits(self) -> bool:
        return self.peak <= self.limit

    def summary(self) -> str:
        parts = ", ".join(
            f"{name} {getattr(self, name) / GiB:.2f}"
            for name in (
                "resident",
                "optimizer",
                "autocast_weights",
                "activations",
                "vision",
                "logits",
                "gradients",
                "heap",
                "accumulated",
            )
            # the vision tower's, the allocator's share, accumulation's: where there are some
            if name not in ("vision", "heap", "accumulated") or getattr(self, name)
        )
        if self.vision:
            parts += " (vision: the vision tower's activations, every slot of the step an image token at most)"
        cap = f"; model.memory_limit_gb limits the whole process to {self.limit / GiB:.2f} GiB" if self.capped else ""
        if self.context > 1:
            parts += f" (activations of this rank's 1/{self.context} of the pack and the keys it gathers)"
        if self.shards > 1:
            unsharded = (self.shards - 1) * (self.optimizer + 2 * self.gradients) / GiB  # states, grads, weights
            parts += (
                f", gathered whole {self.gathered / GiB:.2f} (FSDP2: parameters, gradients and optimizer state "
                f"divided over {self.shards} shards, this rank's share; unsharded: {unsharded:.2f} more)"
            )
        return (
            f"predicted peak memory {self.peak / GiB:.2f} GiB on {self.device} for the largest step "
            f"({self.step.describe()}): {parts} GiB; available beyond what is held now: {self.available / GiB:.2f} GiB"
            + cap
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
        if self.capped:
            knobs.append(f"a higher model.memory_limit_gb (now {self.limit / GiB:.2f}), if the device has the room")
        raise StepMemoryError(
            f"this fit would run out of memory: {self.summary()}. The step needs "
            f"{(self.peak - self.resident) / GiB:.2f} GiB more than the process holds; the limit leaves room for "
            f"{(self.limit - self.resident) / GiB:.2f} GiB. Lower it with: "
            + "; ".join(knobs)
            + ". Or skip this check: model.memory_check=false"
        )


@dataclass(frozen=True)
class MemoryModel:
    """What a step's peak memory is made of, measured once on the model (`memory_model`): the estimate of any step
    of the same layout is then arithmetic, so searching over step sizes runs no forward.

    Attributes:
        device: where the model runs.
        padded: the layout the activations were probed in (padded rows with a mask, or one packed row).
        resident: bytes the process holds now (weights included).
        available: bytes it can still take.
        limit: bytes the whole process may hold at the step's peak: resident + available, or less under
            `model.memory_limit_gb`.
        optimizer: AdamW's two states.
        autocast_weights: the half-precision weight copies of mixed precision.
        gradients: one copy of every trainable parameter's gradient.
        head_gradient: the LM head's gradient, alive at the start of the backward.
        activation_fit: (a, b, c) of the probes: autograd saves ~= a + b * tokens + c * attention pairs bytes.
        layers: decoder layers.
        layer_input_bytes: bytes per token of one layer's input (what gradient checkpointing keeps per layer).
        gradient_checkpointing: layers are recomputed in the backward.
        loss_impl: `full` builds every token's logits; the others one `loss_chunk_size` chunk at a time.
        loss_chunk_size: label tokens per loss chunk.
        vocab_size: logits per token.
        shards: the ranks FSDP2 splits parameters, gradients and optimizer state over (1: none).
        gathered: what a sharded rank holds whole at once beyond its shards (`sharding.gathered_parameter_bytes`).
        accumulated: the gradients held between a step's micro-batches (0 without accumulation): a rank's shard of
            them, or, sharded with `gradient_accumulation: unsharded`, every trainable parameter's whole gradient.
        context: the context-parallel ranks a pack is split over: a rank's activations are its share's.
        key_value_bytes: bytes per token of one layer's keys and values, which a context-parallel rank gathers.
        heap_retention: the share of a step's transient bytes the allocator keeps beyond the live tensors
            (`CPU_HEAP_RETENTION` on a CPU, 0 on a GPU).
        image_token_bytes: what a vision-language model's vision tower and connector keep per image token
            (`activations.image_token_bytes`; 0 without a vision tower).
    """

    device: str
    padded: bool
    resident: int
    available: int
    limit: int
    optimizer: int
    autocast_weights: int
    gradients: int
    head_gradient: int
    activation_fit: tuple[float, float, float]
    layers: int
    layer_input_bytes: int
    gradient_checkpointing: bool
    loss_impl: str
    loss_chunk_size: int
    vocab_size: int
    shards: int = 1
    gathered: int = 0
    accumulated: int = 0
    context: int = 1
    key_value_bytes: int = 0
    heap_retention: float = 0.0
    image_token_bytes: float = 0.0

    def estimate(self, step: StepShape) -> MemoryEstimate:
        """The predicted peak of training on `step` (see the module docstring), from the probes already run."""
        if step.padded != self.padded:
            layouts = {True: "padded rows", False: "a packed row"}
            raise ValueError(
                f"this memory model was probed on {layouts[self.padded]}, the step is {layouts[step.padded]}"
            )
        a, b, c = self.activation_fit
        tokens, pairs = step.slot_tokens, step.attn_pairs
        if self.context > 1:  # this rank's share of the pack (head and tail: of its pairs too), plus a slot
            tokens, pairs = -(-tokens // self.context) + 1, pairs / self.context
        full = max(0.0, a + b * tokens + c * pairs)
        # Context parallel: each layer's kernel keeps the keys and values it attends, about the whole pack's.
        keys = step.slot_tokens * self.key_value_bytes if self.context > 1 else 0
        if self.gradient_checkpointing:
            activations = self.layers * tokens * self.layer_input_bytes + 2 * full / self.layers + keys
        else:
            activations = full + full / self.layers + self.layers * keys  # + a layer's gradients in the backward
        activations = int(activations)
        vision = int(self.image_token_bytes * step.slot_tokens)  # at most every slot holds an image's token
        rows = tokens if self.loss_impl == "full" else min(tokens, self.loss_chunk_size)
        logits = rows * self.vocab_size * LOGIT_BYTES
        # A logits buffer of glibc's largest mmap threshold or more is always mapped, and returned when freed.
        heap_logits = logits if rows * self.vocab_size * 4 < MMAP_THRESHOLD_MAX else 0
        return MemoryEstimate(
            step=step,
            device=self.device,
            resident=self.resident,
            optimizer=self.optimizer,
            autocast_weights=self.autocast_weights,
            activations=activations,
            logits=logits,
            head_gradient=self.head_gradient,
            gradients=self.gradients,
            available=self.available,
            loss_impl=self.loss_impl,
            gradient_checkpointing=self.gradient_checkpointing,
            limit=self.limit,
            shards=self.shards,
            gathered=self.gathered,
            accumulated=self.accumulated,
            context=self.context,
            heap=max(0, int(self.heap_retention * (activations + vision + heap_logits)) - 2 * self.gradients),
            vision=vision,
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


def memory_model(lm: Any, precision: str, padded: bool) -> MemoryModel:
    """Measure what a step's peak memory depends on: the probes' activations (3 forwards) in the `padded` or
    packed layout, the weights, gradients and optimizer states, what the process holds and the limit.

    Args:
        lm: a `PackedCausalLM` on its device (its `memory_limit_gb`, loss and checkpointing settings are read).
        precision: the trainer's precision, e.g. `32-true`, `bf16-mixed`.
        padded: probe padded rows with a mask (padded batch samplers) rather than one packed row.
    """
    hf = lm.hf_model
    config = hf.config.get_text_config()
    device = lm.device
    shards = lm.shard_count
    # Sharded, each rank holds its shard of every parameter, gradient and optimizer state (`local_tensor`); shards
    # kept in host memory (`cpu_offload`) on a GPU are not the device's, nor are their gradients and states.
    trainable = [t for p in lm.parameters() if p.requires_grad and (t := local_tensor(p)).device.type == device.type]
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    mixed = "mixed" in str(precision)
    half = 2 if mixed else 0
    fit = activation_model(lm, padded)
    head = hf.get_output_embeddings().weight
    head_bytes = local_tensor(head).numel() * head.element_size()
    resident, available = resident_bytes(device), available_bytes(device)
    cap = lm.hparams.get("memory_limit_gb")
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return MemoryModel(
        device=str(device),
        padded=padded,
        resident=resident,
        available=available,
        limit=resident + available if cap is None else min(resident + available, int(cap * GiB)),
        # exp_avg, exp_avg_sq: as the gradients, or about a byte each with adamw8bit
        optimizer=int(adamw_8bit_state_bytes(trainable))
        if lm.hparams.get("optimizer") == "adamw8bit"
        else 2 * grad_bytes,
        # bitsandbytes' layers dequantize their own weights: autocast makes no copy of them
        autocast_weights=half
        * sum(local_tensor(p).numel() for p in lm.parameters() if p.ndim == 2 and not is_quantized(p)),  # fmt: skip
        gradients=grad_bytes,
        head_gradient=head_bytes if head.requires_grad else 0,
        activation_fit=tuple(float(x) for x in fit),
        layers=config.num_hidden_layers,
        layer_input_bytes=config.hidden_size * (2 if mixed else next(hf.parameters()).element_size()),
        gradient_checkpointing=bool(lm.hparams.gradient_checkpointing),
        loss_impl=lm.hparams.loss_impl,
        loss_chunk_size=lm.hparams.loss_chunk_size,
        vocab_size=config.vocab_size,
        shards=shards,
        gathered=gathered_parameter_bytes(lm.model, "mixed" in str(precision)) if shards > 1 else 0,
        accumulated=accumulated_bytes(lm, trainable, shards),
        context=lm.context.size if getattr(lm, "context", None) is not None else 1,
        key_value_bytes=2 * kv_heads * head_dim * (2 if mixed else next(hf.parameters()).element_size()),
        heap_retention=CPU_HEAP_RETENTION if device.type == "cpu" else 0.0,
        image_token_bytes=image_token_bytes(lm),
    )


def accumulated_bytes(lm: Any, trainable: list[torch.Tensor], shards: int) -> int:
    """The gradients a rank holds between its optimizer step's micro-batches (`MemoryModel.accumulated`): none with
    one micro-batch a step; this rank's shard of them; sharded with `gradient_accumulation: unsharded`, every
    trainable parameter's whole gradient (FSDP2 reduce-scatters them at the step's last micro-batch only)."""
    trainer = attached_trainer(lm)
    if trainer is None or trainer.accumulate_grad_batches <= 1:
        return 0
    if shards > 1 and gradient_accumulation(trainer.strategy) == "unsharded":
        whole = [p for p in lm.parameters() if p.requires_grad]
        return sum(gathered_numel(p) * p.element_size() for p in whole)
    return sum(p.numel() * p.element_size() for p in trainable)


def estimate_step_memory(lm: Any, step: StepShape, precision: str) -> MemoryEstimate:
    """Predict the peak memory of `lm` training on `step` (see the module docstring)."""
    return memory_model(lm, precision, step.padded).estimate(step)


def check_fit_memory(lm: Any, step: StepShape | None) -> MemoryEstimate | None:
    """At train start: predict the peak memory of the largest step (the data's `largest_step()`), log it, and
    raise when it exceeds the limit (the device's memory, or `model.memory_limit_gb`; no margin here).

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
