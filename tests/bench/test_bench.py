"""`python -m benchmarks --smoke`: every row runs, and the table's arithmetic holds against the samplers'
plans and the collators' counts (no timing is asserted)."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest
from transformers import AutoModelForCausalLM

from benchmarks.run import BenchSettings, main, parse, plan_runs
from benchmarks.variants import VARIANTS, RunSpec
from lit_packing.configs import composition
from lit_packing.cost import hardware_flops, model_shape
from lit_packing.packing_report import configured_data
from lit_packing.samplers import BestFitPackingSampler, FixedLengthPackingSampler, MultipackSampler
from tests.conftest import all_cores

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    with all_cores():  # the workers run one at a time
        report = main(["--smoke", "--out", str(out)])
    return report, json.loads((out / "bench.json").read_text()), out


@pytest.fixture(scope="module")
def data(bench):
    """The examples and mini-batches of the smoke run, built independently of the benchmark's own counting."""
    _, payload, out = bench
    run = next(r for r in payload["runs"] if r["variant"] == "minibatch_packing")
    spec_file = out / "runs" / f"minibatch_packing-r{run['round']}" / "spec.json"
    spec = RunSpec(**json.loads(spec_file.read_text()))
    module, _ = configured_data(composition("minibatch_packing"), spec.overrides())
    batches = [list(map(int, b)) for b in module.train_dataloader().batch_sampler]
    return spec, module.train_lengths, batches


def test_every_row_and_output(bench):
    _, payload, out = bench
    settings = BenchSettings(smoke=True)
    assert [row["row"] for row in payload["table"]] == settings.variants == list(VARIANTS)
    markdown = (out / "bench.md").read_text()
    assert markdown.startswith(
        "**Smoke run**: the wiring with a tiny model and a few steps; its numbers measure nothing."
    )
    for variant in VARIANTS.values():
        assert f"| {variant.label} |" in markdown
    assert (out / "bench.png").stat().st_size > 10_000
    assert len(payload["runs"]) == settings.rounds * len(VARIANTS)
    targets = " / ".join(t["target"] for t in payload["targets"])
    for target in ("2.0x padding", "1.5x HF Trainer", "fewer optimizer steps", "tokens/s >= mini-batch",
                   "val loss of mini-batch packing", "contaminated", "peak memory"):  # fmt: skip
        assert target in targets
    assert all(isinstance(t["met"], bool) for t in payload["targets"])  # every row ran: each can be judged
    assert "| target | measured | met |" in markdown


def test_epoch_counts_match_the_plans(bench, data):
    _, payload, _ = bench
    spec, lengths, batches = data
    rows = {row["row"]: row for row in payload["table"]}
    total = int(lengths.sum())
    padded_slots = sum(len(b) * int(lengths[b].max()) for b in batches)
    for name, row in rows.items():  # every row trains the same examples; only padding has padding
        assert row["real_tokens"] == total, name
        padded = name.startswith("padding")
        assert row["padding_ratio"] == pytest.approx(1 - total / padded_slots if padded else 0.0), name
    for name in ("padding", "padding_full_logits"):
        assert (rows[name]["optimizer_steps_per_epoch"], rows[name]["slot_tokens"]) == (len(batches), padded_slots)
    for name in ("minibatch_packing", "hf_trainer"):
        assert (rows[name]["optimizer_steps_per_epoch"], rows[name]["slot_tokens"]) == (len(batches), total)
    plans = {
        "bestfit_packing": BestFitPackingSampler(lengths, spec.max_tokens),
        "multipack": MultipackSampler(lengths, spec.max_tokens),
        "fixed_position_ids": FixedLengthPackingSampler(lengths, spec.max_length, rows_per_step=spec.rows_per_step),
        "fixed_no_position_ids": FixedLengthPackingSampler(lengths, spec.max_length, rows_per_step=spec.rows_per_step),
    }
    for name, sampler in plans.items():
        assert rows[name]["optimizer_steps_per_epoch"] == len(sampler.plan(0)), name
        assert rows[name]["slot_tokens"] == total, name
    assert rows["trl_bfd"]["optimizer_steps_per_epoch"] >= math.ceil(total / spec.max_tokens)


def test_steps_tokens_and_losses_agree(bench, data):
    _, payload, _ = bench
    spec, lengths, batches = data
    first = {r["row"]: r for r in payload["runs"] if r["round"] == 0}
    expected = [int(lengths[b].sum()) for b in batches[: spec.steps]]
    for name in ("padding", "padding_full_logits", "minibatch_packing", "hf_trainer"):  # the same mini-batches
        assert first[name]["real_tokens"] == expected, name
    assert first["padding"]["slot_tokens"] == [len(b) * int(lengths[b].max()) for b in batches[: spec.steps]]
    # The FLOPs each step computed: padded rows x longest, packed sum(L^2), the peer's sdpa the whole row squared.
    shape = model_shape(AutoModelForCausalLM.from_pretrained(spec.model))
    timed = batches[: spec.steps]
    padded = [{"slot_tokens": len(b) * int(lengths[b].max()), "attn_cost": len(b) * int(lengths[b].max()) ** 2}
              for b in timed]  # fmt: skip
    packed_counts = [{"slot_tokens": int(lengths[b].sum()), "attn_cost": int((lengths[b] ** 2).sum())} for b in timed]
    flat = [{"slot_tokens": int(lengths[b].sum()), "attn_cost": int(lengths[b].sum()) ** 2} for b in timed]
    for name, counts in (("padding", padded), ("minibatch_packing", packed_counts), ("hf_trainer", flat)):
        assert first[name]["work"] == pytest.approx([hardware_flops(shape, c) for c in counts]), name
    # Same batches, same initial weights, same optimizer: the same losses (attention kernels differ in rounding).
    packed = first["minibatch_packing"]
    np.testing.assert_allclose(first["padding"]["loss"], packed["loss"], rtol=1e-5)
    np.testing.assert_allclose(first["padding_full_logits"]["loss"], packed["loss"], rtol=1e-5)
    np.testing.assert_allclose(first["hf_trainer"]["loss"], packed["loss"], rtol=1e-4)
    assert first["padding"]["val_loss"] == pytest.approx(packed["val_loss"], rel=1e-5)
    assert first["hf_trainer"]["val_loss"] == pytest.approx(packed["val_loss"], rel=1e-4)
    for run in payload["runs"]:  # deterministic: every round trains the same
        np.testing.assert_allclose(run["loss"], first[run["row"]]["loss"], rtol=1e-6)


def test_table_arithmetic(bench):
    _, payload, _ = bench
    runs = payload["runs"]

    def rate(run):
        w = run["warmup_steps"]
        return sum(run["real_tokens"][w:]) / (run["step_end"][-1] - run["step_end"][w - 1])

    def epoch_seconds(run):
        w = run["warmup_steps"]
        return (run["step_end"][-1] - run["step_end"][w - 1]) * run["epoch_work"] / sum(run["work"][w:])

    rates = {(r["row"], r["round"]): rate(r) for r in runs}
    seconds = {(r["row"], r["round"]): epoch_seconds(r) for r in runs}
    for row in payload["table"]:
        rounds = range(row["rounds"])
        assert row["effective_tokens_per_s"] == pytest.approx([rates[(row["row"], k)] for k in rounds])
        epoch = [row["real_tokens"] / seconds[(row["row"], k)] for k in rounds]
        assert row["epoch_effective_tokens_per_s"] == pytest.approx(epoch)
        padding = [row["real_tokens"] / seconds[("padding", k)] for k in rounds]
        peer = [row["real_tokens"] / seconds[("hf_trainer", k)] for k in rounds]
        assert row["vs_padding"] == pytest.approx([m / p for m, p in zip(epoch, padding)])
        assert row["vs_hf_trainer"] == pytest.approx([m / p for m, p in zip(epoch, peer)])
        assert row["epoch_seconds"] == pytest.approx(statistics.median(seconds[(row["row"], k)] for k in rounds))
        first = next(r for r in runs if r["row"] == row["row"] and r["round"] == 0)
        assert row["train_loss"] == pytest.approx(statistics.fmean(first["loss"]))
        assert row["peak_memory_gb"] > 0


def test_rounds_interleave_and_rotate():
    settings = BenchSettings(variants=["padding", "minibatch_packing", "bestfit_packing"], pretrained=["padding"],
                             rounds=3, pretrained_rounds=1)  # fmt: skip
    runs = plan_runs(settings, "init")
    order = [(r.round, r.row) for r in runs]
    assert order[:4] == [(0, "padding"), (0, "minibatch_packing"), (0, "bestfit_packing"), (0, "padding@smollm2")]
    assert [row for k, row in order if k == 1] == ["minibatch_packing", "bestfit_packing", "padding"]
    assert all(r.gradient_checkpointing == (r.model == "smollm2") for r in runs)


def test_settings_from_a_yaml(tmp_path):
    config = tmp_path / "bench.yaml"
    config.write_text("rounds: 5\nvariants: [padding, minibatch_packing]\nmodel_config: {num_hidden_layers: 2}\n")
    settings = parse(["--config", str(config), "--steps", "7"])
    assert (settings.rounds, settings.steps, settings.variants) == (5, 7, ["padding", "minibatch_packing"])
    assert settings.model_config == {"num_hidden_layers": 2}


def test_settings_are_checked():
    with pytest.raises(ValueError, match="variants.*unknown.*'nope'"):
        BenchSettings(variants=["nope"])
    with pytest.raises(ValueError, match="steps"):
        BenchSettings(steps=0)
