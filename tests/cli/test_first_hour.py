"""What a new user sees and gets on disk: piped progress lines, each run in a folder of its own with one bounded
checkpoint, no W&B folder for a run that never trained, the config as nested keys in the run's folder, validation
at the end of a `max_steps` run."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Trainer

from lit_packing.callbacks.progress import ProgressLog, StepProgressBar, progress_callback
from lit_packing.cli import cli_main
from tests.conftest import TINY

QUICKSTART = str(Path(__file__).parents[2] / "configs" / "quickstart.yaml")
SMALL = [f"--model.model_config={json.dumps(TINY)}", "--data.limit=64", "--data.max_length=512"]


def fit(*extra: str):
    return cli_main(["fit", "--config", QUICKSTART, *SMALL, *extra])


def test_quickstart_run_prints_steps_validates_at_the_end_and_keeps_one_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    saves, save = [], Trainer.save_checkpoint

    def recording_save(trainer, path, *args, **kwargs):
        saves.append((path, trainer.global_step))
        return save(trainer, path, *args, **kwargs)

    monkeypatch.setattr(Trainer, "save_checkpoint", recording_save)
    cli = fit("--trainer.max_steps=4")  # the quickstart's val_check_interval 0.5: steps 2 and 4
    out = capsys.readouterr().out
    assert isinstance(cli.trainer.progress_bar_callback, ProgressLog)  # pytest's stdout is not a terminal
    steps = [line.split()[1] for line in out.splitlines() if line.startswith("step ")]
    assert steps == ["1/4", "2/4", "3/4", "4/4"]
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("validation")] == [
        "validation at step 2",
        "validation at step 4",
    ]
    last = next(line for line in out.splitlines() if line.startswith("step 4/4"))
    assert "train/loss" in last and "tok/s" in last and "eta 0:00:00" in last
    assert "\x1b[" not in out  # no colour codes in piped output
    monitor = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "TokenThroughputMonitor")
    tok_s = float(last.split("tok/s ")[1].split()[0].replace(",", ""))
    assert tok_s == pytest.approx(monitor.totals["real_tokens"] / monitor.train_seconds, rel=1e-3)

    run_dir = tmp_path / "runs" / "quickstart" / "version_0"  # the run's folder: config, metrics, checkpoints
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["last.ckpt"]
    saved = "runs/quickstart/version_0/checkpoints/last.ckpt"
    assert saves == [(saved, 2), (saved, 4)]  # resumable mid-run
    assert "run folder: runs/quickstart/version_0 (run 'quickstart')" in out
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["trainer"]["max_steps"] == 4
    hparams = yaml.full_load((run_dir / "hparams.yaml").read_text())  # the model hparams hold a tuple
    assert hparams["data"]["val_split"] == 0.02  # nested keys, not one JSON string
    assert len(list((tmp_path / "runs" / "wandb").glob("offline-run-*"))) == 1

    first = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    fit("--trainer.max_steps=2")  # a second experiment from the same checkout: a folder of its own
    second = tmp_path / "runs" / "quickstart" / "version_1"
    assert (second / "config.yaml").exists() and (second / "metrics.csv").exists()
    assert torch.load(second / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    kept = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)  # the first run's, untouched
    assert kept["global_step"] == 4
    assert all(torch.equal(kept["state_dict"][key], tensor) for key, tensor in first["state_dict"].items())
    validated = cli_main(["validate", "--config", QUICKSTART, *SMALL, "--ckpt_path=last"])  # the run's newest
    assert validated.config.validate.ckpt_path == "runs/quickstart/version_1/checkpoints/last.ckpt"
    named = fit("--trainer.max_steps=1", "--run_name=lr-sweep.1")
    assert Path(named.trainer.default_root_dir) == Path("runs/lr-sweep.1/version_0")


def test_a_single_file_checkpoint_exports_to_a_folder_that_plain_transformers_loads(tmp_path, monkeypatch):
    """`lit-packing export` on a one-device run's `last.ckpt`: the trained weights, the config and the tokenizer
    the data used, in a folder `from_pretrained` loads and generates from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_packing.commands import main

    monkeypatch.chdir(tmp_path)
    cli = fit("--trainer.max_steps=1", "--trainer.logger=false")
    saved = Path(cli.trainer.default_root_dir) / "checkpoints" / "last.ckpt"
    monkeypatch.setattr(sys, "argv", ["lit-packing", "export", "--ckpt_path", str(saved), "--output", "out"])
    main()
    model, tokenizer = AutoModelForCausalLM.from_pretrained("out"), AutoTokenizer.from_pretrained("out")
    trained = torch.load(saved, weights_only=True)["state_dict"]
    loaded = model.state_dict()
    assert {f"model.{key}" for key in loaded} <= trained.keys() | {"model.lm_head.weight"}  # the head tied
    assert all(torch.equal(loaded[key.removeprefix("model.")], tensor) for key, tensor in trained.items())
    prompt = tokenizer("2 + 2 =", return_tensors="pt")
    assert model.generate(**prompt, max_new_tokens=3, do_sample=False).shape[1] == prompt["input_ids"].shape[1] + 3


def test_a_lora_checkpoint_exports_merged_as_the_run_itself_exports_it(tmp_path, monkeypatch):
    """`lit-packing export` on a LoRA run's `last.ckpt` (its adapters alone) rebuilds the base from the run's settings
    and writes the merged model: the same tensors as the run's own `model.export_dir`; `--adapters_only`: peft's."""
    from safetensors.torch import load_file

    from lit_packing.commands import main
    from tests.cli.test_configs import saved_tiny

    monkeypatch.chdir(tmp_path)
    lora = json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    cli = cli_main(["fit", "--config", QUICKSTART, f"--model.name_or_path={saved_tiny(tmp_path)}", *SMALL[1:],
                    f"--model.lora={lora}", "--model.lr=1e-2", "--model.export_dir=in_run", "--trainer.max_steps=2",
                    "--trainer.logger=false"])  # fmt: skip
    saved = Path(cli.trainer.default_root_dir) / "checkpoints" / "last.ckpt"
    for out, extra in (("merged", []), ("adapters", ["--adapters_only"])):
        monkeypatch.setattr(sys, "argv", ["lit-packing", "export", "--ckpt_path", str(saved), "--output", out, *extra])
        main()
    run, converted = load_file("in_run/model.safetensors"), load_file("merged/model.safetensors")
    assert run.keys() == converted.keys() and all(torch.equal(converted[key], run[key]) for key in run)
    assert not any("lora" in key for key in run) and Path("adapters/adapter_config.json").exists()


def exits_with(capsys, pattern: str, *args: str) -> None:
    """The CLI prints a toolkit error alone, in one line, and exits with status 2."""
    with pytest.raises(SystemExit) as exit_:
        fit(*args)
    assert exit_.value.code == 2
    err = capsys.readouterr().out.strip().splitlines()
    assert re.match(f"error: {pattern}", err[-1]) and "Traceback" not in "\n".join(err), err[-3:]


def test_a_run_that_fails_before_training_leaves_no_wandb_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exits_with(capsys, r"data\.val_split: 64 examples leave no training data out of 64", "--data.val_split=64")
    assert not (tmp_path / "runs" / "wandb").exists()
    assert not [path for path in (tmp_path / "runs").rglob("*") if path.is_file()]  # no config, no checkpoint


def test_an_explicit_interval_longer_than_the_epoch_names_the_settings(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    pattern = r"trainer\.val_check_interval: 500 batches .* fraction .*data\.val_split"
    exits_with(capsys, pattern, "--trainer.val_check_interval=500", "--trainer.logger=false")


def test_lora_checkpoint_holds_only_the_adapters_and_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lora = json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    logger = "--trainer.logger=false"
    cli = fit(f"--model.lora={lora}", "--trainer.max_steps=2", logger)
    checkpoint = torch.load(tmp_path / "runs/quickstart/version_0/checkpoints/last.ckpt", weights_only=True)
    trainable = {name for name, p in cli.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    assert set(checkpoint["state_dict"]) == trainable  # no frozen base weights (this model has no buffers saved)
    # Lightning counts an epoch that max_steps ended as finished: a second epoch continues from step 2.
    more = ["--trainer.max_steps=3", "--trainer.max_epochs=2", "--ckpt_path=last"]
    resumed = fit(f"--model.lora={lora}", logger, *more)  # loads without the frozen weights (strict_loading off)
    assert resumed.trainer.global_step == 3


def test_the_progress_bar_counts_the_steps_the_run_will_take(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    class Terminal:
        def isatty(self):
            return True

    assert isinstance(progress_callback(Terminal()), StepProgressBar)
    totals = []

    class Recording(StepProgressBar):
        def on_train_epoch_start(self, trainer, *args):
            super().on_train_epoch_start(trainer, *args)
            totals.append((self.train_progress_bar.total, trainer.num_training_batches))

    monkeypatch.setattr("lit_packing.cli.progress_callback", lambda: Recording())
    fit("--trainer.max_steps=3", "--trainer.logger=false", "--trainer.enable_checkpointing=false")
    (bar_total, epoch_batches) = totals[0]
    assert bar_total == 3 and epoch_batches > 3
