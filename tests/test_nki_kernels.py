"""NKI backend specifics: kv_compact against the reference (no shared suite yet), the
largest trees the NKI ops accept, and the runtime selection.

Tree attention and the tree walk are covered for ``nki`` by the shared
backend-parametrised suites (``tests/test_tree_attention.py``,
``tests/test_tree_walk.py``); these tests add what those keep small.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
import kernels.nki as nki_backend
from kernels import reference
from kernels.nki import runtime
from tests.factories import random_tree
from tree_dev.tree import TokenTree, TreeBatch


def test_runtime_is_the_executor_here_and_says_so():
    ok, note = kernels.backend_status("nki")
    assert ok
    if runtime.USING_SDK:
        assert "Neuron SDK" in note and "not installed" not in note
    else:
        assert note == "Neuron SDK not installed, running on the NumPy NKI executor"
        from kernels.nki.executor import nl

        assert runtime.nl is nl


# ----------------------------------------------------------------------------- kv_compact
def random_paths(trees: list[TokenTree], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random root-to-node path per tree, as tree_walk returns it."""
    depth = max(t.max_depth for t in trees)
    nodes = torch.full((len(trees), depth + 1), -1, dtype=torch.int64)
    lens = torch.zeros(len(trees), dtype=torch.int64)
    for b, t in enumerate(trees):
        end = int(torch.randint(t.num_nodes, (1,), generator=gen))
        path = t.path_to(end)
        nodes[b, : len(path)] = torch.tensor(path)
        lens[b] = len(path)
    return nodes, lens


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 4),
    max_nodes=st.sampled_from([4, 30, 130]),
    block=st.sampled_from([None, 8, 16]),
    layers=st.sampled_from([None, 2]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_kv_compact_equals_reference(seed, batch, max_nodes, block, layers, dtype):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    trees = [
        random_tree(rng.randint(1, max_nodes), rng.randrange(2**31), rng.choice([None, 2]))
        for _ in range(batch)
    ]
    plens = torch.tensor([rng.randint(0, 40) for _ in range(batch)])
    need = [int(p) + t.num_nodes for p, t in zip(plens, trees, strict=True)]
    h, d = 2, 8
    lead = () if layers is None else (layers,)
    if block is None:
        shape, table = (*lead, batch, max(need) + 2, h, d), None
    else:
        nblk = [-(-m // block) for m in need]
        table = torch.zeros(batch, max(nblk), dtype=torch.int32)
        perm = torch.randperm(sum(nblk) + 1, generator=gen)
        used = 0
        for b, k in enumerate(nblk):
            table[b, :k] = perm[used : used + k]
            used += k
        shape = (*lead, sum(nblk) + 1, block, h, d)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    nodes, lens = random_paths(trees, gen)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want = reference.kv_compact(k_ref, v_ref, plens, nodes, lens, table)
    got = kernels.kv_compact(k_cache, v_cache, plens, nodes, lens, table, backend="nki")
    assert got.dtype == torch.int64 and torch.equal(got, want)
    # a pure data move: bit-exact in every dtype, untouched slots untouched
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_kv_compact_rejects_paths_longer_than_128():
    cache = torch.zeros(1, 300, 1, 4)
    nodes = torch.arange(129)[None]
    with pytest.raises(ValueError, match="128"):
        kernels.kv_compact(
            cache, cache.clone(), torch.tensor([0]), nodes, torch.tensor([129]), backend="nki"
        )


# ----------------------------------------------------------------------------- limits
def test_tree_attention_limits():
    assert nki_backend.tree_attention.max_tree_nodes == 512
    tb = TreeBatch([TokenTree.chain(2)])
    q = torch.randn(tb.total_nodes, 2, 256)
    k = torch.randn(1, 4, 1, 256)
    with pytest.raises(ValueError, match="head_dim <= 128"):
        kernels.tree_attention(q, k, k.clone(), tb, torch.tensor([1]), backend="nki")


@pytest.mark.parametrize("n", [129, 300])
def test_tree_attention_large_trees_match_reference(n):
    """More than one 128-node query tile and (300) a tree tile wider than one transpose."""
    gen = torch.Generator().manual_seed(n)
    tb = TreeBatch([random_tree(n, n, width=4)])
    plen = 20
    q = torch.randn(n, 2, 64, generator=gen)
    k = torch.randn(1, plen + n, 1, 64, generator=gen)
    v = torch.randn(1, plen + n, 1, 64, generator=gen)
    out, lse = kernels.tree_attention(
        q, k, v, tb, torch.tensor([plen]), return_lse=True, backend="nki"
    )
    ref, ref_lse = reference.tree_attention(q, k, v, tb, torch.tensor([plen]), return_lse=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)  # fp32 summation order only
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("mode", ["greedy", "target_only", "draft_probs"])
def test_tree_walk_128_node_trees_match_reference(mode):
    """The largest trees the walk takes, two per batch (two tiles), vocab not a multiple of 8."""
    gen = torch.Generator().manual_seed(1)
    trees = [random_tree(128, 5, width=3), random_tree(128, 6)]
    tb = TreeBatch(trees)
    t, vocab = tb.total_nodes, 300
    logits = torch.randn(t, vocab, generator=gen) * 3
    probs = torch.softmax(logits, -1)
    # distinct sibling tokens: children of node n draw their ranks from a per-node order
    order = torch.argsort(-(probs + 0.05 * torch.rand(t, vocab, generator=gen)), -1)
    gparent = tb.parents.clamp(min=0) + tb.cu_nodes[tb.request_ids]
    tokens = torch.where(tb.parents >= 0, order[gparent, tb.sibling_rank], 0)
    draft = torch.softmax(logits * 0.8, -1) if mode == "draft_probs" else None
    kw = dict(
        uniforms=None if mode == "greedy" else torch.rand(t, 2, generator=gen),
        draft_probs=draft,
        temperature=0.9,
        top_p=0.95,
    )
    got = kernels.tree_walk(logits, tokens, tb, mode, backend="nki", **kw)
    want = kernels.tree_walk(logits, tokens, tb, mode, backend="reference", **kw)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.int64 and torch.equal(g, w)
    assert nki_backend.tree_walk.max_tree_nodes == 128


def test_dense_masked_alternative_equals_reference():
    """The bench's baseline (one [N, prefix + N] mask applied to every K/V tile, two
    tiles of prefix) computes the same attention as the tree kernel."""
    from kernels.nki.tree_attention import dense_masked_attention

    gen = torch.Generator().manual_seed(3)
    n, plen = 40, 700
    tb = TreeBatch([random_tree(n, 3, width=3)])
    q = torch.randn(n, 2, 32, generator=gen)
    k = torch.randn(1, plen + n, 1, 32, generator=gen)
    v = torch.randn(1, plen + n, 1, 32, generator=gen)
    got = dense_masked_attention(q, k, v, tb, torch.tensor([plen]))
    want = reference.tree_attention(q, k, v, tb, torch.tensor([plen]))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
