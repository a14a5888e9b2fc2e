"""A trained model out as a Hugging Face folder (safetensors files, their index, config, tokenizer), whole or
sharded; a sharded one without any rank ever holding the whole model.

    export_model(lm.model, "runs/export", tokenizer)           # one process: `save_pretrained`
    export_sharded(lm.model, "runs/export", tokenizer)         # FSDP2: a collective, every rank calls it

Sharded, the parameters are written file by file (`EXPORT_FILE_BYTES` each at most, as `save_pretrained` splits a
large model), tensor by tensor, and a tensor sharded by rows (FSDP2's `Shard(0)`) block by block: each rank sends
its rows to rank 0 in turn, which streams them into the file (`SafetensorsStream`: the header first, from the
shapes); so rank 0 holds its shards and one other rank's block, every other rank its shards alone. A tensor split
otherwise (tensor parallel's columns) is gathered whole on every rank, written and dropped.

A tied head is written once, under the embeddings' name, as `save_pretrained` writes it. A LoRA model is exported
merged into the plain model it amounts to (a quantized base dequantized), or, sharded or asked to, as its adapters
alone, gathered and saved by peft. Non-finite weights are refused before anything is written (checked a million
elements at a time: `torch.isfinite` of a whole shard held 1.8 x its bytes more). A write that fails
on rank 0 (a full disk) does not leave the senders blocked: rank 0 goes on receiving without writing, and every rank
raises at the end (`agree.agreed`).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import itertools
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from lit_packing._compat import shard_box
from lit_packing.agree import agreed
from lit_packing.errors import ConfigError, TrainingError
from lit_packing.models.quantize import merged_parts
from lit_packing.models.sharding import is_sharded
from lit_packing.models.weights import all_finite, apply_umask, check_finite_weights

log = logging.getLogger(__name__)

EXPORT_FILE_BYTES = 2**30  # one safetensors file's tensors at most (a larger single tensor is a file of its own)
INDEX = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}  # fmt: skip


def export_model(model: torch.nn.Module, path: str, tokenizer=None, state_dict=None) -> None:
    """`save_pretrained` the model (LoRA: the adapters) and, when one is known, the tokenizer; `state_dict` in place
    of the model's parameters (a LoRA model's adapters gathered from their shards).

    Raises:
        TrainingError: a weight is NaN or infinite; nothing is written.
    """
    check_finite_weights(model, path, state_dict)
    model.save_pretrained(path, **({} if state_dict is None else {"state_dict": state_dict}))
    finish_folder(path, tokenizer)


def export_lm(
    model: torch.nn.Module, path: str, tokenizer, pretrained: str | None, writer: bool, adapters_only: bool = False
) -> None:
    """Write a trained model as a Hugging Face folder with `tokenizer`, else the `pretrained` model's (its name or
    folder) when there is one: sharded, a collective that no rank holds the whole model in (`export_sharded`; LoRA:
    the adapters); else the `writer` rank (rank 0) writes it, a LoRA model merged (`export_merged`) unless
    `adapters_only`. Non-finite weights are refused (`TrainingError`) before anything is written."""
    if tokenizer is None and pretrained is not None:
        tokenizer = pretrained_tokenizer(pretrained)
    if is_sharded(model):
        if hasattr(model, "get_base_model") and not adapters_only:
            log.info("a sharded LoRA run exports its adapters; the merged model: lit-packing export --ckpt_path "
                     "<its checkpoint> (one process)")  # fmt: skip
        export_sharded(model, path, tokenizer)
    elif writer and hasattr(model, "get_base_model") and not adapters_only:
        export_merged(model, path, tokenizer, stored_dtype(pretrained))
    elif writer:
        export_model(model, path, tokenizer)


def export_merged(model: torch.nn.Module, path: str, tokenizer=None, dtype: torch.dtype | None = None,
                  file_bytes: int = EXPORT_FILE_BYTES) -> None:  # fmt: skip
    """A LoRA (or QLoRA) model as the plain model it amounts to: each adapted weight `base + scale x B A`, a quantized
    base dequantized first (`quantize.merged_parts`), in `dtype` (the base's as stored: `stored_dtype`; None: the
    dtype of the model's embeddings), with a config that names no quantization, so that `from_pretrained` loads it
    without peft or bitsandbytes. Written tensor by tensor (`SafetensorsStream`): the host holds the model and one
    merged tensor, never a merged copy beside it.

    Raises:
        TrainingError: a weight is NaN or infinite, or the merged names are not the plain model's; nothing is written.
    """
    from lit_packing.models.loading import model_class

    base = model.get_base_model()
    config = copy.deepcopy(base.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dtype = dtype or base.get_input_embeddings().weight.dtype
    config.dtype = dtype
    with torch.device("meta"):
        plain = model_class(config).from_config(config, dtype=dtype)
    parts = merged_parts(model, dtype)
    shapes = {name: t for name, t in plain.state_dict(keep_vars=True).items() if name not in _tied_keys(plain)}
    missing, unexpected = sorted(set(shapes) - set(parts)), sorted(set(parts) - set(shapes))
    if missing or unexpected:
        raise TrainingError(f"not exporting to {path}: the merged weights are not {type(plain).__name__}'s "
                            f"(missing {missing[:3]}, unexpected {unexpected[:3]})")  # fmt: skip
    check_finite_weights(model, path)
    folder, files = Path(path), file_plan(((name, shapes[name]) for name in parts), file_bytes)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("model*.safetensors"):  # a previous export's files would mix into this one
        stale.unlink()
    weight_map, total = {}, 0
    for index, names in enumerate(files, start=1):
        name = "model.safetensors" if len(files) == 1 else f"model-{index:05d}-of-{len(files):05d}.safetensors"
        with SafetensorsStream(folder / name, {key: shapes[key] for key in names}) as out:
            for key in names:
                tensor = parts[key]()
                if tensor.is_floating_point() and not all_finite(tensor):
                    raise TrainingError(f"not exporting to {path}: the merged {key} holds NaN or inf in {dtype} "
                                        "(adapters too large for it): train again with a lower model.lr")  # fmt: skip
                out.write(key, tensor)
                del tensor
        weight_map.update(dict.fromkeys(names, name))
        total += sum(shapes[key].numel() * shapes[key].element_size() for key in names)
    if len(files) > 1:
        (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                               indent=2, sort_keys=True) + "\n")  # fmt: skip
    plain.config.save_pretrained(path)
    if getattr(base, "generation_config", None) is not None and base.can_generate():
        base.generation_config.save_pretrained(path)
    finish_folder(path, tokenizer)


def stored_dtype(name_or_path: str | None) -> torch.dtype | None:
    """The dtype a pretrained model's config says its weights are stored in (`dtype`, or `torch_dtype` in older
    configs); None where it says none or cannot be read (a merged export then keeps the trained dtype)."""
    if name_or_path is None:
        return None
    from transformers import AutoConfig

    from lit_packing.assets import resolve_pretrained

    try:
        value = getattr(AutoConfig.from_pretrained(resolve_pretrained(name_or_path, with_model=False)), "dtype", None)
    except Exception:  # noqa: BLE001 (any failure to read it means: keep the trained dtype)
        return None
    value = getattr(torch, value) if isinstance(value, str) else value
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


def _tied_keys(model: torch.nn.Module) -> set[str]:
    """The parameter names that share an earlier one's tensor (a tied LM head), which a state dict may leave out."""
    first, tied = set(), set()
    for name, tensor in model.named_parameters(remove_duplicate=False):
        (tied.add(name) if id(tensor) in first else first.add(id(tensor)))
    return tied


def export_sharded(model: torch.nn.Module, path: str, tokenizer=None, file_bytes: int = EXPORT_FILE_BYTES) -> None:
    """Write a sharded model as one Hugging Face folder, file by file (the module docstring); every rank calls it.

    Raises:
        TrainingError: (on every rank) a weight is NaN or infinite on some rank; nothing is written.
    """
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    _check_finite_shards(model, path)
    if hasattr(model, "get_base_model"):  # LoRA: the adapters only, small: gathered whole, saved by peft
        adapters = {name: _whole(p) for name, p in model.state_dict().items() if ".lora_" in name}
        with agreed():
            if rank0:
                model.save_pretrained(path, state_dict={name: t.cpu() for name, t in adapters.items()})
                finish_folder(path, tokenizer)
        return
    files = file_plan(model.named_parameters(), file_bytes)
    folder = Path(path)
    # Rank 0 writes what the others send it. Should a write fail there (a full disk, a folder it may not write), it
    # keeps receiving without writing, so no sender is left blocked in a send, and every rank raises at the end.
    error: Exception | None = None
    if rank0:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for stale in folder.glob("model*.safetensors"):  # a previous export's files would mix into this one
                stale.unlink()
        except OSError as raised:
            error = raised
    params, weight_map, total = dict(model.named_parameters()), {}, 0
    for index, names in enumerate(files, start=1):
        name = "model.safetensors" if len(files) == 1 else f"model-{index:05d}-of-{len(files):05d}.safetensors"
        with contextlib.ExitStack() as stack:
            out = None
            if rank0 and error is None:
                try:
                    out = stack.enter_context(SafetensorsStream(folder / name, {key: params[key] for key in names}))
                except OSError as raised:
                    error = raised
            for key in names:
                blocks = _rows_on_rank0(params[key])  # every rank runs it through: it sends its block in turn
                if out is not None and error is None:
                    try:
                        out.write_rows(key, blocks)
                    except (OSError, ValueError) as raised:
                        error = raised
                        stack.pop_all().close()  # incomplete: `SafetensorsStream` removes its partial file
                collections.deque(blocks, maxlen=0)  # what is left of it still received (and sent)
        weight_map.update(dict.fromkeys(names, name))
        total += sum(params[key].numel() * params[key].element_size() for key in names)
    with agreed():
        if error is not None:
            raise ConfigError("model.export_dir", f"could not write {path}: {error}",
                              "free space there or set it to another folder") from error  # fmt: skip
        if rank0:
            if len(files) > 1:
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            model.config.save_pretrained(path)
            if getattr(model, "generation_config", None) is not None and model.can_generate():
                model.generation_config.save_pretrained(path)
            finish_folder(path, tokenizer)


class SafetensorsStream:
    """One safetensors file written tensor by tensor: its header (every tensor's name, dtype, shape and offsets)
    first, from the tensors' shapes alone, then each tensor's bytes as it comes, so that the writer holds one tensor
    at a time (safetensors' own `save_file` takes them all at once and copies each to bytes). The file is read by
    safetensors (and so `from_pretrained`) as any other; written under a hidden name, renamed when complete."""

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        self.path, self.partial = path, path.with_name(f".{path.name}.partial")
        self.order, self.shapes, offset, header = list(tensors), {}, 0, {"__metadata__": {"format": "pt"}}
        for key, tensor in tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            header[key] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                           "data_offsets": [offset, offset + nbytes]}  # fmt: skip
            self.shapes[key] = (tuple(tensor.shape), tensor.dtype)
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        self.header = encoded + b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        self.written = 0

    def __enter__(self) -> SafetensorsStream:
        self.file = open(self.partial, "wb")  # noqa: SIM115 (closed in __exit__)
        self.file.write(len(self.header).to_bytes(8, "little") + self.header)
        return self

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """The next tensor, whole."""
        self._turn(key)
        if (tuple(tensor.shape), tensor.dtype) != self.shapes[key]:
            raise ValueError(f"{key}: expected {self.shapes[key]}, got {(tuple(tensor.shape), tensor.dtype)}")
        self._append(tensor)
        self.written += 1

    def write_rows(self, key: str, blocks: Iterable[torch.Tensor]) -> None:
        """The next tensor (of one dimension or more) as consecutive blocks of its rows."""
        self._turn(key)
        (rows, *rest), dtype = self.shapes[key]
        for block in blocks:
            if block.dtype != dtype or list(block.shape[1:]) != rest:
                raise ValueError(f"{key}: a block of {tuple(block.shape)} {block.dtype}, not rows of {(rows, *rest)}")
            self._append(block)
            rows -= block.shape[0]
        if rows:
            raise ValueError(f"{key}: {rows} rows short of {self.shapes[key][0]}")
        self.written += 1

    def _turn(self, key: str) -> None:
        if key != self.order[self.written]:
            raise ValueError(f"{key}: expected {self.order[self.written]} next")

    def _append(self, tensor: torch.Tensor) -> None:
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self.file.write(memoryview(data.numpy()))

    def __exit__(self, kind, value, traceback) -> None:
        self.file.close()
        if kind is None and self.written == len(self.order):
            self.partial.replace(self.path)
        else:
            self.partial.unlink(missing_ok=True)


def pretrained_tokenizer(name_or_path: str):
    """The tokenizer of a pretrained model, to save beside its export; None when there is none to load (a nicety:
    the weights are what matters)."""
    from transformers import AutoTokenizer

    from lit_packing.assets import resolve_pretrained

    try:
        return AutoTokenizer.from_pretrained(resolve_pretrained(name_or_path, with_model=False))
    except Exception:  # noqa: BLE001 (any failure to load one means: export without it)
        return None


def file_plan(named: Iterable[tuple[str, torch.Tensor]], file_bytes: int) -> list[list[str]]:
    """The tensors' names (`named`: a model's `named_parameters()`, each shared parameter once, under its first
    name) in files of at most `file_bytes` each, in their order; a tensor larger than that is a file of its own.

    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 2))   # 64, 32 + 8 bytes
    >>> file_plan(model.named_parameters(), 80)
    [['0.weight'], ['1.weight', '1.bias']]
    """
    files: list[list[str]] = [[]]
    size = 0
    for name, param in named:
        nbytes = param.numel() * param.element_size()
        if files[-1] and size + nbytes > file_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return [names for names in files if names]


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a sharded tensor on every rank (an all-gather); a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _rows_on_rank0(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """A tensor's rows, block after block in order, on rank 0; every rank runs it through, sending its block when
    its turn comes (point to point), so rank 0 holds one block at a time; ranks outside rank 0's mesh hold a copy
    and send nothing. A tensor whose shards are not row blocks is gathered whole on every rank; a plain tensor is
    itself."""
    blocks = _row_blocks(tensor) if isinstance(tensor, DTensor) else None
    if blocks is None:
        yield _whole(tensor)
        return
    if 0 not in tensor.device_mesh.mesh.flatten().tolist():
        return  # a copy on ranks apart from rank 0's (a replicated weight's tensor-parallel peers): rank 0 has its own
    me, local = torch.distributed.get_rank(), tensor.to_local()
    for owner, rows in blocks:
        if owner == me == 0:
            yield local
        elif owner == me:
            torch.distributed.send(local.contiguous(), dst=0)
        elif me == 0:
            block = local.new_empty((rows, *tensor.shape[1:]))
            torch.distributed.recv(block, src=owner)
            yield block


def _row_blocks(tensor: DTensor) -> list[tuple[int, int]] | None:
    """(owner's global rank, rows) of each distinct block of a tensor sharded by rows (every placement `Shard(0)`
    or `Replicate`), in row order, each held by the lowest rank that has it, the blocks cut by DTensor's own shard
    arithmetic at every mesh coordinate; None for any other placement (tensor parallel's columns, FSDP2's strided
    shards over tensor parallel).

    Raises:
        RuntimeError: this rank's own block is not the size the split gives (a placement this does not know).
    """
    by_rows = all(type(p) is Replicate or (type(p) is Shard and p.dim == 0) for p in tensor.placements)
    if tensor.dim() == 0 or not by_rows:
        return None
    mesh, owners = tensor.device_mesh, {}
    for coordinate in itertools.product(*map(range, mesh.shape)):
        shape, offset = shard_box(tensor.shape, mesh, tensor.placements, coordinate)
        start, stop = offset[0], offset[0] + shape[0]
        rank = int(mesh.mesh[coordinate])
        owners[(start, stop)] = min(rank, owners.get((start, stop), rank))
        if tuple(coordinate) == tuple(mesh.get_coordinate()) and stop - start != tensor.to_local().shape[0]:
            raise RuntimeError(f"a shard of {stop - start} rows expected, {tensor.to_local().shape[0]} held")
    return [(owner, stop - start) for (start, stop), owner in sorted(owners.items()) if stop > start]


def _check_finite_shards(model: torch.nn.Module, path: str) -> None:
    """Every rank's shards finite, agreed over the ranks (one all-reduce), before any file is written."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    bad = torch.tensor(float(sum(not all_finite(t) for t in local if t.is_floating_point())))
    if torch.distributed.is_initialized():
        device = next(model.parameters()).device
        bad = bad.to(device)
        torch.distributed.all_reduce(bad)
    if bad.item():
        raise TrainingError(
            f"not exporting to {path}: weight tensors hold NaN or inf on {int(bad.item())} shards; the run "
            "diverged: lower model.lr or set trainer.gradient_clip_val, and train again"
        )


def finish_folder(path: str, tokenizer) -> None:
    """The tokenizer beside the weights, the files' mode as a plain `open()` gives, one line saying so."""
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    apply_umask(path)
    log.info("exported the model%s to %s", " and tokenizer" if tokenizer is not None else "", path)
