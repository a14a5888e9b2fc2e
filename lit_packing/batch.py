"""The batch format, defined once: keys, `IGNORE_INDEX`, the host-side counts and the optimizer step's totals that
collators, loss, samplers, callbacks and the packing report share (FLOP formulas live in `lit_packing.cost`).

    from lit_packing.batch import COUNTS, IGNORE_INDEX, LABELS, attention_cost

Key names are Hugging Face's (see `lit_packing.data.collate` for the tensors a collator builds). Besides tensors,
every batch carries host-side Python values that callbacks and the loss read without a device sync: `counts`
(this micro-batch, `Counts`), `lengths` (each real example's length), `step` (the whole optimizer step's totals)
and `rows` (each example's row in the source).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np
import torch
from typing_extensions import NotRequired  # typing's from Python 3.11 (torch requires typing_extensions)

IGNORE_INDEX = -100  # label of a token no loss is taken on (PyTorch's cross-entropy default)

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
LENGTHS = "lengths"  # host list: each real example's token count (windowed attention FLOPs need more than sums)
STEP = "step"
ROWS = "rows"
INDEX = "index"  # an example's row in the source dataset (a column of the tokenized data, and an item key)
SOURCE_TOKENS = "source_tokens"  # host list of a streamed batch: real tokens of each of the stream's sources in it
KEY_LENGTHS = "key_lengths"  # host list beside `lengths` when prompts are shared: the keys each segment attends
WINDOW = "window"  # host dict of a streamed batch: its window's number, examples, fill, data wait so far
# host dict of an on-policy batch (`data.on_policy`): its round's number and rollout stats, `on_policy` (the round's
# first step: trained by the policy that sampled it), `clock` (the rank's seconds spent making rounds so far:
# sampling, scoring, the old log-probs' pass), `truncated` (per completion of the batch, in order: whether it ended
# without an end-of-sequence id) and, past the first step of a round trained in half precision, `old_logps` (per
# completion token, flat as `behaviour_logps`: the training forward's log-probs of the policy that sampled)
ROUND = "round"
PACKED_KEYS = (CU_SEQ_LENS_Q, CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K, SEQ_IDX)
# Which keys each segment of `cu_seq_lens_q` attends, in the two layouts (`cu_seq_lens_k` / `max_length_k` describe
# them; causality is bottom-right aligned, as in FlashAttention); every attention kernel reads the picked keys:
# - Shared prompts (`PairCollator(share_prompt=True)`): `KEY_INDEX` (Tk,) int64 into this row's tokens (a
#   continuation's: its prompt's tokens, then its own).
# - Context parallelism (`models.context.deal`): `GATHERED_INDEX` (Tk,) int64 into the keys all-gathered over the
#   group `CONTEXT` (a `ContextGroup`; rank-major, each rank's row in turn): each piece's document from its start.
KEY_INDEX = "key_index"
GATHERED_INDEX = "gathered_index"
CONTEXT = "context"
# What a transformers model reads of a batch (packed or padded); the rest is for the loss and the callbacks.
# A vision-language model's image inputs, each image's in the order of the documents that hold them
# (`lit_packing.models.vlm`): what the family's processor makes of the batch's images.
PIXEL_VALUES = "pixel_values"
IMAGE_GRID_THW = "image_grid_thw"  # Qwen-VL: (images, 3) patches in time, height, width
PIXEL_ATTENTION_MASK = "pixel_attention_mask"  # Idefics3 / SmolVLM: (1, tiles, H, W)
IMAGE_SIZES = "image_sizes"  # LLaVA: (images, 2)
MM_TOKEN_TYPE_IDS = "mm_token_type_ids"  # (1, T): 0 text, 1 image, 2 video
IMAGE_KEYS = (PIXEL_VALUES, IMAGE_GRID_THW, PIXEL_ATTENTION_MASK, IMAGE_SIZES, MM_TOKEN_TYPE_IDS)
MODEL_KEYS = (
    INPUT_IDS, ATTENTION_MASK, POSITION_IDS, CU_SEQ_LENS_Q, CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K, KEY_INDEX,
    GATHERED_INDEX, CONTEXT, *IMAGE_KEYS,
)  # fmt: skip
TRUNCATED_TOKENS = "truncated_tokens"  # an example's tokens cut by the overlong policy (a tokenized column)
LABEL_TOKENS = "label_tokens"  # an example's trained tokens (labels != -100, first label masked; a tokenized column)
IMAGES = "images"  # an image chat's kept images as `datasets.Image` stores them (a tokenized column, an item key)
# Preference pairs: a tokenized pair is one item, its chosen sequence's tokens first (`CHOSEN_TOKENS` of them), then
# its rejected one's; a batch of pairs names, for each pair, the segments (rows of `cu_seq_lens_q`) of its two
# sequences: `PAIRS` (P, 2) int64, [chosen segment, rejected segment]. With shared prompts the two are the
# continuations, and `PROMPTS` (P,) int64 names the segment of each pair's prompt, which both attend to.
CHOSEN_TOKENS = "chosen_tokens"
PAIRS = "pairs"
PROMPTS = "prompts"
# Rollout groups (`GroupCollator`): a group item holds its prompt's tokens once, then its G completions'
# (`COMPLETION_TOKENS`: each one's count), a reward per completion (`REWARDS`), an advantage per completion
# (`ADVANTAGES`) or per completion token (`TOKEN_ADVANTAGES`, flat), and optionally the behaviour policy's log-probs
# of every completion token (`BEHAVIOUR_LOGPS`, flat). A batch of groups
# names each completion's segment (`COMPLETIONS` (C,) int64) and its group (`GROUPS` (C,) int64, 0..n-1 in the
# batch); with shared prompts, `PROMPTS` (n,) the segment of each group's prompt, which its completions attend to.
COMPLETION_TOKENS = "completion_tokens"
REWARDS = "rewards"
ADVANTAGES = "advantages"
TOKEN_ADVANTAGES = "token_advantages"
BEHAVIOUR_LOGPS = "behaviour_logps"
COMPLETIONS = "completions"
GROUPS = "groups"


class Counts(TypedDict):
    """Host-side counts of one micro-batch (plain Python ints: reading them never syncs a device).

    `real_tokens` are the examples' tokens, `slot_tokens` what the step computes (padding included); `attn_cost`
    is the attention the device computes in (query, key) pairs: sum(L^2) packed (tail padding included),
    rows * max(L)^2 padded; `sum_sq_lengths` the attention of the real examples alone. A batch of image chats
    (`ImageChatCollator`) also counts `image_tokens`: its tokens that hold an image's features (the model's
    `image_token_id`), part of `real_tokens`.
    """

    examples: int
    real_tokens: int
    label_tokens: int
    slot_tokens: int
    attn_cost: int
    sum_sq_lengths: int
    truncated_tokens: int
    image_tokens: NotRequired[int]


def is_packed(batch: dict[str, Any]) -> bool:
    """True for a flattened batch (varlen keys present), False for a padded one."""
    return CU_SEQ_LENS_Q in batch


def attention_cost(
    lengths: Sequence[int] | np.ndarray, window: int | None = None, keys: Sequence[int] | None = None
) -> int:
    """(query, key) pairs attention computes over sequences of `lengths`: sum(L * min(K, window)), K the keys each
    attends (`keys`: a shared prompt's continuation attends the prompt too), else K = L.

    >>> attention_cost([4, 8, 5, 11])
    226
    >>> attention_cost([4, 8, 5, 11], window=5)
    136
    >>> attention_cost([3, 2, 1], keys=[3, 5, 4])  # a prompt of 3, continuations of 2 and 1
    23
    """
    n = np.asarray(lengths, dtype=np.int64)
    k = n if keys is None else np.asarray(keys, dtype=np.int64)
    return int((n * (k if window is None else np.minimum(k, window))).sum())


def batch_counts(
    lengths: Sequence[int],
    label_tokens: int,
    slot_tokens: int,
    attn_cost: int,
    truncated_tokens: int = 0,
    keys: Sequence[int] | None = None,
    examples: int | None = None,
) -> Counts:
    """The `counts` every batch carries.

    Args:
        lengths: real tokens of each example in the batch.
        label_tokens: labels != IGNORE_INDEX, i.e. tokens that contribute to the loss.
        slot_tokens: tokens the step computes, padding included.
        attn_cost: attention the device computes in (query, key) pairs (see `Counts`).
        truncated_tokens: tokens cut from these examples by the overlong policy.
        keys: with shared prompts, the keys each of `lengths` attends (`attention_cost`).
        examples: the sequences, where `lengths` are not one per sequence (shared prompts: a pair's prompt and
            two continuations are its two sequences).

    >>> batch_counts([4, 8], label_tokens=10, slot_tokens=16, attn_cost=2 * 8 * 8)["sum_sq_lengths"]
    80
    """
    return Counts(
        examples=len(lengths) if examples is None else int(examples),
        real_tokens=int(sum(lengths)),
        label_tokens=int(label_tokens),
        slot_tokens=int(slot_tokens),
        attn_cost=int(attn_cost),
        sum_sq_lengths=attention_cost(lengths, keys=keys),
        truncated_tokens=int(truncated_tokens),
    )


class Pack(list):
    """One micro-batch's items (dataset indices, slices, or the examples read for them) and its optimizer step.

    `step` holds `{"label_tokens": int, "sequences": int}` summed over every micro-batch of the optimizer step on
    every rank (None when unknown): the loss divides by it, so no rank needs to communicate to normalise.

    >>> Pack([3, 1], step=step_totals([5, 0])).step
    {'label_tokens': 5, 'sequences': 1}
    """

    def __init__(self, items=(), step: dict[str, int] | None = None) -> None:
        super().__init__(items)
        self.step = step


def step_totals(label_tokens: Sequence[int]) -> dict[str, int]:
    """The `step` entry from the label-token counts of every item (example or slice) of one optimizer step.

    `label_tokens` normalises the token-mean loss, `sequences` (items with at least one label) the sequence mean.

    >>> step_totals([3, 0, 4])
    {'label_tokens': 7, 'sequences': 2}
    """
    counts = np.asarray(label_tokens, dtype=np.int64)
    return {"label_tokens": int(counts.sum()), "sequences": int((counts > 0).sum())}


def continuation_prompts(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """With shared prompts (`PROMPTS` in the batch): each continuation's segment (a pair's two sides, a group's
    completions) and its prompt's segment, two (C,) int64 tensors.

    >>> batch = {PROMPTS: torch.tensor([0, 3]), PAIRS: torch.tensor([[1, 2], [4, 5]])}
    >>> [t.tolist() for t in continuation_prompts(batch)]
    [[1, 2, 4, 5], [0, 0, 3, 3]]
    """
    prompts = batch[PROMPTS]
    if PAIRS in batch:
        return batch[PAIRS].reshape(-1), prompts.repeat_interleave(2)
    return batch[COMPLETIONS], prompts[batch[GROUPS]]


def model_inputs(batch: dict[str, Any], device: torch.device | str | None = None) -> dict[str, Any]:
    """The keyword arguments a transformers model takes from a batch (`MODEL_KEYS`), tensors moved to `device`:
    `model(**model_inputs(batch, "cuda"), use_cache=False)`."""
    return {k: v.to(device) if device is not None and torch.is_tensor(v) else v for k, v in batch.items()
            if k in MODEL_KEYS}  # fmt: skip


def attach_step(batches: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give every micro-batch of one optimizer step the step's `step` totals (for hand-built loaders and tests).

    On one rank this is all the loss needs; with several ranks, pass every rank's micro-batches of the step.

    >>> labels = torch.tensor([[IGNORE_INDEX, 5, 6, IGNORE_INDEX, 7]])
    >>> batch = {LABELS: labels, SEQ_IDX: torch.tensor([[0, 0, 0, 1, 1]])}
    >>> attach_step([batch])[0][STEP]
    {'label_tokens': 3, 'sequences': 2}
    """
    step = step_totals([n for batch in batches for n in item_label_tokens(batch)])
    return [{**batch, STEP: step} for batch in batches]


def item_label_tokens(batch: dict[str, Any]) -> list[int]:
    """Label tokens of each item (packed: each `seq_idx` segment, a preference pair's two together; padded: each
    row) of a collated batch."""
    mask = batch[LABELS] != IGNORE_INDEX
    if PAIRS in batch:
        counts = torch.bincount(batch[SEQ_IDX][mask].long(), minlength=int(batch[SEQ_IDX].max()) + 1)
        return counts[batch[PAIRS]].sum(dim=1).tolist()
    if SEQ_IDX in batch:
        return torch.bincount(batch[SEQ_IDX][mask].long()).tolist()
    return mask.sum(dim=1).tolist()


@dataclass(frozen=True)
class StepShape:
    """One micro-batch: what it computes and its attention cost (the memory estimate sizes it).

    Attributes:
        slot_tokens: tokens computed, padding included (rows x width when padded).
        attn_pairs: sum(L^2) packed, rows x width^2 padded.
        rows: batch rows (1 when packed).
        width: row length.
        padded: a padded batch (2D attention mask) rather than a packed row.
    """

    slot_tokens: int
    attn_pairs: int
    rows: int
    width: int
    padded: bool = False

    def describe(self) -> str:
        if self.padded:
            return f"{self.rows} padded rows x {self.width:,} tokens = {self.slot_tokens:,} slots"
        return f"{self.slot_tokens:,} tokens in one packed row"
