"""The tokenization cache: checked against its size + XXH3-128 record on every load, rebuilt when damaged, and
temporary files of killed runs removed. Real `datasets` caches on disk, real SmolLM2 tokenizer."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import datasets
import pytest

from lit_packing.data.cache_check import STALE_TMP_SECONDS
from lit_packing.data.tokenize import tokenize_dataset

CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there, how are you?"}]


@pytest.fixture
def raw(tmp_path) -> datasets.Dataset:
    rows = [{"messages": [CHAT[0], {"role": "assistant", "content": f"Answer number {i}."}]} for i in range(200)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "raw"))
    return datasets.load_from_disk(str(tmp_path / "raw"))


def cache_file(tokenized: datasets.Dataset) -> Path:
    return Path(tokenized.cache_files[0]["filename"])


def record_of(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".arrow") + ".check.json")


def test_the_cache_has_a_size_and_checksum_record_written_atomically(raw, smollm2_tokenizer):
    tokenized, _ = tokenize_dataset(raw, smollm2_tokenizer)
    path = cache_file(tokenized)
    record = json.loads(record_of(path).read_text())
    assert record[path.name][0] == path.stat().st_size and len(record[path.name][1]) == 32  # XXH3-128 hex
    assert not list(path.parent.glob("tmp*"))  # the record went through a temporary file and a rename


@pytest.mark.parametrize("damage", ["overwrite", "zeros", "truncate"])
def test_a_damaged_cache_is_rebuilt_and_said(damage, raw, smollm2_tokenizer, caplog, encoder_calls):
    original, _ = tokenize_dataset(raw, smollm2_tokenizer)
    path, expected = cache_file(original), original.to_dict()["input_ids"]  # read before the damage
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    if damage == "truncate":
        data = data[:middle]
    else:  # same size: only the checksum can tell
        data[middle : middle + 64] = bytes(64) if damage == "zeros" else os.urandom(64)
    path.write_bytes(bytes(data))
    counter = encoder_calls
    counter.calls = 0  # count from here on
    with caplog.at_level(logging.WARNING, logger="lit_packing.data.tokenize"):
        again, report = tokenize_dataset(datasets.load_from_disk(str(Path(raw.cache_files[0]["filename"]).parent)),
                                         smollm2_tokenizer)  # fmt: skip
    assert f"the tokenized cache ['{path}'] does not match its size + checksum record" in caplog.text
    assert "rebuilding it" in caplog.text
    assert counter.calls > 0 and again.to_dict()["input_ids"] == expected and report.examples_out == 200


def test_a_cache_without_a_record_is_not_trusted(raw, smollm2_tokenizer, caplog):
    original, _ = tokenize_dataset(raw, smollm2_tokenizer)
    path, expected = cache_file(original), original.to_dict()["input_ids"]
    record_of(path).unlink()  # e.g. written by a version without records
    path.write_bytes(path.read_bytes()[:1000])  # Arrow reads this truncated stream without an error
    with caplog.at_level(logging.WARNING, logger="lit_packing.data.tokenize"):
        again, _ = tokenize_dataset(raw, smollm2_tokenizer)
    assert f"the tokenized cache ['{path}'] has no size + checksum record" in caplog.text
    assert again.to_dict()["input_ids"] == expected and record_of(path).exists()


def test_an_intact_cache_is_reused(raw, smollm2_tokenizer, encoder_calls):
    tokenize_dataset(raw, smollm2_tokenizer)
    counter = encoder_calls
    counter.calls = 0  # count from here on
    tokenize_dataset(raw, smollm2_tokenizer)
    assert counter.calls == 0


def test_temporary_files_of_killed_runs_are_removed(raw, smollm2_tokenizer, caplog):
    folder = Path(raw.cache_files[0]["filename"]).parent
    stale, fresh = folder / "tmpkilled123", folder / "tmpwriting456"
    stale.write_bytes(b"half a cache file")
    fresh.write_bytes(b"another run is writing this")
    old = time.time() - STALE_TMP_SECONDS - 60
    os.utime(stale, (old, old))  # last written before the threshold: its writer is gone
    with caplog.at_level(logging.WARNING, logger="lit_packing.data.tokenize"):
        tokenize_dataset(raw, smollm2_tokenizer)
    assert not stale.exists() and fresh.exists()
    assert "removed 1 temporary file(s) left by killed runs" in caplog.text and "tmpkilled123" in caplog.text
