"""`PackedCausalLM` with a preference objective, through a real Lightning `Trainer`: the first step's loss is ln 2
with the policy as its own reference, the step's gradient does not depend on how its pairs are split into
micro-batches, the reference modes (precomputed, copy, lora) agree, the precomputed table is cached, missed when the
model or the data changes, and kept through a resume, and bad settings are refused in one line."""

from __future__ import annotations

import functools
import json
import logging
import math
import pathlib
import random
import sys

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from lit_packing.batch import ROWS
from lit_packing.data import HFDataset, PackingDataModule
from lit_packing.data.collate import PairCollator
from lit_packing.errors import ConfigError, DataError
from lit_packing.models import reference as reference_module
from lit_packing.models.causal_lm import PackedCausalLM
from lit_packing.models.head import head_inputs
from lit_packing.models.preference import PairLogps, pair_logps
from lit_packing.models.reference import CHECKPOINT_KEY, ReferenceTable
from lit_packing.samplers import BestFitPackingSampler
from tests.helpers import TINY_LLAMA, launch
from tests.models.test_causal_lm import assert_grads_close, run_one_step
from tests.models.test_preference import make_pairs

SHAPES = [(5, 4, 7), (3, 6, 2), (8, 3, 3), (2, 9, 5), (4, 4, 6), (6, 2, 8)]
LORA = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
WORDS = ["the", "a", "cat", "dog", "runs", "sits", "on", "mat", "quickly", "slowly", "red", "blue", "green", "sun"]


def make_lm(vocab_size=1000, seed=0, **kwargs) -> PackedCausalLM:
    torch.manual_seed(seed)
    kwargs.setdefault("lr", 0.0)
    return PackedCausalLM(model_config=dict(TINY_LLAMA, vocab_size=vocab_size), memory_check=False, **kwargs)


def pair_lm(**kwargs) -> PackedCausalLM:
    """The tiny model with SmolLM2's vocabulary, for the tokenized pairs of `pair_data`."""
    return make_lm(vocab_size=TINY_LLAMA["vocab_size"], **kwargs)


def pair_data(tmp_path, seed=0, **kwargs) -> PackingDataModule:
    """16 short pairs of a JSON Lines file (`seed` chooses its words), 4 held out, cached under tmp_path."""
    path = tmp_path / f"pairs-{seed}.jsonl"
    if not path.exists():
        rng = random.Random(seed)
        text = lambda most: " ".join(rng.choices(WORDS, k=rng.randint(2, most)))  # noqa: E731
        rows = [{"prompt": text(9), "chosen": text(12), "rejected": text(12)} for _ in range(16)]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return PackingDataModule(
        source=HFDataset(str(path), split="train"), max_length=512, overlong="drop", val_split=4,
        collator=PairCollator, sampler=functools.partial(BestFitPackingSampler, max_tokens=256),
        cache_dir=str(tmp_path / "cache"), **kwargs,
    )  # fmt: skip


class Losses(Callback):
    """Each optimizer step's `train/loss` (one micro-batch a step)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def fit(lm, data, max_steps=2, val=False, precision="64-true", callbacks=(), ckpt_path=None) -> Trainer:
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, precision=precision,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=None if val else 0, val_check_interval=1 if val else None, callbacks=list(callbacks),
    )  # fmt: skip
    trainer.fit(lm, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def reference_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("reference log-probs")]


def refuse_a_pass(*args):
    raise AssertionError("a reference pass ran")


def test_dpo_starts_at_ln_2_with_zero_rewards():
    lm = make_lm(objective="dpo", beta=0.1, reference="copy")
    _, metrics = run_one_step(lm, [PairCollator()(make_pairs(SHAPES))], 1)
    assert float(metrics["train/loss"]) == pytest.approx(math.log(2), abs=1e-9)
    assert float(metrics["train/rewards_chosen"]) == 0 and float(metrics["train/reward_margin"]) == 0


def test_precomputed_dpo_starts_at_ln_2_in_training_and_validation(tmp_path):
    """The default reference: the table of the initial model, packed apart from the training rows (fp64: equal to
    1e-9, packing changes only the summation order)."""
    metrics = fit(pair_lm(objective="dpo", beta=0.1), pair_data(tmp_path), max_steps=1, val=True).callback_metrics
    assert float(metrics["train/loss"]) == pytest.approx(math.log(2), abs=1e-9)
    assert float(metrics["val/loss"]) == pytest.approx(math.log(2), abs=1e-7)  # torchmetrics sums in float32
    assert float(metrics["train/reward_margin"]) == pytest.approx(0, abs=1e-9)


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_the_step_gradient_does_not_depend_on_how_pairs_are_split(objective):
    """6 pairs as 1 micro-batch, or 3 of 2 pairs: the same gradient (the loss is the mean over the step's pairs)."""
    pairs = make_pairs(SHAPES)
    collate = PairCollator()
    lm = functools.partial(make_lm, objective=objective, lr=1e-3, reference="copy")
    one, _ = run_one_step(lm(), [collate(pairs)], 1)
    three, _ = run_one_step(lm(), [collate(pairs[i : i + 2]) for i in (0, 2, 4)], 3)
    assert_grads_close(three, one)


def test_the_lora_reference_is_the_frozen_copy_at_the_start():
    """reference=lora (the adapter disabled) and reference=copy give the same reference log-probs."""
    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    batch = PairCollator()(make_pairs(SHAPES))
    with torch.no_grad():
        copied = make_lm(objective="dpo", lora=lora, reference="copy")
        from lit_packing.models.head import head_inputs

        via_copy = pair_logps(head_inputs(copied.frozen_copies[0], batch), batch)
        adapted = make_lm(objective="dpo", lora=lora, reference="lora")
        with adapted.model.disable_adapter():
            via_lora = pair_logps(adapted.head_inputs(batch), batch)
    for a, b in zip(vars(via_copy).values(), vars(via_lora).values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)


def test_only_the_copy_reference_keeps_a_second_model():
    assert make_lm(objective="simpo").frozen_copies == [] and make_lm(objective="orpo").frozen_copies == []
    assert make_lm(objective="dpo").frozen_copies == [] and make_lm(objective="ipo").frozen_copies == []  # precomputed
    assert len(make_lm(objective="dpo", reference="copy").frozen_copies) == 1


@pytest.mark.parametrize("lora", [None, LORA], ids=["copy", "lora"])
def test_the_precomputed_reference_equals_the_copy_and_the_lora_reference(tmp_path, lora):
    """fp32: the table's log-probs of every training pair equal the other reference's on the training packs, and
    three steps of DPO give the same losses either way."""
    other = "lora" if lora else "copy"
    losses, lms = {}, {}
    for reference in ("precomputed", other):
        lms[reference], recorder = pair_lm(objective="dpo", lr=1e-2, reference=reference, lora=lora), Losses()
        fit(lms[reference], pair_data(tmp_path), max_steps=3, precision="32-true", callbacks=[recorder])
        losses[reference] = torch.tensor(recorder.losses)
    table, where = lms["precomputed"].precomputed.stages["train"]
    start = pair_lm(objective="dpo", reference=other, lora=lora)  # the initial model again (seeded)
    data = pair_data(tmp_path)
    data.prepare_data()
    data.setup("fit")
    seen = 0
    for batch in data.train_dataloader():
        with torch.no_grad(), start.model.disable_adapter() if lora else torch.enable_grad():
            outputs = start.head_inputs(batch) if lora else head_inputs(start.frozen_copies[0], batch)
            want = pair_logps(outputs, batch)
        got = table.lookup(batch[ROWS], want, where)
        torch.testing.assert_close(got.chosen, want.chosen, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got.rejected, want.rejected, rtol=1e-5, atol=1e-4)
        seen += len(batch[ROWS])
    assert seen == len(table) == 12 and len(losses[other]) == 3
    torch.testing.assert_close(losses["precomputed"], losses[other], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(losses[other][0], losses[other][-1])  # it trained


def test_the_table_is_cached_read_by_the_next_fit_and_missed_when_the_model_or_data_changes(
    tmp_path, caplog, monkeypatch
):
    def messages(lm, data) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lit_packing.models.reference"):
            fit(lm, data, max_steps=1)
        return reference_messages(caplog)

    first = messages(pair_lm(objective="dpo"), pair_data(tmp_path))
    assert sum("computing" in m for m in first) == 2, first  # the training and the validation pairs
    assert len(list((tmp_path / "cache").rglob("reference-*.pt"))) == 2
    with monkeypatch.context() as patch:
        patch.setattr(reference_module, "compute_table", refuse_a_pass)
        again = messages(pair_lm(objective="ipo"), pair_data(tmp_path))  # ipo reads dpo's: the same log-probs
    assert len(again) == 2 and all("read from the cache" in m for m in again), again
    other_model = messages(pair_lm(objective="dpo", seed=1), pair_data(tmp_path))
    other_data = messages(pair_lm(objective="dpo"), pair_data(tmp_path, seed=1))
    for changed in (other_model, other_data):
        assert sum("computing" in m for m in changed) == 2, changed
    assert len(list((tmp_path / "cache").rglob("reference-*.pt"))) == 6


def test_a_resumed_fit_keeps_the_initial_models_reference_logps(tmp_path, monkeypatch):
    """The tables travel in the checkpoint: with the cache gone, the resume uses them and runs no pass (a pass
    would see the trained policy, whose log-probs differ); a checkpoint without them is refused in one line."""
    lm = pair_lm(objective="dpo", lr=1e-2)
    fit(lm, pair_data(tmp_path), max_steps=2).save_checkpoint(tmp_path / "step2.ckpt")
    for cached in (tmp_path / "cache").rglob("reference-*.pt"):
        cached.unlink()
    monkeypatch.setattr(reference_module, "compute_table", refuse_a_pass)
    resumed = pair_lm(objective="dpo", lr=1e-2)
    fit(resumed, pair_data(tmp_path), max_steps=3, ckpt_path=str(tmp_path / "step2.ckpt"))
    assert resumed.global_step == 3 and resumed.precomputed.tables.keys() == lm.precomputed.tables.keys()
    for data, table in lm.precomputed.tables.items():
        assert torch.equal(resumed.precomputed.tables[data].logps, table.logps)
    data = pair_data(tmp_path)
    data.prepare_data()
    data.setup("fit")
    batch = next(iter(data.val_dataloader()))
    with torch.no_grad():
        trained = pair_logps(lm.head_inputs(batch), batch)
    table, where = resumed.precomputed.stages["val"]
    assert (table.lookup(batch[ROWS], trained, where).chosen - trained.chosen).abs().max() > 1e-3

    checkpoint = torch.load(tmp_path / "step2.ckpt", weights_only=True)  # the toolkit writes plain values only
    del checkpoint[CHECKPOINT_KEY]
    torch.save(checkpoint, tmp_path / "without.ckpt")
    with pytest.raises(ConfigError) as raised:
        fit(pair_lm(objective="dpo"), pair_data(tmp_path), max_steps=3, ckpt_path=str(tmp_path / "without.ckpt"))
    assert str(raised.value).startswith(
        "model.reference: precomputed: the reference log-probs of the train pairs are neither in the checkpoint nor "
        "cached"
    ) and str(raised.value).endswith("or set model.reference=copy"), str(raised.value)


def test_a_table_refuses_a_pair_it_lacks_or_other_tokens_and_gathers_every_ranks_share():
    def logps(chosen, rejected, tokens):
        return PairLogps(torch.tensor(chosen), torch.tensor(rejected), torch.tensor(tokens), torch.tensor(tokens))

    mine = ReferenceTable.of([([4, 1], logps([-1.0, -2.0], [-3.0, -4.0], [2, 3]))])
    theirs = ReferenceTable.of([([7, 4], logps([-5.0, -1.0], [-6.0, -3.0], [4, 2]))])  # 4: computed by both

    def all_gather(t):  # rank 0 of two: the other rank's tensor of the same call
        if t.dim() == 0:
            return torch.stack([t, torch.tensor(len(theirs))])
        other = torch.cat([theirs.rows.double()[:, None], theirs.logps.double(), theirs.tokens.double()], dim=1)
        return torch.stack([t, torch.cat([other, torch.full((len(t) - len(other), 5), -1.0, dtype=t.dtype)])])

    every = mine.gathered(all_gather, world_size=2)
    assert every.rows.tolist() == [1, 4, 7] and every.logps[:, 0].tolist() == [-2.0, -1.0, -5.0]
    got = every.lookup([7, 1], logps([0.0, 0.0], [0.0, 0.0], [4, 3]), "train pairs")
    assert got.chosen.tolist() == [-5.0, -2.0] and got.rejected.tolist() == [-6.0, -4.0]
    with pytest.raises(DataError, match=r"\(train pairs\) lack the pairs of rows 9: .* set model.reference=copy"):
        every.lookup([9, 1], logps([0.0, 0.0], [0.0, 0.0], [1, 3]), "train pairs")
    with pytest.raises(DataError, match="computed for other tokens of the same rows"):
        every.lookup([4], logps([0.0], [0.0], [5]), "train pairs")


DDP_SCRIPT = """
import pathlib, sys
import torch
from lightning.pytorch import Trainer
sys.path.insert(0, {repo!r})
from tests.models.test_preference_lm import pair_data, pair_lm

tmp = pathlib.Path({tmp!r})
lm = pair_lm(objective="dpo")
trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1, precision="64-true", logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  limit_val_batches=0, use_distributed_sampler=False)
trainer.fit(lm, datamodule=pair_data(tmp))
if trainer.is_global_zero:
    torch.save({{stage: table.state() for stage, (table, _) in lm.precomputed.stages.items()}}, tmp / "ddp.pt")
    print("DDP-OK", float(trainer.callback_metrics["train/loss"]))
"""


@pytest.mark.slow
def test_two_ddp_ranks_each_compute_their_share_of_the_same_table(tmp_path):
    """2 CPU ranks (gloo): each rank's share of the pass, gathered, is the one-process table (fp64), and the loss
    starts at ln 2 on both ranks."""
    repo = str(pathlib.Path(__file__).parents[2])
    script = tmp_path / "ddp_reference.py"
    script.write_text(DDP_SCRIPT.format(repo=repo, tmp=str(tmp_path / "ddp")))
    (tmp_path / "ddp").mkdir()
    done = launch.run([sys.executable, str(script)], cwd=tmp_path, timeout=600)
    assert "DDP-OK" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
    assert float(done.stdout.split("DDP-OK")[1].split()[0]) == pytest.approx(math.log(2), abs=1e-9)
    shared = torch.load(tmp_path / "ddp" / "ddp.pt", weights_only=True)
    alone = pair_lm(objective="dpo")
    fit(alone, pair_data(tmp_path), max_steps=1)
    assert shared.keys() == alone.precomputed.stages.keys() == {"train", "val"}
    for stage, state in shared.items():
        table = alone.precomputed.stages[stage][0]
        assert torch.equal(state["rows"], table.rows) and torch.equal(state["tokens"], table.tokens)
        torch.testing.assert_close(state["logps"], table.logps, rtol=1e-12, atol=1e-9)


def test_the_precomputed_reference_needs_a_data_modules_pairs():
    with pytest.raises(ConfigError, match="model.reference: precomputed computes the reference log-probs from the"):
        run_one_step(make_lm(objective="dpo"), [PairCollator()(make_pairs(SHAPES))], 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"objective": "dpo", "reference": "lora"}, "model.reference: lora takes the reference from the model"),
        ({"objective": "dpo", "beta": 0.0}, "model.beta: must be > 0"),
        ({"objective": "ipo", "reference": "disk"}, "model.reference: 'disk' is not a reference; use precomputed,"),
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
