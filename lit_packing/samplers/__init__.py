"""Batch samplers: lengths in, one list of dataset indices per micro-step on this rank out."""

from lit_packing.samplers.base import (
    AUTO,
    PackPlan,
    PlannedBatchSampler,
    RunContext,
    TokenBudgetSampler,
    deal,
    worst_pack,
)
from lit_packing.samplers.best_fit import BestFitPackingSampler, best_fit_packs
from lit_packing.samplers.fixed_length import FixedLengthPackingSampler, fixed_length_rows
from lit_packing.samplers.length_grouped import LengthGroupedSampler
from lit_packing.samplers.multipack import MultipackSampler, pack_costs, straggler_factor
from lit_packing.samplers.random_batch import RandomBatchSampler
from lit_packing.samplers.sequential import SequentialPackingSampler

__all__ = [
    "AUTO",
    "BestFitPackingSampler",
    "FixedLengthPackingSampler",
    "LengthGroupedSampler",
    "MultipackSampler",
    "PackPlan",
    "PlannedBatchSampler",
    "RandomBatchSampler",
    "RunContext",
    "SequentialPackingSampler",
    "TokenBudgetSampler",
    "best_fit_packs",
    "deal",
    "fixed_length_rows",
    "pack_costs",
    "straggler_factor",
    "worst_pack",
]
