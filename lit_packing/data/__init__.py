"""Data: sources -> tokenize -> collate -> PackingDataModule (see each module's docstring).

Names are imported on first use (PEP 562), so `lit_packing.data.collate` and the model, which only need the batch
format, import without the `datasets` package (e.g. on a bare GPU machine running benchmarks/gpu_check.sh).
"""

from importlib import import_module

_HOMES = {
    "cached": ("split_rows",),
    "collate": ("PackedCollator", "PaddedCollator", "PairCollator"),
    "datamodule": ("PackingDataModule",),
    "encode": ("DEFAULT_CHAT_TEMPLATE",),
    "groups": ("GroupCollator",),
    "image_collate": ("ImageChatCollator",),
    "mixture": ("Mixture",),
    "on_policy": ("OnPolicyRollouts",),
    "packaged": ("ArithmeticPrompts", "ArithmeticRollouts", "ChampChats", "ChampPairs", "ChampProblems", "Chatterbot",
                 "HumanEval",
                 "StateOfTheUnion"),
    "report": ("TokenizationReport",),
    "shapes": ("example_shape",),
    "shards": ("Shard",),
    "sources": ("HFDataset", "LitData", "Source"),
    "stream": ("StreamLoader",),
    "tokenize": ("TokenizedDataset", "tokenize_dataset"),
    "vqa": ("EasyVQA",),
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
