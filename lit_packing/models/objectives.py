"""Training objectives, one seam: what `PackedCausalLM` minimises, chosen in YAML as samplers are.

    model:
      objective: dpo                                        # a name: sft | dpo | ipo | simpo | orpo
      objective:                                            # or a class, with its own settings
        class_path: lit_packing.models.GRPO
        init_args: {loss_type: dapo, epsilon: 0.2}

An objective sees the model through a narrow handle (`ModelHandle`: the policy's forward, the reference's, the
precomputed reference tables, and the step it is on), says what it reads from a batch, returns its loss as a sum
over the micro-batch with the sums of its metrics, names the optimizer step's total it is divided by (`normalizer`:
a key of `batch["step"]`, counted by the plan on the host before the step, so the split of a step into
micro-batches and ranks never changes the gradient), and evaluates.
`PackedCausalLM` calls these and nothing else; it never branches on an objective's name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lit_packing.batch import (
    ADVANTAGES,
    BEHAVIOUR_LOGPS,
    COMPLETIONS,
    GROUPS,
    LABELS,
    PAIRS,
    REWARDS,
    ROUND,
    ROWS,
    TOKEN_ADVANTAGES,
)
from lit_packing.errors import ConfigError, DataError, TrainingError, check_range
from lit_packing.models.grpo import (
    GRPOSettings,
    batch_advantages,
    completion_logps,
    group_advantages,
    grpo_loss,
    sampler_weights,
)
from lit_packing.models.loss import LossNormalization, LossParts, causal_lm_loss, eval_sums
from lit_packing.models.preference import (
    PreferenceSettings,
    pair_logps,
    preference_loss,
    preference_metrics,
    preference_settings,
)

REFERENCES = ("precomputed", "copy", "lora")  # model.reference: where an objective takes reference log-probs from
FULL_PRECISION = ("32-true", "64-true", "32", "64")  # where the sampler's and the trainer's log-probs agree to rounding
# The largest mean |log-prob difference| per token between the sampler and the training forward on an on-policy
# round's first step, by the precision's first word: rounding at full precision (1e-7 measured in fp32), the
# precision's own error in half precision (0.030 measured: SmolLM2-135M sampling in fp32, training in bf16-mixed;
# fp16 keeps 3 bits more): a sampler that tokenizes or computes otherwise is off by whole nats where it errs.
SAMPLER_TOLERANCE = {"64": 1e-3, "32": 1e-3, "16": 0.05, "bf16": 0.1}


@dataclass(frozen=True)
class ModelHandle:
    """What an objective sees of the model it trains (`PackedCausalLM.handle`), and nothing else of it.

    Attributes:
        outputs: the policy's forward: what the loss reads of a batch (logits, or the head's inputs).
        reference: `reference(batch, read)`: `read(outputs, batch)` of the reference model's forward, no gradient
            (the frozen copy, or the model with its adapter off).
        precomputed: the reference's precomputed tables (`reference.PrecomputedReference`), or None.
        step: the optimizer step the trainer is on (-1 outside a fit).
        precision: the trainer's precision (`bf16-mixed`; `32-true` outside a fit).
        reduce_max: a tensor's maximum over every rank (the tensor itself on one).
        log: logs a step metric (`train/...`).
    """

    outputs: Callable[[Mapping[str, Any]], Any]
    reference: Callable[[Mapping[str, Any], Callable[[Any, Mapping[str, Any]], Any]], Any]
    precomputed: Any = None
    step: Callable[[], int] = lambda: -1
    precision: Callable[[], str] = lambda: "32-true"
    reduce_max: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
    log: Callable[[str, torch.Tensor], None] = lambda name, value: None


def sampler_tolerance(precision: str) -> float:
    """The self-test's tolerance at a trainer's `precision` (`bf16-mixed` -> bf16's); an unknown one: bf16's."""
    return SAMPLER_TOLERANCE.get(str(precision).split("-")[0], SAMPLER_TOLERANCE["bf16"])


class Objective:
    """The seam. Subclasses set `normalizer` (and `eval_metrics`, `needs_reference` where they differ) and implement
    `loss` and `evaluate`.

    Attributes:
        normalizer: the key of the optimizer step's totals (`batch["step"]`) the step's loss sum is divided by:
            `label_tokens` or `sequences` (items with a label: examples, pairs, or a group's completions).
        needs_reference: whether a reference model's log-probs enter the loss (`model.reference` says where from).
        reference_keys: the reference settings this objective takes (`precomputed`, `copy`, `lora`).
        temperature: log-probs are of logits / temperature (GRPO's; 1 for the others)
        eval_metrics: what `evaluate`'s accuracy is logged as (`<stage>/<name>`); `perplexity` is exp(loss).
    """

    normalizer: str = "label_tokens"
    needs_reference: bool = False
    reference_keys: tuple[str, ...] = REFERENCES
    temperature: float = 1.0  # the log-probs' (GRPO's sampling temperature): a precomputed reference's too
    eval_metrics: tuple[str, ...] = ("perplexity", "token_accuracy")

    def check(self, reference: str, lora: dict | None) -> None:
        """Refuse, in one line naming the setting, a reference this objective cannot take."""
        if not self.needs_reference:
            return
        if reference not in self.reference_keys:
            raise ConfigError("reference", f"{type(self).__name__} cannot take its reference {reference!r}",
                              f"use {' or '.join(self.reference_keys)}")  # fmt: skip
        if reference == "lora" and not lora:
            raise ConfigError("reference", "lora takes the reference from the model with its adapter disabled",
                              "set {lora} (LoraConfig kwargs) or {reference}=copy")  # fmt: skip

    def loss(
        self, model: ModelHandle, batch: Mapping[str, Any]
    ) -> tuple[LossParts, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """This micro-batch's `LossParts` (`objective` is the sum to divide by the step's `normalizer` total,
        `token_loss_sum` / `label_tokens` what `train/loss` logs) and its metrics as (sum, count) each: logged as
        the step's sum over its count, over every micro-batch and rank."""
        raise NotImplementedError

    def evaluate(self, model: ModelHandle, batch: Mapping[str, Any], stage: str) -> tuple[torch.Tensor, ...]:
        """Validation sums of a batch: (loss sum, count, correct), summed over steps and ranks by `EvalTotals`."""
        raise NotImplementedError

    def check_step(self, model: ModelHandle, metrics: Mapping[str, float]) -> None:
        """Stop the run where a step's metrics (means over the step's micro-batches and ranks, the same on every
        rank) show it cannot be trained as it should: nothing to check by default."""

    def round_advantages(self, rows: list[dict]) -> list[list[float]] | None:
        """The advantages of an on-policy round's groups where they depend on the whole round; None: none here."""
        return None


# What each objective trains, by the batch key its collator writes, and the settings that give it.
_BATCHES = {
    PAIRS: ("preference pairs", "data.collator=lit_packing.data.PairCollator and model.objective=dpo "
            "(configs/dpo.yaml)"),
    COMPLETIONS: ("rollout groups", "data.collator=lit_packing.data.GroupCollator and model.objective="
                  "lit_packing.models.GRPO (configs/grpo.yaml)"),
}  # fmt: skip


def check_batch(objective: Objective, batch: Mapping[str, Any], trains: str | None) -> None:
    """Refuse, in one line, a batch of another kind than the objective trains (`trains`: the key its collator
    writes, None for single sequences): a pair or group read as sequences would train the wrong tokens."""
    found = next((key for key in _BATCHES if key in batch), None)
    if found == trains:
        return
    name = type(objective).__name__
    if trains is None:
        what, fix = _BATCHES[found]
        raise ConfigError("model.objective", f"{name} got a batch of {what}", f"set {fix}")
    what, fix = _BATCHES[trains]
    got = _BATCHES[found][0] if found else "single sequences"
    raise ConfigError("data.collator", f"{name} trains {what}, the batch holds {got}", f"set {fix}")


class SFT(Objective):
    """Next-token cross-entropy on the label tokens, one mean over the step's tokens (`token`) or over its
    examples of each example's token mean (`sequence`, LongAlign)."""

    def __init__(self, normalization: LossNormalization = "token") -> None:
        self.normalization = normalization
        self.normalizer = "label_tokens" if normalization == "token" else "sequences"

    def loss(self, model, batch):
        check_batch(self, batch, None)
        return causal_lm_loss(model.outputs(batch), batch, self.normalization), {}

    def evaluate(self, model, batch, stage):
        check_batch(self, batch, None)
        return eval_sums(model.outputs(batch), batch[LABELS])


class Preference(Objective):
    """DPO, IPO, SimPO or ORPO on packed pairs (`preference.py`), the loss the mean over the step's pairs;
    evaluated as the loss over pairs and how often the chosen side out-rewards the rejected one."""

    normalizer = "sequences"  # a pair is one item of the plan
    eval_metrics = ("reward_accuracy",)

    def __init__(self, settings: PreferenceSettings) -> None:
        self.settings = settings
        self.needs_reference = settings.needs_reference

    def parts(self, model, batch, stage: str):
        """The policy's log-probs of the batch's pairs against the reference's: read from the precomputed table, or
        computed by the reference's forward; none for an objective without a reference (simpo, orpo)."""
        check_batch(self, batch, PAIRS)
        policy = pair_logps(model.outputs(batch), batch)
        reference = None
        if model.precomputed is not None:
            reference = model.precomputed.lookup(stage, batch.get(ROWS, []), policy)
        elif self.needs_reference:
            reference = model.reference(batch, pair_logps)
        return preference_loss(policy, reference, self.settings)

    def loss(self, model, batch):
        parts = self.parts(model, batch, "train")
        pairs = torch.tensor(float(len(parts.chosen_rewards)), device=parts.loss_sum.device)
        metrics = {name: (total, pairs) for name, total in preference_metrics(parts).items()}
        return LossParts(parts.loss_sum, pairs, parts.loss_sum, pairs), metrics

    def evaluate(self, model, batch, stage):
        parts = self.parts(model, batch, stage)
        pairs = torch.tensor(len(parts.chosen_rewards), device=parts.loss_sum.device)
        return parts.loss_sum, pairs, (parts.chosen_rewards > parts.rejected_rewards).sum()


class GRPO(Objective):
    """Policy gradient on packed rollout groups (GRPO and its relatives: `grpo.py`), each prompt run once
    (data.collator `GroupCollator`); TRL's `GRPOTrainer` settings and meanings. The reference (`beta` > 0) is
    precomputed once on stored rollouts (`model.reference: precomputed`, per completion token), a frozen copy
    (`copy`) or the model with its adapter off (`lora`); on-policy rounds take `copy` or `lora`. Logs `train/reward`,
    `train/advantage`, `train/kl`, `train/entropy`, `train/completion_length` and the clip fractions.

    On an on-policy round the ratio's old log-probs are the trainer's, of the policy that sampled: the training
    forward's own (detached) on the round's first step, after it the round's no-grad pass (`batch["round"]
    ["old_logps"]`, half precision) or the sampler's (full precision, where the first step's self-test holds the two
    equal to rounding). The sampler's log-probs enter as the truncated importance weight
    (`importance_sampling_correction`). The first step logs `train/sampler_logp_diff` (mean |difference| per token)
    and `train/sampler_logp_diff_max` at every precision, and stops the run where the mean passes the precision's
    tolerance (`SAMPLER_TOLERANCE`, or `sampler_tolerance`).

    Args:
        loss_type: grpo | dr_grpo | dapo | bnpo | cispo | luspo.
        epsilon: the ratio's lower clip (1 - epsilon).
        epsilon_high: its upper clip (1 + epsilon_high; None: epsilon); cispo: the cap of its ratio.
        beta: the weight of the KL (k3) to the reference; 0 runs no reference.
        importance_sampling_level: `token`, or `sequence` (GSPO).
        max_completion_length: dr_grpo's constant: the generation limit of the completions.
        advantages: from rewards: `grpo` (the group's mean subtracted) or `rloo` (the mean of the others).
        scale_rewards: `group` (divided by the group's std), `batch` (by the std of the generation batch's rewards:
            on-policy rounds, whose sampler computes the advantages) or `none`.
        temperature: the sampling temperature (TRL's): log-probs of the logits divided by it; on-policy rounds are
            sampled at it; stored rollouts' `behaviour_logps` must be of the same.
        mask_truncated_completions: leave the completions that stopped at `max_new_tokens` without an
            end-of-sequence token out of the loss (TRL's; on-policy rounds, whose batches mark them).
        importance_sampling_correction: on-policy rounds: weight each token's policy loss by min(exp(trainer's
            old log-prob - sampler's), `importance_sampling_cap`) (TRL's `vllm_importance_sampling_correction`, mode
            `token_truncate`); 1 to rounding at full precision, where sampler and trainer agree.
        importance_sampling_cap: the weight's bound (TRL's `vllm_importance_sampling_clip_max`, 3.0).
        sampler_tolerance: the largest mean |log-prob difference| per token the first step of a round allows
            between the sampler and the training forward; None: the precision's (`SAMPLER_TOLERANCE`).
    """

    eval_metrics = ()

    def __init__(
        self,
        loss_type: str = "dapo",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        importance_sampling_level: str = "token",
        max_completion_length: int | None = None,
        advantages: str = "grpo",
        scale_rewards: str = "group",
        temperature: float = 1.0,
        mask_truncated_completions: bool = False,
        importance_sampling_correction: bool = True,
        importance_sampling_cap: float = 3.0,
        sampler_tolerance: float | None = None,
    ) -> None:
        self.settings = GRPOSettings(loss_type, epsilon, epsilon_high, beta, importance_sampling_level,
                                     max_completion_length, advantages, scale_rewards, temperature,
                                     mask_truncated_completions, importance_sampling_correction,
                                     importance_sampling_cap)  # fmt: skip
        check_range("sampler_tolerance", sampler_tolerance, 0, low_open=True)
        self.sampler_tolerance = sampler_tolerance
        self.normalizer = self.settings.normalizer
        self.needs_reference = beta > 0
        self.temperature = temperature
        self._largest: tuple[int, torch.Tensor] | None = None  # (step, this rank's largest sampler difference on it)

    def parts(self, model, batch, stage: str = "train"):
        """The loss parts of a group batch, the completions' advantages, and the policy's distance from the sampler
        on an on-policy round's first step (`check_step`)."""
        check_batch(self, batch, COMPLETIONS)
        temperature = self.settings.temperature
        policy = completion_logps(model.outputs(batch), batch, temperature)
        device = policy.logps.device
        if TOKEN_ADVANTAGES in batch:  # the data's, per completion token
            advantages = batch[TOKEN_ADVANTAGES].to(device)
        elif ADVANTAGES in batch:
            advantages = batch[ADVANTAGES].to(device)
        elif self.settings.scale_rewards == "batch" and len(batch[COMPLETIONS]):
            raise ConfigError("scale_rewards", "batch divides by the reward std of the whole generation batch, which "
                              "stored rollouts do not mark", "use it on-policy (data.source: OnPolicyRollouts), store "
                              "advantages, or use group")  # fmt: skip
        elif REWARDS in batch:
            advantages = group_advantages(batch[REWARDS].to(device), batch[GROUPS].to(device), self.settings)
        else:
            raise DataError("a micro-batch holds groups scored by different columns (rewards, advantages, "
                            "token_advantages): give every group of the data the same one")  # fmt: skip
        behaviour = batch[BEHAVIOUR_LOGPS].to(device) if BEHAVIOUR_LOGPS in batch else None
        old, weights, difference = self.old_logps(policy.logps, behaviour, batch.get(ROUND))
        reference = None
        if self.needs_reference and model.precomputed is not None:
            reference = model.precomputed.lookup_groups(stage, batch, policy)
        elif self.needs_reference:
            reference = model.reference(batch, lambda outputs, b: completion_logps(outputs, b, temperature).logps)
        trained = self.trained_completions(batch, device)
        per_token = TOKEN_ADVANTAGES in batch
        parts = grpo_loss(policy, advantages, self.settings, old, reference, per_token, trained, weights)
        return parts, advantages, difference

    def old_logps(
        self, logps: torch.Tensor, sampler: torch.Tensor | None, round_: Mapping[str, Any] | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The ratio's old log-probs (N,) (None: the policy's own, detached), the sampler's importance weights (N,)
        or None, and on a round's first step |trainer - sampler| per token (N,) for the self-test (else None).

        Stored rollouts: the data's behaviour log-probs, no weight. An on-policy round (`round_`, with the sampler's
        log-probs): the trainer's of the policy that sampled, the sampler's in the weight."""
        if round_ is None or sampler is None:
            return sampler, None, None
        difference = None
        if round_.get("on_policy"):  # the policy that sampled trains: its own forward is the trainer's
            old = logps.detach()
            difference = (old - sampler.to(old.dtype)).abs().double()
        elif round_.get("old_logps") is not None:  # the round's no-grad pass, before its first step
            old = torch.as_tensor(round_["old_logps"], dtype=logps.dtype, device=logps.device)
        else:  # full precision: the sampler's are the trainer's to rounding (the first step checked it)
            return sampler, None, None
        weights = None
        if self.settings.importance_sampling_correction:
            weights = sampler_weights(old, sampler, self.settings.importance_sampling_cap)
        return old, weights, difference

    def trained_completions(self, batch, device: torch.device) -> torch.Tensor | None:
        """(C,) bool, the completions the loss trains with `mask_truncated_completions` (those that ended with an
        end-of-sequence token, as the on-policy round marks them); None: all."""
        if not self.settings.mask_truncated_completions or not len(batch[COMPLETIONS]):
            return None
        truncated = batch.get(ROUND, {}).get("truncated")
        if truncated is None:
            raise ConfigError("mask_truncated_completions", "stored rollouts do not mark the completions that hit "
                              "the generation limit", "use it on-policy (data.source: OnPolicyRollouts) or set it "
                              "false")  # fmt: skip
        return ~torch.tensor(truncated, dtype=torch.bool, device=device)

    def loss(self, model, batch):
        parts, advantages, difference = self.parts(model, batch)
        metrics = dict(parts.metrics)
        completions = parts.metrics["completion_length"][1]
        if REWARDS in batch:
            metrics["reward"] = (batch[REWARDS].to(completions.device).double().sum(), completions)
        metrics["advantage"] = (advantages.detach().double().sum(), completions)
        # (sum, count) of the on-policy metrics, (0, 0) where a micro-batch has none (an empty pack, stored
        # rollouts), last: every micro-batch on every rank names the same metrics in one order, which the step
        # reduces as one vector
        zero = completions.new_zeros(())
        metrics["sampling/importance_sampling_ratio/mean"] = metrics.pop("sampling/importance_sampling_ratio/mean",
                                                                         (zero, zero))  # fmt: skip
        metrics["sampler_logp_diff"] = (zero, zero)
        if difference is not None:
            metrics["sampler_logp_diff"] = (difference.sum(), zero + len(difference))
            if len(difference):
                self._keep_largest(model, difference.max())
        loss = parts.loss_sum
        return LossParts(loss, parts.units, loss.detach(), parts.units.detach()), metrics

    def evaluate(self, model, batch, stage):
        parts, _, _ = self.parts(model, batch, stage)
        return parts.loss_sum, parts.units, parts.units.new_zeros(())

    def round_advantages(self, rows: list[dict]) -> list[list[float]] | None:
        """The advantages of an on-policy round's groups when they depend on the whole round (`scale_rewards:
        batch`), computed by the sampler and stored with the round; None: each group's own (computed per batch)."""
        if self.settings.scale_rewards != "batch":
            return None
        rewards = torch.tensor([r for row in rows for r in row["rewards"]], dtype=torch.float64)
        groups = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(row["rewards"]) for row in rows]))
        flat = batch_advantages(rewards, groups, self.settings).tolist()
        ends = torch.tensor([len(row["rewards"]) for row in rows]).cumsum(0).tolist()
        return [flat[a:b] for a, b in zip([0, *ends[:-1]], ends)]

    def _keep_largest(self, model, largest: torch.Tensor) -> None:
        """This rank's largest |trainer - sampler| of the step so far (a tensor: no device sync)."""
        step = model.step()
        if self._largest is not None and self._largest[0] == step:
            largest = torch.maximum(self._largest[1], largest)
        self._largest = (step, largest)

    def check_step(self, model, metrics):
        """The first-step self-test of on-policy rounds: logs the largest |log-prob difference| of the step's tokens
        over every rank (`train/sampler_logp_diff_max`), and stops the run where the mean (`sampler_logp_diff`)
        passes the precision's tolerance. The metrics are the same on every rank: all reduce, all stop."""
        diff = metrics.get("sampler_logp_diff")
        if diff is None:
            return
        step = model.step()
        largest = self._largest[1] if self._largest is not None and self._largest[0] == step else None
        largest = torch.zeros((), dtype=torch.float64) if largest is None else largest
        largest = model.reduce_max(largest)
        model.log("train/sampler_logp_diff_max", largest.double())
        precision = str(model.precision())
        tolerance = self.sampler_tolerance or sampler_tolerance(precision)
        if math.isfinite(diff) and diff <= tolerance:
            return
        raise TrainingError(
            f"on-policy step {step + 1}: the training forward scores the sampled tokens {diff:.2e} away from the "
            f"log-probs they were sampled with (mean per token, {float(largest):.2e} at most; allowed {tolerance:g} "
            f"at precision {precision}): the sampler and the trained model disagree (a chat template or special "
            "tokens that tokenize otherwise than they were sampled, or a model that computes otherwise with a KV "
            "cache); check model.attn_backend and data.tokenizer, or, where the difference is the precision's own, "
            "raise model.objective.init_args.sampler_tolerance"
        )


NAMED = ("sft", "dpo", "ipo", "simpo", "orpo")


def make_objective(objective: str | Objective, hparams: Mapping[str, Any]) -> Objective:
    """The objective of a `PackedCausalLM`: an `Objective` as given, or a named one built from the model's
    settings (`loss_normalization` for sft; `beta`, `simpo_gamma_beta_ratio` for the preference objectives); its
    reference setting checked."""
    if isinstance(objective, Objective):
        built = objective
    elif objective == "sft":
        built = SFT(hparams["loss_normalization"])
    elif objective in NAMED:
        settings = preference_settings(objective, hparams["beta"], hparams["simpo_gamma_beta_ratio"])
        built = Preference(settings)
    else:
        fix = f"use one of {', '.join(NAMED)} or an Objective's class_path (lit_packing.models.GRPO)"
        raise ConfigError("objective", f"{objective!r} is not an objective", fix)
    if hparams["reference"] not in REFERENCES:
        raise ConfigError("reference", f"{hparams['reference']!r} is not a reference", f"use {', '.join(REFERENCES)}")
    built.check(hparams["reference"], hparams["lora"])
    return built
