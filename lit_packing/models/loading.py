"""Build the transformers model a `PackedCausalLM` trains: pretrained or random from a config, LoRA optional.

model = load_causal_lm("smollm2", attn_implementation="packed_per_example")
"""

from __future__ import annotations

import contextlib
import logging
from typing import Literal

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from lit_packing._compat import can_set_attn_implementation
from lit_packing.assets import resolve_pretrained
from lit_packing.errors import ConfigError
from lit_packing.models.mixers import keep_mixers_apart
from lit_packing.text import count

log = logging.getLogger(__name__)

DType = Literal["float32", "bfloat16", "float16"]


def torch_dtype(dtype: str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(
            "model.dtype", f"{dtype!r} is not a choice", "use float32, bfloat16 or float16 (or leave it unset: float32)"
        )
    return getattr(torch, dtype)


def load_causal_lm(
    model: str = "smollm2",
    model_config: dict | None = None,
    vocab_size: int | None = None,
    dtype: str | None = None,
    attn_implementation: str = "sdpa",
    resize_embeddings: bool = False,
) -> PreTrainedModel:
    """A causal LM: random weights from `model_config` if given, else pretrained weights of `model`.

    Args:
        model: `smollm2` (packaged, offline), a local folder or a Hub name.
        model_config: config kwargs with `model_type` (AutoConfig.for_model); when given, `model` is not loaded.
        vocab_size: the tokenizer's size. Sets the vocabulary of a config model; a pretrained model must have at
            least this many embedding rows (or `resize_embeddings=True`).
        dtype: parameter dtype (None: float32, the right choice with bf16-mixed precision).
        attn_implementation: transformers attention implementation name.
        resize_embeddings: grow a pretrained model's embeddings to `vocab_size` instead of raising.

    Raises:
        ValueError: the model cannot keep packed examples apart, or the tokenizer does not fit its vocabulary.
    """
    if model_config is not None:
        cfg = dict(model_config)
        if vocab_size is not None:
            if cfg.get("vocab_size") not in (None, vocab_size):
                log.warning(
                    "model.model_config.vocab_size=%s is replaced by the tokenizer's size %d (model.vocab_size, "
                    "linked from data.vocab_size): the embeddings must hold every token id",
                    cfg["vocab_size"],
                    vocab_size,
                )
            cfg["vocab_size"] = int(vocab_size)
        config = AutoConfig.for_model(**cfg)
        with _own_attention_table(config.model_type, attn_implementation):
            lm = AutoModelForCausalLM.from_config(
                config, attn_implementation=attn_implementation, dtype=torch_dtype(dtype)
            )
    else:
        path = resolve_pretrained(model)
        with _own_attention_table(model, attn_implementation):
            lm = AutoModelForCausalLM.from_pretrained(
                path, attn_implementation=attn_implementation, dtype=torch_dtype(dtype) or torch.float32
            )
        _fit_vocabulary(lm, vocab_size, resize_embeddings, model)
    check_packing_support(lm)
    kept = keep_mixers_apart(lm)
    if kept:
        log.info(
            "%s besides attention %s per example in packed rows (%s%s)",
            count(len(kept), "token mixer"), "runs" if len(kept) == 1 else "run", kept[0], ", ..." * (len(kept) > 1),
        )  # fmt: skip
    # from_pretrained returns eval mode (dropout off); Lightning keeps submodule modes as it finds them.
    return lm.train()


@contextlib.contextmanager
def _own_attention_table(name: str, attn_implementation: str):
    """A model that picks its attention class from its own table (eager, sdpa, ...) fails on a registered
    implementation's name while it is built (`KeyError: 'packed_per_example'`): refuse it in one line."""
    try:
        yield
    except KeyError as error:
        if attn_implementation not in str(error):
            raise
        raise ConfigError(
            "model.name_or_path",
            f"{name} builds its attention from its own table of implementations, not through transformers' "
            "AttentionInterface, so packed examples cannot be kept apart",
            "choose a model that does (the families table in docs/model.md), or train it padded: --config "
            "configs/padding.yaml (data.collator: lit_packing.data.PaddedCollator)",
        ) from None


def check_packing_support(lm: PreTrainedModel) -> None:
    """Raise unless the model's attention goes through transformers' AttentionInterface (the only place packed
    boundaries can be honoured)."""
    if not can_set_attn_implementation(lm):
        where = next(
            (f" ({name}, {type(m).__name__})" for name, m in lm.named_modules() if "Attention" in type(m).__name__), ""
        )
        raise ConfigError(
            "model.name_or_path",
            f"{type(lm).__name__} ({lm.config.model_type}) does not route attention{where} through transformers' "
            "AttentionInterface, so packed examples cannot be kept apart",
            "choose a model that does (the families table in docs/model.md), or train it padded: --config "
            "configs/padding.yaml (data.collator: lit_packing.data.PaddedCollator)",
        )


def _fit_vocabulary(lm: PreTrainedModel, vocab_size: int | None, resize: bool, name: str) -> None:
    rows = lm.get_input_embeddings().weight.shape[0]
    if vocab_size is None or vocab_size <= rows:
        return
    if not resize:
        raise ConfigError(
            "data.tokenizer",
            f"the tokenizer has {vocab_size:,} tokens but model {name!r} has {rows:,} embedding rows",
            "use the model's own tokenizer, or set model.resize_embeddings=true to add (untrained) rows",
        )
    log.warning("resizing %s embeddings from %d to %d rows for the tokenizer", name, rows, vocab_size)
    lm.resize_token_embeddings(vocab_size)


def apply_lora(lm: PreTrainedModel, lora: dict) -> torch.nn.Module:
    """Wrap `lm` with peft LoRA adapters; `lora` holds `peft.LoraConfig` kwargs (e.g. r, lora_alpha,
    target_modules)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(lm, LoraConfig(task_type="CAUSAL_LM", **lora))


def no_decay_parameter_ids(module: torch.nn.Module) -> set[int]:
    """Parameters that take no weight decay: biases, norm weights (anything 1-D) and embeddings."""
    ids = {id(p) for p in module.parameters() if p.ndim < 2}
    for sub in module.modules():
        if isinstance(sub, torch.nn.Embedding):
            ids.update(id(p) for p in sub.parameters())
    return ids
