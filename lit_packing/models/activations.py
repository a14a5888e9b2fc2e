"""What autograd keeps for the backward of a forward, measured on the real model: the activation part of the
start-up memory estimate (`models.memory`).

    activation_model(lm, padded=False)      # (a, b, c): saved bytes ~= a + b * tokens + c * attention pairs

Three probes of 64, 128 and 256 tokens run a forward each under `saved_tensors_hooks`; the bytes of every distinct
storage saved that is not a weight (nor, sharded, a gathered weight) are summed, then fitted, so a longer step is
arithmetic. A vision-language model's images cost more than their tokens: `image_token_bytes` measures what its
vision tower and connector keep per image token, on documents with images made from its config.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lit_packing.batch import (
    ATTENTION_MASK,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    IMAGE_KEYS,
    INPUT_IDS,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    POSITION_IDS,
)
from lit_packing.models.sharding import is_sharded, local_tensor
from lit_packing.models.vlm import pack_vlm_documents, probe_documents

PROBE_LENGTHS = (64, 128, 256)


def _probe_batch(lm: Any, length: int, padded: bool) -> dict[str, Any]:
    ids = (torch.arange(length, device=lm.device) % 1000 + 3)[None]
    if padded:
        return {INPUT_IDS: ids, ATTENTION_MASK: torch.ones_like(ids)}
    cu = torch.tensor([0, length], dtype=torch.int32, device=lm.device)
    return {
        INPUT_IDS: ids,
        POSITION_IDS: torch.arange(length, device=lm.device)[None],
        CU_SEQ_LENS_Q: cu,
        CU_SEQ_LENS_K: cu,
        MAX_LENGTH_Q: length,
        MAX_LENGTH_K: length,
    }


def saved_activation_bytes(lm: Any, length: int, padded: bool) -> int:
    """Bytes autograd keeps for backward in one forward of the decoder on `length` tokens (weights excluded): the
    `saved_bytes` of a probe row (packed) or a masked row (`padded`)."""
    return saved_bytes(lm, _probe_batch(lm, length, padded))


def saved_bytes(lm: Any, batch: dict[str, Any]) -> int:
    """Bytes autograd keeps for backward in one forward of `batch` to the LM head's inputs (weights excluded).

    Runs in eval mode (no dropout; transformers only checkpoints layers in train mode, so this is the full
    activation memory) under the trainer's precision context.
    """
    weights = {local_tensor(p).untyped_storage().data_ptr() for p in lm.parameters()}
    sharded = is_sharded(lm.model)
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = local_tensor(tensor).untyped_storage()  # with tensor parallel, a split tensor: this rank's part
        # Sharded, a layer's gathered parameters are its module's parameters while it runs (with tensor parallel,
        # DTensors of this rank's split): weights, not activations.
        gathered = {local_tensor(p).untyped_storage().data_ptr() for p in lm.parameters()} if sharded else ()
        if storage.data_ptr() not in weights and storage.data_ptr() not in gathered and tensor.device.type != "meta":
            seen[storage.data_ptr()] = storage.nbytes()
        # Detached: a hook that returns a saved output itself ties it to its own graph node, a reference cycle
        # that outlives the forward (each probe's activations leaked, 0.3 GiB at 256 tokens on SmolLM2).
        # Holding the storage until the forward ends keeps two saved tensors from sharing an address.
        return tensor.detach()

    was_training = lm.hf_model.training
    lm.hf_model.eval()
    try:
        with torch.enable_grad(), lm.forward_context(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lm.head_inputs(batch).hidden.sum()
    finally:
        lm.hf_model.train(was_training)
    return sum(seen.values())


def activation_model(lm: Any, padded: bool) -> np.ndarray:
    """(a, b, c): saved bytes ~= a + b * tokens + c * attention pairs, fitted to the probes."""
    lengths = np.asarray(PROBE_LENGTHS, dtype=np.float64)
    measured = [saved_activation_bytes(lm, int(n), padded) for n in PROBE_LENGTHS]
    design = np.stack([np.ones_like(lengths), lengths, lengths**2], axis=1)
    return np.linalg.lstsq(design, np.asarray(measured, dtype=np.float64), rcond=None)[0]


def image_token_bytes(lm: Any) -> float:
    """Bytes autograd keeps per image token beyond what a text token keeps, for a vision-language model (0 for
    others): its vision tower's and connector's activations, measured as the `saved_bytes` of a packed row of
    `vlm.probe_documents` (images of two sizes: Idefics3 tiles and LLaVA images of the model's own size) less those
    of the same tokens without the images, over its image tokens."""
    hf = lm.hf_model
    if getattr(hf.config, "vision_config", None) is None:
        return 0.0
    batch = pack_vlm_documents(hf, probe_documents(hf.config))
    batch = {k: v.to(lm.device) if torch.is_tensor(v) else v for k, v in batch.items()}
    text = {k: v for k, v in batch.items() if k not in IMAGE_KEYS}  # the image tokens read as text tokens
    image_tokens = int((batch[INPUT_IDS] == hf.config.image_token_id).sum())
    return max(0.0, (saved_bytes(lm, batch) - saved_bytes(lm, text)) / image_tokens)
