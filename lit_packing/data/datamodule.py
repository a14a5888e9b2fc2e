"""The LightningDataModule: source -> tokenize (cached) -> deterministic split -> packing sampler + collator.

    dm = PackingDataModule(source=Chatterbot(), max_length=512); dm.prepare_data(); dm.setup("fit")

`prepare_data` loads the source and tokenizes it into the `datasets` disk cache (once, on one process); `setup`
runs the same steps, which now hit the cache, splits off the validation set, builds the datasets and publishes
what the model and the callbacks may know of the data as a `DataContract` (`lit_packing.contract`). Samplers and
the collator are built late from factories, because the lengths and the pad id are only known then:

    sampler(train_lengths).connect(RunContext(...))   # a batch sampler: one pack of example indices per step
    collator(pad_token_id)                            # list of examples -> one batch

The sampler's run context (the seed, the ranks, gradient accumulation, the model's cost coefficients, the label
counter) comes in that one `connect` call and fills only what the sampler's own `init_args` left unset. Every
setting is range-checked once, when the CLI builds the objects (the sampler factories are built once on no data),
so a bad value stops before any tokenization or model loading; a sampler's error names its parameter by its CLI
path (`lit_packing.contract.setting_paths`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable
from typing import Any, Literal

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Sampler

from lit_packing._compat import batch_sampler_with_epoch, set_accumulate_grad_batches, trained_batches
from lit_packing.assets import resolve_pretrained
from lit_packing.batch import INPUT_IDS, StepShape
from lit_packing.contract import DataContract, ModelContract, setting_paths
from lit_packing.data.collate import PackedCollator, PaddedCollator
from lit_packing.data.mixture import Mixture
from lit_packing.data.packaged import ChampChats
from lit_packing.data.sources import Source
from lit_packing.data.stream import Stream, StreamLoader, TokenizeRules, Window, held_out, members, split_id
from lit_packing.data.tokenize import (
    INDEX,
    LINE,
    ROW,
    SAMPLES,
    TOKEN_HASH,
    OnBadRow,
    TokenizationReport,
    TokenizedDataset,
    check_tokenize_settings,
    column,
    tokenize_dataset,
)
from lit_packing.errors import ConfigError, DataError, check_range
from lit_packing.processes import EndWithParent
from lit_packing.samplers import AUTO, BestFitPackingSampler, PlannedBatchSampler, RunContext
from lit_packing.samplers.base import worst_pack as worst_pack_of
from lit_packing.text import count, dividing_fix

log = logging.getLogger(__name__)

VALIDATION_SPLITS = ("validation", "test")  # a source's own split used for validation, first found


def check_val_split(val_split: int | float) -> None:
    """Range-check `data.val_split` on its own (a fraction in [0, 1) or a count >= 0); the data size is checked later
    by `split_rows`."""
    if not isinstance(val_split, float):
        check_range("data.val_split", val_split, 0)
        return
    try:
        check_range("data.val_split", val_split, 0, 1, high_open=True)
    except ConfigError as error:
        fix = "a float is a fraction of the examples in [0, 1) (e.g. 0.05); use an int for a count"
        raise ConfigError(error.setting, error.problem, fix) from None


def split_rows(n: int, val_split: int | float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic train / validation split of rows `0..n-1`: `(train_rows, val_rows)`, each sorted.

    A fraction adapts to the data (0.05 of 30 examples is 2, of a million 50,000); a count is taken as given.

    Args:
        n: number of examples.
        val_split: a fraction in [0, 1) (float) or a count (int) of validation examples; a fraction > 0 keeps at
            least one validation and one training example.
        seed: the same seed always gives the same split (`numpy.random.default_rng(seed).permutation(n)`).

    Raises:
        ConfigError: `val_split` out of range, or a count that leaves no training example.
    """
    check_val_split(val_split)
    if isinstance(val_split, float):
        n_val = min(max(round(val_split * n), 1 if val_split > 0 else 0), max(n - 1, 0))
    else:
        if val_split >= max(n, 1):
            raise ConfigError(
                "data.val_split",
                f"{val_split} examples leave no training data out of {n:,}",
                f"give a fraction (e.g. data.val_split=0.05, which adapts to the data), a count below {n:,}, or more "
                "examples (data.limit)",
            )
        n_val = val_split
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def check_val_check_interval(trainer: Any, train_steps: int) -> None:
    """Raise a clear error where an explicit `trainer.val_check_interval` (an int) cannot work on this data.

    Lightning counts an int interval in training batches of one epoch; more than the epoch has is an error there
    too, but one that names neither the setting's CLI path nor the fixes.

    Args:
        trainer: the Lightning Trainer (its `val_check_interval` and `check_val_every_n_epoch`).
        train_steps: training batches per epoch on this rank (`len(sampler)`).

    Raises:
        ConfigError: naming `trainer.val_check_interval` and the data settings that size the epoch.
    """
    interval = trainer.val_check_interval
    if not isinstance(interval, int) or trainer.check_val_every_n_epoch is None or interval <= train_steps:
        return
    if not trainer.limit_val_batches:  # validation is off: Lightning lets any interval pass
        return
    raise ConfigError(
        "trainer.val_check_interval",
        f"{interval} batches is more than the {train_steps:,} training batches of one epoch of this data",
        f"give a fraction of the run instead (e.g. trainer.val_check_interval=0.5, or 1.0 for the end only), a count "
        f"up to {train_steps:,}, or more training examples (data.val_split, data.limit)",
    )


class PackingDataModule(LightningDataModule):
    """Packed fine-tuning data: any source, the model's tokenizer and chat template, a packing batch sampler.

    Args:
        source: where examples come from (a `lit_packing.data.sources` class); None means `ChampChats()`.
        tokenizer: `smollm2`, `gpt2-tokenizer`, a local folder or a Hub id (via `resolve_pretrained`).
        max_length: most tokens per example.
        overlong: examples over `max_length`: `truncate` (keep the first tokens), `drop` or `error`.
        train_on: `completion` (assistant turns / completions; default) or `all` tokens.
        val_split: validation fraction (float) or count (int), split off with `seed` from the examples before
            tokenization; a fraction adapts to the data. Ignored when the source has its own `validation` (or
            `test`) split. `main.py test` scores the source's `test` split where it has one besides
            `validation`, else the validation examples.
        limit: keep only this many examples of each split (a seeded random choice), for quick runs; with
            `streaming`, each source's first `limit` training rows (its shards in their sorted order, unshuffled).
        seed: seed of the split, of `limit` and of the samplers that were not given their own `seed`. A sampler
            gets the rest of its run context from the run (`RunContext`): the trainer's ranks and
            `accumulate_grad_batches`, and the connected model's cost coefficients (`MultipackSampler`), each only
            where its own `init_args` left it unset.
        num_workers: DataLoader worker processes.
        sampler: builds the training batch sampler from the lengths, e.g. `BestFitPackingSampler` or in YAML
            `{class_path: lit_packing.samplers.BestFitPackingSampler, init_args: {max_tokens: 8192}}`.
        val_sampler: the same for validation; None calls `sampler(val_lengths, shuffle=False)`.
        val_collator: the collator for validation; None uses `collator`. Set both `val_*` when training cuts or
            mixes examples (the fixed-length variants) but validation must score whole, isolated examples.
        collator: builds the collate function from the pad id: `PackedCollator` or `PaddedCollator` (the class, or
            in YAML `{class_path: lit_packing.data.PackedCollator, init_args: {pad_to_multiple_of: 64}}`; typed
            by the classes so that jsonargparse builds a factory, not an instance).
        cache_dir: where `datasets` keeps the examples and their tokenization (None: its default cache).
        num_proc: processes for tokenization (`datasets.map`); None uses one process.
        on_bad_row: rows that cannot be trained (malformed lines, null or mistyped fields, unknown roles, no
            assistant turn, empty answers, control characters): `error` (default) stops before training naming the
            first rows; `skip` leaves them out and counts them (log, `data/bad_examples`, the fit summary).
        packs_per_step: the global batch: packs (micro-batches of one rank) per optimizer step over all ranks.
            `trainer.accumulate_grad_batches` follows from it for the world size the run gets (8 packs: 8 x 1 on 8
            ranks, 2 x 4 on 2, 1 x 8 on one), and every world size that divides it trains the same optimizer steps
            from the same packs in the same order. None: `world size x trainer.accumulate_grad_batches` at the first
            launch, which a resume on another world size keeps (see `docs/resume_and_scale_out.md`).
        tokens_per_step: the global batch in tokens, for samplers with a token budget: `tokens_per_step /
            max_tokens` packs per optimizer step (a whole number). Set at most one of the two.
        streaming: read the source as a stream (`lit_packing.data.stream`): nothing is tokenized ahead of training,
            the DataLoader workers tokenize chunks of `buffer_size` rows, and the sampler plans each window of
            `buffer_size` examples as it plans an epoch here. Needs `trainer.max_steps` (a stream's length is known
            only by reading it); `val_split` is then a count of each source's first rows (held out, in file order).
            A `Mixture` source is always streamed.
        buffer_size: with `streaming`, examples per window (and rows per tokenized chunk).
    """

    def __init__(
        self,
        source: Source | None = None,
        tokenizer: str = "smollm2",
        max_length: int = 2048,
        overlong: Literal["truncate", "drop", "error"] = "truncate",
        train_on: Literal["completion", "all"] = "completion",
        val_split: int | float = 0.05,
        limit: int | None = None,
        seed: int = 42,
        num_workers: int = 0,
        sampler: Callable[[np.ndarray], Sampler] = BestFitPackingSampler,
        val_sampler: Callable[[np.ndarray], Sampler] | None = None,
        collator: Callable[[int], PackedCollator | PaddedCollator] = PackedCollator,
        val_collator: Callable[[int], PackedCollator | PaddedCollator] | None = None,
        cache_dir: str | None = None,
        num_proc: int | None = None,
        on_bad_row: OnBadRow = "error",
        packs_per_step: int | None = None,
        tokens_per_step: int | None = None,
        streaming: bool = False,
        buffer_size: int = 1000,
    ) -> None:
        super().__init__()
        check_tokenize_settings(max_length, overlong, train_on, on_bad_row)
        check_range("data.limit", limit, 1)
        check_range("data.seed", seed, 0)
        check_range("data.num_workers", num_workers, 0)
        check_range("data.num_proc", num_proc, 1)
        check_val_split(val_split)
        check_range("data.packs_per_step", packs_per_step, 1)
        check_range("data.tokens_per_step", tokens_per_step, 1)
        check_range("data.buffer_size", buffer_size, 1)
        if packs_per_step is not None and tokens_per_step is not None:
            raise ConfigError(
                "data.tokens_per_step",
                f"set together with data.packs_per_step={packs_per_step}: both give the global batch",
                "set one of them",
            )
        self.source = source if source is not None else ChampChats()
        self.tokenizer_name = tokenizer
        self.max_length = max_length
        self.overlong = overlong
        self.train_on = train_on
        self.val_split = val_split
        self.limit = limit
        self.seed = seed
        self.num_workers = num_workers
        self.sampler = sampler
        self.val_sampler = val_sampler
        self.collator = collator
        self.val_collator = val_collator
        self.cache_dir = cache_dir
        self.num_proc = num_proc
        self.on_bad_row = on_bad_row
        self.packs_per_step = packs_per_step
        self.tokens_per_step = tokens_per_step
        self.streaming = streaming or isinstance(source, Mixture)
        self.buffer_size = buffer_size
        self.stream: Stream | None = None  # with `streaming`, built by `setup`
        for component, factory in (("sampler", sampler), ("val_sampler", val_sampler)):
            if factory is not None:
                self._probe(component, factory)
        self.overlap_examples = 0  # validation examples whose tokens equal a training example's
        self._tokenizer = None
        self.train_dataset: TokenizedDataset | None = None
        self.val_dataset: TokenizedDataset | None = None
        self.test_dataset: TokenizedDataset | None = None
        self.report: TokenizationReport | None = None
        self.train_sampler: Sampler | None = None
        self._position: dict | None = None  # `load_state_dict`'s, restored when `train_dataloader` builds the sampler
        self.contract: DataContract | None = None  # published by `setup`
        self._prepared = False  # `prepare_data` ran in this process (and announced the data)
        self.model_contract: ModelContract | None = None  # what the model publishes (`connect_model`)
        self._auto_chosen: dict[str, int] = {}  # what a sampler's `auto` setting was sized to
        self._accumulate_setting: int | None = None  # `trainer.accumulate_grad_batches` as configured

    # ------------------------------------------------------------ run-time values (linked to the model by the CLI)

    @property
    def tokenizer(self):
        """The Hugging Face tokenizer, loaded on first use."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            folder = resolve_pretrained(self.tokenizer_name, with_model=False, setting="data.tokenizer")
            self._tokenizer = AutoTokenizer.from_pretrained(folder)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """`len(tokenizer)`: the embedding rows the model needs (added tokens included)."""
        return len(self.tokenizer)

    @property
    def pad_token_id(self) -> int:
        """The tokenizer's pad id, else its eos id, else 0 (pad positions are never trained or attended)."""
        for candidate in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id):
            if candidate is not None:
                return candidate
        return 0

    @property
    def train_lengths(self) -> np.ndarray:
        """(n_train,) int64 tokens per training example (after `setup`)."""
        return self._require(self.train_dataset).lengths

    @property
    def val_lengths(self) -> np.ndarray:
        """(n_val,) int64 tokens per validation example (empty without a validation set)."""
        return self.val_dataset.lengths if self.val_dataset is not None else np.zeros(0, dtype=np.int64)

    # ------------------------------------------------------------ Lightning hooks

    def prepare_data(self) -> None:
        """Load the source and tokenize it into the disk cache (Lightning runs this on one process per node); a
        stream is tokenized while it trains."""
        if self.streaming:  # build what a source's shards read (a packaged source's Arrow files) once
            for member in members(self.source):
                member.source.shards(self.cache_dir)
        else:
            self._tokenize(announce=True)
        self._prepared = True

    def setup(self, stage: str | None = None) -> None:
        """Tokenize (from the cache), split, and build `train_dataset`, `val_dataset` and `report` once; for a fit,
        set the trainer's gradient accumulation from the global batch (`packs_per_step` / `tokens_per_step`)."""
        if self.trainer is not None and stage in (None, "fit"):
            if self._accumulate_setting is None:
                self._accumulate_setting = self.trainer.accumulate_grad_batches
            self._apply_global_batch()
        if self.train_dataset is not None or self.stream is not None:
            return
        if self.streaming:
            self._setup_stream(stage)
            return
        tokenized = self._tokenize(announce=not self._prepared)  # one line per run says where the data came from
        train, self.report = tokenized["train"]
        if "validation" in tokenized:
            val, val_report = tokenized["validation"]
            self.report = self.report + val_report
        else:
            train, val = self._split(train, self.report.examples_in)
        if not len(train):
            raise DataError(
                f"nothing to train on: all {len(val):,} kept examples are validation examples: lower data.val_split"
            )
        test = val
        if "test" in tokenized:
            test, test_report = tokenized["test"]
            self.report = self.report + test_report
        self.train_dataset = TokenizedDataset(train)
        self.val_dataset = TokenizedDataset(val) if len(val) else None
        self.test_dataset = TokenizedDataset(test) if len(test) else None
        own_test = f" / {len(test):,} test" if "test" in tokenized else ""
        log.info(
            "%r with %s: %s; %s train / %s validation%s examples", self.source, self.tokenizer_name, self.report,
            f"{len(self.train_dataset):,}", f"{len(val):,}", own_test,
        )  # fmt: skip
        self._warn_about(train, val)
        self.contract = DataContract(
            tokenizer=self.tokenizer,
            token_id_range=self.token_id_range,
            name_rows=self.name_rows,
            largest_step=self.largest_step,
            report=self.report,
            overlap_examples=self.overlap_examples,
        )

    # ------------------------------------------------------------ the global batch

    def global_batch(self) -> tuple[int, str] | None:
        """`(packs per optimizer step, the setting that gave it)` from `packs_per_step` / `tokens_per_step`; None when
        neither is set (the global batch is then the world size x `trainer.accumulate_grad_batches`)."""
        if self.packs_per_step is not None:
            return self.packs_per_step, "data.packs_per_step"
        if self.tokens_per_step is None:
            return None
        with self._named_settings("sampler"):
            budget = getattr(self.sampler(np.zeros(0, dtype=np.int64)), "max_tokens", None)
        if budget == AUTO:
            raise ConfigError(
                "data.tokens_per_step",
                "needs a fixed token budget, and data.sampler.init_args.max_tokens is auto (chosen at train start)",
                "set data.packs_per_step instead, or give max_tokens a number",
            )
        if not isinstance(budget, int):
            raise ConfigError(
                "data.tokens_per_step",
                "counts the tokens of packs filled up to a token budget, and this sampler has none",
                "use data.packs_per_step (packs per optimizer step)",
            )
        if self.tokens_per_step % budget:
            low = max(self.tokens_per_step // budget, 1) * budget
            raise ConfigError(
                "data.tokens_per_step",
                f"{self.tokens_per_step:,} tokens is not a whole number of {budget:,}-token packs "
                f"(data.sampler.init_args.max_tokens)",
                f"use a multiple of {budget:,} (e.g. {low:,} or {low + budget:,}), or data.packs_per_step",
            )
        return self.tokens_per_step // budget, "data.tokens_per_step"

    def _apply_global_batch(self) -> None:
        """Set `trainer.accumulate_grad_batches` to the global batch over the world size; refuse what cannot
        divide, or an accumulation set by hand that contradicts it."""
        given = self.global_batch()
        if given is None:
            return
        packs, setting = given
        trainer = self.trainer
        world = trainer.world_size
        if packs % world:
            raise ConfigError(
                setting,
                f"{count(packs, 'pack')} per optimizer step cannot be split evenly over {count(world, 'rank')}",
                dividing_fix(packs, world, setting),
            )
        accumulate = packs // world
        if trainer.accumulate_grad_batches not in (1, accumulate):
            raise ConfigError(
                "trainer.accumulate_grad_batches",
                f"{trainer.accumulate_grad_batches} contradicts {setting}: {count(packs, 'pack')} per optimizer step "
                f"on {count(world, 'rank')} is {accumulate} accumulated",
                f"leave trainer.accumulate_grad_batches unset: it follows from {setting}",
            )
        set_accumulate_grad_batches(trainer, accumulate)
        log.info(
            "global batch: %s per optimizer step (%s) = %s x %d accumulated",
            count(packs, "pack"), setting, count(world, "rank"), accumulate,
        )  # fmt: skip

    def _keep_global_batch(self, position: dict[str, Any], setting: int) -> None:
        """On a resume: keep the checkpoint's global batch unless the run changes it (`data.packs_per_step`, or a
        `trainer.accumulate_grad_batches` setting other than the saved launch's `setting`); say when it changes."""
        trainer = self.trainer
        saved_world, saved_accumulate = int(position["world_size"]), int(position["accumulate"])
        saved = saved_world * saved_accumulate
        world, accumulate = trainer.world_size, trainer.accumulate_grad_batches
        given = self.global_batch()
        if given is not None:
            if given[0] != saved:
                log.info(
                    "global batch: %s per optimizer step (%s) instead of the checkpoint's %d: the packs not yet "
                    "trained are formed into steps of the new size", count(given[0], "pack"), given[1], saved,
                )  # fmt: skip
            return
        if accumulate != int(setting) or world * accumulate == saved:
            return  # a global batch the user changed (the sampler says so), or the checkpoint's already
        if saved % world:
            raise ConfigError(
                "trainer.devices",
                f"the checkpoint's global batch of {count(saved, 'pack')} per optimizer step ({saved_world} x "
                f"{saved_accumulate} accumulated) cannot be split evenly over {count(world, 'rank')}",
                f"{dividing_fix(saved, world, 'data.packs_per_step')} to change the global batch",
            )
        set_accumulate_grad_batches(trainer, saved // world)
        log.info(
            "global batch: keeping the checkpoint's %s per optimizer step (%s x %d accumulated): %s x %d accumulated "
            "now; set data.packs_per_step to change it",
            count(saved, "pack"), count(saved_world, "rank"), saved_accumulate, count(world, "rank"), saved // world,
        )  # fmt: skip

    @property
    def resumed_at(self) -> int | None:
        """After a resume: the training micro-batches of the epoch that count as trained, in this run's layout (on
        another layout, the start of the first optimizer step not completed); None otherwise."""
        return getattr(self.train_sampler, "resumed_at", None)

    def connect_model(self, model: ModelContract) -> None:
        """What the model publishes (`lit_packing.contract.DataModelConnection` calls this before any loader):
        its cost coefficients balance `MultipackSampler`'s ranks unless the sampler was given its own."""
        self.model_contract = model

    def largest_step(self) -> StepShape | None:
        """The training plan's micro-batch that needs the most memory (the collator's slots of the sampler's
        plan; no batch is built); for a stream, the worst a window can plan (examples of `max_length` tokens);
        None before `train_dataloader` or for a sampler without a plan."""
        if isinstance(self.train_sampler, StreamLoader):
            return self._largest_stream_step()
        if not isinstance(self.train_sampler, PlannedBatchSampler):
            return None
        return self.collator(self.pad_token_id).plan_slots(self.train_sampler.plan()).largest()

    def _largest_stream_step(self) -> StepShape | None:
        probe = self.sampler(np.zeros(0, dtype=np.int64))
        budget, size = getattr(probe, "max_tokens", None), getattr(probe, "batch_size", None)
        if isinstance(budget, int):
            pack = worst_pack_of(0, min(self.max_length, budget), budget)
        elif isinstance(size, int):
            pack = worst_pack_of(size, self.max_length)
        else:  # `auto`: sized by the estimate itself
            return None
        return self.collator(self.pad_token_id).plan_slots(pack).largest()

    @property
    def token_id_range(self) -> tuple[int, int]:
        """(lowest, highest) token id in the training and validation data, over the Arrow files (no row loop)."""
        lows, highs = [], []
        for part in (self.train_dataset, self.val_dataset):
            if part is not None:
                found = pc.min_max(pc.list_flatten(part.dataset.data.column(INPUT_IDS)))
                if found["min"].is_valid:
                    lows.append(found["min"].as_py())
                    highs.append(found["max"].as_py())
        return (min(lows), max(highs)) if lows else (0, 0)

    def name_rows(self, indices: list[int]) -> str:
        """Training examples (their `index`, as `batch["rows"]` carries) named as the user counts them."""
        table = self._require(self.train_dataset).dataset
        where = dict(zip(column(table, INDEX).tolist(), column(table, ROW).tolist()))
        return "; ".join(self.source.row_name(where[i]) if i in where else f"index {i}" for i in indices)

    def _warn_about(self, train: datasets.Dataset, val: datasets.Dataset) -> None:
        """Name what was skipped, dropped or duplicated, and validation examples that also appear in training."""
        report, name = self.report, self.source.row_name
        for kind, what in (("bad", "bad row"), ("duplicate", "duplicate example")):
            if report.samples.get(kind):
                n = report.bad_examples if kind == "bad" else report.duplicate_examples
                log.warning("%s, first %s", count(n, what), report.named(kind, name))
        if len(val):
            seen = np.isin(column(val, TOKEN_HASH), column(train, TOKEN_HASH))
            self.overlap_examples = int(seen.sum())
            if self.overlap_examples:
                rows = ", ".join(name(int(r)) for r in column(val, ROW)[seen][:SAMPLES])
                log.warning(
                    "%s of %s validation examples also appear in training (duplicates in the data; first %s): "
                    "validation loss overstates generalisation; deduplicate the source",
                    f"{self.overlap_examples:,}", f"{len(val):,}", rows,
                )  # fmt: skip

    def train_dataloader(self) -> DataLoader | StreamLoader:
        if self.stream is not None:
            return self._stream_loader()
        dataset = self._require(self.train_dataset)
        # Every pack carries its optimizer step's label totals (`label_counter`): the loss needs no communication.
        self.train_sampler = self._build_sampler("sampler", self.sampler, self.train_lengths, dataset.count_labels)
        if self._position is not None:
            self._restore_position()
        with self._named_settings("collator"):
            self.largest_step()  # a padding rule that cannot hold the plan's largest pack fails here, not mid-epoch
        if self.trainer is not None:
            check_val_check_interval(self.trainer, len(self.train_sampler))
        return self._loader(dataset, self.train_sampler, self.collator, resumable=self._has_position())

    def val_dataloader(self) -> DataLoader | list:
        if self.val_dataset is None:
            return []
        return self._eval_loader(self.val_dataset)

    def test_dataloader(self) -> DataLoader:
        """`python main.py test`: the source's own `test` split, else the held-out (validation) examples, built
        exactly as validation builds them, so both commands score a split the same way."""
        if self.test_dataset is None:
            raise ConfigError(
                "data.val_split",
                "no held-out examples to test on",
                "set it > 0 (or use a source with a test split)",
            )
        return self._eval_loader(self.test_dataset)

    def state_dict(self) -> dict[str, Any]:
        """The training position, saved in every checkpoint (Lightning calls this); {} for a sampler without one.

        The micro-batches of the epoch that were TRAINED (Lightning's count, never what the DataLoader's workers
        prefetched; without a trainer, the batches handed out), the epoch, the seed, the layout (world size,
        accumulation), the plan's identity, and the optimizer step it was saved at. This is the one copy of the
        position: the training loader only tells Lightning that it resumes (`_ResumableLoader`), because Lightning
        restores a data module before anything builds a loader, and a loader's own state too late to be used.
        """
        if not self._has_position():
            return {}
        if self.trainer is None:
            return {"train_sampler": self.train_sampler.state_dict()}
        if isinstance(self.train_sampler, (PlannedBatchSampler, StreamLoader)):
            position = self.train_sampler.state_dict(steps_done=trained_batches(self.trainer))
        else:
            position = self.train_sampler.state_dict()
        return {
            "train_sampler": position,
            "global_step": self.trainer.global_step,
            "accumulate_setting": self._accumulate_setting,  # the config's, before a global batch derived another
            "auto_chosen": dict(self._auto_chosen),  # what `auto` settings were sized to: the plan depends on it
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict()`: onto the training sampler now, or when `train_dataloader` builds it (on a resume,
        Lightning calls this before it asks for any loader)."""
        if state_dict.get("train_sampler") is None:
            return
        self._auto_chosen.update(state_dict.get("auto_chosen", {}))  # the same plan: `auto` is not sized again
        if self.trainer is not None and "world_size" in state_dict["train_sampler"]:
            saved = state_dict["train_sampler"]
            self._keep_global_batch(saved, state_dict.get("accumulate_setting") or saved["accumulate"])
        self._position = state_dict
        if self.train_sampler is not None:
            self._restore_position()

    def _has_position(self) -> bool:
        """Whether the training sampler saves and restores its position (every `PlannedBatchSampler` does)."""
        return all(hasattr(self.train_sampler, name) for name in ("state_dict", "load_state_dict"))

    def _restore_position(self) -> None:
        """Apply `load_state_dict`'s position to the training sampler and say what was restored, at which step."""
        position, self._position = self._position, None
        with self._named_settings("sampler", self.train_sampler):
            self.train_sampler.load_state_dict(position["train_sampler"])
        # The step saved with the position: `configure_optimizers` may build the loader (reading
        # `trainer.estimated_stepping_batches`) before Lightning restores `trainer.global_step`.
        step = position.get("global_step", self.trainer.global_step if self.trainer is not None else 0)
        restored = getattr(self.train_sampler, "restored", None) or "the saved position"
        log.info("resumed at optimizer step %s: %s", f"{step:,}", restored)

    # ------------------------------------------------------------ streaming

    def _setup_stream(self, stage: str | None) -> None:
        """Hold out the validation rows (tokenized now, as the cached path does), and set up the stream of the rest."""
        if self.trainer is not None and stage in (None, "fit") and (self.trainer.max_steps or -1) < 0:
            raise ConfigError(
                "trainer.max_steps",
                "a stream's length is known only by reading it, so the learning-rate schedule needs the run's length",
                "set it (e.g. --trainer.max_steps=1000); trainer.max_epochs may still end the run earlier",
            )
        rules = TokenizeRules(self.tokenizer, self.max_length, self.overlong, self.train_on, self.on_bad_row)
        held, rows, ids = held_out(self.source, self._held_count(), self.cache_dir)
        self.report = TokenizationReport()  # the held-out rows', then every streamed chunk's as it is read
        self.stream = Stream(
            self.source, rules, self.buffer_size, self.seed, self.num_workers, held, cache_dir=self.cache_dir,
            report=self.report, limit=self.limit,
        )  # fmt: skip
        val = self._tokenize_held(rows, ids) if rows else None
        self.val_dataset = self.test_dataset = val
        names = ", ".join(f"{m.name} {m.weight:g}" for m in self.stream.members)
        log.info(
            "%r with %s: streamed in windows of %s (sources: %s), tokenized as it trains; %s validation examples "
            "held out", self.source, self.tokenizer_name, count(self.buffer_size, "example"), names,
            f"{len(val) if val is not None else 0:,}",
        )  # fmt: skip
        self.contract = DataContract(
            tokenizer=self.tokenizer,
            token_id_range=(0, self.vocab_size - 1),  # what the tokenizer can emit: the stream is not read yet
            name_rows=lambda indices: "; ".join(self.stream.name_example(int(i)) for i in indices),
            largest_step=self.largest_step,
            report=self.report,
            sources=tuple((m.name, m.weight) for m in self.stream.members),
        )

    def _held_count(self) -> int:
        """`val_split` as a count of each source's first rows; a fraction where every shard's row count is known."""
        if not isinstance(self.val_split, float):
            return self.val_split
        if not self.val_split:
            return 0
        sizes = [shard.rows for member in members(self.source) for shard in member.source.shards(self.cache_dir)]
        if any(size is None for size in sizes):
            raise ConfigError(
                "data.val_split",
                f"{self.val_split} is a fraction of a stream whose size is known only by reading it",
                "give a count of each source's first rows to hold out (e.g. data.val_split=200), or 0",
            )
        return max(1, round(self.val_split * sum(sizes) / max(len(members(self.source)), 1)))

    def _tokenize_held(self, rows: list[dict], ids: list[int]) -> TokenizedDataset:
        """The held-out rows, tokenized with the cached path's function (in memory), one source at a time."""
        parts, reports = [], []
        by_source: dict[int, list[int]] = {}
        for k, example in enumerate(ids):
            by_source.setdefault(split_id(example)[0], []).append(k)
        for positions in by_source.values():
            raw = datasets.Dataset.from_list([{k: v for k, v in rows[p].items() if k != LINE} for p in positions])
            tokenized, report = tokenize_dataset(
                raw, self.tokenizer, self.max_length, self.overlong, self.train_on, on_bad_row=self.on_bad_row,
                rows=np.asarray([ids[p] for p in positions], dtype=np.int64), row_name=self.stream.name_example,
            )  # fmt: skip
            parts.append(tokenized)
            reports.append(report)
        for report in reports:
            self.report.update(report)
        return TokenizedDataset(datasets.concatenate_datasets(parts))

    def _stream_loader(self) -> StreamLoader:
        """The training loader of the stream: each window planned by the configured sampler, connected to the run."""
        trainer = self.trainer

        def layout() -> tuple[int, int]:
            return (trainer.world_size, trainer.accumulate_grad_batches) if trainer is not None else (1, 1)

        def make_sampler(window: Window) -> PlannedBatchSampler:
            sampler = self._build_sampler("sampler", self.sampler, window.lengths, window.count_labels)
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

        self.train_sampler = StreamLoader(self.stream, make_sampler, self.collator(self.pad_token_id), layout)
        if self._position is not None:
            self._restore_position()
        return self.train_sampler

    # ------------------------------------------------------------ steps

    def _tokenize(self, announce: bool) -> dict[str, tuple[datasets.Dataset, TokenizationReport]]:
        """`{"train": (tokenized, report)}`, plus `"validation"` / `"test"` where the source has its own; with
        `announce`, one line per split says whether it is tokenized now or read from the cache."""
        parts = self._raw_splits(self.source.load(cache_dir=self.cache_dir))
        tokenized = {}
        for name, raw in parts.items():
            subset, rows = self._limited(raw)
            tokenized[name] = tokenize_dataset(
                subset, self.tokenizer, self.max_length, self.overlong, self.train_on, self.num_proc,
                on_bad_row=self.on_bad_row, rows=rows, row_name=self.source.row_name,
                announce=f"{self.source!r}{'' if name == 'train' else f' ({name})'} with {self.tokenizer_name}"
                if announce else None,
            )  # fmt: skip
        return tokenized

    def _raw_splits(self, loaded: datasets.Dataset | datasets.DatasetDict) -> dict[str, datasets.Dataset]:
        if not isinstance(loaded, datasets.DatasetDict):
            return {"train": loaded}
        if "train" not in loaded:
            raise ConfigError(
                "data.source.init_args.split",
                f"{self.source!r} has splits {sorted(loaded)} but no 'train'",
                "choose one",
            )
        parts = {"train": loaded["train"]}
        validation = next((name for name in VALIDATION_SPLITS if name in loaded), None)
        if validation is not None:
            parts["validation"] = loaded[validation]
        if validation != "test" and "test" in loaded:  # a third split: `main.py test` scores it
            parts["test"] = loaded["test"]
        return parts

    def _limited(self, dataset: datasets.Dataset) -> tuple[datasets.Dataset, np.ndarray | None]:
        """A seeded random `limit` of the examples, with their rows in the source (None: all of them)."""
        if self.limit is None or self.limit >= len(dataset):
            return dataset, None
        rows = np.sort(np.random.default_rng(self.seed).permutation(len(dataset))[: self.limit])
        return dataset.select(rows), rows

    def _split(self, tokenized: datasets.Dataset, n_examples: int) -> tuple[datasets.Dataset, datasets.Dataset]:
        """Split by each example's row in the source (`index`), so drops never move an example across splits."""
        _, val_rows = split_rows(n_examples, self.val_split, self.seed)
        is_val = np.isin(column(tokenized, INDEX), val_rows)
        return tokenized.select(np.flatnonzero(~is_val)), tokenized.select(np.flatnonzero(is_val))

    def _probe(self, component: str, factory: Callable) -> None:
        """Build the sampler once on no data, so that its own checks run now, before tokenization."""
        with self._named_settings(component):
            factory(np.zeros(0, dtype=np.int64))

    @contextlib.contextmanager
    def _named_settings(self, component: str, built: Any = None):
        """Re-raise a core `ConfigError` of `data.<component>` with its settings named by their CLI paths."""
        try:
            yield
        except ConfigError as error:
            given = getattr(built, "given", {error.setting})
            raise error.under(setting_paths(component, [error.setting], given)) from None

    def _eval_loader(self, dataset: TokenizedDataset) -> DataLoader:
        """Whole, isolated examples in a fixed order: `val_sampler` / `val_collator`, else the training ones."""
        if self.val_sampler is not None:
            sampler = self._build_sampler("val_sampler", self.val_sampler, dataset.lengths)
        else:  # the training sampler's settings, with the value its `auto` chose
            chosen = getattr(self.train_sampler, "chosen", {})
            sampler = self._build_sampler("sampler", self.sampler, dataset.lengths, shuffle=False, **chosen)
        return self._loader(dataset, sampler, self.val_collator or self.collator)

    def _build_sampler(
        self, component: str, factory: Callable, lengths: np.ndarray, label_counter: Callable | None = None, **kwargs
    ) -> Sampler:
        """`factory(lengths)`, connected to the run: `data.seed`, the trainer's layout, the model's costs."""
        with self._named_settings(component):
            sampler = factory(lengths, **kwargs)
        if isinstance(sampler, PlannedBatchSampler):
            trainer = self.trainer
            context = RunContext(
                seed=self.seed,
                rank=trainer.global_rank if trainer is not None else None,
                world_size=trainer.world_size if trainer is not None else None,
                accumulate=trainer.accumulate_grad_batches if trainer is not None and label_counter else None,
                cost_coefficients=self.model_contract.cost_coefficients if self.model_contract is not None else None,
                label_counter=label_counter,
                largest_fitting=self._largest_fitting,
            )
            with self._named_settings(component, sampler):
                sampler.connect(context)
        return sampler

    def _largest_fitting(self, setting: str, candidates: list[int], worst_pack: Callable) -> int | None:
        """For a sampler setting given as `auto`: the largest candidate whose most memory-hungry pack, as the
        collator builds it, the model's memory estimate predicts to fit the device (`RunContext.largest_fitting`)."""
        if self.model_contract is None or self.model_contract.largest_fitting is None:
            raise ConfigError(
                f"data.sampler.init_args.{setting}",
                "auto sizes each step with the model's memory estimate, and no model is connected to this data",
                "give it a number, or fit with a PackedCausalLM",
            )
        chosen = self._auto_chosen.get(setting)
        if chosen is not None and chosen >= candidates[0]:  # chosen once (a stream asks for every window)
            return chosen
        collator = self.collator(self.pad_token_id)
        if self.stream is not None:  # every window of a stream must fit: size it for examples of max_length
            longest, budgeted = self.max_length, setting != "batch_size"
            candidates = [c for c in candidates if not budgeted or c >= longest] or candidates[-1:]

            def worst_pack(v: int):
                return worst_pack_of(0 if budgeted else v, longest, v if budgeted else None)

        value, _ = self.model_contract.largest_fitting(
            lambda v: collator.plan_slots(worst_pack(v)).largest(), candidates, what=setting
        )
        if value is not None:
            self._auto_chosen[setting] = value
        return value

    def _loader(
        self, dataset: TokenizedDataset, sampler: Sampler, collator: Callable, resumable: bool = False
    ) -> DataLoader:
        """A DataLoader of `sampler`'s batches; `resumable`: the training loader, whose position this data module
        saves and restores (`_ResumableLoader`)."""
        return (_ResumableLoader if resumable else DataLoader)(
            dataset,
            batch_sampler=batch_sampler_with_epoch(sampler),  # where Lightning's `set_epoch` reaches the sampler
            collate_fn=collator(self.pad_token_id),
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
            worker_init_fn=self._worker_init(),
        )

    def _worker_init(self) -> EndWithParent | None:
        """No worker outlives a killed run; then Lightning's per-worker seeding, which it adds itself only to a
        loader without a `worker_init_fn` (`seed_everything(workers=True)`, as the CLI runs it)."""
        if not self.num_workers:
            return None
        seed = None
        if int(os.environ.get("PL_SEED_WORKERS", 0)):
            from lightning.fabric.utilities.seed import pl_worker_init_function

            rank = self.trainer.global_rank if self.trainer is not None else 0
            seed = functools.partial(pl_worker_init_function, rank=rank)
        return EndWithParent(then=seed)

    @staticmethod
    def _require(dataset: TokenizedDataset | None) -> TokenizedDataset:
        if dataset is None:
            raise RuntimeError("call setup() first (Lightning does it before building dataloaders)")
        return dataset


class _ResumableLoader(DataLoader):
    """The training DataLoader when the sampler has a position: it resumes mid-epoch, and says so to Lightning.

    Lightning takes a loader with `state_dict` / `load_state_dict` (`lightning.fabric.utilities.types._Stateful`)
    as resumable; with any other it warns, on a mid-epoch resume, that the results may be unreliable. Lightning
    would also save this state with the fit loop and hand it back when the fit loop builds its loader, but that
    comes too late: `configure_optimizers` reading `trainer.estimated_stepping_batches` builds and starts the
    loader before the fit loop's state is restored, and Lightning then never hands the state back
    (Lightning issue #20550). So the position is saved and restored once, with the data module
    (`PackingDataModule.state_dict`), which Lightning restores before any loader is built; this loader's own state
    is empty, and it starts where the data module put its sampler.
    """

    def state_dict(self) -> dict[str, Any]:
        """Nothing of its own: the position is in the data module's state (one copy per checkpoint)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the data module restored the sampler's position before this loader was built."""
