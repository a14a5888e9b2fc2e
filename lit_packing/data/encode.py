"""Encoding: one batch of examples of one shape -> token ids, labels and the columns of the tokenized table.

    ids, labels = Encoder(tokenizer, "chat", chat_template(tokenizer), "completion")(batch, indices)

The one encoding both paths share: `tokenize_dataset` (the cached path, `lit_packing.data.tokenize`) maps it over
a whole Dataset, the stream (`lit_packing.data.stream`) runs it on each chunk in the DataLoader workers, so the
same example gives the same tokens either way. `Encoder` holds what every batch reuses (it is pickled to the
workers); `tokenize_batch` applies the policies (`max_length` / `overlong`, bad rows, no trained token) and writes
every row, kept or not, with why it was dropped (`DROPPED`). Labels follow `lit_packing.data.tokenize`'s rules.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash
from datasets import Features, Image, List, Value

from lit_packing.batch import (
    ADVANTAGES,
    BEHAVIOUR_LOGPS,
    CHOSEN_TOKENS,
    COMPLETION_TOKENS,
    IGNORE_INDEX,
    IMAGES,
    INDEX,
    INPUT_IDS,
    LABELS,
    REWARDS,
    TOKEN_ADVANTAGES,
    TRUNCATED_TOKENS,
)
from lit_packing.data.shapes import (
    DROPPED,
    GROUP_OUTPUTS,
    LABEL_TOKENS,
    LENGTH,
    LINE,
    NO_GROUP,
    PROBLEM,
    ExampleShape,
    as_messages,
    shape_named,
)
from lit_packing.errors import ConfigError

# Columns of the tokenized table besides the keys an example carries into a batch (`lit_packing.batch`: input_ids,
# labels, index, truncated_tokens) and the ones its shape's fit writes (`lit_packing.data.shapes`: length, ...).
ROW = "row"  # the example's row as the user counts it: its line in a JSON Lines file, else its source row
TOKEN_HASH = "token_hash"  # 64-bit XXH3 of the token ids: equal for duplicate examples
OUTPUT_COLUMNS = [INPUT_IDS, LABELS, LENGTH, TRUNCATED_TOKENS, INDEX, LABEL_TOKENS, ROW, TOKEN_HASH, CHOSEN_TOKENS,
                  *GROUP_OUTPUTS, IMAGES]  # fmt: skip

FEATURES = Features(
    {
        INPUT_IDS: List(Value("int32")),
        LABELS: List(Value("int32")),
        LENGTH: Value("int32"),
        TRUNCATED_TOKENS: Value("int32"),
        INDEX: Value("int64"),
        ROW: Value("int64"),
        TOKEN_HASH: Value("int64"),
        LABEL_TOKENS: Value("int32"),
        CHOSEN_TOKENS: Value("int32"),
        COMPLETION_TOKENS: List(Value("int32")),
        REWARDS: List(Value("float64")),
        ADVANTAGES: List(Value("float64")),
        TOKEN_ADVANTAGES: List(Value("float64")),
        BEHAVIOUR_LOGPS: List(Value("float64")),
        IMAGES: List(Image(decode=False)),  # references (path or bytes), decoded by the collator in loader workers
        DROPPED: Value("string"),
        PROBLEM: Value("string"),
    }
)

# For tokenizers without a chat template (GPT-2): ChatML, the format SmolLM2 and Qwen use. Its markers are plain
# text to such a tokenizer (no special tokens are added, so the vocabulary and the model's embeddings stay as they
# are), hence a whole assistant span, `content<|im_end|>\n`, is trained.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chat_template(tokenizer) -> str:
    """The tokenizer's chat template, or `DEFAULT_CHAT_TEMPLATE` (ChatML) when it has none."""
    return tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE


def bos_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer itself puts before a text (`[bos]` for Llama-2-style tokenizers, `[]` for SmolLM2)."""
    with_special = tokenizer("a")[INPUT_IDS]
    plain = tokenizer("a", add_special_tokens=False)[INPUT_IDS]
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start : start + len(plain)] == plain:
            return with_special[:start]
    return []


# ---------------------------------------------------------------- one batch of examples -> ids and labels


class Encoder:
    """Turns one batch of examples of one shape into (ids, labels) lists; holds what every batch reuses."""

    def __init__(self, tokenizer, shape: ExampleShape | str, template: str, train_on: str) -> None:
        self.tokenizer = tokenizer
        self.shape = shape_named(shape) if isinstance(shape, str) else shape
        self.template = template
        self.train_on = train_on
        self.bos = bos_prefix(tokenizer)
        self.eos = tokenizer.eos_token_id
        special = set(tokenizer.all_special_ids)
        special |= {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
        self.special_ids = np.array(sorted(special), dtype=np.int64)
        self._processor = None
        if not self.shape.chat and self.eos is None:
            raise ConfigError(
                "data.tokenizer",
                f"{tokenizer.name_or_path!r} has no eos_token to end {shape} examples with",
                "use a tokenizer that has one (the model's own)",
            )

    @property
    def processor(self):
        """The model's processor (tokenizer, image processor, chat template), from the tokenizer's folder: what
        formats image chats. Loaded on first use, in the process that encodes."""
        if self._processor is None:
            from transformers import AutoProcessor

            self._processor = AutoProcessor.from_pretrained(self.tokenizer.name_or_path)
        return self._processor

    def __getstate__(self) -> dict:  # a processor is loaded again where the encoder is unpickled
        return {**self.__dict__, "_processor": None}

    def __call__(self, batch: dict[str, list], indices: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """A batch of chats, prompt/completions or texts (as the shape reads them) -> (ids, labels)."""
        return self.shape.sequences(self, batch, indices)

    def pairs(self, batch: dict[str, list], indices: list[int]) -> tuple[list, list, list[int]]:
        """Preference pairs: each as its chosen conversation's ids then its rejected one's (prompt + side, through
        the chat template), labels on the completion only, and the chosen sequence's token count."""
        prompts = [as_messages(p, "user") for p in batch["prompt"]]
        sides = {}
        for side in ("chosen", "rejected"):
            conversations = [p + as_messages(x, "assistant") for p, x in zip(prompts, batch[side])]
            sides[side] = self._chats_completion(conversations, indices)
        rendered = self._encode([self._render(p, add_generation_prompt=True) if p else "" for p in prompts])
        prompt_tokens = [len(x) if p else 0 for p, x in zip(prompts, rendered[INPUT_IDS])]
        (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = sides["chosen"], sides["rejected"]
        ids, labels, splits = [], [], []
        for k, n in enumerate(prompt_tokens):  # the prompt's tokens: the same in both, trained in neither
            ids.append(list(chosen_ids[k]) + list(rejected_ids[k]))
            labels.append(
                [IGNORE_INDEX] * n + list(chosen_labels[k][n:]) + [IGNORE_INDEX] * n + list(rejected_labels[k][n:])
            )
            splits.append(len(chosen_ids[k]))
        return ids, labels, splits

    def groups(self, batch: dict[str, list], indices: list[int]) -> tuple[list, list, list[list[int]]]:
        """Rollout groups: each as its prompt's ids (rendered once, with the generation prompt) then its completions'
        (token ids as given, or a text as the assistant turn the chat template renders after the prompt, up to and
        including its end-of-turn token), labels on the completions, and each completion's token count."""
        ids, labels, sizes = [], [], []
        given = batch.get("completion_ids") or [[] for _ in indices]
        for k, index in enumerate(indices):
            messages = as_messages(batch["prompt"][k], "user")
            prompt = self._encode([self._render(messages, add_generation_prompt=True)])[INPUT_IDS][0]
            completions = [c if isinstance(c, list) and c else None for c in batch["completions"][k]]
            completions = [g if g else c for c, g in zip(completions, list(given[k]) + [None] * len(completions))]
            texts = [i for i, c in enumerate(batch["completions"][k]) if completions[i] is None]
            conversations = [messages + [{"role": "assistant", "content": batch["completions"][k][i]}] for i in texts]
            encoded = self._chats_completion(conversations, [index] * len(texts)) if texts else ([], [])
            for i, x, y in zip(texts, *encoded):
                if list(x[: len(prompt)]) != list(prompt):
                    raise ConfigError("data.tokenizer", f"example {index}: the chat template renders the prompt "
                                      "differently once a completion follows, so completions cannot follow it once",
                                      "give completions as token ids, or use a prefix-consistent template")  # fmt: skip
                last = max((j for j, label in enumerate(y) if label != IGNORE_INDEX), default=len(prompt) - 1)
                completions[i] = list(x[len(prompt) : last + 1])
            row = list(prompt) + [t for c in completions for t in c]
            ids.append(row)
            labels.append([IGNORE_INDEX] * len(prompt) + row[len(prompt) :])
            sizes.append([len(c) for c in completions])
        return ids, labels, sizes

    def _chats_completion(self, conversations: list[list[dict]], indices: list[int]) -> tuple[list, list]:
        """`chats` with assistant turns trained (what a pair's completion is), whatever `train_on` says."""
        train_on, self.train_on = self.train_on, "completion"
        try:
            return self.chats(conversations, indices)
        finally:
            self.train_on = train_on

    def _encode(self, texts: list[str], **kwargs) -> Any:
        return self.tokenizer(texts, add_special_tokens=False, **kwargs)

    def texts(self, texts: list[str]) -> tuple[list, list]:
        ids = [self.bos + x + [self.eos] for x in self._encode(texts)[INPUT_IDS]]
        return ids, [list(x) for x in ids]

    def prompt_completions(self, prompts: list[str], completions: list[str]) -> tuple[list, list]:
        ids, labels = [], []
        for p, c in zip(self._encode(prompts)[INPUT_IDS], self._encode(completions)[INPUT_IDS]):
            prompt, completion = self.bos + p, c + [self.eos]
            ids.append(prompt + completion)
            masked = [IGNORE_INDEX] * len(prompt) if self.train_on == "completion" else prompt
            labels.append(masked + completion)
        return ids, labels

    def _render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def chats(self, conversations: list[list[dict]], indices: list[int]) -> tuple[list, list]:
        if self.train_on == "all":
            ids = self._encode([self._render(m) for m in conversations])[INPUT_IDS]
            return ids, [list(x) for x in ids]
        rendered = [self._assistant_spans(m, i) for m, i in zip(conversations, indices)]
        encoded = self._encode([text for text, _ in rendered], return_offsets_mapping=True)
        labels = [
            self._label_spans(np.asarray(x), np.asarray(offsets, dtype=np.int64).reshape(-1, 2), spans)
            for x, offsets, (_, spans) in zip(encoded[INPUT_IDS], encoded["offset_mapping"], rendered)
        ]
        return encoded[INPUT_IDS], labels

    def _assistant_spans(self, messages: list[dict], index: int) -> tuple[str, list[tuple[int, int, int]]]:
        """The full render and, per assistant turn, (start, content_end, end) character positions in it."""
        full = self._render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, upto = self._render(messages[:i], add_generation_prompt=True), self._render(messages[: i + 1])
            if not (upto.startswith(before) and full.startswith(upto)):
                raise ConfigError(
                    "data.tokenizer",
                    f"example {index}: the chat template is not prefix-consistent (rendering the first {i + 1} "
                    f"messages is not the start of rendering them all; the template rewrites earlier turns), so "
                    f"assistant turns cannot be located",
                    "set data.train_on=all, or use a tokenizer whose chat_template renders each turn the same "
                    "whatever follows",
                )
            start, end = len(before), len(upto)
            content = (message["content"] or "").strip()
            found = full.find(content, start, end) if content else -1
            spans.append((start, found + len(content) if found >= 0 else start, end))
        return full, spans

    def _label_spans(self, ids: np.ndarray, offsets: np.ndarray, spans: list[tuple[int, int, int]]) -> list[int]:
        """Label the tokens of each span up to and including the first special token after the content (its
        end-of-turn token, e.g. `<|im_end|>`); spans without one are labelled whole."""
        labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
        starts, ends = offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1)  # zero-width special tokens
        for start, content_end, end in spans:
            inside = np.flatnonzero((starts < end) & (ends > start))
            enders = inside[np.isin(ids[inside], self.special_ids) & (starts[inside] >= content_end)]
            if enders.size:
                inside = inside[inside <= enders[0]]
            labels[inside] = ids[inside]
        return labels.tolist()


# ---------------------------------------------------------------- the tokenized table


def token_hash(ids: list[int]) -> int:
    """A signed 64-bit XXH3 of token ids (the `token_hash` column): equal ids, equal hash."""
    digest = xxhash.xxh3_64_intdigest(np.asarray(ids, dtype=np.int32).tobytes())
    return digest - (1 << 64) if digest >= 1 << 63 else digest


def tokenize_batch(
    batch: dict[str, list],
    indices: list[int],
    encoder: Encoder,
    max_length: int,
    overlong: str,
    rows: np.ndarray | None,
) -> dict[str, list]:
    n = len(indices)
    examples = [{name: batch[name][k] for name in batch} for k in range(n)]
    problems = [ex.get(PROBLEM) or encoder.shape.problem(ex) for ex in examples]
    good = [k for k in range(n) if not problems[k]]
    kept = {name: [batch[name][k] for k in good] for name in batch}
    fits = encoder.shape.encode(encoder, kept, [indices[k] for k in good], max_length, overlong)
    fitted = dict(zip(good, fits))
    bad = {TRUNCATED_TOKENS: 0, LABEL_TOKENS: 0, DROPPED: "bad", INPUT_IDS: [], LABELS: [], LENGTH: 0, CHOSEN_TOKENS: 0,
           **NO_GROUP, IMAGES: []}  # fmt: skip
    out = []
    for k, index in enumerate(indices):
        row = fitted.get(k) or {**bad, PROBLEM: problems[k]}
        source_row = batch[LINE][k] if LINE in batch else int(rows[index]) if rows is not None else index
        out.append({**row, INDEX: index, ROW: source_row, TOKEN_HASH: token_hash(row[INPUT_IDS])})
    return {name: [row[name] for row in out] for name in FEATURES}
