"""Example shapes: the column layouts a tokenizer understands, and the checks that make a row trainable.

    example_shape(["messages", "id"])   # -> "chat"

Shapes (columns), detected by `example_shape`:

    preference         prompt, chosen, rejected: each a str or a list of messages (TRL's preference layout)
    chat               messages: [{"role": "system" | "user" | "assistant", "content": str}, ...]
    prompt_completion  prompt: str, completion: str
    text               text: str

`example_problem` says what makes one example untrainable (nulls, wrong types, unknown roles, no assistant turn,
control characters); sources mark rows they could not read with the `PROBLEM` column, and tokenization never
tokenizes a row with a problem.
"""

from __future__ import annotations

import json
import re

from datasets import List, Value

from lit_packing.errors import DataError

CHAT = "chat"
PROMPT_COMPLETION = "prompt_completion"
TEXT = "text"
PREFERENCE = "preference"
SHAPE_COLUMNS = {
    PREFERENCE: ("prompt", "chosen", "rejected"),
    CHAT: ("messages",),
    PROMPT_COMPLETION: ("prompt", "completion"),
    TEXT: ("text",),
}
ROLES = ("system", "user", "assistant")
# Optional columns a source may add: the row as the user counts it (a file's line number), and why a row it could
# not read is bad (empty for good rows). `tokenize_dataset` reads both.
LINE = "_line"
PROBLEM = "_problem"

MESSAGES = List({"role": Value("string"), "content": Value("string")})  # the Arrow type of a chat's `messages`
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # C0 controls and DEL; tab, newline, CR are text


def example_shape(column_names: list[str], knob: str = "data.source") -> str:
    """Which shape a dataset's columns hold: `preference`, `chat`, `prompt_completion` or `text` (in that order).

    Raises:
        DataError: naming the columns found and the `knob` that maps them (e.g. `data.source.init_args.field_map`).
    """
    for shape, needed in SHAPE_COLUMNS.items():
        if all(column in column_names for column in needed):
            return shape
    raise DataError(
        f"no known example shape in columns {sorted(column_names)}: need `messages` (chat), `prompt` + `completion`, "
        f"`text`, or `prompt` + `chosen` + `rejected` (preference pairs); rename yours with {knob}, e.g. field_map: "
        f"{{question: prompt, answer: completion}}"
    )


def example_problem(shape: str, example: dict) -> str:
    """What makes one example untrainable, or "" when it is fine: nulls, wrong types, unknown roles, a chat with no
    assistant turn, empty turns or completions, control characters.

    `example_problem("chat", {"messages": [{"role": "user", "content": "Hi"}]})` -> `"no assistant turn"`.
    """
    if shape == PREFERENCE:
        return _pair_problem(example)
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
