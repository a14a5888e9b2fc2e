"""flash_attn and torch_varlen on the simulated GPU: the per-example backend's exactness tests, run through the real
Python paths above the kernels (families, sliding windows, softcap, GQA / MQA, custom scale, a head_dim that is not
a multiple of 8, fp32 and half inputs, gradients).

The reference is each example run alone in fp32; a kernel backend's packed logits, loss and gradients must lie
within twice the error of the exact per-example backend run packed at the same precision (the noise of a plain
PyTorch half-precision run), as flash-attention's own tests judge a half-precision kernel."""

from __future__ import annotations

import contextlib

import pytest
import torch

from lit_packing.data.collate import PackedCollator, PaddedCollator
from lit_packing.models.backends import resolve_backend
from lit_packing.models.loading import load_causal_lm
from lit_packing.models.loss import token_losses
from lit_packing.models.mixers import find_mixers
from lit_packing.models.pack import pack_model
from tests.conftest import TINY_CONFIGS
from tests.emulated.machine import SimulatedGPU
from tests.helpers import make_examples, tiny_model
from tests.models.families import tiny_config
from tests.models.test_attention import EXTRA_FAMILIES, LENGTHS, MODEL_KEYS

FAMILIES = {
    **{name: dict(config, vocab_size=1000) for name, config in TINY_CONFIGS.items()},
    **EXTRA_FAMILIES,
    # scale 8**-0.5, not head_dim**-0.5; weights large enough that the scores (about +-5) meet the cap of 1
    "gemma2_scaled": dict(
        EXTRA_FAMILIES["gemma2"], query_pre_attn_scalar=8, attn_logit_softcapping=1.0, initializer_range=0.3
    ),
    "llama_head_dim_12": dict(TINY_CONFIGS["llama"], vocab_size=1000, hidden_size=48),  # 4 heads of 12
}
SOFTCAP = ("gemma2", "gemma2_scaled")  # torch_varlen has no softcap: refused (test_findings)
KERNEL_OPS = {"flash_attn": "flash_attn_2_cuda.varlen_fwd", "torch_varlen": "aten::_flash_attention_forward"}
EXAMPLES = make_examples([9, 3, 12, 9, 1, 6])


@pytest.fixture(params=["flash_attn", "torch_varlen"])
def gpu(request):
    """(backend, machine): flash_attn on a machine that has flash-attn; torch_varlen on one that does not."""
    backend = request.param
    with SimulatedGPU(flash_attn=backend == "flash_attn") as machine:
        assert resolve_backend("auto", "cuda") == backend  # what `auto` picks there
        yield backend, machine


def _autocast(dtype):
    return torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _grads(model) -> torch.Tensor:
    flat = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
    model.zero_grad()
    return flat


def per_example(model, examples, attn):
    """Every example alone (fresh positions) with transformers' `attn`, fp32: logits, per-token losses (the label
    tokens in order) and the gradients of their mean."""
    model.set_attn_implementation(attn)
    logits, token_loss, count = [], [], 0
    for ex in examples:
        out = model(input_ids=torch.tensor([ex["input_ids"]], device="cuda"), use_cache=False).logits
        losses, mask, _ = token_losses(out, torch.tensor([ex["labels"]], device="cuda"))
        token_loss.append(losses[mask])
        count += int(mask.sum())
        logits.append(out[0].float())
    token_loss = torch.cat(token_loss)
    (token_loss.sum() / count).backward()
    return torch.cat(logits), token_loss.detach().float(), _grads(model)


def packed(model, examples, backend, dtype):
    """One packed row through `backend`, under autocast to `dtype` (None: none): logits, per-token losses and
    the gradients of their mean."""
    pack_model(model, backend, "cuda")
    batch = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in PackedCollator()(examples).items()}
    with _autocast(dtype):
        logits = model(**{k: batch[k] for k in MODEL_KEYS}, use_cache=False).logits
        losses, mask, _ = token_losses(logits, batch["labels"])
        loss = losses.sum() / mask.sum()
    loss.backward()
    return logits[0].float(), losses[mask].detach().float(), _grads(model)


def assert_within_noise(got, base, ref, what):
    """Each of logits / per-token losses / gradients: |got - ref| <= 2 |base - ref| (+ a floor for exact agreement).
    Token by token, not their mean: one scalar's error is no estimate of the precision's noise (the mean of a bf16
    run's token losses can land within 4e-6 of fp32's by cancellation while its tokens differ by 1e-2)."""
    for name, g, b, r in zip(("logits", "token losses", "gradients"), got, base, ref):
        error, noise = (g - r).norm().item(), (b - r).norm().item()
        assert error <= 2 * noise + 1e-5 * (1 + r.norm().item()), f"{what}: {name} error {error:.3g} > 2 x {noise:.3g}"


CASES = [
    (backend, family, dtype)
    for backend in ("flash_attn", "torch_varlen")
    for family, dtype in [(f, torch.bfloat16) for f in sorted(FAMILIES)]
    + [(f, d) for f in ("llama", "mistral", "gemma2_scaled", "llama_head_dim_12") for d in (torch.float16, None)]
    if not (backend == "torch_varlen" and family in SOFTCAP)  # no softcap: refused at construction (test_findings)
]


@pytest.mark.parametrize(
    "backend, family, dtype", CASES, ids=[f"{b}-{f}-{str(d).removeprefix('torch.')}" for b, f, d in CASES]
)
def test_packed_logits_loss_grads_match_per_example(backend, family, dtype):
    with SimulatedGPU(flash_attn=backend == "flash_attn") as machine:
        model = tiny_model(FAMILIES[family], attn="eager").to("cuda")
        reference = "eager" if family.startswith("gemma2") else "sdpa"
        ref = per_example(model, EXAMPLES, reference)
        base = packed(model, EXAMPLES, "per_example", dtype or torch.bfloat16)  # plain PyTorch at that precision
        got = packed(model, EXAMPLES, backend, dtype)
        assert machine.kernel_calls[KERNEL_OPS[backend]] == model.config.num_hidden_layers  # the kernel ran
    assert_within_noise(got, base, ref, f"{backend} {family} {dtype}")


def test_boundaries_from_position_ids_alone(gpu):
    """No cu_seq_lens, restarting position_ids: the kernel still keeps the examples apart."""
    backend, _ = gpu
    model = tiny_model(FAMILIES["llama"]).to("cuda").eval()
    batch = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in PackedCollator()(EXAMPLES).items()}
    with torch.no_grad(), _autocast(torch.bfloat16):
        pack_model(model, "per_example", "cuda")
        ref = model(**{k: batch[k] for k in MODEL_KEYS}, use_cache=False).logits
        pack_model(model, backend, "cuda")
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=5e-2)


def test_a_padded_batch_runs_sdpa_with_its_mask(gpu):
    backend, machine = gpu
    model = tiny_model(FAMILIES["llama"]).to("cuda").eval()
    batch = PaddedCollator(pad_token_id=0)(make_examples(LENGTHS))
    inputs = {"input_ids": batch["input_ids"].to("cuda"), "attention_mask": batch["attention_mask"].to("cuda")}
    with torch.no_grad():
        ref = model(**inputs, use_cache=False).logits
        pack_model(model, backend, "cuda")
        out = model(**inputs, use_cache=False).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=1e-5)
    assert machine.kernel_calls == {}  # padded rows never reach a varlen kernel


def test_flash_attn_attention_dropout_trains(emulated_gpu):
    """Attention dropout goes to flash-attn's kernel (torch_varlen has none: `auto` skips it for such a model)."""
    model = tiny_model(dict(FAMILIES["llama"], attention_dropout=0.5)).to("cuda").train()
    pack_model(model, "flash_attn", "cuda")
    batch = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in PackedCollator()(EXAMPLES).items()}
    inputs = {k: batch[k] for k in MODEL_KEYS}
    with _autocast(torch.bfloat16):
        first, second = (model(**inputs, use_cache=False).logits for _ in range(2))
    second.float().sum().backward()
    assert not torch.equal(first, second)  # a new dropout mask each call
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


HYBRIDS = ("bamba", "qwen3_next", "lfm2")  # Mamba 2, gated delta net, short convolution beside attention layers


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrids_pack_exactly_on_the_gpu_path(backend, family):
    """The per-example mixers beside each kernel backend, under bf16 autocast on the simulated GPU: within the
    noise of the exact per-example backend at that precision, the kernel called for the attention layers."""
    with SimulatedGPU(flash_attn=backend == "flash_attn") as machine:
        torch.manual_seed(0)
        model = load_causal_lm(model_config=tiny_config(family)).model.to("cuda")
        assert find_mixers(model)  # the mixers run per example (load_causal_lm)
        ref = per_example(model, EXAMPLES, "sdpa")
        base = packed(model, EXAMPLES, "per_example", torch.bfloat16)
        got = packed(model, EXAMPLES, backend, torch.bfloat16)
        assert machine.kernel_calls[KERNEL_OPS[backend]] >= 1  # its attention layers ran the kernel
    assert_within_noise(got, base, ref, f"{backend} {family}")
