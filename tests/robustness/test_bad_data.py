"""Bad data: one bad row among good ones is named by its line (or refused as a whole file), or skipped and counted.

Every case reads a real JSON Lines file through `HFDataset` and tokenizes it with the real SmolLM2 tokenizer.
"""

from __future__ import annotations

import json
import logging
import re

import pytest

from lit_packing.data import HFDataset, PackingDataModule
from lit_packing.data.tokenize import tokenize_dataset
from lit_packing.errors import DataError

HI = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]


def chats(n: int) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"What is {i}+{i}?"}, {"role": "assistant", "content": f"{2 * i}"}]}
        for i in range(n)
    ]


def write(path, lines: list[bytes | str | dict]) -> str:
    def raw(line):
        return line if isinstance(line, bytes) else (line if isinstance(line, str) else json.dumps(line)).encode()

    path.write_bytes(b"\n".join(raw(line) for line in lines) + b"\n")
    return str(path)


def load_and_tokenize(path: str, tokenizer, cache, **kwargs):
    source = HFDataset(path, split="train")
    return tokenize_dataset(source.load(cache), tokenizer, row_name=source.row_name, **kwargs)


CHAT_ROWS = {
    "messages null": ({"messages": None}, "messages is null (or missing)"),
    "messages a number": ({"messages": 5}, "messages is a number (5)"),
    "messages a string": ({"messages": "hello"}, 'messages is a string ("hello")'),
    "messages nested": ({"messages": [HI]}, "messages[0] is a list"),
    "messages missing": ({"id": 3}, "messages is null (or missing)"),
    "unknown role": ({"messages": [{"role": "bot", "content": "x"}, *HI]}, "messages[0] has role 'bot'"),
    "no assistant turn": ({"messages": HI[:1]}, "no assistant turn"),
    "system only": ({"messages": [{"role": "system", "content": "Be nice"}]}, "no assistant turn"),
    "empty answer": ({"messages": [HI[0], {"role": "assistant", "content": " "}]}, "(assistant) content is empty"),
    "control character": (
        {"messages": [HI[0], {"role": "assistant", "content": "ok\x1b[0m"}]},
        "(assistant) content holds control character U+001B at 2",
    ),
    "malformed JSON": ('{"messages": [oops', "not valid JSON (Expecting value at column 15)"),
    "not UTF-8": (b'{"messages": "caf\xe9"}', "not valid UTF-8 (byte 0xe9 at column 18)"),
    "not an object": ("[1, 2]", "not a JSON object"),
}


@pytest.mark.parametrize("case", sorted(CHAT_ROWS))
def test_one_bad_chat_row_is_named_by_line_or_skipped_and_counted(case, tmp_path, smollm2_tokenizer):
    bad, problem = CHAT_ROWS[case]
    path = write(tmp_path / "chats.jsonl", [*chats(20), bad, *chats(20)])  # the bad row is line 21
    with pytest.raises(DataError) as error:
        load_and_tokenize(path, smollm2_tokenizer, str(tmp_path / "cache"))
    assert str(error.value).startswith(f"1 bad rows, first line 21 of {path} (")
    assert problem in str(error.value) and "data.on_bad_row=skip" in str(error.value)
    assert error.value.rows == [21]
    kept, report = load_and_tokenize(path, smollm2_tokenizer, str(tmp_path / "cache"), on_bad_row="skip")
    assert (report.examples_in, report.bad_examples, report.examples_out, len(kept)) == (41, 1, 40, 40)
    assert report.samples["bad"][0][0] == 21 and problem in report.samples["bad"][0][1]
    assert 21 not in kept["row"] and kept["row"][:2] == [1, 2] and kept["row"][20] == 22


@pytest.mark.parametrize(
    "bad, problem",
    [
        ({"prompt": "2+2?"}, "completion is null (or missing), not a string"),
        ({"prompt": "2+2?", "completion": None}, "completion is null (or missing), not a string"),
        ({"prompt": "2+2?", "completion": ""}, "completion is empty"),
        ({"prompt": None, "completion": "4"}, "prompt is null (or missing), not a string"),
        ({"question": "2+2?", "completion": "4"}, "prompt is null (or missing)"),  # a misnamed field
    ],
)
def test_prompt_completion_rows_missing_or_null(bad, problem, tmp_path, smollm2_tokenizer):
    good = [{"prompt": f"{i}+{i}?", "completion": f"{2 * i}"} for i in range(40)]
    path = write(tmp_path / "qa.jsonl", [*good[:3], bad, *good[3:]])
    with pytest.raises(DataError) as error:
        load_and_tokenize(path, smollm2_tokenizer, str(tmp_path / "cache"))
    assert f"first line 4 of {path} ({problem}" in str(error.value) and error.value.rows == [4]


def test_empty_and_blank_files_are_refused_naming_the_file(tmp_path):
    for content in (b"", b"\n  \n"):
        path = tmp_path / "empty.jsonl"
        path.write_bytes(content)
        with pytest.raises(DataError, match=rf"{path} holds no examples \(empty file\).*data.source.init_args.path"):
            HFDataset(str(path)).load(str(tmp_path / "cache"))


def test_a_file_of_no_objects_names_the_shape_it_needs(tmp_path):
    path = write(tmp_path / "numbers.jsonl", ["1", "2"])
    with pytest.raises(DataError, match=r"none of its first 2 lines holds a JSON object \(line 1\)"):
        HFDataset(path).load(str(tmp_path / "cache"))
    fields = write(tmp_path / "fields.jsonl", [{"q": "a", "a": "b"}])
    with pytest.raises(DataError, match=r"columns \['a', 'q'\].*data.source.init_args.field_map"):
        HFDataset(fields).load(str(tmp_path / "cache"))


def test_duplicates_are_counted_and_validation_overlap_warned(tmp_path, smollm2_tokenizer, caplog):
    path = write(tmp_path / "repeated.jsonl", chats(10) * 50)
    _, report = load_and_tokenize(path, smollm2_tokenizer, str(tmp_path / "cache"))
    assert (report.examples_out, report.duplicate_examples) == (500, 490)
    assert [row for row, _ in report.samples["duplicate"]] == [11, 12, 13, 14, 15]  # the second copies
    dm = PackingDataModule(source=HFDataset(path, split="train"), val_split=50, cache_dir=str(tmp_path / "cache"))
    with caplog.at_level("WARNING", logger="lit_packing"):
        dm.setup("fit")
    # A log line of the toolkit's (no Python warning with the toolkit's own source line attached).
    assert re.search(r"50 of 50 validation examples also appear in training .*line \d+ of", caplog.text)
    assert dm.overlap_examples == 50


def test_overlong_policies_count_or_name_rows_in_the_file(tmp_path, smollm2_tokenizer):
    long = {"messages": [HI[0], {"role": "assistant", "content": " ".join(["word"] * 300)}]}
    path = write(tmp_path / "long.jsonl", [*chats(5), long, *chats(5), long])  # lines 6 and 12
    cache = str(tmp_path / "cache")
    _, cut = load_and_tokenize(path, smollm2_tokenizer, cache, max_length=64)
    assert (cut.examples_out, cut.truncated_examples) == (12, 2) and cut.truncated_tokens > 2 * 250
    _, dropped = load_and_tokenize(path, smollm2_tokenizer, cache, max_length=64, overlong="drop")
    assert (dropped.examples_out, dropped.dropped_overlong_examples) == (10, 2)
    assert [row for row, _ in dropped.samples["overlong"]] == [6, 12]
    with pytest.raises(DataError) as error:
        load_and_tokenize(path, smollm2_tokenizer, cache, max_length=64, overlong="error")
    assert f"2 examples over max_length=64, first line 6 of {path} (" in str(error.value)
    assert f"; line 12 of {path} (" in str(error.value) and error.value.rows == [6, 12]


def test_overlong_error_names_the_source_row_not_the_sampled_one(tmp_path):
    long = {"messages": [HI[0], {"role": "assistant", "content": " ".join(["word"] * 300)}]}
    path = write(tmp_path / "long.jsonl", [*chats(30), long, *chats(30)])  # line 31
    dm = PackingDataModule(
        source=HFDataset(path, split="train"), limit=40, max_length=64, overlong="error",
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    rows = dm.feed.limited(dm.source.load(dm.cache_dir)).rows
    assert 30 in rows.tolist() and rows.tolist().index(30) != 30  # the long row sits elsewhere in the sample
    with pytest.raises(DataError, match=rf"first line 31 of {path} \("):
        dm.setup("fit")


def test_everything_filtered_away_stops_before_training(tmp_path, smollm2_tokenizer):
    long = {"messages": [HI[0], {"role": "assistant", "content": " ".join(["word"] * 300)}]}
    path = write(tmp_path / "long.jsonl", [long] * 3)
    with pytest.raises(DataError, match=r"nothing to train on: no example of 3 is left .*dropped 3 overlong"):
        load_and_tokenize(path, smollm2_tokenizer, str(tmp_path / "cache"), max_length=64, overlong="drop")


def test_chat_without_template_says_which_template(tmp_path, gpt2_tokenizer, caplog):
    path = write(tmp_path / "chats.jsonl", chats(3))
    with caplog.at_level(logging.WARNING, logger="lit_packing.data.tokenize"):
        _, report = load_and_tokenize(path, gpt2_tokenizer, str(tmp_path / "cache"))
    assert report.examples_out == 3
    assert "has no chat template: chats are rendered with ChatML" in caplog.text
    assert "lit_packing.data.DEFAULT_CHAT_TEMPLATE" in caplog.text  # a name the user can import
