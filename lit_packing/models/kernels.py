"""The attention kernels of the packed backends: q (total, H, D), k/v (total, Hkv, D), cu (n + 1,) -> (total, H, D).

    out = load_kernel("torch_varlen")[0](q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0))

    flash_attn    `flash_attn_varlen_func` from the flash-attn package (CUDA)
    torch_varlen  `torch.nn.attention.varlen.varlen_attn`, PyTorch's built-in FlashAttention (CUDA, torch >= 2.10)
    per_example   per-example SDPA on any device, one batched call per distinct length: cost sum(L^2), not T^2
    sdpa_mask     SDPA with a dense (T, T) block-diagonal causal mask: the slow reference

    lengths 4, 8, 5, 11 -> cu_seq_lens = [0, 4, 12, 17, 28], max_length = 11, attention cost sum(L^2) = 226
    (a dense block-diagonal mask would cost T^2 = 784 and a padded batch 4 * 11^2 = 484)

This is the only module that imports flash_attn.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F

from lit_packing.errors import ConfigError
from lit_packing.models.segments import length_groups, memo

# The kernels that compute in fp16 / bf16 only (FlashAttention); the per-example backends take any dtype.
HALF_ONLY = ("flash_attn", "torch_varlen")
_HALF = (torch.float16, torch.bfloat16)


def compute_dtype(backend: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype `backend`'s attention computes in when the layer's activations are `dtype` (the autocast dtype
    under autocast): FlashAttention kernels run other dtypes (fp32 without autocast) in bfloat16."""
    return torch.bfloat16 if backend in HALF_ONLY and dtype not in _HALF else dtype


@cache
def flash_attn_status() -> tuple[bool, str]:
    """Whether flash-attn's varlen kernel loads here, and why not: a real import, not a look-up of the name (an
    FA4-only install leaves a namespace package `flash_attn` without it; a wheel built for another torch or CUDA
    fails to load its extension)."""
    if importlib.util.find_spec("flash_attn") is None:
        return False, "flash-attn is not installed"
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401  (imports the compiled extension)
    except Exception as error:  # ImportError, OSError (undefined symbol), RuntimeError from the extension
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return False, f"flash-attn is installed but its varlen kernel does not load ({detail})"
    return True, "flash-attn loads"


def flash_attn_installed() -> bool:
    """flash-attn's varlen kernel can be imported here (see `flash_attn_status`)."""
    return flash_attn_status()[0]


def _kernel_dtype(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.dtype, bool]:
    """One dtype for q, k and v, and whether autocast chose it. Under autocast transformers hands attention q and k
    in fp32 (RoPE multiplies by fp32 cos / sin) and v in the autocast dtype: all three go in the autocast dtype, as
    transformers' own FlashAttention integration does. Without autocast: the activations' half dtype, else bf16."""
    device = q.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in _HALF:
        return torch.get_autocast_dtype(device), True
    return (v.dtype if v.dtype in _HALF else compute_dtype("flash_attn", q.dtype)), False


def _half_inputs(q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype | None]:
    """q, k, v in one half dtype, and the dtype to cast the output back to (None under autocast: the next
    projection runs under the same autocast, so no fp32 copy of every layer's output is made)."""
    dtype, autocast = _kernel_dtype(q, v)
    back = None if autocast or q.dtype == dtype else q.dtype
    return q.to(dtype), k.to(dtype), v.to(dtype), back


def _max_length(cu: torch.Tensor, given: int | None) -> int:
    return int(given) if given is not None else int((cu[1:] - cu[:-1]).max())


def _int32(cu: torch.Tensor) -> torch.Tensor:
    """The kernels read cu_seqlens as a contiguous int32 array."""
    return cu.to(torch.int32).contiguous()


# The kernel functions, imported when a backend is chosen (`attn_implementation`), never inside traced code: under
# torch.compile a cached import would be traced through at every layer.
_LOADED: dict[str, tuple[Callable, frozenset]] = {}


def load_kernel(backend: str) -> tuple[Callable, frozenset]:
    if backend not in _LOADED:
        if backend == "flash_attn":
            from flash_attn import flash_attn_varlen_func as fn
        else:
            from torch.nn.attention.varlen import varlen_attn as fn
        _LOADED[backend] = fn, frozenset(inspect.signature(fn).parameters)
    return _LOADED[backend]


def flash_attn_varlen(
    q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout, sink=None, bias=None
):
    _refuse_extras("flash_attn", sink, bias)
    flash_attn_varlen_func = (_LOADED.get("flash_attn") or load_kernel("flash_attn"))[0]
    kwargs = {"dropout_p": dropout, "softmax_scale": scale, "causal": causal}
    if window is not None:
        kwargs["window_size"] = (window - 1, 0 if causal else window - 1)
    if softcap is not None:
        kwargs["softcap"] = softcap
    q, k, v, back = _half_inputs(q, k, v)
    cu_q, cu_k = _int32(cu_q), _int32(cu_k)
    if cu_k is cu_q:  # one tensor given twice to an autograd.Function: torch.compile breaks the graph there
        cu_k = cu_q.clone()
    out = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, _max_length(cu_q, max_q), _max_length(cu_k, max_k), **kwargs
    )  # GQA is native: k/v keep their Hkv heads; flash-attn pads a head_dim that is not a multiple of 8 itself
    return out if back is None else out.to(back)


def torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout, sink=None, bias=None):
    _refuse_extras("torch_varlen", sink, bias)
    varlen_attn, params = _LOADED.get("torch_varlen") or load_kernel("torch_varlen")
    if dropout > 0:
        raise ConfigError(
            "attn_backend",
            "torch_varlen has no attention dropout",
            "set the model's attention_dropout to 0 or use {attn_backend}=flash_attn / per_example",
        )
    if softcap is not None:
        raise ConfigError(
            "attn_backend", "torch_varlen has no softcap (Gemma 2/3)", "use {attn_backend}=flash_attn or per_example"
        )
    q, k, v, back = _half_inputs(q, k, v)
    head_dim = q.shape[-1]
    if head_dim % 8:  # the kernel takes multiples of 8 only: zero columns change neither scores nor kept values
        q, k, v = (F.pad(x, (0, 8 - head_dim % 8)) for x in (q, k, v))
    kwargs = {}
    if "scale" in params:
        kwargs["scale"] = scale
    else:  # its default is 1/sqrt(D) of the (padded) head_dim: fold any other scale into q
        q = q * (scale * q.shape[-1] ** 0.5)
    if "window_size" in params:  # torch >= 2.11: causal is window (-1, 0); a sliding window is (W - 1, 0)
        left = window - 1 if window is not None else -1
        kwargs["window_size"] = (left, 0 if causal else (-1 if window is None else window - 1))
    else:  # torch 2.10: is_causal only
        if window is not None:
            raise ConfigError(
                "attn_backend",
                "this torch's varlen_attn has no sliding window",
                "upgrade torch or use {attn_backend}=flash_attn",
            )
        kwargs["is_causal"] = causal
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    out = varlen_attn(q, k, v, _int32(cu_q), _int32(cu_k), _max_length(cu_q, max_q), _max_length(cu_k, max_k), **kwargs)
    out = out[..., :head_dim] if out.shape[-1] != head_dim else out
    return out if back is None else out.to(back)


def _refuse_extras(backend: str, sink: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    """The FlashAttention kernels take no sinks and no score bias (`kernel_refusal` keeps `auto` from them)."""
    if sink is not None or bias is not None:
        what = "attention sinks" if sink is not None else "a position bias"
        raise ConfigError("attn_backend", f"{backend} has no {what}", "set {attn_backend}=auto or per_example")


def _same_boundaries(cu_q: torch.Tensor, cu_k: torch.Tensor) -> bool:
    """Whether the keys are the queries' own tokens (self-attention), not gathered for shared prompts."""
    return cu_k is cu_q or torch.equal(cu_q, cu_k)


def _visible(lq: int, lk: int, causal: bool, window: int | None, device) -> torch.Tensor | None:
    """(lq, lk) bool, True = attend: the last `lq` of `lk` positions as queries (bottom-right alignment, a
    continuation's queries after its prompt), causal and windowed as transformers means it; None for plain causal
    self-attention, which SDPA's own `is_causal` does."""
    if lq == lk and causal and window is None:
        return None
    dist = (torch.arange(lq, device=device) + (lk - lq))[:, None] - torch.arange(lk, device=device)[None, :]
    mask = dist >= 0 if causal else torch.ones_like(dist, dtype=torch.bool)
    if window is not None:
        mask &= dist < window if causal else dist.abs() < window
    return mask


def attend(q, k, v, *, causal, scale, window, softcap, dropout, mask=None, sink=None, bias=None) -> torch.Tensor:
    """Attention over (m, H, L, D) batches of equal-length sequences, k/v (m, Hkv, L, D); GQA handled.

    `mask` (L, L) or (m, 1, L, L), True = attend, replaces the causal / window pattern when given. `bias`
    (m, H, L, L) is added to the scores; `sink` (m, H, L) is one more logit per query, whose value is zero: it only
    takes probability mass (attention sinks).
    """
    length = q.shape[2]
    gqa = k.shape[1] != q.shape[1]
    if mask is None and window is not None and length > window:  # transformers: key within (q - window, q]
        i = torch.arange(length, device=q.device)
        dist = i[:, None] - i[None, :]
        mask = ((dist >= 0) & (dist < window)) if causal else (dist.abs() < window)
    if softcap is None and sink is None and bias is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal and mask is None, scale=scale, enable_gqa=gqa
        )
    # Softcap (Gemma 2/3), a score bias and sinks have no SDPA kernel: plain math, still per example.
    if gqa:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    if mask is None and causal:
        mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sink is not None:
        scores = torch.cat([scores, sink[..., None].to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, v)


def per_example_varlen(
    q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout, sink=None, bias=None
):
    """Exact per-example attention on any device: one SDPA call per distinct example length, cost sum(L^2)."""
    if not _same_boundaries(cu_q, cu_k):
        return _per_segment_keys(q, k, v, cu_q, cu_k, causal=causal, scale=scale, window=window, softcap=softcap,
                                 dropout=dropout, sink=sink)  # fmt: skip
    groups, inverse = length_groups(cu_q)
    opts = {"causal": causal, "scale": scale, "window": window, "softcap": softcap, "dropout": dropout}
    outs = []
    for length, starts, index in groups:
        if index is None:  # a single example: a view, no gather
            parts = [x.narrow(0, starts[0], length).unsqueeze(0) for x in (q, k, v)]
        else:
            parts = [x.index_select(0, index).view(len(starts), length, *x.shape[1:]) for x in (q, k, v)]
        qg, kg, vg = (x.transpose(1, 2) for x in parts)  # (m, H, L, D)
        if sink is not None or bias is not None:  # the flat token index of the group's examples
            rows = index if index is not None else torch.arange(starts[0], starts[0] + length, device=q.device)
        if sink is not None:  # (T, H) -> (m, H, L)
            opts["sink"] = sink.index_select(0, rows).view(len(starts), length, -1).transpose(1, 2)
        if bias is not None:  # (B, H, T, T) -> the (m, H, L, L) blocks of the examples
            opts["bias"] = _bias_blocks(bias, rows.view(len(starts), length))
        outs.append(attend(qg, kg, vg, **opts).transpose(1, 2).reshape(-1, *q.shape[1:]))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out if inverse is None else out.index_select(0, inverse)


_KEY_PLAN_CACHE: dict = {}


def _per_segment_keys(q, k, v, cu_q, cu_k, *, causal, scale, window, softcap, dropout, sink):
    """`per_example_varlen` with gathered keys (shared prompts): segment i's queries attend segment i of `cu_k`, one
    SDPA call per distinct (queries, keys) shape, cost sum(Lq * Lk)."""

    def build():
        groups: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        for qa, qb, ka, kb in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
            if qb > qa:
                starts = groups.setdefault((qb - qa, kb - ka), ([], []))
                starts[0].append(qa), starts[1].append(ka)
        plan, order = [], []
        for (lq, lk), (q_starts, k_starts) in groups.items():
            q_index = (torch.tensor(q_starts)[:, None] + torch.arange(lq)[None]).reshape(-1)
            k_index = (torch.tensor(k_starts)[:, None] + torch.arange(lk)[None]).reshape(-1)
            order.append(q_index)
            plan.append((len(q_starts), lq, lk, q_index.to(cu_q.device), k_index.to(cu_q.device)))
        return plan, torch.argsort(torch.cat(order)).to(cu_q.device)

    plan, inverse = memo(_KEY_PLAN_CACHE, cu_k, "plan", build)
    outs = []
    for m, lq, lk, q_index, k_index in plan:
        qg = q.index_select(0, q_index).view(m, lq, *q.shape[1:]).transpose(1, 2)  # (m, H, Lq, D)
        kg, vg = (x.index_select(0, k_index).view(m, lk, *x.shape[1:]).transpose(1, 2) for x in (k, v))
        opts = {"sink": sink.index_select(0, q_index).view(m, lq, -1).transpose(1, 2)} if sink is not None else {}
        mask = _visible(lq, lk, causal, window, q.device)
        out = attend(qg, kg, vg, causal=causal and mask is None, scale=scale, window=None, softcap=softcap,
                      dropout=dropout, mask=mask, **opts)  # fmt: skip
        outs.append(out.transpose(1, 2).reshape(-1, *q.shape[1:]))
    return torch.cat(outs).index_select(0, inverse)


def _bias_blocks(bias: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The (m, H, L, L) diagonal blocks of a (B, H, T, T) score bias for examples at flat token `rows` (m, L)."""
    seq = bias.shape[2]
    row, pos = rows // seq, rows % seq
    blocks = bias[row[:, :, None], :, pos[:, :, None], pos[:, None, :]]  # (m, L, L, H)
    return blocks.permute(0, 3, 1, 2)


_MASK_CACHE: dict = {}


def sdpa_block_mask(
    q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout, sink=None, bias=None
):
    """The reference: one SDPA call over all T tokens with a dense (T, T) block-diagonal mask. Cost T^2. With
    gathered keys (shared prompts) the mask is (T, Tk): segment i's queries, bottom-right aligned, to its keys."""
    total, keys = q.shape[0], k.shape[0]

    def build() -> torch.Tensor:
        lq, lk = (cu_q[1:] - cu_q[:-1]).long(), (cu_k[1:] - cu_k[:-1]).long()
        segments = torch.arange(len(lq), device=q.device)
        seq_q = torch.repeat_interleave(segments, lq, output_size=total)
        seq_k = torch.repeat_interleave(segments, lk, output_size=keys)
        # each query's and key's place among its segment's keys (a query is the last lq of lk)
        at_q = torch.arange(total, device=q.device) - cu_q[:-1].long()[seq_q] + (lk - lq)[seq_q]
        at_k = torch.arange(keys, device=q.device) - cu_k[:-1].long()[seq_k]
        dist = at_q[:, None] - at_k[None, :]
        mask = seq_q[:, None] == seq_k[None, :]
        if causal:
            mask &= dist >= 0
        if window is not None:
            mask &= dist.abs() < window
        return mask  # (T, Tk) bool

    mask = memo(_MASK_CACHE, cu_q, (causal, window), build)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, H, T, D)
    extras = {}
    if sink is not None:
        extras["sink"] = sink.transpose(0, 1).unsqueeze(0)  # (1, H, T)
    if bias is not None:  # self-attention only (attention.py refuses a bias with gathered keys)
        extras["bias"] = _bias_blocks(bias, torch.arange(total, device=q.device)[None])
    out = attend(
        qh, kh, vh, causal=causal, scale=scale, window=window, softcap=softcap, dropout=dropout, mask=mask, **extras
    )
    return out[0].transpose(0, 1)
