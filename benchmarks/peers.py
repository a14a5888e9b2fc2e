"""The peers' rows: our examples trained by the Hugging Face `Trainer` or TRL's `SFTTrainer`, each on its own path.

    run_peer(spec, result)  # in `python -m benchmarks.worker spec.json result.json`, for a peer's spec

The HF Trainer row uses `DataCollatorWithFlattening` and the model's stock `sdpa` attention on exactly our mini-batches
(its sampler set to `sequential` over the examples in our batch order); the TRL row uses `SFTTrainer` with
`padding_free=True` and its own `bfd` packing to the same token budget as best fit. TRL comes with the `bench` extra
and is imported only here, for its row. Validation scores the peer's trained weights with lit_packing's validation.
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.common import step_ended, validate, variant_cli
from benchmarks.variants import VARIANTS, RunResult, RunSpec, check_installed
from lit_packing.assets import resolve_pretrained
from lit_packing.batch import IGNORE_INDEX, INPUT_IDS, LABELS
from lit_packing.cost import hardware_flops, model_shape


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
    """Train with the Hugging Face Trainer (variant `hf_trainer`) or TRL's SFTTrainer (`trl_bfd`) on our examples."""
    from transformers import AutoModelForCausalLM, TrainerCallback

    check_installed([spec.variant])  # TRL: the `bench` extra
    kind = VARIANTS[spec.variant].kind
    # Our data module (and model, for validation) built as the mini-batch packing run builds them: the same
    # examples, split, tokenization and mini-batches.
    cli = variant_cli(spec)
    data, device = cli.datamodule, torch.device("cuda" if spec.accelerator in ("cuda", "gpu") else "cpu")
    data.prepare_data()
    data.setup("fit")
    path = resolve_pretrained(spec.model)  # `smollm2`: the packaged model's converted folder
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    shape = model_shape(model)
    clock_losses: list[torch.Tensor] = []

    class StepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ended(result, device)

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
        seed=spec.seed, disable_tqdm=True, **{_checkpointing_field(): spec.gradient_checkpointing},
        optim="adamw_torch_fused" if device.type == "cuda" else "adamw_torch",  # the AdamW ours runs there
    )  # fmt: skip
    train = data.train_dataset
    if kind == "hf_trainer":
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
    # Validation: the peer's trained weights, loaded into our packed model of the same initial weights and scored
    # by lit_packing's validation on the same held-out examples.
    cli.model.model.load_state_dict(model.state_dict())
    result.val_loss = validate(cli)
    result.device = str(device)


def _checkpointing_field() -> str:
    """`activation_checkpointing` from transformers 5.2x on (`gradient_checkpointing` then warns, as an alias);
    `gradient_checkpointing` before it (5.17 has no such field)."""
    from dataclasses import fields

    from transformers import TrainingArguments

    names = {field.name for field in fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
