"""The packing report runs on real CHAMP data through the CLI's own parser, its numbers are consistent across
strategies, and its configured row equals what a fit of the same config and overrides logs."""

import csv
import json
import math

import numpy as np
import pytest

from lit_packing.callbacks import TokenThroughputMonitor
from lit_packing.cli import cli_main
from lit_packing.packing_report import STRAGGLER_RANKS, configured_data, main, plan_stats, straggler_rows
from lit_packing.samplers import BestFitPackingSampler, PackPlan
from tests.cli.test_configs import TINY

# A tiny random model of SmolLM2's family (the packaged tokenizer stays): the report builds the model as fit does.
TINY_MODEL = [f"--model.model_config={json.dumps(TINY)}", "--trainer.accelerator=cpu", "--trainer.devices=1"]


def test_report_on_champ(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(
        "data:\n  limit: 80\n  val_split: 8\n  max_length: 2048\n"
        "  sampler:\n    class_path: lit_packing.samplers.BestFitPackingSampler\n"
        "    init_args:\n      max_tokens: 4096\n"
    )
    rows = main(["--config", str(config), "--batch_size", "4", "--out", str(tmp_path / "r.png"), *TINY_MODEL])
    by_name = {r.name: r for r in rows}
    assert len({r.real_tokens for r in rows}) == 1  # every strategy trains on the same tokens
    assert by_name["padding (random batches)"].padding_ratio > 0.05
    assert by_name["best-fit packing"].padding_ratio == 0.0
    assert by_name["best-fit packing"].steps < by_name["padding (random batches)"].steps * 4
    assert by_name["mini-batch packing"].steps == by_name["padding (random batches)"].steps
    assert by_name["mini-batch packing"].attn_cost < by_name["padding (random batches)"].attn_cost
    assert (tmp_path / "r.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "best-fit packing" in printed and "straggler factor" in printed and "round-robin (best fit)" in printed


def test_straggler_rows_on_champ(tmp_path):
    """On real CHAMP lengths (cut at 4,096 tokens) multipack balances ranks better than round-robin dealing."""
    config = tmp_path / "c.yaml"
    config.write_text("data:\n  limit: 1500\n  val_split: 8\n  max_length: 4096\n")
    lengths = configured_data(config, TINY_MODEL)[0].train_lengths
    packs = len(BestFitPackingSampler(lengths, 8192).plan(0))
    for accumulate in (1, 2):
        rows = straggler_rows(lengths, 8192, accumulate)
        assert [r.world_size for r in rows] == list(STRAGGLER_RANKS)
        for r in rows:
            micro_steps = math.ceil(packs / r.world_size)
            assert r.steps == math.ceil(micro_steps / accumulate)
            assert 1.0 <= r.multipack <= r.round_robin, r
        eight = rows[1]
        assert eight.round_robin > 1.05 and eight.multipack <= 1.03, eight


def test_plan_stats_worked_example():
    # Two packs: [4, 8] and [5]; padded they cost 2 * 8 and 1 * 5 slots.
    plan = PackPlan(items=np.arange(3), offsets=np.array([0, 2, 3]), tokens=np.array([4, 8, 5]), max_tokens=None)
    packed, padded = plan_stats("p", plan, 0.0, padded=False), plan_stats("q", plan, 0.0, padded=True)
    assert (packed.real_tokens, packed.slot_tokens, packed.attn_cost) == (17, 17, 16 + 64 + 25)
    assert (padded.slot_tokens, padded.attn_cost) == (16 + 5, 2 * 64 + 25)
    assert padded.padding_ratio == pytest.approx(4 / 21)


def test_report_equals_what_a_fit_logs(tmp_path, monkeypatch):
    """Same config, same CLI override (max_tokens 2048 -> 1024) and accumulation: the report's configured row
    equals the fit's optimizer steps, logged real tokens and summed slot tokens."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text(
        "data:\n  limit: 40\n  val_split: 4\n  max_length: 400\n"
        "  sampler:\n    class_path: lit_packing.samplers.BestFitPackingSampler\n"
        "    init_args:\n      max_tokens: 2048\n"
        "  collator:\n    class_path: lit_packing.data.PackedCollator\n    init_args:\n      pad_to_multiple_of: 64\n"
    )
    overrides = ["--data.sampler.init_args.max_tokens=1024", "--trainer.accumulate_grad_batches=2", *TINY_MODEL]
    configured = main(["--config", str(config), *overrides, "--out", str(tmp_path / "r.png")])[0]
    assert configured.name == "configured: BestFitPackingSampler + PackedCollator"
    assert configured.examples_max > 1 and configured.padding_ratio > 0  # packs of several examples, 64-padded

    logger = {"class_path": "CSVLogger", "init_args": {"save_dir": str(tmp_path)}}
    fit = [
        "--trainer.max_epochs=1", "--trainer.log_every_n_steps=1", "--trainer.precision=32-true",
        "--trainer.num_sanity_val_steps=0", "--trainer.enable_checkpointing=false",
        f"--trainer.logger={json.dumps(logger)}", f"--trainer.default_root_dir={tmp_path}",
    ]  # fmt: skip
    cli = cli_main(["fit", "--config", str(config), *overrides, *fit])
    monitor = next(cb for cb in cli.trainer.callbacks if isinstance(cb, TokenThroughputMonitor))
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        logged = [float(row["train/real_tokens"]) for row in csv.DictReader(f) if row.get("train/real_tokens")]
    assert configured.steps == cli.trainer.global_step == len(logged)
    assert configured.real_tokens == sum(logged) == monitor.totals["real_tokens"]
    assert configured.slot_tokens == monitor.totals["slot_tokens"]
    padding = (monitor.totals["slot_tokens"] - monitor.totals["real_tokens"]) / monitor.totals["slot_tokens"]
    assert configured.padding_ratio == pytest.approx(padding, rel=1e-12)  # the same ints, 1 - r/s vs (s - r)/s


def test_report_on_a_stream_shows_windowed_fill_against_offline(tmp_path, capsys):
    """A streaming config: the stream's first examples packed window by window, the configured buffer size marked,
    every row's fill at most offline best fit's, and the largest window within a few tenths of a percent of it."""
    overrides = ["--data.buffer_size=100", f"--data.cache_dir={tmp_path}", "--data.val_split=4"]
    assert main(["--config", "streaming", "--stream_examples", "1200", *overrides, *TINY_MODEL]) == []
    printed = capsys.readouterr().out
    title = " ".join(line.strip() for line in printed.splitlines() if not line.startswith(("│", "┃", "┏", "┡", "└")))
    assert "fill of the stream's first 1,200 examples packed in windows by BestFitPackingSampler" in title
    rows = [line.split("│")[1:-1] for line in printed.splitlines() if line.startswith("│")]
    by_size = {cells[0].strip(): [c.strip() for c in cells] for cells in rows}
    assert "100 (configured)" in by_size and "64" in by_size and "1,000" in by_size
    fills = {size: float(cells[3]) for size, cells in by_size.items()}
    offline = float(by_size["64"][4])
    assert all(fill <= offline + 1e-9 for fill in fills.values())
    assert fills["64"] < fills["1,000"] <= offline
