"""Varlen attention backends for packed batches, plugged into transformers through `AttentionInterface`.

    model.set_attn_implementation(attn_implementation(resolve_backend("auto", device)))

A packed batch is one row of T tokens holding n examples; `cu_seq_lens_q = [0, L1, L1+L2, ..., T]` (int32) and
`max_length_q` tell every backend where the examples start, so each token attends only inside its own example:

    lengths 4, 8, 5, 11 -> cu_seq_lens = [0, 4, 12, 17, 28], max_length = 11, attention cost sum(L^2) = 226
    (a dense block-diagonal mask would cost T^2 = 784 and a padded batch 4 * 11^2 = 484)

Backends (all exact; registered under the names in `HF_NAMES`):
    flash_attn    `flash_attn_varlen_func` from the flash-attn package (CUDA; `pip install -e ".[flash]"`)
    torch_varlen  `torch.nn.attention.varlen.varlen_attn`, PyTorch's built-in FlashAttention-2 (CUDA, torch >= 2.10)
    per_example    per-example SDPA on any device, one batched call per distinct length: cost sum(L^2), not T^2
    sdpa_mask     SDPA with a dense (T, T) block-diagonal causal mask: the slow reference

Each implementation is also registered in `AttentionMaskInterface`: it returns no mask for packed rows (so
transformers never builds a T x T mask) and sdpa's usual mask when a padded batch brings a 2D `attention_mask`,
in which case the layer runs plain sdpa. Without `cu_seq_lens_*` the boundaries come from `position_ids` (a new
example wherever positions do not increase by one), so a backend never silently attends across examples.

This is the only module that imports flash_attn.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import logging
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from functools import cache
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lit_packing.errors import ConfigError

log = logging.getLogger(__name__)

AttnBackend = Literal["auto", "flash_attn", "torch_varlen", "per_example", "sdpa_mask"]
BACKENDS = ("flash_attn", "torch_varlen", "per_example", "sdpa_mask")
# Names inside transformers: none contains "flash" or "sdpa", which transformers reads as its own integrations.
HF_NAMES = {
    "flash_attn": "packed_fa2",
    "torch_varlen": "packed_torch_varlen",
    "per_example": "packed_per_example",
    "sdpa_mask": "packed_dense_mask",
}

# A varlen kernel: q (total, H, D), k/v (total, Hkv, D), cu (n + 1,) int32 -> (total, H, D).
VarlenFn = Callable[..., torch.Tensor]


# ----------------------------------------------------------------------------------------------------------------
# Choosing a backend


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def torch_varlen_available(device: torch.device | str) -> bool:
    """PyTorch's built-in varlen FlashAttention-2: CUDA only, compute capability >= 8.0."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def resolve_backend(backend: AttnBackend, device: torch.device | str) -> str:
    """Turn `auto` into the fastest backend for `device` (flash_attn > torch_varlen > per_example); check others.

    Raises:
        ConfigError: the backend cannot run on this device or is not installed; the message names the fix.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    if backend == "auto":
        if cuda and flash_attn_installed():
            return "flash_attn"
        if torch_varlen_available(device):
            return "torch_varlen"
        return "per_example"
    if backend not in BACKENDS:
        raise ConfigError("attn_backend", f"unknown backend {backend!r}", f"choose one of auto, {', '.join(BACKENDS)}")
    if backend == "flash_attn":
        if not cuda:
            raise ConfigError(
                "attn_backend",
                f"flash_attn needs a CUDA GPU, and this run is on {device}",
                "set {attn_backend}=auto (picks per_example here) or {attn_backend}=per_example",
            )
        if not flash_attn_installed():
            raise ConfigError(
                "attn_backend",
                "flash_attn needs the flash-attn package",
                'from the repository, `pip install -e ".[flash]"` (compiles against your CUDA toolkit), or set '
                "{attn_backend}=auto (PyTorch's built-in torch_varlen on this GPU)",
            )
    if backend == "torch_varlen" and not torch_varlen_available(device):
        raise ConfigError(
            "attn_backend",
            f"torch_varlen needs torch >= 2.10 and a CUDA GPU with compute capability >= 8.0 (device {device}, "
            f"torch {torch.__version__})",
            "set {attn_backend}=auto or per_example",
        )
    return backend


def available_backends(device: torch.device | str) -> list[str]:
    """The backends that can run on `device` here, fastest first (e.g. `["per_example", "sdpa_mask"]` on a CPU)."""
    usable = []
    for backend in BACKENDS:
        try:
            usable.append(resolve_backend(backend, device))
        except ValueError:
            continue
    return usable


def attn_implementation(backend: str) -> str:
    """The transformers `attn_implementation` name of a (resolved) backend, registered on first use."""
    if backend not in HF_NAMES:
        raise ValueError(f"{backend!r} is not a resolved backend: use resolve_backend() first")
    register_backends()
    return HF_NAMES[backend]


@cache
def register_backends() -> None:
    """Register every backend with transformers' attention and mask interfaces (idempotent)."""
    kernels = {
        "flash_attn": _flash_attn_varlen,
        "torch_varlen": _torch_varlen,
        "per_example": _per_example,
        "sdpa_mask": _sdpa_block_mask,
    }
    for backend, name in HF_NAMES.items():
        AttentionInterface.register(name, _attention_forward(kernels[backend]))
        AttentionMaskInterface.register(name, _padding_only_mask)


# ----------------------------------------------------------------------------------------------------------------
# The function transformers calls in every attention layer


def _padding_only_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """Packed rows need no mask (the backend reads the boundaries); a padded batch gets sdpa's boolean mask."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def _attention_forward(kernel: VarlenFn) -> Callable:
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
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        if attention_mask is not None:  # a padded batch: the (B, 1, T, T) mask sdpa_mask built
            if softcap is not None:
                raise ConfigError(
                    "attn_backend",
                    "padded batches run sdpa, which has no softcap",
                    "use packed batches (PackedCollator)",
                )
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal
            )
        if s_aux is not None:
            raise ConfigError("attn_backend", "attention sinks (s_aux) are not supported by the packed backends")
        batch, _, seq, _ = query.shape
        if cu_seq_lens_q is None and key.shape[2] != seq:  # decoding with a KV cache (generate): one sequence a row
            return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling)
        if cu_seq_lens_q is None:
            cu_seq_lens_q = cu_seq_lens_k = boundaries_from_positions(position_ids, batch, seq, query.device)
            max_length_q = max_length_k = None
        elif batch != 1:
            raise ValueError(f"a packed batch has one row, got input_ids of shape ({batch}, {seq})")
        q, k, v = (x.transpose(1, 2).reshape(batch * seq, x.shape[1], x.shape[3]) for x in (query, key, value))
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
        )
        return out.reshape(batch, seq, *out.shape[1:]), None

    return attention_forward


_POSITION_CACHE: dict = {}


def boundaries_from_positions(
    position_ids: torch.Tensor | None, batch: int, seq: int, device: torch.device
) -> torch.Tensor:
    """cu_seq_lens for a batch that came without them: a row starts a sequence, and so does every position that
    does not follow its predecessor by one (transformers' own packed-sequence rule). Syncs once per forward.

    position_ids [[0 1 2 0 1 0 1 2 3]] -> cu_seq_lens [0 3 5 9]
    """
    if position_ids is None:
        return torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=device)

    def build() -> torch.Tensor:
        pos = position_ids.expand(batch, seq)
        starts = torch.ones_like(pos, dtype=torch.bool)
        starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        idx = torch.nonzero(starts.reshape(-1)).reshape(-1)
        total = torch.tensor([batch * seq], device=idx.device, dtype=idx.dtype)
        return torch.cat([idx, total]).to(device=device, dtype=torch.int32)

    return _memo(_POSITION_CACHE, position_ids, (batch, seq), build)


def _memo(store: dict, key: torch.Tensor, variant: object, build: Callable):
    """Memo keyed on one tensor's identity: every layer of one forward receives the same cu_seq_lens object, so
    whatever depends on it only (index plans, masks) is built once per forward, not once per layer."""
    ref = store.get("ref")
    if ref is None or ref() is not key:
        store.clear()
        store["ref"] = weakref.ref(key)
    if variant not in store:
        store[variant] = build()
    return store[variant]


# ----------------------------------------------------------------------------------------------------------------
# Kernels: q (total, H, D), k/v (total, Hkv, D), cu (n + 1,) -> (total, H, D)


# Where the varlen kernels report the dtype they ran in (one may run below the activations' dtype, see `_half`),
# while an `observe_kernel_dtypes` block is open in this thread; None otherwise.
_kernel_dtypes: ContextVar[list[torch.dtype] | None] = ContextVar("kernel_dtypes", default=None)


@contextlib.contextmanager
def observe_kernel_dtypes() -> Iterator[list[torch.dtype]]:
    """Within the block, collect the dtype every flash_attn / torch_varlen call computes in (the isolation
    self-test judges a packed forward by the precision its attention really ran in)."""
    seen: list[torch.dtype] = []
    token = _kernel_dtypes.set(seen)
    try:
        yield seen
    finally:
        _kernel_dtypes.reset(token)


def _report_kernel_dtype(dtype: torch.dtype) -> None:
    seen = _kernel_dtypes.get()
    if seen is not None:
        seen.append(dtype)


@cache
def _warn_cast(kernel: str, dtype: torch.dtype) -> None:
    log.warning(
        "attn_backend=%s computes in bfloat16 only: the %s activations are cast to bfloat16 for attention (and back). "
        "Train with trainer.precision=bf16-mixed, or use attn_backend=per_example / sdpa_mask for %s attention",
        kernel,
        str(dtype).removeprefix("torch."),
        str(dtype).removeprefix("torch."),
    )


def _half(x: torch.Tensor, kernel: str) -> torch.Tensor:
    """FlashAttention kernels take fp16/bf16 only; other activations (fp32 without autocast) run in bf16, with a
    one-time warning naming the dtype."""
    if x.dtype in (torch.float16, torch.bfloat16):
        _report_kernel_dtype(x.dtype)
        return x
    _warn_cast(kernel, x.dtype)
    _report_kernel_dtype(torch.bfloat16)
    return x.to(torch.bfloat16)


def _max_length(cu: torch.Tensor, given: int | None) -> int:
    return int(given) if given is not None else int((cu[1:] - cu[:-1]).max())


@cache
def _load_flash_attn_varlen_func() -> Callable:
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def _flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout):
    flash_attn_varlen_func = _load_flash_attn_varlen_func()
    kwargs = {"dropout_p": dropout, "softmax_scale": scale, "causal": causal}
    if window is not None:
        kwargs["window_size"] = (window - 1, 0 if causal else window - 1)
    if softcap is not None:
        kwargs["softcap"] = softcap
    out = flash_attn_varlen_func(
        _half(q, "flash_attn"),
        _half(k, "flash_attn"),
        _half(v, "flash_attn"),
        cu_q.to(torch.int32),
        cu_k.to(torch.int32),
        _max_length(cu_q, max_q),
        _max_length(cu_k, max_k),
        **kwargs,
    )  # GQA is native: k/v keep their Hkv heads
    return out.to(q.dtype)


@cache
def _torch_varlen_api() -> tuple[Callable, frozenset]:
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout):
    varlen_attn, params = _torch_varlen_api()
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
    kwargs = {}
    if "scale" in params:
        kwargs["scale"] = scale
    else:  # its default is 1/sqrt(D): fold any other scale into q
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
    out = varlen_attn(
        _half(q, "torch_varlen"),
        _half(k, "torch_varlen"),
        _half(v, "torch_varlen"),
        cu_q.to(torch.int32),
        cu_k.to(torch.int32),
        _max_length(cu_q, max_q),
        _max_length(cu_k, max_k),
        **kwargs,
    )
    return out.to(q.dtype)


def _same_boundaries(cu_q: torch.Tensor, cu_k: torch.Tensor) -> None:
    if cu_k is not cu_q and not torch.equal(cu_q, cu_k):
        raise ConfigError(
            "attn_backend", "per_example and sdpa_mask need cu_seq_lens_q == cu_seq_lens_k (self-attention)"
        )


def _attend(q, k, v, *, causal, scale, window, softcap, dropout, mask=None) -> torch.Tensor:
    """Attention over (m, H, L, D) batches of equal-length sequences, k/v (m, Hkv, L, D); GQA handled.

    `mask` (L, L) or (m, 1, L, L), True = attend, replaces the causal / window pattern when given.
    """
    length = q.shape[2]
    gqa = k.shape[1] != q.shape[1]
    if mask is None and window is not None and length > window:  # transformers: key within (q - window, q]
        i = torch.arange(length, device=q.device)
        dist = i[:, None] - i[None, :]
        mask = ((dist >= 0) & (dist < window)) if causal else (dist.abs() < window)
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal and mask is None, scale=scale, enable_gqa=gqa
        )
    # Softcap (Gemma 2/3) has no SDPA kernel: plain math, still per example.
    if gqa:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None and causal:
        mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, v)


_PLAN_CACHE: dict = {}


def _length_groups(cu: torch.Tensor) -> tuple[list[tuple[int, list[int], torch.Tensor | None]], torch.Tensor | None]:
    """Group the examples by length: [(L, starts, token_index (m * L,) or None when m == 1)] and the permutation
    that puts the group outputs, concatenated, back in token order (None when nothing needs moving).

    cu [0 3 5 8 10] (lengths 3 2 3 2) -> groups (3, [0, 5]), (2, [3, 8]); group order of tokens
    [0 1 2 5 6 7 | 3 4 8 9] -> inverse permutation [0 1 2 6 7 3 4 5 8 9]
    """

    def build():
        bounds = cu.tolist()
        by_length: dict[int, list[int]] = {}
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end > start:
                by_length.setdefault(end - start, []).append(start)
        groups, order = [], []
        for length, starts in by_length.items():
            index = torch.tensor(starts)[:, None] + torch.arange(length)[None, :]  # (m, L)
            order.append(index.reshape(-1))
            groups.append((length, starts, index.reshape(-1).to(cu.device) if len(starts) > 1 else None))
        perm = torch.cat(order)
        in_order = bool(torch.equal(perm, torch.arange(len(perm))))
        inverse = None if in_order else torch.argsort(perm).to(cu.device)
        return groups, inverse

    return _memo(_PLAN_CACHE, cu, "groups", build)


def _per_example(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout):
    """Exact per-example attention on any device: one SDPA call per distinct example length, cost sum(L^2)."""
    _same_boundaries(cu_q, cu_k)
    groups, inverse = _length_groups(cu_q)
    opts = {"causal": causal, "scale": scale, "window": window, "softcap": softcap, "dropout": dropout}
    outs = []
    for length, starts, index in groups:
        if index is None:  # a single example: a view, no gather
            parts = [x.narrow(0, starts[0], length).unsqueeze(0) for x in (q, k, v)]
        else:
            parts = [x.index_select(0, index).view(len(starts), length, *x.shape[1:]) for x in (q, k, v)]
        qg, kg, vg = (x.transpose(1, 2) for x in parts)  # (m, H, L, D)
        outs.append(_attend(qg, kg, vg, **opts).transpose(1, 2).reshape(-1, *q.shape[1:]))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out if inverse is None else out.index_select(0, inverse)


_MASK_CACHE: dict = {}


def _sdpa_block_mask(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout):
    """The reference: one SDPA call over all T tokens with a dense (T, T) block-diagonal mask. Cost T^2."""
    _same_boundaries(cu_q, cu_k)
    total = q.shape[0]

    def build() -> torch.Tensor:
        lengths = (cu_q[1:] - cu_q[:-1]).long()
        seq = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths, output_size=total)
        i = torch.arange(total, device=q.device)
        mask = seq[:, None] == seq[None, :]
        if causal:
            mask &= i[:, None] >= i[None, :]
        if window is not None:
            mask &= (i[:, None] - i[None, :]).abs() < window
        return mask  # (T, T) bool

    mask = _memo(_MASK_CACHE, cu_q, (causal, window), build)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, H, T, D)
    out = _attend(qh, kh, vh, causal=causal, scale=scale, window=window, softcap=softcap, dropout=dropout, mask=mask)
    return out[0].transpose(0, 1)
