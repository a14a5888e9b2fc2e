"""The LightningModule and the varlen attention backends."""

from lit_packing.models.attention import BACKENDS, attn_implementation, register_backends, resolve_backend
from lit_packing.models.causal_lm import PackedCausalLM
from lit_packing.models.isolation import IsolationError, check_isolation, check_packed_batch
from lit_packing.models.loss import LossParts, causal_lm_loss

__all__ = [
    "BACKENDS",
    "IsolationError",
    "LossParts",
    "PackedCausalLM",
    "attn_implementation",
    "check_isolation",
    "check_packed_batch",
    "causal_lm_loss",
    "register_backends",
    "resolve_backend",
]
