"""Tree attention microbenchmarks (pytest-benchmark), a small grid of ``bench.attention``.

    pytest bench/test_tree_attention_bench.py --benchmark-only --benchmark-json=results/ta.json

Per shape (benchmark group), the ``torch`` backend (CPU) or ``triton`` (CUDA), on a
contiguous and on a paged cache, next to dense masked SDPA and single-query decode
SDPA over the same KV. Heads 8/2 x 128 on the CPU, 32/8 x 128 on CUDA. On the CPU
torch runs one thread and the timer is the process CPU time: on a shared machine
wall time measures the neighbours (multi-threaded kernels wait for descheduled
threads). Measures only; the full grid, ratios and plot are ``python -m bench.attention``.
"""

from __future__ import annotations

import time

import pytest
import torch

from bench.attention import DTYPES, make_case, methods

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BACKEND = "triton" if CUDA else "torch"
HEADS, KV_HEADS = (32, 8) if CUDA else (8, 2)
COLUMNS = [BACKEND, f"{BACKEND}_paged", "dense_sdpa", "decode_sdpa"]
TIMER = time.perf_counter if CUDA else time.process_time


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    if CUDA:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cases():
    return {}


@pytest.mark.benchmark(timer=TIMER)
@pytest.mark.parametrize("column", COLUMNS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("prefix", [1024, 8192])
@pytest.mark.parametrize("nodes", [8, 64])
def test_tree_attention(benchmark, cases, nodes: int, prefix: int, dtype: str, column: str):
    key = (nodes, prefix, dtype)
    if key not in cases:
        cases.clear()  # one shape's tensors alive at a time
        cases[key] = make_case(1, nodes, prefix, HEADS, KV_HEADS, 128, DTYPES[dtype], DEVICE)
    fn = methods(cases[key], [BACKEND])[column]
    benchmark.group = f"{DEVICE} {dtype} N={nodes} prefix={prefix}"
    if CUDA:
        run = lambda: (fn(), torch.cuda.synchronize())
    else:
        run = fn
    benchmark.pedantic(run, rounds=15, warmup_rounds=2, iterations=1)
