"""A random init that is the same on one process and on any number of ranks, sharded or not: the model's own
`_init_weights` (LoRA adapters: peft's default), module by module, under one generator seeded by the run's seed.

    initialize(model, seed=42)   # a model of plain tensors, a meta-device skeleton just `to_empty`-ed, or FSDP2 shards

Each module, in the order transformers initialises them, gets a whole scratch copy of its own parameters on the
host; the init fills it, and each rank cuts its slice there and copies only that to its shard (no communication;
under `cpu_offload` the shards are host memory and nothing is allocated on the device). `initialize` runs on the
unsharded path too, so the weights match whatever the strategy. A parameter the model's init leaves untouched is
refused by name rather than left as uninitialised memory. `initialize_in_place` writes the same init straight into
a model's own host parameters (the construction probe's stand-in values, `materialize.probe_values`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from lit_packing._compat import shard_box
from lit_packing.errors import ConfigError

LORA_SETTING = "model.lora"


def initialize(model: torch.nn.Module, seed: int, only: Callable[[str], bool] | None = None) -> None:
    """A random init of `model`'s parameters (those `only` selects by name), the same on any number of ranks and
    strategies: each module, in the order transformers initialises them, gets whole scratch copies of its own
    parameters, initialised by the model's `_init_weights` (LoRA adapters as peft's default: A Kaiming-uniform, B
    zeros) under one generator seeded with `seed`; each rank copies its slice of them into its shards.

    Raises:
        ConfigError: a selected parameter that the init leaves untouched (a module the model's `_init_weights` does
            not know), on a model that was built without values (meta).
    """
    done: set[int] = set()
    with _seeded_init(seed):
        for prefix, module, owner in _init_order(model):
            params = [(n, p) for n, p in module.named_parameters(recurse=False)
                      if id(p) not in done and (only is None or only(prefix + n))]  # fmt: skip
            if not params:
                continue
            real = dict(params)
            for name, param in params:  # whole, on the host: this module's own parameters, one module at a time
                scratch = torch.full(param.shape, math.nan, dtype=param.dtype) if param.is_floating_point() else (
                    torch.zeros(param.shape, dtype=param.dtype))  # fmt: skip
                if not param.is_meta and not isinstance(param, DTensor):
                    scratch.copy_(param.detach())  # built with values: what the init leaves untouched stays
                module._parameters[name] = torch.nn.Parameter(scratch, requires_grad=param.requires_grad)
            try:
                _init_module(prefix, module, owner)
                values = {name: module._parameters[name].detach() for name in real}
            finally:
                module._parameters.update(real)
            for name, value in values.items():
                if value.is_floating_point() and torch.isnan(value).any():
                    raise ConfigError(
                        "model.model_config" if only is None else LORA_SETTING,
                        f"{prefix + name} ({type(module).__name__}) is not initialised by "
                        f"{type(owner).__name__}._init_weights, so it has no value on the meta-device build",
                        "load pretrained weights (model.name_or_path), or train with trainer.strategy=ddp",
                    )
                _copy_slice(real[name], value)
                done.add(id(real[name]))


def initialize_in_place(model: torch.nn.Module, seed: int) -> None:
    """`initialize`'s init written straight into `model`'s own (plain, host) parameters, each module whose
    parameters are all initialised already skipped (a layer sharing another's values): no scratch copies."""
    done: set[int] = set()
    with _seeded_init(seed):
        for prefix, module, owner in _init_order(model):
            own = [id(p) for p in module._parameters.values() if p is not None]
            if own and not done.issuperset(own):
                _init_module(prefix, module, owner)
                done.update(own)


@contextlib.contextmanager
def _seeded_init(seed: int) -> Iterator[None]:
    """Inside: no autograd, a generator of its own seeded with `seed` (the caller's random state untouched), and
    transformers' guard on its init functions, as `initialize` and `initialize_in_place` run the model's init."""
    from transformers import initialization

    with torch.no_grad(), torch.random.fork_rng(devices=[]), initialization.guard_torch_init_functions():
        torch.manual_seed(seed)
        yield


def _init_order(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, PreTrainedModel]]:
    """(qualified name prefix, module, the transformers model whose `_init_weights` it takes), children first, as
    transformers' `initialize_weights` visits them (a sub-model dispatches its own init)."""
    base = _base(model)

    def visit(module: torch.nn.Module, prefix: str, owner: PreTrainedModel):
        for name, child in module.named_children():
            yield from visit(child, f"{prefix}{name}.", child if isinstance(child, PreTrainedModel) else owner)
        yield prefix, module, owner

    root = "" if base is model else _prefix_of(model, base)
    yield from visit(base, root, base)


def _prefix_of(model: torch.nn.Module, inner: torch.nn.Module) -> str:
    return next(f"{name}." for name, module in model.named_modules() if module is inner)


def _init_module(prefix: str, module: torch.nn.Module, owner: PreTrainedModel) -> None:
    """peft's default for LoRA's A (Kaiming-uniform, a=sqrt(5)) and B (zeros) matrices; the model's own init else."""
    if ".lora_A." in prefix:
        torch.nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))
    elif ".lora_B." in prefix:
        torch.nn.init.zeros_(module.weight)
    else:
        owner._init_weights(module)
    if ".lora_" in prefix and getattr(module, "bias", None) is not None:
        torch.nn.init.zeros_(module.bias)


def _copy_slice(param: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy this rank's part of `whole` (the parameter's full value, on the host) into `param` (a DTensor's local
    shard, or the plain tensor): the part is cut on the host by DTensor's own shard arithmetic (any nesting of
    `Shard`, FSDP2's strided shards and `Replicate` holds a box of the whole), so only the shard reaches the device."""
    if isinstance(param, DTensor):
        shape, offset = shard_box(whole.shape, param.device_mesh, param.placements)
        param.to_local().copy_(whole[tuple(slice(start, start + size) for start, size in zip(offset, shape))])
    else:
        param.copy_(whole)


def lora_init_supported(lora: dict | None) -> bool:
    """Whether `initialize` gives LoRA's adapters the init `lora` asks for (peft's default)."""
    return lora is None or lora.get("init_lora_weights", True) is True


def _base(model: torch.nn.Module) -> PreTrainedModel:
    return model.get_base_model() if hasattr(model, "get_base_model") else model
