"""Sharded from the first byte: the meta-device build, filled slice by slice, and the export without gathering.

Without processes: the skeleton's buffers and tying, the one-line refusals, the random init's independence of the
path, the file plan and the streamed safetensors writer. Slow: a 239M-parameter Llama saved as a Hub checkpoint is
(bf16 safetensors in 200 MB files), loaded under FSDP2 on 1, 2 and 4 CPU ranks over gloo at once (each rank's
anonymous memory sampled), beside the same load built whole on every rank first; a small untied model on 2 x 2
(data x tensor parallel) and with LoRA; random inits on 1 and 2 ranks against one process.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from lit_packing.errors import AssetError, ConfigError
from lit_packing.models import PackedCausalLM
from lit_packing.models.export import SafetensorsStream, file_plan
from lit_packing.models.materialize import (
    Weights,
    check_names,
    deferred_weights,
    deferring,
    is_meta,
    materialize,
    probe_values,
)
from lit_packing.models.random_init import initialize
from tests.helpers import LORA, TINY_LLAMA, launch
from tests.models.families import tiny_config

ROOT = Path(__file__).parents[2]
LOAD = ROOT / "tests" / "helpers" / "sharded_load.py"
# The issue's model: 239M parameters (0.96 GB in fp32), tied embeddings, as SmolLM2's vocabulary.
BIG = dict(
    model_type="llama", vocab_size=49152, hidden_size=1024, intermediate_size=4096, num_hidden_layers=12,
    num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True, max_position_embeddings=2048,
)  # fmt: skip
SMALL = dict(
    model_type="llama", vocab_size=5003, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=2048,
)  # fmt: skip
SEED = 7  # tests/helpers/sharded_load.py's


# ----------------------------------------------------------------------------------------------------------------
# Without processes


def test_a_deferred_model_has_meta_parameters_real_buffers_and_one_tied_storage():
    with deferred_weights():
        assert deferring()
        lm = PackedCausalLM(model_config=TINY_LLAMA, memory_check=False)
    assert not deferring()
    hf = lm.hf_model
    assert is_meta(lm.model) and all(p.is_meta for p in lm.model.parameters())
    assert hf.lm_head.weight is hf.model.embed_tokens.weight  # the meta patch's copy tied again
    fresh = type(hf.model.rotary_emb)(hf.config)
    assert torch.equal(hf.model.rotary_emb.inv_freq, fresh.inv_freq) and not hf.model.rotary_emb.inv_freq.is_meta
    assert not any(t.is_meta for t in lm.eval_totals.state_dict().values())
    # Packed as a skeleton, as the model built with values is: the probe's findings, the backend, keyed layers.
    whole = PackedCausalLM(model_config=TINY_LLAMA, memory_check=False)
    assert lm.packing.keywords == whole.packing.keywords and lm.packing.keyed and lm.packing.backend == "per_example"
    assert lm.hf_model.config._attn_implementation == whole.hf_model.config._attn_implementation


def test_a_deferred_pretrained_model_keeps_the_generation_config_its_folder_ships(tmp_path):
    """The ids a completion ends at are the folder's `generation_config.json` (Qwen2.5-Instruct ships two), which
    `from_pretrained` reads and a skeleton built from the config alone did not: on-policy sampling under FSDP2 ran
    past the second one, and the export wrote the default config."""
    from tests.cli.test_configs import saved_tiny

    folder = saved_tiny(tmp_path)
    shipped = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**shipped, "eos_token_id": [2, 5]}))
    with deferred_weights():
        lm = PackedCausalLM(name_or_path=str(folder), memory_check=False)
    expected = AutoModelForCausalLM.from_pretrained(folder).generation_config.eos_token_id
    assert lm.hf_model.generation_config.eos_token_id == [2, 5] == expected


def test_the_skeletons_probe_holds_the_root_and_one_layer_of_each_kind_never_the_model():
    """Inside `probe_values` the skeleton's parameters are host tensors: what lies outside the decoder layers
    whole, the layers of one kind sharing one layer's values (the model's own init); outside, meta again."""
    with deferred_weights():
        lm = PackedCausalLM(model_config={**TINY_LLAMA, "num_hidden_layers": 4}, memory_check=False)
    hf = lm.hf_model
    layers = [f"model.layers.{i}" for i in range(4)]
    in_layers = {id(p) for layer in hf.model.layers for p in layer.parameters()}
    root_bytes = sum(p.numel() * p.element_size() for p in hf.parameters() if id(p) not in in_layers)
    layer_bytes = sum(p.numel() * p.element_size() for p in hf.model.layers[0].parameters())
    with probe_values(lm.model, layers):
        assert not is_meta(lm.model)
        storages = {p.untyped_storage().data_ptr(): p.numel() * p.element_size() for p in hf.parameters()}
        assert sum(storages.values()) == root_bytes + layer_bytes  # 4 layers held as one
        for layer in hf.model.layers[1:]:
            for (name, mine), first in zip(layer.named_parameters(), hf.model.layers[0].parameters()):
                assert mine is first, name
        assert torch.equal(hf.model.norm.weight, torch.ones_like(hf.model.norm.weight))  # the model's init
        assert 0.01 < float(hf.model.embed_tokens.weight.detach().std()) < 0.03
        assert hf.lm_head.weight is hf.model.embed_tokens.weight
        logits = hf(input_ids=torch.arange(5)[None], use_cache=False).logits
        assert torch.isfinite(logits).all()
    assert all(p.is_meta for p in lm.model.parameters()) and hf.lm_head.weight is hf.model.embed_tokens.weight


def test_a_skeleton_whose_attention_leaks_is_refused_at_construction_as_a_model_with_values_is():
    with deferred_weights(), pytest.raises(ConfigError) as raised:
        PackedCausalLM(model_config=tiny_config("doge"), vocab_size=1000)
    message = str(raised.value)
    assert message.startswith("model.name_or_path: packed examples are not kept apart"), message
    assert "model.layers.0.self_attn (DogeAttention)" in message, message


def test_lightnings_empty_init_context_defers_too():
    with torch.device("meta"):
        assert deferring()
        lm = PackedCausalLM(model_config=TINY_LLAMA, memory_check=False)
    assert is_meta(lm.model) and not any(t.is_meta for t in lm.eval_totals.state_dict().values())


def test_the_random_init_is_the_same_whether_built_with_values_or_on_the_meta_device():
    """The unsharded build (from_config, then `initialize`) and the meta one (`initialize` on scratch copies)
    give the same weights bit for bit: what makes FSDP2 on any number of ranks start from one process's model."""
    whole = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA))
    initialize(whole, SEED)
    with deferred_weights():
        meta = PackedCausalLM(model_config=TINY_LLAMA, memory_check=False).model
    materialize(meta, "cpu", Weights("tiny", None, SEED))  # allocated whole here: no mesh
    assert meta.lm_head.weight is meta.model.embed_tokens.weight
    expected = whole.state_dict()
    for name, tensor in meta.state_dict().items():
        if "rotary" not in name:
            assert torch.equal(tensor, expected[name]), name
    torch.manual_seed(SEED)
    built = PackedCausalLM(model_config=TINY_LLAMA, memory_check=False, isolation_check=False).model.state_dict()
    assert all(torch.equal(built[name], tensor) for name, tensor in expected.items())  # PackedCausalLM's own


@pytest.mark.parametrize("layout", ["data", "data x tensor"])
def test_a_random_init_under_a_gpu_mesh_with_host_shards_cuts_each_shard_on_the_host(layout):
    """The shards of a GPU run's mesh kept in host memory (FSDP2's `cpu_offload`), seen from the last of 4 ranks (a
    process group that never communicates): its shard of every parameter is cut from the one-process init on the
    host and copied alone, so no whole parameter and no shard reaches the device (this machine has none: a
    `.to("cuda")` of anything raises). Shards over data, and over data x tensor (FSDP2's strided rows over tensor
    parallel's). One rank per process, as in a run: DTensor caches the layouts it has seen by the mesh's shape."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    config = AutoConfig.for_model(**{**TINY_LLAMA, "tie_word_embeddings": False})
    whole = AutoModelForCausalLM.from_config(config)
    initialize(whole, SEED)
    expected = dict(whole.named_parameters())
    shape = (4,) if layout == "data" else (2, 2)
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        names = ("dp",) if layout == "data" else ("dp", "tp")
        mesh = DeviceMesh("cuda", torch.arange(4).reshape(shape), mesh_dim_names=names, _init_backend=False)
        sharded = AutoModelForCausalLM.from_config(config)
        for module in sharded.modules():
            for name, param in [(n, p) for n, p in module._parameters.items() if p is not None]:
                if layout == "data":
                    placements = (Shard(0),)
                elif param.dim() == 2:  # rows over tensor parallel, then FSDP2's rows of those
                    placements = (_StridedShard(0, split_factor=2), Shard(0))
                else:
                    placements = (Shard(0), Replicate())
                spec = DTensorSpec(mesh, placements, TensorMeta(param.shape, param.stride(), param.dtype))
                local, _ = compute_local_shape_and_global_offset(param.shape, mesh, placements)
                host = torch.full(local, math.nan)  # host memory, as cpu_offload keeps a shard
                module._parameters[name] = torch.nn.Parameter(DTensor(host, spec, requires_grad=False))
        initialize(sharded, SEED)
        cpu_mesh = DeviceMesh("cpu", torch.arange(4).reshape(shape), mesh_dim_names=names, _init_backend=False)
        for name, param in sharded.named_parameters():
            cut = distribute_tensor(expected[name].detach(), cpu_mesh, param.placements, src_data_rank=None)
            assert param.to_local().device.type == "cpu", name
            assert cut.to_local().shape[0] < expected[name].shape[0], name  # a shard, not the whole
            assert torch.equal(param.to_local(), cut.to_local()), name
    finally:
        dist.destroy_process_group()


def test_parameters_kept_on_the_host_are_allocated_there_and_only_the_buffers_on_the_device():
    """`cpu_offload`'s build: the parameters allocated and filled in host memory, the buffers (rotary frequencies)
    placed on the run's device (here the meta device stands for it: nothing else is allocated there)."""
    whole = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA))
    initialize(whole, SEED)
    with deferred_weights():
        meta = PackedCausalLM(model_config=TINY_LLAMA, memory_check=False).model
    materialize(meta, "meta", Weights("tiny", None, SEED), parameters_on_host=True)
    expected = dict(whole.named_parameters())
    assert all(p.device.type == "cpu" and torch.equal(p, expected[n]) for n, p in meta.named_parameters())
    assert all(b.is_meta for b in meta.buffers()) and meta.lm_head.weight is meta.model.embed_tokens.weight


def test_lora_adapters_are_initialised_as_peft_does_kaiming_a_and_zero_b():
    torch.manual_seed(SEED)
    lm = PackedCausalLM(model_config=TINY_LLAMA, lora=LORA, memory_check=False, isolation_check=False)
    adapters = {n: p for n, p in lm.model.named_parameters() if "lora_" in n}
    assert adapters and all(not p.any() for n, p in adapters.items() if "lora_B" in n)
    a = next(p for n, p in adapters.items() if "lora_A" in n)
    bound = 1 / a.shape[1] ** 0.5  # kaiming_uniform(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert float(a.abs().max()) <= bound and float(a.abs().max()) > bound / 2


def test_a_parameter_no_init_knows_is_refused_by_name():
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA))
    model.model.norm.extra = torch.nn.Parameter(torch.empty(3, device="meta"))  # not a norm's weight: unknown
    with pytest.raises(ConfigError) as error:
        initialize(model, SEED)
    message = str(error.value)
    assert "model.norm.extra" in message and "_init_weights" in message and "\n" not in message


def test_a_checkpoint_that_is_not_the_models_is_named_in_one_line():
    wanted = {"a.weight": (4, 2), "b.weight": (3,)}
    with pytest.raises(AssetError) as error:
        check_names({"a.weight": (4, 3), "c.weight": (1,)}, wanted, "m", set())
    message = str(error.value)
    assert "lack (first: b.weight)" in message and "no parameter for (first: c.weight)" in message
    assert "a.weight: [4, 3] in the files, [4, 2] here" in message and "\n" not in message
    check_names({"a.weight": (4, 2), "b.weight": (3,), "head.weight": (4, 2)}, wanted, "m", {"head.weight"})


def test_a_folder_without_safetensors_is_refused_before_any_rank_reads(tmp_path):
    from lit_packing.models.materialize import stored_shapes

    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(AssetError, match="no .safetensors files"):
        stored_shapes(tmp_path, "old-model")


def _meta_filled(model_config: dict, folder: Path) -> torch.nn.Module:
    with deferred_weights():
        meta = PackedCausalLM(model_config=model_config, memory_check=False).model
    materialize(meta, "cpu", Weights("saved", str(folder), SEED))
    return meta


def test_a_sharded_checkpoint_reads_the_files_its_index_names_and_no_other(tmp_path):
    """A folder as Mistral's ship: index + shards, and a `consolidated.safetensors` of the same weights under other
    names beside them. Only the index's files are read (before: refused, 'tensors the model has no parameter for');
    a file the index names but the folder lacks is named."""
    saved = AutoModelForCausalLM.from_config(AutoConfig.for_model(**SMALL))
    saved.save_pretrained(tmp_path, max_shard_size="1MB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    save_file({f"consolidated.{k}": v.contiguous() for k, v in saved.state_dict().items()},
              str(tmp_path / "consolidated.safetensors"))  # fmt: skip
    filled = _meta_filled(SMALL, tmp_path)
    for name, tensor in saved.state_dict().items():
        assert torch.equal(filled.state_dict()[name], tensor), name
    (tmp_path / shards[-1]).unlink()
    with pytest.raises(AssetError, match=f"names {shards[-1]}, which is not there"):
        _meta_filled(SMALL, tmp_path)


def test_stored_tensors_the_model_class_ignores_on_load_are_not_refused(tmp_path):
    """GPT-NeoX checkpoints carry `attention.bias` / `masked_bias` buffers transformers ignores on load
    (`_keys_to_ignore_on_load_unexpected`): ignored here too; any other stray tensor is still refused."""
    from tests.conftest import TINY_CONFIGS

    config = TINY_CONFIGS["gpt_neox"]
    saved = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    saved.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["gpt_neox.layers.0.attention.bias"] = torch.ones(4, 4, dtype=torch.bool)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    filled = _meta_filled(config, tmp_path)
    assert all(torch.equal(filled.state_dict()[n], t) for n, t in saved.state_dict().items())
    tensors["gpt_neox.layers.0.stray.weight"] = torch.ones(2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(AssetError, match="no parameter for \\(first: gpt_neox.layers.0.stray.weight\\)"):
        _meta_filled(config, tmp_path)


def test_the_file_plan_keeps_each_file_under_its_size_and_a_tied_weight_once():
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA))
    files = file_plan(model.named_parameters(), 200_000)
    names = [n for f in files for n in f]
    assert names == [n for n, _ in model.named_parameters()] and "lm_head.weight" not in names
    sizes = {n: p.numel() * 4 for n, p in model.named_parameters()}
    assert all(sum(sizes[n] for n in f) <= 200_000 or len(f) == 1 for f in files) and len(files) > 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_the_streamed_file_reads_back_as_safetensors_own(tmp_path, dtype):
    tensors = {"b": torch.arange(7, dtype=dtype).reshape(7, 1), "a": torch.ones(2, 3, dtype=dtype) * 3}
    with SafetensorsStream(tmp_path / "x.safetensors", tensors) as out:
        for name, tensor in tensors.items():
            out.write(name, tensor)
    save_file(tensors, tmp_path / "reference.safetensors")
    read, reference = load_file(tmp_path / "x.safetensors"), load_file(tmp_path / "reference.safetensors")
    assert read.keys() == reference.keys() and all(torch.equal(read[k], reference[k]) for k in read)
    assert not list(tmp_path.glob(".*partial"))


def test_a_tensor_streamed_in_row_blocks_is_the_file_written_whole(tmp_path):
    tensor = torch.arange(30.0).reshape(10, 3)
    with SafetensorsStream(tmp_path / "x.safetensors", {"t": tensor, "u": tensor[:2]}) as out:
        out.write_rows("t", tensor.split([4, 0, 6]))
        out.write_rows("u", [tensor[:2]])
    assert torch.equal(load_file(tmp_path / "x.safetensors")["t"], tensor)
    for blocks, error in (([tensor[:9]], "1 rows short"), ([tensor[:, :2]], "not rows of")):
        with pytest.raises(ValueError, match=error), SafetensorsStream(tmp_path / "y.st", {"t": tensor}) as out:
            out.write_rows("t", blocks)


@pytest.mark.parametrize("rows", [1, 5, 6, 10, 32_001])
@pytest.mark.parametrize("mesh_shape", [(1,), (2,), (4,), (2, 2), (1, 4), (3, 1, 2), (2, 3)])
def test_the_row_blocks_of_a_sharded_tensor_are_nested_chunks_in_order(rows, mesh_shape):
    """The export's blocks of a real DTensor sharded by rows (`Shard(0)` over every mesh dim, or replicated over the
    first of several), seen from the mesh's last rank: in row order they cover every row once, each block being
    what nested `torch.chunk`s give its owner's coordinate (vocab not divisible too), the owner the lowest rank
    holding it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lit_packing.models.export import _row_blocks

    ranks = math.prod(mesh_shape)
    layouts = [(Shard(0),) * len(mesh_shape)] + ([(Replicate(),) + (Shard(0),) * (len(mesh_shape) - 1)]
                                                 if len(mesh_shape) > 1 else [])  # fmt: skip
    dist.init_process_group("fake", store=FakeStore(), rank=ranks - 1, world_size=ranks)
    try:
        grid = torch.arange(ranks).reshape(mesh_shape)
        mesh = DeviceMesh("cpu", grid, mesh_dim_names=tuple(f"d{k}" for k in range(len(mesh_shape))),
                          _init_backend=False)  # fmt: skip
        for placements in layouts:
            blocks = _row_blocks(distribute_tensor(torch.arange(float(rows)), mesh, placements, src_data_rank=None))
            start = 0
            for owner, size in blocks:
                coordinate = [int(c[0]) for c in torch.nonzero(grid == owner, as_tuple=True)]
                held = torch.arange(float(rows))
                for ways, at, placement in zip(mesh_shape, coordinate, placements):
                    if type(placement) is Shard:
                        pieces = held.chunk(ways)
                        held = pieces[at] if at < len(pieces) else held[:0]
                    else:  # replicated: every rank along this dim holds it, the first owns it
                        assert at == 0
                assert torch.equal(held, torch.arange(float(start), start + size)), (placements, owner)
                start += size
            assert start == rows and all(size > 0 for _, size in blocks)
            assert len({owner for owner, _ in blocks}) == len(blocks)
    finally:
        dist.destroy_process_group()


def test_a_stream_cut_short_leaves_no_file(tmp_path):
    tensors = {"a": torch.ones(2), "b": torch.ones(3)}
    with pytest.raises(RuntimeError), SafetensorsStream(tmp_path / "x.safetensors", tensors) as out:
        out.write("a", tensors["a"])
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="expected a"), SafetensorsStream(tmp_path / "y.safetensors", tensors) as out:
        out.write("b", tensors["b"])


# ----------------------------------------------------------------------------------------------------------------
# CPU ranks


def save_checkpoint(folder: Path, config: dict, shard_size: str) -> int:
    """A model saved as a Hub checkpoint is: bf16 safetensors files; returns its fp32 size in bytes."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size=shard_size)
    return 4 * sum(p.numel() for p in model.parameters())


def env() -> dict:
    import os

    return {**{k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")},
            "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # fmt: skip


def start_loads(tmp: Path, runs: dict[str, dict], fork: bool = True) -> dict:
    """Every load at once, each its ranks' reports: {name: [rank 0's, rank 1's, ...]}. `fork=False`: each load a new
    interpreter (`launch.start`), as the memory bounds were measured."""
    started = {}
    for name, run in runs.items():
        args = [sys.executable, str(LOAD), json.dumps({**run, "out": str(tmp / name)})]
        log = tmp / f"{name}.log"
        started[name] = launch.start(args, cwd=tmp, env=env(), stdout=log, merge_stderr=True, fork=fork)
    for name, process in started.items():
        assert process.wait(timeout=900) == 0, (tmp / f"{name}.log").read_text()[-4000:]
    return {
        name: [json.loads((tmp / f"{name}.rank{r}.json").read_text()) for r in range(run["devices"])]
        for name, run in runs.items()
    }


@pytest.fixture(scope="module")
def loads(tmp_path_factory) -> dict:
    """The big model's loads, whose memory is measured (the serial pass: one other serial test at most beside them;
    each rank's resident memory is its own), with "model_bytes"."""
    tmp = tmp_path_factory.mktemp("materialize")
    big_bytes = save_checkpoint(tmp / "big", BIG, "200MB")
    runs = {
        **{f"big{n}": {"folder": str(tmp / "big"), "devices": n} for n in (1, 2, 4)},
        "big2_export": {
            "folder": str(tmp / "big"),
            "devices": 2,
            "export": str(tmp / "big_export"),
            "file_bytes": 200_000_000,
        },  # fmt: skip
        "big2_whole": {"folder": str(tmp / "big"), "devices": 2, "whole": True},
    }
    return {**start_loads(tmp, runs, fork=False), "model_bytes": big_bytes, "tmp": tmp}


@pytest.fixture(scope="module")
def small_loads(tmp_path_factory) -> dict:
    """The small model's loads, whose weights alone are compared (the first pass, beside other tests): 2 x 2 data x
    tensor parallel with an export, LoRA on 2 ranks, random inits on 1 and 2."""
    tmp = tmp_path_factory.mktemp("materialize_small")
    save_checkpoint(tmp / "small", SMALL, "1MB")
    runs = {
        "small_tp": {
            "folder": str(tmp / "small"),
            "devices": 4,
            "tp": 2,
            "export": str(tmp / "small_export"),
            "file_bytes": 1_000_000,
        },  # fmt: skip
        "small_lora": {"folder": str(tmp / "small"), "devices": 2, "lora": LORA, "weights": True},
        **{f"random{n}": {"model_config": SMALL, "devices": n, "weights": True} for n in (1, 2)},
    }
    return {**start_loads(tmp, runs), "tmp": tmp}


def assert_slices_equal(loads: dict, names: tuple[str, ...]) -> None:
    for name in names:
        for rank, report in enumerate(loads[name]):
            assert report["slices_equal"], (name, rank)
            assert report["buffers_equal"], (name, rank)  # rotary inv_freq as the model computes it
            assert report["tied"] == name.startswith("big"), (name, rank)  # one storage after to_empty


def assert_export_round_trips(tmp: Path, source: str, export: str) -> None:
    """`from_pretrained` of the exported folder gives the checkpoint's weights (the model's dtype) tensor for
    tensor."""
    expected = AutoModelForCausalLM.from_pretrained(tmp / source, dtype=torch.float32).state_dict()
    exported = AutoModelForCausalLM.from_pretrained(tmp / export, dtype=torch.float32).state_dict()
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), (export, name)


@pytest.mark.slow
@pytest.mark.serial
def test_every_rank_holds_its_slices_of_the_checkpoint_bit_for_bit(loads):
    assert_slices_equal(loads, ("big1", "big2", "big4", "big2_export"))


@pytest.mark.slow
def test_every_rank_of_a_tensor_parallel_or_lora_load_holds_its_slices_bit_for_bit(small_loads):
    assert_slices_equal(small_loads, ("small_tp", "small_lora"))


@pytest.mark.slow
@pytest.mark.serial
def test_loading_on_n_ranks_costs_each_rank_its_shard(loads):
    """Built, sharded and filled, each rank's peak is its shard plus what the reads pass through (measured: 1.02,
    0.52 and 0.27 x the model on 1, 2 and 4 ranks; built whole first, 1.04 on each of 2), and it holds its shard
    once set up (the same). A build of the whole model on every rank fails the first bound at 2 and 4 ranks. The
    packing probe runs on the skeleton at construction (`probe_values`): the root whole (the tied embeddings, a
    fifth of this model) and one decoder layer, measured 0.33 on any number of ranks; the sharded model is never
    probed, so setup never gathers the root (before, its forward through FSDP2 took 4 ranks to 0.81-0.86)."""
    model = loads["model_bytes"]
    for n in (1, 2, 4):
        loaded = max(r["load_peak"] for r in loads[f"big{n}"])
        held = max(r["held"] for r in loads[f"big{n}"])
        assert loaded < model / n + 0.1 * model, (n, loaded / model)
        assert held < model / n + 0.1 * model, (n, held / model)
        probe = max(r["build_peak"] for r in loads[f"big{n}"])
        assert probe < 0.45 * model, (n, probe / model)  # the root and a layer, never the model
    whole = min(r["load_peak"] for r in loads["big2_whole"])
    assert whole > model, whole / model
    setup = {n: max(r["setup_peak"] for r in loads[f"big{n}"]) / model for n in (1, 2, 4)}
    assert setup[4] < setup[2] < setup[1] < 1.1, setup
    assert setup[4] <= 0.45, setup  # the probe's root and layer, or the shard, whichever is more


@pytest.mark.slow
@pytest.mark.serial
def test_the_export_round_trips_without_rank_0_holding_the_model(loads):
    """From 2 ranks, tied. Rank 0 holds its shard and one other rank's block of rows at a time: measured 0.63-0.65
    x the model at its peak, 0.11-0.13 above what it held before the export (the embeddings' block is 0.105). With
    each tensor's finiteness checked whole (`torch.isfinite`'s temporaries: 1.8 x the embeddings' shard) it was
    0.70-0.83; gathering each tensor whole took it to 0.95-1.01."""
    tmp = loads["tmp"]
    assert_export_round_trips(tmp, "big", "big_export")
    assert len(list((tmp / "big_export").glob("*.safetensors"))) > 1
    rank0, model = loads["big2_export"][0], loads["model_bytes"]
    assert rank0["export_peak"] < 0.75 * model, rank0["export_peak"] / model
    excess = rank0["export_peak"] - rank0["held_before_export"]
    assert excess < 0.16 * model, (excess / model, rank0["held_before_export"] / model)


@pytest.mark.slow
def test_the_export_of_2_x_2_data_x_tensor_parallel_ranks_round_trips_untied(small_loads):
    tmp = small_loads["tmp"]
    assert_export_round_trips(tmp, "small", "small_export")
    assert (tmp / "small_export" / "config.json").exists()


@pytest.mark.slow
def test_a_random_init_and_lora_adapters_are_one_process_weights_on_any_number_of_ranks(small_loads):
    tmp = small_loads["tmp"]
    torch.manual_seed(SEED)
    one = PackedCausalLM(model_config=SMALL, memory_check=False, isolation_check=False).model.state_dict()
    for n in (1, 2):
        sharded = torch.load(tmp / f"random{n}.weights.pt", weights_only=True)
        assert sharded.keys() == {k for k in one if "rotary" not in k}
        assert all(torch.equal(sharded[k], one[k]) for k in sharded), n
    torch.manual_seed(SEED)
    lora = PackedCausalLM(name_or_path=str(tmp / "small"), lora=LORA, memory_check=False, isolation_check=False)
    adapters = {n: p for n, p in lora.model.named_parameters() if p.requires_grad}
    sharded = torch.load(tmp / "small_lora.weights.pt", weights_only=True)
    assert sharded.keys() == adapters.keys() and all(torch.equal(sharded[k], adapters[k]) for k in sharded)


def test_the_export_command_refuses_what_is_not_a_checkpoint_in_one_line(tmp_path, capsys, monkeypatch):
    import sys as system

    from lit_packing.commands import main

    monkeypatch.setattr(system, "argv", ["lit-packing", "export", "--ckpt_path", str(tmp_path), "--output", "out"])
    with pytest.raises(SystemExit) as exit_:
        main()
    printed = capsys.readouterr().out.strip()
    assert exit_.value.code == 2 and printed.count("\n") == 0
    assert "is neither a checkpoint file nor a distributed checkpoint" in printed and "--ckpt_path" in printed
