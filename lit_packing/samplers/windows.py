"""Packing in windows: what planning a stream window by window costs in fill against one plan of the whole set.

    windowed_fill(lengths_in_stream_order, 1000, lambda w: BestFitPackingSampler(w, max_tokens=8192))["gap"]

A stream (`lit_packing.data.stream`) plans each window of `data.buffer_size` consecutive examples with the configured
sampler, exactly as an epoch is planned; the packing report and `benchmarks/stream_fill.py` measure what that costs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np

from lit_packing.samplers.base import PlannedBatchSampler, RunContext

BUFFER_SIZES = (64, 128, 256, 500, 1000, 2000, 5000, 10000)  # the curve the report and the benchmark print


def windows(lengths: np.ndarray, buffer_size: int) -> Iterator[np.ndarray]:
    """Consecutive windows of ``buffer_size`` lengths, the last one shorter."""
    for start in range(0, len(lengths), buffer_size):
        yield lengths[start : start + buffer_size]


def planned(make_sampler: Callable[[np.ndarray], PlannedBatchSampler], lengths: np.ndarray, seed: int):
    """``make_sampler(lengths)`` given the run's ``seed`` as the data module gives it (a seed of its own wins)."""
    return make_sampler(lengths).connect(RunContext(seed=seed))


def windowed_fill(
    lengths: np.ndarray, buffer_size: int, make_sampler: Callable[[np.ndarray], PlannedBatchSampler], seed: int = 0
) -> dict:
    """Fill of packing ``lengths`` (in stream order) window by window, against one plan over all of them.

    Each window of ``buffer_size`` consecutive lengths (the last one shorter) is planned by ``make_sampler(window)``
    with the run's ``seed`` (``connect(RunContext(seed=seed))``: a seed the factory gave wins), ``.plan()``; the
    offline plan is the same over all of ``lengths``. Packs are counted as planned, before dealing: with
    ``world_size`` > 1 the empty packs that complete a window's last step are not packs of the plan.

    Returns:
        ``buffer_size``, ``windows``, ``max_tokens``; ``window_packs`` (each window's), ``real_tokens``, ``packs``,
        ``fill`` of the windows and ``offline_real_tokens``, ``offline_packs``, ``offline_fill`` of the one plan;
        ``gap`` = ``1 - fill / offline_fill``; ``window_ms``: median over windows of building, planning and dealing
        (``schedule()``) one.

    Example: lengths ``[6, 6, 4, 4]``, ``max_tokens=10``: offline packs 6 + 4 twice (fill 1.0); windows of 2 plan
    ``[6, 6]`` into two packs and ``[4, 4]`` into one (fill 20 / 30), a third of the fill lost.

    >>> from lit_packing.samplers import BestFitPackingSampler
    >>> out = windowed_fill(np.array([6, 6, 4, 4]), 2, lambda w: BestFitPackingSampler(w, max_tokens=10))
    >>> out["packs"], out["offline_packs"], round(out["fill"], 3), round(out["gap"], 3)
    (3, 2, 0.667, 0.333)
    """
    offline = planned(make_sampler, lengths, seed).plan()
    max_tokens = offline.max_tokens
    if max_tokens is None:
        raise ValueError("fill needs a token budget: make_sampler must build a sampler with max_tokens")
    real_tokens, window_packs, window_seconds = 0, [], []
    for window in windows(lengths, buffer_size):
        start = time.perf_counter()
        sampler = planned(make_sampler, window, seed)
        tokens = sampler.plan().tokens_per_pack()
        sampler.schedule()
        window_seconds.append(time.perf_counter() - start)
        real_tokens += int(tokens.sum())
        window_packs.append(len(tokens))
    packs = sum(window_packs)
    offline_tokens = int(offline.tokens_per_pack().sum())
    fill = real_tokens / (packs * max_tokens)
    offline_fill = offline_tokens / (len(offline) * max_tokens)
    return {
        "buffer_size": buffer_size,
        "windows": len(window_packs),
        "window_packs": window_packs,
        "max_tokens": max_tokens,
        "real_tokens": real_tokens,
        "packs": packs,
        "fill": fill,
        "offline_real_tokens": offline_tokens,
        "offline_packs": len(offline),
        "offline_fill": offline_fill,
        "gap": 1.0 - fill / offline_fill,
        "window_ms": float(np.median(window_seconds)) * 1e3,
    }
