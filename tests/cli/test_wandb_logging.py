"""A short real fit with the W&B logger offline; the run file is read back and its metrics checked exactly."""

import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import wandb
from wandb.proto import wandb_internal_pb2

from lit_packing.callbacks import throughput as throughput_module
from lit_packing.cli import cli_main

CONFIGS = Path(__file__).parents[2] / "configs"
TINY = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 8192,
}  # fmt: skip
STEP_SECONDS = 0.25


def wandb_records(path: Path):
    """Records of a `.wandb` run file: a 7-byte header, then LevelDB-log blocks of 32 KiB holding protobufs."""
    data, block, pos, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or (length == 0 and kind == 0):  # block trailer / zero padding
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def history(run_file: Path) -> list[dict]:
    rows = []
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def test_wandb_offline_run_logs_padding_ratio_and_effective_tokens_per_sec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    ticks = itertools.count()
    # The monitor's clock only: W&B's own waits (the offline run's flush at `finish`) keep the real one.
    monkeypatch.setattr(throughput_module, "time", SimpleNamespace(perf_counter=lambda: next(ticks) * STEP_SECONDS))
    logger = {"class_path": "WandbLogger", "init_args": {"project": "t", "save_dir": str(tmp_path), "offline": True}}
    cli = cli_main(
        [
            "fit", "--config", str(CONFIGS / "paper.yaml"), "--config", str(CONFIGS / "padding.yaml"),
            f"--model.model_config={json.dumps(TINY)}",
            "--data.limit=48", "--data.val_split=0", "--data.max_length=2048", "--data.sampler.init_args.batch_size=4",
            "--trainer.max_steps=3", "--trainer.limit_val_batches=0", "--trainer.accelerator=cpu",
            "--trainer.log_every_n_steps=1", f"--trainer.logger={json.dumps(logger)}",
            "--throughput_monitor.window=50",
        ]
    )  # fmt: skip
    # The expected values, from the sampler's plan for epoch 0: padded batches of 4.
    dataset, plan = cli.datamodule.train_dataset, cli.datamodule.train_sampler.plan(0)
    expected_ratio, real_so_far, expected_rate = [], 0, []
    for step, pack in enumerate(plan.packs()[:3], start=1):
        lengths = [int(dataset.lengths[i]) for i in pack]
        expected_ratio.append(1 - sum(lengths) / (len(lengths) * max(lengths)))
        real_so_far += sum(lengths)
        expected_rate.append(real_so_far / (step * STEP_SECONDS))

    # The run file is written by W&B's own process (wandb-core), which flushes and closes it after `finish`
    # returns, when the service ends the run's stream: under load a read right after `finish` saw it cut short (no
    # `exit` record, the last step's history missing). `teardown` waits for that process, as the end of ours does.
    wandb.finish()
    wandb.teardown()
    run_file = next(tmp_path.rglob("run-*.wandb"))
    rows = [row for row in history(run_file) if "train/padding_ratio" in row]
    assert [row["train/padding_ratio"] for row in rows] == pytest.approx(expected_ratio)
    assert [row["train/effective_tokens_per_sec"] for row in rows] == pytest.approx(expected_rate)
    assert max(expected_ratio) > 0  # padding is really there to be measured
    config_records = [r for r in wandb_records(run_file) if r.WhichOneof("record_type") == "config"]
    assert any("RandomBatchSampler" in item.value_json for r in config_records for item in r.config.update)
