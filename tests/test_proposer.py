"""The engine-independent proposers (``tree_dev.proposer``): top-K / static expansion and
the n-gram trie.

The engine test runs ``Engine._propose`` with a stand-in draft whose scores are a fixed
function of each node's token path, and grows the same trees with ``TreeExpansion``
directly from the same function: both must agree node for node.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.factories import tiny_llama
from tree_dev.engine import Engine, SamplingParams
from tree_dev.proposer import (
    SEPARATOR,
    NgramHistory,
    TreeExpansion,
    expansion_for,
    ngram_matches,
    ngram_trie,
    ngram_tries,
)
from tree_dev.spec import parse_tree_spec

VOCAB = 16


def path_scores(path: tuple[int, ...], salt: int, vocab: int = VOCAB) -> torch.Tensor:
    """Draft logits ``[V]`` as a function of a node's token path (root first): quantized
    to halves so that equal scores (ties) are common."""
    h = hashlib.blake2b(repr((salt, path)).encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(h, "little") % 2**62)
    return (torch.randn(vocab, generator=gen) * 2).round() / 2


class PathDraft:
    """Stands in for the engine's draft ``Runner``: logits from ``path_scores`` of the
    node's path in the forwarded tree (node 0 of which is the request's root here)."""

    eagle = False

    def __init__(self, salt: int):
        self.salt = salt
        self.tokens: dict[tuple[int, int], int] = {}  # (request, cache position) -> token
        self.calls = 0

    def forward(self, req_ids, prefix_lens, trees, new_nodes, tokens, feats=None, **_):
        rows, it = [], iter(tokens)
        for rid, plen, tree, nodes in zip(req_ids, prefix_lens, trees, new_nodes):
            for n in nodes:
                self.tokens[(rid, plen + n)] = next(it)
            for n in nodes:
                path = tuple(self.tokens[(rid, plen + a)] for a in tree.path_to(n))
                rows.append(path_scores(path, self.salt))
        self.calls += 1
        logits = torch.stack(rows)
        return torch.zeros(len(rows), 4), logits


def grow_directly(policy, root: int, salt: int, temperature=None, seed=None):
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    ex = TreeExpansion(policy, root, sample_temperature=temperature, generator=gen)
    while ex.frontier():
        rows = []
        for c in ex.frontier():
            path = []
            while c != -1:
                path.append(ex.token(c))
                c = ex.parent(c)
            rows.append(path_scores((root, *reversed(path)), salt))
        ex.absorb(torch.log_softmax(torch.stack(rows).float(), dim=-1))
    return ex, ex.result()


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, vocab=VOCAB, hidden=32, layers=1)


SPECS = st.one_of(
    st.builds(
        lambda k, d, b, t: f"topk:k={k},depth={d},budget={b}" + ("" if t else ",temp=0.5"),
        st.integers(1, 4),
        st.integers(1, 5),
        st.integers(1, 24),
        st.booleans(),
    ),
    st.sampled_from(["chain:3", "paths:[(0,),(1,),(0,0),(0,1),(1,0),(0,0,0)]"]),
)


@settings(max_examples=40, deadline=None)
@given(
    spec=SPECS,
    salt=st.integers(0, 10**6),
    roots=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4),
)
def test_engine_and_direct_expansion_grow_the_same_tree(target, spec, salt, roots):
    engine = Engine(target, target, tree=spec, max_batch=8, max_model_len=64, onednn_linear=False)
    engine.draft_runner = PathDraft(salt)
    for r in roots:
        engine.add_request([r], SamplingParams(max_tokens=4))
    engine._admit()
    proposals = engine._propose(list(engine.running))
    assert engine.draft_runner.calls >= 1  # the engine really asked the stand-in draft
    policy = parse_tree_spec(spec)
    for root, prop in zip(roots, proposals):
        _, (tree, tokens, q) = grow_directly(policy, root, salt)
        assert prop.tree.parents.tolist() == tree.parents.tolist(), spec
        assert prop.tokens == tokens and q is None and prop.draft_probs is None
        assert tree.num_nodes <= policy.max_nodes


def test_engine_and_direct_sampled_static_drafts_agree(target):
    spec = "paths:[(0,),(1,),(2,),(0,0),(1,0)]"
    engine = Engine(target, target, tree=spec, max_model_len=64, draft_sampling=True)
    engine.draft_runner = PathDraft(3)
    engine.add_request([5], SamplingParams(max_tokens=4, temperature=0.7, seed=11))
    engine._admit()
    (prop,) = engine._propose(list(engine.running))
    _, (tree, tokens, q) = grow_directly(parse_tree_spec(spec), 5, 3, temperature=0.7, seed=11)
    assert prop.tree == tree and prop.tokens == tokens
    torch.testing.assert_close(prop.draft_probs, q, rtol=0, atol=0)
    # nodes with children carry the draft's distribution at temperature 0.7; leaves zeros
    want_root = torch.softmax(path_scores((5,), 3) / 0.7, -1)
    torch.testing.assert_close(q[0], want_root)
    assert q[tree.num_children == 0].abs().sum() == 0
    assert torch.allclose(q[tree.num_children > 0].sum(-1), torch.ones(3))


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 4),
    depth=st.integers(1, 6),
    budget=st.integers(1, 30),
    salt=st.integers(0, 10**6),
)
def test_topk_keeps_the_best_budget_and_their_ancestors(k, depth, budget, salt):
    policy = parse_tree_spec(f"topk:k={k},depth={depth},budget={budget}")
    ex, (tree, tokens, _) = grow_directly(policy, 1, salt)
    n = ex.num_candidates
    kept = ex.kept()
    # the best `budget` candidates by cumulative log-prob, ties to the earlier one
    brute = sorted(range(n), key=lambda c: (-ex.score(c), c))[:budget]
    assert sorted(kept) == sorted(brute)
    assert tree.num_nodes == 1 + min(budget, n) <= policy.max_nodes
    assert tree.max_depth <= depth
    for c in kept:  # ancestors kept, at the right node
        p = ex.parent(c)
        assert p == -1 or p in kept
        assert tree.parents[ex.node_of(c)] == ex.node_of(p)
        assert tokens[ex.node_of(c)] == ex.token(c)
        assert ex.depth(c) == int(tree.depth[ex.node_of(c)])
    # siblings distinct (the walk needs it)
    seen = set()
    for i in range(1, tree.num_nodes):
        key = (int(tree.parents[i]), tokens[i])
        assert key not in seen
        seen.add(key)


def test_topk_ties_keep_ancestors_by_creation_order():
    # a child as likely as its parent (log-prob 0): parent and child tie, the parent wins
    policy = parse_tree_spec("topk:k=2,depth=3,budget=2")
    ex = TreeExpansion(policy, 9)
    certain = torch.tensor([[0.0, -math.inf, -math.inf]])
    ex.absorb(certain)  # root -> token 0 (score 0), token 1 (-inf)
    assert ex.frontier() == [0, 1]
    ex.absorb(certain.repeat(2, 1))
    tree, tokens, _ = ex.result()
    assert tree.parents.tolist() == [-1, 0, 1] and tokens == [9, 0, 0]
    # uniform drafts: every node of a level ties; the first created are kept
    ex = TreeExpansion(parse_tree_spec("topk:k=2,depth=3,budget=3"), 7)
    uniform = torch.full((1, 2), -math.log(2))
    while ex.frontier():
        ex.absorb(uniform.repeat(len(ex.frontier()), 1))
    tree, tokens, _ = ex.result()
    assert tree.parents.tolist() == [-1, 0, 0, 1] and tokens == [7, 0, 1, 0]


def test_static_tree_takes_top_ranked_children_in_sibling_order():
    ex = TreeExpansion(parse_tree_spec("paths:[(0,),(1,),(0,0)]"), 4)
    assert ex.frontier() == [-1]
    ex.absorb(torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), -1))
    assert ex.frontier() == [0]  # only the rank-0 child has children
    ex.absorb(torch.log_softmax(torch.tensor([[5.0, 0.0, 0.0, 0.0]]), -1))
    assert ex.frontier() == []
    tree, tokens, q = ex.result()
    assert tree.parents.tolist() == [-1, 0, 0, 1] and tokens == [4, 1, 3, 0] and q is None
    assert ex.node_of(-1) == 0 and ex.node_of(2) == 3


def test_no_draft_policy_and_bad_input():
    ex = TreeExpansion(parse_tree_spec("none"), 3)
    assert ex.frontier() == []
    tree, tokens, _ = ex.result()
    assert tree.num_nodes == 1 and tokens == [3]
    with pytest.raises(ValueError, match="complete"):
        ex.absorb(torch.zeros(1, 4))
    topk = parse_tree_spec("topk:k=2,depth=2,budget=3")
    with pytest.raises(ValueError, match="sample_temperature needs a static tree"):
        TreeExpansion(topk, 0, sample_temperature=1.0)
    with pytest.raises(ValueError, match="sample_temperature must be > 0"):
        TreeExpansion(parse_tree_spec("chain:2"), 0, sample_temperature=0.0)
    with pytest.raises(ValueError, match="must be a StaticPolicy or TopKPolicy"):
        TreeExpansion(parse_tree_spec("ngram:budget=3"), 0)
    ex = TreeExpansion(topk, 0)
    with pytest.raises(ValueError, match="2 rows; the frontier has 1"):
        ex.absorb(torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"\[len\(frontier\), V\]"):
        ex.absorb(torch.zeros(4))
    with pytest.raises(ValueError, match="k=2 exceeds the draft vocabulary"):
        ex.absorb(torch.zeros(1, 1))
    with pytest.raises(ValueError, match="call result"):
        ex.node_of(-1)
    with pytest.raises(ValueError, match="candidate 5 does not exist"):
        ex.token(5)


# --------------------------------------------------------------------------- n-gram trie
NG = "ngram:budget={b}"


@pytest.mark.parametrize(
    "context,spec,parents,tokens",
    [
        # suffix [1, 2] matched at j=6 (continuation 5 6 1 2) and j=2 (3 4 1 2 5 6):
        # the most recent match's whole path first, then the older one's first tokens
        (
            [1, 2, 3, 4, 1, 2, 5, 6, 1, 2],
            NG.format(b=6),
            [-1, 0, 0, 1, 2, 3, 5],
            [2, 5, 3, 6, 4, 1, 2],
        ),
        ([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], NG.format(b=2), [-1, 0, 1], [2, 5, 6]),
        ([1, 2, 3], NG.format(b=4), [-1], [3]),  # no match
        # [7 8] at j=8 (1 7 8), j=5 (9 7 8 1), j=2 (9 7 8 9): "9 7 8" twice outranks
        ([7, 8, 9, 7, 8, 9, 7, 8, 1, 7, 8], NG.format(b=4), [-1, 0, 0, 1, 3], [8, 9, 1, 7, 8]),
        (  # depth 4: both "9 7 8 _" continuations end below the shared "8"
            [7, 8, 9, 7, 8, 9, 7, 8, 1, 7, 8],
            "ngram:budget=8,depth=4",
            [-1, 0, 0, 1, 2, 3, 4, 5, 5],
            [8, 9, 1, 7, 7, 8, 8, 1, 9],
        ),
        (  # depth 8: the recent "1 7 8" whole, then j=5's deeper "1 7" (rank before j=2's)
            [7, 8, 9, 7, 8, 9, 7, 8, 1, 7, 8],
            NG.format(b=8),
            [-1, 0, 0, 1, 2, 3, 4, 5, 7],
            [8, 9, 1, 7, 7, 8, 8, 1, 7],
        ),
        (
            [7, 8, 9, 7, 8, 9, 7, 8, 1, 7, 8],
            "ngram:budget=8,matches=1",
            [-1, 0, 1, 2],
            [8, 1, 7, 8],
        ),
        ([7, 8, 9, 7, 8, 9, 7, 8, 1, 7, 8], "ngram:budget=8,min=3", [-1], [8]),
        ([7, 8, 9, 7, 8, 9, 7, 8, 1, 7, 8], "ngram:budget=8,depth=1", [-1, 0, 0], [8, 9, 1]),
        # a 3-token match (older, j=4: 9 2 3) outranks a 2-token one (recent, j=7: 4 1 2)
        ([5, 1, 2, 3, 9, 2, 3, 4, 1, 2, 3], "ngram:budget=3,depth=3", [-1, 0, 1, 2], [3, 9, 2, 3]),
        (
            [5, 1, 2, 3, 9, 2, 3, 4, 1, 2, 3],
            "ngram:budget=4,depth=3",
            [-1, 0, 0, 1, 3],
            [3, 9, 4, 2, 3],
        ),
        ([4], NG.format(b=3), [-1], [4]),  # the root alone
        ([4, 4, 4, 4], NG.format(b=2), [-1, 0, 1], [4, 4, 4]),  # j=3 (4) then j=2 (4 4)
    ],
)
def test_ngram_trie_on_hand_made_contexts(context, spec, parents, tokens):
    tree, toks = ngram_trie(context, parse_tree_spec(spec))
    assert tree.parents.tolist() == parents
    assert toks == tokens


def test_ngram_matches_rank_by_length_then_recency():
    pol = parse_tree_spec("ngram:budget=4,max=3")
    assert ngram_matches([5, 1, 2, 3, 9, 2, 3, 4, 1, 2, 3], pol) == [(4, 3), (7, 2)]
    assert ngram_matches([1, 2, 1, 2, 1, 2], pol) == [(4, 3), (2, 2)]


def brute_force_matches(context: list[int], min_n: int, max_n: int, matches: int):
    """Every continuation start ``j`` whose ``n`` tokens before equal the context's last
    ``n`` (``j < len``), with its largest such ``n`` in ``[min_n, max_n]``; longest, then
    latest first."""
    L, best = len(context), {}
    for j in range(1, L):
        for n in range(min(max_n, j), min_n - 1, -1):
            if j <= L - 1 and context[j - n : j] == context[L - n :] and j - n >= 0:
                best[j] = n
                break
    # a window must end before the suffix's last token: j <= L - 1
    return sorted(best.items(), key=lambda jn: (-jn[1], -jn[0]))[:matches]


@settings(max_examples=200, deadline=None)
@given(
    context=st.lists(st.integers(0, 3), min_size=1, max_size=50),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    matches=st.integers(1, 9),
)
def test_ngram_matches_equal_brute_force(context, min_n, extra, matches):
    pol = parse_tree_spec(f"ngram:budget=4,min={min_n},max={min_n + extra},matches={matches}")
    want = brute_force_matches(context, min_n, min_n + extra, matches)
    assert ngram_matches(context, pol) == want


@settings(max_examples=60, deadline=None)
@given(
    context=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    budget=st.integers(1, 12),
    matches=st.integers(1, 5),
)
def test_ngram_trie_is_a_valid_budgeted_trie_of_context_continuations(context, budget, matches):
    pol = parse_tree_spec(f"ngram:budget={budget},matches={matches}")
    tree, tokens = ngram_trie(context, pol)
    assert tree.num_nodes <= budget + 1 and tokens[0] == context[-1]
    assert tree.depth.tolist() == sorted(tree.depth.tolist())  # breadth-first
    kids = set()
    for i in range(1, tree.num_nodes):
        key = (int(tree.parents[i]), tokens[i])
        assert key not in kids  # a trie: distinct siblings
        kids.add(key)
    # every node's path (root first) is a slice of the context: a continuation of an
    # earlier occurrence of the last token (every match includes it)
    for i in range(1, tree.num_nodes):
        path = [tokens[a] for a in tree.path_to(i)]
        assert any(context[j : j + len(path)] == path for j in range(len(context) - 1))
    assert ngram_trie(context, pol)[1] == tokens  # deterministic


def test_ngram_trie_bad_input():
    with pytest.raises(ValueError, match="empty context"):
        ngram_trie([], parse_tree_spec("ngram:budget=2"))
    with pytest.raises(ValueError, match="must be an NgramPolicy"):
        ngram_trie([1, 2], parse_tree_spec("chain:2"))


# --------------------------------------------------------------------------- hybrid
def _row(probs: dict[int, float], vocab: int = 8) -> torch.Tensor:
    """A log-prob row with the given token probabilities, the rest spread evenly."""
    rest = (1 - sum(probs.values())) / (vocab - len(probs))
    p = torch.full((vocab,), rest)
    for t, q in probs.items():
        p[t] = q
    return p.log()[None]


@pytest.mark.parametrize(
    "spec,root_row,parents,tokens",
    [
        # draft: 2 (q=.6); trie 6 -> 7 with q(6)=.1 floored to p=.5, 7 unseen: p
        (
            "hybrid:k=1,depth=1,budget=3,ngram=2,p=0.5",
            {2: 0.6, 6: 0.1},
            [-1, 0, 0, 2],
            [5, 2, 6, 7],
        ),
        ("hybrid:k=1,depth=1,budget=2,ngram=2,p=0.5", {2: 0.6, 6: 0.1}, [-1, 0, 0], [5, 2, 6]),
        # p=.7 lifts the trie above the draft's top-1 (.6): 6 first, then 2, then 7
        (
            "hybrid:k=1,depth=1,budget=3,ngram=2,p=0.7",
            {2: 0.6, 6: 0.1},
            [-1, 0, 0, 1],
            [5, 6, 2, 7],
        ),
        # p=.05: the trie's 6 scores its draft q=.1 (log .1), 7 then log .1 + log .05
        (
            "hybrid:k=2,depth=1,budget=3,ngram=2,p=0.05",
            {2: 0.6, 3: 0.2, 6: 0.1},
            [-1, 0, 0, 0],
            [5, 2, 3, 6],
        ),
        # the draft's top-1 is the trie's 6: one node, the chain 6 -> 7 (7 at log .6 + log .5)
        ("hybrid:k=1,depth=1,budget=2,ngram=2,p=0.5", {6: 0.6, 2: 0.3}, [-1, 0, 1], [5, 6, 7]),
    ],
)
def test_hybrid_ranks_draft_and_ngram_nodes_on_one_scale(spec, root_row, parents, tokens):
    ex = expansion_for(parse_tree_spec(spec), 5, context=[5, 6, 7, 5])
    assert ex.frontier() == [-1]
    ex.absorb(_row(root_row))
    assert ex.frontier() == []
    tree, toks, q = ex.result()
    assert (tree.parents.tolist(), toks, q) == (parents, tokens, None)


def test_hybrid_uses_the_draft_probability_deeper_in_the_trie():
    # depth 2: the draft saw the trie's 6 (its top-1) and gives 7 q=.9 there: 7 at
    # log .6 + log .9 beats the draft's second child 2 (log .3)
    ex = expansion_for(
        parse_tree_spec("hybrid:k=1,depth=2,budget=2,ngram=2,p=0.5"), 5, [5, 6, 7, 5]
    )
    ex.absorb(_row({6: 0.6, 2: 0.3}))
    assert ex.frontier() == [0] and ex.token(0) == 6
    ex.absorb(_row({7: 0.9}))
    tree, toks, _ = ex.result()
    assert tree.parents.tolist() == [-1, 0, 1] and toks == [5, 6, 7]
    assert ex.node_of(0) == 1 and ex.node_of(1) == 2  # the top-K candidates 6 and 7


@settings(max_examples=40, deadline=None)
@given(
    salt=st.integers(0, 10**6),
    context=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    budget=st.integers(1, 16),
    p=st.sampled_from([0.05, 0.3, 0.9]),
)
def test_hybrid_tree_is_a_budgeted_merge_of_the_topk_tree_and_the_trie(salt, context, budget, p):
    spec = f"hybrid:k=2,depth=3,budget={budget},ngram=6,p={p}"
    policy = parse_tree_spec(spec)
    ex = expansion_for(policy, context[-1], context=context)
    while ex.frontier():
        rows = [path_scores((ex.token(c), c), salt) for c in ex.frontier()]
        ex.absorb(torch.log_softmax(torch.stack(rows), -1))
    tree, tokens, _ = ex.result()  # TokenTree() itself rejects a parent after its child
    assert tree.num_nodes <= budget + 1
    seen = set()
    for i in range(1, tree.num_nodes):
        key = (int(tree.parents[i]), tokens[i])
        assert key not in seen  # equal paths merged
        seen.add(key)
    # every node is a top-K candidate's path or a path of the n-gram trie
    trie, trie_tokens = ngram_trie(context, policy.ngram)
    allowed = {tuple(trie_tokens[a] for a in trie.path_to(i)) for i in range(trie.num_nodes)}
    for c in range(ex.inner.num_candidates):
        cur, toks = c, []
        while cur != -1:
            toks.append(ex.inner.token(cur))
            cur = ex.inner.parent(cur)
        allowed.add((context[-1], *reversed(toks)))
    for i in range(tree.num_nodes):
        assert tuple(tokens[a] for a in tree.path_to(i)) in allowed


def test_ngram_history_is_bounded_and_separated():
    h = NgramHistory(5)
    h.add([1, 2, 3])
    h.add([4, 5, 6])  # 6 tokens > 5: the oldest request goes
    assert h.tokens() == [SEPARATOR, 4, 5, 6] and len(h) == 3
    h.add(list(range(10, 20)))  # a long one keeps its last 5
    assert h.tokens() == [SEPARATOR, 15, 16, 17, 18, 19]
    off = NgramHistory(0)
    off.add([1, 2])
    assert off.tokens() == [] and len(off) == 0
    with pytest.raises(ValueError, match="max_tokens"):
        NgramHistory(-1)


def test_ngram_trie_searches_earlier_requests_after_its_own_context():
    pol = parse_tree_spec("ngram:budget=8,depth=4")
    h = NgramHistory(100)
    h.add([5, 1, 2, 3])
    h.add([9, 9])
    # the context has no earlier 1: the history's 1 -> 2 3, cut at the end of its stream
    tree, toks = ngram_trie([7, 1], pol, h)
    assert tree.parents.tolist() == [-1, 0, 1] and toks == [1, 2, 3]
    assert ngram_trie([7, 1], pol)[1] == [1]  # without the history: the root alone
    # equal lengths: the request's own (most recent) continuation ranks first
    one = parse_tree_spec("ngram:budget=1,depth=1")
    assert ngram_trie([1, 4, 1], one, h)[1] == [1, 4]
    assert ngram_trie([5, 1, 4, 0, 5, 1], one, h)[1] == [1, 4]  # '5 1' in both: own first
    # a longer match in the history outranks a shorter one of the context
    assert ngram_trie([8, 1, 4, 5, 1], one, h)[1] == [1, 2]  # '5 1' there, only '1' here


@settings(max_examples=200, deadline=None)
@given(
    context=st.lists(st.integers(0, 4), min_size=1, max_size=60),
    specs=st.lists(
        st.tuples(
            st.integers(1, 16),  # budget
            st.integers(1, 3),  # min
            st.integers(0, 2),  # max - min
            st.integers(1, 9),  # matches
            st.integers(1, 8),  # depth
        ),
        min_size=1,
        max_size=5,
    ),
)
def test_ngram_tries_equal_one_trie_at_a_time(context, specs):
    """``tree: auto`` builds every trie candidate of a step in one call, sharing the
    match scan and growing one trie per match set to the deepest policy's depth; each
    must equal the trie grown for that policy alone, to its own depth."""
    policies = [
        parse_tree_spec(f"ngram:budget={b},min={m},max={m + e},matches={k},depth={d}")
        for b, m, e, k, d in specs
    ]
    together = ngram_tries(context, policies)
    for policy, (tree, tokens) in zip(policies, together):
        alone_tree, alone_tokens = ngram_tries(context, [policy])[0]
        assert tokens == alone_tokens, policy.spec
        assert tree.parents.tolist() == alone_tree.parents.tolist(), policy.spec
