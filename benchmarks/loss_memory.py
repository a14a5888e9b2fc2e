"""Peak memory of a training step: the full-logits loss vs the chunked loss, each in its own process, side by side,
with the memory estimate's prediction next to each measured peak.

    python -m benchmarks.loss_memory                  # synthetic: 152k vocabulary, 1,024 and 2,048 tokens
    python -m benchmarks.loss_memory --tokens 8192 32768 --device cuda --impls full chunked liger
    python -m benchmarks.loss_memory --quickstart --steps 2  # the real SmolLM2 quickstart step (CPU)

Synthetic: a random-init Qwen2 model with Qwen2.5's vocabulary (151,936) but hidden 256 and 2 layers, so the LM
head and the loss dominate; one packed row of `tokens` (examples of 512), every token a label; one
forward + backward + AdamW step. Quickstart: the packaged `quickstart` config through the CLI for `--steps` steps.
Peak: CPU, the process's peak resident memory (`ru_maxrss`), which includes Python, torch and the weights; CUDA,
`max_memory_allocated`. Each variant runs in a fresh subprocess so peaks never mix.
"""

from __future__ import annotations

import argparse
import json
import subprocess

from benchmarks.common import GiB, child_env, module_command, peak_gib
from lit_packing.configs import config_path
from lit_packing.processes import EndWithParent

QWEN_LIKE = {
    "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 256, "intermediate_size": 1024,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}  # fmt: skip


def synthetic_child(impl: str, tokens: int, device: str, precision: str) -> dict:
    import torch

    from lit_packing.batch import StepShape
    from lit_packing.data.collate import PackedCollator
    from lit_packing.models import PackedCausalLM
    from lit_packing.models.loss import causal_lm_loss
    from lit_packing.models.memory import estimate_step_memory

    torch.manual_seed(0)
    lm = PackedCausalLM(model_config=QWEN_LIKE, loss_impl=impl, attn_backend="auto").to(device)
    example = 512
    gen = torch.Generator().manual_seed(0)
    batch = PackedCollator()(
        [{"input_ids": torch.randint(3, 151936, (example,), generator=gen).tolist()} for _ in range(tokens // example)]
    )
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    step = StepShape(tokens, (tokens // example) * example**2, 1, tokens)
    estimate = estimate_step_memory(lm, step, precision)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-5)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled="mixed" in precision)
    for _ in range(2):  # the second step is the peak: AdamW's states exist from the first
        with autocast:
            parts = causal_lm_loss(lm.loss_outputs(batch), batch, "token")
        (parts.objective / parts.normalizer).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"loss": float(parts.token_loss_sum / parts.label_tokens), "predicted": estimate.peak / GiB}


def quickstart_child(impl: str, steps: int) -> dict:
    from lit_packing.cli import cli_main

    cli = cli_main(
        [
            "fit", "--config", str(config_path("quickstart")), f"--trainer.max_steps={steps}",
            "--trainer.limit_val_batches=0", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
            f"--model.loss_impl={impl}",
        ]
    )  # fmt: skip
    estimate = cli.model.memory_estimate
    return {"loss": float(cli.trainer.callback_metrics["train/loss"]), "predicted": estimate.peak / GiB}


def run(child_args: list[str]) -> dict:
    command = module_command("loss_memory", "--child", *child_args)
    out = subprocess.run(
        command, capture_output=True, text=True, env=child_env(), check=False, preexec_fn=EndWithParent()
    )  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", nargs="+", default=["full", "chunked"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1024, 2048])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="32-true", help="32-true or bf16-mixed (synthetic runs)")
    parser.add_argument("--quickstart", action="store_true", help="the real quickstart step instead")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        kind, impl, *rest = args.child
        if kind == "quickstart":
            result = quickstart_child(impl, int(rest[0]))
        else:
            result = synthetic_child(impl, int(rest[0]), args.device, args.precision)
        print(json.dumps({**result, "peak": peak_gib(args.device)}))
        return
    common = ["--device", args.device, "--precision", args.precision]
    if args.quickstart:
        runs = [(impl, "quickstart", ["quickstart", impl, str(args.steps)]) for impl in args.impls]
    else:
        runs = [(impl, t, ["synthetic", impl, str(t)]) for t in args.tokens for impl in args.impls]
    print(f"{'loss_impl':>9} {'tokens':>10} {'peak GiB':>9} {'predicted':>9} {'pred/meas':>9} {'loss':>8}", flush=True)
    for impl, tokens, child_args in runs:  # each row as soon as it is measured
        r = run(child_args + common)
        if "error" in r:
            print(f"{impl:>9} {tokens!s:>10} failed: {r['error']}", flush=True)
            continue
        ratio = r["predicted"] / r["peak"]
        row = f"{impl:>9} {tokens!s:>10} {r['peak']:9.2f} {r['predicted']:9.2f} {ratio:9.2f} {r['loss']:8.4f}"
        print(row, flush=True)


if __name__ == "__main__":
    main()
