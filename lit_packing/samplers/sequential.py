"""Next-fit packing in data order: packs keep the examples' order, for curricula and streaming-like data.

Usage: ``SequentialPackingSampler(lengths, max_tokens=4096)``.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from lit_packing.samplers import kernels
from lit_packing.samplers.base import PackPlan, TokenBudgetSampler


class SequentialPackingSampler(TokenBudgetSampler):
    """Walk the examples in order, filling the current pack until the next example does not fit (next-fit).

    Order-preserving, so ``shuffle=False`` is the default; ``shuffle=True`` next-fits a random permutation
    (a token-budget version of random mini-batches); then the number of packs, hence ``len()``, changes slightly
    from epoch to epoch (Lightning reads it once per dataloader load). Packs are yielded in stream order: dealt
    round-robin, rank ``r`` gets packs ``r, r + world_size, ...``.

    Worked example: lengths ``[6, 5, 3, 4, 2]``, ``max_tokens=10`` -> 6 opens a pack, 5 does not fit (11 > 10) and
    opens the next, 3 joins it, 4 does not fit (12) and opens a third, 2 joins it -> packs
    ``[[0], [1, 2], [3, 4]]`` of 6, 8 and 6 tokens (best-fit-decreasing needs 2, see ``BestFitPackingSampler``).

    Args:
        lengths: (n,) tokens per example, each <= ``max_tokens``.
        max_tokens: token budget of one pack, or ``auto``: see ``TokenBudgetSampler``.
        shuffle: next-fit a seeded permutation instead of data order (default False).
        **common: ``seed``, ``drop_last``, ``rank``, ``world_size``, ``accumulate``: see ``PlannedBatchSampler``.
    """

    def __init__(
        self, lengths: np.ndarray, max_tokens: int | Literal["auto"] = 4096, *, shuffle: bool = False, **common: Any
    ) -> None:
        super().__init__(lengths, max_tokens, shuffle=shuffle, **common)

    def _build_plan(self, epoch: int, rng: np.random.Generator) -> PackPlan:
        order = self._order(rng)
        offsets = kernels.next_fit(self.lengths[order], self.max_tokens)
        return PackPlan(order, offsets, self.lengths[order], self.max_tokens)
