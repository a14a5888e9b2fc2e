"""Sources load the packaged data offline, in the documented shapes and counts; HFDataset reads local files."""

from __future__ import annotations

import json

import datasets
import pytest

from lit_packing.data.packaged import (
    ChampChats,
    ChampProblems,
    Chatterbot,
    HumanEval,
    StateOfTheUnion,
    champ_messages,
    champ_role,
)
from lit_packing.data.shapes import example_shape
from lit_packing.data.sources import HFDataset


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("sources"))


def roles(messages: list[dict]) -> list[str]:
    return [m["role"] for m in messages]


def test_champ_chats(cache_dir):
    chats = ChampChats().load(cache_dir)
    assert len(chats) == 19_440
    assert example_shape(chats.column_names).name == "chat"
    assert chats[0]["id"] == "P_Combinatorics_1|GPT-3.5|0-Shot"
    assert roles(chats[0]["messages"]) == ["system", "user", "assistant", "user", "assistant"]
    assert chats[0]["messages"][0]["content"] == "You are an expert on mathematics."
    sample = chats.select(range(0, len(chats), 97))["messages"]
    assert all(m[-1]["role"] == "assistant" and m[-1]["content"] for m in sample)
    assert {r for m in sample for r in roles(m)} == {"system", "user", "assistant"}


def test_champ_five_shot_imputations_are_assistant_turns(cache_dir):
    five_shot = ChampChats().load(cache_dir).filter(lambda ex: ex["id"] == "P_Combinatorics_1|GPT-4|5-Shot")
    messages = five_shot[0]["messages"]
    assert roles(messages) == ["system"] + ["user", "assistant"] * 7
    assert messages[2]["content"].startswith("Step-wise solution:\n1. ")  # an imputed reference solution


def test_champ_roles_and_cut_conversations():
    assert [champ_role(r) for r in ("System", "User", "Model.GPT-4 Turbo", "Imputation")] == [
        "system",
        "user",
        "assistant",
        "assistant",
    ]
    with pytest.raises(ValueError, match="unknown CHAMP role 'Critic'"):
        champ_role("Critic")
    raw = [
        {"role": "System", "text": "S", "error": None},
        {"role": "User", "text": "Q", "error": None},
        {"role": "Model.GPT-3.5", "text": "long answer, cut", "error": "LENGTH_CURRENT"},
        {"role": "User", "text": "Now, summarize", "error": None},
        {"role": "Model.GPT-3.5", "text": None, "error": "LENGTH_PREVIOUS"},
    ]
    assert champ_messages(raw) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "long answer, cut"},
    ]


def test_champ_problems(cache_dir):
    problems = ChampProblems().load(cache_dir)
    assert len(problems) == 270
    assert example_shape(problems.column_names).name == "prompt_completion"
    first = problems[0]
    assert first["prompt"].endswith("have adjacent digit differing by less than or equal to 1?\n\n")
    assert first["completion"].startswith("Step-wise solution:\n1. Let x_n, y_n, z_n")
    assert first["completion"].endswith("\n\nAnswer: 239")


def test_chatterbot(cache_dir):
    dialogues = Chatterbot().load(cache_dir)
    assert len(dialogues) == 2_025  # one trivia entry is a string, not a dialogue
    for messages in dialogues["messages"]:
        assert roles(messages) == ["user", "assistant"] * (len(messages) // 2)
    assert dialogues[0]["category"] == "ai"
    assert dialogues[0]["messages"][0]["content"] == "What is AI?"


def test_human_eval(cache_dir):
    tasks = HumanEval().load(cache_dir)
    assert len(tasks) == 164
    assert example_shape(tasks.column_names).name == "prompt_completion"
    assert tasks[0]["id"] == "HumanEval/0"
    assert "def has_close_elements" in tasks[0]["prompt"]
    assert tasks[0]["completion"].startswith("    for idx, elem in enumerate(numbers):")


def test_state_of_the_union(cache_dir):
    paragraphs = StateOfTheUnion().load(cache_dir)
    speeches = StateOfTheUnion(unit="document").load(cache_dir)
    assert (len(paragraphs), len(speeches)) == (25_488, 249)
    assert example_shape(speeches.column_names).name == "text"
    assert speeches[0]["speech"] == "1790-Washington-1"
    assert paragraphs[0]["text"] == "Fellow-Citizens of the Senate and House of Representatives:"
    with pytest.raises(ValueError, match="data.source.init_args.unit: 'chapter' is not a choice"):
        StateOfTheUnion(unit="chapter")


def test_fingerprint_is_stable_and_names_the_options(cache_dir):
    assert StateOfTheUnion().fingerprint == StateOfTheUnion().fingerprint
    assert StateOfTheUnion().fingerprint != StateOfTheUnion(unit="document").fingerprint
    assert ChampChats().fingerprint != ChampProblems().fingerprint
    first, again = HumanEval().load(cache_dir), HumanEval().load(cache_dir)
    assert first._fingerprint == again._fingerprint == HumanEval().fingerprint
    assert first.cache_files == again.cache_files and first.cache_files  # Arrow on disk, built once


def write_jsonl(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_hf_dataset_local_jsonl_with_field_map(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"q": "2+2?", "a": "4"}, {"q": "3+3?", "a": "6"}])
    loaded = HFDataset(path, split="train", field_map={"q": "prompt", "a": "completion"}).load(str(tmp_path / "c"))
    assert isinstance(loaded, datasets.Dataset)
    assert loaded.to_list() == [
        {"_line": 1, "_problem": "", "prompt": "2+2?", "completion": "4"},
        {"_line": 2, "_problem": "", "prompt": "3+3?", "completion": "6"},
    ]
    whole = HFDataset(path, field_map={"q": "prompt", "a": "completion"}).load(str(tmp_path / "c"))
    assert isinstance(whole, datasets.DatasetDict) and list(whole) == ["train"]


def test_hf_dataset_without_known_shape_names_field_map(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"q": "2+2?", "a": "4"}])
    with pytest.raises(ValueError, match=r"columns \['a', 'q'\].*field_map"):
        HFDataset(path).load(str(tmp_path / "c"))


def test_hf_dataset_saved_to_disk_keeps_its_splits(tmp_path):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    saved = datasets.DatasetDict(
        train=datasets.Dataset.from_list([{"messages": chat}] * 3),
        validation=datasets.Dataset.from_list([{"messages": chat}]),
    )
    saved.save_to_disk(str(tmp_path / "saved"))
    loaded = HFDataset(str(tmp_path / "saved")).load()
    assert {name: len(part) for name, part in loaded.items()} == {"train": 3, "validation": 1}
    assert len(HFDataset(str(tmp_path / "saved"), split="validation").load()) == 1


def test_hf_dataset_parquet_text(tmp_path):
    datasets.Dataset.from_list([{"body": "one"}, {"body": "two"}]).to_parquet(str(tmp_path / "t.parquet"))
    loaded = HFDataset(str(tmp_path / "t.parquet"), split="train", field_map={"body": "text"}).load(str(tmp_path))
    assert loaded["text"] == ["one", "two"]


def test_example_shape_prefers_chat_and_names_the_knob():
    assert example_shape(["messages", "text"]).name == "chat"
    assert example_shape(["prompt", "completion", "id"]).name == "prompt_completion"
    with pytest.raises(ValueError, match="rename yours with data.source"):
        example_shape(["prompt"])
