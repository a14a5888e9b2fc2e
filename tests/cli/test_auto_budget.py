"""`max_tokens: auto` through the real CLI (a tiny Llama, Chatterbot, this CPU's RAM as the device): it picks a budget
that trains, and a smaller one under a lower memory limit. The full-logits loss makes every 1,024 tokens cost ~0.8
GiB (49,152 logits x 16 bytes a token), so the candidates' predictions lie far apart compared with how much the
memory a fresh process holds varies between runs."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY
from tests.helpers.launch import run

ROOT = Path(__file__).parents[2]
CHOSE = re.compile(r"max_tokens: auto chose ([\d,]+) tokens per pack: predicted peak ([\d.]+) GiB")


def fit(tmp_path: Path, limit_gb: float, *extra: str) -> tuple[int, float, str]:
    args = [
        sys.executable, str(ROOT / "main.py"), "fit", "--config", "quickstart", *extra,
        f"--model.model_config={json.dumps(TINY)}",
        "--data.source=lit_packing.data.Chatterbot",
        f"--data.cache_dir={tmp_path / 'cache'}",
        "--data.sampler.init_args.max_tokens=auto",
        "--data.sampler.init_args.max_tokens_cap=8192",
        "--model.loss_impl=full",
        f"--model.memory_limit_gb={limit_gb}",
        f"--trainer.max_steps={1 + bool(extra)}", "--trainer.limit_val_batches=0", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path}",
    ]  # fmt: skip
    done = run(args, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    chose = CHOSE.search(done.stdout)
    assert chose, done.stdout[-3000:]
    assert re.search(r"step (\d)/\1", done.stdout)  # the chosen budget trained
    return int(chose.group(1).replace(",", "")), float(chose.group(2)), done.stdout


@pytest.mark.slow
def test_auto_picks_a_budget_that_trains_and_a_smaller_one_under_a_lower_limit(tmp_path):
    budget, peak, _ = fit(tmp_path, limit_gb=16.0)
    assert budget == 8192  # the cap: the device holds more than the cap asks
    lower = (peak - 2.0) / 0.75  # ~2.5 candidates below the cap's predicted peak, with the 25% margin
    smaller, smaller_peak, out = fit(tmp_path, limit_gb=round(lower, 3))
    assert 1024 <= smaller < budget, out[-2000:]
    assert smaller_peak <= round(lower, 3) * 0.75 + 1e-6


@pytest.mark.slow
def test_auto_sizes_a_sharded_step_for_a_ranks_share_and_every_rank_takes_it(tmp_path):
    """FSDP2 on 2 CPU ranks: the estimate behind the choice counts this rank's shard (and says so), the ranks agree
    on one budget (the smallest either chose), and both train 2 steps with it."""
    budget, peak, out = fit(tmp_path, 6.0, "--config", "fsdp2", "--trainer.devices=2", "--trainer.precision=32-true")
    assert 1024 <= budget <= 8192 and peak <= 6.0 * 0.75
    assert "divided over 2 shards" in out and out.count("max_tokens: auto chose") == 1, out[-3000:]
