"""`max_tokens: auto` / `batch_size: auto` on the sampler side: the candidates a sampler offers, the pack it asks
the run to size, and the value it then plans with (the memory estimate itself is tested in tests/models)."""

from __future__ import annotations

import numpy as np
import pytest

from lit_packing.errors import ConfigError
from lit_packing.samplers import (
    BestFitPackingSampler,
    LengthGroupedSampler,
    MultipackSampler,
    RandomBatchSampler,
    RunContext,
    SequentialPackingSampler,
)

LENGTHS = np.array([700, 1500, 30, 2100, 400, 900, 64, 1200] * 10, dtype=np.int64)


class TokenLimit:
    """A run whose device holds `limit` tokens of a pack (memory grows with slots and attention pairs)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.asked = limit, []

    def __call__(self, setting, candidates, worst_pack):
        self.asked.append((setting, list(candidates), [worst_pack(c) for c in candidates]))
        fitting = [c for c in candidates if worst_pack(c).tokens.sum() + worst_pack(c).sq_tokens_per_pack()[0] / 1e4
                   <= self.limit]  # fmt: skip
        return fitting[-1] if fitting else None


@pytest.mark.parametrize("factory", [BestFitPackingSampler, SequentialPackingSampler, MultipackSampler])
def test_max_tokens_auto_takes_the_largest_fitting_multiple_of_the_granule(factory):
    run = TokenLimit(9_000)
    sampler = factory(LENGTHS, max_tokens="auto", max_tokens_granule=512, max_tokens_cap=16_384)
    sampler.connect(RunContext(largest_fitting=run))
    ((setting, candidates, packs),) = run.asked
    assert setting == "max_tokens"
    assert candidates == list(range(2_560, 16_384 + 1, 512))  # from the longest example (2,100) up, by 512
    for budget, pack in zip(candidates, packs):
        assert pack.tokens.sum() == budget and pack.tokens.max() == 2_100  # whole longest examples, then the rest
    chosen = max(c for c, p in zip(candidates, packs) if p.tokens.sum() + p.sq_tokens_per_pack()[0] / 1e4 <= 9_000)
    assert sampler.max_tokens == chosen == sampler.chosen["max_tokens"] and sampler.auto is None
    assert sampler.plan().tokens_per_pack().max() <= chosen


@pytest.mark.parametrize("factory", [RandomBatchSampler, LengthGroupedSampler])
def test_batch_size_auto_sizes_a_batch_of_the_longest_examples(factory):
    run = TokenLimit(20_000)
    sampler = factory(LENGTHS, batch_size="auto", batch_size_cap=32)
    sampler.connect(RunContext(largest_fitting=run))
    ((setting, candidates, packs),) = run.asked
    assert setting == "batch_size" and candidates == list(range(1, 33))
    assert all(p.tokens.tolist() == [2_100] * b for b, p in zip(candidates, packs))
    expected = int(20_000 // (2_100 + 2_100**2 / 1e4))  # b x 2,100 tokens + b x 2,100^2 pairs / 1e4 <= 20,000
    assert sampler.batch_size == sampler.chosen["batch_size"] == expected == 7
    assert max(len(p) for p in sampler.plan().packs()) == expected


def test_auto_without_a_run_that_can_size_it_is_refused():
    sampler = BestFitPackingSampler(LENGTHS, max_tokens="auto")
    with pytest.raises(ConfigError, match="^max_tokens: auto is chosen when the sampler is connected to a run"):
        sampler.plan()  # not connected yet
    with pytest.raises(ConfigError, match="only a run with a model can estimate; give max_tokens a number"):
        sampler.connect(RunContext(seed=1))


def test_auto_when_nothing_fits_names_the_knobs():
    sampler = BestFitPackingSampler(LENGTHS, max_tokens="auto")
    with pytest.raises(
        ConfigError,
        match=r"even the smallest step \(max_tokens=3,072\) is predicted not to fit.*model.gradient_checkpointing=true",
    ):
        sampler.connect(RunContext(largest_fitting=TokenLimit(10)))


def test_a_cap_below_the_longest_example_is_refused():
    sampler = BestFitPackingSampler(LENGTHS, max_tokens="auto", max_tokens_cap=2_048)
    with pytest.raises(ConfigError, match=r"^max_tokens_cap: 2,048 is below the longest example \(2,100 tokens"):
        sampler.connect(RunContext(largest_fitting=TokenLimit(10**9)))
