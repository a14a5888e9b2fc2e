"""Token mixers other than attention, kept apart in packed rows: state-space scans (Mamba 1/2), gated delta rules,
linear and lightning attention, short convolutions, recurrent units, xLSTM.

    kept = keep_mixers_apart(model)     # once, after the model is built; returns the mixers it wraps

A packed row holds n examples in one (1, T) sequence. Softmax attention keeps them apart through `cu_seq_lens`
(`attention.py`); a recurrence or a causal convolution does not: its state and its window run straight across
every boundary unless its kernel is given the boundaries, and transformers' PyTorch paths take none (with
flash-linear-attention missing, its delta-rule path refuses packed rows outright).

So each such module runs per example, the way the `per_example` attention backend runs attention: the row's
hidden states are split at the boundaries, examples of one length go through the module as one (m, L, D) batch,
and the outputs are put back in token order. Every example then starts from a zero state and an empty window, as
it does alone; the cost stays linear in the real tokens (one call per distinct length). The boundaries reach the
modules even where a model's forward drops the packing kwargs on the way down: a pre-hook on the whole model reads
them from its inputs (`cu_seq_lens_q`, else restarting `position_ids`) and the mixers read the latest ones, which
also serve the recomputation of a gradient-checkpointed layer in the backward pass.

Which modules are mixers: those whose class names say so (`MIXER_CLASS`; the outermost one inside a decoder layer).
A mixer this rule misses still cannot leak unseen: the isolation self-test compares the packed forward with each
example alone before step 1 and names the module whose output differs (`isolation.find_leak`).
"""

from __future__ import annotations

import functools
import inspect
import re
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lit_packing.batch import CU_SEQ_LENS_K, CU_SEQ_LENS_Q, MAX_LENGTH_K, MAX_LENGTH_Q, POSITION_IDS
from lit_packing.models.attention import boundaries_from_positions, length_groups

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
_PACKING_KWARGS = frozenset({CU_SEQ_LENS_Q, CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K, "seq_idx", "cu_seqlens"})


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


@dataclass
class _Boundaries:
    """The latest packed boundaries the model was called with (None: the batch is not packed)."""

    cu: torch.Tensor | None = None
    tokens: int = 0
    mixers: list[str] = field(default_factory=list)


def keep_mixers_apart(model: torch.nn.Module) -> list[str]:
    """Make every non-attention token mixer of a transformers `model` run each packed example on its own; return
    their qualified names (empty: nothing to do, the model is left as it is). Idempotent."""
    existing = getattr(model, "_lit_packing_mixers", None)
    if existing is not None:
        return existing.mixers
    mixers = find_mixers(model)
    state = _Boundaries(mixers=[name for name, _ in mixers])
    if not mixers:
        return state.mixers
    model.register_forward_pre_hook(_read_boundaries(state), with_kwargs=True)
    for _, module in mixers:
        # bound to the module (a deep copy of the model rebinds it to the copy); `state` is shared with the hook
        module.forward = types.MethodType(_per_example(type(module).forward, state), module)
    model._lit_packing_mixers = state
    return state.mixers


def _read_boundaries(state: _Boundaries) -> Callable:
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
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


def _per_example(forward: Callable, state: _Boundaries) -> Callable:
    """A mixer class's `forward`, run on each group of equal-length examples of the packed row."""
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
        groups, inverse = length_groups(cu)
        outs = []
        for group in groups:
            out = forward_of(
                *(_take(a, *group, state.tokens) for a in args),
                **{k: _take(v, *group, state.tokens) for k, v in kwargs.items()},
            )
            outs.append(out if isinstance(out, tuple) else (out,))
        merged = tuple(_put_back([out[i] for out in outs], inverse, groups) for i in range(len(outs[0])))
        return merged if isinstance(out, tuple) else merged[0]

    run.__wrapped__ = forward  # the class forward
    return run


def _take(value: Any, length: int, starts: list[int], index: torch.Tensor | None, tokens: int) -> Any:
    """The examples of one length out of a per-token value of the row ((1, T, ...) tensors, also inside tuples such
    as `position_embeddings`), as an (m, L, ...) batch; anything else unchanged."""
    if isinstance(value, tuple):
        return tuple(_take(v, length, starts, index, tokens) for v in value)
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[0] != 1 or value.shape[1] != tokens:
        return value
    if index is None:
        return value.narrow(1, starts[0], length)
    return value[0].index_select(0, index).view(len(starts), length, *value.shape[2:])


def _put_back(parts: list[Any], inverse: torch.Tensor | None, groups: list) -> Any:
    """One output of the groups' calls, as the packed row's: per-token (m, L, ...) tensors concatenated and put
    back in token order as (1, T, ...); anything else (a final state, only kept with a cache) becomes None."""
    per_token = all(
        isinstance(p, torch.Tensor) and p.dim() >= 2 and tuple(p.shape[:2]) == (len(g[1]), g[0])
        for p, g in zip(parts, groups)
    )
    if not per_token:
        return None
    flat = [p.reshape(-1, *p.shape[2:]) for p in parts]
    merged = torch.cat(flat) if len(flat) > 1 else flat[0]
    return (merged if inverse is None else merged.index_select(0, inverse)).unsqueeze(0)
