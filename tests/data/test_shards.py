"""Sources read as shards (`data.streaming`): each reader gives, from any row on, the rows `load()` gives."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import sys

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lit_packing.data.encode import Encoder, chat_template, tokenize_batch
from lit_packing.data.packaged import HumanEval
from lit_packing.data.shards import (
    ArrowShard,
    DatasetShard,
    JsonLinesShard,
    LitDataShard,
    ParquetShard,
    StreamingShard,
)
from lit_packing.data.sources import HFDataset, LitData, Source
from lit_packing.errors import AssetError, ConfigError

QUESTIONS = ["What is a prime number?", "How do I reverse a list in Python?", "Name a noble gas.", "What is 7 * 8?"]
ANSWERS = [
    "A number > 1 whose only divisors are 1 and itself.",
    "Use `items[::-1]` or `items.reverse()`.",
    "Neon.",
    "56",
]


def chat(i: int) -> dict:
    """A realistic chat example: a question and its answer, every third with a system turn and a follow-up."""
    messages = [{"role": "system", "content": "You are a concise tutor."}] if i % 3 == 0 else []
    messages += [
        {"role": "user", "content": f"{QUESTIONS[i % 4]} (#{i})"},
        {"role": "assistant", "content": ANSWERS[i % 4]},
    ]
    if i % 3 == 0:
        messages += [{"role": "user", "content": "Thanks! One more?"}, {"role": "assistant", "content": f"Sure: {i}"}]
    return {"id": f"chat-{i}", "messages": messages}


def write_jsonl(path, lines: list[str]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def train_rows(source, cache_dir) -> list[dict]:
    """The cached path's rows: `load()`, its train split."""
    loaded = source.load(str(cache_dir))
    return (loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded).to_list()


def check_reads(shard, expected: list[dict], starts=(1, 4, 5)) -> None:
    """`read(0)` gives `expected`, `read(k)` its tail from k (past the end: nothing), and so does a pickled copy."""
    assert list(shard.read()) == expected
    for k in (*starts, len(expected), len(expected) + 3):
        assert list(shard.read(k)) == expected[k:], k
    assert list(pickle.loads(pickle.dumps(shard)).read(2)) == expected[2:]
    with pytest.raises(ValueError, match="start=-1"):
        next(iter(shard.read(-1)))


# ---------------------------------------------------------------- the default: one shard over load()


def test_default_shard_streams_what_load_gives(tmp_path):
    source = HumanEval()
    (shard,) = shards = source.shards(str(tmp_path))
    assert isinstance(shard, DatasetShard)
    assert (shard.name, shard.rows, shard.row_name(3)) == ("HumanEval()", 164, "row 3 of HumanEval()")
    check_reads(shard, train_rows(source, tmp_path), starts=(1, 100, 163))
    assert source.shape(shards).name == "prompt_completion"


class Saved(Source):
    """A source whose `load()` gives splits: a `save_to_disk` folder, through the default reader."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def load(self, cache_dir: str | None = None) -> datasets.DatasetDict:
        return datasets.load_from_disk(self.folder)


def test_default_shard_of_splits_is_train(tmp_path):
    train = datasets.Dataset.from_list([chat(i) for i in range(5)])
    datasets.DatasetDict(train=train, validation=train.select([0])).save_to_disk(str(tmp_path / "saved"))
    (shard,) = Saved(str(tmp_path / "saved")).shards()
    assert shard.rows == 5 and list(shard.read(3)) == train.to_list()[3:]
    datasets.DatasetDict(test=train).save_to_disk(str(tmp_path / "test_only"))
    with pytest.raises(ConfigError, match=r"split: Saved\(folder=.*\) has splits \['test'\] but no 'train'"):
        Saved(str(tmp_path / "test_only")).shards()


# ---------------------------------------------------------------- JSON Lines, parsed here


def test_jsonl_file_streams_its_lines_with_bad_rows_named(tmp_path):
    lines = [json.dumps(chat(i)) for i in range(8)]
    lines[3:3] = ["{'messages': oops}", ""]  # a malformed line 4, a blank line 5: rows are counted past both
    path = write_jsonl(tmp_path / "chats.jsonl", lines)
    source = HFDataset(path)
    (shard,) = source.shards()
    assert isinstance(shard, JsonLinesShard) and shard.rows is None and shard.name == path
    rows = list(shard.read())
    assert rows == train_rows(source, tmp_path / "cache")  # exactly what the cached path holds
    assert rows[3] == {"_line": 4, "_problem": rows[3]["_problem"], "messages": []}
    assert rows[3]["_problem"].startswith("not valid JSON (Expecting property name")
    assert [row["_line"] for row in rows] == [1, 2, 3, 4, 6, 7, 8, 9, 10]
    check_reads(shard, rows, starts=(1, 3, 4, 5, 8))
    assert shard.row_name(rows[3]["_line"]) == f"line 4 of {path}"
    assert source.shape().name == "chat"


def test_json_array_file_streams_its_items(tmp_path):
    path = tmp_path / "chats.json"
    path.write_text(json.dumps([chat(i) for i in range(5)]))
    source = HFDataset(str(path), split="train")
    (shard,) = source.shards()
    check_reads(shard, train_rows(source, tmp_path / "cache"), starts=(1, 4))
    assert shard.row_name(3) == f"item 3 of {path}"


def test_jsonl_shards_tokenize_as_the_cached_rows(tmp_path, gpt2_tokenizer):
    path = write_jsonl(tmp_path / "chats.jsonl", [json.dumps(chat(i)) for i in range(12)])
    source = HFDataset(path, split="train")
    cached = source.load(str(tmp_path / "cache"))
    encoder = Encoder(gpt2_tokenizer, "chat", chat_template(gpt2_tokenizer), "completion")

    def tokenized(rows: list[dict], indices: list[int]) -> dict:
        batch = {name: [row[name] for row in rows] for name in rows[0]}
        return tokenize_batch(batch, indices, encoder, 48, "truncate", None)

    streamed = list(source.shards()[0].read(5))[:4]
    assert tokenized(streamed, [5, 6, 7, 8]) == tokenized(cached.select(range(5, 9)).to_list(), [5, 6, 7, 8])


def test_jsonl_glob_is_one_shard_per_file_in_sorted_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, numbers in (("b", range(6, 10)), ("a", range(0, 6)), ("c", range(10, 13))):
        write_jsonl(tmp_path / "shards" / f"{name}.jsonl", [json.dumps(chat(i)) for i in numbers])
    source = HFDataset(path="json", data_files="shards/*.jsonl")
    shards = source.shards()
    assert [(s.name, s.rows) for s in shards] == [(f"shards/{n}.jsonl", None) for n in "abc"]
    assert source.shape(shards).name == "chat"
    # `datasets`' JSON builder (the cached path for data_files) keeps every column and no line numbers
    cached = train_rows(source, tmp_path / "cache")
    streamed = [row for shard in shards for row in shard.read()]
    expected = [chat(i)["messages"] for i in range(13)]
    assert [row["messages"] for row in streamed] == [row["messages"] for row in cached] == expected
    assert [r["_line"] for r in streamed] == [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 1, 2, 3]
    check_reads(shards[1], list(shards[1].read()), starts=(1, 3))
    assert shards[2].row_name(2) == "line 2 of shards/c.jsonl"


def test_missing_glob_names_the_setting(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AssetError, match=r"data.source.init_args.data_files: 'shards/\*.jsonl' matches no local file"):
        HFDataset(path="json", data_files=["shards/*.jsonl"]).shards()


def test_a_part_of_a_split_is_not_streamed(tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", [json.dumps(chat(0))])
    with pytest.raises(ConfigError, match=r"split: 'train\[:10\]' selects part of a split.*data.streaming: false"):
        HFDataset(path, split="train[:10]").shards()
    with pytest.raises(ConfigError, match=r"has splits \['train'\], not 'validation'"):
        HFDataset(path, split="validation").shards()


# ---------------------------------------------------------------- Parquet, by row group


def write_parquet(path, numbers: range, row_group_size: int) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"conversation": chat(i)["messages"], "id": chat(i)["id"]} for i in numbers]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return str(path)


def test_parquet_files_stream_by_row_group(tmp_path):
    write_parquet(tmp_path / "data" / "train-00001.parquet", range(10, 17), row_group_size=3)
    write_parquet(tmp_path / "data" / "train-00000.parquet", range(0, 10), row_group_size=4)
    source = HFDataset(str(tmp_path / "data"), field_map={"conversation": "messages"})
    shards = source.shards()
    assert all(isinstance(shard, ParquetShard) for shard in shards)
    assert [(s.name, s.rows) for s in shards] == [
        (str(tmp_path / "data" / f"train-0000{n}.parquet"), rows) for n, rows in ((0, 10), (1, 7))
    ]
    assert shards[0].columns() == ["messages", "id"] and source.shape(shards).name == "chat"
    cached = train_rows(source, tmp_path / "cache")
    assert cached[0] == {"messages": chat(0)["messages"], "id": "chat-0"}
    check_reads(shards[0], cached[:10], starts=(1, 3, 4, 5, 8, 9))  # within, at and across row groups
    check_reads(shards[1], cached[10:], starts=(2, 3, 6))
    assert shards[1].row_name(7) == f"row 7 of {tmp_path}/data/train-00001.parquet"


# ---------------------------------------------------------------- Arrow, `save_to_disk`


def test_saved_dataset_streams_its_arrow_files(tmp_path):
    saved = datasets.DatasetDict(
        train=datasets.Dataset.from_list([chat(i) for i in range(11)]),
        validation=datasets.Dataset.from_list([chat(i) for i in range(20, 23)]),
    )
    saved.save_to_disk(str(tmp_path / "saved"), num_shards={"train": 2, "validation": 1})
    source = HFDataset(str(tmp_path / "saved"))
    shards = source.shards()
    assert all(isinstance(shard, ArrowShard) for shard in shards)
    names = [f"{tmp_path}/saved/train/data-0000{n}-of-00002.arrow" for n in (0, 1)]
    assert [(s.name, s.rows) for s in shards] == [(names[0], 6), (names[1], 5)]
    assert source.shape(shards).name == "chat"
    cached = train_rows(source, tmp_path)
    check_reads(shards[0], cached[:6])
    check_reads(shards[1], cached[6:], starts=(1, 4))
    (validation,) = HFDataset(str(tmp_path / "saved"), split="validation").shards()
    assert list(validation.read(1)) == saved["validation"].to_list()[1:]
    with pytest.raises(ConfigError, match=r"has splits \['train', 'validation'\], not 'test'"):
        HFDataset(str(tmp_path / "saved"), split="test").shards()
    # one of its files, named alone, is read the same way (and by `load`, through datasets' Arrow builder)
    single = HFDataset(names[1], split="train")
    (shard,) = single.shards()
    assert shard.rows == 5 and list(shard.read()) == single.load(str(tmp_path / "cache")).to_list() == cached[6:]


# ---------------------------------------------------------------- datasets' streaming mode (the Hub's reader)


def test_csv_streams_through_datasets_streaming_mode(tmp_path):
    lines = ["question,answer"] + [f'"{QUESTIONS[i % 4]} (#{i})","{ANSWERS[i % 4]}"' for i in range(9)]
    path = write_jsonl(tmp_path / "qa.csv", lines)
    source = HFDataset(path, field_map={"question": "prompt", "answer": "completion"})
    (shard,) = shards = source.shards()
    assert isinstance(shard, StreamingShard) and shard.rows is None and shard.name == path
    assert source.shape(shards).name == "prompt_completion"
    check_reads(shard, train_rows(source, tmp_path / "cache"), starts=(1, 5))
    assert shard.row_name(4) == f"row 4 of {path}"


def test_hub_reader_streams_a_builder_and_a_hub_name_is_one_shard(tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", [json.dumps(chat(i)) for i in range(6)])
    # the reader of a Hub name, given a local builder: load_dataset("json", data_files=..., streaming=True)
    shard = StreamingShard("chats", None, "json", None, "train", path, None)
    assert shard.columns() == ["id", "messages"]
    check_reads(shard, [chat(i) for i in range(6)], starts=(1, 5))
    (hub,) = HFDataset("someone/chats", name="en").shards()  # HF_HUB_OFFLINE (conftest): nothing is requested
    assert isinstance(hub, StreamingShard) and hub.rows is None
    assert (hub.path, hub.config, hub.split) == ("someone/chats", "en", "train")
    assert hub.row_name(3) == f"row 3 of {HFDataset('someone/chats', name='en')!r}"


# ---------------------------------------------------------------- litdata


@pytest.fixture(scope="module")
def optimized(tmp_path_factory) -> str:
    """25 chats written by `litdata.optimize` in chunks of 10 items (3 chunks), as a user would write them."""
    litdata = pytest.importorskip("litdata")
    folder = str(tmp_path_factory.mktemp("litdata") / "chats")
    inputs = [json.dumps(chat(i)) for i in range(25)]
    start_method = multiprocessing.get_start_method()
    try:
        litdata.optimize(fn=json.loads, inputs=inputs, output_dir=folder, chunk_size=10, num_workers=1)
    finally:  # optimize sets the process-wide start method (spawn): later tests' DataLoader workers keep theirs
        multiprocessing.set_start_method(start_method, force=True)
    return folder


def test_litdata_chunks_are_shards(optimized, tmp_path):
    source = LitData(optimized)
    shards = source.shards()
    assert all(isinstance(shard, LitDataShard) for shard in shards)
    assert [(s.name, s.rows) for s in shards] == [
        (f"{optimized}/chunk-0-{n}.bin", r) for n, r in ((0, 10), (1, 10), (2, 5))
    ]
    assert source.shape(shards).name == "chat"
    items = [chat(i) for i in range(25)]
    check_reads(shards[1], items[10:20], starts=(1, 9))
    assert [row for shard in shards for row in shard.read()] == items
    assert shards[1].row_name(2) == f"row 2 of {optimized}/chunk-0-1.bin (item 12 of {optimized})"
    assert train_rows(source, tmp_path) == items  # the cached path: every item into the datasets cache
    renamed = LitData(optimized, field_map={"messages": "conversation"}).shards()[2]
    assert list(renamed.read(4)) == [{"conversation": items[24]["messages"], "id": "chat-24"}]


def test_litdata_errors_name_the_fix(tmp_path, monkeypatch):
    with pytest.raises(AssetError, match=r"input_dir: '.*nowhere' is no local folder"):
        LitData(str(tmp_path / "nowhere")).shards()
    with pytest.raises(AssetError, match=r"input_dir: '.*' holds no index.json.*litdata.optimize"):
        LitData(str(tmp_path)).shards()
    monkeypatch.setitem(sys.modules, "litdata", None)  # as if not installed
    hint = (
        r'run pip install -e "\.\[stream\]" at the root of your lit_packing clone, or pip install "<wheel>\[stream\]"'
    )
    with pytest.raises(AssetError, match=r"^litdata: the package is not installed .*; " + hint):
        LitData(str(tmp_path)).shards()
