"""Every objective on GPUs by composition: `--config <objective> --config gpu` (and the other order) through the real
CLI on the simulated GPU machine, as the README's commands run them (tiny model, a few steps): gpu.yaml brings the
device, bf16-mixed and the sizes, the objective's config its data, collator, loss and learning rate.

    python main.py fit --config dpo --config gpu     # also grpo, grpo_replay, qlora
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lit_packing.cli import cli_main
from lit_packing.data import ChampPairs, OnPolicyRollouts
from tests.cli.test_configs import saved_tiny
from tests.conftest import TINY
from tests.emulated.machine import SimulatedGPU

SMALL = ["--data.limit=24", "--data.max_length=2048", "--data.sampler.init_args.max_tokens=2048",
         "--trainer.val_check_interval=null", "--trainer.log_every_n_steps=1"]  # fmt: skip
BACKWARD = "flash_attn_2_cuda.varlen_bwd"


def composed_fit(tmp_path: Path, configs: list[str], *extra: str, model: list[str] | None = None):
    """One fit of `--config a --config b ...` on a simulated GPU: the CLI and the kernel calls it made."""
    model = model or [f"--model.model_config={json.dumps(TINY)}"]
    args = ["fit", *[a for c in configs for a in ("--config", c)], *model, *SMALL,
            f"--trainer.default_root_dir={tmp_path}", *extra]  # fmt: skip
    with SimulatedGPU() as gpu:
        cli = cli_main(args)
    return cli, dict(gpu.kernel_calls)


def collator(cli) -> str:
    """The class path of the fit's collator, as the composed config gives it."""
    return cli.config.fit.data.collator.class_path


def trained(cli, steps: int) -> None:
    """The fit ran `steps` optimizer steps on the GPU in bf16-mixed, with a finite loss."""
    trainer = cli.trainer
    assert trainer.global_step == steps
    assert trainer.strategy.root_device.type == "cuda"
    assert str(trainer.precision) == "bf16-mixed"
    loss = trainer.callback_metrics["train/loss"]
    assert loss.isfinite()


@pytest.mark.slow
@pytest.mark.parametrize("order", [["dpo", "gpu"], ["gpu", "dpo"]])
def test_dpo_on_the_gpu_keeps_its_pairs_collator_and_learning_rate(tmp_path, order, capsys):
    cli, kernels = composed_fit(tmp_path, order, "--trainer.max_steps=2")
    trained(cli, 2)
    assert isinstance(cli.datamodule.source, ChampPairs)  # not gpu.yaml's chats under the pair collator
    assert collator(cli) == "lit_packing.data.PairCollator"
    assert cli.model.hparams.lr == 5e-6 and cli.model.hparams.objective == "dpo"
    assert kernels[BACKWARD] == 2 * 2  # 2 layers x 2 steps: the policy's backward on the GPU kernel
    note = "note: --config dpo runs before --config gpu"
    assert (note in capsys.readouterr().err) == (order[0] == "gpu")


@pytest.mark.slow
def test_grpo_on_the_gpu_runs_one_pass_over_its_prompts_in_the_training_process(tmp_path, capsys):
    """gpu.yaml's whole epoch and 4 loader workers under on-policy rounds: rounds sampled in the training process
    (said in one line), the fit one pass over the prompts (8 prompts, 4 a round: 2 rounds, a step each)."""
    cli, kernels = composed_fit(tmp_path, ["grpo", "gpu"], "--data.limit=8")
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert "on-policy: data.num_workers=4 is not used" in text
    assert "on-policy: trainer.max_steps is not set: one pass over the 8 prompts, 2 rounds of 4" in text
    trained(cli, 2)
    assert isinstance(cli.datamodule.source, OnPolicyRollouts)
    assert collator(cli) == "lit_packing.data.GroupCollator"
    rounds = sorted((Path(cli.trainer.default_root_dir) / "rollouts").glob("round_*.jsonl"))
    assert [r.name for r in rounds] == ["round_000000.jsonl", "round_000001.jsonl"]
    assert kernels[BACKWARD] == 2 * 2


@pytest.mark.slow
def test_grpo_replay_on_the_gpu(tmp_path):
    cli, kernels = composed_fit(tmp_path, ["grpo_replay", "gpu"], "--trainer.max_steps=2")
    trained(cli, 2)
    assert collator(cli) == "lit_packing.data.GroupCollator" and cli.model.hparams.lr == 1e-6
    assert kernels[BACKWARD] == 2 * 2


@pytest.mark.slow
def test_qlora_on_the_gpu_computes_in_bf16_at_its_own_learning_rate(tmp_path):
    """qlora.yaml under gpu.yaml: the 4-bit layers dequantize to bf16 (the precision's dtype, not fp32), the
    adapters train at qlora.yaml's 2e-4 with no override."""
    import bitsandbytes as bnb
    import torch

    model = saved_tiny(tmp_path)
    cli, kernels = composed_fit(tmp_path, ["gpu", "qlora"], "--trainer.max_steps=2",
                                model=[f"--model.name_or_path={model}"])  # fmt: skip
    trained(cli, 2)
    layers = [m for m in cli.model.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and {m.compute_dtype for m in layers} == {torch.bfloat16}
    assert cli.model.hparams.lr == 2e-4 and cli.model.hparams.quantization_dtype == "bfloat16"
    assert kernels[BACKWARD] == 2 * 2


def test_the_readme_shows_each_objective_on_one_and_on_8_gpus():
    """The commands the tests above run are the README's: each objective after gpu.yaml, on one GPU and on 8."""
    from tests.test_readme import ROOT, page_commands

    shown: dict[str, set[str]] = {}
    for words in page_commands(ROOT / "README.md"):
        configs = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--config"]
        if words[:3] == ["python", "main.py", "fit"] and configs[1:] == ["gpu"]:
            devices = next((w.split("=")[1] for w in words if w.startswith("--trainer.devices=")), "1")
            shown.setdefault(configs[0], set()).add(devices)
    for objective in ("dpo", "grpo", "qlora"):
        assert shown.get(objective) == {"1", "8"}, (objective, shown)
    assert "1" in shown.get("grpo_replay", set())
