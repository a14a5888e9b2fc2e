"""The cached feed: the source tokenized ahead of training into the `datasets` disk cache, split, and packed by the
configured sampler over the whole epoch.

    PackingDataModule(source=Chatterbot())   # data.streaming: false (the default) trains from a `CachedFeed`

`prepare` loads the source and tokenizes it into the cache (once, on one process per node); `publish` runs the
same steps, which then hit the cache, splits off the validation set by each example's row in the source
(`split_rows`), names what was skipped or duplicated, and publishes the `DataContract`.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, NamedTuple

import datasets
import numpy as np
import pyarrow.compute as pc
from torch.utils.data import DataLoader

from lit_packing._compat import data_parallel
from lit_packing.batch import INDEX, INPUT_IDS, StepShape
from lit_packing.contract import DataContract
from lit_packing.data.encode import ROW, TOKEN_HASH
from lit_packing.data.feed import Feed, FeedSettings, SamplerBuilder, data_loader, named_settings, require
from lit_packing.data.report import SAMPLES
from lit_packing.data.tokenize import Tokenized, TokenizedDataset, column, tokenize_dataset
from lit_packing.errors import ConfigError, DataError, check_range
from lit_packing.samplers import PlannedBatchSampler
from lit_packing.text import count

if TYPE_CHECKING:
    import lightning.pytorch as pl

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


class SplitRows(NamedTuple):
    """The rows of a train / validation split, each sorted."""

    train: np.ndarray
    val: np.ndarray


class Limited(NamedTuple):
    """`data.limit`'s choice of a split: the examples kept, and their rows in the source (None: all of them)."""

    dataset: datasets.Dataset
    rows: np.ndarray | None


def split_rows(n: int, val_split: int | float, seed: int) -> SplitRows:
    """Deterministic train / validation split of rows `0..n-1`: `(train, val)` rows, each sorted.

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
    return SplitRows(np.sort(order[n_val:]), np.sort(order[:n_val]))


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


class CachedFeed(Feed):
    """The source tokenized into the disk cache, split into train / validation (/ test) `TokenizedDataset`s, and
    a DataLoader of the configured sampler's packs of the training set."""

    def __init__(self, settings: FeedSettings) -> None:
        super().__init__(settings)
        self.prepared = False  # `prepare` ran in this process (and announced the data)

    def prepare(self, tokenizer: Any) -> None:
        """Load the source and tokenize it into the disk cache."""
        self._tokenize(tokenizer, announce=True)
        self.prepared = True

    def publish(self, stage: str | None, tokenizer: Any, trainer: pl.Trainer | None) -> DataContract:
        """Tokenize (from the cache), split, and build `train_dataset`, `val_dataset`, `test_dataset` and `report`."""
        settings = self.settings
        tokenized = self._tokenize(tokenizer, announce=not self.prepared)  # one line per run: where the data came from
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
            "%r with %s: %s; %s train / %s validation%s examples", settings.source, settings.tokenizer_name,
            self.report, f"{len(self.train_dataset):,}", f"{len(val):,}", own_test,
        )  # fmt: skip
        self._warn_about(train, val)
        return DataContract(
            tokenizer=tokenizer,
            token_id_range=self.token_id_range(),
            name_rows=self.name_rows,
            largest_step=functools.partial(self.largest_step, tokenizer),
            report=self.report,
            overlap_examples=self.overlap_examples,
        )

    def train_loader(self, build: SamplerBuilder, tokenizer: Any, trainer: pl.Trainer | None) -> DataLoader:
        """Every pack carries its optimizer step's label totals (`label_counter`): the loss needs no communication."""
        dataset = require(self.train_dataset)
        self.sampler = build(dataset.lengths, dataset.count_labels)
        self._apply_position()
        with named_settings("collator"):
            self.largest_step(tokenizer)  # a padding rule that cannot hold the largest pack fails here, not mid-epoch
        if trainer is not None:
            check_val_check_interval(trainer, len(self.sampler))
        rank = data_parallel(trainer).rank if trainer is not None else 0
        collate = self.collate(tokenizer)
        return data_loader(dataset, self.sampler, collate, self.settings.num_workers, rank, self.has_position)

    def largest_step(self, tokenizer: Any) -> StepShape | None:
        """The collator's slots of the sampler's plan (no batch is built); None for a sampler without a plan."""
        if not isinstance(self.sampler, PlannedBatchSampler):
            return None
        return self.collate(tokenizer).plan_slots(self.sampler.plan()).largest()

    def position(self, trained: int | None) -> dict[str, Any]:
        if trained is None or not isinstance(self.sampler, PlannedBatchSampler):
            return self.sampler.state_dict()
        return self.sampler.state_dict(steps_done=trained)

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
        table = require(self.train_dataset).dataset
        where = dict(zip(column(table, INDEX).tolist(), column(table, ROW).tolist()))
        return "; ".join(self.settings.source.row_name(where[i]) if i in where else f"index {i}" for i in indices)

    def _tokenize(self, tokenizer: Any, announce: bool) -> dict[str, Tokenized]:
        """`{"train": (tokenized, report)}`, plus `"validation"` / `"test"` where the source has its own; with
        `announce`, one line per split says whether it is tokenized now or read from the cache."""
        settings = self.settings
        source = settings.source
        parts = self._raw_splits(source.load(cache_dir=settings.cache_dir))
        tokenized = {}
        for name, raw in parts.items():
            subset, rows = self.limited(raw)
            tokenized[name] = tokenize_dataset(
                subset, tokenizer, settings.max_length, settings.overlong, settings.train_on, settings.num_proc,
                on_bad_row=settings.on_bad_row, rows=rows, row_name=source.row_name,
                announce=f"{source!r}{'' if name == 'train' else f' ({name})'} with {settings.tokenizer_name}"
                if announce else None,
            )  # fmt: skip
        return tokenized

    def _raw_splits(self, loaded: datasets.Dataset | datasets.DatasetDict) -> dict[str, datasets.Dataset]:
        if not isinstance(loaded, datasets.DatasetDict):
            return {"train": loaded}
        if "train" not in loaded:
            raise ConfigError(
                "data.source.init_args.split",
                f"{self.settings.source!r} has splits {sorted(loaded)} but no 'train'",
                "choose one",
            )
        parts = {"train": loaded["train"]}
        validation = next((name for name in VALIDATION_SPLITS if name in loaded), None)
        if validation is not None:
            parts["validation"] = loaded[validation]
        if validation != "test" and "test" in loaded:  # a third split: `main.py test` scores it
            parts["test"] = loaded["test"]
        return parts

    def limited(self, dataset: datasets.Dataset) -> Limited:
        """A seeded random `data.limit` of the examples, with their rows in the source (None: all of them)."""
        limit = self.settings.limit
        if limit is None or limit >= len(dataset):
            return Limited(dataset, None)
        rows = np.sort(np.random.default_rng(self.settings.seed).permutation(len(dataset))[:limit])
        return Limited(dataset.select(rows), rows)

    def _split(self, tokenized: datasets.Dataset, n_examples: int) -> tuple[datasets.Dataset, datasets.Dataset]:
        """Split by each example's row in the source (`index`), so drops never move an example across splits."""
        val_rows = split_rows(n_examples, self.settings.val_split, self.settings.seed).val
        is_val = np.isin(column(tokenized, INDEX), val_rows)
        return tokenized.select(np.flatnonzero(~is_val)), tokenized.select(np.flatnonzero(is_val))

    def _warn_about(self, train: datasets.Dataset, val: datasets.Dataset) -> None:
        """Name what was skipped, dropped or duplicated, and validation examples that also appear in training."""
        report, name = self.report, self.settings.source.row_name
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
