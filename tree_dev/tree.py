"""The canonical token tree and ragged batches of trees.

One encoding, everything derived from it: ``parents: int64[N]``, topologically
ordered (every parent index < child index), ``parents[0] == -1``. Node 0 is the
root (the last committed token, not yet processed by the target); nodes
``1..N-1`` are draft tokens. Node ``i`` *sees* node ``j`` iff ``j`` is ``i`` or
an ancestor of ``i``.

Constructors accept the formats users already have: Medusa / vLLM
``speculative_token_tree`` path lists, NxD Inference ``token_tree_config``
adjacency dicts, chains and raw parent arrays. Invalid input raises
``ValueError`` naming the offending node or path.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property

import torch

__all__ = ["TokenTree", "TreeBatch", "MC_SIM_7B_63", "pack_bits"]

# Medusa's published 63-node tree (medusa/model/medusa_choices.py), also shipped
# by vLLM and xFormers under the same name. Each path is the top-k rank of the
# token at every depth below the root.
MC_SIM_7B_63: tuple[tuple[int, ...], ...] = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4),
    (2, 0), (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8),
    (0, 0, 2), (3, 0), (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0),
    (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0),
    (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2),
    (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0),
    (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
)  # fmt: skip

PRESETS: dict[str, tuple[tuple[int, ...], ...]] = {"mc_sim_7b_63": MC_SIM_7B_63}


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool ``[R, N]`` matrix into int64 words ``[R, ceil(N/64)]``.

    Bit ``j % 64`` of word ``j // 64`` in row ``r`` is ``mask[r, j]`` (bit 63 is
    the sign bit: words are two's-complement int64).
    """
    rows, n = mask.shape
    words = max(1, math.ceil(n / 64))
    padded = torch.zeros(rows, words * 64, dtype=torch.int64, device=mask.device)
    padded[:, :n] = mask.to(torch.int64)
    shifts = torch.arange(64, dtype=torch.int64, device=mask.device)
    bits = padded.view(rows, words, 64) << shifts  # bit 63 wraps to the sign bit
    return bits.sum(dim=-1)  # disjoint bits: sum == bitwise or (mod 2**64)


def _node_id(x: str | int) -> int:
    """An adjacency node id: an int >= 0 (or its string)."""
    try:
        v = int(x)
    except (TypeError, ValueError):
        raise ValueError(f"node id {x!r} is not an integer") from None
    if v < 0:
        raise ValueError(f"node id {x!r} is negative")
    return v


def _adjacency_edges(
    adjacency: Mapping[str | int, Sequence[str | int]],
) -> tuple[dict[int, list[int]], dict[int, int]]:
    """``(children per node, parent per node)`` of an adjacency dict; ValueError naming a
    node listed twice, its own child, with two parents, or the root as a child."""
    children: dict[int, list[int]] = {}
    parent_of: dict[int, int] = {}
    for key, kids in adjacency.items():
        p = _node_id(key)
        if p in children:
            raise ValueError(f"node {key!r} listed twice")
        children[p] = []
        for kid in kids:
            c = _node_id(kid)
            if c == p:
                raise ValueError(f"node {c}: its own child (a cycle)")
            if c in parent_of:
                raise ValueError(f"node {c}: two parents ({parent_of[c]} and {p}), or a cycle")
            if c == 0:
                raise ValueError(f"node 0 is the root but is listed as a child of {p}")
            parent_of[c] = p
            children[p].append(c)
    return children, parent_of


class TokenTree:
    """A token tree in canonical form.

    Args:
        parents: ``int[N]`` parent index of every node, ``parents[0] == -1`` and
            ``parents[i] < i`` for ``i > 0``.
        max_nodes: optional upper bound on ``N``.

    All derived tensors are int64/bool CPU tensors, computed once and cached.
    """

    def __init__(self, parents: Sequence[int] | torch.Tensor, max_nodes: int | None = None):
        if isinstance(parents, torch.Tensor):
            if parents.dim() != 1:
                raise ValueError(f"parents must be 1-D, got shape {tuple(parents.shape)}")
            if parents.dtype.is_floating_point or parents.dtype == torch.bool:
                raise ValueError(f"parents must be an integer tensor, got {parents.dtype}")
            plist = [int(p) for p in parents.tolist()]
        else:
            plist = []
            for i, p in enumerate(parents):
                if isinstance(p, bool) or int(p) != p:
                    raise ValueError(f"node {i}: parent {p!r} is not an integer")
                plist.append(int(p))
        n = len(plist)
        if n == 0:
            raise ValueError("empty tree: a tree has at least the root node 0")
        if max_nodes is not None and n > max_nodes:
            raise ValueError(f"tree has {n} nodes, more than the maximum of {max_nodes}")
        if plist[0] != -1:
            raise ValueError(f"node 0 is the root and must have parent -1, got {plist[0]}")
        for i in range(1, n):
            p = plist[i]
            if p < 0:
                raise ValueError(f"node {i}: parent {p} is negative; only the root has no parent")
            if p >= i:
                kind = "itself (a cycle)" if p == i else f"node {p}, at or after it"
                raise ValueError(
                    f"node {i}: parent is {kind}; parents must precede their children "
                    "(topological order)"
                )
        self.parents = torch.tensor(plist, dtype=torch.int64)
        self._plist = plist

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_parents(
        cls, parents: Sequence[int] | torch.Tensor, max_nodes: int | None = None
    ) -> TokenTree:
        """A tree from a raw parent array (already topologically ordered)."""
        return cls(parents, max_nodes=max_nodes)

    @classmethod
    def chain(cls, k: int) -> TokenTree:
        """A chain of ``k`` draft tokens below the root (``k + 1`` nodes)."""
        if k < 0:
            raise ValueError(f"chain length must be >= 0, got {k}")
        return cls([-1] + list(range(k)))

    @classmethod
    def preset(cls, name: str) -> TokenTree:
        """A named published tree, e.g. ``"mc_sim_7b_63"`` (Medusa)."""
        if name not in PRESETS:
            raise ValueError(f"unknown tree preset {name!r}; known: {sorted(PRESETS)}")
        return cls.from_paths(PRESETS[name])

    @classmethod
    def from_paths(cls, paths: Iterable[Sequence[int]], max_nodes: int | None = None) -> TokenTree:
        """A tree from Medusa / vLLM ``speculative_token_tree`` paths.

        Each path lists, from the root down, the sibling rank (top-k index) of the
        token at every depth: ``[(0,), (1,), (0, 0)]`` is a root with two children
        and a grandchild under the first. Paths may come in any order; nodes are
        numbered breadth-first, siblings by rank (Medusa's ``(len, path)`` sort).
        Every prefix of a path must be present and sibling ranks must have no gaps.
        """
        seen: set[tuple[int, ...]] = set()
        plist = []
        for raw in paths:
            path = tuple(raw)
            if len(path) == 0:
                raise ValueError("empty path (); the root is implicit")
            for r in path:
                if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                    raise ValueError(f"path {path}: ranks must be non-negative ints, got {r!r}")
            if path in seen:
                raise ValueError(f"duplicate path {path}")
            seen.add(path)
            plist.append(path)
        ordered = sorted(plist, key=lambda p: (len(p), p))
        index = {(): 0}
        parents = [-1]
        for path in ordered:
            parent = path[:-1]
            if parent not in index:
                raise ValueError(f"path {path}: missing intermediate path {parent}")
            if path[-1] > 0 and parent + (path[-1] - 1,) not in seen:
                raise ValueError(
                    f"path {path}: sibling ranks have a gap, {parent + (path[-1] - 1,)} is missing"
                )
            index[path] = len(parents)
            parents.append(index[parent])
        return cls(parents, max_nodes=max_nodes)

    @classmethod
    def from_adjacency(
        cls, adjacency: Mapping[str | int, Sequence[str | int]], max_nodes: int | None = None
    ) -> TokenTree:
        """A tree from an NxD Inference ``token_tree_config`` dict.

        ``{"0": ["1", "2"], "1": ["3"]}``: keys and values are node ids (str or
        int), ``"0"`` is the root, children in the listed order. Nodes are
        renumbered breadth-first. Cycles, nodes with two parents and unreachable
        nodes are errors.
        """

        children, parent_of = _adjacency_edges(adjacency)
        all_ids = set(children) | set(parent_of)
        if not all_ids:
            all_ids = {0}
        if 0 not in all_ids:
            raise ValueError("adjacency has no root node 0")
        order = [0]
        new_index = {0: 0}
        parents = [-1]
        head = 0
        while head < len(order):
            node = order[head]
            head += 1
            for c in children.get(node, []):
                if c in new_index:
                    raise ValueError(f"node {c}: reached twice (a cycle)")
                new_index[c] = len(order)
                order.append(c)
                parents.append(new_index[node])
        unreachable = sorted(all_ids - set(new_index))
        if unreachable:
            raise ValueError(f"node {unreachable[0]}: not reachable from the root (a cycle?)")
        return cls(parents, max_nodes=max_nodes)

    def to_paths(self) -> list[tuple[int, ...]]:
        """Medusa / vLLM path list (sibling ranks from the root), in node order."""
        paths: list[tuple[int, ...]] = [()]
        rank = self.sibling_rank.tolist()
        for i in range(1, self.num_nodes):
            paths.append(paths[self._plist[i]] + (rank[i],))
        return paths[1:]

    def to_adjacency(self) -> dict[str, list[str]]:
        """NxD Inference style adjacency dict over this tree's node indices."""
        adj: dict[str, list[str]] = {}
        for i in range(1, self.num_nodes):
            adj.setdefault(str(self._plist[i]), []).append(str(i))
        return adj

    # ------------------------------------------------------------------ basics
    @property
    def num_nodes(self) -> int:
        return len(self._plist)

    def __len__(self) -> int:
        return self.num_nodes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenTree) and self._plist == other._plist

    def __hash__(self) -> int:
        return hash(tuple(self._plist))

    def __repr__(self) -> str:
        return f"TokenTree(num_nodes={self.num_nodes}, max_depth={self.max_depth})"

    # ------------------------------------------------------------------ derived
    @cached_property
    def depth_list(self) -> tuple[int, ...]:
        """Depth of each node (root 0) as Python ints, for per-node bookkeeping."""
        d = [0] * self.num_nodes
        for i in range(1, self.num_nodes):
            d[i] = d[self._plist[i]] + 1
        return tuple(d)

    @cached_property
    def depth(self) -> torch.Tensor:
        """``int64[N]``: depth of each node (root 0)."""
        return torch.tensor(self.depth_list, dtype=torch.int64)

    @cached_property
    def max_depth(self) -> int:
        return max(self.depth_list)

    def positions(self, seq_len: int) -> torch.Tensor:
        """``int64[N]`` absolute positions: ``seq_len + depth`` (root at ``seq_len``)."""
        return self.depth + int(seq_len)

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """``bool[N, N]``: ``[i, j]`` is True iff ``j`` is ``i`` or an ancestor of ``i``."""
        n = self.num_nodes
        m = torch.zeros(n, n, dtype=torch.bool)
        m[0, 0] = True
        for i in range(1, n):
            m[i] = m[self._plist[i]]
            m[i, i] = True
        return m

    @cached_property
    def packed_mask(self) -> torch.Tensor:
        """``int64[N, ceil(N/64)]``: the ancestor relation, bit ``j`` of row ``i``."""
        return pack_bits(self.ancestor_mask)

    @cached_property
    def num_children(self) -> torch.Tensor:
        """``int64[N]``: number of children of each node."""
        c = torch.zeros(self.num_nodes, dtype=torch.int64)
        if self.num_nodes > 1:
            c.index_add_(0, self.parents[1:], torch.ones(self.num_nodes - 1, dtype=torch.int64))
        return c

    @cached_property
    def sibling_rank(self) -> torch.Tensor:
        """``int64[N]``: index of each node among its parent's children (root 0)."""
        count = [0] * self.num_nodes
        rank = [0] * self.num_nodes
        for i in range(1, self.num_nodes):
            p = self._plist[i]
            rank[i] = count[p]
            count[p] += 1
        return torch.tensor(rank, dtype=torch.int64)

    @cached_property
    def first_child(self) -> torch.Tensor:
        """``int64[N]``: first child of each node, -1 for leaves."""
        fc = [-1] * self.num_nodes
        for i in range(self.num_nodes - 1, 0, -1):
            fc[self._plist[i]] = i
        return torch.tensor(fc, dtype=torch.int64)

    @cached_property
    def next_sibling(self) -> torch.Tensor:
        """``int64[N]``: next sibling (same parent, next in order), -1 for the last."""
        ns = [-1] * self.num_nodes
        last: dict[int, int] = {}
        for i in range(1, self.num_nodes):
            p = self._plist[i]
            if p in last:
                ns[last[p]] = i
            last[p] = i
        return torch.tensor(ns, dtype=torch.int64)

    @cached_property
    def leaves(self) -> torch.Tensor:
        """``int64[L]``: leaf node indices in ascending order."""
        return torch.nonzero(self.num_children == 0).flatten()

    @cached_property
    def paths(self) -> torch.Tensor:
        """``int64[L, max_depth + 1]``: root-to-leaf node paths, padded with -1."""
        rows = []
        for leaf in self.leaves.tolist():
            path = []
            node = leaf
            while node != -1:
                path.append(node)
                node = self._plist[node]
            path.reverse()
            rows.append(path + [-1] * (self.max_depth + 1 - len(path)))
        return torch.tensor(rows, dtype=torch.int64)

    @cached_property
    def depth_counts(self) -> torch.Tensor:
        """``int64[max_depth + 1]``: number of nodes at each depth."""
        return torch.bincount(self.depth, minlength=self.max_depth + 1)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node`` inclusive."""
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node {node} out of range for a tree of {self.num_nodes} nodes")
        path = []
        while node != -1:
            path.append(node)
            node = self._plist[node]
        return path[::-1]


class TreeBatch:
    """Ragged trees of several requests, nodes concatenated.

    Attributes (int64 unless said otherwise, on ``device``):
        trees: the ``TokenTree`` of each request.
        cu_nodes ``[B + 1]``: request ``b`` owns nodes ``cu_nodes[b]:cu_nodes[b+1]``.
        parents, depth, first_child, next_sibling, sibling_rank ``[T]``: per node,
            indices local to the node's request (-1 for none).
        request_ids ``[T]``: request of each node.
        packed_mask ``[T, W]``: each request's packed ancestor words, local bits,
            ``W = ceil(max_nodes / 64)`` (unused high words are 0).
        num_nodes ``[B]``, max_nodes (int), max_depth (int).
    """

    def __init__(self, trees: Sequence[TokenTree], device: torch.device | str | None = None):
        if len(trees) == 0:
            raise ValueError("a TreeBatch needs at least one tree")
        for i, t in enumerate(trees):
            if not isinstance(t, TokenTree):
                raise ValueError(f"trees[{i}] is {type(t).__name__}, not a TokenTree")
        self.trees = list(trees)
        sizes = [t.num_nodes for t in trees]
        self.max_nodes = max(sizes)
        self.max_depth = max(t.max_depth for t in trees)
        self.num_requests = len(trees)
        words = max(1, math.ceil(self.max_nodes / 64))
        packed = torch.zeros(sum(sizes), words, dtype=torch.int64)
        row = 0
        for t in trees:
            packed[row : row + t.num_nodes, : t.packed_mask.shape[1]] = t.packed_mask
            row += t.num_nodes
        self.num_nodes = torch.tensor(sizes, dtype=torch.int64)
        self.cu_nodes = torch.zeros(len(trees) + 1, dtype=torch.int64)
        self.cu_nodes[1:] = torch.cumsum(self.num_nodes, 0)
        self.parents = torch.cat([t.parents for t in trees])
        self.depth = torch.cat([t.depth for t in trees])
        self.first_child = torch.cat([t.first_child for t in trees])
        self.next_sibling = torch.cat([t.next_sibling for t in trees])
        self.sibling_rank = torch.cat([t.sibling_rank for t in trees])
        self.request_ids = torch.repeat_interleave(
            torch.arange(len(trees), dtype=torch.int64), self.num_nodes
        )
        self.packed_mask = packed
        self.device = torch.device("cpu")
        if device is not None:
            self._move(torch.device(device))

    _TENSORS = (
        "num_nodes",
        "cu_nodes",
        "parents",
        "depth",
        "first_child",
        "next_sibling",
        "sibling_rank",
        "request_ids",
        "packed_mask",
    )

    def _move(self, device: torch.device) -> None:
        for name in self._TENSORS:
            setattr(self, name, getattr(self, name).to(device))
        self.device = device

    def to(self, device: torch.device | str) -> TreeBatch:
        """A copy of this batch with its tensors on ``device``."""
        other = TreeBatch.__new__(TreeBatch)
        other.__dict__.update(self.__dict__)
        other._move(torch.device(device))
        return other

    @property
    def total_nodes(self) -> int:
        return int(self.cu_nodes[-1])

    def __len__(self) -> int:
        return self.num_requests

    def __repr__(self) -> str:
        return (
            f"TreeBatch(num_requests={self.num_requests}, total_nodes={self.total_nodes}, "
            f"max_nodes={self.max_nodes}, max_depth={self.max_depth})"
        )

    def positions(self, prefix_lens: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """``int64[T]``: absolute position of each node, ``prefix_lens[b] + depth``."""
        lens = torch.as_tensor(prefix_lens, dtype=torch.int64, device=self.device)
        if lens.shape != (self.num_requests,):
            raise ValueError(
                f"prefix_lens has shape {tuple(lens.shape)}, expected ({self.num_requests},)"
            )
        return lens[self.request_ids] + self.depth
