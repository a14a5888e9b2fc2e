"""Decisions the ranks take together: a step that fails on some ranks stops every rank, at once, with one line.

    with agreed():                          # every rank runs the block, then learns whether any rank failed
        folder = local_folder(name)         # a download that fails on rank 1 only
    dcp.load(...)                           # reached by every rank, or by none

A collective that only some ranks reach waits for the others until the backend's timeout (NCCL: 10 minutes by
default, then a traceback per rank; gloo often raises at once). So wherever ranks may fail apart (a download, a
self-test judged on each rank's own batch, rank 0 writing files the others send to), each rank finishes its part,
the ranks exchange what failed (one all-gather of a short message), and then every rank raises: the rank that
failed its own error, the others `RankError` naming it. Outside a distributed run (or on one rank) it is a plain
`try`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from lit_packing.errors import LitPackingError


class RankError(LitPackingError):
    """Another rank failed at a step the ranks take together: its rank and its error, as one line."""


def _world(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def any_rank(failed: bool, group: Any = None) -> bool:
    """Whether `failed` holds on any rank of `group` (every rank calls it; one all-gather)."""
    if _world(group) == 1:
        return failed
    flags: list[bool] = [False] * _world(group)
    dist.all_gather_object(flags, bool(failed), group=group)
    return any(flags)


def agree(error: BaseException | None, group: Any = None) -> None:
    """Every rank of `group` calls it with what its part raised (or None); if any rank's part failed, every rank
    raises: its own error, or `RankError` with the lowest failing rank's message."""
    world = _world(group)
    if world == 1:
        if error is not None:
            raise error
        return
    mine = (
        None
        if error is None
        else str(error)
        if isinstance(error, LitPackingError)
        else f"{type(error).__name__}: {error}"
    )
    messages: list[str | None] = [None] * world
    dist.all_gather_object(messages, mine, group=group)
    if error is not None:
        raise error
    failed = next(((rank, message) for rank, message in enumerate(messages) if message is not None), None)
    if failed is not None:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        raise RankError(f"rank {ranks[failed[0]]}: {failed[1]}")


@contextlib.contextmanager
def agreed(group: Any = None) -> Iterator[None]:
    """The block on every rank of `group`, then `agree` on what it raised (the module docstring)."""
    error = None
    try:
        yield
    except Exception as raised:
        error = raised
    agree(error, group)
