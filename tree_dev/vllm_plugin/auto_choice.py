"""``tree: "auto"`` inside vLLM: ``tree_dev.auto`` asked per step which tree each request
gets, told what the step accepted and how long it took, its cost model fitted on this
machine's steps and cached per model and machine.

The proposer calls ``VllmAuto.choose`` for the requests it drafts for, and ``step_done``
at the start of the next propose: the steps's seconds are the wall time between two
proposes (draft, verify, walk and vLLM's own work of the step whose trees were chosen).
Its accepted paths come from the runner's ``StepEvent`` (``on_step_event``); a request
given ``none`` verified no tree and is recorded as such.

Cost model: the cached one of this model, draft and machine (``$TREESPEC_CACHE_DIR/auto``)
when there is one; else it starts from ``START`` (relative costs: one step, a verify row,
a draft level, a draft row) and is refitted online, every ``REFIT_EVERY`` measured steps,
to the last ``KEEP`` ``(shape, seconds)`` samples (``CostModel.fit``), once they hold at
least ``MIN_SHAPES`` distinct shapes; each fit is cached (atomically) for the next start,
by a background thread when the refit is online (the write's ``fsync`` took 4-70 ms
here, the length of 1-10 toy steps, and a step should not wait on the disk; the
calibration's fit, ``fit_now``, is written before it returns).
A new fit's online corrections (``CostModel.observe``) start from the last ``REPLAY``
samples replayed through it: what it still gets wrong on the latest steps (the drafted
ones' extra seconds above all), not from 1.

Every refit keeps the **anchor**: the steps timed with a candidate forced
(``calibrate_auto``: each candidate at 1 and 4 requests, plain steps among them), cached
with the fit. Served traffic alone cannot tell the coefficients apart: a batch of 8
mostly given ``none`` is plain steps of 8 rows, and its few drafted steps have both more
rows and the speculative path, so a fit to them alone puts a drafted step's fixed cost
``f`` into the cost of a row (the toy at batch 8: ``f`` 0.42 ms calibrated, 0 after a run
served). A step that also prefilled (a request admitted, a chunked prompt) is not a
sample: its seconds hold prompt tokens its shape does not count.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections import Counter, deque
from dataclasses import replace
from pathlib import Path
from typing import Any

from tree_dev.auto import (
    AutoPolicy,
    Candidate,
    CostModel,
    Shape,
    StepOutcome,
    batch_shape,
    cache_key,
    default_cache_dir,
    is_branched,
    load_cost_model,
    save_cost_model,
    with_catch_up,
)
from tree_dev.spec import AutoTreePolicy
from tree_dev.step import StepEvent

#: the cost model before any measurement: relative costs (a step, a verify row, a draft
#: level, a draft row, a branched tree's tree attention, a step with drafts over a plain
#: one), about a small model on a CPU at batch 1
START = CostModel(a=1.0, b=0.01, c=0.15, d=0.005, e=0.1, f=0.2)
#: a refit reads up to 2 * KEEP samples (the anchor and the served): 5-15 ms on a CPU,
#: so every 256 steps it is a few hundredths of a millisecond a step
REFIT_EVERY = 256
KEEP = 1024
REPLAY = 64
MIN_SHAPES = 4


def prefill_tokens(scheduler_output) -> int:
    """Tokens a vLLM step schedules beyond one row per request and its drafts: prompt
    tokens (a new request, a chunk of a long prompt).

    >>> from types import SimpleNamespace as NS
    >>> def step(**n):  # "a" verifies 2 drafts: 3 rows
    ...     return NS(num_scheduled_tokens=n, scheduled_spec_decode_tokens={"a": [5, 6]})
    >>> prefill_tokens(step(a=3, b=1)), prefill_tokens(step(a=3, c=40))
    (0, 39)
    """
    spec = scheduler_output.scheduled_spec_decode_tokens
    counts = scheduler_output.num_scheduled_tokens
    return sum(max(int(n) - 1 - len(spec.get(rid, ())), 0) for rid, n in counts.items())


class VllmAuto:
    """``tree: auto`` for one plugin runner (``model``, ``draft``: names for the cache key;
    ``cost_model``: a given one, never refitted)."""

    def __init__(
        self,
        policy: AutoTreePolicy,
        model: str,
        draft: str,
        dtype: object,
        device: str,
        cost_model: CostModel | None = None,
        cache_dir: str | os.PathLike | None = None,
    ):
        self.key = cache_key(f"{model}|{draft}", dtype, device)
        self.key["engine"] = "vllm"
        self.dir = default_cache_dir() if cache_dir is None else Path(cache_dir)
        self.fixed = cost_model is not None
        if cost_model is not None:  # its choices do not depend on timing
            cost_model = replace(cost_model, learn_drafted=False)
        if cost_model is None:
            cost_model = load_cost_model(self.dir, self.key)
        self.measured = cost_model is not None
        start = cost_model if cost_model is not None else CostModel(**START.__dict__)
        self.auto = AutoPolicy(policy, start)
        self.samples: deque[tuple[Shape, float]] = deque(maxlen=KEEP)
        # the forced steps every refit keeps (see the module), the cached ones first
        self.anchor: deque[tuple[Shape, float]] = deque(start.anchor, maxlen=KEEP)
        self._shape_counts: Counter[Shape] = Counter()  # the samples' distinct shapes
        self._events: list[Any] = []
        self._chosen: dict[Any, Candidate] = {}
        self._behind: dict[Any, int] = {}  # per request, its draft's catch-up this step
        self._forced: Candidate | None = None
        self._t_choose: float | None = None  # this step's choose (its drafting began)
        self._draft_s: float | None = None  # its drafting's seconds
        self._t_begin: float | None = None  # its verify step's start (on_update_states)
        self._prefill = 0  # prompt tokens that step also ran
        self._since_fit = 0
        self._prefill_steps = 0  # timed steps left out: they prefilled too
        self._saving: threading.Thread | None = None  # the online refit's cache write

    @property
    def stats(self) -> dict:
        out = self.auto.stats.as_dict()
        out["candidates"] = [c.name for c in self.auto.candidates]
        out["cost_model"] = self.auto.cost_model.coefficients()
        out["cost_model_measured"] = self.measured
        out["samples"] = len(self.samples)
        out["anchor_samples"] = len(self.anchor)
        out["prefill_steps"] = self._prefill_steps
        return out

    # ------------------------------------------------------------- the step's clock
    def step_begin(self, prefill: int = 0) -> None:
        """vLLM began a step (the verify of the trees chosen at the last ``choose``);
        ``prefill``: the prompt tokens it runs besides them (``prefill_tokens``)."""
        self._t_begin = time.perf_counter()
        self._prefill = prefill

    def drafted(self) -> None:
        """The propose that chose this step's trees has drafted them."""
        if self._t_choose is not None:
            self._draft_s = time.perf_counter() - self._t_choose

    def on_step_event(self, event: StepEvent) -> None:
        """The runner's step event: the accepted paths of the trees just verified."""
        self._events.extend(event.requests)

    def step_done(self) -> None:
        """Close the step chosen at the last ``choose`` (called as the next propose
        starts): its records, and its seconds: the drafting plus the verify step from
        its start to now (an idle engine between the two is not counted; a step that
        also prefilled is not timed)."""
        now = time.perf_counter()
        if self._chosen:
            got = {r.req_id: r for r in self._events}
            records = [
                got.get(rid) or StepOutcome(rid, 0, [0])  # none, or a tree vLLM did not verify
                for rid in self._chosen
            ]
            seconds = None
            began = self._t_begin
            if self._draft_s is not None and began is not None and began >= self._t_choose:
                seconds = self._draft_s + (now - began)
                if self._prefill > 0:
                    seconds, self._prefill_steps = None, self._prefill_steps + 1
            shape = self._realised_shape(got)
            if self._forced is None:
                self.auto.record(records, seconds, shape)
            if seconds is not None and shape.verify_rows > 0:
                if self._forced is not None:
                    self.anchor.append((shape, seconds))
                else:
                    self._keep_sample(shape, seconds)
                    self._since_fit += 1
                    self._maybe_refit()
        self._events, self._chosen, self._draft_s = [], {}, None

    def _realised_shape(self, got: dict) -> Shape:
        """The closed step's shape as run: a verified tree's own nodes (a trie that matched
        little is smaller than its budget; a tree vLLM cut is its prefix), the root alone
        for a request with no verified tree (``none``, a trie without a match); draft
        levels and rows of the candidate when its tree was drafted by the model, its
        catch-up included (``shapes.with_catch_up``); branched as the verified tree is
        (the runner gives a chain's rows to vLLM's own kernel); drafted when any tree was
        verified (the step left vLLM's plain path)."""
        parts = []
        for rid, cand in self._chosen.items():
            step = got.get(rid)
            if step is None:
                parts.append(Shape(1, 0, 0))
            else:
                caught = with_catch_up(cand.shape, self._behind.get(rid, 0))
                levels, rows = caught.draft_levels, caught.draft_rows
                branched = is_branched(step.parents)
                parts.append(Shape(len(step.parents), levels, rows, branched, 1))
        return batch_shape(parts)

    def choose(
        self,
        requests: list[tuple[str, float]],
        tries: dict | None = None,
        behind: dict | None = None,
        remaining: dict | None = None,
    ) -> dict[str, Candidate]:
        """``[(request id, temperature), ...]`` -> this step's candidate per request
        (``tries``, ``behind``, ``remaining``: as ``AutoPolicy.choose``)."""
        self._t_choose = time.perf_counter()
        self._behind = dict(behind or {})
        if self._forced is not None:
            self._chosen = dict.fromkeys((rid for rid, _ in requests), self._forced)
        else:
            self._chosen = self.auto.choose(
                requests, tries=tries, behind=behind, remaining=remaining
            )
        return self._chosen

    def forget(self, req_id: str) -> None:
        self.auto.forget(req_id)

    @property
    def forced(self) -> Candidate | None:
        """The candidate every request is given (``force``), None while auto chooses."""
        return self._forced

    # ------------------------------------------------------------- calibration
    def force(self, name: str | None) -> None:
        """Give every request candidate ``name`` (None: choose again), for calibration:
        forced steps are timed, not counted as acceptance."""
        if name is None:
            self._forced = None
            return
        by_name = {c.name: c for c in self.auto.candidates}
        if name not in by_name:
            raise ValueError(f"treespec auto: no candidate {name!r}; have {sorted(by_name)}")
        self._forced = by_name[name]

    def _keep_sample(self, shape: Shape, seconds: float) -> None:
        """One timed step into ``samples`` (the oldest dropped beyond ``KEEP``), its
        shape counted, so a refit check does not scan them all every step."""
        if len(self.samples) == self.samples.maxlen:
            old, _ = self.samples[0]
            self._shape_counts[old] -= 1
            if not self._shape_counts[old]:
                del self._shape_counts[old]
        self.samples.append((shape, seconds))
        self._shape_counts[shape] += 1

    def fit_now(self) -> dict:
        """Fit the cost model to the timed steps (the anchor's and served ones) now and
        cache it (``calibrate_auto``)."""
        shapes = set(self._shape_counts) | {s for s, _ in self.anchor}
        if len(shapes) < 2:
            n = len(self.samples) + len(self.anchor)
            raise ValueError(
                f"treespec auto: {n} timed steps of fewer than 2 shapes: nothing to fit"
            )
        self._fit(background=False)
        return self.stats

    def _maybe_refit(self) -> None:
        if self.fixed or self._since_fit < REFIT_EVERY:
            return
        if len(self._shape_counts) < MIN_SHAPES and not self.anchor:
            return
        self._fit()

    def _fit(self, background: bool = True) -> None:
        """Refit the cost model to the anchor and the served samples, use it, and cache
        it: in a background thread when ``background`` (see the module)."""
        self._since_fit = 0
        fit = CostModel.fit([*self.anchor, *self.samples])
        fit.anchor = list(self.anchor)
        # its corrections start from what it gets wrong on the latest served steps
        for shape, seconds in list(self.samples)[-REPLAY:]:
            fit.observe(shape, seconds)
        self.auto.cost_model = fit
        self.measured = True
        self.wait_saved()  # one write at a time: the newer fit is written last
        if background:
            self._saving = threading.Thread(
                target=self._save, args=(fit,), name="treespec-cost-model-save", daemon=True
            )
            self._saving.start()
        else:
            self._save(fit)

    def _save(self, fit: CostModel) -> None:
        try:
            save_cost_model(self.dir, self.key, fit)
        except OSError as e:  # a read-only cache directory: the fit is used, not kept
            warnings.warn(
                f"treespec auto: cost model not cached: {e}", RuntimeWarning, stacklevel=2
            )

    def wait_saved(self, timeout: float | None = None) -> None:
        """Wait for the online refit's cache write in flight, if any (a test, or a
        caller about to read the cache)."""
        if self._saving is not None:
            self._saving.join(timeout)
            if not self._saving.is_alive():
                self._saving = None


def calibrate_auto(
    llm, batch_sizes: tuple[int, ...] = (1, 4), tokens: int = 40, force: bool = False
) -> dict:
    """Measure ``tree: auto``'s cost model on a running ``vllm.LLM``: every candidate
    forced in turn on ``batch_sizes`` concurrent greedy requests of repetitive prompts (so
    n-gram tries fill; every other one repeats two motifs that part ways, so its tries
    branch and the fit sees what a branched tree costs), ``tokens`` tokens each, the steps
    timed by the worker, then fitted and cached (``$TREESPEC_CACHE_DIR/auto``). Skipped
    when the worker already has a measured (cached) model, unless ``force``. Returns the
    worker's auto statistics.

    ``bench.auto_policy`` calls it after an auto engine starts; without it (``serve.py
    --engine vllm`` hands over to vLLM's own server), the worker refits online from the
    steps it serves, starting from the cached model when there is one.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    stats = llm.collective_rpc("treespec_tree_stats")[0].get("auto")
    if stats is None:
        raise ValueError("calibrate_auto: the engine's tree is not auto")
    if stats["cost_model_measured"] and not force:
        return stats
    motif = [11, 23, 5, 42, 17, 8, 31, 2]
    fork = [11, 7, 5, 42, 17, 9, 31, 2]  # 11 and 17 go on two ways: tries that branch
    prompts = [
        TokensPrompt(prompt_token_ids=motif * 6),
        TokensPrompt(prompt_token_ids=(motif + fork) * 3),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    try:
        for name in stats["candidates"]:
            llm.collective_rpc("treespec_auto_force", args=(name,))
            for bs in batch_sizes:
                batch = [prompts[i % 2] for i in range(bs)]
                llm.generate(batch, params, use_tqdm=False)
    finally:
        llm.collective_rpc("treespec_auto_force", args=(None,))
    return llm.collective_rpc("treespec_auto_fit")[0]
