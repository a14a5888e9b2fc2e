"""Run folders: each fresh fit the next version of its run, a resumed one the version of the run's newest complete
checkpoint (`lit_packing.runs`); the CLI's own runs are tests/cli/test_first_hour.py's."""

import os
from pathlib import Path

import pytest
import torch

from lit_packing.errors import ConfigError
from lit_packing.runs import choose_folder, run_name


def save(path: Path, step: int, mtime: float) -> None:
    """A checkpoint as Lightning writes its top level (the loader checks its format, not its weights)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"pytorch-lightning_version": "2.6.6", "global_step": step, "epoch": 0, "state_dict": {}}, path)
    os.utime(path, (mtime, mtime))


def test_the_name_is_given_or_the_configs_or_the_default():
    assert run_name(None, ["/x/configs/paper.yaml", Path("padding.yaml")]) == "paper-padding"
    assert run_name("lr-3e-5", ["quickstart.yaml"]) == "lr-3e-5"
    assert run_name(None, []) == "lit_packing"
    with pytest.raises(ConfigError, match="run_name: 'a/b' is not a folder name"):
        run_name("a/b", [])


def test_a_fresh_fit_takes_the_next_version_and_a_resumed_one_the_newest_checkpoints(tmp_path):
    first = choose_folder(tmp_path, "quickstart", resume=False)
    assert (first.path, first.launch, first.resumed) == (tmp_path / "quickstart/version_0", "version_0", False)
    first.path.mkdir(parents=True)  # a launch that stopped before training left it empty: the next one reuses it
    assert choose_folder(tmp_path, "quickstart", resume=False).path == first.path
    save(first.path / "checkpoints/last.ckpt", 4, 1000)
    second = choose_folder(tmp_path, "quickstart", resume=False)
    assert second.path == tmp_path / "quickstart/version_1"
    save(second.path / "checkpoints/last.ckpt", 2, 2000)
    assert choose_folder(tmp_path, "quickstart", resume=True).launch == "version_1/resume_1"
    save(first.path / "hpc_ckpt_5.ckpt", 5, 3000)  # the preemption's, newer
    resumed = choose_folder(tmp_path, "quickstart", resume=True)
    assert (resumed.path, resumed.launch) == (first.path, "version_0/resume_1")
    assert resumed.checkpoint == first.path / "hpc_ckpt_5.ckpt"
    (first.path / "resume_1").mkdir()
    assert choose_folder(tmp_path, "quickstart", resume=True).launch == "version_0/resume_2"
    (first.path / "hpc_ckpt_5.ckpt").write_bytes(b"")  # damaged: the next newest is taken
    assert choose_folder(tmp_path, "quickstart", resume=True).path == second.path
    assert choose_folder(tmp_path, "other", resume=True).path == tmp_path / "other/version_0"  # nothing to resume
