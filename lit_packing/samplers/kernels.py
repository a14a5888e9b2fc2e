"""Numba kernels for the packing samplers: counting sort, bin packing (best fit, next fit), dealing packs to ranks.

The only module that imports numba. Every kernel is plain Python compiled with ``njit(cache=True)`` (compiled once
per install, then loaded from ``__pycache__``); the uncompiled function stays reachable as ``kernel.py_func`` and the
tests check both agree.

Usage:

>>> bin_of, n_bins = best_fit_decreasing(np.array([6, 5, 4, 3, 2]), 10)
>>> bin_of.tolist(), n_bins
([0, 1, 0, 1, 1], 2)
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True)
def counting_sort(keys: np.ndarray, n_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """Stable sort of small non-negative integer keys in O(n + n_keys).

    Args:
        keys: (n,) int64, every value in ``[0, n_keys)``.
        n_keys: number of distinct key values.

    Returns:
        ``perm`` (n,) int64 with ``keys[perm]`` sorted and equal keys in input order, and ``offsets``
        (n_keys + 1,) int64: key ``k`` occupies ``perm[offsets[k]:offsets[k + 1]]``.
    """
    n = keys.shape[0]
    offsets = np.zeros(n_keys + 1, dtype=np.int64)
    for i in range(n):
        offsets[keys[i] + 1] += 1
    for k in range(n_keys):
        offsets[k + 1] += offsets[k]
    cursor = offsets[:-1].copy()
    perm = np.empty(n, dtype=np.int64)
    for i in range(n):
        k = keys[i]
        perm[cursor[k]] = i
        cursor[k] += 1
    return perm, offsets


@numba.njit(cache=True)
def best_fit_decreasing(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Best-fit bin packing of items already sorted by decreasing size, in O(n log capacity).

    Each item goes to the open bin with the least remaining room that still fits it; a new bin opens only when none
    does. Bins are kept in per-remaining-room stacks (``head``/``below``: linked lists of bin ids, so equal-room
    ties go to the most recently touched bin) and a segment tree over rooms ``0..capacity`` answers "smallest
    non-empty room >= size". The tree has a leaf for every room including ``capacity`` itself; TRL's packer once
    stopped packing at sizes 2^k+1 by mis-sizing its tree (https://github.com/huggingface/trl/issues/3887).

    Args:
        sizes: (n,) int64, non-increasing, each in ``[0, capacity]``.
        capacity: room of an empty bin (max_tokens).

    Returns:
        ``bin_of`` (n,) int64 (bins numbered in opening order) and the number of bins.
    """
    n = sizes.shape[0]
    leaves = 1
    while leaves < capacity + 1:
        leaves *= 2
    tree = np.zeros(2 * leaves, dtype=np.uint8)  # tree[i] = 1 if any room in node i's range has a bin
    head = np.full(capacity + 1, -1, dtype=np.int64)  # head[room] = top bin of that room's stack, -1 if none
    below = np.empty(n, dtype=np.int64)  # below[bin] = next bin down the same stack
    room = np.empty(n, dtype=np.int64)
    bin_of = np.empty(n, dtype=np.int64)
    n_bins = 0
    for i in range(n):
        size = sizes[i]
        # Leftmost non-empty leaf at index >= size: climb until a right sibling holds a bin, then descend left-first.
        node = leaves + size
        found = tree[node] == 1
        while not found and node > 1:
            if node % 2 == 0 and tree[node + 1] == 1:
                node += 1
                found = True
            else:
                node //= 2
        if found:
            while node < leaves:
                node *= 2
                if tree[node] == 0:
                    node += 1
            b = head[node - leaves]
            _pop(tree, head, below, leaves, node - leaves)
        else:
            b = n_bins
            n_bins += 1
            room[b] = capacity
        bin_of[i] = b
        room[b] -= size
        _push(tree, head, below, leaves, room[b], b)
    return bin_of, n_bins


@numba.njit(cache=True, inline="always")
def _push(tree, head, below, leaves, r, b):
    below[b] = head[r]
    head[r] = b
    node = leaves + r
    while node >= 1 and tree[node] == 0:
        tree[node] = 1
        node //= 2


@numba.njit(cache=True, inline="always")
def _pop(tree, head, below, leaves, r):
    head[r] = below[head[r]]
    if head[r] != -1:
        return
    node = leaves + r
    tree[node] = 0
    node //= 2
    while node >= 1:
        v = tree[2 * node] | tree[2 * node + 1]
        if tree[node] == v:
            break
        tree[node] = v
        node //= 2


@numba.njit(cache=True)
def next_fit(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """Next-fit bin packing in the given order: close the current bin when the next item does not fit.

    Args:
        sizes: (n,) int64, each in ``[0, capacity]``.
        capacity: room of an empty bin (max_tokens).

    Returns:
        ``offsets`` (n_bins + 1,) int64: bin ``k`` holds items ``offsets[k]:offsets[k + 1]``.
    """
    n = sizes.shape[0]
    offsets = np.empty(n + 1, dtype=np.int64)
    offsets[0] = 0
    n_bins = 0
    used = 0
    for i in range(n):
        if n_bins == 0 or used + sizes[i] > capacity:
            offsets[n_bins] = i
            n_bins += 1
            used = 0
        used += sizes[i]
    offsets[n_bins] = n
    return offsets[: n_bins + 1].copy()


@numba.njit(cache=True)
def balance_steps(costs: np.ndarray, ranks: int, per_rank: int) -> np.ndarray:
    """Deal items sorted by decreasing cost to ranks, one optimizer step at a time, evening out each step's load.

    Consecutive items form a step of ``ranks * per_rank`` (the last step takes what is left, ``rows =
    ceil(left / ranks)`` per rank). Within a step, longest-processing-time first with a cardinality cap: each item
    goes to the least loaded rank (fewest items on ties) that still has a free micro-step, so a rank's items come
    out in decreasing cost and every micro-step of the step is balanced too. In the last step every rank gets
    ``rows`` or ``rows - 1`` items, so empty slots are only in the last micro-step, as with round-robin.

    Args:
        costs: (n,) float64, non-increasing.
        ranks: number of ranks (world size).
        per_rank: micro-steps per optimizer step (gradient accumulation).

    Returns:
        (micro_steps, ranks) int64 positions into ``costs``, -1 where a rank has nothing left in the last step.

    Example: costs ``[9, 8, 2, 1]``, 2 ranks, 2 micro-steps -> ``[[0, 1], [3, 2]]``: 9 + 1 and 8 + 2.

    >>> balance_steps(np.array([9.0, 8.0, 2.0, 1.0]), 2, 2).tolist()
    [[0, 1], [3, 2]]
    """
    n = costs.shape[0]
    group = ranks * per_rank
    n_rows = (n // group) * per_rank + (n % group + ranks - 1) // ranks
    out = np.full((n_rows, ranks), -1, dtype=np.int64)
    load = np.zeros(ranks, dtype=np.float64)
    count = np.zeros(ranks, dtype=np.int64)
    row0 = 0
    for start in range(0, n, group):
        stop = min(start + group, n)
        rows = per_rank if stop - start == group else (stop - start + ranks - 1) // ranks
        load[:] = 0.0
        count[:] = 0
        need = ranks * (rows - 1)  # slots that must be filled so that no rank has two empty micro-steps
        for i in range(start, stop):
            spare = stop - i > need  # when no item is spare, only ranks below rows - 1 may take one
            best = -1
            for r in range(ranks):
                if count[r] >= rows or not (spare or count[r] < rows - 1):
                    continue
                if best < 0 or load[r] < load[best] or (load[r] == load[best] and count[r] < count[best]):
                    best = r
            if count[best] < rows - 1:
                need -= 1
            out[row0 + count[best], best] = i
            count[best] += 1
            load[best] += costs[i]
        row0 += rows
    return out
