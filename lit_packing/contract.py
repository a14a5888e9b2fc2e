"""What the data and the model may know of each other, stated once, and the one place that connects them.

    Trainer(...).fit(PackedCausalLM(...), datamodule=PackingDataModule(...))   # connected by `DataModelConnection`

The data module publishes a frozen `DataContract` when it is set up; the model publishes a frozen `ModelContract`.
`DataModelConnection`, a callback that `PackedCausalLM.configure_callbacks` attaches (so a plain `Trainer.fit`
gets it as well as the CLI), hands each side the other's contract in its `setup` hook, which Lightning runs after
the data module's `setup` and before the model's. It is the only code that looks at both sides; nothing else reads
`trainer.datamodule` or `trainer.lightning_module`. A callback that wants to know the data defines
`connect_data(data: DataContract)` and gets the same object.

Core objects (samplers, collators) name their own parameters in a `ConfigError` (`max_tokens`); `setting_paths`
is the one table of where each of those parameters lives in the config (`data.sampler.init_args.max_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl

from lit_packing.cost import ModelShape, flop_coefficients

if TYPE_CHECKING:
    from lit_packing.batch import StepShape
    from lit_packing.data.report import TokenizationReport


@dataclass(frozen=True)
class ReferenceSplit:
    """One split's preference pairs or rollout groups, for reference log-probabilities computed once ahead of
    training (`model.reference: precomputed`, `lit_packing.models.reference`).

    Attributes:
        fingerprint: the split's tokenized data (source, tokenizer, settings, split, limit): it keys the cache.
        folder: the tokenized data's cache folder, where the table is cached beside it; None for data held in
            memory only (computed every fit).
        items: how many pairs (or groups) the split holds.
        loader: this rank's share of them, packed and collated as validation packs them (every rank gets as many
            batches: a sharded model's forwards stay matched).
        groups: rollout groups (else preference pairs).
    """

    fingerprint: str
    folder: str | None
    items: int
    loader: Callable[[], Iterable[Any]]
    groups: bool = False

    @property
    def kind(self) -> str:
        return "groups" if self.groups else "pairs"


@dataclass(frozen=True)
class DataContract:
    """What the model and the callbacks may know of the data, published by `PackingDataModule.setup`.

    Attributes:
        tokenizer: the Hugging Face tokenizer the data was tokenized with (the model exports it beside its weights).
        token_id_range: (lowest, highest) token id in the training and validation data.
        name_rows: training examples (their `index`, as `batch["rows"]` carries) named as the user counts them,
            e.g. `line 38 of chats.jsonl`.
        largest_step: the training plan's micro-batch that needs the most memory (what it computes, padding
            included), from the sampler's plan and the collator's padding rule; None before the training loader
            exists or without a plan.
        report: what tokenization kept, cut, dropped and skipped.
        overlap_examples: validation examples whose tokens equal a training example's.
        sources: a stream's sources as `(name, weight)`, for the share of each in the trained tokens; empty for
            the cached path.
        reference_split: `train`, `val` or `test` -> that split's stored preference pairs or rollout groups
            (`ReferenceSplit`), None where it holds none; None for a stream.
        processor: the model's processor beside the tokenizer (image processor, chat template) for a
            vision-language model, which the model exports with its weights; None for a text model.
    """

    tokenizer: Any
    token_id_range: tuple[int, int]
    name_rows: Callable[[list[int]], str]
    largest_step: Callable[[], StepShape | None]
    report: TokenizationReport | None = None
    overlap_examples: int = 0
    sources: tuple[tuple[str, float], ...] = ()
    reference_split: Callable[[str], ReferenceSplit | None] | None = None
    processor: Any = None


@dataclass(frozen=True)
class Policy:
    """What on-policy rollouts (`lit_packing.data.on_policy`) need of the model: the module that samples (the one
    being trained, in place), the temperature its objective scores log-probs at, and each round's advantages where
    they depend on the whole round (`GRPO.round_advantages`; None: each group's own, computed per batch)."""

    model: Any
    temperature: float = 1.0
    round_advantages: Callable[[list[dict]], list[list[float]] | None] = lambda rows: None


@dataclass(frozen=True)
class ModelContract:
    """What the data may know of the model, published by `PackedCausalLM.contract`.

    Attributes:
        shape: matmul parameters (trainable, frozen), attention width, per-layer windows (`lit_packing.cost`).
        largest_fitting: `largest_fitting(step_of, candidates, what)`: the largest of the increasing `candidates`
            whose step (`step_of(value)`, a `StepShape`) the memory estimate predicts to fit the device, with that
            estimate; None as the value when none fits. It sizes a sampler's `auto` setting (`max_tokens: auto`).
        policy: what on-policy rollouts sample with (`Policy`).
    """

    shape: ModelShape
    largest_fitting: Callable[..., tuple[int | None, Any]] | None = None
    policy: Policy | None = None

    @property
    def cost_coefficients(self) -> tuple[float, float]:
        """Training FLOPs per token and per attended pair: an example of L tokens costs `a * L + b * L^2`."""
        return flop_coefficients(self.shape)


class DataModelConnection(pl.Callback):
    """Hands the data's contract to the model and to every callback that asks, and the model's to the data, once
    per `Trainer.fit` / `validate` / `test`, between the data module's `setup` and the model's."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        data, model = trainer.datamodule, pl_module
        if hasattr(data, "connect_model") and hasattr(model, "contract"):
            data.connect_model(model.contract)
        published = data.contract if data is not None and hasattr(data, "contract") else None
        if published is None:
            return
        for receiver in (model, *trainer.callbacks):
            if hasattr(receiver, "connect_data"):
                receiver.connect_data(published)


# Where the core parameters of a sampler or collator live in the config, besides `data.<component>.init_args.*`:
# values the run fills in unless the component was given them, and data settings its messages refer to.
RUN_SETTINGS = {
    "seed": "data.seed",
    "accumulate": "trainer.accumulate_grad_batches",
    "world_size": "trainer.devices",
    "cost_coefficients": "model.name_or_path",
}
DATA_SETTINGS = {
    "max_length": "data.max_length",
    "overlong": "data.overlong",
    "source": "data.source",
    "limit": "data.limit",
    "tokenizer": "data.tokenizer",
    "ckpt_path": "--ckpt_path",
}


def setting_paths(component: str, params: Iterable[str], given: Iterable[str] = ()) -> dict[str, str]:
    """Parameter -> config path for an object the data module built from `data.<component>`.

    Args:
        component: `sampler`, `val_sampler`, `collator` or `val_collator`.
        params: the object's parameters an error may name.
        given: the parameters set in the component's own `init_args` (they win over the run's).

    >>> setting_paths("sampler", ["max_tokens", "seed"])["seed"], setting_paths("sampler", ["seed"], ["seed"])["seed"]
    ('data.seed', 'data.sampler.init_args.seed')
    """
    given = set(given)
    own = {p: f"data.{component}.init_args.{p}" for p in params}
    run = {p: path for p, path in RUN_SETTINGS.items() if p not in given}
    return {**DATA_SETTINGS, **own, **run, component: f"data.{component}"}
