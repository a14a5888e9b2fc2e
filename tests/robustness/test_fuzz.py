"""Randomized: thousands of malformed JSON Lines example lists through the reader, tokenizer, samplers and collator.

Each list either raises the toolkit's `DataError` naming exactly the first bad (or overlong) lines, or yields packed
batches in which every surviving example's tokens equal an independent tokenization of its line. The generator
knows which lines it broke, so the expected outcome never comes from the code under test.
"""

from __future__ import annotations

import json
import os

import datasets
import numpy as np
import pyarrow as pa
import pytest

from lit_packing.batch import CU_SEQ_LENS_Q, INDEX, INPUT_IDS, LABELS
from lit_packing.data import PackedCollator
from lit_packing.data.encode import FEATURES, Encoder, chat_template, tokenize_batch
from lit_packing.data.report import SAMPLES, check_report
from lit_packing.data.shapes import CHAT, PROMPT_COMPLETION, TEXT
from lit_packing.data.shards import _normalized, parse_json_lines
from lit_packing.data.tokenize import TokenizedDataset, _report, column
from lit_packing.errors import DataError
from lit_packing.samplers import (
    BestFitPackingSampler,
    FixedLengthPackingSampler,
    RandomBatchSampler,
    SequentialPackingSampler,
)

LISTS = int(os.environ.get("FUZZ_LISTS", 2000))
WORDS = ["x", "Hello", "wörld", "中文", "🙂", "a\tb", "line\nbreak", "  ", "0.5", "{}", '"q"', "\\"]


def text(rng: np.random.Generator) -> str:
    return " ".join(rng.choice(WORDS, size=int(rng.integers(1, 12)))).strip() or "x"


def good_example(rng: np.random.Generator, shape: str) -> dict:
    if shape == TEXT:
        return {"text": text(rng)}
    if shape == PROMPT_COMPLETION:
        return {"prompt": text(rng), "completion": text(rng)}
    turns = [{"role": "system", "content": text(rng)}] if rng.random() < 0.3 else []
    for _ in range(int(rng.integers(1, 4))):
        turns += [{"role": "user", "content": text(rng)}, {"role": "assistant", "content": text(rng)}]
    return {"messages": turns}


BREAKS = {
    CHAT: [
        lambda ex: {"messages": None},
        lambda ex: {"messages": 7},
        lambda ex: {"messages": "hello"},
        lambda ex: {"messages": [ex["messages"]]},  # nested list
        lambda ex: {"messages": []},
        lambda ex: {},
        lambda ex: {"messages": [*ex["messages"][:-1], {"role": "bot", "content": "hi"}]},
        lambda ex: {"messages": [m for m in ex["messages"] if m["role"] != "assistant"]},
        lambda ex: {"messages": [{"role": "system", "content": "only"}]},
        lambda ex: {"messages": [*ex["messages"][:-1], {"role": "assistant", "content": " "}]},
        lambda ex: {"messages": [*ex["messages"][:-1], {"role": "assistant", "content": None}]},
        lambda ex: {"messages": [*ex["messages"][:-1], {"role": "assistant"}]},
        lambda ex: {"messages": [*ex["messages"][:-1], {"role": "assistant", "content": 3}]},
        lambda ex: {"messages": [*ex["messages"][:-1], {"role": "assistant", "content": "bell\x07"}]},
        lambda ex: {"messages": [*ex["messages"][:-1], "assistant: hi"]},
    ],
    PROMPT_COMPLETION: [
        lambda ex: {"prompt": ex["prompt"]},
        lambda ex: {**ex, "completion": None},
        lambda ex: {**ex, "completion": ""},
        lambda ex: {**ex, "completion": ["a"]},
        lambda ex: {**ex, "prompt": 12},
        lambda ex: {**ex, "completion": "esc\x1b[0m"},
    ],
    TEXT: [
        lambda ex: {"text": None},
        lambda ex: {"text": ""},
        lambda ex: {"text": {"a": 1}},
        lambda ex: {"body": ex["text"]},
        lambda ex: {"text": "nul\x00"},
    ],
}
LINE_BREAKS = [
    lambda line: line[: max(1, len(line) // 2)],  # malformed JSON
    lambda line: line.replace(b'"', b"\xff", 1) if b'"' in line else b"\xff",  # not UTF-8
    lambda line: b"[1, 2]",  # not an object
    lambda line: b"42",
]


def random_lines(rng: np.random.Generator, shape: str) -> tuple[list[bytes], dict[int, dict], set[int]]:
    """JSON Lines bytes, the good examples by line number, and the numbers of the lines broken on purpose."""
    lines, good, bad = [], {}, set()
    for _ in range(int(rng.integers(1, 9))):
        if rng.random() < 0.1:
            lines.append(b"   ")  # blank lines are skipped, not rows
            continue
        example, number = good_example(rng, shape), len(lines) + 1
        kind = rng.random()
        if kind < 0.2:
            breaks = BREAKS[shape]
            lines.append(json.dumps(breaks[int(rng.integers(len(breaks)))](example)).encode())
            bad.add(number)
        elif kind < 0.3:
            line = json.dumps(example).encode()
            lines.append(LINE_BREAKS[int(rng.integers(len(LINE_BREAKS)))](line))
            bad.add(number)
        else:
            lines.append(json.dumps(example).encode())
            good[number] = example
    return lines, good, bad


def expected_ids(tokenizer, shape: str, example: dict) -> list[int]:
    """An independent tokenization of a good example (what its packed tokens must equal, before any cut)."""

    def encode(value: str) -> list[int]:
        return tokenizer(value, add_special_tokens=False)["input_ids"]

    if shape == TEXT:
        return encode(example["text"]) + [tokenizer.eos_token_id]
    if shape == PROMPT_COMPLETION:
        return encode(example["prompt"]) + encode(example["completion"]) + [tokenizer.eos_token_id]
    return encode(tokenizer.apply_chat_template(example["messages"], tokenize=False))


def run(lines, shape, tokenizer, encoders, max_length, overlong, on_bad_row, rng):
    """The reader's rows -> the tokenizer's map function -> report and policies -> a sampler -> the collator."""
    rows = [_normalized(shape, n, record, problem) for n, record, problem in parse_json_lines(lines)]
    batch = {name: [row[name] for row in rows] for name in rows[0]}
    out = tokenize_batch(batch, list(range(len(rows))), encoders[shape], max_length, overlong, None)
    mapped = datasets.Dataset(pa.Table.from_pydict(out, schema=FEATURES.arrow_schema), fingerprint="fuzz")
    report = _report(mapped)
    check_report(report, on_bad_row, overlong, max_length)
    data = TokenizedDataset(mapped.select(np.flatnonzero(column(mapped, "dropped") == "")))
    budget = int(max(data.lengths.max(), 1) + rng.integers(0, 64))
    sampler = [
        BestFitPackingSampler(data.lengths, max_tokens=budget, seed=int(rng.integers(100))),
        SequentialPackingSampler(data.lengths, max_tokens=budget),
        RandomBatchSampler(data.lengths, batch_size=int(rng.integers(1, 5))),
        FixedLengthPackingSampler(data.lengths, max_tokens=int(rng.integers(1, 40))),
    ][int(rng.integers(4))]
    collate = PackedCollator(pad_token_id=tokenizer.pad_token_id, pad_to_multiple_of=int(rng.integers(1, 16)))
    pieces: dict[int, dict[int, np.ndarray]] = {}  # line -> start -> tokens seen in a batch
    for pack in sampler:
        items = data.__getitems__(pack)
        packed = collate(items)
        cu = packed[CU_SEQ_LENS_Q].tolist()
        ids, labels = packed[INPUT_IDS][0].numpy(), packed[LABELS][0].numpy()
        for k, (item, key) in enumerate(zip(items, pack)):
            segment = ids[cu[k] : cu[k + 1]]
            assert ((labels[cu[k] : cu[k + 1]] == -100) | (labels[cu[k] : cu[k + 1]] == segment)).all()
            line = out["row"][item[INDEX]]
            pieces.setdefault(line, {})[key[1] if isinstance(key, tuple) else 0] = segment
    return report, pieces


@pytest.fixture(scope="module")
def encoders(smollm2_tokenizer):
    template = chat_template(smollm2_tokenizer)
    return {shape: Encoder(smollm2_tokenizer, shape, template if shape == CHAT else "", "completion")
            for shape in (CHAT, PROMPT_COMPLETION, TEXT)}  # fmt: skip


@pytest.mark.slow  # about 25 s for 2,000 lists on 2 cores (FUZZ_LISTS=... to change)
def test_malformed_example_lists_raise_with_rows_or_pack_intact_tokens(smollm2_tokenizer, encoders):
    rng = np.random.default_rng(2024)
    outcomes = {"bad rows": 0, "overlong": 0, "nothing left": 0, "trained": 0}
    for _ in range(LISTS):
        shape = [CHAT, PROMPT_COMPLETION, TEXT][int(rng.integers(3))]
        lines, good, bad = random_lines(rng, shape)
        if not good and not bad:
            continue  # only blank lines: the empty-file case, tested on its own
        max_length = int(rng.integers(2, 160))
        overlong = ["truncate", "drop", "error"][int(rng.integers(3))]
        on_bad_row = ["error", "skip"][int(rng.integers(2))]
        full = {line: expected_ids(smollm2_tokenizer, shape, example) for line, example in good.items()}
        long = sorted(line for line, ids in full.items() if len(ids) > max_length)
        try:
            report, pieces = run(lines, shape, smollm2_tokenizer, encoders, max_length, overlong, on_bad_row, rng)
        except DataError as error:
            if bad and on_bad_row == "error":
                assert error.rows == sorted(bad)[:SAMPLES], str(error)
                assert "data.on_bad_row=skip" in str(error)
                outcomes["bad rows"] += 1
            elif long and overlong == "error":
                assert error.rows == long[:SAMPLES], str(error)
                assert "data.max_length" in str(error)
                outcomes["overlong"] += 1
            else:
                assert str(error).startswith("nothing to train on") and error.rows == []
                outcomes["nothing left"] += 1
            continue
        assert not (bad and on_bad_row == "error") and not (long and overlong == "error")
        assert report.bad_examples == len(bad)
        assert report.examples_out + report.dropped_no_label_examples + report.dropped_overlong_examples == len(good)
        assert report.dropped_overlong_examples == (len(long) if overlong == "drop" else 0)
        assert set(pieces) <= set(good) - (set(long) if overlong == "drop" else set())
        assert len(pieces) == report.examples_out
        for line, starts in pieces.items():
            tokens = np.concatenate([starts[start] for start in sorted(starts)])
            np.testing.assert_array_equal(tokens, full[line][:max_length])
        outcomes["trained"] += 1
    assert min(outcomes.values()) > LISTS // 40, outcomes  # every outcome is exercised many times
