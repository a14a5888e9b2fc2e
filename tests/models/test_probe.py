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


@pytest.mark.parametrize("dropped", [None, "key_index", "context"])
def test_attention_layers_that_drop_key_index_or_the_group_are_refused_where_those_are_needed(dropped):
    """Shared prompts and context parallelism pick each segment's keys with `key_index` (over the group's gathered
    keys): a layer that drops either would attend a shorter key set with longer `cu_seq_lens_k` (out of bounds in
    the GPU kernels). The probe hands both to the model and records whether every attention layer passes them on;
    a model whose second layer drops one is refused for context parallelism and shared prompts, in one line each,
    and still trains plain packs."""
    from lit_packing.batch import CU_SEQ_LENS_K, KEY_INDEX
    from lit_packing.data.collate import PackedCollator
    from lit_packing.models.context import CP_SIZE_SETTING, check_context_parallel
    from lit_packing.models.pack import pack_model
    from tests.helpers import make_examples

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config("llama")))

    def drop(module, args, kwargs):
        return args, {key: value for key, value in kwargs.items() if key != dropped}

    model.model.layers[1].self_attn.register_forward_pre_hook(drop, with_kwargs=True)
    packing = pack_model(model, "per_example")
    assert packing.keyed == (dropped is None)
    batch = PackedCollator()(make_examples([5, 7], vocab=300))
    model(**batch, use_cache=False)  # plain packs: as before
    if dropped is None:
        check_context_parallel(2, model, False, {}, packing.keyed)  # nothing refused
        return
    with pytest.raises(ConfigError) as raised:
        check_context_parallel(2, model, False, {}, packing.keyed)
    assert str(raised.value).startswith(f"{CP_SIZE_SETTING}: 2: LlamaForCausalLM's attention layers do not hand the "
                                        "attention function gathered_index and the context group")  # fmt: skip
    shared = {**batch, KEY_INDEX: torch.arange(12), CU_SEQ_LENS_K: batch[CU_SEQ_LENS_K]}
    with pytest.raises(ConfigError) as raised:
        model(**shared, use_cache=False)
    assert str(raised.value) == (
        "data.collator.init_args.share_prompt: LlamaForCausalLM's attention layers do not hand key_index (each "
        "continuation's prompt keys) to the attention function; set share_prompt=false for this model"
    )
