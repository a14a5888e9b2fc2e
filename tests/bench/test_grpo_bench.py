"""`python -m benchmarks.grpo_throughput --smoke`: its printed table parses, every row trained the same groups to
the same losses, and TRL's fused head in that benchmark scores the completion tokens only (its CUDA layout)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from benchmarks.grpo_throughput import ROWS, main, padded
from benchmarks.trl_grpo import build_trl_grpo_trainer, completion_only_head
from lit_packing.models.grpo import GRPOSettings
from tests.helpers import TINY_LLAMA, tiny_model

ROW_LINE = re.compile(r"^(?P<label>\S.*?)\s{2,}(?P<speed>[\d.]+)\s+(?P<trl>[\d.]+)x\s+(?P<unshared>[\d.]+)x\s+"
                      r"(?P<positions>[\d,]+)$")  # fmt: skip


def table_rows(out: str) -> dict[str, dict[str, float]]:
    """The rows of the printed table, by label: tokens/s, the two ratios and the positions run."""
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("variant"))
    rows = {}
    for line in lines[header + 1 : header + 1 + len(ROWS)]:
        match = ROW_LINE.match(line)
        assert match, line
        rows[match["label"]] = {key: float(match[key].replace(",", "")) for key in ("speed", "trl", "unshared",
                                                                                       "positions")}  # fmt: skip
    return rows


def test_the_smoke_run_prints_a_table_of_every_row_trained_to_the_same_losses(capsys):
    report = main(["--smoke"])
    rows = table_rows(capsys.readouterr().out)
    assert list(rows) == list(ROWS.values())
    trl, unshared, shared = (rows[label] for label in ROWS.values())
    assert trl["trl"] == 1.0 and unshared["unshared"] == 1.0 and all(row["speed"] > 0 for row in rows.values())
    assert shared["positions"] < unshared["positions"] < trl["positions"]  # prompt once < per completion < padded
    for name, label in ROWS.items():
        assert rows[label]["speed"] == pytest.approx(report["tokens_per_s"][name], abs=0.05)
        assert rows[label]["trl"] == pytest.approx(report["vs_trl"][name], abs=0.005)
    losses = [loss for rounds in report["losses"].values() for row in rounds for loss in row]
    assert len(losses) == len(ROWS) * report["rounds"] * (report["warmup"] + report["timed_steps"])
    assert all(math.isfinite(loss) and loss != 0 for loss in losses)
    assert report["loss_spread"] < 1e-5  # the same groups, weights and loss: equal to fp32 rounding


def test_trls_head_scores_the_completion_tokens_only_and_to_the_same_loss(monkeypatch):
    import trl.trainer.utils as trl_utils

    scored, kernel = [], trl_utils._ChunkedLogProbFunction

    class CountingKernel:  # the positions each call of TRL's head projects
        @staticmethod
        def apply(hidden, *rest):
            scored.append(hidden.shape[0])
            return kernel.apply(hidden, *rest)

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", CountingKernel)
    groups = [  # prompts of 5 and 2 tokens; completions of 4, 1, 2 and of 6, 3 tokens
        {"input_ids": list(range(3, 15)), "completion_tokens": [4, 1, 2], "rewards": [1.0, 0.0, 0.5]},
        {"input_ids": list(range(20, 31)), "completion_tokens": [6, 3], "rewards": [0.0, 1.0]},
    ]
    settings = GRPOSettings("dapo", max_completion_length=6)
    inputs = padded(groups, settings)
    model = tiny_model(TINY_LLAMA).train()
    trainer = build_trl_grpo_trainer(model, loss_type="dapo", max_completion_length=6)
    everywhere = trainer.compute_loss(model, inputs)
    with completion_only_head():
        compact = trainer.compute_loss(model, inputs)
    rows, width = 5, 5 + 6  # (B, P + C): prompts padded to 5, completions to 6
    assert scored == [rows * (width - 1), 4 + 1 + 2 + 6 + 3]  # every shifted position on a CPU; the labels only
    torch.testing.assert_close(compact, everywhere)
