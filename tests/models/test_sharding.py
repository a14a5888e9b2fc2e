"""FSDP2 through Lightning's ModelParallelStrategy trains what DDP and one process train: the layer plan, the mixed
precision policy, the mesh's shard count and the memory estimate's arithmetic (no processes); then 2 CPU ranks over
gloo against 2-rank DDP and the 1-process run on the same packs (uneven tokens per rank, accumulation 2, gradient
clipping, one reduce-scatter per layer group and optimizer step), with LoRA and activation checkpointing, and the
paper's config through the CLI."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lit_packing.batch import StepShape
from lit_packing.errors import ConfigError
from lit_packing.models import PackedCausalLM
from lit_packing.models.loading import apply_lora
from lit_packing.models.memory import MemoryModel
from lit_packing.models.sharding import (
    gathered_parameter_bytes,
    mixed_precision_policy,
    shard_count,
    shard_plan,
)
from tests.helpers import TINY_LLAMA, tiny_model

ROOT = Path(__file__).parents[2]
FIT = ROOT / "tests" / "helpers" / "sharded_fit.py"
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")
# fp32 on 2 gloo ranks vs 1 process, 3 AdamW steps at lr 1e-2 with clipping, measured: losses within 3e-6, the
# pre-clipping gradient norms within 1.1e-5 (relative), weights within 2.1e-4 (the embedding rows whose gradient is
# near AdamW's eps, where a summation order's rounding moves the update most; 1e-5 elsewhere). A gradient summed
# where it should be averaged (or the reverse) doubles (halves) every gradient norm; a per-rank mean moves them by %.
LOSS_ATOL, NORM_RTOL, WEIGHT_ATOL = 2e-5, 1e-4, 1e-3


# ----------------------------------------------------------------------------------------------------------------
# Without processes


def test_each_decoder_layer_is_a_shard_group_and_the_rest_is_the_root():
    plan = shard_plan(tiny_model(TINY_LLAMA))
    assert plan.layers == ["model.layers.0", "model.layers.1"]
    assert plan.layer_class == "LlamaDecoderLayer"


def test_a_lora_model_is_sharded_by_its_transformers_models_layers():
    plan = shard_plan(apply_lora(tiny_model(TINY_LLAMA), LORA))
    assert plan.layers == ["model.layers.0", "model.layers.1"]  # named in the transformers model peft wraps


def test_a_model_without_a_layer_class_is_refused_in_one_line():
    with pytest.raises(ConfigError) as error:
        shard_plan(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    message = str(error.value)
    assert "trainer.strategy" in message and "_no_split_modules" in message and "\n" not in message


@pytest.mark.parametrize(
    "precision, param_dtype, reduce_dtype",
    [("bf16-mixed", torch.bfloat16, torch.float32), ("16-mixed", torch.float16, torch.float32),
     ("32-true", None, None), ("bf16-true", None, None)],
)  # fmt: skip
def test_mixed_precision_gathers_half_parameters_and_reduces_in_fp32(precision, param_dtype, reduce_dtype):
    policy = mixed_precision_policy(precision)
    assert (policy.param_dtype, policy.reduce_dtype) == (param_dtype, reduce_dtype)


@pytest.mark.parametrize("kind, warmup", [("cosine", 0), ("cosine", 3), ("linear", 2), ("constant", 0)])
def test_a_schedule_counted_at_the_first_step_is_the_schedule(kind, warmup):
    """Under a strategy that restores a checkpoint after `configure_optimizers`, the step count is read at the
    first step after 0 (reading it earlier would start the loader before a resume's position): same multipliers."""
    from lit_packing.models.causal_lm import _counted_at_first_step
    from lit_packing.models.optim import lr_schedule

    built = []
    eager = lr_schedule(kind, warmup, 20, 0.1)
    lazy = _counted_at_first_step(lambda: built.append(1) or eager, lr_schedule(kind, warmup, warmup + 1, 0.1)(0))
    assert lazy(0) == eager(0) and not built
    assert [lazy(step) for step in range(25)] == [eager(step) for step in range(25)] and built == [1]


@pytest.fixture
def fake_world():
    """A process group of 4 ranks held by this process alone (torch's fake backend): meshes without processes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def test_the_shard_count_is_the_data_parallel_dimension_of_lightnings_mesh(fake_world):
    names = ("data_parallel", "tensor_parallel")
    assert shard_count(init_device_mesh("cpu", (4, 1), mesh_dim_names=names)) == 4
    assert shard_count(init_device_mesh("cpu", (2, 2), mesh_dim_names=names)) == 2
    assert shard_count(None) == 1


def test_tensor_parallel_is_refused_naming_its_setting(fake_world):
    lm = PackedCausalLM(model_config=TINY_LLAMA, isolation_check=False)
    lm._device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    with pytest.raises(ConfigError) as error:
        lm.configure_model()
    message = str(error.value)
    assert "tensor_parallel_size" in message and "\n" not in message


def test_gathered_bytes_are_the_root_and_two_layers_in_the_gather_dtype():
    model = tiny_model(TINY_LLAMA)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    root = 49152 * 64 + 64  # tied embeddings / LM head, final norm
    assert gathered_parameter_bytes(model, mixed=False) == 4 * (root + 2 * layer)
    assert gathered_parameter_bytes(model, mixed=True) == 2 * (root + 2 * layer)


def memory(shards: int, gathered: int) -> MemoryModel:
    GiB = 2**30
    return MemoryModel(
        device="cpu", padded=False, resident=GiB, available=8 * GiB, limit=9 * GiB, optimizer=2 * GiB // shards,
        autocast_weights=0, gradients=GiB // shards, head_gradient=0, activation_fit=(0.0, 1000.0, 0.0), layers=2,
        layer_input_bytes=256, gradient_checkpointing=False, loss_impl="chunked", loss_chunk_size=1024,
        vocab_size=1000, shards=shards, gathered=gathered,
    )  # fmt: skip


def test_the_estimate_counts_a_ranks_share_plus_what_is_gathered_and_says_so():
    step = StepShape(slot_tokens=4096, attn_pairs=4096 * 64, rows=1, width=4096)
    whole, sharded = memory(1, 0).estimate(step), memory(2, 3 * 2**20).estimate(step)
    # On one rank, 2 GiB of AdamW state and, at the optimizer step, 1 GiB of gradients twice (foreach temporaries);
    # half of each on each of 2 ranks, plus 3 MiB gathered whole.
    assert whole.peak - sharded.peak == 2 * 2**30 - 3 * 2**20
    assert "divided over 2 shards" in sharded.summary() and "unsharded: 2.00 more" in sharded.summary()
    assert "shards" not in whole.summary()


# ----------------------------------------------------------------------------------------------------------------
# 2 CPU ranks over gloo


def env() -> dict[str, str]:
    clean = {key: value for key, value in os.environ.items() if key not in DISTRIBUTED_ENV}
    return {**clean, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> dict[str, dict]:
    """The same 3 optimizer steps, run at once: 1 process, 2-rank DDP, 2-rank FSDP2; LoRA with activation
    checkpointing on 1 process and FSDP2. Each run's {"losses", "grad_norms", "reduce_scatters", "weights"}."""
    tmp = tmp_path_factory.mktemp("sharded")
    settings = {
        "one": {"devices": 1},
        "ddp": {"devices": 2, "strategy": "ddp"},
        "fsdp2": {"devices": 2, "strategy": "fsdp2"},
        "one_lora": {"devices": 1, "lora": LORA},
        "fsdp2_lora": {"devices": 2, "strategy": "fsdp2", "lora": LORA, "gradient_checkpointing": True},
    }
    running = {}
    for name, run in settings.items():
        args = [sys.executable, str(FIT), json.dumps({**run, "out": str(tmp / f"{name}.pt")})]
        log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 (closed below)
        running[name] = (subprocess.Popen(args, cwd=tmp, env=env(), stdout=log, stderr=subprocess.STDOUT), log)
    for name, (process, log) in running.items():
        assert process.wait(timeout=600) == 0, (tmp / f"{name}.log").read_text()[-4000:]
        log.close()
    return {name: torch.load(tmp / f"{name}.pt", weights_only=True) for name in settings}


def max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[name] - b[name]).abs().max()) for name in a)


@pytest.mark.slow
@pytest.mark.parametrize("other", ["one", "ddp"])
def test_fsdp2_trains_the_steps_of_ddp_and_of_one_process(fits, other):
    fsdp2, expected = fits["fsdp2"], fits[other]
    assert fsdp2["losses"] == pytest.approx(expected["losses"], abs=LOSS_ATOL)
    # DDP's gradients are each rank's copy of the average: the norm over ranks counts every element twice.
    scale = 2**0.5 if other == "ddp" else 1.0
    assert [n * scale for n in fsdp2["grad_norms"]] == pytest.approx(expected["grad_norms"], rel=NORM_RTOL)
    assert max_weight_diff(fsdp2["weights"], expected["weights"]) < WEIGHT_ATOL


@pytest.mark.slow
def test_ddp_on_the_same_packs_trains_the_steps_of_one_process(fits):
    """The yardstick: DDP and one process agree (so FSDP2 agreeing with both means it trains what DDP does)."""
    assert fits["ddp"]["losses"] == pytest.approx(fits["one"]["losses"], abs=LOSS_ATOL)
    assert max_weight_diff(fits["ddp"]["weights"], fits["one"]["weights"]) < WEIGHT_ATOL


@pytest.mark.slow
def test_accumulating_2_micro_batches_reduce_scatters_once_per_group_and_step(fits):
    """2 decoder layers + the root: 3 reduce-scatters a step, not 6 (the first micro-batch of each step only
    accumulates); with LoRA the root holds no trainable weight: 2."""
    assert fits["fsdp2"]["reduce_scatters"] == [3, 3, 3]
    assert fits["fsdp2_lora"]["reduce_scatters"] == [2, 2, 2]


@pytest.mark.slow
def test_lora_with_activation_checkpointing_sharded_trains_the_adapters_of_one_process(fits):
    sharded, one = fits["fsdp2_lora"], fits["one_lora"]
    assert all("lora_" in name for name in sharded["weights"])  # the base weights stay frozen: not trained
    assert sharded["losses"] == pytest.approx(one["losses"], abs=LOSS_ATOL)
    assert sharded["grad_norms"] == pytest.approx(one["grad_norms"], rel=NORM_RTOL)
    assert max_weight_diff(sharded["weights"], one["weights"]) < WEIGHT_ATOL


def cli_fit(tmp: Path, name: str, *extra: str) -> list[str]:
    """The paper's config on 2 CPU ranks, shrunk to a tiny model, 96 chats and 4 steps, the loss logged each step."""
    from tests.conftest import TINY

    logger = {"class_path": "CSVLogger", "init_args": {"save_dir": str(tmp), "name": name, "version": 0}}
    return [
        sys.executable, str(ROOT / "main.py"), "fit", "--config", "paper", *extra,
        f"--model.model_config={json.dumps(TINY)}", "--model.lr=1e-3", "--model.warmup_steps=0",
        "--data.limit=96", "--data.val_split=16", "--data.max_length=512",
        "--data.sampler.init_args.max_tokens=2048", "--trainer.max_steps=4", "--trainer.limit_val_batches=0",
        "--trainer.log_every_n_steps=1", "--trainer.accelerator=cpu", "--trainer.devices=2",
        "--trainer.precision=32-true", "--trainer.enable_checkpointing=false",
        f"--trainer.default_root_dir={tmp}", f"--trainer.logger={json.dumps(logger)}",
    ]  # fmt: skip


def logged_losses(folder: Path) -> list[float]:
    with open(folder / "metrics.csv") as file:
        return [float(row["train/loss"]) for row in csv.DictReader(file) if row.get("train/loss")]


@pytest.mark.slow
def test_the_paper_config_with_the_fsdp2_delta_trains_the_ddp_runs_losses(tmp_path):
    """`--config paper --config fsdp2 --trainer.devices=2` against the same command with DDP: the same packs from
    the packing sampler, the memory estimate and the isolation self-test under sharding, the same losses."""
    runs = {
        "fsdp2": cli_fit(tmp_path, "fsdp2", "--config", "fsdp2"),
        "ddp": cli_fit(tmp_path, "ddp", "--trainer.strategy=ddp"),
    }
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started = {name: subprocess.Popen(args, cwd=tmp_path, env=env(), **pipes) for name, args in runs.items()}
    out = {name: process.communicate(timeout=600)[0] for name, process in started.items()}
    for name, process in started.items():
        assert process.returncode == 0, out[name][-4000:]
    assert "divided over 2 shards" in out["fsdp2"] and "isolation self-test passed" in out["fsdp2"]
    fsdp2, ddp = logged_losses(tmp_path / "fsdp2" / "version_0"), logged_losses(tmp_path / "ddp" / "version_0")
    assert len(fsdp2) == 4
    assert fsdp2 == pytest.approx(ddp, abs=LOSS_ATOL)


@pytest.mark.slow
def test_kill_9_of_a_sharded_run_then_resume_is_exact_and_exports_one_folder(tmp_path, tiny_llama_config):
    """2 FSDP2 ranks (2 loader workers each, accumulation 2) SIGKILLed after the distributed checkpoint of step 4
    (mid-epoch), resumed from that folder to step 6: every rank trains the batches the run left alone trained, and
    both end with the same weights, each written as one Hugging Face folder."""
    from safetensors.torch import load_file

    from tests.cli.test_resume import RECORDER, env, fit_args, records

    (tmp_path / "recorder.py").write_text(RECORDER)
    run = dict(cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=600)

    def args(name: str, *extra: str) -> list[str]:
        sharded = ("configs/quickstart.yaml", "configs/fsdp2.yaml")
        return [*fit_args(tmp_path, tiny_llama_config, name, sharded, delay=0.3 if name == "killed" else 0.0),
                "--trainer.devices=2", "--trainer.max_steps=6",
                f"--model.export_dir={tmp_path / name / 'export'}", *extra]  # fmt: skip

    alone = subprocess.run(args("alone"), **run)
    assert alone.returncode == 0, alone.stderr[-3000:]
    victim = subprocess.Popen(args("killed"), start_new_session=True, **{k: run[k] for k in ("cwd", "env")},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    checkpoint = tmp_path / "killed" / "step=4.ckpt"
    deadline = time.monotonic() + 400
    while not (checkpoint / "meta.pt").exists() and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # meta.pt: rank 0 writes it after every rank's shards
    time.sleep(1.0)  # let it train (and prefetch) past the checkpoint
    os.killpg(victim.pid, signal.SIGKILL)  # every rank and loader worker, without warning
    victim.wait()
    assert (checkpoint / "meta.pt").exists()
    resumed = subprocess.run(args("resumed", f"--ckpt_path={checkpoint}"), **run)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    for rank in (0, 1):
        uninterrupted = records(tmp_path / f"alone.jsonl.rank{rank}")
        before = [r for r in records(tmp_path / f"killed.jsonl.rank{rank}") if r["step"] < 4]
        assert {r["epoch"] for r in uninterrupted} == {0, 1}  # step 4 is mid-epoch 0 (5 steps), step 6 in epoch 1
        assert any(r["step"] >= 4 for r in records(tmp_path / f"killed.jsonl.rank{rank}"))  # lost, to be redone
        assert [r["rows"] for r in before + records(tmp_path / f"resumed.jsonl.rank{rank}")] == [
            r["rows"] for r in uninterrupted
        ]
    alone, resumed = (load_file(tmp_path / name / "export" / "model.safetensors") for name in ("alone", "resumed"))
    assert len(alone) == 20 and alone["model.embed_tokens.weight"].shape == (49152, 64)  # whole, tied head once
    for key, tensor in alone.items():
        torch.testing.assert_close(resumed[key], tensor, rtol=1e-6, atol=1e-7, msg=key)
