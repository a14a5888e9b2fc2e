"""Launches of a command (`python main.py fit ...`, `python -m lit_packing export ...`, a helper script) as a user's
shell starts them, each a process of its own, without paying each time for the imports (~5 s of one core a launch:
torch, Lightning, transformers, datasets, the toolkit): the launch is forked from a server process that made those
imports once, the way the benchmark forks its runs. The forked process takes the launch's working folder,
environment, arguments (`sys.argv`, `sys.path` from `PYTHONPATH`) and output files, runs the script or module as
`__main__` and ends as an interpreter ends (its threads joined, its exit handlers run). What the toolkit launches in
turn (the other ranks of a multi-rank fit, its loader workers) are started by the toolkit itself, as for a user.

What a fork shares with its siblings that new interpreters would not: the string-hash seed (`PYTHONHASHSEED`), and
memory pages until either writes them (each process's resident memory is still its own). The imports' objects are
frozen out of the cyclic garbage collector (`gc.freeze`), as they would be in a process that froze them after its
imports: a launch's collections never walk them, which in a fork would copy every page they lie on.

A launch whose environment differs from the server's in a variable read at import (`HF_HUB_OFFLINE` and the like:
anything not in `RUN_TIME` below) or whose interpreter is another starts a new interpreter instead, and so does
every launch when `LIT_PACKING_TEST_FORK=0`.

    done = run_fit([sys.executable, "main.py", "fit", ...], cwd=tmp_path, env=env, timeout=300)   # CompletedProcess
    victim = start([sys.executable, "main.py", "fit", ...], cwd=tmp_path, env=env, new_session=True)
    victim.poll(); os.killpg(victim.pid, signal.SIGKILL); victim.wait()

A fit that hangs says where: past its timeout every process of the launch gets SIGABRT, on which Python's fault
handler prints each thread's stack, and the failure carries them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# What a launch's environment may change from the server's: read when used, not at import. Anything else differing
# (an offline switch, a cache folder, a CPU capability) gets a new interpreter.
RUN_TIME = {"PATH", "PYTHONPATH", "PYTHONFAULTHANDLER", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "TMPDIR", "MASTER_ADDR",
            "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID"}  # fmt: skip
RUN_TIME_PREFIXES = ("WANDB_", "PYTEST_", "LIT_PACKING_", "SLURM_", "PL_")  # PL_: Lightning's seed, read when used
PRELOAD = ("torch", "lightning.pytorch", "transformers", "datasets", "lit_packing.cli")

SERVER = r"""
import gc, json, os, signal, sys
start_env = dict(os.environ)
for name in sys.argv[2:]:
    __import__(name)
gc.collect()
gc.freeze()  # the imports' objects: never traversed by a launch's collections, so their pages stay shared
sys.stderr.flush()
with open(sys.argv[1], "rb") as f:  # what the imports printed (warnings): each launch prints it first, as it would
    import_output = f.read()
os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
sys.path.pop(0)  # the server's own ('' for -c); each launch puts its script's folder first
base_path = [p for p in sys.path if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
requests, replies = sys.stdin.buffer, sys.stdout.buffer

def reap(*_):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        done = statuses.pop(pid, None)
        if done:
            with open(done + ".tmp", "w") as f:
                f.write(str(code))
            os.replace(done + ".tmp", done)

statuses = {}
signal.signal(signal.SIGCHLD, reap)
while True:
    line = requests.readline()
    if not line:
        break
    request = json.loads(line)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        break
    statuses[pid] = request["status"]
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    replies.write(b"%d\n" % pid)
    replies.flush()
    reap()
if not line:
    sys.exit(0)

# The launch, in the forked process.
import faulthandler, runpy, tempfile, threading
if request["new_session"]:
    os.setsid()
os.chdir(request["cwd"])
devnull = os.open(os.devnull, os.O_RDONLY)
os.dup2(devnull, 0)
for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, fd)
    os.close(target)
os.write(2, import_output)
env = request["env"]
added = {k: v for k, v in os.environ.items() if k not in start_env}  # what the imports set, as they would have
os.environ.clear()
os.environ.update(env)
for key, value in added.items():
    os.environ.setdefault(key, value)
tempfile.tempdir = None
if "numpy" in sys.modules:  # seeded from the system's entropy at import, as each new interpreter's is (random: by fork)
    sys.modules["numpy"].random.seed()
if env.get("OMP_NUM_THREADS"):
    import torch
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
if env.get("PYTHONFAULTHANDLER"):
    faulthandler.enable(all_threads=True)
if env.get("PYTHONUNBUFFERED"):
    sys.stdout.reconfigure(write_through=True)
    sys.stderr.reconfigure(write_through=True)
argv = request["argv"]
extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
module = argv[0] == "-m"
first = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))
sys.path[:] = [first, *extra, *base_path]
sys.argv = list(argv[1:]) if module else list(argv)
if module:
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
else:
    runpy.run_path(argv[0], run_name="__main__")
"""


class _Server:
    """Started at a test process's first launch (again when its environment changed): imports `PRELOAD` in that
    environment, then forks a process per request."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self._imports = tempfile.NamedTemporaryFile(prefix="launch_server_", suffix=".stderr")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER, self._imports.name, *PRELOAD], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._imports, env=self.env, cwd=Path(__file__).parents[2],
        )  # fmt: skip

    def fork(self, request: dict) -> int:
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline()
        if not reply:
            raise RuntimeError(f"the launch server ended (status {self.process.poll()})")
        return int(reply)


_SERVER: _Server | None = None
_RETIRED: list[_Server] = []  # servers whose environment this process left: kept until it ends (their forks report)


def _read_at_import(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """The variables read at import (not run-time ones) whose values differ between two environments."""
    keys = {k for k in set(a) | set(b) if k not in RUN_TIME and not k.startswith(RUN_TIME_PREFIXES)}
    return sorted(k for k in keys if a.get(k) != b.get(k))


def _server() -> _Server:
    """This process's server, imported in its present environment: a new one if this process's environment has
    changed since in what is read at import (an in-process fit sets variables), the old one kept running."""
    global _SERVER
    if _SERVER is not None and _SERVER.process.poll() is None and not _read_at_import(_SERVER.env, {**os.environ}):
        return _SERVER
    if _SERVER is not None:
        _RETIRED.append(_SERVER)
    _SERVER = _Server()
    return _SERVER


def forkable(args: list[str], env: dict[str, str]) -> bool:
    """Whether this launch can be forked from the server: this interpreter, and an environment that differs from
    this process's (which the server imported in) only in what is read at run time."""
    if os.environ.get("LIT_PACKING_TEST_FORK") == "0" or args[0] != sys.executable or len(args) < 2:
        return False
    if args[1].startswith("-") and args[1] != "-m":
        return False
    return not _read_at_import(env, {**os.environ})


class Launched:
    """A started launch: forked from the server or a new interpreter (`subprocess.Popen`); what `subprocess.Popen`
    offers that the tests use, and its output once it ended."""

    def __init__(self, args: list[str], *, cwd: Path, env: dict[str, str] | None = None, new_session: bool = False,
                 stdout: Path | None = None, merge_stderr: bool = False, fork: bool = True) -> None:  # fmt: skip
        env = dict(os.environ if env is None else env)
        self.args, self.returncode = args, None
        self._folder = tempfile.TemporaryDirectory(prefix="launch_")
        folder = Path(self._folder.name)
        self.stdout_path = Path(stdout) if stdout is not None else folder / "stdout"
        self.stderr_path = self.stdout_path if merge_stderr else folder / "stderr"
        self._status = folder / "status"
        self.forked = fork and forkable(args, env)
        if self.forked:
            self.stdout_path.touch()
            self.stderr_path.touch()
            paths = {"stdout": self.stdout_path, "stderr": self.stderr_path, "status": self._status}
            request = {"argv": args[1:], "cwd": str(cwd), "env": env, "new_session": new_session,
                       **{name: str(path) for name, path in paths.items()}}  # fmt: skip
            self.pid = _server().fork(request)
            self._popen = None
        else:
            with open(self.stdout_path, "a") as out, open(self.stderr_path, "a") as err:
                self._popen = subprocess.Popen(args, cwd=cwd, env=env, stdout=out, stderr=err,
                                               start_new_session=new_session)  # fmt: skip
            self.pid = self._popen.pid

    def poll(self) -> int | None:
        if self.returncode is None:
            if self._popen is not None:
                self.returncode = self._popen.poll()
            elif self._status.exists():
                self.returncode = int(self._status.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status (negative: the signal that ended it). Raises `subprocess.TimeoutExpired` past `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def output(self) -> tuple[str, str]:
        """What it wrote to its standard output and error (the same text twice when they were merged)."""
        read = lambda path: path.read_text(errors="replace") if path.exists() else ""  # noqa: E731
        return read(self.stdout_path), read(self.stderr_path)


def start(args: list[str], *, cwd: Path, env: dict[str, str] | None = None, new_session: bool = False,
          stdout: Path | None = None, merge_stderr: bool = False, fork: bool = True) -> Launched:  # fmt: skip
    """Start `args` (`[sys.executable, script or -m module, ...]`); its output goes to files (`stdout`: a file of the
    caller's, appended to), read by `Launched.output()`. `fork=False`: a new interpreter whatever the launch (a run
    whose memory is measured against bounds set on new interpreters)."""
    return Launched(args, cwd=cwd, env=env, new_session=new_session, stdout=stdout, merge_stderr=merge_stderr,
                    fork=fork)  # fmt: skip


def run(
    args: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float
) -> subprocess.CompletedProcess:  # noqa: E501
    """`subprocess.run(args, capture_output=True, text=True, timeout=timeout)`, the process started by `start`."""
    launched = start(args, cwd=cwd, env=env)
    try:
        launched.wait(timeout)
    except subprocess.TimeoutExpired:
        launched.kill()
        launched.wait()
        raise
    return subprocess.CompletedProcess(args, launched.returncode, *launched.output())


def run_fit(args: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`run` in a session of its own (every rank and loader worker it starts is in it), with Python's fault handler
    on.

    Raises:
        AssertionError: the launch outlived `timeout` seconds; its message holds the stacks every process printed on
            SIGABRT (then each is killed: none is left behind).
    """
    launched = start(args, cwd=cwd, env={**env, "PYTHONFAULTHANDLER": "1"}, new_session=True)
    try:
        launched.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launched.pid, signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            launched.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launched.pid, signal.SIGKILL)
        launched.wait(30)
        out, err = launched.output()
        raise AssertionError(
            f"the launch ran past {timeout:.0f} s; the stacks its processes printed on SIGABRT:\n{err[-30000:]}\n"
            f"standard output's end:\n{out[-3000:]}"
        ) from None
    finally:
        with contextlib.suppress(ProcessLookupError):  # a rank or worker the launch left running
            os.killpg(launched.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(args, launched.returncode, *launched.output())
