"""Collating image chats: a pack's examples flattened as `PackedCollator` flattens them, and their images loaded,
processed and laid out as the vision-language model takes them, here in the loader workers.

    collate = ImageChatCollator(pad_token_id=2)
    collate.connect_processor("path/to/model")   # the data module does this: the tokenizer's folder
    batch = collate(examples)                    # input_ids (1, T), ..., pixel_values, pixel_attention_mask

Each example's images (`images`, as the tokenized table holds them) are decoded (`lit_packing.data.images.
load_image`, an unreadable one named by its row) and run through the processor's image processor, one example at
a time; `lit_packing.models.vlm.add_images` then concatenates the image tensors in document order and, for
families with multimodal (mRoPE) positions, computes each document's positions alone, so they restart per
document. The tokenized ids already hold each image's tokens, so nothing here changes the row's length: the
sampler's plan and the memory estimate hold as they are. The batch's `counts` also count its `image_tokens` (ids
equal to the model's `image_token_id`), on the host: `PackingMonitor` logs them with no device sync.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lit_packing.batch import COUNTS, IMAGES, INDEX, INPUT_IDS, LABELS
from lit_packing.data.collate import PackedCollator
from lit_packing.data.images import load_image
from lit_packing.errors import ConfigError


class ImageChatCollator(PackedCollator):
    """`PackedCollator` for image chats (and text examples beside them): the row, and its images' tensors.

    Args: as `PackedCollator` (`isolate=False` is refused: an image chat's positions are its own).
    """

    def __init__(
        self, pad_token_id: int = 0, pad_to_multiple_of: int | None = None, bucket_sizes: list[int] | None = None
    ) -> None:
        super().__init__(pad_token_id, pad_to_multiple_of, bucket_sizes)
        self.folder: str | None = None
        self._processor = None
        self._config = None

    def connect_processor(self, folder: str) -> None:
        """The model's folder (or Hub name), whose processor and config this collator reads (loaded on first use)."""
        self.folder = folder

    def __getstate__(self) -> dict:  # loader workers load the processor themselves
        return {**self.__dict__, "_processor": None, "_config": None}

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        from lit_packing.models.vlm import add_images  # the model's side: positions and the families' layouts

        batch = super().__call__(examples)
        documents = [self._document(ex) for ex in examples if len(ex[INPUT_IDS]) > 0]
        config = self._loaded()[1]
        batch[COUNTS]["image_tokens"] = int((batch[INPUT_IDS] == config.image_token_id).sum())  # a host tensor
        return add_images(batch, config, documents)

    def _loaded(self):
        if self._processor is None:
            if self.folder is None:
                raise ConfigError(
                    "data.collator", "ImageChatCollator has no processor", "use it through PackingDataModule"
                )
            from transformers import AutoConfig, AutoProcessor

            self._processor = AutoProcessor.from_pretrained(self.folder)
            self._config = AutoConfig.from_pretrained(self.folder)
        return self._processor, self._config

    def _document(self, example: dict[str, Any]) -> dict[str, Any]:
        processor, _ = self._loaded()
        ids = np.asarray(example[INPUT_IDS], dtype=np.int64)
        document = {INPUT_IDS: ids, LABELS: np.asarray(example[LABELS], dtype=np.int64)}
        images = example.get(IMAGES)
        if images is None and IMAGES in example:
            raise ConfigError(
                "data.sampler",
                "a slice of an image chat reached the collator (fixed-length packing cuts examples apart)",
                "use a sampler that keeps examples whole: best-fit, multipack, length-grouped or random mini-batches",
            )
        if images:
            row = example.get(INDEX, -1)
            pictures = [load_image(value, row, k) for k, value in enumerate(images)]
            document.update(processor.image_processor(images=[pictures], return_tensors="pt"))
        return document
