"""Sources: where examples come from, each in one of three shapes a tokenizer understands (`lit_packing.data.shapes`).

    dataset = HFDataset("chats.jsonl").load()   # datasets.DatasetDict, Arrow-backed on disk; column `messages`

Every source is a plain class chosen in YAML by `class_path` (`data.source`), with a `load(cache_dir)` that returns a
`datasets.Dataset` (or a `datasets.DatasetDict` when the source has its own splits), a stable `fingerprint` and
`row_name(row)`, how a user finds row `row` (`line 17 of chats.jsonl`, `row 16 of ChampChats()`). This module holds
the `Source` base, `HFDataset` (anything `datasets` reads) and `LitData` (litdata's format); the packaged datasets
(`ChampChats`, ...) are sources too, in `lit_packing.data.packaged`.

A source can also be read as a stream (`data.streaming`), without building it into the cache first: `shards()`
gives its pieces in order, each a `Shard` (`lit_packing.data.shards`, every reader) read from any row on with
bounded memory, yielding the same rows `load()` holds; `shape(shards)` tells their example shape from a schema or
first row:

    shards = HFDataset("json", data_files="shards/*.jsonl").shards()   # one JsonLinesShard per file, sorted
    rows = shards[1].read(start=500)                                   # lazily, from row 500 of the second file
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import datasets
from datasets import Features, Value

from lit_packing._compat import packaged_builders
from lit_packing.assets import check_local_or_hub
from lit_packing.data.shapes import LINE, PROBLEM, ExampleShape, example_shape
from lit_packing.data.shards import (
    FILE_BUILDERS,
    DatasetShard,
    LitDataShard,
    Shard,
    StreamingShard,
    file_shards,
    import_litdata,
    is_json_array,
    json_rows,
    json_shape,
)
from lit_packing.errors import AssetError, ConfigError, DataError


def _hash(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


class Source:
    """Base of every source: `load()` gives the examples, `fingerprint` names them for caches.

    Subclasses set `version` (bump it when the examples they produce change) and implement `load`.
    The default fingerprint hashes the class name, `version`, the constructor options (`vars(self)`) and the
    versions of the packages in `packages`, so changing any of them re-builds every cache downstream.
    """

    version = "1"
    packages: tuple[str, ...] = ()
    _shape_knob = "data.source"  # the setting that renames columns, named by `shape`'s error

    @property
    def fingerprint(self) -> str:
        """Stable identity of the examples this source yields, e.g. `ChampChats-1f0c...` (valid as a cache name)."""
        installed = [importlib.metadata.version(p) for p in self.packages]
        return f"{type(self).__name__}-{_hash(self.version, sorted(vars(self).items()), installed)}"

    def load(self, cache_dir: str | None = None) -> datasets.Dataset | datasets.DatasetDict:
        """The examples, Arrow-backed (`cache_dir`: where datasets keeps them; None for its default cache)."""
        raise NotImplementedError

    def row_name(self, row: int) -> str:
        """How a user finds row `row` (a value of the tokenized `row` column): `row 16 of ChampChats()`."""
        return f"row {row:,} of {self!r}"

    def shards(self, cache_dir: str | None = None) -> list[Shard]:
        """The examples as shards for `data.streaming`, in the source's own order (the stream shuffles them itself).

        By default one shard over `load(cache_dir)` (its `train` split when it has splits), so every source can be
        streamed, although it is built into the datasets cache first; sources that read files override this to read
        them as they are, nothing cached.

        Raises:
            ConfigError: `load()` gave splits but no `train`.
        """
        loaded = self.load(cache_dir)
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ConfigError(
                    "data.source.init_args.split", f"{self!r} has splits {sorted(loaded)} but no 'train'", "choose one"
                )
            loaded = loaded["train"]
        return [DatasetShard(repr(self), len(loaded), loaded, self)]

    def shape(self, shards: list[Shard] | None = None) -> ExampleShape:
        """The example shape the shards' rows hold (`lit_packing.data.shapes`), told before any is read:
        from the columns of the first shard that may hold rows (its schema, or its first row where it has none).

        Args:
            shards: `shards()`, when the caller has them already (building them may read metadata or a first row).

        Raises:
            DataError: no shard holds a row, or the columns hold no known shape (naming the setting that renames them).
        """
        shards = self.shards() if shards is None else shards
        shard = next((shard for shard in shards if shard.rows != 0), None)
        if shard is None:
            raise DataError(f"{self!r} holds no examples: check data.source (its path, split and field_map)")
        return example_shape(shard.columns(), knob=f"{self._shape_knob} ({shard.name})")

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({options})"

    def _from_generator(self, generator, features: Features, cache_dir: str | None, **gen_kwargs) -> datasets.Dataset:
        return datasets.Dataset.from_generator(
            generator, features=features, gen_kwargs=gen_kwargs, cache_dir=cache_dir, fingerprint=self.fingerprint
        )


# ---------------------------------------------------------------- Anything `datasets` reads


def _one_split(splits: dict, split: str, what: str):
    """`splits[split]`, or a `ConfigError` naming the splits there are."""
    if split not in splits:
        raise ConfigError(
            "data.source.init_args.split", f"{what} has splits {sorted(splits)}, not {split!r}", "choose one"
        )
    return splits[split]


class HFDataset(Source):
    """Any local JSONL/JSON/Parquet/Arrow/CSV file, a dataset saved with `save_to_disk`, or a Hub name.

    In YAML: `source: {class_path: HFDataset, init_args: {path: qa.jsonl, field_map: {q: prompt, a: completion}}}`.

    A local JSON Lines (or JSON array) file is read line by line here, not by `datasets`' JSON builder, so that a
    malformed line, bytes that are not UTF-8, or a field of the wrong type is kept as a bad row with its line number
    (`data.on_bad_row` decides) instead of failing the whole file; only the shape's columns are kept.

    Streamed (`shards()`), local files are read as they are, one shard per file in sorted order; a Hub dataset is one
    shard read through `datasets`' streaming mode.

    Args:
        path: a file (`.jsonl`, `.json`, `.parquet`, `.arrow`, `.csv`), a folder of them, a `save_to_disk` folder,
            or anything `datasets.load_dataset` accepts (a Hub id, a builder name such as `json` with `data_files`).
        name: the dataset configuration (Hub datasets with several).
        split: one split (`train`, `train[:1000]`); None keeps every split (a `validation` or `test` split then
            becomes the validation set).
        data_files: passed to `load_dataset` (e.g. `{train: a.jsonl, validation: b.jsonl}` with `path: json`).
        field_map: renames columns to the known shapes, `{your_column: messages | prompt | completion | text}`.
    """

    _shape_knob = "data.source.init_args.field_map"

    def __init__(
        self,
        path: str,
        name: str | None = None,
        split: str | None = None,
        data_files: str | list[str] | dict[str, str] | None = None,
        field_map: dict[str, str] | None = None,
    ) -> None:
        self.path = path
        self.name = name
        self.split = split
        self.data_files = data_files
        self.field_map = field_map

    def row_name(self, row: int) -> str:
        """`line 17 of chats.jsonl` for a local JSON Lines file (`item 17` of a JSON array), else the source row."""
        if self._reads_json_here():
            return f"{'item' if is_json_array(self.path) else 'line'} {row:,} of {self.path}"
        return super().row_name(row)

    def load(self, cache_dir: str | None = None) -> datasets.Dataset | datasets.DatasetDict:
        if self._reads_json_here():
            loaded = self._read_json(cache_dir)
            return loaded if self.split else datasets.DatasetDict(train=loaded)
        loaded = self._read(cache_dir)
        if self.field_map:
            loaded = loaded.rename_columns(self.field_map)
        parts = loaded.values() if isinstance(loaded, datasets.DatasetDict) else [loaded]
        for part in parts:
            example_shape(part.column_names, knob=f"data.source.init_args.field_map (source {self.path})")
            if not len(part):
                raise DataError(f"{self!r} holds no examples: point data.source.init_args.path at your data")
        return loaded

    def shards(self, cache_dir: str | None = None) -> list[Shard]:
        """The split `split` (default `train`) as shards for `data.streaming`, read as it is (nothing is cached, so
        `cache_dir` is not used):

        - a local file, a folder of files, or a builder (`path: json`, `parquet`, `arrow`, `csv`) with `data_files`
          globs: one shard per file, in the order `datasets` reads them (sorted, pattern by pattern): JSON Lines parsed
          here as `load` parses a file (`JsonLinesShard`), Parquet by row group, Arrow by record batch, other files
          (CSV, compressed JSON) through `datasets`' streaming mode (`StreamingShard`);
        - a `save_to_disk` folder: one `ArrowShard` per `data-*.arrow` file of the split;
        - anything else, a Hub name: one `StreamingShard`, `load_dataset(path, name, split, streaming=True)`.

        The rows are `load`'s, but for JSON files given as `path: json` with `data_files`: `load` reads those with
        `datasets`' JSON builder (every column, no line numbers, and a malformed line fails the whole load), while
        their shards hold what a single file's do (`LINE`, `PROBLEM` and the shape's columns).

        Raises:
            ConfigError: a part of a split (`train[:1000]`), a split the data does not have, an unknown file type.
            AssetError: a local path or `data_files` glob that matches nothing, a Hub dataset that cannot be reached.
        """
        split = self.split or "train"
        if not re.fullmatch(r"[\w.-]+", split):
            raise ConfigError(
                "data.source.init_args.split",
                f"{split!r} selects part of a split (or several), which a stream cannot read",
                "give one whole split (train), or set data.streaming: false",
            )
        local = Path(self.path)
        if (local / "dataset_dict.json").exists() or (local / "state.json").exists():
            return file_shards(self._saved_files(local, split), "arrow", self.field_map)
        if local.is_file() or local.is_dir() or self.path in packaged_builders():
            return file_shards(*self._data_files(split), self.field_map)
        self._check_where()
        return [StreamingShard(repr(self), None, self.path, self.name, split, self.data_files, self.field_map)]

    def _saved_files(self, folder: Path, split: str) -> list[str]:
        """The Arrow files of `split` in a `save_to_disk` folder (a saved Dataset is a `train` split), in order."""
        if (folder / "dataset_dict.json").exists():
            splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
            folder = _one_split({name: folder / name for name in splits}, split, self.path)
        else:
            _one_split({"train": ()}, split, self.path)
        state = json.loads((folder / "state.json").read_text())
        return [str(folder / file["filename"]) for file in state["_data_files"]]

    def _builder_of(self, local: Path) -> str:
        """The `datasets` builder that reads a local file, by its suffix; a clear error for any other file type."""
        if local.suffix not in FILE_BUILDERS:
            raise ConfigError(
                "data.source.init_args.path",
                f"{self.path!r} is of an unknown file type",
                f"use {sorted(FILE_BUILDERS)}",
            )
        return FILE_BUILDERS[local.suffix]

    def _data_files(self, split: str) -> tuple[list[str], str]:
        """The local files of `split`, resolved as `load_dataset` resolves them, and the builder that reads them:
        `path` itself (a file), a folder's data files (split by their names), or a builder's `data_files`."""
        from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns, sanitize_patterns

        local = Path(os.path.abspath(self.path))
        if local.is_file():
            _one_split({"train": ()}, split, self.path)
            return [str(local)], self._builder_of(local)
        if local.is_dir():
            try:
                patterns = get_data_patterns(local.as_posix())
            except EmptyDatasetError:
                raise DataError(
                    f"{self.path} holds no data files: point data.source.init_args.path at a folder of "
                    f"{'/'.join(sorted(FILE_BUILDERS))} files"
                ) from None
            files = _one_split(DataFilesDict.from_patterns(patterns, base_path=local.as_posix()), split, self.path)
            builders = Counter(FILE_BUILDERS.get(Path(file).suffix) for file in files)
            builder = max((b for b in builders if b), key=builders.__getitem__, default=None)
            if builder is None:
                raise ConfigError(
                    "data.source.init_args.path",
                    f"{self.path!r} holds no file of a known type",
                    f"use {sorted(FILE_BUILDERS)}",
                )
            return [file for file in files if FILE_BUILDERS.get(Path(file).suffix) == builder], builder
        self._check_where()
        patterns = {
            name: [os.path.expanduser(pattern) for pattern in group]
            for name, group in sanitize_patterns(self.data_files).items()
        }
        resolved = DataFilesDict.from_patterns(patterns, base_path=Path.cwd().as_posix())
        return list(_one_split(resolved, split, f"{self.path} with data_files {self.data_files!r}")), self.path

    def _reads_json_here(self) -> bool:
        local = Path(self.path)
        return local.is_file() and local.suffix in (".jsonl", ".json") and self.split in (None, "train")

    def _read_json(self, cache_dir: str | None) -> datasets.Dataset:
        shape = json_shape([self.path], self.field_map)
        stat = Path(self.path).stat()
        features = Features({LINE: Value("int64"), PROBLEM: Value("string"), **shape.features})
        return datasets.Dataset.from_generator(
            json_rows,
            features=features,
            gen_kwargs={"path": self.path, "shape": shape, "field_map": self.field_map},
            cache_dir=cache_dir,
            fingerprint=_hash(self.fingerprint, stat.st_size, stat.st_mtime_ns, shape.name),
        )

    def _read(self, cache_dir: str | None) -> datasets.Dataset | datasets.DatasetDict:
        local = Path(self.path)
        if (local / "state.json").exists() or (local / "dataset_dict.json").exists():
            saved = datasets.load_from_disk(str(local))
            return saved[self.split] if self.split else saved
        if local.is_file():
            return datasets.load_dataset(
                self._builder_of(local), data_files=str(local), split=self.split, cache_dir=cache_dir
            )
        self._check_where()
        return datasets.load_dataset(
            self.path, self.name, split=self.split, data_files=self.data_files, cache_dir=cache_dir
        )

    def _check_where(self) -> None:
        """A local path or data file that does not exist, or a Hub dataset that cannot be reached, named in one
        line before `datasets` makes any request."""
        if self.path in packaged_builders():  # a builder (`json`, `parquet`, ...) reading `data_files`
            files = self.data_files
            patterns = [files] if isinstance(files, str) else list(files.values()) if isinstance(files, dict) else files
            for pattern in (p for group in patterns or [] for p in ([group] if isinstance(group, str) else group)):
                if not glob.glob(os.path.expanduser(pattern), recursive=True):
                    raise AssetError(
                        "data.source.init_args.data_files",
                        f"{pattern!r} matches no local file (looked in {Path.cwd()})",
                        "check the path",
                    )
            return
        check_local_or_hub(self.path, "data.source.init_args.path", repo_type="dataset")


# ---------------------------------------------------------------- litdata (Lightning's streaming format)


def _shard_rows(shards: list[Shard]) -> Iterator[dict]:
    for shard in shards:
        yield from shard.read()


class LitData(Source):
    """A dataset written by `litdata.optimize` (Lightning's streaming format), in a local folder or an object store
    (`s3://bucket/chats`), read with `litdata.StreamingDataset`: each item a dict of one of the shapes, as the `fn`
    given to `optimize` returned it (e.g. `{"messages": [{"role": "user", "content": ...}, ...]}`).

    In YAML: `source: {class_path: LitData, init_args: {input_dir: s3://bucket/chats}}`. Streamed (`data.streaming`),
    each optimized chunk is a shard, fetched as it is read; otherwise `load` reads every item into the datasets cache
    first. Needs the `stream` extra, `pip install -e ".[stream]"` in your clone (and, for an object store,
    credentials as litdata takes them).

    Args:
        input_dir: the `output_dir` that `litdata.optimize` wrote: a local folder, or `s3://...`.
        field_map: renames item keys to the known shapes, `{your_key: messages | prompt | completion | text}`.
    """

    _shape_knob = "data.source.init_args.field_map"

    def __init__(self, input_dir: str, field_map: dict[str, str] | None = None) -> None:
        self.input_dir = input_dir
        self.field_map = field_map

    def shards(self, cache_dir: str | None = None) -> list[Shard]:
        """One `LitDataShard` per chunk, in the index's order (nothing is cached, so `cache_dir` is not used).

        Raises:
            AssetError: litdata is not installed, or a local `input_dir` that is not a dataset `optimize` wrote.
        """
        return self._shards(*self._index())

    def load(self, cache_dir: str | None = None) -> datasets.Dataset:
        """Every item, read in index order into an Arrow-backed Dataset (rebuilt when the index changes).

        Raises:
            DataError: the dataset holds no item, or its items no known shape (naming `field_map`).
        """
        where, index = self._index()
        shards = self._shards(where, index)
        return datasets.Dataset.from_generator(
            _shard_rows,
            gen_kwargs={"shards": shards},
            cache_dir=cache_dir,
            fingerprint=_hash(self.fingerprint, index, self.shape(shards).name),
        )

    def _shards(self, where: str, index: dict) -> list[Shard]:
        shards, first = [], 0
        for chunk in index["chunks"]:
            name = f"{self.input_dir.rstrip('/')}/{chunk['filename']}"
            shards.append(LitDataShard(name, chunk["chunk_size"], where, first, self.field_map))
            first += chunk["chunk_size"]
        return shards

    def _index(self) -> tuple[str, dict]:
        """Where litdata reads the dataset (a local folder as an absolute path, else the URL), and its `index.json`
        (fetched into litdata's cache for an object store)."""
        litdata = import_litdata()
        where = self.input_dir
        if "://" not in where:
            where = os.path.abspath(os.path.expanduser(where))
            if not Path(where, "index.json").is_file():
                problem = "holds no index.json" if Path(where).is_dir() else "is no local folder"
                raise AssetError(
                    "data.source.init_args.input_dir",
                    f"{self.input_dir!r} {problem} (looked in {Path.cwd()})",
                    "give the output_dir that litdata.optimize wrote, or an s3:// URL",
                )
        items = litdata.StreamingDataset(where)
        return where, json.loads(Path(items.input_dir.path, "index.json").read_text())
