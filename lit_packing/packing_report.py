"""Packing report: how your configured run and each other sampler would batch your dataset, before training.

    python -m lit_packing.packing_report --config configs/quickstart.yaml [--data.sampler.init_args.max_tokens=8192 ...]

The data module is the one `python main.py fit --config ... <overrides>` builds: the same LightningCLI parser,
links and overrides (any `--data.*`, `--model.*` or `--trainer.*` argument is passed through), the model and trainer
included, so multipack's cost coefficients and `accumulate_grad_batches` are training's. Its first row iterates
the configured training loader for one epoch (single process) and sums the batches' own `counts`: optimizer steps,
real and slot tokens and padding ratio equal what a one-epoch fit logs. Then, per strategy, steps per epoch, real
and slot tokens, padding ratio, fill, examples per step, attention cost (sum L^2 packed vs rows * max(L)^2 padded)
and planning time, and `packing_report.png` (a histogram of example lengths and of pack fill). A second table
shows, at 2, 8 and 64 data-parallel ranks, the straggler factor (`straggler_factor`: slowest rank's compute over the
mean rank's, summed over optimizer steps) of best-fit packs dealt round-robin vs `MultipackSampler`.

For a stream (`data.streaming`), which has no epoch to plan ahead, the report reads the stream's first
`--stream_examples` examples (tokenized as training would, in its order) and shows the fill of packing them window by
window with the configured sampler, at the configured `data.buffer_size` and over a curve of buffer sizes, against
one plan of all of them (`lit_packing.samplers.windows.windowed_fill`).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from lit_packing.batch import COUNTS
from lit_packing.cli import cli_main
from lit_packing.cost import SMOLLM2_135M_SHAPE, flop_coefficients
from lit_packing.data import PackingDataModule
from lit_packing.data.stream import Interleaver, InterleaveState
from lit_packing.samplers import (
    BestFitPackingSampler,
    FixedLengthPackingSampler,
    LengthGroupedSampler,
    MultipackSampler,
    PackPlan,
    RandomBatchSampler,
    SequentialPackingSampler,
    straggler_factor,
)
from lit_packing.samplers.multipack import pack_costs
from lit_packing.samplers.windows import BUFFER_SIZES, windowed_fill

STRAGGLER_RANKS = (2, 8, 64)
PADDING_BASELINE = "padding (random batches)"


@dataclass
class PlanStats:
    """One strategy's epoch, in numbers (every count is over the whole epoch)."""

    name: str
    steps: int
    real_tokens: int
    slot_tokens: int
    attn_cost: int
    examples_mean: float
    examples_max: int
    plan_seconds: float
    fill: np.ndarray  # (steps,) real / slot tokens of each step

    @property
    def padding_ratio(self) -> float:
        return 1.0 - self.real_tokens / max(self.slot_tokens, 1)


def plan_stats(name: str, plan: PackPlan, seconds: float, padded: bool) -> PlanStats:
    """Statistics of a plan as the packed collator (or, with `padded`, the padded collator) would batch it."""
    sizes = plan.examples_per_pack()
    tokens = plan.tokens_per_pack()
    starts = np.minimum(plan.offsets[:-1], max(len(plan.tokens) - 1, 0))
    longest = np.maximum.reduceat(plan.tokens, starts) if len(plan.tokens) else np.zeros(0, np.int64)
    longest = np.where(sizes > 0, longest, 0)
    if padded:
        slots = budget = sizes * longest
        cost = sizes * longest**2
    else:  # the packed collator adds no padding; fill is measured against the token budget
        slots, cost = tokens, plan.sq_tokens_per_pack()
        budget = plan.max_tokens or (tokens.max() if len(tokens) else 1)
    return PlanStats(
        name=name,
        steps=len(plan),
        real_tokens=int(tokens.sum()),
        slot_tokens=int(slots.sum()),
        attn_cost=int(cost.sum()),
        examples_mean=float(sizes.mean()) if len(sizes) else 0.0,
        examples_max=int(sizes.max()) if len(sizes) else 0,
        plan_seconds=seconds,
        fill=tokens / np.maximum(budget, 1),
    )


def configured_stats(data: PackingDataModule, accumulate: int) -> PlanStats:
    """One epoch of the configured training loader, counted from its batches' `counts` as the callbacks count them.

    `steps` are optimizer steps: micro-batches / `accumulate`, rounded up (the epoch's last step takes the rest).
    `fill` is each micro-batch's real tokens over its slots, or over the sampler's token budget where that is more
    (as the strategy rows measure packed fill).
    """
    start = time.perf_counter()
    loader = data.train_dataloader()
    budget = getattr(data.train_sampler, "max_tokens", None) or 0
    totals: Counter[str] = Counter()
    fill, examples = [], []
    for batch in loader:
        counts = batch[COUNTS]
        totals.update(counts)
        fill.append(counts["real_tokens"] / max(counts["slot_tokens"], budget, 1))
        examples.append(counts["examples"])
    sampler, collator = type(data.train_sampler).__name__, type(loader.collate_fn).__name__
    return PlanStats(
        name=f"configured: {sampler} + {collator}",
        steps=-(-len(examples) // accumulate),
        real_tokens=totals["real_tokens"],
        slot_tokens=totals["slot_tokens"],
        attn_cost=totals["attn_cost"],
        examples_mean=float(np.mean(examples)) if examples else 0.0,
        examples_max=max(examples, default=0),
        plan_seconds=time.perf_counter() - start,
        fill=np.asarray(fill),
    )


def strategies(batch_size: int, max_tokens: int) -> dict[str, tuple[Callable, bool]]:
    """The paper's variants and ours: name -> (sampler factory, padded?)."""
    return {
        PADDING_BASELINE: (lambda n: RandomBatchSampler(n, batch_size=batch_size), True),
        "length-grouped, padded": (lambda n: LengthGroupedSampler(n, batch_size=batch_size), True),
        "mini-batch packing": (lambda n: RandomBatchSampler(n, batch_size=batch_size), False),
        "fixed-length packing": (lambda n: FixedLengthPackingSampler(n, max_tokens=max_tokens), False),
        "sequential packing": (lambda n: SequentialPackingSampler(n, max_tokens=max_tokens), False),
        "best-fit packing": (lambda n: BestFitPackingSampler(n, max_tokens=max_tokens), False),
    }


def report(lengths: np.ndarray, batch_size: int, max_tokens: int) -> list[PlanStats]:
    """Plan one epoch with every strategy and measure it."""
    rows = []
    for name, (factory, padded) in strategies(batch_size, max_tokens).items():
        start = time.perf_counter()
        plan = factory(lengths).plan(0)
        rows.append(plan_stats(name, plan, time.perf_counter() - start, padded))
    return rows


@dataclass
class StragglerRow:
    """Straggler factors of one world size: best-fit packs dealt round-robin vs multipack, and multipack's plan time."""

    world_size: int
    steps: int  # optimizer steps per epoch
    round_robin: float
    multipack: float
    plan_seconds: float


def straggler_rows(
    lengths: np.ndarray,
    max_tokens: int,
    accumulate: int = 1,
    world_sizes: tuple[int, ...] = STRAGGLER_RANKS,
    coefficients: tuple[float, float] | None = None,
) -> list[StragglerRow]:
    """Compute balance across ranks, costed with a model's training FLOPs (``a * L + b * L^2`` per example,
    `coefficients`; default SmolLM2-135M's)."""
    coefficients = coefficients or flop_coefficients(SMOLLM2_135M_SHAPE)
    rows = []
    for world_size in world_sizes:
        round_robin = BestFitPackingSampler(lengths, max_tokens, world_size=world_size)
        start = time.perf_counter()
        multipack = MultipackSampler(lengths, max_tokens, cost_coefficients=coefficients, world_size=world_size)
        multipack.accumulate = round_robin.accumulate = accumulate
        micro_steps = len(multipack)
        seconds = time.perf_counter() - start
        factors = [straggler_factor(s, pack_costs(s.plan(), coefficients)) for s in (round_robin, multipack)]
        rows.append(StragglerRow(world_size, -(-micro_steps // accumulate), *factors, seconds))
    return rows


def render_stragglers(rows: list[StragglerRow], title: str) -> Table:
    table = Table(title=title)
    for column in ("ranks", "optimizer steps", "round-robin (best fit)", "multipack", "multipack plan s"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            f"{r.world_size}", f"{r.steps:,}", f"{r.round_robin:.3f}", f"{r.multipack:.3f}", f"{r.plan_seconds:.3f}"
        )
    return table


def render(rows: list[PlanStats], title: str) -> Table:
    table = Table(title=title)
    for column in ("strategy", "steps", "real tok", "slot tok", "padding", "fill", "ex/step mean", "ex/step max",
                   "attn cost", "vs padding", "plan s"):  # fmt: skip
        table.add_column(column, justify="left" if column == "strategy" else "right")
    # The padding baseline: the attention the paper's padded run computes.
    baseline = max(next(r.attn_cost for r in rows if r.name == PADDING_BASELINE), 1)
    for r in rows:
        table.add_row(
            r.name, f"{r.steps:,}", f"{r.real_tokens:,}", f"{r.slot_tokens:,}", f"{r.padding_ratio:.3f}",
            f"{r.fill.mean():.3f}", f"{r.examples_mean:.1f}", f"{r.examples_max}", f"{r.attn_cost:.3g}",
            f"{r.attn_cost / baseline:.2f}", f"{r.plan_seconds:.3f}",
        )  # fmt: skip
    return table


def plot(lengths: np.ndarray, rows: list[PlanStats], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.hist(lengths, bins=60, color="tab:blue")
    left.set(title=f"example lengths (n={len(lengths):,})", xlabel="tokens", ylabel="examples")
    for r in rows:
        if r.name in (rows[0].name, PADDING_BASELINE, "best-fit packing"):
            right.hist(r.fill, bins=40, range=(0, 1), alpha=0.5, label=r.name)
    right.set(title="fill per step (real / slot tokens)", xlabel="fill", ylabel="steps")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def configured_data(config: str | Path | list[str | Path], overrides: list[str]) -> tuple[PackingDataModule, int]:
    """The data module, set up, as `python main.py fit --config <config> <overrides>` builds it (a list: one
    `--config` each, in order, e.g. `["paper", "multipack"]`), and the trainer's `accumulate_grad_batches`.

    The model and trainer are built too (the model's weights load), and the model's contract is handed to the data
    as `Trainer.fit` hands it, so a sampler that balances by FLOPs gets the model's cost coefficients, as in training.
    """
    configs = config if isinstance(config, list) else [config]
    cli = cli_main([*(arg for c in configs for arg in ("--config", str(c))), *overrides], run=False)
    data = cli.datamodule
    data.trainer = cli.trainer  # the run's layout: accumulate_grad_batches, ranks
    data.prepare_data()
    data.setup("fit")
    data.connect_model(cli.model.contract)
    return data, cli.trainer.accumulate_grad_batches


def stream_lengths(data: PackingDataModule, examples: int) -> np.ndarray:
    """(n,) token counts of the stream's first `examples` examples (or all it has), in its order, tokenized as
    training tokenizes them."""
    interleaver = Interleaver(data.stream, epoch=0, state=InterleaveState.start(len(data.stream.members)))
    lengths: list[np.ndarray] = []
    while sum(map(len, lengths)) < examples and (window := interleaver.window(len(lengths))) is not None:
        lengths.append(window.lengths)
    return np.concatenate(lengths)[:examples] if lengths else np.zeros(0, dtype=np.int64)


def render_windows(data: PackingDataModule, lengths: np.ndarray, title: str) -> Table | str:
    """Windowed vs offline fill of the configured sampler on `lengths`: the configured buffer size, then the curve."""
    declared = data.declared
    if not isinstance(getattr(declared, "max_tokens", None), int):
        return f"{title}: {type(declared).__name__} has no token budget, so packing in windows changes no fill"
    table = Table(title=title)
    for column in ("buffer_size", "windows", "packs", "fill", "offline best-fit fill", "gap", "ms / window"):
        table.add_column(column, justify="right")
    sizes = sorted({data.buffer_size, *(b for b in BUFFER_SIZES if b < len(lengths))})
    for size in sizes:
        out = windowed_fill(lengths, size, data.sampler, seed=data.seed)
        name = f"{size:,} (configured)" if size == data.buffer_size else f"{size:,}"
        table.add_row(name, f"{out['windows']:,}", f"{out['packs']:,}", f"{out['fill']:.4f}",
                      f"{out['offline_fill']:.4f}", f"{100 * out['gap']:.2f}%", f"{out['window_ms']:.2f}")  # fmt: skip
    return table


def main(argv: list[str] | None = None) -> list[PlanStats]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--config", action="append", required=True, help="a config file or name, as main.py fit "
                        "takes it; repeat to compose (--config paper --config multipack)")  # fmt: skip
    parser.add_argument("--batch_size", type=int, default=8, help="examples per step for the mini-batch strategies")
    parser.add_argument("--max_tokens", type=int, default=None, help="token budget (default: the config's)")
    parser.add_argument("--accumulate", type=int, default=None, help="micro-steps per optimizer step (stragglers)")
    parser.add_argument("--out", type=Path, default=Path("packing_report.png"), help="where the PNG goes")
    parser.add_argument("--stream_examples", type=int, default=20_000, help="a stream's examples to read")
    args, overrides = parser.parse_known_args(argv)
    data, accumulate = configured_data(args.config, overrides)
    if data.stream is not None:
        lengths = stream_lengths(data, args.stream_examples)
        title = (
            f"{' + '.join(args.config)}: fill of the stream's first {len(lengths):,} examples packed in windows by "
            f"{type(data.declared).__name__}, against one plan of all of them"
        )
        Console(width=max(Console().width, 150)).print(render_windows(data, lengths, title))
        return []
    configured = configured_stats(data, accumulate)  # builds `data.train_sampler`
    lengths = data.train_lengths
    max_tokens = args.max_tokens or getattr(data.train_sampler, "max_tokens", None) or data.max_length
    accumulate = args.accumulate or accumulate
    rows = [configured, *report(lengths, args.batch_size, max_tokens)]
    configs = " + ".join(args.config)
    title = f"{configs}: {len(lengths):,} examples, batch_size={args.batch_size}, max_tokens={max_tokens:,}"
    console = Console(width=max(Console().width, 150))
    console.print(render(rows, title))
    console.print(
        render_stragglers(
            straggler_rows(lengths, max_tokens, accumulate, coefficients=data.model_contract.cost_coefficients),
            f"straggler factor (slowest rank / mean rank, the model's FLOPs per optimizer step), "
            f"max_tokens={max_tokens:,}, accumulate={accumulate}",
        )
    )
    plot(lengths, rows, args.out)
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
