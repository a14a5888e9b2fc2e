"""QLoRA: a 4-bit (or 8-bit) base from a saved model, LoRA adapters trained on it, packed exactly as padded on the
same quantized weights; what cannot train refused in one line; the merged export a plain transformers model
(`lit_packing.models.quantize`, `export.export_merged`)."""

import csv
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lit_packing.cost import model_shape
from lit_packing.data.collate import PackedCollator, PaddedCollator
from lit_packing.errors import ConfigError
from lit_packing.models import PackedCausalLM
from lit_packing.models.materialize import deferred_weights
from lit_packing.models.quantize import EIGHT_BIT_MIN, check_quantized_strategy, stored_bytes
from tests.helpers import make_examples
from tests.models.test_causal_lm import LENGTHS, chunks, run_one_step

ROOT = Path(__file__).parents[2]
bitsandbytes = pytest.importorskip("bitsandbytes")  # the `qlora` extra; `make setup` installs it

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "gate_proj"]}
# Linear layers dominate, as in any LLM past a few hundred million parameters (here: 4.2 of 4.5 M).
SHAPE = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 1024,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
         "max_position_embeddings": 2048}  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A random Llama saved as a pretrained folder (weights are quantized as they load)."""
    folder = tmp_path_factory.mktemp("qlora") / "base"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**SHAPE)).save_pretrained(folder)
    return str(folder)


def qlora(saved, kind="nf4", **kwargs) -> PackedCausalLM:
    torch.manual_seed(0)
    return PackedCausalLM(name_or_path=saved, quantization=kind, lora=LORA, memory_check=False, **kwargs)


def test_what_cannot_train_is_refused_in_one_line(saved):
    with pytest.raises(ConfigError, match="model.quantization: nf4 quantizes the base model.* set model.lora"):
        PackedCausalLM(name_or_path=saved, quantization="nf4", memory_check=False)
    with pytest.raises(ConfigError, match="model.quantization: weights are quantized as a pretrained model loads"):
        PackedCausalLM(model_config=SHAPE, quantization="nf4", lora=LORA, memory_check=False)
    with deferred_weights(), pytest.raises(ConfigError, match="not sharded by FSDP2 here.*trainer.strategy=ddp"):
        PackedCausalLM(name_or_path=saved, quantization="nf4", lora=LORA, memory_check=False)
    with pytest.raises(ConfigError, match="model.quantization: .* not under FSDPStrategy; set trainer.strategy=ddp"):
        check_quantized_strategy("nf4", "FSDPStrategy")
    check_quantized_strategy("nf4", "DDPStrategy")
    with pytest.raises(ConfigError, match="model.export_adapters_only: the merged export does not fold use_dora"):
        PackedCausalLM(name_or_path=saved, lora={**LORA, "use_dora": True}, export_dir="out", memory_check=False)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_the_quantized_base_is_packed_and_trains_its_adapters_alone(saved, kind):
    """The isolation self-test passes on the quantized model (it runs at construction); the base's linear layers
    are bitsandbytes' and frozen, the adapters train."""
    lm = qlora(saved, kind)
    layer = lm.model.get_base_model().model.layers[0]
    assert type(layer.self_attn.k_proj).__name__ == ("Linear4bit" if kind == "nf4" else "Linear8bitLt")
    trainable = {name for name, p in lm.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    # The start-up line and the FLOP count see every weight, 4-bit ones (two a byte) included.
    quantized, plain = (
        model_shape(lm.model),
        model_shape(AutoModelForCausalLM.from_config(AutoConfig.for_model(**SHAPE))),
    )
    adapters = sum(p.numel() for p in lm.model.parameters() if p.requires_grad)
    assert quantized["frozen_params"] + quantized["trainable_params"] == plain["trainable_params"] + adapters


def test_4_bit_weights_take_under_a_third_of_their_bf16_bytes(saved):
    lm = qlora(saved)
    layers = lm.model.get_base_model().model.layers
    bf16 = 2 * sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.for_model(**SHAPE)).model.layers
                   .parameters() if p.ndim == 2)  # fmt: skip
    quantized = sum(stored_bytes(m) for m in layers.modules() if isinstance(m, bitsandbytes.nn.Linear4bit))
    assert quantized < bf16 / 3, (quantized, bf16)


def test_packed_equals_padded_on_the_same_quantized_weights(saved):
    examples = make_examples(LENGTHS)
    results = {}
    for kind, collate in (("packed", PackedCollator()), ("padded", PaddedCollator(pad_token_id=0))):
        lm = qlora(saved)
        grads, metrics = run_one_step(lm, [collate(c) for c in chunks(examples, [3, 5])], 2, precision="32-true")
        results[kind] = grads, float(metrics["train/loss"])
    (packed, packed_loss), (padded, padded_loss) = results["packed"], results["padded"]
    assert packed_loss == pytest.approx(padded_loss, rel=1e-5)
    assert packed.keys() == padded.keys() and packed
    # Every adapter has a gradient, the first layer's too, after the construction's self-test ran the model in eval
    # mode (which, unguarded, leaves bitsandbytes' 4-bit layers on an inference kernel autograd cannot go through).
    assert {name for name, grad in packed.items() if "lora_B" in name and grad.abs().sum() > 0} == {
        name for name in packed if "lora_B" in name} and any("layers.0." in name for name in packed)  # fmt: skip
    for name, grad in packed.items():
        torch.testing.assert_close(grad, padded[name], rtol=1e-3, atol=1e-6, msg=name)


def test_the_merged_export_is_base_plus_scaled_adapters_and_loads_without_peft(saved, tmp_path):
    from peft.utils.integrations import dequantize_module_weight

    lm = qlora(saved, export_dir=str(tmp_path / "merged"))
    with torch.no_grad():
        for name, p in lm.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)  # trained adapters: B is no longer 0
    lm.export(str(tmp_path / "merged"))
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    weights = plain.state_dict()
    adapted = lm.model.get_base_model().model.layers[1].self_attn.q_proj  # LoRA on a 4-bit layer
    scale = LORA["lora_alpha"] / LORA["r"]
    expected = dequantize_module_weight(adapted.base_layer).float()
    expected += scale * adapted.lora_B["default"].weight @ adapted.lora_A["default"].weight
    torch.testing.assert_close(weights["model.layers.1.self_attn.q_proj.weight"], expected, rtol=0, atol=0)
    alone = lm.model.get_base_model().model.layers[1].self_attn.k_proj  # 4-bit, no adapter: dequantized
    assert torch.equal(weights["model.layers.1.self_attn.k_proj.weight"], dequantize_module_weight(alone).float())
    assert not any("lora" in key for key in weights)
    prompt = torch.tensor([[5, 6, 7]])
    assert plain.generate(prompt, max_new_tokens=4, do_sample=False).shape == (1, 7)
    lm.hparams.export_adapters_only = True
    lm.export(str(tmp_path / "adapters"))
    assert (tmp_path / "adapters" / "adapter_config.json").exists()


def test_the_merged_export_is_in_the_bases_stored_dtype_file_by_file(tmp_path):
    """A base stored in bf16: the merged export is bf16 too (each weight summed in fp32, rounded once), written
    tensor by tensor into files of at most `file_bytes` with their index, and loads as the plain model."""
    from peft.utils.integrations import dequantize_module_weight
    from safetensors import safe_open

    from lit_packing.models.export import export_merged, stored_dtype

    folder = tmp_path / "bf16"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**SHAPE)).to(torch.bfloat16).save_pretrained(folder)
    assert stored_dtype(str(folder)) == torch.bfloat16 and stored_dtype(str(tmp_path / "nothing")) is None
    lm = qlora(str(folder))
    with torch.no_grad():
        for name, p in lm.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    export_merged(lm.model, str(tmp_path / "merged"), dtype=stored_dtype(str(folder)), file_bytes=600_000)
    files = sorted((tmp_path / "merged").glob("model-*.safetensors"))
    index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    assert len(files) > 1 and set(index["weight_map"].values()) == {f.name for f in files}
    for file in files:
        with safe_open(file, "pt") as f:
            assert {f.get_slice(key).get_dtype() for key in f.keys()} == {"BF16"}  # noqa: SIM118 (not iterable)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert plain.dtype == torch.bfloat16
    adapted = lm.model.get_base_model().model.layers[1].self_attn.q_proj
    scale = LORA["lora_alpha"] / LORA["r"]
    expected = dequantize_module_weight(adapted.base_layer).float()
    expected += scale * adapted.lora_B["default"].weight.float() @ adapted.lora_A["default"].weight.float()
    got = plain.state_dict()["model.layers.1.self_attn.q_proj.weight"]
    torch.testing.assert_close(got, expected.to(torch.bfloat16), rtol=0, atol=0)
    assert plain.lm_head.weight.data_ptr() == plain.model.embed_tokens.weight.data_ptr()  # the tied head, once


def test_adamw8bit_keeps_its_moments_in_a_byte_and_resumes_them(tiny_llama_config):
    """The full-weight route's 8-bit AdamW: a step trains every weight, the moments are bytes (and counted so by the
    memory estimate), and its state round-trips through a state dict as a checkpoint holds it."""
    from lit_packing.models.memory import memory_model

    torch.manual_seed(0)
    lm = PackedCausalLM(model_config=tiny_llama_config, optimizer="adamw8bit", lr=1e-3, memory_check=False)
    before = {name: p.detach().clone() for name, p in lm.named_parameters()}
    run_one_step(lm, [PackedCollator()(make_examples(LENGTHS))], 1, precision="32-true")
    optimizer = lm.trainer.optimizers[0]
    assert type(optimizer).__name__ == "AdamW8bit"
    states = {p: state for p, state in optimizer.state.items() if "state1" in state}
    assert all((s["state1"].dtype == torch.uint8) == (p.numel() >= EIGHT_BIT_MIN) for p, s in states.items())
    assert any(s["state1"].dtype == s["state2"].dtype == torch.uint8 for s in states.values())
    assert any(not torch.equal(p, before[name]) for name, p in lm.named_parameters())
    restored = type(optimizer)(optimizer.param_groups)
    restored.load_state_dict(optimizer.state_dict())
    assert all(torch.equal(restored.state[p]["state1"], s["state1"]) for p, s in states.items())
    held = sum(t.numel() * t.element_size() for s in states.values() for k, t in s.items()
               if k in ("state1", "state2", "absmax1", "absmax2"))  # fmt: skip
    assert memory_model(lm, "32-true", padded=False).optimizer == pytest.approx(held, rel=0.01)


@pytest.mark.slow  # three short fits through the CLI
def test_a_qlora_fit_resumes_exactly(tmp_path, monkeypatch):
    """Stopped after 2 steps and resumed to 3 (`--ckpt_path=last`: the adapters from the checkpoint, the base quantized
    again as it loads), the adapters equal those of 3 steps run straight."""
    from lit_packing.cli import cli_main
    from tests.cli.test_configs import saved_tiny

    monkeypatch.chdir(tmp_path)
    common = ["fit", "--config", "qlora", f"--model.name_or_path={saved_tiny(tmp_path)}", "--data.limit=64",
              "--data.max_length=256", "--data.sampler.init_args.max_tokens=512", "--trainer.logger=false",
              "--model.lr=1e-2"]  # fmt: skip

    def adapters(cli) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in cli.model.named_parameters() if "lora_" in n}

    straight = adapters(cli_main([*common, "--run_name=straight", "--trainer.max_steps=3"]))
    cli_main([*common, "--run_name=resumed", "--trainer.max_steps=2"])
    resumed = adapters(cli_main([*common, "--run_name=resumed", "--trainer.max_steps=3", "--ckpt_path=last"]))
    assert straight.keys() == resumed.keys() and straight
    for name, tensor in straight.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=0, msg=name)


def fit_rows(cli_args: list[str], out: Path) -> list[dict]:
    """A fit through the CLI with a CSV logger in `out`: its logged rows."""
    from lit_packing.cli import cli_main

    logger = {"class_path": "CSVLogger", "init_args": {"save_dir": str(out)}}
    cli_main([*cli_args, "--trainer.log_every_n_steps=1", f"--trainer.default_root_dir={out}",
              f"--trainer.logger={json.dumps(logger)}"])  # fmt: skip
    (metrics,) = out.glob("**/metrics.csv")
    with open(metrics) as f:
        return [row for row in csv.DictReader(f) if row.get("train/loss")]


QLORA = ["--model.quantization=nf4", f"--model.lora={json.dumps(LORA)}", "--model.reference=lora", "--model.lr=1e-2",
         "--trainer.max_steps=2", "--trainer.val_check_interval=null", "--data.val_split=0"]  # fmt: skip


@pytest.mark.slow  # two short fits through the CLI
def test_qlora_trains_dpo_and_grpo_with_the_adapters_off_as_the_reference(tmp_path, monkeypatch):
    """`model.reference: lora` on a 4-bit base: the reference is the quantized base with the adapters off, so at the
    first step (B = 0) the policy is the reference: DPO's loss is exactly -log sigmoid(0) = log 2 and GRPO's KL to it
    0; the second step, after an update of the adapters, moves both."""
    from tests.cli.test_configs import saved_tiny

    monkeypatch.chdir(tmp_path)
    model = f"--model.name_or_path={saved_tiny(tmp_path)}"
    dpo = fit_rows(["fit", "--config", "dpo", model, *QLORA, "--data.limit=24", "--data.max_length=2048",
                    "--data.sampler.init_args.max_tokens=2048"], tmp_path / "dpo")  # fmt: skip
    assert float(dpo[0]["train/loss"]) == pytest.approx(math.log(2), abs=1e-6)
    assert abs(float(dpo[1]["train/loss"]) - math.log(2)) > 1e-4
    grpo = fit_rows(["fit", "--config", "grpo_replay", model, *QLORA, "--model.objective.init_args.beta=0.04",
                     "--data.limit=12"], tmp_path / "grpo")  # fmt: skip
    assert float(grpo[0]["train/kl"]) == pytest.approx(0.0, abs=1e-7)
    assert float(grpo[1]["train/kl"]) > 1e-6


@pytest.mark.slow
@pytest.mark.serial  # two ranks
def test_qlora_on_2_ddp_ranks_trains_the_steps_of_one_process(tmp_path):
    """`data.packs_per_step=2` on one process (2 accumulated) and on 2 DDP ranks over gloo (one each): the same packs
    each step, so the same per-step losses, each rank with its own quantized base and the adapters kept in step."""
    from tests.cli.test_configs import saved_tiny
    from tests.cli.test_resume import env
    from tests.helpers.launch import run_fit

    model = saved_tiny(tmp_path)
    losses = {}
    for ranks in (1, 2):
        out = tmp_path / f"ranks{ranks}"
        logger = {"class_path": "CSVLogger", "init_args": {"save_dir": str(out)}}
        args = [sys.executable, str(ROOT / "main.py"), "fit", "--config", "qlora", f"--model.name_or_path={model}",
                "--data.limit=64", "--data.max_length=256", "--data.sampler.init_args.max_tokens=512",
                "--data.packs_per_step=2", "--trainer.max_steps=3", "--trainer.val_check_interval=null",
                "--data.val_split=0", f"--trainer.devices={ranks}", "--trainer.accelerator=cpu",
                f"--trainer.strategy={'ddp' if ranks > 1 else 'auto'}", "--trainer.log_every_n_steps=1",
                f"--trainer.default_root_dir={out}", f"--trainer.logger={json.dumps(logger)}"]  # fmt: skip
        done = run_fit(args, cwd=tmp_path, env=env(tmp_path), timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        (metrics,) = out.glob("**/metrics.csv")
        losses[ranks] = [float(r["train/loss"]) for r in csv.DictReader(metrics.open()) if r.get("train/loss")]
    assert len(losses[1]) == 3
    assert losses[2] == pytest.approx(losses[1], abs=1e-5)
