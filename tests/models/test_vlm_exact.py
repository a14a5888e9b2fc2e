"""Packed vision-language rows against each document run alone through the unmodified transformers model (fp64).

A pack of a text-only document, a one-image document and a two-image document (images of different sizes, through
the family's own PIL image processor) must give the same logits, summed token loss and gradients of the language
model, the projector and the vision tower as the three documents run one by one, to fp64 rounding. The negative
controls show what each step of `pack_vlm_documents` is for: plain positions on an mRoPE family, whole-row text
positions where the backend reads the bounds from them, the documents' bounds reaching the vision tower, an image
cut by truncation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    CLIPImageProcessorPil,
    Idefics3ImageProcessorPil,
    Qwen2VLImageProcessorPil,
    SmolVLMImageProcessorPil,
)

from lit_packing.batch import (
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    IMAGE_GRID_THW,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    MM_TOKEN_TYPE_IDS,
    PIXEL_ATTENTION_MASK,
    PIXEL_VALUES,
    POSITION_IDS,
    model_inputs,
)
from lit_packing.errors import ConfigError, DataError
from lit_packing.models.loss import token_losses
from lit_packing.models.pack import pack_model
from lit_packing.models.vlm import (
    ROW_BOUNDS,
    mrope_positions,
    pack_vlm_documents,
    rope_index_owner,
    vlm_family,
)

RTOL = 1e-10  # fp64: packed and alone differ by summation order only (measured ~1e-15)
IMAGE, START, END, AROUND = 290, 292, 293, 294  # the image token, Qwen's vision start / end, Idefics3's fake token
TEXT = {
    "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "initializer_range": 0.1, "tie_word_embeddings": False,
}  # fmt: skip
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
QWEN_TOKENS = {"image_token_id": IMAGE, "video_token_id": 291, "vision_start_token_id": START,
               "vision_end_token_id": END}  # fmt: skip
VISION = {"depth": 2, "num_heads": 2, "spatial_merge_size": 2, "temporal_patch_size": 2, "initializer_range": 0.1}
CONFIGS = {
    "qwen2_vl": {"text_config": {**TEXT, "rope_parameters": MROPE}, **QWEN_TOKENS,
                 "vision_config": {**VISION, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2, "patch_size": 14}},
    "qwen2_5_vl": {"text_config": {**TEXT, "rope_parameters": MROPE}, **QWEN_TOKENS,
                   "vision_config": {**VISION, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64,
                                     "patch_size": 14, "window_size": 56, "fullatt_block_indexes": [1]}},
    "qwen3_vl": {"text_config": {**TEXT, "rope_parameters": {**MROPE, "mrope_interleaved": True}}, **QWEN_TOKENS,
                 "vision_config": {**VISION, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64,
                                   "patch_size": 16, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]}},
    "qwen3_vl_moe": {"text_config": {**TEXT, "rope_parameters": {**MROPE, "mrope_interleaved": True},
                                     "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
                     **QWEN_TOKENS,
                     "vision_config": {**VISION, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64,
                                       "patch_size": 16, "num_position_embeddings": 16,
                                       "deepstack_visual_indexes": [0]}},
    "idefics3": {"text_config": {**TEXT, "model_type": "llama"}, "image_token_id": IMAGE, "scale_factor": 2,
                 "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                   "num_attention_heads": 2, "image_size": 32, "patch_size": 8,
                                   "initializer_range": 0.1}},
    "llava": {"text_config": {**TEXT, "model_type": "llama"}, "image_token_id": IMAGE, "vision_feature_layer": -1,
              "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                                "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
                                "projection_dim": 32}},
}  # fmt: skip
CONFIGS["smolvlm"] = CONFIGS["idefics3"]
FAMILIES = list(CONFIGS)
# Where each part's parameters live: the vision tower, the projector (merger / connector), the language model.
PARTS = {
    "qwen": {"tower": ("model.visual.blocks", "model.visual.patch_embed", "model.visual.pos_embed"),
             "projector": ("model.visual.merger", "model.visual.deepstack_merger_list"),
             "language": ("model.language_model", "lm_head")},
    "idefics": {"tower": ("model.vision_model",), "projector": ("model.connector",),
                "language": ("model.text_model", "lm_head")},
    "llava": {"tower": ("model.vision_tower",), "projector": ("model.multi_modal_projector",),
              "language": ("model.language_model", "lm_head")},
}  # fmt: skip


def kind(family: str) -> str:
    return "qwen" if family.startswith("qwen") else "llava" if family == "llava" else "idefics"


def build(family: str, seed: int = 0):
    """The family's tiny model (fp64, sdpa, random weights) and its config."""
    config = AutoConfig.for_model(family, **CONFIGS[family])
    torch.manual_seed(seed)
    experts = {"experts_implementation": "eager"} if family.endswith("moe") else {}  # grouped_mm has no fp64
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa", **experts).double()
    return model, config


def picture(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def documents(family: str, seed: int = 0) -> list[dict]:
    """A text-only document, a one-image document and a two-image document with images of different sizes: each
    image through the family's PIL image processor, its tokens laid out as the family's processor lays them out."""
    gen = torch.Generator().manual_seed(seed)

    def text(n):
        return torch.randint(3, 280, (n,), generator=gen)

    if kind(family) == "qwen":
        patch = CONFIGS[family]["vision_config"]["patch_size"]
        processor = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, temporal_patch_size=2,
                                             min_pixels=(2 * patch) ** 2, max_pixels=64 * patch**2)  # fmt: skip
        sizes = [[], [(2 * patch, 3 * patch)], [(2 * patch, 2 * patch), (4 * patch, 6 * patch)]]
    elif kind(family) == "idefics":
        processor = (Idefics3ImageProcessorPil if family == "idefics3" else SmolVLMImageProcessorPil)(
            size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True
        )
        sizes = [[], [(40, 60)], [(20, 64), (64, 64)]]  # 4 + 1, 2 + 1 and 4 + 1 tiles of 32 x 32
    else:
        processor = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
        sizes = [[], [(40, 60)], [(30, 30), (56, 84)]]
    docs = []
    for d, images in enumerate(sizes):
        ids, pixels = [text(5 + d)], []
        for i, (h, w) in enumerate(images):
            out = processor(images=[picture(h, w, seed=10 * d + i)], return_tensors="pt")
            pixels.append(out)
            ids += image_tokens(family, out) + [text(3 + i)]
        ids = torch.cat(ids)
        labels = ids.masked_fill(ids == IMAGE, -100)
        doc = {"input_ids": ids, "labels": labels}
        if pixels and kind(family) == "qwen":
            doc[PIXEL_VALUES] = torch.cat([p[PIXEL_VALUES] for p in pixels]).double()
            doc[IMAGE_GRID_THW] = torch.cat([p[IMAGE_GRID_THW] for p in pixels])
            doc[MM_TOKEN_TYPE_IDS] = (ids == IMAGE).int()
        elif pixels and kind(family) == "idefics":
            doc[PIXEL_VALUES] = torch.cat([p[PIXEL_VALUES] for p in pixels], dim=1).double()
            doc[PIXEL_ATTENTION_MASK] = torch.cat([p[PIXEL_ATTENTION_MASK] for p in pixels], dim=1)
        elif pixels:
            doc[PIXEL_VALUES] = torch.cat([p[PIXEL_VALUES] for p in pixels]).double()
        docs.append(doc)
    return docs


def image_tokens(family: str, processed) -> list[torch.Tensor]:
    if kind(family) == "qwen":
        n = int(processed[IMAGE_GRID_THW].prod()) // 4
        return [torch.tensor([START]), torch.full((n,), IMAGE), torch.tensor([END])]
    if kind(family) == "idefics":  # per tile: <fake_token_around_image> <row_r_col_c> 4 image tokens; then one more
        tiles = processed[PIXEL_VALUES].shape[1]
        return [torch.tensor([AROUND, 295 + t, *[IMAGE] * 4]) for t in range(tiles)] + [torch.tensor([AROUND])]
    return [torch.full((4,), IMAGE)]


def alone(model, docs: list[dict]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Each document through the model alone, as transformers runs it (its own positions): logits (T, V) in order,
    the summed token loss, and every parameter's gradient of that sum."""
    model.zero_grad()
    logits, total = [], 0.0
    for doc in docs:
        inputs = {k: v[None] if k in ("input_ids", MM_TOKEN_TYPE_IDS) else v for k, v in doc.items() if k != "labels"}
        out = model(**inputs, use_cache=False).logits
        total = total + token_losses(out, doc["labels"][None])[0].sum()
        logits.append(out[0].detach())
    total.backward()
    return torch.cat(logits), total.detach(), gradients(model)


def packed(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    out = model(**model_inputs(batch), use_cache=False).logits
    total = token_losses(out, batch["labels"])[0].sum()
    total.backward()
    return out[0].detach(), total.detach(), gradients(model)


def gradients(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-300)


@pytest.fixture(scope="module")
def runs():
    """Per family: the model's gradients and logits alone and packed (one build and two runs per family)."""
    found = {}

    def run(family: str):
        if family not in found:
            model, _ = build(family)
            docs = documents(family)
            reference = alone(model, docs)
            batch = pack_vlm_documents(model, docs)
            pack_model(model, "per_example")
            found[family] = (reference, packed(model, batch), batch, model)
        return found[family]

    return run


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_logits_and_loss_equal_each_document_alone(runs, family):
    (logits, loss, _), (got_logits, got_loss, _), batch, _ = runs(family)
    assert batch[CU_SEQ_LENS_Q].tolist()[-1] == got_logits.shape[0] == logits.shape[0]
    assert relative(got_logits, logits) < RTOL
    assert abs(float(got_loss - loss)) <= RTOL * abs(float(loss))


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_gradients_of_every_tower_equal_each_document_alone(runs, family):
    (_, _, grads), (_, _, got), _, _ = runs(family)
    assert set(got) == set(grads)
    for part, prefixes in PARTS[kind(family)].items():
        names = [n for n in grads if n.startswith(prefixes)]
        assert names, f"{family}: no gradient in its {part}"
        # Relative to the part's largest gradient: some are 0 in exact arithmetic (a key bias moves no softmax), and
        # their ~1e-17 rounding noise has no scale of its own.
        scale = max(float(grads[n].abs().max()) for n in names)
        worst = max(float((got[n] - grads[n]).abs().max()) for n in names) / scale
        assert worst < RTOL, f"{family} {part}: {worst:.1e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_tower_attention_sees_each_image_alone(family):
    """The tower's attention gets none of the row's bounds; Qwen's gets its images' (`cu_seqlens` per image)."""
    model, _ = build(family)
    batch = pack_vlm_documents(model, documents(family))
    pack_model(model, "per_example")
    family_ = vlm_family(model.config)
    tower = model.get_submodule(family_.layout.tower)
    calls = []
    for module in tower.modules():
        if type(module).__name__.endswith("Attention"):
            module.register_forward_pre_hook(lambda m, args, kwargs: calls.append(kwargs), with_kwargs=True)
    with torch.no_grad():
        model(**model_inputs(batch), use_cache=False)
    assert calls and not any(ROW_BOUNDS & set(kwargs) for kwargs in calls)
    if kind(family) == "qwen":  # every call cut at every image's bounds (Qwen2.5-VL's windows cut within them)
        grid = batch[IMAGE_GRID_THW]
        images = [0, *(grid[:, 1] * grid[:, 2]).cumsum(0).tolist()]
        cuts = [kwargs["cu_seqlens"].tolist() for kwargs in calls]
        assert images in cuts and all(set(images) <= set(cu) for cu in cuts)


def test_documents_bounds_reaching_the_llava_tower_are_refused(monkeypatch):
    """Without `keep_tower_apart` (which `pack_model` calls for a vision-language model), LLaVA hands
    `cu_seq_lens_q` (the documents') to its CLIP tower: the packed backend refuses them there (a packed row is one
    row, and nothing admitted the tower's attention)."""
    import lit_packing.models.vlm as vlm

    monkeypatch.setattr(vlm, "keep_tower_apart", lambda model: None)
    model, _ = build("llava")
    batch = pack_vlm_documents(model, documents("llava"))
    pack_model(model, "per_example")
    with pytest.raises(ValueError, match="a packed batch"), torch.no_grad():  # (3 images, 5 patches): not one row
        model(**model_inputs(batch), use_cache=False)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_plain_restarting_positions_on_an_mrope_family_are_not_exact(runs, family):
    (logits, _, _), _, batch, model = runs(family)
    plain = {**batch, POSITION_IDS: batch[POSITION_IDS][0]}  # (1, T) restarting: every image token a new position
    with torch.no_grad():
        got = model(**model_inputs(plain), use_cache=False).logits[0]
    assert relative(got, logits) > 1e-3


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_whole_row_text_positions_join_the_documents(runs, family):
    """Without `cu_seq_lens` the backend reads the bounds from the text positions: restarting per document, exact;
    one whole-row run 0..T-1, the documents attend to each other."""
    (logits, _, _), _, batch, model = runs(family)
    bare = {k: v for k, v in batch.items() if k not in (CU_SEQ_LENS_Q, CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K)}
    positions = bare[POSITION_IDS].clone()
    whole = positions.clone()
    whole[0] = torch.arange(positions.shape[-1])  # the text row (4-row mRoPE) or the only row (1-D)
    with torch.no_grad():
        per_document = model(**model_inputs(bare), use_cache=False).logits[0]
        joined = model(**model_inputs({**bare, POSITION_IDS: whole}), use_cache=False).logits[0]
    assert relative(per_document, logits) < RTOL
    assert relative(joined, logits) > 1e-3


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_whole_row_mrope_positions_are_caught_though_rope_is_relative(runs, family):
    """`get_rope_index` over the whole row only shifts each document's positions, which RoPE cancels in exact
    arithmetic; its fp32 angles do not (measured ~2e-7), so the oracle still tells it from per-document positions."""
    (logits, _, _), _, batch, model = runs(family)
    spatial, _ = model.model.get_rope_index(
        batch["input_ids"], mm_token_type_ids=batch[MM_TOKEN_TYPE_IDS], image_grid_thw=batch[IMAGE_GRID_THW]
    )
    assert not torch.equal(spatial, batch[POSITION_IDS][1:])
    whole = {**batch, POSITION_IDS: torch.cat([batch[POSITION_IDS][:1], spatial])}
    with torch.no_grad():
        got = model(**model_inputs(whole), use_cache=False).logits[0]
    assert relative(got, logits) > 100 * RTOL


def test_three_row_mrope_positions_are_exact_with_explicit_bounds(runs):
    """The `mrope-3row` layout (no text row: the bounds come from `cu_seq_lens` alone) is the 4-row one's last 3."""
    (logits, _, _), _, batch, model = runs("qwen2_vl")
    docs = [{**doc, MM_TOKEN_TYPE_IDS: (doc["input_ids"] == IMAGE).int()} for doc in documents("qwen2_vl")]
    three = mrope_positions(rope_index_owner(model), docs, "mrope-3row")  # (3, 1, T)
    assert torch.equal(three, batch[POSITION_IDS][1:])
    with torch.no_grad():
        got = model(**model_inputs({**batch, POSITION_IDS: three}), use_cache=False).logits[0]
    assert relative(got, logits) < RTOL


@pytest.mark.parametrize("family", ["qwen2_vl", "idefics3", "llava"])
def test_an_image_cut_by_truncation_is_refused(family):
    model, _ = build(family)
    docs = documents(family)
    cut = {**docs[2]}
    last = int(torch.nonzero(cut["input_ids"] == IMAGE)[-1])
    cut["input_ids"], cut["labels"] = cut["input_ids"][:last], cut["labels"][:last]  # inside the last image
    cut.pop(MM_TOKEN_TYPE_IDS, None)
    with pytest.raises(DataError, match="document 1 holds"):
        pack_vlm_documents(model, [docs[0], cut])


def test_positions_restart_per_document_as_the_worked_example():
    """The module docstring's example: 3 text tokens; 2 text tokens, a 4 x 6-patch image, 1 text token."""
    _, config = build("qwen2_vl")
    image = {PIXEL_VALUES: torch.zeros(24, 3 * 2 * 14 * 14), IMAGE_GRID_THW: torch.tensor([[1, 4, 6]])}
    docs = [{"input_ids": torch.tensor([5, 6, 7])}, {"input_ids": torch.tensor([5, 6, *[IMAGE] * 6, 7]), **image}]
    batch = pack_vlm_documents(config, docs)  # from the config alone: a weightless skeleton's get_rope_index
    assert batch[CU_SEQ_LENS_Q].tolist() == [0, 3, 12]
    assert batch[POSITION_IDS][:, 0].tolist() == [
        [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8],
        [0, 1, 2, 0, 1, 2, 2, 2, 2, 2, 2, 5],
        [0, 1, 2, 0, 1, 2, 2, 2, 3, 3, 3, 5],
        [0, 1, 2, 0, 1, 2, 3, 4, 2, 3, 4, 5],
    ]
    assert batch["labels"][0, [0, 3]].tolist() == [-100, -100]  # no document predicts the next one's first token


def test_a_refused_family_is_refused_in_one_line_naming_why():
    config = AutoConfig.for_model("gemma3")
    with pytest.raises(ConfigError, match="bidirectionally inside each image"):
        pack_vlm_documents(config, [{"input_ids": torch.tensor([5, 6])}])
