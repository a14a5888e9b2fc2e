"""Example shapes: each kind of example is one object that knows its columns, how a source holds them, what makes
one untrainable, and how it becomes token ids and the columns of the tokenized table.

    shape = example_shape(["messages", "id"])   # -> CHAT; shape.name == "chat"
    shape.problem({"messages": [{"role": "user", "content": "Hi"}]})   # -> "no assistant turn"

Shapes (columns), detected by `example_shape` in this order:

    preference         prompt, chosen, rejected: each a str or a list of messages (TRL's preference layout)
    group              prompt (str or messages), completions: [str or token ids, ...], rewards: [float, ...] (or
                       advantages: [float, ...], or token_advantages: [[float per completion token], ...]),
                       optional behaviour_logps: [[float per completion token], ...] (rollout groups)
    image_chat         messages whose content is a list of parts ({"type": "text", "text": str} or {"type": "image"}),
                       images: [path, bytes or PIL image, one per image part] (TRL's vision layout)
    chat               messages: [{"role": "system" | "user" | "assistant", "content": str}, ...]
    prompt_completion  prompt: str, completion: str
    text               text: str

A new kind of example is one more `ExampleShape` in `SHAPES`: the sources, the stream, the JSON reader and
tokenization ask the shape, never compare its name. The tokenizer's mechanics (chat templates, assistant spans) are
`lit_packing.data.encode.Encoder`'s; a shape says which of them its examples go through and how each is fitted to
`max_length` (`data.overlong`). Sources mark rows they could not read with the `PROBLEM` column, and tokenization
never tokenizes a row with a problem (`lit_packing.data.problems`).
"""

from __future__ import annotations

from typing import Any

from datasets import Image, List, Value

from lit_packing.batch import (
    ADVANTAGES,
    BEHAVIOUR_LOGPS,
    CHOSEN_TOKENS,
    COMPLETION_TOKENS,
    IGNORE_INDEX,
    IMAGES,
    INPUT_IDS,
    LABEL_TOKENS,
    LABELS,
    REWARDS,
    TOKEN_ADVANTAGES,
    TRUNCATED_TOKENS,
)
from lit_packing.data.images import (
    IMAGE_CHAT_COLUMNS,
    IMAGE_CHAT_FEATURES,
    IMAGE_TOKENS,
    Dropped,
    encode_image_chat,
    image_problem,
)
from lit_packing.data.problems import (
    PER_TOKEN,
    ROLES,
    chat_problem,
    group_problem,
    pair_problem,
    text_problem,
)
from lit_packing.errors import DataError

__all__ = ["CHAT", "GROUP", "IMAGE_CHAT", "PREFERENCE", "PROMPT_COMPLETION", "ROLES", "SHAPES", "TEXT", "ExampleShape",
           "as_messages", "example_shape", "shape_named"]  # fmt: skip

# A rollout group's columns besides its shape's: a score per completion (rewards or advantages) or per completion
# token (token_advantages), and the sampler's log-probs of each completion's tokens.
GROUP_COLUMNS = ("rewards", "advantages", "token_advantages", "behaviour_logps")
# Optional columns a source may add: the row as the user counts it (a file's line number), and why a row it could
# not read is bad (empty for good rows). `tokenize_dataset` reads both.
LINE = "_line"
PROBLEM = "_problem"

MESSAGES = List({"role": Value("string"), "content": Value("string")})  # the Arrow type of a chat's `messages`

# Columns of the tokenized table an example's fit writes besides its tokens (`lit_packing.data.encode`).
LENGTH = "length"
DROPPED = "dropped"  # "", "bad", "overlong" or "no_labels"
# A preference pair is one row: its chosen sequence's `chosen_tokens` tokens, then its rejected one's (0: not a pair).
# A rollout group is one row: its prompt's tokens once, then each completion's (`completion_tokens` of them), with a
# reward (or advantage) per completion or an advantage per completion token and, when the data has them, the
# behaviour log-probs of every completion token (the per-token ones flat; empty lists in every other row).
GROUP_OUTPUTS = [COMPLETION_TOKENS, REWARDS, ADVANTAGES, TOKEN_ADVANTAGES, BEHAVIOUR_LOGPS]
NO_GROUP = {name: [] for name in GROUP_OUTPUTS}
_EMPTY = {TRUNCATED_TOKENS: 0, LABEL_TOKENS: 0, DROPPED: "", PROBLEM: "", INPUT_IDS: [], LABELS: [], LENGTH: 0,
          CHOSEN_TOKENS: 0, **NO_GROUP, IMAGES: []}  # fmt: skip


def as_messages(value: object, role: str) -> list[dict]:
    """A preference side as chat messages: a string is one `role` turn ("" none), a list is taken as it is."""
    if isinstance(value, str):
        return [{"role": role, "content": value}] if value else []
    return list(value)


def _turns(messages: list[dict]) -> list[dict[str, str]]:
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class ExampleShape:
    """One kind of example. Subclasses set the class attributes and override what differs.

    Attributes:
        name: the shape's name in messages and logs (`chat`).
        columns: the columns whose presence says a source holds this shape.
        features: the Arrow types a source holds its columns as (a text side of a pair as one turn of messages).
        chat: rendered through the chat template.
        atom: what an example is when it is trained whole or not at all ("preference pairs"): never cut by
            `data.overlong=truncate`; "" when an example may be cut.
        unstreamed: what these examples are called where stream windows do not carry them yet (`data.streaming`);
            "" when they stream.
    """

    name = ""
    columns: tuple[str, ...] = ()
    features: dict[str, Any] = {}
    chat = False
    atom = ""
    unstreamed = ""

    def problem(self, example: dict) -> str:
        """What makes one example untrainable, or "" when it is fine."""
        raise NotImplementedError

    def readable(self, dataset):
        """`dataset` (a `datasets.Dataset` of this shape) as `encode` reads it."""
        return dataset

    def held(self, record: dict, problem: str) -> dict:
        """A read record's columns as `features` holds them; empty ones for a bad record (`problem`)."""
        return {name: "" if problem else record[name] for name in self.columns}

    def encode(self, encoder, batch: dict[str, list], indices: list[int], max_length: int, overlong: str) -> list[dict]:
        """Good examples (`batch`, `indices` their rows) -> each one's row of the tokenized table, fitted to
        `max_length` by `overlong` (`lit_packing.data.encode.tokenize_batch` writes the rest)."""
        ids, labels = encoder(batch, indices) if indices else ([], [])  # through `sequences`
        return [fit(list(x), list(y), max_length, overlong) for x, y in zip(ids, labels)]

    def sequences(self, encoder, batch: dict[str, list], indices: list[int]) -> tuple[list, list]:
        """A batch of examples that are one sequence each -> (ids, labels), through `encoder`'s mechanics."""
        raise NotImplementedError(f"{self.name} examples are not one sequence each")

    def __repr__(self) -> str:
        return self.name

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExampleShape) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __reduce__(self):  # a pickled shape (in loader workers, a stored shard) is the same object again
        return shape_named, (self.name,)


class TextShape(ExampleShape):
    name, columns, features = "text", ("text",), {"text": Value("string")}

    def problem(self, example: dict) -> str:
        return text_problem("text", example.get("text"))

    def sequences(self, encoder, batch, indices):
        return encoder.texts(batch["text"])


class PromptCompletionShape(ExampleShape):
    name, columns = "prompt_completion", ("prompt", "completion")
    features = {"prompt": Value("string"), "completion": Value("string")}

    def problem(self, example: dict) -> str:
        return text_problem("prompt", example.get("prompt"), allow_empty=True) or text_problem(
            "completion", example.get("completion")
        )

    def sequences(self, encoder, batch, indices):
        return encoder.prompt_completions(batch["prompt"], batch["completion"])


class ChatShape(ExampleShape):
    name, columns, features, chat = "chat", ("messages",), {"messages": MESSAGES}, True

    def problem(self, example: dict) -> str:
        return chat_problem(example.get("messages"))

    def held(self, record: dict, problem: str) -> dict:
        return {"messages": [] if problem else _turns(record["messages"])}

    def sequences(self, encoder, batch, indices):
        return encoder.chats(batch["messages"], indices)


class PreferenceShape(ExampleShape):
    name, columns, chat, atom = "preference", ("prompt", "chosen", "rejected"), True, "preference pairs"
    unstreamed = atom
    features = {"prompt": MESSAGES, "chosen": MESSAGES, "rejected": MESSAGES}  # text sides as one turn each

    def problem(self, example: dict) -> str:
        return pair_problem(example)

    def held(self, record: dict, problem: str) -> dict:  # a side may be text or messages: held as messages
        sides = (("prompt", "user"), ("chosen", "assistant"), ("rejected", "assistant"))
        return {name: [] if problem else _turns(as_messages(record[name], role)) for name, role in sides}

    def encode(self, encoder, batch, indices, max_length, overlong):
        ids, labels, splits = encoder.pairs(batch, indices) if indices else ([], [], [])
        return [fit_pair(x, y, k, max_length) for x, y, k in zip(ids, labels, splits)]


class GroupShape(ExampleShape):
    name, columns, chat, atom = "group", ("prompt", "completions"), True, "rollout groups"
    unstreamed = atom
    features = {
        "prompt": MESSAGES,
        "completions": List(Value("string")),
        "completion_ids": List(List(Value("int64"))),
        "rewards": List(Value("float64")),
        "advantages": List(Value("float64")),
        "token_advantages": List(List(Value("float64"))),
        "behaviour_logps": List(List(Value("float64"))),
    }  # fmt: skip

    def problem(self, example: dict) -> str:
        return group_problem(example)

    def held(self, record: dict, problem: str) -> dict:
        """Text completions in `completions` ("" where ids are given), token-id ones in `completion_ids` ([] where
        text is), absent scores and log-probs as empty lists."""
        if problem:
            return {"prompt": [], "completions": [], "completion_ids": [], **{name: [] for name in GROUP_COLUMNS}}
        completions = record["completions"]
        return {
            "prompt": _turns(as_messages(record["prompt"], "user")),
            "completions": [c if isinstance(c, str) else "" for c in completions],
            "completion_ids": [[] if isinstance(c, str) else c for c in completions],
            **{name: record.get(name) or [] for name in GROUP_COLUMNS},
        }

    def encode(self, encoder, batch, indices, max_length, overlong):
        ids, labels, sizes = encoder.groups(batch, indices) if indices else ([], [], [])
        examples = [{name: batch[name][k] for name in batch} for k in range(len(indices))]
        return [fit_group(e, x, y, n, max_length) for e, x, y, n in zip(examples, ids, labels, sizes)]


class ImageChatShape(ExampleShape):
    """A chat whose turns hold text and image parts, and its `images` (TRL's vision layout), formatted by the model's
    processor (`lit_packing.data.images`); its images travel with it, decoded in the loader workers by
    `ImageChatCollator`. An image is never cut: `data.overlong=truncate` ends an example before it."""

    name, columns, features, chat = "image_chat", IMAGE_CHAT_COLUMNS, IMAGE_CHAT_FEATURES, True
    unstreamed = "image chats"

    def problem(self, example: dict) -> str:
        return image_problem(example)

    def readable(self, dataset):  # images as references: decoded by `encode`, an unreadable one named by its row
        feature = dataset.features.get("images")
        if isinstance(feature, List) and isinstance(feature.feature, Image) and feature.feature.decode:
            return dataset.cast_column("images", List(Image(decode=False)))
        return dataset

    def held(self, record: dict, problem: str) -> dict:
        return {"messages": [] if problem else record["messages"], "images": [] if problem else record["images"]}

    def encode(self, encoder, batch, indices, max_length, overlong):
        rows = []
        for k in range(len(indices)):
            example = {name: batch[name][k] for name in batch}
            got = encode_image_chat(encoder.processor, example, max_length, overlong)
            if isinstance(got, Dropped):
                rows.append({**_EMPTY, DROPPED: got.kind, PROBLEM: got.problem})
                continue
            ids = [int(x) for x in got[INPUT_IDS]]
            rows.append({**_EMPTY, INPUT_IDS: ids, LABELS: [int(x) for x in got[LABELS]], LENGTH: len(ids),
                         TRUNCATED_TOKENS: got[TRUNCATED_TOKENS], LABEL_TOKENS: got[LABEL_TOKENS],
                         IMAGES: list(example["images"])[: len(got[IMAGE_TOKENS])]})  # fmt: skip
        return rows


PREFERENCE, GROUP, IMAGE_CHAT, CHAT, PROMPT_COMPLETION, TEXT = (
    PreferenceShape(), GroupShape(), ImageChatShape(), ChatShape(), PromptCompletionShape(), TextShape()
)  # fmt: skip
# Detection order: the most specific columns first (an image chat's `messages` + `images` before a chat's).
SHAPES = (PREFERENCE, GROUP, IMAGE_CHAT, CHAT, PROMPT_COMPLETION, TEXT)


def shape_named(name: str) -> ExampleShape:
    """The shape called `name` (`"chat"`)."""
    for shape in SHAPES:
        if shape.name == name:
            return shape
    raise ValueError(f"no example shape {name!r}: one of {', '.join(s.name for s in SHAPES)}")


def example_shape(column_names: list[str], knob: str = "data.source") -> ExampleShape:
    """Which shape a dataset's columns hold: the first of `SHAPES` whose columns are all there.

    Raises:
        DataError: naming the columns found and the `knob` that maps them (e.g. `data.source.init_args.field_map`).
    """
    for shape in SHAPES:
        if all(column in column_names for column in shape.columns):
            return shape
    raise DataError(
        f"no known example shape in columns {sorted(column_names)}: need `messages` (chat), `prompt` + `completion`, "
        f"`text`, `prompt` + `chosen` + `rejected` (preference pairs), `prompt` + `completions` (rollout groups) or "
        f"`messages` + `images` (image chats); "
        f"rename yours with {knob}, e.g. field_map: "
        f"{{question: prompt, answer: completion}}"
    )


def example_problem(shape: ExampleShape | str, example: dict) -> str:
    """What makes one example of `shape` untrainable, or "" when it is fine.

    `example_problem("chat", {"messages": [{"role": "user", "content": "Hi"}]})` -> `"no assistant turn"`.
    """
    return (shape_named(shape) if isinstance(shape, str) else shape).problem(example)


# ---------------------------------------------------------------- fitting one example to max_length


def fit(ids: list[int], labels: list[int], max_length: int, overlong: str) -> dict[str, Any]:
    """Apply `max_length` / `overlong` and the no-label rule to one example: the columns the map writes for it."""
    n, cut = len(ids), max(0, len(ids) - max_length)
    if cut and overlong in ("drop", "error"):  # `error` raises after the map, naming every such row
        return {**_EMPTY, LENGTH: n, DROPPED: "overlong", PROBLEM: f"{n:,} tokens"}
    ids, labels = ids[:max_length], labels[:max_length]
    if labels:
        labels[0] = IGNORE_INDEX
    trained = sum(label != IGNORE_INDEX for label in labels)
    if not trained:
        return {**_EMPTY, LENGTH: len(ids), TRUNCATED_TOKENS: cut, DROPPED: "no_labels"}
    return {**_EMPTY, INPUT_IDS: ids, LABELS: labels, LENGTH: len(ids), TRUNCATED_TOKENS: cut, LABEL_TOKENS: trained}


def fit_pair(ids: list[int], labels: list[int], split: int, max_length: int) -> dict[str, Any]:
    """A pair is one atom: longer than `max_length` it is dropped (or, `overlong=error`, refused), never cut; a
    side without a trained token drops it (`no_labels`)."""
    n = len(ids)
    row = {**_EMPTY, LENGTH: n}
    if n > max_length:
        return {**row, DROPPED: "overlong", PROBLEM: f"{n:,} tokens (chosen and rejected together)"}
    labels = list(labels)
    labels[0] = labels[split] = IGNORE_INDEX  # each sequence's first token predicts nothing
    chosen = sum(label != IGNORE_INDEX for label in labels[:split])
    rejected = sum(label != IGNORE_INDEX for label in labels[split:])
    if not chosen or not rejected:
        return {**row, DROPPED: "no_labels"}
    return {**row, INPUT_IDS: ids, LABELS: labels, LABEL_TOKENS: chosen + rejected, CHOSEN_TOKENS: split}


def fit_group(example: dict, ids: list, labels: list, sizes: list[int], max_length: int) -> dict[str, Any]:
    """A group is one atom: longer than `max_length` it is dropped (or refused), never cut; an empty completion, or
    per-token advantages or behaviour log-probs of another length than their completion's tokens, make it a bad
    row."""
    n = len(ids)
    row = {**_EMPTY, LENGTH: n}
    if n > max_length:
        return {**row, DROPPED: "overlong", PROBLEM: f"{n:,} tokens (the prompt once and every completion)"}
    empty = [i for i, size in enumerate(sizes) if not size]
    if empty:
        return {**row, DROPPED: "bad", PROBLEM: f"completions[{empty[0]}] has no token after the prompt"}
    per_token = {name: example.get(name) or [] for name in PER_TOKEN}
    for name, lists in per_token.items():
        for i, (values, size) in enumerate(zip(lists, sizes)):
            if len(values) != size:
                problem = f"{name}[{i}] has {len(values)} values for its completion's {size} tokens"
                return {**row, DROPPED: "bad", PROBLEM: problem}
    return {
        **row, INPUT_IDS: ids, LABELS: labels, LABEL_TOKENS: sum(sizes), COMPLETION_TOKENS: sizes,
        REWARDS: list(example.get("rewards") or []), ADVANTAGES: list(example.get("advantages") or []),
        **{name: [float(x) for values in lists for x in values] for name, lists in per_token.items()},
    }  # fmt: skip
