"""`benchmarks/gpu_check.sh` runs only where a GPU is lent, so what it can break on a CPU is checked here: its
environment prelude imports what it names, every part's module takes the options the script passes, and the HF
Trainer peer names the checkpointing field the installed transformers has."""

from __future__ import annotations

import dataclasses
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import TrainingArguments

from benchmarks.peers import _checkpointing_field

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_check.sh"


def test_the_environment_prelude_runs_on_a_cpu():
    prelude = re.search(r"<<'PY'.*?\n(.*?)\nPY\n", SCRIPT.read_text(), re.S).group(1)
    done = subprocess.run([sys.executable, "-c", prelude], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "auto -> per_example" in done.stdout


def test_every_part_passes_options_its_module_takes(monkeypatch, capsys):
    text = SCRIPT.read_text().replace("\\\n", " ")
    calls = re.findall(r'"\$PYTHON" -m (benchmarks(?:\.\w+)?) ([^\n]*)', text)
    assert {module for module, _ in calls} >= {"benchmarks", "benchmarks.qlora", "benchmarks.loss_memory"}
    for module, rest in calls:
        taken = set(re.findall(r"--\w+", _usage(module, monkeypatch, capsys)))
        passed = set(re.findall(r"--\w+", rest)) - {"--help"}
        if "GPU_BENCH" in rest:
            passed |= set(re.findall(r"--\w+", re.search(r"GPU_BENCH=\((.*?)\)", text, re.S).group(1)))
        assert passed <= taken, f"{module}: {sorted(passed - taken)} are not its options"


def _usage(module: str, monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    assert done.value.code == 0
    return capsys.readouterr().out


def test_the_peer_names_a_checkpointing_field_of_this_transformers():
    assert _checkpointing_field() in {field.name for field in dataclasses.fields(TrainingArguments)}
