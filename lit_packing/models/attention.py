"""Varlen attention backends for packed batches, plugged into transformers through `AttentionInterface`.

    model.set_attn_implementation(attn_implementation(resolve_backend("auto", device)))

A packed batch is one row of T tokens holding n examples; `cu_seq_lens_q = [0, L1, L1+L2, ..., T]` (int32) and
`max_length_q` tell every backend where the examples start, so each token attends only inside its own example:

    lengths 4, 8, 5, 11 -> cu_seq_lens = [0, 4, 12, 17, 28], max_length = 11, attention cost sum(L^2) = 226
    (a dense block-diagonal mask would cost T^2 = 784 and a padded batch 4 * 11^2 = 484)

Backends (all exact; registered under the names in `HF_NAMES`):
    flash_attn    `flash_attn_varlen_func` from the flash-attn package (CUDA; `pip install -e ".[flash]"`)
    torch_varlen  `torch.nn.attention.varlen.varlen_attn`, PyTorch's built-in FlashAttention (CUDA, torch >= 2.10;
                  FA2, or FA3 / FA4 where installed: `select_varlen_impl`)
    per_example    per-example SDPA on any device, one batched call per distinct length: cost sum(L^2), not T^2
    sdpa_mask     SDPA with a dense (T, T) block-diagonal causal mask: the slow reference

Each implementation is also registered in `AttentionMaskInterface`: it returns no mask for packed rows (so
transformers never builds a T x T mask) and sdpa's usual mask when a padded batch brings a 2D `attention_mask`,
in which case the layer runs plain sdpa. Without `cu_seq_lens_*` the boundaries come from `position_ids` (a new
example wherever positions do not increase by one), so a backend never silently attends across examples.

This is the only module that imports flash_attn.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class AttentionNeeds:
    """What a model asks of its attention kernel, read from its config (`attention_needs`): a backend that cannot
    give it is never chosen by `auto`, and is refused by name when asked for."""

    model: str = "this model"
    softcap: bool = False  # attention logit soft-capping (Gemma 2/3)
    dropout: bool = False  # attention dropout while training
    sliding_window: bool = False
    sinks: bool = False  # attention sinks: one more logit per head (gpt-oss `s_aux`) or per query (`sinks`)
    position_bias: bool = False  # an additive (B, H, T, T) score bias (relative positions)


def attention_needs(model: torch.nn.Module, keywords: frozenset[str] = frozenset()) -> AttentionNeeds:
    """What `model` asks of attention: from its config, and from the `keywords` its layers were seen to pass the
    attention function (`lit_packing.models.probe`, which records them on the model at construction)."""
    config = model.config.get_text_config()
    keywords = keywords or getattr(model, "_lit_packing_attention_keywords", frozenset())
    return AttentionNeeds(
        model=type(model).__name__,
        softcap=bool(getattr(config, "attn_logit_softcapping", None)) or "softcap" in keywords,
        dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0,
        sliding_window=getattr(config, "sliding_window", None) is not None,
        sinks=bool(keywords & {"s_aux", "sinks"}),
        position_bias="position_bias" in keywords,
    )


def kernel_refusal(backend: str, needs: AttentionNeeds) -> str | None:
    """Why `backend`'s kernel cannot run a model with these needs, or None."""
    if backend in ("flash_attn", "torch_varlen") and (needs.sinks or needs.position_bias):
        return f"{backend} has no {'attention sinks' if needs.sinks else 'position bias'}"
    if backend != "torch_varlen":
        return None  # flash_attn takes softcap, dropout and windows; the per-example backends take everything
    if needs.softcap:
        return "torch_varlen has no softcap"
    if needs.dropout:
        return "torch_varlen has no attention dropout"
    if needs.sliding_window and "window_size" not in _load_kernel("torch_varlen")[1]:
        return f"this torch's varlen_attn has no sliding window (torch {torch.__version__})"
    return None


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


def torch_varlen_available(device: torch.device | str) -> bool:
    """PyTorch's built-in varlen FlashAttention-2: CUDA only, compute capability >= 8.0."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def resolve_backend(backend: AttnBackend, device: torch.device | str, needs: AttentionNeeds | None = None) -> str:
    """Turn `auto` into the fastest backend that runs on `device` and gives the model what it `needs`
    (flash_attn > torch_varlen > per_example); check the others.

    Raises:
        ConfigError: the backend cannot run on this device, is not installed, or cannot run the model; the message
            names the fix.
    """
    device = torch.device(device)
    needs = needs or AttentionNeeds()
    cuda = device.type == "cuda"
    if backend == "auto":
        for candidate in ("flash_attn", "torch_varlen"):
            usable = flash_attn_installed() if candidate == "flash_attn" else torch_varlen_available(device)
            if cuda and usable and kernel_refusal(candidate, needs) is None:
                return candidate
        if cuda:
            _explain_auto(device, needs)
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
        usable, why = flash_attn_status()
        if not usable:
            raise ConfigError(
                "attn_backend",
                f"flash_attn needs the flash-attn package's varlen kernel: {why}",
                'from the repository, `pip install -e ".[flash]"` (compiles against your CUDA toolkit and torch), or '
                "set {attn_backend}=auto (PyTorch's built-in torch_varlen on this GPU)",
            )
    if backend == "torch_varlen" and not torch_varlen_available(device):
        raise ConfigError(
            "attn_backend",
            f"torch_varlen needs torch >= 2.10 and a CUDA GPU with compute capability >= 8.0 (device {device}, "
            f"torch {torch.__version__})",
            "set {attn_backend}=auto or per_example",
        )
    refusal = kernel_refusal(backend, needs)
    if refusal is not None:
        raise ConfigError(
            "attn_backend",
            f"{needs.model} cannot run on attn_backend={backend}: {refusal}",
            "set {attn_backend}=auto (picks a backend that can), flash_attn or per_example",
        )
    return backend


@cache
def _explain_auto(device: torch.device, needs: AttentionNeeds) -> None:
    """Say once why `auto` on a GPU falls back to the per-example backend (resolution time, never traced code)."""
    reasons = [flash_attn_status()[1]]
    if not torch_varlen_available(device):
        reasons.append(f"torch_varlen needs torch >= 2.10 and compute capability >= 8.0 (torch {torch.__version__})")
    elif (refusal := kernel_refusal("torch_varlen", needs)) is not None:  # only where torch_varlen exists
        reasons.append(f"{refusal} ({needs.model})")
    log.info("attn_backend=auto on %s: per_example, exact but slower than a varlen kernel (%s)", device,
             "; ".join(reasons))  # fmt: skip


VarlenImpl = Literal["auto", "FA2", "FA3", "FA4"]
# Which FlashAttention implementation may run torch_varlen's kernels, by compute capability, newest first.
_NEWER_IMPLS = {9: ("FA3", "FA4"), 10: ("FA4",)}


def select_varlen_impl(impl: VarlenImpl, device: torch.device | str) -> str:
    """Make torch_varlen run FlashAttention `impl` (PyTorch >= 2.12 can swap its FA2 kernels for FA3 / FA4 when
    their packages are installed: `torch.nn.attention.activate_flash_attention_impl`); return the one in use.

    `auto`: the newest that loads on this GPU (FA3 or FA4 on Hopper, FA4 on Blackwell), else PyTorch's FA2.

    Raises:
        ConfigError: `impl` was asked for and cannot run here; the message says why.
    """
    from torch.nn import attention as nn_attention

    if impl not in ("auto", "FA2", "FA3", "FA4"):
        raise ConfigError("varlen_impl", f"unknown implementation {impl!r}", "choose one of auto, FA2, FA3, FA4")
    activate = getattr(nn_attention, "activate_flash_attention_impl", None)
    if impl != "FA2" and activate is not None:
        major = torch.cuda.get_device_capability(device)[0]
        reasons = []
        for name in (impl,) if impl != "auto" else _NEWER_IMPLS.get(major, ()):
            try:
                activate(name)
                _trial_call(device)  # registered is not runnable: one tiny call on this GPU decides
                return name
            except Exception as error:  # its package is missing, does not load, or refuses this GPU
                if nn_attention.current_flash_attention_impl() is not None:
                    nn_attention.restore_flash_attention_impl()
                detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                reasons.append(f"{name}: {detail}")
        if impl != "auto":
            raise ConfigError("varlen_impl", f"torch_varlen cannot run {impl} here ({'; '.join(reasons)})",
                              "install its package, or set {varlen_impl}=auto (FA2, built into PyTorch)")  # fmt: skip
    elif impl not in ("auto", "FA2"):
        raise ConfigError("varlen_impl", f"{impl} needs torch >= 2.12 (this is {torch.__version__})",
                          "set {varlen_impl}=auto or FA2")  # fmt: skip
    if activate is not None and nn_attention.current_flash_attention_impl() is not None:
        nn_attention.restore_flash_attention_impl()
    return "FA2"


def _trial_call(device: torch.device | str) -> None:
    """One causal bf16 varlen call of two sequences, forward and backward, through what `torch_varlen` runs."""
    varlen_attn = _load_kernel("torch_varlen")[0]
    q, k, v = (torch.randn(8, 2, 64, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 3, 8], device=device, dtype=torch.int32)
    varlen_attn(q, k, v, cu, cu, 5, 5, window_size=(-1, 0)).sum().backward()


def available_backends(device: torch.device | str, needs: AttentionNeeds | None = None) -> list[str]:
    """The backends that can run on `device` here, fastest first (e.g. `["per_example", "sdpa_mask"]` on a CPU)."""
    usable = []
    for backend in BACKENDS:
        try:
            usable.append(resolve_backend(backend, device, needs))
        except ValueError:
            continue
    return usable


def attn_implementation(backend: str) -> str:
    """The transformers `attn_implementation` name of a (resolved) backend, registered on first use."""
    if backend not in HF_NAMES:
        raise ValueError(f"{backend!r} is not a resolved backend: use resolve_backend() first")
    register_backends()
    if backend in HALF_ONLY:
        _load_kernel(backend)
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


# What the packed backends do with each keyword a model's layers hand the attention function: honoured, or
# without effect on the result. Anything else is refused at construction (`isolation.probe_packing`).
HONOURED_KEYWORDS = frozenset({
    "attention_mask", "dropout", "scaling", "sliding_window", "softcap", "is_causal", "position_ids",
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "s_aux", "sinks", "position_bias",
})  # fmt: skip
INERT_KEYWORDS = frozenset({
    "use_cache", "output_attentions", "output_router_logits", "output_hidden_states", "return_dict",
    "cache_position", "layer_idx", "past_key_values", "cache", "position_embeddings",
})  # fmt: skip
PROBE_NAME = "packed_probe"


def register_probe(seen: set[str]) -> str:
    """Register the per_example backend under `PROBE_NAME`, adding to `seen` every keyword it is handed with a
    value (and `PROBE_NAME` itself once it is called); return the name."""
    forward = _attention_forward(_per_example)

    def probe(*args, **kwargs):
        seen.add(PROBE_NAME)
        seen.update(key for key, value in kwargs.items() if value is not None)
        return forward(*args, **kwargs)

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
        sinks: torch.Tensor | None = None,
        position_bias: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        batch, heads, seq, _ = query.shape
        sink = _sink_logits(s_aux, sinks, batch, heads, seq)  # (B, H, T) or None
        if attention_mask is not None:  # a padded batch: the (B, 1, T, T) mask sdpa_mask built
            if softcap is None and sink is None and position_bias is None:
                return sdpa_attention_forward(
                    module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal
                )
            out = _attend(
                query, key, value, causal=False, scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
                window=None, softcap=softcap, dropout=dropout, mask=attention_mask.bool(), sink=sink,
                bias=position_bias,
            )  # fmt: skip
            return out.transpose(1, 2), None
        if cu_seq_lens_q is None and key.shape[2] != seq:  # decoding with a KV cache (generate): one sequence a row
            return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling)
        if cu_seq_lens_q is None:
            cu_seq_lens_q = cu_seq_lens_k = boundaries_from_positions(position_ids, batch, seq, query.device)
            max_length_q = max_length_k = None
        elif batch != 1:
            raise ValueError(f"a packed batch has one row, got input_ids of shape ({batch}, {seq})")
        q, k, v = (x.transpose(1, 2).reshape(batch * seq, x.shape[1], x.shape[3]) for x in (query, key, value))
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


# The kernels that compute in fp16 / bf16 only (FlashAttention); the per-example backends take any dtype.
HALF_ONLY = ("flash_attn", "torch_varlen")
_HALF = (torch.float16, torch.bfloat16)


def compute_dtype(backend: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype `backend`'s attention computes in when the layer's activations are `dtype` (the autocast dtype
    under autocast): FlashAttention kernels run other dtypes (fp32 without autocast) in bfloat16."""
    return torch.bfloat16 if backend in HALF_ONLY and dtype not in _HALF else dtype


def precision_note(backend: str, dtype: torch.dtype) -> str | None:
    """What to tell a run whose attention computes below its activations' `dtype` (said once, at setup)."""
    if compute_dtype(backend, dtype) == dtype:
        return None
    name = str(dtype).removeprefix("torch.")
    return (
        f"attn_backend={backend} computes in bfloat16 only: the {name} activations are cast to bfloat16 for attention "
        f"(and back). Train with trainer.precision=bf16-mixed, or use attn_backend=per_example / sdpa_mask for {name} "
        "attention"
    )


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


def _load_kernel(backend: str) -> tuple[Callable, frozenset]:
    if backend not in _LOADED:
        if backend == "flash_attn":
            from flash_attn import flash_attn_varlen_func as fn
        else:
            from torch.nn.attention.varlen import varlen_attn as fn
        _LOADED[backend] = fn, frozenset(inspect.signature(fn).parameters)
    return _LOADED[backend]


def _flash_attn_varlen(
    q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout, sink=None, bias=None
):
    _refuse_extras("flash_attn", sink, bias)
    flash_attn_varlen_func = (_LOADED.get("flash_attn") or _load_kernel("flash_attn"))[0]
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


def _torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout, sink=None, bias=None):
    _refuse_extras("torch_varlen", sink, bias)
    varlen_attn, params = _LOADED.get("torch_varlen") or _load_kernel("torch_varlen")
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


def _same_boundaries(cu_q: torch.Tensor, cu_k: torch.Tensor) -> None:
    if cu_k is not cu_q and not torch.equal(cu_q, cu_k):
        raise ConfigError(
            "attn_backend", "per_example and sdpa_mask need cu_seq_lens_q == cu_seq_lens_k (self-attention)"
        )


def _attend(q, k, v, *, causal, scale, window, softcap, dropout, mask=None, sink=None, bias=None) -> torch.Tensor:
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


_PLAN_CACHE: dict = {}


def length_groups(cu: torch.Tensor) -> tuple[list[tuple[int, list[int], torch.Tensor | None]], torch.Tensor | None]:
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


def _per_example(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout, sink=None, bias=None):
    """Exact per-example attention on any device: one SDPA call per distinct example length, cost sum(L^2)."""
    _same_boundaries(cu_q, cu_k)
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
        outs.append(_attend(qg, kg, vg, **opts).transpose(1, 2).reshape(-1, *q.shape[1:]))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out if inverse is None else out.index_select(0, inverse)


def _bias_blocks(bias: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The (m, H, L, L) diagonal blocks of a (B, H, T, T) score bias for examples at flat token `rows` (m, L)."""
    seq = bias.shape[2]
    row, pos = rows // seq, rows % seq
    blocks = bias[row[:, :, None], :, pos[:, :, None], pos[:, None, :]]  # (m, L, L, H)
    return blocks.permute(0, 3, 1, 2)


_MASK_CACHE: dict = {}


def _sdpa_block_mask(
    q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout, sink=None, bias=None
):
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
    extras = {}
    if sink is not None:
        extras["sink"] = sink.transpose(0, 1).unsqueeze(0)  # (1, H, T)
    if bias is not None:
        extras["bias"] = _bias_blocks(bias, torch.arange(total, device=q.device)[None])
    out = _attend(
        qh, kh, vh, causal=causal, scale=scale, window=window, softcap=softcap, dropout=dropout, mask=mask, **extras
    )
    return out[0].transpose(0, 1)
