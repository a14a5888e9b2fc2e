"""Preference pairs as data: CHAMP's real pairs and a user's pair file, tokenized with the prompt masked in both
sequences, a pair never cut in half, bad pairs named, and every sampler dealing whole pairs exactly once."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from transformers import AutoTokenizer

from lit_packing.assets import resolve_pretrained
from lit_packing.batch import CHOSEN_TOKENS, IGNORE_INDEX, INPUT_IDS, LABELS, PAIRS, ROWS, STEP
from lit_packing.data import ChampPairs, HFDataset, PackedCollator, PackingDataModule, PairCollator
from lit_packing.data.tokenize import TokenizedDataset, tokenize_dataset
from lit_packing.errors import ConfigError, DataError
from lit_packing.samplers import BestFitPackingSampler, MultipackSampler


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False))


@pytest.fixture(scope="module")
def champ(tmp_path_factory):
    return ChampPairs().load(str(tmp_path_factory.mktemp("pairs")))


def test_champ_pairs_are_problem_reference_and_a_flawed_model_solution(champ):
    assert len(champ) == 444 and len(set(champ["id"])) == 444
    row = champ[0]
    assert row["chosen"].startswith("Step-wise solution:\n1. ") and "Answer: " in row["chosen"]
    assert row["first_wrong_step"] and row["first_wrong_step"] in row["rejected"]
    assert row["prompt"].startswith("Solve the following problem.") and row["chosen"] != row["rejected"]


def test_a_pair_tokenizes_to_two_sequences_with_the_prompt_masked(champ, tokenizer):
    tokenized, report = tokenize_dataset(champ.select(range(8)), tokenizer, max_length=4096, overlong="drop")
    pair = TokenizedDataset(tokenized)[0]
    split = pair[CHOSEN_TOKENS]
    ids, labels = np.asarray(pair[INPUT_IDS]), np.asarray(pair[LABELS])
    chosen, rejected = (ids[:split], labels[:split]), (ids[split:], labels[split:])
    prompt = np.flatnonzero(chosen[1] != IGNORE_INDEX)[0]  # the first trained token ends the prompt
    assert np.array_equal(chosen[0][:prompt], rejected[0][:prompt])  # the same prompt in both
    assert (rejected[1][:prompt] == IGNORE_INDEX).all()
    assert tokenizer.decode(chosen[0][chosen[1] != IGNORE_INDEX]).startswith("Step-wise solution:")
    assert tokenizer.decode(rejected[0][rejected[1] != IGNORE_INDEX]).startswith(champ[0]["rejected"][:40])
    assert report.examples_in == 8 and report.examples_out == 8


def test_a_pair_longer_than_max_length_is_dropped_and_counted_never_cut(champ, tokenizer):
    tokenized, report = tokenize_dataset(champ.select(range(40)), tokenizer, max_length=1200, overlong="drop")
    lengths = TokenizedDataset(tokenized).lengths
    assert lengths.max() <= 1200 and report.dropped_overlong_examples > 0
    assert len(tokenized) + report.dropped_overlong_examples == 40
    with pytest.raises(ConfigError, match="data.overlong: truncate would cut preference pairs apart"):
        tokenize_dataset(champ.select(range(4)), tokenizer, max_length=1200, overlong="truncate")
    with pytest.raises(DataError, match="max_length"):
        tokenize_dataset(champ.select(range(40)), tokenizer, max_length=1200, overlong="error")


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_a_users_pair_file_in_chat_messages_and_its_bad_rows(tmp_path, tokenizer):
    """TRL's conversational layout; an empty side, identical sides and a wrong type are named by line."""
    good = {
        "prompt": [{"role": "user", "content": "2 + 2?"}],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }
    rows = [good, {**good, "rejected": good["chosen"]}, {**good, "chosen": []}, {**good, "rejected": 7}, good]
    source = HFDataset(write_jsonl(tmp_path / "pairs.jsonl", rows), split="train")
    data = source.load(str(tmp_path / "cache"))
    with pytest.raises(DataError) as raised:
        tokenize_dataset(data, tokenizer, max_length=256, overlong="drop", row_name=source.row_name)
    message = str(raised.value)
    assert "\n" not in message and "line 2" in message and "chosen and rejected are identical" in message, message
    kept, report = tokenize_dataset(data, tokenizer, max_length=256, overlong="drop", on_bad_row="skip")
    assert len(kept) == 2 and report.bad_examples == 3


def test_a_collator_of_single_examples_refuses_pairs_and_the_pair_collator_refuses_examples(champ, tokenizer):
    tokenized, _ = tokenize_dataset(champ.select(range(4)), tokenizer, max_length=4096, overlong="drop")
    pairs = TokenizedDataset(tokenized)
    with pytest.raises(DataError, match="PackedCollator got preference pairs.*PairCollator"):
        PackedCollator()([pairs[0], pairs[1]])
    with pytest.raises(DataError, match="PairCollator got an example that is no whole preference pair"):
        PairCollator()([{INPUT_IDS: [1, 2, 3], LABELS: [1, 2, 3]}])
    with pytest.raises(DataError, match="PairCollator got an example that is no whole preference pair"):
        PairCollator()([pairs[(0, 0, 100)]])  # a slice of a pair (FixedLengthPackingSampler)


@pytest.mark.parametrize("sampler", [BestFitPackingSampler, MultipackSampler])
def test_every_sampler_deals_whole_pairs_exactly_once_with_the_steps_pair_count(tmp_path, sampler):
    data = PackingDataModule(
        source=ChampPairs(), limit=48, val_split=8, max_length=2048, overlong="drop", collator=PairCollator,
        sampler=lambda lengths, **kwargs: sampler(lengths, max_tokens=4096, **kwargs), cache_dir=str(tmp_path),
    )  # fmt: skip
    data.prepare_data()
    data.setup("fit")
    batches = list(data.train_dataloader())
    rows = Counter(row for batch in batches for row in batch[ROWS])
    assert len(rows) == len(data.train_dataset) and set(rows.values()) == {1}  # every pair once
    for batch in batches:
        assert len(batch[PAIRS]) == len(batch[ROWS]) and batch[STEP]["sequences"] == len(batch[ROWS])
        assert batch["input_ids"].shape[1] <= 4096


def test_rows_of_a_tokenized_table_of_examples_are_no_pairs(tmp_path, tokenizer):
    """A table of single examples carries `chosen_tokens` = 0 (one schema for every shape): the collators of
    single examples take its rows as they are (the core page indexes the table directly)."""
    from lit_packing.data import Chatterbot

    examples, _ = tokenize_dataset(Chatterbot().load(str(tmp_path)).select(range(4)), tokenizer, max_length=256)
    rows = [examples[i] for i in range(4)]
    assert all(row[CHOSEN_TOKENS] == 0 for row in rows)
    assert PackedCollator()(rows)["counts"]["examples"] == 4
    with pytest.raises(DataError, match="no whole preference pair"):
        PairCollator()(rows)
