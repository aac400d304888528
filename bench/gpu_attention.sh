#!/usr/bin/env bash
# One-shot CUDA check of tree attention (< 5 minutes on one GPU):
#   1. the CUDA tests (pytest -m gpu tests/test_tree_attention.py),
#   2. a Triton config x prefix-split sweep at the goal shape (N=64, 8K prefix, bf16),
#   3. the GPU benchmark grid (results/attention_cuda.json + .png),
# then prints the goal figures: Triton N=64 @ 8K vs single-query decode (goal <= 1.3x)
# and vs dense masked SDPA (goal >= 3x faster).
#
# Needs a Python with CUDA torch and triton: $PY, else .venv/bin/python when its torch
# sees a GPU, else python3. Usage: bash bench/gpu_attention.sh [--quick]
set -euo pipefail
cd "$(dirname "$0")/.."

has_cuda() { "$1" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
if [[ -z "${PY:-}" ]]; then
  if [[ -x .venv/bin/python ]] && has_cuda .venv/bin/python; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! has_cuda "$PY"; then
  echo "no CUDA device visible to $PY (torch.cuda.is_available() is False)" >&2
  exit 1
fi
unset TRITON_INTERPRET
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

echo "== 1/3 CUDA tests"
tests_rc=0
timeout 110 "$PY" -m pytest -q -m gpu tests/test_tree_attention.py -p no:cacheprovider || tests_rc=$?

echo "== 2/3 + 3/3 sweep at the goal shape, then the benchmark grid"
mkdir -p results
timeout 180 "$PY" -m bench.attention --device cuda --sweep "$@" | tee results/gpu_attention.log \
  || echo "benchmark stopped early (timeout or error); partial rows in results/attention_cuda.json"

echo "== goal figures (Triton N=64 @ 8K prefix)"
grep -E "^(GOAL|SWEEP)" results/gpu_attention.log || true
if [[ $tests_rc != 0 ]]; then echo "CUDA tests FAILED (rc=$tests_rc)" >&2; fi
exit "$tests_rc"
