"""Rollout groups as data: a prompt and its completions (text or token ids), a reward (or advantage) per completion and
the sampler's log-probs, tokenized with the prompt once, bad rows named by line, every sampler dealing whole groups
exactly once with the step's completion count; and a GRPO fit on them through Lightning."""

from __future__ import annotations

import json
import math
import re
from collections import Counter

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, Trainer
from transformers import AutoTokenizer

from lit_packing.assets import resolve_pretrained
from lit_packing.batch import (
    BEHAVIOUR_LOGPS,
    COMPLETION_TOKENS,
    COMPLETIONS,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    REWARDS,
    ROWS,
    STEP,
    TOKEN_ADVANTAGES,
)
from lit_packing.data import GroupCollator, HFDataset, PackedCollator, PackingDataModule
from lit_packing.data.tokenize import TokenizedDataset, tokenize_dataset
from lit_packing.errors import ConfigError, DataError
from lit_packing.samplers import BestFitPackingSampler, MultipackSampler
from tests.helpers import TINY_LLAMA


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False))


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def group(i: int, g: int = 4, ids=None) -> dict:
    """A question and G answers of different lengths, scored 1 when right."""
    answers = [f"{2 * i}", f"It is {2 * i + 1}.", f"{i} plus {i} makes {2 * i}, so the answer is {2 * i}.", "No idea"]
    return {"prompt": f"What is {i} plus {i}?", "completions": ids or answers[:g],
            "rewards": [1.0, 0.0, 1.0, 0.0][:g]}  # fmt: skip


def test_a_group_tokenizes_to_its_prompt_once_then_each_completion(tmp_path, tokenizer):
    """Text completions become the assistant turn after the prompt (end-of-turn token included); token-id ones are
    taken as they are, with the sampler's log-probs; every completion token is trained, no prompt token."""
    ids_group = {**group(1, 2, ids=[[17, 18, 19], [20]]), BEHAVIOUR_LOGPS: [[-0.5, -1.0, -0.25], [-2.0]]}
    source = HFDataset(write_jsonl(tmp_path / "groups.jsonl", [group(3), ids_group]), split="train")
    tokenized, report = tokenize_dataset(source.load(str(tmp_path / "c")), tokenizer, max_length=512, overlong="drop")
    data = TokenizedDataset(tokenized)
    text, given = data[0], data[1]
    sizes = text[COMPLETION_TOKENS]
    prompt = len(text[INPUT_IDS]) - sum(sizes)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 plus 3?"}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    assert tokenizer.decode(text[INPUT_IDS][:prompt]) == rendered
    ends = np.cumsum([prompt, *sizes])
    completions = [tokenizer.decode(text[INPUT_IDS][a:b]) for a, b in zip(ends[:-1], ends[1:])]
    assert completions == [f"{answer}<|im_end|>" for answer in group(3)["completions"]]
    assert (np.asarray(text[LABELS])[:prompt] == IGNORE_INDEX).all()
    assert np.array_equal(text[LABELS][prompt:], text[INPUT_IDS][prompt:])
    assert text[REWARDS] == [1.0, 0.0, 1.0, 0.0] and BEHAVIOUR_LOGPS not in text
    assert given[COMPLETION_TOKENS] == [3, 1] and list(given[INPUT_IDS][-4:]) == [17, 18, 19, 20]
    assert given[BEHAVIOUR_LOGPS] == [-0.5, -1.0, -0.25, -2.0]
    assert data.lengths.tolist() == [len(text[INPUT_IDS]), len(given[INPUT_IDS])]  # the prompt counted once
    assert report.examples_out == 2


def test_bad_groups_are_named_by_line(tmp_path, tokenizer):
    good = group(1)
    rows = [
        good,
        {**good, "rewards": [1.0, float("nan"), 0.0, 1.0]},
        {**good, "completions": []},
        {**good, "rewards": [1.0]},
        {**good, "completions": [[5, 6], [7]], "rewards": [1, 0], BEHAVIOUR_LOGPS: [[-1.0], [-1.0]]},
        {key: value for key, value in good.items() if key != "rewards"},
        good,
    ]
    source = HFDataset(write_jsonl(tmp_path / "groups.jsonl", rows), split="train")
    data = source.load(str(tmp_path / "c"))
    with pytest.raises(DataError) as raised:
        tokenize_dataset(data, tokenizer, max_length=512, overlong="drop", row_name=source.row_name)
    message = str(raised.value)
    assert "\n" not in message and "line 2" in message and "rewards[1] is a number (NaN)" in message, message
    kept, report = tokenize_dataset(data, tokenizer, max_length=512, overlong="drop", on_bad_row="skip",
                                    row_name=source.row_name)  # fmt: skip
    assert len(kept) == 2 and report.bad_examples == 5
    problems = {
        "completions is an empty list": 3, "rewards is a list": 4, "behaviour_logps[0] has 1 values for its": 5,
        "no rewards (or advantages)": 6,
    }  # fmt: skip
    for problem in problems:
        with pytest.raises(DataError, match=re.escape(problem)):
            tokenize_dataset(data.select([problems[problem] - 1]), tokenizer, max_length=512, overlong="drop")
    with pytest.raises(ConfigError, match="truncate would cut rollout groups apart"):
        tokenize_dataset(data.select([0]), tokenizer, max_length=512, overlong="truncate")


def test_advantages_per_token_reach_the_batch_in_label_order_and_bad_lengths_are_named(tmp_path, tokenizer):
    """A group may give an advantage per completion token (`token_advantages`, one list per completion) instead of
    rewards: tokenized flat beside the completions, collated in the order of the row's label tokens (after the
    behaviour log-probs' pattern); a list of another length than its completion's tokens is a bad row, named."""
    token_ids = [[17, 18, 19], [20]]
    advantages = [[0.5, -1.0, 2.0], [-0.25]]
    rows = [
        {"prompt": "What is 1 plus 1?", "completions": token_ids, "token_advantages": advantages,
         BEHAVIOUR_LOGPS: [[-0.5, -1.0, -0.25], [-2.0]]},
        {"prompt": "What is 2 plus 2?", "completions": [[21], [22, 23]], "token_advantages": [[1.0], [3.0, 4.0]]},
        {"prompt": "What is 3 plus 3?", "completions": [[24], [25]], "token_advantages": [[1.0], [3.0, 4.0]]},
        {"prompt": "What is 4 plus 4?", "completions": [[24], [25]], "token_advantages": [[1.0]]},
    ]  # fmt: skip
    source = HFDataset(write_jsonl(tmp_path / "groups.jsonl", rows), split="train")
    data = source.load(str(tmp_path / "c"))
    kept, report = tokenize_dataset(data, tokenizer, max_length=512, overlong="drop", on_bad_row="skip",
                                    row_name=source.row_name)  # fmt: skip
    assert len(kept) == 2 and report.bad_examples == 2
    items = TokenizedDataset(kept)
    assert items[0][TOKEN_ADVANTAGES] == [0.5, -1.0, 2.0, -0.25] and REWARDS not in items[0]
    batch = GroupCollator()([items[0], items[1]])
    labels = batch[LABELS][0][batch[LABELS][0] != IGNORE_INDEX].tolist()
    assert labels == [17, 18, 19, 20, 21, 22, 23]
    assert batch[TOKEN_ADVANTAGES].tolist() == [0.5, -1.0, 2.0, -0.25, 1.0, 3.0, 4.0]
    for line, problem in ((3, "token_advantages[1] has 2 values for its completion's 1 tokens"),
                          (4, "token_advantages is a list ([[1.0]]), not one list per completion (2)")):  # fmt: skip
        with pytest.raises(DataError, match=re.escape(problem)) as raised:
            tokenize_dataset(data.select([line - 1]), tokenizer, max_length=512, overlong="drop")
        assert "\n" not in str(raised.value) and f"row {line} " in str(raised.value)
    with pytest.raises(DataError, match="a group of 4 completion tokens has 3 token_advantages"):
        GroupCollator()([{**items[0], TOKEN_ADVANTAGES: [0.0] * 3}])


def test_collators_of_other_items_refuse_groups(tmp_path, tokenizer):
    source = HFDataset(write_jsonl(tmp_path / "groups.jsonl", [group(1), group(2)]), split="train")
    tokenized, _ = tokenize_dataset(source.load(str(tmp_path / "c")), tokenizer, max_length=512, overlong="drop")
    groups = TokenizedDataset(tokenized)
    with pytest.raises(DataError, match="PackedCollator got rollout groups.*GroupCollator"):
        PackedCollator()([groups[0], groups[1]])
    with pytest.raises(DataError, match="GroupCollator got an item that is no rollout group"):
        GroupCollator()([groups[(0, 0, 10)]])  # a slice of a group (FixedLengthPackingSampler)


def group_data(tmp_path, n=24, **kwargs):
    """A data module of `n` groups, the file written once per folder (a rewritten file is new data to its cache)."""
    path = tmp_path / "groups.jsonl"
    if not path.exists():
        write_jsonl(path, [group(i, g=2 + i % 3) for i in range(n)])
    source = HFDataset(str(path), split="train")
    options = {
        "val_split": 4, "max_length": 512, "overlong": "drop", "collator": GroupCollator,
        "cache_dir": str(tmp_path / "cache"),
        "sampler": lambda lengths, **kw: BestFitPackingSampler(lengths, max_tokens=256, **kw), **kwargs,
    }  # fmt: skip
    return PackingDataModule(source=source, **options)


@pytest.mark.parametrize("sampler", [BestFitPackingSampler, MultipackSampler])
def test_every_sampler_deals_whole_groups_once_with_the_steps_completions(tmp_path, sampler):
    data = group_data(tmp_path, sampler=lambda lengths, **kwargs: sampler(lengths, max_tokens=256, **kwargs))
    data.prepare_data()
    data.setup("fit")
    batches = list(data.train_dataloader())
    rows = Counter(row for batch in batches for row in batch[ROWS])
    assert len(rows) == len(data.train_dataset) and set(rows.values()) == {1}  # every group once
    for batch in batches:
        completions = len(batch[COMPLETIONS])
        assert (
            batch[STEP]["sequences"] == completions and batch[STEP]["label_tokens"] == batch["counts"]["label_tokens"]
        )
        assert batch[INPUT_IDS].shape[1] <= 256


def test_a_grpo_fit_on_stored_groups_logs_its_metrics(tmp_path):
    """PackedCausalLM with the GRPO objective and a frozen reference (beta > 0) through a Lightning Trainer: the
    first step is on-policy (ratio 1: nothing clipped, KL 0), the metrics TRL logs are logged, the loss is finite."""
    from lit_packing.models import GRPO, PackedCausalLM

    data = group_data(tmp_path)
    config = dict(TINY_LLAMA, vocab_size=49152)
    lm = PackedCausalLM(model_config=config, objective=GRPO(loss_type="grpo", beta=0.05), reference="copy", lr=1e-3,
                        memory_check=False)  # fmt: skip
    logged = []

    class Metrics(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            logged.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})

    trainer = Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[Metrics()], num_sanity_val_steps=0,
                      limit_val_batches=0)  # fmt: skip
    trainer.fit(lm, datamodule=data)
    first = logged[0]
    for name in ("loss", "reward", "advantage", "kl", "entropy", "completion_length", "clip_ratio/region_mean"):
        assert f"train/{name}" in first and math.isfinite(first[f"train/{name}"]), name
    assert first["train/kl"] == 0 and first["train/clip_ratio/region_mean"] == 0
    assert 0 < first["train/reward"] < 1 and first["train/entropy"] > 0
    assert logged[-1]["train/kl"] > 0  # the policy moved from the reference


def test_a_grpo_fit_with_lora_takes_the_reference_with_the_adapter_off(tmp_path):
    """`model.reference: lora`: the KL is to the base model (the adapter disabled), 0 before the adapter trains."""
    from lit_packing.models import GRPO, PackedCausalLM

    lm = PackedCausalLM(model_config=dict(TINY_LLAMA), objective=GRPO(beta=0.1), reference="lora",
                        lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}, lr=1e-2,
                        memory_check=False)  # fmt: skip
    kls = []

    class Metrics(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            kls.append(float(trainer.callback_metrics["train/kl"]))

    trainer = Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[Metrics()], limit_val_batches=0)  # fmt: skip
    trainer.fit(lm, datamodule=group_data(tmp_path))
    assert kls[0] == 0 and kls[-1] > 0 and not lm.frozen_copies


@pytest.mark.slow  # four fits (~20 s)
def test_a_precomputed_reference_trains_the_frozen_copys_losses_and_is_read_from_its_cache(tmp_path):
    """`model.reference: precomputed` on stored groups (the default): one no-grad pass of the initial model gives
    every completion token's reference log-prob, and 3 steps train the losses and KL the frozen copy gives (fp32
    rounding: the pass packs the groups as validation does); the table is cached beside the tokenized data, and a
    second fit reads it instead of computing it (the same losses again). At temperature 0.7 the table is another."""
    from lit_packing.models import GRPO, PackedCausalLM

    config = dict(TINY_LLAMA, vocab_size=49152)

    def fit(reference: str, temperature: float = 1.0) -> list[dict]:
        torch.manual_seed(0)
        lm = PackedCausalLM(model_config=config, objective=GRPO(loss_type="grpo", beta=0.5, temperature=temperature),
                            reference=reference, lr=1e-2, memory_check=False)  # fmt: skip
        logged = []

        class Metrics(Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                logged.append({k: float(trainer.callback_metrics[f"train/{k}"]) for k in ("loss", "kl")})

        trainer = Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, callbacks=[Metrics()], limit_val_batches=0)  # fmt: skip
        trainer.fit(lm, datamodule=group_data(tmp_path))
        assert (lm.precomputed is not None) == (reference == "precomputed")
        return logged

    copy, precomputed = fit("copy"), fit("precomputed")
    tables = sorted((tmp_path / "cache").rglob("reference-*.pt"))
    assert len(tables) == 2  # the training groups' and the held-out ones'
    written = [table.stat().st_mtime_ns for table in tables]
    again = fit("precomputed")
    assert sorted((tmp_path / "cache").rglob("reference-*.pt")) == tables
    assert [table.stat().st_mtime_ns for table in tables] == written  # read, not computed again
    assert precomputed[-1]["kl"] > 0  # the policy moved from the reference
    for ours, theirs in zip(precomputed + again, copy + copy):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-7)
        assert ours["kl"] == pytest.approx(theirs["kl"], rel=1e-4, abs=1e-7)
    fit("precomputed", temperature=0.7)
    assert len(sorted((tmp_path / "cache").rglob("reference-*.pt"))) == 4


def test_grpo_refuses_batches_of_other_kinds():
    from lit_packing.models import GRPO, PackedCausalLM

    config = dict(TINY_LLAMA, vocab_size=1000)
    lm = PackedCausalLM(model_config=config, objective=GRPO(), memory_check=False)
    with pytest.raises(ConfigError, match=r"^data.collator: GRPO trains rollout groups, the batch holds single"):
        lm.objective.loss(lm.handle, PackedCollator()([{INPUT_IDS: [1, 2, 3]}]))
    sft = PackedCausalLM(model_config=config, memory_check=False)
    batch = GroupCollator()([{INPUT_IDS: [1, 2, 3], COMPLETION_TOKENS: [1], REWARDS: [1.0]}])
    with pytest.raises(ConfigError, match=r"^model.objective: SFT got a batch of rollout groups"):
        sft.objective.loss(sft, batch)


def test_an_empty_pack_of_groups_trains_nothing_and_still_runs_backward():
    """A rank's share of a step's last packs may be empty (3 groups in 1 pack over 2 ranks): its batch holds no
    completion and no reward; the GRPO loss is 0 with a graph (DDP's gradient all-reduce needs the backward) and
    every metric is there with a count of 0, so the ranks' step totals line up."""

    from lit_packing.batch import Pack, step_totals
    from lit_packing.models import GRPO, PackedCausalLM

    lm = PackedCausalLM(model_config=dict(TINY_LLAMA, vocab_size=49152), objective=GRPO(), memory_check=False)
    batch = GroupCollator()(Pack([], step=step_totals([5, 3])))
    assert batch[REWARDS].shape == (0,) and batch[COMPLETIONS].shape == (0,)
    parts, metrics = lm.objective.loss(lm.handle, batch)
    assert parts.objective.item() == 0 and parts.objective.requires_grad
    parts.objective.backward()
    assert all(p.grad is None or not p.grad.any() for p in lm.parameters())
    assert {"reward", "advantage", "entropy", "completion_length", "sampler_logp_diff"} <= set(metrics)
    assert all(count.item() == 0 for _, count in metrics.values())
