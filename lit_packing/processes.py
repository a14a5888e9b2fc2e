"""Every process a run starts ends when the process that started it dies, however it dies (SIGKILL included).

    DataLoader(..., worker_init_fn=EndWithParent())       # a loader's workers die with the process that made them
    subprocess.run(command, preexec_fn=EndWithParent())   # so does a child a tool starts
    tie_to_launcher()                                     # a rank started by a launcher dies with the launcher
    leave_process_group()                                 # a command that finished leaves its process group
    leave_to_parent({signal.SIGTERM, signal.SIGUSR1})     # what this process forks from now on ignores these
    watch_ranks(procs, describe)                          # a launched rank that dies: one line, status 1

A preempted job is killed with SIGKILL: no handler runs, so only the kernel can end what the process started. On
Linux a process asks for a signal when its parent dies (`prctl(PR_SET_PDEATHSIG)`); a process whose parent died
before it asked (the race between fork and the call) ends at once. Elsewhere these are no-ops: the children then
end as before (DataLoader workers notice a dead parent within seconds; ranks at the process group's timeout).

A scheduler signals every process of a job (SLURM's `--signal` warning and its SIGTERM reach a DataLoader's
workers too): a worker that such a signal ends makes the fit fail at its next batch, before it can stop at a step's
end and save. While a fit runs (`PreemptionCheckpoint` arms it), what this process forks ignores them and leaves
them to the fit's own process, whose end then ends it: at fork, and again in `EndWithParent` (torch's worker loop
sets its own SIGTERM handler first, which ends a worker signalled by anyone but its parent).

Without this, a killed streamed fit left its tokenizing workers asleep forever holding the run's stdout (a wrapper
that waits on that output hangs), and a killed rank 0 left rank 1 blocked in a collective.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Loaded once, here: a `preexec_fn` runs between fork and exec, where loading a library could deadlock.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _alive(pid: int) -> bool:
    """Whether `pid` runs: a process that died and waits to be reaped (a zombie) does not. Read from /proc rather
    than with psutil: this runs in a `preexec_fn` too, between fork and exec, where importing could deadlock."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2 :][:1] not in (b"Z", b"X")  # the state follows the name, in brackets


def die_with_parent(parent: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies; True if armed.

    Args:
        parent: the pid of the process this one should die with. Armed only when it is this process's parent; if
            it is already dead (it died before the call, reaped or not: the race between fork and this call), this
            process exits now; if it is alive but not the parent (a `forkserver` started this process), nothing is
            armed.
        sig: the signal; SIGKILL by default (a process whose parent is gone has nobody to report to).
    """
    if _LIBC is None:
        return False
    armed = _LIBC.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0  # first: a parent dying from now on is seen
    if parent is None or os.getppid() == parent:
        return armed
    if not _alive(parent):  # it died before the call (this process was handed to another parent)
        os._exit(1)
    _LIBC.prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)  # another process started this one: its death means nothing here
    return False


@dataclass(frozen=True)
class EndWithParent:
    """A DataLoader `worker_init_fn` or a subprocess `preexec_fn` that ties the new process to this one.

    Created in the parent (it records the parent's pid), called in the child. Picklable, so it also works with the
    `spawn` start method; under `forkserver` the parent is the fork server, and nothing is armed (the DataLoader's
    own check of its parent remains).
    """

    parent: int = field(default_factory=os.getpid)
    then: Callable[[int], None] | None = None  # a DataLoader `worker_init_fn` to run next (Lightning's seeding)

    def __call__(self, worker_id: int | None = None) -> None:
        die_with_parent(self.parent)
        if worker_id is not None:
            _ignore_left_to_parent()
        if self.then is not None and worker_id is not None:
            self.then(worker_id)


# The signals the processes forked from now on ignore (`leave_to_parent`).
_LEFT_TO_PARENT: set[int] = set()


def leave_to_parent(signals: Iterable[int]) -> None:
    """Processes this one forks from now on (a DataLoader's workers) ignore `signals`; an empty set: no more."""
    _LEFT_TO_PARENT.clear()
    _LEFT_TO_PARENT.update(int(signum) for signum in signals)
    if _LEFT_TO_PARENT and not _KILL_AT_EXIT:
        # Registered after multiprocessing's own exit handler, so it runs first: that handler ends daemonic children
        # with SIGTERM, which a worker forked now ignores, and then waits for them forever.
        atexit.register(_kill_daemonic_children)
        _KILL_AT_EXIT.append(True)


_KILL_AT_EXIT: list[bool] = []


def _kill_daemonic_children() -> None:
    """At exit, end what is left of the daemonic children (a DataLoader's workers, a stream's tokenizing workers
    still waiting for work) with SIGKILL: they may ignore the SIGTERM multiprocessing would send them. The
    DataLoader's SIGCHLD handler, which would report each such worker as failed, is set aside first: the fit is over."""
    import multiprocessing

    children = [child for child in multiprocessing.active_children() if child.daemon]
    if children:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.kill()


def _ignore_left_to_parent() -> None:
    for signum in _LEFT_TO_PARENT:
        signal.signal(signum, signal.SIG_IGN)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_ignore_left_to_parent)


# The pid of the process that launches a run's other ranks, in their environment (they inherit it).
LAUNCHER_PID = "LIT_PACKING_LAUNCHER_PID"


def tie_to_launcher() -> None:
    """At a command's start: a rank another process started dies with it (torchrun's agent starts every rank;
    Lightning's DDP launcher starts ranks 1..N-1 from rank 0); a process a user started is left alone (`nohup`
    and shells that exit keep working) and records itself as the launcher of the ranks it may start."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()
    elif os.environ.get("LOCAL_RANK", "0") != "0":
        launcher = os.environ.get(LAUNCHER_PID)
        if launcher and os.getppid() != int(launcher) and not _alive(int(launcher)):
            print(f"error: rank {os.environ['LOCAL_RANK']}: its launcher (pid {launcher}) is gone", flush=True)
            os._exit(1)
        if launcher and os.getppid() == int(launcher):
            die_with_parent(int(launcher))
    else:
        os.environ[LAUNCHER_PID] = str(os.getpid())


def leave_process_group() -> None:
    """At the end of a command that finished: destroy the process group this process joined (none: nothing).

    Left to the interpreter's exit, a gloo group's worker threads can outlive it and the rank aborts after its
    work is done ("terminate called without an active exception", status -6, an exit a launcher reports as a
    failed run); NCCL warns that the group was not destroyed and may leave a peer waiting. Never after a failure:
    a rank that destroys its group while another still waits in a collective can hang both.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# A rank that stopped with one of the toolkit's own errors: every rank raises it together and rank 0 prints it.
TOOLKIT_ERROR_STATUS = 2
# From this status up, a rank that stopped for a signal on purpose (`PreemptionCheckpoint`: 128 + its number).
SIGNAL_STATUS = 128


def dead_rank(procs: list, wait: float = 0.0) -> str | None:
    """Which of the ranks this process launched (`procs`: ranks 1, 2, ... as `subprocess.Popen`) died, and how:
    "rank 1 (pid 4242) was killed by SIGKILL" or "... exited with status 1"; None while none has (a rank that
    ended cleanly, with the toolkit's own error status, or saved and stopped for a preemption signal, did not
    die). A rank that just died may not have been reaped yet when a collective on this rank fails: `wait` gives it
    that many seconds."""
    deadline = time.monotonic() + wait
    while True:
        for rank, proc in enumerate(procs, start=1):
            code = proc.poll()
            if code is not None and (code < 0 or code not in (0, TOOLKIT_ERROR_STATUS) and code < SIGNAL_STATUS):
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
                return f"rank {rank} (pid {proc.pid}) {how}"
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def watch_ranks(procs: list, describe: Callable[[str], str], every: float = 0.2) -> threading.Thread:
    """On the process that launched ranks 1..N-1 (`procs`): once one of them dies, print `describe(what died)` as
    one `error:` line, end the other ranks and exit with status 1. Without it, a collective on this rank fails with
    the backend's traceback (gloo) or waits for the backend's timeout (NCCL). A daemon thread, polling every
    `every` seconds, that ends when every rank ended cleanly."""

    def watch() -> None:
        while not (died := dead_rank(procs)):
            if all(proc.poll() is not None for proc in procs):
                return
            time.sleep(every)
        print(f"error: {describe(died)}", flush=True)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        os._exit(1)

    thread = threading.Thread(target=watch, name="lit-packing-rank-watch", daemon=True)
    thread.start()
    return thread
