"""One fit of the tiny Llama on fixed packs, as a script, for the multi-process tests of sharded training.

    python tests/helpers/sharded_fit.py '{"strategy": "fsdp2", "devices": 2, "out": "/tmp/fsdp2.pt"}'

Every run trains the same micro-batches (`micro_batches`): `STEPS` optimizer steps of 4 micro-batches each, the
second and fourth of a step much longer than the first and third, so that with 2 ranks (rank 0 trains the first and
third, rank 1 the second and fourth; accumulation 2) rank 1 holds 7x rank 0's label tokens (126 vs 18). One
process accumulating 4 trains the same steps. Rank 0 writes {"losses", "grad_norms", "reduce_scatters",
"all_gathers", "weights"} to `out`: the per-step logged loss, the step's global gradient norm before clipping,
FSDP2's reduce-scatter and all-gather calls per step, and the final full weights.
"""

from __future__ import annotations

import contextlib
import json
import sys

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lit_packing._compat import accumulates
from lit_packing.batch import attach_step
from lit_packing.data.collate import PackedCollator
from lit_packing.models import PackedCausalLM
from lit_packing.models.materialize import deferred_weights
from lit_packing.processes import leave_process_group
from lit_packing.strategies import ShardedStrategy
from tests.helpers import TINY_LLAMA, make_examples

STEPS = 3
# Per optimizer step, 4 micro-batches of examples: short, long, short, long (rank 0 gets the short ones).
MICRO_BATCH_LENGTHS = [[5, 9], [31, 40, 22], [7, 4], [28, 35, 30]]
RUN = dict(lr=1e-2, warmup_steps=0, scheduler="constant", weight_decay=0.1)
CLIP = 0.5  # below every step's gradient norm, so clipping acts on each step


def micro_batches() -> list[dict]:
    """`STEPS` x 4 packed micro-batches, each carrying its optimizer step's global totals."""
    out = []
    for step in range(STEPS):
        groups = [make_examples(lengths, seed=100 * step + i) for i, lengths in enumerate(MICRO_BATCH_LENGTHS)]
        out += attach_step([PackedCollator()(group) for group in groups])
    return out


class Recorder(Callback):
    """Per optimizer step: the logged loss, the global gradient norm (before clipping) and the reduce-scatters since
    the last step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.reduce_scatters: list[int] = []
        self.all_gathers: list[int] = []
        self.calls = {"reduce_scatter_single": 0, "all_gather_single": 0}

    def on_fit_start(self, trainer, pl_module) -> None:
        for name in self.calls:  # FSDP2's default ReduceScatter and AllGather call them by these names
            if hasattr(dist, name):
                setattr(dist, name, self._counted(name, getattr(dist, name)))

    def _counted(self, name: str, original):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            return original(*args, **kwargs)

        return counted

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if any(isinstance(g, DTensor) for g in grads):  # each the whole gradient's norm on every rank (collectives)
            total = sum(torch.linalg.vector_norm(g.double()).full_tensor() ** 2 for g in grads)
        else:  # DDP: each rank's copy, summed over the ranks
            local = sum(g.double().pow(2).sum() for g in grads)
            total = trainer.strategy.reduce(local, reduce_op="sum") if trainer.world_size > 1 else local
        self.grad_norms.append(float(total.sqrt()))
        self.reduce_scatters.append(self.calls["reduce_scatter_single"])
        self.all_gathers.append(self.calls["all_gather_single"])
        self.calls = dict.fromkeys(self.calls, 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not accumulates(trainer):  # `train/loss` was logged before this micro-batch's optimizer step
            self.losses.append(float(trainer.callback_metrics["train/loss"]))


def full_weights(lm: PackedCausalLM) -> dict[str, torch.Tensor]:
    """Every trainable weight, whole, on rank 0 (a collective when sharded)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    names = {n for n, p in lm.model.named_parameters() if p.requires_grad}
    if dist.is_initialized():
        state = get_model_state_dict(lm.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = lm.model.state_dict()
    return {n: t.detach().clone() for n, t in state.items() if n in names}


def main(settings: dict) -> None:
    devices, tp = settings.get("devices", 1), settings.get("tensor_parallel", 1)
    cp = settings.get("context_parallel", 1)
    kind, data_parallel = settings.get("strategy", "auto"), devices // (tp * cp)
    if kind == "fsdp2" and (cp > 1 or settings.get("cpu_offload") or settings.get("accumulation")):
        strategy = ShardedStrategy(data_parallel_size=data_parallel, context_parallel_size=cp, tensor_parallel_size=tp,
                                   cpu_offload=settings.get("cpu_offload", False),
                                   gradient_accumulation=settings.get("accumulation", "sharded"))  # fmt: skip
    elif kind == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=data_parallel, tensor_parallel_size=tp)
    else:
        strategy = kind
    torch.manual_seed(0)
    # FSDP2 builds on the meta device, each rank filling its shards; `"whole": true` builds the model whole on every
    # rank first and shards it (a plain PackedCausalLM under ModelParallelStrategy).
    deferred = kind == "fsdp2" and not settings.get("whole")
    with deferred_weights() if deferred else contextlib.nullcontext():
        lm = PackedCausalLM(
            model_config=TINY_LLAMA, lora=settings.get("lora"),
            gradient_checkpointing=settings.get("gradient_checkpointing", False), **RUN,
        )  # fmt: skip
    recorder = Recorder()
    trainer = Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS,
        accumulate_grad_batches=4 // data_parallel, gradient_clip_val=settings.get("clip", CLIP), precision="32-true",
        callbacks=[recorder], use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
    )  # fmt: skip
    # Each data-parallel rank's own micro-batches (no distributed sampler): data-parallel rank r trains micro-batches
    # r and r + 2 of a step (all 4 with one). The mesh is (data, context, tensor) in row-major order: global rank g
    # is data-parallel rank g // (cp x tp), and its context- and tensor-parallel peers train the same micro-batches.
    mine = micro_batches()[trainer.global_rank // (cp * tp) :: data_parallel]
    trainer.fit(lm, DataLoader(mine, batch_size=None, collate_fn=lambda b: b))
    weights = full_weights(lm)
    if trainer.is_global_zero:
        torch.save(
            {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "reduce_scatters": recorder.reduce_scatters,
             "all_gathers": recorder.all_gathers, "weights": weights},
            settings["out"],
        )  # fmt: skip


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    leave_process_group()  # as the command line does: a gloo group left to the exit can abort the rank
