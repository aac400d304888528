"""The local engine's acceptance: after the target's verify forward, which nodes of each
request's tree are accepted and what the step emits, the accepted nodes' K/V moved into
place, and each request's caches' bookkeeping moved past them.

``accepted_paths`` walks the trees (``tree_dev.step.walk_trees``), or, where every tree is
its root alone (a plain decode step), draws each next token directly (``sample_roots``:
no walk, no compaction). ``compact_accepted`` runs ``kernels.kv_compact`` only when an
accepted path is not already in place. The commit of the emitted tokens and the stop
rules are ``Request.commit``'s (``tree_dev.requests``).
"""

from __future__ import annotations

from functools import lru_cache

import torch

import kernels
from kernels.reference import target_probs
from kernels.torchops.tree_walk import sample_inverse_cdf
from tree_dev.kv_cache import PagedKVCache
from tree_dev.model_runner import _tree_batch
from tree_dev.requests import Request
from tree_dev.step import Proposal, walk_trees

__all__ = [
    "accepted_features",
    "accepted_paths",
    "advance",
    "check_finite_logits",
    "compact_accepted",
    "sample_roots",
]

# the walk's tree batches (the verify forward caches its own: model_runner._batch_of)
_walk_batch = lru_cache(maxsize=1024)(_tree_batch)


def check_finite_logits(batch: list[Request], logits: torch.Tensor, sizes: list[int]) -> None:
    """RuntimeError naming the requests whose verify logits (``[sum(sizes), V]``, ``sizes[i]``
    rows per request) hold an inf or NaN: the walk would pick garbage."""
    # the one walk check the engine can't rule out; a finite sum means every logit is
    # finite (an inf or NaN makes it inf or NaN), the full check only when it is not
    if not bool(torch.isfinite(logits.sum())) and not bool(torch.isfinite(logits).all()):
        bad = [r.req_id for r, x in zip(batch, logits.split(sizes)) if not x.isfinite().all()]
        raise RuntimeError(f"target produced non-finite logits for requests {bad}")


def accepted_paths(
    batch: list[Request],
    proposals: list[Proposal],
    logits: torch.Tensor,
    backend: str,
) -> tuple[list[list[int]], list[list[int]]]:
    """Per request, the accepted node ids (root first) and the emitted tokens (accepted
    drafts + bonus token).

    Args:
        batch, proposals: the verified requests and their trees, in the same order.
        logits: ``[sum N_i, V]``, the target's logits at every node, packed per request.
        backend: ``kernels`` backend of the walk.

    Where every tree is its root alone, ``([0], [next token])`` per request from
    ``sample_roots``; else ``tree_dev.step.walk_trees`` in each request's walk mode.
    """
    sizes = [p.tree.num_nodes for p in proposals]
    if all(n == 1 for n in sizes):  # a plain decode step: nothing to walk
        return [[0] for _ in batch], [[t] for t in sample_roots(batch, logits).tolist()]
    dev = logits.device
    res = walk_trees(
        logits.split(sizes),
        proposals,
        [r.mode for r in batch],
        [r.params.temperature for r in batch],
        [r.params.top_p for r in batch],
        [r.generator for r in batch],
        lambda trees: _walk_batch(trees, dev),
        backend,
    )
    return res.accepted, res.emitted


def sample_roots(batch: list[Request], logits: torch.Tensor) -> torch.Tensor:
    """The next token of every request, ``int64 [B]`` on the CPU, from its root's logits
    ``[B, V]``: the argmax, or a draw by the walk's own rule (``uniforms [1, 2]`` per
    request from its generator, inverse CDF of the tempered top-p target distribution at
    ``u[0, 1]``), so a root-only tree emits exactly what ``tree_walk`` would."""
    out = torch.empty(len(batch), dtype=torch.int64)
    greedy = [i for i, r in enumerate(batch) if r.mode == "greedy"]
    if greedy:
        out[greedy] = logits[greedy].argmax(-1).cpu()
    rest = [i for i in range(len(batch)) if batch[i].mode != "greedy"]
    if rest:
        u = torch.cat([torch.rand(1, 2, generator=batch[i].generator) for i in rest])
        p = target_probs(
            logits[rest].float().cpu(),
            torch.arange(len(rest)),
            torch.tensor([batch[i].params.temperature for i in rest]),
            1.0
            if all(batch[i].params.top_p >= 1 for i in rest)
            else torch.tensor([batch[i].params.top_p for i in rest]),
        )
        out[rest] = sample_inverse_cdf(p, u[:, 1])
    return out


def compact_accepted(
    cache: PagedKVCache, batch: list[Request], accepted: list[list[int]], backend: str
) -> None:
    """Move every accepted path's K/V to slots ``target_len + j`` of ``cache``
    (``kernels.kv_compact``; node ``n`` of request ``r`` sits at ``r.target_len + n``);
    nothing to move when every path is nodes ``0..n-1`` (a chain's accepted prefix)."""
    if all(nodes == list(range(len(nodes))) for nodes in accepted):
        return
    dev = cache.k.device
    width = max(len(nodes) for nodes in accepted)
    acc_nodes = torch.zeros(len(batch), width, dtype=torch.int64)
    for i, nodes in enumerate(accepted):
        acc_nodes[i, : len(nodes)] = torch.tensor(nodes, dtype=torch.int64)
    kernels.kv_compact(
        cache.k,
        cache.v,
        torch.tensor([r.target_len for r in batch], device=dev),
        acc_nodes.to(dev),
        torch.tensor([len(nodes) for nodes in accepted], device=dev),
        cache.block_table([r.req_id for r in batch]),
        backend=backend,
        check_inputs=False,
    )


def accepted_features(
    hidden: torch.Tensor, sizes: list[int], accepted: list[list[int]]
) -> list[torch.Tensor]:
    """EAGLE: per request, the target's features ``[len(accepted[i]), H]`` at its accepted
    nodes, from the verify's ``hidden [sum(sizes), H]`` (``sizes[i]`` rows per request)."""
    if all(n == 1 for n in sizes):  # root-only trees: one row each, a view
        return [hidden[i : i + 1] for i in range(len(sizes))]
    return [
        rows[torch.tensor(nodes, device=hidden.device)]
        for rows, nodes in zip(hidden.split(sizes), accepted)
    ]


def advance(
    req: Request,
    max_depth: int,
    accepted: int,
    emitted: list[int],
    drafted: bool,
    feats: torch.Tensor | None = None,
) -> None:
    """Move ``req`` past one verify step of a tree ``max_depth`` deep: ``accepted`` nodes
    (root first) now in the target cache, their ``emitted`` tokens pending for the draft
    (``drafted``: the engine runs one) and, for an EAGLE head, their target features
    ``feats [accepted, H]``."""
    req.depth.record(max_depth, accepted - 1)
    req.target_len += accepted
    if drafted:
        req.pending = req.pending + emitted
        if feats is not None:
            old = req.pending_feats
            req.pending_feats = feats if old is None or not len(old) else torch.cat([old, feats])
