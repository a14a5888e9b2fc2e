"""Packed DPO against TRL's `DPOTrainer` (padded) on the same CHAMP pairs, model and machine: effective tokens/s.

    python -m benchmarks.preference_throughput              # 48 CHAMP pairs, SmolLM2's architecture, 4 layers
    python -m benchmarks.preference_throughput --smoke      # 8 short pairs, 2 layers: the wiring, in seconds

Both sides train the same pairs (tokenized once by TRL; ours packs exactly those tokens) from the same random
initial weights with the same optimizer (AdamW, constant lr) and a frozen copy as the reference: TRL pads each
mini-batch of `--pairs_per_step` pairs to its longest sequence; ours best-fit packs the pairs into rows of
`--max_tokens` tokens (a pair never split) and runs every row's sequences apart (`per_example` attention), and once
more with each pair's prompt run once (`PairCollator(share_prompt=True)`, the same packs). Effective tokens/s counts
the pairs' real tokens (each pair's prompt twice and both completions: the same work in every row, whatever a row
computes) over the timed steps (after `--warmup`); the ratios are each row's over TRL's, measured in one run,
interleaved over `--rounds`.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import datasets
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from lit_packing.assets import resolve_pretrained
from lit_packing.data import ChampPairs, PairCollator
from lit_packing.models.head import head_inputs
from lit_packing.models.pack import pack_model
from lit_packing.models.preference import PreferenceSettings, pair_logps, preference_loss
from lit_packing.samplers import BestFitPackingSampler


def pairs_of(args, tokenizer) -> list[dict]:
    """The benchmark's pairs as text (prompt, chosen, rejected): CHAMP's, or short synthetic ones for --smoke."""
    if args.smoke:
        return [
            {"prompt": f"What is {i} + {i}?", "chosen": f"{2 * i}.", "rejected": f"It is {2 * i + 1}."}
            for i in range(8)
        ]
    rows = ChampPairs().load().shuffle(seed=0)
    keep = [
        r for r in rows if len(tokenizer(r["prompt"] + r["chosen"] + r["rejected"])["input_ids"]) < args.max_tokens // 2
    ]
    return [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in keep[: args.pairs]]


class StepClock(TrainerCallback):
    def __init__(self):
        self.seconds: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self.start)


def trl_side(start, tokenizer, rows, args) -> tuple[float, list[dict], int]:
    """TRL's DPOTrainer, padded: (real tokens/s over the timed steps, its tokenized rows, steps)."""
    from trl import DPOConfig, DPOTrainer

    steps = -(-len(rows) // args.pairs_per_step)
    config = DPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.pairs_per_step, max_steps=steps,
        learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, beta=0.1, disable_tqdm=True, max_length=args.max_tokens, dataloader_drop_last=False,
    )  # fmt: skip
    clock = StepClock()
    trainer = DPOTrainer(
        model=copy.deepcopy(start), ref_model=copy.deepcopy(start), args=config,
        train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer, callbacks=[clock],
    )  # fmt: skip
    tokenized = [trainer.train_dataset[i] for i in range(len(rows))]
    trainer.train()
    tokens_per_step = [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h]
    real = [b - a for a, b in zip([0.0, *tokens_per_step[:-1]], tokens_per_step)]
    timed = slice(args.warmup, None)
    return sum(real[timed]) / sum(clock.seconds[timed]), tokenized, steps


def as_pair(row: dict) -> dict:
    prompt, chosen, rejected = row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]
    masked = [-100] * len(prompt)
    return {"input_ids": prompt + chosen + prompt + rejected, "labels": masked + chosen + masked + rejected,
            "chosen_tokens": len(prompt) + len(chosen)}  # fmt: skip


def packed_side(start, tokenized: list[dict], args, share_prompt: bool = False) -> tuple[float, int]:
    """Ours, packed (each prompt run once with `share_prompt`): (the pairs' real tokens/s over the timed steps,
    steps)."""
    policy, reference = copy.deepcopy(start), copy.deepcopy(start).eval()
    pack_model(policy)
    pack_model(reference)
    pairs = [as_pair(row) for row in tokenized]
    lengths = [len(p["input_ids"]) for p in pairs]
    sampler = BestFitPackingSampler(lengths, max_tokens=args.max_tokens, seed=0)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    collate, settings = PairCollator(share_prompt=share_prompt), PreferenceSettings("dpo", beta=0.1)
    seconds, real = [], []
    for pack in sampler:
        batch = collate([pairs[i] for i in pack])
        start_time = time.perf_counter()
        with torch.no_grad():
            ref = pair_logps(head_inputs(reference, batch), batch)
        parts = preference_loss(pair_logps(head_inputs(policy, batch), batch), ref, settings)
        (parts.loss_sum / len(pack)).backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start_time)
        real.append(sum(lengths[i] for i in pack))  # = the unshared row's real tokens
    timed = slice(args.warmup, None)
    return sum(real[timed]) / sum(seconds[timed]), len(seconds)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--pairs", type=int, default=48)
    parser.add_argument("--pairs_per_step", type=int, default=4, help="TRL's mini-batch of pairs")
    parser.add_argument("--max_tokens", type=int, default=4096, help="our packed row's budget")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--lr", type=float, default=5e-6)
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.max_tokens, args.pairs_per_step = 2, 96, 2
    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False))
    config = AutoConfig.for_model(**{**smollm2_shape(), "num_hidden_layers": args.layers})
    torch.manual_seed(0)
    start = AutoModelForCausalLM.from_config(config)
    rows = pairs_of(args, tokenizer)
    ratios, shared_ratios, ours_all, shared_all, theirs_all = [], [], [], [], []
    for _ in range(args.rounds):
        theirs, tokenized, trl_steps = trl_side(start, tokenizer, rows, args)
        ours, our_steps = packed_side(start, tokenized, args)
        shared, _ = packed_side(start, tokenized, args, share_prompt=True)
        ours_all.append(ours)
        shared_all.append(shared)
        theirs_all.append(theirs)
        ratios.append(ours / theirs)
        shared_ratios.append(shared / theirs)
    report = {
        "pairs": len(rows), "layers": args.layers, "trl_steps": trl_steps, "packed_steps": our_steps,
        "trl_tokens_per_s": statistics.median(theirs_all), "packed_tokens_per_s": statistics.median(ours_all),
        "shared_tokens_per_s": statistics.median(shared_all), "ratio": statistics.median(ratios),
        "shared_ratio": statistics.median(shared_ratios),
    }  # fmt: skip
    print(
        f"# {len(rows)} pairs, SmolLM2's architecture with {args.layers} layers (random init), fp32, CPU threads "
        f"{torch.get_num_threads()}; TRL: {args.pairs_per_step} pairs a step, padded ({trl_steps} steps); packed: "
        f"best fit to {args.max_tokens:,} tokens ({our_steps} steps); {args.warmup} warm-up step(s) not timed"
    )
    print(f"{'variant':<34}{'effective tokens/s':>20}{'vs TRL':>10}")
    print(f"{'TRL DPOTrainer (padded)':<34}{report['trl_tokens_per_s']:>20.1f}{1.0:>9.2f}x")
    print(f"{'packed DPO (lit_packing)':<34}{report['packed_tokens_per_s']:>20.1f}{report['ratio']:>9.2f}x")
    shared_row = "packed DPO, prompt run once"
    print(f"{shared_row:<34}{report['shared_tokens_per_s']:>20.1f}{report['shared_ratio']:>9.2f}x")
    return report


def smollm2_shape() -> dict:
    """SmolLM2-135M's architecture (its config, random weights: throughput does not depend on their values)."""
    return {
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "rope_theta": 100000.0,
    }  # fmt: skip


if __name__ == "__main__":
    main()
