"""A cluster's faults through the real CLI, under a simulated SLURM allocation (the variables `srun` sets, a
stand-in `scontrol` that records the requeue): the warning signal (USR1) and SIGTERM sent from outside during a
forward, a backward, between micro-batches and during a save, on 1 rank (2 loader workers, accumulation 2) and on
2 gloo ranks signalled 0.4 s apart (accumulation 1), and saves killed with SIGKILL while streaming and before their
rename with `TMPDIR` on another filesystem. Each interrupted run is started again with the same command, as a
requeued job is; together they train exactly the uninterrupted run's batches to the same weights.

One chain of runs per layout shares one uninterrupted reference run: every moment is one run of the chain.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from lit_packing.preflight import read_checkpoint
from tests.cli.test_resume import ROOT, chatterbot_run, env, free_port, records, weights
from tests.conftest import TINY_CONFIGS
from tests.helpers import launch

# Loaded by the runs from their folder: records every micro-batch's rows; at a chosen moment (rank, optimizer step,
# micro-batch of the step, where) it writes `<path>.at<rank>` and waits for `<path>.go<rank>`, so that the test
# sends its signal while the run is there.
RECORDER = """
import json, os, time
from lightning.pytorch import Callback

class Recorder(Callback):
    def __init__(self, path: str, pauses: list | None = None):
        self.path, self.pauses, self.micro = path, pauses or [], 0

    def wait(self, trainer, where):
        rank = trainer.global_rank
        for p in self.pauses:
            if (p["rank"], p["step"], p["micro"], p["where"]) == (rank, trainer.global_step, self.micro, where):
                self.pauses.remove(p)
                open(f"{self.path}.at{rank}", "w").write(where)
                while not os.path.exists(f"{self.path}.go{rank}"):
                    time.sleep(0.01)
                os.remove(f"{self.path}.go{rank}")
                return

    def setup(self, trainer, pl_module, stage):
        linear = next(m for m in pl_module.modules() if type(m).__name__ == "Linear")
        linear.register_forward_hook(lambda *args: self.wait(trainer, "forward"))
        weight = next(p for p in pl_module.parameters() if p.requires_grad)
        weight.register_hook(lambda grad: self.wait(trainer, "backward"))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.micro = batch_idx % trainer.accumulate_grad_batches
        with open(f"{self.path}.rank{trainer.global_rank}", "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "rows": batch["rows"]}) + "\\n")

    def on_train_batch_end(self, trainer, *args):
        self.wait(trainer, "between")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.wait(trainer, "save")
"""

# A checkpoint writer that stops inside a save, where `<path>` names the point: `stream` (1 MB written) or
# `rename` (flushed and named, not yet renamed); it writes `<path>.at` there and waits to be killed.
STALLING_IO = """
import os, time
from lit_packing.checkpoint_io import AtomicCheckpointIO

class StallingIO(AtomicCheckpointIO):
    def __init__(self, path: str):
        self.path = path

    def open_partial(self, folder, partial):
        file, unnamed = super().open_partial(folder, partial)
        point = open(self.path).read() if os.path.exists(self.path) else ""
        return Stalling(file, point, self.path), unnamed

class Stalling:
    def __init__(self, file, point, path):
        self.file, self.point, self.path, self.written = file, point, path, 0

    def stall(self):
        open(self.path + ".at", "w").write(self.point)
        while True:
            time.sleep(1)

    def write(self, data):
        self.written += len(data)
        if self.point == "stream" and self.written > 1_000_000:
            self.stall()
        return self.file.write(data)

    def flush(self):
        self.file.flush()

    def fileno(self):
        return self.file.fileno()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.point == "rename":
            self.stall()
        self.file.close()
"""

SCONTROL = '#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n'
JOB = "4242"


def slurm_env(tmp_path: Path, rank: int, tasks: int, port: int, restarts: int, tmpdir: Path) -> dict[str, str]:
    """What `srun` sets for task `rank` of `tasks` on one node, the stand-in `scontrol` first on PATH, and
    `TMPDIR` on another filesystem than the checkpoints (RAM-backed)."""
    return {
        **env(tmp_path),
        "SLURM_JOB_ID": JOB, "SLURM_JOB_NAME": "train", "SLURM_NTASKS": str(tasks),
        "SLURM_NTASKS_PER_NODE": str(tasks), "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank), "SLURM_NODELIST": "localhost", "SLURM_RESTART_COUNT": str(restarts),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "SCONTROL_LOG": str(tmp_path / "scontrol.log"), "TMPDIR": str(tmpdir),
    }  # fmt: skip


class Job:
    """One simulated SLURM job under `folder`: the same command at every (re)start, `tasks` ranks on one node."""

    def __init__(self, folder: Path, tasks: int, extra: list[str]):
        self.folder, self.tasks, self.extra, self.restarts = folder, tasks, extra, 0
        self.saves = folder / "quickstart" / "version_0"  # the run's folder: every restart resumes into it
        folder.mkdir()
        (folder / "recorder.py").write_text(RECORDER)
        (folder / "stalling_io.py").write_text(STALLING_IO)
        (folder / "bin").mkdir()
        (folder / "bin" / "scontrol").write_text(SCONTROL)
        (folder / "bin" / "scontrol").chmod(0o755)
        self.tmpdir = Path(f"/dev/shm/lit_packing_test_{os.getpid()}_{folder.parent.name}_{folder.name}")
        self.tmpdir.mkdir(exist_ok=True)

    def args(self, pauses: list[dict]) -> list[str]:
        record = str(self.folder / "trained.jsonl")
        callbacks = [{"class_path": "recorder.Recorder", "init_args": {"path": record, "pauses": pauses}}]
        plugin = {"class_path": "stalling_io.StallingIO", "init_args": {"path": str(self.folder / "stall")}}
        return [
            sys.executable, str(ROOT / "main.py"), "fit", "--config", str(ROOT / "configs/quickstart.yaml"),
            *chatterbot_run(self.folder, TINY_CONFIGS["llama"], callbacks),
            f"--trainer.plugins={json.dumps(plugin)}", *self.extra,
        ]  # fmt: skip

    def start(self, pauses: list[dict] = ()) -> list[launch.Launched]:
        port = free_port()
        self.procs = [
            launch.start(
                self.args(list(pauses)),
                cwd=self.folder,
                merge_stderr=True,
                new_session=True,
                env=slurm_env(self.folder, rank, self.tasks, port, self.restarts, self.tmpdir),
            )  # fmt: skip
            for rank in range(self.tasks)
        ]
        self.restarts += 1
        return self.procs

    def reached(self, rank: int, marker: str = "trained.jsonl.at", timeout: float = 300) -> bool:
        """Wait until rank `rank` stands at its pause (True) or has exited (False)."""
        at = self.folder / (f"{marker}{rank}" if marker == "trained.jsonl.at" else marker)
        deadline = time.monotonic() + timeout
        while not at.exists():
            if self.procs[rank].poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        at.unlink()
        return True

    def signal(self, rank: int, signum: int) -> None:
        """Signal every process of the task (its loader workers too), as SLURM signals a job step."""
        os.killpg(self.procs[rank].pid, signum)

    def go(self, rank: int) -> None:
        (self.folder / f"trained.jsonl.go{rank}").touch()

    def run(self) -> list[tuple[int, str]]:
        self.start()
        return self.finish()

    def finish(self) -> list[tuple[int, str]]:
        return [(proc.wait(timeout=300), proc.output()[0]) for proc in self.procs]

    def requeues(self) -> list[str]:
        log = self.folder / "scontrol.log"
        return log.read_text().splitlines() if log.exists() else []

    def forget_lost(self, kept: int, rank: int = 0) -> None:
        """Drop the records of micro-batches after the first `kept`: a killed run's, whose steps are redone."""
        path = self.folder / f"trained.jsonl.rank{rank}"
        path.write_text("".join(path.read_text().splitlines(keepends=True)[:kept]))

    def trained(self, rank: int = 0) -> list[list[int]]:
        return [r["rows"] for r in records(self.folder / f"trained.jsonl.rank{rank}")]


def preempt(job: Job, moments: list[tuple[int, int, int, str, int]], gap: float = 0.4) -> list[tuple[int, str]]:
    """Start the job with a pause at each moment (rank, step, micro-batch, where, signal); at each, send the signal
    from outside, then let the rank go on; the next moment's signal waits `gap` seconds after the previous one."""
    keys = ("rank", "step", "micro", "where")
    job.start([dict(zip(keys, moment[:4])) for moment in moments])
    sent = 0.0
    for rank, *_, signum in moments:
        if not job.reached(rank):
            pytest.fail(f"rank {rank} never reached its pause: {job.finish()[rank][1][-3000:]}")
        time.sleep(max(0.0, sent + gap - time.monotonic()))
        job.signal(rank, signum)
        sent = time.monotonic()
        job.go(rank)
    return job.finish()


def assert_preempted(results: list[tuple[int, str]], signum: int, step: int) -> None:
    for code, output in results:
        assert code == 128 + signum, output[-3000:]
    line = next(line for line in results[0][1].splitlines() if line.startswith("preempted"))
    assert f"({signal.Signals(signum).name}): stopped after optimizer step {step}," in line, line


def assert_same_run(job: Job, reference: Job, ranks: int) -> None:
    for rank in range(ranks):
        assert job.trained(rank) == reference.trained(rank)
    final, expected = (weights(j.saves / "checkpoints" / "last.ckpt") for j in (job, reference))
    for name, tensor in expected.items():
        torch.testing.assert_close(final[name], tensor, rtol=0, atol=0, msg=name)


def files_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.fixture(scope="module", autouse=True)
def _remove_tmpdirs():
    yield
    for folder in Path("/dev/shm").glob(f"lit_packing_test_{os.getpid()}_*"):
        shutil.rmtree(folder, ignore_errors=True)


ONE_RANK = ["--data.num_workers=2", "--trainer.accumulate_grad_batches=2", "--trainer.max_steps=8"]
TWO_RANKS = ["--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.max_steps=6", "--ckpt_path=last"]


@pytest.fixture(scope="module")
def one_rank_reference(tmp_path_factory) -> Job:
    job = Job(tmp_path_factory.mktemp("one") / "reference", 1, ONE_RANK)
    [(code, output)] = job.run()
    assert code == 0, output[-3000:]
    return job


@pytest.mark.slow
@pytest.mark.serial
def test_preempted_at_every_moment_on_one_rank_resumes_by_itself_to_the_same_weights(tmp_path, one_rank_reference):
    job = Job(tmp_path / "job", 1, ONE_RANK)  # no --ckpt_path: a requeued job's command, unchanged
    shm = job.tmpdir

    # USR1 during a forward: the step is finished, saved, and the job requeued.
    assert_preempted(preempt(job, [(0, 1, 0, "forward", signal.SIGUSR1)]), signal.SIGUSR1, 2)
    assert job.requeues() == [f"requeue {JOB}"]
    assert files_in(job.saves).count("hpc_ckpt_1.ckpt") == 1
    # SIGTERM during the backward of a step's second micro-batch: saved, not requeued (scancel sends it too).
    assert_preempted(preempt(job, [(0, 3, 1, "backward", signal.SIGTERM)]), signal.SIGTERM, 4)
    assert job.requeues() == [f"requeue {JOB}"]
    # USR1 between two micro-batches of a step, then SIGTERM during the checkpoint's save: one clean checkpoint.
    moments = [(0, 4, 0, "between", signal.SIGUSR1), (0, 5, 1, "save", signal.SIGTERM)]
    assert_preempted(preempt(job, moments), signal.SIGUSR1, 5)
    assert [name for name in files_in(job.saves) if "ckpt" in name] == ["hpc_ckpt_3.ckpt"]  # the older removed
    assert read_checkpoint(job.saves / "hpc_ckpt_3.ckpt")["global_step"] == 5

    # Saves killed with SIGKILL: while streaming (nothing named is left), then flushed but not yet renamed.
    for point in ("stream", "rename"):
        (job.folder / "stall").write_text(point)
        trained_before = job.trained()
        job.start([{"rank": 0, "step": 6, "micro": 0, "where": "forward"}])
        assert job.reached(0)
        job.signal(0, signal.SIGUSR1)
        job.go(0)
        assert job.reached(0, marker="stall.at")
        job.signal(0, signal.SIGKILL)
        job.finish()
        assert len(job.trained()) == len(trained_before) + 4  # 2 steps past the checkpoint, lost: redone next
        job.forget_lost(len(trained_before))
        leftover = [".hpc_ckpt_4.ckpt.partial"] if point == "rename" else []
        assert [n for n in files_in(job.saves) if "ckpt" in n] == leftover + ["hpc_ckpt_3.ckpt"], point
        assert read_checkpoint(job.saves / "hpc_ckpt_3.ckpt")["global_step"] == 5  # the previous one, intact
        assert [p for p in shm.rglob("*") if p.is_file()] == [], "a save staged a file in TMPDIR"
    (job.folder / "stall").unlink()

    [(code, output)] = job.run()  # the last restart trains to the end
    assert code == 0, output[-3000:]
    assert "resuming from" in output and "hpc_ckpt_3.ckpt" in output
    assert [n for n in files_in(job.saves) if "partial" in n] == []
    assert_same_run(job, one_rank_reference, ranks=1)


@pytest.mark.slow
@pytest.mark.serial
def test_two_ranks_signalled_apart_stop_at_the_same_step_and_resume_to_the_same_weights(tmp_path):
    reference = Job(tmp_path / "reference", 2, TWO_RANKS)
    for code, output in reference.run():
        assert code == 0, output[-3000:]

    job = Job(tmp_path / "job", 2, TWO_RANKS)
    # USR1 reaches rank 0 during a forward, rank 1 0.4 s later during its backward: both stop after that step.
    moments = [(0, 1, 0, "forward", signal.SIGUSR1), (1, 1, 0, "backward", signal.SIGUSR1)]
    assert_preempted(preempt(job, moments), signal.SIGUSR1, 2)
    assert job.requeues() == [f"requeue {JOB}"]  # asked once, by rank 0
    # SIGTERM reaches rank 1 only, at the end of a step: rank 0 learns it at the next agreement.
    assert_preempted(preempt(job, [(1, 3, 0, "between", signal.SIGTERM)]), signal.SIGTERM, 3)
    for code, output in job.run():
        assert code == 0, output[-3000:]
    assert_same_run(job, reference, ranks=2)
