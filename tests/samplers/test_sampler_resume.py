"""Mid-epoch resume: a sampler restored from ``state_dict()`` yields exactly the batches not yet yielded."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from lit_packing.samplers import (
    BestFitPackingSampler,
    FixedLengthPackingSampler,
    LengthGroupedSampler,
    MultipackSampler,
    RandomBatchSampler,
    SequentialPackingSampler,
)

FACTORIES = {
    "random": lambda lengths, **kw: RandomBatchSampler(lengths, batch_size=4, **kw),
    "grouped": lambda lengths, **kw: LengthGroupedSampler(lengths, batch_size=4, mega_batch_mult=3, **kw),
    "best_fit": lambda lengths, **kw: BestFitPackingSampler(lengths, max_tokens=128, **kw),
    "sequential": lambda lengths, **kw: SequentialPackingSampler(lengths, max_tokens=128, shuffle=True, **kw),
    "fixed": lambda lengths, **kw: FixedLengthPackingSampler(lengths, max_tokens=128, **kw),
    "multipack": lambda lengths, **kw: MultipackSampler(lengths, max_tokens=128, cost_coefficients=(1.0, 1.0), **kw),
}
LENGTHS = np.clip(np.random.default_rng(5).lognormal(np.log(30), 1.0, 300), 1, 128).astype(np.int64)


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_resume_mid_epoch(name, world_size):
    make = FACTORIES[name]
    for rank, epoch in itertools.product(range(world_size), (0, 2)):
        sampler = make(LENGTHS, seed=11, rank=rank, world_size=world_size)
        sampler.set_epoch(epoch)
        full = list(sampler)
        assert len(full) > 4
        for k in (0, 1, len(full) // 2, len(full) - 1, len(full)):
            sampler.set_epoch(epoch)
            it = iter(sampler)
            head = [next(it) for _ in range(k)]
            state = sampler.state_dict()
            assert state == {"epoch": epoch, "seed": 11, "batches_yielded": k}
            assert head == full[:k]
            # A FRESH sampler (different seed in its config, epoch never set) restored from the state.
            fresh = make(LENGTHS, seed=0, rank=rank, world_size=world_size)
            fresh.load_state_dict(state)
            assert fresh.state_dict() == state
            fresh.set_epoch(epoch)  # Lightning sets the (same) epoch before iterating: the resume point survives
            assert list(fresh) == full[k:]
            assert list(fresh) == full  # the resume point is used once; the next pass is a whole epoch
            # The interrupted sampler itself, restored in place.
            sampler.load_state_dict(state)
            assert list(sampler) == full[k:]


def test_state_counts_yielded_batches():
    sampler = BestFitPackingSampler(LENGTHS, max_tokens=128)
    assert sampler.state_dict()["batches_yielded"] == 0
    it = iter(sampler)
    next(it), next(it)
    assert sampler.state_dict() == {"epoch": 0, "seed": 0, "batches_yielded": 2}
    list(it)
    assert sampler.state_dict()["batches_yielded"] == len(sampler)
    sampler.set_epoch(1)
    assert sampler.state_dict() == {"epoch": 1, "seed": 0, "batches_yielded": 0}


def test_resume_point_dropped_on_new_epoch():
    sampler = BestFitPackingSampler(LENGTHS, max_tokens=128)
    sampler.load_state_dict({"epoch": 0, "seed": 0, "batches_yielded": 5})
    sampler.set_epoch(1)
    assert list(sampler) == sampler.plan(1).packs()


def test_resume_with_ranks_stays_in_lockstep():
    """Every rank restored from the same state yields the same number of remaining batches."""
    state = {"epoch": 1, "seed": 3, "batches_yielded": 4}
    remaining = []
    for rank in range(4):
        sampler = BestFitPackingSampler(LENGTHS, max_tokens=128, rank=rank, world_size=4)
        sampler.load_state_dict(state)
        remaining.append(len(list(sampler)))
    assert len(set(remaining)) == 1 and remaining[0] == len(sampler) - 4
