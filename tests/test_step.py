"""The engine-independent tree step (``tree_dev.step``) against plain references.

Drafting runs against a fake draft with a real cache discipline: it stores every token it
is given at its slot (``prefix + node``) and scores a node from the context it can read
back (the cached slots before the prefix, then the node's ancestors in the forwarded
tree). A wrong prefix, parent, slot or catch-up gives a different context, so a different
score and a different tree than the reference, which drives the expansion by hand from
the true contexts.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from tests.factories import random_tree
from tree_dev.proposer import expansion_for
from tree_dev.spec import parse_tree_spec
from tree_dev.step import (
    DepthStats,
    DraftBatch,
    DraftRequest,
    Proposal,
    catch_up,
    grow_trees,
    walk_mode,
    walk_trees,
)
from tree_dev.tree import TreeBatch

V = 13  # vocabulary of the fake draft


def score(context: list[int]) -> torch.Tensor:
    """The fake draft's next-token log-probs ``[V]`` fp32 after ``context``."""
    h = sum((i + 1) * t for i, t in enumerate(context[-4:])) + len(context)
    logits = torch.tensor([3.0 * math.sin(h * 0.37 * (v + 1)) for v in range(V)])
    return torch.log_softmax(logits, dim=-1)


class FakeDraft:
    """A ``DraftForward`` with a per-request slot cache; EAGLE-style when ``eagle``: its
    output at node j of request ``key`` is ``[key, prefix + j]``, and it checks that every
    expanded node's feature is its parent's output."""

    def __init__(self, eagle: bool = False):
        self.cache: dict[int, dict[int, int]] = {}
        self.eagle = eagle
        self.calls: list[tuple[list[int], list[list[int]], bool]] = []
        self.trunk: dict[int, int] = {}  # per request: nodes of its trunk

    def __call__(self, batch: DraftBatch):
        keys, prefixes, trees, new_nodes = batch.keys, batch.prefixes, batch.trees, batch.new_nodes
        tokens, feats, want = batch.tokens, batch.feats, batch.want
        self.calls.append((list(keys), [list(n) for n in new_nodes], want is None))
        assert (feats is not None) == self.eagle
        assert len(tokens) == sum(map(len, new_nodes))
        it, row = iter(tokens), 0
        for key, p, tree, nodes in zip(keys, prefixes, trees, new_nodes):
            slots = self.cache.setdefault(key, {})
            parents = tree.parents.tolist()
            if want is not None and nodes[0] == 0:  # the first level: the trunk
                self.trunk[key] = len(nodes)
            for n in nodes:
                slots[p + n] = next(it)
                if self.eagle:  # the trunk's target features are [-1, -1] in these tests
                    expect = [-1, -1] if n < self.trunk[key] else [key, p + parents[n]]
                    assert feats[row].tolist() == expect, (key, n)
                row += 1
        if want is None:
            return None, None
        lps, outs = [], []
        for key, p, tree, w in zip(keys, prefixes, trees, want):
            parents, slots = tree.parents.tolist(), self.cache[key]
            for n in w:
                path, a = [], n
                while a >= 0:
                    path.append(slots[p + a])
                    a = parents[a]
                context = [slots[i] for i in range(p)] + path[::-1]
                lps.append(score(context))
                outs.append(torch.tensor([float(key), float(p + n)]))
        return torch.stack(lps), torch.stack(outs)


def reference_tree(spec: str, context: list[int]):
    """The expansion driven by hand from the true contexts."""
    ex = expansion_for(parse_tree_spec(spec), context[-1], context=context)
    paths = {-1: list(context)}
    while ex.frontier():
        frontier = ex.frontier()
        ex.absorb(torch.stack([score(paths[c]) for c in frontier]))
        for c in ex.frontier():
            paths[c] = paths[ex.parent(c)] + [ex.token(c)]
    return ex.result()


def _contexts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    # repetitive text, so the hybrid tree's n-gram trie finds matches
    return [[rng.choice([1, 2, 3, 4, 5]) for _ in range(n)] for n in lengths]


SPECS = [
    "chain:4",
    "paths:[(0,),(1,),(0,0),(0,1),(0,0,0)]",
    "topk:k=2,depth=4,budget=8",
    "topk:k=3,depth=3,budget=6,temp=0.5",
    "hybrid:k=2,depth=3,budget=8",
]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("seed", range(3))
def test_grown_trees_are_the_expansions_own_from_the_true_context(spec, seed):
    """Three requests at once, one with a long catch-up (a new prompt), two whose draft
    has seen all but the last few tokens: every tree is the reference's, token for token,
    and the whole sequence is in the draft cache afterwards."""
    contexts = _contexts(seed, [80, 12, 40])
    seen = [0, 9, 37]  # tokens already in the draft cache
    draft = FakeDraft()
    for key, (ctx, n) in enumerate(zip(contexts, seen)):
        draft.cache[key] = dict(enumerate(ctx[:n]))
    policy = parse_tree_spec(spec)
    reqs = [
        DraftRequest(k, ctx[n:], n, expansion_for(policy, ctx[-1], context=ctx))
        for k, (ctx, n) in enumerate(zip(contexts, seen))
    ]
    got = grow_trees(reqs, draft)
    for ctx, req, prop in zip(contexts, reqs, got):
        tree, tokens, _ = reference_tree(spec, ctx)
        assert prop.tree.parents.tolist() == tree.parents.tolist()
        assert prop.tokens == tokens
        assert req.prefix == len(ctx)
        assert [draft.cache[req.key][i] for i in range(len(ctx))] == ctx


def test_long_catch_ups_go_first_in_chunks_then_ride_along():
    """A trunk of 80 elements before its root is consumed in chunks of at most ``chunk``
    (no logits), leaving the root; a trunk within the limit waits for the first level."""
    draft = FakeDraft()
    ctx_long, ctx_short = _contexts(0, [81, 10])
    policy = parse_tree_spec("chain:2")
    reqs = [
        DraftRequest(0, list(ctx_long), 0, expansion_for(policy, ctx_long[-1])),
        DraftRequest(1, list(ctx_short), 0, expansion_for(policy, ctx_short[-1])),
    ]
    rounds = catch_up(reqs, draft, limit=32, chunk=30)
    assert rounds == 3
    assert [c[1][0] for c in draft.calls] == [list(range(30)), list(range(30)), list(range(20))]
    assert all(c[0] == [0] and c[2] for c in draft.calls)  # the long one alone, no logits
    assert (reqs[0].prefix, reqs[0].trunk) == (80, [ctx_long[-1]])
    assert (reqs[1].prefix, reqs[1].trunk) == (0, ctx_short)


def test_eagle_features_follow_the_forwarded_tree():
    """EAGLE: a trunk node takes its target feature, an expanded node its parent's draft
    output (``FakeDraft`` asserts it on every forward)."""
    draft = FakeDraft(eagle=True)
    ctx = _contexts(1, [20])[0]
    draft.cache[0] = dict(enumerate(ctx[:15]))
    feats = torch.full((5, 2), -1.0)  # the target's features of the 5 trunk elements
    ex = expansion_for(parse_tree_spec("topk:k=2,depth=3,budget=6"), ctx[-1])
    req = DraftRequest(0, ctx[15:], 15, ex, feats=feats)
    (prop,) = grow_trees([req], draft)
    tree, tokens, _ = reference_tree("topk:k=2,depth=3,budget=6", ctx)
    assert prop.tokens == tokens and req.prefix == 20
    assert len(draft.calls) == 3  # one forward per level


def test_a_request_that_cannot_draft_keeps_its_trunk():
    """An EAGLE head without the root's feature: no forward, the trunk stays unconsumed,
    the tree is the root alone."""
    draft = FakeDraft()
    ex = expansion_for(parse_tree_spec("chain:3"), 7)
    req = DraftRequest(0, [7], 5, ex, can_draft=False)
    (prop,) = grow_trees([req], draft)
    assert draft.calls == [] and req.prefix == 5
    assert prop.tree.num_nodes == 1 and prop.tokens == [7]


# --------------------------------------------------------------------------- walk
def _proposal(n: int, seed: int, vocab: int, sampled: bool) -> Proposal:
    tree = random_tree(n, seed, max_children=4)
    rng = random.Random(seed)
    tokens = [rng.randrange(vocab)] + [0] * (n - 1)
    parents = tree.parents.tolist()
    for p in range(n):
        kids = [c for c in range(n) if parents[c] == p]
        for c, t in zip(kids, rng.sample(range(vocab), len(kids))):
            tokens[c] = t
    q = torch.softmax(torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)), -1)
    return Proposal(tree, tokens, q if sampled else None)


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    seed=st.integers(0, 10_000),
    top_p_cut=st.booleans(),
)
def test_walk_trees_equals_one_walk_per_request(sizes, seed, top_p_cut):
    """Mixed modes in one batch (greedy, target_only, draft_probs): every request's path and
    tokens are those of ``kernels.tree_walk`` on that request alone, with the same
    uniforms from the request's own generator; integer outputs match exactly."""
    vocab = 17
    modes = [("greedy", "target_only", "draft_probs")[(seed + i) % 3] for i in range(len(sizes))]
    props = [
        _proposal(n, seed + i, vocab, m == "draft_probs")
        for i, (n, m) in enumerate(zip(sizes, modes))
    ]
    g = torch.Generator().manual_seed(seed)
    logits = [torch.randn(n, vocab, generator=g) * 3 for n in sizes]
    temps = [0.0 if m == "greedy" else 0.7 + 0.1 * i for i, m in enumerate(modes)]
    top_ps = [0.8 if top_p_cut and i % 2 else 1.0 for i in range(len(sizes))]
    gens = [torch.Generator().manual_seed(seed * 31 + i) for i in range(len(sizes))]
    res = walk_trees(
        logits, props, modes, temps, top_ps, gens, lambda t: TreeBatch(list(t)), "torch"
    )
    for i, (p, m) in enumerate(zip(props, modes)):
        kw = {}
        if m != "greedy":
            u = torch.rand(
                p.tree.num_nodes, 2, generator=torch.Generator().manual_seed(seed * 31 + i)
            )
            kw = dict(uniforms=u, temperature=torch.tensor([temps[i]]))
            kw["top_p"] = torch.tensor([top_ps[i]]) if top_ps[i] < 1 else 1.0
        if m == "draft_probs":
            kw["draft_probs"] = p.draft_probs
        one = kernels.tree_walk(
            logits[i], torch.tensor(p.tokens), TreeBatch([p.tree]), m, backend="torch", **kw
        )
        n = int(one.accepted_len[0])
        assert res.accepted[i] == one.accepted_nodes[0, :n].tolist(), (i, m)
        assert res.emitted[i] == one.output_tokens[0, :n].tolist(), (i, m)
    assert sum(res.walks.values()) == len(sizes)


def test_walk_refuses_draft_probs_of_another_vocabulary():
    p = _proposal(4, 0, 9, sampled=True)
    with pytest.raises(RuntimeError, match=r"draft's vocabulary \(9\) is not the target's \(11\)"):
        walk_trees(
            [torch.randn(4, 11)],
            [p],
            ["draft_probs"],
            [0.8],
            None,
            [None],
            lambda t: TreeBatch(list(t)),
        )


def test_walk_mode_and_depth_stats():
    assert walk_mode(0.0, False) == walk_mode(1e-6, True) == "greedy"
    assert walk_mode(0.8, False) == "target_only" and walk_mode(0.8, True) == "draft_probs"
    d = DepthStats()
    d.record(3, 2)  # a depth-3 tree, two drafts accepted
    d.record(2, 0)
    d.record(0, 0)  # a root-only step
    assert (d.steps, d.emitted, d.accepted_drafts) == (3, 5, 2)
    assert (d.tried, d.accepted) == ([2, 2, 1], [1, 1, 0])
    assert d.acceptance_per_depth() == [0.5, 0.5, 0.0]
    assert d.tokens_per_step() == 5 / 3
