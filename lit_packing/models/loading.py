"""Build the transformers model a `PackedCausalLM` trains: pretrained or random from a config, made packed by
`pack_model`, then gradient checkpointing, LoRA and the LM-head check, in that order.

    model, packing = load_causal_lm("smollm2", backend="auto")     # a packed transformers model, what was found
    model, packing = build_model("smollm2", lora={"r": 8})          # the whole sequence
    model, _ = build_model("smollm2", deferred=True)                # on the meta device, for a sharded strategy
"""

from __future__ import annotations

import contextlib
import logging
from typing import Literal, NamedTuple

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from lit_packing.assets import resolve_pretrained
from lit_packing.errors import ConfigError
from lit_packing.models.attention import attn_implementation
from lit_packing.models.backends import AttnBackend
from lit_packing.models.head import check_head_inputs
from lit_packing.models.materialize import skeleton
from lit_packing.models.mixers import MixerChoice
from lit_packing.models.pack import Packing, check_backend_here, pack_model
from lit_packing.models.selftest import PADDED_FIX

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


class LoadedModel(NamedTuple):
    """A packed transformers model and what `pack_model` found in it."""

    model: PreTrainedModel
    packing: Packing


def load_causal_lm(
    model: str = "smollm2",
    model_config: dict | None = None,
    vocab_size: int | None = None,
    dtype: str | None = None,
    resize_embeddings: bool = False,
    backend: AttnBackend = "auto",
    device: torch.device | str | None = None,
    mixers: MixerChoice = "auto",
    check: bool = True,
) -> LoadedModel:
    """A packed causal LM: random weights from `model_config` if given, else pretrained weights of `model`,
    made packed by `pack_model` (see it for `backend`, `device`, `mixers` and `check`).

    Args:
        model: `smollm2` (packaged, offline), a local folder or a Hub name.
        model_config: config kwargs with `model_type` (AutoConfig.for_model); when given, `model` is not loaded.
        vocab_size: the tokenizer's size. Sets the vocabulary of a config model; a pretrained model must have at
            least this many embedding rows (or `resize_embeddings=True`).
        dtype: parameter dtype (None: float32, the right choice with bf16-mixed precision).
        resize_embeddings: grow a pretrained model's embeddings to `vocab_size` instead of raising.

    Raises:
        ConfigError: the model cannot keep packed examples apart, or the tokenizer does not fit its vocabulary.
    """
    # Built with a packed implementation's name, so that a model choosing attention classes from its own table by
    # that name fails here, in one line, rather than keeping its own attention unseen.
    implementation = attn_implementation("per_example")
    if model_config is not None:
        config = AutoConfig.for_model(**_with_vocabulary(model_config, vocab_size))
        with _own_attention_table(config.model_type, implementation):
            lm = AutoModelForCausalLM.from_config(config, attn_implementation=implementation, dtype=torch_dtype(dtype))
    else:
        path = resolve_pretrained(model)
        with _own_attention_table(model, implementation):
            lm = AutoModelForCausalLM.from_pretrained(
                path, attn_implementation=implementation, dtype=torch_dtype(dtype) or torch.float32
            )
        _fit_vocabulary(lm, vocab_size, resize_embeddings, model)
    packing = pack_model(lm, backend, device, mixers, check)
    # from_pretrained returns eval mode (dropout off); Lightning keeps submodule modes as it finds them.
    return LoadedModel(lm.train(), packing)


def build_model(
    name_or_path: str = "smollm2",
    model_config: dict | None = None,
    vocab_size: int | None = None,
    dtype: str | None = None,
    backend: AttnBackend = "auto",
    device: torch.device | str | None = None,
    mixers: MixerChoice = "auto",
    check: bool = True,
    resize_embeddings: bool = False,
    gradient_checkpointing: bool = False,
    lora: dict | None = None,
    check_head: bool = True,
    deferred: bool = False,
) -> LoadedModel:
    """The whole build of the model a `PackedCausalLM` trains: `load_causal_lm` (load, then `pack_model`), then
    gradient checkpointing, LoRA adapters (`lora`: `peft.LoraConfig` kwargs) and, for a loss on the final hidden
    states (`check_head`), the check that the LM head reproduces the model's logits. The returned model is the
    trained module (a peft model with `lora`).

    `deferred`: the model's skeleton only (`materialize.skeleton`: parameters on the meta device), with its
    gradient checkpointing and adapters and without a `Packing` (None): `finish_build` packs it once
    `materialize.materialize` has filled its (sharded) parameters."""
    check_backend_here(backend, device or "cpu")  # a backend this machine cannot run fails before the model loads
    if deferred:
        lm, packing = model_skeleton(name_or_path, model_config, vocab_size, dtype, resize_embeddings), None
    else:
        lm, packing = load_causal_lm(
            name_or_path, model_config, vocab_size, dtype, resize_embeddings, backend, device, mixers, check
        )
    if gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = apply_lora(lm, lora) if lora else lm
    if deferred:
        return LoadedModel(model, packing)
    packing.on_host(lm)  # until the trainer places it: its construction-time forwards run on the host
    if check_head:
        check_head_inputs(model)
    return LoadedModel(model, packing)


def finish_build(
    model: torch.nn.Module, backend: AttnBackend, device: torch.device, mixers: MixerChoice, check: bool,
    check_head: bool,
) -> Packing:  # fmt: skip
    """What `build_model` does after loading, for a deferred model now holding its values (sharded or not):
    `pack_model` where it trains, then the LM-head check. A collective on a sharded model: every rank calls it."""
    packing = pack_model(model, backend, device, mixers, check)
    if check_head:
        check_head_inputs(model)
    return packing


def model_skeleton(
    name_or_path: str, model_config: dict | None, vocab_size: int | None, dtype: str | None, resize: bool
) -> PreTrainedModel:
    """The causal LM `load_causal_lm` would build, its parameters on the meta device (`materialize.skeleton`):
    from `model_config`, else from the pretrained folder's config (its weights read later, slice by slice)."""
    implementation = attn_implementation("per_example")
    if model_config is not None:
        config = AutoConfig.for_model(**_with_vocabulary(model_config, vocab_size))
        name = config.model_type
    else:
        config, name = AutoConfig.from_pretrained(resolve_pretrained(name_or_path)), name_or_path
    with _own_attention_table(name, implementation):
        lm = skeleton(
            lambda: AutoModelForCausalLM.from_config(
                config, attn_implementation=implementation, dtype=torch_dtype(dtype) or torch.float32
            )
        )
    rows = lm.get_input_embeddings().weight.shape[0]
    if model_config is None and vocab_size is not None and vocab_size > rows:
        if not resize:
            _fit_vocabulary(lm, vocab_size, resize, name_or_path)  # the refusal naming the fix
        raise ConfigError(
            "model.resize_embeddings",
            f"growing {name_or_path}'s {rows:,} embedding rows to the tokenizer's {vocab_size:,} is not done on the "
            "meta-device build of a sharded strategy",
            "use the model's own tokenizer, or resize it once with trainer.strategy=ddp and export it",
        )
    return lm


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
            f"choose a model that does (the families table in docs/model.md), {PADDED_FIX}",
        ) from None


def _with_vocabulary(model_config: dict, vocab_size: int | None) -> dict:
    """`model_config` with the tokenizer's size as its vocabulary (a different value given is replaced, saying so)."""
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
    return cfg


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
