"""The LightningDataModule: source -> tokenize -> deterministic split -> packing sampler + collator.

    dm = PackingDataModule(source=Chatterbot(), max_length=512); dm.prepare_data(); dm.setup("fit")

The examples come from a feed (`lit_packing.data.feed`): the cached one (`lit_packing.data.cached`: tokenized
ahead into the `datasets` disk cache, split, packed over the whole epoch) or, with `streaming`, the streamed one
(`lit_packing.data.stream_feed`: tokenized while it trains, packed window by window). The data module builds it
from its settings (`FeedSettings`, frozen) and delegates to it, without asking which, handing each call the
tokenizer and the trainer it needs: `prepare_data` and `setup` prepare it and publish its `DataContract`
(`lit_packing.contract`), `train_dataloader` has it build the training loader, `state_dict` saves its trained
position. What the data module keeps is what both share: the settings, the tokenizer, the global batch
(`lit_packing.data.global_batch`, applied to `trainer.accumulate_grad_batches`), the validation loaders, and the
samplers' connection to the run. Samplers and the collator are built late from factories, because the lengths and
the pad id are only known then:

    sampler(train_lengths).connect(RunContext(...))   # a batch sampler: one pack of example indices per step
    collator(pad_token_id)                            # list of examples -> one batch

The sampler's run context (the seed, the ranks, gradient accumulation, the model's cost coefficients, the label
counter) comes in that one `connect` call and fills only what the sampler's own `init_args` left unset. Every
setting is range-checked once, when the CLI builds the objects (the sampler factories are built once on no data,
which is also what the training sampler declares of its step size: `declared`), so a bad value stops before any
tokenization or model loading; a sampler's error names its parameter by its CLI path
(`lit_packing.contract.setting_paths`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Sampler

from lit_packing._compat import data_parallel, dataset_fingerprint, set_accumulate_grad_batches, trained_batches
from lit_packing.assets import resolve_pretrained
from lit_packing.batch import StepShape
from lit_packing.contract import DataContract, ModelContract, ReferenceSplit
from lit_packing.data.cached import CachedFeed, check_val_split
from lit_packing.data.collate import PackedCollator, PaddedCollator, PairCollator
from lit_packing.data.feed import (
    Feed,
    FeedSettings,
    build_collator,
    data_loader,
    named_settings,
    pad_token_id,
    require,
)
from lit_packing.data.global_batch import (
    Accumulation,
    GlobalBatch,
    Layout,
    accumulation,
    global_batch,
    resumed_accumulation,
)
from lit_packing.data.groups import GroupCollator
from lit_packing.data.image_collate import ImageChatCollator
from lit_packing.data.mixture import Mixture
from lit_packing.data.on_policy import OnPolicyFeed, OnPolicyRollouts
from lit_packing.data.packaged import ChampChats
from lit_packing.data.report import TokenizationReport
from lit_packing.data.sources import Source
from lit_packing.data.stream import Stream, StreamLoader
from lit_packing.data.stream_feed import StreamFeed
from lit_packing.data.tokenize import OnBadRow, Overlong, TokenizedDataset, TrainOn, check_tokenize_settings
from lit_packing.errors import ConfigError, check_range
from lit_packing.samplers import BestFitPackingSampler, PlannedBatchSampler, RunContext

log = logging.getLogger(__name__)


Collator = PackedCollator | PaddedCollator | PairCollator | GroupCollator | ImageChatCollator  # what `collator` builds


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
        collator: builds the collate function from the pad id: `PackedCollator`, `PaddedCollator`, `PairCollator`
            (preference pairs), `GroupCollator` (rollout groups) or `ImageChatCollator` (image chats) (the class, or
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
        overlong: Overlong = "truncate",
        train_on: TrainOn = "completion",
        val_split: int | float = 0.05,
        limit: int | None = None,
        seed: int = 42,
        num_workers: int = 0,
        sampler: Callable[[np.ndarray], Sampler] = BestFitPackingSampler,
        val_sampler: Callable[[np.ndarray], Sampler] | None = None,
        collator: Callable[[int], Collator] = PackedCollator,
        val_collator: Callable[[int], Collator] | None = None,
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
        self.declared = self._probe("sampler", sampler)  # the training sampler on no data: its declared step size
        if val_sampler is not None:
            self._probe("val_sampler", val_sampler)
        if isinstance(self.source, OnPolicyRollouts) and self.streaming:
            raise ConfigError("data.streaming", "on-policy rollouts are sampled, not read", "set it to false")
        on_policy = isinstance(self.source, OnPolicyRollouts)
        self.feed: Feed = (OnPolicyFeed if on_policy else StreamFeed if self.streaming else CachedFeed)(
            self._feed_settings()
        )
        self._tokenizer = None
        self._processor = None
        self.contract: DataContract | None = None  # published by `setup`
        self.model_contract: ModelContract | None = None  # what the model publishes (`connect_model`)
        self._auto_chosen: dict[str, int] = {}  # what a sampler's `auto` setting was sized to
        self._accumulate_setting: int | None = None  # `trainer.accumulate_grad_batches` as configured

    def _feed_settings(self) -> FeedSettings:
        """What the feed reads of these settings, and the step size the training sampler declares."""
        return FeedSettings(
            source=self.source, tokenizer_name=self.tokenizer_name, max_length=self.max_length,
            overlong=self.overlong, train_on=self.train_on, on_bad_row=self.on_bad_row, val_split=self.val_split,
            limit=self.limit, seed=self.seed, num_workers=self.num_workers, collator=self.collator,
            cache_dir=self.cache_dir, num_proc=self.num_proc, buffer_size=self.buffer_size,
            declared_max_tokens=getattr(self.declared, "max_tokens", None),
            declared_batch_size=getattr(self.declared, "batch_size", None),
        )  # fmt: skip

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
    def processor(self):
        """The model's processor (image processor, chat template, tokenizer) where the tokenizer's folder holds one
        (a vision-language model's), loaded on first use; None for a text model."""
        if self._processor is None:
            folder = Path(resolve_pretrained(self.tokenizer_name, with_model=False, setting="data.tokenizer"))
            if any((folder / name).exists() for name in ("processor_config.json", "preprocessor_config.json")):
                from transformers import AutoProcessor

                self._processor = AutoProcessor.from_pretrained(folder)
            else:
                self._processor = False  # looked for once
        return self._processor or None

    @property
    def vocab_size(self) -> int:
        """`len(tokenizer)`: the embedding rows the model needs (added tokens included)."""
        return len(self.tokenizer)

    @property
    def pad_token_id(self) -> int:
        """The tokenizer's pad id, else its eos id, else 0 (pad positions are never trained or attended)."""
        return pad_token_id(self.tokenizer)

    @property
    def train_lengths(self) -> np.ndarray:
        """(n_train,) int64 tokens per training example (after `setup`)."""
        return require(self.train_dataset).lengths

    @property
    def val_lengths(self) -> np.ndarray:
        """(n_val,) int64 tokens per validation example (empty without a validation set)."""
        return self.val_dataset.lengths if self.val_dataset is not None else np.zeros(0, dtype=np.int64)

    @property
    def train_sampler(self) -> Sampler | StreamLoader | None:
        """The training loader's sampler (a `StreamLoader` for a stream), once `train_dataloader` built it."""
        return self.feed.sampler

    @property
    def stream(self) -> Stream | None:
        """With `streaming`, the stream's settings (after `setup`); None for the cached path."""
        return self.feed.stream

    @property
    def report(self) -> TokenizationReport | None:
        """What tokenization kept, cut, dropped and skipped (after `setup`; a stream's grows as it is read)."""
        return self.feed.report

    @property
    def train_dataset(self) -> TokenizedDataset | None:
        """The tokenized training examples (after `setup`; None for a stream)."""
        return self.feed.train_dataset

    @property
    def val_dataset(self) -> TokenizedDataset | None:
        """The validation examples (None without any)."""
        return self.feed.val_dataset

    @property
    def test_dataset(self) -> TokenizedDataset | None:
        """What `main.py test` scores: the source's `test` split, else the validation examples."""
        return self.feed.test_dataset

    @property
    def overlap_examples(self) -> int:
        """Validation examples whose tokens equal a training example's."""
        return self.feed.overlap_examples

    # ------------------------------------------------------------ Lightning hooks

    def prepare_data(self) -> None:
        """What the feed needs on disk, once per node (Lightning runs this on one process per node): the source
        tokenized into the disk cache, or, for a stream, what its shards read (nothing is tokenized ahead)."""
        self.feed.prepare(self.tokenizer)

    def setup(self, stage: str | None = None) -> None:
        """Build the feed's datasets and publish its `contract` once; for a fit, set the trainer's gradient
        accumulation from the global batch (`packs_per_step` / `tokens_per_step`) and attach the feed, which aligns
        Lightning's count of trained micro-batches on a resume (`Feed.on_train_start`)."""
        trainer = self.trainer
        if trainer is not None and stage in (None, "fit"):
            if self._accumulate_setting is None:
                self._accumulate_setting = trainer.accumulate_grad_batches
            ranks = data_parallel(trainer).size
            self._accumulate(accumulation(self._global_batch(), ranks, trainer.accumulate_grad_batches))
            if self.feed not in trainer.callbacks:
                trainer.callbacks.append(self.feed)
        if self.contract is None:
            self.contract = dataclasses.replace(
                self.feed.publish(stage, self.tokenizer, trainer), reference_split=self._reference_split,
                processor=self.processor,
            )  # fmt: skip

    def teardown(self, stage: str) -> None:
        """Detach the feed that `setup` attached: a later fit of the same trainer aligns with its own data."""
        if self.trainer is not None and self.feed in self.trainer.callbacks:
            self.trainer.callbacks.remove(self.feed)

    def train_dataloader(self) -> DataLoader | StreamLoader:
        build = functools.partial(self._build_sampler, "sampler", self.sampler)
        return self.feed.train_loader(build, self.tokenizer, self.trainer)

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
        position: the training loader only tells Lightning that it resumes (`lit_packing.data.feed`), because
        Lightning restores a data module before anything builds a loader, and a loader's own state too late to be
        used.
        """
        if not self.feed.has_position:
            return {}
        if self.trainer is None:
            return {"train_sampler": self.feed.position(None)}
        return {
            "train_sampler": self.feed.position(trained_batches(self.trainer)),
            "global_step": self.trainer.global_step,
            "accumulate_setting": self._accumulate_setting,  # the config's, before a global batch derived another
            "auto_chosen": dict(self._auto_chosen),  # what `auto` settings were sized to: the plan depends on it
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict()`: the global batch it was saved with (`resumed_accumulation`: Lightning restores a
        data module after its `setup`, before `configure_optimizers` reads the accumulation), and the training
        sampler's position, now or when `train_dataloader` builds it (on a resume, Lightning calls this before it
        asks for any loader)."""
        saved = state_dict.get("train_sampler")
        if saved is None:
            return
        self._auto_chosen.update(state_dict.get("auto_chosen", {}))  # the same plan: `auto` is not sized again
        trainer = self.trainer
        if trainer is not None and "world_size" in saved:
            configured = int(state_dict.get("accumulate_setting") or saved["accumulate"])
            layout = Layout(int(saved["world_size"]), int(saved["accumulate"]))
            world, accumulate = data_parallel(trainer).size, trainer.accumulate_grad_batches
            self._accumulate(resumed_accumulation(self._global_batch(), layout, configured, world, accumulate))
        # The step saved with the position: `configure_optimizers` may build the loader (reading
        # `trainer.estimated_stepping_batches`) before Lightning restores `trainer.global_step`.
        step = state_dict.get("global_step")
        if step is None:  # saved without a trainer
            step = trainer.global_step if trainer is not None else 0
        self.feed.restore(saved, step)

    # ------------------------------------------------------------ the global batch

    def _global_batch(self) -> GlobalBatch | None:
        """`packs_per_step`, or `tokens_per_step` in packs of the training sampler's declared `max_tokens`."""
        return global_batch(self.packs_per_step, self.tokens_per_step, getattr(self.declared, "max_tokens", None))

    def _accumulate(self, choice: Accumulation) -> None:
        """Set `trainer.accumulate_grad_batches` as the global batch decided, and say so: the one place that sets
        it, from `setup` (a fresh fit) and `load_state_dict` (a resume, which Lightning restores after `setup`)."""
        if choice.value is not None:
            set_accumulate_grad_batches(self.trainer, choice.value)
        if choice.note is not None:
            log.info("%s", choice.note)

    # ------------------------------------------------------------ the model's side, the samplers

    @property
    def resumed_at(self) -> int | None:
        """After a resume: the training micro-batches of the epoch that count as trained, in this run's layout (on
        another layout, the start of the first optimizer step not completed); None otherwise."""
        return self.feed.resumed_at

    def connect_model(self, model: ModelContract) -> None:
        """What the model publishes (`lit_packing.contract.DataModelConnection` calls this before any loader):
        its cost coefficients balance `MultipackSampler`'s ranks unless the sampler was given its own."""
        self.model_contract = model
        self.feed.connect_model(model)

    def largest_step(self) -> StepShape | None:
        """The training plan's micro-batch that needs the most memory (the collator's slots of the sampler's
        plan; no batch is built); for a stream, the worst a window can plan (examples of `max_length` tokens);
        None before `train_dataloader` or for a sampler without a plan."""
        return self.feed.largest_step(self.tokenizer)

    def _probe(self, component: str, factory: Callable) -> Sampler:
        """Build the sampler once on no data, so that its own checks run now, before tokenization."""
        with named_settings(component):
            return factory(np.zeros(0, dtype=np.int64))

    def _reference_split(self, split: str) -> ReferenceSplit | None:
        """A split's stored preference pairs or rollout groups (`train`, `val`, `test`), for reference
        log-probabilities computed once (`model.reference: precomputed`): packed as validation packs them, cached
        beside its tokenized data. None for on-policy rounds (sampled during the fit)."""
        if isinstance(self.feed, OnPolicyFeed):
            return None
        dataset = {"train": self.train_dataset, "val": self.val_dataset, "test": self.test_dataset}[split]
        if dataset is None or not (dataset.pairs or dataset.groups):
            return None
        files = dataset.dataset.cache_files
        folder = str(Path(files[0]["filename"]).parent) if files else None
        loader = functools.partial(self._eval_loader, dataset)
        return ReferenceSplit(dataset_fingerprint(dataset.dataset), folder, len(dataset), loader, dataset.groups)

    def _eval_loader(self, dataset: TokenizedDataset) -> DataLoader:
        """Whole, isolated examples in a fixed order: `val_sampler` / `val_collator`, else the training ones."""
        if self.val_sampler is not None:
            sampler = self._build_sampler("val_sampler", self.val_sampler, dataset.lengths)
        else:  # the training sampler's settings, with the value its `auto` chose
            chosen = getattr(self.train_sampler, "chosen", {})
            sampler = self._build_sampler("sampler", self.sampler, dataset.lengths, shuffle=False, **chosen)
        collate = build_collator(self.val_collator or self.collator, self.tokenizer)
        rank = data_parallel(self.trainer).rank if self.trainer is not None else 0
        return data_loader(dataset, sampler, collate, self.num_workers, rank)

    def _build_sampler(
        self, component: str, factory: Callable, lengths: np.ndarray, label_counter: Callable | None = None, **kwargs
    ) -> Sampler:
        """`factory(lengths)`, connected to the run: `data.seed`, the trainer's layout, the model's costs."""
        with named_settings(component):
            sampler = factory(lengths, **kwargs)
        if isinstance(sampler, PlannedBatchSampler):
            trainer = self.trainer
            context = RunContext(
                seed=self.seed,
                rank=data_parallel(trainer).rank if trainer is not None else None,
                world_size=data_parallel(trainer).size if trainer is not None else None,
                accumulate=trainer.accumulate_grad_batches if trainer is not None and label_counter else None,
                cost_coefficients=self.model_contract.cost_coefficients if self.model_contract is not None else None,
                label_counter=label_counter,
                largest_fitting=self._largest_fitting,
            )
            with named_settings(component, sampler):
                sampler.connect(context)
        return sampler

    def _largest_fitting(self, setting: str, candidates: list[int], worst_pack: Callable) -> int | None:
        """For a sampler setting given as `auto`: the largest candidate whose most memory-hungry pack, as the
        collator builds it, the model's memory estimate predicts to fit the device (`RunContext.largest_fitting`);
        the feed says which packs a step may hold (`Feed.auto_candidates`)."""
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
        candidates, worst_pack = self.feed.auto_candidates(setting, candidates, worst_pack)
        value, _ = self.model_contract.largest_fitting(
            lambda v: collator.plan_slots(worst_pack(v)).largest(), candidates, what=setting
        )
        if value is not None:
            self._auto_chosen[setting] = value
        return value
