"""Tokenization: exact label masks, overlong policies with exact counts, the disk cache, token-slice access."""

from __future__ import annotations

import pickle

import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

from lit_packing.data import tokenize as tok_module
from lit_packing.data.encode import DEFAULT_CHAT_TEMPLATE
from lit_packing.data.tokenize import TokenizedDataset, tokenization_fingerprint, tokenize_dataset
from lit_packing.errors import DataError

IGNORE = -100
CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "See you."},
]


def on_disk(tmp_path, rows: list[dict]) -> datasets.Dataset:
    """An Arrow-backed dataset, as sources give (map caches only next to files on disk)."""
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "raw"))
    return datasets.load_from_disk(str(tmp_path / "raw"))


def trained_runs(tokenizer, row: dict) -> list[str]:
    """The decoded text of each maximal run of labelled tokens."""
    runs, current = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != IGNORE:
            assert label == token
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return [tokenizer.decode(run) for run in runs + ([current] if current else [])]


def words(k: int) -> str:
    """k SmolLM2 tokens: 'x', ' x', ' x', ..."""
    return " ".join(["x"] * k)


def test_chat_labels_are_exactly_the_assistant_turns(smollm2_tokenizer):
    out, report = tokenize_dataset(datasets.Dataset.from_list([{"messages": CHAT}]), smollm2_tokenizer)
    row = out[0]
    assert smollm2_tokenizer.decode(row["input_ids"]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\nSee you.<|im_end|>\n"
    )
    assert trained_runs(smollm2_tokenizer, row) == ["Hello!<|im_end|>", "See you.<|im_end|>"]
    assert row["labels"][-1] == IGNORE  # the newline after <|im_end|> is template, not turn
    assert report.label_tokens == sum(label != IGNORE for label in row["labels"]) == 3 + 4
    assert row["length"] == len(row["input_ids"]) == report.real_tokens


def test_chat_train_on_all(smollm2_tokenizer):
    out, _ = tokenize_dataset(datasets.Dataset.from_list([{"messages": CHAT}]), smollm2_tokenizer, train_on="all")
    ids, labels = out[0]["input_ids"], out[0]["labels"]
    assert labels == [IGNORE] + ids[1:]


def test_gpt2_gets_the_default_chatml_template(gpt2_tokenizer):
    assert gpt2_tokenizer.chat_template is None
    out, _ = tokenize_dataset(datasets.Dataset.from_list([{"messages": CHAT}]), gpt2_tokenizer)
    row = out[0]
    assert gpt2_tokenizer.decode(row["input_ids"]).startswith("<|im_start|>user\nHi<|im_end|>\n")
    # Without special end-of-turn tokens the whole assistant span, markers included, is trained.
    assert trained_runs(gpt2_tokenizer, row) == ["Hello!<|im_end|>\n", "See you.<|im_end|>\n"]


def test_template_that_rewrites_earlier_turns_is_refused(smollm2_tokenizer, gpt2_tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(gpt2_tokenizer.name_or_path)
    tokenizer.chat_template = "{{ messages | length }}" + DEFAULT_CHAT_TEMPLATE
    with pytest.raises(ValueError, match=r"example 0: the chat template is not prefix-consistent.*data.train_on=all"):
        tokenize_dataset(datasets.Dataset.from_list([{"messages": CHAT}]), tokenizer)


def test_prompt_completion_masks_the_prompt(smollm2_tokenizer):
    ds = datasets.Dataset.from_list([{"prompt": "Q: 2+2?\n", "completion": "A: 4"}])
    row = tokenize_dataset(ds, smollm2_tokenizer)[0][0]
    prompt = smollm2_tokenizer("Q: 2+2?\n", add_special_tokens=False)["input_ids"]
    completion = smollm2_tokenizer("A: 4", add_special_tokens=False)["input_ids"]
    eos = smollm2_tokenizer.eos_token_id
    assert row["input_ids"] == prompt + completion + [eos]
    assert row["labels"] == [IGNORE] * len(prompt) + completion + [eos]
    everything = tokenize_dataset(ds, smollm2_tokenizer, train_on="all")[0][0]
    assert everything["labels"] == [IGNORE] + everything["input_ids"][1:]


def test_text_trains_every_token_but_the_first(gpt2_tokenizer):
    row = tokenize_dataset(datasets.Dataset.from_list([{"text": "Hello world"}]), gpt2_tokenizer)[0][0]
    assert row["input_ids"] == [15496, 995, 50256]  # no BOS added, eos appended
    assert row["labels"] == [IGNORE, 995, 50256]


TEXTS = [{"text": words(k)} for k in (4, 9, 19, 7)]  # 5, 10, 20, 8 tokens with eos


def test_truncate_counts_cut_tokens(smollm2_tokenizer):
    out, report = tokenize_dataset(datasets.Dataset.from_list(TEXTS), smollm2_tokenizer, max_length=8)
    assert out["length"] == [5, 8, 8, 8]
    assert out["truncated_tokens"] == [0, 2, 12, 0]
    assert (report.truncated_examples, report.truncated_tokens) == (2, 14)
    assert (report.examples_in, report.examples_out, report.real_tokens, report.tokens_in) == (4, 4, 29, 43)
    assert report.label_tokens == 29 - 4  # every token but each example's first


def test_drop_counts_dropped_examples_and_tokens(smollm2_tokenizer):
    out, report = tokenize_dataset(datasets.Dataset.from_list(TEXTS), smollm2_tokenizer, 8, overlong="drop")
    assert out["index"] == [0, 3] and out["length"] == [5, 8]
    assert (report.dropped_overlong_examples, report.dropped_overlong_tokens) == (2, 30)
    assert (report.examples_out, report.real_tokens, report.truncated_tokens) == (2, 13, 0)


def test_error_names_the_example_and_the_knobs(smollm2_tokenizer):
    with pytest.raises(ValueError) as error:
        tokenize_dataset(datasets.Dataset.from_list(TEXTS), smollm2_tokenizer, max_length=8, overlong="error")
    assert str(error.value) == (
        "2 examples over max_length=8, first row 1 (10 tokens); row 2 (20 tokens): "
        "raise data.max_length or set data.overlong=truncate (or drop)"
    )
    assert error.value.rows == [1, 2]


def test_examples_left_without_labels_are_dropped_and_counted(smollm2_tokenizer):
    rows = [
        {"prompt": words(10), "completion": "x"},  # 12 tokens, cut to 8: only prompt left
        {"prompt": "x", "completion": " x"},  # 3 tokens, 2 trained
    ]
    out, report = tokenize_dataset(datasets.Dataset.from_list(rows), smollm2_tokenizer, max_length=8)
    assert out["index"] == [1]
    assert (report.dropped_no_label_examples, report.dropped_no_label_tokens) == (1, 12)
    assert (report.examples_in, report.examples_out, report.truncated_examples, report.label_tokens) == (2, 1, 0, 2)
    one_token = [{"text": ""}, {"prompt": "", "completion": "x"}]  # 1 token + eos: only the first is unlabelled
    _, report = tokenize_dataset(datasets.Dataset.from_list(one_token[1:]), smollm2_tokenizer)
    assert (report.examples_out, report.label_tokens, report.dropped_no_label_examples) == (1, 1, 0)
    only_prompt = [{"prompt": words(10), "completion": "x"}] * 2
    with pytest.raises(DataError, match=r"nothing to train on: no example of 2 is left .*data.max_length"):
        tokenize_dataset(datasets.Dataset.from_list(only_prompt), smollm2_tokenizer, max_length=8)


def test_report_as_dict_and_sum(smollm2_tokenizer):
    _, report = tokenize_dataset(datasets.Dataset.from_list(TEXTS), smollm2_tokenizer, max_length=8)
    numbers = report.as_dict()
    assert numbers["examples_in"] == 4 and all(isinstance(v, int) for v in numbers.values())
    assert (report + report).truncated_tokens == 28
    assert "truncated 2 (14 tokens cut)" in str(report)


def test_cache_is_reused_and_keyed_by_settings(tmp_path, smollm2_tokenizer, monkeypatch, encoder_calls):
    raw = on_disk(tmp_path, [{"messages": CHAT}] * 3)
    counter = encoder_calls
    counter.calls = 0  # count from here on
    first, _ = tokenize_dataset(raw, smollm2_tokenizer)
    assert counter.calls == 1 and str(tmp_path) in first.cache_files[0]["filename"]
    again, report = tokenize_dataset(datasets.load_from_disk(str(tmp_path / "raw")), smollm2_tokenizer)
    assert counter.calls == 1  # not recomputed
    assert again.cache_files == first.cache_files and report.examples_out == 3
    shorter, _ = tokenize_dataset(raw, smollm2_tokenizer, train_on="all")
    assert counter.calls == 2 and shorter.cache_files != first.cache_files


def test_fingerprint_changes_with_every_setting(smollm2_tokenizer, gpt2_tokenizer, monkeypatch):
    base = ("data", smollm2_tokenizer, "template", 2048, "truncate", "completion")
    key = tokenization_fingerprint(*base)
    assert key == tokenization_fingerprint(*base)
    changed = [
        ("other data", *base[1:]),
        (base[0], gpt2_tokenizer, *base[2:]),
        (*base[:2], "another template", *base[3:]),
        (*base[:3], 1024, *base[4:]),
        (*base[:4], "drop", base[5]),
        (*base[:5], "all"),
    ]
    assert len({key} | {tokenization_fingerprint(*args) for args in changed}) == 7
    monkeypatch.setattr(tok_module, "TOKENIZE_VERSION", "next")
    assert tokenization_fingerprint(*base) != key


def test_tokenized_dataset_rows_and_slices(smollm2_tokenizer):
    out, _ = tokenize_dataset(datasets.Dataset.from_list(TEXTS), smollm2_tokenizer, max_length=8)
    data = TokenizedDataset(out.select([1, 2, 3]))
    assert len(data) == 3
    np.testing.assert_array_equal(data.lengths, [8, 8, 8])
    whole = data[1]
    assert whole["truncated_tokens"] == 12
    np.testing.assert_array_equal(whole["input_ids"], out[2]["input_ids"])
    np.testing.assert_array_equal(whole["labels"], out[2]["labels"])
    piece = data[(1, 3, 6)]
    np.testing.assert_array_equal(piece["input_ids"], out[2]["input_ids"][3:6])
    np.testing.assert_array_equal(piece["labels"], out[2]["labels"][3:6])
    assert "truncated_tokens" not in piece  # counted once, on the slice that starts the example
    assert data[(1, 0, 2)]["truncated_tokens"] == 12
    restored = pickle.loads(pickle.dumps(data))  # what DataLoader workers receive
    np.testing.assert_array_equal(restored[2]["input_ids"], data[2]["input_ids"])
