"""The oracles need oracles: kernels/reference.py against independent computations.

* tree attention: for every node, plain attention over ``prefix + root-to-node
  path`` computed here from the K/V rows we wrote into the cache (float64, no
  masks, no slot arithmetic shared with the reference); chains against torch SDPA.
* greedy walk: brute force over all root-to-leaf paths.
* stochastic walks: the first emitted token and the first two tokens follow the
  target distribution (chi-square over >= 20,000 draws, fixed seeds).
* kv_compact: a hand-written move, paged and contiguous, with and without layers.
* every ValueError of kernels/checks.py, reached through the public ``kernels.*`` ops.

Tolerances for attention outputs (compared in float64 with an oracle that reads
the same low-precision inputs): the reference computes in fp32 then rounds once to
the output dtype, so the error is half an ulp of the dtype (relative 2^-11 fp16,
2^-8 bf16) plus fp32 accumulation noise (~1e-6 absolute for |v| <= 5).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

import kernels
from kernels import reference
from tree_dev.tree import TokenTree, TreeBatch

# (rtol, atol) for attention outputs, see the module docstring
OUT_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (8e-3, 1e-5),
}
LSE_TOL = (1e-5, 1e-4)  # lse is fp32 from fp32-upcast scores in every dtype


# ----------------------------------------------------------------------------- helpers
@st.composite
def parent_lists(draw, max_nodes: int = 24) -> list[int]:
    n = draw(st.integers(1, max_nodes))
    raw = draw(st.lists(st.integers(0, 2**16), min_size=n - 1, max_size=n - 1))
    deep = draw(st.booleans())
    return [-1] + [(i - 1 - r % min(i, 2)) if deep else r % i for i, r in enumerate(raw, 1)]


def make_attention_case(trees, prefix_lens, hq, hkv, d, dtype, block_size=None, seed=0):
    """Random q and K/V rows per request, written into a NaN-filled cache.

    Returns ``(q, k_cache, v_cache, batch, prefix_lens, block_table, rows_k, rows_v)``;
    ``rows_k[b]`` is ``[prefix_len + num_nodes, Hkv, D]``: request b's tokens in order.
    """
    gen = torch.Generator().manual_seed(seed)
    batch = TreeBatch(trees)
    lens = [p + t.num_nodes for p, t in zip(prefix_lens, trees, strict=True)]
    q = torch.randn(batch.total_nodes, hq, d, generator=gen).to(dtype)
    rows_k = [torch.randn(n, hkv, d, generator=gen).to(dtype) for n in lens]
    rows_v = [torch.randn(n, hkv, d, generator=gen).to(dtype) for n in lens]
    nan = float("nan")
    if block_size is None:
        shape = (len(trees), max(lens) + 3, hkv, d)
        k_cache, v_cache = torch.full(shape, nan, dtype=dtype), torch.full(shape, nan, dtype=dtype)
        for b, n in enumerate(lens):
            k_cache[b, :n], v_cache[b, :n] = rows_k[b], rows_v[b]
        block_table = None
    else:
        need = [math.ceil(n / block_size) for n in lens]
        num_blocks = sum(need) + 3  # a few blocks nobody owns
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        block_table = torch.full((len(trees), max(need) + 1), -1, dtype=torch.int32)
        shape = (num_blocks, block_size, hkv, d)
        k_cache, v_cache = torch.full(shape, nan, dtype=dtype), torch.full(shape, nan, dtype=dtype)
        for b, n in enumerate(lens):
            block_table[b, : need[b]] = torch.tensor(perm[: need[b]])
            perm = perm[need[b] :]
            for pos in range(n):
                blk = int(block_table[b, pos // block_size])
                k_cache[blk, pos % block_size] = rows_k[b][pos]
                v_cache[blk, pos % block_size] = rows_v[b][pos]
    lens_t = torch.tensor(prefix_lens, dtype=torch.int64)
    return q, k_cache, v_cache, batch, lens_t, block_table, rows_k, rows_v


def attention_oracle(q, trees, prefix_lens, rows_k, rows_v, scale=None):
    """Per node: softmax attention over prefix + root-to-node path, float64."""
    total, hq, d = q.shape
    hkv = rows_k[0].shape[1]
    kv_head = [h // (hq // hkv) for h in range(hq)]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(total, hq, d, dtype=torch.float64)
    lse = torch.zeros(total, hq, dtype=torch.float64)
    row = 0
    for b, tree in enumerate(trees):
        plen = prefix_lens[b]
        for i in range(tree.num_nodes):
            keys = list(range(plen)) + [plen + j for j in tree.path_to(i)]
            k = rows_k[b][keys].double()[:, kv_head]  # [L, Hq, D]
            v = rows_v[b][keys].double()[:, kv_head]
            s = torch.einsum("hd,lhd->hl", q[row].double(), k) * scale
            lse[row] = torch.logsumexp(s, -1)
            out[row] = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v)
            row += 1
    return out, lse


def check_against_oracle(trees, prefix_lens, hq, hkv, d, dtype, block_size, seed, scale=None):
    q, kc, vc, batch, lens, bt, rk, rv = make_attention_case(
        trees, prefix_lens, hq, hkv, d, dtype, block_size, seed
    )
    out, lse = kernels.tree_attention(
        q, kc, vc, batch, lens, bt, scale=scale, return_lse=True, backend="reference"
    )
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    want_out, want_lse = attention_oracle(q, trees, prefix_lens, rk, rv, scale)
    rtol, atol = OUT_TOL[dtype]
    torch.testing.assert_close(out.double(), want_out, rtol=rtol, atol=atol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=LSE_TOL[0], atol=LSE_TOL[1])
    plain = kernels.tree_attention(q, kc, vc, batch, lens, bt, scale=scale, backend="reference")
    assert torch.equal(plain, out)


# ----------------------------------------------------------------------------- attention
@given(
    parents=st.lists(parent_lists(), min_size=1, max_size=3),
    data=st.data(),
    layout=st.sampled_from([None, 1, 3, 16]),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (8, 2), (4, 4)]),
    d=st.sampled_from([8, 32]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_tree_attention_equals_per_node_path_attention(
    parents, data, layout, heads, d, dtype, seed
):
    trees = [TokenTree.from_parents(p) for p in parents]
    prefix = data.draw(st.lists(st.integers(0, 40), min_size=len(trees), max_size=len(trees)))
    check_against_oracle(trees, prefix, heads[0], heads[1], d, dtype, layout, seed)


@pytest.mark.parametrize("block_size", [None, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_attention_big_trees(block_size, dtype):
    # 64 nodes (one full word, bit 63 used) and 71 nodes (two words); prefix 0 and 33
    trees = [TokenTree.preset("mc_sim_7b_63"), TokenTree.chain(70)]
    check_against_oracle(trees, [0, 33], 4, 2, 16, dtype, block_size, seed=1)


def test_tree_attention_custom_scale():
    trees = [TokenTree.from_parents([-1, 0, 0, 1]), TokenTree.chain(2)]
    check_against_oracle(trees, [3, 0], 2, 2, 8, torch.float32, 4, seed=2, scale=0.37)


def test_root_without_prefix_sees_only_itself():
    trees = [TokenTree.from_parents([-1, 0, 0])]
    q, kc, vc, batch, lens, bt, rk, rv = make_attention_case(trees, [0], 2, 1, 8, torch.float32)
    out, lse = kernels.tree_attention(q, kc, vc, batch, lens, return_lse=True, backend="reference")
    torch.testing.assert_close(out[0], rv[0][0].expand(2, 8))
    torch.testing.assert_close(lse[0], (q[0] @ rk[0][0, 0]) / math.sqrt(8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [None, 4])
@pytest.mark.parametrize("prefix, k", [(0, 0), (0, 6), (9, 4)])
@pytest.mark.parametrize("heads", [(2, 2), (4, 1)])
def test_chain_equals_causal_sdpa(dtype, block_size, prefix, k, heads):
    hq, hkv = heads
    trees = [TokenTree.chain(k)]
    q, kc, vc, batch, lens, bt, rk, rv = make_attention_case(
        trees, [prefix], hq, hkv, 16, dtype, block_size, seed=3
    )
    out = kernels.tree_attention(q, kc, vc, batch, lens, bt, backend="reference")
    # causal attention over prefix + chain; the prefix queries are arbitrary
    n = prefix + k + 1
    gen = torch.Generator().manual_seed(11)
    q_all = torch.cat([torch.randn(prefix, hq, 16, generator=gen).to(dtype), q]).float()
    k_all = rk[0].float().repeat_interleave(hq // hkv, dim=1)
    v_all = rv[0].float().repeat_interleave(hq // hkv, dim=1)
    want = torch.nn.functional.scaled_dot_product_attention(
        q_all.transpose(0, 1)[None],
        k_all.transpose(0, 1)[None],
        v_all.transpose(0, 1)[None],
        is_causal=True,
    )[0].transpose(0, 1)
    assert want.shape == (n, hq, 16)
    rtol, atol = OUT_TOL[dtype]
    torch.testing.assert_close(out.float(), want[prefix:], rtol=rtol, atol=max(atol, 2e-6))


# ----------------------------------------------------------------------------- target_probs
def nucleus_numpy(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """Independent softmax + top-p: smallest set of most likely tokens with mass >= top_p."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    keep, mass = [], 0.0
    for i in order:
        keep.append(i)
        mass += p[i]
        if mass >= top_p - 1e-12:
            break
    out = np.zeros_like(p)
    out[keep] = p[keep]
    return out / out.sum()


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.5, 1.0), (1.3, 0.7), (1.0, 0.05)])
def test_target_probs_matches_numpy(temperature, top_p):
    logits = torch.randn(7, 9, generator=torch.Generator().manual_seed(4))
    got = reference.target_probs(logits, torch.zeros(7, dtype=torch.int64), temperature, top_p)
    want = np.stack([nucleus_numpy(row, temperature, top_p) for row in logits.numpy()])
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)


def test_target_probs_whole_distribution_skips_the_sort(monkeypatch):
    """A Python ``top_p`` of 1 keeps every token without sorting; the same as the
    nucleus of a tensor ``top_p`` of 1 (which sorts: a tensor is never read on the host)."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(2)) * 4
    ids = torch.zeros(5, dtype=torch.int64)
    sorted_ = reference.target_probs(logits, ids, 0.8, torch.tensor([1.0]))
    sorts = []
    real_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: sorts.append(1) or real_sort(*a, **k))
    fast = reference.target_probs(logits, ids, 0.8, 1.0)
    assert sorts == []
    np.testing.assert_allclose(fast.numpy(), sorted_.numpy(), rtol=1e-12, atol=1e-15)
    reference.target_probs(logits, ids, 0.8, 0.9)
    assert sorts == [1]


def test_target_probs_per_request_and_ties():
    logits = torch.tensor([[1.0, 1.0, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    got = reference.target_probs(
        logits, torch.tensor([0, 1]), torch.tensor([1.0, 0.5]), torch.tensor([0.5, 1.0])
    )
    # ties broken by token id: 0.5 of mass needs two of the three equal tokens: 0 and 1
    np.testing.assert_allclose(got[0].numpy(), [0.5, 0.5, 0, 0], atol=1e-12)
    np.testing.assert_allclose(got[1].numpy(), nucleus_numpy(logits[1].numpy(), 0.5, 1.0))


# ----------------------------------------------------------------------------- greedy walk
def brute_force_greedy(tree: TokenTree, tokens: list[int], logits: torch.Tensor):
    """Longest root-to-leaf path prefix whose tokens follow the argmax chain."""
    rows = logits.tolist()
    best = [row.index(max(row)) for row in rows]  # first maximum, like torch.argmax
    accepted = [0]
    for padded in tree.paths.tolist():
        path = [x for x in padded if x >= 0]
        k = 0
        while k + 1 < len(path) and tokens[path[k + 1]] == best[path[k]]:
            k += 1
        if k + 1 > len(accepted):
            accepted = path[: k + 1]
    emitted = [tokens[n] for n in accepted[1:]] + [best[accepted[-1]]]
    return accepted, emitted


def random_walk_inputs(trees, seed, follow=0.7):
    """Distinct sibling tokens; the argmax of a node hits one of its children w.p. ``follow``."""
    gen = torch.Generator().manual_seed(seed)
    vocab = max(4, max(int(t.num_children.max()) for t in trees) + 2)
    tokens, logits = [], []
    for tree in trees:
        tok = [0] * tree.num_nodes
        kids = [[] for _ in range(tree.num_nodes)]
        for i in range(1, tree.num_nodes):
            kids[tree.parents[i]].append(i)
        lg = torch.randn(tree.num_nodes, vocab, generator=gen)
        for p in range(tree.num_nodes):
            perm = torch.randperm(vocab, generator=gen).tolist()
            for c, t in zip(kids[p], perm, strict=False):
                tok[c] = t
            if kids[p] and float(torch.rand(1, generator=gen)) < follow:
                pick = kids[p][int(torch.randint(len(kids[p]), (1,), generator=gen))]
                lg[p, tok[pick]] = lg[p].max() + 1.0
        tok[0] = int(torch.randint(vocab, (1,), generator=gen))  # ignored by the walk
        tokens.append(tok)
        logits.append(lg)
    return tokens, logits, vocab


@given(parents=st.lists(parent_lists(max_nodes=40), min_size=1, max_size=4), seed=st.integers())
def test_greedy_walk_equals_brute_force(parents, seed):
    trees = [TokenTree.from_parents(p) for p in parents]
    tokens, logits, _ = random_walk_inputs(trees, seed % 2**31)
    batch = TreeBatch(trees)
    res = kernels.tree_walk(
        torch.cat(logits), torch.tensor(sum(tokens, [])), batch, "greedy", backend="reference"
    )
    depth = max(t.max_depth for t in trees)
    assert res.accepted_len.shape == (len(trees),)
    assert res.accepted_nodes.shape == res.output_tokens.shape == (len(trees), depth + 1)
    for b, tree in enumerate(trees):
        nodes, emitted = brute_force_greedy(tree, tokens[b], logits[b])
        n = len(nodes)
        assert res.accepted_len[b] == n
        assert res.accepted_nodes[b].tolist() == nodes + [-1] * (depth + 1 - n)
        assert res.output_tokens[b].tolist() == emitted + [-1] * (depth + 1 - n)


def test_greedy_walk_hand_example():
    # root -> {a: tok 3, b: tok 1}, a -> {c: tok 2}; argmax: root 1 (b), b 0 (no child)
    tree = TokenTree.from_parents([-1, 0, 0, 1])
    logits = torch.full((4, 5), -1.0)
    logits[0, 1] = logits[2, 0] = logits[1, 2] = 5.0
    res = kernels.tree_walk(
        logits, torch.tensor([7, 3, 1, 2]), TreeBatch([tree]), "greedy", backend="reference"
    )
    assert res.accepted_len.tolist() == [2]
    assert res.accepted_nodes.tolist() == [[0, 2, -1]]
    assert res.output_tokens.tolist() == [[1, 0, -1]]


# ----------------------------------------------------------------------------- stochastic walks
VOCAB = 6
DRAWS = 20_000
# root: 3 siblings; first child: 3 children (one with a child), second child: 2 children
STOCH_PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (0, 0, 0)]


def target_tables(seed: int):
    """A toy target 'model': logits for every context of up to 3 tokens."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((VOCAB,) * (k + 1), generator=gen) for k in range(4)]


def context_row(tables, tree: TokenTree, tokens: torch.Tensor, i: int) -> torch.Tensor:
    """``tokens [R, N]`` -> the row of ``tables`` for node ``i``'s context, ``[R, V]``."""
    path = tree.path_to(i)[1:]
    table = tables[len(path)]
    return table[tuple(tokens[:, j] for j in path)] if path else table.expand(len(tokens), -1)


def context_rows(tables, tree: TokenTree, tokens: torch.Tensor) -> torch.Tensor:
    """``tokens [R, N]`` -> the row of ``tables`` for every node's context, ``[R, N, V]``."""
    return torch.stack([context_row(tables, tree, tokens, i) for i in range(tree.num_nodes)], 1)


def chi_square_two_tokens(out_tokens, expected_first, expected_second, gen):
    """Chi-square tests for the first token and the (first, second) pair.

    ``expected_second[t1]`` is the target's next-token distribution after ``t1``;
    when the walk emitted only one token the second is drawn from it (it is the
    first token of the next step, whose distribution the first test covers).
    """
    t1 = out_tokens[:, 0]
    t2 = out_tokens[:, 1].clone()
    stopped = t2 < 0
    nxt = torch.as_tensor(np.asarray(expected_second))[t1[stopped]]
    t2[stopped] = torch.multinomial(nxt, 1, generator=gen)[:, 0]
    joint = np.asarray(expected_first)[:, None] * np.asarray(expected_second)
    p_values = []
    for obs, prob in (
        (np.bincount(t1.numpy(), minlength=VOCAB), np.asarray(expected_first)),
        (np.bincount((t1 * VOCAB + t2).numpy(), minlength=VOCAB**2), joint.ravel()),
    ):
        assert obs.sum() == DRAWS
        assert obs[prob == 0].sum() == 0, "a token outside the target's support was emitted"
        obs, exp = obs[prob > 0], prob[prob > 0] * DRAWS
        small = exp < 5  # pool the rare cells so the chi-square approximation holds
        if small.any():
            exp = np.append(exp[~small], exp[small].sum())
            obs = np.append(obs[~small], obs[small].sum())
        p_values.append(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
    return p_values


def top_k_drafts(tree: TokenTree, tables) -> torch.Tensor:
    """Deterministic drafts: a node's children are the target's most likely tokens,
    except the last child, which is its least likely one (order and misses matter)."""
    tokens = torch.zeros(tree.num_nodes, dtype=torch.int64)
    kids = [[] for _ in range(tree.num_nodes)]
    for i in range(1, tree.num_nodes):
        kids[tree.parents[i]].append(i)
    for p in range(tree.num_nodes):
        if kids[p]:
            order = torch.argsort(context_row(tables, tree, tokens[None], p)[0], descending=True)
            picks = order[: len(kids[p]) - 1].tolist() + [int(order[-1])]
            tokens[kids[p]] = torch.tensor(picks)
    return tokens


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (1.3, 0.85)])
def test_target_only_walk_is_lossless(temperature, top_p):
    tree = TokenTree.from_paths(STOCH_PATHS)
    tables = target_tables(seed=5)
    draft = top_k_drafts(tree, tables)
    logits = context_rows(tables, tree, draft[None])[0]  # [N, V], identical in every copy
    batch = TreeBatch([tree] * DRAWS)
    gen = torch.Generator().manual_seed(6)
    res = kernels.tree_walk(
        logits.repeat(DRAWS, 1),
        draft.repeat(DRAWS),
        batch,
        "target_only",
        uniforms=torch.rand(batch.total_nodes, 2, generator=gen),
        temperature=torch.full((DRAWS,), temperature) if temperature != 1.0 else temperature,
        top_p=top_p,
        backend="reference",
    )
    p0 = nucleus_numpy(tables[0].numpy(), temperature, top_p)
    p1 = np.stack([nucleus_numpy(row, temperature, top_p) for row in tables[1].numpy()])
    p_first, p_pair = chi_square_two_tokens(res.output_tokens, p0, p1, gen)
    assert p_first > 1e-3 and p_pair > 1e-3, (p_first, p_pair)
    assert (res.accepted_len >= 2).float().mean() > 0.3  # the tree is actually used


def gumbel_children(q: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """``k`` draws without replacement from each row of ``q [R, V]``, in draw order."""
    u = torch.rand(q.shape, generator=gen, dtype=torch.float64).clamp_min(1e-300)
    return torch.topk(q.double().log() - torch.log(-torch.log(u)), k, dim=-1).indices


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (1.3, 0.85)])
def test_draft_probs_walk_is_lossless(temperature, top_p):
    tree = TokenTree.from_paths(STOCH_PATHS)
    tables = target_tables(seed=7)
    gen = torch.Generator().manual_seed(8)
    # the draft 'model': its own distribution for every context, different from the target
    draft_tables = [torch.softmax(torch.randn(t.shape, generator=gen), -1) for t in tables]
    tokens = torch.zeros(DRAWS, tree.num_nodes, dtype=torch.int64)
    kids = [[] for _ in range(tree.num_nodes)]
    for i in range(1, tree.num_nodes):
        kids[tree.parents[i]].append(i)
    for p in range(tree.num_nodes):  # parents come first: their tokens are known
        if kids[p]:
            q = context_row(draft_tables, tree, tokens, p)
            tokens[:, kids[p]] = gumbel_children(q, len(kids[p]), gen)
    q_rows = context_rows(draft_tables, tree, tokens).reshape(-1, VOCAB)
    logits = context_rows(tables, tree, tokens).reshape(-1, VOCAB)
    batch = TreeBatch([tree] * DRAWS)
    res = kernels.tree_walk(
        logits,
        tokens.reshape(-1),
        batch,
        "draft_probs",
        uniforms=torch.rand(batch.total_nodes, 2, generator=gen),
        draft_probs=q_rows,
        temperature=temperature,
        top_p=torch.full((DRAWS,), top_p) if top_p != 1.0 else top_p,
        backend="reference",
    )
    p0 = nucleus_numpy(tables[0].numpy(), temperature, top_p)
    p1 = np.stack([nucleus_numpy(row, temperature, top_p) for row in tables[1].numpy()])
    p_first, p_pair = chi_square_two_tokens(res.output_tokens, p0, p1, gen)
    assert p_first > 1e-3 and p_pair > 1e-3, (p_first, p_pair)
    assert (res.accepted_len >= 2).float().mean() > 0.3


def test_chi_square_check_detects_a_biased_walk():
    # the statistical check has power: a walk that accepts the first child whenever the
    # target merely supports it (no rejection sampling) must fail it
    tree = TokenTree.from_paths(STOCH_PATHS)
    tables = target_tables(seed=5)
    draft = top_k_drafts(tree, tables)
    logits = context_rows(tables, tree, draft[None])[0]
    batch = TreeBatch([tree] * DRAWS)
    gen = torch.Generator().manual_seed(6)
    res = kernels.tree_walk(
        logits.repeat(DRAWS, 1),
        draft.repeat(DRAWS),
        batch,
        "target_only",
        uniforms=torch.rand(batch.total_nodes, 2, generator=gen) * 0.5,  # biased uniforms
        backend="reference",
    )
    p0 = nucleus_numpy(tables[0].numpy(), 1.0, 1.0)
    p1 = np.stack([nucleus_numpy(row, 1.0, 1.0) for row in tables[1].numpy()])
    assert min(chi_square_two_tokens(res.output_tokens, p0, p1, gen)) < 1e-6


def test_target_only_hand_example():
    # p(root) = [0.5, 0.3, 0.2]; children tokens 0 then 1
    tree = TokenTree.from_parents([-1, 0, 0])
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]] * 3))
    tokens = torch.tensor([0, 0, 1])
    batch = TreeBatch([tree])

    def walk(u_first, u_second, u_bonus):
        u = torch.tensor([[0.0, u_bonus], [u_first, 0.0], [u_second, 0.0]])
        return kernels.tree_walk(
            logits, tokens, batch, "target_only", uniforms=u, backend="reference"
        )

    # 0.49 < 0.5: accept token 0, then the bonus after node 1 from p = [0.5, 0.3, 0.2]
    assert walk(0.49, 0.0, 0.0).output_tokens.tolist() == [[0, 0]]
    # reject 0 (0.51 !< 0.5); p' = [0, 0.3, 0.2]: accept 1 iff u * 0.5 < 0.3
    assert walk(0.51, 0.59, 0.0).output_tokens.tolist() == [[1, 0]]
    # reject both: the bonus comes from p'' = [0, 0, 0.2], whatever u is
    assert walk(0.51, 0.61, 0.0).output_tokens.tolist() == [[2, -1]]
    assert walk(0.51, 0.61, 0.999).output_tokens.tolist() == [[2, -1]]
    assert walk(0.51, 0.61, 0.999).accepted_nodes.tolist() == [[0, -1]]


def test_draft_probs_hand_example():
    # p = [0.5, 0.3, 0.2], q = [0.2, 0.6, 0.2]; children: token 1 then token 0
    tree = TokenTree.from_parents([-1, 0, 0])
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    logits = torch.log(p).expand(3, 3)
    batch = TreeBatch([tree])

    def walk(u1, u2, u_bonus):
        u = torch.tensor([[0.0, u_bonus], [u1, 0.0], [u2, 0.0]])
        return kernels.tree_walk(
            logits,
            torch.tensor([0, 1, 0]),
            batch,
            "draft_probs",
            uniforms=u,
            draft_probs=q.expand(3, 3).contiguous(),
            backend="reference",
        ).output_tokens.tolist()

    assert walk(0.49, 0.9, 0.0) == [[1, 0]]  # accept token 1: 0.49 * 0.6 < 0.3
    # reject token 1 (0.51 * 0.6 > 0.3): p <- norm(max(p - q, 0)) = [1, 0, 0],
    # q <- [0.5, 0, 0.5]: accept token 0 whatever u is
    assert walk(0.51, 0.99, 0.0) == [[0, 0]]


def test_draft_probs_walk_with_draft_equal_to_target_never_crashes():
    # q >= p everywhere (q sums to 1 + 5e-4, accepted by the checks): a rejection
    # leaves no residual mass; the walk must still emit a token from the target
    tree = TokenTree.from_parents([-1, 0, 0])
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    res = kernels.tree_walk(
        torch.log(p).expand(3, 3).float(),
        torch.tensor([0, 0, 1]),
        TreeBatch([tree]),
        "draft_probs",
        uniforms=torch.tensor([[0.0, 0.99], [0.9999, 0.0], [0.9999, 0.0]]),
        draft_probs=(p * 1.0005).float().expand(3, 3).contiguous(),
        backend="reference",
    )
    assert res.accepted_len.tolist() == [1]
    assert 0 <= res.output_tokens[0, 0] < 3


# ----------------------------------------------------------------------------- kv_compact
def hand_compact(cache, prefix_lens, nodes, lens, block_table):
    """Expected cache after moving node ``nodes[b][j]`` to slot ``prefix + j``."""
    out = cache.clone()
    bs = cache.shape[-3]

    def at(c, b, pos):
        if block_table is None:
            return c[..., b, pos, :, :]
        return c[..., int(block_table[b, pos // bs]), pos % bs, :, :]

    for b in range(len(prefix_lens)):
        plen = int(prefix_lens[b])
        for j in range(int(lens[b])):
            src = at(cache, b, plen + int(nodes[b][j]))
            dst = at(out, b, plen + j)
            dst.copy_(src)
    return out


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("layers", [None, 3])
def test_kv_compact_equals_hand_written_move(paged, layers):
    gen = torch.Generator().manual_seed(9)
    prefix_lens = torch.tensor([5, 0, 11])
    nodes = torch.tensor([[0, 2, 5, 9], [0, -1, -1, -1], [0, 1, 3, -1]])
    lens = torch.tensor([4, 1, 3])
    lead = () if layers is None else (layers,)
    if paged:
        bs = 4
        block_table = torch.tensor([[7, 2, 9, 0], [1, 8, 3, 4], [6, 5, 10, 11]])
        shape = (*lead, 12, bs, 2, 8)
    else:
        block_table = None
        shape = (*lead, 3, 16, 2, 8)
    k = torch.randn(shape, generator=gen)
    v = torch.randn(shape, generator=gen)
    want_k = hand_compact(k, prefix_lens, nodes, lens, block_table)
    want_v = hand_compact(v, prefix_lens, nodes, lens, block_table)
    assert not torch.equal(want_k, k)  # something moves
    new_lens = kernels.kv_compact(k, v, prefix_lens, nodes, lens, block_table, backend="reference")
    assert new_lens.tolist() == [9, 1, 14] and new_lens.dtype == torch.int64
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_kv_compact_walk_output_round_trip():
    # attention after compaction over prefix + accepted path == attention of the
    # accepted node before compaction (the K/V it saw are now contiguous)
    trees = [TokenTree.from_paths([(0,), (1,), (0, 0), (1, 0), (1, 1)])]
    q, kc, vc, batch, lens, bt, rk, rv = make_attention_case(
        trees, [6], 2, 2, 8, torch.float32, block_size=4, seed=10
    )
    nodes = torch.tensor([[0, 2, 5]])
    kernels.kv_compact(kc, vc, lens, nodes, torch.tensor([3]), bt, backend="reference")
    for j, node in enumerate([0, 2, 5]):
        assert torch.equal(reference.gather_kv(kc, bt, 0, 7 + j)[6 + j], rk[0][6 + node])
        assert torch.equal(reference.gather_kv(vc, bt, 0, 7 + j)[6 + j], rv[0][6 + node])
    assert torch.equal(reference.gather_kv(kc, bt, 0, 6), rk[0][:6])  # prefix untouched


# ----------------------------------------------------------------------------- errors
def attn_inputs(**over):
    tree = TreeBatch([TokenTree.chain(2), TokenTree.from_parents([-1, 0])])
    args = dict(
        q=torch.randn(5, 4, 8),
        k_cache=torch.randn(6, 4, 2, 8),
        v_cache=torch.randn(6, 4, 2, 8),
        tree=tree,
        prefix_lens=torch.tensor([3, 0]),
        block_table=torch.tensor([[0, 1], [2, 3]]),
    )
    args.update(over)
    return args


def attn(**over):
    a = attn_inputs(**over)
    return lambda: kernels.tree_attention(
        a["q"],
        a["k_cache"],
        a["v_cache"],
        a["tree"],
        a["prefix_lens"],
        a["block_table"],
        backend="reference",
    )


def contiguous(**over):
    base = dict(k_cache=torch.randn(2, 8, 2, 8), v_cache=torch.randn(2, 8, 2, 8), block_table=None)
    base.update(over)
    return attn(**base)


WALK_TREE = TreeBatch([TokenTree.from_parents([-1, 0, 0]), TokenTree.chain(1)])


def walk(mode="greedy", **over):
    args = dict(
        logits=torch.randn(5, 4),
        tokens=torch.tensor([0, 1, 2, 0, 3]),
        uniforms=None,
        draft_probs=None,
        temperature=1.0,
        top_p=1.0,
    )
    args.update(over)
    return lambda: kernels.tree_walk(
        args.pop("logits"), args.pop("tokens"), WALK_TREE, mode, backend="reference", **args
    )


def with_row(t, row, value):
    t = t.clone()
    t[row] = value
    return t


def compact(**over):
    args = dict(
        k_cache=torch.randn(2, 8, 2, 4),
        v_cache=torch.randn(2, 8, 2, 4),
        prefix_lens=torch.tensor([2, 3]),
        accepted_nodes=torch.tensor([[0, 1, 2], [0, -1, -1]]),
        accepted_len=torch.tensor([3, 1]),
        block_table=None,
    )
    args.update(over)
    return lambda: kernels.kv_compact(backend="reference", **args)


QPROBS = torch.full((5, 4), 0.25)
META = torch.device("meta")

ERROR_CASES = [
    # tree attention
    (attn(tree=object()), "tree has no tensor 'cu_nodes'"),
    (
        attn(q=torch.randn(5, 32)),
        r"q must be \[total_nodes, num_q_heads, head_dim\], got \(5, 32\)",
    ),
    (attn(q=torch.randn(5, 4, 8).double()), "q has dtype torch.float64"),
    (attn(k_cache=torch.randn(6, 4, 16)), "k_cache/v_cache must be 4-D"),
    (
        attn(v_cache=torch.randn(6, 4, 2, 4)),
        r"k_cache \(6, 4, 2, 8\) and v_cache \(6, 4, 2, 4\) differ",
    ),
    (
        attn(k_cache=torch.randn(6, 4, 2, 8).half()),
        "dtype mismatch: q torch.float32, k_cache torch.float16",
    ),
    (attn(prefix_lens=torch.tensor([3, 0], device=META)), "prefix_lens is on meta, expected cpu"),
    (attn(q=torch.randn(5, 4, 4)), "head_dim mismatch: q has 4, k_cache has 8"),
    (attn(q=torch.randn(5, 3, 8)), "num_q_heads 3 is not a multiple of num_kv_heads 2"),
    (attn(q=torch.randn(6, 4, 8)), "q has 6 rows but the tree batch has 5 nodes"),
    (attn(prefix_lens=torch.tensor([3])), r"prefix_lens must be an integer tensor of shape \(2,\)"),
    (attn(prefix_lens=torch.tensor([3.0, 0.0])), r"prefix_lens must be an integer tensor"),
    (attn(prefix_lens=torch.tensor([3, -1])), r"prefix_lens has a negative entry: \[3, -1\]"),
    (
        contiguous(k_cache=torch.randn(3, 8, 2, 8), v_cache=torch.randn(3, 8, 2, 8)),
        "contiguous KV has batch 3, the tree batch has 2 requests",
    ),
    (
        contiguous(prefix_lens=torch.tensor([3, 7])),
        "request 1: prefix \\+ tree = 9 slots, contiguous KV holds 8",
    ),
    (attn(block_table=torch.tensor([0, 1])), r"block_table must be \[2, max_blocks\], got \(2,\)"),
    (attn(block_table=torch.tensor([[0.0, 1.0], [2.0, 3.0]])), "block_table must be integer"),
    (
        attn(prefix_lens=torch.tensor([3, 7])),
        "request 1: needs 3 blocks of 4 for prefix \\+ tree = 9 tokens, block_table has 2 columns",
    ),
    (
        attn(block_table=torch.tensor([[0, 1], [2, 6]]), prefix_lens=torch.tensor([3, 3])),
        r"request 1: block_table entries \[2, 6\] outside \[0, 6\)",
    ),
    (
        attn(block_table=torch.tensor([[0, -1], [2, 3]])),
        r"request 0: block_table entries \[0, -1\] outside \[0, 6\)",
    ),
    # tree walk
    (
        lambda: kernels.tree_walk(
            torch.randn(5, 4), torch.zeros(5, dtype=torch.int64), "tree", backend="reference"
        ),
        "tree has no tensor",
    ),
    (walk("beam"), "unknown walk mode 'beam'"),
    (
        walk(logits=torch.randn(4, 4)),
        r"logits must be \[5, vocab\] \(one row per node\), got \(4, 4\)",
    ),
    (walk(logits=torch.zeros(5, 4, dtype=torch.int64)), "logits must be floating point"),
    (walk(tokens=torch.tensor([0, 1, 2, 0])), r"tokens must be an integer tensor of shape \(5,\)"),
    (walk(tokens=torch.tensor([0.0, 1, 2, 0, 3])), "tokens must be an integer tensor"),
    (walk(tokens=torch.tensor([0, 1, 2, 0, 3], device=META)), "tokens is on meta, expected cpu"),
    (
        walk(logits=with_row(torch.randn(5, 4), 3, float("nan"))),
        r"logits row 3 \(node\) contains NaN",
    ),
    (
        walk(logits=with_row(torch.randn(5, 4), 1, float("inf"))),
        r"logits row 1 \(node\) contains \+inf",
    ),
    (
        walk(logits=with_row(torch.randn(5, 4), 2, -float("inf"))),
        r"logits row 2 \(node\) is -inf everywhere",
    ),
    (
        walk(tokens=torch.tensor([0, 1, 4, 0, 3])),
        r"node 2: token 4 outside the vocabulary \[0, 4\)",
    ),
    (walk(tokens=torch.tensor([0, 1, 2, 0, -2])), r"node 4: token -2 outside the vocabulary"),
    (
        walk(tokens=torch.tensor([0, 2, 2, 0, 3])),
        "duplicate sibling tokens: node 0 \\(global index\\) has two children with token 2",
    ),
    (walk(temperature=torch.ones(3)), r"temperature must be a float or a tensor of shape \(2,\)"),
    (walk("target_only", temperature=float("inf")), r"temperature must be finite"),
    (walk("target_only", temperature=0.0), "temperature must be > 0 for mode 'target_only'"),
    (walk("target_only", temperature=torch.tensor([1.0, -1.0])), "temperature must be > 0"),
    (walk("target_only", top_p=0.0), "top_p must be > 0 for mode 'target_only'"),
    (walk("target_only", top_p=1.5), "top_p must be <= 1, got 1.5"),
    (
        walk("target_only", top_p=torch.ones(2, 2)),
        r"top_p must be a float or a tensor of shape \(2,\)",
    ),
    (
        walk("target_only", uniforms=torch.rand(5, 1)),
        r"uniforms must be \[5, 2\] \(one pair per node\)",
    ),
    (
        walk("target_only", uniforms=torch.zeros(5, 2, dtype=torch.int64)),
        "uniforms must be floating point",
    ),
    (walk("target_only", uniforms=torch.ones(5, 2)), r"uniforms must lie in \[0, 1\)"),
    (walk("target_only", uniforms=torch.full((5, 2), -0.1)), r"uniforms must lie in \[0, 1\)"),
    (walk("draft_probs"), r"mode 'draft_probs' needs draft_probs \[total_nodes, vocab\]"),
    (
        walk("draft_probs", draft_probs=torch.full((5, 3), 1 / 3)),
        r"draft_probs must match logits \(5, 4\), got \(5, 3\)",
    ),
    (
        walk("draft_probs", draft_probs=with_row(QPROBS, 0, torch.tensor([0.5, 0.75, 0.0, -0.25]))),
        "draft_probs has negative or non-finite entries",
    ),
    (
        walk("draft_probs", draft_probs=with_row(QPROBS, 3, 0.3)),
        "draft_probs row 3 \\(a node with children\\) sums to 1.200000, not 1",
    ),
    (walk("greedy", draft_probs=QPROBS), "draft_probs given but mode is 'greedy'"),
    # kv compact
    (
        compact(v_cache=torch.randn(2, 8, 2, 2)),
        r"k_cache \(2, 8, 2, 4\) and v_cache \(2, 8, 2, 2\) differ",
    ),
    (compact(k_cache=torch.randn(16, 2, 4), v_cache=torch.randn(16, 2, 4)), "caches must be"),
    (compact(prefix_lens=torch.tensor([[2, 3]])), r"prefix_lens must be integer \[batch\]"),
    (compact(prefix_lens=torch.tensor([2.0, 3.0])), r"prefix_lens must be integer \[batch\]"),
    (compact(accepted_nodes=torch.tensor([0, 1, 2])), r"accepted_nodes must be \[2, depth\+1\]"),
    (compact(accepted_len=torch.tensor([3, 1, 1])), r"accepted_len must be \[2\], got \(3,\)"),
    (compact(accepted_len=torch.tensor([3, 1], device=META)), "accepted_len is on meta"),
    (compact(accepted_len=torch.tensor([4, 1])), r"accepted_len must be in \[1, 3\], got \[4, 1\]"),
    (compact(accepted_len=torch.tensor([3, 0])), r"accepted_len must be in \[1, 3\], got \[3, 0\]"),
    (
        compact(accepted_nodes=torch.tensor([[0, -1, 2], [0, -1, -1]])),
        "accepted_nodes has a negative node inside accepted_len",
    ),
    (
        compact(accepted_nodes=torch.tensor([[0, 1, 2], [1, -1, -1]])),
        r"accepted_nodes must start with the root \(node 0\)",
    ),
    (
        compact(k_cache=torch.randn(3, 8, 2, 4), v_cache=torch.randn(3, 8, 2, 4)),
        "contiguous KV has batch 3, prefix_lens has 2",
    ),
    (compact(prefix_lens=torch.tensor([6, 3])), "an accepted node lies beyond the cache length 8"),
    (
        compact(block_table=torch.tensor([[0, 1]])),
        r"block_table must be \[2, max_blocks\], got \(1, 2\)",
    ),
    (
        compact(block_table=torch.tensor([[0], [1]]), prefix_lens=torch.tensor([6, 3])),
        "request 0: accepted nodes reach block 1, block_table has 1 columns",
    ),
    (
        compact(block_table=torch.tensor([[0.0, 1.0], [1.0, 0.0]])),
        "block_table must be integer, got torch.float32",
    ),
    (
        compact(block_table=torch.tensor([[0, 2], [1, 0]]), prefix_lens=torch.tensor([6, 3])),
        r"request 0: block_table entries \[0, 2\] outside \[0, 2\)",
    ),
    (
        compact(block_table=torch.tensor([[0, 1], [-1, 0]])),
        r"request 1: block_table entries \[-1\] outside \[0, 2\)",
    ),
    # dispatch
    (
        lambda: kernels.tree_walk(
            torch.randn(5, 4), torch.zeros(5, dtype=torch.int64), WALK_TREE, backend="cuda"
        ),
        "unknown backend 'cuda'",
    ),
    (lambda: kernels.backend_status("cuda"), "unknown backend 'cuda'"),
]


@pytest.mark.parametrize("make, match", ERROR_CASES, ids=[m[:40] for _, m in ERROR_CASES])
def test_bad_input_raises_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_backend_max_tree_nodes_is_enforced(monkeypatch):
    monkeypatch.setattr(reference.tree_attention, "max_tree_nodes", 2, raising=False)
    with pytest.raises(ValueError, match="a tree has 3 nodes; this backend supports at most 2"):
        attn()()


def test_valid_inputs_of_the_error_table_pass():
    # the error cases above differ from these inputs in one field only
    attn()()
    contiguous()()
    walk()()
    walk("target_only")()
    walk("draft_probs", draft_probs=QPROBS)()
    compact()()
    compact(block_table=torch.tensor([[0, 1], [1, 0]]), k_cache=torch.randn(2, 4, 2, 4),
            v_cache=torch.randn(2, 4, 2, 4))()  # fmt: skip
