"""`lit-packing export --ckpt_path <checkpoint> --output <folder>`: a run's checkpoint as a Hugging Face folder with
its tokenizer, in one process, one output file's tensors at a time: a single file (one device, DDP) or a sharded
run's distributed checkpoint folder; a LoRA or QLoRA run's adapters merged into its base (or alone).

    export_checkpoint("runs/quickstart/version_0/checkpoints/last.ckpt", "runs/export")
"""

from __future__ import annotations

import inspect
import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from lit_packing.errors import AssetError, TrainingError
from lit_packing.models.export import (
    EXPORT_FILE_BYTES,
    INDEX,
    SafetensorsStream,
    file_plan,
    finish_folder,
    pretrained_tokenizer,
)
from lit_packing.models.loading import build_model
from lit_packing.models.weights import all_finite
from lit_packing.preflight import SHARDED_METADATA, read_checkpoint


def export_checkpoint(
    ckpt_path: str, output: str, file_bytes: int = EXPORT_FILE_BYTES, adapters_only: bool = False
) -> None:
    """`lit-packing export --ckpt_path <checkpoint> --output <folder>`: a run's checkpoint as a Hugging Face folder,
    in one process holding one output file's tensors at a time. The model is rebuilt on the meta device from the
    checkpoint's own settings (its `hyper_parameters`); each output file's tensors are then read, from the
    memory-mapped file, or from every rank's shards of a distributed checkpoint (the folder
    `ModelParallelStrategy` writes; torch's distributed checkpoint, without a process group), and streamed into it.

    A LoRA (or QLoRA) run's checkpoint holds its adapters: the base model is built whole from its settings, the
    adapters read into it, and the model they amount to written (`export.export_merged`), or with `adapters_only`
    peft's adapter folder.

    Raises:
        AssetError: the path is not a checkpoint of a `PackedCausalLM`.
        TrainingError: a weight holds NaN or inf.
    """
    folder = Path(ckpt_path)
    distributed = folder.is_dir() and (folder / SHARDED_METADATA).is_file()
    if not distributed and not folder.is_file():
        raise AssetError("--ckpt_path", f"{ckpt_path} is neither a checkpoint file nor a distributed checkpoint (a "
                         f"folder with {SHARDED_METADATA} and the ranks' .distcp shards)",
                         "give a run's checkpoint, e.g. runs/quickstart/version_0/checkpoints/last.ckpt")  # fmt: skip
    checkpoint = read_checkpoint(folder / SHARDED_METADATA if distributed else folder, ckpt_path)
    hp = checkpoint.get("hyper_parameters") or {}
    if "name_or_path" not in hp:
        raise AssetError("--ckpt_path", f"{ckpt_path} holds no PackedCausalLM settings (hyper_parameters)",
                         "give a checkpoint of a lit_packing run")  # fmt: skip
    if hp.get("lora"):
        export_lora(checkpoint, folder if distributed else None, hp, output, adapters_only)
        return
    model, _ = build_model(hp["name_or_path"], hp.get("model_config"), hp.get("vocab_size"), hp.get("dtype"),
                           "per_example", "cpu", check=False, check_head=False, deferred=True)  # fmt: skip
    params = dict(model.named_parameters())
    if distributed:
        stored = {key: meta.properties.dtype
                  for key, meta in FileSystemReader(str(folder)).read_metadata().state_dict_metadata.items()
                  if hasattr(meta, "properties")}  # fmt: skip
    else:
        state = checkpoint.get("state_dict") or {}
        stored = {key: tensor.dtype for key, tensor in state.items()}
    prefix = next((p for p in ("state_dict.model.", "model.") if f"{p}{next(iter(params))}" in stored), None)
    if prefix is None:
        raise AssetError("--ckpt_path", f"{ckpt_path}'s weights are not the model its settings build",
                         "give the checkpoint of the run whose settings it holds")  # fmt: skip

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        if not distributed:
            return {key: state[prefix + key] for key in names}  # memory-mapped: read as the file is written
        tensors = {key: torch.empty(tuple(params[key].shape), dtype=stored[prefix + key]) for key in names}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({prefix + key: t for key, t in tensors.items()}, checkpoint_id=str(folder), no_dist=True)
        return tensors

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    files = file_plan(model.named_parameters(), file_bytes)
    weight_map, total = {}, 0
    for index, names in enumerate(files, start=1):
        name = "model.safetensors" if len(files) == 1 else f"model-{index:05d}-of-{len(files):05d}.safetensors"
        tensors = read(names)
        broken = [key for key, t in tensors.items() if t.is_floating_point() and not all_finite(t)]
        if broken:
            raise TrainingError(f"not exporting {ckpt_path}: {broken[0]} holds NaN or inf; the run diverged: "
                                "export an earlier checkpoint")  # fmt: skip
        with SafetensorsStream(out / name, tensors) as stream:
            for key, tensor in tensors.items():
                stream.write(key, tensor)
        weight_map.update(dict.fromkeys(names, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if len(files) > 1:
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2,
                                            sort_keys=True) + "\n")  # fmt: skip
    model.config.save_pretrained(out)
    tokenizer = pretrained_tokenizer(hp["name_or_path"]) if hp["name_or_path"] else None  # the one the data used
    finish_folder(str(out), tokenizer)


def export_lora(checkpoint: dict, distributed: Path | None, hp: dict, output: str, adapters_only: bool) -> None:
    """A LoRA run's checkpoint (its adapters: a file's `state_dict`, or a distributed checkpoint's shards read whole)
    as the merged model, or its adapters alone, with the tokenizer: the model is rebuilt in this process from the
    run's settings (its base weights, quantized as the run had them), the adapters loaded into it."""
    from lit_packing.models import PackedCausalLM

    if hp.get("model_config") is not None:
        raise AssetError("--ckpt_path", "a LoRA run on a random init (model.model_config) keeps its adapters alone: "
                         "the base it trained on is not in the checkpoint", "export it from the run itself: "
                         "model.export_dir")  # fmt: skip
    settings = {k: v for k, v in hp.items() if k in inspect.signature(PackedCausalLM).parameters}
    lm = PackedCausalLM(**{**settings, "isolation_check": False, "memory_check": False, "export_dir": None})
    adapters = {name: tensor for name, tensor in lm.state_dict().items() if ".lora_" in name}
    if distributed is None:
        stored = checkpoint.get("state_dict") or {}
        missing = sorted(adapters.keys() - stored.keys())
        loaded = {name: stored[name] for name in adapters if name in stored}
    else:
        stored = FileSystemReader(str(distributed)).read_metadata().state_dict_metadata
        prefix = "state_dict." if any(key.startswith("state_dict.") for key in stored) else ""
        missing = sorted(name for name in adapters if prefix + name not in stored)
        loaded = {name: torch.empty_like(tensor) for name, tensor in adapters.items() if prefix + name in stored}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({prefix + name: t for name, t in loaded.items()}, checkpoint_id=str(distributed), no_dist=True)
    if missing:
        raise AssetError("--ckpt_path", f"the checkpoint lacks the adapters its LoRA settings make ({missing[0]}, "
                         f"{len(missing)} in all)", "give the checkpoint of the run that holds them")  # fmt: skip
    lm.load_state_dict(loaded, strict=False)
    lm.hparams.export_adapters_only = adapters_only
    lm.export(output)
