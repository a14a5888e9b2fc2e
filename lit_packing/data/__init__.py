"""Data: sources -> tokenize -> collate -> PackingDataModule (see each module's docstring)."""

from lit_packing.data.collate import PackedCollator, PaddedCollator
from lit_packing.data.datamodule import PackingDataModule, split_rows
from lit_packing.data.sources import (
    ChampChats,
    ChampProblems,
    Chatterbot,
    HFDataset,
    HumanEval,
    Source,
    StateOfTheUnion,
    example_shape,
)
from lit_packing.data.tokenize import (
    DEFAULT_CHAT_TEMPLATE,
    TokenizationReport,
    TokenizedDataset,
    tokenize_dataset,
)

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "ChampChats",
    "ChampProblems",
    "Chatterbot",
    "HFDataset",
    "HumanEval",
    "PackedCollator",
    "PackingDataModule",
    "PaddedCollator",
    "Source",
    "StateOfTheUnion",
    "TokenizationReport",
    "TokenizedDataset",
    "example_shape",
    "split_rows",
    "tokenize_dataset",
]
