"""Varlen backends: packed forward / loss / gradients == each example alone, on tiny models of real families."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lit_packing.batch import INPUT_IDS, PACKED_KEYS, POSITION_IDS
from lit_packing.data.collate import PackedCollator, PaddedCollator
from lit_packing.models.backends import resolve_backend
from lit_packing.models.loss import token_losses
from lit_packing.models.pack import pack_model
from lit_packing.models.segments import boundaries_from_positions
from tests.helpers import make_examples, per_example_reference, tiny_model

# Two examples of equal length (one batched call), a 1-token example, prompts masked with -100.
LENGTHS = [7, 3, 12, 7, 1, 5]
CPU_BACKENDS = ["per_example", "sdpa_mask"]
MODEL_KEYS = (INPUT_IDS, POSITION_IDS, *PACKED_KEYS[:4])  # what the model reads of a packed batch


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_packed_logits_loss_grads_match_per_example(tiny_config, backend):
    model = tiny_model(tiny_config)
    examples = make_examples(LENGTHS)
    ref_logits, ref_loss, ref_grads = per_example_reference(model, examples)

    pack_model(model, backend)
    batch = PackedCollator()(examples)
    logits = model(**{k: batch[k] for k in MODEL_KEYS}, use_cache=False).logits
    losses, mask, _ = token_losses(logits, batch["labels"])
    loss = losses.sum() / mask.sum()
    loss.backward()

    torch.testing.assert_close(logits[0], ref_logits, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(loss.detach(), ref_loss, atol=1e-6, rtol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name], atol=1e-6, rtol=1e-4, msg=name)


EXTRA_FAMILIES = {
    # sliding window shorter than the examples; GQA
    "mistral": dict(
        model_type="mistral",
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
    ),
    # attention logit softcap + alternating sliding layers (no sdpa kernel: reference is eager)
    "gemma2": dict(
        model_type="gemma2",
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        attn_logit_softcapping=5.0,
    ),
    # q/k norms, explicit head_dim
    "qwen3": dict(
        model_type="qwen3",
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    # scaled embeddings, GeGLU, multi-query attention
    "gemma": dict(
        model_type="gemma",
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
    ),
    # fused qkv / gate-up projections
    "phi3": dict(
        model_type="phi3",
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # learned absolute positions
    "gpt2": dict(
        model_type="gpt2",
        vocab_size=1000,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ),
}


@pytest.mark.parametrize("family", sorted(EXTRA_FAMILIES))
def test_per_example_other_families(family):
    model = tiny_model(EXTRA_FAMILIES[family], attn="eager").eval()
    examples = make_examples([9, 3, 12, 9])
    with torch.no_grad():
        ref = torch.cat([model(input_ids=torch.tensor([e["input_ids"]]), use_cache=False).logits[0] for e in examples])
        pack_model(model, "per_example")
        batch = PackedCollator()(examples)
        out = model(**{k: batch[k] for k in MODEL_KEYS}, use_cache=False).logits[0]
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_padded_batch_through_backend_equals_sdpa(tiny_llama_config):
    """A padded batch (2D attention_mask) through a packed backend runs sdpa with the usual mask."""
    model = tiny_model(tiny_llama_config).eval()
    batch = PaddedCollator(pad_token_id=0)(make_examples(LENGTHS))
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        ref = model(**inputs, use_cache=False).logits
        pack_model(model, "per_example")
        out = model(**inputs, use_cache=False).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=1e-5)


def test_without_cu_seq_lens_boundaries_come_from_position_ids(tiny_llama_config):
    """No cu_seq_lens but restarting position_ids: still isolated (never silently one long sequence)."""
    model = tiny_model(tiny_llama_config).eval()
    examples = make_examples(LENGTHS)
    batch = PackedCollator()(examples)
    with torch.no_grad():
        ref = model(**{k: batch[k] for k in MODEL_KEYS}, use_cache=False).logits
        pack_model(model, "per_example")
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_boundaries_from_positions():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert boundaries_from_positions(pos, 1, 9, torch.device("cpu")).tolist() == [0, 3, 5, 9]
    assert boundaries_from_positions(None, 2, 4, torch.device("cpu")).tolist() == [0, 4, 8]


def test_per_example_one_call_per_distinct_length(tiny_llama_config, monkeypatch):
    """150 examples of 2 distinct lengths -> 2 SDPA calls per layer, not 150."""
    model = tiny_model(tiny_llama_config).eval()
    pack_model(model, "per_example")
    batch = PackedCollator()(make_examples([4] * 100 + [3] * 50))
    calls, sdpa = [], F.scaled_dot_product_attention

    def counting_sdpa(*args, **kwargs):
        calls.append(args[0].shape)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr("lit_packing.models.kernels.F.scaled_dot_product_attention", counting_sdpa)
    with torch.no_grad():
        model(**{k: batch[k] for k in MODEL_KEYS}, use_cache=False)
    layers = tiny_llama_config["num_hidden_layers"]
    assert len(calls) == 2 * layers
    assert sorted(shape[0] for shape in calls[:2]) == [50, 100]  # examples batched per call


def test_auto_picks_per_example_without_gpu():
    assert resolve_backend("auto", "cpu") == "per_example"
    assert resolve_backend("sdpa_mask", "cpu") == "sdpa_mask"
    with pytest.raises(ValueError, match="attn_backend=auto"):
        resolve_backend("torch_varlen", "cpu")
    with pytest.raises(ValueError, match="attn_backend: unknown backend 'xformers'"):
        resolve_backend("xformers", "cpu")


# ---------------------------------------------------------------------------------------------------------------
# GPU: flash_attn and torch_varlen against an fp32 reference, tolerance from a plain bf16 PyTorch run


def _gpu_backends():
    from lit_packing.models.backends import flash_attn_installed

    backends = ["torch_varlen"]
    if flash_attn_installed():
        backends.append("flash_attn")
    return backends


def _kernel_inputs(lengths, heads=8, kv_heads=2, dim=64, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads, dim, device="cuda", generator=gen)
    k = torch.randn(total, kv_heads, dim, device="cuda", generator=gen)
    v = torch.randn(total, kv_heads, dim, device="cuda", generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, cu


def _per_example_sdpa(q, k, v, cu, window=None):
    outs = []
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
        mask = None
        if window is not None:
            i = torch.arange(b - a, device=q.device)
            dist = i[:, None] - i[None, :]
            mask = (dist >= 0) & (dist < window)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.cuda
@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("backend", _gpu_backends() if torch.cuda.is_available() else ["torch_varlen"])
def test_gpu_kernel_matches_fp32_reference(backend, window):
    from lit_packing.models import kernels

    kernel = {"torch_varlen": kernels.torch_varlen, "flash_attn": kernels.flash_attn_varlen}[backend]
    lengths = [1, 17, 200, 513, 64, 64, 1000]
    q, k, v, cu = _kernel_inputs(lengths)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _per_example_sdpa(*leaves, cu, window)  # fp32
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, leaves, grad_out)

    low = [x.detach().bfloat16().requires_grad_() for x in (q, k, v)]
    base = _per_example_sdpa(*low, cu, window)  # plain PyTorch bf16: the noise floor
    base_grads = torch.autograd.grad(base, low, grad_out.bfloat16())

    var = [x.detach().bfloat16().requires_grad_() for x in (q, k, v)]
    out = kernel(
        *var, cu, cu, max(lengths), max(lengths), causal=True, scale=64**-0.5, window=window, softcap=None, dropout=0.0
    )
    grads = torch.autograd.grad(out, var, grad_out.bfloat16())

    def err(a, b):
        return (a.float() - b.float()).abs().max().item()

    assert err(out, ref) <= 2 * err(base, ref) + 1e-5
    for g, bg, rg in zip(grads, base_grads, ref_grads):
        assert err(g, rg) <= 2 * err(bg, rg) + 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("backend", _gpu_backends() if torch.cuda.is_available() else ["torch_varlen"])
def test_gpu_model_packed_matches_fp32_per_example(tiny_llama_config, backend):
    config = dict(tiny_llama_config, hidden_size=256, intermediate_size=512, num_attention_heads=4)
    model = tiny_model(config).cuda().eval()
    examples = make_examples([37, 5, 300, 128, 128])

    def alone():
        ids = [torch.tensor([e["input_ids"]], device="cuda") for e in examples]
        return torch.cat([model(input_ids=x, use_cache=False).logits[0] for x in ids])

    with torch.no_grad():
        ref = alone()  # fp32
        with torch.autocast("cuda", dtype=torch.bfloat16):
            base = alone()  # plain bf16 sdpa: the noise floor
            pack_model(model, resolve_backend(backend, "cuda"))
            batch = PackedCollator()(examples)
            inputs = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in batch.items() if k in MODEL_KEYS}
            out = model(**inputs, use_cache=False).logits[0]
    base_err = (base.float() - ref).abs().max().item()
    assert (out.float() - ref).abs().max().item() <= 2 * base_err + 1e-4


def test_flash_attn_on_a_cpu_names_backends_that_work_here():
    from lit_packing.models.backends import resolve_backend

    with pytest.raises(ValueError, match=r"attn_backend=auto .*per_example") as error:
        resolve_backend("flash_attn", "cpu")
    assert "pip install" not in str(error.value)  # installing cannot help without a GPU
