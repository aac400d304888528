"""The local tree speculative-decoding engine: an adapter of ``tree_dev.step``.

A token's life, top to bottom of this file:

1. ``Engine.add_request`` queues a prompt with its ``SamplingParams``.
2. ``Engine.step`` admits queued requests (up to ``max_batch``): the target
   *prefills* the prompt minus its last token into its paged KV cache; the last
   prompt token becomes the request's **root** (committed, not yet processed).
3. The **draft** (a small causal LM, or an EAGLE head over the target's
   features) catches up on the committed tokens it has not seen, then
   **proposes** a token tree below the root: a static tree (``chain:K``,
   ``paths:[...]``, ``medusa:NAME``: the draft's top-ranked tokens at each node)
   or the dynamic top-K tree (``topk:k=,depth=,budget=``: expand the k best nodes
   by cumulative log-probability per level, keep the best ``budget``), or the
   top-K tree merged with the context's n-gram trie (``hybrid:``). Each level is
   one packed draft forward that reuses the draft's KV of earlier levels; the
   catch-up, the levels and the walk are ``tree_dev.step``'s (the tree-growing rules
   ``tree_dev.proposer``'s), shared with the vLLM plugin: this engine is an adapter.
   ``ngram:`` tries (matches of the context's suffix in prompt + output) need no
   draft model; ``none`` proposes the root alone.
4. The **target verifies** every node of every request's tree in one packed
   forward: tree attention (``kernels.tree_attention``) through the
   ``"treespec"`` ``AttentionInterface`` implementation; with the torch backend on
   the CPU, trees of up to ``ROW_PATH_TREE_NODES`` nodes instead take one masked
   SDPA call per request and layer (faster there). Stock HF Llama models run
   through ``tree_dev.lean_forward`` (their own modules, without HF's per-call
   machinery; HF's forward whenever a hook is present).
5. ``kernels.tree_walk`` picks each request's accepted path and a bonus token
   (greedy, or lossless sampling: ``target_only`` for deterministic drafts,
   ``draft_probs`` for sampled drafts), ``kernels.kv_compact`` keeps exactly the
   accepted path's K/V, and the bonus token is the next root.
6. Finished requests leave the batch and their KV blocks are freed.

A step whose every tree is the root alone is a plain decode: one SDPA call per
request and layer over a view of its cache, the next token drawn directly (no
tree attention plan, no walk, no compaction); compaction also runs only when an
accepted path is not already in place.

This file holds the ``Engine`` and its step's order; the parts live next to it: set-up
(models, checks, runners, linear routes) in ``tree_dev.engine_setup``, the drafting glue
in ``tree_dev.drafting``, the walk, compaction and root-only fast path in
``tree_dev.acceptance``, the commit and stop rules in ``tree_dev.requests.Request``, the
forwards over paged KV in ``tree_dev.model_runner``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel

from tree_dev.acceptance import (
    accepted_features,
    accepted_paths,
    advance,
    check_finite_logits,
    compact_accepted,
)
from tree_dev.auto import CostModel, check_objective
from tree_dev.drafting import draft_forward, draft_requests, mark_drafted, undrafted_proposals
from tree_dev.engine_auto import LocalAuto, is_undrafted
from tree_dev.engine_setup import (
    cache_blocks,
    check_kernel_limit,
    draft_runner,
    drafter_models,
    eos_token_ids,
    load_models,
    switch_linears,
    target_runner,
)
from tree_dev.model_runner import Runner, load_causal_lm
from tree_dev.proposer import NgramHistory
from tree_dev.requests import (
    Request,
    RequestStep,
    SamplingParams,
    StepEvent,
    StepOutput,
)
from tree_dev.spec import AutoTreePolicy, Policy, TreeSettings
from tree_dev.step import DraftBatch, Proposal, grow_trees

__all__ = ["Engine", "Request", "RequestStep", "SamplingParams", "StepEvent", "StepOutput"]
__all__ += ["Runner", "load_causal_lm"]


# --------------------------------------------------------------------------- engine
class Engine:
    """Tree speculative decoding over a target and a draft (LM or EAGLE head).

    Args:
        target: a ``transformers`` causal LM (Llama-style), or a local path.
        draft: a smaller causal LM sharing the vocabulary, or a path; or None.
        eagle: an EAGLE head (``tree_dev.models.eagle.EagleHead``) instead of a draft LM.
        tree: a tree spec (see ``tree_dev.spec``); ``"none"`` for plain decoding;
            ``ngram:`` tries need no draft (one given is not loaded into a runner).
            ``"auto"`` (or ``"auto:TREE;TREE;..."``): per step and request, the tree
            (or none) that maximises the batch's expected tokens per second
            (``tree_dev.engine_auto``): the model candidates with a draft or EAGLE head,
            n-gram tries without.
        max_batch: most requests decoded together.
        max_model_len: longest prompt + output.
        kernel_backend: backend for ``kernels.*`` (``"auto"`` picks per device).
        block_size: KV cache block size.
        eos_token_id: stops requests unless ``ignore_eos``; defaults to the target config's.
        draft_sampling: for sampled requests (temperature > 0) draw each node's
            children without replacement from the draft distribution (Gumbel
            top-k) and verify with ``draft_probs``; static trees only. Default:
            deterministic top-ranked children verified with ``target_only``.
        tree_kernel: verify every tree of more than ``ROW_PATH_NODES`` nodes with
            ``kernels.tree_attention`` even where the row path is faster (the accuracy
            tooling's validation sets it: it exists to prove the kernel in the engine).
        onednn_linear: route the models' fp32 CPU linear layers through oneDNN for
            multi-row inputs (tree verify, prefill; see ``tree_dev.onednn_linear``).
            Switches the given models' layers in place. Default (None): where
            ``onednn_faster()`` (a CPU with AVX-512), else MKL's ``F.linear``.
        narrow_linear: route inputs of at most ``narrow_linear.MAX_ROWS`` rows (a
            decode step, a tree verify, a draft level) through ``narrow_gemm``, which
            costs about the same at 1-4 rows as at 1 (see ``tree_dev.narrow_linear``).
            Switches the given models' layers in place. Default (None): where
            ``narrow_available()`` (x86-64 with AVX2 and a C compiler).
        auto_cost_model: ``tree="auto"``'s step-cost model (``tree_dev.auto.CostModel``);
            default: the one cached for these models on this machine, else measured now
            with the engine's own steps and cached.
        auto_cache_dir: where measured cost models are cached (default
            ``$TREESPEC_CACHE_DIR/auto`` or ``~/.cache/treespec/auto``).
        auto_objective: what ``tree="auto"`` maximises (``tree_dev.auto.OBJECTIVES``):
            ``"tokens"``, the batch's tokens per second (a server), or ``"makespan"``:
            the same while requests wait, then, for the last wave, a token is worth what
            it shortens the batch (``auto.makespan_weights``).
    """

    def __init__(
        self,
        target: PreTrainedModel | str | Path,
        draft: PreTrainedModel | str | Path | None = None,
        eagle: torch.nn.Module | None = None,
        tree: str = "chain:4",
        max_batch: int = 8,
        max_model_len: int = 1024,
        kernel_backend: str = "auto",
        block_size: int = 16,
        eos_token_id: int | None = None,
        draft_sampling: bool = False,
        onednn_linear: bool | None = None,
        narrow_linear: bool | None = None,
        tree_kernel: bool = False,
        auto_cost_model: CostModel | None = None,
        auto_cache_dir: str | Path | None = None,
        auto_objective: str = "tokens",
    ):
        settings = TreeSettings.parse(tree, draft_sampling)
        check_objective(auto_objective)
        self.policy: Policy = settings.policy
        if isinstance(self.policy, AutoTreePolicy):  # the candidates its draft runs
            kind = "eagle" if eagle is not None else "draft" if draft is not None else None
            self.policy = self.policy.for_draft(kind)
        self.draft_sampling = settings.draft_sampling
        # finished requests' tokens, searched by an ngram:...,history=H trie
        self.ngram_history = NgramHistory(getattr(self.policy, "history", 0))
        target, draft = load_models(target, draft)
        draft, eagle = drafter_models(self.policy, target, draft, eagle, tree)
        if max_batch < 1 or max_model_len < 2:
            raise ValueError(
                f"max_batch must be >= 1 and max_model_len >= 2, got {max_batch}, {max_model_len}"
            )
        check_kernel_limit(self.policy, target, kernel_backend, tree)
        self.target = target
        self.kernel_backend = kernel_backend
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.vocab_size = target.config.vocab_size
        self.eos_ids = eos_token_ids(target.config, eos_token_id)
        blocks = cache_blocks(max_batch, max_model_len, self.policy.max_nodes, block_size)
        self.runner = target_runner(target, blocks, block_size, kernel_backend, tree_kernel)
        self.draft_runner = draft_runner(draft, eagle, blocks, block_size, kernel_backend)
        switch_linears(
            (target, draft if draft is not None else eagle), onednn_linear, narrow_linear
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self._next_id = 0
        self.timings = {"draft": 0.0, "verify": 0.0, "walk": 0.0, "prefill": 0.0}
        self.forwards = {"target": 0, "draft": 0}
        self._step_listeners: list[Callable[[StepEvent], None]] = []
        self.last_verify_rows = 0  # tree nodes the target verified in the last step
        self.auto: LocalAuto | None = None
        if isinstance(self.policy, AutoTreePolicy):
            self.auto = LocalAuto(self.policy, auto_cost_model, auto_objective)
            self.auto.load_or_calibrate(self, auto_cache_dir)

    # ----------------------------------------------------------------- public API
    def on_step(self, listener: Callable[[StepEvent], None]) -> None:
        """Call ``listener(StepEvent)`` after every verify step (tests, ``bench.validate``,
        statistics). Without listeners a step builds no event."""
        self._step_listeners.append(listener)

    def add_request(self, prompt: list[int], params: SamplingParams | None = None) -> int:
        """Queue a prompt (token ids); returns the request id."""
        params = params or SamplingParams()
        params.validate()
        if not prompt:
            raise ValueError("empty prompt: give at least one token")
        bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(
                f"prompt token {bad[0]!r} outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len} "
                "(prompt + at least one output token)"
            )
        gen = torch.Generator(device="cpu")
        gen.manual_seed(params.seed if params.seed is not None else torch.seed() % 2**63)
        req = Request(self._next_id, list(prompt), params, gen)
        req.sampled_drafts = self.draft_sampling and params.temperature > 0
        self._next_id += 1
        self.requests[req.req_id] = req
        self.waiting.append(req)
        return req.req_id

    def abort(self, req_id: int) -> None:
        """Drop a request (e.g. its client disconnected) and free its blocks."""
        req = self.requests.get(req_id)
        if req is None or req.finished:
            return
        req.finished, req.finish_reason = True, "abort"
        if req in self.waiting:
            self.waiting.remove(req)
        self._release(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Decode ``prompts`` to completion; returns the output token ids of each."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_work():
            self.step()
        return [self.requests[i].output for i in ids]

    def step(self) -> list[StepOutput]:
        """Admit waiting requests, run one draft-verify-accept step for all running."""
        self._admit()
        if not self.running:
            return []
        batch = list(self.running)
        t0 = time.perf_counter()
        if self.auto is not None:
            policies = self.auto.choose(batch, waiting=len(self.waiting))
        else:
            policies = [self.policy] * len(batch)
        proposals = self._propose(batch, policies)
        t1 = time.perf_counter()
        self.last_verify_rows = sum(p.tree.num_nodes for p in proposals)
        hidden, logits = self.runner.forward(
            [r.req_id for r in batch],
            [r.target_len for r in batch],
            [p.tree for p in proposals],
            None,
            [t for p in proposals for t in p.tokens],
        )
        self.forwards["target"] += 1
        t2 = time.perf_counter()
        records = None
        if self._step_listeners:
            records = [
                RequestStep(
                    r.req_id,
                    r.target_len,
                    r.prompt + r.output,
                    p.tree.parents.tolist(),
                    p.tokens,
                    p.tree.max_depth,
                    mode=r.mode,
                )
                for r, p in zip(batch, proposals)
            ]
        want_paths = records is not None or self.auto is not None
        paths: dict[int, tuple[list[int], list[int]]] | None = {} if want_paths else None
        outs = self._accept(batch, proposals, hidden, logits, paths)
        t3 = time.perf_counter()
        if self.auto is not None:
            depths = [p.tree.max_depth for p in proposals]
            self.auto.record(batch, depths, paths, t3 - t0, self.last_verify_rows)
        self.timings["draft"] += t1 - t0
        self.timings["verify"] += t2 - t1
        self.timings["walk"] += t3 - t2
        if records is not None:
            for rec in records:
                rec.accepted, rec.emitted = paths[rec.req_id]
            event = StepEvent(records, {"draft": t1 - t0, "verify": t2 - t1, "walk": t3 - t2})
            for listener in self._step_listeners:
                listener(event)
        return outs

    # ----------------------------------------------------------------- admission
    def _admit(self) -> None:
        new = []
        while self.waiting and len(self.running) + len(new) < self.max_batch:
            new.append(self.waiting.popleft())
        if not new:
            return
        t0 = time.perf_counter()
        ids = [r.req_id for r in new]
        hidden = self.runner.prefill(ids, [0] * len(new), [r.prompt[:-1] for r in new])
        for r, h in zip(new, hidden):
            r.target_len = len(r.prompt) - 1
            if self.draft_runner is not None and self.draft_runner.eagle:
                # the head sees (x_j, feature h_{j-1}) at position j, j = 1..P-1
                r.pending, r.pending_feats, r.draft_len = r.prompt[1:], h, 1
            else:
                r.pending, r.draft_len = list(r.prompt), 0
        self.running.extend(new)
        self.timings["prefill"] += time.perf_counter() - t0

    def auto_stats(self) -> dict | None:
        """``tree: auto``'s choices and its cost model's predicted vs measured step seconds
        (``auto.AutoStats.as_dict``); None for a fixed tree."""
        return None if self.auto is None else self.auto.stats

    def _release(self, req: Request) -> None:
        if self.auto is not None:
            self.auto.forget(req.req_id)
        if self.ngram_history.max_tokens and req.finish_reason in ("stop", "length"):
            self.ngram_history.add(req.prompt + req.output)  # no copy when history is off
        if req in self.running:
            self.running.remove(req)
        self.runner.cache.free(req.req_id)
        if self.draft_runner is not None:
            self.draft_runner.cache.free(req.req_id)

    # ----------------------------------------------------------------- drafting
    def _propose(
        self, batch: list[Request], policies: list[Policy] | None = None
    ) -> list[Proposal]:
        """Request ``i``'s tree under ``policies[i]`` (default: the engine's tree): tries
        and ``none`` from the context, the rest grown by the draft (``grow_trees``), one
        packed forward per level."""
        if policies is None:
            policies = [self.policy] * len(batch)
        grown = [i for i, p in enumerate(policies) if not is_undrafted(p)]
        if not grown:
            return undrafted_proposals(policies, batch, self.ngram_history)
        if len(grown) == len(batch):
            props: list[Proposal | None] = [None] * len(batch)
        else:
            props = list(undrafted_proposals(policies, batch, self.ngram_history))
        sub = [batch[i] for i in grown]
        eagle = self.draft_runner.eagle
        reqs = draft_requests([policies[i] for i in grown], sub, eagle)
        for i, prop in zip(grown, grow_trees(reqs, self._draft_forward)):
            props[i] = prop
        mark_drafted(sub, reqs, eagle)
        return props

    def _draft_forward(self, b: DraftBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The draft runner as ``tree_dev.step.DraftForward``, counting its level forwards."""
        out = draft_forward(self.draft_runner, b)
        if b.want is not None:
            self.forwards["draft"] += 1
        return out

    # ----------------------------------------------------------------- acceptance
    def _accept(
        self,
        batch: list[Request],
        proposals: list[Proposal],
        hidden: torch.Tensor,
        logits: torch.Tensor,
        paths: dict[int, tuple[list[int], list[int]]] | None,
    ) -> list[StepOutput]:
        """Walk every tree, compact the KV of the accepted paths, commit the tokens; fills
        ``paths[req_id] = (accepted node ids, emitted tokens)`` unless ``paths`` is None."""
        sizes = [p.tree.num_nodes for p in proposals]
        check_finite_logits(batch, logits, sizes)
        accepted, emitted = accepted_paths(batch, proposals, logits, self.kernel_backend)
        compact_accepted(self.runner.cache, batch, accepted, self.kernel_backend)
        drafted = self.draft_runner is not None
        feats = None
        if drafted and self.draft_runner.eagle:
            feats = accepted_features(hidden, sizes, accepted)
        outs = []
        for i, r in enumerate(batch):
            nodes, tokens = accepted[i], emitted[i]
            if paths is not None:
                paths[r.req_id] = (list(nodes), list(tokens))
            f = None if feats is None else feats[i]
            advance(r, proposals[i].tree.max_depth, len(nodes), tokens, drafted, f)
            new = r.commit(tokens, self.eos_ids, self.max_model_len)
            outs.append(StepOutput(r.req_id, new, r.finished, r.finish_reason))
        for r in [r for r in batch if r.finished]:
            self._release(r)
        return outs
