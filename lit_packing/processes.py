"""Every process a run starts ends when the process that started it dies, however it dies (SIGKILL included).

    DataLoader(..., worker_init_fn=EndWithParent())       # a loader's workers die with the process that made them
    subprocess.run(command, preexec_fn=EndWithParent())   # so does a child a tool starts
    tie_to_launcher()                                     # a rank started by a launcher dies with the launcher
    leave_process_group()                                 # a command that finished leaves its process group
    leave_to_parent({signal.SIGTERM, signal.SIGUSR1})     # what this process forks from now on ignores these
    watch_ranks(procs, describe)                          # a launched rank that dies: one line, status 1
    peer_lost(error)                                      # a collective that failed because a peer rank left

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
import re
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
# A rank that stopped because another left the process group (`peer_lost`): the other one is what died.
PEER_LOST_STATUS = 3
# From this status up, a rank that stopped for a signal on purpose (`PreemptionCheckpoint`: 128 + its number).
SIGNAL_STATUS = 128


def dead_rank(procs: list, wait: float = 0.0) -> str | None:
    """Which of the ranks this process launched (`procs`: ranks 1, 2, ... as `subprocess.Popen`) died, and how:
    "rank 1 (pid 4242) was killed by SIGKILL" or "... exited with status 1"; None while none has (a rank that
    ended cleanly, with the toolkit's own error status, stopped because another rank left, or saved and stopped
    for a preemption signal, did not die). A rank that just died may not have been reaped yet when a collective on
    this rank fails: `wait` gives it that many seconds."""
    deadline = time.monotonic() + wait
    while True:
        for rank, proc in enumerate(procs, start=1):
            code = proc.poll()
            if code is not None and (code < 0 or code not in (0, TOOLKIT_ERROR_STATUS, PEER_LOST_STATUS)
                                     and code < SIGNAL_STATUS):  # fmt: skip
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


# What the backends say when a collective fails because a peer rank is gone. gloo (a plain RuntimeError): the peer's
# socket closed or was reset (its address given), or nothing came within the process group's timeout. NCCL and the
# store raise `torch.distributed.DistError`s: a remote error, or the timeout (raised by the waiting thread where
# TORCH_NCCL_BLOCKING_WAIT is set; by default NCCL's watchdog ends the process itself).
_GLOO_PEER_LOST = re.compile(
    r"Connection closed by peer \[[^\]]*\]:\d+"
    r"|(?:Read|Write) error \[[^\]]*\]:\d+: (?:Connection reset by peer|Broken pipe)"
    r"|Timed out waiting \d+ms for \w+ operation"
)
# A backend's (NCCL's) error that is about a peer, not about this rank's own use of the backend.
_BACKEND_PEER_LOST = re.compile(r"ncclRemoteError|remote process|timed? ?out", re.IGNORECASE)
_TIMED_OUT = re.compile(r"timed? ?out", re.IGNORECASE)


@dataclass(frozen=True)
class PeerLost:
    """A collective that failed because a peer rank is gone: the backend's own words (`said`: "Connection closed by
    peer [10.0.0.2]:41234", which names the peer's address) and whether it came from waiting out the timeout."""

    said: str
    timed_out: bool


def peer_lost(error: BaseException) -> PeerLost | None:
    """Whether `error` (or what caused it) is a collective that failed because a peer rank left the process group
    (killed, crashed, cut off) or stopped answering for the process group's timeout; None for any other error.

    >>> peer_lost(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:21911. This is typically ..."))
    PeerLost(said='Connection closed by peer [127.0.0.1]:21911', timed_out=False)
    >>> peer_lost(RuntimeError("[pair.cc:575] Read error [10.0.0.2]:4242: Connection reset by peer")).said
    'Read error [10.0.0.2]:4242: Connection reset by peer'
    >>> peer_lost(RuntimeError("[unbound_buffer.cc:78] Timed out waiting 4000ms for recv operation to complete"))
    PeerLost(said='Timed out waiting 4000ms for recv operation', timed_out=True)
    >>> peer_lost(ConnectionResetError(104, "Connection reset by peer")) is None   # a download, not a rank
    True
    """
    from torch.distributed import DistBackendError, DistError

    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if found := _GLOO_PEER_LOST.search(text):
            return PeerLost(found[0], found[0].startswith("Timed out"))
        about_a_peer = not isinstance(error, DistBackendError) or _BACKEND_PEER_LOST.search(text)  # a store, a network
        if isinstance(error, DistError) and about_a_peer:
            said = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
            return PeerLost(said[:300], bool(_TIMED_OUT.search(text)))
        error = error.__cause__ or error.__context__
    return None
