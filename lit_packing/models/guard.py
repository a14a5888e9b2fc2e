"""The batch guard: a cheap host-side check of every batch before it goes to the device (O(T), no device sync).

    check_packed_batch(batch)      # raises IsolationError naming what would let examples see each other

It catches what is silent otherwise: a 2D attention_mask that makes transformers drop packed isolation
(transformers#46634), position ids that run on across examples, malformed `cu_seq_lens`, position ids without
`cu_seq_lens`. A packed row reaching a model that `pack_model` did not build is refused by the attention
function itself (`attention.refuse_unpacked`); what a model does with a well-formed row is the probe's and the
self-test's to check (`probe.py`, `selftest.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lit_packing.batch import (
    ATTENTION_MASK,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    INPUT_IDS,
    KEY_INDEX,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    POSITION_IDS,
    is_packed,
)
from lit_packing.errors import IsolationError


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
    # Before each segment's own keys, the keys gathered for it (a shared prompt's): its positions start there.
    before = torch.zeros_like(lengths)
    if KEY_INDEX in batch:
        cu_k = batch[CU_SEQ_LENS_K].to(cu.dtype)
        before = (cu_k[1:] - cu_k[:-1]) - lengths
        if len(cu_k) != len(cu) or int(cu_k[-1]) != len(batch[KEY_INDEX]) or bool((before < 0).any()):
            raise IsolationError(f"cu_seq_lens_k={cu_k.tolist()} does not give every segment its own keys")
    elif CU_SEQ_LENS_K in batch and not torch.equal(batch[CU_SEQ_LENS_K].to(cu.dtype), cu):
        raise IsolationError("cu_seq_lens_k differs from cu_seq_lens_q in a self-attention batch")
    longest = int(lengths.max())
    for key, length in ((MAX_LENGTH_Q, longest), (MAX_LENGTH_K, int((lengths + before).max()))):
        if key in batch and int(batch[key]) < length:
            raise IsolationError(f"{key}={batch[key]} < the longest example ({length} tokens)")
    if POSITION_IDS not in batch:
        raise IsolationError("a packed batch needs position_ids restarting at 0 for every example")
    starts = (cu[:-1] - before).long()  # a continuation's positions go on after its prompt's
    expected = torch.arange(total) - torch.repeat_interleave(starts, lengths.long(), output_size=total)
    if not torch.equal(batch[POSITION_IDS][0].long(), expected):
        raise IsolationError(
            "position_ids do not restart at 0 at every cu_seq_lens boundary: each example would see shifted "
            "positions. Build packed batches with PackedCollator"
        )
