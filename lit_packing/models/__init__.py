"""Models: the varlen attention backends, the loss and the isolation self-test (the Lightning-free core), and
`PackedCausalLM`, the LightningModule on top (with its memory estimate and model loading).

`PackedCausalLM` is imported on first use (PEP 562), so `lit_packing.models.attention`, `.loss` and `.isolation`
import without Lightning, for plain PyTorch or Hugging Face Trainer users.
"""

from lit_packing.errors import IsolationError
from lit_packing.models.attention import BACKENDS, attn_implementation, register_backends, resolve_backend
from lit_packing.models.isolation import check_isolation, check_packed_batch
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


def __getattr__(name: str):
    if name == "PackedCausalLM":  # the Lightning layer, imported only when asked for
        from lit_packing.models.causal_lm import PackedCausalLM

        return PackedCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
