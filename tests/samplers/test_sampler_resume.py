"""Resume: a sampler restored from ``state_dict()`` trains exactly the batches not yet trained -- on the same world
size, or on another one (every example still exactly once) -- and refuses a position from another plan."""

from __future__ import annotations

import itertools
from collections import Counter

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
            assert (state["epoch"], state["seed"], state["steps_done"]) == (epoch, 11, k)
            assert head == full[:k]
            fresh = make(LENGTHS, seed=11, rank=rank, world_size=world_size)  # a new process, epoch never set
            fresh.load_state_dict(state)
            assert fresh.state_dict() == state
            fresh.set_epoch(epoch)  # Lightning sets the (same) epoch before iterating: the resume point survives
            assert len(fresh) == len(full)
            assert list(fresh) == full[k:]
            assert list(fresh) == full  # the resume point is used once; the next pass is a whole epoch
            sampler.load_state_dict(state)  # the interrupted sampler itself, restored in place
            assert list(sampler) == full[k:]


def test_state_counts_trained_not_prefetched_batches():
    """The data module passes the TRAINED count; without it the state counts batches handed out."""
    sampler = BestFitPackingSampler(LENGTHS, max_tokens=128)
    it = iter(sampler)
    next(it), next(it), next(it)
    assert sampler.state_dict()["steps_done"] == 3
    assert sampler.state_dict(steps_done=1)["steps_done"] == 1  # two were only prefetched
    fresh = BestFitPackingSampler(LENGTHS, max_tokens=128)
    fresh.load_state_dict(sampler.state_dict(steps_done=1))
    assert list(fresh) == sampler.plan().packs()[1:]


def test_resume_point_dropped_on_new_epoch():
    sampler = BestFitPackingSampler(LENGTHS, max_tokens=128)
    state = sampler.state_dict(steps_done=5)
    sampler.load_state_dict(state)
    sampler.set_epoch(1)
    assert list(sampler) == sampler.plan(1).packs()


@pytest.mark.parametrize(
    "other, match",
    [
        (lambda: BestFitPackingSampler(LENGTHS, max_tokens=128, seed=4), "seed=3 but this run uses seed=4"),
        (lambda: BestFitPackingSampler(LENGTHS[:-1], max_tokens=128, seed=3), "the dataset"),
        (lambda: BestFitPackingSampler(LENGTHS, max_tokens=256, seed=3), "^sampler: .* the sampler and its settings"),
        (lambda: SequentialPackingSampler(LENGTHS, max_tokens=128, seed=3), "another plan"),
    ],
)
def test_position_from_another_plan_is_refused(other, match):
    state = BestFitPackingSampler(LENGTHS, max_tokens=128, seed=3).state_dict(steps_done=4)
    with pytest.raises(ValueError, match=match):
        other().load_state_dict(state)


def _items(pack) -> list:
    return [tuple(item) if isinstance(item, tuple) else int(item) for item in pack]


def _epoch_items(make, world_size: int) -> Counter:
    return Counter(item for rank in range(world_size) for pack in make(rank, world_size) for item in _items(pack))


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("old_world, new_world", [(2, 1), (1, 2), (3, 4), (4, 3), (2, 5)])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_elastic_resume_trains_every_example_exactly_once(name, old_world, new_world, accumulate):
    """Killed after k steps on `old_world` ranks, resumed on `new_world`: the epoch's items, none twice, none lost."""

    def make(rank, world_size, state=None):
        sampler = FACTORIES[name](LENGTHS, seed=7, rank=rank, world_size=world_size)
        sampler.accumulate = accumulate
        sampler.set_epoch(1)
        if state is not None:
            sampler.load_state_dict(state)
        return sampler

    expected = _epoch_items(lambda r, w: list(make(r, w)), old_world)
    steps = len(make(0, old_world))
    k = (steps // 2) // accumulate * accumulate  # checkpoints fall on optimizer steps
    trained = Counter(item for r in range(old_world) for pack in list(make(r, old_world))[:k] for item in _items(pack))
    state = make(0, old_world).state_dict(steps_done=k)
    resumed = [make(r, new_world, state) for r in range(new_world)]
    lengths = {len(s) for s in resumed}
    assert len(lengths) == 1  # equal step counts on every new rank
    rest = [list(s) for s in resumed]
    assert {len(r) for r in rest} == {lengths.pop() - k}  # Lightning counts the k trained steps as done
    assert trained + Counter(item for r in rest for pack in r for item in _items(pack)) == expected
    # A second resume within the same epoch, onto yet another world size, keeps exactly-once.
    j = (len(rest[0]) // 2) // accumulate * accumulate
    second = resumed[0].state_dict(steps_done=k + j)
    trained += Counter(item for r in rest for pack in r[:j] for item in _items(pack))
    again = [make(r, 3, second) for r in range(3)]
    assert trained + Counter(item for s in again for pack in s for item in _items(pack)) == expected
    # The next epoch is planned as usual on the new world size.
    for s in again:
        s.set_epoch(2)
    assert _epoch_items(lambda r, w: list(again[r]), 3) == _epoch_items(lambda r, w: make(r, 3).plan(2).packs(), 1)


def _steps(samplers: list, accumulate: int) -> list[list]:
    """The optimizer steps the ranks' samplers yield: each the sorted items of all its micro-batches on all ranks."""
    per_rank = [list(s) for s in samplers]
    micro = len(per_rank[0])
    return [
        sorted(_items_key(item) for rows in per_rank for pack in rows[g : g + accumulate] for item in _items(pack))
        for g in range(0, micro, accumulate)
    ]


def _items_key(item) -> tuple:
    return item if isinstance(item, tuple) else (item,)


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("old, new", [((2, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 2), (4, 1)), ((1, 4), (2, 2))])
def test_resume_onto_another_split_of_the_same_global_batch_keeps_the_steps(name, old, new):
    """Killed after k optimizer steps on one layout, resumed on another with the same packs per optimizer step:
    the remaining steps are the uninterrupted run's, pack for pack, in the same order."""

    def make(rank, layout, state=None):
        sampler = FACTORIES[name](LENGTHS, seed=7, rank=rank, world_size=layout[0], accumulate=layout[1])
        sampler.set_epoch(1)
        if state is not None:
            sampler.load_state_dict(state)
        return sampler

    uninterrupted = _steps([make(r, old) for r in range(old[0])], old[1])
    assert uninterrupted == _steps([make(r, new) for r in range(new[0])], new[1])  # a fresh start on either layout
    k = len(uninterrupted) // 2
    inside = [k * old[1] + 1] if old[1] > 1 else []
    for steps_done in [k * old[1], *inside]:  # saved after step k, or inside step k + 1 (then trained again, whole)
        state = make(0, old).state_dict(steps_done=steps_done)
        resumed = [make(r, new, state) for r in range(new[0])]
        assert {s.resumed_at for s in resumed} == {k * new[1]}
        assert "the same" in resumed[0].restored and "remaining steps as planned" in resumed[0].restored
        assert _steps(resumed, new[1]) == uninterrupted[k:]
        assert -(-len(resumed[0]) // new[1]) == len(uninterrupted)  # Lightning's steps per epoch unchanged


def _tokens(item) -> int:
    return item[2] - item[1] if isinstance(item, tuple) else int(LENGTHS[item])


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_every_pack_carries_its_optimizer_steps_global_totals(name):
    """With a label counter, each micro-batch knows the label tokens of its whole optimizer step (all ranks)."""
    world, accumulate = 3, 2
    samplers = [FACTORIES[name](LENGTHS, seed=1, rank=r, world_size=world) for r in range(world)]
    for s in samplers:
        s.accumulate = accumulate
        s.label_counter = lambda items: [_tokens(item) for item in items]
    per_rank = [list(s) for s in samplers]
    for step in range(len(per_rank[0])):
        first = step // accumulate * accumulate
        group = [p for r in per_rank for p in r[first : first + accumulate]]
        tokens = sum(_tokens(item) for p in group for item in p)
        for r in range(world):
            assert per_rank[r][step].step == {"label_tokens": tokens, "sequences": sum(len(p) for p in group)}


def test_resume_point_survives_an_abandoned_iterator():
    """A DataLoader may start an iterator, prefetch from it and throw it away (persistent workers reset): the
    resume point holds until a pass completes."""
    sampler = BestFitPackingSampler(LENGTHS, max_tokens=128)
    full = list(sampler)
    sampler.load_state_dict(sampler.state_dict(steps_done=5))
    abandoned = iter(sampler)
    next(abandoned), next(abandoned)
    assert list(sampler) == full[5:]
    assert list(sampler) == full
