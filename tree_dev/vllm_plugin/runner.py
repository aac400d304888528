"""One vLLM model runner's tree state: verify, walk, compact, propose.

A step of a request with a tree, in vLLM's order:

1. ``propose`` (end of the previous step): the drafter grows a tree below the request's
   root (its last sampled token); its draft tokens go to vLLM in breadth-first order, the
   shape stays here, keyed by request id. The scheduler may cut the list; a BFS prefix of
   a tree is a tree, so the cut tree is verified.
2. ``prepare_verify`` (after vLLM's ``_prepare_inputs``): the request's ``1 + n`` query
   rows are root + nodes; their RoPE positions become ``P + depth`` (slots stay linear,
   ``P + node``), and ``attention.ACTIVE.verify`` tells the attention override which rows
   are tree rows. A chain's rows are left to vLLM (its positions and causal mask are
   already the chain's).
3. ``walk_and_compact`` (after vLLM's sampler): ``kernels.tree_walk`` on the target's
   logits at every node gives the accepted path and the bonus token; the row of vLLM's
   sampler output is replaced by them (``-1`` padded, as vLLM's rejection sampler does).
   The accepted nodes' K/V move to slots ``P+1 .. P+a`` through the backend's own cache
   write, so when vLLM's scheduler rewinds ``num_computed_tokens`` to ``P + 1 + a`` the
   cache holds exactly the accepted path.

Requests whose sampling needs a feature that assumes chains (penalties, bad words, logit
bias, min_p / top_k, min_tokens, logprobs, structured output, allowed token ids, logits
processors) get no tree: vLLM decodes them plainly, which is exact, only not faster.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tree_dev.proposer import NgramHistory, tree_of
from tree_dev.spec import is_ngram
from tree_dev.step import (
    GREEDY_TEMPERATURE,
    DepthStats,
    Proposal,
    VerifyTrees,
    walk_mode,
    walk_trees,
)
from tree_dev.tree import TokenTree
from tree_dev.vllm_plugin import attention
from tree_dev.vllm_plugin.config import TreeConfig, draft_slots


@dataclass
class Stats:
    """This runner's tree steps: per-depth acceptance, fallbacks, walks, timings."""

    depth: DepthStats = field(default_factory=DepthStats)
    fallback_requests: int = 0
    walks: dict[str, int] = field(default_factory=dict)  # tree walks per mode
    # draft forwards by attention path: "causal" (vLLM's kernel), "tree" (tree attention)
    draft_forwards: dict[str, int] = field(default_factory=lambda: {"causal": 0, "tree": 0})
    seconds: dict[str, float] = field(
        default_factory=lambda: {"walk": 0.0, "compact": 0.0, "propose": 0.0}
    )

    def as_dict(self) -> dict:
        d = self.depth
        return {
            "tree_steps": d.steps,
            "tokens_per_step": d.tokens_per_step(),
            "acceptance_per_depth": d.acceptance_per_depth(),
            "depth_tried": list(d.tried),
            "depth_accepted": list(d.accepted),
            "fallback_requests": self.fallback_requests,
            "walks": dict(self.walks),
            "draft_forwards": dict(self.draft_forwards),
            "seconds": {**self.seconds, "tree_attention": attention.ACTIVE.seconds},
        }


@dataclass
class _Verify:
    """The trees of the verify forward in flight."""

    req_index: list[int]
    req_ids: list[str]
    prefix_lens: list[int]
    proposals: list[Proposal]  # as verified: a tree the scheduler cut is its BFS prefix

    @property
    def trees(self) -> list[TokenTree]:
        return [p.tree for p in self.proposals]


def tree_eligible(sp) -> bool:
    """Whether a request's sampling parameters are exact under tree verification."""
    if sp is None:
        return False
    checks = (
        getattr(sp, "presence_penalty", 0.0) == 0.0,
        getattr(sp, "frequency_penalty", 0.0) == 0.0,
        getattr(sp, "repetition_penalty", 1.0) == 1.0,
        not getattr(sp, "bad_words", None),
        not getattr(sp, "bad_words_token_ids", None),
        not getattr(sp, "logit_bias", None),
        getattr(sp, "min_p", 0.0) == 0.0,
        getattr(sp, "top_k", 0) in (0, -1, None),
        getattr(sp, "min_tokens", 0) == 0,
        getattr(sp, "logprobs", None) is None,
        getattr(sp, "structured_outputs", None) is None,
        not getattr(sp, "allowed_token_ids", None),
        not getattr(sp, "logits_processors", None),
    )
    return all(checks)


class TreeRunner:
    """Tree speculative decoding state of one ``GPUModelRunner`` (CPU runner included)."""

    def __init__(self, runner, cfg: TreeConfig):
        self.runner = runner
        self.cfg = cfg
        self.start_policy = cfg.policy  # the tree the engine reserved KV slots for
        self.proposals: dict[str, Proposal] = {}
        self.draft_len: dict[str, int] = {}
        # an ngram:...,history=H trie: finished requests' tokens, and the running ones'
        self.history = NgramHistory(getattr(cfg.policy, "history", 0))
        self.contexts: dict[str, list[int]] = {}
        self.verify: _Verify | None = None
        self.verify_trees: VerifyTrees | None = None  # this step's, for other tooling
        self.stats = Stats()
        self.recorded: list[dict] = []  # the first cfg.record_trees proposals
        self.target_layers: list[str] = []
        self.drafter = None
        # per step: (req ids, first query row, computed tokens, scheduled tokens) per row
        self.step: tuple[list[str], np.ndarray, np.ndarray, np.ndarray] | None = None
        self.accepted: dict[str, list[int]] = {}  # this step's accepted nodes (root first)
        self.feats: dict[str, tuple[int, torch.Tensor]] = {}  # EAGLE: (first pos, [k, H])
        attention.ACTIVE.backend = cfg.kernel_backend
        # Every drafter runs after vLLM's bookkeeping (sampled tokens as lists, the
        # persistent batch's token ids up to date): the runner's "padded drafter batch"
        # path would hand vLLM's own GPU-side drafting inputs to a chain proposer.
        spec = runner.speculative_config
        if spec is not None:
            spec.disable_padded_drafter_batch = True
        from tree_dev.vllm_plugin.worker_methods import Profiler

        self._profile = Profiler.from_env()

    # ----------------------------------------------------------------- set-up
    def on_model_loaded(self) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        r = self.runner
        layers = get_layers_from_vllm_config(r.vllm_config, Attention)
        draft_names: set[str] = set()
        if self.cfg.uses_draft_model:
            draft_names = set(getattr(r.drafter, "_draft_attn_layer_names", set()))
            from tree_dev.vllm_plugin.drafter import ModelDrafter

            self.drafter = ModelDrafter(
                self, r.drafter, sorted(draft_names), eagle=self.cfg.method == "eagle"
            )
        self.target_layers = sorted(n for n in layers if n not in draft_names)

    def on_update_states(self, scheduler_output) -> None:
        """Forget finished and preempted requests; new and resumed ones start over."""
        gone = set(scheduler_output.finished_req_ids)
        gone |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        gone |= set(getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", ()))
        for new in scheduler_output.scheduled_new_reqs:
            gone.add(new.req_id)
        for rid in scheduler_output.finished_req_ids:  # an ngram:...,history=H trie's
            seen = self.contexts.pop(rid, None)
            if seen is not None:
                self.history.add(seen)
        for rid in gone:
            self.contexts.pop(rid, None)
            self.proposals.pop(rid, None)
            self.draft_len.pop(rid, None)
            self.feats.pop(rid, None)

    # ----------------------------------------------------------------- verify
    def prepare_verify(self, scheduler_output, num_scheduled_tokens: np.ndarray) -> None:
        """Depth positions and tree rows for the requests whose drafts are a tree."""
        r = self.runner
        batch = r.input_batch
        specs = scheduler_output.scheduled_spec_decode_tokens
        self.verify = None
        attention.ACTIVE.verify = None
        self.verify_trees = None  # read by the accuracy tooling's capture (verify_trees)
        self.accepted = {}
        n = batch.num_reqs
        self.step = (
            list(batch.req_ids),
            r.query_start_loc.np[:n].copy(),
            batch.num_computed_tokens_cpu[:n].copy(),
            np.asarray(num_scheduled_tokens[:n]).copy(),
        )
        if not specs:
            return
        idx, rids, prefix, props = [], [], [], []
        qsl = r.query_start_loc.np
        for rid, drafts in specs.items():
            if not drafts:
                continue
            prop = self.proposals.get(rid)
            n = len(drafts)
            if prop is None or prop.tokens[1 : n + 1] != list(drafts):
                raise RuntimeError(
                    f"treespec: request {rid} was scheduled with draft tokens that are not "
                    "its proposed tree's; the worker lost the tree"
                )
            i = batch.req_id_to_index[rid]
            if int(num_scheduled_tokens[i]) != n + 1:
                raise RuntimeError(
                    f"treespec: request {rid} has {n} drafts but {num_scheduled_tokens[i]} "
                    "scheduled tokens (a tree must be verified in one forward)"
                )
            if n + 1 < prop.tree.num_nodes:  # cut to its first n + 1 nodes (BFS)
                q = None if prop.draft_probs is None else prop.draft_probs[: n + 1]
                cut = tree_of(tuple(prop.tree.parents.tolist()[: n + 1]))
                prop = Proposal(cut, prop.tokens[: n + 1], q)
            idx.append(i)
            rids.append(rid)
            prefix.append(int(batch.num_computed_tokens_cpu[i]))
            props.append(prop)
        if not idx:
            return
        self.verify = _Verify(idx, rids, prefix, props)
        trees = self.verify.trees
        self.verify_trees = VerifyTrees(
            list(rids),
            [t.parents.tolist() for t in trees],
            [list(p.tokens) for p in props],
            list(prefix),
        )
        # A chain's rows are what vLLM verifies anyway (positions P + node = P + depth,
        # the causal mask = its ancestors): vLLM's own kernel is exact for them.
        branched = [k for k, t in enumerate(trees) if t.max_depth != t.num_nodes - 1]
        if not branched:
            return
        idx = [idx[k] for k in branched]
        prefix = [prefix[k] for k in branched]
        trees = [trees[k] for k in branched]
        starts = [int(qsl[i]) for i in idx]
        rows = torch.cat(
            [torch.arange(s, s + t.num_nodes, dtype=torch.int64) for s, t in zip(starts, trees)]
        )
        depth = torch.cat([t.depth for t in trees])
        if self.cfg.debug_disable != "positions":
            plen = torch.tensor(prefix, dtype=torch.int64).repeat_interleave(
                torch.tensor([t.num_nodes for t in trees])
            )
            r.positions[rows] = (plen + depth).to(r.positions.dtype)
        if self.cfg.debug_disable == "mask":
            return  # vLLM's causal attention over the tree rows: the planted bug
        batch_trees = attention.tree_batch(tuple(trees))
        attention.ACTIVE.verify = attention.TreeRows(
            batch=batch_trees,
            row_index=rows,
            prefix_lens=torch.tensor(prefix, dtype=torch.int64),
            req_rows=torch.tensor(idx, dtype=torch.int64),
            kv_lens=[p + t.num_nodes for p, t in zip(prefix, trees)],
        )

    # ----------------------------------------------------------------- walk
    def sampler_output_for_trees(self, spec_meta):
        """An empty ``SamplerOutput`` (``-1`` everywhere) when every request of the batch
        is verifying a tree (the walk then writes every row, so vLLM's sampler and
        rejection sampler need not run); None otherwise."""
        v = self.verify
        if v is None or spec_meta is None:
            return None
        batch = self.runner.input_batch
        if len(v.req_index) != batch.num_reqs:
            return None
        from vllm.v1.outputs import SamplerOutput

        batch.update_async_output_token_ids()
        width = max(spec_meta.num_draft_tokens) + 1
        ids = torch.full((batch.num_reqs, width), -1, dtype=torch.int32)
        return SamplerOutput(sampled_token_ids=ids, logprobs_tensors=None)

    def walk_and_compact(self, logits: torch.Tensor, spec_meta, sampler_output) -> None:
        """Replace the tree requests' rows of vLLM's sampler output; compact their KV."""
        v = self.verify
        self.verify = None
        attention.ACTIVE.verify = None
        if v is None or spec_meta is None:
            return
        t0 = time.perf_counter()
        sm = self.runner.input_batch.sampling_metadata
        n_sampled = np.asarray(spec_meta.num_draft_tokens, dtype=np.int64) + 1
        starts = np.concatenate([[0], np.cumsum(n_sampled)[:-1]])
        rows = v.req_index
        first = [int(starts[i]) for i in rows]
        res = walk_trees(
            [logits[f : f + t.num_nodes] for f, t in zip(first, v.trees)],
            v.proposals,
            [self._mode(sm, v, j) for j in range(len(rows))],
            sm.temperature[rows].tolist() if sm.temperature is not None else [0.0] * len(rows),
            sm.top_p[rows].tolist() if sm.top_p is not None else None,
            [sm.generators.get(i) for i in rows],
            attention.tree_batch,
            self.cfg.kernel_backend,
        )
        for mode, n in res.walks.items():
            self.stats.walks[mode] = self.stats.walks.get(mode, 0) + n
        out = sampler_output.sampled_token_ids
        moves = []  # (batch row, prefix, accepted nodes)
        for j, i in enumerate(rows):
            nodes, emitted = res.accepted[j], res.emitted[j]
            out[i].fill_(-1)
            out[i, : len(emitted)] = torch.tensor(emitted, dtype=out.dtype)
            self.stats.depth.record(v.proposals[j].tree.max_depth, len(nodes) - 1)
            moves.append((i, v.prefix_lens[j], nodes))
            self.accepted[v.req_ids[j]] = nodes
        t1 = time.perf_counter()
        if self.cfg.debug_disable != "compaction":
            self._compact(moves)
        self.stats.seconds["walk"] += t1 - t0
        self.stats.seconds["compact"] += time.perf_counter() - t1

    @staticmethod
    def _mode(sm, v: _Verify, j: int) -> str:
        """The walk of tree ``j``: greedy, or lossless sampling of top-ranked drafts
        (``target_only``) or of sampled drafts (``draft_probs``)."""
        if sm.all_greedy or sm.temperature is None:
            return "greedy"
        sampled_drafts = v.proposals[j].draft_probs is not None
        return walk_mode(float(sm.temperature[v.req_index[j]]), sampled_drafts)

    def _compact(self, moves: list[tuple[int, int, list[int]]]) -> None:
        """Accepted nodes ``P + node_j`` -> slots ``P + j`` in every target layer."""
        src, dst = [], []
        bt = self.runner.input_batch.block_table.block_tables[0]
        table, bs = bt.get_cpu_tensor(), bt.block_size
        for i, p, nodes in moves:
            for j, node in enumerate(nodes):
                if node != j:
                    src.append(_slot(table[i], bs, p + node))
                    dst.append(_slot(table[i], bs, p + j))
        if not src:
            return
        src_t = torch.tensor(src, dtype=torch.int64)
        dst_t = torch.tensor(dst, dtype=torch.int64)
        ctx = self.runner.compilation_config.static_forward_context
        for name in self.target_layers:
            layer = ctx[name]
            kv = layer.kv_cache
            kv = kv[0] if isinstance(kv, list) else kv
            lay = attention.layout_for(layer.impl, layer, kv)
            k, v = lay.gather_slots(kv, src_t)
            layer.impl.do_kv_cache_update(layer, k.clone(), v.clone(), kv, dst_t)

    # ----------------------------------------------------------------- propose
    def propose(self, scheduler_output, sampled_token_ids, hidden_states=None) -> list[list[int]]:
        """The next tree of every request that sampled this step (BFS draft tokens)."""
        t0 = time.perf_counter()
        try:
            return self._propose(scheduler_output, sampled_token_ids, hidden_states)
        finally:
            self.stats.seconds["propose"] += time.perf_counter() - t0
            if self._profile is not None:
                self._profile.tick()

    def _propose(self, scheduler_output, sampled_token_ids, hidden_states) -> list[list[int]]:
        if self.cfg.method == "eagle" and hidden_states is not None:
            self._keep_features(hidden_states)
        out: list[list[int]] = [[] for _ in self.runner.input_batch.req_ids]
        todo = self._eligible(sampled_token_ids)
        if not todo or getattr(scheduler_output, "num_spec_tokens_to_schedule", None) == 0:
            return out
        if is_ngram(self.cfg.policy):
            self._propose_ngram(todo, out)
        else:
            self._propose_model(todo, out)
        return out

    def _eligible(self, sampled_token_ids) -> list[tuple[int, str, int]]:
        """``(batch row, request id, committed tokens)`` of the requests that get a tree
        now: they sampled this step, their sampling is exact under trees, and a full tree
        with its draft slots fits before ``max_model_len``."""
        r = self.runner
        batch = r.input_batch
        budget = self.cfg.num_draft_tokens
        slots = draft_slots(self.cfg.policy)
        todo = []
        for i, rid in enumerate(batch.req_ids):
            self.proposals.pop(rid, None)
            if i >= len(sampled_token_ids) or not sampled_token_ids[i]:
                continue
            state = r.requests.get(rid)
            if not tree_eligible(getattr(state, "sampling_params", None)):
                self.stats.fallback_requests += 1
                continue
            n_tokens = int(batch.num_tokens_no_spec[i])
            if n_tokens + budget + max(budget, slots) + 1 > r.max_model_len:
                continue  # too close to the end for a full tree and its draft slots
            todo.append((i, rid, n_tokens))
        return todo

    def _propose_ngram(self, todo: list[tuple[int, str, int]], out: list[list[int]]) -> None:
        from tree_dev.proposer import ngram_trie

        batch = self.runner.input_batch
        for i, rid, n_tokens in todo:
            context = batch.token_ids_cpu[i, :n_tokens].tolist()
            if self.history.max_tokens:
                self.contexts[rid] = context  # into the history when it finishes
            tree, tokens = ngram_trie(context, self.cfg.policy, self.history)
            self._store(rid, tree, tokens, out, i)

    def _propose_model(self, todo: list[tuple[int, str, int]], out: list[list[int]]) -> None:
        draftees = [d for d in (self._draftee(*t) for t in todo) if d is not None]
        eagle = self.cfg.method == "eagle"
        for d, (prop, cached) in zip(draftees, self.drafter.propose(draftees)):
            self.draft_len[d.rid] = cached  # the trunk and root are in the draft cache
            if eagle and cached == len(d.seq):
                self.feats.pop(d.rid, None)  # consumed up to the root
            elif eagle:  # keep the features of what the draft has not consumed
                first, feats = self.feats[d.rid]
                self.feats[d.rid] = (cached, feats[cached - first :])
            self._store(d.rid, prop.tree, prop.tokens, out, d.row, prop.draft_probs)

    def _draftee(self, i: int, rid: str, n_tokens: int):
        """Request ``rid``'s draft sequence and catch-up (None: an EAGLE request without
        the feature history its catch-up needs)."""
        from tree_dev.vllm_plugin.drafter import Draftee

        tokens = self.runner.input_batch.token_ids_cpu[i, :n_tokens].tolist()
        temp, gen = None, None
        if self.cfg.draft_sampling:
            state = self.runner.requests[rid]
            t = float(state.sampling_params.temperature)
            if t >= GREEDY_TEMPERATURE:
                temp, gen = t, state.generator
        if self.cfg.method != "eagle":
            start = min(self.draft_len.get(rid, 0), n_tokens - 1)
            return Draftee(i, rid, tokens, start, None, temp, gen, tokens)
        # element k pairs token k + 1 with the target's feature at k
        seq, start = tokens[1:], self.draft_len.get(rid, 0)
        first, feats = self.feats.get(rid, (None, None))
        if first is None or first > start or first + len(feats) != len(seq):
            self.feats.pop(rid, None)
            self.draft_len.pop(rid, None)
            return None  # no feature history for this request's catch-up
        return Draftee(i, rid, seq, start, feats[start - first :], temp, gen, tokens)

    def _keep_features(self, hidden_states: torch.Tensor) -> None:
        """EAGLE: keep the target's features of this step's newly committed positions."""
        if self.step is None:
            return
        rids, q0, computed, scheduled = self.step
        for i, rid in enumerate(rids):
            nodes = self.accepted.get(rid)
            if nodes is not None:
                rows = [int(q0[i]) + j for j in nodes]
            else:
                rows = list(range(int(q0[i]), int(q0[i]) + int(scheduled[i])))
            if not rows:
                continue
            h = hidden_states[torch.tensor(rows, dtype=torch.int64)].clone()
            pos = int(computed[i])
            prev = self.feats.get(rid)
            if prev is not None and prev[0] + len(prev[1]) == pos:
                self.feats[rid] = (prev[0], torch.cat([prev[1], h]))
            elif prev is None and pos == self.draft_len.get(rid, pos):
                self.feats[rid] = (pos, h)
                self.draft_len[rid] = pos
            else:
                self.feats[rid] = (pos, h)
                self.draft_len[rid] = pos  # history lost: draft KV from here on

    def _store(
        self,
        rid: str,
        tree: TokenTree,
        tokens: list[int],
        out,
        i: int,
        draft_probs: torch.Tensor | None = None,
    ) -> None:
        if tree.num_nodes <= 1:
            return
        if len(self.recorded) < self.cfg.record_trees:
            batch = self.runner.input_batch
            context = batch.token_ids_cpu[i, : int(batch.num_tokens_no_spec[i])]
            self.recorded.append(
                {
                    "req_id": rid,
                    "context": context.tolist(),
                    "parents": tree.parents.tolist(),
                    "tokens": list(tokens),
                }
            )
        self.proposals[rid] = Proposal(tree, list(tokens), draft_probs)
        out[i] = list(tokens[1:])


def _slot(row: torch.Tensor, block_size: int, pos: int) -> int:
    return int(row[pos // block_size]) * block_size + pos % block_size


def tree_runner_of(model_runner) -> TreeRunner | None:
    """The plugin's state on a vLLM model runner (None: no ``tree`` key for this engine)."""
    return getattr(model_runner, "_treespec", None)


def verify_trees(model_runner) -> VerifyTrees | None:
    """The trees of the verify forward a vLLM model runner is about to run (None: no tree
    in this step, or no tree plugin on this runner): set after vLLM prepares the step's
    inputs, before the model's forward. The accuracy capture reads it here."""
    st = tree_runner_of(model_runner)
    return st.verify_trees if st is not None else None
