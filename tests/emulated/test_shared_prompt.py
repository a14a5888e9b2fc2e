"""Shared prompts on the GPU kernels (simulated GPU, flash_attn and torch_varlen under bf16 autocast): the gathered
keys with their own `cu_seqlens_k`, causality bottom-right aligned by the kernel, give each sequence's
log-probability (a pair's sides, a rollout group's completion tokens) and the objective's gradients within the
noise of the exact per-example backend at that precision, against the fp32 unshared pairs or groups."""

from __future__ import annotations

import pytest
import torch

from lit_packing.batch import model_inputs
from lit_packing.data.collate import PairCollator
from lit_packing.data.groups import GroupCollator
from lit_packing.models.grpo import GRPOSettings, completion_logps, group_advantages, grpo_loss
from lit_packing.models.pack import pack_model
from lit_packing.models.preference import PreferenceSettings, pair_logps, preference_loss
from tests.emulated.machine import SimulatedGPU
from tests.emulated.test_backends import KERNEL_OPS, _grads
from tests.helpers import TINY_LLAMA, tiny_model
from tests.models.test_grpo import make_groups
from tests.models.test_preference import make_pairs

PAIRS = make_pairs()
GROUPS = make_groups()


def run(model, backend: str, dtype, share: bool, kind: str):
    collate = PairCollator(share_prompt=share) if kind == "pairs" else GroupCollator(share_prompt=share)
    batch = {
        k: v.to("cuda") if torch.is_tensor(v) else v for k, v in collate(PAIRS if kind == "pairs" else GROUPS).items()
    }
    pack_model(model, backend, "cuda")
    with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
        logits = model(**model_inputs(batch), use_cache=False).logits
    if kind == "pairs":
        policy = pair_logps(logits, batch)
        parts = preference_loss(policy, None, PreferenceSettings("simpo", beta=0.5))
        (parts.loss_sum / len(PAIRS)).backward()
        return torch.cat([policy.chosen, policy.rejected]).detach().float(), _grads(model)
    policy, settings = completion_logps(logits, batch), GRPOSettings("dapo")
    parts = grpo_loss(policy, group_advantages(batch["rewards"], batch["groups"], settings), settings)
    (parts.loss_sum / len(policy.logps)).backward()
    return policy.logps.detach().float(), _grads(model)


@pytest.mark.parametrize("kind", ["pairs", "groups"])
@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
def test_shared_prompts_on_the_gpu_kernels_are_within_bf16_noise(backend, kind):
    with SimulatedGPU(flash_attn=backend == "flash_attn") as machine:
        model = tiny_model(dict(TINY_LLAMA, vocab_size=1000), attn="eager").to("cuda")
        exact = run(model, "per_example", None, share=False, kind=kind)
        base = run(model, "per_example", torch.bfloat16, share=False, kind=kind)
        calls = machine.kernel_calls.get(KERNEL_OPS[backend], 0)
        got = run(model, backend, torch.bfloat16, share=True, kind=kind)
        assert machine.kernel_calls[KERNEL_OPS[backend]] - calls >= model.config.num_hidden_layers
    for name, g, b, r in zip(("log-probs", "gradients"), got, base, exact):
        error, noise = (g - r).norm().item(), (b - r).norm().item()
        assert error <= 2 * noise + 1e-5 * (1 + r.norm().item()), f"{backend}: {name} {error:.3g} > 2 x {noise:.3g}"
