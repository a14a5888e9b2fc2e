"""The memory estimate: the largest step read from a real sampler plan and collator, activations measured on the
real model and extrapolated, and a clear refusal when a step cannot fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lit_packing.batch import COUNTS, INPUT_IDS
from lit_packing.data.collate import PackedCollator, PaddedCollator, StepShape
from lit_packing.models import PackedCausalLM
from lit_packing.models.memory import activation_model, estimate_step_memory, saved_activation_bytes
from lit_packing.samplers import BestFitPackingSampler, FixedLengthPackingSampler, RandomBatchSampler
from tests.conftest import TINY_CONFIGS

LENGTHS = np.array([100, 300, 50, 220, 180, 90, 400, 10])


def largest_step(sampler, collator) -> StepShape:
    """What the data module publishes as `DataContract.largest_step`: the collator's slots of the sampler's plan."""
    return collator.plan_slots(sampler.plan()).largest()


def test_largest_packed_step_is_the_fullest_pack():
    sampler = BestFitPackingSampler(LENGTHS, max_tokens=512, seed=0)
    packs = sampler.plan().packs()
    fullest = max(packs, key=lambda p: LENGTHS[p].sum())
    step = largest_step(sampler, PackedCollator())
    assert step == StepShape(int(LENGTHS[fullest].sum()), int((LENGTHS[fullest] ** 2).sum()), 1, step.width)
    # Bucketed, several packs pad to 1,024 slots: the step with the most attention pairs among them (tail padding
    # is one more segment) is the one that needs the most memory.
    bucketed = largest_step(sampler, PackedCollator(bucket_sizes=[256, 1024]))
    pairs = [(LENGTHS[p] ** 2).sum() + (1024 - LENGTHS[p].sum()) ** 2 for p in packs if LENGTHS[p].sum() > 256]
    assert bucketed.slot_tokens == 1024 and bucketed.attn_pairs == max(pairs)


def test_largest_padded_step_is_rows_times_longest():
    sampler = RandomBatchSampler(LENGTHS, batch_size=3, seed=0)
    batches = sampler.plan().packs()
    cost = [len(b) * LENGTHS[b].max() for b in batches]
    worst = batches[int(np.argmax(cost))]
    step = largest_step(sampler, PaddedCollator())
    assert step.padded and (step.rows, step.width) == (len(worst), int(LENGTHS[worst].max()))
    assert step.slot_tokens == max(cost) and step.attn_pairs == len(worst) * int(LENGTHS[worst].max()) ** 2


@pytest.mark.parametrize(
    "sampler, collator",
    [
        (BestFitPackingSampler(LENGTHS, max_tokens=512, seed=0), PackedCollator(pad_to_multiple_of=64)),
        (BestFitPackingSampler(LENGTHS, max_tokens=512, seed=0), PackedCollator(bucket_sizes=[300, 600])),
        (FixedLengthPackingSampler(LENGTHS, max_tokens=256, seed=0), PackedCollator(isolate=False, row_length=128)),
        (RandomBatchSampler(LENGTHS, batch_size=3, seed=0), PaddedCollator(pad_to_multiple_of=8)),
    ],
)
def test_plan_slots_equal_the_collated_batches_counts(sampler, collator):
    """The slot and attention arithmetic read from a plan is what the collator's real batches count, pack by pack."""
    slots = collator.plan_slots(sampler.plan())
    for p, pack in enumerate(sampler.plan().packs()):
        examples = [
            {INPUT_IDS: list(range(1, 1 + (item[2] - item[1] if isinstance(item, tuple) else LENGTHS[item])))}
            for item in pack
        ]
        counts = collator(examples)[COUNTS]
        assert (counts["slot_tokens"], counts["attn_cost"]) == (slots.slots[p], slots.pairs[p])


@pytest.mark.parametrize("padded", [False, True])
def test_activation_model_extrapolates_to_a_longer_step(padded):
    """Fitted on 64-256 tokens, the model predicts what autograd saves at 768 tokens within 5%."""
    torch.manual_seed(0)
    lm = PackedCausalLM(model_config=dict(TINY_CONFIGS["llama"], vocab_size=1000), attn_backend="per_example")
    a, b, c = activation_model(lm, padded)
    measured = saved_activation_bytes(lm, 768, padded)
    assert a + b * 768 + c * 768**2 == pytest.approx(measured, rel=0.05)
    assert b > 0


def test_gradient_checkpointing_and_chunked_loss_shrink_the_prediction():
    config = dict(TINY_CONFIGS["llama"], vocab_size=32000, num_hidden_layers=8)
    step = StepShape(8192, 8192 * 512, 1, 8192)
    predicted = {}
    for name, kwargs in {
        "full": {"loss_impl": "full"},
        "chunked": {},
        "chunked+checkpointing": {"gradient_checkpointing": True},
    }.items():
        torch.manual_seed(0)
        lm = PackedCausalLM(model_config=config, attn_backend="per_example", **kwargs)
        predicted[name] = estimate_step_memory(lm, step, "32-true")
    assert predicted["full"].logits == 8192 * 32000 * 16
    assert predicted["chunked"].logits == 1024 * 32000 * 16
    assert predicted["chunked+checkpointing"].activations < predicted["chunked"].activations / 2


def test_a_step_that_cannot_fit_is_refused_with_the_knobs():
    torch.manual_seed(0)
    lm = PackedCausalLM(model_config=dict(TINY_CONFIGS["llama"], vocab_size=1000), loss_impl="full")
    estimate = estimate_step_memory(lm, StepShape(50_000_000, 50_000_000 * 1000, 1, 50_000_000), "32-true")
    assert not estimate.fits
    with pytest.raises(MemoryError) as err:
        estimate.check()
    message = str(err.value)
    assert "50,000,000 tokens in one packed row" in message
    for knob in ("data.sampler.init_args.max_tokens", "model.gradient_checkpointing=true", "model.loss_impl=chunked"):
        assert knob in message
