"""What the benchmarks share: starting a benchmark module in a child process, and the measuring helpers.

Every benchmark module may import this one; this one imports no other benchmark module but `variants` (inside the
functions that need it), so the benchmarks' imports never form a cycle. Its top level imports only the standard
library: a light benchmark (`packing_speed`, `stream_fill`) loads no torch or Lightning through it.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from benchmarks.variants import RunResult, RunSpec
    from lit_packing.cli import PackingCLI

ROOT = Path(__file__).resolve().parents[1]  # the checkout: `benchmarks` is importable from here
CLEAR_REFS, STATUS = "/proc/self/clear_refs", "/proc/self/status"
GiB = 2**30


def module_command(name: str, *args: str) -> list[str]:
    """`python -m benchmarks.<name> ARGS...` with this interpreter; run it with `child_env()`."""
    return [sys.executable, "-m", f"benchmarks.{name}", *args]


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) with the checkout first on PYTHONPATH, so that a child started
    by `module_command` imports `benchmarks` whatever its working directory."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


# Peak memory and step clocks.


def peak_gib(device: str) -> float:
    """GiB: CUDA's `max_memory_allocated`, or the process's peak resident set (`ru_maxrss`, Linux) since it began."""
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / GiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Start measuring peak memory anew: CUDA's allocator statistics, or (Linux) the process's peak resident set."""
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
    elif Path(CLEAR_REFS).exists():
        Path(CLEAR_REFS).write_text("5")  # resets VmHWM to the current resident set


def peak_memory(device: torch.device) -> float:
    """GiB: CUDA's peak allocated, or the peak resident set since `reset_peak_memory` (Linux; else since start)."""
    if device.type == "cuda" or not Path(STATUS).exists():
        from lit_packing.callbacks.throughput import peak_memory_gb

        return peak_memory_gb(device)
    line = next(x for x in Path(STATUS).read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 2**20  # kB


def step_ended(result: RunResult, device: torch.device) -> None:
    """The end of an optimizer step: the clock, and the peak memory measured from the end of the warm-up."""
    synchronize(device)
    result.step_end.append(time.perf_counter())
    if len(result.step_end) == result.warmup_steps:
        reset_peak_memory(device)
    if len(result.step_end) == result.steps:  # before validation, which the fit runs next
        result.peak_memory_gb = peak_memory(device)


def warm_up() -> tuple[float, str]:
    """This process's first call of every packing kernel: a cache load, or a compile on a fresh install."""
    import numpy as np

    from lit_packing.samplers import kernels

    start = time.perf_counter()
    kernels.counting_sort(np.array([1, 0]), 2)
    kernels.best_fit_decreasing(np.array([2, 1]), 4)
    kernels.next_fit(np.array([2, 1]), 4)
    kernels.balance_steps(np.array([2.0, 1.0]), 2, 1)
    seconds = time.perf_counter() - start
    kernels_used = (kernels.counting_sort, kernels.next_fit, kernels.balance_steps)
    misses = sum(sum(k.stats.cache_misses.values()) for k in kernels_used)
    return seconds, "compiled (cache was empty)" if misses else "loaded from numba cache"


# Our rows through the CLI's own path (the worker's runs, and the peers' data and validation).


def variant_cli(spec: RunSpec) -> PackingCLI:
    """The CLI (model, data module, trainer; not run) of the spec's variant config with the benchmark's overrides."""
    from benchmarks.variants import VARIANTS
    from lit_packing.cli import cli_main

    return cli_main([*VARIANTS[spec.variant].config_args(), *spec.overrides()], run=False)


def validate(cli: PackingCLI) -> float:
    """The validation loss of the CLI's model on its held-out examples."""
    metrics = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    return float(metrics[0]["val/loss"])
