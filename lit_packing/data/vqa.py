"""Image question answering, offline: easy-VQA's pictures of one coloured shape and questions about them, as image
chats (`lit_packing.data.images`).

    dataset = EasyVQA(split="train", limit=1_000).load()   # columns: id, messages, images, answer, image_id

easy-VQA (PyPI `easy-vqa`, MIT) ships 4,000 train and 1,000 test PNG images of 64 x 64 pixels, one shape (circle,
rectangle, triangle) of one of 8 colours on a pale ground, with 38,575 train and 9,673 test questions whose answers
are one of 13 words (yes, no, the shapes, the colours). Each question becomes one chat:

    user:       [{"type": "image"}, {"type": "text", "text": "what color is the shape?"}]
    assistant:  [{"type": "text", "text": "blue"}]
    images:     [<path of the question's PNG inside the installed package>]

The answer is also a column of its own (`answer`), for an exact-match reward. The questions come in the package's
order: an image's questions one after another.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import datasets
from datasets import Features, Value

from lit_packing.assets import package_file
from lit_packing.data.images import IMAGE_CHAT_FEATURES
from lit_packing.data.sources import Source
from lit_packing.errors import ConfigError

SPLITS = ("train", "test")


def vqa_chat(question: str, answer: str) -> list[dict]:
    """One question about one image as image-chat turns: the image then the question, and the answer."""
    return [
        {"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": question}]},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]


def _easy_vqa(folder: str, split: str, limit: int | None) -> Iterator[dict]:
    questions = json.loads((Path(folder) / split / "questions.json").read_text())
    for k, (question, answer, image_id) in enumerate(questions[:limit]):
        yield {
            "id": f"{split}-{k}",
            "messages": vqa_chat(question, answer),
            "images": [str(Path(folder) / split / "images" / f"{image_id}.png")],
            "answer": answer,
            "image_id": image_id,
        }


class EasyVQA(Source):
    """easy-VQA: questions about 64 x 64 pictures of one coloured shape, with one-word answers (image chat shape).

    Args:
        split: `train` (38,575 questions on 4,000 images), `test` (9,673 on 1,000), or None for both (a
            `DatasetDict`, whose `test` split then becomes the validation set).
        limit: keep the first `limit` questions of each split (None: all).

    Needs `pip install --no-deps easy-vqa==1.0`.
    """

    packages = ("easy-vqa",)

    def __init__(self, split: Literal["train", "test"] | None = "train", limit: int | None = None) -> None:
        if split is not None and split not in SPLITS:
            raise ConfigError(
                "data.source.init_args.split", f"{split!r} is not a split of easy-VQA", "use train or test"
            )
        if limit is not None and limit < 1:
            raise ConfigError("data.source.init_args.limit", f"{limit} is below 1", "use 1 or more, or null for all")
        self.split = split
        self.limit = limit

    def load(self, cache_dir: str | None = None) -> datasets.Dataset | datasets.DatasetDict:
        features = Features({"id": Value("string"), **IMAGE_CHAT_FEATURES, "answer": Value("string"),
                             "image_id": Value("int64")})  # fmt: skip
        splits = {split: self._split(split, features, cache_dir) for split in ((self.split,) if self.split else SPLITS)}
        return splits[self.split] if self.split else datasets.DatasetDict(splits)

    def _split(self, split: str, features: Features, cache_dir: str | None) -> datasets.Dataset:
        folder = str(package_file("easy_vqa", "data"))
        # The rows hold the images' paths in this environment: another environment's cache would point elsewhere.
        where = hashlib.sha256(folder.encode()).hexdigest()[:12]
        return datasets.Dataset.from_generator(
            _easy_vqa,
            features=features,
            gen_kwargs={"folder": folder, "split": split, "limit": self.limit},
            cache_dir=cache_dir,
            fingerprint=f"{self.fingerprint}-{split}-{where}",  # each split its own: caches downstream are keyed by it
        )
