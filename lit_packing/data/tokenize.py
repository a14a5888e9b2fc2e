"""Tokenization: examples (chat, prompt/completion or text) -> `input_ids` + `labels`, cached on disk by `datasets`.

    tokenized, report = tokenize_dataset(ChampChats().load(), tokenizer, max_length=2048)  # re-runs load the cache

Labels are -100 where nothing is trained. With `train_on="completion"` (default) a chat trains only on assistant
turns, each with its end-of-turn token; prompt/completion trains on the completion and eos; text trains on all.
The first label of every example is -100: no token before it predicts it (in a pack, the token before belongs to
another example). Worked example, SmolLM2's ChatML template, `[user "Hi", assistant "Hello!"]`:

    <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello!<|im_end|>\\n
    labels: -100 ...................................................................... Hello ! <|im_end|> -100

Assistant spans come from the chat template itself: the render of `messages[:i]` with a generation prompt ends
where assistant message i starts, the render of `messages[:i + 1]` where it ends. This works for any template that
renders earlier turns the same whatever follows (prefix-consistent); others raise a ValueError naming the fix.

Bad examples (see `lit_packing.data.problems`) are never tokenized: with `on_bad_row="error"`
(default) tokenization stops with a `DataError` naming the first few rows as the user counts them (a file's line
numbers); with `skip` they are left out and counted. The cache file `datasets.map` writes is checked against a
size + XXH3-128 record kept beside it on every load, and rebuilt when it differs (`lit_packing.data.cache_check`).

This module is the map-style path: `tokenize_dataset` and `TokenizedDataset`. The encoding it shares with the stream
is `lit_packing.data.encode`, the report `lit_packing.data.report`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, NamedTuple

import datasets
import numpy as np
import pyarrow.compute as pc
import torch

from lit_packing._compat import dataset_fingerprint
from lit_packing.batch import (
    ADVANTAGES,
    BEHAVIOUR_LOGPS,
    CHOSEN_TOKENS,
    COMPLETION_TOKENS,
    IGNORE_INDEX,
    IMAGES,
    INDEX,
    INPUT_IDS,
    LABELS,
    REWARDS,
    TOKEN_ADVANTAGES,
    TRUNCATED_TOKENS,
    Pack,
)
from lit_packing.data.cache_check import checksum_path, remove_stale_tmp, verify_cache, write_record
from lit_packing.data.encode import (
    DROPPED,
    FEATURES,
    GROUP_OUTPUTS,
    LABEL_TOKENS,
    LENGTH,
    OUTPUT_COLUMNS,
    Encoder,
    bos_prefix,
    chat_template,
    tokenize_batch,
)
from lit_packing.data.report import TokenizationReport, check_report, report_of
from lit_packing.data.shapes import example_shape
from lit_packing.errors import ConfigError, DataError
from lit_packing.text import count

log = logging.getLogger(__name__)

# Bump when the tokens or labels this module or `encode` produces change: every cached tokenization is rebuilt.
TOKENIZE_VERSION = "6"  # 3: the chosen_tokens column (preference pairs); 4: rollout groups' columns; 5: per-token
# advantages; 6: the images column (image chats)

Overlong = Literal["truncate", "drop", "error"]
TrainOn = Literal["completion", "all"]
OnBadRow = Literal["error", "skip"]


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of everything about a tokenizer that changes its output: vocab, merges, normalizer, special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    parts = (type(tokenizer).__name__, tokenizer.name_or_path, len(tokenizer), tokenizer.special_tokens_map, vocab)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def tokenization_fingerprint(
    dataset_fingerprint: str, tokenizer, template: str, max_length: int, overlong: str, train_on: str
) -> str:
    """The cache key of one tokenization: changes with the data, tokenizer, template, settings or this code."""
    parts = (
        TOKENIZE_VERSION,
        dataset_fingerprint,
        tokenizer_fingerprint(tokenizer),
        template,
        max_length,
        overlong,
        train_on,
        bos_prefix(tokenizer),
        tokenizer.eos_token_id,
    )
    return "tokenized-" + hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def column(dataset: datasets.Dataset, name: str) -> np.ndarray:
    """One column as a numpy array, reading only that column (e.g. `length`, never the tokens)."""
    return np.asarray(dataset.with_format("arrow")[name])  # a pyarrow column (indices applied): ~1 ms


def _report(mapped: datasets.Dataset) -> TokenizationReport:
    return report_of(lambda name: column(mapped, name))


# ---------------------------------------------------------------- the map-style path: a whole Dataset, cached


def check_tokenize_settings(max_length: int, overlong: str, train_on: str, on_bad_row: str) -> None:
    """Raise a `ConfigError` naming the `data.*` setting that tokenization cannot work with (the one check of
    each; `PackingDataModule` runs it at construction, before any data is read)."""
    if overlong not in ("truncate", "drop", "error"):
        raise ConfigError("data.overlong", f"{overlong!r} is not a policy", "use truncate, drop or error")
    if train_on not in ("completion", "all"):
        raise ConfigError("data.train_on", f"{train_on!r} is not a choice", "use completion or all")
    if on_bad_row not in ("error", "skip"):
        raise ConfigError("data.on_bad_row", f"{on_bad_row!r} is not a policy", "use error or skip")
    if max_length < 2:
        raise ConfigError("data.max_length", f"must be >= 2 to hold a trained token, got {max_length}")


class Tokenized(NamedTuple):
    """What `tokenize_dataset` returns: the kept examples and the report of what was skipped, cut and dropped."""

    dataset: datasets.Dataset
    report: TokenizationReport


def tokenize_dataset(
    dataset: datasets.Dataset,
    tokenizer,
    max_length: int = 2048,
    overlong: Overlong = "truncate",
    train_on: TrainOn = "completion",
    num_proc: int | None = None,
    on_bad_row: OnBadRow = "error",
    rows: np.ndarray | None = None,
    row_name: Callable[[int], str] = "row {:,}".format,
    announce: str | None = None,
) -> Tokenized:
    """Tokenize every example with `datasets.map` (batched, cached and checksummed next to the dataset's files).

    Args:
        dataset: examples of one shape (see `lit_packing.data.shapes.example_shape`).
        tokenizer: a fast Hugging Face tokenizer (offsets locate assistant turns).
        max_length: most tokens per example.
        overlong: `truncate` keeps the first `max_length` tokens; `drop` removes the example; `error` raises.
        train_on: `completion` trains assistant turns / completions only; `all` trains every token.
        num_proc: processes for `map` (None: one; the tokenizer already batches in Rust).
        on_bad_row: `error` raises a `DataError` naming the first bad rows; `skip` leaves them out, counted.
        rows: (len(dataset),) the source row of each dataset row (when `dataset` is a subset); None: the same.
        row_name: how messages name a row, e.g. `source.row_name` (`line 17 of chats.jsonl`).
        announce: what the data is (`ChampChats() with smollm2`): log one line saying whether it is tokenized now
            or read from the cache.

    Returns:
        The kept examples (columns `input_ids`, `labels`, `length`, `truncated_tokens`, `index` = row in `dataset`,
        `row` = the row as the user counts it, `token_hash`) and the report of what was skipped, cut and dropped.

    Raises:
        DataError: bad rows under `on_bad_row=error`, overlong ones under `overlong=error`, or no example left.
    """
    check_tokenize_settings(max_length, overlong, train_on, on_bad_row)
    if not len(dataset):
        raise DataError("the source holds no examples: check data.source (its path, split and field_map)")
    shape = example_shape(dataset.column_names)
    if shape.atom and overlong == "truncate":
        raise ConfigError(
            "data.overlong",
            f"truncate would cut {shape.atom} apart (each is trained whole or not at all)",
            f"set data.overlong=drop ({shape.atom} longer than data.max_length are left out and counted) or error",
        )
    template = chat_template(tokenizer) if shape.chat else ""
    if shape.chat and not tokenizer.chat_template:
        log.warning(
            "tokenizer %r has no chat template: chats are rendered with ChatML "
            "(lit_packing.data.DEFAULT_CHAT_TEMPLATE; its markers are plain text to this tokenizer)",
            tokenizer.name_or_path,
        )
    fingerprint = tokenization_fingerprint(
        dataset_fingerprint(dataset), tokenizer, template, max_length, overlong, train_on
    )
    folder = Path(dataset.cache_files[0]["filename"]).parent if dataset.cache_files else None
    if folder is not None:
        remove_stale_tmp(folder)
        verify_cache(folder, fingerprint)
    if announce and folder is not None and checksum_path(folder, fingerprint).exists():
        log.info("%s: reading the tokenized examples from the cache in %s", announce, folder)
    elif announce:
        log.info(
            "%s: tokenizing %s (once: later runs with the same settings read the cache)",
            announce, count(len(dataset), "example"),
        )  # fmt: skip
    readable = shape.readable(dataset)
    mapped = _map(readable, tokenizer, shape, template, max_length, overlong, train_on, num_proc, rows, fingerprint)
    if folder is not None:
        write_record(folder, fingerprint)
    report = _report(mapped)
    check_report(report, on_bad_row, overlong, max_length, row_name)
    kept = np.flatnonzero(column(mapped, DROPPED) == "")
    return Tokenized(mapped.select(kept).select_columns(OUTPUT_COLUMNS), report)


def _map(dataset, tokenizer, shape, template, max_length, overlong, train_on, num_proc, rows, fingerprint):
    return dataset.map(
        tokenize_batch,
        batched=True,
        with_indices=True,
        remove_columns=dataset.column_names,
        features=FEATURES,
        fn_kwargs={
            "encoder": Encoder(tokenizer, shape, template, train_on),
            "max_length": max_length,
            "overlong": overlong,
            "rows": rows,
        },
        num_proc=num_proc,
        new_fingerprint=fingerprint,
        desc=f"Tokenizing {shape} (max_length={max_length:,}, overlong={overlong}, train_on={train_on})",
    )


# ---------------------------------------------------------------- what the DataLoader reads


class TokenizedDataset(torch.utils.data.Dataset):
    """Examples by row, or token slices of them, for the collator; `lengths` without reading any token.

    `ds[3]` -> `{"input_ids": array, "labels": array, "index": source row, "truncated_tokens": int}`;
    `ds[(3, 100, 200)]` -> tokens 100..199 of example 3 (what `FixedLengthPackingSampler` asks for;
    `truncated_tokens` only on the slice at 0, so an example's cut tokens are counted once). Arrays are read-only
    int32 views of the memory-mapped Arrow file (about 40 us a row; `datasets`' numpy formatting takes about 200 us).
    A `Pack` of keys is read as a `Pack` of items carrying the same optimizer-step totals.

    Args:
        dataset: the output of `tokenize_dataset` (or a `select` of it).
    """

    def __init__(self, dataset: datasets.Dataset) -> None:
        columns = [INPUT_IDS, LABELS, TRUNCATED_TOKENS, INDEX]
        # one shape a table: its first row says whether it holds pairs or groups (its values read, not the columns)
        first = dataset[0] if len(dataset) else {}
        self.pairs = bool(first.get(CHOSEN_TOKENS))
        self.groups = bool(first.get(COMPLETION_TOKENS))
        # image chats: the table's image column holds any image (its list lengths read, not the images)
        held = dataset.data.column(IMAGES) if IMAGES in dataset.column_names else None
        self.images = held is not None and bool(pc.max(pc.list_value_length(held)).as_py())
        extra = [CHOSEN_TOKENS] * self.pairs + GROUP_OUTPUTS * self.groups + [IMAGES] * self.images
        self.dataset = dataset.with_format("arrow", columns=columns + extra)
        self._lengths: np.ndarray | None = None
        self._label_tokens: np.ndarray | None = None
        self._completion_tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def lengths(self) -> np.ndarray:
        """(n,) int64 tokens per example, read from the `length` column only."""
        if self._lengths is None:
            self._lengths = column(self.dataset, LENGTH).astype(np.int64)
        return self._lengths

    @property
    def label_tokens(self) -> np.ndarray:
        """(n,) int64 trained tokens per example, read from the `label_tokens` column only."""
        if self._label_tokens is None:
            self._label_tokens = column(self.dataset, LABEL_TOKENS).astype(np.int64)
        return self._label_tokens

    def count_labels(self, keys: list) -> list[int]:
        """Trained tokens of each key as the collator will see it: a row's count, or a slice's (whose first label
        the collator masks), read from the labels of the sliced rows only; a rollout group's, one per completion."""
        counts = []
        for key in keys:
            if self.groups and not isinstance(key, tuple):  # each completion: the step's sequences count them
                if self._completion_tokens is None:  # the column alone, read once
                    self._completion_tokens = column(self.dataset, COMPLETION_TOKENS)
                counts.extend(int(n) for n in self._completion_tokens[key])
            elif isinstance(key, tuple):
                labels = self[key][LABELS]
                counts.append(int((labels[1:] != IGNORE_INDEX).sum()))
            else:
                counts.append(int(self.label_tokens[key]))
        return counts

    def __getitem__(self, key: int | tuple[int, int, int]) -> dict[str, Any]:
        index, start, stop = key if isinstance(key, tuple) else (key, 0, None)
        row = self.dataset[int(index)]  # a one-row pyarrow.Table
        item = {
            INPUT_IDS: _tokens(row, INPUT_IDS)[start:stop],
            LABELS: _tokens(row, LABELS)[start:stop],
            INDEX: row.column(INDEX)[0].as_py(),
        }
        if start == 0:
            item[TRUNCATED_TOKENS] = row.column(TRUNCATED_TOKENS)[0].as_py()
        if self.images:  # a slice of an image chat is no document the model can see whole: the collator refuses it
            item[IMAGES] = row.column(IMAGES)[0].as_py() if start == 0 and stop is None else None
        if self.pairs and start == 0 and stop is None:  # a slice of a pair is no pair: the collator refuses it
            item[CHOSEN_TOKENS] = row.column(CHOSEN_TOKENS)[0].as_py()
        if self.groups and start == 0 and stop is None:  # as for pairs: a slice of a group is no group
            item.update({name: row.column(name)[0].as_py() for name in GROUP_OUTPUTS})
            for name in (BEHAVIOUR_LOGPS, REWARDS, ADVANTAGES, TOKEN_ADVANTAGES):  # absent from the data: absent here
                if not item[name]:
                    del item[name]
        return item

    def __getitems__(self, keys: list) -> list[dict[str, Any]]:
        # The DataLoader hands a batch sampler's whole item to this method: keep a Pack's step totals.
        return Pack([self[key] for key in keys], step=getattr(keys, "step", None))


def _tokens(row, name: str) -> np.ndarray:
    # flatten(), not .values: a row sliced from a chunk shares the chunk's whole child array.
    return row.column(name).combine_chunks().flatten().to_numpy()
