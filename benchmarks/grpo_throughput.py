"""The GRPO training step on the same stored rollouts: TRL's `GRPOTrainer` (padded) against packed rollout groups,
each prompt run once or per completion: effective tokens/s side by side in one run.

    python -m benchmarks.grpo_throughput                    # the packaged rollouts (short prompts, 2-32 tokens)
    python -m benchmarks.grpo_throughput --long             # G = 8, prompts ~1,000 tokens, completions 50-1,000
    python -m benchmarks.grpo_throughput --smoke            # a few small groups, 2 layers: the wiring, in seconds

Every row trains the same groups from the same random initial weights (SmolLM2's architecture, `--layers` layers,
fp32, CPU) with the same loss (`--loss_type`, behaviour log-probs from the data) and AdamW, `--groups_per_step`
groups a step. TRL's step is its own `compute_loss` on its padded layout (a row per completion, the prompt
left-padded, the completion right-padded), backward and AdamW; ours packs the step's groups into one row
(`GroupCollator`), once with each prompt run per completion (`share_prompt=False`) and once with each prompt run
once. Effective tokens/s counts each completion's prompt and completion tokens (the same work in every row, whatever
a row computes) over the timed steps (after `--warmup`); the rounds interleave the rows, medians are printed.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from benchmarks.preference_throughput import smollm2_shape
from benchmarks.trl_grpo import build_trl_grpo_trainer
from lit_packing.assets import resolve_pretrained
from lit_packing.batch import BEHAVIOUR_LOGPS
from lit_packing.data import ArithmeticRollouts, GroupCollator
from lit_packing.data.tokenize import TokenizedDataset, tokenize_dataset
from lit_packing.models.grpo import GRPOSettings, completion_logps, group_advantages, grpo_loss
from lit_packing.models.head import head_inputs
from lit_packing.models.pack import pack_model


def packaged_groups(tokenizer, n: int) -> list[dict]:
    """The packaged rollouts as tokenized group items (prompt once, completions, rewards, behaviour log-probs)."""
    tokenized, _ = tokenize_dataset(ArithmeticRollouts().load(), tokenizer, max_length=4096, overlong="drop")
    data = TokenizedDataset(tokenized)
    return [data[i] for i in range(min(n, len(data)))]


def long_groups(n: int, group_size: int, vocab: int, seed: int = 0) -> list[dict]:
    """Synthetic groups with long prompts: ~1,000-token prompts, completions of 50 to 1,000 tokens."""
    rng = random.Random(seed)
    groups = []
    for _ in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(900, 1100))]
        sizes = [rng.randint(50, 1000) for _ in range(group_size)]
        completions = [[rng.randrange(3, vocab) for _ in range(size)] for size in sizes]
        groups.append({
            "input_ids": prompt + [t for c in completions for t in c], "completion_tokens": sizes,
            "rewards": [float(rng.random() < 0.5) for _ in sizes],
            BEHAVIOUR_LOGPS: [-rng.uniform(0.5, 8.0) for _ in range(sum(sizes))],
        })  # fmt: skip
    return groups


def effective_tokens(group: dict) -> int:
    """Each completion's prompt and completion tokens: what every layout trains."""
    sizes = group["completion_tokens"]
    prompt = len(group["input_ids"]) - sum(sizes)
    return prompt * len(sizes) + sum(sizes)


def padded(groups: list[dict], settings: GRPOSettings, dtype: torch.dtype = torch.float32) -> dict:
    """TRL's inputs for these groups: a row per completion, prompts left-padded, completions right-padded; the
    advantages from the rewards (as `GRPO` computes them) and the behaviour log-probs in `dtype`."""
    prompts, completions, old = [], [], []
    for group in groups:
        ids, sizes = list(group["input_ids"]), group["completion_tokens"]
        start = prompt = len(ids) - sum(sizes)
        logps = list(group.get(BEHAVIOUR_LOGPS) or [])
        for size in sizes:
            prompts.append(ids[:prompt])
            completions.append(ids[start : start + size])
            old.append(logps[start - prompt : start - prompt + size])
            start += size
    batch = GroupCollator()(groups)
    wp, wc = max(map(len, prompts)), max(map(len, completions))
    inputs = {
        "prompt_ids": torch.tensor([[0] * (wp - len(p)) + p for p in prompts]),
        "prompt_mask": torch.tensor([[0] * (wp - len(p)) + [1] * len(p) for p in prompts]),
        "completion_ids": torch.tensor([c + [0] * (wc - len(c)) for c in completions]),
        "completion_mask": torch.tensor([[1] * len(c) + [0] * (wc - len(c)) for c in completions]),
        "advantages": group_advantages(batch["rewards"], batch["groups"], settings).to(dtype),
        "num_items_in_batch": torch.tensor(sum(map(len, completions))),
    }
    if all(old):
        inputs["old_per_token_logps"] = torch.tensor([o + [0.0] * (wc - len(o)) for o in old], dtype=dtype)
    return inputs


def trl_row(start, steps: list[list[dict]], settings: GRPOSettings, args) -> list[float]:
    """Seconds of each of TRL's steps: `compute_loss`, backward, AdamW."""
    model = copy.deepcopy(start)
    trainer = build_trl_grpo_trainer(
        model,
        loss_type=settings.loss_type,
        epsilon=settings.epsilon,
        epsilon_high=settings.epsilon_high,
        max_completion_length=args.max_completion,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    model.train()
    seconds = []
    for groups in steps:
        inputs = padded(groups, settings)
        begin = time.perf_counter()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - begin)
    return seconds


def packed_row(start, steps: list[list[dict]], settings: GRPOSettings, share: bool) -> list[float]:
    """Seconds of each packed step: collate, forward through the chunked head, loss, backward, AdamW."""
    model = copy.deepcopy(start)
    pack_model(model, "per_example", "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    model.train()
    collate, seconds = GroupCollator(share_prompt=share), []
    for groups in steps:
        begin = time.perf_counter()
        batch = collate(groups)
        policy = completion_logps(head_inputs(model, batch, 1024), batch)
        advantages = group_advantages(batch["rewards"], batch["groups"], settings)
        parts = grpo_loss(policy, advantages, settings, batch[BEHAVIOUR_LOGPS])
        (parts.loss_sum / max(int(batch["counts"]["label_tokens"]), 1)).backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - begin)
    return seconds


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--long", action="store_true", help="G = 8, prompts ~1,000 tokens, completions 50-1,000")
    parser.add_argument("--groups", type=int, default=24)
    parser.add_argument("--groups_per_step", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--loss_type", default="dapo")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if args.smoke:
        args.groups, args.groups_per_step, args.layers, args.rounds = 4, 2, 2, 1
    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False))
    shape = {**smollm2_shape(), "num_hidden_layers": args.layers}
    if args.long:  # a group a step: ~17k tokens in TRL's padded rows
        args.groups, args.groups_per_step = (2, 1) if args.smoke else (min(args.groups, 6), 1)
        groups = long_groups(args.groups, 8, shape["vocab_size"])
        shape.update(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
    else:
        groups = packaged_groups(tokenizer, args.groups)
    args.max_completion = max(n for g in groups for n in g["completion_tokens"])
    torch.manual_seed(0)
    start = AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape))
    settings = GRPOSettings(args.loss_type, epsilon_high=5.0 if args.loss_type == "cispo" else 0.28,
                            max_completion_length=args.max_completion)  # fmt: skip
    steps = [groups[i : i + args.groups_per_step] for i in range(0, len(groups), args.groups_per_step)]
    args.warmup = min(args.warmup, len(steps) - 1)
    timed = steps[args.warmup :]
    tokens = sum(effective_tokens(g) for step in timed for g in step)
    rows = {"trl": [], "unshared": [], "shared": []}
    for _ in range(args.rounds):
        for name, run in (("trl", lambda: trl_row(start, steps, settings, args)),
                          ("unshared", lambda: packed_row(start, steps, settings, share=False)),
                          ("shared", lambda: packed_row(start, steps, settings, share=True))):  # fmt: skip
            rows[name].append(tokens / sum(run()[args.warmup :]))
    speed = {name: statistics.median(values) for name, values in rows.items()}
    ratios = {name: statistics.median(v / t for v, t in zip(rows[name], rows["trl"])) for name in rows}
    prompt = [len(g["input_ids"]) - sum(g["completion_tokens"]) for g in groups]
    sizes = [n for g in groups for n in g["completion_tokens"]]
    computed = {share: sum(len(GroupCollator(share_prompt=share)(step)["input_ids"][0]) for step in timed)
                for share in (False, True)}  # fmt: skip
    report = {
        "groups": len(groups), "layers": args.layers, "loss_type": args.loss_type, "long": args.long,
        "prompt_tokens": statistics.mean(prompt), "completion_tokens": [min(sizes), max(sizes)],
        "tokens_per_s": speed, "vs_trl": ratios, "shared_tokens_saved": 1 - computed[True] / computed[False],
    }  # fmt: skip
    print(
        f"# {len(groups)} groups x G={len(groups[0]['completion_tokens'])}, prompts ~{report['prompt_tokens']:.0f} "
        f"tokens, completions {min(sizes)}-{max(sizes)}; SmolLM2's architecture, {args.layers} layers, fp32, CPU "
        f"threads {torch.get_num_threads()}; {args.groups_per_step} groups a step, {args.loss_type}; prompt once "
        f"computes {report['shared_tokens_saved']:.1%} fewer tokens than per completion"
    )
    print(f"{'variant':<36}{'effective tokens/s':>20}{'vs TRL':>10}")
    names = {"trl": "TRL GRPOTrainer (padded)", "unshared": "packed, prompt per completion",
             "shared": "packed, prompt once (lit_packing)"}  # fmt: skip
    for name, label in names.items():
        print(f"{label:<36}{speed[name]:>20.1f}{ratios[name]:>9.2f}x")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
