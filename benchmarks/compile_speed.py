"""Eager vs `compile: true` training steps, side by side: the first step's cost (compilation) and the steady-state
step time, on packed steps padded to bucket sizes.

    python -m benchmarks.compile_speed                # SmolLM2 width, 4 layers, vocab 8,192, CPU
    python -m benchmarks.compile_speed --device cuda --layers 30 --vocab 49152 --tokens 8192

Both variants run `PackedCausalLM.training_step` + backward + AdamW on the same random-token packs (examples of 64
to 512 tokens filling `--tokens`, tail padded to `--buckets`), each in a fresh subprocess. Prints per variant:
the first step (compile time included), the median of the later steps, graphs compiled after step 1
(`train/recompiles`), the last loss; and the compiled/eager steady-state speed-up. Break-even = compile overhead /
time saved per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from benchmarks.common import child_env, module_command
from lit_packing.processes import EndWithParent

SMOLLM2_WIDTH = {
    "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
    "num_key_value_heads": 3, "tie_word_embeddings": True, "max_position_embeddings": 8192,
}  # fmt: skip


def child(args: argparse.Namespace, compile: bool) -> dict:
    import numpy as np
    import torch

    from lit_packing._compat import compiled_graphs
    from lit_packing.data.collate import PackedCollator
    from lit_packing.models import PackedCausalLM
    from lit_packing.models.loss import causal_lm_loss

    torch.manual_seed(0)
    config = dict(SMOLLM2_WIDTH, num_hidden_layers=args.layers, vocab_size=args.vocab)
    lm = PackedCausalLM(model_config=config, attn_backend="auto", compile=compile).to(args.device)
    if compile:
        lm.hf_model.base_model.compile(dynamic=None)  # what `setup` does under a Trainer
    rng = np.random.default_rng(0)
    collate = PackedCollator(bucket_sizes=args.buckets)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-5)
    times, graphs_after_first = [], None
    for _ in range(args.steps):
        lengths, total = [], 0
        while total < args.tokens - 512:
            lengths.append(int(rng.integers(64, 513)))
            total += lengths[-1]
        batch = collate([{"input_ids": rng.integers(3, args.vocab, n).tolist()} for n in lengths])
        batch = {k: v.to(args.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        start = time.perf_counter()
        parts = causal_lm_loss(lm.loss_outputs(batch), batch, "token")
        (parts.objective / parts.normalizer).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        graphs = compiled_graphs()
        graphs_after_first = graphs if graphs_after_first is None else graphs_after_first
    return {
        "first": times[0],
        "steady": statistics.median(times[1:]),
        "recompiles": graphs - graphs_after_first,
        "loss": float(parts.token_loss_sum / parts.label_tokens),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=2048, help="token budget of a pack")
    parser.add_argument("--buckets", type=int, nargs="+", default=[1792, 2048])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--child", choices=["eager", "compiled"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args, args.child == "compiled")))
        return
    results = {}
    for variant in ("eager", "compiled"):
        given = sys.argv[1:] if argv is None else argv
        command = module_command("compile_speed", *given, "--child", variant)
        out = subprocess.run(command, capture_output=True, text=True, env=child_env(), preexec_fn=EndWithParent())
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if not lines:
            sys.exit(f"{variant} failed: {out.stderr.strip().splitlines()[-1:]}")
        results[variant] = json.loads(lines[-1])
    print(f"{'variant':>9} {'first step s':>12} {'steady step s':>13} {'recompiles':>10} {'loss':>8}")
    for variant, r in results.items():
        print(f"{variant:>9} {r['first']:12.2f} {r['steady']:13.3f} {r['recompiles']:10d} {r['loss']:8.4f}")
    eager, compiled = results["eager"], results["compiled"]
    saved = eager["steady"] - compiled["steady"]
    print(f"compiled / eager steady-state speed-up: {eager['steady'] / compiled['steady']:.2f}x")
    if saved > 0:
        overhead = compiled["first"] - eager["first"]
        steps = overhead / saved
        print(f"compile overhead {overhead:.1f} s, saved {saved:.3f} s per step: pays off after ~{steps:.0f} steps")
    else:
        print("compiled steps are not faster here: compile does not pay off on this device and size")


if __name__ == "__main__":
    main()
