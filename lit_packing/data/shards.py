"""Shards: a source read as a stream, from any row on, in order, with bounded memory (`data.streaming`).

    rows = JsonLinesShard("a.jsonl", None, "a.jsonl", CHAT, None).read(start=500)   # lazily, from row 500

Every reader is here, so a new file format is one edit in this file: a `Shard` subclass, its suffix in
`FILE_BUILDERS` and its branch in `file_shards`. A source builds its shards (`Source.shards()`, `HFDataset.shards()`
through `file_shards`, `LitData.shards()`); the stream reads them in DataLoader workers, which receive them by
pickle (each opens its file or stream only when read).

    format                                reader          how `read(start)` reaches row `start`
    JSON Lines, one JSON array (.json)    JsonLinesShard  counts non-blank lines, unparsed (an array: parsed whole)
    Parquet                               ParquetShard    passes whole row groups by their metadata, then slices
    Arrow, a `save_to_disk` folder        ArrowShard      passes whole record batches of the memory map, unread
    CSV, compressed JSON, a Hub dataset   StreamingShard  `datasets`' streaming `.skip(start)` (reads what it skips)
    `litdata.optimize` chunks             LitDataShard    reads item `first + start` of the index directly
    a built map-style `datasets.Dataset`  DatasetShard    slices: any row directly (the default `Source.shards()`)
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Protocol

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from lit_packing.data.shapes import LINE, PROBLEM, ExampleShape, example_shape
from lit_packing.errors import AssetError, DataError, install_hint

_READ_ROWS = 1024  # rows turned into Python objects at a time: what bounds a reader's memory


class NamesRows(Protocol):
    """What a `DatasetShard` needs of the source that built it (every `lit_packing.data.sources.Source`)."""

    def row_name(self, row: int) -> str: ...


@dataclass(frozen=True)
class Shard:
    """One piece of a source that can be read from any row on, in order, with bounded memory.

    `data.streaming` reads a source as its shards (`Source.shards()`), tokenizing windows of rows as training goes
    instead of tokenizing all of it into the cache first. Shards are picklable (DataLoader workers receive them) and
    open their file or stream only when read.

    Attributes:
        name: what a user recognises: the file path, or the source's repr (`Chatterbot()`).
        rows: its row count when known without reading it (Parquet/Arrow metadata, a litdata index, a map-style
            dataset); None when only reading it tells (JSON Lines, a Hub stream).
    """

    name: str
    rows: int | None

    def read(self, start: int = 0) -> Iterator[dict]:
        """Its rows from row `start` on (0-based), lazily: dicts with the columns `columns()` names, the same dicts
        the cached path's `Source.load()` holds for the same data (so tokenizing them gives the same examples)."""
        raise NotImplementedError

    def columns(self) -> list[str]:
        """The column names of its rows, from its schema (or its first row where it has none), after `field_map`."""
        raise NotImplementedError

    def row_name(self, row: int) -> str:
        """How a user finds row `row` (its 0-based position in the shard; for a JSON Lines file, its `LINE`, which
        is what tokenization puts in the `row` column): `row 7 of shards/b.parquet`."""
        return f"row {row:,} of {self.name}"


def _check_start(start: int) -> int:
    if start < 0:
        raise ValueError(f"a shard is read from a row >= 0, got start={start}")
    return start


def _renamed_columns(names: Iterable[str], field_map: dict[str, str] | None) -> list[str]:
    return [(field_map or {}).get(name, name) for name in names]


@dataclass(frozen=True)
class DatasetShard(Shard):
    """A map-style `datasets.Dataset` (what a source's `load()` built), read by slices: any row is reached directly.

    Attributes:
        dataset: the rows.
        source: the source that built it, which names its rows (`row 3 of Chatterbot()`).
    """

    dataset: datasets.Dataset
    source: NamesRows

    def read(self, start: int = 0) -> Iterator[dict]:
        for begin in range(_check_start(start), len(self.dataset), _READ_ROWS):
            batch = self.dataset[begin : begin + _READ_ROWS]
            yield from (dict(zip(batch, values)) for values in zip(*batch.values()))

    def columns(self) -> list[str]:
        return list(self.dataset.column_names)

    def row_name(self, row: int) -> str:
        return self.source.row_name(row)


# ---------------------------------------------------------------- files: JSON Lines, Parquet, Arrow, any builder

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
_SHAPE_VOTES = 1000  # records read to decide a JSON file's shape before the full pass


def json_records(path: str, start: int = 0) -> Iterator[tuple[int, object, str]]:
    """`(line, record, problem)` for each non-blank line of a JSON Lines file (or `(item, record, "")` for each
    item of a file holding one JSON array); `problem` says why a line could not be read (`record` is then None).

    `start` skips that many records first: lines are counted, not parsed (a JSON array is one value, parsed whole).
    """
    with open(path, "rb") as lines:
        if is_json_array(path):
            try:
                items = json.load(lines)
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise DataError(f"{path} is not valid JSON ({error}): fix it, or write one object per line") from None
            yield from islice(((number, item, "") for number, item in enumerate(items, 1)), start, None)
            return
        skipped = number = 0
        while skipped < start:  # counted, not parsed; `lines` goes on after the last one skipped
            line = next(lines, b"")
            if not line:
                break
            number += 1
            skipped += bool(line.strip())
        yield from parse_json_lines(lines, first=number + 1)


def parse_json_lines(lines: Iterable[bytes], first: int = 1) -> Iterator[tuple[int, object, str]]:
    """`(line number, record, problem)` for each non-blank line (bytes, as read from a file opened in binary);
    `first` is the number of the first line given."""
    for number, line in enumerate(lines, first):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line.decode("utf-8")), ""
        except UnicodeDecodeError as error:
            yield number, None, f"not valid UTF-8 (byte 0x{line[error.start]:02x} at column {error.start + 1})"
        except json.JSONDecodeError as error:
            yield number, None, f"not valid JSON ({error.msg} at column {error.colno})"


def is_json_array(path: str) -> bool:
    with open(path, "rb") as file:
        head = file.read(4096).lstrip()
    return head[:1] == b"["


def _renamed(record: object, field_map: dict[str, str] | None) -> object:
    if not field_map or not isinstance(record, dict):
        return record
    return {field_map.get(key, key): value for key, value in record.items()}


def _normalized(shape: ExampleShape, line: int, record: object, problem: str) -> dict:
    """One Arrow row of `shape`: the record's fields (types checked), or empty fields and the problem."""
    if not problem:
        problem = "not a JSON object" if not isinstance(record, dict) else shape.problem(record)
    return {LINE: line, PROBLEM: problem, **shape.held(record, problem)}


def json_rows(path: str, shape: ExampleShape, field_map: dict[str, str] | None, start: int = 0) -> Iterator[dict]:
    for line, record, problem in json_records(path, start):
        yield _normalized(shape, line, _renamed(record, field_map), problem)


def json_shape(paths: list[str], field_map: dict[str, str] | None) -> ExampleShape:
    """The shape most of the first `_SHAPE_VOTES` records of the files hold: a few rows missing a field are bad rows,
    not another shape.

    Raises:
        DataError: the files hold no record, or none of the first holds a JSON object, or no known shape.
    """
    where = paths[0] if len(paths) == 1 else f"{paths[0]} (and {len(paths) - 1:,} more)"
    head = islice(((line, record) for path in paths for line, record, _ in json_records(path)), _SHAPE_VOTES)
    first = [(line, _renamed(record, field_map)) for line, record in head]
    if not first:
        raise DataError(f"{where} holds no examples (empty file): point data.source.init_args.path at data")
    votes = Counter(k for _, r in first if isinstance(r, dict) for k, v in r.items() if v is not None)
    if not votes:
        raise DataError(
            f"{where}: none of its first {len(first):,} lines holds a JSON object (line {first[0][0]}): "
            f"write one object per line (JSON Lines) or one array of objects"
        )
    majority = [key for key, count in votes.items() if 2 * count >= max(votes.values())]
    return example_shape(majority, knob=f"data.source.init_args.field_map (file {where})")


def _shown(path: str) -> str:
    """A resolved file as a user names it: relative to the working directory when inside it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


@dataclass(frozen=True)
class JsonLinesShard(Shard):
    """A local JSON Lines file (or one JSON array) parsed here, as `HFDataset.load` parses one: each row carries `LINE`
    and `PROBLEM`, and a malformed line is a row with its problem, never an error that stops the stream. Skipping to
    a row counts non-blank lines without parsing them.

    Attributes:
        path: the file.
        shape: the example shape of the whole source (decided on its first records, as `load` decides it).
        field_map: renames record keys to the shape's columns.
    """

    path: str
    shape: ExampleShape
    field_map: dict[str, str] | None

    def read(self, start: int = 0) -> Iterator[dict]:
        return json_rows(self.path, self.shape, self.field_map, _check_start(start))

    def columns(self) -> list[str]:
        return [LINE, PROBLEM, *self.shape.columns]

    def row_name(self, row: int) -> str:
        """`line 18 of shards/a.jsonl` (`row` is the row's `LINE`), `item 18` for a JSON array."""
        return f"{'item' if is_json_array(self.path) else 'line'} {row:,} of {self.name}"


@dataclass(frozen=True)
class FileShard(Shard):
    """A columnar file (Parquet, Arrow) whose rows are its columns' values, renamed by `field_map`.

    Attributes:
        path: the file.
        field_map: renames columns to the shape's.
    """

    path: str
    field_map: dict[str, str] | None


@dataclass(frozen=True)
class ParquetShard(FileShard):
    """A Parquet file read by row group: skipping to a row passes whole row groups by their metadata, then slices."""

    def read(self, start: int = 0) -> Iterator[dict]:
        skip = _check_start(start)
        with pq.ParquetFile(self.path) as file:
            groups = [file.metadata.row_group(g).num_rows for g in range(file.metadata.num_row_groups)]
            first = 0
            while first < len(groups) and skip >= groups[first]:
                skip -= groups[first]
                first += 1
            for batch in file.iter_batches(_READ_ROWS, row_groups=list(range(first, len(groups)))):
                if skip < batch.num_rows:
                    yield from (_renamed(row, self.field_map) for row in batch.slice(skip).to_pylist())
                skip = max(skip - batch.num_rows, 0)

    def columns(self) -> list[str]:
        return _renamed_columns(pq.read_schema(self.path).names, self.field_map)


def _arrow_batches(source: pa.MemoryMappedFile) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """The schema and record batches of an Arrow file, read as `datasets` reads one: the IPC stream format it writes,
    else the IPC file format. Batches of a memory map are not copied: counting their rows reads no data."""
    try:
        reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        file = pa.ipc.open_file(source)
        return file.schema, (file.get_batch(i) for i in range(file.num_record_batches))
    return reader.schema, iter(reader)


def _arrow_rows(path: str) -> int:
    with pa.memory_map(path) as source:
        return sum(batch.num_rows for batch in _arrow_batches(source)[1])


@dataclass(frozen=True)
class ArrowShard(FileShard):
    """An Arrow file (`datasets`' own format: a `save_to_disk` folder's `data-*.arrow`), memory-mapped and read by
    record batch; skipping to a row passes whole batches without reading them."""

    def read(self, start: int = 0) -> Iterator[dict]:
        skip = _check_start(start)
        with pa.memory_map(self.path) as source:
            for batch in _arrow_batches(source)[1]:
                for begin in range(skip, batch.num_rows, _READ_ROWS):
                    rows = batch.slice(begin, _READ_ROWS).to_pylist()
                    yield from (_renamed(row, self.field_map) for row in rows)
                skip = max(skip - batch.num_rows, 0)

    def columns(self) -> list[str]:
        with pa.memory_map(self.path) as source:
            return _renamed_columns(_arrow_batches(source)[0].names, self.field_map)


@dataclass(frozen=True)
class StreamingShard(Shard):
    """What `datasets.load_dataset(..., streaming=True)` reads: a Hub dataset, or a local file of a builder with no
    reader here (CSV). Rows are known only by reading; `read(start)` passes the first rows with `.skip(start)`.

    Attributes:
        path, config, split, data_files: `load_dataset`'s `path`, `name`, `split` and `data_files`.
        field_map: renames columns to the shape's.
    """

    path: str
    config: str | None
    split: str
    data_files: str | list[str] | dict[str, str] | None
    field_map: dict[str, str] | None

    def read(self, start: int = 0) -> Iterator[dict]:
        rows = self._stream().skip(_check_start(start))
        return (_renamed(row, self.field_map) for row in rows)

    def columns(self) -> list[str]:
        stream = self._stream()
        return _renamed_columns(stream.column_names or next(iter(stream), {}), self.field_map)

    def _stream(self) -> datasets.IterableDataset:
        return datasets.load_dataset(
            self.path, self.config, split=self.split, data_files=self.data_files, streaming=True
        )


def file_shards(files: list[str], builder: str, field_map: dict[str, str] | None) -> list[Shard]:
    """One shard per file, the reader chosen by the `datasets` builder that reads them (`FILE_BUILDERS`); any
    builder with no reader here (CSV, compressed JSON) is read through `datasets`' streaming mode."""
    if builder == "json" and all(Path(file).suffix in (".jsonl", ".json") for file in files):  # not compressed
        shape = json_shape(files, field_map)
        return [JsonLinesShard(_shown(file), None, file, shape, field_map) for file in files]
    if builder == "parquet":
        return [ParquetShard(_shown(f), pq.read_metadata(f).num_rows, f, field_map) for f in files]
    if builder == "arrow":
        return [ArrowShard(_shown(file), _arrow_rows(file), file, field_map) for file in files]
    return [StreamingShard(_shown(file), None, builder, None, "train", file, field_map) for file in files]


# ---------------------------------------------------------------- litdata (Lightning's streaming format)


def import_litdata():
    """The optional `litdata` package, imported on first use."""
    # Older litdata releases ask PyPI for a newer version on every StreamingDataset (one per shard read): not here.
    os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
    try:
        import litdata
    except ImportError:
        raise AssetError(
            "litdata", "the package is not installed (the LitData source reads with it)",
            f"run {install_hint('stream')}",
        ) from None  # fmt: skip
    return litdata


@dataclass(frozen=True)
class LitDataShard(Shard):
    """One chunk of a dataset written by `litdata.optimize`: its rows come from the index, each read by its item index
    (litdata fetches the chunk from an object store first).

    Attributes:
        input_dir: the dataset (a local folder or `s3://...`).
        first: the item index of the chunk's first row in the whole dataset.
        field_map: renames item keys to the shape's columns.
    """

    input_dir: str
    first: int
    field_map: dict[str, str] | None

    def read(self, start: int = 0) -> Iterator[dict]:
        items = import_litdata().StreamingDataset(self.input_dir)
        for item in range(self.first + _check_start(start), self.first + self.rows):
            yield _renamed(items[item], self.field_map)

    def columns(self) -> list[str]:
        return list(next(self.read(), {}))

    def row_name(self, row: int) -> str:
        """`row 7 of data/chunk-0-1.bin (item 17 of data)`: the chunk's row, and its index in the whole dataset."""
        return f"row {row:,} of {self.name} (item {self.first + row:,} of {self.input_dir})"
