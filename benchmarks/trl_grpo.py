"""TRL's own GRPO loss on given rollout tensors: an oracle for the packed GRPO implementation.

`trl_grpo_loss_and_metrics` builds a real `trl.GRPOTrainer` (TRL 1.16) around the given model, offline and on the
model's device, in a few hundredths of a second: a tiny dataset, a zero reward function and the packaged SmolLM2
tokenizer as the processing class (the trainer only needs a tokenizer for its pad/eos ids; nothing is generated). It
then hands TRL's `GRPOTrainer.compute_loss` (-> `_compute_loss`) the micro-batch `inputs` dict exactly as
`_generate_and_score_completions` lays it out, so the loss, its normalisation, clipping, KL term and gradients are
TRL's code, not a re-implementation. vLLM, Liger, gradient checkpointing and mixed precision are off.

What the construction would otherwise do differently, and how it is handled:
- `beta != 0` makes `GRPOTrainer.__init__` load a reference model from `model.config.name_or_path` (the Hub, for a
  model built from a config). The reference log-probs are an input here, so the trainer is built with `beta=0.0` and
  `trainer.beta` / `trainer.args.beta` are set afterwards: `_compute_loss` reads only `self.beta`.
- `_compute_loss` divides by `self.current_gradient_accumulation_steps`, which `Trainer` only sets inside its training
  loop: it is set here to `args.gradient_accumulation_steps` (1 unless given: a step that is one micro-batch).
- `GRPOTrainer.__init__` patches `model.forward` (TRL's fused LM head, `trl.trainer.utils.add_fused_lm_head`), writes
  the tokenizer's pad id into `model.config` / `model.generation_config`, and reseeds the global RNGs: all three are
  restored when the call returns (the autograd graph of the returned loss does not need the patched forward).
- `self.model.training` picks the "train"/"eval" branch: the model is put in `train()` mode (`training=True`) for the
  call and its mode restored after.

`completion_only_head()` makes that head score the completion tokens only on any device, as it does on CUDA (see its
docstring): a throughput comparison on a CPU runs TRL's GPU layout, not its CPU fallback.

Precision: TRL's fused LM head (`trl.kernels.ChunkedLogProbFunction`) does the log-sum-exp in float32 (`tile.float()`),
whatever the model's dtype, so with a float64 model TRL's per-token log-probs, entropies and the gradient through them
carry float32 rounding (~1e-7 relative). `full_precision_logps=True` swaps only `_get_per_token_logps_and_entropies`
for a full-logits `log_softmax` in the model's dtype (same positions, temperature, masking and zeros at padding);
everything after it (`_compute_loss`) is still TRL's. Models with logit softcapping/scaling need the default path.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import tempfile
import unittest.mock
import warnings
from typing import Any

import numpy as np
import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")  # TRL 1.16's `loss_type` values


@functools.lru_cache(maxsize=1)
def packaged_tokenizer():
    """The packaged SmolLM2 tokenizer (offline): the processing class the trainer is built with."""
    from transformers import AutoTokenizer

    from lit_packing.assets import resolve_pretrained

    return AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False))


@functools.lru_cache(maxsize=1)
def _scratch_dir() -> str:
    return tempfile.mkdtemp(prefix="trl_grpo_oracle_")


def _zero_reward(prompts, completions, **kwargs):
    return [0.0] * len(prompts)


@contextlib.contextmanager
def _preserved(model: torch.nn.Module):
    """Undo what building and running the trainer changes outside it: RNGs, `model.forward`, pad ids, the mode."""
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())  # noqa: NPY002
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    had_forward, forward = "forward" in model.__dict__, model.__dict__.get("forward")
    configs = [c for c in (model.config.get_text_config(), getattr(model, "generation_config", None)) if c is not None]
    pad_ids = [(c, c.__dict__.get("pad_token_id", None)) for c in configs]
    training = model.training
    try:
        yield
    finally:
        random.setstate(rng[0])
        np.random.set_state(rng[1])  # noqa: NPY002
        torch.set_rng_state(rng[2])
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        if had_forward:
            model.forward = forward
        else:
            model.__dict__.pop("forward", None)
        for config, pad_id in pad_ids:
            config.pad_token_id = pad_id
        model.train(training)


@contextlib.contextmanager
def completion_only_head():
    """TRL's fused LM head as it runs on CUDA, on any device: it projects the completion tokens only.

    `add_fused_lm_head`'s forward (TRL 1.16, `trl/trainer/utils.py`) projects only the positions with a label
    (`hidden_states[mask]`, scattered back with `masked_scatter`) where `_use_triton(device)` holds (CUDA and XPU with
    Triton); elsewhere it projects every position, prompt and padding included (fixed tile shapes for Neuron's
    compiler), and zeroes them after. On a CPU that is (B x (P + C - 1)) / (completion tokens) times the head's GPU
    work. Inside this context the head takes the compact branch; how the kernel folds a tile (Triton or torch) is its
    own `trl.kernels.chunked_logprob._use_triton`'s choice, untouched. Raises AttributeError if TRL moves the name.
    """
    import trl.trainer.utils as trl_utils

    with unittest.mock.patch.object(trl_utils, "_use_triton", lambda device: True):
        yield


def build_trl_grpo_trainer(
    model,
    *,
    loss_type: str,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    processing_class=None,
    **config_kwargs,
):
    """A real `GRPOTrainer` (TRL's own `__init__`) around `model`, ready for `compute_loss` on one micro-batch.

    `config_kwargs` go to `GRPOConfig` (e.g. `delta`, `use_bias_correction_kl`, `top_entropy_quantile`,
    `entropy_coef`, `off_policy_mask_threshold`, `sapo_temperature_pos`, `temperature`, `gradient_accumulation_steps`,
    `steps_per_generation`, `scale_rewards`, `num_generations`). Mutates `model` (see the module docstring): call it
    inside `_preserved(model)`, as `trl_grpo_loss_and_metrics` does.
    """
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r} is not one of TRL 1.16's {LOSS_TYPES}")
    device = next(model.parameters()).device
    num_generations = config_kwargs.pop("num_generations", 2)
    settings: dict[str, Any] = dict(
        output_dir=_scratch_dir(), report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1,
        use_cpu=device.type == "cpu", bf16=False, fp16=False, gradient_checkpointing=False, use_vllm=False,
        use_liger_kernel=False, per_device_train_batch_size=num_generations, num_generations=num_generations,
        max_completion_length=max_completion_length, loss_type=loss_type, beta=0.0, epsilon=epsilon,
        epsilon_high=epsilon_high, importance_sampling_level=importance_sampling_level,
    )  # fmt: skip
    settings.update(config_kwargs)
    grpo_logger = logging.getLogger("trl.trainer.grpo_trainer")  # its GSPO / loss-type advice, at every build
    level = grpo_logger.level
    grpo_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecations (gradient_checkpointing)
            args = GRPOConfig(**settings)
            trainer = GRPOTrainer(
                model=model, reward_funcs=_zero_reward, args=args, train_dataset=datasets.Dataset.from_list(
                    [{"prompt": "x"}] * num_generations), processing_class=processing_class or packaged_tokenizer(),
            )  # fmt: skip
    finally:
        grpo_logger.setLevel(level)
    # The reference log-probs are given: set beta only now, so that __init__ does not load a reference model.
    trainer.beta = trainer.args.beta = beta
    # Set by Trainer's training loop only; `_compute_loss` divides by it (train mode).
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    return trainer


def _full_precision_logps(trainer):
    """`_get_per_token_logps_and_entropies` through the model's own (unfused) forward and a full `log_softmax`, in the
    model's dtype: the same values as TRL's fused head, without its float32 log-sum-exp."""

    def per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                      compute_entropy=False, compute_aux_loss=False, **multimodal):  # fmt: skip
        if compute_aux_loss or any(v is not None for v in multimodal.values()):
            raise NotImplementedError("full_precision_logps covers text-only, non-MoE models")
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        logps = (logits[:, -logits_to_keep - 1 : -1] / trainer.temperature).log_softmax(-1)
        valid = attention_mask[:, -logits_to_keep:].bool()  # TRL: labels -100 where attention_mask == 0 -> zeros
        per_token = logps.gather(-1, input_ids[:, -logits_to_keep:].unsqueeze(-1)).squeeze(-1).masked_fill(~valid, 0)
        entropy = None
        if compute_entropy:
            entropy = -(logps.exp() * logps).sum(-1).masked_fill(~valid, 0)
        return per_token, entropy, None

    return per_token_logps_and_entropies


def trl_grpo_loss_and_metrics(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    loss_type: str,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    importance_sampling_level: str = "token",
    old_per_token_logps: torch.Tensor | None = None,
    ref_per_token_logps: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    extra_inputs: dict[str, Any] | None = None,
    training: bool = True,
    full_precision_logps: bool = False,
    processing_class=None,
    **config_kwargs,
) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's GRPOTrainer loss of one micro-batch (a step that is one micro-batch), from TRL's own `_compute_loss`
    (with gradient to the model's parameters), and the metrics it logged for this call (`kl`, `entropy`,
    `clip_ratio/*`, ...: the last value of each list in `trainer._metrics[mode]`).

    Args:
        model: a Hugging Face causal LM (not PEFT); its mode, forward, pad ids and the RNGs are left as they were.
        prompt_ids, prompt_mask: (B, P), LEFT-padded, as TRL pads prompts.
        completion_ids, completion_mask: (B, C), right-padded; the mask is also the loss mask.
        advantages: (B,) one per completion.
        old_per_token_logps: (B, C) the sampling policy's; None: on-policy (ratios exactly 1).
        ref_per_token_logps: (B, C), needed when `beta != 0`.
        max_completion_length: `dr_grpo`'s divisor (default C).
        num_items_in_batch: the `dapo` / `cispo` divisor (default `completion_mask.sum()`).
        full_precision_logps: log-probs from full logits in the model's dtype instead of TRL's float32 fused head.
        config_kwargs: any other `GRPOConfig` field.
    """
    if beta != 0.0 and ref_per_token_logps is None:
        raise ValueError("beta != 0 needs ref_per_token_logps (TRL reads inputs['ref_per_token_logps'])")
    if max_completion_length is None:
        max_completion_length = completion_ids.size(1)  # only `dr_grpo` reads it: its constant divisor
    if num_items_in_batch is None:  # what `_generate_and_score_completions` sets: the loss tokens of the generation
        num_items_in_batch = completion_mask.sum()  # batch, here one micro-batch on one process
    inputs: dict[str, Any] = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": torch.as_tensor(num_items_in_batch, device=completion_mask.device),
    }
    if old_per_token_logps is not None:
        inputs["old_per_token_logps"] = old_per_token_logps
    if ref_per_token_logps is not None:
        inputs["ref_per_token_logps"] = ref_per_token_logps
    inputs.update(extra_inputs or {})

    with _preserved(model):
        trainer = build_trl_grpo_trainer(
            model, loss_type=loss_type, beta=beta, epsilon=epsilon, epsilon_high=epsilon_high,
            importance_sampling_level=importance_sampling_level, max_completion_length=max_completion_length,
            processing_class=processing_class, **config_kwargs,
        )  # fmt: skip
        if full_precision_logps:
            trainer._get_per_token_logps_and_entropies = _full_precision_logps(trainer)
        model.train(training)
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, inputs)
        mode = "train" if training else "eval"
        metrics = {name: values[-1] for name, values in trainer._metrics[mode].items() if values}
    return loss, metrics
