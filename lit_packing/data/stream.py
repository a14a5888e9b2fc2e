"""Streaming: sources read as a stream, tokenized in the DataLoader workers, packed window by window.

    data: {streaming: true, buffer_size: 1000}   # PackingDataModule trains from a `StreamLoader`

Nothing is tokenized ahead of training. One epoch of the stream, the same on every rank:

1. Each source's shards in a seeded order (`seed`, epoch, source, pass), read in chunks of `buffer_size` rows. The
   DataLoader workers tokenize the chunks with the cached path's rules and counts (worker `w` of `W` takes chunks
   `w, w + W, ...`; the loader hands them back in order), so only whole chunks cross a process boundary.
2. The interleaver (this process) takes the examples, one at a time, from the source furthest below its share of the
   trained tokens (`Mixture` weights; a single source has weight 1): a deterministic largest-deficit rule, so every
   window follows the weights to within one example. `buffer_size` examples make a window.
3. The configured sampler plans the window exactly as it plans an epoch of the cached path (seeded by the seed,
   epoch and window), and deals its packs over the ranks in whole optimizer steps (`world_size x accumulate`
   packs each). When the window's last step is not full, its examples are carried into the next window instead
   of completing it with empty packs (the epoch's last window completes it), so optimizer steps never straddle two
   windows and nearly no micro-batch is empty, whatever the global batch.
4. Each micro-batch is collated from the window's examples.

The position a checkpoint keeps (`StreamLoader.state_dict`): the epoch, the window, the interleaver's state at the
window's start (each source's pass, rows read and tokens taken), the examples carried into it, and the window
sampler's trained micro-batches; never what the workers prefetched, nothing rank-local. A resume re-reads the
window from the sources' positions, plans it again (the same window, the same plan) and continues: exactly, or on
another layout by re-dealing the window's untrained packs (`PlannedBatchSampler.load_state_dict`), every example
still once.

One module, read whole: the four steps above and the position a checkpoint keeps are one mechanism (the interleaver's
state is what a resume re-reads the window from; the carried examples are what the loader's plan leaves over), so a
change to one step is checked against the others here. The data module's use of it is in `stream_feed`.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lit_packing.batch import IGNORE_INDEX, INDEX, INPUT_IDS, LABELS, SOURCE_TOKENS, TRUNCATED_TOKENS, WINDOW, Pack
from lit_packing.data.encode import DROPPED, LABEL_TOKENS, ROW, Encoder, chat_template, tokenize_batch
from lit_packing.data.global_batch import Layout
from lit_packing.data.report import TokenizationReport, check_report, report_of
from lit_packing.data.shapes import LINE
from lit_packing.data.sources import Source
from lit_packing.errors import ConfigError, DataError
from lit_packing.processes import EndWithParent
from lit_packing.samplers import PlannedBatchSampler

log = logging.getLogger(__name__)

_SHARD_BITS, _ROW_BITS = 16, 32  # an example's id: (source, shard, row) in one int64


def example_id(source: int, shard: int, row: int) -> int:
    """One int64 naming an example of a stream: its source, its shard (in the source's sorted order) and its row."""
    if shard >= 2**_SHARD_BITS or row >= 2**_ROW_BITS:
        raise DataError(
            f"shard {shard:,}, row {row:,}: a stream names at most {2**_SHARD_BITS:,} shards of a source and "
            f"{2**_ROW_BITS:,} rows of a shard; merge the shards, or split the source into a Mixture"
        )
    return (source << (_SHARD_BITS + _ROW_BITS)) | (shard << _ROW_BITS) | row


def split_id(example: int) -> tuple[int, int, int]:
    """`example_id`'s parts: (source, shard, row)."""
    return (
        example >> (_SHARD_BITS + _ROW_BITS),
        (example >> _ROW_BITS) & (2**_SHARD_BITS - 1),
        example & (2**_ROW_BITS - 1),
    )


@dataclass(frozen=True)
class Member:
    """One source of a stream: its name (in logs and metrics), the source, its weight."""

    name: str
    source: Source
    weight: float


def members(source: Source) -> list[Member]:
    """A `Mixture`'s sources with their names and weights; any other source alone, with weight 1."""
    if hasattr(source, "members"):
        return source.members()
    return [Member(type(source).__name__.lower(), source, 1.0)]


@dataclass(frozen=True)
class TokenizeRules:
    """What a worker needs to tokenize rows exactly as the cached path does."""

    tokenizer: Any
    max_length: int
    overlong: str
    train_on: str
    on_bad_row: str


@dataclass
class Chunk:
    """One chunk of a source's rows, tokenized: the kept examples and the report of all its rows."""

    source: int
    number: int
    rows: int  # rows read (kept or not)
    row_in_chunk: np.ndarray  # (kept,) each kept example's row within the chunk
    ids: np.ndarray  # (kept,) example ids
    tokens: list[np.ndarray]
    labels: list[np.ndarray]
    truncated: np.ndarray
    label_tokens: np.ndarray
    report: TokenizationReport
    seconds: float  # spent tokenizing it (in its worker)
    error: str | None = None


class SourceRows:
    """One source's training rows for one (epoch, pass): its shards in a seeded order, without the rows held out
    for validation; read from any row on."""

    def __init__(
        self,
        index: int,
        source: Source,
        held: Sequence[int],
        seed: int,
        shuffle: bool,
        cache_dir: str | None = None,
        limit: int | None = None,
    ) -> None:
        self.index = index
        self.limit = limit  # training rows of a pass (in the shards' sorted order), for quick runs
        self.source = source
        self.shards = source.shards(cache_dir)
        if not self.shards:
            raise DataError(f"{source!r} has no shards to stream: check data.source (its path or data_files)")
        self.shape = source.shape(self.shards)
        if self.shape.unstreamed:
            raise ConfigError(
                "data.streaming",
                f"{source!r} holds {self.shape.unstreamed}, which stream windows do not carry yet",
                "set data.streaming=false (they are tokenized and cached once)",
            )
        self.held = list(held) + [0] * (len(self.shards) - len(held))
        self.seed = seed
        self.shuffle = shuffle
        self._rows: dict[int, int] = {}

    def order(self, epoch: int, pass_: int) -> np.ndarray:
        """The shards' order in this epoch and pass (sorted order without shuffling)."""
        n = len(self.shards)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, self.index, pass_]).permutation(n)

    def rows_of(self, shard: int) -> int:
        """The shard's row count: from its metadata, else counted once by reading it."""
        if shard not in self._rows:
            known = self.shards[shard].rows
            self._rows[shard] = known if known is not None else sum(1 for _ in self.shards[shard].read(0))
        return self._rows[shard]

    def read(self, epoch: int, pass_: int, start: int) -> Iterator[tuple[int, int, dict]]:
        """`(shard, row, raw row)` of the training rows from the `start`-th on."""
        rows = self._read(epoch, pass_, start)
        return rows if self.limit is None else itertools.islice(rows, max(self.limit - start, 0))

    def _read(self, epoch: int, pass_: int, start: int) -> Iterator[tuple[int, int, dict]]:
        order = self.order(epoch, pass_) if self.limit is None else np.arange(len(self.shards))  # a limit: the first
        for shard in order.tolist():
            first = self.held[shard]
            if start:
                left = self.rows_of(shard) - first
                if start >= left:
                    start -= left
                    continue
                first += start
                start = 0
            for row, raw in enumerate(self.shards[shard].read(first), start=first):
                yield shard, row, raw


class _Chunks(IterableDataset):
    """A source's tokenized chunks of one (epoch, pass) from chunk `first` on: in worker `w` of `W`, chunks
    `first + w, first + w + W, ...` (a DataLoader returns them in order)."""

    def __init__(self, rows: SourceRows, epoch: int, pass_: int, first: int, size: int, rules: TokenizeRules):
        self.rows, self.epoch, self.pass_, self.first, self.size, self.rules = rows, epoch, pass_, first, size, rules

    def __iter__(self) -> Iterator[Chunk]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rows = self.rows.read(self.epoch, self.pass_, self.first * self.size)
        shape, tokenizer = self.rows.shape, self.rules.tokenizer
        encoder = Encoder(tokenizer, shape, chat_template(tokenizer) if shape.chat else "", self.rules.train_on)
        for number in itertools.count(self.first):
            block = list(itertools.islice(rows, self.size))
            if not block:
                return
            if (number - self.first) % workers == worker:
                yield tokenize_rows(self.rows.index, number, block, encoder, self.rules)


def tokenize_rows(
    source: int, number: int, block: list[tuple[int, int, dict]], encoder: Encoder, rules: TokenizeRules
) -> Chunk:
    """Tokenize one chunk of `(shard, row, raw row)` with the cached path's function; a bad row is kept in the
    report with its problem (under `on_bad_row: error` the chunk carries the error, raised by the reader)."""
    began = time.perf_counter()
    names = sorted({k for _, _, raw in block for k in raw} - {LINE})
    batch = {name: [raw.get(name) for _, _, raw in block] for name in names}
    ids = [example_id(source, shard, raw.get(LINE, row)) for shard, row, raw in block]  # a file's line names it
    out = tokenize_batch(batch, ids, encoder, rules.max_length, rules.overlong, None)
    columns = {name: np.asarray(values) for name, values in out.items() if name not in (INPUT_IDS, LABELS)}
    columns[ROW] = np.asarray(ids, dtype=np.int64)
    report = report_of(columns.__getitem__)
    error = None
    try:
        check_report(report, rules.on_bad_row, rules.overlong, rules.max_length, lambda i: f"example {i}")
    except DataError as problem:
        error = str(problem)
    kept = np.flatnonzero(columns[DROPPED] == "")
    return Chunk(
        source=source,
        number=number,
        rows=len(block),
        row_in_chunk=kept.astype(np.int64),
        ids=np.asarray(ids, dtype=np.int64)[kept],
        tokens=[np.asarray(out[INPUT_IDS][k], dtype=np.int32) for k in kept],
        labels=[np.asarray(out[LABELS][k], dtype=np.int32) for k in kept],
        truncated=columns[TRUNCATED_TOKENS][kept].astype(np.int64),
        label_tokens=columns[LABEL_TOKENS][kept].astype(np.int64),
        report=report,
        seconds=time.perf_counter() - began,
        error=error if report.bad_examples or report.dropped_overlong_examples else None,
    )


class Window:
    """One window's examples, read by the collator as `TokenizedDataset` rows are (int keys, or `(index, start,
    stop)` token slices)."""

    def __init__(self, number: int, ids: list[int], sources: list[int], tokens: list[np.ndarray],
                 labels: list[np.ndarray], truncated: list[int], label_tokens: list[int]) -> None:  # fmt: skip
        self.number = number
        self.ids = np.asarray(ids, dtype=np.int64)
        self.sources = np.asarray(sources, dtype=np.int64)
        self.tokens, self.labels = tokens, labels
        self.truncated = truncated
        self.label_tokens = np.asarray(label_tokens, dtype=np.int64)
        self.lengths = np.asarray([len(t) for t in tokens], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, key: int | tuple[int, int, int]) -> dict[str, Any]:
        index, start, stop = key if isinstance(key, tuple) else (key, 0, None)
        item = {
            INPUT_IDS: self.tokens[index][start:stop],
            LABELS: self.labels[index][start:stop],
            INDEX: int(self.ids[index]),
        }
        if start == 0:
            item[TRUNCATED_TOKENS] = int(self.truncated[index])
        return item

    def count_labels(self, keys: list) -> list[int]:
        """Trained tokens of each key as the collator sees it (a slice's first label is masked)."""
        return [
            int((self[k][LABELS][1:] != IGNORE_INDEX).sum()) if isinstance(k, tuple) else int(self.label_tokens[k])
            for k in keys
        ]


@dataclass
class InterleaveState:
    """Where the interleaver stands, per source: its pass, the training rows read in it, what it has been given."""

    passes: list[int]
    read: list[int]
    taken: list[float]
    done: list[bool]  # read through at least once this epoch (`repeat`)

    @classmethod
    def start(cls, n: int) -> InterleaveState:
        return cls([0] * n, [0] * n, [0.0] * n, [False] * n)

    def copy(self) -> InterleaveState:
        return InterleaveState(list(self.passes), list(self.read), list(self.taken), list(self.done))

    def as_dict(self) -> dict[str, list]:
        return {"passes": self.passes, "read": self.read, "taken": self.taken, "done": self.done}


class Interleaver:
    """Examples of the sources, one at a time, from the source furthest below its share of what was given so far
    (`weight_by`: real tokens or examples); windows of `size` examples. Reads each source's chunks through its own
    DataLoader (tokenized in `num_workers` processes)."""

    def __init__(self, stream: Stream, epoch: int, state: InterleaveState) -> None:
        self.stream, self.epoch, self.state = stream, epoch, state
        n = len(stream.members)
        total = sum(m.weight for m in stream.members)
        self.weights = [m.weight / total for m in stream.members]
        self._chunks: list[Iterator[Chunk] | None] = [None] * n
        self._open: list[Chunk | None] = [None] * n
        self._next: list[int] = [0] * n  # position in the open chunk's kept examples
        self._took = [read > 0 for read in state.read]  # whether this pass of each source gave an example
        self.report = stream.report  # grows as chunks are read (the data module's, shown in the fit summary)
        self.waited = 0.0  # seconds spent waiting for tokenized chunks
        self.tokenized = [0, 0.0]  # rows tokenized and the workers' seconds for them
        self.finished = False

    def _reader(self, i: int) -> Iterator[Chunk]:
        stream, state = self.stream, self.state
        first = state.read[i] // stream.buffer_size
        dataset = _Chunks(stream.rows[i], self.epoch, state.passes[i], first, stream.buffer_size, stream.rules)
        workers = stream.num_workers
        loader = DataLoader(
            dataset,
            batch_size=None,
            num_workers=workers,
            prefetch_factor=2 if workers else None,
            worker_init_fn=EndWithParent() if workers else None,  # they end with the run, even on SIGKILL
        )
        return iter(loader)

    def _pull(self, i: int) -> bool:
        """Open the next chunk of source `i` that has an example at or after its read position; False at its end."""
        state = self.state
        while True:
            if self._chunks[i] is None:
                self._chunks[i] = self._reader(i)
            began = time.perf_counter()
            chunk = next(self._chunks[i], None)
            self.waited += time.perf_counter() - began
            if chunk is None:
                return False
            if chunk.error:
                raise DataError(_named(chunk.error, self.stream.name_example))
            self.report.update(chunk.report)
            self.tokenized = [self.tokenized[0] + chunk.rows, self.tokenized[1] + chunk.seconds]
            offset = state.read[i] - chunk.number * self.stream.buffer_size
            position = int(np.searchsorted(chunk.row_in_chunk, max(offset, 0)))
            if position < len(chunk.ids):
                self._open[i], self._next[i] = chunk, position
                return True
            state.read[i] = (chunk.number + 1) * self.stream.buffer_size  # only dropped rows were left

    def _choose(self) -> int:
        taken, total = self.state.taken, sum(self.state.taken)
        deficits = [w * total - t for w, t in zip(self.weights, taken)]
        return max(range(len(deficits)), key=lambda i: (deficits[i], self.weights[i], -i))

    def take(self) -> tuple[int, Chunk, int] | None:
        """The next example: (source, its chunk, its position there); None when the epoch's stream ends."""
        state, on_exhausted = self.state, self.stream.on_exhausted
        while not self.finished:
            i = self._choose()
            chunk = self._open[i]
            if chunk is None or self._next[i] >= len(chunk.ids):
                self._open[i] = None
                if self._pull(i):
                    continue
                if not self._took[i]:
                    raise DataError(
                        f"{self.stream.members[i].source!r} (stream source {self.stream.members[i].name!r}) has no "
                        f"example to train in a whole pass: all its rows are held out for validation (data.val_split), "
                        f"bad (data.on_bad_row) or dropped (data.overlong); check them, or leave it out of the Mixture"
                    )
                state.done[i] = True
                if on_exhausted == "stop" or all(state.done):
                    self.finished = True
                    return None
                state.passes[i], state.read[i] = state.passes[i] + 1, 0  # `repeat`: its next pass
                self._chunks[i], self._took[i] = None, False
                continue
            k = self._next[i]
            self._next[i] += 1
            self._took[i] = True
            state.read[i] = chunk.number * self.stream.buffer_size + int(chunk.row_in_chunk[k]) + 1
            state.taken[i] += float(len(chunk.tokens[k])) if self.stream.weight_by == "tokens" else 1.0
            return i, chunk, k
        return None

    def window(self, number: int, carried: Carried | None = None) -> Window | None:
        """The examples `carried` from the last window, then the next `buffer_size` of the stream (fewer at the end
        of the epoch); None when nothing is left."""
        picked = []
        while len(picked) < self.stream.buffer_size:
            example = self.take()
            if example is None:
                break
            picked.append(example)
        carried = carried or Carried()
        if not picked and not carried.ids:
            return None
        return Window(
            number,
            ids=carried.ids + [int(c.ids[k]) for _, c, k in picked],
            sources=carried.sources + [i for i, _, _ in picked],
            tokens=[np.asarray(t, dtype=np.int32) for t in carried.tokens] + [c.tokens[k] for _, c, k in picked],
            labels=[np.asarray(y, dtype=np.int32) for y in carried.labels] + [c.labels[k] for _, c, k in picked],
            truncated=carried.truncated + [int(c.truncated[k]) for _, c, k in picked],
            label_tokens=carried.label_tokens + [int(c.label_tokens[k]) for _, c, k in picked],
        )


@dataclass
class Carried:
    """Examples a window took from the stream but did not train: the packs of its last optimizer step when that
    step was not full. They open the next window, and a checkpoint keeps them (plain lists: a few packs' tokens)."""

    ids: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    labels: list[list[int]] = field(default_factory=list)
    truncated: list[int] = field(default_factory=list)
    label_tokens: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, window: Window, packs: list[list]) -> Carried:
        keys = sorted(int(k) for pack in packs for k in pack)
        return cls(
            ids=[int(window.ids[k]) for k in keys],
            sources=[int(window.sources[k]) for k in keys],
            tokens=[window.tokens[k].tolist() for k in keys],
            labels=[window.labels[k].tolist() for k in keys],
            truncated=[int(window.truncated[k]) for k in keys],
            label_tokens=[int(window.label_tokens[k]) for k in keys],
        )

    def as_dict(self) -> dict[str, list]:
        return dict(vars(self))


def _named(message: str, name_example: Callable[[int], str]) -> str:
    """A chunk's error with every `example <id>` replaced by the row as the user counts it."""
    return re.sub(r"example (\d+)", lambda m: name_example(int(m.group(1))), message)


@dataclass
class _Record:
    """A window this rank yielded: where its micro-batches start (in the epoch's count), how many, its sampler,
    the interleaver's state at its start and end, the optimizer steps of the epoch before it."""

    number: int
    start: int
    micro_batches: int
    sampler: PlannedBatchSampler
    state_start: InterleaveState
    state_end: InterleaveState
    steps_before: int
    carried_start: Carried
    carried_end: Carried


class Stream:
    """The settings of one stream: its members, how they are read and tokenized, its window size and seed."""

    def __init__(
        self,
        source: Source,
        rules: TokenizeRules,
        buffer_size: int,
        seed: int,
        num_workers: int = 0,
        held: Sequence[Sequence[int]] | None = None,
        shuffle: bool = True,
        cache_dir: str | None = None,
        report: TokenizationReport | None = None,
        limit: int | None = None,
    ) -> None:
        self.source = source
        self.members = members(source)
        self.rules = rules
        self.buffer_size = buffer_size
        self.seed = seed
        self.num_workers = num_workers
        self.report = report if report is not None else TokenizationReport()  # what the stream's rows gave so far
        self.weight_by = getattr(source, "weight_by", "tokens")
        self.on_exhausted = getattr(source, "on_exhausted", "stop")
        held = held or [[] for _ in self.members]
        self.limit = limit
        self.rows = [
            SourceRows(i, m.source, held[i], seed, shuffle, cache_dir, limit) for i, m in enumerate(self.members)
        ]

    def name_example(self, example: int) -> str:
        """An example id as the user finds it: `line 18 of shards/a.jsonl`."""
        source, shard, row = split_id(example)
        return self.rows[source].shards[shard].row_name(row)

    def identity(self) -> dict[str, Any]:
        """What a stream position belongs to, by the setting that decides each part."""
        shards = [[s.name for s in rows.shards] for rows in self.rows]
        return {
            "data.source": hashlib.sha1(
                repr([(m.name, m.source.fingerprint, shards) for m in self.members]).encode()
            ).hexdigest(),
            "data.seed": self.seed,
            "data.buffer_size": self.buffer_size,
            "data.limit": self.limit,
            "data.source.init_args.weights": [m.weight for m in self.members],
        }


class StreamLoader:
    """The training loader of a stream: an iterable of collated micro-batches for this rank, one epoch per `iter`,
    with the position a checkpoint keeps (`state_dict(steps_done)` / `load_state_dict`).

    Args:
        stream: the stream's settings.
        make_sampler: builds the configured sampler on a window's lengths, connected to the run (the data module's
            `_build_sampler`), given the window (its `count_labels` gives the step totals).
        collate: the collator.
        layout: the run's `Layout` when asked (every window is whole optimizer steps).
    """

    def __init__(
        self,
        stream: Stream,
        make_sampler: Callable[[Window], PlannedBatchSampler],
        collate: Callable,
        layout: Callable[[], Layout],
    ) -> None:
        self.stream = stream
        self.make_sampler = make_sampler
        self.collate = collate
        self.layout = layout
        self.batch_sampler = self  # where Lightning's `set_epoch` reaches this loader
        self.epoch = 0
        self._records: list[_Record] = []
        self._resume: dict[str, Any] | None = None
        self.resumed_at: int | None = None
        self.restored: str | None = None
        self.interleaver: Interleaver | None = None

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self._resume = None
            self.resumed_at = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # A restored position holds until a pass completes: Lightning may start (and prefetch from) an iterator that
        # it then throws away, and the next one must start at the same position.
        resume = self._resume
        state = InterleaveState.start(len(self.stream.members))
        number, steps_before, sampler_state = 0, 0, None
        if resume is not None:
            state = InterleaveState(**{name: list(values) for name, values in _interleave_state(resume).items()})
            number, steps_before, sampler_state = resume["window"], resume["steps_before"], resume["sampler"]
        carried = Carried(**{k: list(v) for k, v in resume["carried"].items()}) if resume is not None else Carried()
        self._records = []
        self.interleaver = Interleaver(self.stream, self.epoch, state)
        return self._batches(number, steps_before, sampler_state, carried)

    def _batches(
        self, number: int, steps_before: int, sampler_state: dict | None, carried: Carried
    ) -> Iterator[dict[str, Any]]:
        interleaver = self.interleaver
        accumulate = self.layout().accumulate
        while True:
            state_start, carried_start = interleaver.state.copy(), carried
            window = interleaver.window(number, carried)
            if window is None:
                break
            sampler = self.make_sampler(window)
            sampler.set_epoch(_window_key(self.epoch, number))
            if sampler_state is not None:
                sampler.load_state_dict(sampler_state)
                sampler_state = None
            total, trailing = sampler.full_steps()
            slices = sampler.plan().items.ndim > 1  # token slices of examples: not carried, but completed
            if interleaver.finished or slices or not trailing:  # the epoch's last window trains all it holds
                total, trailing = -(-len(sampler) // accumulate) * accumulate, []
            carried = Carried.of(window, trailing)
            start = steps_before * accumulate  # the window's first micro-batch, in the epoch's count
            record = _Record(number, start, total, sampler, state_start, interleaver.state.copy(), steps_before,
                             carried_start, carried)  # fmt: skip
            self._records = [*self._records[-3:], record]
            plan = sampler.plan()
            budget = len(plan) * plan.max_tokens if plan.max_tokens else 0
            fill = {"number": number, "examples": len(window), "tokens": int(window.lengths.sum()),
                    "fill": float(window.lengths.sum() / budget) if budget else None}  # fmt: skip
            step, position = None, sampler.resumed_at or 0
            batches = iter(sampler)
            while position < total:
                pack = next(batches, None)
                if pack is None:  # complete the window's last optimizer step with empty packs
                    pack = Pack([], step=step)
                step, position = pack.step, position + 1
                rows, seconds = interleaver.tokenized
                fill["waited_s"] = interleaver.waited
                fill["examples_per_sec"] = rows / max(seconds, 1e-9) * max(self.stream.num_workers, 1)
                yield self._collate(window, pack, fill)
            steps_before += total // accumulate
            number += 1
        self._resume = None  # a whole pass is done: the next one is a whole epoch

    def _collate(self, window: Window, pack: Pack, fill: dict[str, Any]) -> dict[str, Any]:
        batch = self.collate(Pack([window[key] for key in pack], step=pack.step))
        keys = [key[0] if isinstance(key, tuple) else key for key in pack]
        tokens = np.bincount(window.sources[keys], weights=window.lengths[keys], minlength=len(self.stream.members))
        batch[SOURCE_TOKENS] = tokens.astype(np.int64).tolist()
        batch[WINDOW] = dict(fill)
        return batch

    # ------------------------------------------------------------ resume

    def state_dict(self, steps_done: int | None = None) -> dict[str, Any]:
        """The trained position: the window holding micro-batch `steps_done` of the epoch (Lightning's count of
        trained micro-batches), the interleaver's state at its start, the window sampler's position in it.

        Without `steps_done` (Lightning asking its loader, which it takes as resumable for having this method): {},
        since only the trained count makes a position; the data module saves the one copy, with that count.
        """
        if steps_done is None:
            return {}
        if self._resume is not None and not self._records:  # restored, nothing yielded yet: the same position
            return self._resume
        identity = self.stream.identity()
        world_size, accumulate = self.layout()
        base = {"epoch": self.epoch, "identity": identity, "world_size": world_size, "accumulate": accumulate}
        if not self._records:
            return {**base, "window": 0, "steps_before": 0, "sampler": None, "carried": Carried().as_dict(),
                    "interleaver": InterleaveState.start(len(self.stream.members)).as_dict()}  # fmt: skip
        trained = steps_done
        for record in self._records:
            if record.start <= trained < record.start + record.micro_batches:
                inside = trained - record.start
                if inside > len(record.sampler):  # inside the empty packs that complete the epoch's last step: its
                    accumulate = self.layout().accumulate  # gradients were not applied, redo it
                    inside = inside // accumulate * accumulate
                return {**base, "window": record.number, "steps_before": record.steps_before,
                        "sampler": record.sampler.state_dict(steps_done=inside),
                        "interleaver": record.state_start.as_dict(),
                        "carried": record.carried_start.as_dict()}  # fmt: skip
        last = self._records[-1]
        return {**base, "window": last.number + 1, "sampler": None, "interleaver": last.state_end.as_dict(),
                "carried": last.carried_end.as_dict(),
                "steps_before": last.steps_before + last.micro_batches // self.layout().accumulate}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at `state`'s window; refuse a position of another stream, naming the setting that differs."""
        if not state:
            return  # Lightning handing back its loader's (empty) state
        if "identity" not in state:
            raise ConfigError(
                "data.streaming",
                "the checkpoint's data position is not a stream's (it was saved by the cached path)",
                "resume with data.streaming=false, or start a new run without --ckpt_path",
            )
        for setting, value in self.stream.identity().items():
            if state["identity"].get(setting) != value:
                raise ConfigError(
                    setting,
                    f"the checkpoint's stream position was saved with another {setting} "
                    f"({state['identity'].get(setting)!r}, now {value!r})",
                    "resume with the same stream settings, or start a new run without --ckpt_path",
                )
        self.set_epoch(int(state["epoch"]))
        self._resume = state
        world_size, accumulate = self.layout()
        inside, saved = 0, state["sampler"]
        if saved is not None:  # on another layout the window continues at its first step not completed
            inside = int(saved["steps_done"])
            if (int(saved["world_size"]), int(saved["accumulate"])) != (world_size, accumulate):
                inside = inside // int(saved["accumulate"]) * accumulate
        self.resumed_at = int(state["steps_before"]) * accumulate + inside
        self.restored = (
            f"epoch {self.epoch}, window {state['window']:,} of the stream, micro-batch {inside:,} of it "
            f"(sources read: {', '.join(f'{r:,}' for r in _interleave_state(state)['read'])} rows)"
        )

    def __len__(self) -> int:
        raise TypeError("a stream's length is known only by reading it")


def _window_key(epoch: int, window: int) -> int:
    """The sampler 'epoch' that seeds window `window` of `epoch`: a distinct plan for every window."""
    return (epoch << 32) | window


class HeldOut(NamedTuple):
    """The rows `held_out` holds out for validation."""

    per_shard: list[list[int]]  # per member, the rows held out of each of its shards (`Stream`'s `held`)
    rows: list[dict]  # the raw rows
    ids: list[int]  # their example ids (`example_id`)


def held_out(source: Source, count_: int, cache_dir: str | None = None) -> HeldOut:
    """The first `count_` rows of every member (in its shards' sorted order), held out for validation."""
    held, rows, ids = [], [], []
    for i, member in enumerate(members(source)):
        per_shard, left = [], count_
        for s, shard in enumerate(member.source.shards(cache_dir)):
            if not left:
                break
            taken = list(itertools.islice(shard.read(0), left))
            per_shard.append(len(taken))
            rows.extend(taken)
            ids.extend(example_id(i, s, raw.get(LINE, r)) for r, raw in enumerate(taken))
            left -= len(taken)
        held.append(per_shard)
    return HeldOut(held, rows, ids)


def _interleave_state(position: dict) -> dict:
    """The interleaver's state in a saved position (named `mixer` by checkpoints of earlier releases)."""
    return position["interleaver"] if "interleaver" in position else position["mixer"]
