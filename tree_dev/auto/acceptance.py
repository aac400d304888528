"""What a candidate yields: ``AcceptanceTracker``, decayed per-depth acceptance counts per
request, candidate and temperature class, blended with a shared prior, with probes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from tree_dev.auto.shapes import CLASSES


@dataclass
class _Counts:
    """Decayed step counts of one (request or prior, candidate, class): ``steps``, and per
    depth ``tried[d]`` (trees that reached depth ``d + 1``) / ``accepted[d]`` (steps that
    accepted a token there), as ``step.DepthStats``; ``last``: the step of the last update."""

    steps: float = 0.0
    tried: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    last: int = 0
    pseudo: float = 0.0  # a prior's optimistic pseudo-steps at its birth, to pseudo_depth
    pseudo_depth: int = 0
    pseudo_rate: float = 1.0
    born: int = 0

    def add(self, now: int, decay: float, max_depth: int, accepted: int) -> None:
        """Record a step numbered ``now``; the first record of a step decays the counts."""
        if now != self.last:
            self.steps *= decay
            self.tried = [t * decay for t in self.tried]
            self.accepted = [a * decay for a in self.accepted]
            self.last = now
        grow = max_depth - len(self.tried)
        self.tried += [0.0] * grow
        self.accepted += [0.0] * grow
        self.steps += 1.0
        for d in range(max_depth):
            self.tried[d] += 1.0
            self.accepted[d] += float(d < accepted)

    def count(self, d: int, reached: bool = False) -> float:
        """The steps depth ``d + 1``'s rate is over: all (``steps``), or when ``reached``
        those whose tree got that deep (``tried[d]``)."""
        if not reached:
            return self.steps
        return self.tried[d] if d < len(self.tried) else 0.0

    def rates(
        self,
        bases: Sequence[float],
        weight: float,
        scale: float = 1.0,
        reached: bool = False,
        pseudo: float = 0.0,
    ) -> list[float]:
        """Per depth ``d < len(bases)``: ``(accepted[d] * scale + weight * bases[d]) /
        (count(d, reached) * scale + weight)`` (``bases[d]`` when both are 0); ``pseudo``:
        optimistic pseudo-steps counted too."""
        out = []
        for d, base in enumerate(bases):
            p = pseudo if d < self.pseudo_depth else 0.0
            acc = (self.accepted[d] if d < len(self.accepted) else 0.0) + p * self.pseudo_rate
            den = (self.count(d, reached) + p) * scale + weight
            out.append((acc * scale + weight * base) / den if den > 0 else base)
        return out


class _PriorRates(NamedTuple):
    """A prior's per-depth rates ``q_d``, as ``P(accepted length >= d)`` (non-increasing),
    and the tokens a step yields by them."""

    rates: list[float]
    probs: list[float]
    tokens: float


def _running_min(xs: Sequence[float]) -> list[float]:
    """``xs`` made non-increasing and clipped to [0, 1]: each the least of those before."""
    out, low = [], 1.0
    for x in xs:  # low = min(low, max(0.0, x)), without the two calls (a hot loop)
        x = x if x > 0.0 else 0.0
        if x < low:
            low = x
        out.append(low)
    return out


class AcceptanceTracker:
    """Per request, per candidate, per temperature class: how many tokens a step yields.

    Counts (``_Counts``) are kept per (request, candidate, class) and, as a shared prior,
    per (candidate, class) over all requests. Before a step's record, the counts it
    updates are multiplied by ``decay`` (0.8; a request's own once per its step, the prior
    once per engine step): recent steps weigh most, about ``1 / (1 - decay)`` steps' worth.
    A prior starts with ``optimism_weight`` (2) pseudo-steps that accepted its whole tree at
    rate ``optimism`` (1.0), which decay with time: ``optimism_decay`` (0.8) per engine
    step since the prior was made, however rarely the candidate runs. (Decayed per update,
    as the counts are, a deep tree that ran a few times kept reading several tokens at
    batch 1 and was tried again by every new request.)

    The estimate of ``P(accepted length >= d)``, ``d = 1..depth``:

    - prior ``q_d = A_d / S`` (the prior's accepted-at-depth-``d`` and step counts);
      ``optimism`` while no request of the class has tried the candidate;
    - ``p_d = (a_d + w * q_d) / (s + w)``, ``a_d`` / ``s`` the request's own counts and
      ``w = prior_weight`` (1) pseudo-steps of prior; then made non-increasing in ``d``.

    ``accepted_d / steps`` = reach x accept: ``tried_d / steps`` (how often the tree got
    that deep: an n-gram trie often does not) times ``accepted_d / tried_d``.

    Exploration, deterministic (a request's own counts of a tree it does not run stay as
    they were): probes come in **slots per temperature class**, one every
    ``probe_interval`` engine steps (``probe_every``, 8, backed off as below; 0: never),
    whatever the batch size. A slot goes to the class's request offered one longest ago
    (never first, then the batch order: ``probe_takers``), which is offered the candidate
    it has gone longest without using or being offered (never first, then the candidates'
    order) at an upper bound (``probe=True``): its own counts scaled by ``fade ** n`` (0.9;
    ``n`` the request's steps since it last ran it), the prior's weight faded as much per
    engine step since the prior's last update, and one more pseudo-step that accepted the
    whole tree. ``choose`` takes it if that would pay: a tree left long ago, or after
    few steps, is re-tried (its acceptance may have recovered, or it was unlucky); one
    clearly too costly is not. A slot per class, not per request: what one request's probe
    learns goes into the shared prior its class-mates read, while a probe's draft levels
    slow the whole batch's step; per-request probes made a batch of 8 pay them on a
    quarter of its steps. When a request runs a tree again after ``n`` steps without it,
    its own counts are scaled by ``fade ** n`` before the step is added (old evidence
    gives way to new; until then an estimate stays where its last step left it).

    Probes back off per temperature class: a probe that was taken and did not pay
    (``probe_result(cls, False)``: the request went back to ``none``) doubles the class's
    probe interval, up to ``probe_every * 2 ** max_backoff`` (32 steps); one that paid
    resets it. Where no tree pays, as on sampled text a draft rarely guesses or a batch
    too large for trees, probes then cost one step in 32, not one in 8. A failed probe
    also sets a floor under the interval from what it cost (``probe_result``'s ``cost``,
    the seconds it added to its step over that step without it): the class waits at
    least ``cost / probe_budget`` steps (0.03: its failed probes take at most 3% of its
    time), doubled for each further failure in a row (``n`` failed probes since the last
    that paid: ``2 ** (n - 1) * cost / probe_budget``; where nothing pays, the share
    halves with each failure instead of staying at 3%: on SmolLM2 at 4 concurrent, T=0.8,
    the EAGLE head's probes took 1-4% of the time and returned nothing), the largest such
    floor since the last probe that paid, at most ``longest_wait`` (256) steps. A model
    tree's probe pays its draft's catch-up: on the toy at batch 1 a 2-level chain's
    probe cost two plain steps, so one every 32 steps spent 6% of the time on probes
    that never paid.

    >>> t = AcceptanceTracker(decay=0.5, prior_weight=0.0)
    >>> t.observe("r", "chain:3", "greedy", max_depth=3, accepted=2)
    >>> t.observe("r", "chain:3", "greedy", max_depth=3, accepted=0)
    >>> round(t.expected_tokens("r", "chain:3", "greedy", depth=3), 4)  # 1 + 1/3 + 1/3 + 0
    1.6667
    """

    def __init__(
        self,
        decay: float = 0.8,
        prior_weight: float = 1.0,
        optimism: float = 1.0,
        optimism_weight: float = 2.0,
        optimism_decay: float = 0.8,
        probe_every: int = 8,
        fade: float = 0.9,
        max_backoff: int = 2,
        probe_budget: float = 0.03,
        longest_wait: int = 256,
    ):
        if not (0 < decay <= 1 and 0 < fade <= 1 and 0 < optimism_decay <= 1):
            raise ValueError("decay, fade and optimism_decay must be in (0, 1]")
        if not 0 <= optimism <= 1:
            raise ValueError(f"optimism must be in [0, 1], not {optimism!r}")
        if min(prior_weight, optimism_weight, probe_every, max_backoff) < 0:
            raise ValueError(
                "prior_weight, optimism_weight, probe_every and max_backoff must be >= 0"
            )
        self.decay, self.prior_weight, self.fade = decay, prior_weight, fade
        self.optimism, self.optimism_weight = optimism, optimism_weight
        self.optimism_decay = optimism_decay
        if not (0 <= probe_budget <= 1 and longest_wait >= 0):
            raise ValueError(
                f"probe_budget must be in [0, 1] (got {probe_budget!r}) and longest_wait "
                f">= 0 (got {longest_wait!r})"
            )
        self.probe_every, self.max_backoff = probe_every, max_backoff
        self.probe_budget, self.longest_wait = probe_budget, longest_wait
        self._backoff: dict[str, int] = {}  # class -> doublings of probe_every
        self._wait: dict[str, int] = {}  # class -> steps its failed probes' cost asks for
        self._failed: dict[str, int] = {}  # class -> failed probes since the last that paid
        self._own: dict[tuple[object, str, str], _Counts] = {}
        self._prior: dict[tuple[str, str], _Counts] = {}
        self._offered: dict[tuple[object, str, str], int] = {}  # request step of an offer
        self._slot: dict[str, int] = {}  # class -> engine step of its last probe slot
        self._slot_taker: dict[object, int] = {}  # request -> engine step of its last slot
        self._req_steps: dict[object, int] = {}
        self._steps = 0  # engine steps ended (end_step)
        # What a (candidate, class) reads changes only when it is observed or, while its
        # prior's optimism lasts, at each engine step: its version then moves on (a
        # number never reused), and the reads below are kept until it does.
        self._tick = 0
        self._version: dict[tuple[str, str], int] = {}
        # (candidate, class, depth, reached) -> (version, the prior's rates)
        self._q: dict[tuple[str, str, int, bool], tuple[int, _PriorRates]] = {}
        # (request, candidate, class, depth, reached) -> (version, expected tokens)
        self._memo: dict[tuple[object, str, str, int, bool], tuple[int, float]] = {}

    def observe(
        self,
        req_id: object,
        name: str,
        cls: str,
        max_depth: int,
        accepted: int,
        depth: int | None = None,
        shadow: bool = False,
    ) -> None:
        """One step of ``req_id`` under candidate ``name`` in class ``cls``: a tree
        ``max_depth`` deep of which ``accepted`` drafts were accepted. One call per request
        per engine step, then ``end_step()``. ``depth``: the deepest the candidate's tree
        can be (``tree_depth``), for the prior's optimistic start (else ``max_depth``: an
        n-gram trie that found no match is 0 deep). ``shadow``: a tree the request built
        but did not run, scored against the tokens it emitted since (``AutoPolicy``'s trie
        shadows): counted as a step of the candidate, not of the request (its step clock
        stays)."""
        if cls not in CLASSES:
            raise ValueError(f"temperature class {cls!r}: expected one of {CLASSES}")
        max_depth = max(int(max_depth), 0)
        accepted = min(max(int(accepted), 0), max_depth)
        now = self._req_steps.get(req_id, 0) + (0 if shadow else 1)
        self._req_steps[req_id] = now
        own = self._own.get((req_id, name, cls))
        if own is None:
            own = self._own[req_id, name, cls] = _Counts()
        stale = self.fade ** max(now - own.last - 1, 0)  # as offered at a probe
        own.add(now, self.decay * stale, max_depth, accepted)
        prior = self._prior.get((name, cls))
        if prior is None:  # optimistic start: pseudo-steps that decay away with time
            n, now = max(max_depth, depth or 0), self._steps + 1
            prior = _Counts(last=now, born=now, pseudo_depth=n, pseudo_rate=self.optimism)
            prior.pseudo = self.optimism_weight
            self._prior[name, cls] = prior
        prior.add(self._steps + 1, self.decay, max_depth, accepted)
        self._bump(name, cls)

    def tick(self, req_id: object) -> None:
        """One step of ``req_id`` that drafted nothing (``none``): its step clock moves, as
        ``observe`` would move it, and nothing else (a tree 0 deep teaches no rate; every
        candidate that drafts reads the same as before, ``none`` reads 1 token)."""
        self._req_steps[req_id] = self._req_steps.get(req_id, 0) + 1

    def _bump(self, name: str, cls: str) -> None:
        """What (``name``, ``cls``) reads changed: its kept reads are stale."""
        self._tick += 1
        self._version[name, cls] = self._tick

    def end_step(self) -> None:
        """The engine step is over (the priors' step clock): a prior whose optimism is not
        spent reads differently now."""
        self._steps += 1
        for (name, cls), prior in self._prior.items():
            if prior.pseudo > 0 and self._pseudo(prior, self._steps - 1) > 0:
                self._bump(name, cls)

    def optimistic(self, name: str, cls: str, below: float = 0.05) -> bool:
        """Whether candidate ``name``'s prior in class ``cls`` still holds ``below`` or
        more optimistic pseudo-steps (or has no counts yet): its estimates read high."""
        prior = self._prior.get((name, cls))
        return prior is None or self._pseudo(prior) >= below

    def _pseudo(self, prior: _Counts, steps: int | None = None) -> float:
        """A prior's optimistic pseudo-steps now (or after ``steps`` engine steps):
        ``optimism_weight`` at its birth, times ``optimism_decay`` per engine step since;
        0 once below ``1e-12`` of a step (spent: the prior then reads the same until it is
        observed again)."""
        now = self._steps if steps is None else steps
        w = prior.pseudo * self.optimism_decay ** max(now + 1 - prior.born, 0)
        return w if w >= 1e-12 else 0.0

    def counts(
        self, req_id: object | None, name: str, cls: str
    ) -> tuple[float, list[float], list[float]]:
        """The decayed ``(steps, tried, accepted)`` of a request's own counts (``req_id``
        None: the prior's, pseudo-steps included), as they stand after its last update."""
        c = self._prior.get((name, cls)) if req_id is None else self._own.get((req_id, name, cls))
        if c is None:
            return (0.0, [], [])
        w = self._pseudo(c) if req_id is None else 0.0
        n = max(len(c.tried), c.pseudo_depth)
        add = [w if d < c.pseudo_depth else 0.0 for d in range(n)]
        tried = [(c.tried[d] if d < len(c.tried) else 0.0) + add[d] for d in range(n)]
        acc = [
            (c.accepted[d] if d < len(c.accepted) else 0.0) + add[d] * c.pseudo_rate
            for d in range(n)
        ]
        return (c.steps + w, tried, acc)

    def forget(self, req_id: object) -> None:
        """Drop a finished request's own counts (the prior keeps what it taught)."""
        self._req_steps.pop(req_id, None)
        self._slot_taker.pop(req_id, None)
        for table in (self._own, self._offered, self._memo):
            for k in [k for k in table if k[0] == req_id]:
                del table[k]

    def accept_probs(
        self,
        req_id: object,
        name: str,
        cls: str,
        depth: int,
        probe: bool = False,
        reached: bool = False,
    ) -> list[float]:
        """``P(accepted length >= d)`` for ``d = 1..depth``, non-increasing, in [0, 1];
        ``probe``: the upper bound a probe is offered at (see the class); ``reached``:
        this step's tree is known to be ``depth`` deep (a trie built before the choice,
        ``step_tries``), so each depth's rate is over the steps whose tree reached it
        (``accepted[d] / tried[d]``), not over all (a trie that often matches one token
        would otherwise read low at depth 3 on a step where it matched five)."""
        prior, own = self._prior.get((name, cls)), self._own.get((req_id, name, cls))
        opt, w = self.optimism, self.prior_weight
        scale = 1.0
        if probe and own is not None:
            scale = self.fade ** (self._req_steps.get(req_id, 0) - own.last)
        stale = 1.0  # a probe: the prior's weight fades as its own evidence went stale
        if probe and prior is not None:  # (else a few failed runs, long ago, would hold
            stale = self.fade ** max(self._steps + 1 - prior.last, 0)  # the bound down)
        read = self._prior_rates(name, cls, depth, reached)
        if own is None and not probe:  # the prior's, as most of a batch reads it
            return list(read.probs)
        rates = read.rates if own is None else own.rates(read.rates, w, scale, reached)
        if probe:  # one more pseudo-step that accepted the whole tree
            probed = []  # a new list: ``read.rates`` is the prior's, cached
            for d, p in enumerate(rates):
                s = (own.count(d, reached) * scale if own is not None else 0.0) + w * stale
                probed.append((p * s + opt) / (s + 1.0))
            rates = probed
        return _running_min(rates)

    def expected_tokens(
        self,
        req_id: object,
        name: str,
        cls: str,
        depth: int,
        probe: bool = False,
        reached: bool = False,
    ) -> float:
        """Tokens a step of candidate ``name`` (a tree ``depth`` deep) emits for ``req_id``:
        ``1 + sum(accept_probs)``, in ``[1, 1 + depth]``."""
        if depth <= 0:  # ``none``: no draft to accept
            return 1.0
        if probe:  # read at its step's staleness: never kept
            return 1.0 + sum(self.accept_probs(req_id, name, cls, depth, probe, reached))
        key, version = (req_id, name, cls, depth, reached), self._version.get((name, cls), 0)
        kept = self._memo.get(key)
        if kept is not None and kept[0] == version:
            return kept[1]
        if (req_id, name, cls) not in self._own:
            tokens = self._prior_rates(name, cls, depth, reached).tokens
        else:
            tokens = 1.0 + sum(self.accept_probs(req_id, name, cls, depth, False, reached))
        self._memo[key] = (version, tokens)
        return tokens

    def _prior_rates(self, name: str, cls: str, depth: int, reached: bool) -> _PriorRates:
        """The class prior's rates of candidate ``name`` to ``depth`` now (``optimism``
        while it has none), computed again only once the candidate's version moved."""
        key, version = (name, cls, depth, reached), self._version.get((name, cls), 0)
        kept = self._q.get(key)
        got = kept[1] if kept is not None and kept[0] == version else None
        if got is None:
            prior, opt = self._prior.get((name, cls)), self.optimism
            pseudo = 0.0 if prior is None else self._pseudo(prior)
            rates = [opt] * depth
            if prior is not None:
                rates = prior.rates(rates, 0.0, 1.0, reached, pseudo)
            probs = _running_min(rates)
            got = _PriorRates(rates, probs, 1.0 + sum(probs))
            self._q[key] = (version, got)
        return got

    def probe_interval(self, cls: str) -> int:
        """Engine steps between class ``cls``'s probe slots now (0: never): ``probe_every``,
        doubled per taken probe that did not pay since the last that did (``max_backoff``
        times at most), and at least the wait the costliest of those asked for
        (``probe_result``)."""
        if not self.probe_every:
            return 0
        return max(self.probe_every << self._backoff.get(cls, 0), self._wait.get(cls, 0))

    def probe_result(self, cls: str, paid: bool, cost: float = 0.0) -> None:
        """A taken probe in class ``cls`` paid (the request kept drafting) or not.
        ``cost``: the seconds the probe added to its step, over that step's seconds without
        it (a fraction, >= 0); the ``n``-th probe in a row that did not pay makes the class
        wait at least ``2 ** (n - 1) * cost / probe_budget`` engine steps (at most
        ``longest_wait``) until a probe pays."""
        if paid:
            self._backoff[cls] = 0
            self._wait.pop(cls, None)
            self._failed.pop(cls, None)
            return
        self._backoff[cls] = min(self._backoff.get(cls, 0) + 1, self.max_backoff)
        n = self._failed[cls] = self._failed.get(cls, 0) + 1
        if self.probe_budget > 0 and cost > 0:
            asked = math.ceil(cost / self.probe_budget * 2 ** min(n - 1, 16))
            wait = min(asked, self.longest_wait)
            self._wait[cls] = max(self._wait.get(cls, 0), wait)

    def probe_takers(self, requests: Sequence[tuple[object, str]]) -> set[object]:
        """Of this engine step's ``[(req_id, class), ...]``, the requests a probe slot goes
        to: per class whose slot is due (``probe_interval`` engine steps after its last;
        the first on the class's ``probe_interval``-th step), the one given a slot longest
        ago (never first, then the order given). Marks the slots given."""
        now = self._steps + 1
        every: dict[str, int] = {}
        for _, cls in requests:
            if cls not in every:
                every[cls] = self.probe_interval(cls)
                self._slot.setdefault(cls, now - 1)  # first due at step `every`
        takers: dict[str, object] = {}
        for rid, cls in requests:
            if not every[cls] or now - self._slot[cls] < every[cls]:
                continue
            best = takers.get(cls)
            if best is None or self._slot_taker.get(rid, -1) < self._slot_taker.get(best, -1):
                takers[cls] = rid
        for cls, rid in takers.items():
            self._slot[cls] = self._slot_taker[rid] = now
        return set(takers.values())

    def probe(self, req_id: object, cls: str, names: Sequence[str]) -> str | None:
        """The candidate among ``names`` (drafting ones, in the candidates' order) offered
        to ``req_id``, a taker of this step's probe slot of class ``cls``
        (``probe_takers``), and marked offered; None when ``names`` is empty."""
        if not names:
            return None
        n = self._req_steps.get(req_id, 0) + 1

        def last(name: str) -> int:
            own = self._own.get((req_id, name, cls))
            return max(-1 if own is None else own.last, self._offered.get((req_id, name, cls), -1))

        name = min(names, key=last)  # min() keeps the first of equals
        self._offered[req_id, name, cls] = n
        return name
