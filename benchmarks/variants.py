"""What the benchmark runs: each variant (ours by its config, the peers by their own trainers) and one run's record.

A variant is trained for `warmup_steps + steps` optimizer steps by `worker.py` (the peers by `peers.py`) in a process
of its own; ours run the packaged config of their name (`paper` plus the variant's delta, `lit_packing.configs`). The
run's record (`RunResult`) carries the clock at the end of every optimizer step, every step's token counts and loss, the
validation loss after the last step, the peak memory of the timed steps and the epoch's counts from the variant's
own loader.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Literal

from lit_packing.configs import config_args
from lit_packing.errors import ConfigError, install_hint

Kind = Literal["lit_packing", "hf_trainer", "trl"]
INSTALL_BENCH = install_hint("bench")  # the extra that brings the TRL row's `trl`


@dataclass(frozen=True)
class Variant:
    """One row of the table.

    `config` is a packaged config name: ours train it, the peers take its data module (examples, split, batches);
    `sampler_args` are the `data.sampler.init_args` the benchmark sets from its own settings (`batch_size`,
    `max_tokens` or `row_tokens`: the step size every variant shares); `needs` is a module that must be installed
    (the TRL row's `trl`, from the `bench` extra).
    """

    label: str
    kind: Kind
    config: str = "minibatch_packing"
    sampler_args: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()  # further CLI overrides, with {max_length} etc. filled in by `overrides`
    needs: str | None = None

    def config_args(self) -> list[str]:
        """`--config` arguments of the variant's config: its base, then its delta."""
        return config_args(self.config)

    @property
    def installed(self) -> bool:
        """Whether what the variant needs is installed."""
        return self.needs is None or importlib.util.find_spec(self.needs) is not None


VARIANTS: dict[str, Variant] = {
    "padding": Variant("padding", "lit_packing", "padding", ("batch_size",)),
    "padding_full_logits": Variant(
        "padding, full-logits loss (as plain transformers)",
        "lit_packing",
        "padding",
        ("batch_size",),
        ("--model.loss_impl=full",),
    ),
    "minibatch_packing": Variant("mini-batch packing", "lit_packing", "minibatch_packing", ("batch_size",)),
    "fixed_no_position_ids": Variant(
        "fixed-length, no position ids (contaminated)",
        "lit_packing",
        "fixed_packing_no_position_ids",
        ("row_tokens",),
        ("--data.collator.init_args.row_length={max_length}",),
    ),
    "fixed_position_ids": Variant(
        "fixed-length + position ids", "lit_packing", "fixed_packing_position_ids", ("row_tokens",)
    ),
    "bestfit_packing": Variant("best-fit packing", "lit_packing", "bestfit_packing", ("max_tokens",)),
    "multipack": Variant("multipack", "lit_packing", "multipack", ("max_tokens",)),
    # The peers' examples come from our mini-batch packing data module (the HF Trainer takes its batches).
    "hf_trainer": Variant("HF Trainer + DataCollatorWithFlattening + sdpa", "hf_trainer", sampler_args=("batch_size",)),
    "trl_bfd": Variant("TRL SFTTrainer, padding_free + bfd packing", "trl", sampler_args=("batch_size",), needs="trl"),
}
BASELINE = "padding"
PAPER_METHOD = "minibatch_packing"
PEER = "hf_trainer"


def check_installed(names: Iterable[str]) -> None:
    """Raise a one-line `ConfigError` naming the install command if a chosen variant's package is missing."""
    for name in names:
        if not VARIANTS[name].installed:
            needs = VARIANTS[name].needs
            raise ConfigError(
                "variants", f"{name} needs {needs}, which is not installed", f"{INSTALL_BENCH}, or leave {name} out"
            )


@dataclass
class RunSpec:
    """Everything one run needs: which variant, on which model and examples, for how many steps."""

    variant: str
    round: int
    model: str  # a model folder (the shared random init) or `smollm2`
    row: str  # the table row's name (the variant, or the variant on the pretrained model)
    steps: int  # optimizer steps in all: warm-up + timed
    warmup_steps: int
    examples: int  # CHAMP chats drawn (seeded), validation included
    val_examples: int
    max_length: int
    batch_size: int
    max_tokens: int
    rows_per_step: int
    lr: float
    seed: int
    accelerator: str
    precision: str
    attn_backend: str
    gradient_checkpointing: bool
    out: str  # this run's scratch folder

    def overrides(self) -> list[str]:
        """The CLI overrides that put a variant's config on the benchmark's model, examples, steps and optimizer.

        Every variant gets the same optimizer (AdamW, constant learning rate, no weight decay, clipping at 1.0 as
        in the configs) so that the peers' Trainer can be set to exactly the same.
        """
        variant = VARIANTS[self.variant]
        fill = {"max_length": self.max_length}
        sampler = {
            "batch_size": [f"--data.sampler.init_args.batch_size={self.batch_size}"],
            "max_tokens": [f"--data.sampler.init_args.max_tokens={self.max_tokens}"],
            "row_tokens": [
                f"--data.sampler.init_args.max_tokens={self.max_length}",
                f"--data.sampler.init_args.rows_per_step={self.rows_per_step}",
            ],
        }
        return [
            f"--model.name_or_path={self.model}", f"--model.lr={self.lr}", "--model.weight_decay=0",
            "--model.warmup_steps=0", "--model.scheduler=constant", f"--model.attn_backend={self.attn_backend}",
            f"--model.gradient_checkpointing={str(self.gradient_checkpointing).lower()}",
            f"--data.limit={self.examples}", f"--data.val_split={self.val_examples}",
            f"--data.max_length={self.max_length}", f"--data.seed={self.seed}", f"--seed_everything={self.seed}",
            *(arg for name in variant.sampler_args for arg in sampler[name]),
            *(arg.format(**fill) for arg in variant.extra),
            f"--trainer.max_steps={self.steps}", "--trainer.max_epochs=1", f"--trainer.val_check_interval={self.steps}",
            "--trainer.num_sanity_val_steps=0", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false", "--trainer.gradient_clip_val=1.0",
            f"--trainer.accelerator={self.accelerator}", "--trainer.devices=1", f"--trainer.precision={self.precision}",
            f"--trainer.default_root_dir={self.out}",
        ]  # fmt: skip


@dataclass
class RunResult:
    """One run, as measured. Lists have one entry per optimizer step; times are `time.perf_counter()` seconds
    taken when each step had finished (the device synchronised)."""

    row: str
    variant: str
    round: int
    warmup_steps: int
    steps: int
    step_end: list[float] = field(default_factory=list)
    real_tokens: list[int] = field(default_factory=list)
    slot_tokens: list[int] = field(default_factory=list)
    work: list[float] = field(default_factory=list)  # FLOPs the step computed (`lit_packing.batch.hardware_flops`)
    loss: list[float] = field(default_factory=list)
    val_loss: float | None = None
    peak_memory_gb: float = 0.0  # over the timed steps (see `worker.peak_memory`)
    epoch_steps: int = 0  # optimizer steps of one epoch, from the variant's own loader
    epoch_real_tokens: int = 0
    epoch_slot_tokens: int = 0
    epoch_work: float = 0.0  # FLOPs of one epoch of the row's loader, by the same formula
    device: str = ""

    @property
    def timed_seconds(self) -> float:
        """Seconds from the end of the last warm-up step to the end of the last step."""
        return self.step_end[-1] - self.step_end[self.warmup_steps - 1]

    @property
    def timed_real_tokens(self) -> int:
        return sum(self.real_tokens[self.warmup_steps :])

    @property
    def tokens_per_second(self) -> float:
        """Effective (real) tokens per second of the timed steps."""
        return self.timed_real_tokens / self.timed_seconds

    @property
    def epoch_seconds(self) -> float:
        """One epoch's time, estimated from the timed steps' seconds per FLOP: rows whose timed steps hold other
        examples (best fit, fixed-length, TRL) than the epoch's average are compared on the epoch's mix."""
        return self.timed_seconds * self.epoch_work / sum(self.work[self.warmup_steps :])

    @property
    def epoch_tokens_per_second(self) -> float:
        """Effective tokens/s over one epoch (estimated, see `epoch_seconds`)."""
        return self.epoch_real_tokens / self.epoch_seconds

    def to_dict(self) -> dict:
        return asdict(self)
