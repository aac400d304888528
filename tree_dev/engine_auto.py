"""``tree: "auto"`` in the local engine: ``tree_dev.auto`` asked per step which tree each
request gets, told what each step accepted and cost, and its cost model measured on this
machine with the engine's own steps (cached per model and machine).

The engine calls ``LocalAuto.choose`` before drafting (per request, a candidate tree),
``record`` after the walk, ``forget`` when a request leaves. ``calibrate`` times real engine
steps, every candidate at batch sizes 1 and 4 on a repetitive dummy prompt (so n-gram
tries fill), and fits ``auto.CostModel`` to the steps' realised shapes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tree_dev.auto import (
    AutoPolicy,
    Candidate,
    CostModel,
    Shape,
    StepOutcome,
    batch_shape,
    cache_key,
    check_objective,
    default_cache_dir,
    load_cost_model,
    makespan_applies,
    save_cost_model,
    with_catch_up,
)
from tree_dev.requests import Request, SamplingParams
from tree_dev.spec import AutoTreePolicy, NgramPolicy, NoDraftPolicy, Policy

if TYPE_CHECKING:
    from tree_dev.engine import Engine


class LocalAuto:
    """``tree: auto`` for one local ``Engine``: its ``AutoPolicy`` and the calibration.

    ``cost_model``: a given model (no measurement: a deterministic choice, for tests); else
    the model cached under ``cache_dir`` for this target, draft, dtype and machine, or one
    measured now (``calibrate``) and cached.
    """

    def __init__(
        self,
        policy: AutoTreePolicy,
        cost_model: CostModel | None = None,
        objective: str = "tokens",
    ):
        self.policy, self.objective = policy, check_objective(objective)
        if cost_model is not None:  # its choices do not depend on timing
            cost_model = replace(cost_model, learn_drafted=False)
        self.auto = AutoPolicy(policy, cost_model or CostModel(a=1.0, b=0.0, c=0.0, d=0.0))
        self.measured = cost_model is not None
        self._forced: Candidate | None = None

    @property
    def candidates(self) -> list[Candidate]:
        return self.auto.candidates

    @property
    def stats(self) -> dict:
        """``AutoStats.as_dict`` with the candidates and the cost model's coefficients (the
        same keys as the vLLM plugin's ``treespec_tree_stats()["auto"]``)."""
        out = self.auto.stats.as_dict()
        out["candidates"] = [c.name for c in self.candidates]
        out["cost_model"] = self.auto.cost_model.coefficients()
        out["cost_model_measured"] = self.measured
        return out

    def choose(self, batch: Sequence[Request], waiting: int | None = None) -> list[Policy]:
        """Per request, this step's tree; sets ``sampled_drafts`` where the pick draws a
        sampled request's drafts from the draft model. ``waiting``: requests queued for
        a slot (the ``makespan`` objective weighs tokens once none waits)."""
        if self._forced is not None:
            picks = [self._forced] * len(batch)
        else:
            tries = {
                r.req_id: self.auto.step_tries(r.req_id, r.prompt + r.output)
                for r in batch
                if not self.auto.resting(r.req_id)  # given none unread: no tries needed
            }
            reqs = [(r.req_id, r.params.temperature) for r in batch]
            left = None
            if makespan_applies(self.objective, waiting):
                left = {r.req_id: r.params.max_tokens - len(r.output) for r in batch}
            chosen = self.auto.choose(reqs, tries=tries, behind=behind_of(batch), remaining=left)
            picks = [chosen[r.req_id] for r in batch]
        for r, c in zip(batch, picks):
            r.sampled_drafts = c.sampled_drafts and r.mode != "greedy"
        return [c.policy for c in picks]

    def record(
        self,
        batch: Sequence[Request],
        max_depths: Sequence[int],
        paths: dict[int, tuple[list[int], list[int]]],
        seconds: float,
        verify_rows: int | None = None,
    ) -> None:
        """The step's accepted paths and its measured seconds; ``verify_rows``: the tree
        nodes the target verified (a trie's matched nodes, not its budget; the cost model
        sets the seconds against them), default the chosen trees'."""
        if self._forced is not None:
            return
        steps = [StepOutcome(r.req_id, d, paths[r.req_id][0]) for r, d in zip(batch, max_depths)]
        shape = None
        if verify_rows is not None:
            shape = self.auto.step_shape._replace(verify_rows=verify_rows)
        self.auto.record(steps, seconds, shape)

    def forget(self, req_id: int) -> None:
        self.auto.forget(req_id)

    # ------------------------------------------------------------------ calibration
    def load_or_calibrate(self, engine: Engine, cache_dir: str | os.PathLike | None) -> None:
        """The cached cost model of ``engine``'s models on this machine, or ``calibrate``
        and cache it (atomically). Does nothing when a model was given."""
        if self.measured:
            return
        directory = default_cache_dir() if cache_dir is None else Path(cache_dir)
        key = engine_cache_key(engine)
        model = load_cost_model(directory, key)
        if model is None:
            model = self.calibrate(engine)
            save_cost_model(directory, key, model)
        self.auto.cost_model = model
        self.measured = True

    def calibrate(
        self, engine: Engine, batch_sizes: Sequence[int] = (1, 4), steps: int = 4
    ) -> CostModel:
        """Time ``steps`` engine steps of every candidate at each batch size (after one
        untimed step: the draft's catch-up on the prompt) and fit a ``CostModel`` to the
        realised ``(shape, seconds)``: verify rows as proposed, draft levels as forwarded,
        draft rows from the candidates' shapes."""
        if engine.has_work():
            raise RuntimeError("calibrate needs an idle engine")
        gen = torch.Generator().manual_seed(0)
        vocab = engine.vocab_size
        motif = torch.randint(0, vocab, (8,), generator=gen).tolist()
        prompt = (motif * 6)[: max(2, min(48, engine.max_model_len // 2))]
        samples: list[tuple[Shape, float]] = []
        batch_sizes = [b for b in batch_sizes if b <= engine.max_batch] or [1]
        try:
            for cand in self.candidates:
                self._forced = cand
                for bs in batch_sizes:
                    samples += self._time_steps(engine, cand, bs, prompt, steps)
        finally:
            self._forced = None
        return CostModel.fit(samples)

    def _time_steps(
        self, engine: Engine, cand: Candidate, bs: int, prompt: list[int], steps: int
    ) -> list[tuple[Shape, float]]:
        params = SamplingParams(max_tokens=8 * (steps + 1), ignore_eos=True, seed=0)
        ids = [engine.add_request(list(prompt), params) for _ in range(bs)]
        engine._admit()  # the prefill is not a step
        out = []
        try:
            for k in range(steps + 1):
                if not engine.has_work():
                    break
                levels0 = engine.forwards["draft"]
                late = behind_of(engine.requests[i] for i in ids if i in engine.requests)
                shape = batch_shape(with_catch_up(cand.shape, n) for n in late.values())
                t0 = time.perf_counter()
                engine.step()
                seconds = time.perf_counter() - t0
                rows = engine.last_verify_rows
                levels = engine.forwards["draft"] - levels0
                if k > 0:  # the first drafted step carries the catch-up on the prompt
                    rows_d = shape.draft_rows if levels else 0
                    real = Shape(rows, levels, rows_d, 0, shape.drafted, shape.requests)
                    out.append((real, seconds))
        finally:
            for i in ids:
                engine.abort(i)
                engine.requests.pop(i, None)
        return out


def _model_name(model: torch.nn.Module) -> str:
    """A model's name or path, and its parameter count (two heads of one class differ)."""
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    return f"{name}({sum(p.numel() for p in model.parameters())})"


def engine_cache_key(engine: Engine) -> dict[str, str]:
    """The cost-model cache key: the target and draft (names or paths, parameter counts),
    whether the draft is an EAGLE head, dtype, machine and torch version."""
    runner = engine.draft_runner
    draft = "none" if runner is None else ("eagle:" if runner.eagle else "draft:")
    if runner is not None:
        draft += _model_name(runner.model)
    p = next(engine.target.parameters())
    key = cache_key(f"{_model_name(engine.target)}|{draft}", p.dtype, str(p.device))
    key["engine"] = "local"
    return key


def behind_of(requests: Iterable[Request]) -> dict[int, int]:
    """Per request, the committed tokens its draft has not consumed besides the root
    (``AutoPolicy.choose``'s ``behind``: a model tree's catch-up)."""
    return {r.req_id: max(len(r.pending) - 1, 0) for r in requests}


def is_undrafted(policy: Policy) -> bool:
    """Trees the draft model does not grow: ``none`` and n-gram tries."""
    return isinstance(policy, (NoDraftPolicy, NgramPolicy))
