"""`die_with_parent`, the call every worker and rank makes at its start so that a killed run leaves nothing: the
parent-death signal is armed before the parent is checked, and a parent that died before the call, reaped or not,
ends the process at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).parents[1]

# A parent that forks a child and sleeps; the child waits for `go`, asks to die with `target`, records what the call
# returned and sleeps (a child that the call ended records nothing).
FAMILY = """
import os, sys, time
sys.path.insert(0, {root!r})
from lit_packing.processes import die_with_parent
parent = os.getpid()
if os.fork() == 0:
    while not os.path.exists({go!r}):
        time.sleep(0.01)
    armed = die_with_parent({target})
    with open({record!r}, "w") as f:
        f.write(str(armed))
    time.sleep(600)
print("forked", flush=True)
time.sleep(600)
"""


def family(tmp_path: Path, target: str) -> tuple[subprocess.Popen, Path, Path]:
    go, record = tmp_path / "go", tmp_path / "record"
    script = FAMILY.format(root=str(ROOT), go=str(go), record=str(record), target=target)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout.readline() == "forked\n"
    return parent, go, record


def ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_parent_killed_before_the_child_asks_ends_the_child_even_before_it_is_reaped(tmp_path):
    parent, go, record = family(tmp_path, "parent")
    (child,) = psutil.Process(parent.pid).children()
    parent.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 30
    while psutil.Process(parent.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert psutil.Process(parent.pid).status() == psutil.STATUS_ZOMBIE  # dead, not reaped: its pid still answers
    go.touch()
    while not ended(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    parent.wait()
    assert ended(child.pid) and not record.exists()  # it ended in the call, not after it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_the_signal_is_armed_for_the_parent_and_not_for_a_process_that_did_not_start_this_one(tmp_path):
    for target, armed in (("parent", "True"), (str(os.getpid()), "False")):  # this test's process: alive, not it
        parent, go, record = family(tmp_path, target)
        (child,) = psutil.Process(parent.pid).children()
        go.touch()
        deadline = time.monotonic() + 30
        while not record.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert record.read_text() == armed, target
        parent.kill()
        parent.wait()
        psutil.wait_procs([child], timeout=10 if armed == "True" else 0.5)  # the signal comes at once, or never
        assert ended(child.pid) == (armed == "True"), target  # armed: the parent's death ended it
        if not ended(child.pid):
            child.kill()
        go.unlink()
        record.unlink()
