"""Collators: a list of tokenized examples -> the one batch format every attention backend reads.

    batch = PackedCollator()(examples)   # examples: [{"input_ids": [...], "labels": [...]}, ...]

Packed (the paper's method). Lengths 4, 8, 5, 11 become one row of T = 28 tokens:

    cu_seq_lens_q = cu_seq_lens_k = [0, 4, 12, 17, 28]      int32, (n + 1,)
    max_length_q  = max_length_k  = 11                      Python int
    position_ids  = [0 1 2 3 | 0 1 .. 7 | 0 .. 4 | 0 .. 10]  (1, T), restarting per example
    seq_idx       = [0 0 0 0 | 1 .. 1   | 2 .. 2 | 3 .. 3 ]  int32 (1, T)
    labels        = [-100 t1 t2 t3 | -100 ... | -100 ... | -100 ...]  (1, T): no example predicts the next one

Key names are Hugging Face's (`transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True,
return_seq_idx=True)` gives the same tensors), so the batch also runs through transformers' own flash-attention path.
Every batch also carries host-side values that callbacks and the loss read without a device sync: `counts` (this
micro-batch), `step` (the whole optimizer step it belongs to: every micro-batch on every rank, when the sampler
knows it) and `rows` (each example's row in the source, for error messages and resume checks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

IGNORE_INDEX = -100

# The batch keys, defined once.
INPUT_IDS = "input_ids"
LABELS = "labels"
POSITION_IDS = "position_ids"
ATTENTION_MASK = "attention_mask"
CU_SEQ_LENS_Q = "cu_seq_lens_q"
CU_SEQ_LENS_K = "cu_seq_lens_k"
MAX_LENGTH_Q = "max_length_q"
MAX_LENGTH_K = "max_length_k"
SEQ_IDX = "seq_idx"
COUNTS = "counts"
STEP = "step"
ROWS = "rows"
INDEX = "index"  # an example's row in the source dataset (a column of the tokenized data, and an item key)
PACKED_KEYS = (CU_SEQ_LENS_Q, CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K, SEQ_IDX)


def is_packed(batch: dict[str, Any]) -> bool:
    """True for a flattened batch (varlen keys present), False for a padded one."""
    return CU_SEQ_LENS_Q in batch


def batch_counts(
    lengths: Sequence[int], label_tokens: int, slot_tokens: int, attn_cost: int, truncated_tokens: int = 0
) -> dict[str, int]:
    """The host-side counts every batch carries (Python ints: reading them never syncs a device).

    Args:
        lengths: real tokens of each example in the batch.
        label_tokens: labels != -100, i.e. tokens that contribute to the loss.
        slot_tokens: tokens the step computes, padding included.
        attn_cost: attention work in token pairs: sum(L^2) packed, rows * max(L)^2 padded.
        truncated_tokens: tokens cut from these examples by the overlong policy.
    """
    return {
        "examples": len(lengths),
        "real_tokens": int(sum(lengths)),
        "label_tokens": int(label_tokens),
        "slot_tokens": int(slot_tokens),
        "attn_cost": int(attn_cost),
        "sum_sq_lengths": int(sum(int(n) * int(n) for n in lengths)),
        "truncated_tokens": int(truncated_tokens),
    }


class Pack(list):
    """One micro-batch's items (dataset indices, slices, or the examples read for them) and its optimizer step.

    `step` holds `{"label_tokens": int, "sequences": int}` summed over every micro-batch of the optimizer step on
    every rank (None when unknown): the loss divides by it, so no rank needs to communicate to normalise.
    """

    def __init__(self, items=(), step: dict[str, int] | None = None) -> None:
        super().__init__(items)
        self.step = step


def step_totals(label_tokens: Sequence[int]) -> dict[str, int]:
    """The `step` entry from the label-token counts of every item (example or slice) of one optimizer step.

    `label_tokens` normalises the token-mean loss, `sequences` (items with at least one label) the sequence mean.
    """
    counts = np.asarray(label_tokens, dtype=np.int64)
    return {"label_tokens": int(counts.sum()), "sequences": int((counts > 0).sum())}


def attach_step(batches: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give every micro-batch of one optimizer step the step's `step` totals (for hand-built loaders and tests).

    On one rank this is all the loss needs; with several ranks, pass every rank's micro-batches of the step.
    """
    step = step_totals([n for batch in batches for n in _item_label_tokens(batch)])
    return [{**batch, STEP: step} for batch in batches]


def _host_entries(examples: list[dict[str, Any]]) -> dict[str, Any]:
    """`rows` of the examples that know their source row, and the optimizer step's totals of a `Pack`."""
    host: dict[str, Any] = {ROWS: [int(ex[INDEX]) for ex in examples if INDEX in ex]}
    step = getattr(examples, "step", None)
    if step is not None:
        host[STEP] = step
    return host


def _item_label_tokens(batch: dict[str, Any]) -> list[int]:
    """Label tokens of each example (packed: each `seq_idx` segment; padded: each row) of a collated batch."""
    mask = batch[LABELS] != IGNORE_INDEX
    if SEQ_IDX in batch:
        return torch.bincount(batch[SEQ_IDX][mask].long()).tolist()
    return mask.sum(dim=1).tolist()


def _as_array(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _padded_length(total: int, pad_to_multiple_of: int | None, bucket_sizes: Sequence[int] | None) -> int:
    if bucket_sizes:
        for size in sorted(bucket_sizes):
            if size >= total:
                return size
        raise ValueError(
            f"a batch of {total} tokens exceeds the largest bucket ({max(bucket_sizes)}): "
            f"add a bigger size to collator bucket_sizes or lower the sampler's max_tokens"
        )
    if pad_to_multiple_of:
        return -(-total // pad_to_multiple_of) * pad_to_multiple_of
    return total


class PackedCollator:
    """Flatten examples into one row with restarting `position_ids` and `cu_seq_lens` (see module docstring).

    Args:
        pad_token_id: token used for the optional tail padding.
        pad_to_multiple_of: pad T up to a multiple (e.g. 64) so shapes repeat for torch.compile / CUDA graphs.
        bucket_sizes: pad T up to the smallest of these sizes instead (a small set of shapes).
        isolate: True (default) restarts positions and attention per example. False reproduces the paper's
            contaminated fixed-length baseline: positions run on and attention spans whole rows of `row_length`.
        row_length: with `isolate=False`, the length of each attention row (None: the whole batch is one row).

    Tail padding forms one extra segment in `cu_seq_lens` with labels -100: it is counted as slot tokens, never as
    real tokens. An empty pack (a rank with nothing left to do this step) becomes a single masked pad token.
    """

    def __init__(
        self,
        pad_token_id: int = 0,
        pad_to_multiple_of: int | None = None,
        bucket_sizes: list[int] | None = None,
        isolate: bool = True,
        row_length: int | None = None,
    ) -> None:
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.bucket_sizes = bucket_sizes
        self.isolate = isolate
        self.row_length = row_length

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        host = _host_entries(examples)
        examples = [ex for ex in examples if len(ex[INPUT_IDS]) > 0]
        ids = [_as_array(ex[INPUT_IDS]) for ex in examples]
        lengths = [len(x) for x in ids]
        labels = []
        for ex, x in zip(examples, ids):
            y = _as_array(ex[LABELS]).copy() if LABELS in ex else x.copy()
            y[0] = IGNORE_INDEX
            labels.append(y)
        real = sum(lengths)
        total = _padded_length(max(real, 1), self.pad_to_multiple_of, self.bucket_sizes)
        pad = total - real
        if pad:
            ids.append(np.full(pad, self.pad_token_id, dtype=np.int64))
            labels.append(np.full(pad, IGNORE_INDEX, dtype=np.int64))
        segments = lengths + ([pad] if pad else [])
        if self.isolate:
            seg_lens = np.asarray(segments, dtype=np.int64)
        else:
            row = self.row_length or total
            seg_lens = np.diff(np.append(np.arange(0, total, row), total))
        cu = np.concatenate([[0], np.cumsum(seg_lens)])
        position_ids = np.arange(total) - np.repeat(cu[:-1], seg_lens)
        seq_idx = np.repeat(np.arange(len(segments)), segments)
        label_row = np.concatenate(labels)
        cu_t = torch.from_numpy(cu.astype(np.int32))
        max_len = int(seg_lens.max())
        return {
            INPUT_IDS: torch.from_numpy(np.concatenate(ids))[None],
            LABELS: torch.from_numpy(label_row)[None],
            POSITION_IDS: torch.from_numpy(position_ids)[None],
            CU_SEQ_LENS_Q: cu_t,
            CU_SEQ_LENS_K: cu_t.clone(),
            MAX_LENGTH_Q: max_len,
            MAX_LENGTH_K: max_len,
            SEQ_IDX: torch.from_numpy(seq_idx.astype(np.int32))[None],
            COUNTS: batch_counts(
                lengths,
                label_tokens=int((label_row != IGNORE_INDEX).sum()),
                slot_tokens=total,
                attn_cost=int((seg_lens * seg_lens).sum()),
                truncated_tokens=sum(int(ex.get("truncated_tokens", 0)) for ex in examples),
            ),
            **host,
        }


class PaddedCollator:
    """Pad examples to the longest in the batch (the paper's baseline), with an `attention_mask`.

    Lengths 4, 8, 5, 11 become `input_ids` (4, 11) right-padded with `pad_token_id`, labels -100 on pads and on
    each example's first token (as in the packed format, so both see the same target tokens), and
    counts `slot_tokens` = 44, `attn_cost` = 4 * 11^2.

    Args:
        pad_token_id: the tokenizer's pad id (linked from the data module).
        pad_to_multiple_of: round the padded length up (8 or 64 suit tensor cores).
    """

    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: int | None = None) -> None:
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        host = _host_entries(examples)
        examples = [ex for ex in examples if len(ex[INPUT_IDS]) > 0]
        lengths = [len(ex[INPUT_IDS]) for ex in examples] or [0]
        width = _padded_length(max(max(lengths), 1), self.pad_to_multiple_of, None)
        rows = max(len(examples), 1)
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((rows, width), dtype=torch.long)
        if not examples:
            attention_mask[0, 0] = 1  # an empty pack: one masked token so every rank still steps
        for row, ex in enumerate(examples):
            x = _as_array(ex[INPUT_IDS])
            y = _as_array(ex[LABELS]).copy() if LABELS in ex else x.copy()
            y[0] = IGNORE_INDEX
            input_ids[row, : len(x)] = torch.from_numpy(x)
            labels[row, : len(x)] = torch.from_numpy(y)
            attention_mask[row, : len(x)] = 1
        real_lengths = [len(ex[INPUT_IDS]) for ex in examples]
        return {
            INPUT_IDS: input_ids,
            LABELS: labels,
            ATTENTION_MASK: attention_mask,
            COUNTS: batch_counts(
                real_lengths,
                label_tokens=int((labels != IGNORE_INDEX).sum()),
                slot_tokens=rows * width,
                attn_cost=rows * width * width,
                truncated_tokens=sum(int(ex.get("truncated_tokens", 0)) for ex in examples),
            ),
            **host,
        }
