"""The streamed feed: validation rows held out and tokenized at `setup`, the rest read as a stream
(`lit_packing.data.stream`) and tokenized while it trains.

    PackingDataModule(source=Mixture(...))   # data.streaming: true (a Mixture always) trains from a `StreamFeed`

The training loader is a `StreamLoader`: each window of `data.buffer_size` examples planned by the configured
sampler, as the cached path plans an epoch.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np

from lit_packing._compat import data_parallel
from lit_packing.batch import StepShape
from lit_packing.contract import DataContract
from lit_packing.data.feed import AutoCandidates, Feed, SamplerBuilder
from lit_packing.data.global_batch import Layout
from lit_packing.data.report import TokenizationReport
from lit_packing.data.shapes import LINE
from lit_packing.data.stream import Stream, StreamLoader, TokenizeRules, Window, held_out, members, split_id
from lit_packing.data.tokenize import TokenizedDataset, tokenize_dataset
from lit_packing.errors import ConfigError
from lit_packing.samplers import PlannedBatchSampler
from lit_packing.samplers.base import PackPlan
from lit_packing.samplers.base import worst_pack as worst_pack_of
from lit_packing.text import count

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)


class StreamFeed(Feed):
    """Validation examples: each source's first `data.val_split` rows, tokenized as the cached path does; training
    examples: the stream of the rest, from a `StreamLoader`."""

    def prepare(self, tokenizer: Any) -> None:
        """Build what a source's shards read (a packaged source's Arrow files) once; nothing is tokenized ahead."""
        for member in members(self.settings.source):
            member.source.shards(self.settings.cache_dir)

    def publish(self, stage: str | None, tokenizer: Any, trainer: pl.Trainer | None) -> DataContract:
        """Hold out the validation rows (tokenized now, as the cached path does), and set up the stream of the rest."""
        settings = self.settings
        if trainer is not None and stage in (None, "fit") and (trainer.max_steps or -1) < 0:
            raise ConfigError(
                "trainer.max_steps",
                "a stream's length is known only by reading it, so the learning-rate schedule needs the run's length",
                "set it (e.g. --trainer.max_steps=1000); trainer.max_epochs may still end the run earlier",
            )
        rules = TokenizeRules(tokenizer, settings.max_length, settings.overlong, settings.train_on, settings.on_bad_row)
        held = held_out(settings.source, self._held_count(), settings.cache_dir)
        self.report = TokenizationReport()  # the held-out rows', then every streamed chunk's as it is read
        self.stream = Stream(
            settings.source, rules, settings.buffer_size, settings.seed, settings.num_workers, held.per_shard,
            cache_dir=settings.cache_dir, report=self.report, limit=settings.limit,
        )  # fmt: skip
        val = self._tokenize_held(tokenizer, held.rows, held.ids) if held.rows else None
        self.val_dataset = self.test_dataset = val
        names = ", ".join(f"{m.name} {m.weight:g}" for m in self.stream.members)
        log.info(
            "%r with %s: streamed in windows of %s (sources: %s), tokenized as it trains; %s validation examples "
            "held out", settings.source, settings.tokenizer_name, count(settings.buffer_size, "example"), names,
            f"{len(val) if val is not None else 0:,}",
        )  # fmt: skip
        return DataContract(
            tokenizer=tokenizer,
            token_id_range=(0, len(tokenizer) - 1),  # what the tokenizer can emit: the stream is not read yet
            name_rows=lambda indices: "; ".join(self.stream.name_example(int(i)) for i in indices),
            largest_step=functools.partial(self.largest_step, tokenizer),
            report=self.report,
            sources=tuple((m.name, m.weight) for m in self.stream.members),
        )

    def train_loader(self, build: SamplerBuilder, tokenizer: Any, trainer: pl.Trainer | None) -> StreamLoader:
        """The training loader of the stream: each window planned by the configured sampler, connected to the run."""

        def layout() -> Layout:
            if trainer is None:
                return Layout(1, 1)
            return Layout(data_parallel(trainer).size, trainer.accumulate_grad_batches)

        def make_sampler(window: Window) -> PlannedBatchSampler:
            sampler = build(window.lengths, window.count_labels)
            if not isinstance(sampler, PlannedBatchSampler):
                raise ConfigError(
                    "data.sampler", f"{sampler!r} has no plan to stream with", "use a lit_packing sampler"
                )
            if sampler.drop_last:
                raise ConfigError(
                    "data.sampler.init_args.drop_last",
                    "would drop examples of every window of a stream",
                    "leave it false with data.streaming (only the epoch's last step is completed with empty packs)",
                )
            return sampler

        self.sampler = StreamLoader(self.stream, make_sampler, self.collate(tokenizer), layout)
        self._apply_position()
        return self.sampler

    def largest_step(self, tokenizer: Any) -> StepShape | None:
        """The worst a window can plan: examples of `data.max_length` tokens, in the step size the sampler declares
        (`FeedSettings.declared_max_tokens` / `declared_batch_size`); None before `train_loader`, or for a step size
        given as `auto` (sized by the estimate itself)."""
        if self.sampler is None:
            return None
        longest = self.settings.max_length
        budget, size = self.settings.declared_max_tokens, self.settings.declared_batch_size
        if isinstance(budget, int):
            pack = worst_pack_of(0, min(longest, budget), budget)
        elif isinstance(size, int):
            pack = worst_pack_of(size, longest)
        else:
            return None
        return self.collate(tokenizer).plan_slots(pack).largest()

    def position(self, trained: int | None) -> dict[str, Any]:
        return self.sampler.state_dict(trained)

    def auto_candidates(
        self, setting: str, candidates: list[int], worst_pack: Callable[[int], PackPlan]
    ) -> AutoCandidates:
        """Every window of a stream must fit: the step is sized for examples of `data.max_length` tokens."""
        longest, budgeted = self.settings.max_length, setting != "batch_size"
        candidates = [c for c in candidates if not budgeted or c >= longest] or candidates[-1:]

        def worst(value: int) -> PackPlan:
            return worst_pack_of(0 if budgeted else value, longest, value if budgeted else None)

        return AutoCandidates(candidates, worst)

    def _held_count(self) -> int:
        """`val_split` as a count of each source's first rows; a fraction where every shard's row count is known."""
        val_split, source = self.settings.val_split, self.settings.source
        if not isinstance(val_split, float):
            return val_split
        if not val_split:
            return 0
        sizes = [shard.rows for member in members(source) for shard in member.source.shards(self.settings.cache_dir)]
        if any(size is None for size in sizes):
            raise ConfigError(
                "data.val_split",
                f"{val_split} is a fraction of a stream whose size is known only by reading it",
                "give a count of each source's first rows to hold out (e.g. data.val_split=200), or 0",
            )
        return max(1, round(val_split * sum(sizes) / max(len(members(source)), 1)))

    def _tokenize_held(self, tokenizer: Any, rows: list[dict], ids: list[int]) -> TokenizedDataset:
        """The held-out rows, tokenized with the cached path's function (in memory), one source at a time."""
        settings = self.settings
        parts, reports = [], []
        by_source: dict[int, list[int]] = {}
        for k, example in enumerate(ids):
            by_source.setdefault(split_id(example)[0], []).append(k)
        for positions in by_source.values():
            raw = datasets.Dataset.from_list([{k: v for k, v in rows[p].items() if k != LINE} for p in positions])
            tokenized, report = tokenize_dataset(
                raw, tokenizer, settings.max_length, settings.overlong, settings.train_on,
                on_bad_row=settings.on_bad_row, rows=np.asarray([ids[p] for p in positions], dtype=np.int64),
                row_name=self.stream.name_example,
            )  # fmt: skip
            parts.append(tokenized)
            reports.append(report)
        for report in reports:
            self.report.update(report)
        return TokenizedDataset(datasets.concatenate_datasets(parts))
