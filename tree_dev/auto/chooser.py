"""The choice: per request, the candidate maximising the batch's expected tokens per second
(``choose``); ``AutoPolicy`` runs it for an engine step by step and keeps ``AutoStats``."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, NamedTuple, Protocol

import numpy as np

from tree_dev.auto.acceptance import AcceptanceTracker
from tree_dev.auto.cost_model import CostModel
from tree_dev.auto.shapes import (
    CLASSES,
    Candidate,
    Shape,
    Trie,
    make_candidates,
    step_tries,
    temperature_class,
    trie_walk,
    with_catch_up,
)
from tree_dev.spec import Policy
from tree_dev.step import TRUNK_LIMIT


def batch_shape(shapes: Iterable[Shape]) -> Shape:
    """A batch step's shape: verify and draft rows and branched trees add up; draft levels
    are the deepest request's (each level is one packed draft forward over every request
    still growing); ``drafted`` is 1 when any request's is; requests add up."""
    v = lv = r = br = dr = n = 0
    for s in shapes:
        v, lv, r, br, dr, n = v + s[0], max(lv, s[1]), r + s[2], br + s[3], max(dr, s[4]), n + s[5]
    return Shape(v, lv, r, br, dr, n)


def _best_under_cap(e: np.ndarray, rows: np.ndarray, cost: CostModel, cap: int) -> np.ndarray:
    """Dinkelbach on ``sum(e[i, x_i]) / cost(sum rows, cap, drafted)``: repeat ``x =
    argmax_x sum(e) - lam * cost``, separable per request, with ``lam`` the last ratio,
    until no choice improves on ``lam`` (finite: ``lam`` grows strictly). ``rows[i,
    j]``: request ``i``'s verify rows, draft rows and branched trees under candidate
    ``j``. The step is charged ``f`` (a step with drafts) whatever is chosen: exact for
    every assignment that drafts, which ``choose`` sets against the one that does not.
    Ties: the first column."""
    per_row = cost.additive(rows)  # [requests, candidates]
    fixed = cost.a + cost.c * cap + cost.f + cost.g * len(e)
    idx = np.arange(len(e))
    x = np.argmax(e, axis=1)  # lam = 0: most tokens
    for _ in range(100):
        tokens = float(e[idx, x].sum())
        lam = tokens / max(fixed + float(per_row[idx, x].sum()), 1e-30)
        score = e - lam * per_row
        nxt = np.argmax(score, axis=1)
        gain = float(score[idx, nxt].sum()) - lam * fixed
        if gain <= 1e-12 * max(tokens, 1.0) or np.array_equal(nxt, x):
            break
        x = nxt
    return x


def _none_index(candidates: Sequence[Candidate]) -> int | None:
    """The index of the first undrafted candidate (``none``), None without one."""
    return next((j for j, c in enumerate(candidates) if draft_source(c) is None), None)


def _nothing_pays(
    e: np.ndarray,
    j0: int | None,
    rows: np.ndarray,
    levels: np.ndarray,
    drafted: np.ndarray,
    cost: CostModel,
) -> int | None:
    """The index of ``none`` when giving it to every request is optimal by a sufficient
    test, else None (``choose`` then solves). With ``R0`` the all-``none`` rate, no set
    of switches can beat it when each request's gain from each candidate is at most
    ``R0`` times that candidate's own rows' cost plus ``1 / n`` of its draft levels' and
    of a drafted step's ``f`` (what a batch of ``n`` shares at best): summed over any
    switched set, the gains stay within ``R0`` times the added seconds. Most steps of a
    batch where no tree pays end here, without the solver. ``j0``: the index of
    ``none`` (``_none_index``)."""
    if j0 is None or not np.all(np.isfinite(e[:, j0])):
        return None
    n = len(e)
    per = cost.additive(rows)  # [requests, candidates]
    seconds = cost.a + cost.g * n + float(per[:, j0].sum())
    if not seconds > 0:
        return None
    r0 = float(e[:, j0].sum()) / seconds
    added = per - per[:, j0, None]
    allowance = r0 * (added + (cost.c * levels + cost.f * drafted) / n)
    gain = e - e[:, j0, None]
    ok = ~np.isfinite(e) | (gain <= allowance)
    return j0 if bool(ok.all()) else None


def choose(
    expected: Sequence[Sequence[float | None]],
    candidates: Sequence[Candidate],
    cost_model: CostModel,
    shapes: Sequence[Mapping[int, Shape]] | None = None,
    weights: Sequence[float] | None = None,
) -> list[Candidate]:
    """Per request, the candidate maximising the batch's expected tokens per second.

    ``expected[i][j]``: tokens a step of ``candidates[j]`` yields for request ``i`` (None:
    not allowed for it). ``shapes[i]``: candidate index -> request ``i``'s shape under it
    this step where it is not the candidate's own (a trie built before the choice,
    priced at its nodes). ``weights[i]`` > 0: what a token of request ``i`` is worth
    (default 1 each; ``makespan_weights``). Objective: ``sum_i weights[i] *
    expected[i][x_i] / cost(batch_shape)``.
    Exact: for every cap ``L`` on draft levels (the shapes' distinct ones), Dinkelbach's
    iteration (``_best_under_cap``, a drafted step's ``f`` charged) solves the ratio,
    which is then scored at its true shape; the best cap wins, unless ``none`` for every
    request, scored alone (no ``f``), beats it (ties: ``none``, then the smaller cap,
    then the earlier candidate: with ``make_candidates``' order, the cheaper tree).

    >>> cands = make_candidates(["chain:4"])  # [none, chain:4]
    >>> cost = CostModel(a=0.010, b=0.0, c=0.002, d=0.0)  # chain:4: 18 ms vs 10 ms
    >>> [c.name for c in choose([[1.0, 3.5], [1.0, 1.2]], cands, cost)]
    ['chain:4', 'chain:4']
    >>> [c.name for c in choose([[1.0, 1.5], [1.0, 1.2]], cands, cost)]
    ['none', 'none']
    """
    if not expected:
        return []
    e = np.array([[-np.inf if v is None else float(v) for v in row] for row in expected])
    if e.shape[1] != len(candidates) or not np.all(np.isfinite(e).any(axis=1)):
        raise ValueError("choose: each request needs one value per candidate, one not None")
    if shapes is not None and len(shapes) != len(e):
        raise ValueError(f"choose: {len(shapes)} shape overrides for {len(e)} requests")
    if weights is not None:
        w = np.asarray(weights, dtype=float)
        if w.shape != (len(e),) or not np.all(np.isfinite(w) & (w > 0)):
            raise ValueError(f"choose: weights must be {len(e)} finite numbers > 0, got {weights}")
        e = e * w[:, None]  # -inf (not allowed) stays -inf
    own = [c.shape for c in candidates]
    per = [list(own) for _ in range(len(e))]
    for i, over in enumerate(shapes or ()):
        for j, sh in over.items():
            per[i][j] = sh
    # [requests, candidates, (verify_rows, draft_levels, draft_rows, branched, drafted, 1)]
    sizes = np.array([list(chain.from_iterable(r)) for r in per]).reshape(*e.shape, 6)
    rows = sizes[..., [0, 2, 3]].astype(float)  # what adds up over requests
    levels, drafted = sizes[..., 1], sizes[..., 4]
    j0 = _none_index(candidates)
    nothing = _nothing_pays(e, j0, rows, levels, drafted, cost_model)
    if nothing is not None:
        return [candidates[nothing]] * len(e)
    best, best_rate = None, -1.0
    if j0 is not None and np.all(np.isfinite(e[:, j0])) and not drafted[:, j0].any():
        best = np.full(len(e), j0)  # no draft anywhere: vLLM's plain step, no ``f``
        plain = cost_model.raw(batch_shape(r[j0] for r in per))
        best_rate = float(e[:, j0].sum()) / max(plain, 1e-30)
    for cap in sorted(set(levels.ravel().tolist())):
        ec = np.where(levels <= cap, e, -np.inf)
        if not np.all(np.isfinite(ec).any(axis=1)):
            continue
        x = _best_under_cap(ec, rows, cost_model, cap)
        tokens = float(e[np.arange(len(e)), x].sum())
        rate = tokens / max(cost_model.raw(batch_shape(per[i][j] for i, j in enumerate(x))), 1e-30)
        if rate > best_rate * (1 + 1e-12):
            best, best_rate = x, rate
    return [candidates[j] for j in best]


def makespan_weights(
    remaining: Sequence[int], pace: Sequence[float], cost_model: CostModel
) -> list[float]:
    """What a token of each request is worth when the batch only shrinks (no request
    waits for a slot: an offline batch's last wave), for ``choose``'s ``weights``.

    ``remaining[i]``: the tokens request ``i`` has left at most (its ``max_tokens`` less
    its output); ``pace[i]`` >= 1: its tokens a step at best (its best candidate's
    expected tokens). The batch ends no sooner than ``T = max_i remaining[i] /
    pace[i]`` steps. A request with ``remaining[i] <= T`` finishes by then without a
    draft: its token saves only its own row of the steps the batch runs anyway, worth
    ``n * (b + g) / C`` (``C`` a plain step of ``n`` requests, ``cost_model.raw``) of
    the tokens objective's. The others, the ``k`` that need drafts to end by ``T`` (and
    those that set it), are worth ``n / k``. So trees go to the requests that set the
    batch's end, and one that would end early anyway drafts only where its tree costs
    no more than its row. With the same tokens left and pace everywhere every weight
    is 1: the tokens objective, right where a request that ends frees a slot for the
    next, wrong for a last wave, where a request drafted ahead ends early and the rest
    run on in a smaller batch that costs almost as much a step.

    >>> m = CostModel(a=0.040, b=0.001, c=0.0, d=0.0, g=0.001)  # a plain step of 4: 48 ms
    >>> makespan_weights([10, 10, 10, 10], [2.0] * 4, m)
    [1.0, 1.0, 1.0, 1.0]
    >>> makespan_weights([10, 10, 10, 10], [3.0, 1.0, 3.0, 3.0], m)  # "1" sets the end
    [0.16666666666666666, 4.0, 0.16666666666666666, 0.16666666666666666]
    >>> makespan_weights([12, 10, 4, 10], [3.0, 2.0, 1.0, 1.0], m)  # "3" sets it, at 10
    [2.0, 0.16666666666666666, 0.16666666666666666, 2.0]
    """
    n = len(remaining)
    if n == 0:
        return []
    steps = [r / max(p, 1.0) for r, p in zip(remaining, pace)]
    end = max(steps)
    needs = [r > end or t >= end for r, t in zip(remaining, steps)]
    k = sum(needs)
    plain = cost_model.raw(Shape(n, 0, 0, 0, 0, n))
    row = n * (cost_model.b + cost_model.g) / plain if plain > 0 else 1.0
    other = min(max(row, 1e-3), 1.0)
    return [n / k if need else other for need in needs]


#: what ``tree: auto`` maximises (``makespan_applies``); ``tokens`` is the default
OBJECTIVES = ("tokens", "makespan")


def check_objective(objective: str) -> str:
    """``objective`` when it is one of ``OBJECTIVES``, else a ``ValueError`` naming it."""
    if objective not in OBJECTIVES:
        raise ValueError(f"auto objective {objective!r}: expected one of {OBJECTIVES}")
    return objective


def makespan_applies(objective: str, waiting: int | None) -> bool:
    """Whether ``AutoPolicy.choose`` weighs requests' tokens (``makespan_weights``: an
    engine then passes each request's tokens left as ``remaining``) under ``objective``
    (``OBJECTIVES``) with ``waiting`` requests queued for a slot. ``tokens``: never: the
    batch's tokens per second (a server, where a request that ends frees its slot for
    the next). ``makespan``: once no request waits (an offline batch's last wave); not
    while requests wait, nor where the engine cannot tell (None).

    >>> makespan_applies("makespan", 0), makespan_applies("makespan", 3)
    (True, False)
    >>> makespan_applies("tokens", 0), makespan_applies("makespan", None)
    (False, False)
    """
    return check_objective(objective) == "makespan" and waiting == 0


@dataclass
class AutoStats:
    """What ``tree: auto`` chose and how well it predicted (``as_dict`` for /metrics)."""

    steps: int = 0
    choices: dict[str, dict[str, int]] = field(
        default_factory=lambda: {c: {} for c in CLASSES}
    )  # class -> candidate name -> requests-steps
    measured_steps: int = 0
    predicted_s: float = 0.0  # summed over measured steps
    measured_s: float = 0.0
    abs_rel_error: float = 0.0  # summed |predicted / measured - 1|
    last_predicted_s: float = 0.0
    last_measured_s: float = 0.0
    correction: float = 1.0
    drafted_factor: float = 1.0  # the cost model's, on what drafts add to a step
    drafted_offset: float = 0.0  # the cost model's seconds a step with drafts adds, uncorrected
    trie_shadows: int = 0  # tries scored on steps that did not run them
    rested: int = 0  # request-steps given none without a choice (``AutoPolicy``'s rest)
    weighted_steps: int = 0  # choices with unequal token weights (``makespan_weights``)

    def count(self, cls: str, name: str) -> None:
        self.choices[cls][name] = self.choices[cls].get(name, 0) + 1

    def measured(self, predicted: float, measured: float) -> None:
        self.measured_steps += 1
        self.predicted_s += predicted
        self.measured_s += measured
        self.abs_rel_error += abs(predicted / measured - 1) if measured > 0 else 0.0
        self.last_predicted_s, self.last_measured_s = predicted, measured

    def as_dict(self) -> dict[str, Any]:
        n = max(self.measured_steps, 1)
        total: dict[str, int] = {}
        for per in self.choices.values():
            for name, k in per.items():
                total[name] = total.get(name, 0) + k
        return {
            "steps": self.steps,
            "choices": dict(sorted(total.items())),
            "choices_by_class": {c: dict(sorted(v.items())) for c, v in self.choices.items()},
            "measured_steps": self.measured_steps,
            "mean_predicted_s": self.predicted_s / n,
            "mean_measured_s": self.measured_s / n,
            "mean_abs_rel_error": self.abs_rel_error / n,
            "last_predicted_s": self.last_predicted_s,
            "last_measured_s": self.last_measured_s,
            "correction": self.correction,
            "drafted_factor": self.drafted_factor,
            "drafted_offset": self.drafted_offset,
            "trie_shadows": self.trie_shadows,
            "rested": self.rested,
            "weighted_steps": self.weighted_steps,
        }


class StepRecord(Protocol):
    """What ``AutoPolicy.record`` reads of a ``step.RequestStep``."""

    req_id: Any
    max_depth: int
    accepted: list[int]  # accepted node ids, the root first


def drift_key(c: Candidate) -> str | None:
    """Whose drift factor scales candidate ``c`` (``AutoPolicy``): ``"model"`` for every
    tree the draft model grows, a trie's own name, None for ``none``."""
    source = draft_source(c)
    return c.name if source == "trie" else source


def draft_source(c: Candidate) -> str | None:
    """Where a candidate's drafts come from: ``"model"`` (it runs draft levels), ``"trie"``
    (an n-gram trie), None (``none``)."""
    if c.shape.draft_levels > 0:
        return "model"
    return "trie" if c.depth > 0 else None


class StepOutcome(NamedTuple):
    """A ``StepRecord`` an engine builds itself (the root alone: ``max_depth`` 0,
    ``accepted`` ``[0]``)."""

    req_id: Any
    max_depth: int
    accepted: list[int]


class AutoPolicy:
    """``tree: auto`` for one engine: ``choose`` before a step, ``record`` after it.

    Besides the tracker's per-candidate counts, each request keeps **drift** factors per
    class: the decayed ratio of the drafts it got accepted to the drafts the tracker
    expected (``drift_decay`` 0.7 per observed step, at most 1), one for all the draft
    model's trees and one per trie (``drift_key``), which scales them. The model's trees
    all draft from the same model, so when it goes wrong for a request (the text turned
    novel) every such tree is discounted within a few steps, not one candidate at a time.
    Tries of different match lengths are not one draft: a trie of 3-token matches is
    right where one of 1-token matches is not, so the wide trie's failures do not
    discount it. Unobserved, the factor returns toward its class's (``drift_recover``
    0.9 per request step), so probes find a draft that recovered; the evidence behind it
    fades as much, so an old failure does not weigh on the next step that is observed.

    **Class drift** (tries). The same ratio over every request of a temperature class,
    per trie (``class_drift_decay`` 0.95 per observed request-step), returning to 1
    while unobserved (``class_drift_recover`` 0.99 per engine step): where a request has
    no recent evidence of its own it reads its class's. A trie is chosen on the steps
    its estimate runs high, so what those steps accept falls short of what was expected
    of them (the winner's curse: SmolLM2 at 4 concurrent, T=0.8, the 8-node trie
    accepted 1.02 drafts a step where 1.84 were expected; on the toy 2.25 tokens against
    3.86), and a request that runs a trie one step in ten has recovered its own factor
    to 1 in between. Left out, as read at a bound and not at the estimate: probes (a
    probe offer also reads its request's own drift, not its class's) and a prior's
    optimism (``AcceptanceTracker.optimistic``). Not for the draft model's trees: their
    steps at T=0.8 are mostly probes and optimistic starts, and its request drift
    already spans all its trees.

    **Trie shadows.** An n-gram trie costs nothing to build, so its acceptance is learnt on
    every step it matches, run or not: an engine gets a request's tries from
    ``step_tries(req_id, context)``; a trie ``choose`` did not pick is kept as a shadow
    and scored, a step or more later, against the tokens the request emitted after its
    root (``shapes.trie_walk``: the path they spell through it; for a sampled request
    those tokens are the target's samples the walk would have drawn), then recorded as a
    step of the trie (``AcceptanceTracker.observe(..., shadow=True)``). So a trie's
    estimate does not freeze at the bad luck that made a request leave it, nor is a trie
    that began to match left to probes (``stats.trie_shadows`` counts them).

    **Rest.** Choosing costs a request its tries and its row of estimates every step
    (on the toy model at batch 8 about 0.1 ms a request, an eighth of a 7 ms step), most
    of it wasted where nothing pays (sampled text a draft rarely guesses). A request
    given ``none`` on ``rest_after`` (4) choices in a row, with some tree open to it on
    each, rests: it gets ``none`` with no tries built and no row read for the next 1
    step, then 2, then 4 (``longest_rest``) after each further such choice, until a
    choice gives it a tree. So where nothing pays, a request is chosen for on one step
    in 5 at most, and a trie that begins to match is found within ``longest_rest``
    steps. Engines skip ``step_tries`` for a request that ``resting``. A rest also
    misses the matches of the steps it skips (on SmolLM2, a queue of 24 greedy requests
    for 8 slots, the long trie was seen on half as many steps). ``rest_above`` (a
    fraction, default 0: rest wherever nothing pays, timing aside, deterministic) makes
    a rest begin only where choosing is dear: where one awake request's ``step_tries``
    and share of ``choose`` (timed by ``clock``, a decayed mean) take at least that
    share of a measured step (``record``'s seconds, a decayed mean); no rest before a
    step is measured. At 0.005 SmolLM2's 60-100 ms steps never rested; paired in one
    engine (``bench.auto_ab``, SmolLM2 + EAGLE, 4 waves), 0 over 0.005 read 1.063 at 8
    concurrent T=0.8, 1.035 at 8 concurrent greedy (the queue of 24 above), 0.999 and
    0.992 at 4 concurrent greedy and T=0.8: the missed matches cost less than the
    tries and rows a step built for every request.

    >>> from tree_dev.step import RequestStep
    >>> auto = AutoPolicy(["chain:2", "chain:6"], CostModel(a=0.010, b=0.0, c=0.001, d=0.0))
    >>> picks = []
    >>> for _ in range(10):  # greedy; nothing is ever accepted
    ...     pick = auto.choose([("r", 0.0)])["r"]
    ...     picks.append(pick.name)
    ...     d = pick.depth  # the tree: a chain d deep; accepted: the root alone
    ...     auto.record([RequestStep("r", 0, [0], [-1, *range(d)], [0] * (d + 1), d, [0])])
    >>> " ".join(picks)  # optimism first (the deepest tree), then the draft's drift
    'chain:6 none none chain:2 none none none chain:6 none none'
    >>> auto.stats.as_dict()["choices"]
    {'chain:2': 1, 'chain:6': 2, 'none': 7}
    """

    def __init__(
        self,
        candidates: Iterable[str | Policy | Candidate],
        cost_model: CostModel,
        tracker: AcceptanceTracker | None = None,
        drift_decay: float = 0.7,
        drift_recover: float = 0.9,
        class_drift_decay: float = 0.95,
        class_drift_recover: float = 0.99,
        rest_after: int = 4,
        longest_rest: int = 4,
        rest_above: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
    ):
        for decay, recover in (
            (drift_decay, drift_recover),
            (class_drift_decay, class_drift_recover),
        ):
            if not (0 < decay <= 1 and 0 <= recover <= 1):
                raise ValueError(
                    "drift_decay / class_drift_decay must be in (0, 1], drift_recover / "
                    f"class_drift_recover in [0, 1], got {decay}, {recover}"
                )
        if rest_after < 1 or longest_rest < 0 or not rest_above >= 0:
            raise ValueError(
                "rest_after must be >= 1, longest_rest and rest_above >= 0, got "
                f"{rest_after}, {longest_rest}, {rest_above}"
            )
        self.rest_after, self.longest_rest = rest_after, longest_rest
        self.rest_above, self._clock = rest_above, clock
        self._own = 0.0  # seconds of this step's step_tries so far
        self._choice_s: float | None = None  # decayed seconds of choosing, per awake request
        self._step_s: float | None = None  # decayed measured seconds of a step
        # per request: choices in a row that gave it none; its last rest; steps of rest left
        self._none_run: dict[Any, int] = {}
        self._rest_len: dict[Any, int] = {}
        self._rest_left: dict[Any, int] = {}
        # per request: its best candidate's expected tokens, decayed over its choices
        self._pace: dict[Any, float] = {}
        self.candidates = make_candidates(candidates)
        self._by_name = {c.name: c for c in self.candidates}
        self._index = {c.name: j for j, c in enumerate(self.candidates)}
        self._drift_keys = [drift_key(c) for c in self.candidates]
        # the index of ``none`` (what a probe's cost is set against), None without one
        self._none = _none_index(self.candidates)
        self._rest_row = [1.0 if j == self._none else None for j in range(len(self.candidates))]
        self.cost_model = cost_model
        self.tracker = tracker if tracker is not None else AcceptanceTracker()
        self.stats = AutoStats()
        self.drift_decay, self.drift_recover = drift_decay, drift_recover
        # (request, source, class) -> [accepted, expected, request step of the last update]
        self._drift: dict[tuple[Any, str, str], list[float]] = {}
        self.class_drift_decay, self.class_drift_recover = class_drift_decay, class_drift_recover
        # (source, class) -> [accepted, expected, engine step of the last update]
        self._class_drift: dict[tuple[str, str], list[float]] = {}
        self._req_step: dict[Any, int] = {}
        self._raw: dict[tuple[Any, str], float] = {}  # this step's unscaled expected drafts
        self._pending: dict[Any, tuple[Candidate, str]] = {}
        self._offers: dict[Any, str] = {}  # this step's probe offer per request
        # last step's probe run: (tree, class, what it added to its step, a fraction)
        self._probed: dict[Any, tuple[str, str, float]] = {}
        self._built_at: dict[Any, int] = {}  # context length of this step's tries
        # request -> tries it built and did not run: (name, class, trie, context length)
        self._shadows: dict[Any, list[tuple[str, str, Trie, int]]] = {}
        self._shape = Shape(0, 0, 0, 0, 0, 0)
        self._priced = cost_model  # this step's ``cost_model.priced()`` (``choose``)

    def expected_row(
        self,
        req_id: Any,
        cls: str,
        unavailable: Collection[str] = (),
        probe: bool = False,
        trees: Mapping[str, Trie] | None = None,
    ) -> list[float | None]:
        """Expected tokens of every candidate for ``req_id`` (None: not for its class, or
        in ``unavailable``); ``probe``: the request holds this step's probe slot of its
        class (``AcceptanceTracker.probe_takers``), and the candidate it is offered is
        read at its upper bound; ``trees``: candidates whose tree this step is known (a
        trie, ``step_tries``), read to the depth it reaches."""
        allowed = [
            not (c.sampled_drafts and cls == "greedy") and c.name not in unavailable
            for c in self.candidates
        ]
        drafting = [c.name for c, ok in zip(self.candidates, allowed) if ok and c.depth > 0]
        offer = self.tracker.probe(req_id, cls, drafting) if probe else None
        if offer is not None:
            self._offers[req_id] = offer
        drifts: dict[str, float] = {}  # per drift key: the model's is all its trees'
        row: list[float | None] = []
        for c, key, ok in zip(self.candidates, self._drift_keys, allowed):
            if not ok:
                row.append(None)
                continue
            built = None if trees is None else trees.get(c.name)
            depth = c.depth if built is None else built.tree.max_depth
            reached = built is not None
            tokens = self.tracker.expected_tokens(
                req_id, c.name, cls, depth, c.name == offer, reached
            )
            self._raw[req_id, c.name] = tokens - 1.0
            if key is not None:
                if c.name == offer:  # a probe: its own drift, not its class's
                    factor = self.drift(req_id, key, cls, probe=True)
                else:
                    if key not in drifts:
                        drifts[key] = self.drift(req_id, key, cls)
                    factor = drifts[key]
                tokens = 1.0 + factor * (tokens - 1.0)
            row.append(tokens)
        return row

    def drift(self, req_id: Any, key: str, cls: str, probe: bool = False) -> float:
        """The request's drift factor of ``key`` (``drift_key``) in class ``cls`` (see the
        class), in [0, 1]: its own ratio, returning to the class's (``class_drift``; 1
        for a ``probe``) as it goes unobserved; the class's when never observed."""
        prior = 1.0 if probe else self.class_drift(key, cls)
        d = self._drift.get((req_id, key, cls))
        if d is None or d[1] <= 0:
            return prior
        ratio = min(d[0] / d[1], 1.0)
        idle = max(self._req_step.get(req_id, 0) - int(d[2]), 0)
        return prior - (prior - ratio) * self.drift_recover**idle

    def class_drift(self, key: str, cls: str) -> float:
        """The class's drift factor of trie ``key`` (see the class), in [0, 1]; 1 when
        never observed (and for the draft model's trees), returning to 1 as it goes
        unobserved."""
        d = self._class_drift.get((key, cls))
        if d is None or d[1] <= 0:
            return 1.0
        ratio = min(d[0] / d[1], 1.0)
        idle = max(self.stats.steps - int(d[2]), 0)
        return 1.0 - (1.0 - ratio) * self.class_drift_recover**idle

    def step_tries(self, req_id: Any, context: Sequence[int]) -> dict[str, Trie | None]:
        """``shapes.step_tries`` for ``req_id``'s committed tokens ``context`` (its
        ``choose`` ``tries``), after scoring its trie shadows against them (see the
        class)."""
        t0 = self._clock()
        ctx = context if isinstance(context, list) else list(context)
        waiting = []
        for name, cls, trie, at in self._shadows.pop(req_id, []):
            got = trie_walk(trie, ctx[at:])
            if got is None:  # the tokens so far could still be its path
                waiting.append((name, cls, trie, at))
                continue
            depth = self._by_name[name].depth
            self.tracker.observe(req_id, name, cls, trie.tree.max_depth, got, depth, shadow=True)
            self.stats.trie_shadows += 1
        if waiting:
            self._shadows[req_id] = waiting
        self._built_at[req_id] = len(ctx)
        out = step_tries(ctx, self.candidates)
        self._own += self._clock() - t0
        return out

    def choose(
        self,
        requests: Sequence[tuple[Any, float]],
        unavailable: Mapping[Any, Collection[str]] | None = None,
        tries: Mapping[Any, Mapping[str, Trie | None]] | None = None,
        behind: Mapping[Any, int] | None = None,
        remaining: Mapping[Any, int] | None = None,
    ) -> dict[Any, Candidate]:
        """``[(req_id, temperature), ...]`` -> per request its candidate for this step.
        ``unavailable``: per request, candidates that cannot run for it this step (an
        n-gram trie that finds no match: ``shapes.step_tries``); they are neither
        chosen nor learnt from, so a trie's counts are those of steps where it matched.
        ``tries``: per request, its n-gram tries of this step (``step_tries``): one that
        finds no match (None) is unavailable; one built is priced at its own nodes and
        read to its own depth, and when not chosen becomes a shadow (see the class).
        ``behind``: per request, the committed tokens its draft has not consumed besides
        the root; a tree the draft model grows forwards them first (its catch-up), so
        they are priced with it (``shapes.with_catch_up``): after a run of ``none``
        steps, a model tree costs its catch-up on top of its levels. At most
        ``step.TRUNK_LIMIT`` (32) of them, what a first level carries: a longer catch-up
        (a new request's prompt) is paid once before any model tree can run, not per
        step; charged to one step's choice in full, a long prompt would keep a request
        from ever drafting, and the longer it went without, the more so. A probe's tree
        (the candidate a probe slot offers) is priced with its whole catch-up: a probe is
        judged on its one step, read at an upper bound, so at what that step costs; where
        even its whole tree accepted would not pay for the catch-up (a large batch, a
        request far behind), it does not run. ``remaining``: per request, its tokens left
        at most, where a token is worth what it shortens the batch (``makespan_applies``):
        ``choose`` weighs the requests by ``makespan_weights``, each at the pace of its
        best candidate this step (a resting one at 1); None: every token alike."""
        t0 = self._clock()
        classes = [temperature_class(t) for _, t in requests]
        resting = {rid for rid, _ in requests if self.resting(rid)}
        if self._rests_whole_batch(requests, resting, tries):
            return self._all_rest(requests, classes, t0, unavailable)
        no: dict[Any, set[str]] = {rid: set(v) for rid, v in (unavailable or {}).items()}
        built: dict[Any, dict[str, Trie]] = {}
        for rid, ts in (tries or {}).items():
            no.setdefault(rid, set()).update(n for n, t in ts.items() if t is None)
            built[rid] = {n: t for n, t in ts.items() if t is not None}
        self._offers = {}
        awake = [(rid, cls) for (rid, _), cls in zip(requests, classes) if rid not in resting]
        takers = self.tracker.probe_takers(awake)
        expected = [
            self._rest_row
            if rid in resting
            else self.expected_row(rid, cls, no.get(rid, ()), rid in takers, built.get(rid))
            for (rid, _), cls in zip(requests, classes)
        ]
        index = self._index
        shapes = [{index[n]: t.shape for n, t in built.get(rid, {}).items()} for rid, _ in requests]
        caught_up: dict[int, dict[int, Shape]] = {}  # behind -> the model trees' shapes
        for (rid, _), over in zip(requests, shapes):
            if rid in resting:  # given none unread: its trees are not priced
                continue
            whole = (behind or {}).get(rid, 0)
            late = min(whole, TRUNK_LIMIT)
            if late > 0:
                if late not in caught_up:
                    caught_up[late] = {
                        j: with_catch_up(c.shape, late)
                        for j, c in enumerate(self.candidates)
                        if c.shape.draft_levels > 0
                    }
                over.update(caught_up[late])
            offer = self._offers.get(rid)  # a probe of a model tree: its whole catch-up
            if whole > late and offer is not None and index[offer] in caught_up[late]:
                over[index[offer]] = with_catch_up(self._by_name[offer].shape, whole)
        # the step's prices: drafts at what they are measured to add (``_probe_cost`` too)
        self._priced = priced = self.cost_model.priced()
        if awake or self._none is None:
            w = None
            if remaining is not None and len(requests) > 1:
                left = [remaining.get(rid, 0) for rid, _ in requests]
                w = makespan_weights(left, self._paces(requests, expected, resting), priced)
                self.stats.weighted_steps += len(set(w)) > 1
            picks = choose(expected, self.candidates, priced, shapes, w)
        else:  # every request rests: none, unread, without the solver
            picks = [self.candidates[self._none]] * len(requests)
        for (rid, _), c in zip(requests, picks):
            probed = self._probed.pop(rid, None)  # the request's last step was a probe:
            if probed is not None:  # it paid if the request keeps drafting from the
                name, probed_cls, cost = probed  # probed tree's source (a model probe followed
                source = draft_source(self._by_name[name])  # by a trie says nothing)
                paid = draft_source(c) == source
                if paid or name not in no.get(rid, ()):  # else: a trie without a match:
                    self.tracker.probe_result(probed_cls, paid=paid, cost=cost)  # no say
        self._pending = {rid: (c, cls) for (rid, _), c, cls in zip(requests, picks, classes)}
        raw = self._raw  # a resting request's none was not read: its drafts are 0
        self._raw = {
            (rid, c.name): raw.get((rid, c.name), 0.0) for rid, (c, _) in self._pending.items()
        }
        ran = [s.get(index[c.name], c.shape) for c, s in zip(picks, shapes)]
        self._shape = batch_shape(ran)
        for i, ((rid, _), c, cls) in enumerate(zip(requests, picks, classes)):
            if self._offers.get(rid) == c.name:  # a probe taken: what it adds to the step
                self._probed[rid] = (c.name, cls, self._probe_cost(ran, i, shapes[i]))
        for c, cls in zip(picks, classes):
            self.stats.count(cls, c.name)
        self._update_rest(requests, picks, expected, resting)
        self._timed_choice(t0, max(len(requests) - len(resting), 1))
        for (rid, _), c, cls in zip(requests, picks, classes):  # the tries not run: shadows
            at = self._built_at.pop(rid, None)
            if at is not None:
                shadows = [(n, cls, t, at) for n, t in built.get(rid, {}).items() if n != c.name]
                self._shadows.setdefault(rid, []).extend(shadows)
        return {rid: c for (rid, _), c in zip(requests, picks)}

    def _rests_whole_batch(
        self, requests: Sequence[tuple[Any, float]], resting: Collection[Any], tries: Any
    ) -> bool:
        """Whether ``choose`` can take ``_all_rest``: every request rests, no tries were
        built (an engine that built them wants them shadowed), and there is a ``none``."""
        return self._none is not None and len(resting) == len(requests) and not tries

    def _all_rest(
        self,
        requests: Sequence[tuple[Any, float]],
        classes: Sequence[str],
        t0: float,
        unavailable: Mapping[Any, Collection[str]] | None,
    ) -> dict[Any, Candidate]:
        """``choose`` where every request rests: each gets ``none`` unread, as the full
        path would give it, with only what that path would change (their rests run
        down, the counts, the step's plain shape); no probe slot is due to a resting
        request, nothing was built, so nothing is offered, probed or shadowed. Where
        the batch rests (a class nothing pays for) this is the step's whole choice."""
        none = self.candidates[self._none]
        self._offers, self._raw = {}, {}
        self._pending = {rid: (none, cls) for (rid, _), cls in zip(requests, classes)}
        self._shape = batch_shape([none.shape] * len(requests))
        for (rid, _), cls in zip(requests, classes):
            probed = self._probed.pop(rid, None)  # a probe followed by none did not pay
            if probed is not None and probed[0] not in (unavailable or {}).get(rid, ()):
                self.tracker.probe_result(probed[1], paid=False, cost=probed[2])
            self._rest_left[rid] -= 1
            self.stats.count(cls, none.name)
        self.stats.rested += len(requests)
        self._timed_choice(t0, 1)
        return dict.fromkeys((rid for rid, _ in requests), none)

    def _timed_choice(self, t0: float, awake: int) -> None:
        """Fold this step's choosing (its ``step_tries`` and ``choose`` since ``t0``), per
        ``awake`` request, into the decayed mean a rest is set against (``rest_above``)."""
        own = (self._own + self._clock() - t0) / awake
        prev = self._choice_s
        self._choice_s = own if prev is None else 0.8 * prev + 0.2 * own
        self._own = 0.0

    def _paces(
        self,
        requests: Sequence[tuple[Any, float]],
        expected: Sequence[Sequence[float | None]],
        resting: Collection[Any],
    ) -> list[float]:
        """Per request, the tokens a step it makes at best: its best candidate's expected
        tokens, decayed (0.7) over the steps it is chosen for, as the batch's end is
        steps away, not one (a trie that finds no match this step does not make the
        request a plain one); a resting request keeps its last."""
        out = []
        for (rid, _), row in zip(requests, expected):
            pace = self._pace.get(rid)
            if rid not in resting:
                best = max(v for v in row if v is not None)
                pace = best if pace is None else 0.7 * pace + 0.3 * best
                self._pace[rid] = pace
            out.append(1.0 if pace is None else pace)
        return out

    def resting(self, req_id: Any) -> bool:
        """Whether ``req_id`` rests this step (see the class): ``choose`` gives it
        ``none`` without reading its row, so its tries need not be built."""
        return self._rest_left.get(req_id, 0) > 0

    def _update_rest(
        self,
        requests: Sequence[tuple[Any, float]],
        picks: Sequence[Candidate],
        rows: Sequence[Sequence[float | None]],
        resting: Collection[Any],
    ) -> None:
        """After a choice: a resting request's rest runs down; a request given ``none``
        with some tree open to it ``rest_after`` times in a row begins a rest twice its
        last (1 at first, at most ``longest_rest``) where choosing is dear (see the
        class); a tree ends its run of ``none``."""
        j0 = self._none
        own, step = self._choice_s, self._step_s
        dear = self.rest_above == 0 or (
            own is not None and step is not None and own >= self.rest_above * step
        )
        for (rid, _), c, row in zip(requests, picks, rows):
            if rid in resting:
                self._rest_left[rid] -= 1
                self.stats.rested += 1
            elif draft_source(c) is not None:
                self._none_run.pop(rid, None)
                self._rest_len.pop(rid, None)
            elif any(v is not None for j, v in enumerate(row) if j != j0):
                run = self._none_run[rid] = self._none_run.get(rid, 0) + 1
                if run >= self.rest_after and self.longest_rest > 0 and dear:
                    rest = min(max(2 * self._rest_len.get(rid, 0), 1), self.longest_rest)
                    self._rest_len[rid] = self._rest_left[rid] = rest

    def _probe_cost(self, ran: list[Shape], i: int, over: Mapping[int, Shape]) -> float:
        """What request ``i``'s tree adds to the step of shapes ``ran``, over the step's
        seconds with ``none`` in its place (the cost model's estimate)."""
        j0 = self._none
        if j0 is None:
            return 0.0
        without = batch_shape([*ran[:i], over.get(j0, self.candidates[j0].shape), *ran[i + 1 :]])
        base = self._priced.raw(without)
        return max(self._priced.raw(self._shape) - base, 0.0) / base if base > 0 else 0.0

    @property
    def step_shape(self) -> Shape:
        """The batch shape of the step ``choose`` last chose (the cost model's input)."""
        return self._shape

    def record(
        self, steps: Iterable[StepRecord], seconds: float | None = None, shape: Shape | None = None
    ) -> None:
        """The step's ``RequestStep``s (requests not chosen for are skipped) and, when
        measured, its seconds: the acceptance counts, the cost correction and the stats.
        ``shape``: the step as it ran (a trie verifies the nodes it matched, fewer than its
        budget), which the seconds are set against; default: the chosen trees' shape."""
        for s in steps:
            pick = self._pending.pop(s.req_id, None)
            if pick is None:
                continue
            cand, cls = pick
            now = self._req_step[s.req_id] = self._req_step.get(s.req_id, 0) + 1
            if cand.depth == 0:  # none: the request's clock moves, no rate is learnt
                self.tracker.tick(s.req_id)
                continue
            accepted = len(s.accepted) - 1  # the root is not a draft
            self.tracker.observe(s.req_id, cand.name, cls, s.max_depth, accepted, cand.depth)
            key, expected = drift_key(cand), self._raw.get((s.req_id, cand.name), 0.0)
            if key is not None and expected > 0:
                d = self._drift.setdefault((s.req_id, key, cls), [0.0, 0.0, now])
                # old evidence fades with the steps it went unobserved, as the factor does
                k = self.drift_decay * self.drift_recover ** max(now - int(d[2]) - 1, 0)
                d[:] = [k * d[0] + accepted, k * d[1] + expected, now]
                if (  # a probe, or a prior's optimism, is read at a bound: no evidence
                    draft_source(cand) == "trie"
                    and self._offers.get(s.req_id) != cand.name
                    and not self.tracker.optimistic(cand.name, cls)
                ):
                    step = self.stats.steps + 1  # this engine step, once recorded
                    c = self._class_drift.setdefault((key, cls), [0.0, 0.0, step])
                    idle = max(step - int(c[2]) - 1, 0)
                    k = self.class_drift_decay * self.class_drift_recover**idle
                    c[:] = [k * c[0] + accepted, k * c[1] + expected, step]
        self._pending, self._raw = {}, {}
        self.tracker.end_step()
        self.stats.steps += 1
        ran = self._shape if shape is None else shape
        if seconds is not None and seconds > 0:
            prev = self._step_s
            self._step_s = seconds if prev is None else 0.8 * prev + 0.2 * seconds
        if seconds is not None and ran.verify_rows > 0:
            self.stats.measured(self.cost_model.predict(ran), seconds)
            self.cost_model.observe(ran, seconds)
            self.stats.correction = self.cost_model.correction
            self.stats.drafted_factor = self.cost_model.drafted_factor
            self.stats.drafted_offset = self.cost_model.drafted_offset

    def forget(self, req_id: Any) -> None:
        """A request finished."""
        self.tracker.forget(req_id)
        self._pending.pop(req_id, None)
        self._probed.pop(req_id, None)
        self._req_step.pop(req_id, None)
        self._built_at.pop(req_id, None)
        self._shadows.pop(req_id, None)
        for d in (self._none_run, self._rest_len, self._rest_left, self._pace):
            d.pop(req_id, None)
        for k in [k for k in self._drift if k[0] == req_id]:
            del self._drift[k]
