"""Context parallelism: one pack's tokens split over the ranks of a context-parallel group, exactly.

    ShardedStrategy(context_parallel_size=2)        # configs/context_parallel.yaml: 2 ranks train each pack
    local = deal(batch, size=2, rank=0)             # this rank's half of the pack (PackedCausalLM deals each batch)

The pack is made as always (the collator's `cu_seq_lens`, positions restarting per document, labels), then dealt:
every document is cut into 2 x cp chunks and rank r takes chunks r and 2 x cp - 1 - r (the head and the tail: each
rank the same share of the document's tokens and of its causal (query, key) pairs); a document shorter than
2 x cp goes whole to the rank holding the fewest tokens so far (`plan`). A rank's row is its pieces in the pack's
order, then padding up to the longest rank's count plus one slot, so every rank's row has one length; its labels
are the pack's next-token targets moved one slot right, so that the loss's usual shift (the hidden state at t
predicts label t + 1) gives each token its own target on every rank, and a document's last token predicts nothing,
as in the pack.

In every attention layer the keys and values are all-gathered over the group (`gather_tokens`: key/value heads
only, so grouped-query attention moves fewer bytes; its backward sums and reduce-scatters their gradients in
fp32), and each
rank's piece of a document attends that document's keys from its start up to the piece's end: `gathered_index`
picks them, per piece `cu_seq_lens_q` / `cu_seq_lens_k`, causality aligned bottom-right; the route shared prompts take
through every backend (flash_attn, torch_varlen, per_example, sdpa_mask). The rest of a decoder is per token. The
parameters' gradients are summed over the data x context ranks (FSDP2 shards over both), and the loss is divided by
the optimizer step's label count, as without context parallelism: the losses and the weights are one process's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lit_packing.batch import (
    CONTEXT,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    GATHERED_INDEX,
    IGNORE_INDEX,
    INPUT_IDS,
    KEY_INDEX,
    LABELS,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    POSITION_IDS,
    SEQ_IDX,
)
from lit_packing.errors import ConfigError

CP_SIZE_SETTING = "trainer.strategy.init_args.context_parallel_size"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContextGroup:
    """The context-parallel ranks that train one pack together: their process group, how many, this one's place."""

    group: Any  # a torch.distributed ProcessGroup
    size: int
    rank: int


@dataclass(frozen=True)
class Deal:
    """How a pack's T tokens are spread: `tokens[r]` the pack positions rank r holds, in its row's order, and
    `slots` every rank's row length (the longest rank's count plus at least one slot of padding)."""

    tokens: list[np.ndarray]
    slots: int

    def gathered_position(self, total: int) -> np.ndarray:
        """Where each of the pack's `total` tokens lands in the all-gather of the ranks' rows (rank-major)."""
        where = np.empty(total, dtype=np.int64)
        for rank, held in enumerate(self.tokens):
            where[held] = rank * self.slots + np.arange(len(held))
        return where

    def undeal(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """The pack's order back from every rank's (slots, ...) outputs: (T, ...), padding dropped."""
        total = sum(len(held) for held in self.tokens)
        out = rows[0].new_empty((total, *rows[0].shape[1:]))
        for held, row in zip(self.tokens, rows, strict=True):
            out[torch.from_numpy(held)] = row[: len(held)]
        return out


def plan(cu: list[int] | np.ndarray, size: int) -> list[list[tuple[int, int, int]]]:
    """Each rank's pieces of a pack of documents (`cu`: their boundaries), as (document start, piece start, piece
    stop) in the pack's order: a document of 2 x `size` tokens or more cut into 2 x `size` chunks, rank r taking
    chunks r and 2 x `size` - 1 - r; a shorter one whole to the rank with the fewest tokens so far.

    >>> plan([0, 8, 9], 2)     # 8 tokens in chunks of 2: rank 0 the first and last, rank 1 the middle two;
    ... # then 1 token whole, to the lowest of the ranks holding the fewest (both hold 4: rank 0)
    [[(0, 0, 2), (0, 6, 8), (8, 8, 9)], [(0, 2, 4), (0, 4, 6)]]
    """
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(size)]
    held = [0] * size
    chunks = 2 * size
    for start, stop in zip(cu[:-1], cu[1:]):
        start, stop, length = int(start), int(stop), int(stop - start)
        if length >= chunks:
            bounds = [start + length * c // chunks for c in range(chunks + 1)]
            for rank in range(size):
                for c in (rank, chunks - 1 - rank):
                    pieces[rank].append((start, bounds[c], bounds[c + 1]))
                held[rank] += bounds[rank + 1] - bounds[rank] + bounds[chunks - rank] - bounds[chunks - 1 - rank]
        elif length:
            rank = held.index(min(held))
            pieces[rank].append((start, start, stop))
            held[rank] += length
    return pieces


def deal_of(pieces: list[list[tuple[int, int, int]]]) -> Deal:
    """The token positions each rank holds (`plan`'s pieces) and the row length they share."""
    tokens = [np.concatenate([np.arange(a, b) for _, a, b in mine]) if mine else np.zeros(0, np.int64)
              for mine in pieces]  # fmt: skip
    return Deal([t.astype(np.int64) for t in tokens], max(len(t) for t in tokens) + 1)


def deal(batch: Mapping[str, Any], context: ContextGroup | int, rank: int | None = None) -> dict[str, Any]:
    """This rank's part of a packed one-row batch (the module docstring): its tokens, positions and targets, the
    padding after them, its pieces' `cu_seq_lens_q` / `cu_seq_lens_k` and `gathered_index` into the all-gathered keys,
    and the group the attention gathers over (`CONTEXT`). Host-side values (`counts`, `step`, `lengths`, `rows`)
    are the pack's: callbacks count each token once. `context` may be a size, with `rank`, for a run without a
    group (what the tests compare with).
    """
    group = context if isinstance(context, ContextGroup) else ContextGroup(None, int(context), int(rank or 0))
    if group.group is not None:
        check_one_pack(batch, group)
    ids, positions = batch[INPUT_IDS], batch[POSITION_IDS]
    device, total = ids.device, ids.shape[1]
    cu = batch[CU_SEQ_LENS_Q].cpu().numpy().astype(np.int64)
    pieces = plan(cu, group.size)
    dealt = deal_of(pieces)
    mine, slots = dealt.tokens[group.rank], dealt.slots
    pad = slots - len(mine)
    where = dealt.gathered_position(total)
    index = torch.from_numpy(mine).to(device)
    own = pieces[group.rank]
    keys = [where[start:stop] for start, _, stop in own] + [group.rank * slots + np.arange(len(mine), slots)]
    lengths_q = [b - a for _, a, b in own] + [pad]
    lengths_k = [b - s for s, _, b in own] + [pad]
    out = {key: value for key, value in batch.items() if key != SEQ_IDX}
    out.update({
        INPUT_IDS: torch.cat([ids[0, index], ids.new_zeros(pad)])[None],
        POSITION_IDS: torch.cat([positions[0, index], torch.arange(pad, device=device, dtype=positions.dtype)])[None],
        CU_SEQ_LENS_Q: torch.tensor(np.cumsum([0, *lengths_q]), dtype=torch.int32, device=device),
        CU_SEQ_LENS_K: torch.tensor(np.cumsum([0, *lengths_k]), dtype=torch.int32, device=device),
        MAX_LENGTH_Q: max(lengths_q),
        MAX_LENGTH_K: max(lengths_k),
        GATHERED_INDEX: torch.from_numpy(np.concatenate(keys)).to(device),
        CONTEXT: group if group.group is not None else None,
    })  # fmt: skip
    if LABELS in batch:
        out[LABELS] = _dealt_targets(batch[LABELS], cu, index, pad)
    return out


def check_one_pack(batch: Mapping[str, Any], group: ContextGroup) -> None:
    """Every rank of a context group must hold the same pack before it is dealt: one all-gather of (row length,
    a checksum of its tokens, targets and boundaries) over the group, on the batch's device (NCCL has no host
    path). Rows of other lengths would hang NCCL's gathers in the first attention layer; the same length with other
    tokens would train silently wrong.

    Raises:
        ConfigError: the ranks hold different packs (naming the ranks and what differs), on every rank of the group.
    """
    ids = batch[INPUT_IDS]
    weights = torch.arange(1, ids.shape[1] + 1, device=ids.device)  # position-weighted: a reordering shows
    labels = batch.get(LABELS, ids)
    cu = batch[CU_SEQ_LENS_Q].to(ids.device, torch.int64)
    bounds = (cu * torch.arange(1, len(cu) + 1, device=cu.device)).sum()
    mine = torch.stack([torch.tensor(ids.shape[1], device=ids.device), (ids[0].long() * weights).sum(),
                        (labels[0].long() * weights).sum(), bounds])  # fmt: skip
    held = [torch.empty_like(mine) for _ in range(group.size)]
    dist.all_gather(held, mine, group=group.group)
    packs = [row.tolist() for row in held]
    other = next((r for r, pack in enumerate(packs) if pack != packs[0]), None)
    if other is not None:
        what = (f"rows of {packs[0][0]} and {packs[other][0]} tokens" if packs[0][0] != packs[other][0]
                else "rows of one length with other tokens")  # fmt: skip
        raise ConfigError(CP_SIZE_SETTING, f"context-parallel ranks 0 and {other} of a group hold different packs "
                          f"({what}); the ranks of a context group train one pack together", "deal the batches by "
                          "data-parallel rank only (the toolkit's samplers do; a DataLoader of your own must give "
                          "every rank of a context group the same batches), or set it to 1")  # fmt: skip


def _dealt_targets(labels: torch.Tensor, cu: np.ndarray, index: torch.Tensor, pad: int) -> torch.Tensor:
    """A rank's labels: the pack's next-token targets of its tokens, one slot right (the loss shifts them back),
    a document's last token's ignored; padding ignored. (1, len(index) + pad)."""
    total = labels.shape[1]
    targets = torch.full((total,), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    targets[:-1] = labels[0, 1:]
    ends = (cu[1:] - 1)[cu[1:] > cu[:-1]]
    targets[torch.from_numpy(ends).to(labels.device)] = IGNORE_INDEX  # a document's last token predicts nothing
    fill = torch.full((pad,), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    return torch.cat([fill[:1], targets[index], fill[1:]])[None]


def spread(cu: list[int] | np.ndarray, size: int) -> tuple[float, float]:
    """How unevenly a pack's work falls on `size` ranks dealt by `plan`: (the most tokens on a rank over the mean,
    the most causal (query, key) pairs on a rank over the mean); 1.0 is even."""
    tokens, pairs = np.zeros(size), np.zeros(size)
    for rank, mine in enumerate(plan(cu, size)):
        for start, a, b in mine:
            tokens[rank] += b - a
            pairs[rank] += sum(range(a - start + 1, b - start + 1))  # query i sees i + 1 keys
    return float(tokens.max() / max(tokens.mean(), 1e-9)), float(pairs.max() / max(pairs.mean(), 1e-9))


class _GatherTokens(torch.autograd.Function):
    """All-gather along the token dim over a context group, then the rows `index` picks. The backward sums the
    picked rows' gradients into the gathered rows and reduce-scatters them back to their ranks, both in fp32 (or the
    gradient's own dtype where wider), then casts once to the input's dtype: a document's first keys are picked by
    every later piece of it, and summing those many terms in bf16 (autocast's activation dtype) would round at every
    addition."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, context: ContextGroup, index: torch.Tensor) -> torch.Tensor:
        ctx.context, ctx.rows = context, tokens.shape[0]
        ctx.save_for_backward(index)
        gathered = tokens
        if context.size > 1:
            gathered = tokens.new_empty((context.size * tokens.shape[0], *tokens.shape[1:]))
            dist.all_gather_single(gathered, tokens.contiguous(), group=context.group)
        return gathered.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (index,) = ctx.saved_tensors
        size = ctx.context.size
        wide = torch.promote_types(grad.dtype, torch.float32)  # fp32 for half precision; fp64 stays fp64
        summed = grad.new_zeros((size * ctx.rows, *grad.shape[1:]), dtype=wide)
        summed.index_add_(0, index, grad.to(wide))
        if size > 1:
            mine = summed.new_empty((ctx.rows, *grad.shape[1:]))
            dist.reduce_scatter_single(mine, summed, op=dist.ReduceOp.SUM, group=ctx.context.group)
            summed = mine
        return summed.to(grad.dtype), None, None


def gather_tokens(
    key: torch.Tensor, value: torch.Tensor, context: ContextGroup, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's keys and values (T_local, Hkv, D) gathered over the group (one collective when their head dims
    match, concatenated over heads; two otherwise), then the rows `index` (`gathered_index`) picks: each piece's
    document from its start (`_GatherTokens`, whose backward sums in fp32). A group of one (the construction
    probe's) gathers nothing."""
    if key.shape[-1] == value.shape[-1]:
        both = _GatherTokens.apply(torch.cat([key, value], dim=1), context, index)
        return both[:, : key.shape[1]], both[:, key.shape[1] :]
    return _GatherTokens.apply(key, context, index), _GatherTokens.apply(value, context, index)


def context_group(mesh: Any, model: torch.nn.Module, packing: Any, settings: Mapping[str, Any]):
    """This rank's `ContextGroup` on a device mesh with a context-parallel dim of several ranks (checked by
    `check_context_parallel` first, said once in the log, with what `pack_model` found: `packing`), else None."""
    from lit_packing.models.sharding import CONTEXT_PARALLEL, context_parallel_size

    size = context_parallel_size(mesh)
    if size <= 1:
        return None
    check_context_parallel(size, model, packing.needs.position_bias, settings, packing.keyed)
    ranks = mesh[CONTEXT_PARALLEL]
    if dist.get_rank() == 0:
        log.info("context parallel: each pack's tokens split over %d ranks, keys and values all-gathered in every "
                 "attention layer", size)  # fmt: skip
    return ContextGroup(ranks.get_group(), size, ranks.get_local_rank())


def check_context_parallel(
    size: int, model: torch.nn.Module, position_bias: bool, settings: Mapping[str, Any], keyed: bool = True
) -> None:
    """Refuse in one line what cannot be split over `size` context-parallel ranks yet: attention layers that do not
    hand the attention function `gathered_index` and the group (`keyed`: the construction probe's `Probe.keyed`; each
    rank would attend its own keys with the boundaries of the gathered ones), non-attention token mixers (a
    state-space scan or a convolution would pass its state from rank to rank), a position bias over the pack's
    (query, key) pairs, preference objectives, `loss_normalization: sequence` (a document's mean would span ranks)
    and `compile` (not measured). `settings`: the model's hyperparameters."""
    if size <= 1:
        return
    if not keyed:
        raise ConfigError(CP_SIZE_SETTING, f"{size}: {type(model).__name__}'s attention layers do not hand the "
                          "attention function gathered_index and the context group (the construction probe passed "
                          "them), so a rank would attend its own keys only", "set it to 1 for this model")  # fmt: skip
    from lit_packing.models.mixers import find_mixers

    fix = "set it to 1 for this model"
    for name, module in find_mixers(model)[:1]:
        raise ConfigError(CP_SIZE_SETTING, f"{size}: {name} ({type(module).__name__}) mixes tokens outside "
                          "attention, and its state would have to pass from rank to rank", fix)  # fmt: skip
    if position_bias:
        raise ConfigError(CP_SIZE_SETTING, f"{size}: {type(model).__name__} adds a position bias over the whole "
                          "row's (query, key) pairs, which a rank's gathered keys do not have", fix)  # fmt: skip
    refused = {
        "objective": (settings.get("objective", "sft") != "sft", "preference pairs are not split over ranks"),
        "loss_normalization": (settings.get("loss_normalization") == "sequence",
                               "a document's mean loss would span ranks: use token"),
        "compile": (bool(settings.get("compile")), "compiled context parallelism is not measured"),
    }  # fmt: skip
    for key, (bad, why) in refused.items():
        if bad:
            raise ConfigError(CP_SIZE_SETTING, f"{size} with model.{key}={settings.get(key)}: {why}",
                              f"set it to 1, or change model.{key}")  # fmt: skip


def check_dealable(batch: Mapping[str, Any]) -> None:
    """A batch context parallelism can deal: one packed row without shared prompts."""
    if KEY_INDEX in batch:
        raise ConfigError("data.collator.init_args.share_prompt", "shared prompts are not split over "
                          "context-parallel ranks", f"set it to false, or {CP_SIZE_SETTING}=1")  # fmt: skip
    if CU_SEQ_LENS_Q not in batch or batch[INPUT_IDS].shape[0] != 1:
        raise ConfigError("data.collator", "context parallelism splits packed rows, and this batch is padded",
                          f"use a packing collator, or {CP_SIZE_SETTING}=1")  # fmt: skip
