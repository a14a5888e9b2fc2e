"""The GRPO training step on the same stored rollouts: TRL's `GRPOTrainer` (padded) against packed rollout groups,
each prompt run once or per completion: effective tokens/s and the ratios side by side in one run.

    python -m benchmarks.grpo_throughput                    # the packaged rollouts (prompts ~38 tokens, G = 8)
    python -m benchmarks.grpo_throughput --long             # G = 8, prompts ~1,000 tokens, completions 50-1,000
    python -m benchmarks.grpo_throughput --smoke            # 4 groups, a 64-wide model: the wiring, in seconds

Every row trains the same groups from the same random initial weights (SmolLM2-135M's architecture: hidden 576,
9 heads, 3 KV heads, its 49,152-token vocabulary; `--layers` layers, fp32) with the same loss (`--loss_type`,
behaviour log-probs from the data) and fused AdamW (transformers' default `optim`), `--groups_per_step` groups a
step. What each row's timer holds, per step:

- TRL: its inputs built from the step's groups (`padded`: a row per completion, the prompt left-padded, the
  completion right-padded, masks, advantages, behaviour log-probs), `GRPOTrainer.compute_loss` (forward, TRL's fused
  LM head, loss), backward, AdamW. The head projects the completion tokens only, as on CUDA
  (`completion_only_head`): on a CPU, TRL 1.16 would project every prompt and padding position too.
- packed: `GroupCollator` on the step's groups (one row, each prompt per completion or once), the step's label
  totals, forward, the chunked head on the completion tokens, `grpo_loss`, backward, AdamW.

Building the trainer and copying the model are outside. Effective tokens/s counts each completion's prompt and
completion tokens (the same work in every row, whatever a row computes) over the timed steps (after `--warmup`);
the rows run step by step in turn (a drift of the machine's speed falls on every row alike), each round from fresh
copies of the weights, and each figure is the median over rounds (a ratio: of each round's ratio). Every step's
loss is kept: a step's losses agree across rows and rounds to fp32 rounding. A default run takes 4.5 minutes
(packaged: 24 groups, 4 a step, 3 rounds) or 7 (`--long`: 4 groups, a group a step, one round) on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from benchmarks.preference_throughput import smollm2_shape
from benchmarks.trl_grpo import build_trl_grpo_trainer, completion_only_head
from lit_packing.assets import resolve_pretrained
from lit_packing.batch import BEHAVIOUR_LOGPS, STEP, attach_step
from lit_packing.data import ArithmeticRollouts, GroupCollator
from lit_packing.data.tokenize import TokenizedDataset, tokenize_dataset
from lit_packing.models.grpo import GRPOSettings, completion_logps, group_advantages, grpo_loss
from lit_packing.models.head import head_inputs
from lit_packing.models.pack import pack_model

ROWS = {"trl": "TRL GRPOTrainer (padded)", "unshared": "packed, prompt per completion",
        "shared": "packed, prompt once (lit_packing)"}  # fmt: skip


class Step(NamedTuple):
    """One training step of one row: its timed seconds and its loss."""

    seconds: float
    loss: float


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
    rewards = torch.tensor([float(r) for group in groups for r in group["rewards"]], dtype=torch.float64)
    sizes = torch.tensor([len(group["completion_tokens"]) for group in groups])
    wp, wc = max(map(len, prompts)), max(map(len, completions))
    inputs = {
        "prompt_ids": torch.tensor([[0] * (wp - len(p)) + p for p in prompts]),  # (B, P)
        "prompt_mask": torch.tensor([[0] * (wp - len(p)) + [1] * len(p) for p in prompts]),
        "completion_ids": torch.tensor([c + [0] * (wc - len(c)) for c in completions]),  # (B, C)
        "completion_mask": torch.tensor([[1] * len(c) + [0] * (wc - len(c)) for c in completions]),
        "advantages": group_advantages(rewards, torch.arange(len(groups)).repeat_interleave(sizes), settings).to(dtype),
        "num_items_in_batch": torch.tensor(sum(map(len, completions))),
    }
    if all(old):
        inputs["old_per_token_logps"] = torch.tensor([o + [0.0] * (wc - len(o)) for o in old], dtype=dtype)
    return inputs


def trl_trainer(start, settings: GRPOSettings) -> Callable[[list[dict]], Step]:
    """A copy of `start` in TRL's trainer; the step it returns times its padded inputs, `compute_loss` (the head on
    the completion tokens only), backward and AdamW."""
    model = copy.deepcopy(start)
    trainer = build_trl_grpo_trainer(
        model,
        loss_type=settings.loss_type,
        epsilon=settings.epsilon,
        epsilon_high=settings.epsilon_high,
        max_completion_length=settings.max_completion_length,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)  # transformers' default `optim`
    model.train()

    def step(groups: list[dict]) -> Step:
        with completion_only_head():
            begin = time.perf_counter()
            inputs = padded(groups, settings)
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(model, inputs)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return Step(time.perf_counter() - begin, float(loss.detach()))

    return step


def packed_trainer(start, settings: GRPOSettings, share: bool) -> Callable[[list[dict]], Step]:
    """A packed copy of `start`; the step it returns times the collation, the step's totals, the forward through
    the chunked head, the loss, backward and AdamW."""
    model = copy.deepcopy(start)
    pack_model(model, "per_example", "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    model.train()
    collate = GroupCollator(share_prompt=share)

    def step(groups: list[dict]) -> Step:
        begin = time.perf_counter()
        (batch,) = attach_step([collate(groups)])
        policy = completion_logps(head_inputs(model, batch, 1024), batch)
        advantages = group_advantages(batch["rewards"], batch["groups"], settings)
        parts = grpo_loss(policy, advantages, settings, batch[BEHAVIOUR_LOGPS])
        loss = parts.loss_sum / batch[STEP][settings.normalizer]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return Step(time.perf_counter() - begin, float(loss.detach()))

    return step


def positions(steps: list[list[dict]]) -> dict[str, int]:
    """The positions each row runs through the model over `steps`: TRL's padded slots, the packed rows' tokens."""

    def trl_slots(groups):
        inputs = padded(groups, GRPOSettings("dapo"))
        return inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()

    return {
        "trl": sum(trl_slots(groups) for groups in steps),
        "unshared": sum(GroupCollator(share_prompt=False)(groups)["input_ids"].shape[1] for groups in steps),
        "shared": sum(GroupCollator(share_prompt=True)(groups)["input_ids"].shape[1] for groups in steps),
    }


def loss_spread(runs: dict[str, list[list[Step]]]) -> float:
    """The largest relative difference between a step's losses across rows and rounds."""
    steps = zip(*([step.loss for step in row] for rows in runs.values() for row in rows))
    return max((max(s) - min(s)) / max(abs(statistics.mean(s)), 1e-12) for s in steps)


def model_shape(layers: int, smoke: bool) -> dict:
    """SmolLM2-135M's architecture with `layers` layers; a 64-wide one for `--smoke` (its vocabulary kept: the
    packaged rollouts' token ids)."""
    shape = {**smollm2_shape(), "num_hidden_layers": layers}
    if smoke:
        shape.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    return shape


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="4 groups (2 for --long), a 64-wide model, one round")
    parser.add_argument("--long", action="store_true", help="G = 8, prompts ~1,000 tokens, completions 50-1,000")
    parser.add_argument("--groups", type=int, help="default: 24 packaged groups, 4 a step; 4 long groups, 1 a step")
    parser.add_argument("--groups_per_step", type=int)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--loss_type", default="dapo")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps of every row and round")
    parser.add_argument("--rounds", type=int, help="default: 3; 1 with --long")
    args = parser.parse_args(argv)
    groups, per_step, rounds = (4, 1, 1) if args.long else (24, 4, 3)  # a default run: 4.5 or 7 minutes on 2 cores
    if args.smoke:
        (groups, per_step), args.layers, rounds = ((2, 1) if args.long else (4, 2)), 2, 1
    args.groups = args.groups or groups
    args.groups_per_step = args.groups_per_step or per_step
    args.rounds = args.rounds or rounds
    return args


def ratio(values: list[float], baseline: list[float]) -> float:
    """The median over rounds of a row's tokens/s over the baseline's in the same round."""
    return statistics.median(v / b for v, b in zip(values, baseline))


def print_report(report: dict) -> None:
    """The run, what each timer holds, one line per row (median tokens/s, ratios), the losses' agreement, the JSON."""
    r, (low, high) = report, report["completion_tokens"]
    print("\n".join([
        f"# {r['groups']} groups x G={r['group_size']}, prompts ~{r['prompt_tokens']:.0f} tokens, completions "
        f"{low}-{high}; SmolLM2's architecture: hidden {r['hidden_size']}, {r['heads']} heads ({r['kv_heads']} KV), "
        f"{r['layers']} layers; fp32, CPU, {r['threads']} threads",
        f"# groups a step: {r['groups_per_step']}; {r['loss_type']}, fused AdamW; steps timed: {r['timed_steps']} "
        f"(after {r['warmup']} warm-up); rounds: {r['rounds']}, the rows step by step in turn, medians over the rounds",
        "# timed, each step: TRL = its padded inputs + compute_loss (fused head on the completion tokens only, as on "
        "CUDA) + backward + AdamW",
        "#                   packed = GroupCollator + step totals + forward + chunked head on the completion tokens + "
        "grpo_loss + backward + AdamW",
        f"{'variant':<36}{'tokens/s':>12}{'vs TRL':>9}{'vs per completion':>19}{'positions run':>15}",
        *(f"{label:<36}{r['tokens_per_s'][name]:>12.1f}{r['vs_trl'][name]:>8.2f}x{r['vs_unshared'][name]:>18.2f}x"
          f"{r['positions'][name]:>15,}" for name, label in ROWS.items()),
        f"# effective tokens {r['effective_tokens']:,} over the timed steps (each completion's prompt and "
        f"completion); every step's loss agrees across rows and rounds to {r['loss_spread']:.1e} (relative)",
        json.dumps(report),
    ]))  # fmt: skip


def run_rows(start, steps: list[list[dict]], settings: GRPOSettings, rounds: int) -> dict[str, list[list[Step]]]:
    """Every row's steps, each round from a fresh copy of `start`, the rows interleaved step by step (a drift of
    the machine's speed falls on every row alike)."""
    runs: dict[str, list[list[Step]]] = {name: [] for name in ROWS}
    for _ in range(rounds):
        trainers = {"trl": trl_trainer(start, settings), "unshared": packed_trainer(start, settings, share=False),
                    "shared": packed_trainer(start, settings, share=True)}  # fmt: skip
        for name in trainers:
            runs[name].append([])
        for groups in steps:
            for name, train in trainers.items():
                runs[name][-1].append(train(groups))
    return runs


def summarize(args, shape: dict, steps: list[list[dict]], warmup: int, runs: dict[str, list[list[Step]]]) -> dict:
    """The run's settings, each row's tokens/s per round and median, the ratios, the positions run, the losses."""
    groups, timed = [g for step in steps for g in step], steps[warmup:]
    sizes = [n for g in groups for n in g["completion_tokens"]]
    tokens = sum(effective_tokens(g) for step in timed for g in step)
    per_round = {name: [tokens / sum(step.seconds for step in row[warmup:]) for row in rows]
                 for name, rows in runs.items()}  # fmt: skip
    return {
        "groups": len(groups), "group_size": len(groups[0]["completion_tokens"]), "layers": args.layers,
        "hidden_size": shape["hidden_size"], "heads": shape["num_attention_heads"],
        "kv_heads": shape["num_key_value_heads"], "threads": torch.get_num_threads(), "loss_type": args.loss_type,
        "long": args.long, "groups_per_step": args.groups_per_step, "timed_steps": len(timed), "warmup": warmup,
        "rounds": args.rounds, "completion_tokens": [min(sizes), max(sizes)],
        "prompt_tokens": statistics.mean(len(g["input_ids"]) - sum(g["completion_tokens"]) for g in groups),
        "effective_tokens": tokens, "positions": positions(timed),
        "tokens_per_s": {name: statistics.median(values) for name, values in per_round.items()},
        "tokens_per_s_rounds": per_round,
        "vs_trl": {name: ratio(per_round[name], per_round["trl"]) for name in ROWS},
        "vs_unshared": {name: ratio(per_round[name], per_round["unshared"]) for name in ROWS},
        "seconds": {name: [[step.seconds for step in row] for row in rows] for name, rows in runs.items()},
        "losses": {name: [[step.loss for step in row] for row in rows] for name, rows in runs.items()},
        "loss_spread": loss_spread(runs),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    shape = model_shape(args.layers, args.smoke)
    if args.long:
        groups = long_groups(args.groups, 8, shape["vocab_size"])
    else:
        groups = packaged_groups(AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False)),
                                 args.groups)  # fmt: skip
    steps = [groups[i : i + args.groups_per_step] for i in range(0, len(groups), args.groups_per_step)]
    torch.manual_seed(0)
    start = AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape))
    settings = GRPOSettings(args.loss_type, epsilon_high=5.0 if args.loss_type == "cispo" else 0.28,
                            max_completion_length=max(n for g in groups for n in g["completion_tokens"]))  # fmt: skip
    runs = run_rows(start, steps, settings, args.rounds)
    report = summarize(args, shape, steps, min(args.warmup, len(steps) - 1), runs)
    print_report(report)
    return report


if __name__ == "__main__":
    main()
