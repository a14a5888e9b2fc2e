"""QLoRA against bf16 LoRA and full fine-tuning, side by side in one run: a random Llama of `--hidden` x `--layers`
saved in bf16 safetensors, each route a fit of its own process through the real CLI (CHAMP chats, best-fit packs,
fp32 compute; bf16-mixed on a GPU), its peak memory beside what the start-up memory estimate predicted for it,
effective tokens/s (the fit summary's) and the base's bytes as held.

    python -m benchmarks.qlora                      # ~350 MB of bf16 weights; prints a table
    python -m benchmarks.qlora --layers 2 --steps 2 # a smoke run
    python -m benchmarks.qlora --accelerator gpu --hidden 2048 --layers 24   # bf16-mixed, the device's peak

Each route runs in a fresh process, so that one's freed memory does not lower another's peak. Then the QLoRA model's
merged export (`--model.export_dir`, in the base's stored bf16) in a process of its own: its host memory before and
at its peak (sampled every millisecond) beside its largest merged tensor and the whole merged model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).parents[1]
LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
ROUTES = {
    "full fine-tune": [],
    "LoRA, fp32 base": [f"--model.lora={json.dumps(LORA)}", "--model.lr=2e-4"],
    "QLoRA, NF4 base": [f"--model.lora={json.dumps(LORA)}", "--model.lr=2e-4", "--model.quantization=nf4"],
}


def save_model(folder: Path, hidden: int, layers: int) -> int:
    """A random Llama in bf16 safetensors with SmolLM2's tokenizer; its weights' bytes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lit_packing.assets import resolve_pretrained

    config = AutoConfig.for_model(model_type="llama", vocab_size=49152, hidden_size=hidden,
                                  intermediate_size=int(hidden * 2.75), num_hidden_layers=layers,
                                  num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                                  tie_word_embeddings=True, max_position_embeddings=4096)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False)).save_pretrained(folder)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def fit(folder: Path, work: Path, steps: int, accelerator: str, extra: list[str]) -> dict:
    """One route's fit in its own process: its summary's effective tokens/s and peak memory (on a GPU the device's,
    from the summary; on a CPU the process's peak resident memory)."""
    args = [sys.executable, str(ROOT / "main.py"), "fit", f"--model.name_or_path={folder}",
            "--data.limit=200", "--data.val_split=8", "--data.max_length=512",
            "--data.sampler=lit_packing.samplers.BestFitPackingSampler", "--data.sampler.init_args.max_tokens=1024",
            f"--data.cache_dir={work / 'cache'}", f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
            f"--trainer.accelerator={accelerator}", "--trainer.logger=false",
            f"--trainer.precision={'bf16-mixed' if accelerator == 'gpu' else '32-true'}",
            "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={work}",
            *extra]  # fmt: skip
    script = ("import resource, runpy, sys; sys.argv = sys.argv[1:]; "
              "exec('try:\\n runpy.run_path(sys.argv[0], run_name=\"__main__\")\\nfinally:\\n "
              "print(\"PEAK_RSS_KB\", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script, *args[1:]], cwd=work, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{extra}: exit {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}")
    out = done.stdout
    tokens = re.search(r"effective tokens/s\s*│\s*([\d,.]+)", out)
    resident = re.search(r"PEAK_RSS_KB (\d+)", out)
    device = re.search(r"│ peak memory\s*│\s*([\d.]+) GiB", out)
    predicted = re.search(r"predicted peak memory ([\d.]+) GiB", out)
    peak = float(device[1]) if accelerator == "gpu" and device else int(resident[1]) * 1024 / 2**30
    return {"tokens_per_s": float(tokens[1].replace(",", "")) if tokens else float("nan"), "peak_gib": peak,
            "predicted_gib": float(predicted[1]) if predicted else float("nan")}  # fmt: skip


def base_bytes(folder: Path, quantization: str | None) -> int:
    """The base model's linear layers' bytes as held after loading (quantized: packed weights and scales)."""
    import torch

    from lit_packing.models import PackedCausalLM
    from lit_packing.models.quantize import stored_bytes

    lora = LORA if quantization else None
    lm = PackedCausalLM(name_or_path=str(folder), quantization=quantization, lora=lora, memory_check=False,
                        isolation_check=False, dtype="bfloat16" if quantization is None else None)  # fmt: skip
    base = lm.model.get_base_model() if lora else lm.model
    leaves = [m for name, m in base.model.layers.named_modules() if "lora_" not in name and not list(m.children())]
    return sum(stored_bytes(m) for m in leaves if isinstance(m, torch.nn.Linear))  # bitsandbytes' layers are too


def export_peak(folder: Path, out: Path) -> dict:
    """In this process: the QLoRA model loaded, then exported merged; resident memory before, the peak during the
    export (a thread reading /proc/self/statm every millisecond), the largest merged tensor and the whole."""
    import threading
    import time

    from lit_packing.models import PackedCausalLM
    from lit_packing.models.export import stored_dtype
    from lit_packing.models.quantize import merged_parts

    def resident() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    lm = PackedCausalLM(name_or_path=str(folder), quantization="nf4", lora=LORA, memory_check=False,
                        isolation_check=False)  # fmt: skip
    dtype = stored_dtype(str(folder))
    sizes = [part().numel() * dtype.itemsize for part in merged_parts(lm.model, dtype).values()]
    before, peak, done = resident(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    lm.export(str(out))
    done.set()
    thread.join()
    return {"before": before, "peak": peak[0], "largest": max(sizes), "whole": sum(sizes), "dtype": str(dtype)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (heads of 64)")
    parser.add_argument("--layers", type=int, default=12, help="decoder layers")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per route")
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu", help="gpu: bf16-mixed, device peak")
    parser.add_argument("--export-only", metavar="FOLDER", help=argparse.SUPPRESS)  # the export's own process
    options = parser.parse_args(argv)
    if options.export_only:
        print("EXPORT", json.dumps(export_peak(Path(options.export_only), Path(options.export_only) / "merged")))
        return
    with tempfile.TemporaryDirectory() as tmp:
        work, folder = Path(tmp), Path(tmp) / "model"
        total = save_model(folder, options.hidden, options.layers)
        print(f"model: random Llama, hidden {options.hidden}, {options.layers} layers, {total / 2**20:.0f} MB in bf16")
        bf16, nf4 = base_bytes(folder, None), base_bytes(folder, "nf4")
        print(f"decoder layers' linear weights: bf16 {bf16 / 2**20:.1f} MB, NF4 + double quantization "
              f"{nf4 / 2**20:.1f} MB: {nf4 / bf16:.3f}x")  # fmt: skip
        rows = {name: fit(folder, work, options.steps, options.accelerator, extra) for name, extra in ROUTES.items()}
        full = rows["full fine-tune"]
        print("| route | effective tokens/s | vs full | peak memory | vs full | predicted (start-up estimate) | "
              "predicted / measured |\n|---|---|---|---|---|---|---|")  # fmt: skip
        for name, row in rows.items():
            print(f"| {name} | {row['tokens_per_s']:,.0f} | {row['tokens_per_s'] / full['tokens_per_s']:.2f}x | "
                  f"{row['peak_gib']:.2f} GiB | {row['peak_gib'] / full['peak_gib']:.2f}x | "
                  f"{row['predicted_gib']:.2f} GiB | {row['predicted_gib'] / row['peak_gib']:.2f} |")  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "benchmarks.qlora", "--export-only", str(folder)], cwd=ROOT,
                              capture_output=True, text=True, check=True)  # fmt: skip
        e = json.loads(re.search(r"EXPORT (.*)", done.stdout)[1])
        mb = 2**20
        print(f"QLoRA merged export ({e['dtype']}): host memory {e['before'] / mb:,.0f} MB before, "
              f"{e['peak'] / mb:,.0f} MB at peak (+{(e['peak'] - e['before']) / mb:,.0f} MB); its largest merged "
              f"tensor {e['largest'] / mb:,.0f} MB, the whole merged model {e['whole'] / mb:,.0f} MB")  # fmt: skip


if __name__ == "__main__":
    main()
