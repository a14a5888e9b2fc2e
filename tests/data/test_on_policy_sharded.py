"""On-policy rounds sampled by a sharded policy (`rollouts.sample_groups` under FSDP2 or tensor parallel): every
forward is a collective, so each rank runs as many `generate` calls and forwards as the others whatever its prompts,
and draws what the whole policy draws from the same seed.

In one process (a 1-rank process group): the sharded policy's draws and old-log-probs pass are the whole policy's,
with the stand-in calls and empty packs that keep ranks in step; tensor-parallel peers' groups are gathered once;
context parallel, Lightning's FSDP1 and vLLM on a sharded policy are refused in one line. On 2 gloo ranks (five fits
at once): a GRPO fit under FSDP2 writes DDP's rounds and trains DDP's losses, in bf16 a rank with no prompt and an
empty pack keeps step, and 2 tensor-parallel ranks write one process's rounds and train its losses."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import sys
import time
from pathlib import Path

import datasets
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import AutoTokenizer

from lit_packing.assets import resolve_pretrained
from lit_packing.data.groups import GroupCollator
from lit_packing.data.round_scoring import trainer_logps
from lit_packing.data.tokenize import TokenizedDataset, tokenize_dataset
from lit_packing.errors import ConfigError
from lit_packing.models import rollouts
from lit_packing.models.sharding import shard_model
from tests.cli.test_configs import saved_tiny
from tests.data.test_on_policy import COMMON
from tests.helpers import TINY_LLAMA, launch, packed_model

ROOT = Path(__file__).parents[2]
PROMPTS = ["What is 2 + 3?", "What is 4 + 4?", [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Hi"}]]  # fmt: skip


@pytest.fixture
def one_rank():
    """A gloo process group of this process alone (FSDP2 shards over 1 rank, every collective answered at once): its
    device mesh."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
    dist.destroy_process_group()


def sharded_and_whole(mesh):
    """The tiny packed Llama twice from one seed: FSDP2-sharded over `mesh`, and whole."""
    sharded, whole = packed_model(TINY_LLAMA, seed=0), packed_model(TINY_LLAMA, seed=0)
    shard_model(sharded, mesh, "32-true")
    return sharded.eval(), whole.eval()


def test_a_sharded_policy_keeps_step_with_stand_in_calls_and_draws_what_the_whole_policy_draws(one_rank, monkeypatch):
    """Another rank needing 2 more `generate` calls (the agreed count patched to 2 more than this rank's): this rank
    makes them on the stand-in prompt after its own, and drops them; its own are the whole policy's draws, token for
    token and log-prob for log-prob, and the root's gathered parameters are freed after (DTensors again). A rank
    with no prompts makes the agreed calls too, and returns no group."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False))
    sharded, whole = sharded_and_whole(one_rank)
    agreed = rollouts.agreed_calls
    monkeypatch.setattr(rollouts, "agreed_calls", lambda calls, device: agreed(calls, device) + 2)
    calls, generate = [], sharded.generate

    def counted(**kwargs):
        calls.append((kwargs["input_ids"].shape[0], kwargs["synced_gpus"]))
        return generate(**kwargs)

    sharded.generate = counted
    settings = dict(group_size=3, max_new_tokens=6, temperature=0.7, seed=4, batch_prompts=2)
    got = rollouts.sample_groups(sharded, tokenizer, PROMPTS, **settings)
    assert calls == [(2, True), (1, True), (1, True), (1, True)]  # 2 own batches (2 + 1 prompts), 2 stand-ins
    assert got == rollouts.sample_groups(whole, tokenizer, PROMPTS, **settings)
    assert isinstance(sharded.get_output_embeddings().weight, DTensor)  # resharded
    calls.clear()
    assert rollouts.sample_groups(sharded, tokenizer, [], **settings) == [] and calls == [(1, True), (1, True)]


def group_items(tokenizer, model) -> list[dict]:
    """Two sampled groups, tokenized as a round's rows are."""
    groups = rollouts.sample_groups(model, tokenizer, PROMPTS[:2], group_size=2, max_new_tokens=5, seed=1)
    rows = [{"prompt": [{"role": "user", "content": g["prompt"]}], "completions": g["completions"],
             "rewards": [0.0, 1.0], "behaviour_logps": g["behaviour_logps"]} for g in groups]  # fmt: skip
    tokenized, _ = tokenize_dataset(datasets.Dataset.from_list(rows), tokenizer, max_length=512, overlong="drop")
    items = TokenizedDataset(tokenized)
    return [items[0], items[1]]


def test_the_old_log_probs_pass_runs_a_forward_for_every_pack_an_empty_one_included(one_rank):
    """A sharded model's forwards are collectives: the pass over a plan with an empty pack (a rank's share of the
    step's last packs) runs 3 forwards, not 2, and scores each group as the whole model does; the root's gathered
    parameters are freed after."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False))
    sharded, whole = sharded_and_whole(one_rank)
    first, second = group_items(tokenizer, whole)
    packs = [[first], [], [second]]
    forwards = []
    sharded.register_forward_pre_hook(lambda module, args: forwards.append(1))
    args = (GroupCollator(), 1.0, contextlib.nullcontext, lambda batch: batch)
    got = trainer_logps(sharded, packs, *args)
    assert len(forwards) == 3
    expected = trainer_logps(whole, packs, *args)
    assert got.keys() == expected.keys() == {0, 1}
    for key in got:
        assert got[key] == pytest.approx(expected[key], abs=2e-6)
    assert isinstance(sharded.get_output_embeddings().weight, DTensor)


def test_the_gathered_round_holds_each_data_parallel_ranks_groups_once_under_tensor_parallel(monkeypatch):
    """2 data-parallel x 2 tensor-parallel ranks: both peers of a data-parallel rank sample its prompts and send the
    same groups (Lightning's mesh: ranks 0 and 1 are data-parallel rank 0's, 2 and 3 rank 1's); the round holds each
    group once."""
    from lit_packing.data.round_scoring import gather_groups

    parts = [["a0", "a1"], ["a0", "a1"], ["b0"], ["b0"]]  # what each of the 4 ranks sends
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, sent, group=None: out.__setitem__(slice(None), parts))
    assert gather_groups(["a0", "a1"], world=2) == ["a0", "a1", "b0"]
    assert gather_groups(["a0", "a1"], world=4) == ["a0", "a1", "a0", "a1", "b0", "b0"]  # 4 data-parallel ranks


def test_context_parallel_fsdp1_and_vllm_on_a_sharded_policy_are_refused_in_one_line(one_rank):
    """Context parallel splits a sequence's tokens over its ranks (sampling and the old-log-probs pass run whole
    sequences), Lightning's FSDP1 wraps the policy otherwise, and vLLM is not handed a sharded policy's weights:
    each is refused in one line naming the setting; FSDP2 and tensor parallel pass."""
    from lightning.pytorch.strategies import FSDPStrategy

    from lit_packing.data.on_policy import refuse_strategy
    from lit_packing.models.engines import VLLMEngine
    from lit_packing.strategies import ShardedStrategy

    refuse_strategy(ShardedStrategy(data_parallel_size=2))  # FSDP2 (and tensor parallel): sampled
    with pytest.raises(ConfigError) as error:
        refuse_strategy(ShardedStrategy(context_parallel_size=2))
    assert str(error.value).startswith("trainer.strategy.init_args.context_parallel_size: on-policy rounds are "
                                       "sampled and scored by whole sequences on each rank")  # fmt: skip
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=r"^trainer\.strategy: on-policy rollouts are not sampled under FSDPStrategy"):
        refuse_strategy(FSDPStrategy())
    sharded, _ = sharded_and_whole(one_rank)
    with pytest.raises(ConfigError) as error:
        VLLMEngine(sharded, AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False)))
    assert str(error.value) == ("trainer.strategy: VLLMEngine is not handed a sharded policy's weights yet (each layer "
                                "gathered from its shards in turn); use GenerateEngine, or train with ddp")  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# 2 CPU ranks over gloo


class EndAtEveryFifthToken(Callback):
    """Every fifth token id ends a completion (and the tokenizer's end), set on the policy's generation config at the
    fit's start: a random model's completions then end at varied lengths, not all at max_new_tokens."""

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module.hf_model.generation_config.eos_token_id = list(range(0, pl_module.hf_model.vocab_size, 5))


def run_together(commands: dict[str, list[str]], cwd: Path, timeout: float) -> dict[str, str]:
    """Start every command at once, each in a session of its own; each one's output once all have ended (each must
    succeed). Past `timeout` (a collective that one rank skipped hangs the others) every process still running
    prints its stacks (SIGABRT: Python's fault handler) and is killed."""
    from tests.cli.test_resume import env

    started = {name: launch.start(args, cwd=cwd, env={**env(cwd), "PYTHONFAULTHANDLER": "1"}, merge_stderr=True,
                                  new_session=True) for name, args in commands.items()}  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(process.poll() is None for process in started.values()):
        time.sleep(0.2)
    hung = [process for process in started.values() if process.poll() is None]
    for signum in (signal.SIGABRT, signal.SIGKILL) if hung else ():
        for process in hung:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signum)
        time.sleep(5)
    out = {name: process.output()[0] for name, process in started.items()}
    for name, process in started.items():
        assert not hung and process.returncode == 0, f"{name}: {process.returncode}\n{out[name][-6000:]}"
    return out


def round_files(folder: Path) -> list[list[dict]]:
    """Each round's groups, as the run's round files hold them."""
    return [[json.loads(line) for line in path.read_text().splitlines()] for path in sorted(folder.rglob("round_*"))]


def logged(folder: Path) -> list[dict]:
    with open(next(folder.rglob("metrics.csv"))) as file:
        return [row for row in csv.DictReader(file) if row.get("train/loss")]


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> Path:
    """The 2-step GRPO fits on the tiny random model, run at once, each in its folder under the one returned: 2 ranks
    with 3 prompts a round (rank 0 two, rank 1 one) and one prompt a `generate` call, under DDP (`ddp`) and FSDP2
    (`fsdp2`); FSDP2 in bf16 with one prompt a round trained twice (`bf16`); 2 tensor-parallel ranks (`tp`) and one
    process (`one`) with 3 prompts a round."""
    tmp = tmp_path_factory.mktemp("on_policy_sharded")
    torch.manual_seed(0)  # the random model's weights: the lengths its completions end at
    model = saved_tiny(tmp)
    source = ["--data.source=lit_packing.data.OnPolicyRollouts", "--data.source.init_args.group_size=4",
              "--data.source.init_args.max_new_tokens=12", "--data.source.init_args.generation_batch=1",
              "--data.source.init_args.reward_funcs=[tests.data.test_on_policy.length_reward]",
              f"--trainer.callbacks+={__name__}.EndAtEveryFifthToken"]  # fmt: skip
    sharded = "--trainer.strategy=lit_packing.strategies.ShardedStrategy"
    three = "--data.source.init_args.prompts_per_round=3"
    runs = {
        "ddp": ["--trainer.devices=2", "--trainer.strategy=ddp", three],
        "fsdp2": ["--trainer.devices=2", sharded, three],
        "bf16": ["--trainer.devices=2", sharded, "--data.source.init_args.prompts_per_round=1",
                 "--data.source.init_args.iterations=2", "--trainer.precision=bf16-mixed"],
        "tp": ["--trainer.devices=2", sharded, "--trainer.strategy.init_args.data_parallel_size=1",
               "--trainer.strategy.init_args.tensor_parallel_size=2", three],
        "one": [three],
    }  # fmt: skip
    fit = [sys.executable, str(ROOT / "main.py"), "fit", f"--model.name_or_path={model}", *COMMON, *source,
           "--trainer.max_steps=2", f"--trainer.default_root_dir={tmp}"]  # fmt: skip
    out = run_together({name: [*fit, *extra, f"--run_name={name}"] for name, extra in runs.items()}, tmp, 400)
    assert "divided over 2 shards" in out["fsdp2"] and "split over 2 tensor-parallel ranks" in out["tp"]
    return tmp


def assert_same_rounds(ours: list[list[dict]], theirs: list[list[dict]], logps_atol: float) -> None:
    """The same prompts and sampled completions in every round, their behaviour log-probs within `logps_atol`."""
    assert len(ours) == len(theirs) == 2
    for round_ours, round_theirs in zip(ours, theirs):
        assert [g["prompt_row"] for g in round_ours] == [g["prompt_row"] for g in round_theirs]
        assert [g["completions"] for g in round_ours] == [g["completions"] for g in round_theirs]
        for group, expected in zip(round_ours, round_theirs):
            flat = [x for c in group["behaviour_logps"] for x in c]
            assert flat == pytest.approx([x for c in expected["behaviour_logps"] for x in c], abs=logps_atol)


@pytest.mark.slow  # the module's fits: five at once (~70 s on 2 cores)
@pytest.mark.serial
def test_fsdp2_samples_and_trains_the_rounds_of_ddp(fits):
    """Rank 1 makes a stand-in call to keep step with rank 0's second, and in each round's first call the ranks'
    completions end at different lengths, so the rank finished first keeps running forwards (`synced_gpus`) until
    the other's end. FSDP2 (every forward all-gathers each layer) writes DDP's round files (the same completions,
    the same behaviour log-probs: measured equal) and trains DDP's losses (measured equal), and the sharded trainer
    scores the sampled tokens as the sampler did."""
    sharded = round_files(fits / "fsdp2")
    assert_same_rounds(sharded, round_files(fits / "ddp"), logps_atol=2e-6)
    # Each round's prompts 0 and 2 sampled on rank 0 (2 calls), prompt 1 on rank 1 (then a stand-in call): in the
    # first call the ranks' longest completions differ, so one rank ran forwards past its own end to keep step
    longest = [[max(map(len, group["completions"])) for group in groups] for groups in sharded]
    assert all(first != second for first, second, _ in longest), longest
    ours, theirs = logged(fits / "fsdp2"), logged(fits / "ddp")
    assert [float(r["train/loss"]) for r in ours] == pytest.approx([float(r["train/loss"]) for r in theirs], abs=2e-5)
    assert all(float(r["train/sampler_logp_diff_max"]) < 1e-5 for r in ours)


@pytest.mark.slow
@pytest.mark.serial
def test_a_rank_without_prompts_keeps_step_and_runs_the_old_log_probs_pass_on_its_empty_pack(fits):
    """FSDP2 in bf16, one prompt a round trained twice: rank 1 has no prompt (it makes stand-in calls only) and an
    empty pack (one masked token), and still runs the old-log-probs pass's forward on it. FSDP2 gathers bf16
    parameters for `generate` as for the training forward, so the sampler's log-probs are the trainer's (DDP's
    `generate` runs the fp32 weights: 1e-4 to 0.1 away in bf16, `tests/data/test_on_policy.py`), and the old
    log-probs pass's are too."""
    [[group]] = round_files(fits / "bf16")
    assert list(map(len, group["old_logps"])) == list(map(len, group["completions"]))
    old = torch.tensor([x for c in group["old_logps"] for x in c], dtype=torch.float64)
    sampler = torch.tensor([x for c in group["behaviour_logps"] for x in c], dtype=torch.float64)
    first = logged(fits / "bf16")[0]
    assert float((old - sampler).abs().max()) < 1e-5 and float(first["train/sampler_logp_diff_max"]) < 1e-5


@pytest.mark.slow
@pytest.mark.serial
def test_tensor_parallel_samples_and_trains_the_rounds_of_one_process(fits):
    """2 tensor-parallel ranks (1 data-parallel rank: both sample its 3 prompts from one seed, each its heads, the
    row-wise layers' sums all-reduced) write one process's round files (behaviour log-probs within 1e-5: the heads'
    sums are added in another order) and train its losses."""
    assert_same_rounds(round_files(fits / "tp"), round_files(fits / "one"), logps_atol=1e-5)
    ours, theirs = logged(fits / "tp"), logged(fits / "one")
    assert [float(r["train/loss"]) for r in ours] == pytest.approx([float(r["train/loss"]) for r in theirs], abs=2e-5)
