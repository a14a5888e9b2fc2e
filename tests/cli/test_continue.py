"""Continuing a run through the real command line: a 4-step fit, `validate` of its checkpoint, and the same config
resumed to step 6 (subprocesses, output as a user reads it: stdout and stderr together)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY
from tests.helpers import launch

# Three launches of main.py (a fit, validate, a resumed fit): about 30 s on 2 cores, so `slow` (run by CI).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
# The quickstart (val_check_interval 0.5, max_epochs 1) on 64 examples: about 15 steps per epoch, so both fits
# end mid-epoch.
CONFIG = [
    "--config", str(ROOT / "configs" / "quickstart.yaml"), f"--model.model_config={json.dumps(TINY)}",
    "--data.limit=64", "--data.max_length=512", "--trainer.logger=false",
]  # fmt: skip
CHECKPOINT = "--ckpt_path=last"  # the run's newest checkpoint


def main_py(cwd: Path, *args: str) -> str:
    """`python main.py <args>` in `cwd`, as a user runs it; its stdout and stderr, after checking it succeeded."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = launch.run([sys.executable, str(ROOT / "main.py"), *args], cwd=cwd, env=env, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    return output


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, str]:
    """The output of: a fit of 4 steps; `validate` of its checkpoint; the same fit resumed from it to step 6."""
    cwd = tmp_path_factory.mktemp("continue")
    first = main_py(cwd, "fit", *CONFIG, "--trainer.max_steps=4")
    validated = main_py(cwd, "validate", *CONFIG, CHECKPOINT)
    resumed = main_py(cwd, "fit", *CONFIG, "--trainer.max_steps=6", CHECKPOINT)
    return {"first": first, "validate": validated, "resumed": resumed}


def lines(output: str, start: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(start)]


def summary(output: str) -> dict[str, str]:
    """The fit summary's rows: `│ name │ value │` -> {name: value}."""
    cells = (re.fullmatch(r"│ (.+?) +│ (.+?) +│", line.strip()) for line in output.splitlines())
    return {match[1]: match[2] for match in cells if match}


def test_a_resume_restores_the_data_position_and_says_so_and_lightning_agrees(run):
    resumed = run["resumed"]
    position = lines(resumed, "resumed at")
    assert len(position) == 1 and re.fullmatch(
        r"resumed at optimizer step 4: epoch 0, micro-batch 4 of \d+ of the same plan: exact", position[0]
    ), position
    assert "not resumable" not in resumed  # Lightning's "unreliable results" warning: the loader does resume
    assert lines(resumed, "training:") == ["training: 2 optimizer steps, from step 4 to 6"]
    assert [line.split()[1] for line in lines(resumed, "step ")] == ["5/6", "6/6"]


def test_validation_follows_the_cadence_of_each_launch(run):
    """val_check_interval 0.5: half-way and at the end of each launch (the resumed one's own 2 steps, not Lightning's
    count from the epoch's start, which validates at step 6 only)."""
    steps = [[line.split(":")[0] for line in lines(run[fit], "validation")] for fit in ("first", "resumed")]
    assert steps == [
        ["validation at step 2", "validation at step 4"],
        ["validation at step 5", "validation at step 6"],
    ]


def test_validate_names_the_checkpoints_step(run):
    assert len(lines(run["validate"], "validation at step 4: val/loss ")) == 1


def test_the_summary_tells_the_run_from_this_launch(run):
    first, resumed = summary(run["first"]), summary(run["resumed"])
    assert first["optimizer steps"] == "4" and not any("launch" in name for name in first)
    assert (resumed["optimizer steps (run)"], resumed["optimizer steps (this launch)"]) == ("6", "2")
    assert "optimizer steps" not in resumed
    for measured in ("examples", "real tokens", "effective tokens/s", "train time"):
        assert f"{measured} (this launch)" in resumed and measured not in resumed
    assert "lit_packing fit summary (resumed at step 4)" in run["resumed"]


def test_log_lines_show_rates_with_one_decimal_and_losses_with_four(run):
    step = lines(run["first"], "step 1/4")[0]
    assert re.fullmatch(
        r"step 1/4  pad 0\.0000  train/loss \d+\.\d{4}  tok/s [\d,]+\.\d  elapsed 0:00:\d\d  eta 0:00:\d\d", step
    ), step
    validation = lines(run["first"], "validation at step 2")[0]
    assert re.fullmatch(
        r"validation at step 2: val/loss \d+\.\d{4}  val/perplexity [\d,]+\.\d{4}  val/token_accuracy \d\.\d{4}",
        validation,
    ), validation
    assert lines(run["first"], "training:") == ["training: 4 optimizer steps"]
