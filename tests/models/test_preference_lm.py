"""`PackedCausalLM` with a preference objective, through a real Lightning `Trainer`: the first step's loss is ln 2
with the frozen copy as reference, the step's gradient does not depend on how its pairs are split into
micro-batches, the reference modes agree, and bad settings are refused in one line."""

from __future__ import annotations

import math

import pytest
import torch

from lit_packing.data.collate import PairCollator
from lit_packing.errors import ConfigError
from lit_packing.models.causal_lm import PackedCausalLM
from lit_packing.models.preference import pair_logps
from tests.helpers import TINY_LLAMA
from tests.models.test_causal_lm import assert_grads_close, run_one_step
from tests.models.test_preference import make_pairs

SHAPES = [(5, 4, 7), (3, 6, 2), (8, 3, 3), (2, 9, 5), (4, 4, 6), (6, 2, 8)]


def make_lm(**kwargs) -> PackedCausalLM:
    torch.manual_seed(0)
    kwargs.setdefault("lr", 0.0)
    return PackedCausalLM(model_config=dict(TINY_LLAMA, vocab_size=1000), memory_check=False, **kwargs)


def test_dpo_starts_at_ln_2_with_zero_rewards():
    lm = make_lm(objective="dpo", beta=0.1)
    _, metrics = run_one_step(lm, [PairCollator()(make_pairs(SHAPES))], 1)
    assert float(metrics["train/loss"]) == pytest.approx(math.log(2), abs=1e-9)
    assert float(metrics["train/rewards_chosen"]) == 0 and float(metrics["train/reward_margin"]) == 0


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_the_step_gradient_does_not_depend_on_how_pairs_are_split(objective):
    """6 pairs as 1 micro-batch, or 3 of 2 pairs: the same gradient (the loss is the mean over the step's pairs)."""
    pairs = make_pairs(SHAPES)
    collate = PairCollator()
    one, _ = run_one_step(make_lm(objective=objective, lr=1e-3), [collate(pairs)], 1)
    three, _ = run_one_step(make_lm(objective=objective, lr=1e-3), [collate(pairs[i : i + 2]) for i in (0, 2, 4)], 3)
    assert_grads_close(three, one)


def test_the_lora_reference_is_the_frozen_copy_at_the_start():
    """reference=lora (the adapter disabled) and reference=copy give the same reference log-probs."""
    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    batch = PairCollator()(make_pairs(SHAPES))
    with torch.no_grad():
        copied = make_lm(objective="dpo", lora=lora, reference="copy")
        from lit_packing.models.head import head_inputs

        via_copy = pair_logps(head_inputs(copied._reference[0], batch), batch)
        adapted = make_lm(objective="dpo", lora=lora, reference="lora")
        with adapted.model.disable_adapter():
            via_lora = pair_logps(adapted.head_inputs(batch), batch)
    for a, b in zip(vars(via_copy).values(), vars(via_lora).values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)


def test_reference_free_objectives_keep_no_copy():
    assert make_lm(objective="simpo")._reference == [] and make_lm(objective="orpo")._reference == []
    assert len(make_lm(objective="dpo")._reference) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"objective": "dpo", "reference": "lora"}, "model.reference: lora takes the reference from the model"),
        ({"objective": "dpo", "beta": 0.0}, "model.beta: must be > 0"),
        ({"objective": "ipo", "reference": "disk"}, "model.reference: 'disk' is not a reference"),
    ],
)
def test_bad_preference_settings_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ConfigError) as raised:
        make_lm(**kwargs)
    assert str(raised.value).startswith(message), str(raised.value)


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["ipo", "simpo", "orpo"])
def test_the_dpo_config_fits_with_each_objective(objective, tmp_path, monkeypatch):
    """configs/dpo.yaml through the CLI with the other objectives (dpo itself: the configs test), tiny model."""
    from lit_packing.cli import cli_main
    from tests.cli.test_configs import tiny_overrides

    monkeypatch.chdir(tmp_path)
    overrides = [arg for arg in tiny_overrides(tmp_path) if arg != "--data.max_length=512"]
    args = ["fit", "--config", "dpo", *overrides, f"--model.objective={objective}", "--data.limit=48"]
    cli = cli_main([*args, "--data.sampler.init_args.max_tokens=4096"])
    assert cli.trainer.global_step == 2
    metrics = cli.trainer.callback_metrics
    assert metrics["train/loss"].isfinite() and "train/reward_accuracy" in metrics
    if objective == "orpo":
        assert {"train/nll", "train/odds_ratio"} <= set(metrics)
