"""FSDP2 through Lightning's ModelParallelStrategy trains what DDP and one process train: the layer plan, the mixed
precision policy, the mesh's shard count and the memory estimate's arithmetic (no processes); then 2 CPU ranks over
gloo against 2-rank DDP and the 1-process run on the same packs (uneven tokens per rank, accumulation 2, gradient
clipping, one reduce-scatter per layer group and optimizer step), with LoRA and activation checkpointing, and the
paper's config through the CLI."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import AutoModelForCausalLM

from lit_packing.batch import StepShape
from lit_packing.errors import ConfigError
from lit_packing.models import PackedCausalLM
from lit_packing.models.loading import apply_lora
from lit_packing.models.memory import MemoryModel
from lit_packing.models.sharding import (
    gathered_parameter_bytes,
    is_sharded,
    local_tensor,
    mixed_precision_policy,
    shard_count,
    shard_model,
    shard_plan,
    tensor_parallel_plan,
)
from lit_packing.strategies import ShardedStrategy
from tests.conftest import TINY_CONFIGS
from tests.helpers import LORA, TINY_LLAMA, launch, tiny_model

ROOT = Path(__file__).parents[2]
FIT = ROOT / "tests" / "helpers" / "sharded_fit.py"
DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")
# fp32 on 2 gloo ranks vs 1 process, 3 AdamW steps at lr 1e-2 with clipping, measured: losses within 3e-6, the
# pre-clipping gradient norms within 1.1e-5 (relative), weights within 2.1e-4 (the embedding rows whose gradient is
# near AdamW's eps, where a summation order's rounding moves the update most; 1e-5 elsewhere). A gradient summed
# where it should be averaged (or the reverse) doubles (halves) every gradient norm; a per-rank mean moves them by %.
LOSS_ATOL, NORM_RTOL, WEIGHT_ATOL = 2e-5, 1e-4, 1e-3
MESH_DIMS = ("data_parallel", "tensor_parallel")  # Lightning's ModelParallelStrategy names them so


# ----------------------------------------------------------------------------------------------------------------
# Without processes


def test_each_decoder_layer_is_a_shard_group_and_the_rest_is_the_root():
    plan = shard_plan(tiny_model(TINY_LLAMA))
    assert plan.layers == ["model.layers.0", "model.layers.1"]
    assert plan.layer_class == "LlamaDecoderLayer"


def test_a_lora_model_is_sharded_by_its_transformers_models_layers():
    plan = shard_plan(apply_lora(tiny_model(TINY_LLAMA), LORA))
    assert plan.layers == ["model.layers.0", "model.layers.1"]  # named in the transformers model peft wraps


@pytest.mark.parametrize("family", ["idefics3", "qwen2_vl"])
def test_a_vision_language_models_layers_are_its_language_models_and_the_tower_stays_with_the_root(family):
    from tests.models.test_vlm_exact import build

    model, _ = build(family)
    plan = shard_plan(model)
    decoder = next(name for name, module in model.named_modules() if module is model.get_decoder())
    assert plan.layers == [f"{decoder}.layers.0", f"{decoder}.layers.1"]  # no vision block: each rank gathers alike


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
    from lit_packing.models.optim import counted_at_first_step, lr_schedule

    built = []
    eager = lr_schedule(kind, warmup, 20, 0.1)
    lazy = counted_at_first_step(lambda: built.append(1) or eager, lr_schedule(kind, warmup, warmup + 1, 0.1)(0))
    assert lazy(0) == eager(0) and not built
    assert [lazy(step) for step in range(25)] == [eager(step) for step in range(25)] and built == [1]


@pytest.fixture
def fake_world():
    """A process group of 4 ranks held by this process alone (torch's fake backend): meshes without processes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def test_the_shard_count_is_every_rank_of_lightnings_mesh(fake_world):
    """Data-parallel ranks times tensor-parallel ones: what the memory estimate says it divides by."""
    assert shard_count(init_device_mesh("cpu", (4, 1), mesh_dim_names=MESH_DIMS)) == 4
    assert shard_count(init_device_mesh("cpu", (2, 2), mesh_dim_names=MESH_DIMS)) == 4
    assert shard_count(None) == 1


@pytest.mark.parametrize("device, offload, expected", [("cuda", False, {"cuda": "nccl"}),
                                                      ("cuda", True, {"cuda": "nccl", "cpu": "gloo"}),
                                                      ("cpu", True, {"cpu": "gloo", "cuda": "gloo"})])  # fmt: skip
def test_shards_kept_on_the_host_get_gloo_beside_nccl(device, offload, expected):
    """With `cpu_offload` on GPUs, the gradient norm, the finite-shards check and the export's sends take host
    tensors, which an NCCL-only group refuses ("No backend type associated with device type cpu")."""
    from torch.distributed.distributed_c10d import BackendConfig

    strategy = ShardedStrategy(cpu_offload=offload)
    strategy.parallel_devices = [torch.device(device, 0) if device == "cuda" else torch.device("cpu")]
    backend = strategy._get_process_group_backend()
    assert BackendConfig(dist.Backend(backend)).get_device_backend_map() == expected
    assert ShardedStrategy(cpu_offload=True, process_group_backend="gloo")._get_process_group_backend() == "gloo"


def test_the_tensor_parallel_plan_is_the_models_own_in_torchs_styles():
    plan = tensor_parallel_plan(tiny_model(TINY_LLAMA), 2)
    columns = [f"layers.*.{name}" for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                               "mlp.gate_proj", "mlp.up_proj")]  # fmt: skip
    assert {name for name, style in plan.items() if type(style) is ColwiseParallel} == set(columns)
    assert {name for name, style in plan.items() if type(style) is RowwiseParallel} == {
        "layers.*.self_attn.o_proj",
        "layers.*.mlp.down_proj",
    }


QWEN3 = {**TINY_CONFIGS["qwen2"], "model_type": "qwen3", "head_dim": 16}
GPT2 = {"model_type": "gpt2", "vocab_size": 1000, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}


@pytest.mark.parametrize(
    "config, size, lora, problem",
    [(GPT2, 2, None, "gpt2: the model family has no tensor-parallel plan"),
     (TINY_CONFIGS["gpt_neox"], 2, None, "gpt_neox: its plan holds tensor-parallel styles 'embedding_rowwise'"),
     (QWEN3, 2, None, "qwen3: its plan holds tensor-parallel styles 'replicated_with_grad_allreduce'"),
     (TINY_LLAMA, 3, None, "llama: its 4 attention heads do not divide into 3"),
     (TINY_LLAMA, 4, None, "llama: its 2 key/value heads do not divide into 4"),
     (TINY_LLAMA, 2, LORA, "llama: a LoRA model's adapted layers are not split")],
)  # fmt: skip
def test_tensor_parallel_is_refused_in_one_line_naming_its_setting_and_the_family(config, size, lora, problem):
    model = tiny_model(config)
    model = apply_lora(model, lora) if lora else model
    with pytest.raises(ConfigError) as error:
        tensor_parallel_plan(model, size)
    message = str(error.value)
    assert message.startswith(f"trainer.strategy.init_args.tensor_parallel_size: {size} on {problem}")
    assert "\n" not in message


def test_2_by_2_splits_heads_and_mlp_columns_over_tensor_parallel_and_shards_all_over_data_parallel(fake_world):
    """Column-wise weights split by rows (their output features: heads, MLP columns), row-wise by columns, each on
    the 2-D mesh; the rest whole on each tensor-parallel rank, on the data-parallel sub-mesh."""
    model = tiny_model(TINY_LLAMA)
    shard_model(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=MESH_DIMS), "32-true")
    params = dict(model.named_parameters())
    attention = "model.layers.0.self_attn"
    assert local_tensor(params[f"{attention}.q_proj.weight"]).shape == (4 * 16 // 2 // 2, 64)  # 2 of 4 heads, halved
    assert local_tensor(params[f"{attention}.k_proj.weight"]).shape == (2 * 16 // 2 // 2, 64)  # 1 of 2 kv heads
    assert local_tensor(params[f"{attention}.o_proj.weight"]).shape == (64 // 2, 64 // 2)
    assert local_tensor(params["model.layers.0.mlp.down_proj.weight"]).shape == (64 // 2, 128 // 2)
    for name in (
        f"{attention}.q_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
    ):
        assert params[name].device_mesh.mesh_dim_names == MESH_DIMS
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert params[name].device_mesh.mesh_dim_names == ("data_parallel",)
        assert local_tensor(params[name]).shape[0] == params[name].shape[0] // 2
    # Gathered over the data-parallel ranks: the root whole, a layer's split weights half.
    layer = sum(p.numel() for p in tiny_model(TINY_LLAMA).model.layers[0].parameters())
    norms = 2 * 64
    assert gathered_parameter_bytes(model, mixed=False) == 4 * (49152 * 64 + 64 + 2 * ((layer - norms) // 2 + norms))


def test_configure_model_refuses_tensor_parallel_before_any_collective(fake_world):
    lm = PackedCausalLM(model_config=TINY_LLAMA, isolation_check=False)
    lm._device_mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=MESH_DIMS)
    with pytest.raises(ConfigError) as error:
        lm.configure_model()
    message = str(error.value)
    assert "tensor_parallel_size: 4 on llama" in message and "key/value heads" in message and "\n" not in message
    assert not is_sharded(lm.model)


def test_data_is_dealt_by_data_parallel_rank_so_tensor_parallel_peers_train_the_same_batches():
    """Global rank 3 of a 2 x 2 mesh is data-parallel rank 1 of 2 (Lightning's `distributed_sampler_kwargs`);
    without a parallel strategy, rank 0 of 1."""
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lit_packing._compat import data_parallel

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
        strategy._device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=MESH_DIMS)
        trainer = SimpleNamespace(distributed_sampler_kwargs=strategy.distributed_sampler_kwargs, global_rank=3,
                                  world_size=4)  # fmt: skip
        assert data_parallel(trainer) == (1, 2)
    finally:
        dist.destroy_process_group()
    assert data_parallel(SimpleNamespace(distributed_sampler_kwargs=None, global_rank=0, world_size=1)) == (0, 1)


def test_throughput_counts_a_batch_once_however_many_tensor_parallel_peers_train_it():
    """4 ranks, 2 x 2: the sum over all 4 of the 2 peers' equal counts is the 2 data-parallel ranks' sum."""
    from lit_packing.callbacks.throughput import _sum_over_ranks

    strategy = SimpleNamespace(reduce=lambda tensor, reduce_op: tensor * 4)  # 4 ranks holding the same counts
    trainer = SimpleNamespace(world_size=4, global_rank=3, strategy=strategy,
                              distributed_sampler_kwargs={"num_replicas": 2, "rank": 1})  # fmt: skip
    summed = _sum_over_ranks(trainer, SimpleNamespace(device="cpu"), Counter(real_tokens=100), ["real_tokens"])
    assert summed == {"real_tokens": 200.0}


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
    """The same 3 optimizer steps, run at once: 1 process, 2-rank DDP, 2-rank FSDP2, 2 x 2 (data x tensor
    parallel) on 4 ranks; LoRA with activation checkpointing on 1 process and FSDP2; context parallel on 2 ranks
    (each pack split over both), and 2 x 2 data x context parallel with activation checkpointing; FSDP2 with its
    shards kept in host memory (`cpu_offload`) and activation checkpointing. FSDP2 builds on
    the meta device and fills each rank's shards (the random init and the adapters' as one process makes them);
    2 x 2 builds the model whole on every rank and shards it. Each run's {"losses", "grad_norms", "reduce_scatters",
    "all_gathers", "weights"}."""
    tmp = tmp_path_factory.mktemp("sharded")
    settings = {
        "one": {"devices": 1},
        "ddp": {"devices": 2, "strategy": "ddp"},
        "fsdp2": {"devices": 2, "strategy": "fsdp2"},
        "fsdp2_unsharded": {"devices": 2, "strategy": "fsdp2", "accumulation": "unsharded"},
        "tp": {"devices": 4, "strategy": "fsdp2", "tensor_parallel": 2, "whole": True},
        "one_lora": {"devices": 1, "lora": LORA},
        "fsdp2_lora": {"devices": 2, "strategy": "fsdp2", "lora": LORA, "gradient_checkpointing": True},
        "cp": {"devices": 2, "strategy": "fsdp2", "context_parallel": 2},
        "dp_cp": {"devices": 4, "strategy": "fsdp2", "context_parallel": 2, "gradient_checkpointing": True},
        "fsdp2_offload_ckpt": {"devices": 2, "strategy": "fsdp2", "cpu_offload": True, "gradient_checkpointing": True},
    }
    running = {}
    for name, run in settings.items():
        args = [sys.executable, str(FIT), json.dumps({**run, "out": str(tmp / f"{name}.pt")})]
        running[name] = launch.start(args, cwd=tmp, env=env(), stdout=tmp / f"{name}.log", merge_stderr=True)
    for name, process in running.items():
        assert process.wait(timeout=600) == 0, (tmp / f"{name}.log").read_text()[-4000:]
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
@pytest.mark.parametrize("other", ["ddp", "fsdp2"])
def test_2_by_2_data_and_tensor_parallel_trains_the_steps_of_ddp_and_of_fsdp2(fits, other):
    """Each pair of tensor-parallel peers trains one data-parallel rank's micro-batches, its heads and MLP columns
    split: the losses, the whole gradient's norm (clipping at every step) and the final weights of 2-rank DDP and
    2-rank FSDP2, within the fp32 tolerances above (measured against DDP: losses 2.4e-6, norms 1.1e-5 relative,
    weights 2.1e-4, in the embedding rows as FSDP2's; against FSDP2: 4e-7, 3e-7, 2.6e-5). A replicated weight's
    gradient summed over the tensor-parallel peers would be doubled, a loss normalised over all 4 ranks halved."""
    tp, expected = fits["tp"], fits[other]
    assert tp["losses"] == pytest.approx(expected["losses"], abs=LOSS_ATOL)
    scale = 2**0.5 if other == "ddp" else 1.0
    assert [n * scale for n in tp["grad_norms"]] == pytest.approx(expected["grad_norms"], rel=NORM_RTOL)
    assert max_weight_diff(tp["weights"], expected["weights"]) < WEIGHT_ATOL
    assert tp["reduce_scatters"] == [6, 6, 6]  # over the data-parallel ranks: 2 layers + the root, each micro-batch


@pytest.mark.slow
@pytest.mark.parametrize("run, other", [("cp", "one"), ("dp_cp", "ddp"), ("dp_cp", "fsdp2")])
def test_context_parallel_trains_the_steps_of_one_process_and_2_by_2_those_of_ddp(fits, run, other):
    """2 context-parallel ranks split every pack (1 data-parallel rank accumulating 4): one process's losses,
    clipped gradient norms and weights; 2 x 2 data x context parallel (activation checkpointing on): 2-rank DDP's.
    Every attention layer's key/value gradients are reduce-scattered over the context group once per micro-batch
    (2 layers x the rank's micro-batches), and so are FSDP2's (2 layers + the root, `gradient_accumulation:
    sharded`)."""
    cp, expected = fits[run], fits[other]
    assert cp["losses"] == pytest.approx(expected["losses"], abs=LOSS_ATOL)
    scale = 2**0.5 if other == "ddp" else 1.0
    assert [n * scale for n in cp["grad_norms"]] == pytest.approx(expected["grad_norms"], rel=NORM_RTOL)
    assert max_weight_diff(cp["weights"], expected["weights"]) < WEIGHT_ATOL
    micro_batches = 4 if run == "cp" else 2
    assert cp["reduce_scatters"] == [(3 + 2) * micro_batches] * 3


@pytest.mark.slow
def test_ddp_on_the_same_packs_trains_the_steps_of_one_process(fits):
    """The yardstick: DDP and one process agree (so FSDP2 agreeing with both means it trains what DDP does)."""
    assert fits["ddp"]["losses"] == pytest.approx(fits["one"]["losses"], abs=LOSS_ATOL)
    assert max_weight_diff(fits["ddp"]["weights"], fits["one"]["weights"]) < WEIGHT_ATOL


@pytest.mark.slow
def test_accumulating_2_micro_batches_reduce_scatters_each_or_once_per_group_and_step(fits):
    """2 decoder layers + the root, 2 micro-batches a step: `gradient_accumulation: sharded` (the default)
    reduce-scatters each micro-batch's gradients into the shards, 6 a step (with LoRA the root holds no trainable
    weight: 4); `unsharded` only the step's last micro-batch's, 3 a step, the first one's whole gradients held
    until then."""
    assert fits["fsdp2"]["reduce_scatters"] == [6, 6, 6]
    assert fits["fsdp2_lora"]["reduce_scatters"] == [4, 4, 4]
    assert fits["fsdp2_unsharded"]["reduce_scatters"] == [3, 3, 3]


@pytest.mark.slow
@pytest.mark.parametrize("other", ["one", "fsdp2"])
def test_unsharded_accumulation_trains_the_steps_of_one_process_and_of_sharded_accumulation(fits, other):
    unsharded, expected = fits["fsdp2_unsharded"], fits[other]
    assert unsharded["losses"] == pytest.approx(expected["losses"], abs=LOSS_ATOL)
    assert unsharded["grad_norms"] == pytest.approx(expected["grad_norms"], rel=NORM_RTOL)
    assert max_weight_diff(unsharded["weights"], expected["weights"]) < WEIGHT_ATOL


@pytest.mark.slow
def test_activation_checkpointing_and_cpu_offload_train_fsdp2s_steps_with_no_extra_collective(fits):
    """transformers' activation checkpointing wraps each whole decoder layer; under FSDP2 its recompute runs inside
    the backward, after the layer's pre-backward all-gather, so it gathers nothing more: 10 all-gathers a step
    (2 micro-batches x (the root and 2 layers forward, 2 layers backward)), as without it. The shards kept in host
    memory (`cpu_offload`, all host memory on CPU ranks) train the same bits."""
    checkpointed, plain = fits["fsdp2_offload_ckpt"], fits["fsdp2"]
    assert plain["all_gathers"][1:] == [10, 10] and checkpointed["all_gathers"] == plain["all_gathers"]
    assert checkpointed["reduce_scatters"] == plain["reduce_scatters"] == [6, 6, 6]
    assert checkpointed["losses"] == plain["losses"] and checkpointed["grad_norms"] == plain["grad_norms"]
    assert max_weight_diff(checkpointed["weights"], plain["weights"]) == 0.0


@pytest.mark.slow
def test_lora_with_activation_checkpointing_sharded_trains_the_adapters_of_one_process(fits):
    sharded, one = fits["fsdp2_lora"], fits["one_lora"]
    assert all("lora_" in name for name in sharded["weights"])  # the base weights stay frozen: not trained
    assert sharded["losses"] == pytest.approx(one["losses"], abs=LOSS_ATOL)
    assert sharded["grad_norms"] == pytest.approx(one["grad_norms"], rel=NORM_RTOL)
    assert max_weight_diff(sharded["weights"], one["weights"]) < WEIGHT_ATOL


def cli_fit(tmp: Path, name: str, *extra: str, devices: int = 2, base: str = "paper", after: tuple = ()) -> list[str]:
    """The `base` config (the paper's) on `devices` CPU ranks, shrunk to a tiny model, 96 chats and 4 steps, the
    loss logged each step; `after`: settings that override those."""
    from tests.conftest import TINY

    logger = {"class_path": "CSVLogger", "init_args": {"save_dir": str(tmp), "name": name, "version": 0}}
    return [
        sys.executable, str(ROOT / "main.py"), "fit", "--config", base, *extra,
        f"--model.model_config={json.dumps(TINY)}", "--model.lr=1e-3", "--model.warmup_steps=0",
        "--data.limit=96", "--data.val_split=16", "--data.max_length=512",
        "--data.sampler.init_args.max_tokens=2048", "--trainer.max_steps=4", "--trainer.limit_val_batches=0",
        "--trainer.log_every_n_steps=1", "--trainer.accelerator=cpu", f"--trainer.devices={devices}",
        "--trainer.precision=32-true", "--trainer.enable_checkpointing=false",
        f"--trainer.default_root_dir={tmp}", f"--trainer.logger={json.dumps(logger)}", *after,
    ]  # fmt: skip


def run_all(tmp: Path, runs: dict[str, list[str]]) -> dict[str, str]:
    """Start every command at once; each one's output once all have ended (each must succeed)."""
    started = {name: launch.start(args, cwd=tmp, env=env(), merge_stderr=True) for name, args in runs.items()}
    out = {}
    for name, process in started.items():
        process.wait(timeout=600)
        out[name] = process.output()[0]
        assert process.returncode == 0, out[name][-4000:]
    return out


def logged_losses(folder: Path) -> list[float]:
    with open(folder / "metrics.csv") as file:
        return [float(row["train/loss"]) for row in csv.DictReader(file) if row.get("train/loss")]


@pytest.mark.slow
def test_the_paper_config_with_the_fsdp2_delta_trains_the_ddp_runs_losses(tmp_path):
    """`--config paper --config fsdp2 --trainer.devices=2`, and 2 x 2 (data x tensor parallel) on 4 ranks, against
    the same command with DDP: the same packs from the packing sampler (dealt by data-parallel rank: tensor-parallel
    peers train the same ones), the memory estimate and the isolation self-test under sharding, the same losses
    (2 x 2 measured within 8e-7 of DDP)."""
    tp = ("--trainer.strategy.init_args.data_parallel_size=2", "--trainer.strategy.init_args.tensor_parallel_size=2")
    runs = {
        "fsdp2": cli_fit(tmp_path, "fsdp2", "--config", "fsdp2"),
        "tp": cli_fit(tmp_path, "tp", "--config", "fsdp2", *tp, devices=4),
        "ddp": cli_fit(tmp_path, "ddp", "--trainer.strategy=ddp"),
    }
    out = run_all(tmp_path, runs)
    assert "divided over 2 shards" in out["fsdp2"] and "isolation self-test passed" in out["fsdp2"]
    assert "split over 2 tensor-parallel ranks" in out["tp"] and "divided over 4 shards" in out["tp"]
    assert "isolation self-test passed" in out["tp"]
    fsdp2, ddp = logged_losses(tmp_path / "fsdp2" / "version_0"), logged_losses(tmp_path / "ddp" / "version_0")
    assert len(fsdp2) == 4
    assert fsdp2 == pytest.approx(ddp, abs=LOSS_ATOL)
    assert logged_losses(tmp_path / "tp" / "version_0") == pytest.approx(ddp, abs=LOSS_ATOL)


@pytest.mark.slow
def test_the_paper_config_with_the_context_parallel_delta_trains_one_processs_losses_and_weights(tmp_path):
    """`--config paper --config context_parallel --trainer.devices=2` on packs of 4,096 tokens: every pack split
    over the 2 ranks, against the same packs in one process: the same losses, the exported weights within fp32's
    rounding, the isolation self-test run on the dealt pack."""
    packs = ("--data.sampler.init_args.max_tokens=4096",)
    runs = {
        "cp": cli_fit(tmp_path, "cp", "--config", "context_parallel",
                      after=(*packs, f"--model.export_dir={tmp_path / 'cp.hf'}")),
        "one": cli_fit(tmp_path, "one", "--config", "context_parallel", "--trainer.strategy=auto", devices=1,
                       after=(*packs, f"--model.export_dir={tmp_path / 'one.hf'}")),
    }  # fmt: skip
    out = run_all(tmp_path, runs)
    assert "context parallel: each pack's tokens split over 2 ranks" in out["cp"]
    assert "isolation self-test passed" in out["cp"]
    cp, one = logged_losses(tmp_path / "cp" / "version_0"), logged_losses(tmp_path / "one" / "version_0")
    assert len(cp) == 4 and cp == pytest.approx(one, abs=LOSS_ATOL)
    exported = [AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}.hf").state_dict() for name in ("cp", "one")]
    assert max_weight_diff(*exported) < WEIGHT_ATOL


@pytest.mark.slow
def test_dpo_sharded_trains_the_ddp_runs_losses_with_either_reference(tmp_path):
    """`--config dpo --config fsdp2` on 2 ranks (CHAMP pairs, 3 steps) against DDP: with the precomputed reference
    (each rank's share of the pass through the sharded model, gathered) and with a frozen copy, the same losses.
    Each run its own data cache: the reference log-probs are cached beside the tokenized data."""
    pairs = ("--data.limit=48", "--data.val_split=8", "--data.max_length=1024",
             "--data.sampler.init_args.max_tokens=2048", "--trainer.max_steps=3", "--model.lr=1e-4")  # fmt: skip
    runs = {
        name: cli_fit(
            tmp_path,
            name,
            *extra,
            base="dpo",
            after=(*pairs, f"--model.reference={reference}", f"--data.cache_dir={tmp_path / name}-cache"),
        )
        for name, extra, reference in [
            ("fsdp2", ("--config", "fsdp2"), "precomputed"),
            ("fsdp2_copy", ("--config", "fsdp2"), "copy"),
            ("ddp", ("--trainer.strategy=ddp",), "precomputed"),
        ]
    }
    out = run_all(tmp_path, runs)
    assert "divided over 2 shards" in out["fsdp2"] and "computing" in out["fsdp2"], out["fsdp2"][-3000:]
    ddp = logged_losses(tmp_path / "ddp" / "version_0")
    assert len(ddp) == 3 and abs(ddp[0] - 0.6931472) < 1e-5  # policy = reference at step 0: ln 2
    for name in ("fsdp2", "fsdp2_copy"):
        assert logged_losses(tmp_path / name / "version_0") == pytest.approx(ddp, abs=LOSS_ATOL), name


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.parametrize("parallel", ["data", "context"])
def test_kill_9_of_a_sharded_run_then_resume_is_exact_and_exports_one_folder(tmp_path, tiny_llama_config, parallel):
    """2 FSDP2 ranks (2 loader workers each, accumulation 2) SIGKILLed after the distributed checkpoint of step 4
    (mid-epoch), resumed from that folder to step 6: every rank trains the batches the run left alone trained, and
    both end with the same weights, each written as one Hugging Face folder; `lit-packing export` converts the
    last distributed checkpoint into the same weights. `context`: the 2 ranks are one context-parallel group
    (every pack split over both, so twice the steps an epoch: step 6 is still in the first)."""
    from safetensors.torch import load_file

    from tests.cli.test_resume import RECORDER, env, fit_args, records
    from tests.helpers.launch import run_fit

    (tmp_path / "recorder.py").write_text(RECORDER)
    run = dict(cwd=tmp_path, env=env(tmp_path), timeout=300)  # each launch takes < 60 s

    def args(name: str, *extra: str) -> list[str]:
        sharded = ("configs/quickstart.yaml", "configs/fsdp2.yaml")
        context = ("--trainer.strategy.class_path=lit_packing.strategies.ShardedStrategy",
                   "--trainer.strategy.init_args.data_parallel_size=1",
                   "--trainer.strategy.init_args.context_parallel_size=2") if parallel == "context" else ()  # fmt: skip
        return [*fit_args(tmp_path, tiny_llama_config, name, sharded, delay=0.3 if name == "killed" else 0.0),
                "--trainer.devices=2", "--trainer.max_steps=6", *context,
                f"--model.export_dir={tmp_path / name / 'export'}", *extra]  # fmt: skip

    alone = run_fit(args("alone"), **run)
    assert alone.returncode == 0, alone.stderr[-3000:]
    victim = launch.start(
        args("killed"),
        cwd=tmp_path,
        env=run["env"],
        new_session=True,
        stdout=tmp_path / "killed.log",
        merge_stderr=True,
    )  # the output, read if it ends by itself
    checkpoint = tmp_path / "killed" / "step=4.ckpt"
    deadline = time.monotonic() + 400
    past = lambda: all(any(r["step"] >= 4 for r in records(tmp_path / f"killed.jsonl.rank{rank}"))  # noqa: E731
                       for rank in (0, 1))  # fmt: skip
    while not ((checkpoint / "meta.pt").exists() and past()) and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # meta.pt: rank 0 writes it after every rank's shards; then each rank trains past it
    ended = victim.poll()  # >= 3 micro-batches of 0.3 s left: still running
    with contextlib.suppress(ProcessLookupError):
        os.killpg(victim.pid, signal.SIGKILL)  # every rank and loader worker, without warning
    victim.wait()
    assert ended is None, f"the run ended by itself (status {ended}):\n" + (tmp_path / "killed.log").read_text()[-6000:]
    assert (checkpoint / "meta.pt").exists()
    resumed = run_fit(args("resumed", f"--ckpt_path={checkpoint}"), **run)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    for rank in (0, 1):
        uninterrupted = records(tmp_path / f"alone.jsonl.rank{rank}")
        before = [r for r in records(tmp_path / f"killed.jsonl.rank{rank}") if r["step"] < 4]
        # Step 4 is mid-epoch 0 (5 steps), step 6 in epoch 1; split over context ranks, an epoch is 10 steps.
        assert {r["epoch"] for r in uninterrupted} == ({0, 1} if parallel == "data" else {0})
        assert any(r["step"] >= 4 for r in records(tmp_path / f"killed.jsonl.rank{rank}"))  # lost, to be redone
        assert [r["rows"] for r in before + records(tmp_path / f"resumed.jsonl.rank{rank}")] == [
            r["rows"] for r in uninterrupted
        ]
    alone, resumed = (load_file(tmp_path / name / "export" / "model.safetensors") for name in ("alone", "resumed"))
    assert len(alone) == 20 and alone["model.embed_tokens.weight"].shape == (49152, 64)  # whole, tied head once
    for key, tensor in alone.items():
        torch.testing.assert_close(resumed[key], tensor, rtol=1e-6, atol=1e-7, msg=key)
    # The last checkpoint, converted by the command in one process, file by file: the run's own export.
    out = tmp_path / "converted"
    command = [sys.executable, "-m", "lit_packing", "export", "--ckpt_path", str(tmp_path / "alone" / "step=6.ckpt"),
               "--output", str(out), "--file_bytes", "3000000"]  # fmt: skip
    converted = run_fit(command, **run)
    assert converted.returncode == 0, converted.stdout[-3000:] + converted.stderr[-3000:]
    files = sorted(out.glob("*.safetensors"))
    assert len(files) == 2 and (out / "model.safetensors.index.json").exists() and (out / "config.json").exists()
    tensors = {key: tensor for file in files for key, tensor in load_file(file).items()}
    assert tensors.keys() == alone.keys() and all(torch.equal(tensors[key], alone[key]) for key in alone)


@pytest.mark.slow
def test_a_step_that_fails_on_one_rank_stops_both_in_seconds_with_its_line(tmp_path):
    """2 gloo ranks, one failing at each step the ranks take together (`tests/helpers/agree_ranks.py`): the isolation
    self-test of an FSDP2 model (rank 1: its search for the leaking module runs FSDP2 forwards), the sharded export
    (rank 0 cannot make the folder while rank 1 sends it rows), the weights of a Hub id (rank 1's cache lacks the
    safetensors, rank 0 enters `dcp.load`). Each rank raises within seconds: the failing one its own error, the
    other `RankError` with that line, rather than hanging in a collective the failing rank never reaches."""
    out = tmp_path / "agree.json"
    script = Path(__file__).parents[1] / "helpers" / "agree_ranks.py"
    done = launch.run(
        [sys.executable, str(script), json.dumps({"out": str(out)})], cwd=tmp_path, env=env(), timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cases = json.loads(out.read_text())
    failing = {"selftest": 1, "export": 0, "loading": 1}
    own = {"selftest": "IsolationError: isolation self-test failed", "export": "ConfigError: model.export_dir: could "
           "not write", "loading": "AssetError: model.name_or_path: lit-packing-tests/tiny-llama"}  # fmt: skip
    for case, rank in failing.items():
        raised, seconds = cases[case]["raised"], cases[case]["seconds"]
        mine = raised[rank]
        assert mine.startswith(own[case]) and "\n" not in mine, (case, raised)
        message = mine.split(": ", 1)[1]
        assert raised[1 - rank] == f"RankError: rank {rank}: {message}", (case, raised)
        assert seconds < 30, (case, seconds)  # the process group's timeout is 60 s
