"""The benchmark's table, targets and plot, computed from the runs' records (`RunResult`) alone.

Per row: the epoch's optimizer steps, real and slot tokens and padding ratio (from the row's own loader); effective
tokens/s of the timed steps, and over an epoch (the timed steps' seconds per FLOP applied to the epoch's FLOPs, so
that rows whose few timed steps hold longer or shorter examples than average compare fairly), each the median over
rounds with min and max; the epoch rate's ratio to padding's and to the HF Trainer's (taken within a round, then
the median); the epoch's time; peak memory; the mean train loss of the run's steps and the validation loss after.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks.variants import BASELINE, PAPER_METHOD, PEER, VARIANTS, RunResult

PAPER = "paper (A100, FLAN-like data): mini-batch packing + position ids ~1.9x padding's throughput"


@dataclass
class Row:
    """One row of the table: a variant (on one model) over every round it ran."""

    name: str
    runs: list[RunResult]  # one per round, in round order

    @property
    def label(self) -> str:
        variant, _, model = self.name.partition("@")
        label = VARIANTS[variant].label
        return f"{label}, pretrained SmolLM2-135M" if model else label

    @property
    def first(self) -> RunResult:
        return self.runs[0]

    @property
    def rates(self) -> list[float]:
        """Effective tokens/s of the timed steps, per round."""
        return [run.tokens_per_second for run in self.runs]

    @property
    def epoch_rates(self) -> list[float]:
        """Effective tokens/s over an epoch (the timed steps' seconds per FLOP on the epoch's mix), per round."""
        return [run.epoch_tokens_per_second for run in self.runs]

    @property
    def padding_ratio(self) -> float:
        return 1.0 - self.first.epoch_real_tokens / max(self.first.epoch_slot_tokens, 1)

    @property
    def peak_memory_gb(self) -> float:
        return max(run.peak_memory_gb for run in self.runs)

    @property
    def train_loss(self) -> float:
        """Mean loss over the run's optimizer steps (the same in every round: the runs are deterministic)."""
        return statistics.fmean(self.first.loss)

    @property
    def epoch_seconds(self) -> float:
        """One epoch's time (median over rounds of each run's estimate)."""
        return statistics.median(run.epoch_seconds for run in self.runs)

    def ratio(self, other: Row | None) -> list[float]:
        """This row's epoch effective tokens/s over `other`'s, round by round (rounds both ran)."""
        if other is None:
            return []
        theirs = {run.round: run.epoch_tokens_per_second for run in other.runs}
        return [run.epoch_tokens_per_second / theirs[run.round] for run in self.runs if run.round in theirs]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _spread(values: list[float], digits: int = 1, suffix: str = "") -> str:
    if not values:
        return "—"
    middle = f"{statistics.median(values):,.{digits}f}{suffix}"
    if len(values) == 1:
        return middle
    return f"{middle} ({min(values):,.{digits}f}–{max(values):,.{digits}f})"


class Report:
    """The table and targets of a benchmark, from its runs; `write` saves Markdown, JSON and a PNG."""

    def __init__(self, results: list[RunResult], settings: dict, environment: dict[str, str]) -> None:
        self.settings, self.environment = settings, environment
        names = list(dict.fromkeys(r.row for r in results))
        order = [*settings["variants"], *(f"{v}@smollm2" for v in settings["pretrained"])]
        names.sort(key=lambda n: order.index(n) if n in order else len(order))
        self.rows = {n: Row(n, sorted((r for r in results if r.row == n), key=lambda r: r.round)) for n in names}

    @property
    def rounds(self) -> int:
        """Rounds that ran (fewer than asked when a run was cut short)."""
        return max(len(row.runs) for row in self.rows.values())

    def baseline(self, row: Row, variant: str) -> Row | None:
        """`variant`'s row on the same model as `row`."""
        _, at, model = row.name.partition("@")
        return self.rows.get(f"{variant}{at}{model}")

    def table(self) -> list[dict]:
        """The table's rows as plain values (what bench.json holds besides every run's record)."""
        rows = []
        for row in self.rows.values():
            rows.append(
                {
                    "row": row.name,
                    "variant": row.label,
                    "optimizer_steps_per_epoch": row.first.epoch_steps,
                    "real_tokens": row.first.epoch_real_tokens,
                    "slot_tokens": row.first.epoch_slot_tokens,
                    "padding_ratio": row.padding_ratio,
                    "effective_tokens_per_s": row.rates,
                    "epoch_effective_tokens_per_s": row.epoch_rates,
                    "vs_padding": row.ratio(self.baseline(row, BASELINE)),
                    "vs_hf_trainer": row.ratio(self.baseline(row, PEER)),
                    "epoch_seconds": row.epoch_seconds,
                    "peak_memory_gb": row.peak_memory_gb,
                    "train_loss": row.train_loss,
                    "val_loss": row.first.val_loss,
                    "rounds": len(row.runs),
                }
            )
        return rows

    def targets(self) -> list[tuple[str, str, bool | None]]:
        """(target, measured, met?) for each target the rows present allow checking; None: cannot be judged."""
        rows = self.rows
        out: list[tuple[str, str, bool | None]] = []
        packed, padded, peer = rows.get(PAPER_METHOD), rows.get(BASELINE), rows.get(PEER)
        if packed and padded:
            out.append(self._speedup("mini-batch packing >= 2.0x padding (effective tokens/s)", packed, padded, 2.0))
            # fp32 agrees to rounding; bf16 kernels round differently, and a few steps take that into the weights.
            tolerance = 1e-5 if self.settings["precision"] in ("32-true", "32", "64-true") else 5e-3
            rel = abs(packed.first.val_loss - padded.first.val_loss) / abs(padded.first.val_loss)
            target = f"val loss of mini-batch packing == padding's within {tolerance:g} relative"
            out.append((target, f"{rel:.1e}", rel <= tolerance))
            memory = (packed.peak_memory_gb, padded.peak_memory_gb)
            shown = f"{memory[0]:.2f} vs {memory[1]:.2f} GiB"
            out.append(("peak memory of packing <= padding's", shown, memory[0] <= memory[1]))
        if packed and peer:
            out.append(self._speedup("mini-batch packing >= 1.5x HF Trainer + flattening + sdpa", packed, peer, 1.5))
        best = rows.get("bestfit_packing")
        if best and packed:
            fewer = best.first.epoch_steps < packed.first.epoch_steps
            out.append(
                ("best fit: fewer optimizer steps per epoch than mini-batch packing",
                 f"{best.first.epoch_steps} vs {packed.first.epoch_steps}", fewer)
            )  # fmt: skip
            out.append(self._speedup("best fit: effective tokens/s >= mini-batch packing's", best, packed, 1.0))
        dirty, clean = rows.get("fixed_no_position_ids"), rows.get("fixed_position_ids")
        if dirty and clean:
            worse = (dirty.first.val_loss - clean.first.val_loss) / clean.first.val_loss
            out.append(
                ("contaminated fixed-length: val loss worse than with position ids (same packs, same steps)",
                 f"{dirty.first.val_loss:.4f} vs {clean.first.val_loss:.4f} ({worse:+.2%})", worse > 0)
            )  # fmt: skip
        return out

    @staticmethod
    def _speedup(target: str, row: Row, other: Row, at_least: float) -> tuple[str, str, bool | None]:
        speedup = _median(row.ratio(other))
        if speedup is None:  # no round ran both rows
            return target, "no common round", None
        return target, f"{speedup:.2f}x", speedup >= at_least

    def markdown(self) -> str:
        env, s = self.environment, self.settings
        lines = [
            *(
                ["**Smoke run**: the wiring with a tiny model and a few steps; its numbers measure nothing.", ""]
                if s.get("smoke")
                else []
            ),
            f"Measured {env['date']} on {env['machine']}; "
            + ", ".join(f"{k} {v}" for k, v in env.items() if k not in ("date", "machine"))
            + ".",
            "",
            f"{s['examples']} CHAMP chats ({s['val_examples']} held out), max_length {s['max_length']:,}, "
            f"{s['batch_size']} examples per mini-batch step, {s['max_tokens']:,}-token budget for best fit / "
            f"multipack / TRL bfd, {s['rows_per_step']} rows of {s['max_length']:,} for fixed-length; model: "
            f"SmolLM2-135M's architecture with {s['model_config']} (random init), {s['precision']}; "
            f"{s['warmup_steps']} warm-up + {s['steps']} timed steps per run, {self.rounds} interleaved rounds "
            "(median (min–max) over rounds; ratios within a round). Effective tokens/s counts real tokens; the "
            "epoch columns apply the timed steps' seconds per FLOP to the epoch's mix of examples, which the "
            "ratios compare (rows whose timed steps hold other examples than the epoch's average stay comparable).",
            "",
            "| variant | optimizer steps / epoch | real tokens | slot tokens | padding ratio | effective tokens/s, "
            "timed steps | effective tokens/s, epoch | vs padding | vs HF Trainer | epoch time | peak memory "
            "| train loss | val loss |",
            "|" + "---|" * 13,
        ]
        for row, values in zip(self.rows.values(), self.table()):
            cells = [
                row.label, f"{values['optimizer_steps_per_epoch']:,}", f"{values['real_tokens']:,}",
                f"{values['slot_tokens']:,}", f"{values['padding_ratio']:.3f}",
                _spread(values["effective_tokens_per_s"]), _spread(values["epoch_effective_tokens_per_s"]),
                _spread(values["vs_padding"], 2, "x"),
                _spread(values["vs_hf_trainer"], 2, "x"), f"{values['epoch_seconds']:,.0f} s",
                f"{values['peak_memory_gb']:.2f} GiB", f"{values['train_loss']:.4f}", f"{values['val_loss']:.6f}",
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "| target | measured | met |", "|---|---|---|"]
        for target, measured, met in self.targets():
            lines.append(f"| {target} | {measured} | {'n/a' if met is None else 'yes' if met else 'no'} |")
        lines += ["", f"For comparison, {PAPER}."]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        return {
            "environment": self.environment,
            "settings": self.settings,
            "table": self.table(),
            "targets": [{"target": t, "measured": m, "met": ok} for t, m, ok in self.targets()],
            "runs": [run.to_dict() for row in self.rows.values() for run in row.runs],
        }

    def write(self, out: Path) -> None:
        (out / "bench.md").write_text(self.markdown())
        (out / "bench.json").write_text(json.dumps(self.to_json(), indent=1))
        self.plot(out / "bench.png")

    def plot(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = list(self.rows.values())
        fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
        medians = [statistics.median(r.epoch_rates) for r in rows]
        errors = [
            [m - min(r.epoch_rates) for m, r in zip(medians, rows)],
            [max(r.epoch_rates) - m for m, r in zip(medians, rows)],
        ]
        left.barh(range(len(rows)), medians, xerr=errors, color="tab:blue", capsize=3)
        left.set_yticks(range(len(rows)), [r.label for r in rows], fontsize=8)
        left.invert_yaxis()
        left.set(title="effective (real) tokens/s over an epoch, median and range over rounds", xlabel="tokens/s")
        for r in (r for r in rows if "@" not in r.name):  # the pretrained rows' losses are on another scale
            seen, total = [], 0
            for tokens in r.first.real_tokens:
                total += tokens
                seen.append(total)
            right.plot(seen, r.first.loss, "-o", markersize=3, label=r.label)
        right.set(title="train loss per optimizer step (random init)", xlabel="real tokens trained", ylabel="loss")
        right.legend(fontsize=7)
        for ax in (left, right):
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
