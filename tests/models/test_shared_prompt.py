"""Shared prompts (`PairCollator(share_prompt=True)`): a pair's prompt run once, its two continuations attending to
it and not to each other, gives the unshared pair's log-probabilities, losses and gradients (fp32 rounding) on the
host backends, from logits and from the chunked head; the counts, FLOPs, guard and self-test see the shorter row;
a model with non-attention token mixers refuses it in one line."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from lightning.pytorch import Callback
from transformers import AutoConfig, AutoModelForCausalLM

from lit_packing.batch import COUNTS, KEY_LENGTHS, LENGTHS, POSITION_IDS, model_inputs
from lit_packing.cost import flop_coefficients, model_flops, model_shape
from lit_packing.data import PackingDataModule
from lit_packing.data.collate import PairCollator
from lit_packing.errors import ConfigError, DataError, IsolationError
from lit_packing.models.guard import check_packed_batch
from lit_packing.models.head import head_inputs
from lit_packing.models.pack import HOST_BACKENDS, pack_model
from lit_packing.models.preference import OBJECTIVES, PreferenceSettings, pair_logps, preference_loss
from lit_packing.models.selftest import check_isolation
from lit_packing.samplers import BestFitPackingSampler
from tests.helpers import TINY_LLAMA, packed_model
from tests.models.families import tiny_config
from tests.models.test_preference import SHAPES, make_pairs
from tests.models.test_preference_lm import Losses, fit, pair_data, pair_lm

PAIRS = make_pairs()


def collate(pairs, share: bool):
    return PairCollator(share_prompt=share, pad_to_multiple_of=16)(pairs)


def logps(model, batch, head: bool):
    outputs = head_inputs(model, batch, chunk_size=5) if head else model(**model_inputs(batch), use_cache=False).logits
    return pair_logps(outputs, batch)


@pytest.mark.parametrize("head", [True, False], ids=["chunked_head", "logits"])
@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_shared_prompts_give_the_unshared_log_probs_losses_and_gradients(backend, objective, head):
    policy = packed_model(TINY_LLAMA, backend, seed=0)
    reference = packed_model(TINY_LLAMA, backend, seed=1).eval()
    with torch.no_grad():
        ref = logps(reference, collate(PAIRS, False), head)
    results = []
    for share in (False, True):
        got = logps(policy, collate(PAIRS, share), head)
        parts = preference_loss(got, ref, PreferenceSettings(objective, beta=0.5))
        (parts.loss_sum / len(PAIRS)).backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        policy.zero_grad()
        results.append((got.detach(), parts.loss_sum.detach(), grads))
    (unshared, loss, grads), (shared, shared_loss, shared_grads) = results
    for field in ("chosen", "rejected", "chosen_tokens", "rejected_tokens"):
        torch.testing.assert_close(getattr(shared, field), getattr(unshared, field), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared_loss, loss, rtol=1e-5, atol=1e-6)
    assert shared_grads.keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(shared_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_permuting_pairs_in_a_shared_row_permutes_their_log_probs():
    model = packed_model(TINY_LLAMA, seed=0).eval()
    order = [2, 0, 3, 1]
    with torch.no_grad():
        straight = logps(model, collate(PAIRS, True), head=True)
        permuted = logps(model, collate([PAIRS[i] for i in order], True), head=True)
    torch.testing.assert_close(permuted.chosen, straight.chosen[order], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(permuted.rejected, straight.rejected[order], rtol=1e-5, atol=1e-5)


def test_the_row_counts_each_prompt_once():
    """Tokens, attention pairs and model FLOPs drop by each prompt's second copy; a pair is still two sequences."""
    unshared, shared = collate(PAIRS, False), collate(PAIRS, True)
    saved = sum(prompt for prompt, _, _ in SHAPES)
    assert shared[COUNTS]["real_tokens"] == unshared[COUNTS]["real_tokens"] - saved
    assert shared[COUNTS]["examples"] == unshared[COUNTS]["examples"] == 2 * len(PAIRS)
    assert shared[COUNTS]["label_tokens"] == unshared[COUNTS]["label_tokens"]
    # the prompt's P^2 once, each continuation's queries over the prompt and themselves
    assert shared[COUNTS]["sum_sq_lengths"] == sum(p * p + c * (p + c) + r * (p + r) for p, c, r in SHAPES)
    shape = model_shape(packed_model(TINY_LLAMA))
    per_token, per_pair = flop_coefficients(shape)
    drop = model_flops(shape, unshared[COUNTS], unshared[LENGTHS]) - model_flops(
        shape, shared[COUNTS], shared[LENGTHS], shared[KEY_LENGTHS]
    )
    assert drop == pytest.approx(per_token * saved + per_pair * sum(p * (p + c + r) for p, c, r in SHAPES))


def test_the_guard_and_the_self_test_take_a_shared_row():
    batch = collate(PAIRS, True)
    check_packed_batch(batch)
    check_isolation(packed_model(TINY_LLAMA, seed=0), batch, "per_example")
    restarted = dict(batch, **{POSITION_IDS: collate(PAIRS, True)[POSITION_IDS].clone()})
    restarted[POSITION_IDS][0, SHAPES[0][0]] = 0  # the chosen continuation restarting at 0, not after its prompt
    with pytest.raises(IsolationError, match="position_ids"):
        check_packed_batch(restarted)


def test_pairs_without_a_common_prompt_are_refused():
    pair = {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, 6, 7, -100, 9], "chosen_tokens": 3}
    with pytest.raises(DataError, match="share_prompt=false"):
        PairCollator(share_prompt=True)([pair])


@pytest.mark.parametrize("family", ["bamba", "lfm2"])
def test_a_model_with_other_token_mixers_refuses_shared_prompts(family):
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**dict(tiny_config(family), vocab_size=1000)))
    pack_model(model, "per_example", "cpu")
    with pytest.raises(ConfigError) as error:
        model(**model_inputs(collate(PAIRS, True)), use_cache=False)
    message = str(error.value)
    assert message.startswith("data.collator.init_args.share_prompt:") and "share_prompt=false" in message
    assert "\n" not in message


class Throughput(Callback):
    """Each step's batch counts (real tokens, model FLOPs' inputs)."""

    def __init__(self) -> None:
        self.real_tokens: list[int] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.real_tokens.append(batch[COUNTS]["real_tokens"])


def test_a_precomputed_dpo_fit_with_shared_prompts_logs_the_unshared_losses(tmp_path):
    """Tokenized pairs (SmolLM2's chat template), the precomputed reference, validation: the same losses in fp64
    (after Adam steps, whose normalised updates carry fp64 rounding: measured 1.2e-9 relative), on fewer real
    tokens."""
    runs = []
    for share in (False, True):
        data = PackingDataModule(
            source=pair_data(tmp_path).source, max_length=512, overlong="drop", val_split=4,
            collator=functools.partial(PairCollator, share_prompt=share),
            sampler=functools.partial(BestFitPackingSampler, max_tokens=256), cache_dir=str(tmp_path / f"c{share}"),
        )  # fmt: skip
        losses, counts = Losses(), Throughput()
        trainer = fit(pair_lm(objective="dpo", lr=1e-3), data, max_steps=3, val=True, callbacks=[losses, counts])
        runs.append((losses.losses, float(trainer.callback_metrics["val/loss"]), counts.real_tokens))
    (losses, val, tokens), (shared_losses, shared_val, shared_tokens) = runs
    assert shared_losses == pytest.approx(losses, rel=1e-7) and shared_val == pytest.approx(val, rel=1e-7)
    assert losses[0] == pytest.approx(math.log(2), abs=1e-9) and losses[-1] < losses[0]
    assert all(s < u for s, u in zip(shared_tokens, tokens))


def test_the_lightning_module_refuses_shared_prompts_on_its_chunked_head_path():
    """`PackedCausalLM` reads hidden states through the decoder (no model-level hook sees the batch): it refuses
    itself, before the forward."""
    from lit_packing.models.causal_lm import PackedCausalLM

    lm = PackedCausalLM(model_config=dict(tiny_config("lfm2"), vocab_size=1000), memory_check=False, objective="simpo")
    with pytest.raises(ConfigError, match=r"^data\.collator\.init_args\.share_prompt: .*share_prompt=false"):
        lm.loss_outputs(collate(PAIRS, True))
