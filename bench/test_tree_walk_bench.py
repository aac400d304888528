"""Tree-walk microbenchmarks (pytest-benchmark), a small grid of ``bench.walk``.

    pytest bench/test_tree_walk_bench.py --benchmark-only --benchmark-json=results/walk_bench.json

Each walk is timed end to end (``kernels.tree_walk``, inputs validated beforehand)
and its result checked against the reference once; the vocabulary part (argmax,
target probabilities) and the greedy walk alone are timed as separate rows. Triton
is timed only on CUDA (on the CPU it runs on its interpreter, not a performance
path); NKI not here (NumPy executor).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import kernels
from bench.walk import make_case
from kernels.reference import target_probs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference", "torch"] + (["triton"] if DEVICE == "cuda" else [])
GRID = [(1, 8), (8, 64)]  # (batch, tree nodes)
STOCHASTIC_GRID = [(1, 8), (4, 16)]  # float64 probabilities over 32K: kept small on the CPU
if DEVICE == "cpu":
    torch.set_num_threads(1)  # a shared machine: one thread gives stable medians
VOCAB = 32768
TEMPERATURE, TOP_P = 0.8, 0.95


def sync(fn):
    def run():
        out = fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return out

    return run


def call(case: dict, mode: str, backend: str):
    return kernels.tree_walk(
        case["logits"],
        case["tokens"],
        case["tree"],
        mode,
        uniforms=None if mode == "greedy" else case["uniforms"],
        draft_probs=case["draft_probs"] if mode == "draft_probs" else None,
        temperature=TEMPERATURE,
        top_p=TOP_P,
        backend=backend,
        check_inputs=False,
    )


WALKS = [("greedy", b, n) for b, n in GRID] + [
    (m, b, n) for m in ("target_only", "draft_probs") for b, n in STOCHASTIC_GRID
]


@pytest.mark.parametrize("mode, batch, nodes", WALKS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_walk(benchmark, backend, mode, batch, nodes):
    case = make_case(batch, nodes, VOCAB, DEVICE)
    want = call(case, mode, "reference")
    got = benchmark(sync(lambda: call(case, mode, backend)))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("batch, nodes", GRID)
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_greedy_walk_without_vocab_part(benchmark, backend, batch, nodes):
    case = make_case(batch, nodes, VOCAB, DEVICE)
    mod = importlib.import_module(f"{kernels.BACKENDS[backend]}.tree_walk")
    amax = torch.argmax(case["logits"], -1)
    got = benchmark(sync(lambda: mod.greedy_from_argmax(amax, case["tokens"], case["tree"])))
    assert torch.equal(got.output_tokens, call(case, "greedy", "reference").output_tokens)


@pytest.mark.parametrize(
    "part, batch, nodes",
    [("argmax", b, n) for b, n in GRID] + [("target_probs", b, n) for b, n in STOCHASTIC_GRID],
)
def test_vocab_part(benchmark, part, batch, nodes):
    case = make_case(batch, nodes, VOCAB, DEVICE)
    logits, ids = case["logits"], case["tree"].request_ids
    if part == "argmax":
        out = benchmark(sync(lambda: torch.argmax(logits, -1)))
        assert out.shape == (logits.shape[0],)
    else:
        out = benchmark(sync(lambda: target_probs(logits, ids, TEMPERATURE, TOP_P)))
        assert torch.allclose(out.sum(-1), torch.ones_like(out[:, 0]))
