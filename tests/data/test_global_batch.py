"""The global batch's arithmetic (`lit_packing.data.global_batch`), without a Trainer: packs per optimizer step from
`data.packs_per_step` / `data.tokens_per_step`, the accumulation it makes on a world size, and what a resume keeps."""

from __future__ import annotations

import pytest

from lit_packing.data.global_batch import (
    Accumulation,
    GlobalBatch,
    Layout,
    accumulation,
    global_batch,
    resumed_accumulation,
)
from lit_packing.errors import ConfigError

PACKS = "data.packs_per_step"
TOKENS = "data.tokens_per_step"


def test_neither_setting_leaves_the_trainers_accumulation():
    assert global_batch(None, None, budget=4096) is None
    assert accumulation(None, world_size=4, accumulate=3) == Accumulation()


@pytest.mark.parametrize("world_size, expected", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_packs_per_step_that_the_world_size_divides(world_size, expected):
    """8 packs: 1 x 8 on one rank, 2 x 4 on two, ..., 8 x 1 on eight; an accumulation set to the same value passes."""
    batch = global_batch(8, None, budget=4096)
    assert batch == GlobalBatch(8, PACKS)
    ranks = "1 rank" if world_size == 1 else f"{world_size} ranks"
    assert accumulation(batch, world_size, accumulate=1) == Accumulation(
        expected, f"global batch: 8 packs per optimizer step ({PACKS}) = {ranks} x {expected} accumulated"
    )
    assert accumulation(batch, world_size, accumulate=expected).value == expected


def test_packs_per_step_that_the_world_size_does_not_divide_is_refused():
    with pytest.raises(ConfigError) as raised:
        accumulation(GlobalBatch(3, PACKS), world_size=2, accumulate=1)
    assert str(raised.value) == (
        "data.packs_per_step: 3 packs per optimizer step cannot be split evenly over 2 ranks; run on a number of "
        "ranks that divides 3 (1, 3), or set data.packs_per_step to a multiple of 2 (e.g. 2 or 4)"
    )


def test_tokens_per_step_in_packs_of_the_budget():
    batch = global_batch(None, 16384, budget=4096)
    assert batch == GlobalBatch(4, TOKENS)
    assert accumulation(batch, world_size=2, accumulate=1).value == 2


def test_tokens_per_step_not_a_multiple_of_the_budget_is_refused():
    with pytest.raises(ConfigError) as raised:
        global_batch(None, 10000, budget=4096)
    assert str(raised.value) == (
        "data.tokens_per_step: 10,000 tokens is not a whole number of 4,096-token packs "
        "(data.sampler.init_args.max_tokens); use a multiple of 4,096 (e.g. 8,192 or 12,288), or data.packs_per_step"
    )


@pytest.mark.parametrize(
    "budget, problem",
    [
        ("auto", "needs a fixed token budget, and data.sampler.init_args.max_tokens is auto (chosen at train start)"),
        (None, "counts the tokens of packs filled up to a token budget, and this sampler has none"),
    ],
)
def test_tokens_per_step_needs_a_fixed_budget(budget, problem):
    with pytest.raises(ConfigError) as raised:
        global_batch(None, 8192, budget=budget)
    assert raised.value.setting == TOKENS and raised.value.problem == problem


def test_a_hand_set_accumulation_that_contradicts_the_global_batch_is_refused():
    with pytest.raises(ConfigError) as raised:
        accumulation(GlobalBatch(8, PACKS), world_size=2, accumulate=3)
    assert str(raised.value) == (
        "trainer.accumulate_grad_batches: 3 contradicts data.packs_per_step: 8 packs per optimizer step on 2 ranks "
        "is 4 accumulated; leave trainer.accumulate_grad_batches unset: it follows from data.packs_per_step"
    )


@pytest.mark.parametrize(
    "saved, configured, world_size, accumulate, expected",
    [
        ((2, 1), 1, 1, 1, 2),  # 2 ranks x 1 resumed on one rank: 1 x 2
        ((1, 4), 1, 2, 1, 2),  # 1 x 4 resumed on two ranks: 2 x 2
        ((1, 2), 1, 1, 1, 2),  # kept as 1 x 2 at an earlier resume, resumed again there: still 1 x 2
        ((1, 2), 1, 1, 4, None),  # the setting changed from 1 to 4: the user's new global batch
        ((1, 2), 2, 1, 2, None),  # nothing to change
    ],
)
def test_a_resume_keeps_the_saved_global_batch_on_a_new_world_size(saved, configured, world_size, accumulate, expected):
    kept = resumed_accumulation(None, Layout(*saved), configured, world_size, accumulate)
    assert kept.value == expected
    if expected is not None:
        packs = saved[0] * saved[1]
        assert kept.note.startswith(f"global batch: keeping the checkpoint's {packs} packs per optimizer step")
    else:
        assert kept.note is None


def test_a_resume_that_cannot_split_the_saved_global_batch_is_refused():
    with pytest.raises(ConfigError) as raised:
        resumed_accumulation(None, Layout(2, 1), configured=1, world_size=3, accumulate=1)
    assert str(raised.value) == (
        "trainer.devices: the checkpoint's global batch of 2 packs per optimizer step (2 x 1 accumulated) cannot be "
        "split evenly over 3 ranks; run on a number of ranks that divides 2 (1, 2), or set data.packs_per_step to a "
        "multiple of 3 (e.g. 3 or 6) to change the global batch"
    )


def test_a_resume_with_a_configured_global_batch_takes_it_and_says_when_it_changes():
    """`setup` already derived the accumulation from the setting: the resume sets nothing, it only says so."""
    assert resumed_accumulation(GlobalBatch(2, PACKS), Layout(2, 1), 1, world_size=1, accumulate=2) == Accumulation()
    changed = resumed_accumulation(GlobalBatch(1, PACKS), Layout(2, 1), 1, world_size=1, accumulate=1)
    assert changed == Accumulation(
        None,
        "global batch: 1 pack per optimizer step (data.packs_per_step) instead of the checkpoint's 2: the packs not "
        "yet trained are formed into steps of the new size",
    )
