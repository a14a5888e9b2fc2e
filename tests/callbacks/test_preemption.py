"""PreemptionCheckpoint on a real Trainer (Lightning's `BoringModel`, one process): a signal is only noted, the fit
stops at the end of the optimizer step it arrived in with a checkpoint there, and the process's handlers are
Lightning's again afterwards; the SLURM requeue through a stand-in `scontrol`; `--ckpt_path=last`'s choice among
the run's checkpoints; forked workers leaving the signals to the fit."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lit_packing import processes
from lit_packing.callbacks.checkpoint import LastCheckpoint
from lit_packing.callbacks.preemption import Preempted, PreemptionCheckpoint, next_hpc_path, requeue
from lit_packing.checkpoint_io import AtomicCheckpointIO
from lit_packing.cli import newest_checkpoint


class SignalAt(Callback):
    """Sends `signum` to this process at the start of micro-batch `batch` (and `again` during the next save)."""

    def __init__(self, signum: int, batch: int, again: int | None = None):
        self.signum, self.batch, self.again, self.batches = signum, batch, again, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch_idx)
        if batch_idx == self.batch:
            os.kill(os.getpid(), self.signum)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if self.again is not None:
            os.kill(os.getpid(), self.again)


def fit(tmp_path: Path, *callbacks: Callback, accumulate: int = 2, max_steps: int = 10) -> Trainer:
    trainer = Trainer(
        accelerator="cpu", max_steps=max_steps, accumulate_grad_batches=accumulate, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, limit_val_batches=0,
        callbacks=[*callbacks, LastCheckpoint(), PreemptionCheckpoint()], plugins=[AtomicCheckpointIO()],
    )  # fmt: skip
    trainer.fit(BoringModel())
    return trainer


@pytest.mark.parametrize(("signum", "batch", "step"), [(signal.SIGUSR1, 4, 3), (signal.SIGTERM, 5, 3)])
def test_a_signal_stops_the_fit_after_the_step_it_arrived_in_with_a_checkpoint_there(tmp_path, signum, batch, step):
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    signaller = SignalAt(signum, batch, again=signal.SIGTERM)  # and a second signal during the save
    with pytest.raises(Preempted) as stopped:
        fit(tmp_path, signaller)
    assert stopped.value.code == 128 + signum
    assert signaller.batches == list(range(2 * step))  # micro-batches 4 and 5 are step 3: it was finished
    saved = torch.load(tmp_path / "hpc_ckpt_1.ckpt", weights_only=True)
    assert saved["global_step"] == step
    assert saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"] == 2 * step
    assert f"preempted ({signal.Signals(signum).name}): stopped after optimizer step {step}," in stopped.value.message
    assert "not on SLURM, so not requeued" in stopped.value.message
    assert {s: signal.getsignal(s) for s in before} == before  # Lightning put back what it found


def test_without_a_signal_the_fit_runs_to_its_end(tmp_path):
    trainer = fit(tmp_path, max_steps=3)
    assert trainer.global_step == 3
    assert not list(tmp_path.glob("hpc_ckpt_*.ckpt"))


def test_a_signal_in_the_last_step_lets_the_fit_end(tmp_path):
    trainer = fit(tmp_path, SignalAt(signal.SIGUSR1, 5), max_steps=3)
    assert trainer.global_step == 3
    assert not list(tmp_path.glob("hpc_ckpt_*.ckpt"))


def test_the_note_is_all_a_handler_does():
    callback = PreemptionCheckpoint()
    callback.note(signal.SIGUSR1)
    first = callback.noted[signal.SIGUSR1]
    callback.note(signal.SIGUSR1)
    assert callback.noted == {signal.SIGUSR1: first}


def test_requeue_asks_scontrol_for_the_job_as_lightning_does(tmp_path, monkeypatch):
    (tmp_path / "scontrol").write_text('#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n')
    (tmp_path / "scontrol").chmod(0o755)
    slurm = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train"}
    for key, value in {**slurm, "SCONTROL_LOG": str(tmp_path / "log")}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    assert requeue(trainer) == "requeued SLURM job 77: it resumes from this checkpoint by itself"
    assert (tmp_path / "log").read_text() == "requeue 77\n"
    assert requeue(trainer, asked=False).startswith("not requeued (SIGTERM is also how scancel ends a job")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "70")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert requeue(trainer).startswith("requeued SLURM job 70_3")
    (tmp_path / "scontrol").write_text("#!/bin/sh\necho 'Invalid job id' >&2; exit 1\n")
    assert requeue(trainer) == (
        "requeue of SLURM job 70_3 failed (Invalid job id): resubmit it; it resumes with --ckpt_path=last"
    )


def test_the_next_preemption_checkpoint_follows_lightnings_numbering(tmp_path):
    assert next_hpc_path(tmp_path).name == "hpc_ckpt_1.ckpt"
    (tmp_path / "hpc_ckpt_4.ckpt").touch()
    assert next_hpc_path(tmp_path).name == "hpc_ckpt_5.ckpt"


@pytest.fixture
def lines():
    """What lit_packing's logger prints, line by line."""
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("lit_packing")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield seen
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_ckpt_path_last_takes_the_newest_complete_checkpoint_and_skips_a_damaged_one(tmp_path, lines):
    trainer = fit(tmp_path, max_steps=2)  # writes checkpoints/last.ckpt
    last = tmp_path / "checkpoints" / "last.ckpt"
    hpc = tmp_path / "hpc_ckpt_1.ckpt"
    trainer.save_checkpoint(hpc)
    os.utime(last, (1, 1))
    assert newest_checkpoint(trainer) == hpc
    hpc.write_bytes(hpc.read_bytes()[:1000])  # cut short (a copy that did not finish)
    (tmp_path / "checkpoints" / ".last.ckpt.partial").write_bytes(b"left by a killed save")
    assert newest_checkpoint(trainer) == last
    assert lines[0].startswith(f"--ckpt_path=last: skipping {hpc}: is damaged or cut short (1,000 bytes")
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]
    last.unlink()
    hpc.unlink()
    assert newest_checkpoint(trainer) is None


def test_processes_forked_during_a_fit_ignore_the_signals_left_to_it():
    processes.leave_to_parent({signal.SIGUSR1})
    try:
        child = os.fork()
        if child == 0:
            os._exit(0 if signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN else 1)
        assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
    finally:
        processes.leave_to_parent(())
    assert signal.getsignal(signal.SIGUSR1) != signal.SIG_IGN


def test_a_process_whose_loader_workers_ignore_the_signals_exits_cleanly(tmp_path):
    # A DataLoader's persistent workers forked while the signals are left to the fit ignore SIGTERM: the process
    # still exits promptly, and quietly (no worker reported as failed by the DataLoader's SIGCHLD handler).
    script = tmp_path / "loader.py"
    script.write_text(
        "import signal, torch\n"
        "from lit_packing import processes\n"
        "processes.leave_to_parent({signal.SIGUSR1, signal.SIGTERM})\n"
        "loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, num_workers=2, persistent_workers=True)\n"
        "print(next(iter(loader)).tolist())\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "[0, 1]"), done.stderr
    assert "Traceback" not in done.stderr, done.stderr
