"""Rollout groups into one packed row: each group's prompt run once, its G completions each attending to the
prompt and to itself only, positions continuing after the prompt (the layout `PairCollator(share_prompt=True)`
gives a pair, for G completions).

    batch = GroupCollator()(groups)   # groups: [{"input_ids": prompt + completions, "completion_tokens": [...],
                                      #            "rewards": [...]}, ...]

A group item holds its prompt's tokens once, then its completions' (`completion_tokens` says how many each has),
a reward per completion (or `advantages` per completion, or `token_advantages` per completion token, flat), and
optionally the sampler's log-probs of every completion token (`behaviour_logps`, flat). Every completion token is a
label; the prompt's are not. One group of prompt [5, 6] and completions [7, 8] and [9]:

>>> group = {"input_ids": [5, 6, 7, 8, 9], "completion_tokens": [2, 1], "rewards": [1.0, 0.0]}
>>> batch = GroupCollator()([group])
>>> batch["cu_seq_lens_q"].tolist(), batch["prompts"].tolist(), batch["completions"].tolist()
([0, 2, 4, 5], [0], [1, 2])
>>> batch["position_ids"][0].tolist(), batch["labels"][0].tolist(), batch["key_index"].tolist()
([0, 1, 2, 3, 2], [-100, -100, 7, 8, 9], [0, 1, 0, 1, 2, 3, 0, 1, 4])

Unshared (`share_prompt=False`), each completion is its own sequence, prompt included (the prompt runs G times):

>>> batch = GroupCollator(share_prompt=False)([group])
>>> batch["cu_seq_lens_q"].tolist(), batch["completions"].tolist(), batch["labels"][0].tolist()
([0, 4, 7], [0, 1], [-100, -100, 7, 8, -100, -100, 9])

A batch carries `rewards` (C,) float64 (or `advantages`), `groups` (C,) the group of each completion, and
`token_advantages` and `behaviour_logps` (N,) in the order of the row's label tokens when every group has them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lit_packing.batch import (
    ADVANTAGES,
    BEHAVIOUR_LOGPS,
    COMPLETION_TOKENS,
    COMPLETIONS,
    GROUPS,
    IGNORE_INDEX,
    INPUT_IDS,
    REWARDS,
    TOKEN_ADVANTAGES,
)
from lit_packing.data.collate import PackedCollator, PlanSlots, as_array, host_entries, shared_row
from lit_packing.errors import DataError

if TYPE_CHECKING:
    from lit_packing.samplers import PackPlan


class GroupCollator:
    """Rollout groups into one packed row (see the module docstring).

    Args: those of `PackedCollator` (tail padding), and `share_prompt` (True: each prompt once).
    """

    def __init__(
        self,
        pad_token_id: int = 0,
        pad_to_multiple_of: int | None = None,
        bucket_sizes: list[int] | None = None,
        share_prompt: bool = True,
    ) -> None:
        self.packed = PackedCollator(pad_token_id, pad_to_multiple_of, bucket_sizes)
        self.share_prompt = share_prompt

    def plan_slots(self, plan: PackPlan) -> PlanSlots:
        """Per pack of `plan` (whose items are groups, each counted as its prompt once and its completions), the
        slots and an upper bound on the attention pairs (each completion attends apart: fewer)."""
        return self.packed.plan_slots(plan)

    def __call__(self, groups: list[dict[str, Any]]) -> dict[str, Any]:
        host = host_entries(groups)
        parts = [_group_parts(group) for group in groups]
        if self.share_prompt:
            batch, completions = shared_row(
                [(prompt, _masked(prompt), [(c, c) for c in outs]) for prompt, outs in parts], self.packed
            )
        else:
            sequences = [{INPUT_IDS: np.concatenate([p, c]), "labels": np.concatenate([_masked(p), c])}
                         for p, outs in parts for c in outs]  # fmt: skip
            batch = self.packed.collate_examples(sequences)
            completions = list(range(len(sequences)))
        sizes = [len(outs) for _, outs in parts]
        batch[COMPLETIONS] = torch.tensor(completions, dtype=torch.int64)
        batch[GROUPS] = torch.repeat_interleave(torch.arange(len(parts)), torch.tensor(sizes, dtype=torch.int64))
        if not groups:  # an empty pack (a rank's share of a step's last packs): no completion, no reward
            batch[REWARDS] = torch.zeros(0, dtype=torch.float64)
        for key in (REWARDS, ADVANTAGES):
            if groups and all(key in group for group in groups):
                batch[key] = torch.tensor([float(x) for group in groups for x in group[key]], dtype=torch.float64)
        for key in (TOKEN_ADVANTAGES, BEHAVIOUR_LOGPS):
            if groups and all(group.get(key) is not None for group in groups):
                values = [np.asarray(group[key], dtype=np.float64) for group in groups]
                batch[key] = torch.tensor(np.concatenate(values))
        batch.update(host)
        return batch


def _masked(ids: np.ndarray) -> np.ndarray:
    return np.full(len(ids), IGNORE_INDEX, dtype=np.int64)


def _group_parts(group: dict[str, Any]) -> tuple[np.ndarray, list[np.ndarray]]:
    """A group item's prompt ids and each completion's ids, its counts checked."""
    ids, sizes = as_array(group[INPUT_IDS]), [int(n) for n in group.get(COMPLETION_TOKENS) or []]
    prompt = len(ids) - sum(sizes)
    if not sizes or min(sizes) < 1 or prompt < 1:
        raise DataError(
            f"GroupCollator got an item that is no rollout group (completion_tokens={sizes} of {len(ids)} tokens): "
            "a group needs a prompt and at least one completion of at least one token"
        )
    for key in (REWARDS, ADVANTAGES):
        if key in group and len(group[key]) != len(sizes):
            raise DataError(f"a group of {len(sizes)} completions has {len(group[key])} {key}")
    for key in (TOKEN_ADVANTAGES, BEHAVIOUR_LOGPS):
        values = group.get(key)
        if values is not None and len(values) != sum(sizes):
            raise DataError(f"a group of {sum(sizes)} completion tokens has {len(values)} {key}")
    ends = np.cumsum([prompt, *sizes])
    return ids[:prompt], [ids[a:b] for a, b in zip(ends[:-1], ends[1:])]
