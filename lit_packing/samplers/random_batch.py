"""Fixed-size random mini-batches: the paper's padding baseline (padded collator) and mini-batch packing (packed).

Usage: ``RandomBatchSampler(lengths, batch_size=8)``; in YAML
``sampler: {class_path: lit_packing.samplers.RandomBatchSampler, init_args: {batch_size: 8}}``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from lit_packing.errors import check_range
from lit_packing.samplers.base import AUTO, PackPlan, PlannedBatchSampler, worst_pack


def batch_offsets(n: int, batch_size: int, drop_last: bool) -> np.ndarray:
    """Boundaries of consecutive batches of ``batch_size`` over ``n`` items; the short tail is kept unless drop_last.

    ``batch_offsets(10, 4, False)`` -> ``[0, 4, 8, 10]``; with drop_last -> ``[0, 4, 8]``.
    """
    end = n - n % batch_size if drop_last else n
    return np.append(np.arange(0, end, batch_size, dtype=np.int64), end)


class RandomBatchSampler(PlannedBatchSampler):
    """``batch_size`` examples per step on every rank, in a random order per epoch.

    Packs hold a fixed number of examples (not a token budget), so an epoch has ``ceil(n / batch_size)`` global
    batches and the same optimizer steps as padding: with the padded collator this is the paper's padding baseline,
    with the packed collator its mini-batch packing. With ``world_size`` ranks each step consumes
    ``world_size * batch_size`` examples.

    Worked example: lengths ``[5, 9, 2, 7, 4]``, ``batch_size=2, shuffle=False`` -> packs ``[[0, 1], [2, 3], [4]]``
    (``drop_last=True`` -> ``[[0, 1], [2, 3]]``).

    Args:
        lengths: (n,) tokens per example (only its size matters here).
        batch_size: examples per step per rank; ``auto``: the largest up to ``batch_size_cap`` whose batch of the
            longest examples the run's memory estimate predicts to fit the device (chosen by ``connect``).
        batch_size_cap: with ``auto``, the largest batch size tried.
        **common: ``seed``, ``shuffle``, ``drop_last``, ``rank``, ``world_size``, ``accumulate``: see
            ``PlannedBatchSampler``.
    """

    def __init__(
        self, lengths: np.ndarray, batch_size: int | Literal["auto"] = 8, batch_size_cap: int = 256, **common: Any
    ) -> None:
        if batch_size != AUTO:
            check_range("batch_size", batch_size, 1)
        check_range("batch_size_cap", batch_size_cap, 1)
        self.batch_size = batch_size
        self.batch_size_cap = batch_size_cap
        super().__init__(lengths, **common)
        if batch_size == AUTO:
            self.auto = "batch_size"

    def _auto_candidates(self) -> tuple[list[int], Callable[[int], PackPlan]]:
        longest = self._longest()
        return list(range(1, self.batch_size_cap + 1)), lambda size: worst_pack(size, longest)

    def _build_plan(self, epoch: int, rng: np.random.Generator) -> PackPlan:
        order = self._order(rng)
        return PackPlan(order, batch_offsets(len(order), self.batch_size, self.drop_last), self.lengths[order])
