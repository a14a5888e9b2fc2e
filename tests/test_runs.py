"""Run folders: each fresh fit the next version of its run, claimed; a resumed one the version of the run's newest
complete checkpoint (a file or a sharded run's folder); a requeued SLURM job the version its job created
(`lit_packing.runs`). The CLI's own runs are tests/cli/test_first_hour.py's, SLURM's tests/cli/test_preemption.py's."""

import os
from pathlib import Path

import pytest
import torch

from lit_packing.errors import ConfigError
from lit_packing.runs import RunFolder, choose_folder, launch_id, run_name


def save(path: Path, step: int, mtime: float) -> None:
    """A checkpoint as Lightning writes its top level (the loader checks its format, not its weights); a path
    ending in `last.ckpt` under a `sharded` folder is a distributed checkpoint: a folder with `meta.pt`."""
    target = path / "meta.pt" if "sharded" in path.parts else path
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"pytorch-lightning_version": "2.6.6", "global_step": step, "epoch": 0, "state_dict": {}}, target)
    os.utime(path, (mtime, mtime))


def test_the_name_is_given_or_the_configs_or_the_default():
    assert run_name(None, ["/x/configs/paper.yaml", Path("padding.yaml")]) == "paper-padding"
    assert run_name("lr-3e-5", ["quickstart.yaml"]) == "lr-3e-5"
    assert run_name(None, []) == "lit_packing"
    with pytest.raises(ConfigError, match="run_name: 'a/b' is not a folder name"):
        run_name("a/b", [])


def test_a_fresh_fit_claims_the_next_version_and_a_resumed_one_the_newest_checkpoints(tmp_path):
    first = choose_folder(tmp_path, "quickstart", resume=False, claim=True)
    assert (first.path, first.launch, first.resumed) == (tmp_path / "quickstart/version_0", "version_0", False)
    assert first.path.is_dir()  # claimed: a fit started meanwhile takes the next one
    assert choose_folder(tmp_path, "quickstart", resume=False, claim=True).path.name == "version_1"
    save(first.path / "checkpoints/last.ckpt", 4, 1000)
    second = tmp_path / "quickstart/version_1"
    save(second / "checkpoints/last.ckpt", 2, 2000)
    assert choose_folder(tmp_path, "quickstart", resume=True).launch == "version_1/resume_1"
    save(first.path / "hpc_ckpt_5.ckpt", 5, 3000)  # the preemption's, newer
    resumed = choose_folder(tmp_path, "quickstart", resume=True)
    assert (resumed.path, resumed.launch) == (first.path, "version_0/resume_1")
    assert resumed.checkpoint == first.path / "hpc_ckpt_5.ckpt"
    (first.path / "resume_1").mkdir()
    assert choose_folder(tmp_path, "quickstart", resume=True).launch == "version_0/resume_2"
    (first.path / "hpc_ckpt_5.ckpt").write_bytes(b"")  # damaged: the next newest is taken
    assert choose_folder(tmp_path, "quickstart", resume=True).path == second
    assert choose_folder(tmp_path, "other", resume=True).path == tmp_path / "other/version_0"  # nothing to resume


def test_a_sharded_checkpoint_folder_and_one_that_stepped_aside_are_resumed(tmp_path):
    run = tmp_path / "sharded"
    save(run / "version_0/checkpoints/last.ckpt", 3, 1000)  # a folder with meta.pt
    assert choose_folder(tmp_path, "sharded", resume=True).checkpoint == run / "version_0/checkpoints/last.ckpt"
    save(run / "version_1/checkpoints/.last.ckpt.old", 6, 2000)  # a save killed between its two renames
    assert choose_folder(tmp_path, "sharded", resume=True).path == run / "version_1"
    save(run / "version_1/checkpoints/last.ckpt", 7, 3000)  # the new one in place: the old one is not a candidate
    assert choose_folder(tmp_path, "sharded", resume=True).checkpoint == run / "version_1/checkpoints/last.ckpt"


def test_a_requeued_job_continues_the_version_its_job_created(tmp_path):
    """Requeued before its first save, the job stays in its own version, not an older run's with a checkpoint; a
    resubmitted job (another id) takes a new one; the other ranks of a launch find rank 0's."""
    save(tmp_path / "gpu-multinode/version_0/checkpoints/last.ckpt", 9, 1000)  # an earlier job's run
    job = choose_folder(tmp_path, "gpu-multinode", resume=False, launch="slurm:7", claim=True)  # no --ckpt_path
    assert job.path.name == "version_1" and not job.resumed and (job.path / ".launch").read_text() == "slurm:7\n"
    assert choose_folder(tmp_path, "gpu-multinode", resume=True, launch="slurm:7") == job  # requeued: its own
    save(job.path / "hpc_ckpt_1.ckpt", 4, 2000)
    requeued = choose_folder(tmp_path, "gpu-multinode", resume=False, launch="slurm:7", claim=True)
    assert (requeued.path, requeued.checkpoint) == (job.path, job.path / "hpc_ckpt_1.ckpt")
    resubmitted = choose_folder(tmp_path, "gpu-multinode", resume=False, launch="slurm:8", claim=True)
    assert resubmitted.path.name == "version_2"
    assert RunFolder.from_environ(requeued.to_environ()) == requeued  # how Lightning's launcher hands it on


def test_a_launch_is_named_by_its_job_or_run():
    array = {"SLURM_JOB_ID": "5", "SLURM_NTASKS": "2", "SLURM_ARRAY_JOB_ID": "4", "SLURM_ARRAY_TASK_ID": "1"}
    assert launch_id(array) == "slurm:4_1"
    assert launch_id({"TORCHELASTIC_RUN_ID": "a1b2"}) == "torchrun:a1b2"
    assert launch_id({}) is None
