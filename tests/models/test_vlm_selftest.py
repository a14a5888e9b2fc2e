"""The isolation self-test on vision-language models (`lit_packing.models.selftest`): besides the text examples of
the batch, documents with images made from the model's config (`vlm.probe_documents`), packed and compared with
each document alone; it fails, naming the cause, when the vision tower gets the row's bounds or when the
documents' positions run on across the row."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

import lit_packing.models.selftest as selftest
from lit_packing.batch import INPUT_IDS, POSITION_IDS
from lit_packing.errors import IsolationError
from lit_packing.models.pack import pack_model
from lit_packing.models.selftest import check_image_isolation, check_isolation
from lit_packing.models.vlm import pack_vlm_documents, probe_documents, vlm_family
from tests.helpers import make_examples
from tests.models.test_vlm_exact import CONFIGS, FAMILIES, IMAGE

LENGTHS = [9, 4, 15, 6]


def build(family: str) -> torch.nn.Module:
    """The family's tiny model (fp32, as it trains; random weights), not yet packed."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **CONFIGS[family])
    experts = {"experts_implementation": "eager"} if family.endswith("moe") else {}
    return AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa", **experts)


def text_batch(model) -> dict:
    """Text examples as `ImageChatCollator` packs them for the model (mRoPE families: 4-row positions); no id
    reaches the image token's."""
    return pack_vlm_documents(model, make_examples(LENGTHS, vocab=IMAGE))


@pytest.mark.parametrize("family", FAMILIES)
def test_probe_documents_hold_images_of_two_sizes_with_their_tokens(family):
    config = AutoConfig.for_model(family, **CONFIGS[family])
    documents = probe_documents(config)
    tokens = [int((d[INPUT_IDS] == IMAGE).sum()) for d in documents]
    assert tokens[0] == 0 and 0 < tokens[1] < tokens[2]
    pack_vlm_documents(config, documents)  # its check: every document's image tokens are its images' count


@pytest.mark.parametrize("family", ["idefics3", "qwen2_vl", "llava"])
def test_self_test_packs_documents_with_images_and_passes(family):
    model = build(family)
    pack_model(model, "per_example")
    tower = model.get_submodule(vlm_family(model.config).layout.tower)
    images = []
    tower.register_forward_hook(lambda module, args, output: images.append(module))
    assert check_isolation(model, text_batch(model), "per_example") < 1e-4
    assert images  # the tower ran: the documents with images were packed and checked
    assert check_image_isolation(model, "sdpa", 1e-4).diff < 1e-5


def test_a_tower_handed_the_rows_bounds_fails_naming_it(monkeypatch):
    """Without `keep_tower_apart`, LLaVA hands `cu_seq_lens_q` (the documents') to its CLIP tower, whose attention
    refuses a packed batch: the self-test fails on the documents with images, naming the tower and the fix."""
    import lit_packing.models.vlm as vlm

    monkeypatch.setattr(vlm, "keep_tower_apart", lambda model: None)
    model = build("llava")
    pack_model(model, "per_example")
    with pytest.raises(IsolationError) as caught:
        check_isolation(model, text_batch(model), "per_example")
    message = str(caught.value)
    assert "attn_backend=per_example on documents with images: the packed forward raised ValueError" in message
    assert "vision tower model.vision_tower (CLIPVisionModel) was handed the row's bounds (cu_seq_lens_k" in message
    assert "lit_packing.core.pack_model" in message and isinstance(caught.value.__cause__, ValueError)


@pytest.mark.parametrize("family", ["qwen2_vl", "idefics3"])
def test_whole_row_positions_fail_naming_them(monkeypatch, family):
    """Attention that reads the documents' bounds from the positions (transformers' sdpa; the backends do when a
    batch has no `cu_seq_lens`): restarting per document, the self-test passes; positions 0..T-1 over the whole
    row (the text row of mRoPE's four) join the documents, and the self-test fails naming the positions."""
    model = build(family)
    pack_model(model, "per_example")
    model.set_attn_implementation("sdpa")
    assert check_isolation(model, text_batch(model), "sdpa") < 1e-4

    def whole_row(model_or_config, documents):
        batch = pack_vlm_documents(model_or_config, documents)
        positions = batch[POSITION_IDS].clone()
        positions.view(-1, positions.shape[-1])[0] = torch.arange(positions.shape[-1])
        return {**batch, POSITION_IDS: positions}

    monkeypatch.setattr(selftest, "pack_vlm_documents", whole_row)
    with pytest.raises(IsolationError, match=r"attn_backend=sdpa on documents with images: packed logits differ "
                       r"from each document run alone by max abs .*document 1 starts at \[6"):  # fmt: skip
        check_isolation(model, text_batch(model), "sdpa")
