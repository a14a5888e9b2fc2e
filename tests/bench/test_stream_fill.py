"""`windowed_fill`: packing a stream window by window against one plan of all of it, on seeded synthetic lengths
(no data, no model: a second or two)."""

from __future__ import annotations

import numpy as np
import pytest

from lit_packing.samplers import BestFitPackingSampler, MultipackSampler
from lit_packing.samplers.windows import windowed_fill

MAX_TOKENS = 8192


@pytest.fixture(scope="module")
def lengths():
    rng = np.random.default_rng(0)
    return np.clip(rng.lognormal(np.log(900), 0.9, 20_000), 16, 4096).astype(np.int64)


def best_fit(window):
    return BestFitPackingSampler(window, max_tokens=MAX_TOKENS)


def test_one_window_is_offline(lengths):
    for buffer_size in (len(lengths), 10 * len(lengths)):
        out = windowed_fill(lengths, buffer_size, best_fit)
        assert out["windows"] == 1
        assert (out["packs"], out["real_tokens"], out["fill"]) == (
            out["offline_packs"], out["offline_real_tokens"], out["offline_fill"]
        )  # fmt: skip
        assert out["gap"] == 0.0
        assert out["window_packs"] == [out["packs"]]


@pytest.mark.parametrize("buffer_size", [1, 64, 1000, 4096, 7777])
def test_every_example_once_and_fill_in_range(lengths, buffer_size):
    out = windowed_fill(lengths, buffer_size, best_fit)
    assert out["windows"] == -(-len(lengths) // buffer_size)
    assert out["real_tokens"] == out["offline_real_tokens"] == int(lengths.sum())
    assert 0 < out["fill"] <= out["offline_fill"] <= 1
    assert out["packs"] >= out["offline_packs"] >= -(-int(lengths.sum()) // MAX_TOKENS)
    assert out["fill"] == int(lengths.sum()) / (out["packs"] * MAX_TOKENS)
    assert sum(out["window_packs"]) == out["packs"] and len(out["window_packs"]) == out["windows"]


def test_the_gap_shrinks_as_the_buffer_grows(lengths):
    small, large = (windowed_fill(lengths, b, best_fit)["gap"] for b in (64, 4096))
    assert small > 0.01  # windows of 64 examples (~8 packs each) do lose fill
    assert large <= small + 1e-4


def test_packs_are_counted_as_planned_not_as_dealt(lengths):
    """Dealt to 8 ranks, a window's last step gets empty packs; they are not packs of the plan."""

    def multipack(window):
        return MultipackSampler(window, max_tokens=MAX_TOKENS, balance="tokens", world_size=8)

    first = multipack(lengths[:100])
    assert first.schedule().size > len(first.plan())  # dealing does add empty packs here
    dealt, planned = windowed_fill(lengths, 100, multipack), windowed_fill(lengths, 100, best_fit)
    del dealt["window_ms"], planned["window_ms"]
    assert dealt == planned  # multipack plans best fit's packs


def test_a_sampler_without_a_token_budget_is_refused(lengths):
    from lit_packing.samplers import RandomBatchSampler

    with pytest.raises(ValueError, match="token budget"):
        windowed_fill(lengths, 100, lambda w: RandomBatchSampler(w, batch_size=8))
