"""Length-grouped mini-batches: examples of similar length share a batch, so a padded batch wastes little.

Usage: ``LengthGroupedSampler(lengths, batch_size=8, mega_batch_mult=50)``.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from lit_packing.errors import check_range
from lit_packing.samplers.base import PackPlan
from lit_packing.samplers.random_batch import RandomBatchSampler, batch_offsets


class LengthGroupedSampler(RandomBatchSampler):
    """Random mega-batches of ``batch_size * mega_batch_mult`` examples, each sorted by length, cut into batches.

    As Hugging Face's ``group_by_length``: the order is shuffled, cut into mega-batches, each mega-batch sorted by
    decreasing length and split into batches of ``batch_size``; then the batch order is shuffled and the batch
    holding the longest example is moved first, so an out-of-memory shows at the first step.

    Worked example: lengths ``[5, 9, 2, 7, 4, 1]``, ``batch_size=2, mega_batch_mult=2, shuffle=False`` ->
    mega-batches ``[0, 1, 2, 3]`` and ``[4, 5]`` -> sorted ``[1, 3, 0, 2]``, ``[4, 5]`` -> packs
    ``[[1, 3], [0, 2], [4, 5]]``.

    >>> list(LengthGroupedSampler([5, 9, 2, 7, 4, 1], batch_size=2, mega_batch_mult=2, shuffle=False))
    [[1, 3], [0, 2], [4, 5]]

    Args:
        lengths: (n,) tokens per example.
        batch_size: examples per step per rank, or ``auto`` (with ``batch_size_cap``): see ``RandomBatchSampler``.
        mega_batch_mult: mega-batch size in batches; larger groups lengths more tightly but less randomly.
        **common: ``seed``, ``shuffle``, ``drop_last``, ``rank``, ``world_size``, ``accumulate``: see
            ``PlannedBatchSampler``.
    """

    def __init__(
        self, lengths: np.ndarray, batch_size: int | Literal["auto"] = 8, mega_batch_mult: int = 50, **common: Any
    ) -> None:
        check_range("mega_batch_mult", mega_batch_mult, 1)
        self.mega_batch_mult = mega_batch_mult
        super().__init__(lengths, batch_size, **common)

    def _build_plan(self, epoch: int, rng: np.random.Generator) -> PackPlan:
        order = self._order(rng)
        # Mega-batches start at multiples of batch_size, so batches never straddle two of them.
        mega = np.arange(len(order)) // (self.batch_size * self.mega_batch_mult)
        order = order[np.lexsort((-self.lengths[order], mega))]
        offsets = batch_offsets(len(order), self.batch_size, self.drop_last)
        if self.shuffle and len(offsets) > 1:
            batch_order = rng.permutation(len(offsets) - 1)
            longest = int(np.argmax(self.lengths[order])) // self.batch_size  # batch of the longest example
            if longest < len(batch_order):
                first = int(np.flatnonzero(batch_order == longest)[0])
                batch_order[[0, first]] = batch_order[[first, 0]]
            order, offsets = reorder_packs(order, offsets, batch_order)
        return PackPlan(order, offsets, self.lengths[order])


def reorder_packs(items: np.ndarray, offsets: np.ndarray, pack_order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR packs rearranged so that new pack ``k`` is old pack ``pack_order[k]``."""
    sizes = np.diff(offsets)[pack_order]
    new_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    # Index of every item of every selected pack, in the new order.
    src = np.repeat(offsets[:-1][pack_order] - new_offsets[:-1], sizes) + np.arange(new_offsets[-1])
    return items[src], new_offsets
