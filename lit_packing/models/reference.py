"""Reference log-probabilities computed once (`model.reference: precomputed`, the default of dpo and ipo, and of
grpo on stored rollouts): one no-grad pass of the initial model over every pair (or rollout group) before the first
step, cached beside the tokenized data.

    table = ReferenceTable.of(batches)                 # (rows, PairLogps) of each batch of the pass
    reference = table.lookup(batch[ROWS], policy)      # the PairLogps of a batch's pairs, in the batch's order

Why: the reference is the initial model, which never changes, so its log-probabilities of a pair never change
either; a frozen copy (`copy`) holds a second model and runs a second forward every step (and validation) for
numbers known before the first. A table holds, per pair (its `index`, the row `batch["rows"]` carries), the summed
log-probabilities of the chosen and rejected completions and their token counts: 32 bytes a pair.

A table is cached in the tokenized data's folder under a key of the initial model (`model.name_or_path` and a hash
of its weights as built, before any checkpoint is loaded), the precision and the split's tokenized data (its
`datasets` fingerprint: source, tokenizer, settings, split and limit), so another model, precision or data misses
it; and it travels in every checkpoint, so a resumed fit takes the initial model's log-probabilities, never the
trained policy's. The token counts are checked against each batch's: a table of other tokens is refused.

A rollout group's table (`TokenTable`) holds the log-probability of every completion token (GRPO's KL is per
token), at the objective's sampling temperature (part of the key), with each completion's token count: 8 bytes a
completion token.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lit_packing.batch import GROUPS, ROWS
from lit_packing.errors import ConfigError, DataError
from lit_packing.models.grpo import CompletionLogps, completion_logps
from lit_packing.models.head import head_inputs
from lit_packing.models.preference import PairLogps, pair_logps
from lit_packing.models.sharding import local_tensor, reshard
from lit_packing.text import count

log = logging.getLogger(__name__)

# Bump when what a table holds or how it is computed changes: every cached table is computed again.
REFERENCE_VERSION = "2"  # 2: rollout groups' tables, the objective's temperature in the key
CHECKPOINT_KEY = "reference_logps"  # the tables in a checkpoint: {data fingerprint: ReferenceTable.state()}
FIX = "set model.reference=copy (a frozen copy of the initial model) or delete the cached table"


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A hash of every weight's name, dtype, shape and bytes (~1 s for 135M fp32 parameters on a CPU); of a sharded
    model, this rank's shards."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        tensor = local_tensor(tensor.detach())
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:24]


def table_key(name_or_path: str, weights: str, precision: str, data: str, temperature: float = 1.0) -> str:
    """The cache key of one split's table: the initial model, the precision, the split's tokenized data and the
    temperature the log-probs are of."""
    parts = (REFERENCE_VERSION, name_or_path, weights, precision, data, temperature)
    return "reference-" + hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


@dataclass
class ReferenceTable:
    """Each pair's reference log-probabilities, by the pair's row (`index`).

    Attributes:
        rows: (N,) int64, sorted, each pair's row in the source.
        logps: (N, 2) the summed log-probabilities of its chosen and rejected completions.
        tokens: (N, 2) int64 their token counts (checked against each batch's).
    """

    rows: torch.Tensor
    logps: torch.Tensor
    tokens: torch.Tensor

    @classmethod
    def of(cls, batches: Iterable[tuple[list[int], PairLogps]]) -> ReferenceTable:
        """The table of a pass: each batch's rows (`batch["rows"]`) and its pairs' log-probabilities."""
        rows, logps, tokens = [], [], []
        for batch_rows, pairs in batches:
            if len(batch_rows) != len(pairs.chosen):
                raise DataError(
                    f"a batch names the rows of {len(batch_rows)} of its {len(pairs.chosen)} pairs: precomputed "
                    f"reference log-probs are kept by row; {FIX}"
                )
            rows.append(torch.tensor(batch_rows, dtype=torch.int64))
            logps.append(torch.stack([pairs.chosen, pairs.rejected], dim=1).detach().cpu())
            tokens.append(torch.stack([pairs.chosen_tokens, pairs.rejected_tokens], dim=1).long().cpu())
        if not rows:
            return cls(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int64))
        return cls(torch.cat(rows), torch.cat(logps), torch.cat(tokens)).sorted()

    def sorted(self) -> ReferenceTable:
        order = torch.argsort(self.rows)
        return ReferenceTable(self.rows[order], self.logps[order], self.tokens[order])

    def __len__(self) -> int:
        return len(self.rows)

    def to(self, device: torch.device | str) -> ReferenceTable:
        """The log-probabilities on `device`, the rows and counts (looked up on the host) where they are."""
        return ReferenceTable(self.rows, self.logps.to(device), self.tokens)

    def state(self) -> dict[str, torch.Tensor]:
        """Plain tensors on the host (a checkpoint's entry, `torch.load(weights_only=True)` reads it)."""
        return {"rows": self.rows, "logps": self.logps.cpu(), "tokens": self.tokens}

    def gathered(self, all_gather: Callable[[torch.Tensor], torch.Tensor], world_size: int) -> ReferenceTable:
        """Every rank's share of the pass in one table: `all_gather` (the strategy's) of equal shapes, each
        share padded to the longest with row -1; a pair computed by several ranks (tensor-parallel ranks share
        their data) kept once."""
        if world_size == 1:
            return self
        longest = int(all_gather(torch.tensor(len(self))).max())
        pad = longest - len(self)
        mine = torch.cat([self.rows.double()[:, None], self.logps.double(), self.tokens.double()], dim=1)
        mine = torch.cat([mine, torch.full((pad, 5), -1.0, dtype=torch.float64)])
        every = all_gather(mine).reshape(-1, 5).cpu()
        every = every[every[:, 0] >= 0]
        table = ReferenceTable(every[:, 0].long(), every[:, 1:3].to(self.logps.dtype), every[:, 3:].long()).sorted()
        first = torch.ones(len(table), dtype=torch.bool)
        first[1:] = table.rows[1:] != table.rows[:-1]
        return ReferenceTable(table.rows[first], table.logps[first], table.tokens[first])

    def lookup(self, rows: list[int], policy: PairLogps, where: str) -> PairLogps:
        """The reference `PairLogps` of a batch's pairs (`rows`, the batch's order), on the policy's device.

        Raises:
            DataError: a pair the table lacks, or whose token counts differ from the batch's (`where` names the
                table: its split and cache file).
        """
        query = torch.tensor(rows, dtype=torch.int64)
        if len(query) != len(policy.chosen):
            raise DataError(
                f"the batch names the rows of {len(query)} of its {len(policy.chosen)} pairs, and precomputed "
                f"reference log-probs are looked up by row (batches of a PackingDataModule carry them): {FIX}"
            )
        at = torch.searchsorted(self.rows, query).clamp_max(max(len(self) - 1, 0))
        missing = query[(self.rows[at] != query) if len(self) else torch.ones_like(query, dtype=torch.bool)]
        if len(missing):
            raise DataError(
                f"the precomputed reference log-probs ({where}) lack the pairs of rows "
                f"{', '.join(map(str, missing[:8].tolist()))}: they were computed for other data; {FIX}"
            )
        counts = torch.stack([policy.chosen_tokens, policy.rejected_tokens], dim=1).long().cpu()
        if not torch.equal(self.tokens[at], counts):
            raise DataError(
                f"the precomputed reference log-probs ({where}) were computed for other tokens of the same rows "
                f"(their completions' token counts differ from the batch's): {FIX}"
            )
        device = policy.chosen.device
        logps = self.logps[at.to(self.logps.device)].to(device=device, dtype=policy.chosen.dtype)
        return PairLogps(logps[:, 0], logps[:, 1], policy.chosen_tokens, policy.rejected_tokens)


@dataclass
class TokenTable:
    """Each rollout group's reference log-probability of every completion token, by the group's row (`index`).

    Attributes:
        rows: (R,) int64, sorted, each group's row in the source.
        completions: (R,) int64 each group's completion count.
        tokens: (K,) int64 each completion's token count, group after group (checked against each batch's).
        logps: (M,) the log-probabilities of every completion token, in the row order of a group batch.
    """

    rows: torch.Tensor
    completions: torch.Tensor
    tokens: torch.Tensor
    logps: torch.Tensor

    @classmethod
    def of(cls, groups: Iterable[tuple[int, torch.Tensor, torch.Tensor]]) -> TokenTable:
        """The table of (row, its completions' token counts, its completion tokens' log-probs) per group."""
        ordered = sorted(groups, key=lambda group: group[0])
        if not ordered:
            empty = torch.zeros(0, dtype=torch.int64)
            return cls(empty, empty, empty, torch.zeros(0))
        return cls(
            torch.tensor([row for row, _, _ in ordered], dtype=torch.int64),
            torch.tensor([len(tokens) for _, tokens, _ in ordered], dtype=torch.int64),
            torch.cat([tokens.long().cpu() for _, tokens, _ in ordered]),
            torch.cat([logps.detach().cpu() for _, _, logps in ordered]),
        )

    def groups(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(row, token counts, log-probs) of each group, in row order."""
        out, token_start, value_start = [], 0, 0
        for row, many in zip(self.rows.tolist(), self.completions.tolist()):
            tokens = self.tokens[token_start : token_start + many]
            values = int(tokens.sum())
            out.append((row, tokens, self.logps[value_start : value_start + values]))
            token_start, value_start = token_start + many, value_start + values
        return out

    @functools.cached_property
    def _by_row(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """row -> (token counts, log-probs), built once a table: every training step looks rows up."""
        return {row: (tokens, logps) for row, tokens, logps in self.groups()}

    def __len__(self) -> int:
        return len(self.rows)

    def to(self, device: torch.device | str) -> TokenTable:
        return TokenTable(self.rows, self.completions, self.tokens, self.logps.to(device))

    def state(self) -> dict[str, torch.Tensor]:
        return {"rows": self.rows, "completions": self.completions, "tokens": self.tokens, "logps": self.logps.cpu()}

    def gathered(self, all_gather: Callable[[torch.Tensor], torch.Tensor], world_size: int) -> TokenTable:
        """Every rank's share of the pass in one table (`all_gather` of equal shapes: each part padded to the
        longest rank's), a group computed by several ranks kept once."""
        if world_size == 1:
            return self
        sizes = all_gather(torch.tensor([len(self.rows), len(self.tokens), len(self.logps)])).reshape(-1, 3).cpu()
        parts = []
        for part, column in ((self.rows, 0), (self.completions, 0), (self.tokens, 1), (self.logps, 2)):
            longest = int(sizes[:, column].max())  # every rank pads to the same length: one shape for NCCL
            padded = torch.cat([part.double(), torch.zeros(longest - len(part), dtype=torch.float64)])
            parts.append(all_gather(padded).reshape(world_size, -1).cpu())
        seen, groups = set(), []
        for rank in range(world_size):
            r, k, m = sizes[rank].tolist()
            table = TokenTable(parts[0][rank, :r].long(), parts[1][rank, :r].long(), parts[2][rank, :k].long(),
                               parts[3][rank, :m].to(self.logps.dtype))  # fmt: skip
            groups += [group for group in table.groups() if group[0] not in seen and not seen.add(group[0])]
        return TokenTable.of(groups)

    def lookup(self, rows: list[int], tokens: torch.Tensor, completions: torch.Tensor, where: str) -> torch.Tensor:
        """The reference log-probs (M,) of a batch's groups (`rows`, the batch's order; `completions` (B,) each
        group's completion count, `tokens` (C,) each completion's token count), in the batch's token order.

        Raises:
            DataError: a group the table lacks, or whose completions' token counts differ from the batch's.
        """
        by_row = self._by_row
        missing = [row for row in rows if row not in by_row]
        if len(rows) != len(completions) or missing:
            raise DataError(
                f"the precomputed reference log-probs ({where}) lack the groups of rows "
                f"{', '.join(map(str, missing[:8]))}: they were computed for other data; {FIX}"
            )
        out, start = [], 0
        for row, many in zip(rows, completions.tolist()):
            stored, logps = by_row[row]
            if not torch.equal(stored, tokens[start : start + many].long().cpu()):
                raise DataError(
                    f"the precomputed reference log-probs ({where}) were computed for other tokens of row {row} (its "
                    f"completions' token counts differ from the batch's): {FIX}"
                )
            out.append(logps)
            start += many
        return torch.cat(out) if out else self.logps[:0]


def read_table(path: Path) -> ReferenceTable | TokenTable | None:
    """The cached table at `path`, None when there is none (or it cannot be read: it is computed again)."""
    if not path.exists():
        return None
    try:
        return table_of(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as error:  # a torn or foreign file is a cache miss, never a failed run
        log.warning("ignoring the unreadable cached reference log-probs %s (%s): computing them again", path, error)
        return None


def table_of(state: dict[str, torch.Tensor]) -> ReferenceTable | TokenTable:
    """A table from its `state()` (a pair table's or a group table's)."""
    return TokenTable(**state) if "completions" in state else ReferenceTable(**state)


def write_table(table: ReferenceTable | TokenTable, path: Path) -> None:
    """Write atomically (a temporary file, then a rename): a run killed while writing leaves no torn table."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save(table.state(), tmp)
    os.replace(tmp, path)


class PrecomputedReference:
    """`model.reference: precomputed` in a `PackedCausalLM`: the tables by the split's data fingerprint (computed,
    read from the cache or from a checkpoint) and each stage's on the device; the initial weights' identity keys
    them.

    Attributes:
        initial_weights: `weights_fingerprint` of the model as built (before any checkpoint loads others).
        tables: {data fingerprint: table}, kept in checkpoints (`state`, `load`).
        loaded_weights: a checkpoint's weights were loaded: the policy is no longer the initial model.
    """

    def __init__(self, name_or_path: str, temperature: float = 1.0) -> None:
        self.name_or_path = name_or_path
        self.temperature = temperature  # the objective's: a group table's log-probs are of logits / temperature
        self.initial_weights: str | None = None
        self.tables: dict[str, ReferenceTable | TokenTable] = {}
        self.stages: dict[str, tuple[ReferenceTable | TokenTable, str]] = {}  # stage -> (table on the device, name)
        self.loaded_weights = False

    def state(self) -> dict:
        return {data: table.state() for data, table in self.tables.items()}

    def load(self, checkpoint: dict) -> None:
        """A checkpoint's tables (the initial model's: used, never computed again); its weights replace the model's."""
        self.loaded_weights = True
        saved = checkpoint.get(CHECKPOINT_KEY, {})
        self.tables.update({data: table_of(state) for data, state in saved.items()})

    def prepare(self, lm, *stages: str) -> None:
        """Each stage's table on the device, from this run's memory or a checkpoint, else the cache beside the
        tokenized data, else one no-grad pass of `lm` (a `PackedCausalLM`, which must still be the initial model: a
        fit's start, before any step or checkpoint) over the split's pairs (or groups). Rank 0 decides what is read,
        and every rank computes its share of a pass, so the ranks' forwards stay matched."""
        reference_split = lm._data.reference_split if lm._data is not None else None
        for stage in stages:
            split = reference_split(stage) if reference_split is not None else None
            if split is None:
                if stage == "train":
                    raise ConfigError(
                        "model.reference",
                        "precomputed computes the reference log-probs from the training pairs or rollout groups of "
                        "a PackingDataModule's tokenized data (stored: not streamed, not sampled on-policy), and "
                        "this fit has none",
                        "train from stored pairs or rollouts, or set model.reference=copy (or lora)",
                    )
                continue
            table, where = self._table(lm, split, stage)
            self.stages[stage] = (table.to(lm.device), where)

    def lookup(self, stage: str, rows: Iterable[int], policy: PairLogps) -> PairLogps:
        """The reference log-probs of a batch's pairs (its `rows`), in the batch's order."""
        if stage not in self.stages:
            raise ConfigError(
                "model.reference",
                f"precomputed: no reference log-probs for the {stage} pairs (they are computed at fit start, "
                "from a PackingDataModule's pairs)",
                "fit with a PackingDataModule, or set model.reference=copy",
            )
        table, where = self.stages[stage]
        return table.lookup(rows, policy, where)

    def lookup_groups(self, stage: str, batch: Mapping[str, Any], policy: CompletionLogps) -> torch.Tensor:
        """The reference log-probs (N,) of a group batch's completion tokens (its `rows`), in the batch's order."""
        if stage not in self.stages:
            raise ConfigError("model.reference", f"precomputed: no reference log-probs for the {stage} groups",
                              "fit with stored rollouts, or set model.reference=copy")  # fmt: skip
        table, where = self.stages[stage]
        tokens, completions = _group_counts(batch, policy)
        values = table.lookup(list(batch.get(ROWS, [])), tokens, completions, where)
        return values.to(device=policy.logps.device, dtype=policy.logps.dtype)

    def _table(self, lm, split, stage: str) -> tuple[ReferenceTable, str]:
        """One split's table and what names it in messages (read, or computed and cached)."""
        trainer = lm.trainer
        temperature = self.temperature if split.groups else 1.0
        key = trainer.strategy.broadcast(
            table_key(self.name_or_path, self.initial_weights, str(trainer.precision), split.fingerprint, temperature)
        )  # rank 0's: every rank reads or computes the same
        path = Path(split.folder) / f"{key}.pt" if split.folder is not None else None
        where = f"{stage} {split.kind}, {path or 'not cached: the data is in memory'}"
        table = self.tables.get(split.fingerprint)
        if table is not None:
            log.info("reference log-probs (%s): %d %s, from this run (a checkpoint, or the fit before)", where,
                     len(table), split.kind)  # fmt: skip
            return table, where
        found = read_table(path) if path is not None and trainer.is_global_zero else None
        table = trainer.strategy.broadcast(found)
        if table is not None:
            log.info("reference log-probs (%s): %d %s, read from the cache", where, len(table), split.kind)
        else:
            if self.loaded_weights or lm.global_step > 0:
                raise ConfigError(
                    "model.reference",
                    f"precomputed: the reference log-probs of the {stage} {split.kind} are neither in the checkpoint "
                    f"nor cached ({path}), and the model now holds trained weights, not the initial model's",
                    "run a fit from the initial model first (it caches them), or set model.reference=copy",
                )
            table = compute_table(lm, split, stage, temperature)
            if path is not None and trainer.is_global_zero:
                write_table(table, path)
        self.tables[split.fingerprint] = table
        return table, where


def reference_forward(lm, batch: Mapping[str, Any], read: Callable[[Any, Mapping[str, Any]], Any]) -> Any:
    """`read(outputs, batch)` of the reference's outputs, no gradient: the frozen copy's (`reference=copy`), else
    the model's with its adapter off (`lora`), read inside that context (the head is adapted too)."""
    with torch.no_grad():
        if lm.frozen_copies:
            impl = "liger" if lm.hparams.loss_impl == "liger" else "chunked"
            return read(head_inputs(lm.frozen_copies[0], batch, lm.hparams.loss_chunk_size, impl), batch)
        with lm.model.disable_adapter():  # reference=lora: the base model, its adapter off
            return read(lm.loss_outputs(batch), batch)


def compute_table(lm, split, stage: str, temperature: float = 1.0) -> ReferenceTable | TokenTable:
    """One no-grad pass of `lm`'s (initial) model over this rank's share of the split's pairs (or groups, their
    completion tokens' log-probs of logits / `temperature`), as the training step computes the policy's log-probs
    (the same head, precision context and packing); eval mode."""
    from tqdm.auto import tqdm

    trainer, loader, start = lm.trainer, split.loader(), time.perf_counter()
    log.info("reference log-probs (%s %s): computing %s with the initial model, %s on this rank "
             "(model.reference=precomputed; once: later fits read the cache)", stage, split.kind,
             count(split.items, split.kind.rstrip("s")), count(len(loader), "batch"))  # fmt: skip
    quiet = not trainer.is_global_zero or trainer.progress_bar_callback is None
    training, parts = lm.model.training, []
    lm.model.eval()
    try:
        with torch.no_grad(), lm.forward_context():
            for batch in tqdm(loader, desc=f"reference log-probs ({stage})", disable=True if quiet else None):
                batch = trainer.strategy.batch_to_device(batch)
                if split.groups:
                    parts += _group_entries(batch, completion_logps(lm.loss_outputs(batch), batch, temperature))
                else:
                    parts.append((batch[ROWS], pair_logps(lm.loss_outputs(batch), batch)))
    finally:
        lm.model.train(training)
    reshard(lm.model)  # no backward follows: the root's gathered weights freed
    gather = lambda t: trainer.strategy.all_gather(t.to(lm.device))  # noqa: E731
    table = (TokenTable if split.groups else ReferenceTable).of(parts).gathered(gather, trainer.world_size)
    log.info("reference log-probs (%s %s): %d computed in %.1f s", stage, split.kind, len(table),
             time.perf_counter() - start)  # fmt: skip
    return table


def _group_entries(batch: Mapping[str, Any], policy: CompletionLogps) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(row, its completions' token counts, their tokens' log-probs) of each group of a batch."""
    tokens, completions = _group_counts(batch, policy)
    entries, completion, value = [], 0, 0
    for row, many in zip(batch[ROWS], completions.tolist()):
        sizes = tokens[completion : completion + many]
        entries.append((int(row), sizes, policy.logps[value : value + int(sizes.sum())]))
        completion, value = completion + many, value + int(sizes.sum())
    return entries


def _group_counts(batch: Mapping[str, Any], policy: CompletionLogps) -> tuple[torch.Tensor, torch.Tensor]:
    """(C,) each completion's token count and (B,) each group's completion count, on the host, of a group batch."""
    tokens = torch.bincount(policy.completion.cpu(), minlength=policy.completions)
    return tokens, torch.bincount(batch[GROUPS].cpu(), minlength=len(batch.get(ROWS, [])))
