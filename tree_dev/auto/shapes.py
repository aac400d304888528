"""Candidate trees and their sizes: temperature classes, a policy's ``Shape`` (verify rows,
draft levels, draft rows), its depth, and the ``Candidate`` list ``choose`` picks from."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from tree_dev.proposer import ngram_tries
from tree_dev.spec import (
    AutoTreePolicy,
    HybridPolicy,
    NgramPolicy,
    NoDraftPolicy,
    Policy,
    StaticPolicy,
    TopKPolicy,
    draft_slots,
    parse_candidate,
)
from tree_dev.step import CATCH_UP_CHUNK, GREEDY_TEMPERATURE, TRUNK_LIMIT
from tree_dev.tree import TokenTree

CLASSES = ("greedy", "sampled")  # temperature classes: below GREEDY_TEMPERATURE, or not


def temperature_class(temperature: float) -> str:
    """``"greedy"`` below ``step.GREEDY_TEMPERATURE`` (the greedy walk), else ``"sampled"``."""
    return "greedy" if temperature < GREEDY_TEMPERATURE else "sampled"


class Shape(NamedTuple):
    """A step's (or one request's part of a step's) size, the cost model's inputs.

    ``verify_rows``: tree nodes the target scores (root included); ``draft_levels``:
    packed draft forwards (one per tree level grown); ``draft_rows``: nodes the draft
    forwards over all levels (the root included, when it drafts at all); ``branched``:
    trees verified with a branch (0 or 1 for one request; a batch adds them up). Inside
    vLLM a branched tree costs tree attention in every layer (on SmolLM2 here about 8 ms
    a tree at 4 concurrent, a fifth of a step), while a chain's rows are vLLM's own
    causal kernel's; the local engine's cost fits find no such term. ``drafted``: 1 when
    the step verifies any draft (a batch takes the largest): inside vLLM a step where
    every request gets ``none`` stays on vLLM's plain path, and the first tree of a step
    moves the whole batch to the speculative one (its rejection sampler, spec metadata,
    a second propose pass): a fixed cost no row count carries (on the toy model at batch
    8, one lone tree added 2.8 ms to a 5.9 ms plain step, most of it this).
    ``requests``: the requests in the step (1 for one request's part; a batch adds them
    up): what a request costs whatever its tree (its sampling, its inputs, the engine's
    work per request) is not a verify row's cost, and a fit that has no column for it
    prices a tree's rows at what a request costs (the root rows are one per request).
    """

    verify_rows: int
    draft_levels: int
    draft_rows: int
    branched: int = 0
    drafted: int = 0
    requests: int = 1


def policy_shape(policy: Policy) -> Shape:
    """One request's verify rows, draft levels and draft rows under ``policy``.

    - ``none``: ``(1, 0, 0, 0, 0)``; ``ngram``: ``(budget + 1, 0, 0, 1)`` (no draft model;
      a trie may branch: one built for a step is priced as built, ``trie_shape``).
    - static (``chain:K``, ``paths``, ``medusa``): ``(N, D, 1 + F, B)``: ``N`` nodes,
      ``D`` the tree's depth (``TreeExpansion`` forwards one level per depth holding a
      node with children), ``F`` the non-root nodes with children (``spec.draft_slots``:
      a leaf is never forwarded), ``B`` 0 for a chain, else 1.
    - ``topk:k,depth,budget``: ``(1 + min(budget, k + (depth-1)*k*k), depth,
      1 + k*(depth-1), 1)``: level 1 forwards the root and makes ``k`` candidates, each
      later level forwards the ``k`` best and makes ``k*k``; the last level's are not
      forwarded (``k=1``: a chain, ``B`` 0).
    - ``hybrid``: verify ``1 + min(budget, topk candidates + ngram budget)``; draft levels
      and rows its top-K part's (the trie costs the draft nothing); branched.
    - every policy but ``none``: ``drafted`` 1.

    When the draft runs, ``draft_rows - 1`` is ``spec.draft_slots`` (the root's KV slot is
    the trunk's).
    The trunk (last step's accepted tokens, forwarded with the root at level 1) and the
    catch-up after a request drafted nothing for a while are not counted here.

    >>> from tree_dev.spec import parse_tree_spec
    >>> policy_shape(parse_tree_spec("topk:k=4,depth=6,budget=32"))
    Shape(verify_rows=33, draft_levels=6, draft_rows=21, branched=1, drafted=1, requests=1)
    """
    if isinstance(policy, NoDraftPolicy):
        return Shape(1, 0, 0)
    if isinstance(policy, NgramPolicy):
        return Shape(policy.budget + 1, 0, 0, int(policy.budget > 1), 1)
    if isinstance(policy, StaticPolicy):
        tree = policy.tree
        slots = 1 + draft_slots(policy)
        return Shape(tree.num_nodes, tree.max_depth, slots, is_branched(tree), 1)
    if isinstance(policy, TopKPolicy):
        k, depth = policy.k, policy.depth
        made = k + (depth - 1) * k * k
        return Shape(1 + min(policy.budget, made), depth, 1 + draft_slots(policy), int(k > 1), 1)
    if isinstance(policy, HybridPolicy):
        top = policy_shape(policy.topk)
        nodes = min(policy.budget, top.verify_rows - 1 + policy.ngram.budget)
        return Shape(1 + nodes, top.draft_levels, top.draft_rows, 1, 1)
    raise TypeError(f"not a tree policy: {policy!r}")


def is_branched(tree: TokenTree | Sequence[int]) -> int:
    """1 when ``tree`` (or its ``parents`` list) has a node with two children, else 0 (a
    chain, or the root alone).

    >>> is_branched([-1, 0, 1]), is_branched([-1, 0, 0])
    (0, 1)
    """
    if isinstance(tree, TokenTree):  # a chain is as deep as it has nodes besides the root
        return int(tree.max_depth != tree.num_nodes - 1)
    return int(any(p != i - 1 for i, p in enumerate(tree)))


def with_catch_up(shape: Shape, behind: int) -> Shape:
    """``shape`` of a model-drafted tree for a request whose draft has not consumed
    ``behind`` committed tokens besides the root (``step.grow_trees``' trunk: the last
    step's accepted drafts, or every token since the request last drafted, its prompt on
    its first tree). They ride along in the first level as draft rows; more than
    ``step.TRUNK_LIMIT`` go first in chunks of ``step.CATCH_UP_CHUNK``, a packed forward
    (a draft level) each. Undrafted shapes (``none``, a trie) are returned as they are.

    >>> with_catch_up(Shape(5, 4, 4, 0, 1), 3)
    Shape(verify_rows=5, draft_levels=4, draft_rows=7, branched=0, drafted=1, requests=1)
    >>> with_catch_up(Shape(5, 4, 4, 0, 1), 300)  # 2 chunks of catch-up first
    Shape(verify_rows=5, draft_levels=6, draft_rows=304, branched=0, drafted=1, requests=1)
    >>> with_catch_up(Shape(9, 0, 0, 1, 1), 300)
    Shape(verify_rows=9, draft_levels=0, draft_rows=0, branched=1, drafted=1, requests=1)
    """
    if shape.draft_levels == 0 or behind <= 0:
        return shape
    chunks = -(-behind // CATCH_UP_CHUNK) if behind > TRUNK_LIMIT else 0
    return shape._replace(
        draft_levels=shape.draft_levels + chunks, draft_rows=shape.draft_rows + behind
    )


def tree_depth(policy: Policy) -> int:
    """The deepest a ``policy`` tree can reach (accepted drafts per step, at most).

    ``none`` 0; static: the tree's depth; ``topk`` / ``ngram``: ``min(depth, budget)``;
    ``hybrid``: ``min(budget, max(top-K depth, n-gram depth))``.
    """
    if isinstance(policy, NoDraftPolicy):
        return 0
    if isinstance(policy, StaticPolicy):
        return policy.tree.max_depth
    if isinstance(policy, (TopKPolicy, NgramPolicy)):
        return min(policy.depth, policy.budget)
    if isinstance(policy, HybridPolicy):
        return min(policy.budget, max(policy.topk.depth, policy.ngram.depth))
    raise TypeError(f"not a tree policy: {policy!r}")


@dataclass(frozen=True)
class Candidate:
    """A tree the chooser may give a request: a policy, and whether a sampled request's
    children are drawn from the draft (``sampled_drafts``; static trees with a model draft
    only; greedy requests never get such a candidate: their drafts are top-ranked anyway).
    """

    policy: Policy
    sampled_drafts: bool = False

    @cached_property
    def name(self) -> str:
        """The key of its statistics: the spec, ``+sampled`` for sampled drafts."""
        return self.policy.spec + ("+sampled" if self.sampled_drafts else "")

    @cached_property
    def shape(self) -> Shape:
        return policy_shape(self.policy)

    @cached_property
    def depth(self) -> int:
        return tree_depth(self.policy)


class Trie(NamedTuple):
    """An n-gram trie built for a step: its ``tree`` and ``tokens`` per node (the root's
    first), as ``proposer.ngram_trie`` returns them."""

    tree: TokenTree
    tokens: list[int]

    @property
    def shape(self) -> Shape:
        """The step shape of running it: its own nodes, branched or not, no draft model."""
        return Shape(self.tree.num_nodes, 0, 0, is_branched(self.tree), 1)


def step_tries(context: Sequence[int], candidates: Iterable[Candidate]) -> dict[str, Trie | None]:
    """The n-gram trie candidates' (those without ``history=``) tries of this step: name ->
    the ``Trie`` ``proposer.ngram_trie`` builds from ``context``, or None where it finds
    no match (the trie is its root alone; ``proposer.ngram_tries`` builds them all with
    one scan of the context). ``AutoPolicy.choose`` prices a
    trie at the nodes it has (a budget-8 trie that matched 2 tokens verifies 3 rows, not
    9) and reads its acceptance to the depth it reaches; None is ``unavailable``.

    >>> cands = make_candidates(["ngram:budget=8"])
    >>> step_tries([5, 6, 7, 8], cands)
    {'ngram:budget=8': None}
    >>> t = step_tries([5, 6, 7, 5], cands)["ngram:budget=8"]
    >>> t.tree.num_nodes, t.tree.max_depth, t.tokens  # 6, 7, 5 followed the earlier 5
    (4, 3, [5, 6, 7, 5])
    """
    ngram = [c for c in candidates if isinstance(c.policy, NgramPolicy) and not c.policy.history]
    if not ngram:
        return {}
    built = ngram_tries(context, [c.policy for c in ngram])  # one scan, shared tries
    return {c.name: Trie(*t) if t[0].num_nodes > 1 else None for c, t in zip(ngram, built)}


def trie_walk(trie: Trie, continuation: Sequence[int]) -> int | None:
    """How many of ``trie``'s draft tokens the tokens that followed its root
    (``continuation``) accept: the longest root-to-node path they spell. None while the
    path could still go deeper (the continuation is used up at a node with children).

    >>> t = step_tries([5, 6, 7, 5], make_candidates(["ngram:budget=8"]))["ngram:budget=8"]
    >>> trie_walk(t, [6, 7, 9]), trie_walk(t, [8]), trie_walk(t, [6]), trie_walk(t, [6, 7, 5])
    (2, 0, None, 3)
    """
    parents = trie.tree.parents.tolist()
    node, depth = 0, 0
    for tok in continuation:
        kids = [i for i in range(node + 1, len(parents)) if parents[i] == node]
        if not kids:
            return depth
        nxt = next((i for i in kids if trie.tokens[i] == tok), None)
        if nxt is None:
            return depth
        node, depth = nxt, depth + 1
    has_kids = any(parents[i] == node for i in range(node + 1, len(parents)))
    return None if has_kids else depth


def make_candidates(
    specs: Iterable[str | Policy | tuple[Policy, bool] | Candidate] | AutoTreePolicy,
) -> list[Candidate]:
    """Candidates from specs (``"chain:4"``, ``"chain:4+sampled"``: ``spec.parse_candidate``),
    policies, ``(policy, sampled_drafts)`` pairs, candidates, or an ``auto`` policy's
    candidates; ``none`` added when missing; cheapest shape first (ties by name), duplicates
    dropped. This order is ``choose``'s tie-break: equal gains go to the cheaper one."""
    if isinstance(specs, AutoTreePolicy):
        specs = specs.candidates
    out: dict[str, Candidate] = {}
    for s in [*specs, "none"]:
        if isinstance(s, str):
            s = Candidate(*parse_candidate(s))
        elif isinstance(s, tuple):
            s = Candidate(*s)
        elif not isinstance(s, Candidate):
            s = Candidate(s)
        if isinstance(s.policy, AutoTreePolicy):
            raise ValueError(f"candidate {s.policy.spec!r}: auto cannot be its own candidate")
        if s.sampled_drafts and not isinstance(s.policy, StaticPolicy):
            raise ValueError(f"sampled drafts need a static tree, not {s.policy.spec!r}")
        out.setdefault(s.name, s)
    return sorted(out.values(), key=lambda c: (*c.shape, c.name))
