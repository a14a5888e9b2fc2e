"""easy-VQA loads offline as image chats: the documented counts, one question per chat with its image and one-word
answer, and rows that encode for the tiny SmolVLM with the answer as the only trained text."""

from __future__ import annotations

import datasets
import pytest

from lit_packing.assets import package_file
from lit_packing.batch import IGNORE_INDEX, INPUT_IDS, LABELS
from lit_packing.data.images import IMAGE_TOKENS, encode_image_chat, image_problem, image_size, image_tokens
from lit_packing.data.vqa import EasyVQA
from lit_packing.errors import ConfigError
from lit_packing.models.vlm_assets import vlm_processor


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("vqa"))


def test_both_splits_hold_the_documented_questions_and_answers(cache_dir):
    splits = EasyVQA(split=None).load(cache_dir)
    assert isinstance(splits, datasets.DatasetDict) and {k: len(v) for k, v in splits.items()} == {
        "train": 38_575,
        "test": 9_673,
    }
    answers = package_file("easy_vqa", "data/answers.txt").read_text().split()
    assert len(answers) == 13
    for split in splits.values():
        assert set(split["answer"]) == set(answers)
        assert split.column_names == ["id", "messages", "images", "answer", "image_id"]
    assert len(set(splits["train"]["image_id"])) == 4_000 and len(set(splits["test"]["image_id"])) == 1_000
    assert splits["train"]._fingerprint != splits["test"]._fingerprint  # caches downstream tell them apart


def test_a_question_is_one_image_chat_with_its_answer(cache_dir):
    rows = EasyVQA(limit=50).load(cache_dir)
    assert len(rows) == 50
    first = rows.cast_column("images", datasets.List(datasets.Image(decode=False)))[0]
    assert first["messages"] == [
        {
            "role": "user",
            "content": [{"type": "image", "text": None}, {"type": "text", "text": "what is the blue shape?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "rectangle"}]},
    ]
    assert first["id"] == "train-0" and first["answer"] == "rectangle" and first["image_id"] == 0
    assert first["images"][0]["path"].endswith("easy_vqa/data/train/images/0.png")
    assert image_size(first["images"][0], row=0) == (64, 64)
    for row in rows:
        assert image_problem(row) == ""
        assert row["messages"][1]["content"][0]["text"] == row["answer"]
        assert row["images"][0].size == (64, 64)


def test_the_test_split_and_a_limit(cache_dir):
    rows = EasyVQA(split="test", limit=7).load(cache_dir)
    assert rows["id"] == [f"test-{k}" for k in range(7)]
    assert rows.cast_column("images", datasets.List(datasets.Image(decode=False)))[0]["images"][0]["path"].endswith(
        "easy_vqa/data/test/images/0.png"
    )
    assert EasyVQA(limit=7).fingerprint != EasyVQA(limit=8).fingerprint != EasyVQA(split="test", limit=8).fingerprint


def test_bad_settings_name_the_setting():
    with pytest.raises(ConfigError, match="data.source.init_args.split: 'validation' is not a split of easy-VQA"):
        EasyVQA(split="validation")
    with pytest.raises(ConfigError, match="data.source.init_args.limit: 0 is below 1"):
        EasyVQA(limit=0)


def test_a_row_encodes_with_the_answer_as_the_only_trained_text(cache_dir, smollm2_tokenizer):
    processor = vlm_processor(smollm2_tokenizer)
    row = EasyVQA(limit=3).load(cache_dir)[2]
    encoded = encode_image_chat(processor, row, max_length=512)
    trained = [t for t, y in zip(encoded[INPUT_IDS], encoded[LABELS]) if y != IGNORE_INDEX]
    assert processor.tokenizer.decode(trained) == row["answer"] + "<|im_end|>"
    assert encoded[IMAGE_TOKENS] == [image_tokens(processor, 64, 64)] == [93]  # upscaled to 512: 2 x 2 tiles + global
