"""Exact resume through the real CLI: kill -9 mid-epoch with DataLoader workers, then `--ckpt_path`, trains the
same batches in the same order and ends with the same weights as a run left alone; a 2-node launch (torchrun on
loopback, multipack) resumed on one process trains every example of the epoch exactly once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from lit_packing.batch import INDEX
from lit_packing.data import Chatterbot, PackingDataModule
from lit_packing.data.tokenize import column
from tests.helpers import launch
from tests.helpers.launch import run_fit

ROOT = Path(__file__).parents[2]
MULTINODE = ("configs/gpu.yaml", "configs/multinode.yaml")  # a delta on the GPU config
DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
                   "LIT_PACKING_LAUNCHER_PID")  # fmt: skip

# A callback the runs load from tmp_path: it writes every micro-batch's source rows (and may slow the run down, so
# that the test can kill it at a known point).
RECORDER = """
import json, os, time
from lightning.pytorch import Callback

class Recorder(Callback):
    def __init__(self, path: str, delay: float = 0.0):
        self.path, self.delay = path, delay

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        rank = trainer.global_rank
        with open(f"{self.path}.rank{rank}", "a") as f:
            f.write(json.dumps({"epoch": trainer.current_epoch, "step": trainer.global_step, "rows": batch["rows"]}))
            f.write("\\n")
        time.sleep(self.delay)
"""


def fit_args(
    tmp_path: Path,
    model_config: dict,
    name: str,
    configs: tuple[str, ...] = ("configs/quickstart.yaml",),
    delay: float = 0.0,
) -> list[str]:
    callbacks = [
        {"class_path": "recorder.Recorder", "init_args": {"path": str(tmp_path / f"{name}.jsonl"), "delay": delay}},
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": str(tmp_path / name), "filename": "{step}", "every_n_train_steps": 2,
                          "save_top_k": -1},
        },
    ]  # fmt: skip
    return [
        sys.executable, str(ROOT / "main.py"), "fit",
        *(arg for config in configs for arg in ("--config", str(ROOT / config))),
        *chatterbot_run(tmp_path, model_config, callbacks),
        "--data.num_workers=2",
        "--trainer.max_epochs=3",
        "--trainer.accumulate_grad_batches=2",
    ]  # fmt: skip


def chatterbot_run(tmp_path: Path, model_config: dict, callbacks: list[dict]) -> list[str]:
    """What the resume tests' runs share: a tiny model on 112 Chatterbot chats in 384-token packs, fp32 on the CPU,
    no validation, no logger, `callbacks`, everything under `tmp_path`."""
    return [
        f"--model.model_config={json.dumps(model_config)}",
        "--model.lr=1e-3",
        "--data.source=lit_packing.data.Chatterbot",
        "--data.limit=120",
        "--data.val_split=8",
        "--data.max_length=256",
        "--data.sampler.init_args.max_tokens=384",
        f"--data.cache_dir={tmp_path / 'cache'}",
        "--trainer.accelerator=cpu",
        "--trainer.precision=32-true",
        "--trainer.limit_val_batches=0",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.callbacks={json.dumps(callbacks)}",
    ]  # fmt: skip


def env(tmp_path: Path) -> dict[str, str]:
    """This environment without any launcher variables (each run is its own launch), the recorder importable."""
    clean = {key: value for key, value in os.environ.items() if key not in DISTRIBUTED_ENV}
    return {**clean, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "OMP_NUM_THREADS": "1"}


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


@pytest.mark.slow
@pytest.mark.serial
def test_kill_9_mid_epoch_with_workers_then_resume_is_exact(tmp_path, tiny_llama_config):
    (tmp_path / "recorder.py").write_text(RECORDER)
    run = dict(cwd=tmp_path, env=env(tmp_path), timeout=300)  # each launch takes < 60 s
    max_steps = ["--trainer.max_steps=14"]
    alone = run_fit(fit_args(tmp_path, tiny_llama_config, "alone") + max_steps, **run)
    assert alone.returncode == 0, alone.stderr[-3000:]
    uninterrupted = records(tmp_path / "alone.jsonl.rank0")
    epochs = {r["epoch"] for r in uninterrupted}
    assert len(epochs) >= 2, "the run must cross an epoch boundary for this test to mean anything"
    steps_per_epoch = max(r["step"] for r in uninterrupted if r["epoch"] == 0) + 1
    kill_at = steps_per_epoch + 2 + (steps_per_epoch % 2)  # an even step (a checkpoint) inside the second epoch

    victim = launch.start(fit_args(tmp_path, tiny_llama_config, "killed", delay=0.4) + max_steps, cwd=tmp_path,
                          env=env(tmp_path))  # fmt: skip
    checkpoint = tmp_path / "killed" / f"step={kill_at}.ckpt"
    deadline = time.monotonic() + 400
    while not checkpoint.exists() and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # let it train (and prefetch) past the checkpoint, then kill it without warning
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert checkpoint.exists()
    killed = records(tmp_path / "killed.jsonl.rank0")
    assert any(r["step"] >= kill_at for r in killed)  # batches past the checkpoint were lost and must be redone

    resume = [f"--ckpt_path={checkpoint}"]
    resumed = run_fit(fit_args(tmp_path, tiny_llama_config, "resumed") + max_steps + resume, **run)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    trained_before = [r for r in killed if r["step"] < kill_at]
    assert [r["rows"] for r in trained_before + records(tmp_path / "resumed.jsonl.rank0")] == [
        r["rows"] for r in uninterrupted
    ]
    final_alone, final_resumed = (
        weights(tmp_path / "alone" / "step=14.ckpt"),
        weights(tmp_path / "resumed" / "step=14.ckpt"),
    )
    for name, tensor in final_alone.items():
        torch.testing.assert_close(final_resumed[name], tensor, rtol=1e-6, atol=1e-7, msg=name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Per launch layout: ranks per node, then what the launch on 2 nodes and the resume on one process add.
LAYOUTS = {
    "ddp": (1, (), ()),
    "fsdp2": (  # 2 nodes x 2 ranks sharded 4 ways; the resume reads the 4 shards into 1
        2,
        ("--config", str(ROOT / "configs/fsdp2.yaml"), "--trainer.strategy.init_args.data_parallel_size=4"),
        ("--config", str(ROOT / "configs/fsdp2.yaml"), "--trainer.strategy.init_args.data_parallel_size=1"),
    ),
}


@pytest.mark.slow  # the first pass, beside other runs: a free port, nothing killed or measured
@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_node_launch_on_loopback_then_resume_on_one_process(tmp_path, tiny_llama_config, layout):
    """`torchrun --nnodes=2` twice (node ranks 0 and 1) trains over gloo (DDP with 1 rank a node; FSDP2 with 2 a
    node, each layer sharded over the 4 ranks), its shape taken from torchrun, and stops at a checkpoint mid-epoch;
    one process resumes it: every example of the epoch is trained exactly once."""
    per_node, launched, resumed = LAYOUTS[layout]
    ranks = 2 * per_node
    (tmp_path / "recorder.py").write_text(RECORDER)
    port = free_port()
    common = fit_args(tmp_path, tiny_llama_config, "nodes", configs=MULTINODE)[1:]  # drop the interpreter
    # No trainer.devices or num_nodes: multinode.yaml takes the shape torchrun gives (2 nodes x `per_node`).
    common += ["--trainer.max_epochs=1", "--trainer.max_steps=2", *launched]
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--nproc-per-node={per_node}",
                f"--node-rank={rank}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                *common,
            ],
            cwd=tmp_path,
            env=env(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-3000:]
    per_rank = [records(tmp_path / f"nodes.jsonl.rank{r}") for r in range(ranks)]
    assert [len(rank) for rank in per_rank] == [4] * ranks  # 2 optimizer steps x 2 micro-batches, on each rank

    single = fit_args(tmp_path, tiny_llama_config, "single", configs=MULTINODE)
    single += ["--trainer.num_nodes=1", "--trainer.devices=1", "--trainer.max_epochs=1", *resumed,
               f"--ckpt_path={tmp_path / 'nodes' / 'step=2.ckpt'}"]  # fmt: skip
    done = run_fit(single, cwd=tmp_path, env=env(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    trained = Counter(row for rank in per_rank for r in rank for row in r["rows"])
    trained += Counter(row for r in records(tmp_path / "single.jsonl.rank0") for row in r["rows"])
    assert set(trained.values()) == {1}, "an example was trained twice"
    # Every training example of the epoch, once: the same data module settings, set up in this process.
    dm = PackingDataModule(
        source=Chatterbot(), limit=120, val_split=8, max_length=256, cache_dir=str(tmp_path / "cache")
    )
    dm.setup("fit")
    assert sorted(trained) == sorted(column(dm.train_dataset.dataset, INDEX).tolist())
