"""Rollout groups from a model: G sampled completions per prompt, with the sampler's log-probs of every token, as
the rows `GroupCollator` trains (and a JSON Lines file of them, `data.source` for `GRPO`, replays).

    groups = sample_groups(model, tokenizer, ["What is 2 + 3?"], group_size=8, max_new_tokens=64)
    groups[0]["completions"][0], groups[0]["behaviour_logps"][0]     # token ids, their log-probs when sampled

A prompt (a text, one user turn; or a list of chat messages) is rendered with the tokenizer's chat template and
its generation prompt, exactly as tokenization renders a group's prompt, so the stored token ids continue the
prompt the data module builds. A completion ends with the end-of-sequence token (kept: it is trained, as TRL
trains it) or at `max_new_tokens`. Log-probs are the policy's when it sampled, `log_softmax(logits / temperature)`
over the whole vocabulary, as the objective scores them: a top-k / top-p cut (`top_k`, `top_p`) decides which
tokens can be drawn, not the log-probs stored (as TRL scores a policy sampled with a cut), so a first step on-policy
has an importance ratio of exactly 1 either way.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch

RewardFunction = Callable[..., list[float]]  # (prompts, completions, **columns) -> one reward per completion


@torch.no_grad()
def sample_groups(
    model,
    tokenizer,
    prompts: Sequence[str | list[dict]],
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
    `top_p` (1: off) cut the tokens drawn from."""
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    groups = []
    for start in range(0, len(prompts), batch_prompts):
        chunk = list(prompts[start : start + batch_prompts])
        messages = [[{"role": "user", "content": p}] if isinstance(p, str) else list(p) for p in chunk]
        rendered = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
        encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in rendered]
        width = max(map(len, encoded))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in encoded], device=device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in encoded], device=device)
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
            max_new_tokens=max_new_tokens, num_return_sequences=group_size, output_logits=True,
            return_dict_in_generate=True, pad_token_id=pad, eos_token_id=eos,
        )  # fmt: skip
        tokens = out.sequences[:, width:]  # (n * G, new)
        steps = [(s.float() / temperature).log_softmax(-1).gather(-1, tokens[:, t, None])
                 for t, s in enumerate(out.logits)]  # fmt: skip
        picked = torch.cat(steps, 1)  # (n * G, new): the policy's log-probs at `temperature`, before any cut
        for k, prompt in enumerate(chunk):
            completions, behaviour = [], []
            for row in range(k * group_size, (k + 1) * group_size):
                seq = tokens[row].tolist()
                n = seq.index(eos) + 1 if eos in seq else len(seq)
                completions.append(seq[:n])
                behaviour.append([round(float(x), 6) for x in picked[row, :n]])
            texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
            groups.append({"prompt": prompt, "completions": completions, "texts": texts, "behaviour_logps": behaviour})
    return groups


def score_groups(groups: list[dict], reward: RewardFunction, **columns: Sequence) -> None:
    """Add `rewards` to each group: `reward(prompts, completion texts, **columns)` per group, each column's value of
    that group repeated for its completions (as TRL calls reward functions)."""
    for k, group in enumerate(groups):
        n = len(group["completions"])
        extra = {name: [values[k]] * n for name, values in columns.items()}
        group["rewards"] = [float(r) for r in reward([group["prompt"]] * n, group["texts"], **extra)]


def math_answer(prompts: list, completions: list[str], answer: list, **columns) -> list[float]:
    """A reward function built on `math-verify` (the `rl` extra): 1.0 where the completion's final answer (a
    `\\boxed{}`, LaTeX or a plain expression) is mathematically equal to the `answer` column's, else 0.0."""
    from math_verify import parse, verify

    return [float(verify(parse(str(gold)), parse(text))) for text, gold in zip(completions, answer)]


math_answer.requires = ("math_verify", "rl")  # the module it imports, and the extra that installs it
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_number(prompts: list, completions: list[str], answer: list, **columns) -> list[float]:
    """A reward function: 1.0 where the completion's last number equals the `answer` column's, else 0.0."""
    rewards = []
    for text, expected in zip(completions, answer):
        numbers = _NUMBER.findall(text.replace(",", ""))
        rewards.append(float(bool(numbers) and float(numbers[-1]) == float(expected)))
    return rewards
