"""What verifying the tokenization cache costs: the size + XXH3-128 check against a load from cache, on full CHAMP.

    python -m benchmarks.cache_check --cache-dir /tmp/champ_cache   # the first run tokenizes (minutes)

Prints the cache size, the time of the check alone, and the time of a whole `tokenize_dataset` call that hits the
cache (check included), best of `--repeats`, measured side by side in one process.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from transformers import AutoTokenizer

from lit_packing._compat import dataset_fingerprint
from lit_packing.assets import resolve_pretrained
from lit_packing.data import ChampChats
from lit_packing.data.cache_check import cache_files, file_record
from lit_packing.data.tokenize import tokenization_fingerprint, tokenize_dataset


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=None, help="datasets cache folder (default: its own)")
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False))
    raw = ChampChats().load(args.cache_dir)
    start = time.perf_counter()
    tokenized, report = tokenize_dataset(raw, tokenizer, max_length=args.max_length)
    print(f"first call (tokenizes unless cached): {time.perf_counter() - start:.1f} s; {report}")

    fingerprint = tokenization_fingerprint(
        dataset_fingerprint(raw), tokenizer, tokenizer.chat_template, args.max_length, "truncate", "completion"
    )
    files = cache_files(Path(tokenized.cache_files[0]["filename"]).parent, fingerprint)
    size = sum(path.stat().st_size for path in files)
    check = best_of(args.repeats, lambda: [file_record(path) for path in files])
    load = best_of(args.repeats, lambda: tokenize_dataset(raw, tokenizer, max_length=args.max_length))
    print(f"cache: {len(files)} file(s), {size / 2**20:,.1f} MiB, {report.real_tokens:,} tokens")
    print(f"size + XXH3-128 check: {check:.3f} s ({size / 2**20 / check:,.0f} MiB/s)")
    print(f"tokenize_dataset from cache, check included: {load:.3f} s (check = {check / load:.0%} of it)")


if __name__ == "__main__":
    main()
