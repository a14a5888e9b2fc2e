"""Training cost of a model on a batch: the model's shape, FLOPs per token and per attended pair, model and
hardware FLOPs of a batch. Samplers (compute balance), callbacks (TFLOP/s, MFU), the packing report and the
benchmark share these formulas.

    a, b = flop_coefficients(model_shape(hf_model))     # an example of L tokens costs a * L + b * L^2

FLOPs follow PaLM's convention: two FLOPs per multiply-add, and attention counted as QK^T and AV over every
(query, key) pair of a sequence, causal masking not discounted (L^2 per sequence of L tokens; a sliding window of
w caps the keys: L * min(L, w)).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any, TypedDict

import torch

from lit_packing.batch import Counts, attention_cost, batch_counts  # noqa: F401  (batch_counts: doctests)

# FLOPs per parameter per token: forward 2; backward 2 for the input gradient + 2 for the weight gradient.
TRAINABLE_FLOPS_PER_PARAM = 6
FROZEN_FLOPS_PER_PARAM = 4  # a frozen weight (LoRA's base) still passes the gradient to its input
# Per (query, key) pair per unit of attention width: QK^T and AV, 2 FLOPs each forward, backward twice forward.
ATTENTION_FLOPS_PER_PAIR = 12


class ModelShape(TypedDict):
    """What training FLOPs depend on: matmul parameters (trainable, frozen), attention width, per-layer windows.

    `windows` has one entry per layer: the sliding window in tokens, or None for full attention.
    """

    trainable_params: int
    frozen_params: int
    attn_width: int
    windows: tuple[int | None, ...]


# SmolLM2-135M(-Instruct), as `model_shape` reads it (tied embeddings: the LM head counts once): the default shape
# for compute-balanced packing when no model is attached. A test checks it against the packaged model's config.
SMOLLM2_135M_SHAPE = ModelShape(trainable_params=134_515_008, frozen_params=0, attn_width=576, windows=(None,) * 30)


def flop_coefficients(shape: ModelShape) -> tuple[float, float]:
    """Training FLOPs (forward + backward) ``a`` per token and ``b`` per attended (query, key) pair, all layers full.

    ``a = 6 * trainable + 4 * frozen`` matmul parameters, ``b = 12 * layers * width``. An example of L tokens costs
    ``a * L + b * L^2`` (multipack balances ranks with this). SmolLM2-135M: attention matches the matmuls at
    L = a / b = 3,892 tokens.

    >>> a, b = flop_coefficients(SMOLLM2_135M_SHAPE)
    >>> f"{a:.3g} {b:.3g} {a / b:,.0f}"
    '8.07e+08 2.07e+05 3,892'
    >>> flop_coefficients(ModelShape(trainable_params=10, frozen_params=100, attn_width=8, windows=(None, 4)))
    (460.0, 192.0)
    """
    per_token = TRAINABLE_FLOPS_PER_PARAM * shape["trainable_params"] + FROZEN_FLOPS_PER_PARAM * shape["frozen_params"]
    return float(per_token), float(ATTENTION_FLOPS_PER_PAIR * len(shape["windows"]) * shape["attn_width"])


def model_flops(shape: ModelShape, counts: Counts, lengths: Sequence[int], keys: Sequence[int] | None = None) -> float:
    """FLOPs of the work a batch asks for: real tokens only, each layer's attention within its window.

    Padding is waste, not work, so the same examples cost the same whether packed or padded (this is what
    `train/tflops_per_sec` and `train/mfu` count). With shared prompts (`keys`, the batch's `key_lengths`) a
    prompt counts once, and each continuation's attention over it counts with the continuation.

    >>> shape = ModelShape(trainable_params=1000, frozen_params=0, attn_width=8, windows=(None, 5))
    >>> counts = batch_counts([4, 8, 5, 11], label_tokens=24, slot_tokens=44, attn_cost=4 * 11 * 11)
    >>> model_flops(shape, counts, [4, 8, 5, 11]) == 6 * 1000 * 28 + 12 * 8 * (226 + 136)
    True
    """
    per_token, _ = flop_coefficients(shape)
    attention = sum(k * attention_cost(lengths, w, keys) for w, k in Counter(shape["windows"]).items())
    return per_token * counts["real_tokens"] + ATTENTION_FLOPS_PER_PAIR * shape["attn_width"] * attention


def hardware_flops(shape: ModelShape, counts: Counts) -> float:
    """FLOPs the device computes on a batch: every slot token, and attention over every computed row in full.

    Padding and padded rows' max(L)^2 count here; windows do not (an upper bound where a kernel skips the
    blocks outside a sliding window).

    >>> shape = ModelShape(trainable_params=1000, frozen_params=0, attn_width=8, windows=(None, 5))
    >>> counts = batch_counts([4, 8, 5, 11], label_tokens=24, slot_tokens=44, attn_cost=4 * 11 * 11)
    >>> hardware_flops(shape, counts) == 6 * 1000 * 44 + 12 * 2 * 8 * 484
    True
    """
    per_token, per_pair = flop_coefficients(shape)
    return per_token * counts["slot_tokens"] + per_pair * counts["attn_cost"]


def weights_in(parameter: torch.Tensor) -> int:
    """The weights a parameter stands for: its elements, or for a 4-bit quantized one (bitsandbytes packs two
    weights a byte) the shape its quantization state keeps."""
    state = getattr(parameter, "quant_state", None)
    shape = getattr(state, "shape", None) if state is not None else None
    return math.prod(shape) if shape is not None else parameter.numel()


def model_shape(model: torch.nn.Module) -> ModelShape:
    """Matmul parameters (trainable, frozen), attention width and per-layer sliding windows of a Hugging Face model.

    The input embedding is a lookup, not a matmul; a tied matrix still counts once (the LM head). Windows come from
    the config's `layer_types` ("sliding_attention" layers get `sliding_window`), else `sliding_window` on every layer.
    """
    trainable = frozen = 0
    for p in model.parameters():
        if p.requires_grad:
            trainable += weights_in(p)
        else:
            frozen += weights_in(p)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embed is not None and (output is None or output.weight is not embed.weight):
        if embed.weight.requires_grad:
            trainable -= embed.weight.numel()
        else:
            frozen -= embed.weight.numel()
    config = model.config.get_text_config() if hasattr(model, "config") else None
    if config is None:
        return ModelShape(trainable_params=trainable, frozen_params=frozen, attn_width=0, windows=())
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelShape(
        trainable_params=trainable, frozen_params=frozen, attn_width=heads * head_dim, windows=_layer_windows(config)
    )


def _layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as transformers configs spell it."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return tuple(window if kind == "sliding_attention" else None for kind in types)
    return (window,) * config.num_hidden_layers
