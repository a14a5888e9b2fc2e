"""A user's second day, through the real command line (subprocesses, as a user runs it): every common mistake is
one line naming the setting and the fix, exit status 2, no traceback, in seconds, and nothing is asked of the Hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TINY
from tests.helpers.launch import run

ROOT = Path(__file__).parents[2]


def main_py(tmp_path: Path, *args: str, offline: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python main.py <args>` in `tmp_path`, as a user runs it (network closed unless `offline=False` asks to try)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))}
    if offline:
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.update(WANDB_MODE="offline", PYTHONPATH=str(ROOT))
    return run([sys.executable, str(ROOT / "main.py"), *args], cwd=tmp_path, env=env, timeout=timeout)


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """The run failed as a toolkit error does: status 2, no traceback, the message on the last line."""
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith("error: "), output[-3000:]
    return last


QUICK = ["fit", "--config", "quickstart", f"--model.model_config={json.dumps(TINY)}", "--trainer.max_steps=1"]


@pytest.mark.parametrize(
    "override, message",
    [
        (
            ["--data.source=lit_packing.data.HFDataset", "--data.source.init_args.path=my_chat.jsonl"],
            "error: data.source.init_args.path: no such local file or folder 'my_chat.jsonl' (looked in {cwd}); "
            "check the path",
        ),
        (
            [
                "--data.source=lit_packing.data.HFDataset",
                "--data.source.init_args.path=json",
                "--data.source.init_args.data_files=shards/*.jsonl",
            ],
            "error: data.source.init_args.data_files: 'shards/*.jsonl' matches no local file (looked in {cwd}); "
            "check the path",
        ),
    ],
    ids=["data file", "data_files glob"],
)
def test_a_missing_local_path_is_named_before_any_hub_request(tmp_path, override, message):
    started = time.perf_counter()
    done = main_py(tmp_path, *QUICK, *override, offline=False)  # the network is tried only if the path test fails
    assert one_line_error(done) == message.format(cwd=tmp_path)
    assert "huggingface.co" not in done.stdout + done.stderr
    assert time.perf_counter() - started < 120  # no retries (a Hub lookup of a missing folder took ~55 s)


def test_a_missing_model_folder_is_named_in_seconds(tmp_path):
    started = time.perf_counter()
    done = main_py(tmp_path, "fit", "--config", "quickstart", "--model.name_or_path=runs/my_model/final", offline=False)
    assert one_line_error(done) == (
        f"error: model.name_or_path: no such local file or folder 'runs/my_model/final' (looked in {tmp_path}); "
        "check the path"
    )
    assert time.perf_counter() - started < 120


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE=1", "no network"])
def test_a_hub_id_that_cannot_be_reached_says_so_once(tmp_path, offline):
    done = main_py(tmp_path, "fit", "--config", "quickstart", "--model.name_or_path=no-such-org/no-such-model",
                   offline=offline)  # fmt: skip
    last = one_line_error(done)
    assert last.startswith("error: model.name_or_path: 'no-such-org/no-such-model' is not a local path, and the ")
    assert ("HF_HUB_OFFLINE=1" in last) if offline else ("cannot be reached" in last)
    assert (done.stdout + done.stderr).count("no-such-org/no-such-model") == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data.max_lenght", "512"], "error: data.max_lenght is not a setting here: did you mean --data.max_length?"),
        (
            ["--trainer.max_stpes=5"],
            "error: trainer.max_stpes is not a setting here: did you mean --trainer.max_steps?",
        ),
        (["--data.overlong", "trunc"], "error: data.overlong: 'trunc' is not one of: truncate, drop, error"),
        (["--data.max_length", "abc"], "error: data.max_length: 'abc' is not an int"),
        (
            ["--trainer.accelerator", "gpu"],
            "error: trainer.accelerator: gpu asks for a CUDA GPU, and this machine has none (torch {torch}, a CPU-only "
            "build); set --trainer.accelerator=cpu (or auto); configs/gpu.yaml is for machines with a GPU",
        ),
        (
            ["--ckpt_path", "runs/quickstart/version_0/checkpoints/typo.ckpt"],
            "error: --ckpt_path: 'runs/quickstart/version_0/checkpoints/typo.ckpt': no such file (looked in {cwd}); "
            "give a checkpoint (e.g. runs/quickstart/version_0/checkpoints/last.ckpt), or last: the run's newest",
        ),
    ],
    ids=["unknown key", "unknown trainer key", "wrong choice", "wrong type", "no GPU", "missing checkpoint"],
)
def test_a_common_mistake_is_one_line_last_with_the_fix(tmp_path, args, message):
    import torch

    if "gpu" in args and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    started = time.perf_counter()
    done = main_py(tmp_path, "fit", "--config", "quickstart", *args)
    assert one_line_error(done) == message.format(cwd=tmp_path, torch=torch.__version__)
    assert "usage:" not in done.stdout + done.stderr  # no usage dump above the line
    assert time.perf_counter() - started < 60  # before the model or the data load


def test_an_unknown_key_in_a_yaml_file_names_the_nearest(tmp_path):
    (tmp_path / "mine.yaml").write_text("data:\n  max_lenght: 512\n")
    done = main_py(tmp_path, "fit", "--config", "quickstart", "--config", "mine.yaml")
    assert one_line_error(done) == "error: data.max_lenght is not a setting here: did you mean --data.max_length?"


@pytest.mark.slow  # seven launches of main.py, three of them fits: over a minute on 2 cores
def test_continuing_a_run_with_nothing_left_to_train_stops_before_training(tmp_path):
    """`max_steps` counts from the start of the run: the same limit again stops at once, naming the checkpoint's
    step and the value that trains more; that value trains, from the exact position. Before that, `validate` and
    `test` of the first fit's checkpoint print their metrics and write no run folder."""
    run = [*QUICK[:-1], "--data.limit=24", "--trainer.max_steps=2"]
    assert main_py(tmp_path, *run).returncode == 0
    ckpt = ["--ckpt_path", "last"]  # the run's newest checkpoint, in its folder
    before = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "runs").rglob("*"))
    for command in ("validate", "test"):
        done = main_py(tmp_path, command, *run[1:], *ckpt)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        assert f"{'val' if command == 'validate' else 'test'}/loss" in done.stdout
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "runs").rglob("*")) == before
    started = time.perf_counter()
    again = main_py(tmp_path, *run, *ckpt)
    assert one_line_error(again) == (
        "error: trainer.max_steps: 2 counts optimizer steps from the start of the run, and "
        "runs/quickstart/version_0/checkpoints/last.ckpt is at optimizer step 2 (epoch 0): nothing is left to train; "
        "--trainer.max_steps=4 trains 2 more "
        "(--trainer.max_steps=-1 --trainer.max_epochs=1: to the end of the epoch it is in)"
    )
    assert time.perf_counter() - started < 60 and "`max_steps=2` reached" not in again.stdout + again.stderr
    more = main_py(tmp_path, *run[:-1], "--trainer.max_steps=4", *ckpt)
    assert more.returncode == 0, (more.stdout + more.stderr)[-3000:]
    assert "of the same plan: exact" in more.stdout
    epochs = main_py(tmp_path, *run[:-1], "--trainer.max_steps=-1", "--trainer.max_epochs=1", *ckpt)
    assert epochs.returncode == 0, (epochs.stdout + epochs.stderr)[-3000:]
    last = main_py(tmp_path, *run[:-1], "--trainer.max_steps=-1", "--trainer.max_epochs=1", *ckpt)
    assert one_line_error(last).startswith(
        "error: trainer.max_epochs: 1 counts epochs from the start of the run, and "
        "runs/quickstart/version_0/checkpoints/last.ckpt is at "
    )
    assert "with 1 epoch completed: nothing is left to train; --trainer.max_epochs=2 trains 1 more" in last.stdout


def test_every_toolkit_line_is_on_stdout(tmp_path):
    """`python main.py fit ... | tee run.log` keeps the whole story: data, progress, validation, summary."""
    done = main_py(tmp_path, *QUICK[:-1], "--data.limit=64", "--trainer.max_steps=2")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    lines = ("ChampChats() with smollm2: ", "attention backend: per_example", "isolation self-test passed",
             "step 2/2", "validation at step 2", "lit_packing fit summary")  # fmt: skip
    for line in lines:
        assert line in done.stdout, (line, done.stdout[-3000:])
        assert line not in done.stderr
    assert "UserWarning" not in done.stderr  # the toolkit's own warnings are log lines, not Python warnings
