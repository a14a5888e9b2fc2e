"""`lit-packing export --ckpt_path <distributed checkpoint> --output <folder>`: a sharded run's checkpoint as a
Hugging Face folder, in one process, one file's tensors at a time.

    export_checkpoint("runs/checkpoints/last.ckpt", "runs/export")
"""

from __future__ import annotations

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
from lit_packing.preflight import read_checkpoint


def export_checkpoint(ckpt_path: str, output: str, file_bytes: int = EXPORT_FILE_BYTES) -> None:
    """`lit-packing export --ckpt_path <distributed checkpoint> --output <folder>`: a sharded run's checkpoint (the
    folder `ModelParallelStrategy` writes) as a Hugging Face folder, in one process holding one file's tensors at a
    time: the model is rebuilt on the meta device from the checkpoint's own settings (its `hyper_parameters`),
    then each output file's tensors are read from every rank's shards (torch's distributed checkpoint, without a
    process group) and streamed into the file.

    Raises:
        AssetError: the folder is not a distributed checkpoint of a `PackedCausalLM`, or was trained with LoRA
            (its adapters are exported by the run itself: `model.export_dir`).
    """
    folder = Path(ckpt_path)
    meta = folder / "meta.pt"
    if not folder.is_dir() or not meta.is_file():
        raise AssetError("--ckpt_path", f"{ckpt_path} is not a distributed checkpoint (a folder with meta.pt and the "
                         "ranks' .distcp shards, as trainer.strategy=ModelParallelStrategy writes)",
                         "give the folder a sharded run saved (e.g. runs/checkpoints/last.ckpt)")  # fmt: skip
    hp = read_checkpoint(meta).get("hyper_parameters") or {}
    if "name_or_path" not in hp:
        raise AssetError("--ckpt_path", f"{ckpt_path} holds no PackedCausalLM settings (hyper_parameters)",
                         "give a checkpoint of a lit_packing run")  # fmt: skip
    if hp.get("lora"):
        raise AssetError("--ckpt_path", f"{ckpt_path} was trained with LoRA (model.lora): its adapters are what "
                         "to export", "set model.export_dir in the run: it saves the adapters")  # fmt: skip
    model, _ = build_model(hp["name_or_path"], hp.get("model_config"), hp.get("vocab_size"), hp.get("dtype"),
                           "per_example", "cpu", check=False, check_head=False, deferred=True)  # fmt: skip
    stored = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    prefix = next((p for p in ("state_dict.model.", "model.") if f"{p}{next(iter(dict(model.named_parameters())))}"
                   in stored), None)  # fmt: skip
    if prefix is None:
        raise AssetError("--ckpt_path", f"{ckpt_path}'s weights are not the model its settings build",
                         "give the checkpoint of the run whose settings it holds")  # fmt: skip
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    files, params = file_plan(model, file_bytes), dict(model.named_parameters())
    weight_map, total = {}, 0
    for index, names in enumerate(files, start=1):
        name = "model.safetensors" if len(files) == 1 else f"model-{index:05d}-of-{len(files):05d}.safetensors"
        tensors = {key: torch.empty(tuple(params[key].shape), dtype=stored[prefix + key].properties.dtype)
                   for key in names}  # fmt: skip
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({prefix + key: t for key, t in tensors.items()}, checkpoint_id=str(folder), no_dist=True)
        broken = [key for key, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
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
    tokenizer = pretrained_tokenizer(hp["name_or_path"]) if hp.get("model_config") is None else None
    finish_folder(str(out), tokenizer)
