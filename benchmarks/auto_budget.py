"""`max_tokens: auto` on the real quickstart: the token budget the memory estimate chooses under a memory limit,
then real training steps at that budget and at the configured one, each measured against the limit.

    python -m benchmarks.auto_budget --limit-gb 10   # SmolLM2-135M, CHAMP chats, CPU: 3-8 minutes
    python -m benchmarks.auto_budget --smoke         # a tiny model, 2 steps: a wiring check in ~1 minute

Choose (one process): the quickstart's data and model as `main.py fit` builds them, the trainer attached, with
`model.memory_limit_gb` = the limit. Candidates: the multiples of 1,024 from the longest training example up to
65,536, as `BestFitPackingSampler`'s `max_tokens: auto` tries them; the worst-case step of a budget is its pack of
whole examples as long as the longest, then the rest, in one packed row (`worst_pack`, counted by `PackedCollator`).
`PackedCausalLM.largest_fitting` picks the largest whose predicted peak is at most the limit x (1 - margin); the
configured budget's worst-case step is predicted from the same measurement.
Train (a fresh process per budget, so peaks never mix): the quickstart for `--steps` steps with that number as
`data.sampler.init_args.max_tokens`, the same `model.memory_limit_gb` (the memory check applies it), no validation,
checkpoint or logger. Measured: the process's peak resident memory (`ru_maxrss`: Python, torch, data and weights
included) and real tokens per second of the steps after the first (the first includes the isolation self-test and
one-time allocations). CPU only: RAM is the device memory here.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time

from lightning.pytorch import Callback

from benchmarks.common import GiB, child_env, module_command, peak_gib
from lit_packing.batch import COUNTS
from lit_packing.configs import config_path
from lit_packing.processes import EndWithParent

LARGEST_CANDIDATE = 65536
SMOKE_MODEL = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 65536, "tie_word_embeddings": True,
}  # fmt: skip


class StepClock(Callback):
    """Real tokens and host seconds of the training steps after the first."""

    def __init__(self) -> None:
        self.tokens, self.seconds, self._start = 0, 0.0, 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx:
            self.tokens += batch[COUNTS]["real_tokens"]
            self.seconds += time.perf_counter() - self._start


def pack_of(longest: int):
    """A token budget -> the step of its most memory-hungry pack, as `max_tokens: auto` sizes it: whole examples
    of the longest length, then the rest, in one packed row."""
    from lit_packing.data.collate import PackedCollator
    from lit_packing.samplers.base import worst_pack

    return lambda tokens: PackedCollator().plan_slots(worst_pack(0, longest, tokens)).largest()


def cli_args(args: argparse.Namespace) -> list[str]:
    """The quickstart as every process of this benchmark runs it."""
    given = [
        "--config", str(config_path("quickstart")), f"--model.memory_limit_gb={args.limit_gb}",
        f"--model.memory_margin={args.margin}", "--trainer.limit_val_batches=0", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
    ]  # fmt: skip
    if args.smoke:
        given += [f"--model.model_config={json.dumps(SMOKE_MODEL)}", "--data.limit=64", "--data.max_length=256"]
    return given


def choose_child(args: argparse.Namespace) -> dict:
    from lit_packing.cli import cli_main
    from lit_packing.models.memory import memory_model

    cli = cli_main(cli_args(args), run=False)
    data, lm = cli.datamodule, cli.model
    data.trainer = lm.trainer = cli.trainer
    data.prepare_data()
    data.setup("fit")
    longest = int(data.train_lengths.max())
    step_of = pack_of(longest)
    candidates = range(math.ceil(longest / 1024) * 1024, LARGEST_CANDIDATE + 1, 1024)
    chosen, estimate = lm.largest_fitting(step_of, candidates)
    configured = int(cli.config.data.sampler.init_args.max_tokens)
    default = memory_model(lm, str(cli.trainer.precision), padded=False).estimate(step_of(configured))
    return {
        "longest": longest,
        "chosen": chosen,
        "chosen_predicted": estimate.peak / GiB,
        "configured": configured,
        "configured_predicted": default.peak / GiB,
    }


def train_child(args: argparse.Namespace, max_tokens: int) -> dict:
    from benchmarks import auto_budget  # the class the CLI instantiates (this file runs as `__main__`)
    from lit_packing.cli import cli_main

    budget = [f"--data.sampler.init_args.max_tokens={max_tokens}", f"--trainer.max_steps={args.steps}"]
    clock = "--trainer.callbacks+=benchmarks.auto_budget.StepClock"
    cli = cli_main(["fit", *cli_args(args), *budget, clock])
    clock = next(c for c in cli.trainer.callbacks if isinstance(c, auto_budget.StepClock))
    return {
        "plan_predicted": cli.model.memory_estimate.peak / GiB,
        "tokens_per_s": clock.tokens / clock.seconds if clock.seconds else None,  # None: one step, nothing timed
        "steps": cli.trainer.global_step,
    }


def run(given: list[str], child: list[str]) -> dict:
    """One child process; its JSON line, with its lines that name the choice echoed."""
    command = module_command("auto_budget", *given, "--child", *child)
    out = subprocess.run(
        command, capture_output=True, text=True, env=child_env(), check=False, preexec_fn=EndWithParent()
    )  # fmt: skip
    for line in out.stdout.splitlines():
        if "auto chose" in line or "auto found" in line:
            print(line.strip(), flush=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        return {"error": ((out.stderr.strip() or out.stdout.strip()).splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit-gb", type=float, default=10.0, help="model.memory_limit_gb: the memory limit")
    parser.add_argument("--margin", type=float, default=0.25, help="model.memory_margin: the fraction kept free")
    parser.add_argument("--steps", type=int, default=3, help="training steps per budget (>= 2: the first is not timed)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 64 short chats, 2 steps: the wiring")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2: the first step is not timed")
    if args.smoke:
        args.steps = 2
    if args.child is not None:
        kind, *rest = args.child
        result = choose_child(args) if kind == "choose" else train_child(args, int(rest[0]))
        print(json.dumps({**result, "peak": peak_gib("cpu")}))
        return
    given = [f"--limit-gb={args.limit_gb}", f"--margin={args.margin}", f"--steps={args.steps}"]
    given += ["--smoke"] if args.smoke else []
    choice = run(given, ["choose"])
    if "error" in choice:
        sys.exit(f"choosing failed: {choice['error']}")
    limit = f"limit {args.limit_gb:g} GiB, margin {args.margin:.0%}"
    print(f"longest training example: {choice['longest']:,} tokens; {limit}")
    rows = [("configured", choice["configured"], choice["configured_predicted"])]
    if choice["chosen"] is not None:
        rows.append(("auto", choice["chosen"], choice["chosen_predicted"]))
    header = ("budget", "max_tokens", "predicted", "plan pred.", "measured", "meas/limit", "tokens/s")
    print("{:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9}".format(*header), flush=True)
    for name, tokens, predicted in rows:  # each row as soon as it is measured
        r = run(given, ["train", str(tokens)])
        if "error" in r:
            print(f"{name:>10} {tokens:>10,} {predicted:10.2f} failed: {r['error']}", flush=True)
            continue
        ratio = r["peak"] / args.limit_gb
        speed = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}"
        print(
            f"{name:>10} {tokens:>10,} {predicted:10.2f} {r['plan_predicted']:10.2f} {r['peak']:10.2f} "
            f"{ratio:10.2f} {speed:>9}",
            flush=True,
        )
    print("GiB; predicted: the worst-case step of the budget; plan pred.: the plan's largest step, at train start")


if __name__ == "__main__":
    main()
