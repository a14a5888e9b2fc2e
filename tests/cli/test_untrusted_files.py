"""Files from elsewhere and runs that die: a crafted checkpoint never runs code, a damaged one is named in one line,
and a run killed with SIGKILL leaves no process behind (its workers, its other ranks), through the real CLI."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from lit_packing.cli import cli_main
from lit_packing.preflight import read_checkpoint
from tests.cli.test_configs import error_line
from tests.cli.test_resume import env
from tests.cli.test_trajectory import LLAMA, RECORDER, fit_args
from tests.conftest import TINY

ROOT = Path(__file__).parents[2]
UNSAFE = "weights_only=" + "False"  # spelled apart so that this file passes its own scan


def test_no_unsafe_unpickling_anywhere_in_the_source():
    """Every checkpoint read goes through PyTorch's safe loader: no unsafe `weights_only`, no bare pickle loads, no
    pickled numpy arrays, in the package, the benchmarks, the tests or main.py; every `torch.load` in the package
    and the benchmarks says `weights_only=True`."""
    files = [*ROOT.glob("lit_packing/**/*.py"), *ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("tests/**/*.py")]
    files.append(ROOT / "main.py")
    assert len(files) > 100
    for path in files:
        text = path.read_text()
        assert UNSAFE not in text, path
        assert "allow_pickle=" + "True" not in text, path
        if path.parts[len(ROOT.parts)] in ("lit_packing", "benchmarks"):
            assert not re.search(r"\bpickle\.loads?\(|\bdill\.|joblib\.load", text), path
            for call in re.finditer(r"torch\.load\(([^()]|\([^()]*\))*\)", text):
                assert "weights_only=True" in call[0], (path, call[0])


def tiny_args(tmp_path: Path, *extra: str) -> list[str]:
    """A tiny model on 40 Chatterbot chats, fp32 on the CPU, 2 steps, a checkpoint under tmp_path."""
    return [
        "--config", "quickstart", f"--model.model_config={json.dumps(TINY)}",
        "--data.source=lit_packing.data.Chatterbot", "--data.limit=40", "--data.val_split=8",
        "--data.max_length=256", "--data.sampler.init_args.max_tokens=512",
        f"--data.cache_dir={tmp_path / 'cache'}", "--trainer.accelerator=cpu", "--trainer.precision=32-true",
        "--trainer.max_steps=2", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Real checkpoints the toolkit wrote: a full fine-tune, a LoRA run's (adapters only), a `max_tokens: auto`
    run's (the chosen size kept). A stream's position and an elastic resume's checkpoints are read the same way by
    their own tests (tests/cli/test_stream_resume.py, test_trajectory.py: the pre-flight of every resume)."""
    kinds = {
        "full": (),
        "lora": ("--model.lora={r: 4, lora_alpha: 8, target_modules: [q_proj]}",),
        "auto": ("--data.sampler.init_args.max_tokens=auto", "--data.sampler.init_args.max_tokens_cap=2048",
                 "--model.memory_limit_gb=16"),
    }  # fmt: skip
    found = {}
    for kind, extra in kinds.items():
        tmp = tmp_path_factory.mktemp(kind)
        cli = cli_main(["fit", *tiny_args(tmp, *extra)])
        found[kind] = Path(cli.trainer.default_root_dir) / "checkpoints" / "last.ckpt"
    found["tmp"] = tmp_path_factory.mktemp("damaged")
    return found


def test_every_checkpoint_the_toolkit_writes_loads_with_the_safe_loader(checkpoints):
    for kind in ("full", "lora", "auto"):
        contents = read_checkpoint(checkpoints[kind])
        assert contents["global_step"] >= 1 and contents["state_dict"]
        torch.load(checkpoints[kind], map_location="cpu", weights_only=True)
    assert all("lora_" in key for key in read_checkpoint(checkpoints["lora"])["state_dict"])  # adapters only


class Payload:
    """What a crafted checkpoint carries: unpickling it runs a shell command."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


@pytest.mark.parametrize("command", ["fit", "validate", "test"])
def test_a_crafted_checkpoint_never_runs_its_payload(command, tmp_path, capsys):
    sentinel, crafted = tmp_path / "PAYLOAD_RAN", tmp_path / "last.ckpt"
    torch.save({"pytorch-lightning_version": "2.6.6", "state_dict": {}, "x": Payload(sentinel)}, crafted)
    line = error_line([command, *tiny_args(tmp_path), f"--ckpt_path={crafted}"], capsys)
    assert not sentinel.exists()
    assert line == (
        f"error: --ckpt_path: {crafted} holds posix.system, which the safe loader does not read: unpickling it could "
        "run code; only checkpoints of plain tensors and values are read; resume from a checkpoint this toolkit "
        "wrote; a file from elsewhere is code, not data, unless it holds plain tensors"
    )


DAMAGED = {
    "truncated": ("cut short", lambda data: data[: len(data) // 2]),
    "empty": ("is empty (0 bytes)", lambda data: b""),
    "text": ("is not a checkpoint", lambda data: b"step: 10\nloss: 1.2\n"),
}


@pytest.mark.parametrize("kind", sorted(DAMAGED))
def test_a_damaged_checkpoint_is_named_in_one_line(kind, checkpoints, capsys):
    what, damage = DAMAGED[kind]
    path = checkpoints["tmp"] / f"{kind}.ckpt"
    path.write_bytes(damage(checkpoints["full"].read_bytes()))
    line = error_line(["fit", *tiny_args(checkpoints["tmp"]), f"--ckpt_path={path}", "--trainer.max_steps=4"], capsys)
    assert line.startswith(f"error: --ckpt_path: {path} ") and what in line


def test_a_torch_file_that_is_not_a_lightning_checkpoint_is_named(checkpoints, capsys):
    path = checkpoints["tmp"] / "weights.pt"
    torch.save({"embed.weight": torch.zeros(2, 2)}, path)
    line = error_line(["fit", *tiny_args(checkpoints["tmp"]), f"--ckpt_path={path}", "--trainer.max_steps=4"], capsys)
    assert line.startswith(f"error: --ckpt_path: {path} is not a Lightning checkpoint (a torch.save file of embed.")


def test_a_checkpoint_of_another_model_shape_is_named(checkpoints):
    """Through the CLI a checkpoint brings its own model settings (Lightning parses its hyper-parameters); through
    the Python API a model of another shape meets it, and is refused before Lightning loads a weight."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from lit_packing.data.collate import PackedCollator
    from lit_packing.errors import AssetError
    from lit_packing.models import PackedCausalLM
    from tests.helpers import make_examples

    other = PackedCausalLM(model_config={**TINY, "hidden_size": 32, "intermediate_size": 64})
    batches = DataLoader([PackedCollator()(make_examples([5, 7]))], batch_size=None, collate_fn=lambda b: b)
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(AssetError) as error:
        trainer.validate(other, batches, ckpt_path=str(checkpoints["full"]))
    first = "model.model.embed_tokens.weight: [49152, 64] there, [49152, 32] here"
    assert str(error.value).startswith(f"--ckpt_path: {checkpoints['full']} holds another model than this run builds:")
    assert f"weights of another shape (first: {first})" in str(error.value) and "\n" not in str(error.value)


def test_a_checkpoint_of_another_data_source_is_named(checkpoints, capsys):
    args = ["fit", *tiny_args(checkpoints["tmp"]), "--data.limit=30", "--trainer.max_steps=4"]
    line = error_line([*args, f"--ckpt_path={checkpoints['full']}"], capsys)
    assert "the checkpoint's data position belongs to another plan" in line and "data.limit" in line


# ---------------------------------------------------------------------------------------------------------------
# SIGKILL: nothing of the run outlives it


def kill_and_watch(tmp_path: Path, args: list[str], ready: Path, ranks: int = 1) -> tuple[list[str], bool]:
    """Start a fit with its output on a pipe, wait until it trains (`ready` has a line), SIGKILL its first process
    only (a preemption), and give the rest 3 s to end (the kernel ends them at once; without that, a DataLoader
    worker notices a dead parent in 5 s at best, a stream's never). Returns a line for each process still alive and
    whether the pipe closed (a process still holding the run's stdout keeps a wrapper waiting)."""
    victim = subprocess.Popen(args, cwd=tmp_path, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    reader = threading.Thread(target=victim.stdout.read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while not (ready.exists() and ready.read_text().strip()) and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert victim.poll() is None, "the run ended before it trained"
    time.sleep(1.0)
    family = psutil.Process(victim.pid).children(recursive=True)
    assert len(family) >= 2 * ranks + (ranks - 1), family  # 2 workers a rank (+ the other ranks): a real test
    killed = time.time()
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    gone, alive = psutil.wait_procs(family, timeout=3)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    described = [describe(p, victim.pid, killed) for p in alive]
    reader.join(timeout=15)
    for p in alive:  # leave nothing behind for the next test either
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    return described, not reader.is_alive()


def describe(process: psutil.Process, victim: int, killed: float) -> str:
    """A process still alive after the kill: when it started, whose child it is, its state, and how long it then
    takes to end by itself (up to 30 s more)."""
    try:
        with process.oneshot():
            what = (
                f"pid {process.pid} ({process.name()}, started {killed - process.create_time():.1f} s before the "
                f"kill, parent {process.ppid()}; the killed run was {victim}), state {process.status()}"
            )
    except psutil.NoSuchProcess:
        return f"pid {process.pid}: ended while described"
    began = time.monotonic()
    _, still = psutil.wait_procs([process], timeout=30)
    return f"{what}: {'alive 30 s later' if still else f'ended {time.monotonic() - began:.1f} s later'}"


STREAM = [
    "--data.streaming=true",
    "--data.buffer_size=48",
    "--data.limit=null",
    "--data.val_split=0",
    "--trainer.val_check_interval=1.0",
]


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.parametrize("path", ["cached", "streamed"])
def test_sigkill_of_a_fit_with_workers_leaves_no_process(path, tmp_path):
    (tmp_path / "recorder.py").write_text(RECORDER)
    extra = ["--data.num_workers=2", "--trainer.max_steps=200", *(STREAM if path == "streamed" else [])]
    args = fit_args(tmp_path, LLAMA, "run", 1, *extra, delay=0.5)
    alive, closed = kill_and_watch(tmp_path, args, tmp_path / "run.rank0")
    assert alive == [] and closed


@pytest.mark.slow
@pytest.mark.serial
def test_sigkill_of_rank_0_leaves_no_rank_or_worker(tmp_path):
    (tmp_path / "recorder.py").write_text(RECORDER)
    args = fit_args(tmp_path, LLAMA, "run", 2, "--data.num_workers=2", "--trainer.max_steps=200", delay=0.5)
    alive, closed = kill_and_watch(tmp_path, args, tmp_path / "run.rank1", ranks=2)
    assert alive == [] and closed


@pytest.mark.slow
@pytest.mark.serial
def test_a_rank_that_dies_ends_the_run_in_one_line_naming_it_and_the_resume(tmp_path):
    """SIGKILL rank 1 of a 2-rank fit once a checkpoint is saved: rank 0 says in one line which rank died and how,
    at which step, the last checkpoint and the command that resumes from it; status 1, no traceback, in seconds,
    no process left (rank 0's collective would otherwise fail with gloo's traceback, or wait for NCCL's timeout)."""
    (tmp_path / "recorder.py").write_text(RECORDER)
    args = fit_args(tmp_path, LLAMA, "run", 2, "--data.num_workers=1", "--trainer.max_steps=200", delay=0.3)
    run = subprocess.Popen(args, cwd=tmp_path, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)  # fmt: skip
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(run.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300

    def trained_past_a_checkpoint() -> bool:  # the checkpoint of step 2 saved, and rank 0 training step 3 or later
        record = tmp_path / "run.rank0"
        steps = [json.loads(line)["step"] for line in record.read_text().splitlines()] if record.exists() else []
        return bool(list((tmp_path / "run").glob("step=*.ckpt"))) and max(steps, default=0) >= 3

    while not trained_past_a_checkpoint() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run.poll() is None, "".join(output)[-3000:]
    family = psutil.Process(run.pid).children(recursive=True)
    rank1 = next(p for p in psutil.Process(run.pid).children() if p.environ().get("LOCAL_RANK") == "1")
    killed = time.monotonic()
    rank1.send_signal(signal.SIGKILL)
    status = run.wait(timeout=60)
    ended = time.monotonic() - killed
    reader.join(timeout=15)
    gone, alive = psutil.wait_procs(family, timeout=3)
    alive = [p.pid for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    text = "".join(output)
    last = text.strip().splitlines()[-1]
    assert status == 1 and ended < 10, (status, ended, text[-3000:])
    assert "Traceback" not in text, text[-3000:]
    found = re.fullmatch(rf"error: rank 1 \(pid {rank1.pid}\) was killed by SIGKILL at optimizer step (\d+); the last "
                         r"checkpoint: (\S+); resume with: python (.*)", last)  # fmt: skip
    assert found, last
    assert Path(found[2]).parent == tmp_path / "run" and Path(found[2]).is_file()
    assert found[3].endswith(f"--ckpt_path={found[2]}") and "main.py fit --config" in found[3]
    assert alive == []
