"""Fixed-size batches: random order and length grouping, on worked examples."""

from __future__ import annotations

import numpy as np

from lit_packing.samplers import LengthGroupedSampler, RandomBatchSampler


def test_random_batches_worked_example():
    assert list(RandomBatchSampler([5, 9, 2, 7, 4], batch_size=2, shuffle=False)) == [[0, 1], [2, 3], [4]]
    assert list(RandomBatchSampler([5, 9, 2, 7, 4], batch_size=2, shuffle=False, drop_last=True)) == [[0, 1], [2, 3]]


def test_random_batches_per_rank():
    """Each rank gets batch_size examples per step; the missing last batch of rank 1 is an empty pack."""
    ranks = [list(RandomBatchSampler(range(10), 2, shuffle=False, rank=r, world_size=2)) for r in range(2)]
    assert ranks == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], []]]


def test_length_grouped_worked_example():
    sampler = LengthGroupedSampler([5, 9, 2, 7, 4, 1], batch_size=2, mega_batch_mult=2, shuffle=False)
    assert list(sampler) == [[1, 3], [0, 2], [4, 5]]


def test_length_grouped_groups_lengths_and_puts_longest_first():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2000, 4000)
    grouped = LengthGroupedSampler(lengths, batch_size=8, mega_batch_mult=50)
    random = RandomBatchSampler(lengths, batch_size=8)
    for epoch in range(3):
        grouped.set_epoch(epoch)
        batches = list(grouped)
        assert lengths[batches[0]].max() == lengths.max()
        padded = sum(len(b) * lengths[b].max() for b in batches)
        padded_random = sum(len(b) * lengths[b].max() for b in random)
        assert padded < 0.6 * padded_random  # grouping removes most of the padding
        for b in batches:  # each batch sorted by decreasing length
            assert (np.diff(lengths[b]) <= 0).all()
