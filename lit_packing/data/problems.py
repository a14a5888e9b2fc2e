"""What makes one example untrainable: nulls, wrong types, unknown roles, a chat with no assistant turn, empty turns
or completions, control characters, scores that are no finite numbers.

    chat_problem([{"role": "user", "content": "Hi"}])   # -> "no assistant turn"

Each example shape (`lit_packing.data.shapes`) checks its rows with these; sources mark rows they could not read
with the `PROBLEM` column, and tokenization never tokenizes a row with a problem.
"""

from __future__ import annotations

import json
import math
import re

ROLES = ("system", "user", "assistant")
# Per-token columns of a rollout group: a list of numbers per completion, one per token.
PER_TOKEN = ("token_advantages", "behaviour_logps")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # C0 controls and DEL; tab, newline, CR are text


def text_problem(name: str, value: object, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        return f"{name} is {kind_of(value)}, not a string"
    if not allow_empty and not value.strip():
        return f"{name} is empty"
    found = _CONTROL.search(value)
    return f"{name} holds control character U+{ord(found.group()):04X} at {found.start()}" if found else ""


def chat_problem(messages: object) -> str:
    if not isinstance(messages, list) or not messages:
        return f"messages is {kind_of(messages)}, not a list of {{role, content}} turns"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{i}] is {kind_of(message)}, not a {{role, content}} object"
        role = message.get("role")
        if role not in ROLES:
            return f"messages[{i}] has role {role!r}: use one of {', '.join(ROLES)}"
        problem = text_problem(f"messages[{i}] ({role}) content", message.get("content"), role == "system")
        if problem:
            return problem
    if not any(message["role"] == "assistant" for message in messages):
        return "no assistant turn"
    return ""


def pair_problem(example: dict) -> str:
    """A preference pair's problem: a side that is no text or no messages, an empty or untrainable side, or a
    chosen side identical to the rejected one (the pair would teach nothing)."""
    prompt = example.get("prompt")
    if isinstance(prompt, str):
        problem = text_problem("prompt", prompt, allow_empty=True)
    elif isinstance(prompt, list):
        problem = chat_problem([*prompt, {"role": "assistant", "content": "x"}]) if prompt else ""  # its turns
    else:
        problem = f"prompt is {kind_of(prompt)}, not a string or a list of messages"
    if problem:
        return problem
    for side in ("chosen", "rejected"):
        value = example.get(side)
        if isinstance(value, str):
            problem = text_problem(side, value)
        elif isinstance(value, list):
            problem = chat_problem(value) if value else f"{side} is an empty list"
            problem = problem and f"{side}: {problem}"
        else:
            problem = f"{side} is {kind_of(value)}, not a string or a list of messages"
        if problem:
            return problem
    if example.get("chosen") == example.get("rejected"):
        return "chosen and rejected are identical"
    return ""


def prompt_problem(prompt: object) -> str:
    if isinstance(prompt, str):
        return text_problem("prompt", prompt)
    if isinstance(prompt, list) and prompt:
        return chat_problem([*prompt, {"role": "assistant", "content": "x"}])  # its turns
    return f"prompt is {kind_of(prompt)}, not a string or a list of messages"


def group_problem(example: dict) -> str:
    """A rollout group's problem: no prompt, no completion, an empty completion, a score missing, not a number,
    NaN or infinite, or as many scores (or behaviour log-prob lists) as there are completions."""
    problem = prompt_problem(example.get("prompt"))
    completions = example.get("completions")
    if problem:
        return problem
    if not isinstance(completions, list) or not completions:
        return f"completions is {kind_of(completions)}, not a list of completions"
    given = example.get("completion_ids") or []  # a read JSON file holds token ids apart, "" in `completions`
    for i, completion in enumerate(completions):
        completion = given[i] if i < len(given) and given[i] else completion
        if isinstance(completion, str):
            problem = text_problem(f"completions[{i}]", completion)
        elif not isinstance(completion, list) or not completion:
            problem = f"completions[{i}] is {kind_of(completion)}, not a string or a list of token ids"
        elif not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in completion):
            problem = f"completions[{i}] holds something that is no token id"
        if problem:
            return problem
    scores = [name for name in ("rewards", "advantages", "token_advantages") if example.get(name) not in (None, [])]
    if not scores:
        return "no rewards (or advantages): give one per completion"
    for name in scores:
        problem = "" if name in PER_TOKEN else numbers_problem(name, example[name], len(completions))
        if problem:
            return problem
    for name in PER_TOKEN:
        values = example.get(name)
        if values in (None, []):
            continue
        if not isinstance(values, list) or len(values) != len(completions):
            return f"{name} is {kind_of(values)}, not one list per completion ({len(completions)})"
        for i, numbers in enumerate(values):
            problem = numbers_problem(f"{name}[{i}]", numbers, None)
            if problem:
                return problem
    return ""


def numbers_problem(name: str, values: object, expected: int | None) -> str:
    if not isinstance(values, list) or (expected is not None and len(values) != expected):
        return f"{name} is {kind_of(values)}, not {expected} numbers (one per completion)" if expected else (
            f"{name} is {kind_of(values)}, not a list of numbers")  # fmt: skip
    for k, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{name}[{k}] is {kind_of(value)}: give a finite number"
    return ""


_JSON_KINDS = {
    bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object",
}  # fmt: skip


def kind_of(value: object) -> str:
    """A JSON value as a message names it: `null (or missing)`, `an empty list`, `a number (5)`."""
    if value is None:
        return "null (or missing)"
    kind = _JSON_KINDS.get(type(value), f"a {type(value).__name__}")
    if isinstance(value, (list, dict, str)) and not value:
        return f"an empty {kind.split()[-1]}"
    return f"{kind} ({json.dumps(value, default=str)[:40]})"
