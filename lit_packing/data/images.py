"""Image chats: chats whose turns hold images, read as Hugging Face and TRL write them, and encoded for a
vision-language model's processor (text and pixels together, labels on the assistant turns only).

    encoded = encode_image_chat(processor, example, max_length=2048, overlong="truncate")

An image chat is a `messages` column whose `content` is a list of parts, `{"type": "text", "text": ...}` or
`{"type": "image"}`, and an `images` column that holds one image per image part, in the order the parts come: a
path, the bytes (`{"bytes": ..., "path": ...}`, as `datasets.Image` stores them) or a PIL image. A column of
`datasets.Image` works either way: decoded (PIL images) or cast with `Image(decode=False)` (the stored dicts, which
is what reading sizes without decoding pixels wants).

How many tokens an image becomes depends on its size alone, so `image_tokens(processor, width, height)` tells it
before any pixel is decoded (`image_size` reads a file's header only): what packing plans lengths with. Worked
example, the tiny SmolVLM of `lit_packing.models.vlm_assets` (Idefics3's rule: longest edge resized to 512, cut into
tiles of 256 px, 16 `<image>` tokens per tile), a 451 x 300 photo:

    451 x 300 -> 512 x 340 (longest edge 512) -> 512 x 512 (each side up to a whole tile) -> 2 x 2 tiles + 1 global
    tokens: 4 tiles, each <fake_token_around_image> <row_r_col_c> + 16 <image>            4 x 18 = 72
            "\\n" after row 1, "\\n\\n" (one token) after row 2                                  1 + 1 =  2
            global: <fake_token_around_image> <global-img> + 16 <image> <fake_token_around_image>      19
                                                                                                   = 93

Labels follow `lit_packing.data.tokenize`'s rules for chats (each assistant turn up to and including its
end-of-turn token, the first label -100) and never fall on an image's tokens. An image is never cut: when
`max_length` falls inside an image's tokens, `overlong=truncate` cuts before that image (and keeps only the images
wholly before the cut) when an assistant token is left to learn from, and drops the example otherwise.
"""

from __future__ import annotations

import io
import math
import os
from typing import Any, NamedTuple

import numpy as np
import torch
from datasets import Image, List, Value
from PIL import Image as PILImage
from PIL import UnidentifiedImageError

from lit_packing.batch import (
    IGNORE_INDEX,
    IMAGE_GRID_THW,
    INPUT_IDS,
    LABEL_TOKENS,
    LABELS,
    MM_TOKEN_TYPE_IDS,
    PIXEL_ATTENTION_MASK,
    PIXEL_VALUES,
    TRUNCATED_TOKENS,
)
from lit_packing.data.problems import chat_problem, kind_of
from lit_packing.errors import ConfigError, DataError

# The processor's image tensors (keys in `lit_packing.batch`), as the model takes them for one example: an Idefics3 /
# SmolVLM example holds tiles, `pixel_values` (1, tiles, 3, H, W) and `pixel_attention_mask` (1, tiles, H, W); a
# Qwen2-VL one holds patches, `pixel_values` (patches, 3 * temporal_patch * patch**2), `image_grid_thw` (images, 3)
# and `mm_token_type_ids` (T,), 1 at an image's tokens (its M-RoPE positions need them).
IMAGE_TOKENS = "image_tokens"  # tokens each kept image of an encoded example became (a list, one per image)

IMAGE_CHAT_COLUMNS = ("messages", "images")
PART = {"type": Value("string"), "text": Value("string")}  # an image part holds text None
IMAGE_MESSAGES = List({"role": Value("string"), "content": List(PART)})  # the Arrow type of an image chat's turns
IMAGE_CHAT_FEATURES = {"messages": IMAGE_MESSAGES, "images": List(Image())}

_IMAGE_MARK = "[image]"  # an image part's stand-in when a turn's text is checked: a turn of one image is not empty
_MAX_IMAGE_SIZE = 4096  # Idefics3's cap on the resized longest edge (`MAX_IMAGE_SIZE` in its image processors)
_MAX_ASPECT = 200  # Qwen2-VL refuses images more elongated than this


class Dropped(NamedTuple):
    """Why an example is left out: `kind` as the tokenized table's `dropped` column names it (`bad`, `overlong`,
    `no_labels`), `problem` the reason a report gives for the row."""

    kind: str
    problem: str

    def __str__(self) -> str:
        return self.problem


# ---------------------------------------------------------------- what makes an image chat untrainable


def image_problem(example: dict) -> str:
    """What makes one image chat untrainable, or "" when it is fine: a part that is neither text nor image, the
    chat's own problems (`lit_packing.data.problems.chat_problem`: roles, empty turns, no assistant turn, control
    characters; an image part counts as text there), or another number of images than image parts. Reads no image.

    >>> image_problem({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]},
    ...                             {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]}],
    ...                "images": []})
    '1 image part in messages but 0 images: give one image per {"type": "image"} part, in order'
    """
    messages = example.get("messages")
    turns = messages if not isinstance(messages, list) else [_as_text(m) for m in messages]
    problems = (_parts_problem(i, m["content"]) for i, m in enumerate(messages or []) if _has_parts(m))
    problem = next((p for p in problems if p), "") or chat_problem(turns)
    if problem:
        return problem
    parts = sum(part.get("type") == "image" for m in messages if _has_parts(m) for part in m["content"])
    images = example.get("images")
    images = [] if images is None else images
    if not isinstance(images, list):
        return f"images is {kind_of(images)}, not a list of images"
    if parts != len(images):
        return (f"{parts} image part{'s' * (parts != 1)} in messages but {len(images)} image{'s' * (len(images) != 1)}"
                ': give one image per {"type": "image"} part, in order')  # fmt: skip
    for k, image in enumerate(images):
        stored = isinstance(image, dict) and (image.get("bytes") or image.get("path"))
        if not (stored or isinstance(image, (str, bytes, os.PathLike, PILImage.Image))):
            return f"images[{k}] is {kind_of(image)}, not an image path, bytes or PIL image"
    return ""


def _has_parts(message: object) -> bool:
    return isinstance(message, dict) and isinstance(message.get("content"), list)


def _parts_problem(i: int, content: list) -> str:
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "image"):
            return f"messages[{i}].content[{j}] is {kind_of(part)}: give {{type: text, text}} or {{type: image}}"
        if kind == "text" and not isinstance(part.get("text"), str):
            return f"messages[{i}].content[{j}] text is {kind_of(part.get('text'))}, not a string"
    return ""


def _as_text(message: object) -> object:
    """A turn of parts as one text turn, each image as `_IMAGE_MARK` (well-formed parts assumed; others read as "")."""
    if not _has_parts(message):
        return message
    texts = [_IMAGE_MARK if p.get("type") == "image" else p.get("text") or "" for p in message["content"]
             if isinstance(p, dict)]  # fmt: skip
    return {**message, "content": "".join(texts)}


# ---------------------------------------------------------------- reading images


def _open(value: Any, index: int) -> PILImage.Image | str:
    """The image `value` opened lazily (only its header read), or what is wrong with it."""
    where = f"images[{index}]"
    if isinstance(value, PILImage.Image):
        image = value
    else:
        if isinstance(value, dict):
            data, path = value.get("bytes"), value.get("path")
        elif isinstance(value, (bytes, bytearray)):
            data, path = value, None
        elif isinstance(value, (str, os.PathLike)):
            data, path = None, value
        else:
            return f"{where} is {kind_of(value)}, not an image path, bytes or PIL image"
        try:
            if data:
                image = PILImage.open(io.BytesIO(data))
            elif path:
                if not os.path.exists(path):
                    return f"{where}: no such file {str(path)!r}"
                if not os.path.getsize(path):
                    return f"{where}: {str(path)!r} is empty (0 bytes)"
                image = PILImage.open(path)
            else:
                return f"{where} is {kind_of(value)}, with neither bytes nor a path"
        except (UnidentifiedImageError, OSError) as error:
            source = repr(str(path)) if path else f"{len(data):,} bytes"
            return f"{where}: {source} cannot be read as an image ({type(error).__name__}: {error})"
    if not image.width or not image.height:
        return f"{where} has size {image.width} x {image.height}: an image needs pixels"
    return image


def image_size(value: Any, row: int, index: int = 0) -> tuple[int, int]:
    """(width, height) of an image, read from its header only (no pixel is decoded).

    Raises:
        DataError: naming `row` and the image, when it is missing, empty or no image.
    """
    image = _open(value, index)
    if isinstance(image, str):
        raise DataError(f"row {row:,}: {image}", rows=[row])
    return image.size


def _decode(value: Any, index: int) -> PILImage.Image | str:
    image = _open(value, index)
    if isinstance(image, str):
        return image
    try:
        image.load()
    except (OSError, ValueError) as error:  # a truncated or corrupt file fails only when its pixels are read
        return f"images[{index}] cannot be decoded ({type(error).__name__}: {error})"
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:  # onto white, as transformers does
        rgba = image.convert("RGBA")
        white = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PILImage.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def load_image(value: Any, row: int, index: int = 0) -> PILImage.Image:
    """One image of an image chat (a path, bytes, a `datasets.Image` dict or a PIL image) decoded to RGB.

    Raises:
        DataError: naming `row` and the image, when it is missing, empty (0 bytes or 0 pixels) or unreadable.
    """
    image = _decode(value, index)
    if isinstance(image, str):
        raise DataError(f"row {row:,}: {image}", rows=[row])
    return image


# ---------------------------------------------------------------- how many tokens an image becomes


def _field(size: Any, key: str) -> int | None:
    """A key of an image processor's `size` (a dict, or a `SizeDict` on transformers 5)."""
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


def _longest_edge_to(height: int, width: int, longest: int) -> tuple[int, int]:
    """Idefics3's resize: the longest edge to `longest`, the other kept in proportion and rounded up to even."""
    if width >= height:
        height, width = int(longest / (width / height)), longest
        height += height % 2
    else:
        height, width = longest, int(longest * (width / height))
        width += width % 2
    return max(height, 1), max(width, 1)


def _below(height: int, width: int, most: int) -> tuple[int, int]:
    """Idefics3's cap: scale down so that no edge exceeds `most`."""
    if width >= height and width > most:
        height, width = int(most / (width / height)), most
    elif height > width and height > most:
        height, width = most, int(most * (width / height))
    return max(height, 1), max(width, 1)


def tiles(image_processor, width: int, height: int) -> tuple[int, int]:
    """(rows, cols) of the tiles an Idefics3 / SmolVLM image processor cuts an image of this size into, (0, 0) when
    it is one tile; a global view of the whole image comes with any split. The processor's own preprocessing rule."""
    tile = _field(image_processor.max_image_size, "longest_edge")
    if getattr(image_processor, "do_resize", True):
        height, width = _longest_edge_to(height, width, _field(image_processor.size, "longest_edge"))
        height, width = _below(height, width, _MAX_IMAGE_SIZE)
    if not getattr(image_processor, "do_image_splitting", True):
        return 0, 0
    aspect = width / height  # each side up to whole tiles, the short one through the aspect ratio first
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    if height > tile or width > tile:
        return height // tile, width // tile
    return 0, 0


def _smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize: both sides multiples of `factor`, the area within [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > _MAX_ASPECT:
        raise DataError(f"an image of {width} x {height} is more elongated than {_MAX_ASPECT}:1 (Qwen2-VL refuses it)")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def image_tokens(processor, width: int, height: int) -> int:
    """How many tokens the processor puts in place of one image of `width` x `height`, from the size alone.

    - Idefics3 / SmolVLM (`processor.image_seq_len`, tiles): the tiles of `tiles`, each `image_seq_len` `<image>`
      tokens with its markers, as the processor's own `replace_image_token` writes them, counted by its tokenizer.
    - Qwen2-VL family (an image processor with `patch_size`, `merge_size`, `temporal_patch_size`; the image processor
      alone will do): `(h / patch) * (w / patch) / merge**2` `<|image_pad|>` tokens, h and w smart-resized.
    - Any other processor: it is run on a blank image of that size (slow; no rule is known).

    Raises:
        ConfigError: an image processor alone of a family with no known rule (it cannot be run without text).
    """
    image_processor = getattr(processor, "image_processor", processor)
    if hasattr(processor, "image_seq_len") and hasattr(image_processor, "max_image_size"):
        rows, cols = tiles(image_processor, width, height)
        text = processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, image_idx=0)
        return len(processor.tokenizer(text, add_special_tokens=False)[INPUT_IDS])
    if all(hasattr(image_processor, name) for name in ("patch_size", "merge_size", "temporal_patch_size")):
        patch, merge, size = image_processor.patch_size, image_processor.merge_size, image_processor.size
        h, w = _smart_resize(height, width, patch * merge, _field(size, "shortest_edge"), _field(size, "longest_edge"))
        return (h // patch) * (w // patch) // merge**2
    if getattr(processor, "tokenizer", None) is None or getattr(processor, "image_token", None) is None:
        raise ConfigError(
            "data.tokenizer",
            f"no rule is known for how many tokens {type(processor).__name__} makes of an image",
            "pass the whole processor (with its tokenizer), which is then run on a blank image of each size",
        )
    blank = PILImage.new("RGB", (width, height))
    out = processor(text=[processor.image_token], images=[[blank]], add_special_tokens=False)
    return len(out[INPUT_IDS][0])


# ---------------------------------------------------------------- image chat -> ids, labels, pixels


def _template_turns(messages: list[dict]) -> list[dict]:
    """Turns as a chat template reads them: an Arrow-held part's empty keys (an image part's `text: None`) left out."""
    turns = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [{k: v for k, v in part.items() if v is not None} for part in content]
        turns.append({"role": message["role"], "content": content})
    return turns


def _assistant_spans(tokenizer, template: str, messages: list[dict]) -> tuple[str, list[tuple[int, int, int]]]:
    """The full render and, per assistant turn, (start, content_end, end) character positions in it, found as
    `lit_packing.data.encode` finds them: renders of the turns before (with the generation prompt) and up to it."""

    def render(turns: list[dict], prompt: bool = False) -> str:
        options = {"chat_template": template, "tokenize": False, "add_generation_prompt": prompt}
        return tokenizer.apply_chat_template(turns, **options)

    full, spans = render(messages), []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, upto = render(messages[:i], prompt=True), render(messages[: i + 1])
        if not (upto.startswith(before) and full.startswith(upto)):
            raise ConfigError(
                "data.tokenizer",
                f"the processor's chat template is not prefix-consistent (rendering the first {i + 1} messages is "
                "not the start of rendering them all), so assistant turns cannot be located",
                "use a processor whose chat_template renders each turn the same whatever follows",
            )
        start, end = len(before), len(upto)
        content = message["content"]
        texts = [content] if isinstance(content, str) else [p["text"] for p in content if p.get("type") == "text"]
        last = (texts[-1] if texts else "").strip()
        found = full.find(last, start, end) if last else -1
        spans.append((start, found + len(last) if found >= 0 else start, end))
    return full, spans


def _labels(ids: np.ndarray, offsets: np.ndarray, spans: list, image_ranges: list, special: np.ndarray) -> np.ndarray:
    """Each assistant span's tokens up to and including the first special token after its content, never an
    image's tokens; -100 elsewhere."""
    labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
    image = np.zeros(len(ids), dtype=bool)
    for a, b in image_ranges:
        image[a:b] = True
    starts, ends = offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1)
    for start, content_end, end in spans:
        inside = np.flatnonzero((starts < end) & (ends > start) & ~image)
        enders = inside[np.isin(ids[inside], special) & (starts[inside] >= content_end)]
        if enders.size:
            inside = inside[inside <= enders[0]]
        labels[inside] = ids[inside]
    return labels


def _expanded(position: int, replacements: list[dict]) -> int:
    """A character position of the rendered text in the text with each image placeholder expanded."""
    grown = [len(r["replacement"]) - (r["span"][1] - r["span"][0]) for r in replacements if r["span"][1] <= position]
    return position + sum(grown)


def _image_ranges(offsets: np.ndarray, replacements: list[dict]) -> list[tuple[int, int]]:
    """[first, last + 1) token of each image's expansion, in order."""
    ranges = []
    for r in replacements:
        start, end = r["new_span"]
        inside = np.flatnonzero((offsets[:, 0] >= start) & (offsets[:, 1] <= end) & (offsets[:, 1] > offsets[:, 0]))
        ranges.append((int(inside[0]), int(inside[-1]) + 1))
    return ranges


def _image_tensors(processor, inputs, ids: np.ndarray, ranges: list[tuple[int, int]], kept: int, end: int) -> dict:
    """The processor's image tensors of the first `kept` images (and, for patches, the type ids of the first `end`
    tokens), as the model takes them for one example."""
    if not ranges:
        return {}
    if IMAGE_GRID_THW in inputs:  # patches: each image fills t * h * w rows of pixel_values
        grid = inputs[IMAGE_GRID_THW]
        rows = int(grid[:kept].prod(dim=-1).sum())
        types = torch.zeros(end, dtype=torch.long)
        for a, b in ranges[:kept]:
            types[a:b] = 1
        return {PIXEL_VALUES: inputs[PIXEL_VALUES][:rows], IMAGE_GRID_THW: grid[:kept], MM_TOKEN_TYPE_IDS: types}
    # tiles: an image's tiles hold image_seq_len <image> tokens each
    tiles_of = [int((ids[a:b] == processor.image_token_id).sum()) // processor.image_seq_len for a, b in ranges]
    n = sum(tiles_of[:kept])
    out = {PIXEL_VALUES: inputs[PIXEL_VALUES][:, :n]}
    if PIXEL_ATTENTION_MASK in inputs:
        out[PIXEL_ATTENTION_MASK] = inputs[PIXEL_ATTENTION_MASK][:, :n]
    return out


def _cut(labels: np.ndarray, ranges: list, max_length: int, overlong: str) -> tuple[int, Dropped | None]:
    """Where the example ends under `max_length` / `overlong` (never inside an image), or why it is dropped."""
    n = len(labels)
    if n <= max_length:
        return n, None
    inside = next((k for k, (a, b) in enumerate(ranges) if a < max_length < b), None)
    if inside is None and overlong == "truncate":
        return max_length, None
    if inside is None:
        fix = "raise data.max_length or set data.overlong=truncate"
        return n, Dropped("overlong", f"{n:,} tokens > max_length={max_length:,}: {fix}")
    a, b = ranges[inside]
    cut = f"an image would be cut at max_length={max_length:,} (image {inside} is tokens {a:,}-{b:,} of {n:,})"
    if overlong != "truncate":
        fix = "raise data.max_length, or set data.overlong=truncate to end the example before the image"
        return n, Dropped("overlong", f"{cut}: {fix}")
    if not (labels[1:a] != IGNORE_INDEX).any():
        fix = "raise data.max_length (data.overlong=truncate ends an example before an image)"
        return n, Dropped("no_labels", f"{cut}, and no assistant token comes before it: {fix}")
    return a, None


def encode_image_chat(processor, example: dict, max_length: int, overlong: str = "truncate") -> dict | Dropped:
    """One image chat -> `input_ids`, `labels`, the processor's image tensors and its counts, or why it is dropped.

    The chat is rendered with the processor's chat template and run through the processor with its images (which
    expands each image placeholder into the image's tokens); labels are set on the assistant turns (see the module
    docstring), never on an image's tokens. Fitting to `max_length` never cuts an image.

    Args:
        processor: a Hugging Face processor (tokenizer, image processor, chat template), e.g. `AutoProcessor` of
            the tiny SmolVLM (`lit_packing.models.vlm_assets`).
        example: `messages` and `images` (see the module docstring).
        max_length: most tokens an example keeps.
        overlong: `truncate` ends a longer example at `max_length`, or before the image that would be cut there;
            `drop` and `error` give `Dropped("overlong", ...)` (the caller raises for `error` after counting every
            row, as `lit_packing.data.report.check_report` does).

    Returns:
        `{input_ids, labels, pixel_values, pixel_attention_mask | image_grid_thw + mm_token_type_ids, image_tokens,
        truncated_tokens, label_tokens}` (ids and labels as lists, the tensors as the model takes them for this one
        example (see `PIXEL_VALUES`), of the images kept only; none for a chat without an image), or a `Dropped`:
        `bad` (`image_problem`, an unreadable image), `overlong`, or `no_labels` (nothing left to train on).
    """
    problem = image_problem(example)
    if problem:
        return Dropped("bad", problem)
    images = [_decode(value, k) for k, value in enumerate(example.get("images") or [])]
    unreadable = next((image for image in images if isinstance(image, str)), None)
    if unreadable:
        return Dropped("bad", unreadable)
    tokenizer = processor.tokenizer
    full, spans = _assistant_spans(tokenizer, processor.chat_template, _template_turns(example["messages"]))
    inputs = processor(
        text=[full],
        images=[images] if images else None,
        add_special_tokens=False,
        return_offsets_mapping=True,
        return_text_replacement_offsets=True,
        return_tensors="pt",
    )
    ids = inputs[INPUT_IDS][0].numpy()
    offsets = inputs["offset_mapping"][0].numpy().reshape(-1, 2)
    replacements = [r for r in (inputs.get("text_replacement_offsets") or [[]])[0] if r["type"] == "image"]
    ranges = _image_ranges(offsets, replacements)
    spans = [tuple(_expanded(p, replacements) for p in span) for span in spans]
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    labels = _labels(ids, offsets, spans, ranges, np.array(sorted(special), dtype=np.int64))
    if len(labels):
        labels[0] = IGNORE_INDEX  # no token before the first predicts it (in a pack, it belongs to another example)
    end, dropped = _cut(labels, ranges, max_length, overlong)
    if dropped:
        return dropped
    labels = labels[:end]
    trained = int((labels != IGNORE_INDEX).sum())
    if not trained:
        return Dropped("no_labels", f"no assistant token in the first {end:,} tokens: raise data.max_length")
    kept = sum(b <= end for _, b in ranges)
    return {
        INPUT_IDS: ids[:end].tolist(),
        LABELS: labels.tolist(),
        **_image_tensors(processor, inputs, ids, ranges, kept, end),
        IMAGE_TOKENS: [b - a for a, b in ranges[:kept]],
        TRUNCATED_TOKENS: len(ids) - end,
        LABEL_TOKENS: trained,
    }
