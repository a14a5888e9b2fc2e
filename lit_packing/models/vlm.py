"""Packed rows for vision-language models: several documents with images in one row, each document attending only
inside itself in the language model, each image only inside itself in the vision tower.

    batch = pack_vlm_documents(model, documents)      # one row: ids, labels, positions, cu_seq_lens, the images
    pack_model(model, backend="per_example")   # refuses an unproven family; keeps the vision tower off the row's bounds
    logits = model(**model_inputs(batch), use_cache=False).logits

What `pack_vlm_documents` does, in order: checks each document's image tokens against its images (an image cut by
truncation is refused, naming the document); concatenates the ids and labels as `PackedCollator` does (each
document's first label masked, `cu_seq_lens_q/k` and `max_length_q/k` at its bounds); computes each document's
positions ALONE and concatenates them, so they restart per document: mRoPE families by the model's own
`get_rope_index` (4 rows, text row first, where the family's forward reads them: its text row restarts too;
else its 3 rows), others `0..L-1`; concatenates the images' tensors (pixels, grids, masks) in document order.

Worked example (Qwen2-VL, spatial merge 2): a text document of 3 tokens, then one of 2 text tokens, an image of
4 x 6 patches (2 x 3 = 6 tokens) and 1 text token, is a row of T = 12 with cu_seq_lens [0, 3, 12] and

    text row      [0 1 2 | 0 1 2 3 4 5 6 7 8]
    temporal      [0 1 2 | 0 1 2 2 2 2 2 2 5]     the image's tokens share t = 2 ...
    height        [0 1 2 | 0 1 2 2 2 3 3 3 5]     ... and run over its 2 rows ...
    width         [0 1 2 | 0 1 2 3 4 2 3 4 5]     ... and 3 columns; text resumes at 2 + max(2, 3)

The vision tower must see each image alone, and the language model the documents' bounds: transformers hands the
model's keyword arguments to the vision tower too (`get_image_features(**kwargs)`). For Qwen-VL, transformers'
`accepts_precomputed_kwargs` drops `cu_seq_lens_*` / `max_length_*` on the way (not `key_index` and the other
bounds); LLaVA hands them all to its CLIP tower, whose attention would cut its patches at the documents' bounds.
`pack_model` drops them at the tower's door (`keep_tower_apart`), and the tower keeps its own per-image bounds
(Qwen-VL: `cu_seqlens` from `image_grid_thw`; SigLIP and CLIP: one image a row). A tower that still got them is
refused by the packed backend (a packed row is one row; its attention modules are never admitted).

The family table (`vlm_family`) says, for the installed transformers, which model types are exact and how, and
refuses the others in one line; a type it does not list is refused as not yet proven.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import torch
from transformers import AutoModel, PretrainedConfig, PreTrainedModel

from lit_packing.batch import (
    CONTEXT,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    GATHERED_INDEX,
    IGNORE_INDEX,
    IMAGE_GRID_THW,
    IMAGE_SIZES,
    INPUT_IDS,
    KEY_INDEX,
    LABELS,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    MM_TOKEN_TYPE_IDS,
    PACKED_KEYS,
    PIXEL_ATTENTION_MASK,
    PIXEL_VALUES,
    POSITION_IDS,
    SEQ_IDX,
)
from lit_packing.errors import ConfigError, DataError

# What a packed row says of its documents' bounds: the language model's, never the vision tower's.
ROW_BOUNDS = frozenset(PACKED_KEYS) | {KEY_INDEX, GATHERED_INDEX, CONTEXT}

# How a family's positions are laid out: `mrope-4row` (4, 1, T), the text row then time / height / width, for
# forwards that split a 4-row tensor; `mrope-3row` (3, 1, T), the bounds then from `cu_seq_lens` alone; `1d` (1, T).
Route = Literal["mrope-4row", "mrope-3row", "1d"]


@dataclass(frozen=True)
class ImageLayout:
    """How a family's documents hold their images.

    Attributes:
        keys: each image tensor's key and the axis the documents' tensors are concatenated on.
        tower: the vision tower, from the model (the module whose keyword arguments lose the row's bounds).
        tokens: the image tokens a document's images need (config, document) -> int.
    """

    keys: tuple[tuple[str, int], ...]
    tower: str
    tokens: Callable[[PretrainedConfig, Mapping[str, torch.Tensor]], int]


@dataclass(frozen=True)
class VlmFamily:
    """One model type under packing: exact by `route` (with `layout` and the `proof`), or refused (`refusal`)."""

    model_type: str
    route: Route | None = None
    layout: ImageLayout | None = None
    proof: str = ""
    refusal: str = ""

    @property
    def exact(self) -> bool:
        return self.route is not None


def _qwen_tokens(config: PretrainedConfig, doc: Mapping[str, torch.Tensor]) -> int:
    grid = doc.get(IMAGE_GRID_THW)
    merge = config.vision_config.spatial_merge_size
    return 0 if grid is None else int((grid.prod(-1) // merge**2).sum())


def _idefics_tokens(config: PretrainedConfig, doc: Mapping[str, torch.Tensor]) -> int:
    pixels = doc.get(PIXEL_VALUES)  # (1, tiles, C, H, W); all-zero tiles are padding, dropped by the model
    if pixels is None:
        return 0
    tiles = int((pixels.flatten(2) != 0).any(-1).sum())
    vision = config.vision_config
    return tiles * int((vision.image_size // vision.patch_size) ** 2 / config.scale_factor**2)


def _llava_tokens(config: PretrainedConfig, doc: Mapping[str, torch.Tensor]) -> int:
    pixels = doc.get(PIXEL_VALUES)  # (images, C, H, W)
    if pixels is None:
        return 0
    vision = config.vision_config
    cls = 1 if config.vision_feature_select_strategy == "full" else 0
    return len(pixels) * ((vision.image_size // vision.patch_size) ** 2 + cls)


QWEN = ImageLayout(((PIXEL_VALUES, 0), (IMAGE_GRID_THW, 0)), "model.visual", _qwen_tokens)
IDEFICS = ImageLayout(((PIXEL_VALUES, 1), (PIXEL_ATTENTION_MASK, 1)), "model.vision_model", _idefics_tokens)
LLAVA = ImageLayout(((PIXEL_VALUES, 0), (IMAGE_SIZES, 0)), "model.vision_tower", _llava_tokens)

_PROOF = "tests/models/test_vlm_exact.py: fp64 logits, loss and every tower's gradients against each document alone"
_PROVEN = {
    "qwen2_vl": ("mrope-4row", QWEN),
    "qwen2_5_vl": ("mrope-4row", QWEN),
    "qwen3_vl": ("mrope-4row", QWEN),
    "qwen3_vl_moe": ("mrope-4row", QWEN),
    "idefics3": ("1d", IDEFICS),
    "smolvlm": ("1d", IDEFICS),
    "llava": ("1d", LLAVA),
}

# Refusals, one line each, by reason. A family not proven yet says so; the others say why it cannot be packed here.
_REFUSED = {
    "its language model attends bidirectionally inside each image (a blockwise mask from the image tokens' types), "
    "and the packed backends mask only by cu_seq_lens, causally: image tokens would see less than alone": (
        "gemma3", "shieldgemma2", "gemma4", "gemma4_unified",
    ),
    "a prefix LM: the image and the prompt attend bidirectionally, which the causal packed backends do not mask": (
        "paligemma",
    ),
    "an encoder-decoder: its decoder cross-attends the whole encoder output, and packing is for causal decoders": (
        "florence2", "pix2struct", "pp_formulanet", "pp_chart2table", "t5gemma2", "udop", "vision-encoder-decoder",
    ),
    "its text cross-attends the images in cross-attention layers, which the packed backends do not cut per "
    "document": ("mllama", "idefics", "evolla"),
    "not a next-token language model (block diffusion / flow-matching actions): packing is for causal LMs": (
        "diffusion_gemma", "pi0",
    ),
    "mRoPE with 4-row positions like Qwen2-VL, but its own get_rope_index and vision tower are not yet proven "
    "(no oracle test against each document alone)": (
        "cohere_compass", "cosmos3_edge", "cosmos3_omni", "ernie4_5_vl_moe", "glm46v", "glmga", "glm4v",
        "glm4v_moe", "glm_ocr", "hunyuan_vl", "hy_v4_vl", "paddleocr_vl", "minicpmv4_7", "qwen4_exp",
    ),
    "Qwen-VL's mRoPE, but its audio tower and audio-interleaved positions are not yet proven": (
        "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker",
    ),
    "Qwen-VL's mRoPE, but its language model's linear-attention (gated delta) layers are not yet proven with "
    "images in the row": ("qwen3_5", "qwen3_5_moe"),
    "1-D positions like LLaVA, but its image tokens per image (tiling, newline tokens, resampler) and vision tower "
    "are not yet proven (no oracle test against each document alone)": (
        "aya_vision", "cohere2_vision", "fast_vlm", "got_ocr2", "granite4_vision", "granite_docling", "idefics2",
        "internvl", "janus", "lfm2_vl", "lfm3_vl", "lighton_ocr", "llava_next", "llava_next_video",
        "llava_onevision", "mistral3", "mistral_large4", "ovis2", "perception_lm", "qianfan_ocr", "video_llava",
        "vipllava", "deepseek_vl", "deepseek_vl_hybrid", "deepseek_ocr2", "hyperclovax_vision_v2", "kimi_k25",
        "llama4", "minimax_m3_vl", "molmo2", "step3p7", "unlimited_ocr", "video_llama_3",
    ),
}  # fmt: skip
NOT_PROVEN = "not yet proven under packing: no oracle test of its packed forward against each document run alone"
_UNPROVEN = (
    "apertus1p5", "aria", "blip", "blip-2", "chameleon", "dots3_note", "emu3", "exaone4_5", "fuyu", "gemma3n",
    "git", "glm5_next", "inkling2", "inkling2_loop", "inkling_mm_model", "instructblip", "instructblipvideo",
    "kosmos-2", "kosmos-2.5", "minicpm_ocr", "minicpmv4_6", "mistral4", "muse_glimmer", "muse_spark",
    "nemotron_h_omni",
)  # fmt: skip

VLM_FAMILIES: dict[str, VlmFamily] = {
    **{t: VlmFamily(t, route, layout, _PROOF) for t, (route, layout) in _PROVEN.items()},
    **{t: VlmFamily(t, refusal=why) for why, types in _REFUSED.items() for t in types},
    **{t: VlmFamily(t, refusal=NOT_PROVEN) for t in _UNPROVEN},
}


def vlm_family(config: PretrainedConfig | str) -> VlmFamily:
    """The table's entry for a config (or a model type); a type the table does not list is refused as not proven.

    >>> vlm_family("qwen2_vl").route, vlm_family("gemma3").exact
    ('mrope-4row', False)
    """
    model_type = config if isinstance(config, str) else config.model_type
    return VLM_FAMILIES.get(model_type, VlmFamily(model_type, refusal=f"{NOT_PROVEN} (not in lit_packing's table)"))


def exact_family(config: PretrainedConfig) -> VlmFamily:
    """`vlm_family`, or a `ConfigError` naming the refusal."""
    family = vlm_family(config)
    if not family.exact:
        raise ConfigError(
            "model.name_or_path",
            f"{config.model_type} cannot train packed: {family.refusal}",
            "train it one document a row (its families-table entry: lit_packing.models.vlm)",
        )
    return family


def pack_vlm_documents(
    model_or_config: PreTrainedModel | PretrainedConfig, documents: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """One packed row of `documents` (see the module docstring), in `PackedCollator`'s format plus the images.

    Args:
        model_or_config: the model, or its config (mRoPE positions then come from a weightless skeleton of it).
        documents: each `input_ids` (L,), `labels` (L,) (default: the ids, image tokens masked), and its images
            in the family's keys:
            `pixel_values` + `image_grid_thw` (Qwen-VL, with `mm_token_type_ids` (L,) or derived from the image
            token), `pixel_values` (1, tiles, C, H, W) + `pixel_attention_mask` (Idefics3 / SmolVLM), `pixel_values`
            (images, C, H, W) (LLaVA).

    Returns:
        `input_ids`, `labels` (1, T) (each document's first label -100, as `PackedCollator` masks it);
        `position_ids` (1, T), or (4 | 3, 1, T) for mRoPE; `cu_seq_lens_q/k`, `max_length_q/k`, `seq_idx`; the
        images' keys concatenated in document order.

    Raises:
        ConfigError: the family is not exact under packing (`vlm_family`).
        DataError: a document's image tokens do not match its images (an image cut by truncation), or it has videos.
    """
    config = model_or_config if isinstance(model_or_config, PretrainedConfig) else model_or_config.config
    docs = [{**d, INPUT_IDS: torch.as_tensor(d[INPUT_IDS]).reshape(-1)} for d in documents]
    docs = [d for d in docs if len(d[INPUT_IDS])]
    image = config.image_token_id
    labels = [d[INPUT_IDS].masked_fill(d[INPUT_IDS] == image, IGNORE_INDEX) if d.get(LABELS) is None
              else torch.as_tensor(d[LABELS]).reshape(-1).clone() for d in docs]  # fmt: skip
    for y in labels:
        y[0] = IGNORE_INDEX  # no token before a document's first predicts it
    lengths = torch.tensor([len(d[INPUT_IDS]) for d in docs])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    longest = int(lengths.max())
    batch = {
        INPUT_IDS: torch.cat([d[INPUT_IDS] for d in docs])[None], LABELS: torch.cat(labels)[None],
        POSITION_IDS: torch.cat([torch.arange(n) for n in lengths.tolist()])[None],
        CU_SEQ_LENS_Q: cu, CU_SEQ_LENS_K: cu.clone(), MAX_LENGTH_Q: longest, MAX_LENGTH_K: longest,
        SEQ_IDX: torch.repeat_interleave(torch.arange(len(docs), dtype=torch.int32), lengths)[None],
    }  # fmt: skip
    return add_images(batch, model_or_config, docs)


def add_images(
    batch: dict[str, Any], model_or_config: PreTrainedModel | PretrainedConfig, documents: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """A packed row of `documents` (`batch`, as `PackedCollator` made it from their ids, tail padding included) with
    their images: the image tensors concatenated in document order and, for mRoPE families, each document's
    positions computed alone (tail padding positions 0, 1, ... on every row). `documents` as `pack_vlm_documents`
    takes them, empty ones left out.

    Raises:
        ConfigError, DataError: as `pack_vlm_documents`.
    """
    config = model_or_config if isinstance(model_or_config, PretrainedConfig) else model_or_config.config
    family = exact_family(config)
    docs = [_document(doc, i, family, config) for i, doc in enumerate(documents)]
    total = batch[INPUT_IDS].shape[-1]
    if family.route != "1d":
        positions = mrope_positions(rope_index_owner(model_or_config), docs, family.route)  # (rows, 1, L)
        pad = total - positions.shape[-1]
        tail = torch.arange(pad, dtype=positions.dtype).expand(positions.shape[0], 1, pad)
        batch[POSITION_IDS] = torch.cat([positions, tail], dim=-1)
    for key, axis in family.layout.keys:
        present = [d[key] for d in docs if key in d]
        if present:
            batch[key] = torch.cat(present, dim=axis)
    if any(MM_TOKEN_TYPE_IDS in d for d in docs):
        types = torch.cat([d[MM_TOKEN_TYPE_IDS] for d in docs])
        batch[MM_TOKEN_TYPE_IDS] = torch.nn.functional.pad(types, (0, total - len(types)))[None]
    return batch


def _document(doc: Mapping[str, Any], index: int, family: VlmFamily, config: PretrainedConfig) -> dict:
    """One document as tensors: ids, labels and type ids flat, images as given; its image tokens checked."""
    if any(key.endswith("videos") or key.startswith("video") for key in doc):
        raise DataError(f"document {index} has videos, which packing has not been proven with: leave them out")
    ids = torch.as_tensor(doc[INPUT_IDS]).reshape(-1)
    image = ids == config.image_token_id
    labels = doc.get(LABELS)
    labels = ids.masked_fill(image, IGNORE_INDEX) if labels is None else torch.as_tensor(labels).reshape(-1)
    out = {INPUT_IDS: ids, LABELS: labels}
    for key, _ in family.layout.keys:
        if doc.get(key) is not None:
            out[key] = torch.as_tensor(doc[key])
    if family.route != "1d":  # `get_rope_index` reads the tokens' types: the processor's, else the image tokens'
        types = doc.get(MM_TOKEN_TYPE_IDS)
        out[MM_TOKEN_TYPE_IDS] = (image if types is None else torch.as_tensor(types).reshape(-1)).int()
    found, needed = int(image.sum()), family.layout.tokens(config, out)
    if found != needed:
        raise DataError(
            f"document {index} holds {found} image tokens where its images need {needed}: an image was cut (by "
            "truncation?) or its tokens and pixels disagree; raise data.max_length above the document's tokens or "
            "drop it (data.overlong=drop)"
        )
    return out


def mrope_positions(owner: torch.nn.Module, docs: Sequence[Mapping[str, torch.Tensor]], route: Route) -> torch.Tensor:
    """(rows, 1, T) positions: each document's `get_rope_index` computed alone, concatenated (restarting per
    document); with `mrope-4row`, its text positions 0..L-1 as the first row."""
    pieces = []
    for doc in docs:
        ids = doc[INPUT_IDS][None]
        spatial, _ = owner.get_rope_index(
            ids, mm_token_type_ids=doc[MM_TOKEN_TYPE_IDS][None], image_grid_thw=doc.get(IMAGE_GRID_THW)
        )  # (3, 1, L)
        if route == "mrope-4row":
            spatial = torch.cat([torch.arange(ids.shape[1], dtype=spatial.dtype)[None, None], spatial])
        pieces.append(spatial)
    return torch.cat(pieces, dim=-1)


def rope_index_owner(model_or_config: PreTrainedModel | PretrainedConfig) -> torch.nn.Module:
    """The module whose `get_rope_index` computes mRoPE positions: the model's own, or (from a config) that of a
    weightless skeleton built once on the meta device (`get_rope_index` reads the config, never a weight)."""
    if isinstance(model_or_config, PretrainedConfig):
        return _skeleton(type(model_or_config), model_or_config.to_json_string())
    return next(m for m in model_or_config.modules() if hasattr(type(m), "get_rope_index"))


@lru_cache(maxsize=4)
def _skeleton(config_class: type[PretrainedConfig], config_json: str) -> torch.nn.Module:
    with torch.device("meta"):
        base = AutoModel.from_config(config_class.from_dict(json.loads(config_json)))
    return next(m for m in base.modules() if hasattr(type(m), "get_rope_index"))


# Towers already kept off the row's bounds (weak: a model is freed as usual).
_TOWERS: weakref.WeakSet = weakref.WeakSet()


def keep_tower_apart(model: PreTrainedModel) -> torch.nn.Module:
    """Drop the packed row's bounds (`ROW_BOUNDS`) from the keyword arguments of the model's vision tower, so that
    its attention keeps its own per-image bounds; return the tower. Idempotent."""
    tower = _base(model).get_submodule(exact_family(_base(model).config).layout.tower)
    if tower not in _TOWERS:
        _TOWERS.add(tower)

        def drop(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
            return args, {key: value for key, value in kwargs.items() if key not in ROW_BOUNDS}

        tower.register_forward_pre_hook(drop, with_kwargs=True)
    return tower


def _base(model: torch.nn.Module) -> PreTrainedModel:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def probe_documents(config: PretrainedConfig, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Documents with random images, made from the config alone (no processor), in `pack_vlm_documents`' format:
    a text document, one with a small image, one with a large image then a small one (Qwen-VL: grids of 2 x 2 and
    2 x 3 merged patches; Idefics3 / SmolVLM: 1 and 2 tiles; LLaVA, whose images have one size: one image each).
    Each image's tokens are the family's count (`ImageLayout.tokens`) of `image_token_id`, between random text
    tokens that are none of the config's special ids. The isolation self-test packs them; the memory estimate
    measures the vision tower on them.

    >>> from transformers import AutoConfig
    >>> docs = probe_documents(AutoConfig.for_model("llava"))
    >>> [int((d["input_ids"] == 32000).sum()) for d in docs], tuple(docs[2]["pixel_values"].shape)
    ([0, 576, 1152], (2, 3, 336, 336))
    """
    layout = exact_family(config).layout
    vision, gen = config.vision_config, torch.Generator().manual_seed(seed)
    special = {v for k, v in config.to_dict().items() if k.endswith(("token_id", "token_index")) and isinstance(v, int)}
    special = torch.tensor(sorted(special | {config.image_token_id}))
    plain = next(i for i in range(len(special) + 1) if i not in special)  # stands in for a special id drawn

    def text(n: int) -> torch.Tensor:
        ids = torch.randint(config.get_text_config().vocab_size, (n,), generator=gen)
        return ids.masked_fill(torch.isin(ids, special), plain)

    def image(large: bool) -> dict[str, torch.Tensor]:  # one image's tensors in the family's keys
        if layout is QWEN:
            merge, patch = vision.spatial_merge_size, vision.patch_size
            grid = torch.tensor([[1, 2 * merge, (3 if large else 2) * merge]])
            width = getattr(vision, "in_channels", 3) * vision.temporal_patch_size * patch**2
            return {PIXEL_VALUES: torch.randn(int(grid.prod()), width, generator=gen), IMAGE_GRID_THW: grid}
        size, channels = vision.image_size, getattr(vision, "num_channels", 3)
        if layout is IDEFICS:
            tiles = 2 if large else 1
            pixels = torch.randn(1, tiles, channels, size, size, generator=gen)
            return {PIXEL_VALUES: pixels, PIXEL_ATTENTION_MASK: torch.ones(1, tiles, size, size, dtype=torch.bool)}
        return {PIXEL_VALUES: torch.randn(1, channels, size, size, generator=gen)}

    documents = [{INPUT_IDS: text(6)}]
    for images in ([image(False)], [image(True), image(False)]):
        ids = [text(4)]
        for one in images:
            ids += [torch.full((layout.tokens(config, one),), config.image_token_id), text(3)]
        tensors = {key: torch.cat([one[key] for one in images], dim=axis) for key, axis in layout.keys
                   if key in images[0]}  # fmt: skip
        documents.append({INPUT_IDS: torch.cat(ids), **tensors})
    return documents
