"""Choosing the attention backend of a packed model: the fastest that runs on the device and gives the model what
it needs (sinks, softcap, windows, dropout), or a one-line refusal naming why.

    backend = resolve_backend("auto", "cuda", needs)    # flash_attn > torch_varlen > per_example

`lit_packing.models.pack.pack_model` resolves once for the host the model is built on, and once more for the
trainer's device (`Packing.to_device`); nothing else resolves a backend.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from functools import cache
from typing import Literal

import torch

from lit_packing.errors import ConfigError
from lit_packing.models.kernels import compute_dtype, flash_attn_status, load_kernel

log = logging.getLogger(__name__)

AttnBackend = Literal["auto", "flash_attn", "torch_varlen", "per_example", "sdpa_mask"]
BACKENDS = ("flash_attn", "torch_varlen", "per_example", "sdpa_mask")


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
    attention function (what `probe.probe_packing` returns)."""
    config = model.config.get_text_config()
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
    if needs.sliding_window and "window_size" not in load_kernel("torch_varlen")[1]:
        return f"this torch's varlen_attn has no sliding window (torch {torch.__version__})"
    return None


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
    check_backend(backend, device)
    refusal = kernel_refusal(backend, needs)
    if refusal is not None:
        raise ConfigError(
            "attn_backend",
            f"{needs.model} cannot run on attn_backend={backend}: {refusal}",
            "set {attn_backend}=auto (picks a backend that can), flash_attn or per_example",
        )
    return backend


def check_backend(backend: AttnBackend, device: torch.device | str) -> None:
    """Raise unless `backend` (a name, or `auto`) can run on `device` here: the device, the packages, the GPU. What
    the model needs is `resolve_backend`'s to check; this is what can be known before the model loads.

    Raises:
        ConfigError: naming the fix.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    if backend == "auto":
        return
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
    varlen_attn = load_kernel("torch_varlen")[0]
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


def activation_dtype(model: torch.nn.Module, precision: str) -> torch.dtype:
    """The dtype attention sees: the autocast dtype of a mixed precision, else the parameters'."""
    if precision.startswith("bf16-mixed"):
        return torch.bfloat16
    if precision.startswith("16-mixed"):
        return torch.float16
    return next(model.parameters()).dtype
