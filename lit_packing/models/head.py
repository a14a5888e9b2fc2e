"""The LM head the loss runs on the final hidden states (the (T, V) logits are never built whole), and the checks
that it reproduces the model's own logits.

    inputs = head_inputs(model, batch, chunk_size=1024)      # HeadInputs(hidden (B, T, H), head, softcap, ...)
    check_head_inputs(model)                                  # at construction, on 8 tokens
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from lit_packing.batch import INPUT_IDS, model_inputs
from lit_packing.errors import ConfigError, install_hint
from lit_packing.models.loss import HeadInputs
from lit_packing.models.sharding import is_sharded


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def head_inputs(
    model: torch.nn.Module,
    batch: Mapping[str, Any],
    chunk_size: int = 1024,
    impl: Literal["chunked", "liger"] = "chunked",
) -> HeadInputs:
    """The final hidden states of a batch with the LM head, for a loss that never builds the (T, V) logits.
    `model` is the trained module (a peft model runs its adapters); its transformers model supplies the head."""
    hf = _base(model)
    if is_sharded(model):
        hidden = _sharded_hidden_states(model, hf, batch)
    else:
        hidden = hf.base_model(**model_inputs(batch), use_cache=False).last_hidden_state  # (B, T, H)
    config = hf.config.get_text_config()
    return HeadInputs(
        hidden,
        hf.get_output_embeddings(),
        softcap=getattr(config, "final_logit_softcapping", None),
        chunk_size=chunk_size,
        impl=impl,
    )


def _sharded_hidden_states(model: torch.nn.Module, hf: torch.nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """The decoder's last hidden states (B, T, H) of an FSDP2-sharded model, through the root's own forward: FSDP2
    gathers the root's parameters (embeddings, final norm, LM head) in the root's forward hook only, and keeps them
    gathered until the backward, so the head the loss then runs chunk by chunk holds its whole weight. The forward
    builds the logits of one position (`logits_to_keep=1`), not the (T, V) logits."""
    found: list[torch.Tensor] = []
    handle = hf.base_model.register_forward_hook(lambda module, args, out: found.append(out.last_hidden_state))
    try:
        model(**model_inputs(batch), use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    return found[0]


@torch.no_grad()
def check_head_inputs(model: torch.nn.Module) -> None:
    """The hidden-states path must give the model's own logits: a model that transforms its logits in a way
    `HeadInputs` does not know (only soft-capping is applied) is refused here, at construction, on 8 tokens."""
    hf = _base(model)
    ids = torch.arange(3, 11, device=hf.device)[None] % hf.config.get_text_config().vocab_size
    was_training = hf.training
    hf.eval()
    try:
        batch = {INPUT_IDS: ids}
        expected = model(**model_inputs(batch), use_cache=False).logits[0]
        inputs = head_inputs(model, batch)
        got = inputs.logits(inputs.hidden[0])
    finally:
        hf.train(was_training)
    scale = max(1.0, expected.abs().max().item())
    if not torch.allclose(got, expected, rtol=0, atol=1e-4 * scale):
        raise ConfigError(
            "model.loss_impl",
            f"{type(hf).__name__}'s LM head applied to its final hidden states does not reproduce its logits (the "
            "model rescales them in its forward)",
            "set model.loss_impl=full",
        )


def check_liger(device: torch.device, head: torch.nn.Module) -> None:
    """`loss_impl=liger` needs CUDA, the liger-kernel package and a plain linear LM head."""
    if device.type != "cuda":
        raise ConfigError("model.loss_impl", f"liger runs Triton kernels on CUDA, not on {device}", "use chunked")
    try:
        import liger_kernel  # noqa: F401
    except ImportError as err:
        raise ConfigError("model.loss_impl", "liger needs liger-kernel", install_hint("liger")) from err
    if type(head) is not torch.nn.Linear:
        raise ConfigError("model.loss_impl", f"liger needs a plain nn.Linear LM head, not {type(head).__name__}")
