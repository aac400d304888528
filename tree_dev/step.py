"""The tree step, written once for both engines.

A speculative step of one request, whichever engine runs it:

1. **catch-up** (``catch_up``): the draft consumes the committed sequence elements it has
   not seen. Long catch-ups (a new prompt) go first, in chunks; a short one (the last
   step's accepted tokens and the root) rides along as the *trunk* of the first level.
2. **levels** (``grow_trees``): one packed draft forward per level over every request's
   new nodes; the expansion (``tree_dev.proposer``: top-K, static, hybrid) picks the next
   nodes from the draft's log-probabilities and finally the kept tree (``Proposal``).
3. **verify**: the engine's target scores every node of every tree in one forward.
4. **walk** (``walk_trees``): ``kernels.tree_walk`` per sampling mode (``walk_mode``)
   gives each request's accepted path and the tokens it emits.
5. **bookkeeping** (``DepthStats``): per-depth acceptance; ``VerifyTrees`` describes a
   verify forward's trees to other tooling (the accuracy capture).

The engines differ only in how they run a model and move KV, and say so through two
callables: a ``DraftForward`` (the draft over some requests' new tree nodes) and the tree
batch builder of the walk. The local engine (``tree_dev.engine``) and the vLLM plugin's
runner (``tree_dev.vllm_plugin.runner`` with ``drafter``) are adapters around this module.

>>> from tree_dev.step import walk_mode
>>> walk_mode(0.0, sampled_drafts=False), walk_mode(0.8, sampled_drafts=True)
('greedy', 'draft_probs')
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

import kernels
from tree_dev.proposer import HybridExpansion, TreeExpansion, tree_of
from tree_dev.tree import TokenTree, TreeBatch

TRUNK_LIMIT = 32  # catch-ups up to this many elements before the root ride along in level 1
CATCH_UP_CHUNK = 256  # longer ones are consumed in chunks of this many elements first
GREEDY_TEMPERATURE = 1e-5  # vLLM's sampler treats lower temperatures as greedy; so do we
WALK_MODES = ("greedy", "target_only", "draft_probs")


def walk_mode(temperature: float, sampled_drafts: bool) -> str:
    """The walk that verifies a request's tree losslessly: ``"greedy"`` below
    ``GREEDY_TEMPERATURE``; else ``"draft_probs"`` when its children were drawn from the
    draft (``Proposal.draft_probs`` set), ``"target_only"`` for top-ranked children."""
    if temperature < GREEDY_TEMPERATURE:
        return "greedy"
    return "draft_probs" if sampled_drafts else "target_only"


@dataclass
class Proposal:
    """A request's proposed tree: node 0 is the root (the last committed token).

    Attributes:
        tree: the tree's shape (``N`` nodes, breadth-first).
        tokens: ``[N]`` token of every node, the root first.
        draft_probs: ``[N, V]`` fp32 distributions each node's children were drawn from
            (sampled drafts only; rows of leaves unused), else None.
    """

    tree: TokenTree
    tokens: list[int]
    draft_probs: torch.Tensor | None = None


@dataclass
class DepthStats:
    """Per-depth acceptance over tree steps: ``tried[d]`` steps whose tree reached depth
    ``d + 1``, ``accepted[d]`` of those that accepted a token there."""

    steps: int = 0
    emitted: int = 0
    tried: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def record(self, max_depth: int, accepted_drafts: int) -> None:
        """One step of a tree ``max_depth`` deep that accepted ``accepted_drafts`` drafts
        (it emitted those and a bonus token)."""
        self.steps += 1
        self.emitted += accepted_drafts + 1
        while len(self.tried) < max_depth:
            self.tried.append(0)
            self.accepted.append(0)
        for d in range(max_depth):
            self.tried[d] += 1
            self.accepted[d] += int(d < accepted_drafts)

    @property
    def accepted_drafts(self) -> int:
        return self.emitted - self.steps

    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    def acceptance_per_depth(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.accepted, self.tried)]


# --------------------------------------------------------------------------- drafting
@dataclass
class DraftBatch:
    """One packed draft forward's inputs (what the core asks of an engine's draft).

    Attributes:
        keys: per request, what the engine knows it by (a cache id, a batch row).
        prefixes: per request, the draft's cached positions before its tree; tree node
            ``j`` sits at slot ``prefix + j``, RoPE position ``prefix + depth(j)``.
        trees: per request, the tree forwarded so far (trunk chain, then new levels).
        new_nodes: per request, the nodes computed now (ascending); the others' K/V are
            already cached.
        tokens: the token of every new node, packed in request order.
        feats: EAGLE only, ``[T_new, H]`` features paired with the new nodes; else None.
        want: per request, nodes among ``new_nodes`` whose next-token distribution is
            wanted; None wants nothing (a catch-up chunk).
    """

    keys: list
    prefixes: list[int]
    trees: list[TokenTree]
    new_nodes: list[list[int]]
    tokens: list[int]
    feats: torch.Tensor | None
    want: list[list[int]] | None


#: An engine's packed draft forward: ``DraftBatch`` -> fp32 log-probs ``[sum(len(w)), V]``
#: at the wanted nodes and the draft's outputs there ``[sum(len(w)), H]`` (``None, None``
#: when ``want`` is None).
DraftForward = Callable[[DraftBatch], tuple[torch.Tensor | None, torch.Tensor | None]]


@dataclass
class DraftRequest:
    """One request to draft for, as the core sees it.

    Attributes:
        key: the engine's handle, passed to its ``DraftForward``.
        trunk: the draft-sequence elements the draft has not consumed, the root last.
        prefix: the draft's cached positions before the trunk; advanced as the draft
            consumes the trunk (read it back after ``grow_trees``).
        expansion: grows and keeps the tree (``tree_dev.proposer.expansion_for``).
        feats: EAGLE only, ``[len(trunk), H]`` target features paired with the trunk.
        can_draft: False when the draft cannot run for this root yet (an EAGLE head
            without the root's feature): the tree is the expansion's, undrafted.
    """

    key: object
    trunk: list[int]
    prefix: int
    expansion: TreeExpansion | HybridExpansion
    feats: torch.Tensor | None = None
    can_draft: bool = True
    # the forwarded tree (trunk chain, then expanded nodes), filled by grow_trees
    _parents: list[int] = field(default_factory=list)
    _tokens: list[int] = field(default_factory=list)
    _feats: list[torch.Tensor] = field(default_factory=list)
    _outs: dict[int, torch.Tensor] = field(default_factory=dict)
    _fwd: dict[int, int] = field(default_factory=dict)  # candidate -> forwarded node
    _new: list[int] = field(default_factory=list)


def catch_up(
    reqs: Sequence[DraftRequest],
    forward: DraftForward,
    limit: int = TRUNK_LIMIT,
    chunk: int = CATCH_UP_CHUNK,
) -> int:
    """Consume every trunk longer than ``limit`` elements before its root, all but the
    root, in chunks of ``chunk`` (one packed forward per round, no logits). Returns the
    number of forwards."""
    todo = [r for r in reqs if r.can_draft and len(r.trunk) - 1 > limit]
    rounds = 0
    while todo:
        sizes = [min(chunk, len(r.trunk) - 1) for r in todo]
        feats = None
        if todo[0].feats is not None:
            feats = torch.cat([r.feats[:n] for r, n in zip(todo, sizes)])
        forward(
            DraftBatch(
                [r.key for r in todo],
                [r.prefix for r in todo],
                [tree_of((-1, *range(n - 1))) for n in sizes],
                [list(range(n)) for n in sizes],
                [t for r, n in zip(todo, sizes) for t in r.trunk[:n]],
                feats,
                None,
            )
        )
        rounds += 1
        for r, n in zip(todo, sizes):
            r.prefix += n
            r.trunk = r.trunk[n:]
            if r.feats is not None:
                r.feats = r.feats[n:]
        todo = [r for r in todo if len(r.trunk) > 1]
    return rounds


def grow_trees(reqs: Sequence[DraftRequest], forward: DraftForward) -> list[Proposal]:
    """Every request's draft tree, level by level, one packed ``forward`` per level.

    The first level forwards each request's trunk (``catch_up`` first for long ones); an
    EAGLE node's feature is its trunk feature, or its parent's draft output. Afterwards
    ``req.prefix`` counts the trunk as consumed (its K/V stays in the draft cache); the
    expanded nodes' K/V is scratch the next step overwrites.

    Returns:
        one ``Proposal`` per request (the expansion's kept tree, breadth-first).
    """
    catch_up(reqs, forward)
    for r in reqs:
        n = len(r.trunk)
        r._parents = list(range(-1, n - 1))
        r._tokens = list(r.trunk)
        r._feats = list(r.feats) if r.feats is not None else []
        r._outs, r._fwd = {}, {-1: n - 1}
        r._new = list(range(n)) if r.can_draft and r.expansion.frontier() else []
    active = [r for r in reqs if r._new]
    while active:
        want = [[r._fwd[c] for c in r.expansion.frontier()] for r in active]
        feats = None
        if active[0].feats is not None:
            feats = torch.stack([r._feats[n] for r in active for n in r._new])
        logprobs, outs = forward(
            DraftBatch(
                [r.key for r in active],
                [r.prefix for r in active],
                [tree_of(tuple(r._parents)) for r in active],
                [r._new for r in active],
                [r._tokens[n] for r in active for n in r._new],
                feats,
                want,
            )
        )
        if len(active) == 1:  # a split costs more than the rest of the level's Python
            parts = zip(active, want, (logprobs,), (outs,))
        else:
            sizes = [len(w) for w in want]
            parts = zip(active, want, logprobs.split(sizes), outs.split(sizes))
        for r, w, lp, out in parts:
            _absorb(r, w, lp, out)
        active = [r for r in active if r._new]
    for r in reqs:
        if r.can_draft and r._outs:  # the trunk was forwarded: it is in the draft cache
            r.prefix += len(r.trunk)
    return [Proposal(*r.expansion.result()) for r in reqs]


def _absorb(r: DraftRequest, want: list[int], logprobs: torch.Tensor, outs: torch.Tensor):
    """Hand one level's draft output to the expansion; queue the next level's nodes."""
    ex = r.expansion
    ex.absorb(logprobs)
    for node, o in zip(want, outs):
        r._outs[node] = o
    r._new = []
    for c in ex.frontier():
        parent = r._fwd[ex.parent(c)]
        r._parents.append(parent)
        r._tokens.append(ex.token(c))
        if r.feats is not None:
            r._feats.append(r._outs[parent])
        r._fwd[c] = len(r._parents) - 1
        r._new.append(len(r._parents) - 1)


# --------------------------------------------------------------------------- verify
@dataclass(frozen=True)
class VerifyTrees:
    """The trees of one verify forward, in request order: the documented interface other
    tooling reads (the accuracy capture stores it with each captured pass).

    Attributes:
        req_ids: the requests verifying a tree.
        parents: per request, its tree's parents (``-1``: the root), as verified (a tree
            the scheduler cut is its breadth-first prefix).
        tokens: per request, the token of every node, the root first.
        prefix_lens: per request, committed tokens before the root (the root's position).
    """

    req_ids: list
    parents: list[list[int]]
    tokens: list[list[int]]
    prefix_lens: list[int]

    def as_dict(self) -> dict[str, list]:
        return {
            "req_ids": list(self.req_ids),
            "parents": [list(p) for p in self.parents],
            "tokens": [list(t) for t in self.tokens],
            "prefix_lens": list(self.prefix_lens),
        }


# --------------------------------------------------------------------------- walk
@dataclass
class WalkResult:
    """Per request: the accepted node ids (root first) and the tokens the step emits
    (the accepted drafts and the bonus token, ``len(accepted)`` of them)."""

    accepted: list[list[int]]
    emitted: list[list[int]]
    walks: dict[str, int]  # requests walked per mode


def walk_trees(
    logits: Sequence[torch.Tensor],
    proposals: Sequence[Proposal],
    modes: Sequence[str],
    temperatures: Sequence[float],
    top_ps: Sequence[float] | None,
    generators: Sequence[torch.Generator | None],
    tree_batch: Callable[[tuple[TokenTree, ...]], TreeBatch],
    backend: str = "auto",
) -> WalkResult:
    """Walk every request's tree with ``kernels.tree_walk``, one call per mode.

    Args:
        logits: per request, the target's ``[N_i, V]`` logits at its tree's nodes.
        proposals: per request, the verified tree and its tokens (``draft_probs`` for the
            ``"draft_probs"`` walk).
        modes: per request, ``walk_mode(...)``.
        temperatures, top_ps: per request (top_ps None: no nucleus anywhere).
        generators: per request, the CPU generator of its uniforms ``[N_i, 2]`` (None:
            torch's global one), drawn only for sampled walks.
        tree_batch: the engine's (cached) ``TreeBatch`` builder on the logits' device.
        backend: ``kernels`` backend.

    Returns:
        a ``WalkResult``.
    """
    n_req = len(proposals)
    accepted: list[list[int]] = [[] for _ in range(n_req)]
    emitted: list[list[int]] = [[] for _ in range(n_req)]
    walks: dict[str, int] = {}
    dev = logits[0].device if n_req else torch.device("cpu")
    for mode in WALK_MODES:
        idx = [i for i in range(n_req) if modes[i] == mode]
        if not idx:
            continue
        walks[mode] = len(idx)
        lg = torch.cat([logits[i] for i in idx]).float()
        kw = {}
        if mode != "greedy":
            kw = _sampling_inputs(idx, temperatures, top_ps)
            kw["uniforms"] = torch.cat(
                [torch.rand(proposals[i].tree.num_nodes, 2, generator=generators[i]) for i in idx]
            ).to(dev)
        if mode == "draft_probs":
            kw["draft_probs"] = _draft_probs(idx, proposals, lg.shape[1]).to(dev)
        res = kernels.tree_walk(
            lg,
            torch.tensor([t for i in idx for t in proposals[i].tokens], device=dev),
            tree_batch(tuple(proposals[i].tree for i in idx)),
            mode,
            backend=backend,
            check_inputs=False,  # built by the engines: distinct siblings, valid shapes
            **kw,
        )
        lens = res.accepted_len.tolist()
        nodes = res.accepted_nodes.tolist()
        toks = res.output_tokens.tolist()
        for k, i in enumerate(idx):
            accepted[i] = nodes[k][: lens[k]]
            emitted[i] = toks[k][: lens[k]]
    return WalkResult(accepted, emitted, walks)


def _sampling_inputs(idx, temperatures, top_ps) -> dict:
    """The sampled walks' temperature and top-p (a float when no request cuts a nucleus:
    the walk then skips its sort)."""
    top_p: float | torch.Tensor = 1.0
    if top_ps is not None and not all(top_ps[i] >= 1 for i in idx):
        top_p = torch.tensor([float(top_ps[i]) for i in idx])
    return {"temperature": torch.tensor([float(temperatures[i]) for i in idx]), "top_p": top_p}


def _draft_probs(idx, proposals, vocab: int) -> torch.Tensor:
    rows = []
    for i in idx:
        q = proposals[i].draft_probs
        if q is None:  # a root-only tree: no children, its row is unused
            q = torch.zeros(proposals[i].tree.num_nodes, vocab)
        elif q.shape[1] != vocab:
            raise RuntimeError(
                f"the draft's vocabulary ({q.shape[1]}) is not the target's ({vocab}); "
                "sampled drafts need one"
            )
        rows.append(q)
    return torch.cat(rows)


@dataclass
class RequestStep:
    """One request in one verify step (``StepEvent``): the tree the target scored and the
    path the walk accepted."""

    req_id: int | str  # the local engine's int id; vLLM's request id
    prefix_len: int  # committed tokens cached before the root; the root's position
    context: list[int]  # committed tokens, root last (len prefix_len + 1)
    parents: list[int]  # [N] node parents (-1: the root)
    tokens: list[int]  # [N] node tokens
    max_depth: int  # the tree's depth (0: the root alone)
    accepted: list[int] = field(default_factory=list)  # accepted node ids, root first
    emitted: list[int] = field(default_factory=list)  # the walk's tokens: drafts + bonus
    mode: str = "greedy"  # the walk (``walk_mode``)


@dataclass
class StepEvent:
    """What one verify step did, for subscribers (``Engine.on_step`` in the local engine,
    ``TreeRunner.on_step`` in the vLLM plugin): every tree request's tree and accepted
    path, and the step's seconds by phase."""

    requests: list[RequestStep]
    timings: dict[str, float]
