"""Segment boundaries of a packed row: where each example starts, and the examples grouped by length.

    cu = boundaries_from_positions(position_ids, 1, T, device)   # [0, L1, L1+L2, ..., T] from restarting positions
    groups, inverse = length_groups(cu)                           # one batched call per distinct length

Attention (`kernels.py`, the per-example backend) and the non-attention mixers (`mixers.py`) both cut a row at
these boundaries; every layer of one forward receives the same `cu_seq_lens` tensor, so what is derived from it is
built once per forward (`memo`), not once per layer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch


class LengthGroup(NamedTuple):
    """The examples of one length in a packed row: their length, start offsets, and flat token index (m * L,)
    (None for a single example, which is a view of the row)."""

    length: int
    starts: list[int]
    index: torch.Tensor | None


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

    return memo(_POSITION_CACHE, position_ids, (batch, seq), build)


def memo(store: dict, key: torch.Tensor, variant: object, build: Callable):
    """Memo keyed on one tensor's identity: every layer of one forward receives the same cu_seq_lens object, so
    whatever depends on it only (index plans, masks) is built once per forward, not once per layer."""
    ref = store.get("ref")
    if ref is None or ref() is not key:
        store.clear()
        store["ref"] = weakref.ref(key)
    if variant not in store:
        store[variant] = build()
    return store[variant]


def seq_idx(cu: torch.Tensor, tokens: int) -> torch.Tensor:
    """The (1, T) int32 example index of every token (mamba-ssm's and causal-conv1d's `seq_idx`).

    cu [0 3 5 9] -> seq_idx [[0 0 0 1 1 2 2 2 2]]
    """

    def build() -> torch.Tensor:
        lengths = (cu[1:] - cu[:-1]).long()
        ids = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths, output_size=tokens)
        return ids.to(torch.int32)[None]

    return memo(_SEQ_IDX_CACHE, cu, ("seq_idx", tokens), build)


_SEQ_IDX_CACHE: dict = {}


_PLAN_CACHE: dict = {}


def length_groups(cu: torch.Tensor) -> tuple[list[LengthGroup], torch.Tensor | None]:
    """Group the examples by length (`LengthGroup`s) and the permutation
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
            groups.append(LengthGroup(length, starts, index.reshape(-1).to(cu.device) if len(starts) > 1 else None))
        perm = torch.cat(order)
        in_order = bool(torch.equal(perm, torch.arange(len(perm))))
        inverse = None if in_order else torch.argsort(perm).to(cu.device)
        return groups, inverse

    return memo(_PLAN_CACHE, cu, "groups", build)
