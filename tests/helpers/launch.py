"""A fit launched as a user launches one (its ranks and loader workers its own processes), which, if it hangs, says
where: past its timeout every process of the launch gets SIGABRT, on which Python's fault handler prints each
thread's stack, and the failure carries them.

    done = run_fit([sys.executable, "main.py", "fit", ...], cwd=tmp_path, env=env, timeout=300)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path


def run_fit(args: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run(args, capture_output=True, text=True)` in a session of its own (every rank and loader worker
    it starts is in it).

    Raises:
        AssertionError: the launch outlived `timeout` seconds; its message holds the stacks every process printed on
            SIGABRT (then each is killed: none is left behind).
    """
    process = subprocess.Popen(args, cwd=cwd, env={**env, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGABRT)
        try:
            out, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise AssertionError(
            f"the launch ran past {timeout:.0f} s; the stacks its processes printed on SIGABRT:\n{err[-30000:]}\n"
            f"standard output's end:\n{out[-3000:]}"
        ) from None
    finally:
        with contextlib.suppress(ProcessLookupError):  # a rank or worker the launch left running
            os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(args, process.returncode, out, err)
