"""The isolation self-test: the packed forward of the real model, with its backend and precision, against each
example run alone, once before the first training step; and `find_leak`, which names the module that lets
examples see each other when they differ.

    check_isolation(model, batch, "per_example")     # packed forward == forward of each example alone

`find_leak` hooks every module, splits the packed run at the boundaries and compares it with each example's run:
the first module whose output differs is the mixer, attention or position embedding at fault, e.g.
`model.layers.0.mamba (BambaMixer)`. The construction probe (`probe.py`) uses it too.

A vision-language model is also checked on documents with images (`check_image_isolation`): the self-test has the
model, not its processor, so they are made from its config (`vlm.probe_documents`: random pixels, images of two
sizes, the family's image tokens), packed as the collator packs them (`vlm.pack_vlm_documents`) and compared with
each document run alone, its images through the tower alone and its positions the model's own. A vision tower
that sees another document's images, or positions that run on across documents, fail it, named.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from lit_packing._compat import attn_implementation_of, supports_sdpa
from lit_packing.agree import agreed, any_rank
from lit_packing.batch import (
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    MM_TOKEN_TYPE_IDS,
    POSITION_IDS,
    PROMPTS,
    continuation_prompts,
    model_inputs,
)
from lit_packing.errors import IsolationError
from lit_packing.models.context import ContextGroup, deal, deal_of, plan
from lit_packing.models.kernels import compute_dtype
from lit_packing.models.mixers import MIXER_CLASS
from lit_packing.models.vlm import ROW_BOUNDS, exact_family, pack_vlm_documents, probe_documents

# What to do when a module keeps packed examples from being isolated.
PADDED_FIX = (
    "or train it padded: --config configs/paper.yaml --config configs/padding.yaml "
    "(data.collator: lit_packing.data.PaddedCollator)"
)

# Allowed max |packed - per-example| of the logits, relative to max(1, max |logits|), by compute dtype. Packed and
# per-example fp32 agree to ~1e-6 (different kernels, same math); examples that see each other differ by far more.
ISOLATION_RTOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@contextlib.contextmanager
def attn_implementation_set(model: PreTrainedModel, name: str) -> Iterator[None]:
    """Temporarily switch a transformers model's attention implementation."""
    previous = attn_implementation_of(model)
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def sample_packed(
    batch: Mapping[str, Any], max_examples: int = 8, max_example_tokens: int = 256, vocab_size: int | None = None
) -> dict[str, Any]:
    """A small packed batch from the first examples of `batch`, each cut to its first tokens.

    Causal attention makes a prefix of an example behave exactly as the example does, so the cut keeps the test
    exact while bounding its cost. The batch's own position ids are kept (a collator bug shows up); of mRoPE's rows
    the text row, on every row (the sample carries no pixels: an image token in it reads as text).
    Lengths 300, 40, 700 with max_example_tokens=256 -> 256, 40, 256; cu_seq_lens [0 256 296 552].

    With `vocab_size`, the sample always holds exactly `max_examples` examples: a batch with fewer (an empty
    pack) is topped up with seeded random ones. Then every rank runs the same number of forwards, which keeps a
    sharded model's collectives (FSDP all-gathers every forward) matched across ranks.
    """
    cu = batch[CU_SEQ_LENS_Q].cpu().tolist()
    labels = batch[LABELS][0].cpu() if LABELS in batch else None
    # Real examples only: a segment without labels is the collator's tail padding or an empty pack's token. With
    # shared prompts an example is a prompt and one continuation, put back together (the gathered-key attention
    # itself is the tests' to check: tests/models/test_shared_prompt.py).
    prompt_of = {}
    if PROMPTS in batch:
        continued, prompts = continuation_prompts(batch)
        prompt_of = dict(zip(continued.tolist(), prompts.tolist()))
    examples = [
        ([(cu[prompt_of[s]], cu[prompt_of[s] + 1])] if s in prompt_of else []) + [(a, b)]
        for s, (a, b) in enumerate(zip(cu[:-1], cu[1:]))
        if b > a and (labels is None or bool((labels[a:b] != IGNORE_INDEX).any()))
    ][:max_examples]
    index = [torch.cat([torch.arange(a, b) for a, b in spans])[:max_example_tokens] for spans in examples]
    ids = [batch[INPUT_IDS][0].cpu()[i] for i in index]
    positions = batch[POSITION_IDS]  # (1, T), or mRoPE's (4, 1, T), its text row first
    pos = [positions.reshape(-1, positions.shape[-1])[0].cpu()[i] for i in index]
    if vocab_size is not None:
        gen = torch.Generator().manual_seed(0)
        for j in range(max_examples - len(examples)):
            ids.append(torch.randint(vocab_size, (5 + 3 * j,), generator=gen))
            pos.append(torch.arange(5 + 3 * j))
    lengths = [len(x) for x in ids]
    device = batch[INPUT_IDS].device
    new_cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    pos = torch.cat(pos)[None]
    if positions.dim() == 3:  # (rows, 1, T): text only, so every row is the text row
        pos = pos.expand(positions.shape[0], 1, -1)
    return {
        INPUT_IDS: torch.cat(ids)[None].to(device),
        POSITION_IDS: pos.to(device),
        CU_SEQ_LENS_Q: new_cu,
        CU_SEQ_LENS_K: new_cu,
        MAX_LENGTH_Q: max(lengths),
        MAX_LENGTH_K: max(lengths),
    }


@torch.no_grad()
def check_isolation(
    model: PreTrainedModel,
    batch: Mapping[str, Any],
    backend: str,
    reference: str | None = None,
    rtol: float | None = None,
    context: ContextGroup | None = None,
    group: Any = None,
) -> float:
    """Packed forward of the model as configured == forward of each example alone; raise otherwise.

    The packed forward is exactly what training runs (the batch's own position ids and boundaries, the model's
    backend, the surrounding autocast); the reference runs every example as its own (1, L) batch with fresh
    positions 0..L-1 through transformers' `reference` attention. Runs in eval mode (no dropout), restores the mode.

    Args:
        model: the transformers model (a peft model is fine).
        batch: a packed batch on the model's device; its first examples are used (see `sample_packed`).
        backend: the backend name, for the error message.
        reference: transformers attention for the per-example forward (default sdpa, eager where sdpa is missing).
        rtol: allowed max abs difference relative to max(1, max |logits|); default by the dtype the packed forward
            computed in (ISOLATION_RTOL): the autocast / parameter dtype, or the attention kernel's where lower.
        context: context parallel: the packed forward runs dealt over the group (`context.deal`), its logits
            gathered back into the pack's order; every rank of the group calls it with the same batch.
        group: the ranks that run it together (a process group; `torch.distributed.group.WORLD` for all), each on
            its own batch: a failure on any of them stops them all at once (`agree`), and all run the search for
            the leaking module, so a sharded model's collectives stay matched. None: this process alone.

    Returns:
        The max abs difference of the logits.

    Raises:
        IsolationError: naming the backend, the difference and the tolerance (on the ranks where it failed;
            `agree.RankError` naming the first of them on the others).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    small = sample_packed(batch, vocab_size=base.config.get_text_config().vocab_size)
    cu = small[CU_SEQ_LENS_Q].cpu().tolist()
    if reference is None:
        reference = reference_attention(base)
    was_training = model.training
    model.eval()
    # Each example's logits are compared with its slice of the packed row as they come: no whole-row copy of the
    # per-example logits, no whole-row difference (each (T, vocab) in fp32: 1.2 GB at 2,048 tokens and 150k words).
    diff = scale = torch.zeros((), device=small[INPUT_IDS].device)
    try:
        packed = _packed_logits(model, small, context)  # (T, V)
        with attn_implementation_set(base, reference):
            for start, end in zip(cu[:-1], cu[1:]):
                ids = small[INPUT_IDS][:, start:end]
                pos = torch.arange(end - start, device=ids.device)[None]
                alone = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()
                diff = torch.maximum(diff, (packed[start:end] - alone).abs().amax())
                scale = torch.maximum(scale, alone.abs().amax())
    finally:
        model.train(was_training)
    del packed
    diff, scale = float(diff), max(1.0, float(scale))
    dtype = compute_dtype(backend, model_compute_dtype(model))  # a kernel below the model's precision: judge by it
    relative = rtol if rtol is not None else ISOLATION_RTOL.get(dtype, 5e-2)
    tol = relative * scale
    failed = not diff <= tol  # also catches nan
    if any_rank(failed, group):  # every rank runs find_leak's forwards: a sharded model's gathers stay matched
        where = blame(find_leak(model, small, reference, relative), base)
    # The same documents on every rank, each its forwards: a sharded model's gathers stay matched here too.
    images = check_image_isolation(model, reference, relative) if _has_vision(base) else None
    with agreed(group):
        if failed:
            raise IsolationError(
                f"isolation self-test failed for attn_backend={backend}: packed logits differ from per-example "
                f"logits by max abs {diff:.3g} > tolerance {tol:.3g} ({dtype}, {len(cu) - 1} examples, {cu[-1]} "
                f"tokens). {where}; isolation_check=false switches this test off"
            )
        if images is not None and images.problem:
            raise IsolationError(
                f"isolation self-test failed for attn_backend={backend} on documents with images: {images.problem}; "
                "isolation_check=false switches this test off"
            ) from images.error
    return diff if images is None else max(diff, images.diff)


@dataclass(frozen=True)
class ImageIsolation:
    """What `check_image_isolation` found: the max abs difference of the logits (inf where the packed forward
    raised `error`), the tolerance, and what went wrong and why ("" when every document agrees with itself alone)."""

    diff: float
    tol: float
    problem: str = ""
    error: Exception | None = None


@torch.no_grad()
def check_image_isolation(model: PreTrainedModel, reference: str, rtol: float) -> ImageIsolation:
    """Pack a vision-language model's `probe_documents` (a text document and two with images of two sizes) as the
    collator does, run the packed row, and compare each document's logits with the document run alone (its images
    only through the tower, the model's own positions, transformers' `reference` attention). Eval mode, restored.

    Args:
        model: the packed transformers model (a peft model is fine), of a family `vlm.exact_family` admits.
        reference: transformers attention for the per-document forwards.
        rtol: allowed max abs difference relative to max(1, max |logits| alone).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    family = exact_family(base.config)
    documents = probe_documents(base.config)
    batch = pack_vlm_documents(base, documents)
    cu = batch[CU_SEQ_LENS_Q].tolist()
    tower = base.get_submodule(family.layout.tower)
    handed: set[str] = set()  # the row's bounds that reached the tower (past `keep_tower_apart`, hooked before)
    hook = tower.register_forward_pre_hook(lambda m, a, kw: handed.update(ROW_BOUNDS & set(kw)), with_kwargs=True)
    was_training = model.training
    model.eval()
    diff = scale = torch.zeros((), device=base.device)
    raised = None
    try:
        try:
            packed = model(**model_inputs(batch, base.device), use_cache=False).logits[0].float()  # (T, V)
        except Exception as error:  # a backend refusing the bounds the tower got, say: named below
            packed, raised = None, error
        finally:
            hook.remove()
        with attn_implementation_set(base, reference):
            for document, start, end in zip(documents, cu[:-1], cu[1:]):
                alone = model(**_alone(document, family.route, base), use_cache=False).logits[0].float()
                if packed is not None:
                    diff = torch.maximum(diff, (packed[start:end] - alone).abs().amax())
                scale = torch.maximum(scale, alone.abs().amax())
    finally:
        model.train(was_training)
    diff = float("inf") if raised is not None else float(diff)
    tol = rtol * max(1.0, float(scale))
    if diff <= tol:
        return ImageIsolation(diff, tol)
    what = (
        f"the packed forward raised {type(raised).__name__}: {str(raised).strip()[:300]}"
        if raised is not None
        else f"packed logits differ from each document run alone by max abs {diff:.3g} > tolerance {tol:.3g}"
    )
    where = f"a text document and two with images of two sizes, {cu[-1]} tokens, made from the model's config"
    why = _image_blame(handed, batch, cu, family.layout.tower, tower)
    return ImageIsolation(diff, tol, f"{what} ({where}). {why}", raised)


def _alone(document: Mapping[str, torch.Tensor], route: str, base: PreTrainedModel) -> dict[str, Any]:
    """One probe document as the model takes it alone: (1, L) ids, its images, no positions (the model's own)."""
    inputs = {key: value.to(base.device) for key, value in document.items()}
    inputs[INPUT_IDS] = inputs[INPUT_IDS][None]
    if route != "1d":  # mRoPE's `get_rope_index` reads the tokens' types
        inputs[MM_TOKEN_TYPE_IDS] = (inputs[INPUT_IDS] == base.config.image_token_id).int()
    return inputs


def _image_blame(handed: set[str], batch: Mapping[str, Any], cu: list[int], name: str, tower: torch.nn.Module) -> str:
    """What lets documents with images see each other, and the fix: the tower handed the row's bounds, positions
    that do not restart at each document, or (neither seen) something else that mixes them."""
    if handed:
        return (
            f"The vision tower {name} ({type(tower).__name__}) was handed the row's bounds ({', '.join(sorted(handed))}"
            "): its attention cuts or refuses its images at the documents' bounds, not its own. Build the model "
            "through lit_packing.core.pack_model(model), which keeps them from it (lit_packing.models.vlm."
            "keep_tower_apart)"
        )
    positions = batch[POSITION_IDS]
    first = positions[..., cu[:-1]].reshape(-1, len(cu) - 1)  # (rows, documents): each document's first positions
    late = [i for i in range(len(cu) - 1) if bool(first[:, i].any())]
    if late:
        return (
            f"The row's positions do not restart at each document (document {late[0]} starts at "
            f"{first[:, late[0]].tolist()}, not 0): they run on across documents, and attention that reads the "
            "bounds from them joins the documents. Each document's positions are its own: lit_packing.models.vlm."
            "add_images (the collator's) computes them"
        )
    return (
        "The tower got none of the row's bounds and every document's positions restart, so the images' features "
        f"or the model's own masks mix the documents by other means; {PADDED_FIX.removeprefix('or ')}"
    )


def _has_vision(base: PreTrainedModel) -> bool:
    return getattr(base.config, "vision_config", None) is not None


def _packed_logits(model: torch.nn.Module, small: dict[str, Any], context: ContextGroup | None) -> torch.Tensor:
    """The packed forward's (T, V) fp32 logits; context parallel, dealt and gathered back (every rank of the group
    runs it)."""
    if context is None:
        return model(**small, use_cache=False).logits[0].float()
    local = model(**model_inputs(deal(small, context)), use_cache=False).logits[0].float()  # (slots, V)
    rows = [torch.empty_like(local) for _ in range(context.size)]
    torch.distributed.all_gather(rows, local.contiguous(), group=context.group)
    return deal_of(plan(small[CU_SEQ_LENS_Q].cpu().numpy(), context.size)).undeal(rows)


@torch.no_grad()
def find_leak(
    model: torch.nn.Module, small: Mapping[str, Any], reference: str, rtol: float
) -> tuple[str, torch.nn.Module, float] | None:
    """The first module (in the order modules finish) whose output on the packed row differs from its outputs on
    each example alone: `(qualified name, module, max abs difference)`, or None when every module agrees (then the
    logits differ only in how they are put together: the positions or the boundaries given).

    Both runs are hooked on every module; a module's output counts when it has a token axis (shape (1, T, ...)
    packed, (1, L, ...) alone); a module called more than once per forward is compared on its first call.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cu = small[CU_SEQ_LENS_Q].cpu().tolist()
    total, n = cu[-1], len(cu) - 1
    packed: dict[str, torch.Tensor] = {}
    alone: dict[str, list[torch.Tensor]] = {}
    order: list[str] = []
    modules = {name: module for name, module in base.named_modules() if name}
    tokens = {"want": total, "into": None}

    def hook(name: str):
        def record(module, args, output):
            out = output[0] if isinstance(output, tuple) and output else output
            if not isinstance(out, torch.Tensor) or out.dim() < 2 or out.shape[0] != 1:
                return
            if out.shape[1] != tokens["want"]:
                return
            if tokens["into"] is None:
                if name not in packed:
                    packed[name] = out[0].detach().float()
                    order.append(name)
            elif len(alone.setdefault(name, [])) < tokens["into"] + 1:
                alone[name].append(out[0].detach().float())

        return record

    handles = [module.register_forward_hook(hook(name)) for name, module in modules.items()]
    was_training = model.training
    model.eval()
    try:
        with contextlib.suppress(Exception):  # a packed forward that raises: the modules it finished are compared
            model(**small, use_cache=False)
        with attn_implementation_set(base, reference):
            for i, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
                tokens.update(want=end - start, into=i)
                ids = small[INPUT_IDS][:, start:end]
                model(input_ids=ids, position_ids=torch.arange(end - start, device=ids.device)[None], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    for name in order:
        outs = alone.get(name, [])
        if len(outs) != n:
            continue
        mine, theirs = packed[name], torch.cat(outs)
        if mine.shape != theirs.shape:
            continue
        diff = float((mine - theirs).abs().max())
        if not diff <= rtol * max(1.0, float(theirs.abs().max())):
            return name, modules[name], diff
    return None


def blame(leak: tuple[str, torch.nn.Module, float] | None, base: torch.nn.Module) -> str:
    """What lets examples see each other, and what to do, from `find_leak`'s answer."""
    if leak is None:
        return (
            "Every module agrees with the examples run alone, so the positions or boundaries given are wrong: check "
            "the collator's position_ids / cu_seq_lens"
        )
    name, module, diff = leak
    owner = _mixing_module(name, base)
    what = f"{owner} ({type(base.get_submodule(owner)).__name__})" if owner != name else ""
    here = f"{name} ({type(module).__name__})" + (f" in {what}" if what else "")
    cls = type(base.get_submodule(owner)).__name__
    fix = f"{type(base).__name__} cannot be packed; {PADDED_FIX.removeprefix('or ')}"
    if MIXER_CLASS.search(cls):
        kind = "its recurrence or convolution runs across the boundary"
        fix = (
            "Run its mixers per example: build it through lit_packing.core.pack_model(model) (PackedCausalLM and "
            f"load_causal_lm do), {PADDED_FIX}"
        )
    elif "attention" in cls.lower() or "attn" in owner.rsplit(".", 1)[-1]:
        kind = "its attention does not go through transformers' attention interface, or builds its own mask"
    elif "position" in (name + cls).lower() or "embed" in name.lower():
        kind = "its positions are counted along the packed row, not from each example's start"
    else:
        kind = "it mixes tokens along the sequence by other means than attention"
    return (
        f"Examples see each other in {here}: its output differs from each example run alone by max abs {diff:.3g} "
        f"({kind}). {fix}"
    )


def _mixing_module(name: str, base: torch.nn.Module) -> str:
    """The module of a decoder layer that `name` is in (`model.layers.3.mamba` for `model.layers.3.mamba.conv1d`):
    the child of a numbered layer; `name` itself outside the layers."""
    parts = name.split(".")
    for i in range(len(parts) - 1):
        if parts[i].isdigit():
            return ".".join(parts[: i + 2])
    return name


def reference_attention(model: PreTrainedModel) -> str:
    """transformers' own attention for running examples alone: sdpa, eager where the model has no sdpa."""
    return "sdpa" if supports_sdpa(model) else "eager"


def model_compute_dtype(model: torch.nn.Module) -> torch.dtype:
    param = next(model.parameters())
    device_type = param.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return param.dtype
