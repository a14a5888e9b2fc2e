"""One benchmark run, in a process of its own (so that its peak memory is its own):

    python -m benchmarks.worker spec.json result.json

Ours run through `main.py fit`'s own path (the LightningCLI parser on the variant's config, `Trainer.fit`); the peers
through their own trainers (`peers.py`, imported only for a peer's run). Every run records the clock at the end of
each optimizer step (after the optimizer and the device are done), each step's real and slot tokens and loss, then
scores the validation examples with lit_packing's validation and counts one epoch of the variant's own loader.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback

from benchmarks.common import step_ended, variant_cli
from benchmarks.variants import VARIANTS, RunResult, RunSpec
from lit_packing.batch import COUNTS
from lit_packing.cost import hardware_flops, model_shape
from lit_packing.packing_report import configured_stats


class StepClock(Callback):
    """Records, for every optimizer step of a Lightning fit, when it ended, its batch's counts and its loss."""

    def __init__(self, result: RunResult) -> None:
        self.result = result
        self._losses: list[torch.Tensor] = []
        self._shape = None

    def on_train_start(self, trainer, pl_module) -> None:
        self._shape = model_shape(pl_module.hf_model)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step_ended(self.result, pl_module.device)
        counts = batch[COUNTS]
        self.result.real_tokens.append(int(counts["real_tokens"]))
        self.result.slot_tokens.append(int(counts["slot_tokens"]))
        self.result.work.append(hardware_flops(self._shape, counts))
        self._losses.append(outputs["loss"].detach())  # read back once, at the end: no extra sync per step

    def on_train_end(self, trainer, pl_module) -> None:
        self.result.loss = [float(x) for x in self._losses]


def run_ours(spec: RunSpec, result: RunResult) -> None:
    cli = variant_cli(spec)
    trainer = cli.trainer
    trainer.callbacks.append(StepClock(result))
    trainer.fit(cli.model, datamodule=cli.datamodule)
    if "val/loss" not in trainer.callback_metrics:
        raise RuntimeError(f"{spec.variant}: the fit did not validate after its last step")
    result.val_loss = float(trainer.callback_metrics["val/loss"])
    epoch = configured_stats(cli.datamodule, trainer.accumulate_grad_batches)
    result.epoch_steps, result.epoch_real_tokens, result.epoch_slot_tokens = (
        epoch.steps, epoch.real_tokens, epoch.slot_tokens
    )  # fmt: skip
    totals = {"slot_tokens": epoch.slot_tokens, "attn_cost": epoch.attn_cost}
    result.epoch_work = hardware_flops(model_shape(cli.model.hf_model), totals)
    result.device = str(cli.model.device)


def run(spec: RunSpec) -> RunResult:
    result = RunResult(spec.row, spec.variant, spec.round, spec.warmup_steps, spec.steps)
    if VARIANTS[spec.variant].kind == "lit_packing":
        run_ours(spec, result)
    else:
        from benchmarks.peers import run_peer  # the peers' trainers (and TRL) load only for their rows

        run_peer(spec, result)
    if len(result.step_end) != spec.steps:
        raise RuntimeError(f"{spec.variant}: {len(result.step_end)} optimizer steps ran, {spec.steps} asked")
    return result


def main(argv: list[str] | None = None) -> None:
    spec_path, result_path = argv or sys.argv[1:]
    sys.argv = sys.argv[:1]  # the CLI built inside reads its arguments from the spec, not from this command line
    spec = RunSpec(**json.loads(Path(spec_path).read_text()))
    result = run(spec)
    Path(result_path).write_text(json.dumps(result.to_dict()))


if __name__ == "__main__":
    main()
