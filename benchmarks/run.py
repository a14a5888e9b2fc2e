"""`python -m benchmarks`: padding, the paper's packing variants, ours and the peers, trained side by side.

Every row trains the same examples from the same initial weights with the same optimizer, for `warmup_steps + steps`
optimizer steps, each run in a fresh process; rounds are interleaved (round r runs every row, in an order rotated by
r) so that machine noise reaches every row alike. Effective tokens/s counts real tokens only over the timed steps;
its ratios are taken within a round and their median reported. Writes `bench.md`, `bench.json` and `bench.png`
under `out` and prints the table and the targets.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

from jsonargparse import ActionConfigFile, ArgumentParser
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from benchmarks.report import Report
from benchmarks.variants import INSTALL_BENCH, VARIANTS, RunResult, RunSpec, check_installed
from lit_packing.cli import quiet_defaults
from lit_packing.errors import ConfigError, LitPackingError
from lit_packing.processes import die_with_parent

PRETRAINED = "smollm2"
SMOKE_MODEL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 2}  # fmt: skip


@dataclass
class BenchSettings:
    """What to run. Every field is a flag (`--rounds 5`) or a key of a YAML given with `--config`.

    Args:
        variants: rows to run, of: padding, padding_full_logits, minibatch_packing, fixed_no_position_ids,
            fixed_position_ids, bestfit_packing, multipack, hf_trainer, trl_bfd (TRL, from the `bench` extra).
            Default: every row whose packages are installed.
        pretrained: variants run a second time on the packaged pretrained SmolLM2-135M (30 layers, gradient
            checkpointing on), each as a row of its own.
        pretrained_rounds: rounds that include the pretrained rows (they are ~15x slower per token).
        model_config: the random-init model: SmolLM2-135M's architecture with these fields changed.
        rounds: interleaved repetitions of every row (medians and spread are over rounds).
        warmup_steps: optimizer steps before the clock starts (kernel selection, first-step checks, allocator).
        steps: timed optimizer steps per run.
        examples: CHAMP chats drawn (seeded); `val_examples` of them are held out for validation.
        val_examples: held-out chats every row's validation loss is measured on.
        max_length: tokens per example (longer chats are truncated, as in training).
        batch_size: examples per step of padding, mini-batch packing and the HF Trainer.
        max_tokens: token budget per step of best fit, multipack and TRL's bfd packing; default
            `batch_size * max_length`, the slots of one padded mini-batch at its longest (padding's memory budget).
        rows_per_step: rows of `max_length` tokens per step of fixed-length packing.
        lr: AdamW learning rate (constant; no weight decay; gradient clipping at 1.0), every row.
        seed: data split, shuffling and initial weights.
        accelerator: cpu or cuda.
        precision: Lightning precision, e.g. 32-true (CPU) or bf16-mixed (GPU; the peers get bf16=True).
        attn_backend: lit_packing's packed attention (auto: flash_attn > torch_varlen on GPU, per_example on CPU).
        out: folder for bench.md / bench.json / bench.png, the per-run logs and the initial weights.
        smoke: a wiring check in a minute or two: a 2-layer, 64-wide model, 48 short examples, 2 rounds of 1+2 steps.
    """

    variants: list[str] = field(default_factory=lambda: [name for name, v in VARIANTS.items() if v.installed])
    pretrained: list[str] = field(default_factory=lambda: ["minibatch_packing"])
    pretrained_rounds: int = 1
    model_config: dict = field(default_factory=lambda: {"num_hidden_layers": 4})
    rounds: int = 3
    warmup_steps: int = 1
    steps: int = 3
    examples: int = 400
    val_examples: int = 16
    max_length: int = 2048
    batch_size: int = 8
    max_tokens: int | None = None
    rows_per_step: int = 4
    lr: float = 1e-4
    seed: int = 42
    accelerator: Literal["cpu", "cuda"] = "cpu"
    precision: str = "32-true"
    attn_backend: str = "auto"
    out: Path = Path("runs/bench")
    smoke: bool = False

    def __post_init__(self) -> None:
        if self.smoke:
            self.model_config, self.pretrained = dict(SMOKE_MODEL), []
            self.rounds, self.warmup_steps, self.steps = 2, 1, 2
            self.examples, self.val_examples, self.max_length = 64, 8, 256
            self.batch_size, self.max_tokens, self.rows_per_step = 4, None, 4
            if self.out == Path("runs/bench"):  # never over the full benchmark's results
                self.out = Path("runs/bench_smoke")
        if self.max_tokens is None:
            self.max_tokens = self.batch_size * self.max_length
        unknown = sorted(set(self.variants + self.pretrained) - set(VARIANTS))
        if unknown:
            raise ConfigError("variants", f"unknown {unknown}", f"choose from {', '.join(VARIANTS)}")
        for name in ("rounds", "warmup_steps", "steps", "examples", "val_examples", "batch_size", "max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"{getattr(self, name)} is not >= 1", "use a positive count")
        check_installed(self.variants + self.pretrained)


def initial_weights(settings: BenchSettings) -> str:
    """Save the random-init model (SmolLM2-135M's architecture with `model_config`) and the tokenizer once, in
    `out/init_model`, so that every row and peer starts from exactly these weights; reused while the config holds."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lit_packing.assets import resolve_pretrained

    folder = settings.out / "init_model"
    source = resolve_pretrained(PRETRAINED, with_model=False)  # the architecture and tokenizer: no weights
    config = AutoConfig.from_pretrained(source)
    for key, value in settings.model_config.items():
        setattr(config, key, value)
    stamp = folder / "bench_init.json"
    wanted = {"config": config.to_diff_dict(), "seed": settings.seed}
    if stamp.exists() and json.loads(stamp.read_text()) == json.loads(json.dumps(wanted, default=str)):
        return str(folder.resolve())
    torch.manual_seed(settings.seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    stamp.write_text(json.dumps(wanted, default=str))
    return str(folder.resolve())


def plan_runs(settings: BenchSettings, init_model: str) -> list[RunSpec]:
    """Every run of the benchmark, round by round; within round r the rows start at the r-th (rotated)."""
    rows = [(name, name, init_model, False) for name in settings.variants]
    rows += [(f"{name}@{PRETRAINED}", name, PRETRAINED, True) for name in settings.pretrained]
    runs = []
    for r in range(settings.rounds):
        here = [row for row in rows if not row[3] or r < settings.pretrained_rounds]
        shift = r % len(here)
        for row, variant, model, pretrained in here[shift:] + here[:shift]:
            runs.append(
                RunSpec(
                    variant=variant, round=r, model=model, row=row, steps=settings.warmup_steps + settings.steps,
                    warmup_steps=settings.warmup_steps, examples=settings.examples,
                    val_examples=settings.val_examples, max_length=settings.max_length,
                    batch_size=settings.batch_size, max_tokens=settings.max_tokens,
                    rows_per_step=settings.rows_per_step, lr=settings.lr, seed=settings.seed,
                    accelerator=settings.accelerator, precision=settings.precision,
                    attn_backend=settings.attn_backend, gradient_checkpointing=pretrained,
                    out=str(settings.out / "runs" / f"{row}-r{r}"),
                )
            )  # fmt: skip
    return runs


def run_isolated(spec: RunSpec, logs: Path) -> RunResult:
    """Run one spec in a fresh process (its own peak memory, no state left by another row), forked from a server
    that imported the worker's modules once: each run starts from that clean import, without its seconds."""
    run_dir = Path(spec.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_file, result_file = run_dir / "spec.json", run_dir / "result.json"
    spec_file.write_text(json.dumps(asdict(spec)))
    result_file.unlink(missing_ok=True)
    log = logs / f"{spec.row}-r{spec.round}.log"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    process = _worker_processes().Process(target=_run_worker, args=(str(spec_file), str(result_file), str(log), env))
    process.start()
    process.join()
    if process.exitcode != 0 or not result_file.exists():
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise RuntimeError(f"{spec.row} (round {spec.round}) failed with status {process.exitcode}; {log}:\n{tail}")
    fields = json.loads(result_file.read_text())
    return RunResult(**fields)


def _worker_processes():
    """multiprocessing's `forkserver`: a server process imports `benchmarks.worker` (torch, Lightning,
    transformers: seconds) once, and each run is a fork of it. Nothing runs in the server but those imports (no
    thread, no device), so every run starts as a new interpreter would after the same imports."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["benchmarks.worker"])
    return context


def _run_worker(spec_file: str, result_file: str, log: str, env: dict[str, str]) -> None:
    """One run, in a process forked from the server: `env` as its environment, its output in `log`, ended with
    the server (which ends with the process that runs the benchmark)."""
    import gc

    import torch

    from benchmarks.worker import main

    gc.freeze()  # the server's imports: never traversed by this run's collections, so their pages stay shared
    die_with_parent()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS"):  # the server's torch read the environment it was started in
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    main([spec_file, result_file])


def environment(settings: BenchSettings) -> dict[str, str]:
    import lightning
    import torch
    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__,
                "transformers": transformers.__version__}  # fmt: skip
    if importlib.util.find_spec("trl") is not None:
        import trl

        versions["trl"] = trl.__version__
    if settings.accelerator == "cuda" and torch.cuda.is_available():
        machine = torch.cuda.get_device_name(0)
    else:
        machine = f"{_cpu_name()}, {len(os.sched_getaffinity(0))} cores"
    return {"date": time.strftime("%Y-%m-%d"), "machine": machine, **versions}


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return f"{platform.processor() or platform.machine()} CPU"


def parse(argv: list[str] | None) -> BenchSettings:
    parser = ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML of the settings below")
    parser.add_class_arguments(BenchSettings, skip={"smoke"})
    parser.add_argument("--smoke", action="store_true", help="a wiring check: tiny model, few examples and steps")
    config = parser.parse_args(argv)
    config.pop("config", None)
    return BenchSettings(**config.as_dict())


def main(argv: list[str] | None = None) -> Report:
    """Run the benchmark; a bad setting is printed in one line (exit status 2), as `main.py` prints its own."""
    try:
        settings = parse(argv)
    except LitPackingError as error:
        print(f"error: {error}", flush=True)
        raise SystemExit(2) from None
    quiet_defaults()
    settings.out.mkdir(parents=True, exist_ok=True)
    logs = settings.out / "logs"
    logs.mkdir(exist_ok=True)
    console = Console()
    left_out = [name for name, variant in VARIANTS.items() if not variant.installed]
    if left_out:
        line = f"not installed, so not run: {', '.join(left_out)}; to add them: {INSTALL_BENCH}"
        console.print(line, soft_wrap=True, markup=False)  # markup would eat `[bench]`
    console.print(f"preparing the initial weights in {settings.out / 'init_model'}")
    runs = plan_runs(settings, initial_weights(settings))
    results = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("benchmark", total=len(runs))
        for k, spec in enumerate(runs):
            progress.update(task, description=f"round {spec.round + 1}/{settings.rounds}: {spec.row}")
            result = run_isolated(spec, logs)
            results.append(result)
            progress.console.print(
                f"  round {spec.round + 1} {spec.row:<28} {result.tokens_per_second:10.1f} effective tok/s  "
                f"loss {result.loss[-1]:.4f}  val {result.val_loss:.4f}  peak {result.peak_memory_gb:.2f} GiB"
            )
            progress.advance(task)
            if k == len(runs) - 1 or runs[k + 1].round != spec.round:
                report = Report(results, asdict(replace(settings, out=str(settings.out))), environment(settings))
                report.write(settings.out)  # after every round: a run cut short keeps the rounds it finished
    console.print(report.markdown())
    console.print(f"wrote {settings.out / 'bench.md'}, bench.json, bench.png")
    return report


if __name__ == "__main__":
    main()
