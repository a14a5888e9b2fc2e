"""The global batch: packs per optimizer step over all ranks, and the gradient accumulation it makes on a world size.

    batch = global_batch(None, 16384, budget=4096)          # GlobalBatch(packs=4, setting="data.tokens_per_step")
    accumulation(batch, world_size=2, accumulate=1).value    # 2: 2 ranks x 2 accumulated
    resumed_accumulation(None, Layout(2, 1), configured=1, world_size=1, accumulate=1).value   # 2: the saved 2 packs

Arithmetic on the settings and the trainer's numbers only, so that every case is tested without a Trainer
(tests/data/test_global_batch.py). `PackingDataModule` applies the result: it sets Lightning's
`accumulate_grad_batches` to `Accumulation.value` and logs `Accumulation.note`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from lit_packing.errors import ConfigError
from lit_packing.samplers import AUTO
from lit_packing.text import count, dividing_fix


class Layout(NamedTuple):
    """How a run spreads an optimizer step: over `world_size` ranks, `accumulate` micro-batches on each."""

    world_size: int
    accumulate: int


@dataclass(frozen=True)
class GlobalBatch:
    """Packs (micro-batches of one rank) per optimizer step over all ranks, and the setting that gave them."""

    packs: int
    setting: str


@dataclass(frozen=True)
class Accumulation:
    """What the global batch makes of `trainer.accumulate_grad_batches`: the value to set (None: leave it as it is)
    and the line to log (None: nothing to say)."""

    value: int | None = None
    note: str | None = None


def global_batch(packs_per_step: int | None, tokens_per_step: int | None, budget: object) -> GlobalBatch | None:
    """The configured global batch; None when neither setting is given (it is then the world size x
    `trainer.accumulate_grad_batches`).

    Args:
        packs_per_step: `data.packs_per_step`.
        tokens_per_step: `data.tokens_per_step`, a whole number of the sampler's token budgets.
        budget: what the training sampler declares as its `max_tokens` (an int, `auto`, or None without one).

    Raises:
        ConfigError: `tokens_per_step` with a budget that is `auto`, missing, or does not divide it.
    """
    if packs_per_step is not None:
        return GlobalBatch(packs_per_step, "data.packs_per_step")
    if tokens_per_step is None:
        return None
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
    if tokens_per_step % budget:
        low = max(tokens_per_step // budget, 1) * budget
        raise ConfigError(
            "data.tokens_per_step",
            f"{tokens_per_step:,} tokens is not a whole number of {budget:,}-token packs "
            f"(data.sampler.init_args.max_tokens)",
            f"use a multiple of {budget:,} (e.g. {low:,} or {low + budget:,}), or data.packs_per_step",
        )
    return GlobalBatch(tokens_per_step // budget, "data.tokens_per_step")


def accumulation(batch: GlobalBatch | None, world_size: int, accumulate: int) -> Accumulation:
    """The accumulation of a fresh fit: the global batch over the world size.

    Args:
        batch: the configured global batch (`global_batch`); None leaves the trainer's accumulation.
        world_size: the ranks this run gets.
        accumulate: `trainer.accumulate_grad_batches` as configured (1 unless set by hand).

    Raises:
        ConfigError: a global batch the ranks cannot split evenly, or an accumulation set by hand that contradicts it.
    """
    if batch is None:
        return Accumulation()
    packs, setting = batch.packs, batch.setting
    if packs % world_size:
        raise ConfigError(
            setting,
            f"{count(packs, 'pack')} per optimizer step cannot be split evenly over {count(world_size, 'rank')}",
            dividing_fix(packs, world_size, setting),
        )
    derived = packs // world_size
    if accumulate not in (1, derived):
        raise ConfigError(
            "trainer.accumulate_grad_batches",
            f"{accumulate} contradicts {setting}: {count(packs, 'pack')} per optimizer step on "
            f"{count(world_size, 'rank')} is {derived} accumulated",
            f"leave trainer.accumulate_grad_batches unset: it follows from {setting}",
        )
    note = (
        f"global batch: {count(packs, 'pack')} per optimizer step ({setting}) = {count(world_size, 'rank')} x "
        f"{derived} accumulated"
    )
    return Accumulation(derived, note)


def resumed_accumulation(
    batch: GlobalBatch | None, saved: Layout, configured: int, world_size: int, accumulate: int
) -> Accumulation:
    """On a resume: keep the checkpoint's global batch unless the run changes it, and say when it changes.

    The run changes it by `data.packs_per_step` / `data.tokens_per_step` (`batch`), or by a
    `trainer.accumulate_grad_batches` other than the one configured at the saved launch (`configured`); else the
    checkpoint's `world_size x accumulate` packs are split over this run's ranks.

    Args:
        batch: the configured global batch (`global_batch`), None when neither setting is given.
        saved: the checkpoint's layout.
        configured: `trainer.accumulate_grad_batches` as configured at the saved launch (before a global batch
            derived another).
        world_size: the ranks this run gets.
        accumulate: `trainer.accumulate_grad_batches` as this run has it.

    Raises:
        ConfigError: the checkpoint's global batch cannot be split evenly over this run's ranks.
    """
    saved_world, saved_accumulate = saved.world_size, saved.accumulate
    packs = saved_world * saved_accumulate
    if batch is not None:
        if batch.packs == packs:
            return Accumulation()
        return Accumulation(
            note=f"global batch: {count(batch.packs, 'pack')} per optimizer step ({batch.setting}) instead of the "
            f"checkpoint's {packs}: the packs not yet trained are formed into steps of the new size"
        )
    if accumulate != configured or world_size * accumulate == packs:
        return Accumulation()  # a global batch the user changed (the sampler says so), or the checkpoint's already
    if packs % world_size:
        raise ConfigError(
            "trainer.devices",
            f"the checkpoint's global batch of {count(packs, 'pack')} per optimizer step ({saved_world} x "
            f"{saved_accumulate} accumulated) cannot be split evenly over {count(world_size, 'rank')}",
            f"{dividing_fix(packs, world_size, 'data.packs_per_step')} to change the global batch",
        )
    kept = packs // world_size
    return Accumulation(
        kept,
        f"global batch: keeping the checkpoint's {count(packs, 'pack')} per optimizer step "
        f"({count(saved_world, 'rank')} x {saved_accumulate} accumulated): {count(world_size, 'rank')} x {kept} "
        "accumulated now; set data.packs_per_step to change it",
    )
