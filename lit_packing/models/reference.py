"""Reference log-probabilities computed once (`model.reference: precomputed`, the default of dpo and ipo): one
no-grad pass of the initial model over every pair before the first step, cached beside the tokenized data.

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
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lit_packing.batch import ROWS
from lit_packing.errors import ConfigError, DataError
from lit_packing.models.head import head_inputs
from lit_packing.models.preference import PairLogps, pair_logps
from lit_packing.models.sharding import local_tensor, reshard
from lit_packing.text import count

log = logging.getLogger(__name__)

# Bump when what a table holds or how it is computed changes: every cached table is computed again.
REFERENCE_VERSION = "1"
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


def table_key(name_or_path: str, weights: str, precision: str, data: str) -> str:
    """The cache key of one split's table: the initial model, the precision and the split's tokenized data."""
    parts = (REFERENCE_VERSION, name_or_path, weights, precision, data)
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


def read_table(path: Path) -> ReferenceTable | None:
    """The cached table at `path`, None when there is none (or it cannot be read: it is computed again)."""
    if not path.exists():
        return None
    try:
        return ReferenceTable(**torch.load(path, map_location="cpu", weights_only=True))
    except Exception as error:  # a torn or foreign file is a cache miss, never a failed run
        log.warning("ignoring the unreadable cached reference log-probs %s (%s): computing them again", path, error)
        return None


def write_table(table: ReferenceTable, path: Path) -> None:
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

    def __init__(self, name_or_path: str) -> None:
        self.name_or_path = name_or_path
        self.initial_weights: str | None = None
        self.tables: dict[str, ReferenceTable] = {}
        self.stages: dict[str, tuple[ReferenceTable, str]] = {}  # stage -> (table on the device, its name)
        self.loaded_weights = False

    def state(self) -> dict:
        return {data: table.state() for data, table in self.tables.items()}

    def load(self, checkpoint: dict) -> None:
        """A checkpoint's tables (the initial model's: used, never computed again); its weights replace the model's."""
        self.loaded_weights = True
        saved = checkpoint.get(CHECKPOINT_KEY, {})
        self.tables.update({data: ReferenceTable(**state) for data, state in saved.items()})

    def prepare(self, lm, *stages: str) -> None:
        """Each stage's table on the device, from this run's memory or a checkpoint, else the cache beside the
        tokenized data, else one no-grad pass of `lm` (a `PackedCausalLM`, which must still be the initial model: a
        fit's start, before any step or checkpoint) over the split's pairs. Rank 0 decides what is read, and every
        rank computes its share of a pass, so the ranks' forwards stay matched."""
        pair_split = lm._data.pair_split if lm._data is not None else None
        for stage in stages:
            split = pair_split(stage) if pair_split is not None else None
            if split is None:
                if stage == "train":
                    raise ConfigError(
                        "model.reference",
                        "precomputed computes the reference log-probs from the training pairs of a "
                        "PackingDataModule's tokenized data (data.collator PairCollator, not streamed), and this "
                        "fit has none",
                        "train from a PackingDataModule with pairs, or set model.reference=copy",
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

    def _table(self, lm, split, stage: str) -> tuple[ReferenceTable, str]:
        """One split's table and what names it in messages (read, or computed and cached)."""
        trainer = lm.trainer
        key = trainer.strategy.broadcast(
            table_key(self.name_or_path, self.initial_weights, str(trainer.precision), split.fingerprint)
        )  # rank 0's: every rank reads or computes the same
        path = Path(split.folder) / f"{key}.pt" if split.folder is not None else None
        where = f"{stage} pairs, {path or 'not cached: the data is in memory'}"
        table = self.tables.get(split.fingerprint)
        if table is not None:
            log.info("reference log-probs (%s): %d pairs, from this run (a checkpoint, or the fit before)", where,
                     len(table))  # fmt: skip
            return table, where
        found = read_table(path) if path is not None and trainer.is_global_zero else None
        table = trainer.strategy.broadcast(found)
        if table is not None:
            log.info("reference log-probs (%s): %d pairs, read from the cache", where, len(table))
        else:
            if self.loaded_weights or lm.global_step > 0:
                raise ConfigError(
                    "model.reference",
                    f"precomputed: the reference log-probs of the {stage} pairs are neither in the checkpoint nor "
                    f"cached ({path}), and the model now holds trained weights, not the initial model's",
                    "run a fit from the initial model first (it caches them), or set model.reference=copy",
                )
            table = compute_table(lm, split, stage)
            if path is not None and trainer.is_global_zero:
                write_table(table, path)
        self.tables[split.fingerprint] = table
        return table, where


def reference_logps(lm, batch: Mapping[str, Any], stage: str, policy: PairLogps) -> PairLogps | None:
    """The reference log-probs of a batch's pairs for `lm`'s preference objective (`PackedCausalLM`): read from the
    precomputed table, or computed by the frozen copy (`copy`) or the model with its adapter off (`lora`); None for
    an objective without a reference (simpo, orpo)."""
    if lm.precomputed is not None:
        return lm.precomputed.lookup(stage, batch.get(ROWS, []), policy)
    if not lm.objective.needs_reference:
        return None
    return reference_forward(lm, batch, pair_logps)


def reference_forward(lm, batch: Mapping[str, Any], read: Callable[[Any, Mapping[str, Any]], Any]) -> Any:
    """`read(outputs, batch)` of the reference's outputs, no gradient: the frozen copy's (`reference=copy`), else
    the model's with its adapter off (`lora`), read inside that context (the head is adapted too)."""
    with torch.no_grad():
        if lm.frozen_copies:
            impl = "liger" if lm.hparams.loss_impl == "liger" else "chunked"
            return read(head_inputs(lm.frozen_copies[0], batch, lm.hparams.loss_chunk_size, impl), batch)
        with lm.model.disable_adapter():  # reference=lora: the base model, its adapter off
            return read(lm.loss_outputs(batch), batch)


def compute_table(lm, split, stage: str) -> ReferenceTable:
    """One no-grad pass of `lm`'s (initial) model over this rank's share of the split's pairs, as the training step
    computes the policy's log-probs (the same head, precision context and packing); eval mode."""
    from tqdm.auto import tqdm

    trainer, loader, start = lm.trainer, split.loader(), time.perf_counter()
    log.info("reference log-probs (%s pairs): computing %s with the initial model, %s on this rank "
             "(model.reference=precomputed; once: later fits read the cache)", stage, count(split.pairs, "pair"),
             count(len(loader), "batch"))  # fmt: skip
    quiet = not trainer.is_global_zero or trainer.progress_bar_callback is None
    training, parts = lm.model.training, []
    lm.model.eval()
    try:
        with torch.no_grad(), lm.forward_context():
            for batch in tqdm(loader, desc=f"reference log-probs ({stage})", disable=True if quiet else None):
                batch = trainer.strategy.batch_to_device(batch)
                parts.append((batch[ROWS], pair_logps(lm.loss_outputs(batch), batch)))
    finally:
        lm.model.train(training)
    reshard(lm.model)  # no backward follows: the root's gathered weights freed
    gather = lambda t: trainer.strategy.all_gather(t.to(lm.device))  # noqa: E731
    table = ReferenceTable.of(parts).gathered(gather, trainer.world_size)
    log.info("reference log-probs (%s pairs): %d computed in %.1f s", stage, len(table), time.perf_counter() - start)
    return table
