"""Non-attention token mixers in packed rows (`lit_packing.models.mixers`): found outermost, run per example
wherever the boundaries reach them (from `cu_seq_lens`, from restarting positions alone, in a checkpointed layer's
recomputation, inside LoRA), and a hybrid whose mixers were left as transformers wrote them is refused or named."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lit_packing.batch import MODEL_KEYS
from lit_packing.data.collate import PackedCollator
from lit_packing.errors import IsolationError
from lit_packing.models.attention import admit, attn_implementation
from lit_packing.models.causal_lm import PackedCausalLM
from lit_packing.models.loading import load_causal_lm
from lit_packing.models.loss import token_losses
from lit_packing.models.mixers import find_mixers, keep_mixers_apart
from lit_packing.models.pack import pack_model
from lit_packing.models.selftest import check_isolation
from tests.helpers import per_example_reference
from tests.models.families import tiny_config


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


@pytest.mark.parametrize("family", ["bamba", "qwen3_next", "lfm2", "mamba2"])
def test_the_memory_lean_head_runs_the_mixers_per_example_too(family):
    """`head_inputs` (the chunked loss's path, the default) calls the decoder alone: its mixers still get this
    batch's boundaries, not none and not those of the whole model's previous forward (before: Bamba 2.4 away from
    each example run alone, Qwen3-Next 0.28, LFM2 1.8e-3)."""
    from lit_packing.models.head import head_inputs

    model = _hybrid(family).eval()
    first = PackedCollator()([{"input_ids": list(range(3, 3 + n))} for n in (5, 15)])
    batch = PackedCollator()([{"input_ids": list(range(3, 3 + n))} for n in (7, 4, 9)])
    with torch.no_grad():
        model(**{k: first[k] for k in MODEL_KEYS if k in first}, use_cache=False)  # other boundaries, 20 tokens
        hidden = head_inputs(model, batch).hidden[0]
        alone = torch.cat([model.base_model(input_ids=torch.arange(3, 3 + n)[None]).last_hidden_state[0]
                           for n in (7, 4, 9)])  # fmt: skip
    torch.testing.assert_close(hidden, alone, atol=2e-5, rtol=1e-5)


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
