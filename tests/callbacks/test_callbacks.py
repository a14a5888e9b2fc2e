"""Callbacks against fixed batches and a patched clock: the exact values that reach the logger."""

import csv
import itertools
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from transformers import AutoConfig, AutoModelForCausalLM

from lit_packing.callbacks import PackingMonitor, ProgressLog, TokenThroughputMonitor
from lit_packing.callbacks import throughput as throughput_module
from lit_packing.contract import DataContract, DataModelConnection
from lit_packing.cost import ModelShape, hardware_flops, model_flops, model_shape
from lit_packing.data.collate import PackedCollator, PaddedCollator
from lit_packing.models.loading import apply_lora
from tests.conftest import TINY_CONFIGS
from tests.helpers import launch

BATCH_LENGTHS = [(4, 8, 5, 11), (30,), (3, 3)]
STEP_SECONDS = 0.5


def examples(lengths):
    return [{"input_ids": list(range(1, n + 1)), "labels": list(range(1, n + 1))} for n in lengths]


class FixedBatches(pl.LightningModule):
    """The smallest real LightningModule: one weight, a loss that touches it, batches given up front."""

    def __init__(self, batches):
        super().__init__()
        self.batches = batches
        self.weight = torch.nn.Parameter(torch.ones(3))

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.batches, batch_size=None, collate_fn=lambda b: b)

    def training_step(self, batch, batch_idx):
        return self.weight.sum() * 0.0 + batch["input_ids"].float().mean() * self.weight[0]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(tmp_path, monkeypatch, batches, accumulate=1, module=FixedBatches):
    ticks = itertools.count()
    monkeypatch.setattr(throughput_module, "time", SimpleNamespace(perf_counter=lambda: next(ticks) * STEP_SECONDS))
    trainer = pl.Trainer(
        max_epochs=1,
        logger=CSVLogger(tmp_path),
        callbacks=[PackingMonitor(), TokenThroughputMonitor(window=2)],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(module(batches))
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(f)]
    return trainer, [row for row in rows if "train/padding_ratio" in row]


def test_packed_steps_log_exact_padding_and_windowed_throughput(tmp_path, monkeypatch):
    collate = PackedCollator(pad_to_multiple_of=16)
    trainer, rows = fit(tmp_path, monkeypatch, [collate(examples(lengths)) for lengths in BATCH_LENGTHS])
    assert [row["step"] for row in rows] == [0, 1, 2]
    # slots: 28 -> 32, 30 -> 32, 6 -> 16
    assert [row["train/padding_ratio"] for row in rows] == pytest.approx([4 / 32, 2 / 32, 10 / 16])
    assert [row["train/packing_efficiency"] for row in rows] == pytest.approx([28 / 32, 30 / 32, 6 / 16])
    assert [row["train/examples_per_step"] for row in rows] == [4, 1, 2]
    assert [row["train/real_tokens"] for row in rows] == [28, 30, 6]
    assert [row["train/label_tokens"] for row in rows] == [24, 29, 4]
    # Window of 2 steps, 0.5 s apart on the patched clock.
    expected_rates = [28 / 0.5, (28 + 30) / 1.0, (30 + 6) / 1.0]
    assert [row["train/effective_tokens_per_sec"] for row in rows] == pytest.approx(expected_rates)
    assert [row["train/slot_tokens_per_sec"] for row in rows] == pytest.approx([32 / 0.5, 64 / 1.0, 48 / 1.0])
    assert [row["train/examples_per_sec"] for row in rows] == pytest.approx([4 / 0.5, 5 / 1.0, 3 / 1.0])
    params = 3  # FixedBatches has no attention: model FLOPs are 6 * params * real tokens, hardware's slot tokens
    assert rows[0]["train/tflops_per_sec"] == pytest.approx(6 * params * 28 / 0.5 / 1e12)
    assert rows[0]["train/hardware_tflops_per_sec"] == pytest.approx(6 * params * 32 / 0.5 / 1e12)
    assert rows[0]["train/peak_memory_gb"] > 0
    epoch = trainer.callback_metrics
    assert float(epoch["train/epoch_padding_ratio"]) == pytest.approx((80 - 64) / 80)


def test_padded_batches_count_pad_slots(tmp_path, monkeypatch):
    collate = PaddedCollator(pad_token_id=0)
    _, rows = fit(tmp_path, monkeypatch, [collate(examples(lengths)) for lengths in BATCH_LENGTHS])
    # (4, 8, 5, 11) padded to 4 x 11 = 44 slots with 28 real tokens
    assert rows[0]["train/padding_ratio"] == pytest.approx(16 / 44)
    assert rows[1]["train/padding_ratio"] == 0.0


def test_model_flops_count_real_work_and_hardware_flops_what_the_device_computed():
    # 1,000 trainable and 500 frozen matmul params; two layers of width 8: one full, one with a 5-token window.
    shape = ModelShape(trainable_params=1000, frozen_params=500, attn_width=8, windows=(None, 5))
    packed = PackedCollator(pad_to_multiple_of=16)(examples((4, 8, 5, 11)))  # 28 real tokens in 32 slots
    padded = PaddedCollator()(examples((4, 8, 5, 11)))  # 4 rows x 11 = 44 slots
    per_token = 6 * 1000 + 4 * 500
    # Full layer: 16 + 64 + 25 + 121 = 226 pairs; windowed: 4*4 + 8*5 + 5*5 + 11*5 = 136.
    real = per_token * 28 + 12 * 8 * (226 + 136)
    assert model_flops(shape, packed["counts"], packed["lengths"]) == real == 258_752
    assert model_flops(shape, padded["counts"], padded["lengths"]) == real  # padding is waste, not work
    # Hardware: every slot; attention over whole rows (packed: + the 4-token pad segment), windows not discounted.
    assert hardware_flops(shape, packed["counts"]) == per_token * 32 + 12 * 2 * 8 * (226 + 16) == 302_464
    assert hardware_flops(shape, padded["counts"]) == per_token * 44 + 12 * 2 * 8 * 4 * 121 == 444_928


class TinyQwen2(FixedBatches):
    """FixedBatches holding a real tiny Qwen2 (second layer windowed to 6 tokens) with LoRA on q and v."""

    def __init__(self, batches):
        super().__init__(batches)
        config = dict(TINY_CONFIGS["qwen2"], use_sliding_window=True, sliding_window=6, max_window_layers=1)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
        self.model = apply_lora(model, {"r": 4, "target_modules": ["q_proj", "v_proj"]})


@pytest.mark.parametrize("collate", [PackedCollator(pad_to_multiple_of=16), PaddedCollator()], ids=["packed", "padded"])
def test_logged_tflops_count_lora_windows_and_real_tokens_only(tmp_path, monkeypatch, collate):
    # LoRA r=4 on q (64 -> 64) and v (64 -> 32) in 2 layers: 2 * (64*4 + 4*64 + 64*4 + 4*32) = 1,792 trainable;
    # the frozen rest, input embedding left out (a lookup): 3,220,032.
    assert model_shape(TinyQwen2([]).model) == ModelShape(
        trainable_params=1792, frozen_params=3_220_032, attn_width=64, windows=(None, 6)
    )
    _, rows = fit(tmp_path, monkeypatch, [collate(examples(lengths)) for lengths in BATCH_LENGTHS], module=TinyQwen2)
    # Step 0: lengths 4, 8, 5, 11 (28 real tokens); full layer 226 pairs, windowed (6) 16 + 48 + 25 + 66 = 155.
    flops = (6 * 1792 + 4 * 3_220_032) * 28 + 12 * 64 * (226 + 155)
    assert rows[0]["train/tflops_per_sec"] == pytest.approx(flops / 0.5 / 1e12)  # float32, as Lightning logs
    slots, attn = (32, 226 + 16) if isinstance(collate, PackedCollator) else (44, 4 * 121)
    hardware = (6 * 1792 + 4 * 3_220_032) * slots + 12 * 2 * 64 * attn
    assert rows[0]["train/hardware_tflops_per_sec"] == pytest.approx(hardware / 0.5 / 1e12)


def test_gradient_accumulation_logs_once_per_optimizer_step_over_all_micro_batches(tmp_path, monkeypatch):
    collate = PackedCollator(pad_to_multiple_of=16)
    _, rows = fit(tmp_path, monkeypatch, [collate(examples(lengths)) for lengths in BATCH_LENGTHS], accumulate=2)
    # Step 0 = micro-batches (4, 8, 5, 11) + (30,): 58 real in 64 slots; step 1 = the epoch's last micro-batch.
    assert [row["step"] for row in rows] == [0, 1]
    assert [row["train/padding_ratio"] for row in rows] == pytest.approx([6 / 64, 10 / 16])
    assert [row["train/examples_per_step"] for row in rows] == [5, 2]
    assert [row["train/label_tokens"] for row in rows] == [24 + 29, 4]


class ReportingData(pl.LightningDataModule):
    """Fixed batches and a tokenization report, published in a `DataContract` as `PackingDataModule` does."""

    def __init__(self, batches, report):
        super().__init__()
        self.batches = batches
        self.contract = DataContract(
            tokenizer=None, token_id_range=(0, 0), name_rows=str,
            largest_step=lambda: None, report=report,
        )  # fmt: skip

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.batches, batch_size=None, collate_fn=lambda b: b)


def read_rows(tmp_path):
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(f)]


def test_dataset_counts_are_logged_once_and_truncation_per_step(tmp_path):
    """`train/truncated_tokens` is each step's own count; `data/...` (the dataset's report) is logged once."""
    from lit_packing.data.report import TokenizationReport

    batches = [PackedCollator()(examples(lengths)) for lengths in BATCH_LENGTHS]
    for batch, cut in zip(batches, (5, 0, 2)):
        batch["counts"]["truncated_tokens"] = cut
    report = TokenizationReport(examples_in=9, examples_out=7, truncated_tokens=7, dropped_overlong_examples=2)
    trainer = pl.Trainer(
        max_epochs=1,
        logger=CSVLogger(tmp_path),
        callbacks=[PackingMonitor(), DataModelConnection()],  # PackedCausalLM attaches the connection itself
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(FixedBatches(batches), datamodule=ReportingData(batches, report))
    rows = read_rows(tmp_path)
    assert [row["train/truncated_tokens"] for row in rows if "train/truncated_tokens" in row] == [5, 0, 2]
    data_rows = [row for row in rows if "data/truncated_tokens" in row]
    assert len(data_rows) == 1 and data_rows[0]["step"] == 0
    assert data_rows[0]["data/truncated_tokens"] == 7 and data_rows[0]["data/dropped_overlong_examples"] == 2
    assert not any("train/dropped_examples" in row for row in rows)


def test_summary_tokens_per_sec_is_the_logged_rate_when_the_fit_fits_in_the_window(tmp_path, capsys):
    """One clock: with 3 steps and window 20 the last logged rate, the bar's `tok/s` and the summary agree."""
    monitor = TokenThroughputMonitor(window=20)
    trainer = pl.Trainer(
        max_epochs=1,
        logger=CSVLogger(tmp_path),
        callbacks=[monitor],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    collate = PackedCollator()
    trainer.fit(FixedBatches([collate(examples(lengths)) for lengths in BATCH_LENGTHS]))
    rows = read_rows(tmp_path)
    logged = [row["train/effective_tokens_per_sec"] for row in rows if "train/effective_tokens_per_sec" in row]
    summary = monitor.totals["real_tokens"] / monitor.train_seconds
    assert monitor.totals["real_tokens"] == 28 + 30 + 6
    assert logged[-1] == pytest.approx(summary, rel=1e-6)  # Lightning keeps logged scalars as float32
    assert float(trainer.progress_bar_metrics["tok/s"]) == pytest.approx(summary, rel=1e-6)
    printed = next(line for line in capsys.readouterr().out.splitlines() if "effective tokens/s" in line)
    assert printed.split()[-2] == f"{summary:,.1f}" and "ranks" not in printed  # one rank: no rank label


def test_progress_log_words_one_step_and_shows_any_rate_with_one_decimal(tmp_path, monkeypatch, capsys):
    """`training: 1 optimizer step`, singular; 28 tokens in 0.5 s on the patched clock: `tok/s 56.0`, the rate with
    one decimal however small (a loss or a ratio keeps four)."""
    ticks = itertools.count()
    monkeypatch.setattr(throughput_module, "time", SimpleNamespace(perf_counter=lambda: next(ticks) * STEP_SECONDS))
    callbacks = [TokenThroughputMonitor(summary=False), ProgressLog()]
    trainer = pl.Trainer(
        max_steps=1, logger=False, callbacks=callbacks, enable_checkpointing=False, enable_model_summary=False,
        accelerator="cpu", default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(FixedBatches([PackedCollator()(examples(BATCH_LENGTHS[0]))]))
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith(("training:", "step "))] == [
        "training: 1 optimizer step",
        "step 1/1  tok/s 56.0  elapsed 0:00:00  eta 0:00:00",
    ]


DDP_SCRIPT = """
import json
import sys

import torch
from lightning.pytorch import Trainer
from lit_packing.callbacks import TokenThroughputMonitor
from lit_packing.callbacks import throughput
from lit_packing.data.collate import PackedCollator

sys.path[:0] = [{tests!r}, {root!r}]  # this file, and the repository (it imports tests.conftest)
from test_callbacks import FixedBatches, examples

LENGTHS = [(3, 5), (7,), (2, 2, 2), (9, 1), (4,), (6, 6), (8,), (5, 5, 5)]
batches = [PackedCollator()(examples(lengths)) for lengths in LENGTHS]
calls = []
original = throughput._sum_over_ranks
def counting(trainer, *args):
    calls.append(trainer.global_step)
    return original(trainer, *args)
throughput._sum_over_ranks = counting

trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=4, log_every_n_steps=2, logger=False,
                  callbacks=[TokenThroughputMonitor(window=50)], enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False)
trainer.fit(FixedBatches(batches))
if trainer.is_global_zero:
    print("REDUCES", json.dumps(calls))
    print("REAL-TOKENS", sum(sum(lengths) for lengths in LENGTHS))
"""


@pytest.mark.slow
def test_two_ranks_reduce_only_at_logging_steps_and_label_the_summary(tmp_path):
    """2 CPU ranks (gloo), 4 steps, log_every_n_steps=2: the monitor all-reduces at the 2 logging steps and once for
    the summary, never per step; the summary counts both ranks' tokens and says so."""
    script = tmp_path / "ddp_throughput.py"
    script.write_text(DDP_SCRIPT.format(tests=str(Path(__file__).parent), root=str(Path(__file__).parents[2])))
    done = launch.run([sys.executable, str(script)], cwd=tmp_path, timeout=300)
    out = done.stdout
    assert "REDUCES" in out, out[-2000:] + done.stderr[-4000:]
    reduces = json.loads(out.split("REDUCES", 1)[1].splitlines()[0])
    assert len(reduces) == 3, reduces  # steps 2 and 4 (logging), then the summary: not one per step
    real = int(out.split("REAL-TOKENS", 1)[1].split()[0])
    row = next(line for line in out.splitlines() if "real tokens (2 ranks)" in line)
    assert row.split()[-2] == f"{real:,}"  # both ranks' tokens: "│ real tokens (2 ranks) │ 110 │"
    assert "effective tokens/s per rank" in out
