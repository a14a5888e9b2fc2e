"""TRL's own generation batch on given completions: an oracle for what an on-policy round computes before training.

    out, loss, metrics = trl_generation_batch(model, prompts, completions, sampler_logps, {"f": f}, group_size=3)

`GRPOTrainer._generate_and_score_completions` (TRL 1.16) runs as it does with vLLM, except that the completions and
the sampler's log-probs of their tokens are given (its `_tokenize_prompts` and `_generate_single_turn` return them)
instead of generated: the old log-probs (TRL's no-grad forward of the policy), the truncated importance weights
(`vllm_importance_sampling_correction`, mode `token_truncate`, `vllm_importance_sampling_clip_max` the cap), the
rewards, advantages and the metrics TRL logs (`reward_std`, `frac_reward_zero_std`, `rewards/<name>/mean`,
`completions/clipped_ratio`, `sampling/...`) are TRL's code. Then `compute_loss` on that batch (with a KL to given
reference log-probs where `beta` > 0). The trainer is `benchmarks.trl_grpo`'s (fp64 log-probs from full logits);
what it changes in the model is undone when the call returns.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.trl_grpo import _full_precision_logps, _preserved, build_trl_grpo_trainer


def trl_generation_batch(
    model,
    prompts: list[list[int]],
    completions: list[list[int]],
    sampler_logps: list[list[float]],
    reward_funcs: dict[str, Callable],
    *,
    group_size: int,
    cap: float = 3.0,
    loss_type: str = "dapo",
    beta: float = 0.0,
    ref_per_token_logps: torch.Tensor | None = None,
    **config,
) -> tuple[dict, torch.Tensor, dict[str, float]]:
    """TRL's generation batch of these completions (one per row; `prompts` the prompt of each, `group_size` rows a
    group), its loss (with gradient to `model`) and the metrics TRL logged (the last value of each).

    Args:
        sampler_logps: the sampler's log-prob of each completion token (as vLLM returns them).
        reward_funcs: TRL's reward functions by name, `(prompts, completions, **kwargs) -> list[float | None]`.
        ref_per_token_logps: (B, C) right-padded, for `beta` > 0.
        config: `GRPOConfig` fields (`epsilon_high`, `max_completion_length`, ...).
    """
    with _preserved(model):
        trainer = build_trl_grpo_trainer(model, loss_type=loss_type, num_generations=group_size, **config)
        trainer._get_per_token_logps_and_entropies = _full_precision_logps(trainer)
        trainer.use_vllm = True  # what vLLM's path computes: the old log-probs and the importance weights
        trainer.vllm_importance_sampling_correction = True
        trainer.vllm_importance_sampling_mode = "token_truncate"
        trainer.vllm_importance_sampling_clip_max, trainer.vllm_importance_sampling_clip_min = cap, None
        trainer.reward_funcs, trainer.reward_func_names = list(reward_funcs.values()), list(reward_funcs)
        trainer.reward_weights = torch.ones(len(reward_funcs))
        trainer.reward_processing_classes = [None] * len(reward_funcs)
        trainer._tokenize_prompts = lambda texts: (prompts, None, {})
        trainer._generate_single_turn = lambda *args, **kwargs: (completions, sampler_logps)
        model.train()
        out = trainer._generate_and_score_completions([{"prompt": "x"}] * len(completions))
        if beta:
            trainer.beta = trainer.args.beta = beta
            out["ref_per_token_logps"] = ref_per_token_logps
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, out)
        metrics = {name: values[-1] for name, values in trainer._metrics["train"].items() if values}
    return out, loss, metrics
