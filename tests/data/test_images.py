"""Image chats: reading images (paths, bytes, datasets' Image, PIL), their problems, the tokens an image becomes told
from its size alone (checked against what each processor really inserts, on real photographs and odd sizes), and
the encoding: labels on assistant turns only, never on an image, and no image ever cut by max_length."""

from __future__ import annotations

import importlib.util
import io
import re
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

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
from lit_packing.data.images import (
    IMAGE_CHAT_FEATURES,
    IMAGE_TOKENS,
    Dropped,
    _image_tensors,
    encode_image_chat,
    image_problem,
    image_size,
    image_tokens,
    load_image,
    tiles,
)
from lit_packing.errors import ConfigError, DataError
from lit_packing.models.vlm_assets import vlm_processor

MATPLOTLIB_DATA = Path(importlib.util.find_spec("matplotlib").submodule_search_locations[0]) / "mpl-data/sample_data"
SKIMAGE = importlib.util.find_spec("skimage")  # scikit-image's wheel ships ~30 photographs (read, never imported)
SKIMAGE_DATA = Path(SKIMAGE.submodule_search_locations[0]) / "data" if SKIMAGE else None
PHOTOS = ("chelsea.png", "coffee.png", "rocket.jpg", "hubble_deep_field.jpg", "page.png", "horse.png", "camera.png")
# Sizes that exercise each rounding of the resize rules: tiny, square, odd, very wide and very tall, exact tiles.
SIZES = [(1, 1), (64, 64), (255, 256), (256, 256), (257, 512), (451, 300), (300, 451), (513, 255), (640, 427),
         (777, 333), (1000, 100), (100, 1000), (1024, 768), (2000, 1999), (13, 997)]  # fmt: skip


@pytest.fixture(scope="module")
def processor(smollm2_tokenizer):
    """The tiny SmolVLM's processor: tiles of 256 px (16 tokens), longest edge 512."""
    return vlm_processor(smollm2_tokenizer)


@pytest.fixture(scope="module")
def grace_hopper() -> Image.Image:
    return Image.open(MATPLOTLIB_DATA / "grace_hopper.jpg").convert("RGB")  # 512 x 600, shipped with matplotlib


def chat(*turns: tuple[str, list]) -> list[dict]:
    """Turns from (role, parts) with parts given as text strings or None for an image."""
    return [{"role": role, "content": [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]}
            for role, parts in turns]  # fmt: skip


def one_image(image, question: str = "What is this?", answer: str = "A cat.") -> dict:
    return {"messages": chat(("user", [None, question]), ("assistant", [answer])), "images": [image]}


def trained(processor, encoded: dict) -> str:
    return processor.tokenizer.decode([t for t, y in zip(encoded[INPUT_IDS], encoded[LABELS]) if y != IGNORE_INDEX])


def inserted(processor, image: Image.Image) -> int:
    """The tokens the processor really puts in place of one image: a text that is the image placeholder alone."""
    out = processor(text=[processor.image_token], images=[[image]], add_special_tokens=False)
    return len(out[INPUT_IDS][0])


# ---------------------------------------------------------------- reading images


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_an_image_loads_to_rgb_from_a_path_bytes_a_stored_dict_or_pil(tmp_path, grace_hopper):
    path = tmp_path / "g.png"
    grace_hopper.save(path)
    data = png_bytes(grace_hopper)
    for value in (str(path), path, data, {"bytes": data, "path": None}, {"bytes": None, "path": str(path)},
                  grace_hopper):  # fmt: skip
        image = load_image(value, row=3)
        assert image.mode == "RGB" and image.size == (512, 600)
        assert np.array_equal(np.asarray(image), np.asarray(grace_hopper))


def test_transparent_and_grey_images_become_rgb_on_white():
    clear = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent red: white once composited
    assert load_image(clear, row=0).getpixel((0, 0)) == (255, 255, 255)
    assert load_image(Image.new("L", (4, 4), 7), row=0).getpixel((0, 0)) == (7, 7, 7)


def test_an_unreadable_or_empty_image_names_its_row_and_what_is_wrong(tmp_path, grace_hopper):
    empty, garbage, cut = tmp_path / "empty.png", tmp_path / "garbage.png", tmp_path / "cut.png"
    empty.write_bytes(b"")
    garbage.write_bytes(b"not an image at all")
    cut.write_bytes(png_bytes(grace_hopper)[:2_000])  # the header whole, the pixels cut short
    cases = [
        (str(tmp_path / "missing.png"), "no such file"),
        (str(empty), "is empty (0 bytes)"),
        (str(garbage), "cannot be read as an image"),
        (b"\x89PNG\r\n", "cannot be read as an image"),
        ({"bytes": None, "path": None}, "neither bytes nor a path"),
        (Image.new("RGB", (0, 5)), "size 0 x 5"),
        (str(cut), "cannot be decoded"),
        (5, "is a number (5), not an image path, bytes or PIL image"),
    ]
    for value, what in cases:
        with pytest.raises(DataError, match=r"row 12: images\[1\].*" + re.escape(what)) as error:
            load_image(value, row=12, index=1)
        assert error.value.rows == [12]
    assert image_size(str(cut), row=12) == (512, 600)  # the header alone: the size is read, no pixel decoded


def test_datasets_image_column_decoded_or_not_encodes_the_same(processor, tmp_path, grace_hopper):
    path = tmp_path / "g.jpg"
    grace_hopper.resize((96, 64)).save(path)
    rows = [one_image(str(path)), one_image({"bytes": png_bytes(grace_hopper.resize((40, 80))), "path": None})]
    dataset = datasets.Dataset.from_list(rows, features=datasets.Features(IMAGE_CHAT_FEATURES))
    stored = dataset.cast_column("images", datasets.List(datasets.Image(decode=False)))
    for decoded, raw in zip(dataset, stored):
        assert isinstance(decoded["images"][0], Image.Image) and isinstance(raw["images"][0], dict)
        assert image_problem(decoded) == image_problem(raw) == ""
        assert image_size(raw["images"][0], row=0) == decoded["images"][0].size
        a, b = encode_image_chat(processor, decoded, 4096), encode_image_chat(processor, raw, 4096)
        assert a[INPUT_IDS] == b[INPUT_IDS] and torch.equal(a[PIXEL_VALUES], b[PIXEL_VALUES])


# ---------------------------------------------------------------- problems


def test_image_problem_names_what_makes_an_image_chat_untrainable():
    good = one_image("a.png")
    assert image_problem(good) == ""
    assert image_problem({**good, "messages": chat(("user", [None]), ("assistant", ["x"]))}) == ""  # image alone
    text_turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert image_problem({"messages": text_turns}) == ""  # plain text turns, no image: fine
    cases = {
        "images": ({**good, "images": []}, "1 image part in messages but 0 images"),
        "extra": ({**good, "images": ["a.png", "b.png"]}, "1 image part in messages but 2 images"),
        "not a list": ({**good, "images": "a.png"}, "images is a string"),
        "null image": ({**good, "images": [None]}, "images[0] is null"),
        "part type": ({**good, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
                      "messages[0].content[0] is an object"),
        "text null": ({**good, "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
                      "messages[0].content[0] text is null"),
        "no answer": ({**good, "messages": chat(("user", [None, "What?"]))}, "no assistant turn"),
        "empty turn": ({**good, "messages": chat(("user", [None]), ("assistant", [""]))},
                       "(assistant) content is empty"),
        "role": ({**good, "messages": chat(("robot", [None]), ("assistant", ["x"]))}, "role 'robot'"),
    }  # fmt: skip
    for name, (example, problem) in cases.items():
        assert problem in image_problem(example), name


# ---------------------------------------------------------------- tokens of an image, from its size alone


def test_the_worked_example_of_the_module_docstring(processor):
    assert tiles(processor.image_processor, 451, 300) == (2, 2)
    assert image_tokens(processor, 451, 300) == 4 * 18 + 2 + 19 == 93


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_image_tokens_equal_what_the_tiny_smolvlm_processor_inserts(processor, size):
    assert image_tokens(processor, *size) == inserted(processor, Image.new("RGB", size))


def test_image_tokens_follow_other_idefics3_and_smolvlm_settings(processor):
    """Idefics3's defaults (1,456 px, tiles of 364, 169 tokens) and SmolVLM-256M's (2,048 px, tiles of 512, 64)."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor, SmolVLMImageProcessorPil

    idefics3 = Idefics3Processor(Idefics3ImageProcessorPil(), processor.tokenizer, image_seq_len=169)
    smolvlm_images = SmolVLMImageProcessorPil(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512})
    smolvlm = Idefics3Processor(smolvlm_images, processor.tokenizer, image_seq_len=64)
    for other in (idefics3, smolvlm):
        for size in [(64, 64), (451, 300), (777, 333), (100, 1000)]:
            assert image_tokens(other, *size) == inserted(other, Image.new("RGB", size)), (type(other), size)
    assert image_tokens(idefics3, 451, 300) == 12 * (169 + 2) + 2 + 1 + 169 + 3  # 3 x 4 tiles of 364 + global


@pytest.mark.parametrize("limits", [None, (56 * 56, 28 * 28 * 64)], ids=["default", "small"])
def test_image_tokens_follow_qwen2_vl_smart_resize(limits):
    from transformers import Qwen2VLImageProcessorPil

    kwargs = {"min_pixels": limits[0], "max_pixels": limits[1]} if limits else {}
    image_processor = Qwen2VLImageProcessorPil(**kwargs)
    for width, height in [(64, 64), (451, 300), (777, 333), (1000, 100), (13, 997), (1024, 768), (2000, 1999)]:
        grid = image_processor(Image.new("RGB", (width, height)), return_tensors="pt")[IMAGE_GRID_THW][0]
        assert image_tokens(image_processor, width, height) == int(grid.prod()) // 4, (width, height)
    if not limits:
        assert image_tokens(image_processor, 64, 64) == 4 and image_tokens(image_processor, 512, 512) == 324


def test_a_processor_with_no_known_rule_is_run_on_a_blank_image(processor):
    class NoRule:  # the tiny processor without the attributes a rule reads
        tokenizer, image_token = processor.tokenizer, processor.image_token

        def __call__(self, **kwargs):
            return processor(**kwargs)

    assert image_tokens(NoRule(), 777, 333) == image_tokens(processor, 777, 333)
    with pytest.raises(ConfigError, match="no rule is known"):
        image_tokens(processor.image_processor, 64, 64)  # tiles, but no tokenizer to count their tokens


@pytest.mark.skipif(SKIMAGE is None, reason="scikit-image's photographs are not installed")
def test_real_photographs_of_mixed_sizes_encode_to_the_tokens_their_size_tells(processor):
    counts = {}
    for name in PHOTOS:
        encoded = encode_image_chat(processor, one_image(str(SKIMAGE_DATA / name)), 4096)
        counts[name] = encoded[IMAGE_TOKENS][0]
        assert counts[name] == image_tokens(processor, *image_size(str(SKIMAGE_DATA / name), row=0)), name
    assert len(set(counts.values())) > 1  # mixed sizes: a spread of image tokens


def test_resized_crops_of_a_photograph_encode_to_the_tokens_their_size_tells(processor, grace_hopper):
    for box, size in [((0, 0, 512, 600), (512, 600)), ((100, 50, 400, 130), (900, 240)), ((0, 0, 60, 500), (37, 311)),
                      ((200, 200, 264, 264), (64, 64)), ((0, 0, 512, 300), (1400, 820))]:  # fmt: skip
        photo = grace_hopper.crop(box).resize(size)
        encoded = encode_image_chat(processor, one_image(photo), 4096)
        assert encoded[IMAGE_TOKENS] == [image_tokens(processor, *size)], size
        rows, cols = tiles(processor.image_processor, *size)
        assert encoded[PIXEL_VALUES].shape[:2] == (1, rows * cols + 1)


# ---------------------------------------------------------------- encoding


def test_labels_fall_on_assistant_turns_only_and_never_on_an_image(processor, grace_hopper):
    example = {
        "messages": chat(("user", [None, "Who is this?"]), ("assistant", ["Grace Hopper."]),
                         ("user", ["And this one?", None]), ("assistant", ["A crop of her."])),
        "images": [grace_hopper, grace_hopper.crop((0, 0, 300, 100))],
    }  # fmt: skip
    encoded = encode_image_chat(processor, example, 4096)
    assert trained(processor, encoded) == "Grace Hopper.<|im_end|>A crop of her.<|im_end|>"
    ids, labels = np.array(encoded[INPUT_IDS]), np.array(encoded[LABELS])
    image_ids = processor.tokenizer.convert_tokens_to_ids(["<image>", "<fake_token_around_image>", "<global-img>"])
    assert (labels[np.isin(ids, image_ids)] == IGNORE_INDEX).all() and np.isin(ids, image_ids).sum() > 100
    assert labels[0] == IGNORE_INDEX and encoded[LABEL_TOKENS] == (labels != IGNORE_INDEX).sum()
    assert encoded[IMAGE_TOKENS] == [image_tokens(processor, 512, 600), image_tokens(processor, 300, 100)]
    # the ids are the processor's own for the rendered chat (nothing re-tokenized apart)
    text = processor.apply_chat_template(example["messages"], tokenize=False)
    again = processor(text=[text], images=[example["images"]], add_special_tokens=False)
    assert encoded[INPUT_IDS] == again[INPUT_IDS][0]
    assert encoded[PIXEL_VALUES].shape == (1, 5 + 3, 3, 256, 256)
    assert encoded[PIXEL_ATTENTION_MASK].shape == (1, 8, 256, 256)


def test_a_chat_without_images_encodes_without_image_tensors(processor):
    encoded = encode_image_chat(processor, {"messages": chat(("user", ["Hi"]), ("assistant", ["Hello!"]))}, 64)
    assert trained(processor, encoded) == "Hello!<|im_end|>"
    assert encoded[IMAGE_TOKENS] == [] and PIXEL_VALUES not in encoded


def test_a_bad_row_or_unreadable_image_is_dropped_as_bad(processor, tmp_path):
    assert encode_image_chat(processor, {**one_image("a.png"), "images": []}, 64) == Dropped(
        "bad", '1 image part in messages but 0 images: give one image per {"type": "image"} part, in order'
    )
    dropped = encode_image_chat(processor, one_image(str(tmp_path / "missing.png")), 64)
    assert dropped.kind == "bad" and "no such file" in dropped.problem


def two_images(grace_hopper) -> dict:
    """A first answer, then a second image whose tokens a short max_length falls inside."""
    return {
        "messages": chat(("user", [None, "Who?"]), ("assistant", ["Grace."]), ("user", [None, "And?"]),
                         ("assistant", ["Her again."])),
        "images": [grace_hopper.resize((64, 64)), grace_hopper.resize((64, 64))],
    }  # fmt: skip


def test_truncation_ends_before_an_image_it_would_cut_and_keeps_that_images_pixels_out(processor, grace_hopper):
    whole = encode_image_chat(processor, two_images(grace_hopper), 4096)
    first, second = whole[IMAGE_TOKENS]
    start = (
        len(whole[INPUT_IDS])
        - len(processor.tokenizer("And?<|im_end|>\n<|im_start|>assistant\nHer again.<|im_end|>\n")[INPUT_IDS])
        - second
    )
    assert whole[INPUT_IDS][start - 1] != whole[INPUT_IDS][start]  # `start`: the second image's first token
    cut = encode_image_chat(processor, two_images(grace_hopper), start + 10, overlong="truncate")
    assert cut[INPUT_IDS] == whole[INPUT_IDS][:start] and cut[TRUNCATED_TOKENS] == len(whole[INPUT_IDS]) - start
    assert cut[IMAGE_TOKENS] == [first] and trained(processor, cut) == "Grace.<|im_end|>"
    assert torch.equal(cut[PIXEL_VALUES], whole[PIXEL_VALUES][:, :5]) and cut[PIXEL_ATTENTION_MASK].shape[:2] == (1, 5)
    in_text = encode_image_chat(processor, two_images(grace_hopper), len(whole[INPUT_IDS]) - 3, overlong="truncate")
    assert in_text[IMAGE_TOKENS] == [first, second] and in_text[TRUNCATED_TOKENS] == 3  # a cut in text stays there


def test_an_image_that_would_be_cut_drops_the_row_and_names_data_overlong(processor, grace_hopper):
    for overlong in ("drop", "error"):
        dropped = encode_image_chat(processor, one_image(grace_hopper), 60, overlong=overlong)
        assert dropped.kind == "overlong" and "an image would be cut at max_length=60" in dropped.problem
        assert "data.overlong=truncate" in dropped.problem
    only_image_first = encode_image_chat(processor, one_image(grace_hopper), 60, overlong="truncate")
    assert only_image_first.kind == "no_labels"  # nothing to learn from before the image
    assert "an image would be cut at max_length=60" in only_image_first.problem
    assert "data.overlong" in only_image_first.problem
    whole = encode_image_chat(processor, one_image(grace_hopper), 4096)
    text_cut = encode_image_chat(processor, one_image(grace_hopper), len(whole[INPUT_IDS]) - 1, overlong="drop")
    n = len(whole[INPUT_IDS])
    problem = f"{n:,} tokens > max_length={n - 1:,}: raise data.max_length or set data.overlong=truncate"
    assert text_cut == Dropped("overlong", problem)


def test_qwen2_vl_patch_tensors_keep_the_first_images_patches(processor):
    """The patch layout (Qwen2-VL's `pixel_values` rows and `image_grid_thw`) keeps what the kept images fill."""
    from transformers import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil()
    images = [Image.new("RGB", (64, 64), "red"), Image.new("RGB", (451, 300), "blue")]
    both = dict(image_processor(images, return_tensors="pt"))
    first = image_processor(images[:1], return_tensors="pt")
    kept = _image_tensors(processor, both, np.zeros(0), [(1, 5), (6, 172)], kept=1, end=6)
    assert torch.equal(kept[IMAGE_GRID_THW], first[IMAGE_GRID_THW])
    assert torch.equal(kept[PIXEL_VALUES], first[PIXEL_VALUES])
    assert kept[MM_TOKEN_TYPE_IDS].tolist() == [0, 1, 1, 1, 1, 0]
