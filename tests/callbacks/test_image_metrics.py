"""`train/image_tokens`: the tokens of a step that hold an image's features, counted on the host by
`ImageChatCollator` (`counts["image_tokens"]`) and logged by `PackingMonitor` with no device sync."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from transformers import AutoConfig, AutoProcessor, AutoTokenizer

from lit_packing.assets import resolve_pretrained
from lit_packing.batch import COUNTS, IMAGES, INPUT_IDS, LABELS
from lit_packing.data import ImageChatCollator
from lit_packing.data.collate import PackedCollator
from lit_packing.data.images import encode_image_chat
from lit_packing.models.vlm_assets import build_vlm
from tests.callbacks.test_callbacks import fit
from tests.conftest import TINY


@pytest.fixture(scope="module")
def vlm_folder(tmp_path_factory):
    """The tiny SmolVLM's processor and config (no weights): 256-px tiles of 16 `<image>` tokens, plus a global
    view when an image is split."""
    folder = tmp_path_factory.mktemp("vlm")
    AutoConfig.for_model(**TINY).save_pretrained(folder / "text")
    AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False)).save_pretrained(folder / "text")
    return str(build_vlm(folder / "text", folder / "model", with_model=False))


def chat(question: str, answer: str, image: Image.Image | None) -> dict:
    parts = [{"type": "image"}] * (image is not None) + [{"type": "text", "text": question}]
    return {
        "messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": [{"type": "text",
                                                                                          "text": answer}]}],
        "images": [image] if image is not None else [],
    }  # fmt: skip


def tokenized(processor, example: dict) -> dict:
    """An example as the tokenized table holds it: ids, labels and its images (as given)."""
    encoded = encode_image_chat(processor, example, max_length=512)
    return {INPUT_IDS: encoded[INPUT_IDS], LABELS: encoded[LABELS], IMAGES: example["images"]}


def picture(width: int, height: int) -> Image.Image:
    return Image.fromarray(np.full((height, width, 3), 128, dtype=np.uint8))


def test_a_step_of_image_chats_logs_its_image_tokens(vlm_folder, tmp_path, monkeypatch):
    """64 x 64: longest edge to 512, 2 x 2 tiles + the global view = 5 tiles, 80 `<image>` tokens; 300 x 100:
    512 x 170, 1 x 2 tiles + the global view = 3 tiles, 48; a text chat: none. A step of text chats logs 0."""
    processor = AutoProcessor.from_pretrained(vlm_folder)
    examples = [
        tokenized(processor, chat("What shape is it?", "circle", picture(64, 64))),
        tokenized(processor, chat("Any colour?", "no", None)),
        tokenized(processor, chat("How wide is it?", "wide", picture(300, 100))),
    ]
    collate = ImageChatCollator(pad_token_id=processor.tokenizer.pad_token_id)
    collate.connect_processor(vlm_folder)
    images = collate(examples)
    assert images[COUNTS]["image_tokens"] == 80 + 48 == int((images[INPUT_IDS] == processor.image_token_id).sum())
    assert images[COUNTS]["real_tokens"] == sum(len(ex[INPUT_IDS]) for ex in examples)
    text = collate([examples[1]])
    assert text[COUNTS]["image_tokens"] == 0

    _, rows = fit(tmp_path, monkeypatch, [images, text])
    assert [row["train/image_tokens"] for row in rows] == [128, 0]


def test_text_batches_log_no_image_tokens(tmp_path, monkeypatch):
    text = PackedCollator()([{INPUT_IDS: [5, 6, 7], LABELS: [5, 6, 7]}])
    assert "image_tokens" not in text[COUNTS]
    _, rows = fit(tmp_path, monkeypatch, [text])
    assert rows and "train/image_tokens" not in rows[0]


def test_gradient_accumulation_sums_the_image_tokens_of_the_step(vlm_folder, tmp_path, monkeypatch):
    processor = AutoProcessor.from_pretrained(vlm_folder)
    collate = ImageChatCollator(pad_token_id=processor.tokenizer.pad_token_id)
    collate.connect_processor(vlm_folder)
    small = collate([tokenized(processor, chat("Wide?", "yes", picture(300, 100)))])  # 48
    large = collate([tokenized(processor, chat("Square?", "yes", picture(64, 64)))])  # 80
    _, rows = fit(tmp_path, monkeypatch, [small, large, large, large], accumulate=2)
    assert [row["train/image_tokens"] for row in rows] == [48 + 80, 80 + 80]
