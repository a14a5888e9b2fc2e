"""Guards against packed examples seeing each other: a cheap host-side check of every batch, and a self-test of
the real model and backend before the first training step.

    check_packed_batch(batch)                       # every batch, on the host, before the transfer
    check_isolation(model, batch, "per_example")     # once: packed forward == forward of each example alone

The failures they catch are silent otherwise: a 2D attention_mask that makes transformers drop
packed isolation (transformers#46634), position ids that run on across examples, a backend that ignores
`cu_seq_lens`, a model whose attention does not go through transformers' AttentionInterface.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from transformers import PreTrainedModel

from lit_packing._compat import attn_implementation_of, supports_sdpa
from lit_packing.batch import (
    ATTENTION_MASK,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    POSITION_IDS,
    is_packed,
)
from lit_packing.errors import IsolationError
from lit_packing.models.attention import compute_dtype

# Allowed max |packed - per-example| of the logits, relative to max(1, max |logits|), by compute dtype. Packed and
# per-example fp32 agree to ~1e-6 (different kernels, same math); examples that see each other differ by far more.
ISOLATION_RTOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def check_packed_batch(batch: Mapping[str, Any]) -> None:
    """Host-side sanity of a batch before it goes to the device: cheap, O(T), no device sync.

    Raises:
        IsolationError: a packed batch with a 2D attention_mask, position ids that run on across examples,
            malformed cu_seq_lens, or position ids without cu_seq_lens.
    """
    if not is_packed(batch):
        ids = batch[INPUT_IDS]
        if POSITION_IDS in batch and ATTENTION_MASK not in batch and ids.shape[0] == 1 and ids.shape[1] > 1:
            pos = batch[POSITION_IDS][0]
            if bool((pos[1:] != pos[:-1] + 1).any()):
                raise IsolationError(
                    "a packed batch (restarting position_ids) without cu_seq_lens_q/k: use PackedCollator, or "
                    "DataCollatorWithFlattening(return_flash_attn_kwargs=True)"
                )
        return
    if ATTENTION_MASK in batch:
        raise IsolationError(
            "a packed batch (cu_seq_lens_q) also carries a 2D attention_mask: transformers then ignores the packing "
            "and lets examples attend to each other (transformers#46634). Drop attention_mask from packed batches"
        )
    cu, ids = batch[CU_SEQ_LENS_Q], batch[INPUT_IDS]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise IsolationError(f"a packed batch has shape (1, T), got input_ids {tuple(ids.shape)}")
    total = ids.shape[1]
    if cu.device.type != "cpu":
        return  # already on a device: checking would sync; the fit-start self-test still runs
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != total or bool((lengths < 0).any()):
        raise IsolationError(f"cu_seq_lens_q={cu.tolist()} does not cover the T={total} tokens of the batch")
    if CU_SEQ_LENS_K in batch and not torch.equal(batch[CU_SEQ_LENS_K].to(cu.dtype), cu):
        raise IsolationError("cu_seq_lens_k differs from cu_seq_lens_q in a self-attention batch")
    longest = int(lengths.max())
    for key in (MAX_LENGTH_Q, MAX_LENGTH_K):
        if key in batch and int(batch[key]) < longest:
            raise IsolationError(f"{key}={batch[key]} < the longest example ({longest} tokens)")
    if POSITION_IDS not in batch:
        raise IsolationError("a packed batch needs position_ids restarting at 0 for every example")
    expected = torch.arange(total) - torch.repeat_interleave(cu[:-1].long(), lengths.long(), output_size=total)
    if not torch.equal(batch[POSITION_IDS][0].long(), expected):
        raise IsolationError(
            "position_ids do not restart at 0 at every cu_seq_lens boundary: each example would see shifted "
            "positions. Build packed batches with PackedCollator"
        )


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
    exact while bounding its cost. The batch's own position ids are kept (a collator bug shows up).
    Lengths 300, 40, 700 with max_example_tokens=256 -> 256, 40, 256; cu_seq_lens [0 256 296 552].

    With `vocab_size`, the sample always holds exactly `max_examples` examples: a batch with fewer (an empty
    pack) is topped up with seeded random ones. Then every rank runs the same number of forwards, which keeps a
    sharded model's collectives (FSDP all-gathers every forward) matched across ranks.
    """
    cu = batch[CU_SEQ_LENS_Q].cpu().tolist()
    labels = batch[LABELS][0].cpu() if LABELS in batch else None
    # Real examples only: a segment without labels is the collator's tail padding or an empty pack's token.
    spans = [
        (a, min(b, a + max_example_tokens))
        for a, b in zip(cu[:-1], cu[1:])
        if b > a and (labels is None or bool((labels[a:b] != IGNORE_INDEX).any()))
    ][:max_examples]
    ids = [batch[INPUT_IDS][0, a:b].cpu() for a, b in spans]
    pos = [batch[POSITION_IDS][0, a:b].cpu() for a, b in spans]
    if vocab_size is not None:
        gen = torch.Generator().manual_seed(0)
        for j in range(max_examples - len(spans)):
            ids.append(torch.randint(vocab_size, (5 + 3 * j,), generator=gen))
            pos.append(torch.arange(5 + 3 * j))
    lengths = [len(x) for x in ids]
    device = batch[INPUT_IDS].device
    new_cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return {
        INPUT_IDS: torch.cat(ids)[None].to(device),
        POSITION_IDS: torch.cat(pos)[None].to(device),
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

    Returns:
        The max abs difference of the logits.

    Raises:
        IsolationError: naming the backend, the difference and the tolerance.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    small = sample_packed(batch, vocab_size=base.config.get_text_config().vocab_size)
    cu = small[CU_SEQ_LENS_Q].cpu().tolist()
    if reference is None:
        reference = "sdpa" if supports_sdpa(base) else "eager"
    was_training = model.training
    model.eval()
    try:
        packed = model(**small, use_cache=False).logits[0].float()  # (T, V)
        with attn_implementation_set(base, reference):
            alone = []
            for start, end in zip(cu[:-1], cu[1:]):
                ids = small[INPUT_IDS][:, start:end]
                pos = torch.arange(end - start, device=ids.device)[None]
                alone.append(model(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float())
    finally:
        model.train(was_training)
    per_example = torch.cat(alone)
    diff = float((packed - per_example).abs().max())
    scale = max(1.0, float(per_example.abs().max()))
    dtype = compute_dtype(backend, _compute_dtype(model))  # a kernel below the model's precision: judge by it
    tol = (rtol if rtol is not None else ISOLATION_RTOL.get(dtype, 5e-2)) * scale
    if not diff <= tol:  # also catches nan
        raise IsolationError(
            f"isolation self-test failed for attn_backend={backend}: packed logits differ from per-example logits "
            f"by max abs {diff:.3g} > tolerance {tol:.3g} ({dtype}, {len(cu) - 1} examples, {cu[-1]} tokens). "
            "Examples attend to each other or see wrong positions: check the collator's position_ids / cu_seq_lens "
            "and the backend; isolation_check=false switches this test off"
        )
    return diff


def _compute_dtype(model: torch.nn.Module) -> torch.dtype:
    param = next(model.parameters())
    device_type = param.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return param.dtype
