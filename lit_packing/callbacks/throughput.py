"""TokenThroughputMonitor: effective (real-token) throughput, FLOP/s, MFU, peak memory, and an end-of-fit summary.

    Trainer(callbacks=[TokenThroughputMonitor(window=20)])   # logs train/effective_tokens_per_sec, ...

Tokens come from the host-side `batch["counts"]`; time is the host clock between batch ends, never a device sync:
over a window of steps the host cannot run ahead of the device by more than a step or two, so the windowed rate
converges to the device's.
"""

from __future__ import annotations

import resource
import time
from collections import Counter, deque
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from rich.console import Console
from rich.table import Table

from lit_packing._compat import data_parallel, should_update_logs
from lit_packing.batch import COUNTS, KEY_LENGTHS, LENGTHS, ROUND, SOURCE_TOKENS, WINDOW
from lit_packing.contract import DataContract
from lit_packing.cost import ModelShape, hardware_flops, model_flops, model_shape

_RATES = {  # logged name -> count it divides by time
    "effective_tokens_per_sec": "real_tokens",
    "label_tokens_per_sec": "label_tokens",
    "slot_tokens_per_sec": "slot_tokens",
    "examples_per_sec": "examples",
}


def _sampling_seconds(batch: Any) -> float:
    """The seconds this rank spent making on-policy rounds so far (0 for other data)."""
    return batch.get(ROUND, {}).get("clock", {}).get("sampling_s", 0.0) if isinstance(batch, dict) else 0.0


def peak_memory_gb(device: torch.device) -> float:
    """Peak device memory allocated (CUDA), or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def data_rows(data: DataContract | None, pl_module: pl.LightningModule, launch: str = "") -> list[tuple[str, str]]:
    """Summary rows for what the run skipped or changed: bad rows, drops, cuts, duplicates, non-finite steps (the
    model counts those in this process: labelled with `launch`, e.g. "this launch", when it resumed a run)."""
    report = data.report if data is not None else None
    rows = []
    if report is not None:
        rows += [
            ("bad rows skipped", f"{report.bad_examples:,}"),
            ("dropped overlong", f"{report.dropped_overlong_examples:,} ({report.dropped_overlong_tokens:,} tokens)"),
            ("dropped, no label", f"{report.dropped_no_label_examples:,}"),
            ("truncated", f"{report.truncated_examples:,} ({report.truncated_tokens:,} tokens cut)"),
            ("duplicates", f"{report.duplicate_examples:,}"),
            ("val also in train", f"{data.overlap_examples:,}"),
        ]
    if hasattr(pl_module, "nonfinite_steps"):
        rows.append((_label("non-finite steps skipped", launch), f"{pl_module.nonfinite_steps:,}"))
    return rows


def _label(name: str, *qualifiers: str) -> str:
    """`name (a, b)` with the qualifiers that apply (the empty ones left out), else `name`."""
    given = [qualifier for qualifier in qualifiers if qualifier]
    return f"{name} ({', '.join(given)})" if given else name


class TokenThroughputMonitor(pl.Callback):
    """Log effective tokens/s (real tokens only) and friends at logging steps, over a window of steps.

    One clock for every number: training time is host time between the end of one training batch and the end of
    the next, with validation and checkpointing left out (the clock pauses and resumes at the next batch). So the
    progress bar's `tok/s`, the logged `train/effective_tokens_per_sec` and the summary's "effective tokens/s" are
    the same quantity: real tokens / training seconds, over the last `window` steps (logs, bar) or the whole fit
    (summary); for a fit of at most `window` steps they are equal. The first step includes the model's one-time
    isolation self-test.

    Logged (`train/...`): `effective_tokens_per_sec`, `label_tokens_per_sec`, `slot_tokens_per_sec`,
    `examples_per_sec`, `tflops_per_sec` (model FLOPs, `lit_packing.batch.model_flops`: real tokens only, each
    layer's attention within its window, frozen weights at 4 FLOPs per token, trainable at 6), `mfu` (the same
    FLOPs over the device's peak, where Lightning's table of chips knows it), `hardware_tflops_per_sec` (what the
    device computed, `hardware_flops`: padding slots and padded rows' max(L)^2 included), `peak_memory_gb`. On
    on-policy rounds, whose making (sampling, scoring) is left out of training time, `rollout/generation_share`:
    the seconds spent making rounds over those plus the training seconds, in the same window, over all ranks.
    Rates are totals over all ranks; with several ranks `effective_tokens_per_sec_per_rank` is their mean per
    rank, and the counts are summed over ranks (one all-reduce) only at logging steps (`trainer.log_every_n_steps`)
    and at the end, so no step waits for a device sync. When training ends a summary table is printed, labelled
    per rank / all ranks, and, for a fit resumed from a checkpoint, run / this launch: the optimizer steps of the
    whole run (the global step) beside this launch's, and every count, time and rate measured in this process
    (examples, tokens, padding, tokens/s, train time, peak memory, skipped steps) marked "this launch".

    Args:
        window: number of steps the rates are averaged over.
        summary: print the end-of-fit summary table.
    """

    def __init__(self, window: int = 20, summary: bool = True) -> None:
        self.window = window
        self.summary = summary
        self.totals: Counter[str] = Counter()
        self.window_fills: dict[tuple[int, int], float] = {}  # a stream's (epoch, window) trained here: its fill
        self.train_seconds = 0.0
        self._recent: deque[tuple[float, Counter[str]]] = deque([(0.0, Counter())], maxlen=window + 1)
        self._shape: ModelShape | None = None
        self._peak_flops: float | None = None
        self._batch_start: float | None = None  # None: the clock is paused until the next training batch starts
        self._data: DataContract | None = None  # what the data publishes (the summary's data rows)
        self._first_step = 0  # the global step this launch started from (> 0: resumed from a checkpoint)
        self._sampled = 0.0  # the on-policy sampling seconds already left out of `train_seconds`
        self._rounds_counted = 0.0  # those already counted in a step's `round_s`, paused or not (round 0's too)

    def connect_data(self, data: DataContract) -> None:
        """The data's contract (`lit_packing.contract`): its tokenization report ends the fit summary."""
        self._data = data

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = getattr(pl_module, "model", pl_module)
        self._shape = model_shape(model)
        dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(str(trainer.precision).split("-")[0], torch.float32)
        self._peak_flops = get_available_flops(pl_module.device, dtype)
        if self._peak_flops is not None:
            self._peak_flops *= trainer.world_size

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_step = trainer.global_step  # restored from the checkpoint by now

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._batch_start = None  # the dataloader restart is not training time

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Nor is validation, nor the checkpoint saved after it (ModelCheckpoint runs after this callback).
        self._batch_start = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._batch_start is None:
            self._batch_start = time.perf_counter()
            self._sampled = _sampling_seconds(batch)  # sampled while the clock was paused: not counted either

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        counts = Counter(batch[COUNTS])
        counts.update({f"source_tokens_{i}": tokens for i, tokens in enumerate(batch.get(SOURCE_TOKENS, ()))})
        if batch.get(WINDOW, {}).get("fill") is not None:
            self.window_fills[(trainer.current_epoch, batch[WINDOW]["number"])] = batch[WINDOW]["fill"]
        if self._shape:
            counts["flops"] = model_flops(self._shape, batch[COUNTS], batch[LENGTHS], batch.get(KEY_LENGTHS))
            counts["hardware_flops"] = hardware_flops(self._shape, batch[COUNTS])
        sampled = _sampling_seconds(batch)  # on-policy rollouts sampled since the last batch: not training time
        trained = now - self._batch_start - (sampled - self._sampled)
        if ROUND in batch:  # both clocks of an on-policy step, for the generation share
            counts.update({"round_s": sampled - self._rounds_counted, "train_s": trained})
            self._rounds_counted = sampled
        self.train_seconds += trained
        self._sampled = sampled
        self._batch_start = now
        self.totals.update(counts)
        self._recent.append((self.train_seconds, counts))
        # Lightning's own test for "this step's metrics reach the loggers" (log_every_n_steps, or the run stops).
        if trainer.world_size > 1 and not should_update_logs(trainer):
            return
        rates = self.rates(trainer, pl_module)
        share = rates.pop("generation_share", None)
        if share is not None:
            pl_module.log("rollout/generation_share", share, on_step=True, batch_size=1)
        for name, value in rates.items():
            pl_module.log(f"train/{name}", value, on_step=True, batch_size=1)
        pl_module.log(
            "tok/s", rates["effective_tokens_per_sec"], on_step=True, batch_size=1, prog_bar=True, logger=False
        )

    def rates(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """Windowed rates over the steps in `_recent`, summed over ranks (a collective with several ranks)."""
        window: Counter[str] = Counter()
        for _, counts in list(self._recent)[1:]:
            window.update(counts)
        names = [*_RATES.values(), "flops", "hardware_flops", "round_s", "train_s"]
        summed = _sum_over_ranks(trainer, pl_module, window, names)
        elapsed = max(self._recent[-1][0] - self._recent[0][0], 1e-9)
        metrics = {name: summed[count] / elapsed for name, count in _RATES.items()}
        if trainer.world_size > 1:
            metrics["effective_tokens_per_sec_per_rank"] = metrics["effective_tokens_per_sec"] / trainer.world_size
        metrics["tflops_per_sec"] = summed["flops"] / elapsed / 1e12
        metrics["hardware_tflops_per_sec"] = summed["hardware_flops"] / elapsed / 1e12
        if self._peak_flops:
            metrics["mfu"] = summed["flops"] / elapsed / self._peak_flops
        metrics["peak_memory_gb"] = peak_memory_gb(pl_module.device)
        if summed["round_s"] + summed["train_s"] > 0:  # on-policy steps in the window
            metrics["generation_share"] = summed["round_s"] / (summed["round_s"] + summed["train_s"])
        return metrics

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Here, not in `on_fit_end`: that runs after the strategy's teardown (model on CPU), too late for a
        # collective on the device.
        if not self.summary or not self.totals:
            return
        table = self.summary_table(trainer, pl_module)  # every rank takes part in the sum
        if trainer.is_global_zero:
            Console().print(table)

    def summary_table(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Table:
        """Steps, examples, real tokens, padding, effective tokens/s, peak memory, final losses.

        Counts and tokens/s are summed over ranks (one all-reduce) and labelled "all ranks" when there are
        several; time and memory are this rank's (rank 0, which prints). After a resume, the optimizer steps are
        given for the run and for this launch, and what this process measured is labelled "this launch".
        """
        launch = "this launch" if self._first_step else ""
        rows = self._step_rows(trainer) + self._measured_rows(trainer, pl_module, launch)
        estimate = getattr(pl_module, "memory_estimate", None)  # PackedCausalLM's prediction, made before step 1
        if estimate is not None:
            rows.append(("predicted peak memory", f"{estimate.peak / 2**30:.2f} GiB"))
        metrics = trainer.callback_metrics
        for key in ("train/loss", "val/loss", "val/perplexity"):
            if key in metrics:
                rows.append((key, f"{float(metrics[key]):.4f}"))
        rows += self._source_rows(trainer, pl_module, launch)
        rows += data_rows(self._data, pl_module, launch)
        title = "lit_packing fit summary" + (f" (resumed at step {self._first_step:,})" if launch else "")
        table = Table(title=title, show_header=False)
        for name, value in rows:
            table.add_row(name, value)
        return table

    def _source_rows(self, trainer: pl.Trainer, pl_module: pl.LightningModule, launch: str) -> list[tuple[str, str]]:
        """A stream's sources: each one's share of the real tokens trained, beside its weight (all ranks)."""
        sources = self._data.sources if self._data is not None else ()
        if not sources:
            return []
        fills = list(self.window_fills.values())
        mean = sum(fills) / max(len(fills), 1)
        rows = [(_label("window fill (mean)", launch), f"{mean:.4f} over {len(fills):,} windows")] if fills else []
        names = [f"source_tokens_{i}" for i in range(len(sources))]
        tokens = _sum_over_ranks(trainer, pl_module, self.totals, names)
        total, weights = max(sum(tokens.values()), 1.0), sum(w for _, w in sources)
        return rows + [
            (_label(f"share of real tokens: {name}", launch), f"{tokens[key] / total:.3f} (weight {w / weights:.3f})")
            for (name, w), key in zip(sources, names)
        ]

    def _step_rows(self, trainer: pl.Trainer) -> list[tuple[str, str]]:
        """The optimizer steps: one row for a fresh run, the run's (global step) and this launch's after a resume."""
        if not self._first_step:
            return [("optimizer steps", f"{trainer.global_step:,}")]
        return [
            ("optimizer steps (run)", f"{trainer.global_step:,}"),
            ("optimizer steps (this launch)", f"{trainer.global_step - self._first_step:,}"),
        ]

    def _measured_rows(self, trainer: pl.Trainer, pl_module: pl.LightningModule, launch: str) -> list[tuple[str, str]]:
        """What this process counted and timed: examples, tokens, padding, tokens/s, train time, peak memory."""
        names = ["examples", "real_tokens", "slot_tokens"]
        totals = _sum_over_ranks(trainer, pl_module, self.totals, names)
        seconds, ranks = max(self.train_seconds, 1e-9), trainer.world_size
        summed, rank0 = (f"{ranks} ranks", "rank 0") if ranks > 1 else ("", "")
        padding = (totals["slot_tokens"] - totals["real_tokens"]) / max(totals["slot_tokens"], 1)
        rows = [
            (_label("examples", launch, summed), f"{totals['examples']:,.0f}"),
            (_label("real tokens", launch, summed), f"{totals['real_tokens']:,.0f}"),
            (_label("slot tokens", launch, summed), f"{totals['slot_tokens']:,.0f}"),
            (_label("padding ratio", launch), f"{padding:.3f}"),
            (_label("effective tokens/s", launch, summed), f"{totals['real_tokens'] / seconds:,.1f}"),
        ]
        if ranks > 1:
            per_rank = totals["real_tokens"] / seconds / ranks
            rows.append((_label("effective tokens/s per rank", launch), f"{per_rank:,.1f}"))
        return rows + [
            (_label("train time", launch, rank0), f"{seconds:,.1f} s"),
            (_label("peak memory", launch, rank0), f"{peak_memory_gb(pl_module.device):.2f} GiB"),
        ]


def _sum_over_ranks(
    trainer: pl.Trainer, pl_module: pl.LightningModule, counts: Counter[str], names: list[str]
) -> dict[str, float]:
    """`counts[name]` summed over every rank for each name, a batch counted once however many tensor-parallel peers
    train it: one all-reduce with several ranks, none with one."""
    values = [float(counts[name]) for name in names]
    if trainer.world_size > 1:
        peers = trainer.world_size // data_parallel(trainer).size  # each counted the same batches
        values = trainer.strategy.reduce(
            torch.tensor(values, dtype=torch.float64, device=pl_module.device) / peers, reduce_op="sum"
        ).tolist()
    return dict(zip(names, values))
