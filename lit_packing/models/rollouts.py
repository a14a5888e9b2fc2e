"""Rollout groups from a model: G sampled completions per prompt, with the sampler's log-probs of every token, as
the rows `GroupCollator` trains (and a JSON Lines file of them, `data.source` for `GRPO`, replays). What samples an
on-policy round (this module's `generate`, or vLLM) is a rollout engine (`models/engines.py`).

    groups = sample_groups(model, tokenizer, ["What is 2 + 3?"], group_size=8, max_new_tokens=64)
    groups[0]["completions"][0], groups[0]["behaviour_logps"][0]     # token ids, their log-probs when sampled

A prompt (a text, one user turn; or a list of chat messages) is rendered with the tokenizer's chat template and
its generation prompt, exactly as tokenization renders a group's prompt, so the stored token ids continue the
prompt the data module builds. A completion ends with an end-of-sequence token (kept: it is trained, as TRL
trains it): the tokenizer's, or any of the model generation config's `eos_token_id` (a list on many chat models),
or at `max_new_tokens`. Log-probs are the policy's when it sampled, `log_softmax(logits / temperature)` over the
whole vocabulary, as the objective scores them: a top-k / top-p cut (`top_k`, `top_p`) decides which tokens can be
drawn, not the log-probs stored (as TRL scores a policy sampled with a cut), so a first step on-policy has an
importance ratio of exactly 1 either way.

Every draw is from that distribution: `generate` fills each setting a call leaves unset from the model's
`generation_config`, and a model ships processors there that would change the draws and not the log-probs stored
(Qwen2.5-Instruct's `repetition_penalty` 1.05; `suppress_tokens`, `no_repeat_ngram_size`, `bad_words_ids`,
`min_new_tokens`, ...). Sampling sets the temperature, the cut, the limit and the end and pad ids, and nothing
else: the model's other fields are cleared for the call, and named once in the log.

A sharded policy (FSDP2, tensor parallel: `is_sharded`) runs every forward as a collective (each layer all-gathers
its shards), so every rank must run as many forwards as the others, whatever its prompts: `generate` steps all ranks
together (`synced_gpus`: a rank whose completions have all ended keeps running forwards, its draws stopped, until
every rank's have; transformers sets it by itself for DeepSpeed ZeRO-3 and FSDP1 only), and every rank makes as many
`generate` calls as the rank with the most prompts (agreed with one all-reduce; the extra calls run on a stand-in
prompt and their completions are dropped, after the real ones, so a rank's draws are the ones an unsharded policy
makes from the same seed).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers import GenerationConfig

from lit_packing.models.sharding import is_sharded, reshard

log = logging.getLogger(__name__)

Prompt = str | list[dict]  # a text (one user turn) or chat messages
RewardFunction = Callable[..., list[float | None]]  # (prompts, completions, **columns) -> a reward per completion
SAMPLER_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "max_new_tokens", "max_length")  # sampling sets these
# Fields no draw depends on: token ids (the end ids are taken), how generate runs, what it returns
NON_DRAW_FIELDS = (
    "eos_token_id",
    "pad_token_id",
    "bos_token_id",
    "decoder_start_token_id",
    "transformers_version",
    "use_cache",
    "cache_implementation",
    "cache_config",
    "compile_config",
    "disable_compile",
)
_said: set[str] = set()  # the log lines said once in this process
STAND_IN: Prompt = "Hi"  # what a rank with fewer prompts generates from in the calls it makes to keep step (dropped)


def end_of_sequence_ids(model, tokenizer) -> list[int]:
    """Every token that ends a completion: the tokenizer's end-of-sequence token and each of the model generation
    config's `eos_token_id` (one id, or a list: Qwen2.5-Instruct ends a turn at <|im_end|> and <|endoftext|>)."""
    shipped = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    listed = shipped if isinstance(shipped, (list, tuple)) else [shipped]
    return list(dict.fromkeys(int(i) for i in [tokenizer.eos_token_id, *listed] if i is not None))


def shipped_settings(model) -> dict[str, Any]:
    """The fields the model's `generation_config` sets that a draw depends on: what `generate` would add to one."""
    shipped = getattr(model, "generation_config", None)
    if shipped is None:
        return {}
    fields = shipped.to_diff_dict().items()
    return {k: v for k, v in fields if k not in NON_DRAW_FIELDS and not k.startswith(("_", "output_", "return_"))}


def prompt_ids(tokenizer, prompt: Prompt) -> list[int]:
    """A prompt's token ids: rendered with the chat template and its generation prompt, as tokenization renders a
    group's prompt, so sampled completions continue what the data module builds."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


@contextlib.contextmanager
def own_distribution(model) -> Iterator[None]:
    """`generate` with the model's `generation_config` blank for the call (restored after it): transformers fills
    every setting the call's config leaves unset from it, processors included."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model reads its base's
    shipped = hf.generation_config
    hf.generation_config = GenerationConfig()
    try:
        yield
    finally:
        hf.generation_config = shipped


def _say_cleared(model, temperature: float, top_k: int, top_p: float) -> None:
    """One log line, once, naming the model's generation-config fields sampling clears or replaces."""
    fields = shipped_settings(model)
    if not fields:
        return
    short = lambda v: f"[{len(v)} ids]" if isinstance(v, (list, tuple)) and len(v) > 4 else repr(v)  # noqa: E731
    cleared = ", ".join(f"{k}={short(v)}" for k, v in fields.items() if k not in SAMPLER_FIELDS)
    replaced = ", ".join(f"{k}={short(v)}" for k, v in fields.items() if k in SAMPLER_FIELDS)
    parts = [f"cleared {cleared}"] * bool(cleared) + [f"replaced {replaced}"] * bool(replaced)
    line = (f"sampling draws from the policy's own distribution (temperature {temperature}, top_k {top_k}, "
            f"top_p {top_p}: what the log-probs are stored at); of the model's generation_config it "
            f"{' and '.join(parts)}")  # fmt: skip
    if line not in _said:
        _said.add(line)
        log.info(line)


def synced_generation(model) -> bool:
    """Whether `model`'s forwards are collectives (a sharded policy in a process group): then every rank runs as many
    `generate` calls and forwards as the others (the module docstring)."""
    return is_sharded(model) and torch.distributed.is_initialized()


def compute_device(model) -> torch.device:
    """Where `model` computes: its parameters' device; a sharded parameter's mesh device, where FSDP2 gathers it for
    a forward (with `cpu_offload` the shards themselves stay on the host, where NCCL takes no tensor)."""
    param = next(model.parameters())
    if isinstance(param, DTensor) and param.device_mesh.device_type != param.device.type:
        return torch.device(param.device_mesh.device_type, torch.accelerator.current_device_index())
    return param.device


def agreed_calls(calls: int, device: torch.device) -> int:
    """The most `generate` calls any rank needs, on every rank: one all-reduce on the compute `device`."""
    most = torch.tensor([calls], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    return int(most.item())


@torch.no_grad()
def sample_groups(
    model,
    tokenizer,
    prompts: Sequence[Prompt],
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    batch_prompts: int = 8,
    top_k: int = 0,
    top_p: float = 1.0,
) -> list[dict]:
    """`group_size` sampled completions of each prompt: `[{"prompt", "completions" (token ids), "texts",
    "behaviour_logps"}]`, `batch_prompts` prompts (x group_size sequences) per `generate` call; `top_k` (0: off) and
    `top_p` (1: off) cut the tokens drawn from. A sharded `model` is called on every rank of its process group, each
    with its own prompts (none included): the ranks step together (the module docstring), and its gathered
    parameters are freed after."""
    torch.manual_seed(seed)
    device = compute_device(model)
    ends = end_of_sequence_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (ends or [0])[0]
    config = GenerationConfig(
        do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens,
        num_return_sequences=group_size, eos_token_id=ends or None, pad_token_id=pad, output_logits=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    _say_cleared(model, temperature, top_k, top_p)
    synced = synced_generation(model)
    chunks = [list(prompts[start : start + batch_prompts]) for start in range(0, len(prompts), batch_prompts)]
    calls = agreed_calls(len(chunks), device) if synced else len(chunks)
    groups = []
    for call in range(calls):
        chunk = chunks[call] if call < len(chunks) else [STAND_IN]
        tokens, picked = _generate(model, tokenizer, chunk, config, device, synced)
        if call >= len(chunks):
            continue  # a stand-in call: it kept this rank in step with the others
        for k, prompt in enumerate(chunk):
            completions, behaviour = [], []
            for row in range(k * group_size, (k + 1) * group_size):
                seq = tokens[row].tolist()
                n = next((i + 1 for i, token in enumerate(seq) if token in ends), len(seq))
                completions.append(seq[:n])
                behaviour.append([round(float(x), 6) for x in picked[row, :n]])
            texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
            groups.append({"prompt": prompt, "completions": completions, "texts": texts, "behaviour_logps": behaviour})
    if synced:
        reshard(model)  # no backward follows: the root's parameters, gathered since the first forward, freed
    return groups


def _generate(model, tokenizer, chunk: list[Prompt], config: GenerationConfig, device: torch.device,
              synced: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One `generate` call on `chunk`'s prompts (left-padded): the drawn tokens (n * G, new) and the policy's
    log-probs of each at the config's temperature, before any cut (n * G, new)."""
    encoded = [prompt_ids(tokenizer, prompt) for prompt in chunk]
    width = max(map(len, encoded))
    pad = config.pad_token_id
    ids = torch.tensor([[pad] * (width - len(x)) + x for x in encoded], device=device)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in encoded], device=device)
    with own_distribution(model):
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, synced_gpus=synced)
    tokens = out.sequences[:, width:]  # (n * G, new)
    steps = [(s.float() / config.temperature).log_softmax(-1).gather(-1, tokens[:, t, None])
             for t, s in enumerate(out.logits)]  # fmt: skip
    return tokens, torch.cat(steps, 1)


def score_groups(groups: list[dict], reward: RewardFunction, **columns: Sequence) -> None:
    """Add `rewards` to each group: `reward(prompts, completion texts, **columns)` per group, each column's value of
    that group repeated for its completions (as TRL calls reward functions); a None (the function does not score
    that completion) is kept as NaN, as TRL keeps it."""
    for k, group in enumerate(groups):
        n = len(group["completions"])
        extra = {name: [values[k]] * n for name, values in columns.items()}
        scores = reward([group["prompt"]] * n, group["texts"], **extra)
        group["rewards"] = [math.nan if r is None else float(r) for r in scores]


def math_answer(prompts: list, completions: list[str], answer: list, **columns) -> list[float | None]:
    """TRL's `accuracy_reward` on the `answer` column, with `math-verify` (the `rl` extra): 1.0 where the completion's
    answer (its first `\\boxed{}`, else a LaTeX answer after an anchor such as "the final answer is $11$"; a bare
    number in the text, hedged or not, is no answer, and two boxes are a set) is mathematically equal to the gold,
    0.0 where it is not or there is none; None (not scored) where the gold does not parse. A gold answer written as
    LaTeX without `$` (`\\pi`, `\\frac{\\sqrt2}{2}`) is parsed as LaTeX, any other as math-verify parses text (a
    number, `$...$`, `\\boxed{}`)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    main = threading.current_thread() is threading.main_thread()  # math-verify times out with signal.alarm
    parsing, verifying = (10, 5) if main else (None, None)
    extraction = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True), boxed_match_priority=0,
                                        try_extract_without_anchor=False)]  # fmt: skip
    rewards: list[float | None] = []
    for text, expected in zip(completions, answer):
        gold = str(expected)
        if "\\" in gold and "$" not in gold:  # bare LaTeX: as text, "3\pi" would parse as the number 3
            gold_parsed = parse(f"${gold}$", [LatexExtractionConfig()], parsing_timeout=parsing)
        else:
            gold_parsed = parse(gold, parsing_timeout=parsing)
        if not gold_parsed:
            rewards.append(None)
            continue
        parsed = parse(text, extraction, extraction_mode="first_match", parsing_timeout=parsing)
        rewards.append(float(verify(gold_parsed, parsed, timeout_seconds=verifying)))
    return rewards


math_answer.requires = ("math_verify", "rl")  # the module it imports, and the extra that installs it
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_number(prompts: list, completions: list[str], answer: list, **columns) -> list[float]:
    """A reward function: 1.0 where the completion's last number equals the `answer` column's, else 0.0."""
    rewards = []
    for text, expected in zip(completions, answer):
        numbers = _NUMBER.findall(text.replace(",", ""))
        rewards.append(float(bool(numbers) and float(numbers[-1]) == float(expected)))
    return rewards
