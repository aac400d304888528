"""Tree spec strings shared by the engine, the benchmarks and serve.py."""

from __future__ import annotations

import pytest

from tree_dev.spec import (
    HybridPolicy,
    NgramPolicy,
    NoDraftPolicy,
    StaticPolicy,
    TopKPolicy,
    parse_tree_spec,
)
from tree_dev.tree import MC_SIM_7B_63, TokenTree


def test_every_kind_parses_to_its_policy():
    assert isinstance(parse_tree_spec("none"), NoDraftPolicy)
    chain = parse_tree_spec("chain:5")
    assert isinstance(chain, StaticPolicy) and chain.tree == TokenTree.chain(5)
    paths = parse_tree_spec("paths:[(0,),(1,),(0,0)]")
    assert paths.tree.parents.tolist() == [-1, 0, 0, 1]
    medusa = parse_tree_spec("medusa:mc_sim_7b_63")
    assert medusa.tree.num_nodes == len(MC_SIM_7B_63) + 1 and medusa.max_nodes == 64
    topk = parse_tree_spec("topk:k=4,depth=5,budget=32")
    assert (topk.k, topk.depth, topk.budget, topk.temp, topk.max_nodes) == (4, 5, 32, 1.0, 33)
    assert isinstance(topk, TopKPolicy)
    assert parse_tree_spec("topk:k=2,depth=8,budget=8,temp=0.3").temp == 0.3
    ngram = parse_tree_spec("ngram:budget=8")
    assert isinstance(ngram, NgramPolicy)
    assert (ngram.budget, ngram.min_n, ngram.max_n, ngram.matches, ngram.depth) == (8, 1, 3, 8, 8)
    full = parse_tree_spec("ngram:budget=6,min=2,max=5,matches=3,depth=4")
    assert (full.budget, full.min_n, full.max_n, full.matches, full.depth) == (6, 2, 5, 3, 4)
    assert parse_tree_spec("ngram:budget=6,min=4").max_n == 4  # max defaults to >= min
    hy = parse_tree_spec("hybrid:k=2,depth=6,budget=16,temp=0.3,ngram=8,max=4,ndepth=5,p=0.3")
    assert isinstance(hy, HybridPolicy) and (hy.budget, hy.p) == (16, 0.3)
    assert (hy.topk.k, hy.topk.depth, hy.topk.budget, hy.topk.temp) == (2, 6, 16, 0.3)
    assert (hy.ngram.budget, hy.ngram.max_n, hy.ngram.depth, hy.ngram.matches) == (8, 4, 5, 8)
    assert parse_tree_spec("hybrid:k=1,depth=2,budget=5").ngram.budget == 5


@pytest.mark.parametrize(
    "spec,max_nodes,draft_budget",
    [
        ("none", 1, 0),
        ("chain:5", 6, 5),
        ("paths:[(0,),(1,),(0,0)]", 4, 3),
        ("topk:k=4,depth=5,budget=32", 33, 32),
        ("ngram:budget=10", 11, 10),
        ("hybrid:k=2,depth=3,budget=12,ngram=20", 13, 12),
    ],
)
def test_every_policy_has_max_nodes_and_draft_budget(spec, max_nodes, draft_budget):
    policy = parse_tree_spec(spec)
    assert (policy.max_nodes, policy.draft_budget) == (max_nodes, draft_budget)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("", "empty tree spec"),
        ("bushy", "unknown tree spec"),
        ("bushy:3", "unknown tree spec kind"),
        ("chain:x", "not an integer"),
        ("chain:0", ">= 1"),
        ("paths:[(0,", "not a Python literal"),
        ("paths:[]", "non-empty"),
        ("paths:[(1,)]", "gap"),
        ("medusa:nope", "unknown medusa tree"),
        ("topk:k=4,depth=5", "missing"),
        ("topk:k=4,depth=5,budget=0", ">= 1"),
        ("topk:k=4,width=5,budget=8", "bad field"),
        ("topk:k=4,depth=5,budget=8,temp=0", "temp must be > 0"),
        ("topk:k=4,depth=5,budget=8,temp=hot", "not a number"),
        ("ngram:min=2", r"missing \['budget'\]"),
        ("ngram:budget=0", "budget= must be >= 1"),
        ("ngram:budget=4,min=3,max=2", r"min= \(3\) exceeds max= \(2\)"),
        ("ngram:budget=4,width=2", "bad field 'width=2'"),
        ("ngram:budget=x", "'budget=x' .* is not an integer"),
        ("ngram:budget=4,budget=5", "'budget' given twice"),
        ("topk:k=2,k=3,depth=4,budget=8", "'k' given twice"),
        ("topk:k=2,depth=4,budget=8,temp=0.5,temp=2", "'temp' given twice"),
        ("topk:k=0,depth=4,budget=8", "k= must be >= 1"),
        ("ngram:budget=4,matches=0", "matches= must be >= 1"),
        ("hybrid:k=2,budget=4", r"missing \['depth'\]"),
        ("hybrid:k=2,depth=2,budget=4,p=0", r"p= must be in \(0, 1\]"),
        ("hybrid:k=2,depth=2,budget=4,p=x", "'p=x' .* is not a number"),
        ("hybrid:k=2,depth=2,budget=4,temp=0", "temp must be > 0"),
        ("hybrid:k=2,depth=2,budget=4,min=3,max=2", r"min= \(3\) exceeds max="),
        ("hybrid:k=2,depth=2,budget=4,width=1", "bad field 'width=1'"),
    ],
)
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_tree_spec(spec)
