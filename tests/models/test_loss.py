"""The memory-lean loss: LM head + cross-entropy on the label positions only, chunk by chunk, equals the loss and
gradients of the full (T, V) logits for every tested family (tied heads, gemma2's soft-cap, LoRA), and never
creates a (T, V) tensor."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lit_packing.data.collate import PackedCollator, PaddedCollator
from lit_packing.errors import ConfigError
from lit_packing.models import PackedCausalLM
from lit_packing.models.loss import causal_lm_loss, eval_sums
from tests.conftest import TINY_CONFIGS
from tests.helpers import make_examples
from tests.models.test_attention import EXTRA_FAMILIES

FAMILIES = {**{name: dict(cfg, vocab_size=1000) for name, cfg in TINY_CONFIGS.items()}, **EXTRA_FAMILIES}
# Random-init logits are ~0.1: a cap of 0.1 (gemma2's is 30) makes the soft-cap change them for real.
FAMILIES["gemma2"] = dict(FAMILIES["gemma2"], final_logit_softcapping=0.1)
LENGTHS = [9, 4, 15, 6, 6, 11, 2, 8]


def make_lm(config: dict, **kwargs) -> PackedCausalLM:
    torch.manual_seed(0)
    return PackedCausalLM(model_config=config, attn_backend="per_example", **kwargs)


def loss_and_grads(lm: PackedCausalLM, outputs, batch, normalization: str):
    lm.zero_grad()
    parts = causal_lm_loss(outputs, batch, normalization)
    parts.objective.backward()
    grads = {name: p.grad.clone() for name, p in lm.named_parameters() if p.grad is not None}
    return parts, grads


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_chunked_loss_and_gradients_equal_full_logits(family, normalization):
    lm = make_lm(FAMILIES[family])
    batch = PackedCollator()(make_examples(LENGTHS))
    full, full_grads = loss_and_grads(lm, lm(batch), batch, normalization)
    inputs = lm.head_inputs(batch)
    inputs.chunk_size = 7  # several chunks, the last one partial
    chunked, grads = loss_and_grads(lm, inputs, batch, normalization)
    for field in ("objective", "normalizer", "token_loss_sum", "label_tokens"):
        torch.testing.assert_close(getattr(chunked, field), getattr(full, field), rtol=1e-6, atol=0)
    assert grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item(), msg=name)


def test_gemma2_soft_cap_is_applied():
    """Without the soft-cap the chunked logits would differ: the check is not vacuous."""
    lm = make_lm(FAMILIES["gemma2"])
    assert lm.hf_model.config.final_logit_softcapping
    batch = PackedCollator()(make_examples(LENGTHS[:3]))
    with torch.no_grad():
        inputs = lm.head_inputs(batch)
        capped = inputs.logits(inputs.hidden[0])
        inputs.softcap = None
        raw = inputs.logits(inputs.hidden[0])
        torch.testing.assert_close(capped, lm(batch)[0], rtol=1e-5, atol=1e-5)
    assert (raw - capped).abs().max() > 0.01


def test_lora_on_the_lm_head_chunked_equals_full():
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "lm_head"], "init_lora_weights": False}
    lm = make_lm(FAMILIES["qwen2"], lora=lora)
    assert "lora" in type(lm.hf_model.get_output_embeddings()).__module__
    batch = PackedCollator()(make_examples(LENGTHS))
    full, full_grads = loss_and_grads(lm, lm(batch), batch, "token")
    chunked, grads = loss_and_grads(lm, lm.head_inputs(batch), batch, "token")
    torch.testing.assert_close(chunked.objective, full.objective, rtol=1e-6, atol=0)
    assert full_grads and all("lora_" in name for name in full_grads)
    for name, grad in full_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item(), msg=name)


@pytest.mark.parametrize("kind", ["packed", "padded"])
def test_eval_sums_chunked_equal_full(kind):
    lm = make_lm(FAMILIES["llama"], loss_chunk_size=5)
    collate = PackedCollator() if kind == "packed" else PaddedCollator(pad_token_id=0)
    batch = collate(make_examples(LENGTHS))
    with torch.no_grad():
        full = eval_sums(lm(batch), batch["labels"])
        chunked = eval_sums(lm.loss_outputs(batch), batch["labels"])
    torch.testing.assert_close(chunked[0], full[0], rtol=1e-6, atol=0)
    assert chunked[1].item() == full[1].item() == batch["counts"]["label_tokens"]
    assert chunked[2].item() == full[2].item()


def test_empty_pack_gives_zero_loss_with_a_graph():
    lm = make_lm(FAMILIES["llama"])
    batch = PackedCollator()([])
    parts = causal_lm_loss(lm.head_inputs(batch), batch, "token")
    parts.objective.backward()
    assert parts.objective.item() == 0 and parts.label_tokens.item() == 0


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op creates (forward and backward alike)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("loss_impl", ["chunked", "full"])
def test_no_tensor_of_tokens_times_vocabulary(loss_impl):
    """fwd + bwd of a 600-token pack, vocabulary 8,192: the chunked loss never creates a (T, V) tensor."""
    config = dict(FAMILIES["llama"], vocab_size=8192)
    lm = make_lm(config, loss_impl=loss_impl, loss_chunk_size=64)
    batch = PackedCollator()(make_examples([150] * 4, vocab=8192))
    tokens, vocab = batch["input_ids"].shape[1], 8192
    with LargestTensor() as probe:
        causal_lm_loss(lm.loss_outputs(batch), batch, "token").objective.backward()
    if loss_impl == "full":
        assert probe.largest >= tokens * vocab
    else:
        assert probe.largest == vocab * 64  # one chunk's logits (or the (V, H) head gradient, smaller here)


def test_bad_loss_settings_are_clear_errors():
    """The core names its parameter; the model names the same check by its `model.*` path."""
    with pytest.raises(ConfigError, match="^model.loss_chunk_size: must be >= 1, got 0$"):
        make_lm(FAMILIES["llama"], loss_chunk_size=0)
    with pytest.raises(ConfigError, match="^model.loss_impl: liger sums .*; use model.loss_normalization=token or"):
        make_lm(FAMILIES["llama"], loss_impl="liger", loss_normalization="sequence")
    with pytest.raises(ConfigError, match="^model.loss_normalization: 'mean' is not a choice"):
        make_lm(FAMILIES["llama"], loss_normalization="mean")
    batch = PackedCollator()(make_examples([5, 7], vocab=64))
    with pytest.raises(ConfigError, match="^loss_normalization: 'mean' is not a choice; use token or sequence$"):
        causal_lm_loss(torch.randn(1, 12, 64), batch, "mean")


def test_liger_on_cpu_is_refused_at_setup():
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    lm = make_lm(FAMILIES["llama"], loss_impl="liger")
    trainer = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False)
    loader = DataLoader([PackedCollator()(make_examples(LENGTHS))], batch_size=None, collate_fn=lambda b: b)
    with pytest.raises(ValueError, match="model.loss_impl: liger runs Triton kernels on CUDA"):
        trainer.fit(lm, loader)


def test_model_that_rescales_its_logits_is_refused():
    cohere = dict(FAMILIES["llama"], model_type="cohere", logit_scale=0.25)
    with pytest.raises(ValueError, match="model.loss_impl=full"):
        make_lm(cohere)
    assert make_lm(cohere, loss_impl="full").hparams.loss_impl == "full"
