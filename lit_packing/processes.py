"""Every process a run starts ends when the process that started it dies, however it dies (SIGKILL included).

    DataLoader(..., worker_init_fn=EndWithParent())       # a loader's workers die with the process that made them
    subprocess.run(command, preexec_fn=EndWithParent())   # so does a child a tool starts
    end_with_launcher()                                   # a rank started by a launcher dies with the launcher

A preempted job is killed with SIGKILL: no handler runs, so only the kernel can end what the process started. On
Linux a process asks for a signal when its parent dies (`prctl(PR_SET_PDEATHSIG)`); a process whose parent died
before it asked (the race between fork and the call) ends at once. Elsewhere these are no-ops: the children then
end as before (DataLoader workers notice a dead parent within seconds; ranks at the process group's timeout).

Without this, a killed streamed fit left its tokenizing workers asleep forever holding the run's stdout (a wrapper
that waits on that output hangs), and a killed rank 0 left rank 1 blocked in a collective.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from dataclasses import dataclass, field

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies; True if armed.

    Args:
        parent: the pid the parent had when it started this process: if this process already has another parent
            (the original one died before the call), it exits now.
        sig: the signal; SIGKILL by default (a process whose parent is gone has nobody to report to).
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent:
        os._exit(1)
    return True


@dataclass(frozen=True)
class EndWithParent:
    """A DataLoader `worker_init_fn` or a subprocess `preexec_fn` that ties the new process to this one.

    Created in the parent (it records the parent's pid), called in the child. Picklable, so it also works with the
    `spawn` and `forkserver` start methods.
    """

    parent: int = field(default_factory=os.getpid)

    def __call__(self, worker_id: int | None = None) -> None:
        die_with_parent(self.parent)


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
        die_with_parent(int(launcher) if launcher else None)
    else:
        os.environ[LAUNCHER_PID] = str(os.getpid())
