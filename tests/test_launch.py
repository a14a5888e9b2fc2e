"""`tests/helpers/launch.py`: a launch forked from the preloaded server behaves as a new interpreter does (the same
script, both ways): its arguments, folder, environment and `sys.path`, its output, its exit status (a number, a
message, an exception, a signal), its exit handlers and threads at the end, a session of its own; a launch whose
environment changes what is read at import gets a new interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import launch

SCRIPT = """
import atexit, os, sys, threading, time
import launch_probe_lib
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("LIT_PACKING_TEST_PROBE"), flush=True)
print("path", sys.path[0] == os.path.dirname(os.path.abspath(__file__)), launch_probe_lib.WHERE, flush=True)
print("executable", sys.executable, "name", __name__, flush=True)
print("to stderr", file=sys.stderr, flush=True)
atexit.register(print, "exit handler ran", flush=True)
threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined", flush=True))).start()
what = sys.argv[1]
if what == "raise":
    raise ValueError("boom")
if what == "sleep":
    time.sleep(120)
sys.exit(int(what) if what.isdigit() else what)
"""


@pytest.fixture
def script(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "launch_probe_lib.py").write_text("WHERE = 'from PYTHONPATH'\n")
    (tmp_path / "probe.py").write_text(SCRIPT)
    (tmp_path / "work").mkdir()
    env = {**os.environ, "LIT_PACKING_TEST_PROBE": "seen", "PYTHONPATH": str(tmp_path / "lib")}
    return [sys.executable, str(tmp_path / "probe.py")], tmp_path / "work", env


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "new interpreter"])
@pytest.mark.parametrize(("what", "status"), [("0", 0), ("3", 3), ("a message", 1), ("raise", 1)])
def test_a_launch_runs_as_a_new_interpreter(script, fork, what, status):
    args, cwd, env = script
    started = launch.start([*args, what], cwd=cwd, env=env, fork=fork)
    assert started.forked is fork
    assert started.wait(timeout=120) == status
    out, err = started.output()
    assert f"argv ['{what}'] cwd {cwd} env seen" in out
    assert "path True from PYTHONPATH" in out and f"executable {sys.executable} name __main__" in out
    assert out.rstrip().endswith("thread joined\nexit handler ran"), out  # threads joined, then the exit handlers
    assert "to stderr" in err and "to stderr" not in out
    if what == "a message":
        assert err.rstrip().endswith("a message")
    if what == "raise":
        assert "Traceback" in err and err.rstrip().endswith("ValueError: boom")


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "new interpreter"])
def test_a_launch_in_a_session_of_its_own_ends_by_its_group(script, fork):
    args, cwd, env = script
    started = launch.start([*args, "sleep"], cwd=cwd, env=env, new_session=True, fork=fork)
    assert started.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        started.wait(timeout=0.5)
    assert os.getpgid(started.pid) == started.pid  # its own group: `os.killpg` ends it with what it started
    os.killpg(started.pid, signal.SIGKILL)
    assert started.wait(timeout=60) == -signal.SIGKILL


def test_an_environment_read_at_import_gets_a_new_interpreter(script, monkeypatch):
    args, cwd, env = script
    assert launch.forkable(args, env)
    for changed in ({"HF_HUB_OFFLINE": "0" if env.get("HF_HUB_OFFLINE") == "1" else "1"}, {"HF_HOME": str(cwd)}):
        assert not launch.forkable(args, {**env, **changed}), changed
    assert not launch.forkable(args, {k: v for k, v in env.items() if k != "HF_HUB_OFFLINE"})
    assert not launch.forkable(["/usr/bin/python3", *args[1:]], env)  # another interpreter
    assert not launch.forkable([sys.executable, "-c", "pass"], env)
    assert launch.forkable([sys.executable, "-m", "lit_packing", "export"], env)
    done = launch.run([*args, "0"], cwd=cwd, env={**env, "HF_HOME": str(cwd)}, timeout=120)
    assert done.returncode == 0 and "env seen" in done.stdout
    # This process's own environment changed (an in-process fit sets NO_COLOR): a server imported in it forks
    monkeypatch.setenv("NO_COLOR", "1")
    started = launch.start([*args, "0"], cwd=cwd, env={**env, "NO_COLOR": "1"})
    assert started.forked and started.wait(timeout=120) == 0 and launch._SERVER.env["NO_COLOR"] == "1"
