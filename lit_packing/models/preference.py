"""Preference objectives on packed pairs: each sequence's log-probability summed at the collator's boundaries (the
label shift applied per sequence, the (T, V) logits never built), then DPO, IPO, SimPO or ORPO per pair.

    logps = pair_logps(HeadInputs(hidden, lm_head), batch)          # PairLogps: chosen / rejected sums and counts
    parts = preference_loss(logps, reference, PreferenceSettings("dpo", beta=0.1))
    (parts.loss_sum / step_pairs).backward()                         # pairs of the whole optimizer step

Why sums over pairs: the step's loss is the mean over every pair of the optimizer step (all micro-batches, all
ranks), so each micro-batch returns the sum over its pairs and the caller divides once by the step's pair count
(`batch["step"]["sequences"]`: a pair is one item of the plan). How pairs are packed or split never changes the
gradient; a token-weighted mean would weight a pair by its length.

Per pair, with pi / ref the policy's / reference's summed log-probabilities of the completion tokens (the prompt is
masked) and |y| the completion's token count:

    dpo    -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))                       (Rafailov et al., 2023)
    ipo    ((pi_c - ref_c) / |y_c| - (pi_r - ref_r) / |y_r| - 1 / (2 beta))^2    (Azar et al., 2023)
    simpo  -log sigmoid(beta * (pi_c / |y_c| - pi_r / |y_r|) - gamma_beta_ratio * beta)   (reference-free)
    orpo   -pi_c / |y_c|  -  lambda * log sigmoid(log odds(c) - log odds(r)),  odds(y) = p / (1 - p), p the
           per-token mean probability exp(pi / |y|)                                      (reference-free)

Rewards, as logged: beta * (pi - ref) for dpo / ipo, beta * pi / |y| for simpo / orpo.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from lit_packing.batch import CU_SEQ_LENS_Q, LABELS, PAIRS, PROMPTS
from lit_packing.errors import ConfigError, check_range
from lit_packing.models.loss import (
    HeadInputs,
    batch_segments,
    head_token_losses,
    label_sources,
    per_example_losses,
    predicted_losses,
    token_losses,
)

Objective = Literal["dpo", "ipo", "simpo", "orpo"]
OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")


@dataclass(frozen=True)
class PreferenceSettings:
    """The objective and its parameters (`model.objective`, `model.beta`, ...).

    Args:
        objective: dpo | ipo | simpo | orpo.
        beta: the inverse temperature of the reward (dpo, simpo), IPO's regulariser (its target margin is
            1 / (2 beta)), ORPO's weight of the odds-ratio term (lambda).
        simpo_gamma_beta_ratio: SimPO's target margin gamma, as a fraction of beta.
    """

    objective: Objective = "dpo"
    beta: float = 0.1
    simpo_gamma_beta_ratio: float = 0.5

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ConfigError(
                "objective", f"{self.objective!r} is not an objective", f"use one of {', '.join(OBJECTIVES)}"
            )
        check_range("beta", self.beta, 0, low_open=True)
        check_range("simpo_gamma_beta_ratio", self.simpo_gamma_beta_ratio, 0)

    @property
    def needs_reference(self) -> bool:
        return self.objective not in REFERENCE_FREE


@dataclass
class PairLogps:
    """Summed log-probabilities of each pair's completion tokens and their counts: four (P,) tensors."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    def detach(self) -> PairLogps:
        return PairLogps(*(t.detach() for t in (self.chosen, self.rejected, self.chosen_tokens, self.rejected_tokens)))


@dataclass
class PreferenceParts:
    """One micro-batch's preference loss as a sum over its pairs, and what is logged per pair.

    Attributes:
        loss_sum: sum over pairs of each pair's loss (divide by the optimizer step's pairs).
        chosen_rewards, rejected_rewards: (P,) detached.
        terms: (P,) detached per-pair terms of the objective (ORPO: `nll`, `odds_ratio`), summed by the caller.
    """

    loss_sum: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    terms: dict[str, torch.Tensor]


def sequence_logps(outputs: torch.Tensor | HeadInputs, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities of every segment's label tokens and their counts: two (S,) tensors, S the segments
    of `cu_seq_lens_q`. From logits (B, T, V) or `HeadInputs` (chunk by chunk, no (T, V) logits)."""
    if PROMPTS in batch:
        return _shared_prompt_logps(outputs, batch)
    if isinstance(outputs, HeadInputs):
        losses, mask, _ = head_token_losses(outputs, batch[LABELS])
    else:
        losses, mask, _ = token_losses(outputs, batch[LABELS])
    sums, counts = per_example_losses(losses, mask, batch_segments(batch), batch[CU_SEQ_LENS_Q].shape[0] - 1)
    return -sums, counts


def _shared_prompt_logps(outputs: torch.Tensor | HeadInputs, batch: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
    """`sequence_logps` of a row with shared prompts (`PairCollator(share_prompt=True)`): a continuation's first
    token is predicted from its prompt's last position (`loss.label_sources`)."""
    where, sources = label_sources(batch)
    losses = predicted_losses(outputs, sources, batch[LABELS][0, where])
    segments, n = batch_segments(batch)[0, where], batch[CU_SEQ_LENS_Q].shape[0] - 1
    sums = losses.new_zeros(n).index_add_(0, segments, losses)
    return -sums, losses.new_zeros(n).index_add_(0, segments, torch.ones_like(losses))


def pair_logps(outputs: torch.Tensor | HeadInputs, batch: Mapping[str, Any]) -> PairLogps:
    """The pairs' chosen and rejected log-probabilities of a batch from `PairCollator` (its `pairs` (P, 2))."""
    sums, counts = sequence_logps(outputs, batch)
    pairs = batch[PAIRS].to(sums.device)
    return PairLogps(sums[pairs[:, 0]], sums[pairs[:, 1]], counts[pairs[:, 0]], counts[pairs[:, 1]])


def preference_loss(policy: PairLogps, reference: PairLogps | None, settings: PreferenceSettings) -> PreferenceParts:
    """The summed per-pair loss of `settings.objective` (see the module docstring); `reference` is required by dpo
    and ipo, ignored by simpo and orpo."""
    beta, objective = settings.beta, settings.objective
    if settings.needs_reference and reference is None:
        raise ConfigError("reference", f"{objective} compares with a reference model", "give reference log-probs")
    terms: dict[str, torch.Tensor] = {}
    if objective == "dpo":
        chosen, rejected = policy.chosen - reference.chosen, policy.rejected - reference.rejected
        losses = -F.logsigmoid(beta * (chosen - rejected))
        chosen_reward, rejected_reward = beta * chosen, beta * rejected
    elif objective == "ipo":
        chosen = (policy.chosen - reference.chosen) / policy.chosen_tokens.clamp_min(1)
        rejected = (policy.rejected - reference.rejected) / policy.rejected_tokens.clamp_min(1)
        losses = (chosen - rejected - 1 / (2 * beta)) ** 2
        chosen_reward, rejected_reward = (
            beta * (policy.chosen - reference.chosen),
            beta * (policy.rejected - reference.rejected),
        )
    else:
        chosen = policy.chosen / policy.chosen_tokens.clamp_min(1)  # per-token mean log-probability
        rejected = policy.rejected / policy.rejected_tokens.clamp_min(1)
        chosen_reward, rejected_reward = beta * chosen, beta * rejected
        if objective == "simpo":
            losses = -F.logsigmoid(beta * (chosen - rejected) - settings.simpo_gamma_beta_ratio * beta)
        else:  # orpo: log odds = log p - log(1 - p), p = exp(mean log-probability)
            log_odds = (chosen - rejected) - (_log1m_exp(chosen) - _log1m_exp(rejected))
            odds_ratio = -F.logsigmoid(log_odds)
            terms = {"nll": (-chosen).detach(), "odds_ratio": odds_ratio.detach()}
            losses = -chosen + beta * odds_ratio
    return PreferenceParts(losses.sum(), chosen_reward.detach(), rejected_reward.detach(), terms)


def _log1m_exp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -ln 2."""
    x = x.clamp_max(-1e-6)
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def preference_settings(objective: str, beta: float, simpo_gamma_beta_ratio: float) -> PreferenceSettings:
    """The preference settings of a `PackedCausalLM` (`model.objective`, `model.beta`, ...), checked."""
    return PreferenceSettings(objective, beta, simpo_gamma_beta_ratio)


def preference_metrics(parts: PreferenceParts) -> dict[str, torch.Tensor]:
    """Sums over the micro-batch's pairs of what is logged per step (the caller divides by the step's pairs):
    `rewards_chosen`, `rewards_rejected`, `reward_margin`, `reward_accuracy` and the objective's own terms."""
    chosen, rejected = parts.chosen_rewards.float(), parts.rejected_rewards.float()
    sums = {
        "rewards_chosen": chosen.sum(),
        "rewards_rejected": rejected.sum(),
        "reward_margin": (chosen - rejected).sum(),
        "reward_accuracy": (chosen > rejected).float().sum(),
    }
    sums.update({name: term.float().sum() for name, term in parts.terms.items()})
    return {name: value.to(parts.loss_sum.device) for name, value in sums.items()}
