"""The construction probe: before a model trains packed, one tiny packed forward on the device it is built on,
with a recording attention, tells what its layers hand attention and whether examples stay apart in every layer.

    found = probe_packing(model)     # Probe(keywords=frozenset({...}), attention=[modules...], keyed=True)

Refused in one line each, naming the model and the module or keyword: a keyword no packed backend implements, a
packed forward that raises, and packed logits that differ from each example run alone (`selftest.find_leak`
names the module that lets them see each other). A second forward hands the model `key_index` and
`gathered_index` (the identity) and a context group of one, which change nothing, and records whether every
attention layer passed them on to the attention function: shared prompts and context parallelism pick each
segment's keys with them, and a layer that drops them would attend a shorter key set with longer boundaries.
What it learns goes back to the caller (`pack_model`), which hands it on explicitly: the keywords to
`backends.attention_needs`, the attention modules to `attention.admit`, `keyed` to the context-parallel and
shared-prompt checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedModel

from lit_packing.batch import (
    CONTEXT,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    GATHERED_INDEX,
    INPUT_IDS,
    KEY_INDEX,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    POSITION_IDS,
)
from lit_packing.errors import ConfigError
from lit_packing.models.attention import HONOURED_KEYWORDS, INERT_KEYWORDS, PROBE_NAME, register_probe
from lit_packing.models.context import ContextGroup
from lit_packing.models.selftest import (
    ISOLATION_RTOL,
    PADDED_FIX,
    attn_implementation_set,
    blame,
    find_leak,
    model_compute_dtype,
    reference_attention,
)


class Probe(NamedTuple):
    """What the probe learned: the keywords the model's layers hand attention, its attention modules, and whether
    every one of them hands on `key_index` and the context group (`keyed`)."""

    keywords: frozenset[str]
    attention: list[torch.nn.Module]
    keyed: bool = False


@torch.no_grad()
def probe_packing(model: PreTrainedModel, check: bool = True) -> Probe:
    """At construction, on the host: run two tiny packed examples through the model's layers with a recording
    per_example attention, and return the keywords its layers hand attention (`attention_needs` reads them) and
    the modules that called attention.

    Refuses, in one line each, a model whose attention hands over a keyword no backend implements, whose packed
    forward raises (naming the module it raised in), and (`check`) whose packed logits differ from each example's
    run alone (naming the module that lets them see each other: `find_leak`).

    Raises:
        ConfigError: naming the model, the module or keyword, and what to do.
    """
    seen: set[str] = set()
    attention: list[torch.nn.Module] = []
    config = model.config.get_text_config()
    ids = (torch.arange(11, device=model.device)[None] * 7 + 3) % config.vocab_size
    cu = torch.tensor([0, 5, 11], dtype=torch.int32, device=model.device)
    small = {
        INPUT_IDS: ids,
        POSITION_IDS: torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]], device=model.device),
        CU_SEQ_LENS_Q: cu,
        CU_SEQ_LENS_K: cu,
        MAX_LENGTH_Q: 6,
        MAX_LENGTH_K: 6,
    }
    name = type(model).__name__
    running: list[str] = []  # the modules whose forward is under way, outermost first
    handles = []
    for qualified, module in model.named_modules():
        if qualified:
            handles.append(module.register_forward_pre_hook(lambda m, a, n=qualified: running.append(n)))
            handles.append(module.register_forward_hook(lambda m, a, o: running.pop() and None))  # None: output kept
    was_training = model.training
    model.eval()
    try:
        try:
            with attn_implementation_set(model, register_probe(seen, attention)):
                packed = model(**small, use_cache=False).logits[0].float()
        except Exception as error:
            _refuse_packed_error(model, ids, error, running)
        finally:
            for handle in handles:
                handle.remove()
        if check:
            _compare_alone(model, small, packed)
    finally:
        model.train(was_training)
    unknown = sorted(seen - HONOURED_KEYWORDS - INERT_KEYWORDS - {PROBE_NAME})
    if unknown:
        raise ConfigError(
            "model.name_or_path",
            f"{name}'s attention hands the attention function {', '.join(unknown)}, which the packed backends do not "
            "implement: its attention would be computed without it",
            "choose a model whose attention the backends implement (the families table in docs/model.md)",
        )
    modules = list({id(m): m for m in attention}.values())
    return Probe(frozenset(seen - {PROBE_NAME}), modules, _hands_on_keys(model, small, modules))


def _hands_on_keys(model: PreTrainedModel, small: Mapping[str, Any], modules: list[torch.nn.Module]) -> bool:
    """Whether every attention module hands the attention function `key_index` and the context group: one more
    packed forward with both (the identity index, a group of one). A model that cannot run that forward (token
    mixers that cannot fork their state after a prompt, a position bias over the row) is not keyed."""
    each: dict[int, set[str]] = {}
    identity = torch.arange(small[INPUT_IDS].shape[1], device=model.device)
    keyed = {**small, KEY_INDEX: identity, GATHERED_INDEX: identity, CONTEXT: ContextGroup(None, 1, 0)}
    try:
        with attn_implementation_set(model, register_probe(set(), [], each)):
            model(**keyed, use_cache=False)
    except Exception:  # what it is said where the route is asked for (`refuse_shared_prompt`, the checks)
        return False
    return bool(modules) and all({KEY_INDEX, GATHERED_INDEX, CONTEXT} <= each.get(id(m), set()) for m in modules)


def _refuse_packed_error(model: PreTrainedModel, ids: torch.Tensor, error: Exception, running: list[str]) -> None:
    """A packed forward raised: refuse in one line naming the module it raised in, unless the model cannot run one
    example alone either (then the error is the model's own, not packing's, and is raised as it is)."""
    try:
        with attn_implementation_set(model, reference_attention(model)):
            model(input_ids=ids[:, :5], use_cache=False)
    except Exception:
        raise error from None
    detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    where = f"{running[-1]} ({type(model.get_submodule(running[-1])).__name__})" if running else "its forward"
    raise ConfigError(
        "model.name_or_path",
        f"{type(model).__name__} cannot run a packed row: {where} raised {type(error).__name__}: {detail[:200]}",
        PADDED_FIX.removeprefix("or "),
    ) from None


def _compare_alone(model: PreTrainedModel, small: Mapping[str, Any], packed: torch.Tensor) -> None:
    """The probe's packed logits (per_example attention) against each example run alone; refuse a difference,
    naming the module that lets the examples see each other."""
    reference = reference_attention(model)
    rtol = ISOLATION_RTOL.get(model_compute_dtype(model), 5e-2)
    ids, cu = small[INPUT_IDS], small[CU_SEQ_LENS_Q].tolist()
    with attn_implementation_set(model, reference):
        alone = torch.cat(
            [model(input_ids=ids[:, a:b], use_cache=False).logits[0].float() for a, b in zip(cu[:-1], cu[1:])]
        )
    if not float((packed - alone).abs().max()) <= rtol * max(1.0, float(alone.abs().max())):
        with attn_implementation_set(model, register_probe(set(), [])):
            where = blame(find_leak(model, small, reference, rtol), model)
        raise ConfigError("model.name_or_path", f"packed examples are not kept apart: {where}")
