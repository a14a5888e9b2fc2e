"""Example shapes: the column layouts a tokenizer understands, and the checks that make a row trainable.

    example_shape(["messages", "id"])   # -> "chat"

Shapes (columns), detected by `example_shape`:

    preference         prompt, chosen, rejected: each a str or a list of messages (TRL's preference layout)
    group              prompt (str or messages), completions: [str or token ids, ...], rewards: [float, ...] (or
                       advantages: [float, ...], or token_advantages: [[float per completion token], ...]),
                       optional behaviour_logps: [[float per completion token], ...] (rollout groups)
    chat               messages: [{"role": "system" | "user" | "assistant", "content": str}, ...]
    prompt_completion  prompt: str, completion: str
    text               text: str

`example_problem` says what makes one example untrainable (nulls, wrong types, unknown roles, no assistant turn,
control characters); sources mark rows they could not read with the `PROBLEM` column, and tokenization never
tokenizes a row with a problem.
"""

from __future__ import annotations

import json
import math
import re

from datasets import List, Value

from lit_packing.errors import DataError

CHAT = "chat"
PROMPT_COMPLETION = "prompt_completion"
TEXT = "text"
PREFERENCE = "preference"
GROUP = "group"
SHAPE_COLUMNS = {
    PREFERENCE: ("prompt", "chosen", "rejected"),
    GROUP: ("prompt", "completions"),
    CHAT: ("messages",),
    PROMPT_COMPLETION: ("prompt", "completion"),
    TEXT: ("text",),
}
ROLES = ("system", "user", "assistant")
# A rollout group's columns besides its shape's: a score per completion (rewards or advantages) or per completion
# token (token_advantages), and the sampler's log-probs of each completion's tokens.
GROUP_COLUMNS = ("rewards", "advantages", "token_advantages", "behaviour_logps")
PER_TOKEN = ("token_advantages", "behaviour_logps")  # a list of numbers per completion, one per token
# Optional columns a source may add: the row as the user counts it (a file's line number), and why a row it could
# not read is bad (empty for good rows). `tokenize_dataset` reads both.
LINE = "_line"
PROBLEM = "_problem"

MESSAGES = List({"role": Value("string"), "content": Value("string")})  # the Arrow type of a chat's `messages`
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # C0 controls and DEL; tab, newline, CR are text


def example_shape(column_names: list[str], knob: str = "data.source") -> str:
    """Which shape a dataset's columns hold: `preference`, `group`, `chat`, `prompt_completion` or `text` (in that
    order).

    Raises:
        DataError: naming the columns found and the `knob` that maps them (e.g. `data.source.init_args.field_map`).
    """
    for shape, needed in SHAPE_COLUMNS.items():
        if all(column in column_names for column in needed):
            return shape
    raise DataError(
        f"no known example shape in columns {sorted(column_names)}: need `messages` (chat), `prompt` + `completion`, "
        f"`text`, `prompt` + `chosen` + `rejected` (preference pairs) or `prompt` + `completions` (rollout groups); "
        f"rename yours with {knob}, e.g. field_map: "
        f"{{question: prompt, answer: completion}}"
    )


def example_problem(shape: str, example: dict) -> str:
    """What makes one example untrainable, or "" when it is fine: nulls, wrong types, unknown roles, a chat with no
    assistant turn, empty turns or completions, control characters.

    `example_problem("chat", {"messages": [{"role": "user", "content": "Hi"}]})` -> `"no assistant turn"`.
    """
    if shape == PREFERENCE:
        return _pair_problem(example)
    if shape == GROUP:
        return _group_problem(example)
    if shape == CHAT:
        return _chat_problem(example.get("messages"))
    if shape == PROMPT_COMPLETION:
        return _text_problem("prompt", example.get("prompt"), allow_empty=True) or _text_problem(
            "completion", example.get("completion")
        )
    return _text_problem("text", example.get("text"))


def _text_problem(name: str, value: object, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        return f"{name} is {_kind(value)}, not a string"
    if not allow_empty and not value.strip():
        return f"{name} is empty"
    found = _CONTROL.search(value)
    return f"{name} holds control character U+{ord(found.group()):04X} at {found.start()}" if found else ""


def _chat_problem(messages: object) -> str:
    if not isinstance(messages, list) or not messages:
        return f"messages is {_kind(messages)}, not a list of {{role, content}} turns"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{i}] is {_kind(message)}, not a {{role, content}} object"
        role = message.get("role")
        if role not in ROLES:
            return f"messages[{i}] has role {role!r}: use one of {', '.join(ROLES)}"
        problem = _text_problem(f"messages[{i}] ({role}) content", message.get("content"), role == "system")
        if problem:
            return problem
    if not any(message["role"] == "assistant" for message in messages):
        return "no assistant turn"
    return ""


def as_messages(value: object, role: str) -> list[dict]:
    """A preference side as chat messages: a string is one `role` turn ("" none), a list is taken as it is."""
    if isinstance(value, str):
        return [{"role": role, "content": value}] if value else []
    return list(value)


def _pair_problem(example: dict) -> str:
    """A preference pair's problem: a side that is no text or no messages, an empty or untrainable side, or a
    chosen side identical to the rejected one (the pair would teach nothing)."""
    prompt = example.get("prompt")
    if isinstance(prompt, str):
        problem = _text_problem("prompt", prompt, allow_empty=True)
    elif isinstance(prompt, list):
        problem = _chat_problem([*prompt, {"role": "assistant", "content": "x"}]) if prompt else ""  # its turns
    else:
        problem = f"prompt is {_kind(prompt)}, not a string or a list of messages"
    if problem:
        return problem
    for side in ("chosen", "rejected"):
        value = example.get(side)
        if isinstance(value, str):
            problem = _text_problem(side, value)
        elif isinstance(value, list):
            problem = _chat_problem(value) if value else f"{side} is an empty list"
            problem = problem and f"{side}: {problem}"
        else:
            problem = f"{side} is {_kind(value)}, not a string or a list of messages"
        if problem:
            return problem
    if example.get("chosen") == example.get("rejected"):
        return "chosen and rejected are identical"
    return ""


def _prompt_problem(prompt: object) -> str:
    if isinstance(prompt, str):
        return _text_problem("prompt", prompt)
    if isinstance(prompt, list) and prompt:
        return _chat_problem([*prompt, {"role": "assistant", "content": "x"}])  # its turns
    return f"prompt is {_kind(prompt)}, not a string or a list of messages"


def _group_problem(example: dict) -> str:
    """A rollout group's problem: no prompt, no completion, an empty completion, a score missing, not a number,
    NaN or infinite, or as many scores (or behaviour log-prob lists) as there are completions."""
    problem = _prompt_problem(example.get("prompt"))
    completions = example.get("completions")
    if problem:
        return problem
    if not isinstance(completions, list) or not completions:
        return f"completions is {_kind(completions)}, not a list of completions"
    given = example.get("completion_ids") or []  # a read JSON file holds token ids apart, "" in `completions`
    for i, completion in enumerate(completions):
        completion = given[i] if i < len(given) and given[i] else completion
        if isinstance(completion, str):
            problem = _text_problem(f"completions[{i}]", completion)
        elif not isinstance(completion, list) or not completion:
            problem = f"completions[{i}] is {_kind(completion)}, not a string or a list of token ids"
        elif not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in completion):
            problem = f"completions[{i}] holds something that is no token id"
        if problem:
            return problem
    scores = [name for name in ("rewards", "advantages", "token_advantages") if example.get(name) not in (None, [])]
    if not scores:
        return "no rewards (or advantages): give one per completion"
    for name in scores:
        problem = "" if name in PER_TOKEN else _numbers_problem(name, example[name], len(completions))
        if problem:
            return problem
    for name in PER_TOKEN:
        values = example.get(name)
        if values in (None, []):
            continue
        if not isinstance(values, list) or len(values) != len(completions):
            return f"{name} is {_kind(values)}, not one list per completion ({len(completions)})"
        for i, numbers in enumerate(values):
            problem = _numbers_problem(f"{name}[{i}]", numbers, None)
            if problem:
                return problem
    return ""


def _numbers_problem(name: str, values: object, expected: int | None) -> str:
    if not isinstance(values, list) or (expected is not None and len(values) != expected):
        return f"{name} is {_kind(values)}, not {expected} numbers (one per completion)" if expected else (
            f"{name} is {_kind(values)}, not a list of numbers")  # fmt: skip
    for k, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{name}[{k}] is {_kind(value)}: give a finite number"
    return ""


_JSON_KINDS = {
    bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object",
}  # fmt: skip


def _kind(value: object) -> str:
    """A JSON value as a message names it: `null (or missing)`, `an empty list`, `a number (5)`."""
    if value is None:
        return "null (or missing)"
    kind = _JSON_KINDS.get(type(value), f"a {type(value).__name__}")
    if isinstance(value, (list, dict, str)) and not value:
        return f"an empty {kind.split()[-1]}"
    return f"{kind} ({json.dumps(value, default=str)[:40]})"
