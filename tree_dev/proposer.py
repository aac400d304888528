"""Engine-independent proposers: grow a ``TokenTree`` from draft scores or from the context.

One implementation, used by the local engine (``tree_dev.engine``) and the vLLM plugin
(``tree_dev.vllm_plugin``) alike; neither knows how the other runs its draft.

- ``TreeExpansion``: one request's draft tree grown level by level from the draft's
  log-probabilities. The engine asks ``frontier()`` which candidates need a draft
  distribution, runs its draft on them, and hands the ``[len(frontier), V]`` fp32
  log-softmax rows to ``absorb``; ``result()`` gives the tree.

  * top-K (``TopKPolicy``, EAGLE-2 style): every frontier node gets its top-``k``
    children, scored by cumulative log-probability (optionally at a ranking
    temperature); the best ``k`` new candidates form the next frontier until
    ``depth`` levels exist; the best ``budget`` candidates overall are kept. Ties are
    broken by creation order, so a parent (cumulative score >= its child's, created
    first) always ranks before its children: a kept node's ancestors are kept.
  * static (``StaticPolicy``): the tree's shape is fixed; a node's children are the
    draft's top-ranked tokens in sibling order, or, when ``sample_temperature`` is
    given, a without-replacement sample (Gumbel top-k) from the draft at that
    temperature, in draw order, with the sampling distributions returned for
    SpecInfer-style verification.

- ``ngram_trie``: no draft model. The trie of the continuations of several n-gram
  matches of the context's suffix inside the context (prompt + output).
- ``HybridExpansion``: a top-K expansion and the n-gram trie merged under one budget,
  ranked on the draft's cumulative log-probability scale (``HybridPolicy``).
- ``expansion_for``: the expansion a policy needs.

Candidate ids are creation order: 0, 1, ... as ``absorb`` creates them; ``-1`` is the
root (the last committed token, node 0 of the result).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from tree_dev.spec import HybridPolicy, NgramPolicy, NoDraftPolicy, StaticPolicy, TopKPolicy
from tree_dev.tree import TokenTree

ROOT = -1


class TreeExpansion:
    """One request's draft tree grown level by level from the draft's log-probabilities.

    Args:
        policy: a ``TopKPolicy`` or ``StaticPolicy`` (a ``NoDraftPolicy`` gives the root
            alone: ``frontier()`` is empty from the start).
        root_token: the last committed token (node 0 of the tree).
        sample_temperature: static trees only; draw children without replacement from
            the draft's distribution at this temperature (> 0) instead of taking the
            top-ranked tokens; ``result()`` then returns those distributions.
        generator: the CPU generator of the Gumbel noise (sampled static drafts).
    """

    def __init__(
        self,
        policy: StaticPolicy | TopKPolicy | NoDraftPolicy,
        root_token: int,
        sample_temperature: float | None = None,
        generator: torch.Generator | None = None,
    ):
        if not isinstance(policy, (StaticPolicy, TopKPolicy, NoDraftPolicy)):
            raise ValueError(
                f"policy must be a StaticPolicy or TopKPolicy, got {type(policy).__name__}"
            )
        if sample_temperature is not None:
            if not isinstance(policy, StaticPolicy):
                raise ValueError(
                    "sample_temperature needs a static tree (chain/paths/medusa), not "
                    f"{policy.spec!r}: pruning a sampled dynamic tree would bias the output"
                )
            if not (sample_temperature > 0 and np.isfinite(sample_temperature)):
                raise ValueError(f"sample_temperature must be > 0, got {sample_temperature!r}")
        self.policy = policy
        self.root_token = int(root_token)
        self.sample_temperature = sample_temperature
        self.generator = generator
        # candidates: parent candidate (-1 root), token, cumulative log-prob, depth
        self._parent: list[int] = []
        self._token: list[int] = []
        self._score: list[float] = []
        self._depth: list[int] = []
        self._level = 0
        self._q_rows: dict[int, torch.Tensor] = {}  # candidate (-1 root) -> draft probs [V]
        self._node: dict[int, int] | None = None
        if isinstance(policy, StaticPolicy):
            tree = policy.tree
            self._first_child = tree.first_child.tolist()
            self._next_sibling = tree.next_sibling.tolist()
            self._cand_static = {ROOT: 0}  # candidate -> node of the static tree
            has_kids = self._first_child[0] != -1
        else:
            has_kids = isinstance(policy, TopKPolicy)
        self._frontier: list[int] = [ROOT] if has_kids else []

    # ------------------------------------------------------------------ queries
    def frontier(self) -> list[int]:
        """Candidates whose draft distribution is needed next, ``[-1]`` (the root)
        first; ``[]`` once the tree is complete."""
        return list(self._frontier)

    def parent(self, cand: int) -> int:
        """Candidate id of ``cand``'s parent; -1 for children of the root."""
        return self._parent[self._check(cand)]

    def token(self, cand: int) -> int:
        """Token id of ``cand`` (the root token for -1)."""
        return self.root_token if cand == ROOT else self._token[self._check(cand)]

    def depth(self, cand: int) -> int:
        """Depth of ``cand``: 1 for children of the root, 0 for the root."""
        return 0 if cand == ROOT else self._depth[self._check(cand)]

    def score(self, cand: int) -> float:
        """Cumulative (ranking) log-probability of ``cand``; 0 for the root."""
        return 0.0 if cand == ROOT else self._score[self._check(cand)]

    @property
    def num_candidates(self) -> int:
        return len(self._token)

    def _check(self, cand: int) -> int:
        if not (isinstance(cand, int) and 0 <= cand < len(self._token)):
            raise ValueError(f"candidate {cand!r} does not exist (have {len(self._token)})")
        return cand

    # ------------------------------------------------------------------ growth
    def absorb(self, logprobs: torch.Tensor) -> None:
        """Take the draft's fp32 log-softmax ``[len(frontier()), V]`` at the frontier
        nodes (frontier order) and grow the next level."""
        nodes = self._frontier
        if not nodes:
            raise ValueError("absorb: the tree is complete (frontier() is empty)")
        if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 2:
            raise ValueError(
                f"logprobs must be a [len(frontier), V] tensor, got "
                f"{getattr(logprobs, 'shape', type(logprobs).__name__)}"
            )
        if logprobs.shape[0] != len(nodes):
            raise ValueError(
                f"logprobs has {logprobs.shape[0]} rows; the frontier has {len(nodes)} nodes"
            )
        logprobs = logprobs.detach().float().cpu()
        self._level += 1
        if isinstance(self.policy, TopKPolicy):
            self._absorb_topk(nodes, logprobs)
        else:
            self._absorb_static(nodes, logprobs)

    def _new(self, parent: int, token: int, score: float) -> int:
        self._parent.append(parent)
        self._token.append(int(token))
        self._score.append(float(score))
        self._depth.append(self._level)
        return len(self._token) - 1

    def _absorb_topk(self, nodes: list[int], logprobs: torch.Tensor) -> None:
        k = self.policy.k
        if k > logprobs.shape[1]:
            raise ValueError(f"top-K k={k} exceeds the draft vocabulary ({logprobs.shape[1]})")
        if self.policy.temp != 1.0:  # ranking temperature: shapes the tree only
            logprobs = torch.log_softmax(logprobs / self.policy.temp, dim=-1)
        top_lp, top_tok = logprobs.topk(k, dim=-1)
        new = []
        for n, lps, toks in zip(nodes, top_lp.tolist(), top_tok.tolist()):
            base = self.score(n)
            new.extend(self._new(n, t, base + lp) for lp, t in zip(lps, toks))
        self._frontier = []
        if self._level < self.policy.depth:
            best = sorted(new, key=lambda c: (-self._score[c], c))[:k]
            self._frontier = sorted(best)

    def _absorb_static(self, nodes: list[int], logprobs: torch.Tensor) -> None:
        fc, ns = self._first_child, self._next_sibling
        kids_per = []
        for n in nodes:
            kids, c = [], fc[self._cand_static[n]]
            while c != -1:
                kids.append(c)
                c = ns[c]
            kids_per.append(kids)
        width = max(1, max(len(k) for k in kids_per))
        if width > logprobs.shape[1]:
            raise ValueError(
                f"static tree node has {width} children; the draft vocabulary has "
                f"{logprobs.shape[1]} tokens"
            )
        if self.sample_temperature is not None:
            # Gumbel top-k: children are a without-replacement sample from q, in draw order
            q_log = torch.log_softmax(logprobs / self.sample_temperature, dim=-1)
            u = torch.rand(q_log.shape, generator=self.generator).clamp_(1e-20, 1.0)
            _, top_tok = (q_log - torch.log(-torch.log(u))).topk(width, dim=-1)
            top_lp = torch.gather(logprobs, -1, top_tok)
            for n, ql in zip(nodes, q_log):
                self._q_rows[n] = ql.exp()
        else:
            top_lp, top_tok = logprobs.topk(width, dim=-1)
        nxt = []
        for n, kids, lps, toks in zip(nodes, kids_per, top_lp.tolist(), top_tok.tolist()):
            base = self.score(n)
            for rank, child in enumerate(kids):
                c = self._new(n, toks[rank], base + lps[rank])
                self._cand_static[c] = child
                if fc[child] != -1:
                    nxt.append(c)
        self._frontier = nxt

    # ------------------------------------------------------------------ result
    def kept(self) -> list[int]:
        """The kept candidates in breadth-first tree order (node 1, 2, ...)."""
        cands = range(len(self._token))
        if isinstance(self.policy, TopKPolicy):
            ranked = sorted(cands, key=lambda c: (-self._score[c], c))
            keep = ranked[: self.policy.budget]
            return sorted(keep, key=lambda c: (self._depth[c], -self._score[c], c))
        # static: breadth-first in creation order = sibling rank / draw order
        return sorted(cands, key=lambda c: (self._depth[c], c))

    def result(self) -> tuple[TokenTree, list[int], torch.Tensor | None]:
        """The proposed tree so far (complete once ``frontier()`` is empty).

        Returns:
            ``tree`` (breadth-first, node 0 = root), ``tokens`` per node
            (``tokens[0] = root_token``), and for sampled static drafts the draft
            probabilities ``[N, V]`` fp32 at every node that has children (zeros
            elsewhere), else None.
        """
        index = {ROOT: 0}
        parents, tokens = [-1], [self.root_token]
        for c in self.kept():
            index[c] = len(parents)
            parents.append(index[self._parent[c]])
            tokens.append(self._token[c])
        self._node = index
        q = None
        if self.sample_temperature is not None and self._q_rows:
            some = next(iter(self._q_rows.values()))
            q = torch.zeros(len(parents), some.shape[0], dtype=some.dtype)
            for c, row in self._q_rows.items():
                if c in index:
                    q[index[c]] = row
        return tree_of(tuple(parents)), tokens, q

    def node_of(self, cand: int) -> int:
        """After ``result()``: the tree node index of a kept candidate (0 for the root)."""
        if self._node is None:
            raise ValueError("node_of: call result() first")
        if cand not in self._node:
            raise ValueError(f"candidate {cand!r} is not in the proposed tree")
        return self._node[cand]


@lru_cache(maxsize=4096)
def tree_of(parents: tuple[int, ...]) -> TokenTree:
    """One ``TokenTree`` per distinct shape, so its derived tensors are computed once."""
    return TokenTree(parents)


# --------------------------------------------------------------------------- n-gram trie
SEPARATOR = -1  # between the streams of an ``NgramHistory``: matches nothing, ends a path


def ngram_matches(context: Sequence[int], policy: NgramPolicy) -> list[tuple[int, int]]:
    """The n-gram matches of the context's suffix, best first.

    A match is a position ``j < len(context)`` where the ``n`` tokens before ``j``
    equal the context's last ``n`` tokens, for some ``policy.min_n <= n <=
    policy.max_n``; its length is the largest such ``n``. Ranked by match length
    (longest first), then recency (latest ``j`` first); at most ``policy.matches``.
    ``SEPARATOR`` entries match no token.

    Returns:
        ``[(j, n), ...]``: continuation start and match length.
    """
    return _rank_matches(_match_scan(np.asarray(context, dtype=np.int64), policy.max_n), policy)


def _match_scan(arr: np.ndarray, max_n: int) -> tuple[list[int], list[int]]:
    """Every match of the suffix of ``arr`` (``[L]`` int64) of length 1 to ``max_n``:
    continuation starts and match lengths, unranked (``_rank_matches`` filters and ranks
    them per policy; one scan serves every policy of the same ``max_n``)."""
    L = arr.shape[0]
    if L < 2 or max_n < 1:
        return [], []
    # a match ends at e <= L - 2 with arr[e] == the last token; its length is how far
    # arr[..e] and arr[..L-1] agree backwards, capped at max_n (and at e + 1)
    ends = np.nonzero(arr[: L - 1] == arr[L - 1])[0]
    if arr[L - 1] == SEPARATOR or ends.size == 0:
        return [], []
    length = np.ones(ends.shape, dtype=np.int64)
    alive = np.ones(ends.shape, dtype=bool)
    for k in range(1, min(max_n, L - 1)):
        back = ends - k
        alive &= back >= 0
        alive &= arr[np.maximum(back, 0)] == arr[L - 1 - k]
        if not alive.any():
            break
        length += alive
    return (ends + 1).tolist(), length.tolist()


def _rank_matches(scan: tuple[list[int], list[int]], policy: NgramPolicy) -> list[tuple[int, int]]:
    """``ngram_matches`` from a ``_match_scan`` of ``policy.max_n``."""
    kept = [(j, n) for j, n in zip(*scan) if n >= policy.min_n]
    kept.sort(key=lambda jn: (-jn[1], -jn[0]))
    return kept[: policy.matches]


class NgramHistory:
    """Earlier requests' tokens (prompt + output) of one engine, searched by the n-gram
    trie after the request's own context (SuffixDecoding's idea: a server's outputs
    repeat across requests). Bounded: at most ``max_tokens``, the oldest requests
    dropped first. ``policy.history`` sets the bound; 0 keeps nothing.

        >>> h = NgramHistory(8)
        >>> h.add([1, 2, 3]); h.add([4, 5, 6, 7, 8])
        >>> h.tokens()
        [-1, 1, 2, 3, -1, 4, 5, 6, 7, 8]
    """

    def __init__(self, max_tokens: int):
        if max_tokens < 0:
            raise ValueError(f"NgramHistory: max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._streams: list[list[int]] = []
        self._size = 0
        self._flat: list[int] | None = []

    def add(self, tokens: Sequence[int]) -> None:
        """Remember a finished request's tokens (its last ``max_tokens`` at most)."""
        if self.max_tokens == 0 or not tokens:
            return
        stream = [int(t) for t in tokens[-self.max_tokens :]]
        self._streams.append(stream)
        self._size += len(stream)
        while self._size > self.max_tokens:
            self._size -= len(self._streams.pop(0))
        self._flat = None

    def tokens(self) -> list[int]:
        """The remembered streams, oldest first, each after a ``SEPARATOR``."""
        if self._flat is None:
            self._flat = [t for s in self._streams for t in (SEPARATOR, *s)]
        return self._flat

    def __len__(self) -> int:
        return self._size


def ngram_trie(
    context: Sequence[int], policy: NgramPolicy, history: NgramHistory | None = None
) -> tuple[TokenTree, list[int]]:
    """The trie of the continuations of the context suffix's best n-gram matches.

    Args:
        context: the committed tokens (prompt + output); ``context[-1]`` is the root.
        policy: ``NgramPolicy`` (``ngram:budget=N[,min=,max=,matches=,depth=,history=]``).
        history: earlier requests' tokens (``NgramHistory``), searched too: matches in
            them rank as matches of the request's own context do (by length, then
            recency, the own context being the most recent); their continuations end
            at the end of their stream.

    Each of the ``ngram_matches`` contributes its continuation
    ``context[j : j + depth]`` (cut at the end of the context) as a root-to-leaf
    path; equal prefixes merge. Trie nodes are ranked by the longest match through
    them, then the number of chosen continuations through them (more first), then the
    best-ranked (most recent) one, then depth, then insertion order; the best
    ``budget`` are kept. A child never outranks its parent (the matches through it are
    a subset of the parent's, its depth larger), so the kept nodes form a tree.
    Deterministic: the same context and history give the same trie.

    Returns:
        ``tree`` (breadth-first, node 0 = root, at most ``budget`` draft nodes) and
        ``tokens`` per node (``tokens[0] = context[-1]``).
    """
    return ngram_tries(context, [policy], history)[0]


def ngram_tries(
    context: Sequence[int],
    policies: Sequence[NgramPolicy],
    history: NgramHistory | None = None,
) -> list[tuple[TokenTree, list[int]]]:
    """``ngram_trie`` of every policy in ``policies`` for one context, sharing the work:
    one match scan per ``max_n``, and one trie per distinct set of ranked matches (tries
    of several budgets; a long-match trie where the context has enough long matches)
    grown to the deepest such policy's ``depth``, then cut per policy to its depth and
    budget.

    Exact: a node's rank keys (longest match, count, first match, depth) do not depend
    on how deep the other paths grow, and insertion order among the nodes of depth
    ``<= d`` is the same in a trie grown deeper, so the cut equals the trie grown to
    ``d`` (``test_ngram_tries_equal_one_trie_at_a_time``).

    >>> from tree_dev.spec import parse_tree_spec
    >>> pols = [parse_tree_spec("ngram:budget=2"), parse_tree_spec("ngram:budget=8")]
    >>> [toks for _, toks in ngram_tries([5, 6, 7, 5], pols)]
    [[5, 6, 7], [5, 6, 7, 5]]
    """
    for policy in policies:
        if not isinstance(policy, NgramPolicy):
            raise ValueError(f"policy must be an NgramPolicy, got {type(policy).__name__}")
    if len(context) == 0:
        raise ValueError("ngram_trie: empty context (the root token is its last element)")
    ctx = context if isinstance(context, list) else list(context)  # ints out: ``cut``
    if history is not None and len(history):
        ctx = history.tokens() + [SEPARATOR] + ctx
    arr = np.asarray(ctx, dtype=np.int64)
    scans: dict[int, tuple[list[int], list[int]]] = {}
    ranked = []  # per policy, its matches: policies whose matches are equal share a trie
    for policy in policies:
        if policy.max_n not in scans:
            scans[policy.max_n] = _match_scan(arr, policy.max_n)
        ranked.append(tuple(_rank_matches(scans[policy.max_n], policy)))
    depth: dict[tuple[tuple[int, int], ...], int] = {}
    for policy, matches in zip(policies, ranked):
        depth[matches] = max(depth.get(matches, 0), policy.depth)
    grown = {m: _TrieNodes(ctx, m, d) for m, d in depth.items()}
    return [grown[m].cut(p.budget, p.depth) for p, m in zip(policies, ranked)]


class _TrieNodes:
    """The trie of ``matches``' continuations of ``ctx`` up to ``depth`` tokens each,
    its nodes ranked (``ngram_trie``); ``cut`` keeps a budget of them to a depth."""

    def __init__(self, ctx: list[int], matches: Sequence[tuple[int, int]], depth: int):
        # matches with the same continuation (a context that loops) add one path: walk
        # it once, at its first (best-ranked) match, counting every match through it
        paths: dict[tuple[int, ...], list[int]] = {}  # continuation -> [first r, n, matches]
        for r, (j, n) in enumerate(matches):
            cont = tuple(ctx[j : j + depth])
            seen = paths.get(cont)
            if seen is None:
                paths[cont] = [r, n, 1]
            else:
                seen[2] += 1
        nodes: dict[tuple[int, int], int] = {}  # (parent node, token) -> node (1-based)
        parent, token, level = [-1], [ctx[-1]], [0]
        count, longest, rank = [0], [0], [0]
        for cont, (r, n, weight) in paths.items():
            cur = 0
            for t in cont:
                if t == SEPARATOR:
                    break
                nxt = nodes.get((cur, t))
                if nxt is None:
                    nxt = nodes[(cur, t)] = len(token)
                    parent.append(cur)
                    token.append(t)
                    level.append(level[cur] + 1)
                    count.append(0)
                    longest.append(n)
                    rank.append(r)
                count[nxt] += weight
                cur = nxt
        self.parent, self.token, self.level = parent, token, level
        self.ranked = sorted(
            range(1, len(token)), key=lambda i: (-longest[i], -count[i], rank[i], level[i], i)
        )

    def cut(self, budget: int, depth: int) -> tuple[TokenTree, list[int]]:
        """The best ``budget`` nodes of depth at most ``depth``, breadth-first."""
        level = self.level
        ranked = [i for i in self.ranked if level[i] <= depth]
        pos = {i: p for p, i in enumerate(ranked)}
        keep = sorted(ranked[:budget], key=lambda i: (level[i], pos[i]))
        index = {0: 0}
        parents, tokens = [-1], [int(self.token[0])]
        for i in keep:
            index[i] = len(parents)
            parents.append(index[self.parent[i]])
            tokens.append(int(self.token[i]))
        return tree_of(tuple(parents)), tokens


# --------------------------------------------------------------------------- hybrid
class HybridExpansion:
    """The draft's top-K tree and the context's n-gram trie, ranked on one scale.

    The draft grows the top-K tree exactly as ``TreeExpansion`` does (same frontier,
    same draft forwards); the n-gram trie is fixed up front from the context. Both
    are merged (a path found by both is one node) and every node is scored by a
    cumulative log-probability: a top-K candidate by the draft's (at the ranking
    temperature), an n-gram node by its parent's score plus ``log(max(q, p))``,
    where ``q`` is the draft's probability of the node's token at the parent when
    the draft saw the parent (the root always; deeper nodes when the top-K tree
    holds the same path), else unknown (``p`` alone). A node found by both takes the
    larger score. Scores never increase from parent to child, and ties go to the
    shallower node, then creation order (top-K candidates, then new n-gram nodes
    breadth-first), so the best ``budget`` nodes always include their ancestors.

    Same interface as ``TreeExpansion`` (the frontier is the top-K tree's).
    """

    def __init__(self, policy: HybridPolicy, root_token: int, context: Sequence[int]):
        if not isinstance(policy, HybridPolicy):
            raise ValueError(f"policy must be a HybridPolicy, got {type(policy).__name__}")
        if len(context) == 0 or int(context[-1]) != int(root_token):
            raise ValueError("context must end with the root token")
        self.policy = policy
        self.inner = TreeExpansion(policy.topk, root_token)
        tree, tokens = ngram_trie(context, policy.ngram)
        self._ng_parents = tree.parents.tolist()
        self._ng_tokens = tokens
        self._ng_children: dict[int, list[int]] = {}
        for i in range(1, len(tokens)):
            self._ng_children.setdefault(self._ng_parents[i], []).append(i)
        self._ng_of_cand: dict[int, int] = {ROOT: 0}  # inner candidate -> trie node, same path
        self._edge_lp: dict[int, float] = {}  # trie node -> draft log-prob at its parent
        self._node: dict[int, int] | None = None
        self._log_p = float(np.log(policy.p))

    def frontier(self) -> list[int]:
        return self.inner.frontier()

    def parent(self, cand: int) -> int:
        return self.inner.parent(cand)

    def token(self, cand: int) -> int:
        return self.inner.token(cand)

    def depth(self, cand: int) -> int:
        return self.inner.depth(cand)

    def absorb(self, logprobs: torch.Tensor) -> None:
        """As ``TreeExpansion.absorb``; also reads the draft's log-probabilities of the
        n-gram children of frontier nodes that lie on the trie."""
        nodes = self.inner.frontier()
        self.inner.absorb(logprobs)
        lp = logprobs.detach().float().cpu()
        if self.policy.topk.temp != 1.0:
            lp = torch.log_softmax(lp / self.policy.topk.temp, dim=-1)
        for row, cand in enumerate(nodes):
            trie = self._trie_node(cand)
            for child in self._ng_children.get(trie, []) if trie is not None else []:
                self._edge_lp[child] = float(lp[row, self._ng_tokens[child]])

    def _trie_node(self, cand: int) -> int | None:
        if cand in self._ng_of_cand:
            return self._ng_of_cand[cand]
        parent = self._trie_node(self.inner.parent(cand))
        node = None
        if parent is not None:
            tok = self.inner.token(cand)
            node = next(
                (c for c in self._ng_children.get(parent, []) if self._ng_tokens[c] == tok), None
            )
        self._ng_of_cand[cand] = node
        return node

    def result(self) -> tuple[TokenTree, list[int], None]:
        """The merged tree (breadth-first, node 0 = root), tokens per node, None."""
        inner = self.inner
        # unified nodes: 0 = root, then the top-K candidates, then new n-gram nodes
        parent, token, score, depth = [-1], [inner.root_token], [0.0], [0]
        of_cand = {ROOT: 0}
        key: dict[tuple[int, int], int] = {}
        for c in range(inner.num_candidates):
            u = len(token)
            of_cand[c] = u
            parent.append(of_cand[inner.parent(c)])
            token.append(inner.token(c))
            score.append(inner.score(c))
            depth.append(inner.depth(c))
            key[(parent[u], token[u])] = u
        of_trie = {0: 0}
        for i in range(1, len(self._ng_tokens)):
            pu = of_trie[self._ng_parents[i]]
            edge = max(self._edge_lp.get(i, -math.inf), self._log_p)
            s = score[pu] + edge
            u = key.get((pu, self._ng_tokens[i]))
            if u is None:
                u = len(token)
                parent.append(pu)
                token.append(self._ng_tokens[i])
                score.append(s)
                depth.append(depth[pu] + 1)
                key[(pu, token[u])] = u
            else:
                score[u] = max(score[u], s)
            of_trie[i] = u
        ranked = sorted(range(1, len(token)), key=lambda u: (-score[u], depth[u], u))
        keep = sorted(ranked[: self.policy.budget], key=lambda u: (depth[u], -score[u], u))
        index = {0: 0}
        parents, tokens = [-1], [inner.root_token]
        for u in keep:
            index[u] = len(parents)
            parents.append(index[parent[u]])
            tokens.append(token[u])
        self._node = {c: index[u] for c, u in of_cand.items() if u in index}
        return tree_of(tuple(parents)), tokens, None

    def node_of(self, cand: int) -> int:
        """After ``result()``: the tree node of a kept top-K candidate."""
        if self._node is None:
            raise ValueError("node_of: call result() first")
        if cand not in self._node:
            raise ValueError(f"candidate {cand!r} is not in the proposed tree")
        return self._node[cand]


def expansion_for(
    policy: StaticPolicy | TopKPolicy | HybridPolicy | NoDraftPolicy,
    root_token: int,
    context: Sequence[int] | None = None,
    sample_temperature: float | None = None,
    generator: torch.Generator | None = None,
) -> TreeExpansion | HybridExpansion:
    """The expansion ``policy`` needs (``context``, ending in the root: hybrid only)."""
    if isinstance(policy, HybridPolicy):
        if sample_temperature is not None:
            raise ValueError("sample_temperature needs a static tree, not a hybrid one")
        return HybridExpansion(policy, root_token, context if context is not None else [root_token])
    return TreeExpansion(policy, root_token, sample_temperature, generator)
