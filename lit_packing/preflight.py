"""What a command checks before anything loads (no model, no data, no trainer): that this machine has the
accelerator and devices the trainer settings ask for, that `--ckpt_path` exists, and that a resumed fit has
something left to train. Each failure is one `ConfigError` naming the setting and the value that works.

    preflight("fit", trainer_settings, "runs/quickstart/version_0/checkpoints/last.ckpt")   # before anything loads
"""

from __future__ import annotations

import pickle
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lit_packing._compat import checkpoint_position
from lit_packing.assets import looks_like_path
from lit_packing.errors import AssetError, ConfigError
from lit_packing.text import dividing_fix

# `--ckpt_path` values Lightning resolves itself (not files).
SPECIAL_CKPT_PATHS = ("last", "best", "hpc", "registry")


@dataclass(frozen=True)
class Position:
    """Where a checkpoint's run stands (read without loading its tensors).

    Attributes:
        path: the checkpoint file.
        global_step: optimizer steps taken since the run started.
        epoch: the epoch the checkpoint was taken in (0-based).
        epochs_completed: whole epochs finished.
    """

    path: str
    global_step: int
    epoch: int
    epochs_completed: int

    def describe(self) -> str:
        return f"{self.path} is at optimizer step {self.global_step:,} (epoch {self.epoch})"


def launch_shape(trainer: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, int]:
    """The `trainer.devices` and `trainer.num_nodes` a multi-process launcher (`srun` on SLURM, `torchrun`) gives,
    for the settings left to it (`devices: auto`, `num_nodes` unset or 1), so that one config runs on whatever
    shape the job has; {} when no launcher started this process or the settings are the user's.

    >>> launch_shape({"devices": "auto", "num_nodes": 1}, {"SLURM_NTASKS": "16", "SLURM_NNODES": "2",
    ...     "SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_NAME": "train"})
    {'devices': 8, 'num_nodes': 2}
    >>> launch_shape({"devices": "auto"}, {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"})
    {'devices': 4, 'num_nodes': 2}
    """
    slurm = "SLURM_NTASKS" in environ and environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")
    if slurm and environ.get("SLURM_NTASKS_PER_NODE", "").isdigit() and environ.get("SLURM_NNODES", "").isdigit():
        per_node, nodes = int(environ["SLURM_NTASKS_PER_NODE"]), int(environ["SLURM_NNODES"])
    elif "TORCHELASTIC_RUN_ID" in environ and environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        per_node = int(environ["LOCAL_WORLD_SIZE"])
        nodes = int(environ.get("WORLD_SIZE", per_node)) // per_node
    else:
        return {}
    shape = {"devices": per_node} if trainer.get("devices", "auto") == "auto" else {}
    return shape | ({"num_nodes": nodes} if trainer.get("num_nodes") in (None, 1) else {})


def preflight(
    subcommand: str, trainer: Mapping[str, Any], ckpt_path: str | None, data: Mapping[str, Any] | None = None
) -> Position | None:
    """Run every check for `subcommand` (`fit`, `validate`, `test`, ...); the checkpoint's position, if any."""
    check_devices(trainer.get("accelerator"), trainer.get("devices"))
    if subcommand == "fit" and data is not None:
        check_global_batch(data.get("packs_per_step"), trainer.get("devices"), trainer.get("num_nodes"))
    position = read_position(ckpt_path) if ckpt_path and ckpt_path not in SPECIAL_CKPT_PATHS else None
    if subcommand == "fit" and position is not None:
        check_left_to_train(position, trainer.get("max_steps"), trainer.get("max_epochs"))
    return position


def check_devices(accelerator: Any, devices: Any) -> None:
    """Refuse an accelerator this machine lacks, or more devices than it has, naming what it has."""
    if not isinstance(accelerator, str):  # `auto`, None, or an Accelerator object: Lightning chooses
        return
    kind = accelerator.lower()
    if kind in ("gpu", "cuda") and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ConfigError(
            "trainer.accelerator",
            f"{accelerator} asks for a CUDA GPU, and this machine has none (torch {torch.__version__}, {build})",
            "set --trainer.accelerator=cpu (or auto); configs/gpu.yaml is for machines with a GPU",
        )
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("trainer.accelerator", "mps asks for an Apple GPU, and this machine has none", "use cpu")
    if kind in ("gpu", "cuda") and isinstance(devices, int) and devices > torch.cuda.device_count():
        have = torch.cuda.device_count()
        raise ConfigError(
            "trainer.devices",
            f"{devices} GPUs asked, and this machine has {have}",
            f"set --trainer.devices={have} (or -1: all of them), or launch on more machines (trainer.num_nodes)",
        )


def check_global_batch(packs_per_step: Any, devices: Any, num_nodes: Any) -> None:
    """Refuse `data.packs_per_step` that the launch's ranks (`trainer.devices` x `trainer.num_nodes`, where both
    are counts) cannot split evenly, before any process starts; the data module checks it again on the world size
    it gets."""
    devices = int(devices) if isinstance(devices, str) and devices.isdigit() else devices
    if not isinstance(packs_per_step, int) or not isinstance(devices, int) or devices < 1:
        return
    world = devices * (num_nodes if isinstance(num_nodes, int) else 1)
    if packs_per_step % world:
        raise ConfigError(
            "data.packs_per_step",
            f"{packs_per_step} packs per optimizer step cannot be split evenly over {world} ranks "
            f"(trainer.devices={devices} x trainer.num_nodes={num_nodes or 1})",
            dividing_fix(packs_per_step, world, "data.packs_per_step"),
        )


def read_position(ckpt_path: str) -> Position:
    """The run's position in a checkpoint file, or an `AssetError` naming `--ckpt_path` when there is none."""
    path = Path(ckpt_path).expanduser()
    if path.is_dir() and (path / SHARDED_METADATA).is_file():
        path = path / SHARDED_METADATA  # a sharded (distributed) checkpoint: its loops' state beside the shards
    if not path.is_file():
        where = "a folder, not a checkpoint file" if path.is_dir() else "no such file"
        hint = f" (looked in {Path.cwd()})" if not path.is_absolute() and looks_like_path(ckpt_path) else ""
        raise AssetError(
            "--ckpt_path",
            f"{ckpt_path!r}: {where}{hint}",
            "give a checkpoint (e.g. runs/quickstart/version_0/checkpoints/last.ckpt), or last: the run's newest",
        )
    step, epoch, completed = checkpoint_position(read_checkpoint(path, ckpt_path))
    return Position(str(ckpt_path), step, epoch, completed)


# What Lightning's ModelParallelStrategy writes beside the shards of a distributed checkpoint (a folder): everything
# but the weights and optimizer states, from global rank 0.
SHARDED_METADATA = "meta.pt"
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format is a zip archive
# torch names the first object it refuses: "Unsupported global: GLOBAL x.y ..." or "... unsupported GLOBAL x.y ..."
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
LIGHTNING_KEY = "pytorch-lightning_version"  # every checkpoint Lightning writes has it


def read_checkpoint(path: Path, shown: str | None = None) -> dict[str, Any]:
    """A checkpoint's contents through PyTorch's safe loader (`weights_only=True`: tensors and plain values only,
    so a crafted file cannot run code; its tensors memory-mapped, not read), or one `AssetError` naming the file
    and what is wrong with it: empty, cut short, not torch.save's format, objects the safe loader refuses, not a
    Lightning checkpoint.

    Safe reading costs nothing here: every checkpoint the toolkit writes holds tensors and plain values only.
    """
    shown = shown or str(path)

    def refuse(problem: str, fix: str = "give a checkpoint this toolkit (Lightning) wrote, e.g. last.ckpt") -> None:
        raise AssetError("--ckpt_path", f"{shown} {problem}", fix)

    with open(path, "rb") as f:
        head = f.read(4)
    if not head:
        refuse("is empty (0 bytes): the copy or the save that wrote it did not finish")
    if head != ZIP_MAGIC:
        refuse("is not a checkpoint: torch.save's zip format starts otherwise (a legacy pickle, text, another format)")
    if not zipfile.is_zipfile(path):
        refuse(
            f"is damaged or cut short ({path.stat().st_size:,} bytes, a zip archive without its directory: an "
            "interrupted copy or a full disk)",
            "copy it again from where it was written, or resume from an earlier checkpoint",
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as error:
        found = _REFUSED_GLOBAL.search(str(error))
        lines = [line for line in str(error).splitlines() if "Unsupported" in line or "Unpickler" in line]
        what = found[1] if found else (lines[0].strip() if lines else "objects of other types than tensors")
        refuse(
            f"holds {what}, which the safe loader does not read: unpickling it could run code; only checkpoints "
            "of plain tensors and values are read",
            "resume from a checkpoint this toolkit wrote; a file from elsewhere is code, not data, unless it "
            "holds plain tensors",
        )
    except (RuntimeError, EOFError, KeyError, ValueError) as error:  # a zip whose members are damaged
        refuse(f"is damaged: {str(error).strip().splitlines()[0]}", "copy it again, or resume from an earlier one")
    if not isinstance(checkpoint, dict) or LIGHTNING_KEY not in checkpoint:
        keys = ", ".join(map(str, list(checkpoint)[:4])) if isinstance(checkpoint, dict) else type(checkpoint).__name__
        refuse(f"is not a Lightning checkpoint (a torch.save file of {keys or 'nothing'}; no {LIGHTNING_KEY})")
    return checkpoint


def check_left_to_train(position: Position, max_steps: int | None, max_epochs: int | None) -> None:
    """Refuse a resumed fit that would train nothing: `max_steps` and `max_epochs` count from the start of the run,
    not from the checkpoint. The message gives the value that trains as much again."""
    step, done = position.global_step, position.epochs_completed
    if max_steps is not None and max_steps >= 0 and step >= max_steps:
        more = max(max_steps, 1)
        raise ConfigError(
            "trainer.max_steps",
            f"{max_steps:,} counts optimizer steps from the start of the run, and {position.describe()}: nothing is "
            "left to train",
            f"--trainer.max_steps={step + more} trains {more:,} more (--trainer.max_steps=-1 "
            f"--trainer.max_epochs={done + 1}: to the end of the epoch it is in)",
        )
    if max_epochs is None:  # Lightning's default: 1,000 epochs unless max_steps is set
        max_epochs = 1000 if max_steps is None or max_steps < 0 else -1
    if max_epochs >= 0 and done >= max_epochs:
        raise ConfigError(
            "trainer.max_epochs",
            f"{max_epochs:,} counts epochs from the start of the run, and {position.describe()}, with {done:,} "
            f"{'epoch' if done == 1 else 'epochs'} completed: nothing is left to train",
            f"--trainer.max_epochs={done + max(max_epochs, 1)} trains {max(max_epochs, 1):,} more",
        )
