"""Collators: a list of tokenized examples -> the one batch format every attention backend reads.

    batch = PackedCollator()(examples)   # examples: [{"input_ids": [...], "labels": [...]}, ...]

Packed (the paper's method). Lengths 4, 8, 5, 11 become one row of T = 28 tokens: `cu_seq_lens_q/k` int32
(n + 1,), `max_length_q/k` Python ints, `position_ids` (1, T) restarting per example, `seq_idx` int32 (1, T), and
`labels` (1, T) with each example's first label masked: no example predicts the next one.

>>> examples = [{"input_ids": list(range(1, n + 1))} for n in (4, 8, 5, 11)]
>>> batch = PackedCollator()(examples)
>>> batch["cu_seq_lens_q"].tolist(), batch["max_length_q"]
([0, 4, 12, 17, 28], 11)
>>> batch["position_ids"][0, :14].tolist()
[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
>>> batch["seq_idx"][0, :14].tolist()
[0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2]
>>> batch["labels"][0, :6].tolist()
[-100, 2, 3, 4, -100, 2]
>>> batch["counts"]["slot_tokens"], batch["counts"]["attn_cost"], batch["lengths"]
(28, 226, [4, 8, 5, 11])

Key names are Hugging Face's (`transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True,
return_seq_idx=True)` gives the same tensors), so the batch also runs through transformers' own flash-attention path.
Every batch also carries host-side values that callbacks and the loss read without a device sync
(`lit_packing.batch`): `counts` (this micro-batch), `lengths` (each real example's tokens), `step` (the whole
optimizer step it belongs to: every micro-batch on every rank, when the sampler knows it) and `rows` (each
example's row in the source, for error messages and resume checks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lit_packing.batch import (
    ATTENTION_MASK,
    CHOSEN_TOKENS,
    COMPLETION_TOKENS,
    COUNTS,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    IGNORE_INDEX,
    INDEX,
    INPUT_IDS,
    KEY_INDEX,
    KEY_LENGTHS,
    LABELS,
    LENGTHS,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    PAIRS,
    POSITION_IDS,
    PROMPTS,
    ROWS,
    SEQ_IDX,
    STEP,
    TRUNCATED_TOKENS,
    StepShape,
    attention_cost,
    batch_counts,
)
from lit_packing.errors import ConfigError, DataError

if TYPE_CHECKING:
    from lit_packing.samplers import PackPlan


def host_entries(examples: list[dict[str, Any]]) -> dict[str, Any]:
    """`rows` of the examples that know their source row, and the optimizer step's totals of a `Pack`."""
    host: dict[str, Any] = {ROWS: [int(ex[INDEX]) for ex in examples if INDEX in ex]}
    step = getattr(examples, "step", None)
    if step is not None:
        host[STEP] = step
    return host


def as_array(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def padded_lengths(
    totals: np.ndarray, pad_to_multiple_of: int | None, bucket_sizes: Sequence[int] | None
) -> np.ndarray:
    """The length each of `totals` tokens is padded to: the smallest bucket that holds it, else the next multiple.

    >>> padded_lengths(np.array([5, 64, 65]), 64, None).tolist(), padded_lengths([5, 9], None, [8, 16]).tolist()
    ([64, 64, 128], [8, 16])
    """
    totals = np.asarray(totals, dtype=np.int64)
    if bucket_sizes:
        sizes = np.sort(np.asarray(bucket_sizes, dtype=np.int64))
        where = np.searchsorted(sizes, totals)
        if (where == len(sizes)).any():
            raise ConfigError(
                "bucket_sizes",
                f"a batch of {int(totals.max()):,} tokens exceeds the largest bucket ({int(sizes[-1]):,})",
                "add a bigger size to {bucket_sizes} or lower {max_tokens}",
            )
        return sizes[where]
    if pad_to_multiple_of:
        return -(-totals // pad_to_multiple_of) * pad_to_multiple_of
    return totals


@dataclass(frozen=True)
class PlanSlots:
    """What a collator turns each pack of a plan into, computed from the plan alone (no batch is built).

    Attributes:
        slots: (n_packs,) tokens computed, padding included (`counts["slot_tokens"]` of the batch).
        pairs: (n_packs,) attention pairs computed (`counts["attn_cost"]`).
        rows: (n_packs,) batch rows (1 packed).
        width: (n_packs,) row length.
        padded: padded rows with an attention mask rather than one packed row.
    """

    slots: np.ndarray
    pairs: np.ndarray
    rows: np.ndarray
    width: np.ndarray
    padded: bool = False

    def largest(self) -> StepShape | None:
        """The micro-batch that needs the most memory: the most slots, then the most attention pairs; None if no
        pack."""
        if not len(self.slots):
            return None
        p = int(np.lexsort((self.pairs, self.slots))[-1])
        values = (self.slots[p], self.pairs[p], self.rows[p], self.width[p])
        return StepShape(*(int(v) for v in values), padded=self.padded)


def _longest_per_pack(plan: PackPlan) -> np.ndarray:
    """(n_packs,) the longest item of each pack, 0 for an empty pack."""
    sizes = plan.examples_per_pack()
    longest = np.zeros(len(sizes), dtype=np.int64)
    if len(plan.tokens):
        nonempty = sizes > 0
        longest[nonempty] = np.maximum.reduceat(plan.tokens, plan.offsets[:-1][nonempty])
    return longest


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

    def plan_slots(self, plan: PackPlan) -> PlanSlots:
        """Per pack of `plan`, the slots and attention pairs this collator's batch would compute (its `counts`)."""
        tokens = plan.tokens_per_pack()
        slots = padded_lengths(np.maximum(tokens, 1), self.pad_to_multiple_of, self.bucket_sizes)
        if self.isolate:  # tail padding is one more segment
            pairs = plan.sq_tokens_per_pack() + (slots - tokens) ** 2
        else:
            row = np.full_like(slots, self.row_length) if self.row_length else slots
            pairs = (slots // row) * row**2 + (slots % row) ** 2
        return PlanSlots(slots, pairs, np.ones_like(slots), slots)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        _refuse_pairs(examples, type(self).__name__)
        return self.collate_examples(examples)

    def collate_examples(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        """`__call__` without its check that the examples are single sequences (for collators built on this one)."""
        host = host_entries(examples)
        examples = [ex for ex in examples if len(ex[INPUT_IDS]) > 0]
        ids = [as_array(ex[INPUT_IDS]) for ex in examples]
        lengths = [len(x) for x in ids]
        labels = []
        for ex, x in zip(examples, ids):
            y = as_array(ex[LABELS]).copy() if LABELS in ex else x.copy()
            y[0] = IGNORE_INDEX
            labels.append(y)
        real = sum(lengths)
        total = int(padded_lengths(np.array([max(real, 1)]), self.pad_to_multiple_of, self.bucket_sizes)[0])
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
                attn_cost=attention_cost(seg_lens),
                truncated_tokens=sum(int(ex.get(TRUNCATED_TOKENS, 0)) for ex in examples),
            ),
            LENGTHS: lengths,
            **host,
        }


def _refuse_pairs(examples: list[dict[str, Any]], collator: str) -> None:
    """Preference pairs (or rollout groups) given to a collator of single examples would train each as one
    sequence."""
    if examples and examples[0].get(COMPLETION_TOKENS):
        raise DataError(
            f"{collator} got rollout groups (prompt, completions, rewards): it would train each group as one sequence; "
            "set data.collator=lit_packing.data.GroupCollator and model.objective=lit_packing.models.GRPO: "
            "configs/grpo.yaml"
        )
    if examples and examples[0].get(CHOSEN_TOKENS):  # a tokenized table's other rows say 0
        raise DataError(
            f"{collator} got preference pairs (prompt, chosen, rejected): it would train each pair as one sequence; "
            "set data.collator=lit_packing.data.PairCollator and a preference objective (model.objective=dpo, ...): "
            "configs/dpo.yaml"
        )


class PairCollator:
    """Preference pairs into one packed row: each pair's chosen and rejected sequences are two segments of it, and
    `pairs` (P, 2) names the segments of each pair, so the pair's identity is explicit per segment.

    A pair item holds `input_ids` / `labels` of its chosen sequence then its rejected one (`chosen_tokens` of them
    first), the prompt in both, masked in the labels. Two pairs of (prompt 2 + chosen 2, prompt 2 + rejected 1):

    >>> pair = {"input_ids": [5, 6, 7, 8, 5, 6, 9], "labels": [-100, -100, 7, 8, -100, -100, 9], "chosen_tokens": 4}
    >>> batch = PairCollator()([pair, pair])
    >>> batch["cu_seq_lens_q"].tolist(), batch["pairs"].tolist()
    ([0, 4, 7, 11, 14], [[0, 1], [2, 3]])
    >>> batch["position_ids"][0, :7].tolist(), batch["labels"][0, :7].tolist()
    ([0, 1, 2, 3, 0, 1, 2], [-100, -100, 7, 8, -100, -100, 9])

    With `share_prompt`, a pair's prompt is run once: the row holds [prompt][chosen continuation][rejected
    continuation], three segments; both continuations attend to the prompt's keys and their own (not each other's),
    their positions continue after the prompt, and `prompts` (P,) names each pair's prompt segment. The prompt is
    the two sequences' common prefix before the first label (the tokens whose hidden states are the same in both):

    >>> batch = PairCollator(share_prompt=True)([pair, pair])
    >>> batch["cu_seq_lens_q"].tolist(), batch["pairs"].tolist(), batch["prompts"].tolist()
    ([0, 2, 4, 5, 7, 9, 10], [[1, 2], [4, 5]], [0, 3])
    >>> batch["position_ids"][0, :5].tolist(), batch["key_index"][:9].tolist(), batch["cu_seq_lens_k"].tolist()
    ([0, 1, 2, 3, 2], [0, 1, 0, 1, 2, 3, 0, 1, 4], [0, 2, 6, 9, 11, 15, 18])

    Args: those of `PackedCollator` (the row is built by it; isolation is always on), and `share_prompt`.
    """

    def __init__(
        self,
        pad_token_id: int = 0,
        pad_to_multiple_of: int | None = None,
        bucket_sizes: list[int] | None = None,
        share_prompt: bool = False,
    ) -> None:
        self.packed = PackedCollator(pad_token_id, pad_to_multiple_of, bucket_sizes)
        self.share_prompt = share_prompt

    def plan_slots(self, plan: PackPlan) -> PlanSlots:
        """Per pack of `plan` (whose items are pairs), the slots; attention pairs are bounded by the pairs' whole
        lengths (a pair's two sequences attend apart: fewer). With `share_prompt` both are upper bounds: the plan
        counts a pair's prompt twice, the row holds it once."""
        return self.packed.plan_slots(plan)

    def __call__(self, pairs: list[dict[str, Any]]) -> dict[str, Any]:
        host = host_entries(pairs)
        sides = [_pair_sides(pair) for pair in pairs]
        if self.share_prompt:
            batch = self._shared(sides)
        else:
            sequences = [{INPUT_IDS: x, LABELS: y} for side in sides for x, y in side]
            batch = self.packed.collate_examples(sequences)
            batch[PAIRS] = torch.arange(2 * len(pairs), dtype=torch.int64).view(len(pairs), 2)
        batch.update(host)
        return batch

    def _shared(self, sides: list[tuple[tuple[np.ndarray, np.ndarray], ...]]) -> dict[str, Any]:
        """The row of `share_prompt`: per pair a prompt segment and two continuation segments (see the class)."""
        groups = []
        for (chosen, chosen_labels), (rejected, rejected_labels) in sides:
            prompt = _prompt_length(chosen, chosen_labels, rejected, rejected_labels)
            chosen_labels, rejected_labels = chosen_labels.copy(), rejected_labels.copy()
            chosen_labels[0] = rejected_labels[0] = IGNORE_INDEX  # as each sequence's first label is, unshared
            continuations = [(chosen[prompt:], chosen_labels[prompt:]), (rejected[prompt:], rejected_labels[prompt:])]
            groups.append((chosen[:prompt], chosen_labels[:prompt], continuations))
        batch, _ = shared_row(groups, self.packed)
        n = len(sides)
        batch[PAIRS] = torch.stack([torch.arange(1, 3 * n, 3), torch.arange(2, 3 * n, 3)], dim=1)
        return batch


def shared_row(
    groups: Sequence[tuple[np.ndarray, np.ndarray, Sequence[tuple[np.ndarray, np.ndarray]]]], packed: PackedCollator
) -> tuple[dict[str, Any], list[int]]:
    """One packed row of prompts each run once: per group (prompt ids, prompt labels, [(continuation ids, labels),
    ...]) a prompt segment then one segment per continuation, each continuation attending to its prompt's keys and
    its own (`key_index`), its positions continuing after the prompt; `prompts` names each group's prompt segment.
    Tail padding as `packed` pads. Returns the batch and each continuation's segment (in order)."""
    ids, labels, lengths, keys, key_index, offsets, continued = [], [], [], [], [], [], []
    start = 0
    for prompt_ids, prompt_labels, continuations in groups:
        prompt = len(prompt_ids)
        prompt_keys = np.arange(start, start + prompt)
        ids.append(prompt_ids), labels.append(prompt_labels), lengths.append(prompt), keys.append(prompt)
        key_index.append(prompt_keys), offsets.append(0)
        start += prompt
        for continuation, continuation_labels in continuations:
            size = len(continuation)
            continued.append(len(lengths))
            ids.append(continuation), labels.append(continuation_labels), lengths.append(size)
            keys.append(prompt + size), offsets.append(prompt)
            key_index.append(np.concatenate([prompt_keys, np.arange(start, start + size)]))
            start += size
    real = start
    total = int(padded_lengths(np.array([max(real, 1)]), packed.pad_to_multiple_of, packed.bucket_sizes)[0])
    pad = total - real
    segments, key_lengths = lengths + ([pad] if pad else []), keys + ([pad] if pad else [])
    if pad:
        ids.append(np.full(pad, packed.pad_token_id, dtype=np.int64))
        labels.append(np.full(pad, IGNORE_INDEX, dtype=np.int64))
        key_index.append(np.arange(real, total))
        offsets.append(0)
    seg_lens = np.asarray(segments, dtype=np.int64)
    cu_q = np.concatenate([[0], np.cumsum(seg_lens)])
    cu_k = np.concatenate([[0], np.cumsum(key_lengths)])
    position_ids = np.arange(total) - np.repeat(cu_q[:-1] - np.asarray(offsets), seg_lens)
    label_row = np.concatenate(labels)
    prompt_segments = sorted(set(range(len(lengths))) - set(continued))
    batch = {
        INPUT_IDS: torch.from_numpy(np.concatenate(ids))[None],
        LABELS: torch.from_numpy(label_row)[None],
        POSITION_IDS: torch.from_numpy(position_ids)[None],
        CU_SEQ_LENS_Q: torch.from_numpy(cu_q.astype(np.int32)),
        CU_SEQ_LENS_K: torch.from_numpy(cu_k.astype(np.int32)),
        MAX_LENGTH_Q: int(seg_lens.max()),
        MAX_LENGTH_K: int(max(key_lengths)),
        KEY_INDEX: torch.from_numpy(np.concatenate(key_index).astype(np.int64)),
        SEQ_IDX: torch.from_numpy(np.repeat(np.arange(len(segments)), segments).astype(np.int32))[None],
        PROMPTS: torch.tensor(prompt_segments, dtype=torch.int64),
        COUNTS: batch_counts(
            lengths,
            label_tokens=int((label_row != IGNORE_INDEX).sum()),
            slot_tokens=total,
            attn_cost=attention_cost(segments, keys=key_lengths),
            keys=keys,
            examples=len(continued),
        ),
        LENGTHS: lengths,
        KEY_LENGTHS: keys,
    }
    return batch, continued


def _pair_sides(pair: dict[str, Any]) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """A pair item's (input_ids, labels) of its chosen sequence and of its rejected one."""
    if not pair.get(CHOSEN_TOKENS):
        raise DataError(
            "PairCollator got an example that is no whole preference pair: the data needs prompt, chosen and "
            "rejected columns, and a sampler that keeps examples whole (not FixedLengthPackingSampler)"
        )
    ids, labels, split = as_array(pair[INPUT_IDS]), as_array(pair[LABELS]), int(pair[CHOSEN_TOKENS])
    if not 0 < split < len(ids):
        raise DataError(f"a pair needs a chosen and a rejected sequence: chosen_tokens={split} of {len(ids)}")
    return (ids[:split], labels[:split]), (ids[split:], labels[split:])


def _prompt_length(chosen: np.ndarray, chosen_labels: np.ndarray, rejected: np.ndarray, rejected_labels: np.ndarray):
    """The tokens a pair's two sequences can share: their common prefix, up to the first label of either (the
    first token is never a label) and leaving each at least one token of its own."""
    limit = min(len(chosen), len(rejected)) - 1
    differ = np.flatnonzero(chosen[:limit] != rejected[:limit])
    shared = int(differ[0]) if len(differ) else limit
    for labels in (chosen_labels, rejected_labels):
        labelled = np.flatnonzero(labels[1:] != IGNORE_INDEX)
        if len(labelled):
            shared = min(shared, int(labelled[0]) + 1)
    if shared < 1:
        raise DataError(
            "a preference pair's chosen and rejected sequences start with different tokens: there is no prompt to "
            "share; set data.collator.init_args.share_prompt=false"
        )
    return shared


class PaddedCollator:
    """Pad examples to the longest in the batch (the paper's baseline), with an `attention_mask`.

    Lengths 4, 8, 5, 11 become `input_ids` (4, 11) right-padded with `pad_token_id`, labels -100 on pads and on
    each example's first token (as in the packed format, so both see the same target tokens):

    >>> batch = PaddedCollator()([{"input_ids": list(range(1, n + 1))} for n in (4, 8, 5, 11)])
    >>> tuple(batch["input_ids"].shape), batch["counts"]["slot_tokens"], batch["counts"]["attn_cost"]
    ((4, 11), 44, 484)

    Args:
        pad_token_id: the tokenizer's pad id (linked from the data module).
        pad_to_multiple_of: round the padded length up (8 or 64 suit tensor cores).
    """

    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: int | None = None) -> None:
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def plan_slots(self, plan: PackPlan) -> PlanSlots:
        """Per pack of `plan`, the slots and attention pairs this collator's batch would compute (its `counts`)."""
        width = padded_lengths(np.maximum(_longest_per_pack(plan), 1), self.pad_to_multiple_of, None)
        rows = np.maximum(plan.examples_per_pack(), 1)
        return PlanSlots(rows * width, rows * width**2, rows, width, padded=True)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        _refuse_pairs(examples, type(self).__name__)
        host = host_entries(examples)
        examples = [ex for ex in examples if len(ex[INPUT_IDS]) > 0]
        lengths = [len(ex[INPUT_IDS]) for ex in examples] or [0]
        width = int(padded_lengths(np.array([max(max(lengths), 1)]), self.pad_to_multiple_of, None)[0])
        rows = max(len(examples), 1)
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((rows, width), dtype=torch.long)
        if not examples:
            attention_mask[0, 0] = 1  # an empty pack: one masked token so every rank still steps
        for row, ex in enumerate(examples):
            x = as_array(ex[INPUT_IDS])
            y = as_array(ex[LABELS]).copy() if LABELS in ex else x.copy()
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
                attn_cost=attention_cost([width] * rows),
                truncated_tokens=sum(int(ex.get(TRUNCATED_TOKENS, 0)) for ex in examples),
            ),
            LENGTHS: real_lengths,
            **host,
        }
