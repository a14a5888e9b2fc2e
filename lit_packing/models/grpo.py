"""Policy-gradient losses on packed rollout groups (GRPO and its relatives), as sums over the optimizer step.

    logps = completion_logps(HeadInputs(hidden, lm_head), batch)     # per completion token, prompt run once
    parts = grpo_loss(logps, advantages, GRPOSettings("dapo"), behaviour=None, reference=None)
    (parts.loss_sum / batch["step"]["label_tokens"]).backward()      # the step's units, counted by the plan

A group is one prompt and its G completions (`GroupCollator`: the prompt run once, each completion attending to it
and to itself). Per completion token t of completion i, with pi / old / ref the policy's, the old policy's (the
trainer's log-probs of the policy that sampled on an on-policy round; the behaviour log-probs of stored rollouts;
else the policy's own, detached) and the reference's log-probabilities, and A_i the completion's advantage:

    ratio     r = exp(pi - old)  (token);  GSPO (`importance_sampling_level: sequence`): exp(mean_t (pi - old)) per i
    surrogate -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)            grpo, dr_grpo, dapo, bnpo, luspo
              -min(r, epsilon_high).detach() A pi                            cispo
              x w, with `importance_sampling_correction` on an on-policy round (see `sampler_weights`)
    kl        beta r (exp(ref - pi) - (ref - pi) - 1)   added to each token's loss (k3, importance-corrected)

Where the sampler is not the trainer (`generate` in another precision than the training forward, or another
engine), the ratio is of the trainer's log-probs, so the sampler/trainer mismatch does not hide in it (a first step
would clip what only the precision moved); the sampler's log-probs s enter as TRL's truncated importance weight
(`vllm_importance_sampling_correction`, mode `token_truncate`): w = min(exp(old - s), cap) per token, detached.

Normalisation (what `loss_sum` is divided by: `normalizer`, a total of the whole optimizer step):

    grpo     sum_i mean_t loss_it               / the step's completions     (`sequences`)
    dr_grpo  sum_it loss_it / max_len           / the step's completions     (Dr. GRPO's constant: G x max_len)
    dapo     sum_it loss_it                     / the step's completion tokens (`label_tokens`)
    bnpo     as dapo (TRL: the micro-batch's tokens; equal on a step of one micro-batch)
    cispo    as dapo
    luspo    sum_i sum_t loss_it                / the step's completions

so the loss and its gradients are the same however the step's groups are packed, split into micro-batches or
spread over ranks. TRL's `grpo` and `bnpo` divide by the local micro-batch's completions / tokens (and then by the
accumulation steps): equal to these on a step of one micro-batch, different once a step is split.

`mask_truncated_completions` (TRL's) leaves the completions that stopped at the generation limit without an
end-of-sequence token out of the loss: their tokens' loss (surrogate and KL) and metrics are zero, so they move
nothing; their rewards still count in their group's advantages. The step's totals, counted by the plan before
anything is trained, still count them: the sequence-normalised types divide as TRL does (its mean over the
micro-batch's completions counts them too), the token-normalised ones by all the step's completion tokens, where
TRL's `num_items_in_batch` leaves the masked ones out.

Advantages from rewards (`advantages`): `grpo` subtracts the group's mean reward and divides by the group's std
(`scale_rewards: group`, + 1e-4 as TRL does), by the std of every reward of the generation batch (`batch`: an
on-policy round, whose advantages the sampler computes with `batch_advantages`) or not (`none`); `rloo` subtracts the
mean of the group's other rewards.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.checkpoint import checkpoint

from lit_packing.batch import COMPLETIONS, CU_SEQ_LENS_Q, LABELS
from lit_packing.errors import ConfigError, check_range
from lit_packing.models.loss import HeadInputs, batch_segments, label_sources

LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "luspo"]
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "luspo")
SEQUENCE_NORMALIZED = ("grpo", "dr_grpo", "luspo")  # divided by the step's completions; the others by its tokens
STD_EPS = 1e-4  # added to the std that scales advantages (TRL's)


@dataclass(frozen=True)
class GRPOSettings:
    """The loss's settings (TRL's `GRPOConfig` names and meanings).

    Args:
        loss_type: grpo | dr_grpo | dapo | bnpo | cispo | luspo (see the module docstring).
        epsilon: the lower clip of the ratio (1 - epsilon).
        epsilon_high: the upper clip (1 + epsilon_high; None: epsilon); cispo: the cap of its detached ratio.
        beta: the weight of the KL to the reference (0: no reference model runs).
        importance_sampling_level: `token` (a ratio per token) or `sequence` (GSPO: one per completion, the
            exponential of its mean token log-ratio).
        max_completion_length: dr_grpo's constant (the generation limit the completions were sampled under).
        advantages: `grpo` (the group's mean reward subtracted) or `rloo` (the mean of the group's other rewards).
        scale_rewards: `group` (divided by the group's reward std), `batch` (by the generation batch's: on-policy
            rounds only) or `none`.
        temperature: the sampling temperature: the completions' log-probs are the logits divided by it (on-policy
            rounds are sampled at it).
        mask_truncated_completions: leave the completions that hit the generation limit without an end-of-sequence
            token out of the loss (on-policy rounds, which mark them).
        importance_sampling_correction: on an on-policy round, weight each token's policy loss by the truncated
            importance weight of the trainer over the sampler (`sampler_weights`; TRL's
            `vllm_importance_sampling_correction` in mode `token_truncate`).
        importance_sampling_cap: the weight's upper bound (TRL's `vllm_importance_sampling_clip_max`).
    """

    loss_type: LossType = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    importance_sampling_level: Literal["token", "sequence"] = "token"
    max_completion_length: int | None = None
    advantages: Literal["grpo", "rloo"] = "grpo"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    temperature: float = 1.0
    mask_truncated_completions: bool = False
    importance_sampling_correction: bool = True
    importance_sampling_cap: float = 3.0

    def __post_init__(self) -> None:
        choices = {"loss_type": LOSS_TYPES, "importance_sampling_level": ("token", "sequence"),
                   "advantages": ("grpo", "rloo"), "scale_rewards": ("group", "batch", "none")}  # fmt: skip
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(name, f"{getattr(self, name)!r} is not a choice", f"use {', '.join(allowed)}")
        check_range("epsilon", self.epsilon, 0)
        check_range("beta", self.beta, 0)
        check_range("temperature", self.temperature, 0, low_open=True)
        check_range("importance_sampling_cap", self.importance_sampling_cap, 0, low_open=True)
        if self.epsilon_high is not None:
            check_range("epsilon_high", self.epsilon_high, 0)
        if self.loss_type == "cispo" and self.epsilon_high is None:
            raise ConfigError("epsilon_high", "cispo caps its ratio at epsilon_high itself (not 1 + epsilon_high)",
                              "set it, e.g. 5.0 (MiniMax-M1's value)")  # fmt: skip
        if self.loss_type == "dr_grpo" and not self.max_completion_length:
            raise ConfigError("max_completion_length", "dr_grpo divides by G x the generation limit",
                              "set it to the max_new_tokens the completions were sampled with")  # fmt: skip

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def normalizer(self) -> str:
        """The step total the loss sum is divided by: `sequences` (completions) or `label_tokens`."""
        return "sequences" if self.loss_type in SEQUENCE_NORMALIZED else "label_tokens"


@dataclass
class CompletionLogps:
    """Per completion token of a batch (in row order), its log-probability and entropy under the model, and which
    completion (0..C-1 in `batch["completions"]` order) it belongs to."""

    logps: torch.Tensor  # (N,) fp32 (fp64 for an fp64 model)
    entropy: torch.Tensor  # (N,) detached
    completion: torch.Tensor  # (N,) int64
    completions: int  # C


@dataclass
class GRPOParts:
    """One micro-batch's loss as a sum (divide by the step's `normalizer` total), its own count of that unit, and
    the sums of what is logged with the counts each is a mean over."""

    loss_sum: torch.Tensor
    units: torch.Tensor
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]]


def completion_logps(
    outputs: torch.Tensor | HeadInputs, batch: Mapping[str, Any], temperature: float = 1.0
) -> CompletionLogps:
    """Log-probabilities and entropies of every completion token of a group batch (`GroupCollator`, shared prompts
    or not), from logits (1, T, V) or `HeadInputs` (chunk by chunk: no (T, V) logits), of the distribution the
    completions were sampled from: the logits divided by the sampling `temperature` (as TRL scores them)."""
    where, sources = label_sources(batch)
    targets = batch[LABELS][0, where]
    if isinstance(outputs, HeadInputs):
        hidden = outputs.hidden[0].index_select(0, sources)
        logps, entropy = _chunked(outputs, hidden, targets, temperature)
    else:
        logps, entropy = _logps_entropy(outputs[0].index_select(0, sources), targets, temperature)
    segments = batch_segments(batch)[0, where]
    completions = batch[COMPLETIONS].to(segments.device)
    n = batch[CU_SEQ_LENS_Q].shape[0] - 1
    completion_of = torch.full((n,), -1, dtype=torch.int64, device=segments.device)
    completion_of[completions] = torch.arange(len(completions), device=segments.device)
    return CompletionLogps(logps, entropy, completion_of[segments], len(completions))


def _logps_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logprobs = (logits if temperature == 1 else logits / temperature).log_softmax(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logprobs.gather(-1, targets[:, None]).squeeze(-1), entropy.detach()


def _head_chunk(inputs: HeadInputs, temperature: float, hidden: torch.Tensor, targets: torch.Tensor):
    return _logps_entropy(inputs.logits(hidden), targets, temperature)


def _chunked(
    inputs: HeadInputs, hidden: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    compute = functools.partial(_head_chunk, inputs, temperature)
    if torch.is_grad_enabled() and hidden.requires_grad:
        compute = functools.partial(checkpoint, compute, use_reentrant=False)
    size = inputs.chunk_size
    parts = [compute(hidden[i : i + size], targets[i : i + size]) for i in range(0, max(len(targets), 1), size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _surrogate(ratio, advantage, pi, settings: GRPOSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each token's policy loss (N,) and where its ratio is clipped (the masks TRL logs)."""
    if settings.loss_type == "cispo":
        losses = -ratio.clamp(max=settings.high).detach() * advantage * pi
        return losses, {"cispo_clip_ratio": (ratio > settings.high) & (advantage > 0)}
    clipped = ratio.clamp(1 - settings.epsilon, 1 + settings.high)
    losses = -torch.minimum(ratio * advantage, clipped * advantage)
    low = (ratio < 1 - settings.epsilon) & (advantage < 0)
    high = (ratio > 1 + settings.high) & (advantage > 0)
    return losses, {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": low | high}


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, settings: GRPOSettings) -> torch.Tensor:
    """Each completion's advantage (C,) from its reward (C,) and its group (C,): see the module docstring. A group
    is whole in a micro-batch (an atom of the plan), so this needs no other micro-batch."""
    n = int(groups.max()) + 1 if len(groups) else 0
    size = torch.zeros(n, dtype=rewards.dtype, device=rewards.device).index_add_(0, groups, torch.ones_like(rewards))
    total = torch.zeros_like(size).index_add_(0, groups, rewards)
    mean = (total / size)[groups]
    if settings.advantages == "rloo":
        baseline = (total[groups] - rewards) / (size[groups] - 1).clamp_min(1)
        advantages = rewards - baseline
    else:
        advantages = rewards - mean
    if settings.scale_rewards == "group":
        squares = torch.zeros_like(size).index_add_(0, groups, (rewards - mean) ** 2)
        std = (squares / (size - 1).clamp_min(1)).sqrt()[groups]  # unbiased, as torch.std
        advantages = advantages / (std + STD_EPS)
    return advantages


def batch_advantages(rewards: torch.Tensor, groups: torch.Tensor, settings: GRPOSettings) -> torch.Tensor:
    """`scale_rewards: batch` (TRL's): each completion's advantage over its group (`advantages`), divided by the
    std of every reward of the generation batch (+1e-4): computed where the whole batch is, by the sampler."""
    centred = group_advantages(rewards, groups, dataclasses.replace(settings, scale_rewards="none"))
    return centred / (rewards.std() + STD_EPS)


def sampler_weights(old: torch.Tensor, sampler: torch.Tensor, cap: float) -> torch.Tensor:
    """Each token's truncated importance weight (N,) of the trainer's log-probs `old` over the sampler's
    `sampler`: min(exp(old - sampler), cap), no gradient (TRL's `vllm_importance_sampling_mode: token_truncate`).

    >>> sampler_weights(torch.tensor([-1.0, -1.0, -3.0]), torch.tensor([-1.0, -2.0, -1.0]), cap=2.0)
    tensor([1.0000, 2.0000, 0.1353])
    """
    return (old.detach() - sampler.to(old.dtype)).exp().clamp(max=cap)


def grpo_loss(
    policy: CompletionLogps,
    advantages: torch.Tensor,
    settings: GRPOSettings,
    behaviour: torch.Tensor | None = None,
    reference: torch.Tensor | None = None,
    per_token: bool = False,
    trained: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> GRPOParts:
    """The micro-batch's loss sum and metric sums (see the module docstring).

    Args:
        policy: the policy's completion-token log-probs (with gradient).
        advantages: (C,) one per completion, or with `per_token` (N,) one per completion token.
        settings: the loss's settings.
        behaviour: (N,) the old policy's log-probs per completion token (the ratio's denominator); None: the
            policy's own, detached (ratio 1).
        reference: (N,) the reference's log-probs per completion token (needed when `beta` > 0).
        trained: (C,) bool, the completions the loss trains (`mask_truncated_completions`); None: all of them.
        weights: (N,) each token's importance weight of the trainer over the sampler (`sampler_weights`),
            multiplying its policy loss (not the KL); logged as `sampling/importance_sampling_ratio/mean` (TRL's
            name). None: 1.
    """
    if settings.beta and reference is None:
        raise ConfigError("beta", "a KL to the reference needs the reference's log-probs", "set it to 0 or give them")
    pi, which, count = policy.logps, policy.completion, policy.completions
    old = pi.detach() if behaviour is None else behaviour.to(pi.dtype)
    tokens = torch.zeros(count, dtype=pi.dtype, device=pi.device).index_add_(0, which, torch.ones_like(pi))
    per_completion = lambda x: torch.zeros_like(tokens).index_add_(0, which, x)  # noqa: E731
    kept = torch.ones_like(pi, dtype=torch.bool) if trained is None else trained.to(pi.device)[which]  # (N,)
    log_ratio = pi - old
    sequence = settings.importance_sampling_level == "sequence"
    if sequence:  # GSPO: one ratio per completion, its mean token log-ratio's exponential
        log_ratio = (per_completion(log_ratio) / tokens.clamp_min(1))[which]
    ratio = log_ratio.exp()
    advantages = advantages.to(pi.dtype) if per_token else advantages.to(pi.dtype)[which]
    losses, clipped = _surrogate(ratio, advantages, pi, settings)
    n_tokens = kept.double().sum()
    if weights is not None:  # TRL: the policy loss times the weight, before the KL is added
        losses = losses * weights.detach().to(pi.dtype)
    completions = torch.tensor(float(count), dtype=torch.float64, device=pi.device)
    metrics = {  # clip fractions over tokens, or (GSPO) over completions (a masked one: never clipped), as TRL's
        name: ((per_completion((mask & kept).to(pi.dtype)) > 0).double().sum(), completions) if sequence
        else ((mask & kept).double().sum(), n_tokens)
        for name, mask in clipped.items()
    }  # fmt: skip
    metrics["entropy"] = (policy.entropy.double().masked_fill(~kept, 0).sum(), n_tokens)
    if weights is not None:
        weight_sum = weights.detach().double().masked_fill(~kept, 0).sum()
        metrics["sampling/importance_sampling_ratio/mean"] = (weight_sum, n_tokens)
    if settings.beta:
        delta = reference.to(pi.dtype) - pi
        kl = (delta.exp() - delta - 1) * ratio  # importance-corrected, as TRL's default (use_bias_correction_kl)
        losses = losses + settings.beta * kl
        metrics["kl"] = (kl.detach().double().masked_fill(~kept, 0).sum(), n_tokens)
    losses = torch.where(kept, losses, torch.zeros_like(losses))  # a masked completion's tokens: no loss, no gradient
    if settings.loss_type == "grpo":  # each completion's token mean
        loss_sum = (per_completion(losses) / tokens.clamp_min(1)).sum()
    elif settings.loss_type == "dr_grpo":
        loss_sum = losses.sum() / settings.max_completion_length
    else:  # dapo, bnpo, cispo (over the step's tokens), luspo (over its completions)
        loss_sum = losses.sum()
    metrics["completion_length"] = (tokens.double().sum(), completions)
    units = completions if settings.normalizer == "sequences" else n_tokens
    return GRPOParts(loss_sum, units.to(pi.dtype), metrics)
