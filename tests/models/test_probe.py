"""The construction probe (`lit_packing.models.probe`): a model whose attention leaks, or whose layers hand
attention a keyword no backend implements, is refused in one line naming the module or keyword; what the probe
records keeps `auto` off the kernels that cannot give it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lit_packing.errors import ConfigError
from lit_packing.models.attention import attn_implementation
from lit_packing.models.backends import attention_needs, kernel_refusal
from lit_packing.models.causal_lm import PackedCausalLM
from lit_packing.models.probe import probe_packing
from tests.models.families import tiny_config


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
