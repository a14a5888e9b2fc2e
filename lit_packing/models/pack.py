"""The one way to make a transformers causal LM train on packed rows: `pack_model`.

    packing = pack_model(model, backend="auto", device="cuda")   # changes `model` in place, returns what it found
    packing.to_device(model, trainer_device)                     # the backend once more, where it trains

What it does, in order: refuses a model whose attention does not go through transformers' `AttentionInterface`;
chooses a route for each non-attention token mixer (its packed kernels where installed, else per example:
`mixers.py`); runs the construction probe (`probe.py`), which checks on the model's device that packed examples
stay apart in every layer and records what the layers hand attention (a kernel route the probe finds inexact falls
back to per example); chooses the attention backend for the model's needs on `device` (`backends.py`) and sets it;
admits the model's attention modules, so that its packed rows run (a model that skipped this is refused on its
first packed forward: `attention.refuse_unpacked`). Everything that cannot pack is refused in one line naming the
module or keyword and the fix. `PackedCausalLM`, `load_causal_lm`, the core recipes and the benchmarks all build
their packed models here.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from lit_packing._compat import attn_implementation_of, can_set_attn_implementation
from lit_packing.batch import KEY_INDEX
from lit_packing.errors import ConfigError
from lit_packing.models.attention import admit, attn_implementation
from lit_packing.models.backends import (
    AttentionNeeds,
    AttnBackend,
    attention_needs,
    available_backends,
    check_backend,
    precision_note,
    resolve_backend,
    select_varlen_impl,
)
from lit_packing.models.head import check_liger
from lit_packing.models.mixers import (
    MixerChoice,
    MixerRoute,
    describe_routes,
    fall_back,
    keep_mixers_apart,
    kernel_unavailable,
)
from lit_packing.models.probe import Probe, probe_packing
from lit_packing.models.selftest import PADDED_FIX

log = logging.getLogger(__name__)

HOST_BACKENDS = ("per_example", "sdpa_mask")  # the backends that run on any device


@dataclass
class Packing:
    """What `pack_model` found and chose for one model.

    Attributes:
        requested: the backend asked for (`auto` or a name), resolved again by `to_device`.
        backend: the backend the model's attention runs now.
        device: the device `backend` was resolved for.
        needs: what the model asks of attention (softcap, sinks, windows, ...).
        keywords: what its layers hand the attention function (the probe's record).
        keyed: every attention layer hands on `key_index` and the context group (shared prompts and context
            parallelism need both; the probe's record).
        mixers: each non-attention token mixer's route and why (empty for an attention-only model).
        mixer_choice: the routes asked for (`auto`, `kernel`, `per_example`), decided again by `route_mixers`.
    """

    requested: str
    backend: str
    device: torch.device
    needs: AttentionNeeds
    keywords: frozenset[str] = frozenset()
    keyed: bool = False
    mixers: list[MixerRoute] = field(default_factory=list)
    mixer_choice: MixerChoice = "auto"

    def to_device(self, model: torch.nn.Module, device: torch.device | str) -> str:
        """Resolve the requested backend for `device` (the trainer's) and set it. Returns the backend."""
        device = torch.device(device)
        self.backend = _resolve(self.requested, device, self.needs)
        self.device = device
        _base(model).set_attn_implementation(attn_implementation(self.backend))
        return self.backend

    def place(
        self, model: torch.nn.Module, device: torch.device, auto: bool, varlen_impl: str, dtype: torch.dtype,
        loss_impl: str,
    ) -> None:  # fmt: skip
        """`to_device`, said in one line (the backend, `auto` when it was chosen, the FlashAttention implementation
        torch_varlen runs), with the precision note of the backend at the activations' `dtype`; a liger loss is
        checked for the device."""
        self.to_device(model, device)
        how = " (auto)" if auto else ""
        if self.backend == "torch_varlen":
            how += f", {select_varlen_impl(varlen_impl, device)}"
        log.info("attention backend: %s%s on %s", self.backend, how, device)
        note = precision_note(self.backend, dtype)
        if note:
            log.warning(note)
        if loss_impl == "liger":
            check_liger(device, _base(model).get_output_embeddings())

    def on_host(self, model: torch.nn.Module) -> None:
        """Run the exact per_example backend where the model is now (the host it was built on, for a GPU it will
        train on) until `to_device` sets the chosen one there: a forward on the host never calls a GPU kernel."""
        hf = _base(model)
        if hf.device.type != self.device.type and self.backend not in HOST_BACKENDS:
            self.backend, self.device = "per_example", hf.device
            hf.set_attn_implementation(attn_implementation(self.backend))

    def route_mixers(self, model: torch.nn.Module) -> list[MixerRoute]:
        """Re-decide the mixers' routes where the model is now (after it moved to its device): where their packed
        kernels can run there, the probe decides on that device; elsewhere nothing runs."""
        hf = _base(model)
        if self.mixer_choice == "per_example" or not any(
            kernel_unavailable(hf.get_submodule(route.name), hf.device) is None for route in self.mixers
        ):
            return self.mixers
        backend = attn_implementation_of(hf)
        probe, self.mixers = _probe_routes(hf, hf.device, self.mixer_choice, check=True)
        hf.set_attn_implementation(backend)
        admit(probe.attention)
        log.info(describe_routes(self.mixers))
        return self.mixers


def pack_model(
    model: torch.nn.Module,
    backend: AttnBackend = "auto",
    device: torch.device | str | None = None,
    mixers: MixerChoice = "auto",
    check: bool = True,
) -> Packing:
    """Make `model` (a transformers causal LM, or a peft model around one) keep packed examples apart in every
    layer, in place; return what was found and chosen.

    Args:
        model: the model, on the device it is built on (where the probe runs).
        backend: auto | flash_attn | torch_varlen | per_example | sdpa_mask: the attention backend, resolved for
            `device` and the model's needs (`auto`: the fastest that can run it).
        device: where the model will run (default: where it is); the backend is chosen and checked for it. A model
            built on the host for a GPU runs the GPU's backend once it is moved there (`Packing.to_device` resolves
            again for another device).
        mixers: auto | kernel | per_example: the route of non-attention token mixers (`mixers.py`); `kernel`
            refuses a mixer whose packed kernels are missing or inexact on this device.
        check: compare the probe's packed logits with each example run alone (the construction-time check).

    Raises:
        ConfigError: the model cannot be packed (naming the module or keyword), or the backend cannot run it on
            `device` (naming the backends that can).
    """
    hf = _base(model)
    here = hf.device
    device = torch.device(device) if device is not None else here
    check_packing_support(hf)
    vision = getattr(hf.config, "vision_config", None) is not None
    if vision:  # a vision-language model: refused here, before the probe, unless the families table proves it
        from lit_packing.models.vlm import exact_family  # vlm imports pack: imported here, not at the top

        exact_family(hf.config)
    probe, routes = _probe_routes(hf, here, mixers, check)
    needs = attention_needs(hf, probe.keywords)
    chosen = _resolve(backend, device, needs)
    hf.set_attn_implementation(attn_implementation(chosen))
    admit(probe.attention)
    if vision:  # the vision tower keeps its images' bounds, never the documents'
        from lit_packing.models.vlm import keep_tower_apart

        keep_tower_apart(hf)
    if not probe.keyed:
        _refuse_key_index(hf)
    if routes:
        log.info(describe_routes(routes))
    return Packing(backend, chosen, device, needs, probe.keywords, probe.keyed, routes, mixers)


def _probe_routes(hf: PreTrainedModel, device: torch.device, choice: MixerChoice, check: bool):
    """Route the mixers for `device`, then probe (`confirm_routes`). Returns the probe's record and the routes."""
    routes = keep_mixers_apart(hf, device, choice)
    return confirm_routes(hf, routes, device, choice, check), routes


def confirm_routes(
    hf: PreTrainedModel,
    routes: list[MixerRoute],
    device: torch.device,
    choice: MixerChoice = "auto",
    check: bool = True,
) -> Probe:
    """Run the construction probe over the routed mixers; a kernel route the probe refuses (its packed forward
    raises or leaks on this device) falls back per example and the probe runs again, or, with `choice=kernel`,
    is refused in one line. Returns the probe's record."""
    if choice == "kernel" and (slow := [r for r in routes if r.route != "kernel"]):
        raise ConfigError(
            "mixers",
            f"{slow[0].name} ({slow[0].kind}) cannot take the kernel route on {device}: {slow[0].why}",
            "install its kernels' packages, or set {mixers}=auto (per example where they are missing)",
        )
    try:
        return probe_packing(hf, check=check)
    except ConfigError as error:
        if not any(r.route == "kernel" for r in routes):
            raise
        if choice == "kernel":
            raise ConfigError("mixers", f"the kernel route is not exact on {device}: {error.problem}",
                              "set {mixers}=auto") from None  # fmt: skip
        fall_back(routes, f"its packed kernels were not exact on {device}: {error.problem[:300]}")
        return probe_packing(hf, check=check)


# Models whose attention layers drop `key_index` (the probe's `keyed`), hooked once to refuse a batch that brings it.
_UNKEYED: weakref.WeakSet = weakref.WeakSet()


def _refuse_key_index(hf: PreTrainedModel) -> None:
    """A model whose attention layers do not hand `key_index` on refuses, before its forward and in one line, a
    batch of shared prompts: its continuations would attend their own keys with boundaries counting the prompt's."""
    if hf in _UNKEYED:
        return
    _UNKEYED.add(hf)

    def refuse(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if kwargs.get(KEY_INDEX) is not None:
            raise ConfigError("data.collator.init_args.share_prompt", f"{type(module).__name__}'s attention layers do "
                              "not hand key_index (each continuation's prompt keys) to the attention function",
                              "set {share_prompt}=false for this model")  # fmt: skip

    hf.register_forward_pre_hook(refuse, with_kwargs=True)


def check_packing_support(lm: PreTrainedModel) -> None:
    """Raise unless the model's attention goes through transformers' AttentionInterface (the only place packed
    boundaries can be honoured)."""
    if not can_set_attn_implementation(lm):
        where = next(
            (f" ({name}, {type(m).__name__})" for name, m in lm.named_modules() if "Attention" in type(m).__name__), ""
        )
        raise ConfigError(
            "model.name_or_path",
            f"{type(lm).__name__} ({lm.config.model_type}) does not route attention{where} through transformers' "
            "AttentionInterface, so packed examples cannot be kept apart",
            f"choose a model that does (the families table in docs/model.md), {PADDED_FIX}",
        )


def check_backend_here(backend: str, device: torch.device | str) -> None:
    """`check_backend` (what can be known before a model loads), its refusal naming the backends that run here."""
    try:
        check_backend(backend, device)
    except ConfigError as error:
        raise _naming_usable(error, torch.device(device), None) from None


def _resolve(backend: str, device: torch.device, needs: AttentionNeeds) -> str:
    """`resolve_backend`, its refusal naming the backends this device can run for this model."""
    try:
        return resolve_backend(backend, device, needs)
    except ConfigError as error:
        raise _naming_usable(error, device, needs) from None


def _naming_usable(error: ConfigError, device: torch.device, needs: AttentionNeeds | None) -> ConfigError:
    usable = ", ".join(available_backends(device, needs))
    return ConfigError(error.setting, error.problem, f"{error.fix}; on {device} these run: auto, {usable}", error.paths)


def _base(model: torch.nn.Module) -> PreTrainedModel:
    return model.get_base_model() if hasattr(model, "get_base_model") else model
