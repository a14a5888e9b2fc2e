"""The default VLM builds offline: Hugging Face's Auto classes load it, its language model's weights are the source
model's exactly, the same seed writes the same weights, and a forward on an image chat gives a finite loss that
reaches the vision tower. Fast tests build it around a tiny random SmolLM2-vocabulary model; the real build (on the
packaged SmolLM2-135M) is `slow`."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from lit_packing import assets
from lit_packing.assets import SMOLVLM_TINY, resolve_pretrained
from lit_packing.batch import INPUT_IDS, LABELS, PIXEL_ATTENTION_MASK, PIXEL_VALUES
from lit_packing.data.images import encode_image_chat
from lit_packing.models import vlm_assets
from lit_packing.models.vlm_assets import (
    ADDED_TOKENS,
    CHAT_TEMPLATE,
    build_vlm,
    image_seq_len,
)

VOCAB = 49_152  # SmolLM2's


@pytest.fixture(scope="module")
def text_model(tmp_path_factory, smollm2_tokenizer) -> str:
    """A tiny random Llama of SmolLM2's vocabulary, saved with SmolLM2's tokenizer."""
    folder = tmp_path_factory.mktemp("text_model")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def built(tmp_path_factory, text_model) -> str:
    return str(build_vlm(text_model, tmp_path_factory.mktemp("vlm")))


def image_chat(color: str = "red") -> dict:
    from PIL import Image

    return {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": color}]},
        ],
        "images": [Image.new("RGB", (300, 200), color)],
    }


def forward(model, processor, example: dict):
    encoded = encode_image_chat(processor, example, max_length=1024)
    return model(
        input_ids=torch.tensor([encoded[INPUT_IDS]]),
        labels=torch.tensor([encoded[LABELS]]),
        pixel_values=encoded[PIXEL_VALUES],
        pixel_attention_mask=encoded[PIXEL_ATTENTION_MASK],
        use_cache=False,
    )


def test_the_same_seed_writes_the_same_weights_and_another_seed_another_vision_tower(built, text_model, tmp_path):
    first = load_file(f"{built}/model.safetensors")
    again = load_file(build_vlm(text_model, tmp_path / "again") / "model.safetensors")
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    other = load_file(build_vlm(text_model, tmp_path / "other", seed=1) / "model.safetensors")
    vision = [k for k in first if ".vision_model." in k and k.endswith("weight") and "norm" not in k]
    assert vision and all(not torch.equal(first[k], other[k]) for k in vision)
    language = [k for k in first if ".text_model.layers." in k]
    assert language and all(torch.equal(first[k], other[k]) for k in language)


def test_auto_classes_load_it_and_the_language_model_is_the_source_models(built, text_model):
    model = AutoModelForImageTextToText.from_pretrained(built)
    processor = AutoProcessor.from_pretrained(built)
    source = LlamaForCausalLM.from_pretrained(text_model)
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    assert type(processor).__name__ == "Idefics3Processor" and processor.image_seq_len == image_seq_len() == 16
    assert len(processor.tokenizer) == VOCAB + len(ADDED_TOKENS) == model.config.text_config.vocab_size
    assert all(
        processor.tokenizer(t, add_special_tokens=False)[INPUT_IDS] == [VOCAB + k] for k, t in enumerate(ADDED_TOKENS)
    )
    assert (
        model.config.image_token_id == processor.image_token_id == processor.tokenizer.convert_tokens_to_ids("<image>")
    )
    theirs, ours = source.model.state_dict(), model.model.text_model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs if k != "embed_tokens.weight")
    embeddings = ours["embed_tokens.weight"]
    assert torch.equal(embeddings[:VOCAB], theirs["embed_tokens.weight"])
    new = embeddings[VOCAB:]
    assert torch.isfinite(new).all() and len(torch.unique(new, dim=0)) == len(ADDED_TOKENS)  # each token its own
    assert model.lm_head.weight.data_ptr() == embeddings.data_ptr()  # tied, as SmolLM2's are


def test_a_forward_on_an_image_chat_gives_a_finite_loss_that_reaches_the_vision_tower(built):
    model = AutoModelForImageTextToText.from_pretrained(built)
    processor = AutoProcessor.from_pretrained(built)
    out = forward(model, processor, image_chat())
    assert torch.isfinite(out.loss)
    out.loss.backward()
    patches = model.model.vision_model.embeddings.patch_embedding.weight.grad
    assert patches is not None and torch.isfinite(patches).all() and patches.abs().sum() > 0
    model.zero_grad()
    assert not torch.equal(out.logits, forward(model, processor, image_chat("blue")).logits)  # pixels change logits


def test_the_chat_template_renders_text_chats_as_smollm2_does(built, smollm2_tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(built)
    assert tokenizer.chat_template == AutoProcessor.from_pretrained(built).chat_template == CHAT_TEMPLATE
    for chat in ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]):  # fmt: skip
        for prompt in (False, True):
            ours = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
            assert ours == smollm2_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"}]}]
    assert tokenizer.apply_chat_template(parts, tokenize=False).endswith("<|im_start|>user\nLook: <image><|im_end|>\n")


def test_the_cache_folder_is_built_once(monkeypatch, tmp_path, text_model):
    monkeypatch.setenv("LIT_PACKING_CACHE", str(tmp_path))
    builds = []

    def build(folder, with_model=True):
        builds.append(with_model)
        return build_vlm(text_model, folder, with_model=with_model)

    monkeypatch.setattr(vlm_assets, "build_vlm", lambda source, folder, with_model=True: build(folder, with_model))
    monkeypatch.setattr(assets, "_smollm2_folder", lambda with_model: text_model)  # not converted into tmp_path
    processor_only = Path(resolve_pretrained(SMOLVLM_TINY, with_model=False))
    assert processor_only.parent == tmp_path and not (processor_only / "model.safetensors").exists()
    assert (processor_only / "processor_config.json").exists() and (processor_only / "config.json").exists()
    folder = Path(resolve_pretrained(SMOLVLM_TINY))
    assert folder == processor_only and (folder / "model.safetensors").exists()
    assert Path(resolve_pretrained(SMOLVLM_TINY)) == folder and builds == [False, True]  # the third call finds it built
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name, folder.name + ".lock"]  # no scratch left


@pytest.mark.slow
def test_the_default_vlm_is_smollm2_135m_with_a_vision_tower(tmp_path):
    """The real build: SmolLM2-135M-Instruct's weights copied exactly (about 5 s here once SmolLM2 is converted)."""
    start = time.perf_counter()
    folder = build_vlm(resolve_pretrained("smollm2"), tmp_path / "vlm")
    seconds = time.perf_counter() - start
    model = AutoModelForImageTextToText.from_pretrained(folder)
    smollm2 = LlamaForCausalLM.from_pretrained(resolve_pretrained("smollm2"))
    theirs, ours = smollm2.model.state_dict(), model.model.text_model.state_dict()
    assert all(torch.equal(ours[k][: theirs[k].shape[0]], theirs[k]) for k in theirs)
    assert model.config.text_config.num_hidden_layers == 30 and model.config.text_config.hidden_size == 576
    assert torch.isfinite(forward(model, AutoProcessor.from_pretrained(folder), image_chat()).loss)
    assert seconds < 120, f"building the default VLM took {seconds:.0f} s"
