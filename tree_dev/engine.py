"""The local tree speculative-decoding engine, in one file.

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
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch
from transformers import PreTrainedModel

import kernels
from kernels.reference import target_probs
from kernels.torchops.tree_walk import sample_inverse_cdf
from tree_dev.attention import register
from tree_dev.model_runner import (
    PREFILL_CHUNK,
    Runner,
    _attn_geometry,
    _tree_batch,
    load_causal_lm,
)
from tree_dev.narrow_linear import narrow_available, use_narrow_linears
from tree_dev.onednn_linear import onednn_faster, use_onednn_linears
from tree_dev.proposer import NgramHistory, expansion_for, ngram_trie
from tree_dev.requests import (
    Request,
    RequestStep,
    SamplingParams,
    StepEvent,
    StepOutput,
)
from tree_dev.spec import (
    HybridPolicy,
    NgramPolicy,
    NoDraftPolicy,
    Policy,
    TreeSettings,
)
from tree_dev.step import DraftBatch, DraftRequest, Proposal, grow_trees, walk_trees
from tree_dev.tree import TokenTree

__all__ = ["Engine", "Request", "RequestStep", "SamplingParams", "StepEvent", "StepOutput"]
__all__ += ["Runner", "load_causal_lm"]

_ROOT_ONLY = TokenTree.chain(0)  # plain decoding's tree (immutable, its properties cached)
# the walk's tree batches (the verify forward caches its own: model_runner._batch_of)
_walk_batch = lru_cache(maxsize=1024)(_tree_batch)


def _switch_linears(models, onednn_linear: bool | None, narrow_linear: bool | None) -> None:
    """Route the models' linear layers through oneDNN and/or ``narrow_gemm`` (None: where
    this CPU gains from it)."""
    if onednn_linear is None:
        onednn_linear = onednn_faster()
    if narrow_linear is None:
        narrow_linear = narrow_available()
    for model in models:
        if model is not None and onednn_linear:
            use_onednn_linears(model)
        if model is not None and narrow_linear:  # after oneDNN: it keeps the wide inputs
            use_narrow_linears(model)


# --------------------------------------------------------------------------- engine
class Engine:
    """Tree speculative decoding over a target and a draft (LM or EAGLE head).

    Args:
        target: a ``transformers`` causal LM (Llama-style), or a local path.
        draft: a smaller causal LM sharing the vocabulary, or a path; or None.
        eagle: an EAGLE head (``tree_dev.models.eagle.EagleHead``) instead of a draft LM.
        tree: a tree spec (see ``tree_dev.spec``); ``"none"`` for plain decoding;
            ``ngram:`` tries need no draft (one given is not loaded into a runner).
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
    ):
        settings = TreeSettings.parse(tree, draft_sampling)
        self.policy: Policy = settings.policy
        self.draft_sampling = settings.draft_sampling
        # finished requests' tokens, searched by an ngram:...,history=H trie
        self.ngram_history = NgramHistory(getattr(self.policy, "history", 0))
        if isinstance(target, (str, Path)):
            target = load_causal_lm(target)
        if isinstance(draft, (str, Path)):
            draft = load_causal_lm(draft, dtype=next(target.parameters()).dtype)
        draft, eagle = self._drafter_models(target, draft, eagle, tree)
        if max_batch < 1 or max_model_len < 2:
            raise ValueError(
                f"max_batch must be >= 1 and max_model_len >= 2, got {max_batch}, {max_model_len}"
            )
        self._check_kernel_limit(target, kernel_backend, tree)
        register()
        self.target = target.eval()
        self.target.set_attn_implementation("treespec")
        self.kernel_backend = kernel_backend
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.vocab_size = target.config.vocab_size
        eos = target.config.eos_token_id if eos_token_id is None else eos_token_id
        self.eos_ids = set(
            eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []
        )
        blocks = max_batch * -(
            -(max_model_len + self.policy.max_nodes + PREFILL_CHUNK) // block_size
        )
        self.runner = Runner(
            target,
            *_attn_geometry(target.config),
            blocks,
            block_size,
            kernel_backend,
            tree_kernel=tree_kernel,
        )
        self.draft_runner = self._draft_runner(draft, eagle, blocks, block_size)
        _switch_linears(
            (target, draft if draft is not None else eagle), onednn_linear, narrow_linear
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self._next_id = 0
        self.timings = {"draft": 0.0, "verify": 0.0, "walk": 0.0, "prefill": 0.0}
        self.forwards = {"target": 0, "draft": 0}
        self._step_listeners: list[Callable[[StepEvent], None]] = []

    def _drafter_models(self, target, draft, eagle, tree: str) -> tuple:
        """``(draft, eagle)`` this engine runs: both None where the tree needs no draft
        (plain decoding, n-gram tries); ValueError for a missing, doubled or mismatched
        draft."""
        if draft is not None and eagle is not None:
            raise ValueError("give either a draft model or an EAGLE head, not both")
        uses_draft = not isinstance(self.policy, (NoDraftPolicy, NgramPolicy))
        if uses_draft and draft is None and eagle is None:
            raise ValueError(f"tree {tree!r} needs a draft model or an EAGLE head")
        if not uses_draft:  # plain decoding and n-gram tries run no draft
            return None, None
        vocab = target.config.vocab_size
        drafter = draft if draft is not None else eagle
        if drafter.config.vocab_size != vocab:
            raise ValueError(
                f"draft vocabulary ({drafter.config.vocab_size}) differs from "
                f"the target's ({vocab})"
            )
        return draft, eagle

    def _check_kernel_limit(self, target, kernel_backend: str, tree: str) -> None:
        dev = next(target.parameters()).device
        attn_fn = kernels._resolve("tree_attention", kernel_backend, dev)
        limit = getattr(attn_fn, "max_tree_nodes", None)
        if limit is not None and self.policy.max_nodes > limit:
            raise ValueError(
                f"tree {tree!r} has up to {self.policy.max_nodes} nodes; kernel backend "
                f"{kernel_backend!r} supports at most {limit}"
            )

    def _draft_runner(self, draft, eagle, blocks: int, block_size: int) -> Runner | None:
        """The draft LM's or EAGLE head's runner (None without one)."""
        drafter = draft if draft is not None else eagle
        if drafter is None:
            return None
        drafter.eval()
        if eagle is not None:
            eagle.config._attn_implementation = "treespec"
            eagle.decoder.set_attn_implementation("treespec")
        else:
            drafter.set_attn_implementation("treespec")
        return Runner(
            drafter,
            *_attn_geometry(drafter.config),
            blocks,
            block_size,
            self.kernel_backend,
            eagle=eagle is not None,
        )

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
        proposals = self._propose(batch)
        t1 = time.perf_counter()
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
                )
                for r, p in zip(batch, proposals)
            ]
        paths: dict[int, tuple[list[int], list[int]]] | None = {} if records is not None else None
        outs = self._accept(batch, proposals, hidden, logits, paths)
        t3 = time.perf_counter()
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

    def _release(self, req: Request) -> None:
        if self.ngram_history.max_tokens and req.finish_reason in ("stop", "length"):
            self.ngram_history.add(req.prompt + req.output)  # no copy when history is off
        if req in self.running:
            self.running.remove(req)
        self.runner.cache.free(req.req_id)
        if self.draft_runner is not None:
            self.draft_runner.cache.free(req.req_id)

    # ----------------------------------------------------------------- drafting
    def _propose(self, batch: list[Request]) -> list[Proposal]:
        if isinstance(self.policy, NoDraftPolicy):
            return [Proposal(_ROOT_ONLY, [r.root]) for r in batch]
        if isinstance(self.policy, NgramPolicy):
            hist = self.ngram_history
            return [Proposal(*ngram_trie(r.prompt + r.output, self.policy, hist)) for r in batch]
        eagle = self.draft_runner.eagle
        reqs = []
        for r in batch:
            can = not eagle or bool(r.pending)  # an EAGLE head needs the root's feature
            expansion = expansion_for(
                self.policy,
                r.root,
                context=r.prompt + r.output if isinstance(self.policy, HybridPolicy) else None,
                sample_temperature=r.params.temperature if r.sampled_drafts else None,
                generator=r.generator,
            )
            trunk, feats = (
                (r.pending, r.pending_feats if eagle else None) if can else ([r.root], None)
            )
            reqs.append(DraftRequest(r.req_id, trunk, r.draft_len, expansion, feats, can))
        proposals = grow_trees(reqs, self._draft_forward)
        for r, d in zip(batch, reqs):  # what the draft consumed is in its cache
            done = d.prefix - r.draft_len
            r.draft_len = d.prefix
            r.pending = r.pending[done:]
            if eagle and r.pending_feats is not None:
                r.pending_feats = r.pending_feats[done:]
        return proposals

    def _draft_forward(self, b: DraftBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The draft runner as ``tree_dev.step.DraftForward``."""
        dr = self.draft_runner
        if b.want is None:  # a catch-up chunk: every node of a chain
            dr.forward(b.keys, b.prefixes, b.trees, None, b.tokens, b.feats, want_logits=False)
            return None, None
        rows, offset = [], 0  # logits only at the wanted rows
        for nodes, w in zip(b.new_nodes, b.want):
            where = {n: k for k, n in enumerate(nodes)}
            rows += [offset + where[n] for n in w]
            offset += len(nodes)
        hidden, logits = dr.forward(
            b.keys, b.prefixes, b.trees, b.new_nodes, b.tokens, b.feats, logit_rows=rows
        )
        self.forwards["draft"] += 1
        return torch.log_softmax(logits.float(), dim=-1), hidden[rows]

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
        # the one walk check the engine can't rule out; a finite sum means every logit is
        # finite (an inf or NaN makes it inf or NaN), the full check only when it is not
        if not bool(torch.isfinite(logits.sum())) and not bool(torch.isfinite(logits).all()):
            bad = [r.req_id for r, x in zip(batch, logits.split(sizes)) if not x.isfinite().all()]
            raise RuntimeError(f"target produced non-finite logits for requests {bad}")
        if all(n == 1 for n in sizes):
            return self._accept_roots(batch, hidden, logits, paths)
        dev = logits.device
        res = walk_trees(
            logits.split(sizes),
            proposals,
            [r.mode for r in batch],
            [r.params.temperature for r in batch],
            [r.params.top_p for r in batch],
            [r.generator for r in batch],
            lambda trees: _walk_batch(trees, dev),
            self.kernel_backend,
        )
        self._compact(batch, res.accepted)
        hidden_rows = hidden.split(sizes)
        outs = []
        for i, r in enumerate(batch):
            nodes, emitted = res.accepted[i], res.emitted[i]
            if paths is not None:
                paths[r.req_id] = (list(nodes), list(emitted))
            r.depth.record(proposals[i].tree.max_depth, len(nodes) - 1)
            r.target_len += len(nodes)
            if self.draft_runner is not None:
                r.pending = r.pending + emitted
                if self.draft_runner.eagle:
                    f = hidden_rows[i][torch.tensor(nodes, device=hidden.device)]
                    old = r.pending_feats
                    r.pending_feats = f if old is None or not len(old) else torch.cat([old, f])
            new = self._commit(r, emitted)
            outs.append(StepOutput(r.req_id, new, r.finished, r.finish_reason))
        for r in [r for r in batch if r.finished]:
            self._release(r)
        return outs

    def _compact(self, batch: list[Request], accepted: list[list[int]]) -> None:
        """Move every accepted path's K/V to slots ``target_len + j`` (``kernels.kv_compact``);
        nothing to move when every path is nodes ``0..n-1`` (a chain's accepted prefix)."""
        if all(nodes == list(range(len(nodes))) for nodes in accepted):
            return
        dev = self.runner.device
        width = max(len(nodes) for nodes in accepted)
        acc_nodes = torch.zeros(len(batch), width, dtype=torch.int64)
        for i, nodes in enumerate(accepted):
            acc_nodes[i, : len(nodes)] = torch.tensor(nodes, dtype=torch.int64)
        kernels.kv_compact(
            self.runner.cache.k,
            self.runner.cache.v,
            torch.tensor([r.target_len for r in batch], device=dev),
            acc_nodes.to(dev),
            torch.tensor([len(nodes) for nodes in accepted], device=dev),
            self.runner.cache.block_table([r.req_id for r in batch]),
            backend=self.kernel_backend,
            check_inputs=False,
        )

    def _accept_roots(
        self,
        batch: list[Request],
        hidden: torch.Tensor,
        logits: torch.Tensor,
        paths: dict[int, tuple[list[int], list[int]]] | None,
    ) -> list[StepOutput]:
        """``_accept`` when every tree is its root alone (a plain decode step): the next
        token is the root's bonus token, nothing to walk or compact."""
        outs = []
        for i, (r, t) in enumerate(zip(batch, self._sample_roots(batch, logits).tolist())):
            if paths is not None:
                paths[r.req_id] = ([0], [t])
            r.depth.record(0, 0)
            r.target_len += 1
            if self.draft_runner is not None:
                r.pending = r.pending + [t]
                if self.draft_runner.eagle:
                    f, old = hidden[i : i + 1], r.pending_feats
                    r.pending_feats = f if old is None or not len(old) else torch.cat([old, f])
            new = self._commit(r, [t])
            outs.append(StepOutput(r.req_id, new, r.finished, r.finish_reason))
        for r in [r for r in batch if r.finished]:
            self._release(r)
        return outs

    def _sample_roots(self, batch: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """The next token of every request from its root's logits ``[B, V]``: the
        argmax, or a draw by the walk's own rule (``uniforms [1, 2]`` per request from
        its generator, inverse CDF of the tempered top-p target distribution at
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

    def _commit(self, req: Request, emitted: list[int]) -> list[int]:
        """Append tokens up to the first stop condition; returns what was appended."""
        new = []
        for t in emitted:
            new.append(t)
            req.output.append(t)
            if t in req.params.stop_token_ids or (t in self.eos_ids and not req.params.ignore_eos):
                req.finished, req.finish_reason = True, "stop"
                break
            if len(req.output) >= req.params.max_tokens:
                req.finished, req.finish_reason = True, "length"
                break
            if len(req.prompt) + len(req.output) >= self.max_model_len:
                req.finished, req.finish_reason = True, "length"
                break
        return new
