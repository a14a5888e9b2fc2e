"""`configs/gpu.yaml` through the real CLI on the simulated GPU machine, as a GPU user runs it (tiny model): bf16-mixed
and 16-mixed, flash_attn and torch_varlen, gradient accumulation, the isolation self-test on, and `compile: true`;
the per-step losses match the exact per_example backend's within half-precision noise. Slow (minutes: fp16 matmuls
are slow on a CPU); the fast tier's Trainer fits are in test_findings.

    python -m tests.emulated.test_fit     # the losses side by side
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from lit_packing.cli import cli_main
from tests.conftest import TINY
from tests.emulated.machine import SimulatedGPU

STEPS = 4
# Half-precision noise on these losses (~10.8): per_example itself moves by ~1e-3 between bf16-mixed and 16-mixed
# runs of the same steps; a contaminated pack or a wrong scale moves a loss by far more (see test_backends).
LOSS_TOL = {"bf16-mixed": 2e-2, "16-mixed": 5e-3}
KERNELS = {  # each backend's forward and backward kernel, as the simulated GPU counts them
    "flash_attn": ("flash_attn_2_cuda.varlen_fwd", "flash_attn_2_cuda.varlen_bwd"),
    "torch_varlen": ("aten::_flash_attention_forward", "aten::_flash_attention_backward"),
}


def gpu_fit(tmp_path: Path, precision: str, backend: str, *extra: str, flash_attn: bool = True) -> dict:
    """One fit of configs/gpu.yaml on a simulated GPU: its per-step losses and the kernels it called."""
    out = tmp_path / f"{backend}_{precision}"
    args = [
        "fit", "--config", "gpu",
        f"--model.model_config={json.dumps(TINY)}", f"--model.attn_backend={backend}", "--model.lr=1e-3",
        "--model.warmup_steps=0", "--data.limit=64", "--data.val_split=8", "--data.max_length=256",
        "--data.sampler.init_args.max_tokens=512", "--data.num_workers=1",
        f"--trainer.precision={precision}", f"--trainer.max_steps={STEPS}", "--trainer.accumulate_grad_batches=2",
        "--trainer.val_check_interval=null", "--trainer.log_every_n_steps=1", f"--trainer.default_root_dir={out}",
        f"--trainer.logger={json.dumps({'class_path': 'CSVLogger', 'init_args': {'save_dir': str(out)}})}",
        *extra,
    ]  # fmt: skip
    with SimulatedGPU(flash_attn=flash_attn) as gpu:
        cli_main(args)
    (metrics,) = out.glob("**/metrics.csv")
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    return {"losses": losses, "kernels": dict(gpu.kernel_calls)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The exact per_example backend's losses, per precision (computed once)."""
    cache = {}

    def losses(precision: str) -> list[float]:
        if precision not in cache:
            cache[precision] = gpu_fit(tmp_path_factory.mktemp("ref"), precision, "per_example")
            assert cache[precision]["kernels"] == {}  # the exact backend never calls a kernel
        return cache[precision]["losses"]

    return losses


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
def test_gpu_config_fits_with_the_kernel_backend(tmp_path, reference, backend, precision, capsys, every_core):
    run = gpu_fit(tmp_path, precision, backend, flash_attn=backend == "flash_attn")
    printed = capsys.readouterr().out
    assert f"attention backend: {backend} on cuda:0" in printed or f"attention backend: {backend}," in printed
    assert f"isolation self-test passed: attn_backend={backend}" in printed
    assert "computes in bfloat16" not in printed  # mixed precision: nothing to warn about
    forward, backward = KERNELS[backend]
    # 2 layers x 2 micro-batches x 4 steps backward; forward also runs in the self-test and the memory probes
    assert run["kernels"][backward] == 2 * 2 * STEPS and run["kernels"][forward] > 2 * 2 * STEPS
    ref = reference(precision)
    assert len(run["losses"]) == len(ref) == STEPS
    diff = max(abs(a - b) for a, b in zip(run["losses"], ref))
    assert diff <= LOSS_TOL[precision], (run["losses"], ref)
    assert ref[-1] < ref[0] - 0.05  # the steps really train: the comparison is not between two flat lines


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
def test_gpu_config_fits_compiled(tmp_path, reference, backend, every_core):
    """`compile: true`: the same losses; graph breaks counted over the whole fit, none in the attention path
    (without the fixes: 14 with either backend, from logging and a ContextVar); the compiled graphs call the
    kernels, every micro-batch's backward."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    # On an AVX-512 CPU, torch 2.13's inductor compiles these bf16 graphs into 512-bit CPU kernels that write past
    # a buffer ("malloc(): corrupted top size", the worker aborted; NaN logits in a later test of the same process);
    # 256-bit vectors (what an AVX2-only CPU gets) run them exactly. A GPU compiles them with Triton instead.
    with torch._inductor.config.patch({"cpp.simdlen": 256}):
        run = gpu_fit(tmp_path, "bf16-mixed", backend, "--model.compile=true", flash_attn=backend == "flash_attn")
    breaks = dict(counters["graph_break"])
    torch._dynamo.reset()
    assert not [reason for reason in breaks if "attention.py" in reason or "lit_packing" in reason], breaks
    assert breaks == {}, breaks
    forward, backward = KERNELS[backend]
    assert run["kernels"][backward] == 2 * 2 * STEPS  # 2 layers x 2 micro-batches x 4 steps, in compiled graphs
    assert run["kernels"][forward] > 2 * 2 * STEPS
    diff = max(abs(a - b) for a, b in zip(run["losses"], reference("bf16-mixed")))
    assert diff <= LOSS_TOL["bf16-mixed"]


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        for precision in ("bf16-mixed", "16-mixed"):
            runs = {b: gpu_fit(Path(folder), precision, b, flash_attn=b != "torch_varlen")["losses"]
                    for b in ("per_example", "flash_attn", "torch_varlen")}  # fmt: skip
            print(f"{precision}: step  " + "  ".join(f"{b:>12}" for b in runs))
            for step in range(STEPS):
                print(f"{'':{len(precision)}}  {step + 1:4d}  " + "  ".join(f"{runs[b][step]:12.5f}" for b in runs))
