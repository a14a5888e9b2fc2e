"""Every decoder family of the installed transformers packs exactly, or is refused in one line naming the model and
the module (or keyword) and the fix; the families table in docs/model.md is what this measures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lit_packing.batch import MODEL_KEYS
from lit_packing.data.collate import PackedCollator
from lit_packing.errors import ConfigError, IsolationError
from lit_packing.models.attention import admit, attn_implementation
from lit_packing.models.backends import attention_needs, kernel_refusal
from lit_packing.models.causal_lm import PackedCausalLM
from lit_packing.models.loading import load_causal_lm
from lit_packing.models.loss import token_losses
from lit_packing.models.mixers import find_mixers, keep_mixers_apart
from lit_packing.models.pack import pack_model
from lit_packing.models.probe import probe_packing
from lit_packing.models.selftest import check_isolation
from tests.cli.test_day_two import main_py, one_line_error
from tests.models.families import decoder_families, measure, per_example_reference, tiny_config

ROOT = Path(__file__).parents[2]
DOC = ROOT / "docs" / "model.md"
# Packed == per-example, fp32: the attention tests' tolerances (different kernels, same math; their loss tolerance,
# 1e-6 + 1e-6 relative, at a loss of ~ln(1000) = 6.9).
LOGITS, LOSS, GRADS = 2e-5, 8e-6, 1e-5


def assert_exact(row):
    assert not row.refused and not row.unbuilt, row
    assert row.logits <= LOGITS and row.loss <= LOSS and row.grads <= GRADS, row


def doc_table() -> dict[str, list[str]]:
    """The families table of docs/model.md: family -> its cells."""
    text = DOC.read_text()
    table = text.split("<!-- families table -->")[1]
    rows = {}
    for line in table.strip().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells
    return rows


def test_the_families_table_lists_every_decoder_family():
    assert sorted(doc_table()) == decoder_families(), "docs/model.md's families table lists other families"


@pytest.mark.parametrize("family", decoder_families())
def test_every_decoder_family_packs_exactly_or_is_refused_in_one_line(family):
    """The sweep behind the families table: the family's row in docs/model.md says what this measures."""
    row, cells = measure(family), doc_table()[family]
    if row.unbuilt:
        assert cells[2] == "not measured", (family, row.unbuilt)
    elif row.refused:
        line = row.refused
        assert "\n" not in line and len(line) < 700, line
        assert line.startswith("model.name_or_path: "), line
        assert re.search(r"(ForCausalLM|LMHeadModel|" + re.escape(family) + ")", line), line
        assert "configs/padding.yaml" in line, line
        assert cells[2] == "refused", (family, line)
    else:
        assert_exact(row)
        assert (cells[1], cells[2]) == (row.route, "exact"), (family, row.route)


def test_mixers_are_found_outermost_and_not_in_attention_only_models():
    bamba = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config("bamba")))
    names = [name for name, _ in find_mixers(bamba)]
    assert names == ["model.layers.0.mamba"]  # layer 1 is attention
    llama = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config("llama")))
    assert keep_mixers_apart(llama) == []


def _three_examples() -> dict:
    ids = torch.arange(3, 40)[None]
    cu = torch.tensor([0, 12, 25, 37], dtype=torch.int32)
    pos = torch.cat([torch.arange(12), torch.arange(13), torch.arange(12)])[None]
    return {"input_ids": ids, "position_ids": pos, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": 13, "max_length_k": 13}  # fmt: skip


def test_a_hybrid_built_by_hand_is_refused_on_its_first_packed_forward():
    """A Bamba given a packed backend by name, without `pack_model`: its Mamba mixer would run across the
    boundaries; the first packed forward is refused in one line naming the fix."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(**tiny_config("bamba")), attn_implementation=attn_implementation("per_example")
    )
    with pytest.raises(IsolationError) as raised:
        model(**_three_examples(), use_cache=False)
    message = str(raised.value)
    assert "\n" not in message and message.startswith("a packed batch reached BambaAttention"), message
    assert "lit_packing.core.pack_model(model)" in message, message
    pack_model(model)
    assert check_isolation(model, _three_examples(), "per_example") < 1e-5


def test_without_the_per_example_mixers_the_leak_is_named():
    """The same Bamba, its attention admitted but its Mamba mixers left as transformers wrote them (what the door
    would have wrapped): the self-test names the mixer and the fix."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(**tiny_config("bamba")), attn_implementation=attn_implementation("per_example")
    )
    admit([module for name, module in model.named_modules() if name.endswith("self_attn")])
    with pytest.raises(IsolationError) as raised:
        check_isolation(model, _three_examples(), "per_example")
    message = str(raised.value)
    assert "model.layers.0.mamba (BambaMixer)" in message, message
    assert "recurrence or convolution runs across the boundary" in message, message
    assert "lit_packing.core.pack_model(model)" in message and "configs/padding.yaml" in message, message
    keep_mixers_apart(model)
    assert check_isolation(model, _three_examples(), "per_example") < 1e-5


def test_a_model_whose_attention_leaks_is_refused_at_construction_naming_the_module():
    with pytest.raises(ConfigError) as raised:
        PackedCausalLM(model_config=tiny_config("doge"), vocab_size=1000)
    message = str(raised.value)
    assert message.startswith("model.name_or_path: packed examples are not kept apart"), message
    assert "model.layers.0.self_attn (DogeAttention)" in message, message


def test_an_attention_keyword_no_backend_implements_is_refused_in_one_line():
    """A Llama whose attention layers hand the attention function one keyword more (as a new family would)."""
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(**tiny_config("llama")), attn_implementation=attn_implementation("per_example")
    )

    def one_more(module, args, kwargs):
        return args, {**kwargs, "alibi_slopes": torch.ones(4)}

    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(one_more, with_kwargs=True)
    with pytest.raises(ConfigError) as raised:
        probe_packing(model)
    assert str(raised.value) == (
        "model.name_or_path: LlamaForCausalLM's attention hands the attention function alibi_slopes, which the "
        "packed backends do not implement: its attention would be computed without it; choose a model whose "
        "attention the backends implement (the families table in docs/model.md)"
    )


def test_sinks_and_position_bias_keep_auto_off_the_flash_kernels():
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(**tiny_config("gpt_oss")), attn_implementation=attn_implementation("per_example")
    )
    needs = attention_needs(model, probe_packing(model).keywords)
    assert needs.sinks and not needs.position_bias
    assert kernel_refusal("flash_attn", needs) == "flash_attn has no attention sinks"
    assert kernel_refusal("torch_varlen", needs) == "torch_varlen has no attention sinks"
    assert kernel_refusal("per_example", needs) is None


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bamba", "qwen3_next", "lfm2"])
def test_one_step_fit_through_the_cli(tmp_path, family):
    """Mamba 2, gated delta net and short-convolution hybrids train packed through the CLI, self-test passing."""
    config = {k: v for k, v in tiny_config(family).items() if k != "vocab_size"}
    done = main_py(
        tmp_path, "fit", "--config", "quickstart", f"--model.model_config={json.dumps(config)}",
        "--trainer.max_steps=1", "--data.limit=32", "--data.max_length=256",
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "isolation self-test passed" in output, output[-3000:]
    assert re.search(r"\d+ token mixers? besides attention: \d+ \w+ per example \(", output), output[-3000:]


def test_a_refused_family_through_the_cli_is_one_line(tmp_path):
    config = {k: v for k, v in tiny_config("doge").items() if k != "vocab_size"}
    last = one_line_error(
        main_py(
            tmp_path,
            "fit",
            "--config",
            "quickstart",
            f"--model.model_config={json.dumps(config)}",
            "--trainer.max_steps=1",
        )  # fmt: skip
    )
    assert "model.layers.0.self_attn (DogeAttention)" in last, last


def _hybrid(family: str):
    torch.manual_seed(0)
    return load_causal_lm(model_config=tiny_config(family)).model


@pytest.mark.parametrize("family", ["bamba", "qwen3_next"])
def test_boundaries_reach_the_mixers_from_position_ids_alone(family):
    """A row with restarting position_ids and no cu_seq_lens (DataCollatorWithFlattening's default): the mixers
    still run per example."""
    model = _hybrid(family).eval()
    batch = PackedCollator()([{"input_ids": list(range(3, 3 + n))} for n in (7, 4, 9)])
    with torch.no_grad():
        full = model(**{k: batch[k] for k in MODEL_KEYS if k in batch}, use_cache=False).logits
        bare = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        alone = torch.cat([model(input_ids=torch.arange(3, 3 + n)[None], use_cache=False).logits[0] for n in (7, 4, 9)])
    torch.testing.assert_close(bare[0], alone, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(full, bare, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["bamba", "qwen3_next"])
def test_gradient_checkpointing_recomputes_the_mixers_per_example(family):
    """The backward pass recomputes each checkpointed layer: its mixers read the same boundaries again."""
    model = _hybrid(family).eval()
    examples = [{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))} for n in (7, 4, 9, 4)]
    batch = PackedCollator()(examples)

    def grads(**inputs):
        model.zero_grad()
        losses, mask, _ = token_losses(model(**inputs, use_cache=False).logits, batch["labels"])
        (losses.sum() / mask.sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads(**{k: batch[k] for k in MODEL_KEYS if k in batch})
    alone = per_example_reference(model, examples)[2]
    for name, grad in plain.items():  # packed == each example alone, then checkpointed == packed
        torch.testing.assert_close(grad, alone[name], atol=1e-6, rtol=1e-4, msg=name)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # transformers checkpoints only in training mode; these tiny configs have no dropout
    checkpointed = grads(**{k: batch[k] for k in MODEL_KEYS if k in batch})
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_lora_adapters_inside_the_mixers_keep_them_per_example():
    """peft wraps the mixers' projections after they were made per-example: the self-test still passes."""
    lm = PackedCausalLM(
        model_config=tiny_config("bamba"), vocab_size=1000, lora=dict(r=4, target_modules=["in_proj", "out_proj"])
    )
    batch = PackedCollator()([{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))} for n in (7, 4, 9)])
    assert type(lm.model).__name__ == "PeftModelForCausalLM"
    assert check_isolation(lm.model, batch, "per_example") < 1e-5
