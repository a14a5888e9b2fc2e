"""Fixed-length packing: concatenate the example stream and cut it into rows of exactly ``max_tokens`` tokens.

The paper's "fixed-length packing" variant: far fewer steps per epoch, examples split across rows.
Usage: ``FixedLengthPackingSampler(lengths, max_tokens=2048)``; the dataset's ``__getitem__`` receives
``(index, start, stop)`` tuples and returns that token slice of the example.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lit_packing.errors import check_range
from lit_packing.samplers.base import PackPlan, PlannedBatchSampler


def fixed_length_rows(sizes: np.ndarray, max_tokens: int, drop_last: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Cut the concatenation of items with ``sizes`` into rows of ``max_tokens`` tokens, vectorised.

    Returns CSR rows ``(pieces, offsets)``: ``pieces`` (k, 3) int64 ``(item, start, stop)`` in stream order. Every
    token is in exactly one piece; the last row is shorter unless ``drop_last`` drops it. Zero-length items have no
    token and hence no piece.

    Worked example: sizes ``[5, 3, 6]``, ``max_tokens=4`` (a 14-token stream) -> rows
    ``[(0, 0, 4)]``, ``[(0, 4, 5), (1, 0, 3)]``, ``[(2, 0, 4)]``, ``[(2, 4, 6)]``.

    >>> pieces, offsets = fixed_length_rows(np.array([5, 3, 6]), 4)
    >>> pieces.tolist(), offsets.tolist()
    ([[0, 0, 4], [0, 4, 5], [1, 0, 3], [2, 0, 4], [2, 4, 6]], [0, 1, 3, 4, 5])
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    total = int(ends[-1]) if len(ends) else 0
    n_rows = total // max_tokens if drop_last else -(-total // max_tokens)
    # An item of tokens [s, e) has a piece in every row from s // max_tokens to (e - 1) // max_tokens.
    first_row = starts // max_tokens
    counts = np.where(sizes > 0, (ends - 1) // max_tokens - first_row + 1, 0)
    item = np.repeat(np.arange(len(sizes), dtype=np.int64), counts)
    row = first_row[item] + np.arange(len(item)) - np.repeat(np.cumsum(counts) - counts, counts)
    keep = np.searchsorted(row, n_rows)  # rows are non-decreasing: the pieces of dropped rows are a suffix
    item, row = item[:keep], row[:keep]
    lo = np.maximum(starts[item], row * max_tokens) - starts[item]
    hi = np.minimum(ends[item], (row + 1) * max_tokens) - starts[item]
    offsets = np.searchsorted(row, np.arange(n_rows + 1))
    return np.stack([item, lo, hi], axis=1), offsets.astype(np.int64)


class FixedLengthPackingSampler(PlannedBatchSampler):
    """Rows of exactly ``max_tokens`` tokens cut from the (shuffled) stream of examples; yields token slices.

    Each step yields a list of ``(index, start, stop)`` tuples: ``rows_per_step`` consecutive rows whose slices add
    up to ``rows_per_step * max_tokens`` tokens (the last step of the epoch may be shorter unless ``drop_last``).
    Every token of every example is yielded exactly once per epoch. See ``fixed_length_rows`` for a worked example.
    The paper's setting, 4 rows of 4,096 per step, is ``max_tokens=4096, rows_per_step=4``; with
    ``PackedCollator(isolate=False, row_length=4096)`` attention then spans each row (its contaminated variant).

    Args:
        lengths: (n,) tokens per example; examples longer than ``max_tokens`` are simply split over several rows.
        max_tokens: tokens per row.
        rows_per_step: rows flattened into one step.
        **common: ``seed``, ``shuffle``, ``drop_last``, ``rank``, ``world_size``, ``accumulate``: see
            ``PlannedBatchSampler``.
    """

    def __init__(self, lengths: np.ndarray, max_tokens: int = 2048, rows_per_step: int = 1, **common: Any) -> None:
        check_range("max_tokens", max_tokens, 1)
        check_range("rows_per_step", rows_per_step, 1)
        self.max_tokens = max_tokens
        self.rows_per_step = rows_per_step
        super().__init__(lengths, **common)

    def _build_plan(self, epoch: int, rng: np.random.Generator) -> PackPlan:
        order = self._order(rng)
        pieces, offsets = fixed_length_rows(self.lengths[order], self.max_tokens, self.drop_last)
        pieces[:, 0] = order[pieces[:, 0]]
        n_rows = len(offsets) - 1
        full_steps, rest = divmod(n_rows, self.rows_per_step)
        steps = full_steps + (1 if rest and not self.drop_last else 0)
        offsets = offsets[np.minimum(np.arange(steps + 1) * self.rows_per_step, n_rows)]
        pieces = pieces[: offsets[-1]]
        return PackPlan(pieces, offsets, pieces[:, 2] - pieces[:, 1], self.max_tokens * self.rows_per_step)
