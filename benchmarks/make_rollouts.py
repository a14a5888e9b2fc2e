"""Write the packaged rollout groups: the packaged SmolLM2-135M-Instruct answering arithmetic questions, G sampled
answers each with the sampler's log-probs, rewarded 1 when the answer's last number is right.

    python -m benchmarks.make_rollouts            # -> lit_packing/data/rollouts/arithmetic.jsonl (ArithmeticRollouts)

The questions are `ArithmeticPrompts`' seeded one-digit sums; sampling at temperature 1, no
top-k / top-p, so the stored log-probs are the model's own at the time it sampled (`models/rollouts.py`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_packing.assets import resolve_pretrained
from lit_packing.data import ArithmeticPrompts
from lit_packing.models.rollouts import final_number, sample_groups, score_groups

OUT = Path(__file__).resolve().parents[1] / "lit_packing" / "data" / "rollouts" / "arithmetic.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    path = resolve_pretrained("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    asked = ArithmeticPrompts(n=args.prompts, seed=args.seed).load()
    start = time.perf_counter()
    groups = sample_groups(model, tokenizer, asked["prompt"], args.group_size, args.max_new_tokens, seed=args.seed)
    score_groups(groups, final_number, answer=asked["answer"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as file:
        for group, answer in zip(groups, asked["answer"]):
            row = {key: group[key] for key in ("prompt", "completions", "rewards", "behaviour_logps")}
            file.write(json.dumps({**row, "answer": answer}) + "\n")
    rewards = [r for g in groups for r in g["rewards"]]
    lengths = [len(c) for g in groups for c in g["completions"]]
    print(
        f"{len(groups)} groups x {args.group_size} in {time.perf_counter() - start:.0f} s: mean reward "
        f"{sum(rewards) / len(rewards):.3f}, completion tokens {min(lengths)}-{max(lengths)} "
        f"(mean {sum(lengths) / len(lengths):.1f}) -> {args.out}"
    )


if __name__ == "__main__":
    main()
