"""Models: the varlen attention backends, the loss and the isolation self-test (the Lightning-free core), and
`PackedCausalLM`, the LightningModule on top (with its memory estimate and model loading).

Names are imported on first use (PEP 562), so `lit_packing.models.attention`, `.loss` and `.isolation` import without
Lightning, for plain PyTorch or Hugging Face Trainer users.
"""

from importlib import import_module

_HOMES = {
    "attention": ("BACKENDS", "attn_implementation", "register_backends", "resolve_backend"),
    "causal_lm": ("PackedCausalLM",),
    "isolation": ("check_isolation", "check_packed_batch"),
    "loss": ("LossParts", "causal_lm_loss"),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted([*_MODULE_OF, "IsolationError"])


def __getattr__(name: str):
    if name == "IsolationError":  # its home is `lit_packing.errors`, with every other toolkit error
        from lit_packing.errors import IsolationError

        return IsolationError
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
