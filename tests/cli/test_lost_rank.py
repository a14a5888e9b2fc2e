"""A rank that dies under torchrun ends the whole job: 2 loopback "nodes" (one rank each, gloo, the tiny model), one
rank killed with SIGKILL after its first optimizer step. Its node's agent ends at once (torchrun tears its own
workers down); the other node's rank sees its collective fail and ends with one line naming the dead rank instead
of gloo's traceback; both agents end well within the process group's timeout, and no process of the run is left.
Without a process: which errors are a lost peer (`processes.peer_lost`), the line (`cli.peer_left`), and the status
that tells a rank stopped by a lost peer from a dead one (`processes.dead_rank`)."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from torch.distributed import DistBackendError, DistNetworkError, DistStoreError

from lit_packing.cli import peer_left
from lit_packing.processes import PEER_LOST_STATUS, PeerLost, dead_rank, peer_lost
from tests.cli.test_resume import MULTINODE, RECORDER, ROOT, chatterbot_run, env, free_port, records
from tests.conftest import TINY_CONFIGS

TIMEOUT = 30  # seconds: the process group's timeout the run is given, and the bound on the job's end


def node_args(tmp_path: Path, port: int, node: int) -> list[str]:
    """torchrun for one of 2 loopback nodes (1 rank each) running the multinode recipe on the CPU, slowly enough
    (0.3 s a micro-batch, up to 200 steps over as many epochs) that it is still training when the test kills a rank."""
    callbacks = [{"class_path": "recorder.Recorder", "init_args": {"path": str(tmp_path / "run.jsonl"), "delay": 0.3}}]
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}",
        "--master-addr=127.0.0.1", f"--master-port={port}",
        str(ROOT / "main.py"), "fit",
        *(arg for config in MULTINODE for arg in ("--config", str(ROOT / config))),
        *chatterbot_run(tmp_path, TINY_CONFIGS["llama"], callbacks),
        "--data.num_workers=1",
        "--trainer.max_steps=200",
        "--trainer.max_epochs=-1",
        f"--trainer.strategy.init_args.timeout={TIMEOUT}",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.serial
def test_a_rank_killed_under_torchrun_ends_the_job_in_one_line_naming_it(tmp_path):
    (tmp_path / "recorder.py").write_text(RECORDER)
    port = free_port()
    run = dict(cwd=tmp_path, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    agents = [subprocess.Popen(node_args(tmp_path, port, node), **run, start_new_session=True) for node in (0, 1)]
    family: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        trained = lambda: any(r["step"] >= 1 for r in records(tmp_path / "run.jsonl.rank1"))  # noqa: E731
        while not trained() and all(a.poll() is None for a in agents) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(a.poll() is None for a in agents), "\n".join(a.communicate()[0][-6000:] for a in agents)
        assert trained(), "rank 1 took no optimizer step within 240 s"
        family = [psutil.Process(a.pid) for a in agents]
        family += [p for a in agents for p in psutil.Process(a.pid).children(recursive=True)]
        rank1 = next(p for p in psutil.Process(agents[1].pid).children() if p.environ().get("RANK") == "1")
        assert len(family) >= 6, family  # 2 agents, 2 ranks, a loader worker each: a real test
        killed = time.monotonic()
        rank1.send_signal(signal.SIGKILL)
        outputs = [agent.communicate(timeout=TIMEOUT + 30)[0] for agent in agents]
        ended = time.monotonic() - killed
        gone, alive = psutil.wait_procs(family, timeout=3)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        for process in family + [psutil.Process(a.pid) for a in agents if a.poll() is None]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    text = "\n".join(outputs)
    assert ended < TIMEOUT, (ended, text[-4000:])
    assert [agent.returncode for agent in agents] == [1, 1], text[-4000:]  # torchrun's status for a failed worker
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text[-4000:]
    step = max(r["step"] for r in records(tmp_path / "run.jsonl.rank0"))
    assert re.fullmatch(
        r"error: rank 0: rank 1 \(its only peer\) left the process group \((?:Connection closed by peer "
        r"\[127\.0\.0\.1\]:\d+|Read error \[127\.0\.0\.1\]:\d+: Connection reset by peer)\) at optimizer step "
        rf"({step - 1}|{step}); no checkpoint was saved in this launch",  # gloo's words: the peer's socket closed
        errors[0],
    ), errors[0]
    assert "pair.cc" not in text and "RuntimeError" not in text, text[-4000:]  # no gloo traceback
    assert re.search(rf"rank\s*:\s*0 .*\n\s*exitcode\s*:\s*{PEER_LOST_STATUS} ", outputs[0]), outputs[0][-3000:]
    assert re.search(r"rank\s*:\s*1 .*\n\s*exitcode\s*:\s*-9 ", outputs[1]), outputs[1][-3000:]
    assert alive == [], alive


@pytest.mark.parametrize(
    "error, said, timed_out",
    [
        (RuntimeError("[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:21911. This is typically "
                      "caused by a remote worker crashing."), "Connection closed by peer [10.0.0.2]:21911", False),
        (RuntimeError("[pair.cc:575] Read error [127.0.0.1]:4242: Connection reset by peer"),
         "Read error [127.0.0.1]:4242: Connection reset by peer", False),
        (RuntimeError("[/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 600000ms for recv operation to "
                      "complete"), "Timed out waiting 600000ms for recv operation", True),
        (DistBackendError("NCCL error in: x, remote process exited or there was a network error\nncclRemoteError: ."),
         "NCCL error in: x, remote process exited or there was a network error", False),
        (DistStoreError("Timed out after 601 seconds waiting for clients. 1/2 clients joined."),
         "Timed out after 601 seconds waiting for clients. 1/2 clients joined.", True),
        (DistNetworkError("failed to recv, got 0 bytes"), "failed to recv, got 0 bytes", False),
    ],
    ids=["gloo-closed", "gloo-reset", "gloo-timeout", "nccl-remote", "store-timeout", "store-gone"],
)  # fmt: skip
def test_a_collective_that_lost_its_peer_is_told_from_any_other_error(error, said, timed_out):
    assert peer_lost(error) == PeerLost(said, timed_out)
    try:
        try:
            raise error
        except RuntimeError as cause:
            raise ValueError("while reducing the loss") from cause
    except ValueError as wrapped:
        assert peer_lost(wrapped) == PeerLost(said, timed_out)  # what caused an error is read too


@pytest.mark.parametrize(
    "error",
    [RuntimeError("CUDA out of memory"), ConnectionResetError(104, "Connection reset by peer"),
     BrokenPipeError(32, "Broken pipe"), DistBackendError("NCCL error: invalid usage (ncclInvalidUsage)")],
    ids=["oom", "a-download", "stdout-closed", "nccl-own-use"],
)  # fmt: skip
def test_other_errors_are_no_lost_peer(error):
    assert peer_lost(error) is None


def fake_trainer(tmp_path: Path, rank: int, world: int, timeout: float | None = None) -> SimpleNamespace:
    strategy = SimpleNamespace(timeout=None if timeout is None else timedelta(seconds=timeout))
    return SimpleNamespace(global_rank=rank, world_size=world, global_step=3, strategy=strategy,
                           checkpoint_callbacks=[], default_root_dir=str(tmp_path))  # fmt: skip


def test_the_line_names_the_only_peer_or_says_a_peer_and_the_timeout_it_waited(tmp_path):
    closed = PeerLost("Connection closed by peer [10.0.0.2]:4242", timed_out=False)
    assert peer_left(fake_trainer(tmp_path, 0, 2), closed) == (
        "rank 0: rank 1 (its only peer) left the process group (Connection closed by peer [10.0.0.2]:4242) at "
        "optimizer step 3; no checkpoint was saved in this launch"
    )
    waited = PeerLost("Timed out waiting 30000ms for recv operation", timed_out=True)
    assert peer_left(fake_trainer(tmp_path, 5, 16, timeout=30), waited) == (
        "rank 5: a peer rank (of 16) did not answer within trainer.strategy.init_args.timeout=30 s (Timed out waiting "
        "30000ms for recv operation) at optimizer step 3; no checkpoint was saved in this launch"
    )


class Ended:
    """A launched rank that has ended with `code` (what `dead_rank` reads of a `subprocess.Popen`)."""

    def __init__(self, code: int, pid: int = 4242) -> None:
        self.code, self.pid = code, pid

    def poll(self) -> int:
        return self.code


def test_a_rank_stopped_by_a_lost_peer_is_not_the_one_that_died():
    assert dead_rank([Ended(PEER_LOST_STATUS)]) is None
    assert dead_rank([Ended(PEER_LOST_STATUS), Ended(-9, pid=77)]) == "rank 2 (pid 77) was killed by SIGKILL"
