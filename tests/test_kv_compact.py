"""KV compaction: every backend against ``kernels.reference.kv_compact``, and no leaks.

One suite parametrised over backends. Accepted paths are real root-to-node paths
of random trees; caches are paged (shuffled blocks) or contiguous, with or without
a leading layer dimension, in several dtypes. The leak test runs the next decoding
step's tree attention over the compacted cache and over a cache built from only
the accepted path: rejected nodes' K/V (set huge) must not change a single bit.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
from kernels import reference
from tests.factories import BACKENDS, random_tree
from tree_dev.tree import TokenTree, TreeBatch

# examples: hypothesis runs; max_batch / max_nodes / max_prefix: largest drawn;
# max_layers: leading layer dim drawn (the interpreter pays per program).
LIMITS = {
    "torch": dict(examples=40, max_batch=8, max_nodes=64, max_prefix=200, max_layers=3),
    "triton": dict(examples=15, max_batch=4, max_nodes=32, max_prefix=100, max_layers=2),
    "nki": dict(examples=6, max_batch=3, max_nodes=16, max_prefix=50, max_layers=2),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_case(seed: int, lim: dict, paged: bool, layers: int, dtype: torch.dtype) -> dict:
    """Caches holding prefix + tree K/V, and a random accepted path per request."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    b = rng.randint(1, lim["max_batch"])
    trees = [
        random_tree(
            rng.randint(1, lim["max_nodes"]), rng.randrange(2**31), rng.choice([None, 1, 3])
        )
        for _ in range(b)
    ]
    plens = [rng.choice([0, rng.randint(1, lim["max_prefix"])]) for _ in range(b)]
    d = max(t.max_depth for t in trees)
    nodes = torch.full((b, d + 1), -1, dtype=torch.int64)
    lens = torch.zeros(b, dtype=torch.int64)
    for r, t in enumerate(trees):
        path = t.path_to(rng.randrange(t.num_nodes))
        nodes[r, : len(path)] = torch.tensor(path)
        lens[r] = len(path)
    heads, dim = rng.choice([(1, 8), (2, 16), (4, 4)])
    need = [p + t.num_nodes for p, t in zip(plens, trees, strict=True)]
    lead = (layers,) if layers else ()
    if paged:
        bs = rng.choice([1, 4, 16])
        nblk = [math.ceil(m / bs) for m in need]
        total = sum(nblk) + 2
        perm = torch.randperm(total, generator=gen)
        table = torch.zeros(b, max(nblk) + 1, dtype=rng.choice([torch.int32, torch.int64]))
        used = 0
        for r, k in enumerate(nblk):
            table[r, :k] = perm[used : used + k]
            used += k
        shape = (*lead, total, bs, heads, dim)
    else:
        table = None
        shape = (*lead, b, max(need) + rng.randint(0, 3), heads, dim)
    return dict(
        k_cache=torch.randn(shape, generator=gen).to(dtype),
        v_cache=torch.randn(shape, generator=gen).to(dtype),
        prefix_lens=torch.tensor(plens, dtype=rng.choice([torch.int32, torch.int64])),
        accepted_nodes=nodes,
        accepted_len=lens,
        block_table=table,
    )


def compact(case: dict, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k, v = case["k_cache"].clone(), case["v_cache"].clone()
    rest = {n: case[n] for n in ("prefix_lens", "accepted_nodes", "accepted_len")}
    new = kernels.kv_compact(k, v, block_table=case["block_table"], backend=backend, **rest)
    return k, v, new


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_compact_equals_reference(backend, paged):
    lim = LIMITS[backend]

    @settings(max_examples=lim["examples"], deadline=None)
    @given(
        seed=st.integers(0, 2**31 - 1),
        layers=st.integers(0, lim["max_layers"]),
        dtype=st.sampled_from(DTYPES),
    )
    def check(seed, layers, dtype):
        case = make_case(seed, lim, paged, layers, dtype)
        got_k, got_v, got_len = compact(case, backend)
        want_k, want_v, want_len = compact(case, "reference")
        assert got_len.dtype == torch.int64 and torch.equal(got_len, want_len)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        j = torch.arange(case["accepted_nodes"].shape[1])
        valid = j < case["accepted_len"][:, None]
        if ((case["accepted_nodes"] != j) & valid).any():  # something actually moved
            assert not torch.equal(want_k, case["k_cache"])

    check()


def build_cache(rows: list[torch.Tensor], bs: int | None, width: int):
    """Cache whose request r holds ``rows[r] [n, H, D]`` from position 0 (paged: shuffled)."""
    b, (heads, dim) = len(rows), rows[0].shape[1:]
    if bs is None:
        cache = torch.full((b, width, heads, dim), float("nan"))
        for r, x in enumerate(rows):
            cache[r, : x.shape[0]] = x
        return cache, None
    nblk = math.ceil(width / bs)
    perm = torch.randperm(b * nblk, generator=torch.Generator().manual_seed(width))
    table = perm.view(b, nblk).to(torch.int32)
    cache = torch.full((b * nblk, bs, heads, dim), float("nan"))
    for r, x in enumerate(rows):
        for pos in range(x.shape[0]):
            cache[table[r, pos // bs], pos % bs] = x[pos]
    return cache, table


@pytest.mark.parametrize("bs", [4, None], ids=["paged", "contiguous"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rejected_kv_never_leaks_into_the_next_step(backend, bs):
    gen = torch.Generator().manual_seed(0)
    heads, dim, plens = 2, 8, [5, 0, 9]
    trees = [
        TokenTree.preset("mc_sim_7b_63"),
        TokenTree.from_parents([-1, 0, 0, 1]),
        TokenTree.chain(3),
    ]
    accepted = [[0, 1, 11, 39], [0, 2], [0]]  # root-to-node paths
    nxt = [
        TokenTree.from_parents([-1, 0, 0, 1, 2]),
        TokenTree.chain(2),
        TokenTree.preset("mc_sim_7b_63"),
    ]
    prefix = [torch.randn(p, heads, dim, generator=gen) for p in plens]
    tree_kv = [torch.randn(t.num_nodes, heads, dim, generator=gen) * 1e4 for t in trees]
    for r, path in enumerate(accepted):  # accepted nodes: ordinary values; the rest stay huge
        tree_kv[r][path] /= 1e4
    next_kv = [torch.randn(t.num_nodes, heads, dim, generator=gen) for t in nxt]
    width = max(p + t.num_nodes + n.num_nodes for p, t, n in zip(plens, trees, nxt, strict=True))

    # this step: prefix + the whole tree; compact; write the next tree after the new length
    k, table = build_cache([torch.cat(x) for x in zip(prefix, tree_kv, strict=True)], bs, width)
    v = k.clone() * 0.5
    nodes = torch.full((3, 4), -1, dtype=torch.int64)
    for r, path in enumerate(accepted):
        nodes[r, : len(path)] = torch.tensor(path)
    lens = torch.tensor([len(p) for p in accepted])
    new = kernels.kv_compact(
        k, v, torch.tensor(plens), nodes, lens, block_table=table, backend=backend
    )
    assert new.tolist() == [p + len(a) for p, a in zip(plens, accepted, strict=True)]
    flat_k = k.view(-1, heads, dim)
    flat_v = v.view(-1, heads, dim)
    for r, n in enumerate(nxt):
        pos = torch.arange(int(new[r]), int(new[r]) + n.num_nodes)
        slot = reference.slot_index(table, r, pos, k.shape[1])
        flat_k[slot] = next_kv[r]
        flat_v[slot] = next_kv[r] * 0.5

    # the same state built from only the accepted path
    clean = [torch.cat([prefix[r], tree_kv[r][accepted[r]], next_kv[r]]) for r in range(3)]
    k2, table2 = build_cache(clean, bs, width)
    v2 = k2 * 0.5
    q = torch.randn(sum(n.num_nodes for n in nxt), heads, dim, generator=gen)
    batch = TreeBatch(nxt)
    got = reference.tree_attention(q, k, v, batch, new, table)
    want = reference.tree_attention(q, k2, v2, batch, new, table2)
    assert torch.isfinite(got).all()
    assert got.abs().max() < 10  # a huge rejected value would dominate the output
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_compact_of_a_walk_result(backend):
    # the walk's own outputs feed compaction; the moved rows are the path's rows
    tb = TreeBatch([TokenTree.preset("mc_sim_7b_63"), TokenTree.chain(4)])
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(tb.total_nodes, 50, generator=gen)
    gparent = tb.parents.clamp(min=0) + tb.cu_nodes[tb.request_ids]
    tokens = (logits.argmax(-1)[gparent] + tb.sibling_rank) % 50  # first children: the argmax
    res = kernels.tree_walk(logits, tokens, tb, "greedy", backend="reference")
    assert res.accepted_len.min() >= 2
    plens = torch.tensor([3, 7])
    k = torch.randn(2, 80, 1, 4, generator=gen)
    v = torch.randn(2, 80, 1, 4, generator=gen)
    k0, v0 = k.clone(), v.clone()
    new = kernels.kv_compact(k, v, plens, res.accepted_nodes, res.accepted_len, backend=backend)
    for r in range(2):
        n = int(res.accepted_len[r])
        src = int(plens[r]) + res.accepted_nodes[r, :n]
        assert torch.equal(k[r, : int(new[r])], torch.cat([k0[r, : int(plens[r])], k0[r, src]]))
        assert torch.equal(v[r, int(plens[r]) : int(new[r])], v0[r, src])
        assert torch.equal(k[r, int(new[r]) :], k0[r, int(new[r]) :])  # the rest is untouched


class NoHostSync(TorchDispatchMode):
    """Fails on ops that read data back to the host or have data-dependent shapes."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if name.startswith(("_local_scalar_dense", "nonzero", "masked_select", "unique")):
            raise AssertionError(f"host synchronisation inside kv_compact: aten.{name}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_torch_kv_compact_has_no_host_sync(paged):
    from kernels.torchops.kv_compact import kv_compact

    case = make_case(3, LIMITS["torch"], paged, 2, torch.float32)
    want = compact(case, "reference")
    k, v = case["k_cache"].clone(), case["v_cache"].clone()
    rest = [case[n] for n in ("prefix_lens", "accepted_nodes", "accepted_len", "block_table")]
    with NoHostSync():
        new = kv_compact(k, v, *rest)
    assert torch.equal(k, want[0]) and torch.equal(v, want[1]) and torch.equal(new, want[2])
    with pytest.raises(AssertionError, match="host synchronisation"), NoHostSync():
        reference.kv_compact(k, v, *rest)  # the mode catches the reference's int() reads


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kv_compact_on_cuda_equals_reference(backend, paged):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for seed in range(10):
        case = make_case(seed, LIMITS["torch"], paged, seed % 3, torch.bfloat16)
        want = compact(case, "reference")
        dev = {n: (t.cuda() if t is not None else None) for n, t in case.items()}
        got = compact(dev, backend)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.cpu(), w)


def test_backends_are_listed():
    # the suite runs every backend the dispatcher knows (bar the oracle)
    assert set(BACKENDS) == set(kernels.BACKENDS) - {"reference"}


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.triton import kv_compact as kc
sig = dict(k_ptr="*bf16", v_ptr="*bf16", prefix_ptr="*i64", nodes_ptr="*i64", len_ptr="*i64",
           bt_ptr="*i32", D1="i32", bt_cols="i32", slots="i32", layer_stride="i64",
           block_stride="i64", slot_stride="i64", ROW="constexpr", PAGED="constexpr",
           BLOCK="constexpr")
for paged in (False, True):
    const = dict(ROW=1024, PAGED=paged, BLOCK=1024)
    k = triton.compile(ASTSource(fn=kc._compact_kernel, signature=sig, constexprs=const),
                       target=GPUTarget("cuda", 90, 32))
    assert k.asm["cubin"]
    print("compiled", paged)
"""


def test_triton_compact_kernel_compiles_for_hopper():
    # no GPU here: the interpreter skips Triton's compiler, so compile for sm_90 directly
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("compiled") == 2
