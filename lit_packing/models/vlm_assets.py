"""The default vision-language model, built offline: a SmolVLM-shaped Idefics3 model whose language model is the
packaged SmolLM2-135M-Instruct, with a small random vision tower, and its processor.

    folder = resolve_pretrained("smolvlm-tiny")   # built once into the asset cache (~5 s), `lit_packing.assets`
    model = AutoModelForImageTextToText.from_pretrained(folder); processor = AutoProcessor.from_pretrained(folder)

No vision-language checkpoint ships in a package registry, so this one is made: SmolVLM is an Idefics3 model whose
language model is SmolLM2, and SmolLM2-135M is packaged (`lit_packing.assets`). Its language model's weights are
SmolLM2's, copied exactly; the 40 image tokens (`<image>`, `<fake_token_around_image>`, `<global-img>`,
`<row_r_col_c>`, ...) get new embedding rows; the SigLIP-style vision tower (2 layers, hidden 128, patch 16, tiles
of 256 px) and the connector (pixel shuffle by 4, a linear map to 576) are initialised from `seed`. It has never
seen an image: it is the shape of a VLM for packing, memory and speed work, and a start for fine-tuning, not a
model that describes pictures. The processor resizes an image's longest edge to 512 and cuts it into tiles of 256 px
(16 tokens each, plus a global view): 56 to 93 tokens an image. Its chat template is SmolLM2's ChatML, with an image
part rendered as `<image>`; a chat of text turns renders exactly as SmolLM2's own template renders it.
"""

from __future__ import annotations

from pathlib import Path

import torch

VERSION = 1  # bump when what `build_vlm` writes changes: the cache folder's name carries it
VISION = {
    "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "image_size": 256, "patch_size": 16,
}  # fmt: skip
SCALE_FACTOR = 4  # the connector's pixel shuffle: (256 / 16)**2 / 4**2 = 16 tokens a tile
IMAGE_SIZE = {"longest_edge": 512}  # an image's longest edge before it is cut into tiles
ADDED_TOKENS = (
    "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
)  # fmt: skip
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # SmolLM2's default system turn
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + SYSTEM + "<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def image_seq_len() -> int:
    """`<image>` tokens a tile becomes: the vision tower's patches of a tile, merged by the pixel shuffle."""
    return (VISION["image_size"] // VISION["patch_size"]) ** 2 // SCALE_FACTOR**2


def vlm_processor(tokenizer):
    """An Idefics3 processor for a SmolLM2-vocabulary tokenizer: the image tokens added (to a copy) as special
    tokens, Idefics3's PIL image processor sized for `VISION`, and `CHAT_TEMPLATE` (the tokenizer's too)."""
    import copy

    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(ADDED_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = Idefics3ImageProcessorPil(size=IMAGE_SIZE, max_image_size={"longest_edge": VISION["image_size"]})
    return Idefics3Processor(image_processor, tokenizer, image_seq_len=image_seq_len(), chat_template=CHAT_TEMPLATE)


def vlm_config(text_config, vocab_size: int, image_token_id: int):
    """The Idefics3 config: `text_config` (the language model's) with `vocab_size` tokens, `VISION`'s tower."""
    from transformers import Idefics3Config

    text = {**text_config.to_dict(), "vocab_size": vocab_size}
    return Idefics3Config(
        text_config=text,
        vision_config=dict(VISION),
        scale_factor=SCALE_FACTOR,
        image_token_id=image_token_id,
        tie_word_embeddings=text_config.tie_word_embeddings,
    )


def _embeddings(weight: torch.Tensor, new: int) -> torch.Tensor:
    """`weight` (vocab, hidden) with `new` rows after it: the mean row plus noise of 1% of the rows' spread, from
    the current random state (each new token distinct, none far from where the language model's tokens sit)."""
    rows = weight.mean(0) + 0.01 * weight.std(0) * torch.randn(new, weight.shape[1], dtype=weight.dtype)
    return torch.cat([weight, rows])


def build_vlm(text_model: str | Path, folder: str | Path, seed: int = 0, with_model: bool = True) -> Path:
    """Write a SmolVLM-shaped Idefics3 model and its processor into `folder`, from a causal language model folder
    (`text_model`: SmolLM2's vocabulary and tokenizer; its weights are copied exactly, the rest is set from `seed`).

    The same `text_model` and `seed` write the same weights. `with_model=False` writes the processor and the
    config only (no weights to read or write: what a tokenizer or a random-init run needs).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Idefics3ForConditionalGeneration

    folder = Path(folder)
    processor = vlm_processor(AutoTokenizer.from_pretrained(text_model))
    tokenizer = processor.tokenizer
    config = vlm_config(AutoConfig.from_pretrained(text_model), len(tokenizer), processor.image_token_id)
    processor.save_pretrained(folder)
    if not with_model:
        config.save_pretrained(folder)
        return folder
    language = AutoModelForCausalLM.from_pretrained(text_model, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config)
        new = len(tokenizer) - language.config.vocab_size
        weights = language.model.state_dict()
        weights["embed_tokens.weight"] = _embeddings(weights["embed_tokens.weight"], new)
        model.model.text_model.load_state_dict(weights)
        if not config.tie_word_embeddings:
            model.lm_head.weight.data.copy_(_embeddings(language.lm_head.weight.detach(), new))
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    return folder
