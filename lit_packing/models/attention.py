"""The attention function transformers calls in every layer of a packed model, registered through
`AttentionInterface` (and `AttentionMaskInterface`) under the names in `HF_NAMES`.

    model.set_attn_implementation(attn_implementation("per_example"))   # what `pack_model` does

A packed row of T tokens holds n examples; `cu_seq_lens_q` and `max_length_q` tell the kernel (`kernels.py`)
where the examples start, so each token attends only inside its own example. Each implementation returns no mask
for packed rows (so transformers never builds a T x T mask) and sdpa's usual mask when a padded batch brings a 2D
`attention_mask`, in which case the layer runs plain sdpa. Without `cu_seq_lens_*` the boundaries come from
`position_ids` (a new example wherever positions do not increase by one), so a backend never silently attends
across examples. A packed row reaching an attention layer of a model that `pack_model` did not build is refused
(its other token mixers would run across the boundaries unseen).

Shared prompts (`key_index`, from `PairCollator(share_prompt=True)`): the keys and values are gathered segment by
segment (a continuation's: its prompt's, then its own) and every kernel attends the queries of segment i of
`cu_seq_lens_q` to the keys of segment i of `cu_seq_lens_k`, causality aligned bottom-right (the last query sees
every key): FlashAttention's own convention for fewer queries than keys, and the per-example kernels' masks.

Context parallel (`CONTEXT`, a batch `context.deal` made): the keys and values are first all-gathered over the
context-parallel group, then picked by `gathered_index` the same way, each rank's piece of a document attending that
document's keys up to its own last token.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import cache

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lit_packing.batch import (
    ATTENTION_MASK,
    CONTEXT,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    GATHERED_INDEX,
    KEY_INDEX,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    POSITION_IDS,
)
from lit_packing.errors import ConfigError, IsolationError
from lit_packing.models.context import ContextGroup, gather_tokens
from lit_packing.models.kernels import (
    HALF_ONLY,
    attend,
    flash_attn_varlen,
    load_kernel,
    per_example_varlen,
    sdpa_block_mask,
    torch_varlen,
)
from lit_packing.models.segments import boundaries_from_positions

# Names inside transformers: none contains "flash" or "sdpa", which transformers reads as its own integrations.
HF_NAMES = {
    "flash_attn": "packed_fa2",
    "torch_varlen": "packed_torch_varlen",
    "per_example": "packed_per_example",
    "sdpa_mask": "packed_dense_mask",
}

# A varlen kernel: q (total, H, D), k/v (total, Hkv, D), cu (n + 1,) int32 -> (total, H, D).
VarlenFn = Callable[..., torch.Tensor]


def attn_implementation(backend: str) -> str:
    """The transformers `attn_implementation` name of a (resolved) backend, registered on first use."""
    if backend not in HF_NAMES:
        raise ValueError(f"{backend!r} is not a resolved backend: use resolve_backend() first")
    register_backends()
    if backend in HALF_ONLY:
        load_kernel(backend)
    return HF_NAMES[backend]


@cache
def register_backends() -> None:
    """Register every backend with transformers' attention and mask interfaces (idempotent)."""
    kernels = {
        "flash_attn": flash_attn_varlen,
        "torch_varlen": torch_varlen,
        "per_example": per_example_varlen,
        "sdpa_mask": sdpa_block_mask,
    }
    for backend, name in HF_NAMES.items():
        AttentionInterface.register(name, _attention_forward(kernels[backend]))
        AttentionMaskInterface.register(name, _padding_only_mask)


# What the packed backends do with each keyword a model's layers hand the attention function: honoured, or
# without effect on the result. Anything else is refused at construction (`probe.probe_packing`).
HONOURED_KEYWORDS = frozenset({
    ATTENTION_MASK, POSITION_IDS, CU_SEQ_LENS_Q, CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K, KEY_INDEX, GATHERED_INDEX,
    CONTEXT,
    "dropout", "scaling", "sliding_window", "softcap", "is_causal", "s_aux", "sinks", "position_bias",
})  # fmt: skip
INERT_KEYWORDS = frozenset({
    "use_cache", "output_attentions", "output_router_logits", "output_hidden_states", "return_dict",
    "cache_position", "layer_idx", "past_key_values", "cache", "position_embeddings",
})  # fmt: skip
PROBE_NAME = "packed_probe"


def register_probe(seen: set[str], modules: list[torch.nn.Module], each: dict[int, set[str]] | None = None) -> str:
    """Register the per_example backend under `PROBE_NAME`, adding to `seen` every keyword it is handed with a
    value (and `PROBE_NAME` itself once it is called), to `modules` every attention module that calls it and, per
    module (`each`, by `id`), the keywords that module handed it; return the name."""
    forward = _attention_forward(per_example_varlen, check_door=False)

    def probe(module, *args, **kwargs):
        modules.append(module)
        seen.add(PROBE_NAME)
        handed = {key for key, value in kwargs.items() if value is not None}
        seen.update(handed)
        if each is not None:
            each.setdefault(id(module), set()).update(handed)
        return forward(module, *args, **kwargs)

    AttentionInterface.register(PROBE_NAME, probe)
    AttentionMaskInterface.register(PROBE_NAME, _padding_only_mask)
    return PROBE_NAME


# ----------------------------------------------------------------------------------------------------------------
# The function transformers calls in every attention layer


def _padding_only_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """Packed rows need no mask (the backend reads the boundaries); a padded batch gets sdpa's boolean mask."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def _attention_forward(kernel: VarlenFn, check_door: bool = True) -> Callable:
    """The attention function of one kernel. `check_door`: refuse packed rows in a model `pack_model` did not
    build (off only for the construction probe, which runs before the door admits the model)."""

    def attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,  # (B, H, T, D)
        key: torch.Tensor,  # (B, Hkv, T, D)
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        is_causal: bool | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        position_ids: torch.Tensor | None = None,
        s_aux: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        position_bias: torch.Tensor | None = None,
        key_index: torch.Tensor | None = None,
        gathered_index: torch.Tensor | None = None,
        context: ContextGroup | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        batch, heads, seq, _ = query.shape
        sink = _sink_logits(s_aux, sinks, batch, heads, seq)  # (B, H, T) or None
        if attention_mask is not None:  # a padded batch: the (B, 1, T, T) mask sdpa_mask built
            if softcap is None and sink is None and position_bias is None:
                return sdpa_attention_forward(
                    module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal
                )
            out = attend(
                query, key, value, causal=False, scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
                window=None, softcap=softcap, dropout=dropout, mask=attention_mask.bool(), sink=sink,
                bias=position_bias,
            )  # fmt: skip
            return out.transpose(1, 2), None
        if cu_seq_lens_q is None and key.shape[2] != seq:  # decoding with a KV cache (generate): one sequence a row
            return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling)
        packed = cu_seq_lens_q is not None
        if cu_seq_lens_q is None:
            cu_seq_lens_q = cu_seq_lens_k = boundaries_from_positions(position_ids, batch, seq, query.device)
            max_length_q = max_length_k = None
            packed = len(cu_seq_lens_q) > batch + 1  # positions that restart inside a row
        elif batch != 1:
            raise ValueError(f"a packed batch has one row, got input_ids of shape ({batch}, {seq})")
        if packed and check_door and not torch.compiler.is_compiling() and module not in _PACKED_BY_DOOR:
            refuse_unpacked(module)
        q, k, v = (x.transpose(1, 2).reshape(batch * seq, x.shape[1], x.shape[3]) for x in (query, key, value))
        if key_index is not None and position_bias is not None:
            raise ConfigError(
                "data.collator.init_args.share_prompt",
                f"{type(module).__name__} adds a position bias over the row's (query, key) pairs, which gathered "
                "keys do not have",
                "set {share_prompt}=false for this model",
            )
        if context is not None:  # context parallel: every rank's keys, `gathered_index` picks each piece's document
            k, v = gather_tokens(k, v, context, gathered_index)
        elif key_index is not None:  # shared prompts: each segment's keys, its prompt's then its own
            k, v = k.index_select(0, key_index), v.index_select(0, key_index)
        extras = {}
        if sink is not None:  # per token and head: (B * T, H)
            extras["sink"] = sink.transpose(1, 2).reshape(batch * seq, heads)
        if position_bias is not None:
            extras["bias"] = position_bias.expand(batch, heads, seq, key.shape[2])
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        out = kernel(
            q,
            k,
            v,
            cu_seq_lens_q,
            cu_seq_lens_k if cu_seq_lens_k is not None else cu_seq_lens_q,
            max_length_q,
            max_length_k,
            causal=causal,
            scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
            window=sliding_window,
            softcap=softcap,
            dropout=dropout,
            **extras,
        )
        return out.reshape(batch, seq, *out.shape[1:]), None

    return attention_forward


def _sink_logits(s_aux, sinks, batch: int, heads: int, seq: int) -> torch.Tensor | None:
    """Attention sinks as one logit per row, head and query (B, H, T): gpt-oss's per-head `s_aux` (H,) or a
    per-query `sinks` (B, H, T, 1); None without."""
    if s_aux is not None:
        return s_aux.reshape(1, heads, 1).expand(batch, heads, seq)
    return sinks[..., 0] if sinks is not None else None


# The attention modules of every model `pack_model` built (and the probe saw call attention). Membership, not an
# attribute on the module: what the door learns is its own. Weak, so a model is freed as usual.
_PACKED_BY_DOOR: weakref.WeakSet = weakref.WeakSet()


def admit(modules) -> None:
    """Let these attention modules run packed rows (`pack_model` calls it with the modules its probe saw)."""
    _PACKED_BY_DOOR.update(modules)


def refuse_unpacked(module: torch.nn.Module) -> None:
    """A packed row reached a lit_packing attention backend in a model `pack_model` did not build: its other token
    mixers (state-space scans, convolutions) would run across the examples' boundaries unseen, and nothing probed
    it. Refused on its first packed forward, in one line."""
    raise IsolationError(
        f"a packed batch reached {type(module).__name__}, whose model was not made packed by "
        "lit_packing.core.pack_model: its non-attention token mixers could run across the examples' boundaries "
        "and nothing checked that examples stay apart. Call `lit_packing.core.pack_model(model)` once after "
        "building it (it chooses and sets the attention backend itself), or train it padded "
        "(lit_packing.data.PaddedCollator)"
    )
