"""One benchmark run, in a process of its own (so that its peak memory is its own):

    python -m lit_packing.bench.worker spec.json result.json

Ours run through `main.py fit`'s own path (the LightningCLI parser on the variant's config, `Trainer.fit`); the peers
through their own trainers on the same tokenized examples: the Hugging Face `Trainer` with
`DataCollatorWithFlattening` and the model's stock `sdpa` attention, on exactly our mini-batches (its sampler set to
`sequential` over the examples in our batch order), and TRL's `SFTTrainer` with `padding_free=True` and its own
`bfd` packing to the same token budget as best fit. Every run records the clock at the end of each optimizer step
(after the optimizer and the device are done), each step's real and slot tokens and loss, then scores the
validation examples with lit_packing's validation (the peers' trained weights loaded into it) and counts one epoch
of the variant's own loader.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback

from lit_packing.assets import resolve_pretrained
from lit_packing.batch import COUNTS, IGNORE_INDEX, INPUT_IDS, LABELS
from lit_packing.bench.variants import CONFIGS, VARIANTS, RunResult, RunSpec
from lit_packing.callbacks.throughput import peak_memory_gb
from lit_packing.cli import PackingCLI, cli_main
from lit_packing.cost import hardware_flops, model_shape
from lit_packing.packing_report import configured_stats

CLEAR_REFS, STATUS = "/proc/self/clear_refs", "/proc/self/status"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Start measuring peak memory anew: CUDA's allocator statistics, or (Linux) the process's peak resident set."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif Path(CLEAR_REFS).exists():
        Path(CLEAR_REFS).write_text("5")  # resets VmHWM to the current resident set


def peak_memory(device: torch.device) -> float:
    """GiB: CUDA's peak allocated, or the peak resident set since `reset_peak_memory` (Linux; else since start)."""
    if device.type == "cuda" or not Path(STATUS).exists():
        return peak_memory_gb(device)
    line = next(x for x in Path(STATUS).read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 2**20  # kB


def _step_ended(result: RunResult, device: torch.device) -> None:
    """The end of an optimizer step: the clock, and the peak memory measured from the end of the warm-up."""
    _synchronize(device)
    result.step_end.append(time.perf_counter())
    if len(result.step_end) == result.warmup_steps:
        reset_peak_memory(device)
    if len(result.step_end) == result.steps:  # before validation, which the fit runs next
        result.peak_memory_gb = peak_memory(device)


class StepClock(Callback):
    """Records, for every optimizer step of a Lightning fit, when it ended, its batch's counts and its loss."""

    def __init__(self, result: RunResult) -> None:
        self.result = result
        self._losses: list[torch.Tensor] = []
        self._shape = None

    def on_train_start(self, trainer, pl_module) -> None:
        self._shape = model_shape(pl_module.hf_model)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        _step_ended(self.result, pl_module.device)
        counts = batch[COUNTS]
        self.result.real_tokens.append(int(counts["real_tokens"]))
        self.result.slot_tokens.append(int(counts["slot_tokens"]))
        self.result.work.append(hardware_flops(self._shape, counts))
        self._losses.append(outputs["loss"].detach())  # read back once, at the end: no extra sync per step

    def on_train_end(self, trainer, pl_module) -> None:
        self.result.loss = [float(x) for x in self._losses]


def _cli(spec: RunSpec, config: str) -> PackingCLI:
    return cli_main(["--config", str(CONFIGS / config), *spec.overrides()], run=False)


def _validate(cli: PackingCLI) -> float:
    metrics = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    return float(metrics[0]["val/loss"])


def run_ours(spec: RunSpec, result: RunResult) -> None:
    cli = _cli(spec, VARIANTS[spec.variant].config)
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


def _examples(dataset, order) -> list[dict[str, list[int]]]:
    items = (dataset[int(i)] for i in order)  # one read per example
    return [{INPUT_IDS: item[INPUT_IDS].tolist(), LABELS: item[LABELS].tolist()} for item in items]


def peer_counts(batch: dict) -> dict[str, int]:
    """Real and slot tokens of a peer's batch, and the attention its `sdpa` computes: every row in full (a packed
    row's block-diagonal mask is applied to the whole T x T product)."""
    ids, mask = batch[INPUT_IDS], batch.get("attention_mask")
    rows, width = ids.shape
    real = int(mask.sum()) if mask is not None else ids.numel()
    return {"real_tokens": real, "slot_tokens": ids.numel(), "attn_cost": rows * width * width}


def run_peer(spec: RunSpec, result: RunResult) -> None:
    """Train with the Hugging Face Trainer (kind `hf_trainer`) or TRL's SFTTrainer (`trl`) on our examples."""
    from transformers import AutoModelForCausalLM, TrainerCallback

    # Our data module (and model, for validation) built as the mini-batch packing run builds them: the same
    # examples, split, tokenization and mini-batches.
    cli = _cli(spec, VARIANTS[spec.variant].config)
    data, device = cli.datamodule, torch.device("cuda" if spec.accelerator in ("cuda", "gpu") else "cpu")
    data.prepare_data()
    data.setup("fit")
    path = resolve_pretrained(spec.model)  # `smollm2`: the packaged model's converted folder
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    cli.model.name_or_path = model  # one copy in memory; validation later scores these weights with our attention
    shape = model_shape(model)
    clock_losses: list[torch.Tensor] = []

    class StepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            _step_ended(result, device)

    class Recorded:
        """Mixed into the peer's trainer: keeps every step's loss and token counts (its logs round the loss)."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            counts = peer_counts(inputs)
            result.real_tokens.append(counts["real_tokens"])
            result.slot_tokens.append(counts["slot_tokens"])
            result.work.append(hardware_flops(shape, counts))
            clock_losses.append((loss[0] if return_outputs else loss).detach())
            return loss

    common = dict(
        output_dir=str(Path(spec.out) / "peer"), max_steps=spec.steps, learning_rate=spec.lr, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0, lr_scheduler_type="constant",
        warmup_steps=0, logging_steps=spec.steps, report_to="none", save_strategy="no", eval_strategy="no",
        use_cpu=device.type == "cpu", bf16=spec.precision.startswith("bf16"), dataloader_num_workers=0,
        seed=spec.seed, disable_tqdm=True, activation_checkpointing=spec.gradient_checkpointing,
        optim="adamw_torch_fused" if device.type == "cuda" else "adamw_torch",  # the AdamW ours runs there
    )  # fmt: skip
    train = data.train_dataset
    if spec.variant == "hf_trainer":
        from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

        batches = data.train_dataloader().batch_sampler  # our epoch's mini-batches, in order
        order = [int(i) for batch in batches for i in batch]

        class PeerTrainer(Recorded, Trainer):
            pass

        args = TrainingArguments(
            per_device_train_batch_size=spec.batch_size, train_sampling_strategy="sequential",
            remove_unused_columns=False, **common,
        )  # fmt: skip
        trainer = PeerTrainer(
            model=model, args=args, train_dataset=_examples(train, order),
            data_collator=DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE_INDEX),
            callbacks=[StepEnd()],
        )  # fmt: skip
    else:
        import datasets
        from trl import SFTConfig, SFTTrainer

        class PeerTrainer(Recorded, SFTTrainer):
            pass

        examples = _examples(train, range(len(train)))
        args = SFTConfig(
            packing=True, packing_strategy="bfd", padding_free=True, max_length=spec.max_tokens,
            per_device_train_batch_size=1, **common,
        )  # fmt: skip
        trainer = PeerTrainer(
            model=model, args=args, processing_class=data.tokenizer,
            train_dataset=datasets.Dataset.from_list(examples), callbacks=[StepEnd()],
        )  # fmt: skip
    trainer.train()
    result.loss = [float(x) for x in clock_losses]
    # One epoch of the peer's own loader and collator: its steps and tokens.
    for batch in trainer.get_train_dataloader():
        counts = peer_counts(batch)
        result.epoch_steps += 1
        result.epoch_slot_tokens += counts["slot_tokens"]
        result.epoch_real_tokens += counts["real_tokens"]
        result.epoch_work += hardware_flops(shape, counts)
    # Validation: the peer's trained weights, scored by lit_packing's validation on the same held-out examples.
    result.val_loss = _validate(cli)
    result.device = str(device)


def run(spec: RunSpec) -> RunResult:
    result = RunResult(spec.row, spec.variant, spec.round, spec.warmup_steps, spec.steps)
    (run_ours if VARIANTS[spec.variant].kind == "lit_packing" else run_peer)(spec, result)
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
