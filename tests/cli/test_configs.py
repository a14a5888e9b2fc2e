"""Every YAML under configs/ runs through the real CLI in-process (fast_dev_run, a tiny model of the same family)."""

import json
from pathlib import Path

import pytest

from lit_packing.cli import cli_main

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
TINY = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 8192, "tie_word_embeddings": True,
}  # fmt: skip


def tiny_overrides(tmp_path: Path) -> list[str]:
    """Shrink a config to seconds: tiny random model, 96 examples, CPU, CSV logs in tmp_path."""
    return [
        f"--model.model_config={json.dumps(TINY)}",
        "--data.limit=96",
        "--data.val_split=16",
        "--data.max_length=512",
        "--trainer.fast_dev_run=2",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.num_nodes=1",
        "--trainer.precision=32-true",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger={json.dumps({'class_path': 'CSVLogger', 'init_args': {'save_dir': str(tmp_path)}})}",
    ]


def test_every_config_is_found():
    names = {c.stem for c in CONFIGS}
    assert {"quickstart", "padding", "minibatch_packing", "bestfit_packing", "gpu", "multipack"} <= names
    assert {"fixed_packing_position_ids", "fixed_packing_no_position_ids"} <= names


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.stem)
def test_config_fits_with_fast_dev_run(config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = cli_main(["fit", "--config", str(config), *tiny_overrides(tmp_path)])
    assert cli.trainer.state.finished
    assert cli.trainer.global_step == 2
    assert cli.trainer.callback_metrics["train/loss"].isfinite()


def test_print_config_resolves_links_and_class_paths(capsys):
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", str(CONFIGS[0]), "--print_config"])
    printed = capsys.readouterr().out
    assert "BestFitPackingSampler" in printed or "RandomBatchSampler" in printed
    assert "attn_backend" in printed


def test_sampler_and_backend_swap_from_the_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = cli_main(
        [
            "fit", "--config", str(Path(__file__).parents[2] / "configs" / "quickstart.yaml"),
            *tiny_overrides(tmp_path),
            "--data.sampler=lit_packing.samplers.SequentialPackingSampler",
            "--data.sampler.init_args.max_tokens=700",
            "--model.attn_backend=sdpa_mask",
        ]
    )  # fmt: skip
    assert type(cli.datamodule.train_sampler).__name__ == "SequentialPackingSampler"
    assert cli.datamodule.train_sampler.max_tokens == 700
    assert cli.model.attn_backend == "sdpa_mask"


def test_validate_and_test_subcommands_agree_on_the_held_out_split(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    quickstart = str(Path(__file__).parents[2] / "configs" / "quickstart.yaml")
    common = [arg for arg in tiny_overrides(tmp_path) if not arg.startswith("--trainer.fast_dev_run")]
    common.append("--trainer.limit_val_batches=1.0")  # all held-out batches, as `test` uses
    validated = cli_main(["validate", "--config", quickstart, *common]).trainer.callback_metrics
    tested = cli_main(["test", "--config", quickstart, *common]).trainer.callback_metrics
    assert float(tested["test/loss"]) == pytest.approx(float(validated["val/loss"]), rel=1e-6)
    assert float(tested["test/perplexity"]) > 1
