"""Properties every sampler keeps, over many random and adversarial length lists, seeds and rank counts."""

from __future__ import annotations

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

MAX_TOKENS = 64
BATCH = 3

SAMPLERS = {
    "random": (RandomBatchSampler, {"batch_size": BATCH}),
    "grouped": (LengthGroupedSampler, {"batch_size": BATCH, "mega_batch_mult": 4}),
    "best_fit": (BestFitPackingSampler, {"max_tokens": MAX_TOKENS}),
    "sequential": (SequentialPackingSampler, {"max_tokens": MAX_TOKENS, "shuffle": True}),
    "fixed": (FixedLengthPackingSampler, {"max_tokens": MAX_TOKENS}),
    "fixed_rows": (FixedLengthPackingSampler, {"max_tokens": MAX_TOKENS // 2, "rows_per_step": 2}),
    "multipack": (MultipackSampler, {"max_tokens": MAX_TOKENS, "cost_coefficients": (1.0, 1.0)}),
}


def length_cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    cases = {
        "empty": np.zeros(0, dtype=np.int64),
        "single": np.array([17]),
        "single_full": np.array([MAX_TOKENS]),
        "all_max": np.full(23, MAX_TOKENS),
        "all_one": np.ones(40, dtype=np.int64),
        "pow2_plus1": np.array([2**k + 1 for k in range(6)] * 7),  # 2, 3, 5, 9, 17, 33 (trl#3887)
        "pow2": np.array([2**k for k in range(7)] * 5),  # up to 64 = MAX_TOKENS
        "with_zeros": rng.integers(0, 8, 50),
        "few": np.array([30, 40, 50]),  # fewer packs than most rank counts
    }
    for i in range(8):
        n = int(rng.integers(1, 400))
        cases[f"lognormal{i}"] = np.clip(rng.lognormal(np.log(12), 1.0, n), 1, MAX_TOKENS).astype(np.int64)
        cases[f"uniform{i}"] = rng.integers(1, MAX_TOKENS + 1, int(rng.integers(1, 200)))
    return cases


CASES = length_cases()


def make(name: str, lengths: np.ndarray, **kwargs):
    cls, init = SAMPLERS[name]
    return cls(lengths, **{**init, **kwargs})


def run_epoch(name, lengths, world_size, epoch=0, **kwargs) -> list[list[list]]:
    """Per rank, the batches it yields in ``epoch``."""
    out = []
    for rank in range(world_size):
        sampler = make(name, lengths, rank=rank, world_size=world_size, **kwargs)
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        out.append(batches)
    return out


def token_counts(batch, lengths) -> int:
    return (
        sum(stop - start for _, start, stop in batch)
        if batch and isinstance(batch[0], tuple)
        else int(sum(lengths[i] for i in batch))
    )


def check_coverage(name, lengths, batches_per_rank, drop_last):
    """Every example (every token, for fixed-length rows) at most once; exactly once unless drop_last."""
    flat = [item for batches in batches_per_rank for batch in batches for item in batch]
    if name.startswith("fixed"):
        pieces: dict[int, list[tuple[int, int]]] = {}
        for index, start, stop in flat:
            assert 0 <= start < stop <= lengths[index]
            pieces.setdefault(index, []).append((start, stop))
        for index, spans in pieces.items():
            spans.sort()
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"token of example {index} twice"
            if not drop_last:  # contiguous cover of [0, L)
                assert spans[0][0] == 0 and spans[-1][1] == lengths[index]
                assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        if not drop_last:
            assert set(pieces) == set(np.flatnonzero(lengths > 0).tolist())
        return
    counts = Counter(flat)
    assert all(c == 1 for c in counts.values()), "an example appears twice"
    assert all(0 <= i < len(lengths) for i in counts)
    if not drop_last:
        assert len(counts) == len(lengths)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_epoch_properties(name, case, world_size, drop_last):
    lengths = CASES[case]
    for seed in (0, 7):
        per_rank = run_epoch(name, lengths, world_size, epoch=seed % 3, seed=seed, drop_last=drop_last)
        # Identical step counts on every rank, equal to len().
        assert len({len(b) for b in per_rank}) == 1
        check_coverage(name, lengths, per_rank, drop_last)
        steps = len(per_rank[0])
        plan = make(name, lengths, seed=seed, drop_last=drop_last, world_size=world_size).plan(seed % 3)
        n_packs = len(plan)
        assert steps == (n_packs // world_size if drop_last else -(-n_packs // world_size))
        n_empty = sum(not batch for batches in per_rank for batch in batches)
        assert n_empty == (0 if drop_last else steps * world_size - n_packs)
        for batches in per_rank:
            for batch in batches:
                if name in ("random", "grouped"):
                    assert len(batch) <= BATCH and (len(batch) == BATCH or not drop_last)
                else:
                    assert token_counts(batch, lengths) <= MAX_TOKENS
        if name.startswith("fixed"):  # rows are exactly full, except the last row of the epoch
            rows = plan.tokens_per_pack()
            assert (rows[:-1] == MAX_TOKENS).all()
            if drop_last and len(rows):
                assert rows[-1] == MAX_TOKENS
        # Deterministic per (seed, epoch): a fresh run gives the same batches.
        assert run_epoch(name, lengths, world_size, epoch=seed % 3, seed=seed, drop_last=drop_last) == per_rank


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_plan_statistics(name):
    lengths = CASES["lognormal0"]
    plan = make(name, lengths).plan(0)
    packs = plan.packs()
    assert len(packs) == len(plan)
    assert plan.examples_per_pack().tolist() == [len(p) for p in packs]
    tokens = [token_counts(p, lengths) for p in packs]
    assert plan.tokens_per_pack().tolist() == tokens
    assert plan.tokens_per_pack().sum() == lengths.sum()
    squares = [sum((s[2] - s[1]) ** 2 if isinstance(s, tuple) else int(lengths[s]) ** 2 for s in p) for p in packs]
    assert plan.sq_tokens_per_pack().tolist() == squares


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_shuffle_changes_plan_across_epochs(name):
    lengths = np.clip(np.random.default_rng(0).lognormal(np.log(12), 1.0, 500), 1, MAX_TOKENS).astype(np.int64)
    sampler = make(name, lengths, shuffle=True)
    epoch0 = sampler.plan(0).packs()
    assert sampler.plan(1).packs() != epoch0
    assert make(name, lengths, shuffle=True, seed=1).plan(0).packs() != epoch0
    assert sampler.plan(0).packs() == epoch0  # cached or not, same plan
    fixed = make(name, lengths, shuffle=False)
    assert fixed.plan(0).packs() == fixed.plan(1).packs()


@pytest.mark.parametrize("name", ["random", "grouped", "best_fit", "fixed", "multipack"])
def test_step_count_constant_across_epochs(name):
    """Only shuffled next-fit changes its pack count with the order; the others keep len() fixed."""
    lengths = CASES["lognormal2"]
    sampler = make(name, lengths, world_size=3)
    counts = set()
    for epoch in range(6):
        sampler.set_epoch(epoch)
        counts.add(len(sampler))
    assert len(counts) == 1


def test_best_fit_ties_vary_across_epochs():
    """All lengths equal: only the tie-breaking can change, and it must."""
    sampler = BestFitPackingSampler(np.full(100, 16), max_tokens=MAX_TOKENS)
    first = [sorted(p) for p in sampler.plan(0).packs()]
    assert all(len(p) == 4 for p in first)
    assert sorted(first) != sorted(sorted(p) for p in sampler.plan(1).packs())


def test_iteration_follows_set_epoch():
    lengths = CASES["lognormal1"]
    sampler = BestFitPackingSampler(lengths, MAX_TOKENS)
    sampler.set_epoch(3)
    assert list(sampler) == sampler.plan(3).packs()
    assert list(sampler) == sampler.plan(3).packs()  # a second pass over the same epoch starts over
