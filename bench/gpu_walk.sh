#!/usr/bin/env bash
# One-shot CUDA check of the tree walk and KV compaction (< 6 minutes on one GPU):
#   1. the CUDA tests (pytest -m gpu tests/test_tree_walk.py tests/test_kv_compact.py):
#      torch and triton on CUDA equal the reference, greedy replays in a CUDA graph;
#   2. the GPU benchmark grid, batch {1,8,64} x nodes {8,64,256} x vocab {32K,128K}
#      (results/walk_cuda.json + .png), or the small grid with --quick;
# then prints the goal figure: the Triton greedy walk at batch 64 x 64 nodes, one
# launch (counted by the profiler), < 15 us excluding the vocabulary argmax (timed apart).
#
# Needs a Python with CUDA torch and triton: $PY, else .venv/bin/python when its torch
# sees a GPU, else python3. Usage: bash bench/gpu_walk.sh [--quick]
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

echo "== 1/2 CUDA tests"
timeout 180 "$PY" -m pytest -q -m gpu tests/test_tree_walk.py tests/test_kv_compact.py -p no:cacheprovider

echo "== 2/2 benchmark grid and goal figure"
mkdir -p results
timeout 300 "$PY" -m bench.walk --device cuda "$@" | tee results/gpu_walk.log

echo "== goal figure (Triton greedy walk, batch 64 x 64 nodes, vocab part excluded)"
grep -E "^GOAL" results/gpu_walk.log || true
