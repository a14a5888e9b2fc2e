"""Each fit in a folder of its own, and `--ckpt_path=last` as the newest checkpoint of the run it names.

    runs/<run_name>/version_<N>/            config.yaml, metrics.csv, checkpoints/last.ckpt, hpc_ckpt_<N>.ckpt
    runs/<run_name>/version_<N>/resume_<K>/ the config and metrics of the K-th launch that resumed it

`run_name` is `--run_name`, else the `--config` files' names joined by `-` (`quickstart`, `paper-padding`), else
`lit_packing`; the runs go under `trainer.default_root_dir` (`runs`). A fresh fit takes the next version, so two
experiments from one checkout never write over each other; a resumed one (`--ckpt_path=last`, or a requeued SLURM
job) continues in the version that holds the run's newest complete checkpoint.

    folder = choose_folder(Path("runs"), "quickstart", resume=True)   # RunFolder(path=runs/quickstart/version_3, ...)

Every rank chooses alone, before the process group exists, and all choose alike: nothing writes into a version
before every rank has joined the group (the first write is at training start).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from lit_packing.errors import AssetError, ConfigError

DEFAULT_NAME = "lit_packing"
VERSION = re.compile(r"version_(\d+)")
RESUME = re.compile(r"resume_(\d+)")
LAST_NAME = re.compile(r"last(-v?\d+)?\.ckpt")  # ModelCheckpoint's `last` file, and its versioned names
HPC_NAME = re.compile(r"hpc_ckpt_(\d+)\.ckpt")  # the preemption checkpoint (`callbacks.preemption`)
_NAME = re.compile(r"[\w.+=-]+")


@dataclass(frozen=True)
class RunFolder:
    """Where one launch of a fit writes.

    Attributes:
        path: the run's folder, `<root>/<name>/version_<N>` (the trainer's `default_root_dir`).
        name: the run's name.
        launch: the CSV logger's version for this launch: `version_<N>`, or `version_<N>/resume_<K>` when it
            resumes the run in `path`.
        checkpoint: the run's newest complete checkpoint, in `path`, when this launch resumes it; else None.
    """

    path: Path
    name: str
    launch: str
    checkpoint: Path | None = None

    @property
    def resumed(self) -> bool:
        return self.checkpoint is not None


def run_name(given: str | None, configs: Iterable[str | Path]) -> str:
    """`given` (`--run_name`), else the config files' names joined by `-`, else `lit_packing`.

    Raises:
        ConfigError: `given` is not a plain folder name.
    """
    if given is not None:
        if not _NAME.fullmatch(given) or given in (".", ".."):
            raise ConfigError("run_name", f"{given!r} is not a folder name", "use letters, digits, and . _ - + =")
        return given
    stems = [Path(str(config)).stem for config in configs]
    return "-".join(stems) or DEFAULT_NAME


def versions(run: Path) -> list[Path]:
    """The run's `version_<N>` folders, by N."""
    found = [p for p in run.iterdir() if p.is_dir() and VERSION.fullmatch(p.name)] if run.is_dir() else []
    return sorted(found, key=lambda p: int(VERSION.fullmatch(p.name)[1]))


def checkpoints_in(folder: Path) -> set[Path]:
    """The checkpoints `--ckpt_path=last` considers in a run's folder: `checkpoints/last*.ckpt` and the
    preemption's `hpc_ckpt_<N>.ckpt`."""
    found = {p for p in folder.iterdir() if HPC_NAME.fullmatch(p.name)} if folder.is_dir() else set()
    saved = folder / "checkpoints"
    return found | ({p for p in saved.iterdir() if LAST_NAME.fullmatch(p.name)} if saved.is_dir() else set())


def newest_complete(candidates: Iterable[Path], skipped=None) -> Path | None:
    """The newest (by modification time) of `candidates` that reads as a complete checkpoint, or None; each one
    skipped as damaged (empty, cut short, unreadable) is passed to `skipped(path, problem)`."""
    from lit_packing.preflight import read_checkpoint

    for path in sorted(candidates, key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            read_checkpoint(path)
        except AssetError as error:
            if skipped is not None:
                skipped(path, error.problem.removeprefix(str(path)).strip())
            continue
        return path
    return None


def choose_folder(root: Path, name: str, resume: bool) -> RunFolder:
    """This launch's folder: with `resume`, the version holding the run's newest complete checkpoint (a fresh
    version when there is none); otherwise the next version (the last one, if a launch left it empty)."""
    run = root / name
    found = versions(run)
    if resume:
        newest = newest_complete(path for version in found for path in checkpoints_in(version))
        if newest is not None:
            version = newest.parent if HPC_NAME.fullmatch(newest.name) else newest.parent.parent
            resumes = [p for p in version.iterdir() if p.is_dir() and RESUME.fullmatch(p.name)]
            number = 1 + max((int(RESUME.fullmatch(p.name)[1]) for p in resumes), default=0)
            return RunFolder(version, name, f"{version.name}/resume_{number}", newest)
    number = int(VERSION.fullmatch(found[-1].name)[1]) if found else -1
    if not found or any(found[-1].iterdir()):  # an empty one is a launch that stopped before training: reused
        number += 1
    return RunFolder(run / f"version_{number}", name, f"version_{number}")
