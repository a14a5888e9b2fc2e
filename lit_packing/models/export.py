"""A trained model out as a Hugging Face folder (safetensors files, their index, config, tokenizer), whole or
sharded; a sharded one without any rank ever holding the whole model.

    export_model(lm.model, "runs/export", tokenizer)           # one process: `save_pretrained`
    export_sharded(lm.model, "runs/export", tokenizer)         # FSDP2: a collective, every rank calls it

Sharded, the parameters are written file by file (`EXPORT_FILE_BYTES` each at most, as `save_pretrained` splits a
large model): for each file every rank gathers its tensors one at a time (an all-gather of that tensor), rank 0
keeps them until the file is written and the others drop each at once; so no rank holds more than its shards and
one file. A tied head is written once, under the embeddings' name, as `save_pretrained` writes it; a LoRA model's
adapters alone are gathered and saved by peft. Non-finite weights are refused before anything is written.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from lit_packing.errors import TrainingError
from lit_packing.models.weights import apply_umask, check_finite_weights

log = logging.getLogger(__name__)

EXPORT_FILE_BYTES = 2**30  # one safetensors file's tensors at most (a larger single tensor is a file of its own)
INDEX = "model.safetensors.index.json"


def export_model(model: torch.nn.Module, path: str, tokenizer=None, state_dict=None) -> None:
    """`save_pretrained` the model (LoRA: the adapters) and, when one is known, the tokenizer; `state_dict` in place
    of the model's parameters (a LoRA model's adapters gathered from their shards).

    Raises:
        TrainingError: a weight is NaN or infinite; nothing is written.
    """
    check_finite_weights(model, path, state_dict)
    model.save_pretrained(path, **({} if state_dict is None else {"state_dict": state_dict}))
    _finish(path, tokenizer)


def export_sharded(model: torch.nn.Module, path: str, tokenizer=None, file_bytes: int = EXPORT_FILE_BYTES) -> None:
    """Write a sharded model as one Hugging Face folder, file by file (the module docstring); every rank calls it.

    Raises:
        TrainingError: (on every rank) a weight is NaN or infinite on some rank; nothing is written.
    """
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    _check_finite_shards(model, path)
    if hasattr(model, "get_base_model"):  # LoRA: the adapters only, small: gathered whole, saved by peft
        adapters = {name: _whole(p) for name, p in model.state_dict().items() if ".lora_" in name}
        if rank0:
            model.save_pretrained(path, state_dict={name: t.cpu() for name, t in adapters.items()})
            _finish(path, tokenizer)
        return
    from safetensors.torch import save_file

    files = file_plan(model, file_bytes)
    folder = Path(path)
    if rank0:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("model*.safetensors"):  # a previous export's files would mix into this one
            stale.unlink()
    weight_map, total = {}, 0
    for index, names in enumerate(files, start=1):
        name = "model.safetensors" if len(files) == 1 else f"model-{index:05d}-of-{len(files):05d}.safetensors"
        tensors = {}
        for key, param in _named(model, names):
            whole = _whole(param)
            if rank0:
                tensors[key] = whole.detach().to("cpu").contiguous()
                total += whole.numel() * whole.element_size()
            del whole
        if rank0:
            save_file(tensors, str(folder / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    if rank0:
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        model.config.save_pretrained(path)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(path)
        _finish(path, tokenizer)


def file_plan(model: torch.nn.Module, file_bytes: int) -> list[list[str]]:
    """The parameters' names (each shared parameter once, under its first name) in files of at most `file_bytes`
    each, in the model's order; a tensor larger than that is a file of its own.

    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 2))   # 64, 32 + 8 bytes
    >>> file_plan(model, 100)
    [['0.weight'], ['1.weight', '1.bias']]
    """
    files: list[list[str]] = [[]]
    size = 0
    for name, param in model.named_parameters():
        nbytes = param.numel() * param.element_size()
        if files[-1] and size + nbytes > file_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return [names for names in files if names]


def _named(model: torch.nn.Module, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    params = dict(model.named_parameters())
    for name in names:
        yield name, params[name]


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a sharded tensor on every rank (an all-gather); a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _check_finite_shards(model: torch.nn.Module, path: str) -> None:
    """Every rank's shards finite, agreed over the ranks (one all-reduce), before any file is written."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    bad = torch.tensor(float(sum(not torch.isfinite(t).all() for t in local if t.is_floating_point())))
    if torch.distributed.is_initialized():
        device = next(model.parameters()).device
        bad = bad.to(device)
        torch.distributed.all_reduce(bad)
    if bad.item():
        raise TrainingError(
            f"not exporting to {path}: weight tensors hold NaN or inf on {int(bad.item())} shards; the run "
            "diverged: lower model.lr or set trainer.gradient_clip_val, and train again"
        )


def _finish(path: str, tokenizer) -> None:
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    apply_umask(path)
    log.info("exported the model%s to %s", " and tokenizer" if tokenizer is not None else "", path)
