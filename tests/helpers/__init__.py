"""What many tests share: one tiny model config, one set of example builders, one per-example reference.

    from tests.helpers import TINY_LLAMA, make_examples, per_example_reference, packed_model

The reference runs each example alone (a (1, L) batch, fresh positions 0..L-1): what packing must reproduce.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lit_packing.models.loss import token_losses
from lit_packing.models.pack import pack_model

# SmolLM2's architecture (Llama, its vocabulary) at a toy size: 2 layers, hidden 64.
TINY_LLAMA = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 2048, "tie_word_embeddings": True,
}  # fmt: skip
# LoRA adapters on attention and MLP projections, as the sharded tests train and load them.
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def make_examples(lengths, vocab=1000, seed=0, masked=3):
    """Random examples of `lengths` tokens (ids 3..vocab), the first `n // masked` labels of each masked (-100)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
        out.append({"input_ids": ids, "labels": [-100] * (n // masked) + ids[n // masked :]})
    return out


def tiny_model(config: dict, attn: str = "sdpa", seed: int = 0):
    """A random-init transformers model of `config` (not packed), seeded."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), attn_implementation=attn)


def packed_model(config: dict, backend: str = "per_example", seed: int = 0, device=None):
    """`tiny_model` made packed by `pack_model` (the one way a packed model is built)."""
    model = tiny_model(config, seed=seed)
    pack_model(model, backend, device)
    return model


def per_example_reference(model, examples):
    """Logits (T, V) of each example run alone, concatenated, and the token-mean loss and gradients over all."""
    model.zero_grad()
    logits, total, count = [], 0.0, 0
    for ex in examples:
        out = model(input_ids=torch.tensor([ex["input_ids"]]), use_cache=False).logits
        losses, mask, _ = token_losses(out, torch.tensor([ex["labels"]]))
        total = total + losses.sum()
        count += int(mask.sum())
        logits.append(out[0].detach())
    loss = total / count
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return torch.cat(logits), loss.detach(), grads


def broken_backend() -> str:
    """Register (once) and return the name of a broken attention backend: plain causal sdpa over the whole packed
    row, ignoring `cu_seq_lens` (what the self-test must catch)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    def ignores_boundaries(module, query, key, value, attention_mask, cu_seq_lens_q=None, **kwargs):
        kwargs.pop("cu_seq_lens_k", None), kwargs.pop("max_length_q", None), kwargs.pop("max_length_k", None)
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)

    AttentionInterface.register(BROKEN, ignores_boundaries)
    AttentionMaskInterface.register(BROKEN, lambda *args, **kwargs: None)
    return BROKEN


BROKEN = "test_ignores_boundaries"
