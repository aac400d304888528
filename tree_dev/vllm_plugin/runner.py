"""One vLLM model runner's tree state: verify, walk, compact, propose.

A step of a request with a tree, in vLLM's order:

1. ``propose`` (end of the previous step): the drafter grows a tree below the request's
   root (its last sampled token); its draft tokens go to vLLM in breadth-first order, the
   shape stays here, keyed by request id. The scheduler may cut the list; a BFS prefix of
   a tree is a tree, so the cut tree is verified.
2. ``prepare_verify`` (after vLLM's ``_prepare_inputs``): the request's ``1 + n`` query
   rows are root + nodes; their RoPE positions become ``P + depth`` (slots stay linear,
   ``P + node``), and the forward's ``attention.TreeRows`` (published in vLLM's forward
   context) tell the attention override which rows are tree rows. A chain's rows are left
   to vLLM (its positions and causal mask are already the chain's).
3. ``walk_and_compact`` (after vLLM's sampler): ``kernels.tree_walk`` on the target's
   logits at every node gives the accepted path and the bonus token; the row of vLLM's
   sampler output is replaced by them (``-1`` padded, as vLLM's rejection sampler does).
   The accepted nodes' K/V move to slots ``P+1 .. P+a`` through the backend's own cache
   write, so when vLLM's scheduler rewinds ``num_computed_tokens`` to ``P + 1 + a`` the
   cache holds exactly the accepted path (``compaction``). A ``StepEvent`` (the core's, as
   the local engine sends) goes to ``on_step`` subscribers: ``Stats`` among them.

Requests whose sampling needs a feature that assumes chains (penalties, bad words, logit
bias, min_p / top_k, min_tokens, logprobs, structured output, allowed token ids, logits
processors) get no tree: vLLM decodes them plainly, which is exact, only not faster.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tree_dev.auto.shapes import is_branched
from tree_dev.proposer import tree_of
from tree_dev.spec import AutoTreePolicy
from tree_dev.step import (
    Proposal,
    RequestStep,
    StepEvent,
    VerifyTrees,
    walk_mode,
    walk_trees,
)
from tree_dev.tree import TokenTree
from tree_dev.vllm_plugin import attention
from tree_dev.vllm_plugin.auto_choice import prefill_tokens
from tree_dev.vllm_plugin.compaction import compact_accepted
from tree_dev.vllm_plugin.config import TreeConfig
from tree_dev.vllm_plugin.proposing import TreeProposer
from tree_dev.vllm_plugin.stats import Stats


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


class TreeRunner:
    """Tree speculative decoding state of one ``GPUModelRunner`` (CPU runner included)."""

    def __init__(self, runner, cfg: TreeConfig):
        self.runner = runner
        self.cfg = cfg
        self.start_policy = cfg.policy  # the tree the engine reserved KV slots for
        self.proposer = TreeProposer(self)
        self.verify: _Verify | None = None
        self.verify_trees: VerifyTrees | None = None  # this step's, for other tooling
        self.verify_rows: attention.TreeRows | None = None  # this forward's tree rows
        self.stats = Stats()
        self._step_listeners: list[Callable[[StepEvent], None]] = [self.stats.record]
        if isinstance(cfg.policy, AutoTreePolicy):  # tree: auto chooses per request
            from tree_dev.vllm_plugin.auto_choice import VllmAuto

            mc, sc = runner.vllm_config.model_config, runner.speculative_config
            draft = f"{cfg.method}:{getattr(sc, 'model', None)}"
            self.proposer.auto = VllmAuto(
                cfg.policy, str(mc.model), draft, mc.dtype, str(runner.device)
            )
            self.on_step(self.proposer.auto.on_step_event)
        self.target_layers: list[str] = []
        # per step: (req ids, first query row, computed tokens, scheduled tokens) per row
        self.step: tuple[list[str], np.ndarray, np.ndarray, np.ndarray] | None = None
        self.accepted: dict[str, list[int]] = {}  # this step's accepted nodes (root first)
        # Every drafter runs after vLLM's bookkeeping (sampled tokens as lists, the
        # persistent batch's token ids up to date): the runner's "padded drafter batch"
        # path would hand vLLM's own GPU-side drafting inputs to a chain proposer.
        spec = runner.speculative_config
        if spec is not None:
            spec.disable_padded_drafter_batch = True
        from tree_dev.vllm_plugin.worker_methods import Profiler

        self._profile = Profiler.from_env()
        # developer switches for A/B runs (bench.spec_floor): TREESPEC_SAMPLER=vllm keeps
        # vLLM's rejection sampler on every speculative step, as before ``sampler_output``
        # skipped it; TREESPEC_SPEC_INPUTS=always keeps vLLM's speculative inputs on steps
        # without drafts, as before ``plain_step``
        self._vllm_sampler = os.environ.get("TREESPEC_SAMPLER") == "vllm"
        self._always_spec_inputs = os.environ.get("TREESPEC_SPEC_INPUTS") == "always"
        # the step's drafts travel with its ModelRunnerOutput (hooks._sample_tokens): only
        # where vLLM's engine core asks for drafts after each step (no async scheduling,
        # one pipeline stage); TREESPEC_DRAFTS_IN_OUTPUT=0: never (A/B)
        self.drafts_in_output = (
            os.environ.get("TREESPEC_DRAFTS_IN_OUTPUT", "1") != "0"
            and not getattr(runner, "use_async_scheduling", False)
            and runner.vllm_config.parallel_config.pipeline_parallel_size == 1
        )
        self.taking_drafts_for_output = False  # hooks: the take that fills the output

    # ----------------------------------------------------------------- set-up
    def on_step(self, listener: Callable[[StepEvent], None]) -> None:
        """Call ``listener(StepEvent)`` after every verify step with trees: each tree
        request's tree, accepted path, emitted tokens and walk mode, and the step's
        ``walk`` / ``compact`` / ``tree_attention`` seconds."""
        self._step_listeners.append(listener)

    def on_model_loaded(self) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        from tree_dev.vllm_plugin.attention import TreeRowsMixin

        r = self.runner
        layers = get_layers_from_vllm_config(r.vllm_config, Attention)
        plain = sorted(
            n for n, layer in layers.items() if not isinstance(layer.impl, TreeRowsMixin)
        )
        if plain:  # never verify trees with a causal kernel: outputs would silently change
            raise ValueError(
                f"treespec: attention layers {plain[:3]}{' ...' if len(plain) > 3 else ''} "
                f"got {type(layers[plain[0]].impl).__name__}, not a tree attention backend "
                "(another attention backend was selected for this engine: its tree rows "
                "would be verified as causal rows)"
            )
        draft_names: set[str] = set()
        if self.cfg.uses_draft_model:
            draft_names = set(getattr(r.drafter, "_draft_attn_layer_names", set()))
            from tree_dev.vllm_plugin.drafter import ModelDrafter

            self.proposer.drafter = ModelDrafter(
                self, r.drafter, sorted(draft_names), eagle=self.cfg.method == "eagle"
            )
        self.target_layers = sorted(n for n in layers if n not in draft_names)

    def on_update_states(self, scheduler_output) -> None:
        """Forget finished and preempted requests; new and resumed ones start over."""
        if self.proposer.auto is not None:
            self.proposer.auto.step_begin(prefill_tokens(scheduler_output))
        gone = set(scheduler_output.finished_req_ids)
        gone |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        gone |= set(getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", ()))
        for new in scheduler_output.scheduled_new_reqs:
            gone.add(new.req_id)
        self.proposer.forget(scheduler_output.finished_req_ids, gone)

    # ----------------------------------------------------------------- verify
    def plain_step(self, scheduler_output) -> bool:
        """Whether this step runs as vLLM without speculation: no request is scheduled
        with draft tokens (``tree: auto`` chose ``none`` for all, no trie matched, or every
        request is in its prefill).

        vLLM 0.32's runner takes its speculative path on every step of a speculative
        engine: spec-decode metadata, logits rows per draft, the rejection sampler. With
        no draft in the batch none of it has anything to do; the plain path's inputs
        (one logits row per request, its last) are the same rows, sampled by vLLM's
        plain sampler. Counted in ``sampler_steps["plain"]``."""
        if self._always_spec_inputs or any(scheduler_output.scheduled_spec_decode_tokens.values()):
            return False
        self.stats.sampler_steps["plain"] += 1
        return True

    def prepare_verify(self, scheduler_output, num_scheduled_tokens: np.ndarray) -> None:
        """Depth positions and tree rows for the requests whose drafts are a tree."""
        r = self.runner
        batch = r.input_batch
        specs = scheduler_output.scheduled_spec_decode_tokens
        self.verify = None
        self.verify_rows = None
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
            prop = self.proposer.proposals.get(rid)
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
        branched = [k for k, t in enumerate(trees) if is_branched(t)]
        if not branched:
            return
        idx = [idx[k] for k in branched]
        prefix = [prefix[k] for k in branched]
        trees = [trees[k] for k in branched]
        rows = attention.verify_tree_rows(
            trees, [int(qsl[i]) for i in idx], prefix, idx, self.cfg.kernel_backend
        )
        if self.cfg.debug_disable != "positions":
            plen = torch.tensor(prefix, dtype=torch.int64).repeat_interleave(
                torch.tensor([t.num_nodes for t in trees])
            )
            depth = torch.cat([t.depth for t in trees])
            r.positions[rows.row_index] = (plen + depth).to(r.positions.dtype)
        if self.cfg.debug_disable != "mask":  # "mask": vLLM's causal attention, the planted bug
            self.verify_rows = rows

    # ----------------------------------------------------------------- walk
    def sampler_output(self, logits: torch.Tensor, spec_meta):
        """The step's ``SamplerOutput`` before the walk, without vLLM's rejection sampler
        where it has nothing to do; None: run vLLM's (its output goes to the walk too).

        In vLLM 0.32 a speculative engine runs the rejection sampler on every step, also
        for requests with no draft; at temperature > 0 it draws a ``[requests, vocab]``
        exponential for recovered tokens even when no draft is verified (about 7 ms a step
        for 8 requests of a 49152-token vocabulary on this CPU). Here every request that
        drafted is a tree (``prepare_verify``), which the walk decides; so:

        - every request verifies a tree: ``-1`` everywhere (the walk writes every row);
        - else: vLLM's sampler over the requests' last rows (``bonus_logits_indices``), as
          the rejection sampler samples a request with no draft, ``-1`` padded; the walk
          then overwrites the tree requests' rows;
        - a request asks for logprobs (their rows are the rejection sampler's): None.

        A step where no request drafted runs vLLM's plain inputs (``plain_step``):
        ``spec_meta`` is None, and so is the answer (vLLM's plain sampler). With
        ``TREESPEC_SPEC_INPUTS=always`` such a step is the second case for every request.
        """
        if spec_meta is None or self._vllm_sampler:
            return None
        r, v = self.runner, self.verify
        batch, sm = r.input_batch, r.input_batch.sampling_metadata
        trees = 0 if v is None else len(v.req_index)
        if sm.max_num_logprobs is not None or (v is None and any(spec_meta.num_draft_tokens)):
            self.stats.sampler_steps["rejection"] += 1
            return None
        from vllm.v1.outputs import SamplerOutput

        batch.update_async_output_token_ids()
        width = max(spec_meta.num_draft_tokens) + 1
        ids = torch.full((batch.num_reqs, width), -1, dtype=torch.int32)
        if trees == batch.num_reqs:
            self.stats.sampler_steps["trees_only"] += 1
        else:
            # no draft in the step: one logits row per request, the bonus rows themselves
            last = logits if width == 1 else logits[spec_meta.bonus_logits_indices]
            bonus = r.sampler(
                logits=last,
                sampling_metadata=sm,
                predict_bonus_token=True,  # penalties see no draft tokens, as vLLM's
            ).sampled_token_ids
            ids[:, :1] = bonus.to(device=ids.device, dtype=ids.dtype)[:, :1]
            self.stats.sampler_steps["bonus_rows"] += 1
        return SamplerOutput(sampled_token_ids=ids, logprobs_tensors=None)

    def walk_and_compact(self, logits: torch.Tensor, spec_meta, sampler_output) -> None:
        """Replace the tree requests' rows of vLLM's sampler output; compact their KV; send
        the step's ``StepEvent``."""
        v, rows_used = self.verify, self.verify_rows
        self.verify = self.verify_rows = None
        if v is None or spec_meta is None:
            return
        t0 = time.perf_counter()
        sm = self.runner.input_batch.sampling_metadata
        n_sampled = np.asarray(spec_meta.num_draft_tokens, dtype=np.int64) + 1
        starts = np.concatenate([[0], np.cumsum(n_sampled)[:-1]])
        rows = v.req_index
        first = [int(starts[i]) for i in rows]
        modes = [self._mode(sm, v, j) for j in range(len(rows))]
        res = walk_trees(
            [logits[f : f + t.num_nodes] for f, t in zip(first, v.trees)],
            v.proposals,
            modes,
            sm.temperature[rows].tolist() if sm.temperature is not None else [0.0] * len(rows),
            sm.top_p[rows].tolist() if sm.top_p is not None else None,
            [sm.generators.get(i) for i in rows],
            attention.tree_batch,
            self.cfg.kernel_backend,
        )
        out = sampler_output.sampled_token_ids
        moves = []  # (batch row, prefix, accepted nodes)
        for j, i in enumerate(rows):
            nodes, emitted = res.accepted[j], res.emitted[j]
            out[i].fill_(-1)
            out[i, : len(emitted)] = torch.tensor(emitted, dtype=out.dtype)
            moves.append((i, v.prefix_lens[j], nodes))
            self.accepted[v.req_ids[j]] = nodes
        t1 = time.perf_counter()
        if self.cfg.debug_disable != "compaction":
            compact_accepted(self.runner, self.target_layers, moves)
        timings = {"walk": t1 - t0, "compact": time.perf_counter() - t1}
        timings["tree_attention"] = rows_used.seconds if rows_used is not None else 0.0
        self._send(v, res, modes, timings)

    def _send(self, v: _Verify, res, modes: list[str], timings: dict[str, float]) -> None:
        """The step's ``StepEvent`` to every subscriber."""
        tokens = self.runner.input_batch.token_ids_cpu
        reqs = [
            RequestStep(
                rid,
                p,
                tokens[i, : p + 1].tolist(),
                prop.tree.parents.tolist(),
                list(prop.tokens),
                prop.tree.max_depth,
                list(res.accepted[j]),
                list(res.emitted[j]),
                modes[j],
            )
            for j, (i, rid, p, prop) in enumerate(
                zip(v.req_index, v.req_ids, v.prefix_lens, v.proposals)
            )
        ]
        event = StepEvent(reqs, timings)
        for listener in self._step_listeners:
            listener(event)

    @staticmethod
    def _mode(sm, v: _Verify, j: int) -> str:
        """The walk of tree ``j``: greedy, or lossless sampling of top-ranked drafts
        (``target_only``) or of sampled drafts (``draft_probs``)."""
        if sm.all_greedy or sm.temperature is None:
            return "greedy"
        sampled_drafts = v.proposals[j].draft_probs is not None
        return walk_mode(float(sm.temperature[v.req_index[j]]), sampled_drafts)

    # ----------------------------------------------------------------- propose
    def propose(self, scheduler_output, sampled_token_ids, hidden_states=None) -> list[list[int]]:
        """The next tree of every request that sampled this step (BFS draft tokens)."""
        t0 = time.perf_counter()
        try:
            return self.proposer.propose(
                scheduler_output, sampled_token_ids, hidden_states, self.step, self.accepted
            )
        finally:
            self.stats.seconds["propose"] += time.perf_counter() - t0
            if self._profile is not None:
                self._profile.tick()


def tree_runner_of(model_runner) -> TreeRunner | None:
    """The plugin's state on a vLLM model runner (None: no ``tree`` key for this engine)."""
    return getattr(model_runner, "_treespec", None)


def verify_trees(model_runner) -> VerifyTrees | None:
    """The trees of the verify forward a vLLM model runner is about to run (None: no tree
    in this step, or no tree plugin on this runner): set after vLLM prepares the step's
    inputs, before the model's forward. The accuracy capture reads it here."""
    st = tree_runner_of(model_runner)
    return st.verify_trees if st is not None else None
