"""The packing core without Lightning: what a plain PyTorch loop or a Hugging Face `Trainer` imports.

    from lit_packing.core import BestFitPackingSampler, PackedCollator, causal_lm_loss, model_inputs, pack_model

    sampler = BestFitPackingSampler(lengths, max_tokens=4096)             # lengths in, packs of indices out
    loader = DataLoader(examples, batch_sampler=sampler, collate_fn=PackedCollator())
    packing = pack_model(model.to("cuda"))   # backend, mixers per example, probe; refuses what cannot pack
    for batch in loader:
        parts = causal_lm_loss(model(**model_inputs(batch, "cuda"), use_cache=False).logits, batch)
        (parts.token_loss_sum / parts.label_tokens).backward()

A batch is one flattened row with restarting `position_ids` and `cu_seq_lens` (Hugging Face's key names);
`pack_model` makes a model keep its examples apart in every layer (attention and every other token mixer), and a
packed row reaching a model it did not build is refused; the loss is the padded loss. Nothing here imports
Lightning (a test checks it). docs/core.md runs a plain PyTorch loop and a Hugging Face `Trainer` on it.
"""

from lit_packing.batch import IGNORE_INDEX, MODEL_KEYS, attach_step, model_inputs
from lit_packing.data.collate import PackedCollator, PaddedCollator, PairCollator
from lit_packing.errors import ConfigError, DataError, IsolationError, LitPackingError
from lit_packing.models.backends import BACKENDS
from lit_packing.models.guard import check_packed_batch
from lit_packing.models.loss import LossParts, causal_lm_loss
from lit_packing.models.pack import Packing, pack_model
from lit_packing.models.preference import PairLogps, PreferenceSettings, pair_logps, preference_loss
from lit_packing.models.selftest import check_isolation
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
    "Packing",
    "PaddedCollator",
    "PairCollator",
    "PairLogps",
    "PreferenceSettings",
    "RandomBatchSampler",
    "SequentialPackingSampler",
    "attach_step",
    "causal_lm_loss",
    "check_isolation",
    "check_packed_batch",
    "model_inputs",
    "pack_model",
    "pair_logps",
    "preference_loss",
]
