"""The local engine's drafting: what each request asks of ``tree_dev.step.grow_trees``, the
draft runner as the core's ``DraftForward``, and the draft-cache bookkeeping after it.

Trees that need no draft model come straight from here: plain decoding proposes the root
alone, ``ngram:`` tries come from the context (``tree_dev.proposer.ngram_trie``). Every
other tree grows level by level in the core (catch-up, levels: ``tree_dev.step``); the
engine calls ``draft_requests``, then ``grow_trees`` over ``draft_forward``, then
``mark_drafted``.
"""

from __future__ import annotations

import torch

from tree_dev.model_runner import Runner
from tree_dev.proposer import NgramHistory, expansion_for, ngram_trie
from tree_dev.requests import Request
from tree_dev.spec import HybridPolicy, NgramPolicy, Policy
from tree_dev.step import DraftBatch, DraftRequest, Proposal
from tree_dev.tree import TokenTree

__all__ = ["draft_forward", "draft_requests", "mark_drafted", "undrafted_proposals"]

_ROOT_ONLY = TokenTree.chain(0)  # plain decoding's tree (immutable, its properties cached)


def undrafted_proposals(
    policies: list[Policy], batch: list[Request], history: NgramHistory
) -> list[Proposal]:
    """The proposals of trees the draft model does not grow (``policies[i]`` is request
    ``i``'s): the n-gram trie of the request's context (and of ``history``, finished
    requests' tokens) for an ``NgramPolicy``, the root alone (plain decoding) for any
    other."""
    return [
        Proposal(*ngram_trie(r.prompt + r.output, p, history))
        if isinstance(p, NgramPolicy)
        else Proposal(_ROOT_ONLY, [r.root])
        for p, r in zip(policies, batch)
    ]


def draft_requests(policies: list[Policy], batch: list[Request], eagle: bool) -> list[DraftRequest]:
    """Per request, what the draft catches up on (its committed tokens not in the draft
    cache; an EAGLE head also their target features ``[len, H]``) and how its tree grows
    below the root (``expansion_for`` of ``policies[i]``, request ``i``'s tree). An EAGLE
    head without the root's feature proposes the root alone."""
    reqs = []
    for policy, r in zip(policies, batch):
        can = not eagle or bool(r.pending)  # an EAGLE head needs the root's feature
        expansion = expansion_for(
            policy,
            r.root,
            context=r.prompt + r.output if isinstance(policy, HybridPolicy) else None,
            sample_temperature=r.params.temperature if r.sampled_drafts else None,
            generator=r.generator,
        )
        trunk, feats = (r.pending, r.pending_feats if eagle else None) if can else ([r.root], None)
        reqs.append(DraftRequest(r.req_id, trunk, r.draft_len, expansion, feats, can))
    return reqs


def mark_drafted(batch: list[Request], reqs: list[DraftRequest], eagle: bool) -> None:
    """After ``grow_trees``: what the draft consumed of each request's pending tokens (and
    features) is in its cache now."""
    for r, d in zip(batch, reqs):
        done = d.prefix - r.draft_len
        r.draft_len = d.prefix
        r.pending = r.pending[done:]
        if eagle and r.pending_feats is not None:
            r.pending_feats = r.pending_feats[done:]


def draft_forward(runner: Runner, b: DraftBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``runner`` (the draft's) as ``tree_dev.step.DraftForward``: a catch-up chunk
    (``b.want`` None) fills the cache and returns ``(None, None)``; a level returns
    ``(log-probs float32 [R, V], hidden [R, H])`` at the ``R`` wanted nodes of every
    request, in request order."""
    if b.want is None:  # a catch-up chunk: every node of a chain
        runner.forward(b.keys, b.prefixes, b.trees, None, b.tokens, b.feats, want_logits=False)
        return None, None
    rows, offset = [], 0  # logits only at the wanted rows
    for nodes, w in zip(b.new_nodes, b.want):
        where = {n: k for k, n in enumerate(nodes)}
        rows += [offset + where[n] for n in w]
        offset += len(nodes)
    hidden, logits = runner.forward(
        b.keys, b.prefixes, b.trees, b.new_nodes, b.tokens, b.feats, logit_rows=rows
    )
    return torch.log_softmax(logits.float(), dim=-1), hidden[rows]
