"""QLoRA: the base model's linear layers quantized on load (bitsandbytes, through transformers), LoRA adapters
trained on top; and a LoRA model's adapters merged into plain weights for export. The one place that talks to
bitsandbytes and to peft's k-bit helpers.

    quantization = Quantization("nf4")                      # model.quantization: nf4
    AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization.config())
    lm = prepare(lm, gradient_checkpointing=True)           # norms and head in full precision, input gradients on
    parts = merged_parts(peft_model, torch.bfloat16)        # {name: () -> base + scale x B A}, the base dequantized

The quantized layers hold their weights as stored (NF4 or FP4: 4 bits a weight plus a scale per block of 64, itself
quantized with `double_quantization`; int8: a byte a weight and a scale per row); the embeddings, norms and the LM
head are kept in fp32, as peft's k-bit preparation casts them. Packing does not change: the attention layers run
the same packed kernels, the isolation self-test runs on the quantized model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from lit_packing.errors import ConfigError, install_hint

QuantizationKind = Literal["nf4", "fp4", "int8"]
SETTING = "model.quantization"
QUANTIZED_PARAMETERS = ("Params4bit", "Int8Params")  # bitsandbytes' parameter classes


@dataclass(frozen=True)
class Quantization:
    """How the base model is quantized on load.

    Attributes:
        kind: `nf4` or `fp4` (4 bits a weight), `int8` (LLM.int8()).
        compute_dtype: the dtype a 4-bit layer dequantizes its weights to for its matmul (`model.quantization_dtype`;
            the command line's `auto` follows the trainer's precision: `compute_dtype`).
        double: quantize the 4-bit layers' per-block scales too (~0.4 bits a weight saved).
    """

    kind: QuantizationKind
    compute_dtype: str = "float32"
    double: bool = True

    def config(self):
        """transformers' `BitsAndBytesConfig` for this quantization."""
        from transformers import BitsAndBytesConfig

        if self.kind == "int8":
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=self.kind,
            bnb_4bit_compute_dtype=getattr(torch, self.compute_dtype),
            bnb_4bit_use_double_quant=self.double,
        )


def compute_dtype(setting: str, precision: str | None) -> str:
    """`model.quantization_dtype` resolved: `auto` follows the trainer's precision (bfloat16 under `bf16-mixed` or
    `bf16-true`, float16 under `16-mixed`, else float32: bitsandbytes' fp32 path is its slow one on a GPU)."""
    if setting != "auto":
        return setting
    precision = str(precision or "32")
    return "bfloat16" if precision.startswith("bf16") else "float16" if precision.startswith("16") else "float32"


def quantization_settings(
    kind: str | None, compute_dtype: str, double: bool, lora: dict | None, model_config: dict | None, deferred: bool
) -> Quantization | None:
    """The run's `Quantization`, or None; a combination that cannot train is refused in one line.

    Raises:
        ConfigError: no LoRA (a quantized base does not train), a random init (`model_config`: weights are
            quantized as they load), a sharded strategy, or bitsandbytes missing.
    """
    if kind is None:
        return None
    if not lora:
        raise ConfigError(SETTING, f"{kind} quantizes the base model, whose weights then do not train, and no "
                          "adapters are set", "set model.lora (e.g. {r: 16, lora_alpha: 32, target_modules: "
                          "all-linear}), or drop model.quantization")  # fmt: skip
    if model_config is not None:
        raise ConfigError(SETTING, "weights are quantized as a pretrained model loads, and model.model_config "
                          "builds a random one", "give model.name_or_path a saved model (save_pretrained a random "
                          "one to quantize it), or drop model.quantization")  # fmt: skip
    if deferred:
        raise ConfigError(SETTING, f"a bitsandbytes-quantized ({kind}) base is not sharded by FSDP2 here (its packed "
                          "weights and their scales are not one tensor FSDP2 can split)",
                          "train it with trainer.strategy=ddp (each GPU holds the whole quantized base: a quarter of "
                          "its bf16 bytes), or drop model.quantization")  # fmt: skip
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError(
            SETTING, f"{kind} needs bitsandbytes, which is not installed", install_hint("qlora")
        ) from None
    return Quantization(kind, compute_dtype if compute_dtype != "auto" else "float32", double)


def check_quantized_strategy(kind: str, strategy: str) -> None:
    """Refuse a strategy that would shard or wrap a bitsandbytes base (FSDP1, DeepSpeed): one process per device
    (DDP) holds the whole quantized base."""
    if strategy not in ("SingleDeviceStrategy", "DDPStrategy"):
        raise ConfigError(SETTING, f"a bitsandbytes-quantized ({kind}) base runs on one device or under DDP, not "
                          f"under {strategy}", "set trainer.strategy=ddp (or auto)")  # fmt: skip


def check_mergeable(lora: dict) -> None:
    """Refuse adapters whose merge `merged_parts` does not compute (DoRA's magnitudes, `modules_to_save` copies):
    their export is peft's adapter folder.

    Raises:
        ConfigError: naming `model.export_adapters_only`.
    """
    unmerged = [key for key in ("use_dora", "modules_to_save") if lora.get(key)]
    if unmerged:
        raise ConfigError("model.export_adapters_only", f"the merged export does not fold {unmerged[0]} into "
                          "the base weights", "set it to true (peft's adapter folder)")  # fmt: skip


def adamw_8bit(groups: list[dict], **settings) -> torch.optim.Optimizer:
    """bitsandbytes' AdamW with its two moments in 8 bits (block-wise quantized: ~2 bytes a parameter instead of 8).

    Raises:
        ConfigError: bitsandbytes is not installed (naming `model.optimizer`).
    """
    try:
        import bitsandbytes
    except ImportError:
        raise ConfigError("model.optimizer", "adamw8bit needs bitsandbytes, which is not installed",
                          f"use adamw, or {install_hint('qlora')}") from None  # fmt: skip
    return bitsandbytes.optim.AdamW8bit(groups, **settings)


EIGHT_BIT_MIN = 4096  # bitsandbytes keeps a smaller parameter's moments in fp32 (its optimizers' `min_8bit_size`)


def adamw_8bit_state_bytes(parameters: list[torch.Tensor]) -> int:
    """What `adamw_8bit`'s two moments take: a byte each per element of a parameter of `EIGHT_BIT_MIN` elements or
    more (plus a scale per block of 256), 4 bytes each below."""
    return sum(2 * p.numel() * (1 + 4 / 256) if p.numel() >= EIGHT_BIT_MIN else 8 * p.numel() for p in parameters)


def is_quantized(tensor: torch.Tensor) -> bool:
    """Whether a parameter is bitsandbytes' (packed 4-bit or int8 weights, dequantized by their own layer)."""
    return type(tensor).__name__ in QUANTIZED_PARAMETERS


def prepare(lm: torch.nn.Module, gradient_checkpointing: bool) -> torch.nn.Module:
    """peft's k-bit preparation: the parameters that stay unquantized (embeddings, norms, head) in full precision,
    every weight frozen; and the embeddings' output requiring gradients with or without checkpointing: bitsandbytes
    runs a quantized layer whose input needs no gradient with an inference kernel that autograd cannot go back
    through, which would leave every adapter before the last layer without a gradient."""
    from peft import prepare_model_for_kbit_training

    lm = prepare_model_for_kbit_training(
        lm, use_gradient_checkpointing=gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )  # fmt: skip
    lm.enable_input_require_grads()
    return lm


def keep_trainable(lm: torch.nn.Module) -> None:
    """On a CPU with AVX-512 BF16, bitsandbytes (0.50) repacks a 4-bit layer's weights for its inference kernel at the
    first forward in eval mode without gradients (the isolation self-test, validation), for good: training through
    the layer then runs that kernel, which autograd cannot go back through, and every adapter before it silently
    gets no gradient. Turned off here for every 4-bit layer (the layout training uses is kept)."""
    for module in lm.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def stored_bytes(model: torch.nn.Module) -> int:
    """The bytes the model's parameters and buffers take as stored (a 4-bit layer: half a byte a weight, plus its
    scales, kept in each weight's quantization state)."""
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            nested = getattr(state, "state2", None)  # with double quantization: the scales' own scales
            for tensor in (state.absmax, getattr(nested, "absmax", None), getattr(state, "offset", None)):
                total += tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
    return total


def merged_parts(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, Callable[[], torch.Tensor]]:
    """A LoRA model's weights as one plain model's, each computed when called (one at a time: `export_merged` writes
    each before computing the next): an adapted layer's base weight (dequantized) plus its adapters' `scale x B A`,
    every tensor in `dtype` on the host; the adapters themselves dropped; a tensor tied to an earlier one (a tied LM
    head) left out. The names are the base model's (`model.layers.0.self_attn.q_proj.weight`)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.integrations import dequantize_module_weight

    @torch.no_grad()
    def adapted(module: LoraLayer) -> torch.Tensor:
        weight = dequantize_module_weight(module.get_base_layer()).float()  # the sum in fp32, rounded once
        for adapter in module.active_adapters:
            weight += module.get_delta_weight(adapter).float()
        return weight.to("cpu", dtype)

    @torch.no_grad()
    def plain(module: torch.nn.Module, tensor: torch.Tensor) -> torch.Tensor:
        whole = dequantize_module_weight(module) if is_quantized(tensor) else tensor  # a layer adapters left alone
        return whole.detach().to("cpu", dtype if whole.is_floating_point() else whole.dtype)

    base, parts, seen = model.get_base_model(), {}, set()
    for name, module in base.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, LoraLayer):
            layer = module.get_base_layer()
            parts[f"{prefix}weight"] = functools.partial(adapted, module)
            if getattr(layer, "bias", None) is not None:
                parts[f"{prefix}bias"] = functools.partial(plain, layer, layer.bias)
            continue
        if any(isinstance(parent, LoraLayer) for parent in _parents(base, name)):
            continue  # inside an adapted layer: its base layer and adapters, taken above
        for key, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if key in module._non_persistent_buffers_set or id(tensor) in seen:  # noqa: SLF001
                continue
            seen.add(id(tensor))
            parts[f"{prefix}{key}"] = functools.partial(plain, module, tensor)
    return parts


def _parents(root: torch.nn.Module, name: str) -> list[torch.nn.Module]:
    """The modules on the path from `root` to the module called `name`, without it."""
    parts, found, module = name.split(".") if name else [], [], root
    for part in parts[:-1]:
        module = getattr(module, part)
        found.append(module)
    return found
