"""Sharded from the first byte: a model built on the meta device, split there, and only each rank's shards ever
allocated and filled, from the checkpoint's files slice by slice or from a random init computed one module at a
time.

    with deferred_weights():                       # the CLI does this under a sharded strategy
        lm = PackedCausalLM(name_or_path="smollm2")  # parameters on the meta device, buffers real
    ...                                            # configure_model: tensor parallel, fully_shard, then
    materialize(lm.model, device, Weights("smollm2", folder, seed=42))   # each rank's shards, filled

What each step keeps exact:
- the skeleton (`skeleton`) is transformers' own model class built from the config with its parameters on the meta
  device (accelerate's `init_empty_weights`) and its buffers real, computed on the host as the model computes them
  (rotary `inv_freq`, embedding scales): `to_empty` leaves garbage in them, so `materialize` copies them back. The
  embeddings are tied again after the build (the meta patch re-registers a tied weight as a copy), so a tied head
  stays one storage through sharding and `to_empty`;
- the construction probe runs on the skeleton before it is sharded (`probe_values`: the root whole and one layer
  per kind of layer, random stand-ins), so no forward of the sharded model gathers anything during setup;
- pretrained weights are read by torch's distributed checkpoint with its Hugging Face reader: each rank reads only
  the slices it holds (`safe_open(...).get_slice`), cast on copy (bf16 on disk -> the run's master dtype), from the
  files transformers reads (`weight_files`: those the index names, so a `consolidated.safetensors` shipped beside
  the shards is neither read nor downloaded); every parameter must be in the files and every file's tensor used but
  those the model class says to ignore (missing or unexpected keys named in one line);
- a random init (`model.model_config`, LoRA adapters) is `random_init.initialize`: the model's own
  `_init_weights` on a whole host copy of each module's parameters, each rank copying only its slice to its shard
  (no communication): the same weights on any number of ranks, on any strategy, as on one process.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import json
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from lit_packing._compat import checkpoint_renaming
from lit_packing.agree import agreed
from lit_packing.errors import AssetError
from lit_packing.models.random_init import initialize, initialize_in_place

_DEFERRED = contextvars.ContextVar("lit_packing_deferred_weights", default=False)
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
INDEX = "model.safetensors.index.json"  # a sharded checkpoint's map of tensor name -> file
SINGLE = "model.safetensors"  # an unsharded checkpoint's file


@contextlib.contextmanager
def deferred_weights() -> Iterator[None]:
    """Models built inside (`PackedCausalLM`) get their parameters on the meta device; `materialize` fills them once
    they are sharded. Lightning's `trainer.init_module(empty_init=True)` (a meta default device) does the same."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def deferring() -> bool:
    """Whether a model built now is built on the meta device (inside `deferred_weights`, or under a meta default
    device)."""
    return _DEFERRED.get() or torch.empty(0).device.type == "meta"


class Weights(NamedTuple):
    """Where a materialised model's values come from.

    Attributes:
        name: the model's name as the user gave it (`model.name_or_path`), for messages.
        folder: the pretrained model's local folder (its safetensors files), or None for a random init.
        seed: the random init's seed (the same on every rank), for a random init and for what the files do not
            hold (LoRA adapters).
    """

    name: str
    folder: str | None
    seed: int


def skeleton(build: Callable[[], PreTrainedModel]) -> PreTrainedModel:
    """`build()` (a transformers `from_config`) with its parameters on the meta device and its buffers on the host,
    its tied weights tied again."""
    from accelerate import init_empty_weights

    with torch.device("cpu"), init_empty_weights(include_buffers=False):
        lm = build()
    lm.tie_weights()  # init_empty_weights re-registers the tied head as a copy of the embeddings: one storage again
    return lm


def local_folder(name_or_path: str) -> str:
    """The local folder of a pretrained model: the path itself, else the Hub snapshot of its config and safetensors
    files (downloaded once by huggingface_hub, which needs network)."""
    if Path(name_or_path).is_dir():
        return name_or_path
    from huggingface_hub import snapshot_download

    folder = Path(snapshot_download(name_or_path, allow_patterns=["*.json"]))
    wanted = indexed_files(folder) or [SINGLE]  # only the files the index names (not a consolidated copy beside them)
    return snapshot_download(name_or_path, allow_patterns=["*.json", *wanted])


def indexed_files(folder: Path) -> list[str] | None:
    """The file names a checkpoint's index (`model.safetensors.index.json`) maps its tensors to; None without one."""
    if not (folder / INDEX).is_file():
        return None
    return sorted({*json.loads((folder / INDEX).read_text())["weight_map"].values()})


def weight_files(folder: Path, name: str) -> list[Path]:
    """The safetensors files of a checkpoint folder that hold its weights, as transformers reads them: the files its
    index (`model.safetensors.index.json`) names, else `model.safetensors`, else (a folder of another writer) every
    `.safetensors` file in it. Other files beside them (Mistral's `consolidated.safetensors`) are not read.

    Raises:
        AssetError: the index names a file the folder lacks.
    """
    names = indexed_files(folder)
    if names is not None:
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise AssetError("model.name_or_path", f"{name} ({folder}): {INDEX} names {missing[0]}, which is not there",
                             "download the checkpoint again (a file is missing)")  # fmt: skip
        return [folder / n for n in names]
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    return sorted(folder.glob("*.safetensors"))


@contextlib.contextmanager
def only_files(folder: Path, files: list[Path]) -> Iterator[Path]:
    """`folder` itself when `files` are all its safetensors files, else a scratch folder linking just `files` (torch's
    Hugging Face reader reads every `.safetensors` file of the folder it is given)."""
    if set(files) == set(folder.glob("*.safetensors")):
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="lit_packing_weights_") as scratch:
        for file in files:
            (Path(scratch) / file.name).symlink_to(file.resolve())
        yield Path(scratch)


def is_meta(model: torch.nn.Module) -> bool:
    """Whether any parameter of `model` is still on the meta device (to be materialised)."""
    return any(p.is_meta for p in model.parameters())


def materialize(
    model: torch.nn.Module, device: torch.device | str, weights: Weights, parameters_on_host: bool = False
) -> None:
    """Allocate `model`'s parameters (each rank's shards, when it is sharded) on `device`, in place, and fill them:
    the buffers as the model built them, the parameters from `weights.folder`'s safetensors (each rank its slices)
    and, for what the files do not hold (LoRA adapters) or a random init, `initialize`. `parameters_on_host`: the
    parameters (shards) are allocated in host memory and only the buffers on `device` (FSDP2's `cpu_offload`, where
    the shards live on the host: none is ever allocated on the device).

    Raises:
        AssetError: the folder holds no safetensors files, or its tensors do not match the model's parameters.
        ConfigError: a parameter that no init fills (naming it).
    """
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model.to_empty(device="cpu" if parameters_on_host else device)
    _base(model).tie_weights()  # a plain `to_empty` allocates each module's parameters anew: a tied head, a copy
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    if parameters_on_host:
        _buffers_to(model, torch.device(device))
    if weights.folder is None:
        initialize(model, weights.seed)
        return
    loaded = load_slices(model, weights)
    initialize(model, weights.seed, only=lambda name: name not in loaded)


@contextlib.contextmanager
def host_memory_returned() -> Iterator[None]:
    """Inside, glibc hands every freed block of 1 MiB or more back to the system at once (a fixed mmap threshold);
    on exit the threshold is 32 MiB, where glibc's own adaptive threshold ends, and what is freed is trimmed. The
    slices read, the scratch copies and the probe's stand-in values are freed one after another in blocks of
    different sizes and from several threads: kept in glibc's heaps they held a rank's resident memory near the
    whole model's (measured on each of 4 CPU ranks, a 239M-parameter model: a setup peak of 1.54 x its fp32 size
    above the interpreter's own, 0.81 x with this, when the probe still ran on the sharded model). A no-op where
    the C library is not glibc."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
            libc.malloc_trim(0)


@contextlib.contextmanager
def probe_values(model: torch.nn.Module, layers: list[str], seed: int = 0) -> Iterator[None]:
    """Inside, a skeleton (`is_meta`) holds values on the host for the construction probe's forwards (packing's
    checks, the head check) without ever holding the whole model: what lies outside the decoder `layers` (names in
    the transformers model: embeddings, head, norms) whole, and one set of values per kind of layer (its class and
    its parameters' shapes), shared by every layer of that kind. The values are the model's own random init
    (its `_init_weights` under seed `seed`; a parameter that init does not know: normal, std 0.02), whatever it is later
    filled with: the probe checks what the layers do with packed rows, which is the same on any weights. On exit,
    every parameter is the meta tensor it was; the values are freed."""
    base = _base(model)
    stand_in: dict[int, torch.nn.Parameter] = {}  # id(meta parameter) -> its value inside
    kinds: dict[tuple, dict[str, torch.Tensor]] = {}  # a kind of layer -> its stand-ins by name in the layer

    def value(param: torch.Tensor) -> torch.nn.Parameter:
        if param.is_floating_point():
            data = torch.empty(param.shape, dtype=param.dtype).normal_(0, 0.02)
        else:
            data = torch.zeros(param.shape, dtype=param.dtype)
        return torch.nn.Parameter(data, requires_grad=param.requires_grad)

    for name in layers:
        named = list(base.get_submodule(name).named_parameters())
        kind = (type(base.get_submodule(name)), tuple((n, tuple(p.shape), p.dtype) for n, p in named))
        shared = kinds.setdefault(kind, {n: value(p) for n, p in named})
        stand_in.update({id(p): shared[n] for n, p in named})
    for param in model.parameters():
        if id(param) not in stand_in:
            stand_in[id(param)] = value(param)
    swapped = [(module, key, param) for module in model.modules() for key, param in module._parameters.items()
               if param is not None and id(param) in stand_in]  # fmt: skip
    try:
        for module, key, param in swapped:
            module._parameters[key] = stand_in[id(param)]
        initialize_in_place(model, seed)
        yield
    finally:
        for module, key, param in swapped:
            module._parameters[key] = param


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def checkpoint_names(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s parameters by the names a transformers checkpoint gives them (a peft model's base weights without
    its `base_model.model.` and `.base_layer`; adapters left out), each shared parameter once."""
    names: dict[str, torch.Tensor] = {}
    for name, param in _base(model).named_parameters():  # remove_duplicate: a tied head under its first name only
        if ".lora_" in name or name.startswith("lora_"):
            continue
        names[name.replace(".base_layer.", ".")] = param
    return names


def load_slices(model: torch.nn.Module, weights: Weights) -> set[str]:
    """Fill `model`'s parameters from `weights.folder`'s safetensors files, each rank reading only its slices;
    returns the model's names of the parameters filled."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    folder = Path(weights.folder)
    wanted = checkpoint_names(model)
    with agreed():  # a folder one rank cannot read stops every rank, not just that one (the others in dcp.load)
        files = weight_files(folder, weights.name)
        stored_as = model_names(model, stored_shapes(folder, weights.name, files), weights.name)
        stored = {name: shape for name, (_, shape) in stored_as.items()}
        check_names(stored, {name: tuple(p.shape) for name, p in wanted.items()}, weights.name,
                    _tied_aliases(model) | _ignored(model, stored))  # fmt: skip
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    as_stored = {stored_as[name][0] if name in stored_as else name: param for name, param in wanted.items()}
    with only_files(folder, files) as readable:
        dcp.load(as_stored, storage_reader=HuggingFaceStorageReader(str(readable)), no_dist=not distributed)
    ids = {id(p) for p in wanted.values()}
    return {name for name, p in model.named_parameters(remove_duplicate=False) if id(p) in ids}


def stored_shapes(folder: Path, name: str, files: list[Path] | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in the checkpoint's safetensors files (`weight_files`), from their headers."""
    from safetensors import safe_open

    files = weight_files(folder, name) if files is None else files
    if not files:
        raise AssetError(
            "model.name_or_path",
            f"{name} ({folder}) holds no .safetensors files, which a sharded strategy reads slice by slice",
            "convert the checkpoint to safetensors (save_pretrained writes them), or train with trainer.strategy=ddp",
        )
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def model_names(
    model: torch.nn.Module, stored: dict[str, tuple[int, ...]], name: str
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The stored tensors under the model's names for them, as transformers renames them on load: model name ->
    (stored name, shape).

    Raises:
        AssetError: a tensor transformers converts on load (merges, splits or reshapes), which slices cannot read.
    """
    rename = checkpoint_renaming(_base(model))
    found = {}
    for key, shape in stored.items():
        renamed, converted = rename(key)
        if converted:
            raise AssetError(
                "model.name_or_path",
                f"{name} stores {key} in a layout transformers converts on load (tensors merged, split or reshaped),"
                " which a sharded load cannot read slice by slice",
                "train with trainer.strategy=ddp (transformers converts it), or load it once with from_pretrained, "
                "save_pretrained it and train from that folder",
            )
        found[renamed] = (key, shape)
    return found


def check_names(
    stored: dict[str, tuple[int, ...]], wanted: dict[str, tuple[int, ...]], name: str, aliases: set[str]
) -> None:
    """Refuse, in one line, a checkpoint whose tensors are not the model's parameters: a parameter it lacks, a
    tensor the model has no place for (a tied head's second copy excepted), or a shape that differs.

    >>> check_names({"w": (2, 3)}, {"w": (2, 3)}, "m", set())
    >>> try:
    ...     check_names({"w": (2, 3), "x": (1,)}, {"w": (2, 3)}, "m", set())
    ... except AssetError as error:
    ...     print(error.problem)
    m's files do not match the model its config builds: 1 tensor the model has no parameter for (first: x)
    """
    missing = [key for key in wanted if key not in stored]
    unexpected = [key for key in stored if key not in wanted and key not in aliases]
    wrong = [(k, stored[k], wanted[k]) for k in wanted if k in stored and stored[k] != wanted[k]]
    parts = []
    if missing:
        parts.append(f"{len(missing):,} parameters the files lack (first: {missing[0]})")
    if unexpected:
        parts.append(f"{len(unexpected):,} tensor{'s' * (len(unexpected) > 1)} the model has no parameter for "
                     f"(first: {unexpected[0]})")  # fmt: skip
    if wrong:
        key, there, here = wrong[0]
        parts.append(f"{len(wrong):,} of another shape (first: {key}: {list(there)} in the files, {list(here)} here)")
    if parts:
        raise AssetError(
            "model.name_or_path",
            f"{name}'s files do not match the model its config builds: {'; '.join(parts)}",
            "check the folder's config.json against its weights, or load it with trainer.strategy=ddp to let "
            "transformers convert it",
        )


def _ignored(model: torch.nn.Module, stored: dict[str, tuple[int, ...]]) -> set[str]:
    """The stored tensors transformers ignores on load for this model class (its `_keys_to_ignore_on_load_unexpected`
    patterns: e.g. rotary `inv_freq` buffers older checkpoints saved): not read, not refused."""
    patterns = getattr(_base(model), "_keys_to_ignore_on_load_unexpected", None) or []
    return {key for key in stored if any(re.search(pattern, key) for pattern in patterns)}


def _tied_aliases(model: torch.nn.Module) -> set[str]:
    """The checkpoint names of parameters that are another parameter (a tied head): a file may hold them too."""
    named = _base(model).named_parameters(remove_duplicate=False)
    first: dict[int, str] = {}
    aliases = set()
    for name, param in named:
        if first.setdefault(id(param), name) != name:
            aliases.add(name.replace(".base_layer.", "."))
    return aliases


def _buffers_to(model: torch.nn.Module, device: torch.device) -> None:
    """Move every buffer of `model` to `device`, one moved copy per buffer however many modules share it."""
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[key] = moved.setdefault(id(buffer), buffer.to(device))


def _base(model: torch.nn.Module) -> PreTrainedModel:
    return model.get_base_model() if hasattr(model, "get_base_model") else model
