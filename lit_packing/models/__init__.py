"""Models: `pack_model` (the one way to make a transformers causal LM train packed), the attention backends, the
loss, the guards (batch check, construction probe, isolation self-test) -- the Lightning-free core -- and
`PackedCausalLM`, the LightningModule on top.

`PackedCausalLM` is imported on first use (PEP 562), so the core modules import without Lightning, for plain
PyTorch or Hugging Face Trainer users.
"""

from lit_packing.errors import IsolationError
from lit_packing.models.backends import BACKENDS, resolve_backend
from lit_packing.models.guard import check_packed_batch
from lit_packing.models.loss import LossParts, causal_lm_loss
from lit_packing.models.pack import Packing, pack_model
from lit_packing.models.selftest import check_isolation

__all__ = [
    "BACKENDS",
    "IsolationError",
    "LossParts",
    "GRPO",
    "Objective",
    "PackedCausalLM",
    "Packing",
    "causal_lm_loss",
    "check_isolation",
    "check_packed_batch",
    "pack_model",
    "resolve_backend",
]


def __getattr__(name: str):
    if name == "PackedCausalLM":  # the Lightning layer, imported only when asked for
        from lit_packing.models.causal_lm import PackedCausalLM

        return PackedCausalLM
    if name in ("GRPO", "Objective"):
        from lit_packing.models import objectives

        return getattr(objectives, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
