"""PreemptionCheckpoint: a scheduler's warning ends the fit at the end of the optimizer step it arrives in, on every
rank the same step, with a checkpoint there and, on SLURM, the job requeued to resume from it by itself.

    Trainer(callbacks=[PreemptionCheckpoint()])   # the CLI adds it; sbatch --signal=USR1@90 python main.py fit ...

The signals: SLURM's `--signal` warning (`USR1`, or the `requeue_signal` of a `SLURMEnvironment` plugin), and
SIGTERM, which SLURM, Kubernetes and torchrun's elastic agent send before SIGKILL. Their handlers only note the
signal. Lightning's own handlers act inside the handler: its SLURM one saved `hpc_ckpt_N.ckpt` in the middle of an
optimizer step (a resume then skipped a micro-batch, or moved the accumulation boundary), and its SIGTERM one calls
a collective from the handler (on two ranks signalled 0.4 s apart no requeue was ever asked for).

Here, at the end of every optimizer step the ranks agree (an all-reduce of what each has noted, on a gloo group
of its own so that no GPU is synchronised) whether to stop; so ranks signalled at different moments stop after
the same step. Then every rank takes part in `trainer.save_checkpoint` of `<default_root_dir>/hpc_ckpt_<N>.ckpt`
(Lightning's name, which its SLURM auto-resume and `--ckpt_path=last` find; older ones are removed once it is
written), rank 0 asks `scontrol requeue` for the requeue signal (as Lightning does; SIGTERM is also how `scancel`
ends a job, so it is not requeued), prints one line, and the process exits with status 128 + the signal's number
(`Preempted`), as a process ended by that signal. A signal during the save changes nothing: it is only noted.

The checkpoint is taken where `ModelCheckpoint(every_n_train_steps=...)` takes its own, so the resumed fit trains
exactly the batches and reaches exactly the weights of a fit left alone; a validation due at that step is skipped
by the resume, as Lightning skips it after any checkpoint of a step's end.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Checkpoint

from lit_packing.processes import leave_to_parent

log = logging.getLogger("lit_packing")

HPC_CHECKPOINT = re.compile(r"hpc_ckpt_(\d+)\.ckpt")  # Lightning's name for a SLURM checkpoint


class Preempted(SystemExit):
    """The fit stopped for a preemption signal after saving: exits with status 128 + the signal's number."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(128 + signum)
        self.signum, self.message = signum, message


class PreemptionCheckpoint(Checkpoint):
    """Stop at the end of the optimizer step a preemption signal arrives in, save, requeue on SLURM, exit.

    A `Checkpoint` so that Lightning runs it after every other callback of a step's end (their state is saved as
    it is then); it adds no `trainer.checkpoint_callback`: put it after the `ModelCheckpoint` callbacks.
    """

    def __init__(self) -> None:
        self.noted: dict[int, float] = {}  # signal number -> when this process first got it (time.monotonic)
        self._group: Any = None
        self._group_ready = False
        self._boundary = -1  # the optimizer step at which the ranks last agreed

    def note(self, signum: int, frame: FrameType | None = None) -> None:
        """The signal handler: record the signal, do nothing else (the step it interrupts goes on)."""
        self.noted.setdefault(int(signum), time.monotonic())

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # before the loader's workers start (Lightning counts the batches in the optimizer set-up)
            leave_to_parent({requeue_signal(trainer), signal.SIGTERM})  # `lit_packing.processes`: why

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        leave_to_parent(())

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        leave_to_parent(())  # Lightning's teardown restores the handlers it found before the fit

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)  # Lightning registers its handlers after `on_fit_start` (and restores them)
        self._boundary = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self._boundary:
            return  # inside an optimizer step (gradient accumulation)
        self._boundary = trainer.global_step
        requeue, terminate = self._agree(trainer)
        done = 0 < trainer.max_steps <= trainer.global_step
        if (requeue or terminate) and not done:
            self._stop(trainer, requeue_signal(trainer) if requeue else signal.SIGTERM)

    def _install(self, trainer: pl.Trainer) -> None:
        if not self._group_ready:  # every rank reaches its first install together
            self._group_ready = True
            if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
                gloo = dist.get_backend() == "gloo"
                self._group = dist.group.WORLD if gloo else dist.new_group(backend="gloo")
        for signum in {requeue_signal(trainer), signal.SIGTERM}:
            signal.signal(signum, self.note)

    def _agree(self, trainer: pl.Trainer) -> tuple[bool, bool]:
        """(any rank got the requeue signal, any rank got SIGTERM): the same answer on every rank."""
        noted = torch.tensor([requeue_signal(trainer) in self.noted, signal.SIGTERM in self.noted], dtype=torch.int32)
        if self._group is not None:
            dist.all_reduce(noted, op=dist.ReduceOp.MAX, group=self._group)
        return bool(noted[0]), bool(noted[1])

    def _stop(self, trainer: pl.Trainer, signum: int) -> None:
        started = time.monotonic()
        root = Path(trainer.default_root_dir)
        path = trainer.strategy.broadcast(str(next_hpc_path(root)), src=0)
        trainer.save_checkpoint(path)
        saved = time.monotonic() - started
        name = signal.Signals(signum).name
        if trainer.is_global_zero:
            remove_older_hpc_checkpoints(Path(path))
            for logger in trainer.loggers:
                logger.finalize("finished")
        then = requeue(trainer, signum != signal.SIGTERM)
        message = (
            f"preempted ({name}): stopped after optimizer step {trainer.global_step:,}, the step it arrived in, and "
            f"saved {path} in {saved:.1f} s; {then}; exiting with status {128 + signum}"
        )
        if trainer.is_global_zero:
            log.info(message)
        trainer.strategy.barrier("PreemptionCheckpoint")
        raise Preempted(signum, message)


def requeue_signal(trainer: pl.Trainer) -> int:
    """The signal SLURM warns with: the `SLURMEnvironment` plugin's `requeue_signal`, else USR1."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    chosen = getattr(environment, "requeue_signal", None) if isinstance(environment, SLURMEnvironment) else None
    return int(chosen or signal.SIGUSR1)


def requeue(trainer: pl.Trainer, asked: bool = True) -> str:
    """On rank 0 under SLURM with auto-requeue, for the requeue signal (`asked`): `scontrol requeue <job>`, as
    Lightning's handler does; what happened, in words."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if not isinstance(environment, SLURMEnvironment):
        if not SLURMEnvironment.detect():
            return "not on SLURM, so not requeued: run the same command with --ckpt_path=last to resume"
        environment = SLURMEnvironment()
    if not asked:
        return (
            "not requeued (SIGTERM is also how scancel ends a job; SLURM requeues a preempted job itself where "
            "PreemptMode=REQUEUE): the same command with --ckpt_path=last resumes"
        )
    if not environment.auto_requeue:
        return "not requeued (SLURMEnvironment auto_requeue=False): resubmit it; it resumes with --ckpt_path=last"
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        return f"not requeued: SLURM_JOB_ID {job!r} is not a job id"
    if not trainer.is_global_zero:
        return f"rank 0 requeues SLURM job {job}"
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"requeue of SLURM job {job} failed ({error}): resubmit it; it resumes with --ckpt_path=last"
    if result.returncode != 0:
        why = (result.stderr or result.stdout).strip().splitlines()[-1:] or [f"exit {result.returncode}"]
        return f"requeue of SLURM job {job} failed ({why[0]}): resubmit it; it resumes with --ckpt_path=last"
    return f"requeued SLURM job {job}: it resumes from this checkpoint by itself"


def hpc_checkpoints(root: Path) -> dict[int, Path]:
    """`hpc_ckpt_<N>.ckpt` files directly in `root`, by N."""
    if not root.is_dir():
        return {}
    found = (HPC_CHECKPOINT.fullmatch(entry.name) for entry in root.iterdir())
    return {int(match[1]): root / match[0] for match in found if match}


def next_hpc_path(root: Path) -> Path:
    """Lightning's next SLURM checkpoint name: `hpc_ckpt_<highest N + 1>.ckpt`."""
    return root / f"hpc_ckpt_{max(hpc_checkpoints(root), default=0) + 1}.ckpt"


def remove_older_hpc_checkpoints(kept: Path) -> None:
    """One preemption checkpoint on disk: the earlier ones are superseded once `kept` is complete."""
    for path in hpc_checkpoints(kept.parent).values():
        if path != kept:
            path.unlink(missing_ok=True)
