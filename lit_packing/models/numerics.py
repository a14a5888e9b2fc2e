"""The numerics guard of a `PackedCausalLM`'s optimizer step: a non-finite loss or gradient stops the run naming
the step and its examples (`model.nonfinite: error`), or drops the step and counts it (`skip`).

    if not finite_step(lm, loss_sum, rows):   # in on_before_optimizer_step, once per optimizer step
        return
"""

from __future__ import annotations

import logging

import torch

from lit_packing._compat import foreach_norm
from lit_packing.errors import TrainingError
from lit_packing.models.sharding import local_tensor

log = logging.getLogger(__name__)

SAMPLE_ROWS = 8  # source rows named when a step fails


def finite_step(lm, loss_sum: torch.Tensor, rows: list[int]) -> bool:
    """Whether this optimizer step's loss and gradients are finite (one host sync, one scalar all-reduce with
    several ranks); if not, raise a `TrainingError` naming the step and its examples' `rows` (`nonfinite=error`),
    or drop every gradient so the optimizer skips the step (`skip`: counted in `lm.nonfinite_steps`)."""
    trainer = lm.trainer
    grads = [local_tensor(p.grad) for p in lm.parameters() if p.grad is not None]  # a shard each, sharded
    # Under fp16 the GradScaler itself skips steps with inf gradients (and lowers its scale): check the loss only.
    check_grads = grads and str(trainer.precision) != "16-mixed"
    norms = foreach_norm(grads) if check_grads else []
    local = torch.stack([loss_sum.float(), *(n.float().to(loss_sum.device) for n in norms)]).sum()
    # Every rank takes the same decision (NaN + x = NaN).
    total = trainer.strategy.reduce(local, reduce_op="sum") if trainer.world_size > 1 else local
    if torch.isfinite(total):
        return True
    what = "gradient" if torch.isfinite(loss_sum) else "loss"
    if lm.hparams.nonfinite == "error":
        named = lm._data.name_rows(rows[:SAMPLE_ROWS]) if lm._data is not None else (
            f"rows {', '.join(map(str, rows[:SAMPLE_ROWS]))}" if rows else "not recorded")  # fmt: skip
        raise TrainingError(
            f"non-finite {what} at optimizer step {lm.global_step + 1} (epoch {lm.current_epoch}; examples of that "
            f"step: {named}): lower model.lr (now {lm.hparams.lr:g}), set trainer.gradient_clip_val, check those "
            f"examples, or set model.nonfinite=skip to skip such steps (they are counted)"
        )
    for p in lm.parameters():
        p.grad = None  # AdamW leaves parameters without a gradient untouched
    lm.nonfinite_steps += 1
    log.warning("skipped optimizer step %d: non-finite %s (model.nonfinite=skip)", lm.global_step, what)
    lm.log("train/nonfinite_steps", float(lm.nonfinite_steps), on_step=True, on_epoch=False)
    return False
