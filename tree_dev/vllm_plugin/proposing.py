"""The propose half of the plugin's runner: the next tree of every request.

Per request it keeps the proposed tree (verified next step), how much of the request the
draft's cache holds, the EAGLE feature history and the n-gram trie's history. Trees come
from ``tree_dev.proposer.ngram_trie`` (method ``ngram``) or from the core's
``grow_trees`` on vLLM's draft model (``drafter.ModelDrafter``: ``draft_model``,
``eagle``). Requests whose sampling needs a feature that assumes chains get none
(``tree_eligible``).
"""

from __future__ import annotations

import torch

from tree_dev.auto import makespan_applies
from tree_dev.proposer import NgramHistory
from tree_dev.spec import is_ngram
from tree_dev.step import GREEDY_TEMPERATURE, Proposal
from tree_dev.tree import TokenTree
from tree_dev.vllm_plugin.config import draft_slots
from tree_dev.vllm_plugin.eagle_features import FeatureHistory


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


class TreeProposer:
    """Proposing state of one ``TreeRunner`` (``tr``: its config, vLLM runner and stats)."""

    def __init__(self, tr):
        self.tr = tr
        self.proposals: dict[str, Proposal] = {}
        self.draft_len: dict[str, int] = {}  # sequence elements in the request's draft cache
        # an ngram:...,history=H trie: finished requests' tokens, and the running ones'
        self.history = NgramHistory(getattr(tr.cfg.policy, "history", 0))
        self.contexts: dict[str, list[int]] = {}
        self.features = FeatureHistory(self.draft_len)  # EAGLE
        self.recorded: list[dict] = []  # the first cfg.record_trees proposals
        self.drafter = None  # drafter.ModelDrafter, once the model is loaded
        self.auto = None  # auto_choice.VllmAuto under tree: auto (TreeRunner sets it)

    @property
    def cfg(self):
        return self.tr.cfg

    def forget(self, finished: set[str], gone: set[str]) -> None:
        """Drop the state of requests that are ``gone`` (finished, preempted, restarted);
        finished ones' tokens go into the n-gram history."""
        for rid in finished:
            seen = self.contexts.pop(rid, None)
            if seen is not None:
                self.history.add(seen)
        for rid in gone:
            if self.auto is not None:
                self.auto.forget(rid)
            self.contexts.pop(rid, None)
            self.proposals.pop(rid, None)
            self.draft_len.pop(rid, None)
            self.features.forget(rid)

    def propose(
        self, scheduler_output, sampled_token_ids, hidden_states, step, accepted
    ) -> list[list[int]]:
        """Per batch row, the draft tokens (BFS, root excluded) of its next tree; empty
        for rows that get none. ``step`` and ``accepted``: the runner's description of the
        step just verified (EAGLE keeps the features of what it committed)."""
        if self.cfg.method == "eagle" and hidden_states is not None and step is not None:
            self.features.keep(hidden_states, step, accepted)
        if self.auto is not None:
            self.auto.step_done()
        out: list[list[int]] = [[] for _ in self.tr.runner.input_batch.req_ids]
        todo = self._eligible(sampled_token_ids)
        if not todo or getattr(scheduler_output, "num_spec_tokens_to_schedule", None) == 0:
            return out
        if self.auto is not None:
            self._propose_auto(todo, out, self._remaining(scheduler_output, todo))
            self.auto.drafted()
        elif is_ngram(self.cfg.policy):
            self._propose_ngram(todo, out)
        else:
            self._propose_model(todo, out)
        return out

    def _remaining(self, scheduler_output, todo: list[tuple[int, str, int]]) -> dict | None:
        """Per request, its tokens left at most (its ``max_tokens`` less its output, within
        the model length), where ``tree: auto`` weighs tokens by what they shorten the
        batch (``auto.makespan_applies``: ``auto_objective: makespan`` and the scheduler's
        ``treespec_waiting`` 0); else None: every token alike."""
        waiting = getattr(scheduler_output, "treespec_waiting", None)
        if not makespan_applies(self.cfg.auto_objective, waiting):
            return None
        r = self.tr.runner
        remaining = {}
        for _, rid, n_tokens in todo:
            state = r.requests[rid]
            left = r.max_model_len - n_tokens
            max_tokens = getattr(state.sampling_params, "max_tokens", None)
            if max_tokens is not None:
                left = min(left, max_tokens - len(state.output_token_ids))
            remaining[rid] = max(left, 0)
        return remaining

    def _propose_auto(
        self, todo: list[tuple[int, str, int]], out: list[list[int]], remaining: dict | None = None
    ) -> None:
        """``tree: auto``: each request's tree of this step (``VllmAuto.choose``): none,
        an n-gram trie, or a tree the draft model grows (sampled drafts where chosen);
        ``remaining``: per request, its tokens left (``_remaining``)."""
        states, tokens = self.tr.runner.requests, self.tr.runner.input_batch.token_ids_cpu
        temps = [float(states[rid].sampling_params.temperature) for _, rid, _ in todo]
        auto = self.auto.auto
        forced = self.auto.forced is not None  # a forced tree: nothing is chosen
        built = {  # a resting request is given none unread: no tries needed
            rid: auto.step_tries(rid, tokens[i, :n].tolist())
            for i, rid, n in todo
            if not forced and not auto.resting(rid)
        }
        behind = {rid: self._behind(rid, n) for _, rid, n in todo}
        requests = [(rid, t) for (_, rid, _), t in zip(todo, temps)]
        picks = self.auto.choose(requests, built, behind, remaining)
        model = []
        for (i, rid, n_tokens), temp in zip(todo, temps):
            cand = picks[rid]
            if is_ngram(cand.policy):
                trie = built.get(rid, {}).get(cand.name)
                if trie is not None and not self.history.max_tokens:  # built for the choice
                    self._store(rid, trie.tree, trie.tokens, out, i)
                else:
                    self._propose_ngram([(i, rid, n_tokens)], out, cand.policy)
            elif cand.depth > 0:
                sampled = cand.sampled_drafts and temp >= GREEDY_TEMPERATURE
                model.append(((i, rid, n_tokens), cand.policy, sampled))
        if model:
            self._propose_model([t for t, _, _ in model], out, [(p, s) for _, p, s in model])

    def _behind(self, rid: str, n_tokens: int) -> int:
        """Committed elements of request ``rid`` (``n_tokens`` tokens) its draft has not
        consumed besides the root: the catch-up its next model tree forwards first (0
        without a draft model). An EAGLE draft sequence pairs token ``k + 1`` with the
        target's feature at ``k``: one element fewer than tokens."""
        if self.drafter is None:
            return 0
        seq_len = n_tokens - 1 if self.cfg.method == "eagle" else n_tokens
        return max(seq_len - self.draft_len.get(rid, 0) - 1, 0)

    def _eligible(self, sampled_token_ids) -> list[tuple[int, str, int]]:
        """``(batch row, request id, committed tokens)`` of the requests that get a tree
        now: they sampled this step, their sampling is exact under trees, and a full tree
        with its draft slots fits before ``max_model_len``."""
        r = self.tr.runner
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
                self.tr.stats.fallback_requests += 1
                continue
            n_tokens = int(batch.num_tokens_no_spec[i])
            if n_tokens + budget + max(budget, slots) + 1 > r.max_model_len:
                continue  # too close to the end for a full tree and its draft slots
            todo.append((i, rid, n_tokens))
        return todo

    def _propose_ngram(
        self, todo: list[tuple[int, str, int]], out: list[list[int]], policy=None
    ) -> None:
        from tree_dev.proposer import ngram_trie

        policy = policy or self.cfg.policy
        batch = self.tr.runner.input_batch
        for i, rid, n_tokens in todo:
            context = batch.token_ids_cpu[i, :n_tokens].tolist()
            if self.history.max_tokens:
                self.contexts[rid] = context  # into the history when it finishes
            tree, tokens = ngram_trie(context, policy, self.history)
            self._store(rid, tree, tokens, out, i)

    def _propose_model(
        self, todo: list[tuple[int, str, int]], out: list[list[int]], trees=None
    ) -> None:
        """Trees the draft model grows; ``trees``: per request ``(policy, sampled drafts)``
        (``tree: auto``), else the config's tree and draft sampling."""
        trees = trees or [(None, self.cfg.draft_sampling)] * len(todo)
        made = (self._draftee(*t, policy=p, sampled=s) for t, (p, s) in zip(todo, trees))
        draftees = [d for d in made if d is not None]
        eagle = self.cfg.method == "eagle"
        for d, (prop, cached) in zip(draftees, self.drafter.propose(draftees)):
            self.draft_len[d.rid] = cached  # the trunk and root are in the draft cache
            if eagle:  # keep the features of what the draft has not consumed
                self.features.consumed(d.rid, cached, len(d.seq))
            self._store(d.rid, prop.tree, prop.tokens, out, d.row, prop.draft_probs)

    def _draftee(self, i: int, rid: str, n_tokens: int, policy=None, sampled: bool = False):
        """Request ``rid``'s draft sequence and catch-up (None: an EAGLE request without
        the feature history its catch-up needs); ``policy``: its tree (None: the
        config's), ``sampled``: draw a sampled request's drafts from the draft."""
        from tree_dev.vllm_plugin.drafter import Draftee

        tokens = self.tr.runner.input_batch.token_ids_cpu[i, :n_tokens].tolist()
        temp, gen = None, None
        if sampled:
            state = self.tr.runner.requests[rid]
            t = float(state.sampling_params.temperature)
            if t >= GREEDY_TEMPERATURE:
                temp, gen = t, state.generator
        if self.cfg.method != "eagle":
            start = min(self.draft_len.get(rid, 0), n_tokens - 1)
            return Draftee(i, rid, tokens, start, None, temp, gen, tokens, policy)
        seq = tokens[1:]  # element k pairs token k + 1 with the target's feature at k
        found = self.features.catch_up(rid, len(seq))
        if found is None:
            return None  # no feature history for this request's catch-up
        return Draftee(i, rid, seq, found[0], found[1], temp, gen, tokens, policy)

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
            batch = self.tr.runner.input_batch
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
