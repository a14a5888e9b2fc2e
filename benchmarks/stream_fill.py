"""Packing in windows (streaming) against packing the whole epoch: the fill that buffered packing loses.

A stream plans each window of ``buffer_size`` consecutive examples (in stream order) with the configured sampler,
exactly as a whole epoch is planned offline: ``make_sampler(window_lengths).plan()``. Here a stream's lengths are cut
into such windows (the last one shorter), every window is planned and its packs are counted as planned (dealing to
ranks only adds empty packs, it never changes fill), next to one plan over all the lengths (offline). Fill is
``real tokens / (packs * max_tokens)``; the gap is ``1 - fill / offline fill``, the share of offline's fill lost.

Data: CHAMP's training chats as ``PackingDataModule`` builds them (``ChampChats()``, the SmolLM2 tokenizer, both
packaged assets, offline; ``--max-length`` 4,096 with the split of ``configs/paper.yaml``: ``val_split=0.01``, seed
42), and, so that windows of up to 10,000 examples leave many windows in an epoch, ``--synthetic`` (200,000) lengths
drawn from CHAMP's with replacement (seeded). Stream order: ``np.random.default_rng(order).permutation(n)`` of the
examples, ``order`` = 0 for the tables. Samplers: ``BestFitPackingSampler`` and ``MultipackSampler`` for ``--ranks``
(8) ranks, at ``--max-tokens`` (8,192). Window ms: the median over the stream's windows of building the sampler,
planning the window and dealing it to the ranks (``schedule()``), after the numba kernels are loaded: what every
rank pays for every window. Not part of fill, and shown apart: what completing each window's last optimizer step
with empty packs would cost (the stream carries that step's examples into the next window instead); "empty %" is
their share of the micro-batches for a global batch of ``--global-batches`` (8, 64) packs per step
(``empty_share``). The target line gives the CHAMP gap at
``buffer_size`` 1,000 for ``--orders`` stream orders.

Usage: ``python -m benchmarks.stream_fill`` (seconds once CHAMP is tokenized; the first run tokenizes it, about
a minute on 2 cores), ``--smoke``: 1,000 chats and 20,000 synthetic lengths, one order, a wiring check.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np

from benchmarks.common import warm_up
from lit_packing.samplers.base import PlannedBatchSampler
from lit_packing.samplers.windows import BUFFER_SIZES, windowed_fill

TARGET_BUFFER, TARGET_GAP = 1000, 0.01  # fill within 1% of offline best fit at buffer_size 1,000 on CHAMP


def empty_share(window_packs: list[int], global_batch: int) -> float:
    """Share of micro-batches that are empty packs when every window's packs are completed to whole optimizer steps
    of ``global_batch`` packs (the stream's rule: an optimizer step never straddles two windows).

    >>> empty_share([13, 16], 8)  # 3 empty packs complete the first window's second step
    0.09375
    """
    empty = sum(-p % global_batch for p in window_packs)
    return empty / (sum(window_packs) + empty)


def stream_order(lengths: np.ndarray, order: int) -> np.ndarray:
    """The lengths in stream order: a permutation seeded by ``order``."""
    return lengths[np.random.default_rng(order).permutation(len(lengths))]


def champ_lengths(max_length: int, limit: int | None) -> np.ndarray:
    """Tokens per training chat of CHAMP as the data module builds them (split as ``configs/paper.yaml``)."""
    from lit_packing.data import PackingDataModule

    data = PackingDataModule(max_length=max_length, val_split=0.01, limit=limit)
    data.prepare_data()
    data.setup("fit")
    return data.train_lengths


def samplers(max_tokens: int, ranks: int) -> dict[str, Callable[[np.ndarray], PlannedBatchSampler]]:
    from lit_packing.cost import SMOLLM2_135M_SHAPE, flop_coefficients
    from lit_packing.samplers import BestFitPackingSampler, MultipackSampler

    coefficients = flop_coefficients(SMOLLM2_135M_SHAPE)
    return {
        "BestFit": lambda window: BestFitPackingSampler(window, max_tokens=max_tokens),
        f"Multipack x{ranks}": lambda window: MultipackSampler(
            window, max_tokens=max_tokens, cost_coefficients=coefficients, world_size=ranks
        ),
    }


def fill_table(lengths: np.ndarray, factories: dict, seed: int, global_batches: list[int]) -> list[str]:
    """Markdown lines of fill vs buffer size of one stream, every gap against offline best fit (the first factory's
    one plan of all lengths, the first row), then the first factory's ``empty_share`` for each global batch."""
    sizes = [len(lengths)] + [b for b in BUFFER_SIZES if b < len(lengths)]  # one window of all: offline
    results = [[windowed_fill(lengths, b, factory, seed) for factory in factories.values()] for b in sizes]
    reference = results[0][0]["fill"]
    columns = [f"{name} {what}" for name in factories for what in ("packs", "fill", "gap %", "window ms")]
    columns += [f"empty % at {g} packs/step" for g in global_batches]
    lines = ["| buffer_size | windows | " + " | ".join(columns) + " |", "|---" + "|---:" * (1 + len(columns)) + "|"]
    for size, row in zip(sizes, results):
        cells = [f"offline ({size:,}: one plan)" if size == len(lengths) else f"{size:,}", f"{row[0]['windows']:,}"]
        for r in row:
            cells += [f"{r['packs']:,}", f"{r['fill']:.4f}", f"{100 * (1 - r['fill'] / reference):.2f}",
                      f"{r['window_ms']:.2f}"]  # fmt: skip
        cells += [f"{100 * empty_share(row[0]['window_packs'], g):.2f}" for g in global_batches]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-length", type=int, default=4096, help="tokens per chat (longer chats are truncated)")
    parser.add_argument("--max-tokens", type=int, default=8192, help="token budget of a pack")
    parser.add_argument("--ranks", type=int, default=8, help="world size Multipack plans and deals each window for")
    parser.add_argument("--synthetic", type=int, default=200_000, help="lengths drawn from CHAMP's, with replacement")
    parser.add_argument(
        "--global-batches", type=int, nargs="+", default=[8, 64], help="packs per optimizer step for the empty %%"
    )
    parser.add_argument("--orders", type=int, default=5, help="stream orders the target gap is measured on")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (samplers) and the synthetic draw's")
    parser.add_argument("--smoke", action="store_true", help="1,000 chats, 20,000 synthetic lengths, one order")
    args = parser.parse_args(argv)
    if args.smoke:
        args.synthetic, args.orders = 20_000, 1

    champ = champ_lengths(args.max_length, 1000 if args.smoke else None)
    synthetic = np.random.default_rng(args.seed).choice(champ, args.synthetic, replace=True)
    factories = samplers(args.max_tokens, args.ranks)
    seconds, how = warm_up()
    if args.smoke:
        print("**Smoke run**: 1,000 CHAMP chats, 20,000 synthetic lengths, one order: a wiring check.\n")
    print(f"numba kernels: {seconds:.2f} s ({how}), not counted in window ms\n")
    label = f"SmolLM2 tokenizer, max_length {args.max_length:,}, max_tokens {args.max_tokens:,}, stream order 0"
    datasets = (
        (f"CHAMP chats: {len(champ):,} training chats", champ),
        (f"Synthetic: {len(synthetic):,} lengths drawn from CHAMP's with replacement (seed {args.seed})", synthetic),
    )
    for name, lengths in datasets:
        print(f"**{name}**, {int(lengths.sum()):,} tokens ({label}; gap: vs offline best fit)\n")
        print("\n".join(fill_table(stream_order(lengths, 0), factories, args.seed, args.global_batches)) + "\n")

    target = f"target: fill within {TARGET_GAP:.0%} of offline best fit at buffer_size {TARGET_BUFFER:,}, CHAMP: "
    if len(champ) <= TARGET_BUFFER:
        print(target + f"not judged, {len(champ):,} chats fit one window")
        return
    best_fit = next(iter(factories.values()))
    orders = [
        windowed_fill(stream_order(champ, o), TARGET_BUFFER, best_fit, args.seed)["gap"] for o in range(args.orders)
    ]
    worst = max(orders)
    print(
        target + f"gap {100 * min(orders):.2f}-{100 * worst:.2f}% over stream orders 0-{args.orders - 1}: "
        f"{'met' if worst <= TARGET_GAP else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
