"""Build the transformers model a `PackedCausalLM` trains: pretrained or random from a config, made packed by
`pack_model`, then gradient checkpointing, LoRA and the LM-head check, in that order.

    model, packing = load_causal_lm("smollm2", backend="auto")     # a packed transformers model, what was found
    model, packing = build_model("smollm2", lora={"r": 8})          # the whole sequence
    model, _ = build_model("smollm2", deferred=True)                # on the meta device, for a sharded strategy
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    GenerationConfig,
    PreTrainedModel,
)

from lit_packing.agree import agreed
from lit_packing.assets import resolve_pretrained
from lit_packing.errors import ConfigError, check_range
from lit_packing.models.attention import attn_implementation
from lit_packing.models.backends import AttnBackend
from lit_packing.models.head import check_head_inputs
from lit_packing.models.materialize import (
    Weights,
    host_memory_returned,
    local_folder,
    materialize,
    probe_values,
    skeleton,
)
from lit_packing.models.mixers import MixerChoice
from lit_packing.models.pack import Packing, check_backend_here, pack_model
from lit_packing.models.quantize import (
    Quantization,
    check_mergeable,
    keep_trainable,
    prepare,
    quantization_settings,
)
from lit_packing.models.random_init import initialize, lora_init_supported
from lit_packing.models.selftest import PADDED_FIX
from lit_packing.models.sharding import (
    data_parallel_mesh,
    local_tensor,
    shard_model,
    shard_plan,
    tensor_parallel_plan,
    tensor_parallel_size,
)
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


def model_class(config) -> type:
    """The transformers auto class that builds a model of `config`, chosen here only: image-text-to-text for a
    config with a vision tower (`vision_config`), else causal LM."""
    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM


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
    quantization: Quantization | None = None,
) -> LoadedModel:
    """A packed causal LM: random weights from `model_config` if given, else pretrained weights of `model`
    (quantized as they load with `quantization`: `quantize.py`),
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
        config = _config(model_config, vocab_size)
        with _own_attention_table(config.model_type, implementation):
            lm = model_class(config).from_config(config, attn_implementation=implementation, dtype=torch_dtype(dtype))
    else:
        path = resolve_pretrained(model)
        with _own_attention_table(model, implementation):
            # Quantized on the host (transformers would put every rank's copy on the current GPU, the first): the
            # trainer then moves each rank's to its own device.
            quantized = {} if quantization is None else {"quantization_config": quantization.config(),
                                                         "device_map": {"": "cpu"}}  # fmt: skip
            lm = model_class(AutoConfig.from_pretrained(path)).from_pretrained(
                path, attn_implementation=implementation, dtype=torch_dtype(dtype) or torch.float32, **quantized
            )
            if quantization is not None:
                keep_trainable(lm)  # before `pack_model`'s self-test runs it in eval mode
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
    quantization: Quantization | None = None,
) -> LoadedModel:
    """The whole build of the model a `PackedCausalLM` trains: `load_causal_lm` (load, then `pack_model`), then
    gradient checkpointing, the k-bit preparation of a `quantization`, LoRA adapters (`lora`: `peft.LoraConfig`
    kwargs) and, for a loss on the final hidden
    states (`check_head`), the check that the LM head reproduces the model's logits. The returned model is the
    trained module (a peft model with `lora`).

    `deferred`: the model's skeleton only (`materialize.skeleton`: parameters on the meta device), with its
    gradient checkpointing and adapters, packed on the host as it is (`pack_skeleton`); `materialize.materialize`
    fills its (sharded) parameters later."""
    check_backend_here(backend, device or "cpu")  # a backend this machine cannot run fails before the model loads
    if deferred:
        lm, packing = model_skeleton(name_or_path, model_config, vocab_size, dtype, resize_embeddings), None
    else:
        lm, packing = load_causal_lm(
            name_or_path, model_config, vocab_size, dtype, resize_embeddings, backend, device, mixers, check,
            quantization,
        )  # fmt: skip
    if quantization is not None:
        lm = prepare(lm, gradient_checkpointing)
    elif gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = apply_lora(lm, lora) if lora else lm
    if deferred:
        return LoadedModel(model, pack_skeleton(model, backend, device or "cpu", mixers, check, check_head))
    packing.on_host(lm)  # until the trainer places it: its construction-time forwards run on the host
    if check_head:
        check_head_inputs(model)
    return LoadedModel(model, packing)


def pack_skeleton(
    model: torch.nn.Module, backend: AttnBackend, device: torch.device | str, mixers: MixerChoice, check: bool,
    check_head: bool,
) -> Packing:  # fmt: skip
    """What `build_model` does after loading, for a skeleton (a deferred model, before it is sharded or filled):
    `pack_model` for `device`, then the LM-head check, their forwards on the host over stand-in values that never
    hold the whole model (`materialize.probe_values`: what lies outside the decoder layers, and one layer of each
    kind). A sharded model is never probed, so its setup never gathers the root (embeddings, head)."""
    try:
        layers = shard_plan(model).layers
    except ConfigError:  # no layer class to share values between (trained unsharded): the whole model's values
        layers = []
    with host_memory_returned(), probe_values(model, layers):
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
        config = _config(model_config, vocab_size)
        name = config.model_type
    else:
        config, name = AutoConfig.from_pretrained(resolve_pretrained(name_or_path)), name_or_path
    with _own_attention_table(name, implementation):
        lm = skeleton(
            lambda: model_class(config).from_config(
                config, attn_implementation=implementation, dtype=torch_dtype(dtype) or torch.float32
            )
        )
    if model_config is None and lm.can_generate():  # as from_pretrained: the folder's generation config (its end ids)
        with contextlib.suppress(OSError):  # none shipped: the one from_config made of the model's config
            lm.generation_config = GenerationConfig.from_pretrained(resolve_pretrained(name_or_path))
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


def _config(model_config: dict, vocab_size: int | None):
    """The transformers config `model_config` describes, with the tokenizer's vocabulary (`_with_vocabulary`).

    Raises:
        ConfigError: it names no `model_type`.
    """
    if "model_type" not in model_config:
        raise ConfigError("model.model_config", f"{sorted(model_config)} names no model_type (the architecture)",
                          'add one, e.g. {"model_type": "llama", ...}')  # fmt: skip
    return AutoConfig.for_model(**_with_vocabulary(model_config, vocab_size))


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


# ----------------------------------------------------------------------------------------------------------------
# The sequence a PackedCausalLM runs: built (whole, or a skeleton), then under a sharded strategy split and filled

# Core parameters that are `model.<name>` settings (a core `ConfigError` naming one is re-raised with that path).
MODEL_SETTINGS = ("attn_backend", "varlen_impl", "mixers", "loss_impl", "loss_normalization", "loss_chunk_size",
                  "objective", "beta", "simpo_gamma_beta_ratio", "reference", "lora")  # fmt: skip


@contextlib.contextmanager
def named_model_settings():
    """A core `ConfigError` (e.g. a backend that cannot run this model) named by its `model.*` path."""
    try:
        yield
    except ConfigError as error:
        raise error.under({name: f"model.{name}" for name in MODEL_SETTINGS}) from None


class Built(NamedTuple):
    """A `PackedCausalLM`'s models as `build_models` made them, packed (a deferred one as a skeleton)."""

    model: torch.nn.Module
    packing: Packing
    references: list[torch.nn.Module]  # reference=copy: the initial model, frozen


def build_models(hp, deferred: bool, copy_reference: bool) -> Built:
    """The trained model from a `PackedCausalLM`'s settings `hp` (`build_model`) and, with `copy_reference`, a
    frozen copy of it. Built whole, a random init (`model_config`, LoRA adapters) is redone by
    `random_init.initialize`, which the meta-device build (`deferred`) runs once filled: the same weights either
    way, on any number of ranks."""
    # Built on the host and checked for the device this machine trains on (a GPU backend on a machine without one
    # fails here); `PackedCausalLM.setup` resolves once more for the trainer's device (`Packing.to_device`).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lora = hp["lora"]
    quantization = quantization_settings(hp["quantization"], hp["quantization_dtype"], hp["double_quantization"],
                                         lora, hp["model_config"], deferred)  # fmt: skip
    if lora and hp["export_dir"] and not hp["export_adapters_only"]:
        check_mergeable(lora)
    if deferred and not lora_init_supported(lora):
        raise ConfigError("model.lora", f"init_lora_weights={lora['init_lora_weights']!r} is not made on the "
                          "meta-device build of a sharded strategy (only peft's default)",
                          "leave init_lora_weights unset, or train with trainer.strategy=ddp")  # fmt: skip
    with named_model_settings():
        model, packing = build_model(
            hp["name_or_path"], hp["model_config"], hp["vocab_size"], hp["dtype"], hp["attn_backend"], device,
            hp["mixers"], hp["isolation_check"], hp["resize_embeddings"], hp["gradient_checkpointing"], lora,
            check_head=hp["loss_impl"] != "full", deferred=deferred, quantization=quantization,
        )  # fmt: skip
    if not deferred and (hp["model_config"] is not None or (lora and lora_init_supported(lora))):
        adapters = None if hp["model_config"] is not None else lambda name: ".lora_" in name
        initialize(model, torch.initial_seed(), only=adapters)
    references = [copy.deepcopy(model).eval().requires_grad_(False)] if copy_reference else []
    if references and deferred:
        pack_skeleton(references[0], "per_example", device, hp["mixers"], check=False, check_head=False)
    elif references:
        pack_model(references[0], "per_example")  # a copy is a new model: through the door, on the host
    return Built(model, packing, references)


def shard_models(
    models: list[torch.nn.Module], mesh, precision: Callable[[], str], broadcast_init: bool, cpu_offload: bool = False
) -> None:
    """Split every model over Lightning's mesh (`sharding.shard_model`), saying so in one line; `precision`: the
    trainer's, asked once the plan is checked; `broadcast_init`: a random init built whole is rank 0's on every
    rank first (as DDP does at wrap); `cpu_offload`: the shards kept in host memory (`ShardedStrategy`'s)."""
    tp = tensor_parallel_size(mesh)
    if tp > 1:
        tensor_parallel_plan(models[0], tp)  # refused before any collective
    if broadcast_init:
        with torch.no_grad():
            for tensor in [*models[0].parameters(), *models[0].buffers()]:
                torch.distributed.broadcast(tensor.data, src=0)
    for model in models:
        plan = shard_model(model, mesh, precision(), cpu_offload=cpu_offload)
    log.info(
        "FSDP2: %d %s layers and the root sharded over %d data-parallel ranks%s%s",
        len(plan.layers), plan.layer_class, data_parallel_mesh(mesh).size(),
        f", attention heads and MLP columns split over {tp} tensor-parallel ranks" if tp > 1 else "",
        "; parameters, gradients and optimizer state kept in host memory (cpu_offload)" if cpu_offload else "",
    )  # fmt: skip


def fill_models(hp, models: list[torch.nn.Module], strategy, seed: int) -> None:
    """Allocate and fill deferred models (the trained one first, then a reference copy; packed already, as
    skeletons: `pack_skeleton`) where the strategy trains, each rank its shards only (`materialize.materialize`; a
    random init from rank 0's `seed`, the one the model was built under). A collective: every rank calls it."""
    with host_memory_returned():
        device, start = strategy.root_device, time.perf_counter()
        with agreed():  # a download failing on one rank stops every rank, not just that one (then dcp.load hangs)
            folder = None if hp["model_config"] is not None else local_folder(resolve_pretrained(hp["name_or_path"]))
        weights = Weights(hp["name_or_path"], folder, strategy.broadcast(seed))
        on_host = getattr(strategy, "cpu_offload", False)  # ShardedStrategy's: the shards live in host memory
        for model in models:
            materialize(model, device, weights, parameters_on_host=on_host)
        log.info("weights %s in %.1f s: %s on this rank", f"read from {folder}" if folder else "initialised",
                 time.perf_counter() - start, count(sum(local_tensor(p).numel() for p in models[0].parameters()),
                 "parameter"))  # fmt: skip


def check_model_settings(hp: Mapping[str, Any]) -> None:
    """Range-check the numeric settings and choices, naming each by its CLI path (`model.lr`)."""
    if hp["nonfinite"] not in ("error", "skip"):
        raise ConfigError("model.nonfinite", f"{hp['nonfinite']!r} is not a policy", "use error or skip")
    check_range("model.lr", hp["lr"], 0)  # 0 is a dry run: gradients without updates
    check_range("model.weight_decay", hp["weight_decay"], 0)
    check_range("model.eps", hp["eps"], 0, low_open=True)
    check_range("model.warmup_steps", hp["warmup_steps"], 0)
    check_range("model.min_lr_ratio", hp["min_lr_ratio"], 0, 1)
    check_range("model.vocab_size", hp["vocab_size"], 1)
    check_range("model.memory_limit_gb", hp["memory_limit_gb"], 0, low_open=True)
    check_range("model.memory_margin", hp["memory_margin"], 0, 1, high_open=True)
    for i, beta in enumerate(hp["betas"]):
        check_range(f"model.betas[{i}]", beta, 0, 1, high_open=True)
