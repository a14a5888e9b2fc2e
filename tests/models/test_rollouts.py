"""Sampled rollout groups (`rollouts.py`): the completions a model samples, tokenized back as a group (the prompt
rendered as tokenization renders it), get from the packed model the very log-probs the sampler recorded, so an
on-policy step's importance ratios are 1; a reward scores each completion."""

from __future__ import annotations

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from lit_packing.assets import resolve_pretrained
from lit_packing.data.groups import GroupCollator
from lit_packing.data.tokenize import TokenizedDataset, tokenize_dataset
from lit_packing.models.grpo import completion_logps
from lit_packing.models.head import head_inputs
from lit_packing.models.rollouts import final_number, math_answer, sample_groups, score_groups
from tests.helpers import TINY_LLAMA, packed_model


def test_sampled_groups_replay_with_the_samplers_log_probs(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False))
    model = packed_model(TINY_LLAMA, seed=0).double().eval()
    prompts = ["What is 2 + 3?", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]]
    groups = sample_groups(model, tokenizer, prompts, group_size=3, max_new_tokens=6, seed=0)
    assert [len(g["completions"]) for g in groups] == [3, 3]
    for group in groups:
        for ids, logps in zip(group["completions"], group["behaviour_logps"]):
            assert 1 <= len(ids) <= 6 and len(logps) == len(ids)
            assert ids[-1] == tokenizer.eos_token_id or len(ids) == 6  # ends at eos (kept) or at the limit
    score_groups(groups, final_number, answer=[5, 0])
    rows = [{k: g[k] for k in ("prompt", "completions", "rewards", "behaviour_logps")} for g in groups]
    rows[1]["prompt"] = prompts[1]
    data = datasets.Dataset.from_list([{**r, "prompt": r["prompt"] if isinstance(r["prompt"], list) else
                                        [{"role": "user", "content": r["prompt"]}]} for r in rows])  # fmt: skip
    tokenized, _ = tokenize_dataset(data, tokenizer, max_length=512, overlong="drop")
    items = TokenizedDataset(tokenized)
    batch = GroupCollator()([items[0], items[1]])
    with torch.no_grad():
        replayed = completion_logps(head_inputs(model, batch, 64), batch).logps
    torch.testing.assert_close(replayed, batch["behaviour_logps"], rtol=0, atol=1e-5)  # stored to 6 decimals


def test_the_final_number_reward():
    texts = ["2 + 3 = 5.", "It is 4, no, 5", "five", "5.0", "-5", "1,005"]
    assert final_number([""] * 6, texts, answer=[5, 5, 5, 5, -5, 1005]) == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]


def test_the_math_answer_reward_verifies_final_answers_with_math_verify():
    texts = ["4 + 7 = 11.", "The answer is \\boxed{11}", "It is 12", "eleven", "$\\frac{22}{2}$", "x = 1/2"]
    assert math_answer([""] * 6, texts, answer=[11, 11, 11, 11, 11, "0.5"]) == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]


def test_a_reward_function_whose_package_is_missing_is_named_with_its_extra(monkeypatch):
    import importlib.util

    from lit_packing.data.on_policy import import_reward
    from lit_packing.errors import ConfigError

    find_spec = importlib.util.find_spec
    missing = lambda name: None if name == "math_verify" else find_spec(name)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", missing)
    hint = r'pip install -e "\.\[rl\]" at the root of your lit_packing clone, or pip install "<wheel>\[rl\]"'
    with pytest.raises(ConfigError, match=r"reward_funcs: .*math_answer needs the math_verify package; " + hint):
        import_reward("lit_packing.models.rollouts.math_answer")
