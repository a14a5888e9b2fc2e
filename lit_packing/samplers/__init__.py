"""Batch samplers: lengths in, one list of dataset indices per micro-step on this rank out.

The public list is the samplers, their plan and run context, and the packing functions with worked examples; the
machinery under them (`base.deal`, `base.worst_pack`, `multipack.pack_costs`) is imported from its module.
"""

from lit_packing.samplers.base import (
    AUTO,
    PackPlan,
    PlannedBatchSampler,
    RunContext,
    TokenBudgetSampler,
)
from lit_packing.samplers.best_fit import BestFitPackingSampler, best_fit_packs
from lit_packing.samplers.fixed_length import FixedLengthPackingSampler, fixed_length_rows
from lit_packing.samplers.length_grouped import LengthGroupedSampler
from lit_packing.samplers.multipack import MultipackSampler, straggler_factor
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
    "fixed_length_rows",
    "straggler_factor",
]
