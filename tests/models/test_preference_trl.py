"""Packed DPO against TRL's `DPOTrainer` (padded) on the same pairs, tokens and initial weights: the same step-0
loss (ln 2) and gradients, and the same losses over the first optimizer steps.

Measured here: the step-0 gradients agree to 3e-5 of each tensor's largest element (TRL computes the log-probs
through its own fused LM head over the 49k vocabulary; the two fp32 summation orders differ), and the four steps'
losses to 4.7e-4 relative (SGD, lr 0.5, loss 0.693 -> 0.242): within 1e-3 below."""

from __future__ import annotations

import copy
import tempfile

import datasets
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lit_packing.assets import resolve_pretrained
from lit_packing.batch import MODEL_KEYS
from lit_packing.data.collate import PairCollator
from lit_packing.models.pack import pack_model
from lit_packing.models.preference import PreferenceSettings, pair_logps, preference_loss

ROWS = [
    {"prompt": f"What is {i} plus {i}?", "chosen": f"It is {2 * i}.", "rejected": f"It is {2 * i + 1}, or {3 * i}."}
    for i in range(8)
]
# Plain SGD: Adam's first steps turn float noise in near-zero gradients into whole-lr updates, which would hide
# an agreement of the gradients themselves.
STEPS, LR, BETA = 4, 0.5, 0.1


def trl_trainer(model, reference, tokenizer):
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=len(ROWS), max_steps=STEPS, learning_rate=LR,
        lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no", max_grad_norm=0.0,
        use_cpu=True, beta=BETA, disable_tqdm=True, weight_decay=0.0, optim="sgd",
    )  # fmt: skip
    return DPOTrainer(
        model=model, ref_model=reference, args=args, train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=tokenizer,
    )  # fmt: skip


def as_pair(row: dict) -> dict:
    prompt, chosen, rejected = row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]
    masked = [-100] * len(prompt)
    return {
        "input_ids": prompt + chosen + prompt + rejected,
        "labels": masked + chosen + masked + rejected,
        "chosen_tokens": len(prompt) + len(chosen),
    }


def test_packed_dpo_gives_trls_losses_step_by_step():
    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False))
    config = AutoConfig.for_model(
        "llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    start = AutoModelForCausalLM.from_config(config)
    trainer = trl_trainer(copy.deepcopy(start), copy.deepcopy(start), tokenizer)
    tokenized = [trainer.train_dataset[i] for i in range(len(ROWS))]
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, next(iter(trainer.get_train_dataloader())))  # its padded batch
    trl_loss.backward()
    trl_grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.model.zero_grad()
    trainer.train()
    trl_losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]

    policy, reference = copy.deepcopy(start), copy.deepcopy(start).eval()
    pack_model(policy)
    pack_model(reference)
    batch = PairCollator()([as_pair(row) for row in tokenized])
    inputs = {k: batch[k] for k in MODEL_KEYS if k in batch}
    with torch.no_grad():
        ref = pair_logps(reference(**inputs, use_cache=False).logits, batch)
    optimizer = torch.optim.SGD(policy.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        parts = preference_loss(
            pair_logps(policy(**inputs, use_cache=False).logits, batch), ref, PreferenceSettings("dpo", BETA)
        )
        loss = parts.loss_sum / len(ROWS)
        loss.backward()
        if step == 0:
            assert (
                abs(loss.item() - trl_loss.item()) < 1e-5
            )  # its no-grad reference pass rounds apart from its policy pass
            for name, param in policy.named_parameters():
                scale = trl_grads[name].abs().max().item()
                assert (param.grad - trl_grads[name]).abs().max().item() <= 1e-4 * scale + 1e-9, name
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert abs(losses[0] - 0.6931471805599453) < 1e-6
    assert losses[-1] < losses[0] - 0.05  # the steps move the loss
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(trl_losses, dtype=torch.float32), rtol=1e-3, atol=0)
