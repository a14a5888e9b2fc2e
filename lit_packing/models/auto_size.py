"""The largest step that fits: `max_tokens: auto` and `batch_size: auto` choose among increasing step sizes the largest
whose predicted peak memory (`memory.MemoryModel.estimate`, arithmetic once the probes ran) is at most the limit
with a margin to spare, by binary search; with several ranks the smallest any rank chose, so that every rank builds
the same plan.

    memory = memory_model(lm, "32-true", padded=False)                                   # the probes, once
    choice = choose_largest_fitting(memory, step_of, range(1024, 65537, 1024), margin=0.25)   # arithmetic only
    value, estimate = largest_fitting(lm, step_of, candidates)                           # what PackedCausalLM asks
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lit_packing.batch import StepShape
from lit_packing.models.memory import GiB, MemoryEstimate, MemoryModel, memory_model

log = logging.getLogger(__name__)

AUTO_UNITS = {"max_tokens": "tokens per pack", "batch_size": "examples per batch"}


@dataclass(frozen=True)
class FitChoice:
    """The largest candidate step size that fits with a margin (`choose_largest_fitting`).

    Attributes:
        value: the chosen candidate, or None when not even the smallest fits.
        candidate: the candidate `estimate` is of: the chosen one, or the smallest when none fits.
        estimate: its predicted peak.
        following: the next larger candidate and its estimate (the first that does not fit), None after the last
            candidate or when none fits.
        margin: the fraction of the limit kept free.
    """

    value: int | None
    candidate: int
    estimate: MemoryEstimate
    following: tuple[int, MemoryEstimate] | None
    margin: float

    @property
    def budget(self) -> float:
        """The largest predicted peak a chosen step may have: the limit x (1 - margin)."""
        return self.estimate.limit * (1 - self.margin)

    def describe(self, what: str, unit: str = "") -> str:
        """One line: the choice, its predicted peak against the limit and margin, and the next candidate's peak.

        Args:
            what: the setting chosen, e.g. `max_tokens`.
            unit: what its value counts, e.g. `tokens per pack`.
        """
        amount = f"{self.candidate:,} {unit}".rstrip()
        limit = f"a {self.estimate.limit / GiB:.2f} GiB limit with a {self.margin:.0%} margin"
        peak = f"{self.estimate.peak / GiB:.2f} GiB"
        if self.value is None:
            return (
                f"{what}: auto found no value that fits: the smallest candidate, {amount}, is predicted to peak at "
                f"{peak}, over {self.budget / GiB:.2f} GiB ({limit})"
            )
        if self.following is None:
            after = "the largest candidate"
        else:
            value, estimate = self.following
            after = f"next candidate {value:,}: {estimate.peak / GiB:.2f} GiB"
        return f"{what}: auto chose {amount}: predicted peak {peak} of {limit} ({after})"


def increasing(candidates: Sequence[int]) -> list[int]:
    """`candidates` as a list of ints, checked non-empty and strictly increasing (what a binary search needs)."""
    values = [int(c) for c in candidates]
    if not values or any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"candidates must be a non-empty increasing sequence, got {values[:8]}")
    return values


def choose_largest_fitting(
    memory: MemoryModel,
    step_of: Callable[[int], StepShape],
    candidates: Sequence[int],
    margin: float,
    agree: Callable[[int], int] | None = None,
) -> FitChoice:
    """The largest of `candidates` whose step's predicted peak is at most the limit x (1 - `margin`).

    The predicted peak grows with the step, so a binary search finds it in ~log2(len(candidates)) estimates, each
    arithmetic (`MemoryModel.estimate`).

    Args:
        memory: the model's `memory_model`, probed in the steps' layout.
        step_of: a candidate -> the worst-case `StepShape` of a step that size.
        candidates: increasing step sizes (token budgets, batch sizes).
        margin: the fraction of the limit kept free, for what the estimate does not model.
        agree: this process's choice (an index into `candidates`, -1 for none) -> the one to take; with several
            ranks, the smallest over ranks, so that every rank builds the same plan.

    Returns:
        The choice: its `value` (None when none fits), estimate and the next candidate's.
    """
    candidates = increasing(candidates)
    budget = memory.limit * (1 - margin)
    low, high = 0, len(candidates)  # candidates[:low] fit, candidates[high:] do not
    while low < high:
        middle = (low + high) // 2
        if memory.estimate(step_of(candidates[middle])).peak <= budget:
            low = middle + 1
        else:
            high = middle
    index = low - 1 if agree is None else agree(low - 1)
    candidate = candidates[max(index, 0)]
    following = None
    if 0 <= index < len(candidates) - 1:
        following = (candidates[index + 1], memory.estimate(step_of(candidates[index + 1])))
    value = candidate if index >= 0 else None
    return FitChoice(value, candidate, memory.estimate(step_of(candidate)), following, margin)


def largest_fitting(
    lm, step_of: Callable[[int], StepShape], candidates: Sequence[int], what: str = "max_tokens",
    unit: str | None = None,
) -> tuple[int | None, MemoryEstimate]:  # fmt: skip
    """The largest step size whose predicted peak memory fits with `lm`'s `memory_margin` to spare: what
    `max_tokens: auto` / `batch_size: auto` ask a `PackedCausalLM` (through `contract.largest_fitting`) when the
    training loader is built, with the model on its device and the trainer attached.

    The probes run once (3 forwards, `memory_model`); each candidate's estimate is then arithmetic. Logs one line
    (the choice, its predicted peak, the limit and margin, the next candidate's peak) and, on global rank zero,
    `train/auto_<what>` at step 0.

    Args:
        step_of: a candidate -> the worst-case `StepShape` of a step that size (the collator's padding rule applied
            to the longest example).
        candidates: increasing values to choose from.
        what: the setting being chosen, as the log line names it: `max_tokens`, `batch_size`.
        unit: what the value counts, as the log line says it; default `tokens per pack` for `max_tokens`,
            `examples per batch` for `batch_size`.

    Returns:
        (value, estimate): the largest candidate whose predicted peak is at most the limit (`memory_limit_gb`, else
        the device's memory) x (1 - `memory_margin`), None when none is; with several ranks, the smallest any rank
        chose. The estimate is that candidate's (the smallest candidate's when none fits).
    """
    candidates = increasing(candidates)
    trainer = lm.trainer

    def smallest_over_ranks(index: int) -> int:
        """Every rank must build the same plan: the smallest rank's choice (one all-gather with several ranks)."""
        if trainer.world_size == 1:
            return index
        return int(trainer.strategy.all_gather(torch.tensor(index, device=lm.device)).min())

    memory = memory_model(lm, str(trainer.precision), padded=step_of(candidates[0]).padded)
    choice = choose_largest_fitting(memory, step_of, candidates, lm.hparams.memory_margin, agree=smallest_over_ranks)
    unit = unit or AUTO_UNITS.get(what, "")
    if choice.value is None:
        log.warning(choice.describe(what, unit))
        return None, choice.estimate
    log.info(choice.describe(what, unit))
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics({f"train/auto_{what}": float(choice.value)}, step=0)
    return choice.value, choice.estimate
