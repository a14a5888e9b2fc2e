"""Where the training examples come from: a `Feed`, cached (`lit_packing.data.cached`) or streamed
(`lit_packing.data.stream_feed`), behind the one small interface `PackingDataModule` delegates to.

    feed = CachedFeed(FeedSettings(source=Chatterbot(), ...))   # the data settings, fixed, checked by the data module
    feed.prepare(tokenizer)                          # prepare_data: the tokenized disk cache, or what the shards read
    contract = feed.publish(stage, tokenizer, trainer)          # setup: the datasets and report, as a DataContract
    loader = feed.train_loader(build, tokenizer, trainer)       # build(lengths, label_counter) -> the sampler
    feed.largest_step(tokenizer); feed.position(trained); feed.restore(position, step)

A feed holds its settings (`FeedSettings`, frozen) and what it built from them; what is known only at run time, the
tokenizer (loaded on first use) and the trainer (None outside a fit), comes as arguments of the call that needs it.

A feed also owns the resume's alignment with Lightning: it is a callback, attached to the trainer by the data
module's `setup` for a fit (and detached by its `teardown`), whose `on_train_start` makes the fit loop count the
micro-batches the data counts as trained.
It must be a callback's hook: Lightning restores its loop counters after building the training loader
(`configure_optimizers` builds it, reading `trainer.estimated_stepping_batches`) and a data module gets no hook
after that, and no callback of `lit_packing.callbacks` owns every resume (`LastCheckpoint` only writes, and a run
may save with its own `ModelCheckpoint`, e.g. configs/multinode.yaml, or resume a plain `Trainer.fit`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from lit_packing._compat import batch_sampler_with_epoch, move_epoch_position, ready_batches
from lit_packing.contract import DataContract, ModelContract, setting_paths
from lit_packing.errors import ConfigError
from lit_packing.processes import EndWithParent
from lit_packing.samplers.base import PackPlan

if TYPE_CHECKING:
    from lit_packing.batch import StepShape
    from lit_packing.data.collate import PackedCollator, PaddedCollator
    from lit_packing.data.report import TokenizationReport
    from lit_packing.data.sources import Source
    from lit_packing.data.stream import Stream
    from lit_packing.data.tokenize import OnBadRow, Overlong, TokenizedDataset, TrainOn

log = logging.getLogger(__name__)

SamplerBuilder = Callable[[np.ndarray, Callable[[list], list[int]]], Sampler]  # (lengths, label counter) -> sampler


@dataclass(frozen=True)
class FeedSettings:
    """The data settings a feed reads: `PackingDataModule`'s arguments of the same names (documented there), as it
    checked them, and what its training sampler declares of its step size.

    Attributes:
        declared_max_tokens, declared_batch_size: the training sampler's `max_tokens` / `batch_size` (an int,
            `auto`, or None where it has no such setting), as `PackingDataModule.declared` built it on no data.
    """

    source: Source
    tokenizer_name: str
    max_length: int
    overlong: Overlong
    train_on: TrainOn
    on_bad_row: OnBadRow
    val_split: int | float
    limit: int | None
    seed: int
    num_workers: int
    collator: Callable[[int], PackedCollator | PaddedCollator]
    cache_dir: str | None
    num_proc: int | None
    buffer_size: int
    declared_max_tokens: int | str | None = None
    declared_batch_size: int | str | None = None


class AutoCandidates(NamedTuple):
    """The values an `auto` sampler setting may take, and the most memory-hungry pack of each value."""

    candidates: list[int]
    worst_pack: Callable[[int], PackPlan]


class Feed(pl.Callback):
    """The training examples, read by the `settings`, and the training sampler's position. A subclass implements
    `prepare`, `publish`, `train_loader`, `largest_step` and `position`.

    Attributes:
        settings: the data settings (frozen).
        sampler: the training loader's sampler (`PackingDataModule.train_sampler`), once `train_loader` built it.
        report, train_dataset, val_dataset, test_dataset: what `publish` built (the stream has no train dataset).
        stream: the stream's settings (`lit_packing.data.stream.Stream`); None for the cached path.
    """

    def __init__(self, settings: FeedSettings) -> None:
        self.settings = settings
        self.sampler: Any = None
        self.report: TokenizationReport | None = None
        self.train_dataset: TokenizedDataset | None = None
        self.val_dataset: TokenizedDataset | None = None
        self.test_dataset: TokenizedDataset | None = None
        self.stream: Stream | None = None
        self.overlap_examples = 0  # validation examples whose tokens equal a training example's
        self._pending: tuple[dict[str, Any], int] | None = None  # `restore`'s, until the sampler exists

    def prepare(self, tokenizer: Any) -> None:
        """Once per node, before `publish`: what the examples need on disk."""
        raise NotImplementedError

    def connect_model(self, model: ModelContract) -> None:
        """What the model publishes, before any loader is built (the on-policy feed samples with its `policy`)."""

    def publish(self, stage: str | None, tokenizer: Any, trainer: pl.Trainer | None) -> DataContract:
        """Build the datasets and the report, and return what the model and the callbacks may know of them."""
        raise NotImplementedError

    def train_loader(self, build: SamplerBuilder, tokenizer: Any, trainer: pl.Trainer | None) -> DataLoader | Any:
        """The training loader, its sampler built by `build` (and a restored position applied to it)."""
        raise NotImplementedError

    def largest_step(self, tokenizer: Any) -> StepShape | None:
        """The training micro-batch that needs the most memory; None before `train_loader` or without a plan."""
        raise NotImplementedError

    def position(self, trained: int | None) -> dict[str, Any]:
        """The training sampler's position after `trained` micro-batches of the epoch (Lightning's count); None:
        no trainer counts them (the sampler's own count)."""
        raise NotImplementedError

    def auto_candidates(
        self, setting: str, candidates: list[int], worst_pack: Callable[[int], PackPlan]
    ) -> AutoCandidates:
        """The values an `auto` sampler setting may take and the most memory-hungry pack of each: the sampler's."""
        return AutoCandidates(candidates, worst_pack)

    def collate(self, tokenizer: Any) -> PackedCollator | PaddedCollator:
        """The training collator (`collator`), padding with the tokenizer's pad id."""
        return build_collator(self.settings.collator, tokenizer)

    @property
    def has_position(self) -> bool:
        """Whether the training sampler saves and restores its position (every `PlannedBatchSampler` does)."""
        return all(hasattr(self.sampler, name) for name in ("state_dict", "load_state_dict"))

    @property
    def resumed_at(self) -> int | None:
        """After a resume: the training micro-batches of the epoch that count as trained, in this run's layout (on
        another layout, the start of the first optimizer step not completed); None otherwise."""
        return getattr(self.sampler, "resumed_at", None)

    def restore(self, position: dict[str, Any], step: int) -> None:
        """Put the training sampler at `position` (saved at optimizer step `step`): now, or when `train_loader`
        builds it (Lightning restores a data module before it asks for any loader)."""
        self._pending = position, step
        if self.sampler is not None:
            self._apply_position()

    def _apply_position(self) -> None:
        """Apply `restore`'s position to the training sampler and say what was restored, at which step."""
        if self._pending is None:
            return
        (position, step), self._pending = self._pending, None
        with named_settings("sampler", self.sampler):
            self.sampler.load_state_dict(position)
        restored = getattr(self.sampler, "restored", None) or "the saved position"
        log.info("resumed at optimizer step %s: %s", f"{step:,}", restored)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a resume onto another layout, count in the fit loop the micro-batches the data counts as trained
        (the start of the first optimizer step not completed, in this layout), so that accumulation steps the
        optimizer on the same packs as the uninterrupted run."""
        resumed_at = self.resumed_at
        if resumed_at is not None and resumed_at != ready_batches(trainer):
            move_epoch_position(trainer, resumed_at)


def build_collator(factory: Callable[[int], Any], tokenizer: Any) -> Any:
    """`factory(pad id)`, and for a collator that reads the model's processor (`ImageChatCollator`), the
    tokenizer's folder, where the processor lies beside it."""
    collate = factory(pad_token_id(tokenizer))
    if hasattr(collate, "connect_processor"):
        collate.connect_processor(tokenizer.name_or_path)
    return collate


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its eos id, else 0 (pad positions are never trained or attended)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return candidate
    return 0


def require(dataset: TokenizedDataset | None) -> TokenizedDataset:
    """`dataset`, which `setup` builds: a clear error where it was not called."""
    if dataset is None:
        raise RuntimeError("call setup() first (Lightning does it before building dataloaders)")
    return dataset


@contextlib.contextmanager
def named_settings(component: str, built: Any = None) -> Iterator[None]:
    """Re-raise a core `ConfigError` of `data.<component>` with its settings named by their CLI paths."""
    try:
        yield
    except ConfigError as error:
        given = getattr(built, "given", {error.setting})
        raise error.under(setting_paths(component, [error.setting], given)) from None


def data_loader(
    dataset: Any, sampler: Sampler, collate: Callable, num_workers: int, rank: int, resumable: bool = False
) -> DataLoader:
    """A DataLoader of `sampler`'s batches of `dataset`; `resumable`: the training loader, whose position the data
    module saves and restores (`_ResumableLoader`)."""
    return (_ResumableLoader if resumable else DataLoader)(
        dataset,
        batch_sampler=batch_sampler_with_epoch(sampler),  # where Lightning's `set_epoch` reaches the sampler
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        worker_init_fn=_worker_init(num_workers, rank),
    )


def _worker_init(num_workers: int, rank: int) -> EndWithParent | None:
    """No worker outlives a killed run; then Lightning's per-worker seeding, which it adds itself only to a loader
    without a `worker_init_fn` (`seed_everything(workers=True)`, as the CLI runs it)."""
    if not num_workers:
        return None
    seed = None
    if int(os.environ.get("PL_SEED_WORKERS", 0)):
        from lightning.fabric.utilities.seed import pl_worker_init_function

        seed = functools.partial(pl_worker_init_function, rank=rank)
    return EndWithParent(then=seed)


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
