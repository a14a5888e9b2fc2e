"""Image chats through the data path: detected as their own shape, tokenized by the model's processor with their
images carried as references, and collated in the loader into the packed row the model's exactness is proven on."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoProcessor, AutoTokenizer

from lit_packing.assets import resolve_pretrained
from lit_packing.batch import CU_SEQ_LENS_Q, IMAGES, INPUT_IDS, LABELS, PIXEL_ATTENTION_MASK, PIXEL_VALUES, POSITION_IDS
from lit_packing.data import EasyVQA, ImageChatCollator
from lit_packing.data.images import IMAGE_TOKENS, encode_image_chat, image_tokens
from lit_packing.data.shapes import IMAGE_CHAT, example_shape
from lit_packing.data.sources import HFDataset
from lit_packing.data.tokenize import TokenizedDataset, tokenize_dataset
from lit_packing.errors import ConfigError, DataError
from lit_packing.models.vlm import pack_vlm_documents
from lit_packing.models.vlm_assets import build_vlm
from tests.conftest import TINY


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    """A SmolVLM-shaped model around a tiny random language model with SmolLM2's tokenizer."""
    folder = tmp_path_factory.mktemp("vlm")
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY)).save_pretrained(folder / "text")
    AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False)).save_pretrained(folder / "text")
    return build_vlm(folder / "text", folder / "model")


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    return EasyVQA(limit=12).load(cache_dir=str(tmp_path_factory.mktemp("cache")))


def test_image_chats_are_their_own_shape_and_keep_their_images_as_references(tiny_vlm, questions):
    assert example_shape(questions.column_names) is IMAGE_CHAT
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm)
    tokenized, report = tokenize_dataset(questions, tokenizer, max_length=512)
    assert len(tokenized) == 12 and report.examples_out == 12
    dataset = TokenizedDataset(tokenized)
    item = dataset[3]
    assert dataset.images and [image["path"] for image in item[IMAGES]] == [questions[3][IMAGES][0].filename]
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    alone = encode_image_chat(processor, questions[3], 512)
    assert list(item[INPUT_IDS]) == list(alone[INPUT_IDS]) and list(item[LABELS]) == list(alone[LABELS])
    assert dataset.lengths[3] == len(alone[INPUT_IDS])  # the image's tokens counted: planned by true size
    assert alone[IMAGE_TOKENS] == [image_tokens(processor, 64, 64)]  # known from the image's size alone


def test_the_collator_builds_the_row_the_oracle_proves(tiny_vlm, questions):
    """`ImageChatCollator` (images decoded here, as in a loader worker) gives the row `pack_vlm_documents` builds
    from the processor's own output for each chat: the same ids, labels, bounds, positions and pixels."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm)
    dataset = TokenizedDataset(tokenize_dataset(questions, tokenizer, max_length=512)[0])
    collate = ImageChatCollator(pad_token_id=tokenizer.pad_token_id, pad_to_multiple_of=64)
    collate.connect_processor(str(tiny_vlm))
    batch = collate(dataset.__getitems__([0, 5, 7]))
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    documents = [encode_image_chat(processor, questions[k], 512) for k in (0, 5, 7)]
    oracle = pack_vlm_documents(AutoConfig.from_pretrained(tiny_vlm), documents)
    real = int(oracle[CU_SEQ_LENS_Q][-1])
    assert batch[INPUT_IDS].shape[1] % 64 == 0 and batch[CU_SEQ_LENS_Q][:-1].tolist() == oracle[CU_SEQ_LENS_Q].tolist()
    for key in (INPUT_IDS, LABELS, POSITION_IDS):
        assert torch.equal(batch[key][:, :real], oracle[key]), key
    assert torch.equal(batch[PIXEL_VALUES], oracle[PIXEL_VALUES]) and batch[PIXEL_VALUES].shape[1] == 3 * 5  # tiles
    assert torch.equal(batch[PIXEL_ATTENTION_MASK], oracle[PIXEL_ATTENTION_MASK])
    with pytest.raises(ConfigError, match="a slice of an image chat"):
        collate(dataset.__getitems__([(0, 0, 50)]))


def test_an_unreadable_image_is_named_by_its_row(tiny_vlm, questions, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    good = questions[0]
    rows = [
        {"messages": good["messages"], "images": [good[IMAGES][0].filename]},
        {"messages": good["messages"], "images": [str(broken)]},
    ]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    dataset = HFDataset(str(tmp_path / "chats.jsonl")).load()["train"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm)
    with pytest.raises(DataError, match="images\\[0\\]"):
        tokenize_dataset(dataset, tokenizer, max_length=512)
    tokenized, report = tokenize_dataset(dataset, tokenizer, max_length=512, on_bad_row="skip")
    assert len(tokenized) == 1 and report.bad_examples == 1 and "broken.png" in report.samples["bad"][0][1]
