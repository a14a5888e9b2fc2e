"""The streaming pipeline on its own (no model): time to the first packed step, memory over a pass, throughput,
mixture shares -- on synthetic chats written as local JSON Lines shards, with the real SmolLM2 tokenizer.

    python -m benchmarks.stream_pipeline                   # 20k vs 2M chats, a full pass of 2M, shares
    python -m benchmarks.stream_pipeline --smoke           # 2k vs 20k chats (about a minute)

What each number is:
- time to first step: from building the stream (listing the shards, holding out validation rows) to the first
  collated micro-batch, in a fresh process, for a small and a large corpus of the same chats; the ratio is the
  target (<= 1.2: it must not grow with the corpus).
- memory: resident memory of the pipeline (this process plus its DataLoader workers) sampled every 2 s over a
  pass of the large corpus; flat means bounded by the window, not the corpus.
- throughput: real tokens per second the pipeline packs (tokenize in workers, plan and collate here), against the
  tokens per second the quickstart model trains at on this CPU (`--train-tokens-per-sec`, from `make run`).
- shares: a 70/30 token mixture of two shard folders (short and long chats): each source's share of the real tokens
  in every window and over the pass.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import child_env, module_command
from lit_packing.processes import EndWithParent

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "this",
    "which",
    "be",
    "are",
    "was",
    "it",
    "an",
    "or",
    "we",
    "can",
]
SHARD_ROWS = 100_000


def write_chats(folder: Path, n: int, seed: int, scale: float = 1.0) -> Path:
    """`n` synthetic chats (a question and a long-tailed answer) in JSON Lines shards of 100,000 rows."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for start in range(0, n, SHARD_ROWS):
        rows = min(SHARD_ROWS, n - start)
        words = np.clip(rng.lognormal(np.log(60 * scale), 0.9, rows), 4, 1500).astype(int)
        with open(folder / f"chats-{start // SHARD_ROWS:05d}.jsonl", "w") as file:
            for k in range(rows):
                answer = " ".join(WORDS[(start + k + j) % len(WORDS)] for j in range(words[k]))
                chat = [{"role": "user", "content": f"question {start + k}"}, {"role": "assistant", "content": answer}]
                file.write(json.dumps({"messages": chat}) + "\n")
    return folder


def stream_loader(source, workers: int, buffer_size: int, max_tokens: int = 8192):
    """A one-rank StreamLoader of `source` with best fit, built as the data module builds it."""
    from transformers import AutoTokenizer

    from lit_packing.assets import resolve_pretrained
    from lit_packing.data import PackedCollator
    from lit_packing.data.global_batch import Layout
    from lit_packing.data.stream import Stream, StreamLoader, TokenizeRules
    from lit_packing.samplers import BestFitPackingSampler, RunContext

    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False, setting="tokenizer"))
    rules = TokenizeRules(tokenizer, 4096, "truncate", "completion", "error")
    stream = Stream(source, rules, buffer_size, seed=0, num_workers=workers)

    def make(window):
        sampler = BestFitPackingSampler(window.lengths, max_tokens=max_tokens)
        return sampler.connect(RunContext(seed=0, label_counter=window.count_labels))

    return StreamLoader(stream, make, PackedCollator(2), lambda: Layout(1, 1))


def first_step(folder: str, workers: int, buffer_size: int) -> None:
    """In a fresh process: seconds from building the stream to the first micro-batch (printed as JSON)."""
    from lit_packing.data import HFDataset

    began = time.perf_counter()
    loader = stream_loader(HFDataset("json", data_files=f"{folder}/*.jsonl"), workers, buffer_size)
    next(iter(loader))
    print(json.dumps({"seconds": time.perf_counter() - began}))


def rss_of_tree(pid: int) -> int:
    import psutil

    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def full_pass(source, workers: int, buffer_size: int, limit_s: float) -> dict:
    """Pack a pass (or `limit_s` seconds) of `source`: tokens/s, examples, resident memory samples, per-window
    source tokens."""
    loader = stream_loader(source, workers, buffer_size)
    samples, stop = [], threading.Event()

    def sample() -> None:
        while not stop.wait(2.0):
            samples.append(rss_of_tree(os.getpid()))

    threading.Thread(target=sample, daemon=True).start()
    windows: dict[int, np.ndarray] = {}
    tokens = examples = 0
    began = time.perf_counter()
    for batch in loader:
        counts = batch["counts"]
        tokens += counts["real_tokens"]
        examples += counts["examples"]
        number = batch["window"]["number"]
        windows[number] = windows.get(number, 0) + np.asarray(batch["source_tokens"])
        if time.perf_counter() - began > limit_s:
            break
    seconds = time.perf_counter() - began
    stop.set()
    return {"seconds": seconds, "tokens": tokens, "examples": examples, "rss": samples, "windows": windows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="2k vs 20k chats, a short pass")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--buffer-size", type=int, default=1000)
    parser.add_argument("--train-tokens-per-sec", type=float, default=229.2, help="the quickstart's, from make run")
    parser.add_argument("--pass-seconds", type=float, default=600.0, help="stop a pass after this long")
    parser.add_argument("--first-step-only", nargs=2, metavar=("FOLDER", "WORKERS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.first_step_only:
        first_step(args.first_step_only[0], int(args.first_step_only[1]), args.buffer_size)
        return
    from lit_packing.data import HFDataset, Mixture

    small_n, large_n = (2_000, 20_000) if args.smoke else (20_000, 2_000_000)
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        small = write_chats(Path(tmp) / "small", small_n, seed=1)
        large = write_chats(Path(tmp) / "large", large_n, seed=1)
        print(f"wrote {small_n:,} and {large_n:,} synthetic chats in {time.perf_counter() - began:.0f} s")
        times = {}
        for name, folder in (("small", small), ("large", large)):
            runs = []
            for _ in range(2):  # the best of two: the first may read a cold page cache
                out = subprocess.run(
                    module_command("stream_pipeline", "--first-step-only", str(folder), str(args.workers),
                                   "--buffer-size", str(args.buffer_size)),
                    capture_output=True, text=True, env=child_env(), check=True, preexec_fn=EndWithParent(),
                )  # fmt: skip
                runs.append(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])
            times[name] = min(runs)
        print("\n| corpus | chats | time to first step (s) |\n|---|---:|---:|")
        print(f"| small | {small_n:,} | {times['small']:.2f} |\n| large | {large_n:,} | {times['large']:.2f} |")
        print(f"ratio large / small: {times['large'] / times['small']:.2f} (target <= 1.2)")

        source = HFDataset("json", data_files=f"{large}/*.jsonl")
        result = full_pass(source, args.workers, args.buffer_size, args.pass_seconds)
        rate = result["tokens"] / result["seconds"]
        rss = np.asarray(result["rss"]) / 2**20
        print(f"\npass over {result['examples']:,} of {large_n:,} chats in {result['seconds']:.0f} s")
        print(f"pipeline: {rate:,.0f} real tokens/s, {result['examples'] / result['seconds']:,.0f} examples/s "
              f"({args.workers} workers); the quickstart trains {args.train_tokens_per_sec:,.1f} tokens/s: "
              f"{rate / args.train_tokens_per_sec:,.0f}x (target >= 10x)")  # fmt: skip
        if len(rss):
            quarter = max(len(rss) // 4, 1)
            first, last = rss[:quarter].mean(), rss[-quarter:].mean()
            print(f"resident memory (MiB, process + workers): first quarter mean {first:,.0f}, last quarter mean "
                  f"{last:,.0f}, max {rss.max():,.0f} over {len(rss)} samples")  # fmt: skip

        short = write_chats(Path(tmp) / "short", small_n, seed=2, scale=0.5)
        long_ = write_chats(Path(tmp) / "long", small_n, seed=3, scale=2.0)
        mixture = Mixture(
            [HFDataset("json", data_files=f"{short}/*.jsonl"), HFDataset("json", data_files=f"{long_}/*.jsonl")],
            weights=[0.7, 0.3], names=["short", "long"],
        )  # fmt: skip
        mixed = full_pass(mixture, args.workers, args.buffer_size, args.pass_seconds)
        shares = [w[0] / max(w.sum(), 1) for _, w in sorted(mixed["windows"].items())]
        whole = sum(mixed["windows"].values())
        full = shares[:-1] or shares  # the last window of the pass may be partial
        print(f"\nmixture 70/30 of short and long chats: share of 'short' per window of {args.buffer_size:,} "
              f"examples: min {min(full):.4f}, max {max(full):.4f} over {len(full)} windows; over the pass "
              f"{whole[0] / whole.sum():.4f} (target: within 0.01 of 0.70)")  # fmt: skip


if __name__ == "__main__":
    main()
