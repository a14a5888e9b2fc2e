"""The packing report runs on real CHAMP data and its numbers are consistent across strategies."""

import numpy as np
import pytest

from lit_packing.inspect import main, plan_stats
from lit_packing.samplers import PackPlan


def test_report_on_champ(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(
        "data:\n  limit: 80\n  val_split: 8\n  max_length: 2048\n"
        "  sampler:\n    class_path: lit_packing.samplers.BestFitPackingSampler\n"
        "    init_args:\n      max_tokens: 4096\n"
    )
    rows = main(["--config", str(config), "--batch_size", "4", "--out", str(tmp_path / "r.png")])
    by_name = {r.name: r for r in rows}
    assert len({r.real_tokens for r in rows}) == 1  # every strategy trains on the same tokens
    assert by_name["padding (random batches)"].padding_ratio > 0.05
    assert by_name["best-fit packing"].padding_ratio == 0.0
    assert by_name["best-fit packing"].steps < by_name["padding (random batches)"].steps * 4
    assert by_name["mini-batch packing"].steps == by_name["padding (random batches)"].steps
    assert by_name["mini-batch packing"].attn_cost < by_name["padding (random batches)"].attn_cost
    assert (tmp_path / "r.png").stat().st_size > 10_000
    assert "best-fit packing" in capsys.readouterr().out


def test_plan_stats_worked_example():
    # Two packs: [4, 8] and [5]; padded they cost 2 * 8 and 1 * 5 slots.
    plan = PackPlan(items=np.arange(3), offsets=np.array([0, 2, 3]), tokens=np.array([4, 8, 5]), max_tokens=None)
    packed, padded = plan_stats("p", plan, 0.0, padded=False), plan_stats("q", plan, 0.0, padded=True)
    assert (packed.real_tokens, packed.slot_tokens, packed.attn_cost) == (17, 17, 16 + 64 + 25)
    assert (padded.slot_tokens, padded.attn_cost) == (16 + 5, 2 * 64 + 25)
    assert padded.padding_ratio == pytest.approx(4 / 21)
