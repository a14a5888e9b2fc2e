"""Each fit in a folder of its own, and `--ckpt_path=last` as the newest checkpoint of the run it names.

    runs/<run_name>/version_<N>/            config.yaml, metrics.csv, checkpoints/last.ckpt, hpc_ckpt_<N>.ckpt
    runs/<run_name>/version_<N>/resume_<K>/ the config and metrics of the K-th launch that resumed it

`run_name` is `--run_name`, else the `--config` files' names joined by `-` (`quickstart`, `paper-padding`), else
`lit_packing`; the runs go under `trainer.default_root_dir` (`runs`). A fresh fit takes the next version, claimed
by creating its folder (so two fits started at once never share one); a fit given `--ckpt_path=last` continues in
the version that holds the run's newest complete checkpoint; a requeued SLURM job continues in the version its own
job created, named in the version's `.launch` file.

    folder = choose_folder(Path("runs"), "quickstart", resume=True)   # RunFolder(path=runs/quickstart/version_3, ...)

The process that claims is global rank 0 (or the only one). The ranks Lightning's launcher starts take rank 0's
choice from the environment; ranks that torchrun or srun start choose alone, by the same rule, and what they write
goes where rank 0 says: Lightning broadcasts rank 0's checkpoint paths, and the run's folder is rank 0's on every
rank once the process group exists (`agree_on_folder`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from lit_packing.callbacks.preemption import hpc_checkpoints
from lit_packing.checkpoint_io import OLD_SUFFIX
from lit_packing.errors import AssetError, ConfigError

DEFAULT_NAME = "lit_packing"
VERSION = re.compile(r"version_(\d+)")
RESUME = re.compile(r"resume_(\d+)")
LAST_NAME = re.compile(r"last(-v?\d+)?\.ckpt")  # ModelCheckpoint's `last` file, and its versioned names
LAUNCH_FILE = ".launch"  # in a version: the launch (SLURM job, torchrun run) that created it
CHOSEN = "LIT_PACKING_RUN_FOLDER"  # rank 0's choice, for the ranks Lightning's launcher starts
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

    def to_environ(self) -> str:
        return json.dumps([str(self.path), self.name, self.launch, self.checkpoint and str(self.checkpoint)])

    @classmethod
    def from_environ(cls, value: str) -> RunFolder:
        path, name, launch, checkpoint = json.loads(value)
        return cls(Path(path), name, launch, checkpoint and Path(checkpoint))

    def discard_if_unused(self) -> None:
        """Remove the folder if nothing but its launch file is in it (a fit that stopped before training)."""
        entries = list(self.path.iterdir()) if self.path.is_dir() else None
        if entries is not None and all(entry.name == LAUNCH_FILE for entry in entries):
            for entry in entries:
                entry.unlink()
            self.path.rmdir()


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


def launch_id(environ: Mapping[str, str]) -> str | None:
    """What names this launch on every rank and, for SLURM, across its requeues: the job (an array's task), or
    torchrun's run id when it has one; None for a launch from a shell.

    >>> launch_id({"SLURM_JOB_ID": "42", "SLURM_NTASKS": "16"}), launch_id({"TORCHELASTIC_RUN_ID": "none"})
    ('slurm:42', None)
    """
    if "SLURM_JOB_ID" in environ and "SLURM_NTASKS" in environ:
        array = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
        return f"slurm:{array[0]}_{array[1]}" if all(array) else f"slurm:{environ['SLURM_JOB_ID']}"
    run = environ.get("TORCHELASTIC_RUN_ID")
    return f"torchrun:{run}" if run and run != "none" else None


def is_first_rank(environ: Mapping[str, str]) -> bool:
    """Whether this process is global rank 0, or the only one, as its launcher says (before any process group)."""
    return all(environ.get(key, "0") == "0" for key in ("RANK", "SLURM_PROCID"))


def versions(run: Path) -> list[Path]:
    """The run's `version_<N>` folders, by N."""
    found = [p for p in run.iterdir() if p.is_dir() and VERSION.fullmatch(p.name)] if run.is_dir() else []
    return sorted(found, key=lambda p: int(VERSION.fullmatch(p.name)[1]))


def checkpoints_in(folder: Path) -> set[Path]:
    """The checkpoints `--ckpt_path=last` considers in a run's folder: `checkpoints/last*.ckpt` (a file, or a
    sharded run's folder), the preemption's `hpc_ckpt_<N>.ckpt`, and a sharded checkpoint that stepped aside for
    a save killed before the new one took its name (`.last.ckpt.old`, put back when the fit resumes)."""
    found = set(hpc_checkpoints(folder).values())
    saved = folder / "checkpoints"
    if saved.is_dir():
        found |= {p for p in saved.iterdir() if LAST_NAME.fullmatch(p.name)}
        found |= {
            p
            for p in saved.iterdir()
            if p.name.endswith(OLD_SUFFIX)
            and LAST_NAME.fullmatch(p.name[1:].removesuffix(OLD_SUFFIX))
            and not (saved / p.name[1:].removesuffix(OLD_SUFFIX)).exists()
        }
    return found


def newest_complete(candidates: Iterable[Path], skipped=None) -> Path | None:
    """The newest (by modification time) of `candidates` that reads as a complete checkpoint (a sharded one: its
    `meta.pt`), or None; each one skipped as damaged (empty, cut short, unreadable) is passed to
    `skipped(path, problem)`."""
    from lit_packing.preflight import SHARDED_METADATA, read_checkpoint

    for path in sorted(candidates, key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            read_checkpoint(path / SHARDED_METADATA if path.is_dir() else path, str(path))
        except (AssetError, OSError) as error:
            if skipped is not None:
                problem = error.problem if isinstance(error, AssetError) else str(error)
                skipped(path, problem.removeprefix(str(path)).strip())
            continue
        return path
    return None


def choose_folder(root: Path, name: str, resume: bool, launch: str | None = None, claim: bool = False) -> RunFolder:
    """This launch's folder: the version a launch of the same id (`launch_id`) created, if any (a requeued SLURM
    job's, or rank 0's for the other ranks of this launch); else with `resume` the version holding the run's newest
    complete checkpoint; else, or when there is none, the next version, created when `claim` (with its launch
    file), the number after it if another fit took it meanwhile."""
    run = root / name
    found = versions(run)
    own = next((v for v in reversed(found) if launch and _launch_of(v) == launch), None)
    if own is not None:
        return _resumed(own, name, newest_complete(checkpoints_in(own)))
    if resume:
        newest = newest_complete(path for version in found for path in checkpoints_in(version))
        if newest is not None:
            return _resumed(newest.parent if newest.parent.name != "checkpoints" else newest.parent.parent, name,
                            newest)  # fmt: skip
    number = 1 + int(VERSION.fullmatch(found[-1].name)[1]) if found else 0
    while claim:
        try:
            (run / f"version_{number}").mkdir(parents=True)
        except FileExistsError:
            number += 1
            continue
        if launch:
            (run / f"version_{number}" / LAUNCH_FILE).write_text(launch + "\n")
        break
    return RunFolder(run / f"version_{number}", name, f"version_{number}")


def _launch_of(version: Path) -> str | None:
    try:
        return (version / LAUNCH_FILE).read_text().strip()
    except OSError:
        return None


def _resumed(version: Path, name: str, checkpoint: Path | None) -> RunFolder:
    """`version` continued by this launch, its config and metrics in the next `resume_<K>` (none yet: the first)."""
    if checkpoint is None:
        return RunFolder(version, name, version.name)
    resumes = [p for p in version.iterdir() if p.is_dir() and RESUME.fullmatch(p.name)]
    number = 1 + max((int(RESUME.fullmatch(p.name)[1]) for p in resumes), default=0)
    return RunFolder(version, name, f"{version.name}/resume_{number}", checkpoint)


def chosen_by_rank_zero(environ: Mapping[str, str]) -> RunFolder | None:
    """Rank 0's choice, in a rank that Lightning's launcher started (`LOCAL_RANK` set, `CHOSEN` inherited)."""
    return RunFolder.from_environ(environ[CHOSEN]) if "LOCAL_RANK" in environ and CHOSEN in environ else None
