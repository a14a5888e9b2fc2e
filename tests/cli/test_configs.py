"""Every packaged config, as it runs (a whole file, or a base and its delta), through the real CLI in-process
(fast_dev_run, a tiny model of the same family); config names, compositions and their errors."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

from lit_packing import commands
from lit_packing.cli import cli_main
from lit_packing.configs import DELTAS, FOLDER, composition, config_args, config_path, names
from lit_packing.preflight import launch_shape
from tests.conftest import TINY

ROOT = Path(__file__).parents[2]
COMPOSITIONS = [composition(name) for name in names()]  # [quickstart.yaml], [paper.yaml, padding.yaml], ...
# What the paper's variants may differ in (the header of paper.yaml says so); everything else is paper.yaml's.
VARIANT_KEYS = ("data.sampler", "data.collator", "data.val_sampler", "data.val_collator", "data.max_length")
# Deltas on the paper's run that change how it is distributed: the settings each may change, and what makes it one
# rank for the in-process run (the 2-rank runs are tests/models/test_sharding.py's).
SCALING = {
    "fsdp2": (("trainer.strategy",), ["--trainer.strategy.init_args.data_parallel_size=1"]),
    "context_parallel": (
        ("trainer.strategy", "data.sampler", "data.collator", "data.max_length"),
        ["--trainer.strategy.init_args.data_parallel_size=1", "--trainer.strategy.init_args.context_parallel_size=1"],
    ),
}


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


def saved_tiny(tmp_path: Path) -> Path:
    """The tiny model, random, saved as a pretrained folder with SmolLM2's tokenizer (whose vocabulary it has)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lit_packing.assets import resolve_pretrained

    folder = tmp_path / "tiny"
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False)).save_pretrained(folder)
    return folder


def saved_tiny_vlm(tmp_path: Path) -> Path:
    """A SmolVLM-shaped model around the tiny language model (`vlm_assets.build_vlm`: a 2-layer vision tower)."""
    from lit_packing.models.vlm_assets import build_vlm

    return build_vlm(saved_tiny(tmp_path), tmp_path / "tiny_vlm")


def pack_cap(files: list[Path]) -> list[str]:
    """Packs of at most 4,096 tokens where the config packs by tokens: a 32k-token pack's fp32 logits over SmolLM2's
    vocabulary take 6 GiB, and their gradients as much again, even with the tiny model; fixed-length rows one a step
    (4 rows of 4,096 tokens took the step 3x the others' time, and 2 steps of them nearly every example)."""
    samplers = [((yaml.safe_load(f.read_text()).get("data") or {}).get("sampler") or {}).get("init_args") or {}
                for f in files]  # fmt: skip
    capped = ["--data.sampler.init_args.max_tokens=4096"] if any("max_tokens" in s for s in samplers) else []
    one_row = ["--data.sampler.init_args.rows_per_step=1"] if any("rows_per_step" in s for s in samplers) else []
    return capped + one_row


def resolved(args: list[str], capsys) -> dict:
    """The fully resolved config (`fit ... --print_config`), without the list of config files."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None), capsys.readouterr().err
    config = yaml.safe_load(capsys.readouterr().out)
    config.pop("config", None)
    return config


def leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    """`{"data.sampler.init_args.batch_size": 8, ...}`: every leaf of a nested config by its dotted path."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    return {k: v for key, value in tree.items() for k, v in leaves(value, f"{prefix}.{key}" if prefix else key).items()}


def error_line(args: list[str], capsys) -> str:
    """The one line a toolkit error prints before the CLI exits with status 2."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(args)
    assert exit_info.value.code == 2
    out = capsys.readouterr().out.strip().splitlines()  # every toolkit line on stdout, the error last, alone
    errors = [line for line in out if line.startswith("error:")]
    assert errors == [out[-1]], out[-5:]
    return out[-1]


def test_every_config_is_found():
    found = set(names())
    assert {"quickstart", "gpu", "paper", "padding", "minibatch_packing", "bestfit_packing", "multipack"} <= found
    assert {"fixed_packing_position_ids", "fixed_packing_no_position_ids", "multinode"} <= found
    assert set(DELTAS) | set(DELTAS.values()) <= found
    assert (ROOT / "configs").resolve() == FOLDER.resolve()  # the repository's configs/ is the packaged folder


# The quickstart's run is in `make test`; the other configs' runs (5-15 s each on 2 cores) are `slow`, run by CI.
CONFIG_RUNS = [
    pytest.param(files, marks=() if [f.stem for f in files] == ["quickstart"] else pytest.mark.slow)
    for files in COMPOSITIONS
]


@pytest.mark.parametrize("files", CONFIG_RUNS, ids=lambda files: "+".join(f.stem for f in files))
def test_config_fits_with_fast_dev_run(files, tmp_path, monkeypatch, every_core):
    monkeypatch.chdir(tmp_path)
    configs = [arg for f in files for arg in ("--config", str(f))]
    one_rank = SCALING[files[-1].stem][1] if files[-1].stem in SCALING else []
    overrides = tiny_overrides(tmp_path)
    if files[-1].stem == "dpo":  # a pair is never cut: at 512 tokens too few CHAMP pairs are left for two steps
        overrides.remove("--data.max_length=512")
    if files[-1].stem == "qlora":  # weights quantize as a saved model loads: the tiny model, saved
        overrides = [arg for arg in overrides if not arg.startswith("--model.model_config")]
        overrides += [f"--model.name_or_path={saved_tiny(tmp_path)}", f"--model.export_dir={tmp_path / 'export'}"]
    if files[-1].stem == "vlm":  # image chats: the tiny model as a VLM's language model, 120 questions
        overrides = [arg for arg in overrides if not arg.startswith("--model.model_config")]
        folder = saved_tiny_vlm(tmp_path)
        overrides += [f"--model.name_or_path={folder}"]  # the tokenizer (and its processor) follow the model
        overrides += ["--data.source.init_args.limit=64", f"--model.export_dir={tmp_path / 'export'}"]
    cli = cli_main(["fit", *configs, *overrides, *pack_cap(files), *one_rank])
    assert cli.trainer.state.finished
    if files[-1].stem == "vlm":  # exported with its processor: the folder loads as the VLM and processor it was
        from transformers import AutoModelForImageTextToText, AutoProcessor

        assert AutoProcessor.from_pretrained(tmp_path / "export").image_processor is not None
        assert AutoModelForImageTextToText.from_pretrained(tmp_path / "export").config.model_type == "idefics3"
    assert cli.trainer.global_step == 2
    assert cli.trainer.callback_metrics["train/loss"].isfinite()


def test_print_config_resolves_links_and_class_paths(capsys):
    with pytest.raises(SystemExit):
        cli_main(["fit", *config_args("bestfit_packing"), "--print_config"])
    printed = capsys.readouterr().out
    assert "BestFitPackingSampler" in printed
    assert "attn_backend" in printed


def test_paper_variants_differ_only_in_their_sampler_collator_and_length(capsys):
    paper = leaves(resolved(["--config", "paper"], capsys))
    for delta in (name for name, base in DELTAS.items() if base == "paper"):
        variant = leaves(resolved(["--config", "paper", "--config", delta], capsys))
        changed = {key for key in paper.keys() | variant.keys() if paper.get(key) != variant.get(key)}
        assert changed, delta
        allowed = SCALING[delta][0] if delta in SCALING else VARIANT_KEYS
        assert all(key.startswith(allowed) for key in changed), (delta, sorted(changed))


def test_the_scaling_deltas_keep_the_gpu_bases_packs_and_take_every_rank(capsys):
    """On gpu.yaml, context parallel keeps its 32,768-token packs, and FSDP2 shards over however many GPUs run."""
    gpu = resolved(["--config", "gpu"], capsys)
    split = resolved(["--config", "gpu", "--config", "context_parallel"], capsys)
    assert split["data"]["sampler"] == gpu["data"]["sampler"] and split["data"]["max_length"] == 4096
    assert split["data"]["sampler"]["init_args"]["max_tokens"] == 32768
    sharded = resolved(["--config", "gpu", "--config", "fsdp2"], capsys)
    assert sharded["trainer"]["strategy"]["init_args"]["data_parallel_size"] == "auto"


@pytest.mark.parametrize("objective", ["dpo", "grpo", "grpo_replay", "qlora"])
def test_gpu_goes_on_top_of_an_objective_in_either_order(objective, capsys):
    """`--config <objective> --config gpu` and `--config gpu --config <objective>` resolve alike: gpu.yaml's device,
    precision and sizes over the objective's data, collator, loss and learning rate (gpu.yaml's chats never under a
    pair or group collator, its learning rate never over the objective's)."""
    alone = resolved(["--config", objective], capsys)
    on_top = resolved(["--config", objective, "--config", "gpu"], capsys)
    swapped = resolved(["--config", "gpu", "--config", objective], capsys)
    assert swapped == on_top
    trainer = on_top["trainer"]
    assert (trainer["accelerator"], trainer["precision"], trainer["max_steps"]) == ("gpu", "bf16-mixed", -1)
    assert on_top["data"]["limit"] is None and on_top["data"]["sampler"]["init_args"]["max_tokens"] == 32768
    for key in ("source", "collator", "overlong"):
        assert on_top["data"][key] == alone["data"][key], key
    for key in ("lr", "objective", "reference", "lora", "quantization", "scheduler"):
        assert on_top["model"][key] == alone["model"][key], key


def test_an_objective_after_gpu_moves_before_it_with_the_deltas_on_gpu_kept_after():
    from lit_packing.configs import resolve_config_args

    args = ["fit", "--config", "gpu", "--config=multinode", "--model.lr=1e-4", "-c", "dpo", "--trainer.devices=2"]
    names = [Path(a.removeprefix("--config=")).stem if a.endswith(".yaml") else a for a in resolve_config_args(args)]
    assert names == ["fit", "-c", "dpo", "--config", "gpu", "multinode", "--model.lr=1e-4",
                     "--trainer.devices=2"]  # fmt: skip
    untouched = ["fit", "--config", "dpo", "--config", "gpu"]
    assert [Path(a).stem if a.endswith(".yaml") else a for a in resolve_config_args(untouched)] == untouched


@pytest.mark.parametrize("trainer, environ, shape", [
    ({"devices": "auto"}, {"SLURM_NTASKS": "16", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "8"},
     {"devices": 8, "num_nodes": 2}),
    ({"devices": 4, "num_nodes": 1}, {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"},
     {"num_nodes": 2}),
    ({"devices": "auto", "num_nodes": 3}, {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"},
     {"devices": 4}),
    ({"devices": "auto"}, {"SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "4",
                           "SLURM_JOB_NAME": "bash"}, {}),  # an interactive allocation: its shell is no launcher
    ({"devices": "auto"}, {}, {}),
])  # fmt: skip
def test_a_launchers_shape_fills_the_settings_left_open(trainer, environ, shape):
    """multinode.yaml leaves devices to the launcher: srun's and torchrun's shape fills what a config leaves open
    (`devices: auto`, `num_nodes` unset or 1) and nothing a user set."""
    assert launch_shape(trainer, environ) == shape


def test_a_name_resolves_to_the_packaged_config(capsys):
    by_path = resolved(["--config", str(ROOT / "configs" / "quickstart.yaml")], capsys)
    assert resolved(["--config", "quickstart"], capsys) == by_path
    assert resolved(["--config=quickstart.yaml"], capsys) == by_path
    assert resolved(["-c", "quickstart"], capsys) == by_path
    assert config_path("quickstart") == FOLDER / "quickstart.yaml"
    composed = resolved(["--config", "paper", "--config", "padding"], capsys)
    assert composed == resolved(["--config", str(ROOT / "configs" / "paper.yaml"), "--config=padding"], capsys)
    assert composed["data"]["collator"]["class_path"] == "lit_packing.data.PaddedCollator"


def test_the_subcommands_are_the_ones_that_do_something(capsys):
    """fit, validate and test; no `predict` (packed rows have no prediction of their own to write)."""
    err = error_line(["predict", "--config", "quickstart"], capsys)
    assert "invalid choice: 'predict' (choose from 'fit', 'validate', 'test')" in err


def test_a_name_beside_a_folder_of_that_name_is_still_the_packaged_config(tmp_path, monkeypatch, capsys):
    """A run folder named after its config (`default_root_dir: .` writes `./quickstart/version_0`) is no config."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "quickstart" / "version_0").mkdir(parents=True)
    assert resolved(["--config", "quickstart"], capsys)["data"]["limit"] == 600


def test_an_unknown_name_lists_the_packaged_ones(capsys):
    err = error_line(["fit", "--config", "quickstrat"], capsys)
    assert "'quickstrat' is neither a file nor a packaged config" in err
    assert all(name in err for name in names())


@pytest.mark.parametrize("given", ["padding", str(ROOT / "configs" / "multinode.yaml")], ids=["name", "path"])
def test_a_delta_alone_names_its_base(given, capsys):
    delta = Path(given).stem
    err = error_line(["fit", "--config", given], capsys)
    assert f"use --config {DELTAS[delta]} --config {delta}" in err


def test_the_command_line_is_rewritten_in_place(monkeypatch, capsys):
    """main.py and `lit-packing` pass no `args`: the names are resolved in `sys.argv` itself, so that LightningCLI
    reads one command line (given `args` and `sys.argv` both, it warns)."""
    monkeypatch.setattr(sys, "argv", ["main.py", "fit", "--config", "quickstart", "--print_config"])
    with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit):
        warnings.simplefilter("always")
        cli_main()
    assert sys.argv[3] == str(config_path("quickstart"))
    assert "BestFitPackingSampler" in capsys.readouterr().out
    assert not [w for w in caught if "args parameter" in str(w.message)]


@pytest.mark.filterwarnings("ignore:It is recommended to use")  # sync_dist advice: this group is one rank
def test_a_command_that_finished_leaves_its_process_group_and_one_that_failed_keeps_it(tmp_path, monkeypatch):
    """Each rank runs the command (`main.py`, `lit-packing`); when it returns the rank's process group is destroyed
    (left to the interpreter's exit, gloo's threads can abort a rank whose work is done). After a failure it is
    kept: a rank that destroys its group while another still waits in a collective can hang both."""
    monkeypatch.chdir(tmp_path)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    monkeypatch.setattr(sys, "argv", ["main.py", "fit", "--config", "quickstart", "--trainer.max_steps=many"])
    with pytest.raises(SystemExit):
        commands.main()
    assert dist.is_initialized()
    tiny = [*tiny_overrides(tmp_path), "--trainer.fast_dev_run=1"]
    monkeypatch.setattr(sys, "argv", ["main.py", "fit", "--config", "quickstart", *tiny])
    commands.main()
    assert not dist.is_initialized()  # (the autouse fixture closes a group a failed test leaves)


def test_the_command_line_imports_with_the_collector_paused_then_frozen():
    """In a new interpreter (the imports must really run): the training CLI's imports run with the cyclic garbage
    collector paused (its one collection is the one after them), their objects are then frozen out of it (a
    command's collections and the loader workers it forks never walk them), and it runs again."""
    code = (
        "import gc; from lit_packing import commands; seen = []\n"
        "gc.callbacks.append(lambda phase, info: seen.append(phase))\n"
        "commands.import_cli(); print(seen, gc.isenabled(), gc.get_freeze_count() > 100_000)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.stdout.splitlines()[-1] == "['start', 'stop'] True True", done.stdout + done.stderr


def test_sampler_and_backend_swap_from_the_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = cli_main(
        [
            "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"),
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
    common = [arg for arg in tiny_overrides(tmp_path) if not arg.startswith("--trainer.fast_dev_run")]
    common.append("--trainer.limit_val_batches=1.0")  # all held-out batches, as `test` uses
    validated = cli_main(["validate", "--config", "quickstart", *common]).trainer.callback_metrics
    tested = cli_main(["test", "--config", "quickstart", *common]).trainer.callback_metrics
    assert float(tested["test/loss"]) == pytest.approx(float(validated["val/loss"]), rel=1e-6)
    assert float(tested["test/perplexity"]) > 1


@pytest.mark.slow
def test_vlm_trains_lora_on_its_language_model_and_exports_it_merged(tmp_path, monkeypatch, every_core):
    """LoRA on a vision-language model's language model only (peft's regex over module names): the vision tower and
    connector stay frozen, and the merged export loads as the plain VLM."""
    from transformers import AutoModelForImageTextToText

    monkeypatch.chdir(tmp_path)
    folder = saved_tiny_vlm(tmp_path)
    overrides = [arg for arg in tiny_overrides(tmp_path) if not arg.startswith("--model.model_config")]
    lora = "{r: 8, lora_alpha: 16, target_modules: '.*text_model.*_proj'}"
    overrides += [f"--model.name_or_path={folder}", "--data.source.init_args.limit=60", f"--model.lora={lora}"]
    cli = cli_main(["fit", "--config", str(config_path("vlm")), *overrides, f"--model.export_dir={tmp_path / 'out'}"])
    trainable = [name for name, p in cli.model.model.named_parameters() if p.requires_grad]
    assert trainable and all("text_model" in name and "lora_" in name for name in trainable)
    assert cli.trainer.global_step == 2 and cli.trainer.callback_metrics["train/loss"].isfinite()
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "out")
    assert not any("lora" in name for name, _ in merged.named_parameters())


@pytest.mark.slow
def test_vlm_trains_on_2_fsdp2_ranks_whatever_images_each_ranks_packs_hold(tmp_path):
    """FSDP2 over 2 gloo ranks: the language model's layers sharded, the vision tower with the root, so ranks whose
    packs hold other numbers of images run the same collectives (sharding the tower's blocks broke the second step
    with gloo's size mismatch; NCCL would hang)."""
    folder = saved_tiny_vlm(tmp_path)
    args = ["fit", "--config", str(config_path("vlm")), "--config", "fsdp2", "--trainer.devices=2",
            "--trainer.strategy.init_args.data_parallel_size=2", "--trainer.max_steps=3", "--trainer.logger=false",
            f"--model.name_or_path={folder}", "--data.source.init_args.limit=60",
            "--data.sampler.init_args.max_tokens=512", f"--trainer.default_root_dir={tmp_path}"]  # fmt: skip
    done = subprocess.run([sys.executable, str(ROOT / "main.py"), *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "LlamaDecoderLayer layers and the root sharded over 2" in done.stdout + done.stderr
    assert "step 3/3" in done.stdout + done.stderr
