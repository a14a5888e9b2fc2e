"""Tokenization: examples (chat, prompt/completion or text) -> `input_ids` + `labels`, cached on disk by `datasets`.

    tokenized, report = tokenize_dataset(ChampChats().load(), tokenizer, max_length=2048)  # re-runs load the cache

Labels are -100 where nothing is trained. With `train_on="completion"` (default) a chat trains only on assistant
turns, each with its end-of-turn token; prompt/completion trains on the completion and eos; text trains on all.
The first label of every example is -100: no token before it predicts it (in a pack, the token before belongs to
another example). Worked example, SmolLM2's ChatML template, `[user "Hi", assistant "Hello!"]`:

    <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello!<|im_end|>\\n
    labels: -100 ...................................................................... Hello ! <|im_end|> -100

Assistant spans come from the chat template itself: the render of `messages[:i]` with a generation prompt ends
where assistant message i starts, the render of `messages[:i + 1]` where it ends. This works for any template that
renders earlier turns the same whatever follows (prefix-consistent); others raise a ValueError naming the fix.

Bad examples (see `lit_packing.data.sources.example_problem`) are never tokenized: with `on_bad_row="error"`
(default) tokenization stops with a `DataError` naming the first few rows as the user counts them (a file's line
numbers); with `skip` they are left out and counted. The cache file `datasets.map` writes is checked against a
size + XXH3-128 record kept beside it on every load, and rebuilt when it differs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import datasets
import numpy as np
import torch
import xxhash
from datasets import Features, List, Value

from lit_packing._compat import dataset_fingerprint
from lit_packing.batch import IGNORE_INDEX, INDEX, INPUT_IDS, LABELS, TRUNCATED_TOKENS, Pack
from lit_packing.data.sources import CHAT, LINE, PROBLEM, PROMPT_COMPLETION, example_problem, example_shape
from lit_packing.errors import ConfigError, DataError
from lit_packing.text import count

log = logging.getLogger(__name__)

# Bump when the tokens or labels this module produces change: every cached tokenization is then rebuilt.
TOKENIZE_VERSION = "2"

Overlong = Literal["truncate", "drop", "error"]
TrainOn = Literal["completion", "all"]
OnBadRow = Literal["error", "skip"]

# Columns of the tokenized table besides the keys an example carries into a batch (`lit_packing.batch`: input_ids,
# labels, index, truncated_tokens).
LENGTH = "length"
ROW = "row"  # the example's row as the user counts it: its line in a JSON Lines file, else its source row
TOKEN_HASH = "token_hash"  # 64-bit XXH3 of the token ids: equal for duplicate examples
LABEL_TOKENS = "label_tokens"  # trained tokens of the example (labels != -100, its first label masked)
_DROPPED = "dropped"  # "", "bad", "overlong" or "no_labels"
OUTPUT_COLUMNS = [INPUT_IDS, LABELS, LENGTH, TRUNCATED_TOKENS, INDEX, LABEL_TOKENS, ROW, TOKEN_HASH]
SAMPLES = 5  # offending rows named per kind, in messages and reports
STALE_TMP_SECONDS = 600  # a `tmp*` file untouched this long in a cache folder is a killed run's leftover

_FEATURES = Features(
    {
        INPUT_IDS: List(Value("int32")),
        LABELS: List(Value("int32")),
        LENGTH: Value("int32"),
        TRUNCATED_TOKENS: Value("int32"),
        INDEX: Value("int64"),
        ROW: Value("int64"),
        TOKEN_HASH: Value("int64"),
        LABEL_TOKENS: Value("int32"),
        _DROPPED: Value("string"),
        PROBLEM: Value("string"),
    }
)

# For tokenizers without a chat template (GPT-2): ChatML, the format SmolLM2 and Qwen use. Its markers are plain
# text to such a tokenizer (no special tokens are added, so the vocabulary and the model's embeddings stay as they
# are), hence a whole assistant span, `content<|im_end|>\n`, is trained.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class TokenizationReport:
    """What tokenization kept, cut and dropped; nothing is dropped without being counted here.

    `tokens_in == real_tokens + truncated_tokens + dropped_overlong_tokens + dropped_no_label_tokens` and
    `examples_in == examples_out + bad_examples + dropped_overlong_examples + dropped_no_label_examples`
    (bad rows are never tokenized). `duplicate_examples` counts kept examples whose tokens equal an earlier one's.
    `samples` names the first few rows of each kind: `{"bad": [(row, problem), ...], "overlong": ...}`.
    """

    examples_in: int = 0
    examples_out: int = 0
    tokens_in: int = 0
    real_tokens: int = 0
    label_tokens: int = 0
    truncated_examples: int = 0
    truncated_tokens: int = 0
    dropped_overlong_examples: int = 0
    dropped_overlong_tokens: int = 0
    dropped_no_label_examples: int = 0
    dropped_no_label_tokens: int = 0
    bad_examples: int = 0
    duplicate_examples: int = 0
    samples: dict[str, list[tuple[int, str]]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        """Plain ints for loggers (`logger.log_hyperparams({"data": report.as_dict()})`)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "samples"}

    def update(self, other: TokenizationReport) -> None:
        """Add `other`'s counts to these, in place (a stream's report grows as its chunks are tokenized)."""
        total = self + other
        for name, value in vars(total).items():
            setattr(self, name, value)

    def __add__(self, other: TokenizationReport) -> TokenizationReport:
        kinds = {**self.samples, **other.samples}
        samples = {k: (self.samples.get(k, []) + other.samples.get(k, []))[:SAMPLES] for k in kinds}
        return TokenizationReport(**{k: v + getattr(other, k) for k, v in self.as_dict().items()}, samples=samples)

    def __str__(self) -> str:
        return (
            f"tokenized {count(self.examples_in, 'example')} -> kept {self.examples_out:,} "
            f"({count(self.real_tokens, 'token')}, {self.label_tokens:,} trained); "
            f"skipped {count(self.bad_examples, 'bad row')}; "
            f"truncated {self.truncated_examples:,} ({count(self.truncated_tokens, 'token')} cut); "
            f"dropped {self.dropped_overlong_examples:,} overlong ({count(self.dropped_overlong_tokens, 'token')}) "
            f"and {self.dropped_no_label_examples:,} with no trained token "
            f"({count(self.dropped_no_label_tokens, 'token')}); {count(self.duplicate_examples, 'duplicate')} kept"
        )

    def named(self, kind: str, row_name: Callable[[int], str] = "row {:,}".format) -> str:
        """The first rows of one kind, e.g. `line 3 of a.jsonl (messages is null); line 9 of a.jsonl (...)`."""
        return "; ".join(
            f"{row_name(row)}" + (f" ({detail})" if detail else "") for row, detail in self.samples.get(kind, [])
        )


def chat_template(tokenizer) -> str:
    """The tokenizer's chat template, or `DEFAULT_CHAT_TEMPLATE` (ChatML) when it has none."""
    return tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE


def bos_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer itself puts before a text (`[bos]` for Llama-2-style tokenizers, `[]` for SmolLM2)."""
    with_special = tokenizer("a")[INPUT_IDS]
    plain = tokenizer("a", add_special_tokens=False)[INPUT_IDS]
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start : start + len(plain)] == plain:
            return with_special[:start]
    return []


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of everything about a tokenizer that changes its output: vocab, merges, normalizer, special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    parts = (type(tokenizer).__name__, tokenizer.name_or_path, len(tokenizer), tokenizer.special_tokens_map, vocab)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def tokenization_fingerprint(
    dataset_fingerprint: str, tokenizer, template: str, max_length: int, overlong: str, train_on: str
) -> str:
    """The cache key of one tokenization: changes with the data, tokenizer, template, settings or this code."""
    parts = (
        TOKENIZE_VERSION,
        dataset_fingerprint,
        tokenizer_fingerprint(tokenizer),
        template,
        max_length,
        overlong,
        train_on,
        bos_prefix(tokenizer),
        tokenizer.eos_token_id,
    )
    return "tokenized-" + hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


# ---------------------------------------------------------------- one batch of examples -> ids and labels


class _Encoder:
    """Turns one batch of examples of one shape into (ids, labels) lists; holds what every batch reuses."""

    def __init__(self, tokenizer, shape: str, template: str, train_on: str) -> None:
        self.tokenizer = tokenizer
        self.shape = shape
        self.template = template
        self.train_on = train_on
        self.bos = bos_prefix(tokenizer)
        self.eos = tokenizer.eos_token_id
        special = set(tokenizer.all_special_ids)
        special |= {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
        self.special_ids = np.array(sorted(special), dtype=np.int64)
        if shape != CHAT and self.eos is None:
            raise ConfigError(
                "data.tokenizer",
                f"{tokenizer.name_or_path!r} has no eos_token to end {shape} examples with",
                "use a tokenizer that has one (the model's own)",
            )

    def __call__(self, batch: dict[str, list], indices: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        if self.shape == CHAT:
            return self._chats(batch["messages"], indices)
        if self.shape == PROMPT_COMPLETION:
            return self._prompt_completions(batch["prompt"], batch["completion"])
        return self._texts(batch["text"])

    def _encode(self, texts: list[str], **kwargs) -> Any:
        return self.tokenizer(texts, add_special_tokens=False, **kwargs)

    def _texts(self, texts: list[str]) -> tuple[list, list]:
        ids = [self.bos + x + [self.eos] for x in self._encode(texts)[INPUT_IDS]]
        return ids, [list(x) for x in ids]

    def _prompt_completions(self, prompts: list[str], completions: list[str]) -> tuple[list, list]:
        ids, labels = [], []
        for p, c in zip(self._encode(prompts)[INPUT_IDS], self._encode(completions)[INPUT_IDS]):
            prompt, completion = self.bos + p, c + [self.eos]
            ids.append(prompt + completion)
            masked = [IGNORE_INDEX] * len(prompt) if self.train_on == "completion" else prompt
            labels.append(masked + completion)
        return ids, labels

    def _render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _chats(self, conversations: list[list[dict]], indices: list[int]) -> tuple[list, list]:
        if self.train_on == "all":
            ids = self._encode([self._render(m) for m in conversations])[INPUT_IDS]
            return ids, [list(x) for x in ids]
        rendered = [self._assistant_spans(m, i) for m, i in zip(conversations, indices)]
        encoded = self._encode([text for text, _ in rendered], return_offsets_mapping=True)
        labels = [
            self._label_spans(np.asarray(x), np.asarray(offsets, dtype=np.int64).reshape(-1, 2), spans)
            for x, offsets, (_, spans) in zip(encoded[INPUT_IDS], encoded["offset_mapping"], rendered)
        ]
        return encoded[INPUT_IDS], labels

    def _assistant_spans(self, messages: list[dict], index: int) -> tuple[str, list[tuple[int, int, int]]]:
        """The full render and, per assistant turn, (start, content_end, end) character positions in it."""
        full = self._render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, upto = self._render(messages[:i], add_generation_prompt=True), self._render(messages[: i + 1])
            if not (upto.startswith(before) and full.startswith(upto)):
                raise ConfigError(
                    "data.tokenizer",
                    f"example {index}: the chat template is not prefix-consistent (rendering the first {i + 1} "
                    f"messages is not the start of rendering them all; the template rewrites earlier turns), so "
                    f"assistant turns cannot be located",
                    "set data.train_on=all, or use a tokenizer whose chat_template renders each turn the same "
                    "whatever follows",
                )
            start, end = len(before), len(upto)
            content = (message["content"] or "").strip()
            found = full.find(content, start, end) if content else -1
            spans.append((start, found + len(content) if found >= 0 else start, end))
        return full, spans

    def _label_spans(self, ids: np.ndarray, offsets: np.ndarray, spans: list[tuple[int, int, int]]) -> list[int]:
        """Label the tokens of each span up to and including the first special token after the content (its
        end-of-turn token, e.g. `<|im_end|>`); spans without one are labelled whole."""
        labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
        starts, ends = offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1)  # zero-width special tokens
        for start, content_end, end in spans:
            inside = np.flatnonzero((starts < end) & (ends > start))
            enders = inside[np.isin(ids[inside], self.special_ids) & (starts[inside] >= content_end)]
            if enders.size:
                inside = inside[inside <= enders[0]]
            labels[inside] = ids[inside]
        return labels.tolist()


# ---------------------------------------------------------------- lengths and policies


def _fit(ids: list[int], labels: list[int], max_length: int, overlong: str) -> dict[str, Any]:
    """Apply `max_length` / `overlong` and the no-label rule to one example: the columns the map writes for it."""
    n, cut = len(ids), max(0, len(ids) - max_length)
    row = {TRUNCATED_TOKENS: 0, LABEL_TOKENS: 0, _DROPPED: "", PROBLEM: "", INPUT_IDS: [], LABELS: []}
    if cut and overlong in ("drop", "error"):  # `error` raises after the map, naming every such row
        return {**row, LENGTH: n, _DROPPED: "overlong", PROBLEM: f"{n:,} tokens"}
    ids, labels = ids[:max_length], labels[:max_length]
    if labels:
        labels[0] = IGNORE_INDEX
    trained = sum(label != IGNORE_INDEX for label in labels)
    if not trained:
        return {**row, LENGTH: len(ids), TRUNCATED_TOKENS: cut, _DROPPED: "no_labels"}
    return {**row, INPUT_IDS: ids, LABELS: labels, LENGTH: len(ids), TRUNCATED_TOKENS: cut, LABEL_TOKENS: trained}


def token_hash(ids: list[int]) -> int:
    """A signed 64-bit XXH3 of token ids (the `token_hash` column): equal ids, equal hash."""
    digest = xxhash.xxh3_64_intdigest(np.asarray(ids, dtype=np.int32).tobytes())
    return digest - (1 << 64) if digest >= 1 << 63 else digest


def _tokenize_batch(
    batch: dict[str, list],
    indices: list[int],
    encoder: _Encoder,
    max_length: int,
    overlong: str,
    rows: np.ndarray | None,
) -> dict[str, list]:
    n = len(indices)
    examples = [{name: batch[name][k] for name in batch} for k in range(n)]
    problems = [ex.get(PROBLEM) or example_problem(encoder.shape, ex) for ex in examples]
    good = [k for k in range(n) if not problems[k]]
    chosen = {name: [batch[name][k] for k in good] for name in batch}
    ids, labels = encoder(chosen, [indices[k] for k in good]) if good else ([], [])
    fitted = dict(zip(good, (_fit(list(x), list(y), max_length, overlong) for x, y in zip(ids, labels))))
    bad = {TRUNCATED_TOKENS: 0, LABEL_TOKENS: 0, _DROPPED: "bad", INPUT_IDS: [], LABELS: [], LENGTH: 0}
    out = []
    for k, index in enumerate(indices):
        row = fitted.get(k) or {**bad, PROBLEM: problems[k]}
        source_row = batch[LINE][k] if LINE in batch else int(rows[index]) if rows is not None else index
        out.append({**row, INDEX: index, ROW: source_row, TOKEN_HASH: token_hash(row[INPUT_IDS])})
    return {name: [row[name] for row in out] for name in _FEATURES}


def column(dataset: datasets.Dataset, name: str) -> np.ndarray:
    """One column as a numpy array, reading only that column (e.g. `length`, never the tokens)."""
    return np.asarray(dataset.with_format("arrow")[name])  # a pyarrow column (indices applied): ~1 ms


def _samples(where: np.ndarray, rows: np.ndarray, details: np.ndarray | None = None) -> list[tuple[int, str]]:
    first = np.flatnonzero(where)[:SAMPLES]
    return [(int(rows[i]), str(details[i]) if details is not None else "") for i in first]


def _report(mapped: datasets.Dataset) -> TokenizationReport:
    return report_of(lambda name: column(mapped, name))


def report_of(read: Callable[[str], np.ndarray]) -> TokenizationReport:
    """The report of tokenized rows, each column given by `read(name)` (a mapped dataset's column, or a streamed
    chunk's); duplicates are counted among these rows."""
    length, cut = read(LENGTH).astype(np.int64), read(TRUNCATED_TOKENS).astype(np.int64)
    trained, dropped = read(LABEL_TOKENS).astype(np.int64), read(_DROPPED)
    rows, problems, hashes = read(ROW), read(PROBLEM), read(TOKEN_HASH)
    kept, overlong, unlabelled, bad = dropped == "", dropped == "overlong", dropped == "no_labels", dropped == "bad"
    duplicate = np.zeros(len(length), dtype=bool)
    _, first = np.unique(hashes[kept], return_index=True)
    duplicate[np.flatnonzero(kept)] = True
    duplicate[np.flatnonzero(kept)[first]] = False
    return TokenizationReport(
        examples_in=len(length),
        examples_out=int(kept.sum()),
        tokens_in=int((length + cut).sum()),
        real_tokens=int(length[kept].sum()),
        label_tokens=int(trained[kept].sum()),
        truncated_examples=int((kept & (cut > 0)).sum()),
        truncated_tokens=int(cut[kept].sum()),
        dropped_overlong_examples=int(overlong.sum()),
        dropped_overlong_tokens=int(length[overlong].sum()),
        dropped_no_label_examples=int(unlabelled.sum()),
        dropped_no_label_tokens=int((length + cut)[unlabelled].sum()),
        bad_examples=int(bad.sum()),
        duplicate_examples=int(duplicate.sum()),
        samples={
            kind: found
            for kind, found in (
                ("bad", _samples(bad, rows, problems)),
                ("overlong", _samples(overlong, rows, problems)),
                ("no_labels", _samples(unlabelled, rows)),
                ("duplicate", _samples(duplicate, rows)),
            )
            if found
        },
    )


def check_report(
    report: TokenizationReport,
    on_bad_row: str,
    overlong: str,
    max_length: int,
    row_name: Callable[[int], str] = "row {:,}".format,
) -> None:
    """Raise the `DataError` the policies ask for: bad rows under `error`, overlong rows under `error`, or nothing
    left to train on; each names the first rows and the setting to change."""
    bad, long = report.samples.get("bad", []), report.samples.get("overlong", [])
    if bad and on_bad_row == "error":
        raise DataError(
            f"{report.bad_examples:,} bad rows, first {report.named('bad', row_name)}: fix them, or set "
            f"data.on_bad_row=skip to leave them out (they are counted)",
            rows=[row for row, _ in bad],
        )
    if long and overlong == "error":
        raise DataError(
            f"{report.dropped_overlong_examples:,} examples over max_length={max_length:,}, first "
            f"{report.named('overlong', row_name)}: raise data.max_length or set data.overlong=truncate (or drop)",
            rows=[row for row, _ in long],
        )
    if not report.examples_out:
        raise DataError(
            f"nothing to train on: no example of {report.examples_in:,} is left ({report}): check the source's "
            f"fields (data.source), data.max_length with data.overlong, data.train_on and data.on_bad_row"
        )


# ---------------------------------------------------------------- the cache on disk


def file_record(path: Path) -> list:
    """[size, XXH3-128 hex] of a file, streamed in 8 MiB blocks. XXH3 (xxhash, a `datasets` dependency) catches
    any accidental damage and reads GB/s, so checking a 160 MiB cache costs tens of milliseconds."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as file:
        while block := file.read(8 << 20):
            digest.update(block)
    return [path.stat().st_size, digest.hexdigest()]


def cache_files(folder: Path, fingerprint: str) -> list[Path]:
    """The Arrow files of one tokenization (its `fingerprint`) in a `datasets` cache folder."""
    return sorted(folder.glob(f"cache-{fingerprint}*.arrow"))


def _record_path(folder: Path, fingerprint: str) -> Path:
    return folder / f"cache-{fingerprint}.check.json"


def _remove_stale_tmp(folder: Path) -> None:
    """Delete `tmp*` files that killed runs left in a cache folder (untouched for `STALE_TMP_SECONDS`)."""
    now, removed = time.time(), []
    for path in folder.glob("tmp*"):
        if path.is_file() and now - path.stat().st_mtime > STALE_TMP_SECONDS:
            path.unlink(missing_ok=True)
            removed.append(path.name)
    if removed:
        log.warning("removed %d temporary file(s) left by killed runs in %s: %s", len(removed), folder, removed)


def _verify_cache(folder: Path, fingerprint: str) -> None:
    """Delete this tokenization's cache files when they differ from their record, or have none (an older version
    wrote them, or a run died before recording them), so the map rebuilds them; say so."""
    files, record_path = cache_files(folder, fingerprint), _record_path(folder, fingerprint)
    if not files:
        return
    try:
        expected = json.loads(record_path.read_text())
    except (OSError, ValueError):
        expected = None
    if expected is not None and {path.name: file_record(path) for path in files} == expected:
        return
    problem = "has no size + checksum record" if expected is None else "does not match its size + checksum record"
    log.warning("the tokenized cache %s %s (%s): rebuilding it", [str(p) for p in files], problem, record_path)
    for path in [*files, record_path]:
        path.unlink(missing_ok=True)


def _write_record(folder: Path, fingerprint: str) -> None:
    """Record size + checksum of this tokenization's cache files, atomically (a temporary file, then a rename)."""
    record_path, files = _record_path(folder, fingerprint), cache_files(folder, fingerprint)
    if record_path.exists() or not files:
        return
    record = {path.name: file_record(path) for path in files}
    with tempfile.NamedTemporaryFile("w", dir=folder, prefix="tmp", suffix=".json", delete=False) as tmp:
        json.dump(record, tmp)
    os.replace(tmp.name, record_path)


def check_tokenize_settings(max_length: int, overlong: str, train_on: str, on_bad_row: str) -> None:
    """Raise a `ConfigError` naming the `data.*` setting that tokenization cannot work with (the one check of
    each; `PackingDataModule` runs it at construction, before any data is read)."""
    if overlong not in ("truncate", "drop", "error"):
        raise ConfigError("data.overlong", f"{overlong!r} is not a policy", "use truncate, drop or error")
    if train_on not in ("completion", "all"):
        raise ConfigError("data.train_on", f"{train_on!r} is not a choice", "use completion or all")
    if on_bad_row not in ("error", "skip"):
        raise ConfigError("data.on_bad_row", f"{on_bad_row!r} is not a policy", "use error or skip")
    if max_length < 2:
        raise ConfigError("data.max_length", f"must be >= 2 to hold a trained token, got {max_length}")


def tokenize_dataset(
    dataset: datasets.Dataset,
    tokenizer,
    max_length: int = 2048,
    overlong: Overlong = "truncate",
    train_on: TrainOn = "completion",
    num_proc: int | None = None,
    on_bad_row: OnBadRow = "error",
    rows: np.ndarray | None = None,
    row_name: Callable[[int], str] = "row {:,}".format,
    announce: str | None = None,
) -> tuple[datasets.Dataset, TokenizationReport]:
    """Tokenize every example with `datasets.map` (batched, cached and checksummed next to the dataset's files).

    Args:
        dataset: examples of one shape (see `lit_packing.data.sources.example_shape`).
        tokenizer: a fast Hugging Face tokenizer (offsets locate assistant turns).
        max_length: most tokens per example.
        overlong: `truncate` keeps the first `max_length` tokens; `drop` removes the example; `error` raises.
        train_on: `completion` trains assistant turns / completions only; `all` trains every token.
        num_proc: processes for `map` (None: one; the tokenizer already batches in Rust).
        on_bad_row: `error` raises a `DataError` naming the first bad rows; `skip` leaves them out, counted.
        rows: (len(dataset),) the source row of each dataset row (when `dataset` is a subset); None: the same.
        row_name: how messages name a row, e.g. `source.row_name` (`line 17 of chats.jsonl`).
        announce: what the data is (`ChampChats() with smollm2`): log one line saying whether it is tokenized now
            or read from the cache.

    Returns:
        The kept examples (columns `input_ids`, `labels`, `length`, `truncated_tokens`, `index` = row in `dataset`,
        `row` = the row as the user counts it, `token_hash`) and the report of what was skipped, cut and dropped.

    Raises:
        DataError: bad rows under `on_bad_row=error`, overlong ones under `overlong=error`, or no example left.
    """
    check_tokenize_settings(max_length, overlong, train_on, on_bad_row)
    if not len(dataset):
        raise DataError("the source holds no examples: check data.source (its path, split and field_map)")
    shape = example_shape(dataset.column_names)
    template = chat_template(tokenizer) if shape == CHAT else ""
    if shape == CHAT and not tokenizer.chat_template:
        log.warning(
            "tokenizer %r has no chat template: chats are rendered with ChatML "
            "(lit_packing.data.tokenize.DEFAULT_CHAT_TEMPLATE; its markers are plain text to this tokenizer)",
            tokenizer.name_or_path,
        )
    fingerprint = tokenization_fingerprint(
        dataset_fingerprint(dataset), tokenizer, template, max_length, overlong, train_on
    )
    folder = Path(dataset.cache_files[0]["filename"]).parent if dataset.cache_files else None
    if folder is not None:
        _remove_stale_tmp(folder)
        _verify_cache(folder, fingerprint)
    if announce and folder is not None and _record_path(folder, fingerprint).exists():
        log.info("%s: reading the tokenized examples from the cache in %s", announce, folder)
    elif announce:
        log.info(
            "%s: tokenizing %s (once: later runs with the same settings read the cache)",
            announce, count(len(dataset), "example"),
        )  # fmt: skip
    mapped = _map(dataset, tokenizer, shape, template, max_length, overlong, train_on, num_proc, rows, fingerprint)
    if folder is not None:
        _write_record(folder, fingerprint)
    report = _report(mapped)
    check_report(report, on_bad_row, overlong, max_length, row_name)
    kept = np.flatnonzero(column(mapped, _DROPPED) == "")
    return mapped.select(kept).select_columns(OUTPUT_COLUMNS), report


def _map(dataset, tokenizer, shape, template, max_length, overlong, train_on, num_proc, rows, fingerprint):
    return dataset.map(
        _tokenize_batch,
        batched=True,
        with_indices=True,
        remove_columns=dataset.column_names,
        features=_FEATURES,
        fn_kwargs={
            "encoder": _Encoder(tokenizer, shape, template, train_on),
            "max_length": max_length,
            "overlong": overlong,
            "rows": rows,
        },
        num_proc=num_proc,
        new_fingerprint=fingerprint,
        desc=f"Tokenizing {shape} (max_length={max_length:,}, overlong={overlong}, train_on={train_on})",
    )


# ---------------------------------------------------------------- what the DataLoader reads


class TokenizedDataset(torch.utils.data.Dataset):
    """Examples by row, or token slices of them, for the collator; `lengths` without reading any token.

    `ds[3]` -> `{"input_ids": array, "labels": array, "index": source row, "truncated_tokens": int}`;
    `ds[(3, 100, 200)]` -> tokens 100..199 of example 3 (what `FixedLengthPackingSampler` asks for;
    `truncated_tokens` only on the slice at 0, so an example's cut tokens are counted once). Arrays are read-only
    int32 views of the memory-mapped Arrow file (about 40 us a row; `datasets`' numpy formatting takes about 200 us).
    A `Pack` of keys is read as a `Pack` of items carrying the same optimizer-step totals.

    Args:
        dataset: the output of `tokenize_dataset` (or a `select` of it).
    """

    def __init__(self, dataset: datasets.Dataset) -> None:
        self.dataset = dataset.with_format("arrow", columns=[INPUT_IDS, LABELS, TRUNCATED_TOKENS, INDEX])
        self._lengths: np.ndarray | None = None
        self._label_tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def lengths(self) -> np.ndarray:
        """(n,) int64 tokens per example, read from the `length` column only."""
        if self._lengths is None:
            self._lengths = column(self.dataset, LENGTH).astype(np.int64)
        return self._lengths

    @property
    def label_tokens(self) -> np.ndarray:
        """(n,) int64 trained tokens per example, read from the `label_tokens` column only."""
        if self._label_tokens is None:
            self._label_tokens = column(self.dataset, LABEL_TOKENS).astype(np.int64)
        return self._label_tokens

    def count_labels(self, keys: list) -> list[int]:
        """Trained tokens of each key as the collator will see it: a row's count, or a slice's (whose first label
        the collator masks), read from the labels of the sliced rows only."""
        counts = []
        for key in keys:
            if isinstance(key, tuple):
                labels = self[key][LABELS]
                counts.append(int((labels[1:] != IGNORE_INDEX).sum()))
            else:
                counts.append(int(self.label_tokens[key]))
        return counts

    def __getitem__(self, key: int | tuple[int, int, int]) -> dict[str, Any]:
        index, start, stop = key if isinstance(key, tuple) else (key, 0, None)
        row = self.dataset[int(index)]  # a one-row pyarrow.Table
        item = {
            INPUT_IDS: _tokens(row, INPUT_IDS)[start:stop],
            LABELS: _tokens(row, LABELS)[start:stop],
            INDEX: row.column(INDEX)[0].as_py(),
        }
        if start == 0:
            item[TRUNCATED_TOKENS] = row.column(TRUNCATED_TOKENS)[0].as_py()
        return item

    def __getitems__(self, keys: list) -> list[dict[str, Any]]:
        # The DataLoader hands a batch sampler's whole item to this method: keep a Pack's step totals.
        return Pack([self[key] for key in keys], step=getattr(keys, "step", None))


def _tokens(row, name: str) -> np.ndarray:
    # flatten(), not .values: a row sliced from a chunk shares the chunk's whole child array.
    return row.column(name).combine_chunks().flatten().to_numpy()
