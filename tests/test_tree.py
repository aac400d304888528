"""TokenTree and TreeBatch (tree_dev/tree.py) against independent computations.

Every derived tensor is recomputed here from ``parents`` alone, by the most
direct method (walking parent pointers, Python ints for the packed bits), and
compared with the cached tensors of the class.
"""

from __future__ import annotations

import ast
import random
from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tree_dev.tree import MC_SIM_7B_63, TokenTree, TreeBatch, pack_bits

# Medusa's published list, copied verbatim from FasterDecoding/Medusa
# medusa/model/medusa_choices.py (the preset must equal it, in the same order).
PUBLISHED_MC_SIM_7B_63 = ast.literal_eval(
    "[[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], "
    "[2, 0], [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], "
    "[0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], "
    "[2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], "
    "[1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2], "
    "[2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], "
    "[0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0]]"
)


# ----------------------------------------------------------------------------- helpers
@st.composite
def parent_lists(draw, min_nodes: int = 1, max_nodes: int = 150) -> list[int]:
    """Random topologically ordered parent arrays: bushy, deep, or mixed."""
    n = draw(st.integers(min_nodes, max_nodes))
    style = draw(st.sampled_from(["uniform", "deep", "bushy"]))
    raw = draw(st.lists(st.integers(0, 2**16), min_size=n - 1, max_size=n - 1))
    parents = [-1]
    for i, r in enumerate(raw, start=1):
        if style == "uniform":
            parents.append(r % i)
        elif style == "deep":  # parent among the last 2 nodes
            parents.append(i - 1 - r % min(i, 2))
        else:  # parent among the first 3 nodes
            parents.append(r % min(i, 3))
    return parents


def ancestors_by_walking(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] != -1:
        i = parents[i]
        out.add(i)
    return out


def children_lists(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            kids[p].append(i)
    return kids


def bit(word: int, b: int) -> int:
    return ((word & (2**64 - 1)) >> b) & 1  # two's-complement int64 -> unsigned


def check_derived(tree: TokenTree, parents: list[int]) -> None:
    n = len(parents)
    assert tree.num_nodes == len(tree) == n
    assert tree.parents.tolist() == parents
    depth = [len(ancestors_by_walking(parents, i)) - 1 for i in range(n)]
    assert tree.depth.tolist() == depth
    assert tree.depth_list == tuple(depth)
    assert tree.max_depth == max(depth)
    assert tree.positions(17).tolist() == [17 + d for d in depth]
    anc = [ancestors_by_walking(parents, i) for i in range(n)]
    assert tree.ancestor_mask.dtype == torch.bool
    assert tree.ancestor_mask.tolist() == [[j in anc[i] for j in range(n)] for i in range(n)]
    words = tree.packed_mask
    assert words.dtype == torch.int64 and words.shape == (n, (n + 63) // 64)
    wl = words.tolist()
    for i in range(n):
        for w in range(words.shape[1]):
            for b in range(64):
                j = 64 * w + b
                assert bit(wl[i][w], b) == (j < n and j in anc[i]), (i, j)
    kids = children_lists(parents)
    fc, ns = tree.first_child.tolist(), tree.next_sibling.tolist()
    for i in range(n):
        walked, c = [], fc[i]
        while c != -1:
            walked.append(c)
            c = ns[c]
        assert walked == kids[i]
        assert tree.num_children[i] == len(kids[i])
    assert ns[0] == -1
    for p in range(n):
        for r, c in enumerate(kids[p]):
            assert tree.sibling_rank[c] == r
    assert tree.sibling_rank[0] == 0
    leaves = [i for i in range(n) if not kids[i]]
    assert tree.leaves.tolist() == leaves
    expected_paths = []
    for leaf in leaves:
        path = sorted(anc[leaf])  # ancestors have smaller indices: sorted == root-to-leaf
        expected_paths.append(path + [-1] * (max(depth) + 1 - len(path)))
    assert tree.paths.tolist() == expected_paths
    for i in range(n):
        assert tree.path_to(i) == sorted(anc[i])
    counts = Counter(depth)
    assert tree.depth_counts.tolist() == [counts[d] for d in range(max(depth) + 1)]


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def mc_sim_tree() -> TokenTree:
    return TokenTree.preset("mc_sim_7b_63")


# ----------------------------------------------------------------------------- derived
@given(parent_lists())
def test_derived_tensors_match_independent_computation(parents):
    check_derived(TokenTree.from_parents(parents), parents)


@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 128, 129, 200])
def test_derived_tensors_on_chains_and_stars(n):
    check_derived(TokenTree.chain(n - 1), [-1] + list(range(n - 1)))
    check_derived(TokenTree.from_parents([-1] + [0] * (n - 1)), [-1] + [0] * (n - 1))


def test_packed_words_bit_63_and_second_word():
    tree = TokenTree.chain(70)  # 71 nodes: two words per row
    words = tree.packed_mask
    assert words.shape == (71, 2)
    assert words[62].tolist() == [2**63 - 1, 0]  # bits 0..62
    assert words[63].tolist() == [-1, 0]  # bits 0..63: bit 63 is the sign bit
    assert words[64].tolist() == [-1, 1]
    assert words[70].tolist() == [-1, 2**7 - 1]
    star = TokenTree.from_parents([-1] + [0] * 64)  # node 64 sees 0 and itself
    assert star.packed_mask[63].tolist() == [1 - 2**63, 0]  # bits 0 and 63
    assert star.packed_mask[64].tolist() == [1, 1]


def test_pack_bits_matches_python_ints():
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(5, 150, generator=gen) < 0.5
    words = pack_bits(mask).tolist()
    for r in range(5):
        value = sum(1 << j for j in range(150) if mask[r, j])
        for w in range(3):
            assert words[r][w] & (2**64 - 1) == (value >> (64 * w)) & (2**64 - 1)


def test_positions_and_from_parents_tensor():
    tree = TokenTree.from_parents(torch.tensor([-1, 0, 0, 1], dtype=torch.int32))
    assert tree.parents.dtype == torch.int64
    assert tree.positions(0).tolist() == [0, 1, 1, 2]
    assert tree.positions(5).tolist() == [5, 6, 6, 7]
    assert tree == TokenTree([-1, 0, 0, 1]) and hash(tree) == hash(TokenTree([-1, 0, 0, 1]))
    assert tree != TokenTree([-1, 0, 1, 1])


@pytest.mark.parametrize("k", [0, 1, 5])
def test_chain(k):
    tree = TokenTree.chain(k)
    assert tree.parents.tolist() == [-1] + list(range(k))
    assert tree.max_depth == k and tree.depth_counts.tolist() == [1] * (k + 1)
    assert tree.to_paths() == [(0,) * d for d in range(1, k + 1)]


# ----------------------------------------------------------------------------- constructors
def test_from_paths_sorts_breadth_first_like_medusa():
    paths = [(1,), (0, 0), (0,), (1, 0), (0, 1), (0, 0, 0)]
    tree = TokenTree.from_paths(paths)
    # Medusa: sorted(choices, key=lambda x: (len(x), x)); node i+1 is sorted[i]
    medusa_sorted = sorted(paths, key=lambda x: (len(x), x))
    assert medusa_sorted == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert tree.to_paths() == medusa_sorted
    for i, path in enumerate(medusa_sorted, start=1):
        # the node's sibling ranks from the root spell its path
        ranks = [int(tree.sibling_rank[j]) for j in tree.path_to(i)[1:]]
        assert tuple(ranks) == path


def test_from_paths_any_order_gives_the_same_tree():
    rng = random.Random(0)
    paths = [tuple(p) for p in PUBLISHED_MC_SIM_7B_63]
    reference = TokenTree.from_paths(paths)
    for _ in range(5):
        rng.shuffle(paths)
        assert TokenTree.from_paths(paths) == reference
    assert TokenTree.from_paths([list(p) for p in paths]) == reference  # lists work too


def test_from_paths_empty_list_is_the_root_alone():
    assert TokenTree.from_paths([]) == TokenTree.chain(0)


def test_preset_mc_sim_7b_63(mc_sim_tree):
    assert MC_SIM_7B_63 == tuple(tuple(p) for p in PUBLISHED_MC_SIM_7B_63)
    assert mc_sim_tree.num_nodes == 64  # root + 63 draft nodes
    assert mc_sim_tree.max_depth == 4
    by_len = Counter(len(p) for p in PUBLISHED_MC_SIM_7B_63)
    assert mc_sim_tree.depth_counts.tolist() == [1, by_len[1], by_len[2], by_len[3], by_len[4]]
    assert mc_sim_tree.depth_counts.tolist() == [1, 10, 28, 23, 2]
    assert set(mc_sim_tree.to_paths()) == {tuple(p) for p in PUBLISHED_MC_SIM_7B_63}
    assert int(mc_sim_tree.num_children[0]) == 10
    assert mc_sim_tree.packed_mask.shape == (64, 1)
    check_derived(mc_sim_tree, mc_sim_tree.parents.tolist())


def test_from_adjacency_nxd_style():
    adj = {"0": ["1", "2"], "1": ["3", "4"], "2": ["5"], "3": ["6"]}
    tree = TokenTree.from_adjacency(adj)
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert tree.to_adjacency() == adj
    int_keys = {0: [1, 2], 1: [3, 4], 2: [5], 3: [6]}
    assert TokenTree.from_adjacency(int_keys) == tree


def test_from_adjacency_renumbers_breadth_first():
    # ids are not breadth-first: 9 is a child of the root, 4 a grandchild
    tree = TokenTree.from_adjacency({"0": ["7", "9"], "7": ["4"], "9": ["2", "3"]})
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2, 2]
    assert TokenTree.from_adjacency({"0": []}) == TokenTree.chain(0)
    assert TokenTree.from_adjacency({}) == TokenTree.chain(0)


@given(parent_lists(max_nodes=80))
def test_round_trips(parents):
    tree = TokenTree.from_parents(parents)
    paths = tree.to_paths()
    assert len(paths) == len(set(paths)) == tree.num_nodes - 1
    canon = TokenTree.from_paths(paths)
    assert set(canon.to_paths()) == set(paths)  # same tree, renumbered breadth-first
    assert canon.depth_counts.tolist() == tree.depth_counts.tolist()
    assert TokenTree.from_paths(canon.to_paths()) == canon
    assert TokenTree.from_adjacency(tree.to_adjacency()) == canon
    assert TokenTree.from_adjacency(canon.to_adjacency()) == canon
    # the adjacency lists the children of every inner node, in node order
    adj = tree.to_adjacency()
    kids = children_lists(parents)
    assert adj == {str(p): [str(c) for c in kids[p]] for p in range(len(parents)) if kids[p]}
    # breadth-first order: depth never decreases along the node order
    assert canon.depth.tolist() == sorted(canon.depth.tolist())


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: TokenTree.from_parents([]), "empty tree"),
        (lambda: TokenTree.from_parents([0, 0]), "node 0 is the root and must have parent -1"),
        (lambda: TokenTree.from_parents([-1, 1]), r"node 1: parent is itself \(a cycle\)"),
        (lambda: TokenTree.from_parents([-1, 0, 2]), r"node 2: parent is itself \(a cycle\)"),
        (lambda: TokenTree.from_parents([-1, 2, 0]), "node 1: parent is node 2, at or after it"),
        (lambda: TokenTree.from_parents([-1, 0, -3]), "node 2: parent -3 is negative"),
        (lambda: TokenTree.from_parents([-1, 0.5]), "node 1: parent 0.5 is not an integer"),
        (lambda: TokenTree.from_parents([-1, True]), "node 1: parent True is not an integer"),
        (lambda: TokenTree.from_parents(torch.tensor([-1.0, 0.0])), "integer tensor"),
        (lambda: TokenTree.from_parents(torch.tensor([[-1, 0]])), r"1-D, got shape \(1, 2\)"),
        (
            lambda: TokenTree.from_parents([-1, 0, 0], max_nodes=2),
            "tree has 3 nodes, more than the maximum of 2",
        ),
        (lambda: TokenTree.chain(-1), "chain length must be >= 0, got -1"),
        (lambda: TokenTree.preset("nope"), "unknown tree preset 'nope'"),
        (lambda: TokenTree.from_paths([(0,), ()]), r"empty path \(\)"),
        (lambda: TokenTree.from_paths([(0,), (0,)]), r"duplicate path \(0,\)"),
        (
            lambda: TokenTree.from_paths([(0,), [0, 1], (0, 1)]),
            r"duplicate path \(0, 1\)",
        ),
        (
            lambda: TokenTree.from_paths([(0,), (0, 0, 0)]),
            r"path \(0, 0, 0\): missing intermediate path \(0, 0\)",
        ),
        (
            lambda: TokenTree.from_paths([(0,), (1, 0)]),
            r"path \(1, 0\): missing intermediate path \(1,\)",
        ),
        (
            lambda: TokenTree.from_paths([(0,), (2,)]),
            r"path \(2,\): sibling ranks have a gap, \(1,\) is missing",
        ),
        (
            lambda: TokenTree.from_paths([(0,), (0, 1)]),
            r"path \(0, 1\): sibling ranks have a gap, \(0, 0\) is missing",
        ),
        (lambda: TokenTree.from_paths([(0,), (0, -1)]), r"path \(0, -1\): ranks must be non-neg"),
        (lambda: TokenTree.from_paths([(0.5,)]), r"path \(0.5,\): ranks must be non-negative"),
        (
            lambda: TokenTree.from_paths([(0,), (1,), (2,)], max_nodes=3),
            "tree has 4 nodes, more than the maximum of 3",
        ),
        (
            lambda: TokenTree.from_adjacency({"0": ["1", "2"], "1": ["2"]}),
            r"node 2: two parents \(0 and 1\)",
        ),
        (
            lambda: TokenTree.from_adjacency({"0": ["1"], "1": ["2"], "2": ["1"]}),
            r"node 1: two parents \(0 and 2\), or a cycle",
        ),
        (lambda: TokenTree.from_adjacency({"0": ["0"]}), r"node 0: its own child \(a cycle\)"),
        (lambda: TokenTree.from_adjacency({"0": ["1"], "1": ["1"]}), "node 1: its own child"),
        (
            lambda: TokenTree.from_adjacency({"0": ["1"], "1": ["0"]}),
            "node 0 is the root but is listed as a child of 1",
        ),
        (
            lambda: TokenTree.from_adjacency({"0": ["1"], "5": ["6"]}),
            "node 5: not reachable from the root",
        ),
        (
            lambda: TokenTree.from_adjacency({"0": ["1"], "2": ["3"], "3": ["2"]}),
            "node 2: not reachable from the root",
        ),
        (lambda: TokenTree.from_adjacency({"1": ["2"]}), "adjacency has no root node 0"),
        (lambda: TokenTree.from_adjacency({"0": ["-1"]}), "node id '-1' is negative"),
        (lambda: TokenTree.from_adjacency({"0": ["x"]}), "node id 'x' is not an integer"),
        (lambda: TokenTree.from_adjacency({"0": ["1"], 0: ["2"]}), "node 0 listed twice"),
        (
            lambda: TokenTree.from_adjacency({"0": ["1", "2", "3"]}, max_nodes=3),
            "tree has 4 nodes, more than the maximum of 3",
        ),
        (lambda: TokenTree.chain(3).path_to(4), "node 4 out of range for a tree of 4 nodes"),
        (lambda: TreeBatch([]), "a TreeBatch needs at least one tree"),
        (lambda: TreeBatch([TokenTree.chain(1), [-1, 0]]), r"trees\[1\] is list, not a TokenTree"),
        (
            lambda: TreeBatch([TokenTree.chain(1), TokenTree.chain(2)]).positions([3]),
            r"prefix_lens has shape \(1,\), expected \(2,\)",
        ),
    ],
)
def test_bad_input_raises_value_error_naming_the_culprit(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ----------------------------------------------------------------------------- TreeBatch
def test_tree_batch_ragged(mc_sim_tree):
    trees = [TokenTree.chain(3), mc_sim_tree, TokenTree.chain(0), TokenTree.chain(70)]
    batch = TreeBatch(trees)
    sizes = [4, 64, 1, 71]
    assert len(batch) == batch.num_requests == 4
    assert batch.num_nodes.tolist() == sizes
    assert batch.cu_nodes.tolist() == [0, 4, 68, 69, 140]
    assert batch.total_nodes == 140
    assert batch.max_nodes == 71 and batch.max_depth == 70
    assert batch.request_ids.tolist() == sum(([b] * n for b, n in enumerate(sizes)), [])
    assert batch.packed_mask.shape == (140, 2)  # ceil(71 / 64) words for everybody
    for b, tree in enumerate(trees):
        s, e = batch.cu_nodes[b], batch.cu_nodes[b + 1]
        words = tree.packed_mask.shape[1]
        assert torch.equal(batch.packed_mask[s:e, :words], tree.packed_mask)
        assert (batch.packed_mask[s:e, words:] == 0).all()
        for name in ("parents", "depth", "first_child", "next_sibling", "sibling_rank"):
            assert torch.equal(getattr(batch, name)[s:e], getattr(tree, name)), name
    pos = batch.positions(torch.tensor([10, 0, 5, 2]))
    assert pos[:4].tolist() == [10, 11, 12, 13]
    assert pos[4:68].tolist() == mc_sim_tree.depth.tolist()
    assert pos[68].item() == 5
    assert pos[69:].tolist() == list(range(2, 73))
    assert batch.positions([1, 1, 1, 1]).dtype == torch.int64
    assert "num_requests=4" in repr(batch) and "total_nodes=140" in repr(batch)


def test_tree_batch_to_moves_every_tensor():
    batch = TreeBatch([TokenTree.chain(2), TokenTree.from_parents([-1, 0, 0])])
    moved = batch.to("meta")
    assert moved.device == torch.device("meta")
    for name in TreeBatch._TENSORS:
        assert getattr(moved, name).device.type == "meta", name
        assert getattr(batch, name).device.type == "cpu", name  # the original is untouched
    assert moved.max_nodes == batch.max_nodes and moved.trees == batch.trees
    back = TreeBatch([TokenTree.chain(2)], device="meta")
    assert back.cu_nodes.device.type == "meta"
    same = batch.to("cpu")
    for name in TreeBatch._TENSORS:
        assert torch.equal(getattr(same, name), getattr(batch, name)), name
