"""Shared prompts on the GPU kernels (simulated GPU, flash_attn and torch_varlen under bf16 autocast): the gathered
keys with their own `cu_seqlens_k`, causality bottom-right aligned by the kernel, give each sequence's
log-probability and the objective's gradients within the noise of the exact per-example backend at that precision,
against the fp32 unshared pairs."""

from __future__ import annotations

import pytest
import torch

from lit_packing.batch import model_inputs
from lit_packing.data.collate import PairCollator
from lit_packing.models.pack import pack_model
from lit_packing.models.preference import PreferenceSettings, pair_logps, preference_loss
from tests.emulated.machine import SimulatedGPU
from tests.emulated.test_backends import KERNEL_OPS, _grads
from tests.helpers import TINY_LLAMA, tiny_model
from tests.models.test_preference import make_pairs

PAIRS = make_pairs()


def run(model, backend: str, dtype, share: bool):
    batch = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in PairCollator(share_prompt=share)(PAIRS).items()}
    pack_model(model, backend, "cuda")
    with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
        policy = pair_logps(model(**model_inputs(batch), use_cache=False).logits, batch)
    parts = preference_loss(policy, None, PreferenceSettings("simpo", beta=0.5))
    (parts.loss_sum / len(PAIRS)).backward()
    return torch.cat([policy.chosen, policy.rejected]).detach().float(), _grads(model)


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
def test_shared_prompts_on_the_gpu_kernels_are_within_bf16_noise(backend):
    with SimulatedGPU(flash_attn=backend == "flash_attn") as machine:
        model = tiny_model(dict(TINY_LLAMA, vocab_size=1000), attn="eager").to("cuda")
        exact = run(model, "per_example", None, share=False)
        base = run(model, "per_example", torch.bfloat16, share=False)
        calls = machine.kernel_calls.get(KERNEL_OPS[backend], 0)
        got = run(model, backend, torch.bfloat16, share=True)
        assert machine.kernel_calls[KERNEL_OPS[backend]] - calls >= model.config.num_hidden_layers
    for name, g, b, r in zip(("log-probs", "gradients"), got, base, exact):
        error, noise = (g - r).norm().item(), (b - r).norm().item()
        assert error <= 2 * noise + 1e-5 * (1 + r.norm().item()), f"{backend}: {name} {error:.3g} > 2 x {noise:.3g}"
