"""Multipack: best-fit packs dealt to ranks so that every rank does the same compute in every optimizer step.

Usage: ``MultipackSampler(lengths, max_tokens=8192, world_size=8)``; in YAML
``sampler: {class_path: lit_packing.samplers.MultipackSampler, init_args: {max_tokens: 8192}}``.

Best-fit packs all hold about ``max_tokens`` tokens, but not the same compute: a pack of two 4,096-token examples
attends 2 * 4,096^2 pairs, one of twenty 400-token examples 20 * 400^2. Dealt round-robin, every optimizer step
waits for its most expensive rank. Here the packs of one optimizer step (``world_size * accumulate`` of them) are
chosen among packs of similar cost and spread over the ranks so that the slowest rank's sum is as low as possible;
``straggler_factor`` measures what is left.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from lit_packing.cost import SMOLLM2_135M_SHAPE, flop_coefficients
from lit_packing.errors import ConfigError
from lit_packing.samplers import kernels
from lit_packing.samplers.base import PackPlan, PlannedBatchSampler, RunContext, TokenBudgetSampler
from lit_packing.samplers.best_fit import best_fit_packs

log = logging.getLogger(__name__)

Balance = Literal["compute", "tokens"]


def pack_costs(plan: PackPlan, cost_coefficients: tuple[float, float]) -> np.ndarray:
    """(n_packs,) float64 cost of every pack: ``a * sum(L) + b * sum(L^2)`` over its examples, ``(a, b)`` given."""
    per_token, per_pair = cost_coefficients
    return per_token * plan.tokens_per_pack().astype(np.float64) + per_pair * plan.sq_tokens_per_pack()


def straggler_factor(
    sampler_or_schedule: PlannedBatchSampler | np.ndarray, costs: np.ndarray, accumulate: int = 1
) -> float:
    """Sum over optimizer steps of the slowest rank's cost, over the sum over steps of the mean rank's cost.

    1.0 means no rank ever waits; 1.25 means a quarter of the mean work is spent waiting for the slowest rank. An
    optimizer step is ``accumulate`` consecutive micro-steps (the last may be shorter); an empty pack costs 0.

    Args:
        sampler_or_schedule: a sampler (its ``schedule()`` of the current epoch and its ``accumulate`` are used) or
            a (micro_steps, world_size) array of pack ids, -1 for an empty pack.
        costs: (n_packs,) cost of every pack id of the plan, e.g. ``pack_costs(sampler.plan(), (a, b))``.
        accumulate: micro-steps per optimizer step, for a schedule array.

    Example: schedule ``[[0, 1], [2, -1]]`` with costs ``[3, 1, 2]`` and ``accumulate=1`` -> steps cost ``[3, 1]``
    and ``[2, 0]``: (3 + 2) / (2 + 1) = 1.67.

    >>> round(straggler_factor(np.array([[0, 1], [2, -1]]), np.array([3.0, 1.0, 2.0])), 2)
    1.67
    """
    if isinstance(sampler_or_schedule, PlannedBatchSampler):
        schedule, accumulate = sampler_or_schedule.schedule(), sampler_or_schedule.accumulate
    else:
        schedule = np.asarray(sampler_or_schedule)
    if not len(schedule):
        return 1.0
    costs = np.asarray(costs, dtype=np.float64)
    work = np.where(schedule >= 0, costs[np.maximum(schedule, 0)], 0.0)  # (micro_steps, ranks)
    per_step = np.add.reduceat(work, np.arange(0, len(work), accumulate), axis=0)  # (optimizer steps, ranks)
    mean = per_step.mean(axis=1).sum()
    return float(per_step.max(axis=1).sum() / mean) if mean > 0 else 1.0


@dataclass(frozen=True, eq=False)
class _SeededPlan(PackPlan):
    """A plan that carries the seed its dealing draws from, taken from the plan's own ``(seed, epoch)`` stream."""

    deal_seed: int = 0


def _checked_costs(given: tuple[float, float]) -> tuple[float, float]:
    values = np.asarray(given, dtype=np.float64)
    if values.shape != (2,) or not np.isfinite(values).all() or (values < 0).any() or not values.any():
        raise ConfigError(
            "cost_coefficients",
            f"{given!r}: need two finite numbers >= 0, not both 0 (FLOPs per token, per attended pair)",
            "fix it or leave it null (the model's own are used)",
        )
    return float(values[0]), float(values[1])


class MultipackSampler(TokenBudgetSampler):
    """Best-fit packs of at most ``max_tokens`` tokens, dealt so that ranks finish each optimizer step together.

    Packs are planned exactly as ``BestFitPackingSampler`` does (same fill, same pack count). Dealing: packs are
    sorted by cost (``a * tokens + b * sum(L^2)``), consecutive runs of ``world_size * accumulate`` packs form the
    optimizer steps, and within a step each pack goes, most expensive first, to the least loaded rank that still
    has a free micro-step. The steps are then shuffled (with ``shuffle``; without, they run most expensive first,
    which also surfaces an out-of-memory step at once). The last step, with fewer packs, stays last: ranks without
    a pack there get an empty pack, as with round-robin. Every rank takes the same number of micro-steps,
    ``ceil(packs / world_size)`` (``floor`` with ``drop_last``, which drops ``packs % world_size`` packs at random).

    What it trades: an optimizer step holds packs of similar cost, so steps of long examples and steps of short
    ones alternate (in a shuffled order) instead of every step mixing them; the examples inside a pack are those
    best fit chose. ``accumulate`` (set by the data module from ``trainer.accumulate_grad_batches``) gives every
    rank several packs per step to balance, which evens out the steps further.

    Args:
        lengths: (n,) tokens per example, each <= ``max_tokens``.
        max_tokens: token budget of one pack (one micro-step on one rank), or ``auto`` (with
            ``max_tokens_granule``, ``max_tokens_cap``): see ``TokenBudgetSampler``.
        balance: ``compute``: even out ``a * L + b * L^2`` (matmuls + attention); ``tokens``: even out tokens only.
        cost_coefficients: ``(a, b)`` FLOPs per token and per attended (query, key) pair, as
            ``lit_packing.cost.flop_coefficients`` computes them. None: the run's model's (``RunContext``), else
            SmolLM2-135M's (``a = 8.07e8``, ``b = 2.07e5``), logged. Ignored with ``balance="tokens"``.
        **common: ``seed``, ``shuffle``, ``drop_last``, ``rank``, ``world_size``, ``accumulate``: see
            ``PlannedBatchSampler``.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        max_tokens: int | Literal["auto"] = 4096,
        *,
        balance: Balance = "compute",
        cost_coefficients: tuple[float, float] | None = None,
        **common: Any,
    ) -> None:
        if balance not in ("compute", "tokens"):
            raise ConfigError("balance", f"{balance!r} is not a choice", "use compute or tokens")
        super().__init__(lengths, max_tokens, **common)
        self.balance = balance
        self._given_costs = None if cost_coefficients is None else _checked_costs(cost_coefficients)
        self._run_costs: tuple[float, float] | None = None

    def _connect(self, context: RunContext) -> None:
        if context.cost_coefficients is not None:
            self._run_costs = _checked_costs(context.cost_coefficients)

    @property
    def cost_coefficients(self) -> tuple[float, float]:
        """``(a, b)`` in use: ``(1, 0)`` balancing tokens; else given, else the run's model's, else SmolLM2-135M's."""
        if self.balance == "tokens":
            return 1.0, 0.0
        if self._given_costs is not None or self._run_costs is not None:
            return self._given_costs or self._run_costs
        per_token, per_pair = flop_coefficients(SMOLLM2_135M_SHAPE)
        if not getattr(self, "_told_default", False):
            log.info(
                "MultipackSampler: no cost_coefficients given, balancing with SmolLM2-135M's FLOPs per token "
                "%.3g and per attended pair %.3g (set cost_coefficients for another model)",
                per_token,
                per_pair,
            )
            self._told_default = True
        return per_token, per_pair

    def _build_plan(self, epoch: int, rng: np.random.Generator) -> PackPlan:
        items, offsets = best_fit_packs(self.lengths, self.max_tokens, rng if self.shuffle else None)
        return _SeededPlan(items, offsets, self.lengths[items], self.max_tokens, int(rng.integers(2**63)))

    def _order_steps(self, plan: PackPlan, pack_ids: np.ndarray, world_size: int, accumulate: int) -> np.ndarray:
        """Packs sorted by cost and cut into optimizer steps of ``world_size * accumulate``, the whole steps shuffled;
        seeded by the plan and the global batch (never the world size alone), so every rank, and every layout of the
        same global batch, forms the same steps. See the class docstring."""
        group = world_size * accumulate
        rng = np.random.default_rng([plan.deal_seed, len(pack_ids), group])
        costs = pack_costs(plan, self.cost_coefficients)[pack_ids]
        if self.drop_last and len(pack_ids) % world_size:  # its own stream: the steps' order does not move with it
            dropping = np.random.default_rng([plan.deal_seed, len(pack_ids), group, world_size])
            keep = np.sort(dropping.permutation(len(pack_ids))[: len(pack_ids) - len(pack_ids) % world_size])
            pack_ids, costs = pack_ids[keep], costs[keep]
        order = rng.permutation(len(pack_ids)) if self.shuffle else np.arange(len(pack_ids))  # ties: random
        ordered = pack_ids[order[np.argsort(-costs[order], kind="stable")]]
        full = len(ordered) // group
        if self.shuffle and full > 1:  # shuffle whole optimizer steps; a short last step stays last
            steps = rng.permutation(full)[:, None] * group + np.arange(group)
            ordered[: full * group] = ordered[steps.ravel()]
        return ordered

    def _place(self, plan: PackPlan, ordered: np.ndarray, world_size: int, accumulate: int) -> np.ndarray:
        """Within each optimizer step (its packs come most expensive first), each pack to the least loaded rank that
        still has a free micro-step (``kernels.balance_steps``)."""
        costs = pack_costs(plan, self.cost_coefficients)[ordered]
        slots = kernels.balance_steps(costs, world_size, accumulate)  # (micro_steps, ranks) positions into ordered
        return np.where(slots >= 0, ordered[np.maximum(slots, 0)], -1)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, balance={self.balance}, cost_coefficients={self.cost_coefficients})"
