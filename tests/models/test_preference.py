"""Preference objectives on packed pairs equal the per-pair computation of each sequence run alone; the loss is a
sum over pairs, so its step mean does not depend on how pairs are packed or split."""

from __future__ import annotations

import math

import pytest
import torch

from lit_packing.batch import MODEL_KEYS
from lit_packing.data.collate import PairCollator
from lit_packing.errors import ConfigError
from lit_packing.models.preference import OBJECTIVES, PairLogps, PreferenceSettings, pair_logps, preference_loss
from tests.helpers import TINY_LLAMA, packed_model

# (prompt, chosen, rejected) token counts: chosen and rejected of different lengths, one rejected longer.
SHAPES = [(5, 4, 7), (3, 6, 2), (8, 3, 3), (2, 9, 5)]


def make_pairs(shapes=SHAPES, vocab=1000, seed=0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    pairs = []
    for prompt, chosen, rejected in shapes:
        p, c, r = (torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (prompt, chosen, rejected))
        ids = p + c + p + r
        labels = [-100] * prompt + c + [-100] * prompt + r
        pairs.append({"input_ids": ids, "labels": labels, "chosen_tokens": prompt + chosen, "index": len(pairs)})
    return pairs


def alone_logps(model, pairs) -> PairLogps:
    """Each sequence as its own (1, L) batch: its completion tokens' summed log-probability."""
    out = {"chosen": [], "rejected": [], "chosen_tokens": [], "rejected_tokens": []}
    for pair in pairs:
        k = pair["chosen_tokens"]
        for side, ids, labels in (
            ("chosen", pair["input_ids"][:k], pair["labels"][:k]),
            ("rejected", pair["input_ids"][k:], pair["labels"][k:]),
        ):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1].float()
            target = torch.tensor(labels[1:])
            keep = target != -100
            logp = torch.log_softmax(logits, -1)[keep].gather(1, target[keep][:, None]).sum()
            out[side].append(logp)
            out[side + "_tokens"].append(torch.tensor(float(keep.sum())))
    return PairLogps(*(torch.stack(out[k]) for k in ("chosen", "rejected", "chosen_tokens", "rejected_tokens")))


def packed_logps(model, pairs) -> PairLogps:
    batch = PairCollator()(pairs)
    logits = model(**{k: batch[k] for k in MODEL_KEYS if k in batch}, use_cache=False).logits
    return pair_logps(logits, batch)


@pytest.fixture(scope="module")
def models():
    policy = packed_model(TINY_LLAMA, seed=0).eval()
    reference = packed_model(TINY_LLAMA, seed=1).eval()
    return policy, reference


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_packed_loss_and_gradients_equal_each_pair_alone(models, objective):
    policy, reference = models
    pairs = make_pairs()
    settings = PreferenceSettings(objective, beta=0.5)
    with torch.no_grad():
        ref = packed_logps(reference, pairs)
    policy.zero_grad()
    alone = preference_loss(alone_logps(policy, pairs), ref, settings)
    alone.loss_sum.backward()
    expected = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()
    packed = preference_loss(packed_logps(policy, pairs), ref, settings)
    packed.loss_sum.backward()
    torch.testing.assert_close(packed.loss_sum, alone.loss_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.chosen_rewards, alone.chosen_rewards, rtol=1e-5, atol=1e-5)
    for name, param in policy.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_reference_logps_packed_equal_each_sequence_alone(models):
    _, reference = models
    with torch.no_grad():
        packed, alone = packed_logps(reference, make_pairs()), alone_logps(reference, make_pairs())
    for a, b in zip(vars(packed).values(), vars(alone).values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_policy_equal_to_reference_gives_ln_2_and_zero_rewards(models):
    policy, _ = models
    with torch.no_grad():
        logps = packed_logps(policy, make_pairs())
    parts = preference_loss(logps, logps, PreferenceSettings("dpo", beta=0.1))
    assert parts.loss_sum.item() / len(SHAPES) == pytest.approx(math.log(2), abs=1e-7)
    assert torch.equal(parts.chosen_rewards, torch.zeros(len(SHAPES)))
    assert torch.equal(parts.rejected_rewards, torch.zeros(len(SHAPES)))


def test_permuting_pairs_in_a_row_permutes_their_log_probs(models):
    policy, _ = models
    pairs, order = make_pairs(), [2, 0, 3, 1]
    with torch.no_grad():
        straight = packed_logps(policy, pairs)
        permuted = packed_logps(policy, [pairs[i] for i in order])
    for a, b in zip(vars(straight).values(), vars(permuted).values()):
        torch.testing.assert_close(a[order], b, rtol=1e-5, atol=1e-4)


def test_the_step_mean_over_pairs_does_not_depend_on_the_split(models):
    """1 x 4, 2 x 2 and 4 x 1 micro-batches of the same pairs: each micro-batch's sum over the step's pair count
    adds up to the same loss and gradient. A token-weighted mean (each micro-batch's mean weighted by its tokens)
    does not."""
    policy, reference = models
    pairs, settings = make_pairs(), PreferenceSettings("dpo", beta=0.5)
    with torch.no_grad():
        ref_all = [packed_logps(reference, [p]) for p in pairs]

    def step(split: int, token_weighted: bool = False):
        policy.zero_grad()
        total = 0.0
        for i in range(0, len(pairs), split):
            chunk = pairs[i : i + split]
            ref = PairLogps(*(torch.cat([getattr(r, f) for r in ref_all[i : i + split]]) for f in vars(ref_all[0])))
            parts = preference_loss(packed_logps(policy, chunk), ref, settings)
            if token_weighted:
                tokens = sum(len(p["input_ids"]) for p in chunk)
                loss = parts.loss_sum / len(chunk) * tokens / sum(len(p["input_ids"]) for p in pairs)
            else:
                loss = parts.loss_sum / len(pairs)
            loss.backward()
            total += float(loss)
        return total, torch.cat([p.grad.flatten() for p in policy.parameters()])

    loss_1, grad_1 = step(4)
    for split in (2, 1):
        loss, grad = step(split)
        assert loss == pytest.approx(loss_1, rel=1e-5)
        torch.testing.assert_close(grad, grad_1, rtol=1e-4, atol=1e-7)
    weighted, weighted_grad = step(1, token_weighted=True)
    assert not torch.allclose(weighted_grad, grad_1, rtol=1e-3, atol=1e-6)


def test_objectives_by_hand():
    """One pair, numbers chosen to check each formula."""
    policy = PairLogps(*(torch.tensor([v]) for v in (-4.0, -9.0, 2.0, 3.0)))
    ref = PairLogps(*(torch.tensor([v]) for v in (-5.0, -8.0, 2.0, 3.0)))
    dpo = preference_loss(policy, ref, PreferenceSettings("dpo", beta=0.5))
    assert dpo.loss_sum.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.5 * (1 - -1)))))
    ipo = preference_loss(policy, ref, PreferenceSettings("ipo", beta=0.5))
    assert ipo.loss_sum.item() == pytest.approx((1 / 2 - -1 / 3 - 1) ** 2)
    simpo = preference_loss(policy, None, PreferenceSettings("simpo", beta=2.0, simpo_gamma_beta_ratio=0.5))
    assert simpo.loss_sum.item() == pytest.approx(-math.log(1 / (1 + math.exp(-(2.0 * (-2 - -3) - 1.0)))))
    orpo = preference_loss(policy, None, PreferenceSettings("orpo", beta=0.1))
    log_odds = lambda m: m - math.log(1 - math.exp(m))  # noqa: E731
    expected = 2.0 + 0.1 * -math.log(1 / (1 + math.exp(-(log_odds(-2.0) - log_odds(-3.0)))))
    assert orpo.loss_sum.item() == pytest.approx(expected, rel=1e-6)


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="objective: 'kto' is not an objective; use one of dpo, ipo, simpo, orpo"):
        PreferenceSettings("kto")
    with pytest.raises(ConfigError, match="beta: must be > 0"):
        PreferenceSettings("dpo", beta=0.0)
    logps = PairLogps(*(torch.zeros(1) for _ in range(4)))
    with pytest.raises(ConfigError, match="dpo compares with a reference model"):
        preference_loss(logps, None, PreferenceSettings("dpo"))
