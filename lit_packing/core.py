"""The packing core without Lightning: what a plain PyTorch loop or a Hugging Face `Trainer` imports.

    from lit_packing.core import BestFitPackingSampler, PackedCollator, attn_implementation, causal_lm_loss

    sampler = BestFitPackingSampler(lengths, max_tokens=4096)             # lengths in, packs of indices out
    loader = DataLoader(examples, batch_sampler=sampler, collate_fn=PackedCollator())
    model.set_attn_implementation(attn_implementation(resolve_backend("auto", "cuda")))
    for batch in loader:
        parts = causal_lm_loss(model(**model_inputs(batch, "cuda"), use_cache=False).logits, batch)
        (parts.token_loss_sum / parts.label_tokens).backward()

A batch is one flattened row with restarting `position_ids` and `cu_seq_lens` (Hugging Face's key names); the
attention backends keep its examples apart in every layer; the loss is the padded loss. Nothing here imports
Lightning (a test checks it). docs/core.md runs a plain PyTorch loop and a Hugging Face `Trainer` on it.
"""

from lit_packing.batch import IGNORE_INDEX, MODEL_KEYS, attach_step, model_inputs
from lit_packing.data.collate import PackedCollator, PaddedCollator
from lit_packing.errors import ConfigError, DataError, IsolationError, LitPackingError
from lit_packing.models.attention import BACKENDS, attn_implementation, resolve_backend
from lit_packing.models.isolation import check_isolation, check_packed_batch
from lit_packing.models.loss import LossParts, causal_lm_loss
from lit_packing.samplers import (
    BestFitPackingSampler,
    FixedLengthPackingSampler,
    LengthGroupedSampler,
    MultipackSampler,
    PackPlan,
    RandomBatchSampler,
    SequentialPackingSampler,
)

__all__ = [
    "BACKENDS",
    "IGNORE_INDEX",
    "MODEL_KEYS",
    "BestFitPackingSampler",
    "ConfigError",
    "DataError",
    "FixedLengthPackingSampler",
    "IsolationError",
    "LengthGroupedSampler",
    "LitPackingError",
    "LossParts",
    "MultipackSampler",
    "PackPlan",
    "PackedCollator",
    "PaddedCollator",
    "RandomBatchSampler",
    "SequentialPackingSampler",
    "attach_step",
    "attn_implementation",
    "causal_lm_loss",
    "check_isolation",
    "check_packed_batch",
    "model_inputs",
    "resolve_backend",
]
