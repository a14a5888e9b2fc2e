"""Token mixers other than attention, kept apart in packed rows: state-space scans (Mamba 1/2), gated delta rules,
linear and lightning attention, short convolutions, recurrent units, xLSTM.

    routes = keep_mixers_apart(model, device)   # once, after the model is built (`pack_model` calls it)

A packed row holds n examples in one (1, T) sequence. Softmax attention keeps them apart through `cu_seq_lens`
(`attention.py`); a recurrence or a causal convolution does not: its state and its window run straight across
every boundary unless its kernel is given the boundaries, and transformers' PyTorch paths take none (they refuse
`seq_idx` / `cu_seqlens` outright).

Each mixer takes one of two routes, chosen per mixer and said in the start-up line:
- `kernel`: where transformers' own packed kernels for it are installed and run on the model's device
  (causal-conv1d and mamba-ssm take `seq_idx`, flash-linear-attention's gated-delta kernels `cu_seqlens`), the
  whole row goes through the module once with the boundaries handed to those kernels. Kept only when the
  construction probe finds the packed forward exact on that device (`pack_model`); otherwise the mixer falls back
  to `per_example`, and the line says why.
- `per_example`: the row's hidden states are split at the boundaries, examples of one length go through the module
  as one (m, L, D) batch, and the outputs are put back in token order. Every example then starts from a zero state
  and an empty window, as it does alone; the cost stays linear in the real tokens (one call per distinct length).

The boundaries reach the modules even where a model's forward drops the packing kwargs on the way down: a pre-hook
on the whole model reads them from its inputs (`cu_seq_lens_q`, else restarting `position_ids`) and the mixers read
the latest ones, which also serve the recomputation of a gradient-checkpointed layer in the backward pass.

Which modules are mixers: those whose class names say so (`MIXER_CLASS`; the outermost one inside a decoder layer).
A mixer this rule misses still cannot leak unseen: the probe and the isolation self-test compare the packed forward
with each example alone and name the module whose output differs (`selftest.find_leak`).
"""

from __future__ import annotations

import functools
import inspect
import re
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from lit_packing._compat import mixer_kernels
from lit_packing.batch import (
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    KEY_INDEX,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    POSITION_IDS,
    SEQ_IDX,
)
from lit_packing.errors import ConfigError
from lit_packing.models.segments import boundaries_from_positions, length_groups, seq_idx
from lit_packing.text import count

# Class names of the non-attention token mixers of transformers' decoder families (Mamba, Mamba 2 and their hybrids
# Bamba, Jamba, Falcon-H1, Granite 4.0-H, Nemotron-H, Zamba 1/2; gated delta nets of Qwen3-Next, Qwen3.5, OLMo hybrid;
# Kimi and Bailing delta attention; MiniMax lightning attention; LFM short convolutions; RecurrentGemma's RG-LRU;
# xLSTM's mLSTM; ZAYA's convolutional q/k/v projection). A decoder layer holding one is never itself one.
MIXER_CLASS = re.compile(
    r"Mamba\d?Mixer|MambaLayer|Mixer$|GatedDeltaNet|DeltaAttention|LightningAttention|ShortConv|ShortConvolution"
    r"|RecurrentBlock|xLSTMLayer|CCAProjection"
)
_NOT_A_MIXER = re.compile(r"DecoderLayer|MoE|MLP|Model$")

# Keyword arguments that carry packing boundaries. A mixer called on whole examples takes none of them; the
# PyTorch paths of transformers' mixers refuse them.
_PACKING_KWARGS = frozenset({CU_SEQ_LENS_Q, CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K, SEQ_IDX, "cu_seqlens"})
# The pip names of the kernels' packages, as the start-up line and the fixes say them.
DISTRIBUTIONS = {"causal_conv1d": "causal-conv1d", "mamba_ssm": "mamba-ssm", "fla": "flash-linear-attention"}

Route = Literal["kernel", "per_example"]
MixerChoice = Literal["auto", "kernel", "per_example"]


@dataclass
class MixerRoute:
    """How one mixer runs packed rows, and why (`route` can change once: a kernel route the probe finds inexact
    falls back to `per_example`)."""

    name: str  # qualified name, e.g. `model.layers.0.mamba`
    kind: str  # class name, e.g. `BambaMixer`
    route: Route
    why: str


def find_mixers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The (qualified name, module) of every non-attention token mixer of `model`, outermost first; none for a
    model of attention layers only.

    >>> [name for name, _ in find_mixers(bamba)][:2]   # doctest: +SKIP
    ['model.layers.0.mamba', 'model.layers.1.mamba']
    """
    found: list[tuple[str, torch.nn.Module]] = []
    inside: set[str] = set()
    for name, module in model.named_modules():
        cls = type(module).__name__
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        if MIXER_CLASS.search(cls) and not _NOT_A_MIXER.search(cls):
            found.append((name, module))
            inside.add(name)
    return found


def kernel_unavailable(module: torch.nn.Module, device: torch.device | str) -> str | None:
    """Why `module` cannot take the kernel route on `device` (None: its packed kernels are installed and the
    device is a GPU, so the probe decides)."""
    kernels = mixer_kernels(module)
    if not kernels:
        return "transformers has no packed kernel for it"
    packages = ", ".join(sorted({DISTRIBUTIONS.get(k.package, k.package) for k in kernels}))
    if torch.device(device).type != "cuda":
        return f"its packed kernels ({packages}) run on CUDA, not on {torch.device(device).type}"
    missing = sorted({DISTRIBUTIONS.get(k.package, k.package) for k in kernels if not k.installed})
    if missing:
        return f"{', '.join(missing)} not installed"
    return None


@dataclass
class _Boundaries:
    """The latest packed boundaries the model was called with (None: the batch is not packed)."""

    cu: torch.Tensor | None = None
    tokens: int = 0
    routes: list[MixerRoute] = field(default_factory=list)
    inside: bool = False  # within the whole model's forward, whose arguments set the boundaries


def keep_mixers_apart(
    model: torch.nn.Module, device: torch.device | str = "cpu", choice: MixerChoice = "auto"
) -> list[MixerRoute]:
    """Make every non-attention token mixer of a transformers `model` keep packed examples apart; return how each
    does (empty: nothing to do, the model is left as it is). Idempotent: a second call re-decides the routes for
    `device` (the trainer's, after the host's).

    `choice`: `auto` takes the kernel route wherever it is available on `device` (the probe then confirms it),
    `per_example` never, `kernel` everywhere it can (`pack_model` refuses a mixer that cannot).
    """
    state = getattr(model, "_lit_packing_mixers", None)
    if state is None:
        mixers = find_mixers(model)
        state = _Boundaries(routes=[MixerRoute(name, type(m).__name__, "per_example", "") for name, m in mixers])
        if not mixers:
            return state.routes
        # Read from the whole model's arguments (a state-space decoder is not handed the positions), and from the
        # decoder's when it is called alone, as the memory-lean head does: with the whole model's only, the mixers
        # ran the head's row as one sequence, or on the previous batch's boundaries.
        model.register_forward_pre_hook(_read_boundaries(state, outer=True), with_kwargs=True)
        model.register_forward_hook(_leave(state), always_call=True)
        if model.base_model is not model:
            model.base_model.register_forward_pre_hook(_read_boundaries(state, outer=False), with_kwargs=True)
        for (_, module), route in zip(mixers, state.routes):
            # bound to the module (a deep copy of the model rebinds it to the copy); `state` is shared with the hook
            module.forward = types.MethodType(_route(type(module).forward, state, route), module)
        model._lit_packing_mixers = state
    for route in state.routes:
        why = kernel_unavailable(model.get_submodule(route.name), device)
        if choice == "per_example":
            route.route, route.why = "per_example", "mixers=per_example"
        elif why is None:
            route.route, route.why = "kernel", "its packed kernels, exact in the probe"
        else:
            route.route, route.why = "per_example", why
    return state.routes


def fall_back(routes: list[MixerRoute], why: str) -> list[MixerRoute]:
    """Send every kernel-route mixer per example, saying `why`; return those that moved."""
    moved = [route for route in routes if route.route == "kernel"]
    for route in moved:
        route.route, route.why = "per_example", why
    return moved


def describe_routes(routes: list[MixerRoute]) -> str:
    """One start-up line: how many mixers take which route and why.

    `3 token mixers besides attention: 3 BambaMixer per example (causal-conv1d, mamba-ssm not installed)`
    """
    groups: dict[tuple[str, str, str], int] = {}
    for route in routes:
        key = (route.kind, route.route.replace("_", " "), route.why)
        groups[key] = groups.get(key, 0) + 1
    parts = [f"{n} {kind} {how} ({why})" for (kind, how, why), n in groups.items()]
    return f"{count(len(routes), 'token mixer')} besides attention: {'; '.join(parts)}"


def refuse_shared_prompt(routes: list[MixerRoute]) -> None:
    """Shared prompts need every token mixer to let two continuations start from one prompt: attention reads the
    prompt's keys twice, but a scan or convolution carries a state that would have to fork after the prompt."""
    if routes:
        raise ConfigError(
            "data.collator.init_args.share_prompt",
            f"{count(len(routes), 'token mixer')} besides attention ({routes[0].kind}) would have to fork their "
            "state after each prompt for its two continuations",
            "set {share_prompt}=false for this model (its pairs run as two sequences)",
        )


def _read_boundaries(state: _Boundaries, outer: bool) -> Callable:
    """A pre-hook that records the call's boundaries in `state`: on the whole model (`outer`) always, on its
    decoder only when the decoder is called alone (within the whole model's forward, the whole model's hold)."""

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if kwargs.get(KEY_INDEX) is not None:
            refuse_shared_prompt(state.routes)
        if not outer and state.inside:
            return
        state.inside = outer
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        shape = (ids if ids is not None else embeds).shape[:2] if (ids is not None or embeds is not None) else None
        cu = kwargs.get(CU_SEQ_LENS_Q)
        if cu is None and shape is not None and shape[0] == 1 and kwargs.get(POSITION_IDS) is not None:
            cu = boundaries_from_positions(kwargs[POSITION_IDS], 1, shape[1], kwargs[POSITION_IDS].device)
        if cu is not None and (shape is None or shape[0] != 1 or len(cu) <= 2):
            cu = None  # a batch of whole rows, or one example: the mixers run as transformers wrote them
        state.cu, state.tokens = cu, (shape[1] if shape is not None else 0)

    return hook


def _leave(state: _Boundaries) -> Callable:
    def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
        state.inside = False

    return hook


def _route(forward: Callable, state: _Boundaries, route: MixerRoute) -> Callable:
    """A mixer class's `forward` on a packed row: the whole row with the boundaries handed to its kernels
    (`kernel`), or each group of equal-length examples on its own (`per_example`)."""
    first = list(inspect.signature(forward).parameters)[1]  # after self: hidden_states, input_states, x, ...

    def run(self, *args, **kwargs):
        forward_of = functools.partial(forward, self)
        kwargs = {k: v for k, v in kwargs.items() if k not in _PACKING_KWARGS}
        hidden = args[0] if args else kwargs[first]
        cu = state.cu
        if cu is None or hidden.dim() < 2 or hidden.shape[0] != 1 or hidden.shape[1] != state.tokens:
            return forward_of(*args, **kwargs)
        if kwargs.get("cache") is not None or kwargs.get("cache_params") is not None:
            raise ValueError("a packed batch cannot run with a cache: call the model with use_cache=False")
        if route.route == "kernel":  # mamba-ssm / causal-conv1d read seq_idx; transformers hands fla cu_seq_lens_q
            return forward_of(*args, **kwargs, **{CU_SEQ_LENS_Q: cu, SEQ_IDX: seq_idx(cu, state.tokens)})
        groups, inverse = length_groups(cu)
        outs = []
        for group in groups:
            out = forward_of(
                *(_take(a, group, state.tokens) for a in args),
                **{k: _take(v, group, state.tokens) for k, v in kwargs.items()},
            )
            outs.append(out if isinstance(out, tuple) else (out,))
        merged = tuple(_put_back([out[i] for out in outs], inverse, groups) for i in range(len(outs[0])))
        return merged if isinstance(out, tuple) else merged[0]

    run.__wrapped__ = forward  # the class forward
    return run


def _take(value: Any, group, tokens: int) -> Any:
    """The examples of one `LengthGroup` out of a per-token value of the row ((1, T, ...) tensors, also inside
    tuples such as `position_embeddings`), as an (m, L, ...) batch; anything else unchanged."""
    if isinstance(value, tuple):
        return tuple(_take(v, group, tokens) for v in value)
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[0] != 1 or value.shape[1] != tokens:
        return value
    if group.index is None:
        return value.narrow(1, group.starts[0], group.length)
    return value[0].index_select(0, group.index).view(len(group.starts), group.length, *value.shape[2:])


def _put_back(parts: list[Any], inverse: torch.Tensor | None, groups: list) -> Any:
    """One output of the groups' calls, as the packed row's: per-token (m, L, ...) tensors concatenated and put
    back in token order as (1, T, ...); anything else (a final state, only kept with a cache) becomes None."""
    per_token = all(
        isinstance(p, torch.Tensor) and p.dim() >= 2 and tuple(p.shape[:2]) == (len(g.starts), g.length)
        for p, g in zip(parts, groups)
    )
    if not per_token:
        return None
    flat = [p.reshape(-1, *p.shape[2:]) for p in parts]
    merged = torch.cat(flat) if len(flat) > 1 else flat[0]
    return (merged if inverse is None else merged.index_select(0, inverse)).unsqueeze(0)
