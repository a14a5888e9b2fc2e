"""Planning speed and fill of the packing samplers, side by side with TRL's ``pack_dataset(strategy="bfd")``.

For each dataset size, long-tailed lengths (lognormal, median 400 tokens, clipped to [16, --max-len]) are planned by
BestFit, Sequential and FixedLength packing, and by Multipack for --ranks ranks (its time includes dealing the packs
to the ranks; a last table gives its straggler factor next to round-robin's); the table shows the planning time
(best of --repeats, after JIT),
the fill ``sum(L) / (packs * max_tokens)`` and packs relative to the lower bound ``ceil(sum(L) / max_tokens)``.
TRL, when installed, packs a ``datasets.Dataset`` of the same lengths; only ``pack_dataset`` is timed.
The numba compile time is reported separately: cold (a fresh cache directory, in a subprocess) and this run's
first call (normally a load from the on-disk cache).

Usage: ``python -m benchmarks.packing_speed --sizes 10000 100000 1000000 --max-tokens 4096``
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import warm_up
from lit_packing.processes import EndWithParent

JIT_PROBE = """
import time, numpy as np
from lit_packing.samplers import kernels
start = time.perf_counter()
kernels.counting_sort(np.array([1, 0]), 2)
kernels.best_fit_decreasing(np.array([2, 1]), 4)
kernels.next_fit(np.array([2, 1]), 4)
kernels.balance_steps(np.array([2.0, 1.0]), 2, 1)
print(time.perf_counter() - start)
"""


def long_tailed(n: int, seed: int, max_len: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(400), 1.0, n), 16, max_len).astype(np.int64)


def cold_jit_seconds() -> float:
    """Compile time of every kernel with an empty numba cache, in a fresh interpreter (imports not counted)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        out = subprocess.run(
            [sys.executable, "-c", JIT_PROBE],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            preexec_fn=EndWithParent(),
        )
    return float(out.stdout.strip().splitlines()[-1])


def time_sampler(cls, lengths: np.ndarray, max_tokens: int, repeats: int, **kwargs) -> tuple[float, int]:
    """Best time to build the sampler and plan epoch 0 (and, given ``world_size``, deal it to the ranks)."""
    best, n_packs = float("inf"), 0
    for _ in range(repeats):
        start = time.perf_counter()
        sampler = cls(lengths, max_tokens=max_tokens, **kwargs)
        n_packs = len(sampler.plan(0))
        if "world_size" in kwargs:
            sampler.schedule(0)
        best = min(best, time.perf_counter() - start)
    return best, n_packs


def straggler_factors(lengths: np.ndarray, max_tokens: int, world_size: int) -> tuple[float, float]:
    """Round-robin best fit vs multipack, costed with SmolLM2-135M's training FLOPs."""
    from lit_packing.cost import SMOLLM2_135M_SHAPE, flop_coefficients
    from lit_packing.samplers import BestFitPackingSampler, MultipackSampler, straggler_factor
    from lit_packing.samplers.multipack import pack_costs

    coefficients = flop_coefficients(SMOLLM2_135M_SHAPE)
    samplers = (
        BestFitPackingSampler(lengths, max_tokens, world_size=world_size),
        MultipackSampler(lengths, max_tokens, cost_coefficients=coefficients, world_size=world_size),
    )
    return tuple(straggler_factor(s, pack_costs(s.plan(0), coefficients)) for s in samplers)


def time_trl(lengths: np.ndarray, max_tokens: int) -> tuple[float, int]:
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable
    from trl.data_utils import pack_dataset

    datasets.disable_progress_bars()
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = pa.array(np.arange(offsets[-1], dtype=np.int64) % 50_000, type=pa.int32())
    column = pa.LargeListArray.from_arrays(pa.array(offsets), values)
    dataset = datasets.Dataset(InMemoryTable(pa.table({"input_ids": column})))
    start = time.perf_counter()
    packed = pack_dataset(dataset, max_tokens, strategy="bfd")
    return time.perf_counter() - start, len(packed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--max-len", type=int, default=4096, help="longest example (lengths are clipped to it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="planning time is the best of this many runs")
    parser.add_argument("--ranks", type=int, default=64, help="world size Multipack plans and deals for")
    parser.add_argument("--max-trl", type=int, default=100_000, help="skip TRL above this many examples")
    parser.add_argument("--no-cold-jit", action="store_true", help="skip measuring the compile with an empty cache")
    args = parser.parse_args(argv)

    from lit_packing.cost import SMOLLM2_135M_SHAPE, flop_coefficients
    from lit_packing.samplers import (
        BestFitPackingSampler,
        FixedLengthPackingSampler,
        MultipackSampler,
        SequentialPackingSampler,
    )

    try:
        import trl  # noqa: F401

        has_trl = True
    except ImportError:
        has_trl = False

    if not args.no_cold_jit:
        print(f"numba JIT compile of all kernels, empty cache (fresh interpreter): {cold_jit_seconds():.2f} s")
    seconds, how = warm_up()
    print(f"numba first call in this process: {seconds:.2f} s ({how})\n")

    strategies = [
        ("BestFit (ours)", BestFitPackingSampler, {}),
        ("Sequential next-fit (ours)", SequentialPackingSampler, {}),
        ("FixedLength (ours)", FixedLengthPackingSampler, {}),
        (
            f"Multipack, {args.ranks} ranks (ours)",
            MultipackSampler,
            {"world_size": args.ranks, "cost_coefficients": flop_coefficients(SMOLLM2_135M_SHAPE)},
        ),
    ]
    header = f"| {'examples':>9} | {'max_tokens':>10} | {'strategy':<26} | {'plan ms':>8} | {'fill':>6} | "
    header += f"{'packs':>8} | {'lower bd':>8} | {'packs/LB':>8} |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for n in args.sizes:
        lengths = long_tailed(n, args.seed, args.max_len)
        total = int(lengths.sum())
        for max_tokens in args.max_tokens:
            lower = -(-total // max_tokens)
            rows = [(name, *time_sampler(cls, lengths, max_tokens, args.repeats, **kw)) for name, cls, kw in strategies]
            if has_trl and n <= args.max_trl:
                rows.append(("TRL pack_dataset bfd", *time_trl(lengths, max_tokens)))
            elif has_trl:
                rows.append(("TRL pack_dataset bfd", float("nan"), 0))
            for name, seconds, packs in rows:
                if not packs:
                    print(f"| {n:>9,} | {max_tokens:>10,} | {name:<26} | {'skipped (--max-trl)':>47} |")
                    continue
                fill = total / (packs * max_tokens)
                print(
                    f"| {n:>9,} | {max_tokens:>10,} | {name:<26} | {seconds * 1e3:>8.1f} | {fill:>6.4f} | "
                    f"{packs:>8,} | {lower:>8,} | {packs / lower:>8.4f} |"
                )
    if not has_trl:
        print("\n(trl not installed: TRL rows skipped)")

    print(f"\nstraggler factor at {args.ranks} ranks (SmolLM2-135M FLOPs; slowest rank / mean rank, summed over steps)")
    print(f"| {'examples':>9} | {'max_tokens':>10} | {'round-robin':>11} | {'multipack':>9} |")
    print(f"|{'-' * 11}|{'-' * 12}|{'-' * 13}|{'-' * 11}|")
    for n in args.sizes:
        lengths = long_tailed(n, args.seed, args.max_len)
        for max_tokens in args.max_tokens:
            round_robin, multipack = straggler_factors(lengths, max_tokens, args.ranks)
            print(f"| {n:>9,} | {max_tokens:>10,} | {round_robin:>11.3f} | {multipack:>9.3f} |")


if __name__ == "__main__":
    main()
