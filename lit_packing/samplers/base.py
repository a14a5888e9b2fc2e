"""The base every sampler shares: lengths in, one epoch's global plan of packs, packs dealt to ranks, resumable state.

A sampler is a batch sampler: each item it yields is the list of dataset indices of ONE micro-step on THIS rank
(a "pack"; for ``FixedLengthPackingSampler`` a list of ``(index, start, stop)`` token slices). Every epoch runs in
two stages, identical on every rank:

1. ``plan(epoch)``: the strategy turns ``lengths`` into the epoch's global list of packs (a ``PackPlan``),
   deterministic per ``(seed, epoch)`` and cached, so ``__len__`` and ``__iter__`` plan once per epoch.
2. Steps and dealing: ``_order_steps`` puts the packs in training order, where every run of ``world_size *
   accumulate`` packs (the global batch) is one optimizer step; which packs form a step depends on the global
   batch only, so 1 rank x 4 accumulated, 2 x 2 and 4 x 1 train the same steps. ``_place`` splits each step over
   ranks and micro-batches: round-robin by default (pack ``p`` to rank ``p % world_size`` at micro-step ``p //
   world_size``). When the number of packs is not a multiple of ``world_size`` the last micro-step is completed
   with EMPTY packs ``[]``, which the collator turns into a 1-token, all-masked batch that adds zero loss: every
   rank takes the same number of steps (no hang) and no example is dropped. ``drop_last=True`` drops those last
   packs instead.

Worked example: 5 packs ``[P0, P1, P2, P3, P4]``, ``world_size=2`` -> rank 0 yields ``P0, P2, P4``, rank 1 yields
``P1, P3, []``; with ``drop_last=True`` rank 0 yields ``P0, P2`` and rank 1 ``P1, P3``. With five examples of
8 tokens, one per pack:

>>> from lit_packing.samplers import SequentialPackingSampler
>>> [list(SequentialPackingSampler([8] * 5, max_tokens=8, rank=r, world_size=2, shuffle=False)) for r in (0, 1)]
[[[0], [2], [4]], [[1], [3], []]]

Usage: ``sampler = BestFitPackingSampler(lengths, max_tokens=4096); DataLoader(ds, batch_sampler=sampler)``
(with Lightning, set ``Trainer(use_distributed_sampler=False)``: the samplers shard themselves; and hand the loader
``lit_packing._compat.batch_sampler_with_epoch(sampler)``, where Lightning's ``set_epoch`` reaches it, as
``PackingDataModule`` does).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler

from lit_packing.batch import Pack, step_totals
from lit_packing.errors import ConfigError, check_range
from lit_packing.text import count


@dataclass(frozen=True, eq=False)
class PackPlan:
    """One epoch's global packs, before dealing to ranks, in CSR form: pack ``p`` is ``items[offsets[p]:offsets[p+1]]``.

    Attributes:
        items: (n_items,) int64 dataset indices, or (n_items, 3) int64 ``(index, start, stop)`` token slices.
        offsets: (n_packs + 1,) int64, ``offsets[0] == 0``.
        tokens: (n_items,) int64 real tokens of each item (its length, or ``stop - start`` for a slice).
        max_tokens: token budget of one pack, or None when packs hold a fixed number of examples.
    """

    items: np.ndarray
    offsets: np.ndarray
    tokens: np.ndarray
    max_tokens: int | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def pack(self, p: int) -> list:
        """Pack ``p`` as a list of ints (or of ``(index, start, stop)`` tuples); ``p == -1`` is the empty pack."""
        if p < 0:
            return []
        rows = self.items[self.offsets[p] : self.offsets[p + 1]].tolist()
        return rows if self.items.ndim == 1 else [tuple(r) for r in rows]

    def packs(self) -> list[list]:
        """All packs, in plan order (for reports and tests; iteration does not build this list)."""
        return [self.pack(p) for p in range(len(self))]

    def examples_per_pack(self) -> np.ndarray:
        """(n_packs,) int64 number of items in each pack."""
        return np.diff(self.offsets)

    def tokens_per_pack(self) -> np.ndarray:
        """(n_packs,) int64 real tokens in each pack."""
        return np.diff(np.concatenate([[0], np.cumsum(self.tokens)])[self.offsets])

    def sq_tokens_per_pack(self) -> np.ndarray:
        """(n_packs,) int64 sum of squared item lengths in each pack (the attention-cost term of a varlen batch)."""
        return np.diff(np.concatenate([[0], np.cumsum(self.tokens**2)])[self.offsets])


def deal(n_packs: int, world_size: int, drop_last: bool = False) -> np.ndarray:
    """Round-robin schedule of packs over ranks: (steps, world_size) int64 pack ids, -1 for an empty pack.

    >>> deal(5, 2).tolist(), deal(5, 2, drop_last=True).tolist()
    ([[0, 1], [2, 3], [4, -1]], [[0, 1], [2, 3]])
    """
    steps = n_packs // world_size if drop_last else -(-n_packs // world_size)
    schedule = np.arange(steps * world_size, dtype=np.int64)
    schedule[schedule >= n_packs] = -1
    return schedule.reshape(steps, world_size)


@dataclass(frozen=True)
class RunContext:
    """What a sampler learns from the run it is part of, handed over once by ``PlannedBatchSampler.connect``.

    A field fills a sampler setting only where the sampler was not given one: a seed set on the sampler wins over the
    run's seed, cost coefficients set on ``MultipackSampler`` win over the model's. None leaves a setting as it is.

    Attributes:
        seed: the run's data seed.
        rank: this process's data-parallel rank.
        world_size: the number of data-parallel ranks.
        accumulate: micro-batches per optimizer step (gradient accumulation).
        cost_coefficients: the model's training FLOPs per token and per attended pair (``lit_packing.cost``).
        label_counter: the trained tokens of each item, so that every pack carries its optimizer step's totals.
        largest_fitting: ``largest_fitting(setting, candidates, worst_pack)``: the largest of the increasing
            ``candidates`` whose most memory-hungry pack (``worst_pack(value)``, a one-pack ``PackPlan``) the run's
            memory estimate predicts to fit the device, None if none does; it sizes a setting given as ``auto``.
    """

    seed: int | None = None
    rank: int | None = None
    world_size: int | None = None
    accumulate: int | None = None
    cost_coefficients: tuple[float, float] | None = None
    label_counter: Callable[[list], list[int]] | None = None
    largest_fitting: Callable[[str, list[int], Callable[[int], PackPlan]], int | None] | None = None


AUTO = "auto"  # a step size (``max_tokens``, ``batch_size``) the run chooses for the device's memory


def worst_pack(items: int, longest: int, budget: int | None = None) -> PackPlan:
    """The pack that needs the most memory among packs of ``items`` examples of at most ``longest`` tokens (padded
    batches), or, with ``budget``, among packs of at most ``budget`` tokens (the most attention: whole examples of
    the longest length, then the rest). One pack, as a ``PackPlan`` that a collator's ``plan_slots`` reads.

    >>> worst_pack(3, 100).tokens.tolist(), worst_pack(0, 100, budget=250).tokens.tolist()
    ([100, 100, 100], [100, 100, 50])
    """
    if budget is not None:
        whole, rest = divmod(budget, longest)
        tokens = [longest] * whole + ([rest] if rest else [])
    else:
        tokens = [longest] * items
    n = len(tokens)
    return PackPlan(np.arange(n, dtype=np.int64), np.array([0, n], dtype=np.int64), np.asarray(tokens, np.int64))


class PlannedBatchSampler(Sampler[list]):
    """Base of every sampler: its shared settings, rank resolution, per-epoch plan cache, dealing, resumable iteration.

    A strategy is a subclass that implements ``_build_plan(epoch, rng) -> PackPlan`` and declares only its own
    settings, passing the rest on (``def __init__(self, lengths, batch_size=8, **common)``). Settings left None
    here are filled by the run (``connect``), else take the stated default.

    Args:
        lengths: (n,) tokens per example.
        seed: base of the per-epoch random stream ``np.random.default_rng([seed, epoch])``; None: the run's seed
            (``data.seed`` in the data module), else 0.
        shuffle: randomise the plan per epoch; False gives the same plan every epoch.
        drop_last: drop the packs that do not fill the last step on every rank (and, for the batch samplers, the
            last incomplete batch; for ``FixedLengthPackingSampler``, the last short row). Default False: nothing
            is dropped, missing packs of the last step are empty packs ``[]``.
        rank: this process's rank; None: the run's, else ``torch.distributed`` when initialised, else 0.
        world_size: number of ranks; None: the run's, else ``torch.distributed`` when initialised, else 1.
        accumulate: micro-batches per optimizer step (``trainer.accumulate_grad_batches``); None: the run's, else 1.
    """

    _cache_size = 2  # the current epoch, plus one other a report may ask for

    def __init__(
        self,
        lengths: np.ndarray,
        *,
        seed: int | None = None,
        shuffle: bool = True,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        accumulate: int | None = None,
    ) -> None:
        super().__init__()
        lengths = np.asarray(lengths)
        if lengths.ndim != 1 or (lengths.size and not np.issubdtype(lengths.dtype, np.integer)):
            raise ConfigError(
                "lengths",
                f"must be a 1-D array of integer token counts, got shape {lengths.shape} and dtype {lengths.dtype}",
            )
        if lengths.size and lengths.min() < 0:
            i = int(np.argmin(lengths))
            raise ConfigError("lengths", f"must be >= 0: example {i} has {lengths[i]} tokens")
        check_range("seed", seed, 0)
        check_range("accumulate", accumulate, 1)
        self.lengths = lengths.astype(np.int64, copy=False)
        self.shuffle = shuffle
        self.drop_last = drop_last
        # The settings the caller chose; `connect` fills only the others.
        self.given = {k: v for k, v in (("seed", seed), ("rank", rank), ("world_size", world_size),
                                        ("accumulate", accumulate)) if v is not None}  # fmt: skip
        self.seed = int(seed) if seed is not None else 0
        self._rank = rank
        self._world_size = world_size
        self.accumulate = accumulate if accumulate is not None else 1  # micro-batches per optimizer step
        # Trained tokens of each item, with which every pack holds its optimizer step's totals (see `connect`).
        self.label_counter: Callable[[list], list[int]] | None = None
        self.epoch = 0
        self._yielded = 0  # batches of the current epoch handed out (the position when no trainer reports one)
        # After load_state_dict: where passes over this epoch start, until one pass completes. Kept across several
        # iter() calls, because a DataLoader may start (and prefetch from) an iterator it then throws away.
        self._resume_at: int | None = None
        # After a resume onto another layout (world size x accumulation): (optimizer steps of the epoch trained
        # before, pack ids still to train, whether they are already in step order).
        self._elastic: tuple[int, np.ndarray, bool] | None = None
        self.resumed_at: int | None = None  # after load_state_dict: micro-batches of the epoch counted as trained
        self._plans: OrderedDict[tuple[int, int], PackPlan] = OrderedDict()
        self.restored: str | None = None  # after `load_state_dict`: what it restored, in words
        self.auto: str | None = None  # the setting given as `auto` until `connect` chooses it (a subclass sets it)
        self.chosen: dict[str, int] = {}  # what `connect` chose for it
        self._check_rank()

    def connect(self, context: RunContext) -> PlannedBatchSampler:
        """Take what the run knows (once, before the first plan): every setting the caller left None, the label
        counter, and what a subclass reads of the context (``_connect``). Returns the sampler."""
        for name in ("seed", "rank", "world_size", "accumulate"):
            value = getattr(context, name)
            if value is not None and name not in self.given:
                setattr(self, {"rank": "_rank", "world_size": "_world_size"}.get(name, name), value)
        check_range("accumulate", self.accumulate, 1)
        self._check_rank()
        if context.label_counter is not None:
            self.label_counter = context.label_counter
        if self.auto is not None:
            self._choose(context)
        self._connect(context)
        self._plans.clear()
        return self

    def _choose(self, context: RunContext) -> None:
        """Size the setting given as ``auto`` with the run's memory estimate (``RunContext.largest_fitting``)."""
        name = self.auto
        if context.largest_fitting is None:
            raise ConfigError(
                name,
                "auto sizes each step to the device's memory, which only a run with a model can estimate",
                f"give {{{name}}} a number",
            )
        candidates, pack_of = self._auto_candidates()
        value = context.largest_fitting(name, candidates, pack_of)
        if value is None:
            raise ConfigError(
                name,
                f"auto: even the smallest step ({name}={candidates[0]:,}) is predicted not to fit the device's memory "
                "(the estimate is logged above)",
                "lower {max_length}, set model.gradient_checkpointing=true, or raise model.memory_limit_gb",
            )
        setattr(self, name, int(value))
        self.auto, self.chosen = None, {name: int(value)}
        self._check_chosen()

    def _auto_candidates(self) -> tuple[list[int], Callable[[int], PackPlan]]:
        """For the setting given as ``auto``: the values to try, increasing, and the most memory-hungry pack of
        each (``worst_pack``)."""
        raise NotImplementedError

    def _check_chosen(self) -> None:
        """Check the data against the value ``auto`` chose, as ``__init__`` checks a given one."""

    def _longest(self) -> int:
        return int(self.lengths.max()) if len(self.lengths) else 1

    def _connect(self, context: RunContext) -> None:
        """What a strategy takes from the run besides the shared settings (e.g. ``MultipackSampler``'s costs)."""

    def _check_rank(self) -> None:
        if self.rank >= self.world_size:
            raise ConfigError("rank", f"must be < world_size={self.world_size}, got {self.rank}")

    @property
    def rank(self) -> int:
        if self._rank is not None:
            return self._rank
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        if self._world_size is not None:
            return self._world_size
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def _build_plan(self, epoch: int, rng: np.random.Generator) -> PackPlan:
        raise NotImplementedError

    def plan(self, epoch: int | None = None) -> PackPlan:
        """The global packs of ``epoch`` (default: the current one), identical on every rank; cached.

        A packing report reads steps, real tokens, fill (``tokens_per_pack().sum() / (len(plan) * max_tokens)``),
        examples per pack and ``sq_tokens_per_pack()`` from it without iterating the sampler.
        """
        if self.auto is not None:
            raise ConfigError(
                self.auto,
                "auto is chosen when the sampler is connected to a run (`connect`), before its first plan",
                f"connect it with a RunContext that has largest_fitting, or give {{{self.auto}}} a number",
            )
        epoch = self.epoch if epoch is None else epoch
        key = (self.seed, epoch if self.shuffle else 0)
        if key not in self._plans:
            self._plans[key] = self._build_plan(epoch, np.random.default_rng(list(key)))
            while len(self._plans) > self._cache_size:
                self._plans.popitem(last=False)
        self._plans.move_to_end(key)
        return self._plans[key]

    def _order(self, rng: np.random.Generator) -> np.ndarray:
        """The epoch's example order: a seeded permutation when shuffling, else data order. (n,) int64."""
        n = len(self.lengths)
        return rng.permutation(n) if self.shuffle else np.arange(n, dtype=np.int64)

    @property
    def global_batch(self) -> int:
        """Packs per optimizer step over all ranks: ``world_size * accumulate``."""
        return self.world_size * self.accumulate

    def _order_steps(self, plan: PackPlan, pack_ids: np.ndarray, world_size: int, accumulate: int) -> np.ndarray:
        """``pack_ids`` in training order, where each run of ``world_size * accumulate`` consecutive packs (the
        global batch) is one optimizer step, the last one possibly shorter.

        Which packs form a step, and the order of the steps, must depend on the global batch only, never on how it
        is split into ranks and micro-batches (``_place`` does that): the same global batch then trains the same
        optimizer steps on any world size, and a resume onto another one continues with the steps not yet taken.
        Default: plan order; ``drop_last`` leaves out the ``len(pack_ids) % world_size`` last packs.
        """
        if self.drop_last:
            pack_ids = pack_ids[: len(pack_ids) - len(pack_ids) % world_size]
        return pack_ids

    def _place(self, plan: PackPlan, ordered: np.ndarray, world_size: int, accumulate: int) -> np.ndarray:
        """Split each optimizer step of ``ordered`` (``_order_steps``' output) over ranks and micro-batches:
        (micro_steps, world_size) int64 pack ids, -1 for an empty pack. Default: round-robin (``deal``), so step
        ``g``'s micro-batch ``j`` holds packs ``g * G + j * world_size ...`` on ranks ``0 ...``. A balancing
        sampler overrides this, within each step."""
        schedule = deal(len(ordered), world_size)
        return np.where(schedule >= 0, ordered[np.maximum(schedule, 0)], -1)

    def _ordered(self, plan: PackPlan, world_size: int, accumulate: int) -> np.ndarray:
        """The epoch's packs not trained before ``schedule()`` begins, in step order, for this layout."""
        if self._elastic is None:
            return self._order_steps(plan, np.arange(len(plan), dtype=np.int64), world_size, accumulate)
        _, pack_ids, ordered = self._elastic
        return pack_ids if ordered else self._order_steps(plan, pack_ids, world_size, accumulate)

    def schedule(self, epoch: int | None = None) -> np.ndarray:
        """(steps, world_size) pack ids of ``epoch`` per step and rank, -1 for an empty pack (see ``_place``).

        For the epoch being resumed onto another layout, the steps after the resume point only (see
        ``load_state_dict``); ``__len__`` adds the steps trained before it.
        """
        epoch = self.epoch if epoch is None else epoch
        plan = self.plan(epoch)
        if self._elastic is not None and epoch == self.epoch:
            ordered = self._ordered(plan, self.world_size, self.accumulate)
        else:
            ordered = self._order_steps(plan, np.arange(len(plan), dtype=np.int64), self.world_size, self.accumulate)
        return self._place(plan, ordered, self.world_size, self.accumulate)

    def full_steps(self) -> tuple[int, list[list]]:
        """``(micro-batches of the epoch's full optimizer steps, the packs of its last step when that one holds fewer
        than global_batch packs)``: what a stream trains of a window, and what it carries into the next one instead of
        completing the step with empty packs."""
        plan = self.plan()
        ordered = self._ordered(plan, self.world_size, self.accumulate)
        full, rest = divmod(len(ordered), self.global_batch)
        trailing = [plan.pack(int(p)) for p in ordered[len(ordered) - rest :]]
        return self._offset + full * self.accumulate, trailing

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to plan; a pending resume point survives only if it belongs to this epoch."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._yielded = 0
            self._resume_at = self.resumed_at = None
            self._elastic = None

    @property
    def _offset(self) -> int:
        """Micro-batches of this epoch before ``schedule()`` begins, in this layout (non-zero only after an elastic
        resume: the optimizer steps trained before it, times ``accumulate``)."""
        return self._elastic[0] * self.accumulate if self._elastic is not None else 0

    def __len__(self) -> int:
        return self._offset + len(self.schedule())

    def __iter__(self) -> Iterator[list]:
        plan, schedule = self.plan(), self.schedule()
        start = self._resume_at if self._resume_at is not None else self._offset
        self._yielded = start
        return self._batches(plan, schedule, start)

    def _batches(self, plan: PackPlan, schedule: np.ndarray, start: int) -> Iterator[list]:
        offset, accumulate = self._offset, max(1, self.accumulate)
        step = None
        for absolute in range(start, offset + len(schedule)):
            if self.label_counter is not None and (step is None or absolute % accumulate == 0):
                step = self._step_totals(plan, schedule, absolute, offset, accumulate)
            self._yielded = absolute + 1  # counted before the yield: a state_dict taken now includes this batch
            yield Pack(plan.pack(int(schedule[absolute - offset, self.rank])), step=step)
        self._resume_at = None  # a whole pass is done: the next one is a whole epoch

    def _step_totals(
        self, plan: PackPlan, schedule: np.ndarray, absolute: int, offset: int, accumulate: int
    ) -> dict[str, int]:
        """Totals of the optimizer step holding micro-batch ``absolute``: all its micro-batches on all ranks.

        Lightning steps the optimizer after every ``accumulate`` micro-batches of the epoch and after its last one,
        so the step's rows are ``[g * accumulate, (g + 1) * accumulate)`` cut to the epoch, ``g = absolute //
        accumulate``. Every rank computes the same totals from the same global schedule: no communication.
        """
        first = (absolute // accumulate) * accumulate
        rows = schedule[max(first - offset, 0) : first + accumulate - offset]
        items = [item for p in rows.ravel() for item in plan.pack(int(p))]
        return step_totals(self.label_counter(items))

    # ------------------------------------------------------------ resume

    def fingerprint(self) -> str:
        """Identity of the epoch's plan: the dataset's lengths, the strategy and its settings, the seed and epoch.

        Any change that would make a checkpoint's position mean other examples changes it (world size and
        gradient accumulation do not: only dealing depends on them, and a resume re-deals).
        """
        plan = self.plan()
        digest = hashlib.sha1(type(self).__name__.encode())
        for array in (self.lengths, plan.items, plan.offsets):
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()

    def state_dict(self, steps_done: int | None = None) -> dict[str, Any]:
        """The position in the epoch: what resuming needs to train exactly the batches not yet trained.

        Args:
            steps_done: micro-batches of this epoch already TRAINED on each rank (the data module passes
                Lightning's count). Default: the batches handed out, which runs ahead of training by the
                DataLoader's prefetch when there are workers.
        """
        steps = self._yielded if steps_done is None else int(steps_done)
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "steps_done": steps,
            "world_size": self.world_size,
            "accumulate": self.accumulate,
            "fingerprint": self.fingerprint(),
            "elastic": None
            if self._elastic is None
            else [self._elastic[0], self._elastic[1].tolist(), self._elastic[2]],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``: the next ``__iter__`` yields exactly the batches not yet trained.

        On the same layout (world size and accumulation) the epoch continues at the saved micro-batch. On another
        layout it continues at the first optimizer step not completed (``resumed_at`` micro-batches of this layout
        count as trained): with the same global batch (``world_size * accumulate``), the remaining steps are the
        very steps the saved layout would have taken, in the same order, only split over other ranks and
        micro-batches; with another global batch the packs not yet trained -- all of them, none twice -- are formed
        into steps of the new size. The next epoch is planned as usual.

        Raises:
            ConfigError: the checkpoint was taken with another seed, dataset or sampler setting.
        """
        if int(state["seed"]) != self.seed:
            raise ConfigError(
                "seed",
                f"the checkpoint's data position was saved with seed={state['seed']} but this run uses "
                f"seed={self.seed}",
                "resume with the same {seed} (or start a new run without {ckpt_path})",
            )
        self.set_epoch(int(state["epoch"]))
        self._elastic = None
        if state["fingerprint"] != self.fingerprint():
            raise ConfigError(
                "sampler",
                f"the checkpoint's data position belongs to another plan than {self!r} makes for epoch "
                f"{self.epoch}: the dataset ({{source}}, {{limit}}, {{max_length}}, {{tokenizer}}) or the sampler "
                f"and its settings changed since it was saved",
                "resume with the same data settings, or start a new run without {ckpt_path}",
            )
        steps = int(state["steps_done"])
        saved = (int(state["world_size"]), int(state["accumulate"]))
        elastic = state.get("elastic")
        if elastic is not None:
            if len(elastic) == 2:  # saved before steps were kept whole: (micro-batches before, unordered pack ids)
                elastic = [int(elastic[0]) // saved[1], elastic[1], False]
            self._elastic = (int(elastic[0]), np.asarray(elastic[1], dtype=np.int64), bool(elastic[2]))
        if saved != (self.world_size, self.accumulate):
            self._elastic = self._untrained_after(steps, *saved)
            steps = self._offset
        self._yielded = self._resume_at = self.resumed_at = steps
        self.restored = self._describe_restore(steps, *saved)

    def _untrained_after(self, steps: int, world_size: int, accumulate: int) -> tuple[int, np.ndarray, bool]:
        """``(optimizer steps completed, pack ids not yet trained, in step order?)`` after ``steps`` micro-batches of
        the saved layout. A step the saved layout had begun but not completed is not counted: its gradients were
        never applied, so it is trained again, whole."""
        plan = self.plan()
        before = self._elastic[0] if self._elastic is not None else 0
        ordered = self._ordered(plan, world_size, accumulate)
        micro_steps = before * accumulate + len(self._place(plan, ordered, world_size, accumulate))
        done = -(-micro_steps // accumulate) if steps >= micro_steps else steps // accumulate
        rest = ordered[(done - before) * world_size * accumulate :]
        return done, rest, world_size * accumulate == self.global_batch

    def _describe_restore(self, steps: int, world_size: int, accumulate: int) -> str:
        """What ``load_state_dict`` restored, in one phrase (the data module prints it)."""
        where = f"epoch {self.epoch}, micro-batch {steps:,} of {len(self):,}"
        if (world_size, accumulate) == (self.world_size, self.accumulate):
            return f"{where} of the same plan: exact"
        layout = f"on {count(self.world_size, 'rank')} x {self.accumulate} accumulated instead of {world_size} x "
        layout += str(accumulate)
        if world_size * accumulate == self.global_batch:
            return (
                f"{where} of the same plan, {layout}: the same {count(self.global_batch, 'pack')} per optimizer step, "
                f"the remaining steps as planned"
            )
        rest = len(self._elastic[1]) if self._elastic is not None else 0
        return (
            f"{where} of the same plan, {layout}: {count(self.global_batch, 'pack')} per optimizer step instead of "
            f"{world_size * accumulate}, the {count(rest, 'untrained pack')} formed into new steps, every example "
            f"still once"
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(n={len(self.lengths)}, seed={self.seed}, shuffle={self.shuffle}, "
            f"drop_last={self.drop_last}, rank={self.rank}, world_size={self.world_size})"
        )


class TokenBudgetSampler(PlannedBatchSampler):
    """Base of the strategies that fill packs up to a token budget: every example must fit in one pack.

    Args:
        lengths: (n,) tokens per example, each <= ``max_tokens`` (else a ``ConfigError`` naming the example).
        max_tokens: token budget of one pack (one micro-step on one rank); ``auto``: the largest multiple of
            ``max_tokens_granule`` up to ``max_tokens_cap`` whose fullest pack the run's memory estimate predicts to
            fit the device (chosen by ``connect``; ``model.memory_limit_gb`` and ``model.memory_margin`` bound it).
        max_tokens_granule: with ``auto``, the budget is a multiple of this.
        max_tokens_cap: with ``auto``, the largest budget tried.
        **common: ``seed``, ``shuffle``, ``drop_last``, ``rank``, ``world_size``, ``accumulate``: see
            ``PlannedBatchSampler``.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        max_tokens: int | Literal["auto"] = 4096,
        max_tokens_granule: int = 1024,
        max_tokens_cap: int = 65536,
        **common: Any,
    ) -> None:
        super().__init__(lengths, **common)
        check_range("max_tokens_granule", max_tokens_granule, 1)
        check_range("max_tokens_cap", max_tokens_cap, 1)
        if max_tokens == AUTO:
            self.auto = "max_tokens"
        else:
            check_max_tokens(self.lengths, max_tokens)
        self.max_tokens = max_tokens
        self.max_tokens_granule = max_tokens_granule
        self.max_tokens_cap = max_tokens_cap

    def _auto_candidates(self) -> tuple[list[int], Callable[[int], PackPlan]]:
        longest, granule = self._longest(), self.max_tokens_granule
        first = -(-longest // granule) * granule
        if first > self.max_tokens_cap:
            raise ConfigError(
                "max_tokens_cap",
                f"{self.max_tokens_cap:,} is below the longest example ({longest:,} tokens; {first:,} in multiples of "
                f"max_tokens_granule={granule:,})",
                "raise {max_tokens_cap}, or lower {max_length}",
            )
        return list(range(first, self.max_tokens_cap + 1, granule)), lambda budget: worst_pack(0, longest, budget)

    def _check_chosen(self) -> None:
        check_max_tokens(self.lengths, self.max_tokens)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, max_tokens={self.max_tokens})"


def check_max_tokens(lengths: np.ndarray, max_tokens: int) -> None:
    """Raise a ``ConfigError`` naming the first example over the token budget and the settings that fix it."""
    check_range("max_tokens", max_tokens, 1)
    over = np.flatnonzero(lengths > max_tokens)
    if over.size:
        i = int(over[0])
        more = f" ({over.size:,} examples over budget, longest {int(lengths.max()):,} tokens)" if over.size > 1 else ""
        raise ConfigError(
            "max_tokens",
            f"example {i} has {int(lengths[i]):,} tokens > max_tokens={max_tokens:,}{more}",
            f"raise {{max_tokens}}, or set {{max_length}} <= {max_tokens:,} with {{overlong}}=truncate",
        )
