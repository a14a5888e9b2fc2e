"""Packed preference objectives on the GPU path (simulated GPU, flash_attn and torch_varlen kernels under bf16
autocast): each sequence's log-probability and the objective's gradients within the noise of the exact per-example
backend at that precision, against the fp32 per-pair computation."""

from __future__ import annotations

import pytest
import torch

from lit_packing.batch import MODEL_KEYS
from lit_packing.data.collate import PairCollator
from lit_packing.models.pack import pack_model
from lit_packing.models.preference import OBJECTIVES, PairLogps, PreferenceSettings, pair_logps, preference_loss
from tests.emulated.machine import SimulatedGPU
from tests.emulated.test_backends import KERNEL_OPS, _grads
from tests.helpers import TINY_LLAMA, tiny_model
from tests.models.test_preference import make_pairs

PAIRS = make_pairs()


def run(model, backend: str | None, dtype, objective: str, reference: PairLogps | None):
    """The pairs packed through `backend` under autocast `dtype` (None: fp32, each sequence alone with sdpa)."""
    batch = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in PairCollator()(PAIRS).items()}
    if backend is None:
        model.set_attn_implementation("sdpa")
        logps = []
        for pair in PAIRS:
            single = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in PairCollator()([pair]).items()}
            sequences = [
                (a, b) for a, b in zip(single["cu_seq_lens_q"][:-1].tolist(), single["cu_seq_lens_q"][1:].tolist())
            ]
            logits = torch.cat(
                [model(input_ids=single["input_ids"][:, a:b], use_cache=False).logits for a, b in sequences], dim=1
            )
            logps.append(pair_logps(logits, single))
        policy = PairLogps(*(torch.cat([getattr(p, f) for p in logps]) for f in vars(logps[0])))
    else:
        pack_model(model, backend, "cuda")
        with torch.autocast("cuda", dtype=dtype):
            policy = pair_logps(model(**{k: batch[k] for k in MODEL_KEYS if k in batch}, use_cache=False).logits, batch)
    parts = preference_loss(policy, reference, PreferenceSettings(objective, beta=0.5))
    (parts.loss_sum / len(PAIRS)).backward()
    # the 2P sequence log-probabilities (a vector: one scalar loss's error against one scalar noise says little)
    return torch.cat([policy.chosen, policy.rejected]).detach().float(), _grads(model)


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
def test_packed_objectives_on_the_gpu_kernels_are_within_bf16_noise(backend, objective):
    with SimulatedGPU(flash_attn=backend == "flash_attn") as machine:
        model = tiny_model(dict(TINY_LLAMA, vocab_size=1000), attn="eager").to("cuda")
        reference = tiny_model(dict(TINY_LLAMA, vocab_size=1000), attn="eager", seed=1).to("cuda").eval()
        pack_model(reference, "per_example", "cuda")
        with torch.no_grad():
            ref_batch = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in PairCollator()(PAIRS).items()}
            ref = pair_logps(
                reference(**{k: ref_batch[k] for k in MODEL_KEYS if k in ref_batch}, use_cache=False).logits, ref_batch
            )
        exact = run(model, None, None, objective, ref)
        base = run(model, "per_example", torch.bfloat16, objective, ref)
        got = run(model, backend, torch.bfloat16, objective, ref)
        assert machine.kernel_calls[KERNEL_OPS[backend]] >= model.config.num_hidden_layers
    for name, g, b, r in zip(("log-probs", "gradients"), got, base, exact):
        error, noise = (g - r).norm().item(), (b - r).norm().item()
        assert error <= 2 * noise + 1e-5 * (1 + r.norm().item()), (
            f"{objective} {backend}: {name} {error:.3g} > 2 x {noise:.3g}"
        )
