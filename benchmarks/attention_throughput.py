"""Forward + backward throughput of padding vs packing (per attention backend) on CHAMP-like lengths.

    python -m benchmarks.attention_throughput --device cuda          # SmolLM2-135M architecture, bf16
    python -m benchmarks.attention_throughput --device cpu --smoke   # seconds, tiny model: a wiring check
    python -m benchmarks.attention_throughput --family bamba         # a Mamba-2 hybrid (or qwen3_next: delta net)

The same examples (lognormal lengths, median ~940, p90 ~1,900, capped at 2,048, random tokens: no dataset needed)
run through every mode, in the same mini-batches: `padding` pads each mini-batch to its longest example and runs
sdpa with the attention mask (the paper's baseline); `packed/<backend>` flattens it into one row. Weights are random
(throughput does not depend on them). Prints effective tokens/s (real tokens, pads not counted), the speed-up over
padding, peak memory and the loss (equal across modes up to precision: the same targets).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lit_packing.batch import ATTENTION_MASK, INPUT_IDS, PACKED_KEYS, POSITION_IDS
from lit_packing.data.collate import PackedCollator, PaddedCollator
from lit_packing.models.attention import attn_implementation
from lit_packing.models.backends import flash_attn_installed, torch_varlen_available
from lit_packing.models.loss import causal_lm_loss
from lit_packing.models.mixers import describe_routes
from lit_packing.models.pack import pack_model

SMOLLM2_135M = dict(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0,
    max_position_embeddings=8192, rms_norm_eps=1e-5,
)  # fmt: skip
SMOKE = dict(SMOLLM2_135M, vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
# Hybrids of SmolLM2's vocabulary and width class: a layer of the family's token mixer, then one of attention.
HYBRIDS = {
    "bamba": dict(
        model_type="bamba", vocab_size=49152, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1, 3], mamba_n_heads=8, mamba_d_head=64,
        mamba_d_state=64, mamba_chunk_size=256, tie_word_embeddings=True,
    ),
    "qwen3_next": dict(
        model_type="qwen3_next", vocab_size=49152, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=256,
        tie_word_embeddings=True,
    ),
}  # fmt: skip
MODEL_KEYS = (INPUT_IDS, ATTENTION_MASK, POSITION_IDS, *PACKED_KEYS[:4])  # what the model reads of a batch


def champ_like_lengths(n: int, seed: int, median: float = 940, p90: float = 1900, cap: int = 2048, low: int = 32):
    """Lognormal lengths with CHAMP's median and p90 (SmolLM2 tokens, chat template), clipped to [low, cap]."""
    sigma = math.log(p90 / median) / 1.2816  # z of the 90th percentile
    lengths = np.random.default_rng(seed).lognormal(math.log(median), sigma, n)
    return np.clip(lengths.round(), low, cap).astype(int).tolist()


def make_batches(args, vocab: int):
    rng = np.random.default_rng(args.seed)
    lengths = champ_like_lengths(args.steps * args.examples, args.seed, args.median, args.p90, args.cap)
    examples = [{"input_ids": rng.integers(3, vocab, n).tolist()} for n in lengths]
    return [examples[i : i + args.examples] for i in range(0, len(examples), args.examples)]


def available_modes(device: torch.device, wanted: list[str] | None) -> list[str]:
    modes = ["padding", "packed/per_example", "packed/sdpa_mask"]
    if torch_varlen_available(device):
        modes.insert(1, "packed/torch_varlen")
    if device.type == "cuda" and flash_attn_installed():
        modes.insert(1, "packed/flash_attn")
    return [m for m in modes if wanted is None or m in wanted or m.split("/")[-1] in wanted]


def run_mode(model, mode: str, batches, device, dtype, warmup: int) -> dict:
    if mode == "padding":
        collate, impl = PaddedCollator(pad_token_id=0), "sdpa"
    else:
        collate, impl = PackedCollator(), attn_implementation(mode.split("/")[1])
    model.set_attn_implementation(impl)
    prepared = [collate(b) for b in batches]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    real = slots = 0
    loss_sum = tokens = 0.0
    elapsed = 0.0
    for step, batch in enumerate(prepared):
        inputs = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
        sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(**{k: inputs[k] for k in MODEL_KEYS if k in inputs}, use_cache=False).logits
            parts = causal_lm_loss(logits, inputs)
        (parts.objective / parts.normalizer).backward()
        model.zero_grad(set_to_none=True)
        sync(device)
        if step >= warmup:
            elapsed += time.perf_counter() - start
            real += batch["counts"]["real_tokens"]
            slots += batch["counts"]["slot_tokens"]
            loss_sum += parts.token_loss_sum.item()
            tokens += parts.label_tokens.item()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return {"mode": mode, "tok_s": real / elapsed, "slot_frac": real / slots, "peak_gib": peak,
            "loss": loss_sum / tokens, "s_per_step": elapsed / max(1, len(prepared) - warmup)}  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny model and lengths: checks the wiring in seconds")
    parser.add_argument("--modes", nargs="*", help="subset, e.g. padding torch_varlen (default: all available)")
    parser.add_argument("--examples", type=int, default=16, help="examples per mini-batch")
    parser.add_argument("--steps", type=int, default=12, help="mini-batches per mode, warmup included")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", default=None, help="bfloat16 (cuda default) or float32 (cpu default)")
    parser.add_argument("--family", choices=sorted(HYBRIDS), help="a hybrid instead of SmolLM2-135M's architecture")
    parser.add_argument(
        "--mixers",
        default="auto",
        choices=["auto", "kernel", "per_example"],
        help="a hybrid's non-attention mixers: packed kernels where exact (auto), or per example",
    )
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    parser.add_argument("--vocab", type=int, default=None, help="override vocab_size")
    parser.add_argument("--median", type=float, default=940.0)
    parser.add_argument("--p90", type=float, default=1900.0)
    parser.add_argument("--cap", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    config = dict(HYBRIDS[args.family] if args.family else SMOKE if args.smoke else SMOLLM2_135M)
    if args.smoke:
        args.median, args.p90, args.cap = args.median / 10, args.p90 / 10, args.cap // 10
        args.examples, args.steps, args.warmup = min(args.examples, 8), min(args.steps, 3), min(args.warmup, 1)
    if args.layers:
        config["num_hidden_layers"] = args.layers
    if args.vocab:
        config["vocab_size"] = args.vocab
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), attn_implementation="sdpa").to(device)
    packing = pack_model(model, "per_example", device, mixers=args.mixers)  # each mode then sets its backend
    if packing.mixers:
        print(f"# mixers: {describe_routes(packing.mixers)}")
    model.train()
    batches = make_batches(args, config["vocab_size"])
    lengths = [len(ex["input_ids"]) for b in batches for ex in b]
    print(
        f"# {config['model_type']}: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
        f"vocab {config['vocab_size']}, "
        f"{device} {dtype}; {len(batches)} mini-batches x {args.examples} examples; lengths median "
        f"{int(np.median(lengths))}, p90 {int(np.percentile(lengths, 90))}, max {max(lengths)}"
    )
    results = []
    for mode in available_modes(device, args.modes):
        results.append(run_mode(model, mode, batches, device, dtype, args.warmup))
    base = next((r["tok_s"] for r in results if r["mode"] == "padding"), None)
    print(f"{'mode':<22}{'real tok/s':>12}{'speed-up':>10}{'real/slots':>12}{'s/step':>9}{'peak GiB':>10}{'loss':>9}")
    for r in results:
        speedup = f"{r['tok_s'] / base:.2f}x" if base else "-"
        print(
            f"{r['mode']:<22}{r['tok_s']:>12,.0f}{speedup:>10}{r['slot_frac']:>12.2f}{r['s_per_step']:>9.3f}"
            f"{r['peak_gib']:>10.2f}{r['loss']:>9.4f}"
        )
    return results


if __name__ == "__main__":
    main()
