"""GRPO and its relatives on packed rollout groups (`grpo.py`, `GroupCollator`): for every loss type, the packed
loss and gradients equal TRL's `GRPOTrainer` on the same rollouts (fp64, a step that is one micro-batch), each
prompt run once or not; and the step's loss and gradients do not depend on how its groups are split.

Tolerances: fp64 rounding (1e-10) for every loss and log-prob, and for gradients of rows that run each prompt per
completion (TRL's layout). Where a prompt runs once, its positions' gradients are summed over the group's
completions before transformers' RMSNorm, which computes in fp32 whatever the model's dtype, rounds them (once,
instead of once per completion): those gradients agree to fp32 rounding, 1e-6 of each tensor's largest element."""

from __future__ import annotations

import pytest
import torch

from benchmarks.grpo_throughput import padded as padded_groups
from lit_packing.batch import BEHAVIOUR_LOGPS, STEP, TOKEN_ADVANTAGES, Pack, attach_step, model_inputs, step_totals
from lit_packing.data.groups import GroupCollator
from lit_packing.errors import ConfigError, DataError
from lit_packing.models.grpo import (
    LOSS_TYPES,
    CompletionLogps,
    GRPOSettings,
    batch_advantages,
    completion_logps,
    group_advantages,
    grpo_loss,
)
from lit_packing.models.head import head_inputs
from lit_packing.models.pack import HOST_BACKENDS
from tests.helpers import TINY_LLAMA, packed_model, tiny_model

CONFIG = dict(TINY_LLAMA, vocab_size=512)
# Prompt lengths and each group's completion lengths (G = 3, 2, 4, 3): completions from 1 token to 9.
SHAPES = [(5, [4, 1, 6]), (3, [2, 9]), (7, [3, 3, 1, 5]), (4, [8, 2, 2])]
# For TRL's padded layout, prompts of one length: TRL left-pads prompts and passes no position_ids, so a shorter
# prompt's tokens sit at later positions there, and transformers computes RoPE's angles in fp32 (a shift moves the
# logits by ~1e-8): equal lengths keep every position the same and the comparison at fp64 rounding. Shared prompts
# of different lengths are checked against each completion run alone below.
ORACLE_SHAPES = [(5, [4, 1, 6]), (5, [2, 9]), (5, [3, 3, 1, 5]), (5, [8, 2, 2])]
MAX_COMPLETION = 9


def make_groups(shapes=SHAPES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for prompt, sizes in shapes:
        ids = torch.randint(3, CONFIG["vocab_size"], (prompt + sum(sizes),), generator=gen).tolist()
        rewards = torch.randint(0, 3, (len(sizes),), generator=gen).double().tolist()
        groups.append({"input_ids": ids, "completion_tokens": sizes, "rewards": rewards})
    return groups


def settings_for(loss_type, level="token", beta=0.0):
    return GRPOSettings(loss_type, epsilon=0.2, epsilon_high=1.1 if loss_type == "cispo" else 0.28, beta=beta,
                        importance_sampling_level=level, max_completion_length=MAX_COMPLETION)  # fmt: skip


def logps_of(model, batch, head=True):
    outputs = head_inputs(model, batch, chunk_size=7) if head else model(**model_inputs(batch), use_cache=False).logits
    return completion_logps(outputs, batch)


def with_behaviour(model, groups, seed=1):
    """Each group's behaviour log-probs: the model's own, moved by up to +-0.5 per token and +-1 per completion
    (token ratios from 0.2 to 4.5; a completion's mean log-ratio, GSPO's, beyond both clips)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        own = logps_of(model, GroupCollator()(groups))
    shift = (torch.rand(own.completions, generator=gen, dtype=own.logps.dtype) - 0.5) * 2
    noisy = (
        own.logps + (torch.rand(own.logps.shape, generator=gen, dtype=own.logps.dtype) - 0.5) + shift[own.completion]
    )
    out, start = [], 0
    for group in groups:
        n = sum(group["completion_tokens"])
        out.append({**group, BEHAVIOUR_LOGPS: noisy[start : start + n].tolist()})
        start += n
    return out


def assert_grads_close(got, expected, shared, what=""):
    assert got.keys() == expected.keys()
    for name, g in expected.items():
        scale = float(g.abs().max()) if shared else 0.0
        torch.testing.assert_close(got[name], g, rtol=1e-6 if shared else 1e-8, atol=1e-6 * scale + 1e-13,
                                   msg=f"{what} {name}")  # fmt: skip


def step_loss(model, groups, settings, splits, share=True, reference=None):
    """The optimizer step's loss over `splits` micro-batches (groups in order), its gradients, as the module runs
    it: each micro-batch's sum divided by the step's total (`attach_step`, as the plan gives it)."""
    bounds = torch.linspace(0, len(groups), splits + 1).round().long().tolist()
    batches = attach_step([GroupCollator(share_prompt=share)(groups[a:b]) for a, b in zip(bounds, bounds[1:])])
    model.zero_grad()
    total = 0.0
    for batch in batches:
        policy = logps_of(model, batch)
        per_token = TOKEN_ADVANTAGES in batch  # the data's advantages per completion token, as GRPO takes them
        advantages = batch[TOKEN_ADVANTAGES] if per_token else group_advantages(batch["rewards"], batch["groups"],
                                                                                 settings)  # fmt: skip
        behaviour = batch.get(BEHAVIOUR_LOGPS)
        ref = None if reference is None else logps_of(reference, batch).logps.detach()
        parts = grpo_loss(policy, advantages, settings, behaviour, ref, per_token)
        loss = parts.loss_sum / batch[STEP][settings.normalizer]
        loss.backward()
        total += float(loss)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, grads


@pytest.mark.parametrize("share", [True, False], ids=["prompt_once", "unshared"])
@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["no_kl", "kl"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_packed_loss_and_gradients_equal_trls(loss_type, level, beta, share):
    """fp64, off-policy (behaviour log-probs from the data, so ratios clip): TRL's loss and every gradient, and its
    logged clip fractions, entropy and KL."""
    from benchmarks.trl_grpo import trl_grpo_loss_and_metrics

    policy = packed_model(CONFIG, seed=0).double()
    reference = packed_model(CONFIG, seed=1).double().eval() if beta else None
    trl_model = tiny_model(CONFIG, seed=0).double()
    settings = settings_for(loss_type, level, beta)
    groups = with_behaviour(policy, make_groups(ORACLE_SHAPES))
    ours, grads = step_loss(policy, groups, settings, splits=1, share=share, reference=reference)
    batch = GroupCollator(share_prompt=share)(groups)
    policy.zero_grad()
    parts = grpo_loss(logps_of(policy, batch), group_advantages(batch["rewards"], batch["groups"], settings),
                      settings, batch[BEHAVIOUR_LOGPS],
                      logps_of(reference, batch).logps if beta else None)  # fmt: skip
    padded = padded_groups(groups, settings, torch.float64)
    ref = None
    if beta:
        with torch.no_grad():
            ref_batch = GroupCollator(share_prompt=False)(groups)
            flat = logps_of(reference, ref_batch).logps
        ref = _as_padded(flat, groups, padded["completion_ids"].shape[1])
    trl_loss, trl_metrics = trl_grpo_loss_and_metrics(
        trl_model, **padded, loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=settings.epsilon_high,
        importance_sampling_level=level, ref_per_token_logps=ref, max_completion_length=MAX_COMPLETION,
        full_precision_logps=True,
    )  # fmt: skip
    trl_loss.backward()
    trl_grads = {n: p.grad for n, p in trl_model.named_parameters() if p.grad is not None}
    assert ours == pytest.approx(float(trl_loss), rel=1e-10, abs=1e-13)
    assert_grads_close(grads, trl_grads, share)
    for name, (total, count) in parts.metrics.items():
        if name in trl_metrics:
            assert float(total / count) == pytest.approx(trl_metrics[name], rel=1e-6, abs=1e-9), name
    logged = {"entropy", "clip_ratio/region_mean" if loss_type != "cispo" else "cispo_clip_ratio"}
    assert logged <= parts.metrics.keys() & trl_metrics.keys()
    assert ("kl" in parts.metrics) == bool(beta)
    if loss_type != "cispo":
        assert 0 < trl_metrics["clip_ratio/region_mean"] < 1  # the behaviour log-probs make the clip matter


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "cispo"])
def test_advantages_per_token_give_trls_loss_and_gradients_on_any_split(loss_type, level):
    """Advantages given per completion token (`token_advantages`) instead of rewards: TRL's `GRPOTrainer` takes a
    (B, T) advantage as it is; fp64, off-policy, each prompt once, as one micro-batch and as 2 x 2 and 4 x 1."""
    from benchmarks.trl_grpo import trl_grpo_loss_and_metrics

    policy = packed_model(CONFIG, seed=0).double()
    trl_model = tiny_model(CONFIG, seed=0).double()
    settings = settings_for(loss_type, level)
    gen = torch.Generator().manual_seed(5)
    groups = [{**g, TOKEN_ADVANTAGES: torch.randn(sum(g["completion_tokens"]), generator=gen).double().tolist()}
              for g in with_behaviour(policy, make_groups(ORACLE_SHAPES))]  # fmt: skip
    runs = {splits: step_loss(policy, groups, settings, splits) for splits in (1, 2, 4)}
    padded = padded_groups(groups, settings, torch.float64)
    flat = torch.tensor([a for g in groups for a in g[TOKEN_ADVANTAGES]], dtype=torch.float64)
    padded["advantages"] = _as_padded(flat, groups, padded["completion_ids"].shape[1])
    trl_loss, _ = trl_grpo_loss_and_metrics(
        trl_model, **padded, loss_type=loss_type, epsilon=0.2, epsilon_high=settings.epsilon_high,
        importance_sampling_level=level, max_completion_length=MAX_COMPLETION, full_precision_logps=True,
    )  # fmt: skip
    trl_loss.backward()
    trl_grads = {n: p.grad for n, p in trl_model.named_parameters() if p.grad is not None}
    for splits, (loss, grads) in runs.items():
        assert loss == pytest.approx(float(trl_loss), rel=1e-10, abs=1e-13), splits
        assert_grads_close(grads, trl_grads, True, f"{splits} micro-batches")
    from_rewards = [{**g, TOKEN_ADVANTAGES: None} for g in groups]  # without them: the rewards' advantages
    assert runs[1][0] != pytest.approx(step_loss(policy, from_rewards, settings, 1)[0], rel=1e-6)


def _as_padded(flat, groups, width):
    rows, start = [], 0
    for group in groups:
        for size in group["completion_tokens"]:
            rows.append(flat[start : start + size].tolist() + [0.0] * (width - size))
            start += size
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_steps_loss_and_gradients_do_not_depend_on_its_split_or_sharing(loss_type):
    """1 x 4 = 2 x 2 = 4 x 1 micro-batches, each prompt once or not: one loss, one gradient (fp64)."""
    model = packed_model(CONFIG, seed=0).double()
    groups = with_behaviour(model, make_groups())
    settings = settings_for(loss_type, "token", 0.0)
    runs = {(splits, share): step_loss(model, groups, settings, splits, share) for splits in (1, 2, 4)
            for share in (True, False)}  # fmt: skip
    loss, grads = runs[(1, False)]
    for (splits, share), (other, other_grads) in runs.items():
        assert other == pytest.approx(loss, rel=1e-10), (splits, share)
        assert_grads_close(other_grads, grads, share, f"{splits} micro-batches, shared={share}")


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_a_shared_prompt_gives_each_completion_alone(backend):
    """Each completion's token log-probs in a shared row equal the completion run alone after its prompt (a (1, L)
    batch, no packing), from the chunked head and from logits."""
    model = packed_model(CONFIG, backend, seed=0).double().eval()
    groups = make_groups()
    with torch.no_grad():
        shared = [logps_of(model, GroupCollator()(groups), head).logps for head in (True, False)]
        alone = []
        for group in groups:
            ids, sizes = group["input_ids"], group["completion_tokens"]
            prompt, start = len(ids) - sum(sizes), len(ids) - sum(sizes)
            for size in sizes:
                row = torch.tensor([ids[:prompt] + ids[start : start + size]])
                logits = model(input_ids=row, use_cache=False).logits[0, prompt - 1 : -1].log_softmax(-1)
                alone.append(logits.gather(-1, row[0, prompt:, None]).squeeze(-1))
                start += size
    for got in shared:
        torch.testing.assert_close(got, torch.cat(alone), rtol=1e-10, atol=1e-10)


def test_advantages_as_trl_computes_them_and_leave_one_out():
    rewards = torch.tensor([1.0, 0.0, 2.0, 5.0, 5.0, 0.0, 1.0, 3.0, 2.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    sizes = [3, 2, 4]
    by_group = rewards.split(sizes)
    expected = torch.cat([(r - r.mean()) / (r.std() + 1e-4) for r in by_group])  # TRL: scale_rewards=group
    torch.testing.assert_close(group_advantages(rewards, groups, GRPOSettings()), expected)
    unscaled = torch.cat([r - r.mean() for r in by_group])
    torch.testing.assert_close(group_advantages(rewards, groups, GRPOSettings(scale_rewards="none")), unscaled)
    loo = torch.cat([r - (r.sum() - r) / (len(r) - 1) for r in by_group])
    got = group_advantages(rewards, groups, GRPOSettings(advantages="rloo", scale_rewards="none"))
    torch.testing.assert_close(got, loo)
    assert got[3:5].abs().sum() == 0  # equal rewards: no advantage, no division by a zero std
    batch = torch.cat([r - r.mean() for r in by_group]) / (rewards.std() + 1e-4)  # TRL: scale_rewards=batch
    torch.testing.assert_close(batch_advantages(rewards, groups, GRPOSettings(scale_rewards="batch")), batch)


def test_batch_scaled_advantages_need_the_generation_batch():
    """Stored rollouts without advantages cannot say what their generation batch was: refused in one line."""
    from lit_packing.models import GRPO, PackedCausalLM

    lm = PackedCausalLM(model_config=dict(TINY_LLAMA, vocab_size=49152), objective=GRPO(scale_rewards="batch"),
                        memory_check=False)  # fmt: skip
    group = {"input_ids": [5, 6, 7, 8, 9], "completion_tokens": [2, 1], "rewards": [1.0, 0.0]}
    with pytest.raises(ConfigError, match=r"scale_rewards: batch divides by the reward std of the whole generation"):
        lm.objective.loss(lm.handle, GroupCollator()(Pack([group], step=step_totals([3]))))


def test_on_policy_ratios_are_one_and_nothing_clips():
    model = packed_model(CONFIG, seed=0).double()
    batch = GroupCollator()(make_groups())
    settings = settings_for("dapo")
    parts = grpo_loss(logps_of(model, batch), group_advantages(batch["rewards"], batch["groups"], settings), settings)
    assert float(parts.metrics["clip_ratio/region_mean"][0]) == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss_type": "cispo"}, "epsilon_high: cispo caps its ratio"),
        ({"loss_type": "dr_grpo"}, "max_completion_length: dr_grpo divides by G x the generation limit"),
        ({"loss_type": "ppo"}, "loss_type: 'ppo' is not a choice"),
        ({"beta": -1.0}, "beta: must be >= 0"),
        ({"importance_sampling_cap": 0.0}, "importance_sampling_cap: must be > 0"),
    ],
)
def test_bad_settings_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ConfigError) as raised:
        GRPOSettings(**kwargs)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("group", "message"),
    [
        ({"input_ids": [5, 6, 7], "completion_tokens": [], "rewards": []}, "no rollout group"),
        ({"input_ids": [5, 6, 7], "completion_tokens": [3], "rewards": [1.0]}, "no rollout group"),
        ({"input_ids": [5, 6, 7], "completion_tokens": [1, 1], "rewards": [1.0]}, "2 completions has 1 rewards"),
        ({"input_ids": [5, 6, 7], "completion_tokens": [2], "rewards": [1.0], BEHAVIOUR_LOGPS: [0.0]}, "1 behav"),
    ],
)
def test_bad_groups_are_refused(group, message):
    with pytest.raises(DataError, match=message):
        GroupCollator()([group])


@pytest.mark.parametrize("family", ["bamba", "lfm2"])
def test_a_model_with_other_token_mixers_refuses_a_shared_group_and_takes_it_unshared(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_packing.models.pack import pack_model
    from tests.models.families import tiny_config

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**dict(tiny_config(family), vocab_size=1000)))
    pack_model(model, "per_example", "cpu")
    with pytest.raises(ConfigError) as error:
        model(**model_inputs(GroupCollator()(make_groups())), use_cache=False)
    message = str(error.value)
    assert message.startswith("data.collator.init_args.share_prompt:") and "\n" not in message
    unshared = GroupCollator(share_prompt=False)(make_groups())
    assert completion_logps(model(**model_inputs(unshared), use_cache=False).logits, unshared).logps.isfinite().all()


def test_a_group_row_counts_each_prompt_once():
    """Tokens, attention pairs and model FLOPs as run: a prompt's G - 1 other copies saved, G sequences a group."""
    from lit_packing.batch import COUNTS, KEY_LENGTHS, LENGTHS
    from lit_packing.cost import flop_coefficients, model_flops, model_shape

    groups = make_groups()
    unshared, shared = GroupCollator(share_prompt=False)(groups), GroupCollator()(groups)
    saved = sum(p * (len(sizes) - 1) for p, sizes in SHAPES)
    assert shared[COUNTS]["real_tokens"] == unshared[COUNTS]["real_tokens"] - saved
    assert shared[COUNTS]["examples"] == unshared[COUNTS]["examples"] == sum(len(sizes) for _, sizes in SHAPES)
    assert shared[COUNTS]["label_tokens"] == unshared[COUNTS]["label_tokens"] == sum(sum(s) for _, s in SHAPES)
    # the prompt's P^2 once, each completion's queries over the prompt and itself
    assert shared[COUNTS]["sum_sq_lengths"] == sum(p * p + sum(c * (p + c) for c in sizes) for p, sizes in SHAPES)
    shape = model_shape(packed_model(CONFIG))
    per_token, per_pair = flop_coefficients(shape)
    drop = model_flops(shape, unshared[COUNTS], unshared[LENGTHS]) - model_flops(
        shape, shared[COUNTS], shared[LENGTHS], shared[KEY_LENGTHS]
    )
    # unshared sum (p + c)^2 against shared p^2 + sum c (p + c): (G - 1) p^2 + p sum c fewer pairs
    pairs = sum((len(sizes) - 1) * p * p + p * sum(sizes) for p, sizes in SHAPES)
    assert drop == pytest.approx(per_token * saved + per_pair * pairs)


def truncated_flags(groups) -> list[bool]:
    """The first completion of each group marked as stopped at the generation limit."""
    return [k == 0 for group in groups for k in range(len(group["completion_tokens"]))]


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t != "bnpo"])
def test_masked_truncated_completions_give_trls_loss_gradients_and_metrics(loss_type, level):
    """`mask_truncated_completions`: the first completion of each group, marked truncated, is out of the loss as
    TRL masks it (its row of `completion_mask` zero): TRL's loss, every gradient and the logged clip fractions,
    entropy and KL, fp64, off-policy, KL on. The divisor is the step's count of every completion token, as the plan
    counts it: TRL's dapo and cispo take it as `num_items_in_batch` here (TRL's own leaves the masked tokens out,
    and its bnpo divides by the micro-batch's unmasked tokens: not compared)."""
    from benchmarks.trl_grpo import trl_grpo_loss_and_metrics

    policy = packed_model(CONFIG, seed=0).double()
    reference = packed_model(CONFIG, seed=1).double().eval()
    trl_model = tiny_model(CONFIG, seed=0).double()
    settings = settings_for(loss_type, level, beta=0.04)
    groups = with_behaviour(policy, make_groups(ORACLE_SHAPES))
    [batch] = attach_step([GroupCollator()(groups)])
    trained = ~torch.tensor(truncated_flags(groups))
    policy.zero_grad()
    advantages = group_advantages(batch["rewards"], batch["groups"], settings)
    parts = grpo_loss(logps_of(policy, batch), advantages, settings, batch[BEHAVIOUR_LOGPS],
                      logps_of(reference, batch).logps.detach(), trained=trained)  # fmt: skip
    ours = parts.loss_sum / batch[STEP][settings.normalizer]
    ours.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    padded = padded_groups(groups, settings, torch.float64)
    padded["completion_mask"][~trained] = 0
    with torch.no_grad():
        ref = _as_padded(logps_of(reference, GroupCollator(share_prompt=False)(groups)).logps, groups,
                         padded["completion_ids"].shape[1])  # fmt: skip
    trl_loss, trl_metrics = trl_grpo_loss_and_metrics(
        trl_model, **padded, loss_type=loss_type, beta=0.04, epsilon=0.2, epsilon_high=settings.epsilon_high,
        importance_sampling_level=level, ref_per_token_logps=ref, max_completion_length=MAX_COMPLETION,
        full_precision_logps=True,
    )  # fmt: skip
    trl_loss.backward()
    assert float(ours.detach()) == pytest.approx(float(trl_loss), rel=1e-10, abs=1e-13)
    assert_grads_close(grads, {n: p.grad for n, p in trl_model.named_parameters() if p.grad is not None}, True)
    compared = {"entropy", "kl", "clip_ratio/region_mean", "cispo_clip_ratio"} & parts.metrics.keys()
    for name in compared & trl_metrics.keys():
        total, count = parts.metrics[name]
        assert float(total / count) == pytest.approx(trl_metrics[name], rel=1e-6, abs=1e-9), name
    assert {"entropy", "kl"} <= compared & trl_metrics.keys()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_truncated_completion_contributes_nothing_to_the_loss_or_the_gradients(loss_type):
    """Through `GRPO.loss`, as a fit calls it, a batch whose on-policy round marks the first completion of each group
    truncated: whatever those completions' tokens and behaviour log-probs, the loss and every gradient are the same
    (they count in their groups' advantages only, through their rewards); unmasked, the loss differs."""
    from lit_packing.batch import ROUND
    from lit_packing.models import GRPO, PackedCausalLM

    def step(objective, groups, truncated):
        lm = PackedCausalLM(model_config=CONFIG, objective=objective, memory_check=False)
        lm.model.double()
        [batch] = attach_step([GroupCollator()(groups)])
        batch[ROUND] = {"on_policy": False, "truncated": truncated}
        parts, metrics = lm.objective.loss(lm.handle, batch)
        parts.objective.backward()
        grads = {n: p.grad for n, p in lm.named_parameters() if p.grad is not None}
        return float(parts.objective), grads, metrics

    policy = packed_model(CONFIG, seed=0).double()
    groups = with_behaviour(policy, make_groups())
    flags = truncated_flags(groups)
    gen = torch.Generator().manual_seed(5)
    changed = []  # the truncated completions' tokens and behaviour log-probs replaced
    for group in groups:
        ids, first = list(group["input_ids"]), group["completion_tokens"][0]
        prompt = len(ids) - sum(group["completion_tokens"])
        ids[prompt : prompt + first] = torch.randint(3, CONFIG["vocab_size"], (first,), generator=gen).tolist()
        logps = list(group[BEHAVIOUR_LOGPS])
        logps[:first] = (-torch.rand(first, generator=gen, dtype=torch.float64) * 5).tolist()
        changed.append({**group, "input_ids": ids, BEHAVIOUR_LOGPS: logps})
    settings = dict(loss_type=loss_type, epsilon_high=1.1 if loss_type == "cispo" else 0.28,
                    max_completion_length=MAX_COMPLETION, mask_truncated_completions=True)  # fmt: skip
    torch.manual_seed(0)
    loss, grads, metrics = step(GRPO(**settings), groups, flags)
    torch.manual_seed(0)
    other, other_grads, other_metrics = step(GRPO(**settings), changed, flags)
    assert other == pytest.approx(loss, rel=1e-12, abs=1e-15)
    assert_grads_close(other_grads, grads, False)
    for name in ("entropy", "clip_ratio/region_mean", "reward", "advantage"):
        if name in metrics:
            assert float(other_metrics[name][0]) == pytest.approx(float(metrics[name][0]), rel=1e-12), name
    torch.manual_seed(0)
    unmasked = step(GRPO(**{**settings, "mask_truncated_completions": False}), changed, flags)[0]
    assert unmasked != pytest.approx(loss, rel=1e-6)


def test_masking_truncated_completions_needs_an_on_policy_round():
    """Stored rollouts do not mark the completions that hit the generation limit: refused in one line."""
    from lit_packing.models import GRPO, PackedCausalLM

    lm = PackedCausalLM(model_config=CONFIG, objective=GRPO(mask_truncated_completions=True), memory_check=False)
    group = {"input_ids": [5, 6, 7, 8, 9], "completion_tokens": [2, 1], "rewards": [1.0, 0.0]}
    with pytest.raises(ConfigError, match=r"^mask_truncated_completions: stored rollouts do not mark the .* set it "):
        lm.objective.loss(lm.handle, GroupCollator()(Pack([group], step=step_totals([3]))))


# Groups of one size, as TRL's generation batch needs (G = 3), prompts of one length (see ORACLE_SHAPES).
EQUAL_GROUPS = [(5, [4, 1, 6]), (5, [2, 9, 3]), (5, [3, 3, 5])]


def sampler_moved(model, groups, seed=2, spread=3.0):
    """Each group with the sampler's log-probs: the model's own, moved by up to +-spread/2 a token (weights
    exp(old - sampler) from 0.2 to 4.5: some over the cap of 3, some under 1), fp32 values: TRL reads the sampler's
    log-probs into a float32 tensor."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        own = logps_of(model, GroupCollator()(groups)).logps
    moved = (own + (torch.rand(own.shape, generator=gen, dtype=own.dtype) - 0.5) * spread).float().double()
    out, start = [], 0
    for group in groups:
        n = sum(group["completion_tokens"])
        out.append({**group, BEHAVIOUR_LOGPS: moved[start : start + n].tolist()})
        start += n
    return out


def trl_rows(groups, key):
    """Per completion (a TRL row): its prompt's ids, its ids, or its tokens' values of `key` (flat per group)."""
    rows = []
    for group in groups:
        ids, sizes = group["input_ids"], group["completion_tokens"]
        prompt = len(ids) - sum(sizes)
        start = 0
        for size in sizes:
            rows.append({"prompt": ids[:prompt], "completion": ids[prompt + start : prompt + start + size],
                         "values": group[key][start : start + size] if key else None})  # fmt: skip
            start += size
    return rows


@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["no_kl", "kl"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_the_sampler_weight_and_the_first_steps_loss_are_trls_on_its_generation_batch(loss_type, beta):
    """fp64, a round's first step, correction on: the completions and the sampler's log-probs handed to TRL's
    generation batch as vLLM hands them. TRL's old log-probs (its no-grad forward of the policy) are the training
    forward's own; its truncated weights are `sampler_weights`' (some at the cap, some under 1); the first step's loss
    and every gradient equal TRL's `compute_loss` (the KL not weighted), and so do the logged mean and largest
    |trainer - sampler| and the weights' mean."""
    from lit_packing.models import GRPO
    from tests.helpers.trl_generation import trl_generation_batch

    policy = packed_model(CONFIG, seed=0).double()
    reference = packed_model(CONFIG, seed=1).double().eval() if beta else None
    trl_model = tiny_model(CONFIG, seed=0).double()
    groups = sampler_moved(policy, make_groups(EQUAL_GROUPS))
    rows = trl_rows(groups, BEHAVIOUR_LOGPS)
    width = max(len(row["completion"]) for row in rows)
    ref = None
    if beta:
        with torch.no_grad():
            ref = _as_padded(logps_of(reference, GroupCollator(share_prompt=False)(groups)).logps, groups, width)
    high = 1.1 if loss_type == "cispo" else 0.28
    out, trl_loss, trl_metrics = trl_generation_batch(
        trl_model, [r["prompt"] for r in rows], [r["completion"] for r in rows], [r["values"] for r in rows],
        {"length": lambda prompts, completions, **kw: [float(len(c) % 3) for c in completions]}, group_size=3,
        cap=3.0, loss_type=loss_type, beta=beta, ref_per_token_logps=ref, epsilon=0.2, epsilon_high=high,
    )  # fmt: skip
    trl_loss.backward()
    mask = out["completion_mask"].bool()

    objective = GRPO(loss_type, epsilon_high=high, beta=beta, importance_sampling_cap=3.0)
    [batch] = attach_step([GroupCollator()(groups)])
    policy.zero_grad()
    logps = logps_of(policy, batch)
    old, weights, difference = objective.old_logps(logps.logps, batch[BEHAVIOUR_LOGPS], {"on_policy": True})
    torch.testing.assert_close(old, out["old_per_token_logps"][mask], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(weights, out["importance_sampling_ratio"][mask], rtol=1e-10, atol=1e-12)
    assert (weights == 3.0).any() and (weights < 1).any()  # the cap and the other side both in play
    advantages = out["advantages"].double()  # TRL's, from its float32 rewards: the loss is compared, not them
    parts = grpo_loss(logps, advantages, objective.settings, old,
                      logps_of(reference, batch).logps.detach() if beta else None, weights=weights)  # fmt: skip
    ours = parts.loss_sum / batch[STEP][objective.normalizer]
    ours.backward()
    assert float(ours.detach()) == pytest.approx(float(trl_loss), rel=1e-10, abs=1e-13)
    assert_grads_close({n: p.grad for n, p in policy.named_parameters() if p.grad is not None},
                       {n: p.grad for n, p in trl_model.named_parameters() if p.grad is not None}, True)  # fmt: skip
    assert float(difference.mean()) == pytest.approx(trl_metrics["sampling/sampling_logp_difference/mean"], rel=1e-10)
    assert float(difference.max()) == pytest.approx(trl_metrics["sampling/sampling_logp_difference/max"], rel=1e-10)
    total, count = parts.metrics["sampling/importance_sampling_ratio/mean"]
    assert float(total / count) == pytest.approx(trl_metrics["sampling/importance_sampling_ratio/mean"], rel=1e-10)


def test_the_old_log_probs_are_the_trainers_and_the_sampler_enters_as_a_weight():
    """`GRPO.old_logps` on each kind of batch, exact: stored rollouts take the data's behaviour log-probs as they
    are; a round's first step the training forward's own (detached), weighted by min(exp(old - sampler), cap); a
    later step of a half-precision round the round's pass (`old_logps`); a later step at full precision the
    sampler's, which are the trainer's to rounding (no weight); correction off, no weight anywhere."""
    from lit_packing.models import GRPO

    logps = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    sampler = torch.tensor([-1.0, -3.5, -0.25], dtype=torch.float64)
    weighted = GRPO(importance_sampling_cap=3.0)
    old, weights, difference = weighted.old_logps(logps, sampler, None)  # stored rollouts
    assert old is sampler and weights is None and difference is None
    old, weights, difference = weighted.old_logps(logps, sampler, {"on_policy": True})
    assert torch.equal(old, logps.detach()) and not old.requires_grad
    torch.testing.assert_close(weights, torch.tensor([1.0, 3.0, torch.e**-0.25], dtype=torch.float64))  # e^1.5 capped
    torch.testing.assert_close(difference, torch.tensor([0.0, 1.5, 0.25], dtype=torch.float64))
    old, weights, difference = weighted.old_logps(logps, sampler, {"on_policy": False, "old_logps": [-1.5, -3, 0]})
    torch.testing.assert_close(old, torch.tensor([-1.5, -3.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(weights, torch.tensor([torch.e**-0.5, torch.e**0.5, torch.e**0.25], dtype=torch.float64))
    assert difference is None
    old, weights, difference = weighted.old_logps(logps, sampler, {"on_policy": False})
    assert old is sampler and weights is None and difference is None
    unweighted = GRPO(importance_sampling_correction=False)
    old, weights, difference = unweighted.old_logps(logps, sampler, {"on_policy": True})
    assert torch.equal(old, logps.detach()) and weights is None and difference is not None


def test_the_weight_scales_each_tokens_policy_loss_not_its_kl():
    """dapo, one completion of 2 tokens on its first step (ratio 1, advantage 1): the loss is -sum_t w_t + beta
    sum_t k3_t, and the gradient of the policy term w_t times the plain one."""
    settings = GRPOSettings("dapo", beta=0.5)
    pi = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    policy = CompletionLogps(pi, torch.zeros(2, dtype=torch.float64), torch.tensor([0, 0]), 1)
    reference = torch.tensor([-1.5, -2.0], dtype=torch.float64)
    weights = torch.tensor([2.0, 0.5], dtype=torch.float64)
    parts = grpo_loss(policy, torch.tensor([1.0], dtype=torch.float64), settings, None, reference, weights=weights)
    k3 = (reference - pi).exp() - (reference - pi) - 1
    assert float(parts.loss_sum) == pytest.approx(float(-(weights.sum()) + 0.5 * k3.sum()), rel=1e-15)
    parts.loss_sum.backward()
    d_k3 = 0.5 * (1 - (reference - pi.detach()).exp() + k3.detach())  # d(k3 * ratio)/dpi at ratio 1
    torch.testing.assert_close(pi.grad, -weights + d_k3)
    assert parts.metrics["sampling/importance_sampling_ratio/mean"][0] == pytest.approx(2.5)


@pytest.mark.parametrize(
    ("precision", "passes", "stops"),
    [("32-true", 9e-4, 2e-3), ("64-true", 9e-4, 2e-3), ("bf16-mixed", 0.09, 0.11), ("bf16-true", 0.09, 0.11),
     ("16-mixed", 0.04, 0.06)],
)  # fmt: skip
def test_the_self_test_judges_the_mean_difference_at_the_precisions_tolerance(precision, passes, stops):
    """`GRPO.check_step` on a round's first step, at every precision: the largest difference of the step is logged,
    the mean is judged against the precision's tolerance (never skipped), and `sampler_tolerance` overrides it."""
    from lit_packing.errors import TrainingError
    from lit_packing.models import GRPO, objectives

    logged = {}
    log = lambda name, value: logged.update({name: float(value)})  # noqa: E731
    lm = objectives.ModelHandle(None, None, step=lambda: 4, precision=lambda: precision, log=log)  # on step 5
    objective = GRPO()
    objective._keep_largest(lm, torch.tensor(0.75, dtype=torch.float64))
    objective.check_step(lm, {"sampler_logp_diff": passes})
    assert logged == {"train/sampler_logp_diff_max": 0.75}
    with pytest.raises(TrainingError) as stopped:
        objective.check_step(lm, {"sampler_logp_diff": stops})
    message = str(stopped.value)
    assert f"on-policy step 5: the training forward scores the sampled tokens {stops:.2e} away" in message
    assert f"7.50e-01 at most; allowed {objectives.sampler_tolerance(precision):g} at precision {precision}" in message
    assert message.endswith("raise model.objective.init_args.sampler_tolerance") and "\n" not in message
    GRPO(sampler_tolerance=2 * stops).check_step(lm, {"sampler_logp_diff": stops})
    GRPO().check_step(lm, {"reward": 1.0})  # not a round's first step: nothing judged, nothing logged
    assert logged == {"train/sampler_logp_diff_max": 0.0}  # a new objective: nothing kept for this step


def test_every_micro_batch_names_the_same_metrics_on_policy_or_not():
    """The step sums its micro-batches' metrics as one vector, all-reduced over the ranks: stored rollouts, a round's
    first step, a later step and an empty pack (a rank with no group in the step) name the same metrics, in one
    order (the on-policy ones (0, 0) where a batch has none)."""
    from lit_packing.batch import ROUND
    from lit_packing.models import GRPO, PackedCausalLM

    lm = PackedCausalLM(model_config=CONFIG, objective=GRPO(), memory_check=False)
    groups = with_behaviour(packed_model(CONFIG, seed=0), make_groups())
    [batch] = attach_step([GroupCollator()(groups)])
    [empty] = attach_step([GroupCollator()(Pack([], step=batch[STEP]))])
    flags = truncated_flags(groups)
    batches = [batch, {**batch, ROUND: {"on_policy": True, "truncated": flags}},
               {**batch, ROUND: {"on_policy": False, "truncated": flags}},
               {**empty, ROUND: {"on_policy": True, "truncated": []}}]  # fmt: skip
    named = [list(lm.objective.loss(lm.handle, b)[1]) for b in batches]
    assert all(names == named[0] for names in named), named
    assert {"sampler_logp_diff", "sampling/importance_sampling_ratio/mean"} <= set(named[0])
