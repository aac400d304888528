#!/usr/bin/env bash
# The whole CUDA check in one run (< 9 minutes on one GPU, sized for a 15-minute lease):
#   1. every CUDA test (pytest -m gpu): tree attention, tree walk, KV compaction, each
#      against kernels/reference.py;
#   2. the tree-attention grid (--quick) with the Triton config x split sweep at the
#      goal shape; 3. the tree-walk grid (--quick).
# Each stage has its own time limit, so one stage that hangs does not lose the others.
# Usage: bash bench/gpu_check.sh [OUT_DIR]   (default results/)
# Needs a Python with CUDA torch and triton: $PY, else python3.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-results}
PY=${PY:-python3}
mkdir -p "$out"
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" || exit 1
rc=0
echo "== 1/3 CUDA tests"
timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider --durations=10 \
  tests/test_tree_attention.py tests/test_tree_walk.py tests/test_kv_compact.py 2>&1 \
  | tee "$out/gpu_tests.log" || rc=1
echo "== 2/3 tree attention (quick grid + sweep)"
timeout 150 "$PY" -m bench.attention --device cuda --quick --sweep --out "$out" 2>&1 \
  | tee "$out/gpu_attention.log" || rc=1
echo "== 3/3 tree walk (quick grid)"
timeout 120 "$PY" -m bench.walk --device cuda --quick --out "$out" 2>&1 \
  | tee "$out/gpu_walk.log" || rc=1
echo "== goal figures"
grep -hE "^(GOAL|SWEEP)" "$out"/gpu_attention.log "$out"/gpu_walk.log || true
exit $rc
