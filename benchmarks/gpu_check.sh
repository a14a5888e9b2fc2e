#!/usr/bin/env bash
# GPU checks of lit_packing (one H200: about 3-5 minutes for parts 1-2 below, a few more for part 3), from the
# repository root:
#
#   bash benchmarks/gpu_check.sh            # the cuda-marked tests, then padding vs packing throughput
#   bash benchmarks/gpu_check.sh --smoke    # the same wiring on CPU with a tiny model (seconds)
#
# 1. `pytest -m cuda tests/models`: flash_attn (if installed) and torch_varlen against an fp32 per-example
#    reference, with the tolerance set by the error of a plain bf16 PyTorch run (kernel fwd+bwd, and model logits).
# 2. fwd+bwd of the SmolLM2-135M architecture (random weights, bf16 autocast) on CHAMP-like lengths: padding (sdpa
#    with the mask) vs packing with each backend; prints real tokens/s, speed-up, peak memory, loss.
# 3. peak memory of a step with a 152k vocabulary at 8k and 32k tokens: full logits vs the chunked loss vs Liger, each
#    beside the memory estimate's prediction (benchmarks/loss_memory.py).
#
# Python: $PYTHON, else .venv/bin/python, else python3. lit_packing runs from the checkout (PYTHONPATH), nothing is
# installed; it needs torch, transformers, lightning, torchmetrics and peft (the parts used here, lit_packing.models
# and lit_packing.data.collate, do not import `datasets`). On a machine without an index, put wheels of a missing
# package in .whl/, e.g.:
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

if [[ "${1:-}" == "--smoke" ]]; then
  exec "$PYTHON" benchmarks/attention_throughput.py --device cpu --smoke
fi

status=0
echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PYTHON" - <<'EOF' || { echo "lit_packing does not import: put the missing package's wheels in .whl/ (see above)"; exit 1; }
import torch, transformers, lightning
from lit_packing.models.attention import flash_attn_installed, resolve_backend
print(f"torch {torch.__version__}, transformers {transformers.__version__}, lightning {lightning.__version__}")
print(f"cuda {torch.cuda.is_available()}, flash-attn installed {flash_attn_installed()}, auto -> "
      f"{resolve_backend('auto', 'cuda' if torch.cuda.is_available() else 'cpu')}")
EOF

echo "== cuda tests"
timeout 240 "$PYTHON" -m pytest -m cuda tests/models -q -p no:cacheprovider -rs || status=1

echo "== throughput: SmolLM2-135M architecture, bf16, 16 examples per mini-batch, all backends"
timeout 180 "$PYTHON" benchmarks/attention_throughput.py --device cuda --examples 16 --steps 12 || status=1

echo "== throughput: 32 examples per mini-batch, padding vs torch_varlen"
timeout 120 "$PYTHON" benchmarks/attention_throughput.py --device cuda --examples 32 --steps 8 \
  --modes padding torch_varlen flash_attn || status=1

echo "== loss memory: 152k vocabulary (Qwen2.5), 8k and 32k tokens, bf16-mixed: full logits vs chunked vs Liger"
# liger-kernel is optional (`lit_packing[liger]`): without it the liger rows print a clear error, the others still run.
timeout 240 "$PYTHON" benchmarks/loss_memory.py --device cuda --precision bf16-mixed --tokens 8192 32768 \
  --impls full chunked liger || status=1

exit $status
