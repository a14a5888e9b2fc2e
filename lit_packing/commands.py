"""The `lit-packing` command (also `python main.py` and `python -m lit_packing`): training, the report, the configs.

    lit-packing fit --config quickstart          # LightningCLI: fit, validate, test (as python main.py)
    lit-packing report --config quickstart       # the packing report (python -m lit_packing.packing_report)
    lit-packing configs                          # the packaged configs: name, how it runs, what it is
    lit-packing export --ckpt_path CKPT --output DIR   # a run's checkpoint as a Hugging Face folder

The benchmark is not part of the installed package: it runs from a checkout of the repository, from its root, with
`python -m benchmarks` (`lit-packing bench` says so and exits with status 2).

A `--config` value is a file or the name of a packaged config; a packaged delta runs after its base
(`--config paper --config padding`). Anything else on the command line goes to the command as it is.
"""

from __future__ import annotations

import sys
import textwrap

BENCH_MOVED = (
    "the benchmark is not part of the installed package; run it from a checkout of the repository, "
    "from its root: python -m benchmarks"
)


def main() -> None:
    """Run the command `sys.argv` names: `report`, `configs`, or else the training CLI (`bench`: a pointer)."""
    command, rest = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else (None, [])
    if command == "report":
        del sys.argv[1:]  # the report builds the training CLI in-process from `rest`: LightningCLI must not see argv
        from lit_packing.packing_report import main as report

        report(rest)
    elif command == "bench":
        print(f"error: {BENCH_MOVED}", flush=True)
        raise SystemExit(2)
    elif command == "configs":
        print_configs()
    elif command == "export":
        export(rest)
    else:
        if command in ("-h", "--help"):
            print(__doc__.split("\n\n")[1].rstrip("\n") + "\n")
        from lit_packing.processes import leave_process_group

        cli_main = import_cli()
        cli_main()
        leave_process_group()  # only after a run that finished: see its docstring


def import_cli():
    """The training CLI's imports (torch, Lightning, transformers: ~500k objects, little garbage) with Python's
    cyclic garbage collector paused, then frozen out of it: 0.7 s less of a ~4.4 s start for every command and rank,
    and the loader workers a fit forks never walk the imports' objects (a walk writes to, so copies, their pages)."""
    import gc

    gc.disable()
    try:
        from lit_packing.cli import cli_main
    finally:
        gc.enable()
    gc.collect()
    gc.freeze()
    return cli_main


def print_configs() -> None:
    """Every packaged config: its name, the `--config` arguments it runs with, and its header's first sentence."""
    from lit_packing.configs import DELTAS, describe, names

    width = max(map(len, names()))
    for name in names():
        runs = f"--config {DELTAS[name]} --config {name}" if name in DELTAS else f"--config {name}"
        print(f"{name:<{width}}  {runs}")
        print(textwrap.fill(describe(name), 116, initial_indent="    ", subsequent_indent="    "))


def export(args: list[str]) -> None:
    """`lit-packing export --ckpt_path CKPT --output DIR [--file_bytes N]` (`export.export_checkpoint`); an error is
    one line and status 2."""
    import argparse

    from lit_packing.checkpoint_export import export_checkpoint
    from lit_packing.errors import LitPackingError
    from lit_packing.models.export import EXPORT_FILE_BYTES

    parser = argparse.ArgumentParser(prog="lit-packing export", description=export.__doc__)
    parser.add_argument(
        "--ckpt_path",
        required=True,
        help="a run's checkpoint: a file (last.ckpt), or a sharded run's distributed checkpoint folder",
    )
    parser.add_argument("--output", required=True, help="the Hugging Face folder to write")
    parser.add_argument("--file_bytes", type=int, default=EXPORT_FILE_BYTES, help="the most bytes a file holds")
    parser.add_argument(
        "--adapters_only",
        action="store_true",
        help="a LoRA run: its adapters (peft's folder) instead of the merged model",
    )
    options = parser.parse_args(args)
    try:
        export_checkpoint(options.ckpt_path, options.output, options.file_bytes, options.adapters_only)
    except LitPackingError as error:
        print(f"error: {error}", flush=True)
        raise SystemExit(2) from None
