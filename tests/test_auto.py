"""``tree: auto``'s decision core (``tree_dev.auto``): no models, no engines, no vLLM.

Expected values are written out by hand or derived from a formula stated in the test.
The acceptance formula used for synthetic requests: a request that accepts each depth with
probability ``p`` given the depth before it (the tree reaching ``D`` levels) yields
``E(p, D) = 1 + sum_{d=1..D} p**d`` tokens per step.
"""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tree_dev import auto
from tree_dev.auto import (
    AcceptanceTracker,
    AutoPolicy,
    Candidate,
    CostModel,
    Shape,
    cache_key,
    cache_path,
    choose,
    default_shapes,
    is_branched,
    load_cost_model,
    load_or_measure,
    make_candidates,
    measure,
    policy_shape,
    save_cost_model,
    step_tries,
    temperature_class,
    tree_depth,
    trie_walk,
)
from tree_dev.proposer import TreeExpansion
from tree_dev.spec import parse_tree_spec
from tree_dev.step import GREEDY_TEMPERATURE, DepthStats

BIG = "topk:k=4,depth=6,budget=32"
CANDS = ["chain:2", "chain:4", BIG]
# a GPU-like step: 10 ms fixed, 0.03 ms per verify row, 0.6 ms per draft level, 0.02 ms per
# draft row. Per request (make_candidates' order, shapes from test_policy_shapes_by_hand):
#   none    (1, 0, 0)   10.03 ms      chain:2 (3, 2, 2)  11.33 ms
#   chain:4 (5, 4, 4)   12.63 ms      BIG     (33, 6, 21) 15.01 ms
GPU = dict(a=0.010, b=0.00003, c=0.0006, d=0.00002)


def E(p: float, depth: int) -> float:
    return 1.0 + sum(p**d for d in range(1, depth + 1))


def rows_for(p: float) -> list[float]:
    """Expected tokens of [none, chain:2, chain:4, BIG] at acceptance ``p``."""
    return [E(p, 0), E(p, 2), E(p, 4), E(p, 6)]


def names(picks) -> list[str]:
    return [c.name for c in picks]


# --------------------------------------------------------------------------- shapes
@pytest.mark.parametrize(
    "spec, shape, depth",
    [
        ("none", (1, 0, 0, 0, 0), 0),  # the only undrafted one: a plain step
        ("chain:4", (5, 4, 4, 0, 1), 4),  # levels: root, 1, 2, 3 forwarded; node 4 is a leaf
        ("ngram:budget=8", (9, 0, 0, 1, 1), 8),  # a trie may branch
        ("ngram:budget=8,depth=3", (9, 0, 0, 1, 1), 3),
        ("ngram:budget=1", (2, 0, 0, 0, 1), 1),  # one node: a chain
        # made: 4 + 5 * 4*4 = 84 candidates, 32 kept; forwarded: root + 4 per level 2..6
        (BIG, (33, 6, 21, 1, 1), 6),
        ("topk:k=2,depth=4,budget=8", (9, 4, 7, 1, 1), 4),  # spec.draft_slots says 6 (+ root)
        ("topk:k=2,depth=2,budget=32", (7, 2, 3, 1, 1), 2),  # only 2 + 2*2 = 6 candidates exist
        ("topk:k=1,depth=3,budget=8", (4, 3, 3, 0, 1), 3),  # k=1: a chain
        ("paths:[(0,),(1,),(0,0)]", (4, 2, 2, 1, 1), 2),  # root and node (0,) have children
        ("paths:[(0,),(0,0)]", (3, 2, 2, 0, 1), 2),  # a chain spelt as paths
        # top-K part: 2 + 5*4 = 22 made, 16 kept with the trie; n-gram depth = its budget 16
        ("hybrid:k=2,depth=6,budget=16", (17, 6, 11, 1, 1), 16),
    ],
)
def test_policy_shapes_by_hand(spec, shape, depth):
    policy = parse_tree_spec(spec)
    assert policy_shape(policy) == Shape(*shape)
    assert tree_depth(policy) == depth


@pytest.mark.parametrize(
    "spec", [BIG, "topk:k=2,depth=2,budget=32", "chain:4", "paths:[(0,),(1,),(0,0)]"]
)
def test_policy_shapes_match_the_proposer(spec):
    """The draft levels / forwarded rows / kept nodes the real expansion has."""
    import torch

    policy = parse_tree_spec(spec)
    ex = TreeExpansion(policy, 0)
    gen = torch.Generator().manual_seed(0)
    levels = rows = 0
    while ex.frontier():
        levels, rows = levels + 1, rows + len(ex.frontier())
        ex.absorb(torch.log_softmax(torch.randn(len(ex.frontier()), 50, generator=gen), -1))
    tree = ex.result()[0]
    assert policy_shape(policy) == (tree.num_nodes, levels, rows, is_branched(tree), 1, 1)
    assert tree.max_depth <= tree_depth(policy)  # a kept top-K tree may be shallower


def test_make_candidates_orders_cheapest_first_and_adds_none():
    cands = make_candidates([BIG, "chain:4+sampled", "chain:2", "chain:2"])
    assert names(cands) == ["none", "chain:2", "chain:4+sampled", BIG]
    assert cands[2].sampled_drafts and cands[2].policy.spec == "chain:4"
    with pytest.raises(ValueError, match="suffix"):
        make_candidates(["chain:2+greedy"])
    with pytest.raises(ValueError, match="static"):
        make_candidates([BIG + "+sampled"])


def test_temperature_classes_follow_the_walk():
    assert temperature_class(0.0) == "greedy"
    assert temperature_class(GREEDY_TEMPERATURE / 2) == "greedy"
    assert temperature_class(GREEDY_TEMPERATURE) == "sampled"
    assert temperature_class(0.8) == "sampled"


# --------------------------------------------------------------------------- cost model
TRUE = dict(a=4e-3, b=1e-4, c=1.2e-3, d=5e-5, e=8e-4, f=1.5e-3, g=3e-4)


def true_seconds(shape) -> float:
    """``TRUE``'s seconds of a step of ``shape``."""
    v, lv, r, br, dr, n = Shape(*shape)
    t = TRUE
    return t["a"] + t["b"] * v + t["c"] * lv + t["d"] * r + t["e"] * br + t["f"] * dr + t["g"] * n


def fake_forward(noise: float, seed: int = 0):
    """A run_step with a known cost (``TRUE``) times ``1 + noise * N(0, 1)`` on a fake clock."""
    rng = np.random.default_rng(seed)
    now = [0.0]
    calls = []

    def run_step(shape):
        calls.append(shape)
        cost = true_seconds(shape)
        now[0] += cost * (1 + noise * rng.standard_normal())

    return run_step, (lambda: now[0]), calls


def test_measure_recovers_known_coefficients_from_noisy_steps():
    """Every coefficient, the branched trees' ``e``, a drafted step's ``f`` and a
    request's ``g`` included, from steps with 3% noise: plain steps of 1, 16 and 64
    requests (vLLM's batches with no draft) beside drafted ones of 1 and 4 requests."""
    run_step, clock, calls = fake_forward(noise=0.03)
    plain = [s._replace(requests=s.verify_rows) for s in default_shapes() if s.draft_levels == 0]
    drafted = [
        s._replace(drafted=1, requests=k)
        for s in default_shapes()
        if s.verify_rows > 1
        for k in (1, 4)
    ]
    shapes = plain + drafted + [s._replace(branched=k) for s in drafted for k in (1, 4)]
    model = measure(run_step, shapes, repeats=5, warmup=1, clock=clock)
    assert len(calls) == len(shapes) * (1 + 5)
    for k, tol in zip("abcdefg", (0.05, 0.05, 0.05, 0.15, 0.1, 0.1, 0.1)):
        assert getattr(model, k) == pytest.approx(TRUE[k], rel=tol), k
    for shape in shapes:
        assert model.predict(shape) == pytest.approx(true_seconds(shape), rel=0.03)
    assert model.samples == len(shapes) and 0 < model.rel_rms < 0.03


def test_a_fit_without_branched_or_plain_steps_prices_them_at_zero():
    """The local engine times no branched step (its tree attention is the same for any
    tree), runs a step with drafts as one without, and times one request a step: ``e``,
    ``f`` and ``g`` are 0, not a guess (the request's cost is the step's: ``a``), and
    the other coefficients are unchanged."""
    run_step, clock, _ = fake_forward(noise=0.0)
    model = measure(run_step, default_shapes(), repeats=1, warmup=0, clock=clock)
    assert model.e == model.f == model.g == 0.0
    assert model.a == pytest.approx(TRUE["a"] + TRUE["g"], rel=1e-6)
    for k in "bcd":
        assert getattr(model, k) == pytest.approx(TRUE[k], rel=1e-6), k


def test_fit_keeps_coefficients_non_negative():
    # seconds = 0.01 + 0.001 * verify_rows - 0.0001 * draft_rows: no least-squares fit with
    # d >= 0 beats dropping d; the rest of the data is exactly a + b * verify_rows
    samples = [
        (Shape(v, lv, r), 0.01 + 0.001 * v - 0.0001 * r)
        for v, lv, r in [(1, 0, 0), (8, 0, 0), (32, 0, 0), (1, 2, 8), (8, 2, 8), (32, 6, 32)]
    ]
    model = CostModel.fit(samples)
    assert min(model.a, model.b, model.c, model.d) >= 0
    assert model.d == 0
    with pytest.raises(ValueError):
        CostModel.fit([])
    with pytest.raises(ValueError):
        CostModel.fit([(Shape(1, 0, 0), 0.0)])


def test_drafted_factor_learns_what_drafts_add_beyond_the_fit():
    """Plain steps of 4 as the fit says and drafted ones of two sizes whose drafts take
    1.4x what it says (1 ms a row over the plain step's 4 rows): the uniform correction
    stays near 1, ``drafted_factor`` goes to 1.4 with no offset, and the prediction of a
    drafted step is then its measured seconds; plain steps leave both alone, and the
    factor is clipped to ``drafted_bounds`` (1 to 2)."""
    m = CostModel(a=0.040, b=0.001, c=0.0, d=0.0, f=0.002)
    plain = Shape(4, 0, 0, 0, 0, 4)
    small, big = Shape(12, 0, 0, 0, 1, 4), Shape(72, 0, 0, 0, 1, 4)
    extra = {s: m.raw(s) - m.raw(plain) for s in (small, big)}  # f and 8 / 68 rows
    for _ in range(200):
        m.observe(plain, m.raw(plain))
        assert (m.drafted_factor, m.drafted_offset) == (1.0, 0.0)
    for _ in range(80):
        m.observe(plain, m.raw(plain))
        for s in (small, big):
            m.observe(s, m.raw(plain) + 1.4 * extra[s])
    assert m.correction == pytest.approx(1.0, abs=0.01)
    assert m.drafted_factor == pytest.approx(1.4, rel=0.03)
    assert m.drafted_offset == pytest.approx(0.0, abs=1e-3)  # of 10 and 70 ms
    for s in (small, big):
        assert m.predict(s) == pytest.approx(m.raw(plain) + 1.4 * extra[s], rel=0.01)
    assert m.predict(plain) == pytest.approx(m.correction * m.raw(plain))
    for _ in range(50):
        for s in (small, big):
            m.observe(s, m.raw(plain) + 9 * extra[s])
    assert m.drafted_factor == m.drafted_bounds[1] == 2.0
    for _ in range(50):  # drafts cheaper than the fit says: never priced below it
        for s in (small, big):
            m.observe(s, m.raw(plain) + 0.3 * extra[s])
    assert (m.drafted_factor, m.drafted_offset) == (m.drafted_bounds[0], 0.0) == (1.0, 0.0)


def test_drafted_offset_prices_a_step_the_fit_reads_as_free():
    """A fit that put the fixed cost of a step with drafts elsewhere (``f`` 0, rows free)
    says a chain trie's step costs what a plain one does; measured, it takes 2.5 ms more,
    as does a step with a branched tree (2.8 ms by the fit) 2.5 ms over it. No factor
    can price the first (it scales 0): ``drafted_offset`` learns the 2.5 ms, the factor
    stays at 1, and both steps are then predicted as measured. The offset is at most a
    plain step of one request."""
    m = CostModel(a=0.0045, b=0.0, c=0.002, d=0.0, e=0.0028, f=0.0, g=0.0003)
    plain, chain, branched = (Shape(8, 0, 0, br, dr, 8) for br, dr in ((0, 0), (0, 1), (1, 1)))
    assert m.predict(chain) == m.predict(plain)
    for _ in range(150):  # the uniform correction takes a share at first
        m.observe(plain, m.raw(plain))
        m.observe(chain, m.raw(plain) + 0.0025)
        m.observe(branched, m.raw(branched) + 0.0025)
    assert m.drafted_offset == pytest.approx(0.0025, rel=0.03)
    assert m.drafted_factor == pytest.approx(1.0, abs=0.02)
    assert m.predict(chain) == pytest.approx(m.raw(plain) + 0.0025, rel=0.01)
    assert m.predict(branched) == pytest.approx(m.raw(branched) + 0.0025, rel=0.01)
    assert m.priced().f == pytest.approx(m.drafted_offset)  # choose's price of drafting
    for _ in range(60):  # far dearer: capped at a plain step of one request
        m.observe(chain, m.raw(plain) + 0.5)
    assert m.drafted_offset == pytest.approx(m.a + m.b + m.g)
    m.drafted_offset_max = 0.0  # no offset (an A/B's other side): gone where it is read
    assert m.predict(chain) == pytest.approx(m.predict(plain))
    assert m.priced().f == 0.0
    fixed = CostModel(a=0.0045, b=0.0, c=0.0, d=0.0, learn_drafted=False)
    fixed.observe(chain, 0.5)
    assert (fixed.drafted_factor, fixed.drafted_offset) == (1.0, 0.0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 64), min_size=6, max_size=6),
    st.floats(0.5, 2.0),
    st.floats(0.0, 0.01),
    st.lists(st.floats(0.0, 0.01), min_size=7, max_size=7),
)
def test_priced_model_is_plain_step_plus_scaled_drafts(sizes, k, o, coef):
    """``CostModel.priced()``'s raw seconds of any shape are the plain step of its
    requests plus, with drafts, ``drafted_factor`` times what they add and
    ``drafted_offset``; its ``predict`` at ``correction`` equals the model's own:
    ``choose`` compares what ``predict`` says."""
    v, lv, r, br, dr, n = sizes
    dr = 1 if v or lv or r or br else min(dr, 1)  # a step with drafts is drafted (f)
    shape = Shape(n + v, lv, r, br, dr, n)
    m = CostModel(*coef, drafted_factor=k, drafted_offset=o, correction=1.3)
    p = m.priced()
    plain = m.raw(m.plain_of(shape))
    o = min(o, m.a + m.b + m.g)  # the offset's cap: a plain step of one request
    want = plain + k * (m.raw(shape) - plain) + o if dr else m.raw(shape)
    assert p.raw(shape) == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert p.correction * p.raw(shape) == pytest.approx(m.predict(shape), rel=1e-9, abs=1e-12)
    assert p.raw(m.plain_of(shape)) == pytest.approx(plain, rel=1e-9, abs=1e-12)


def test_auto_stops_drafting_once_drafts_are_measured_dearer_than_modelled():
    """chain:2 accepts both drafts (3 tokens a step); by the model a step with it costs
    10 ms against 4 ms plain (0.30 against 0.25 tokens/ms: it pays). Plain steps run as
    modelled. Where its drafts take 1.8x what the model says (14.8 ms a step: 0.20
    tokens/ms), ``drafted_factor`` learns 1.8 within a few steps and the policy gives
    none from then on; where they take what it says, chain:2 is kept."""
    picks = {}
    for slower in (1.8, 1.0):
        cost = CostModel(a=0.004, b=0.0, c=0.003, d=0.0)
        for _ in range(30):  # plain steps as modelled (a served batch's, the anchor's)
            cost.observe(Shape(1, 0, 0, 0, 0, 1), 0.004)
        policy = AutoPolicy(["chain:2"], cost, AcceptanceTracker(probe_every=0))
        got = picks[slower] = []
        for _ in range(12):
            pick = policy.choose([("r", 0.0)])["r"]
            got.append(pick.name)
            seconds = 0.004 + (slower * 0.006 if pick.depth else 0.0)
            policy.record([step_of("r", pick.depth, pick.depth)], seconds)
        assert policy.stats.as_dict()["drafted_factor"] == policy.cost_model.drafted_factor
    assert picks[1.0] == ["chain:2"] * 12
    first = picks[1.8].index("none")
    assert 0 < first <= 5 and set(picks[1.8][first:]) == {"none"}, picks[1.8]


def test_online_correction_moves_prediction_towards_measured():
    m = CostModel(a=0.010, b=0.0, c=0.0, d=0.0, correction_decay=0.9, bounds=(0.5, 2.0))
    shape = Shape(1, 0, 0)
    assert m.predict(shape) == pytest.approx(0.010)
    m.observe(shape, 0.015)  # (15) / (10)
    assert m.correction == pytest.approx(1.5) and m.predict(shape) == pytest.approx(0.015)
    m.observe(shape, 0.030)  # (0.9*15 + 30) / (0.9*10 + 10) = 43.5 / 19 > 2: clipped
    assert m.correction == 2.0
    before = abs(m.predict(shape) - 0.004)
    m.observe(shape, 0.004)  # (0.9*43.5 + 4) / (0.9*19 + 10) = 43.15 / 27.1
    assert m.correction == pytest.approx(43.15 / 27.1)
    assert abs(m.predict(shape) - 0.004) < before
    for _ in range(100):
        m.observe(shape, 0.001)  # towards 0.1, clipped at 0.5
    assert m.correction == 0.5
    m.observe(shape, float("nan"))  # ignored
    assert m.correction == 0.5


def test_cost_model_json_round_trip_and_rejects():
    m = CostModel(a=0.004, b=1e-4, c=0.0012, d=5e-5, e=2e-3, f=3e-3, samples=15, rel_rms=0.01)
    back = CostModel.from_json(m.to_json())
    got = (back.a, back.b, back.c, back.d, back.e, back.f, back.samples, back.rel_rms)
    assert got == (0.004, 1e-4, 0.0012, 5e-5, 2e-3, 3e-3, 15, 0.01)
    # a model given by hand may leave out the drafted step's ``f``: 0
    assert CostModel.from_json({"a": 1, "b": 0, "c": 0, "d": 0, "e": 0}).f == 0.0
    good = {"a": 0, "b": 0, "c": 0, "d": 0, "e": 0}
    for bad in (dict(good, a=-1), {"a": 0, "b": 0, "c": 0}, '{"a": NaN}', dict(good, f=-1)):
        with pytest.raises(ValueError):
            CostModel.from_json(bad if isinstance(bad, str) else json.dumps(bad))
    with pytest.raises(ValueError):
        CostModel.from_json({"a": True, "b": 0, "c": 0, "d": 0})


KEY = {"model": "tiny", "machine": "cpu:test:2 cores", "torch": "2.x", "dtype": "float32"}


def test_cache_round_trip_is_json_and_leaves_no_temporary(tmp_path):
    m = CostModel(a=0.004, b=1e-4, c=0.0012, d=5e-5)
    path = save_cost_model(tmp_path / "cache", KEY, m)
    assert path == cache_path(tmp_path / "cache", KEY)
    doc = json.loads(path.read_text())
    assert doc["key"] == KEY and doc["model"]["b"] == 1e-4
    back = load_cost_model(tmp_path / "cache", KEY)
    assert (back.a, back.b, back.c, back.d) == (0.004, 1e-4, 0.0012, 5e-5)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.name]
    assert load_cost_model(tmp_path / "nothing-here", KEY) is None


def test_cache_write_is_atomic(tmp_path, monkeypatch):
    old = CostModel(a=0.001, b=0.0, c=0.0, d=0.0)
    path = save_cost_model(tmp_path, KEY, old)
    before = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(auto.cost_model.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        save_cost_model(tmp_path, KEY, CostModel(a=0.002, b=0.0, c=0.0, d=0.0))
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the temporary is gone
    monkeypatch.undo()
    assert load_cost_model(tmp_path, KEY).a == 0.001


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\x80\x04\x95pickle",  # a pickle is never unpickled: not UTF-8 JSON, ignored
        b'{"format": "something else", "version": 1}',
        b'{"format": "treespec.auto.cost_model", "version": 1, "key": KEY, "model": {}}',
        b"[1, 2, 3]",
        # the format before ``e`` (branched trees): measured again, not read as e = 0
        b'{"format": "treespec.auto.cost_model", "version": 1, "key": KEY, "model": '
        b'{"a": 0.01, "b": 0.001, "c": 0.0, "d": 0.0, "samples": 4, "rel_rms": 0.0}}',
        # an anchor row that is not a step's counts and seconds
        b'{"format": "treespec.auto.cost_model", "version": 3, "key": KEY, "model": '
        b'{"a": 0.01, "b": 0.001, "c": 0.0, "d": 0.0, "e": 0.0}, '
        b'"anchor": [[1, 0, 0, 0, 0, 1, -1]]}',
        # the format before ``f`` (a step with drafts): measured again, not read as f = 0
        b'{"format": "treespec.auto.cost_model", "version": 2, "key": KEY, "model": '
        b'{"a": 0.01, "b": 0.001, "c": 0.0, "d": 0.0, "e": 0.0, "samples": 4, "rel_rms": 0}}',
    ],
)
def test_corrupt_cache_is_ignored_with_a_warning(tmp_path, content):
    content = content.replace(b"KEY", json.dumps(KEY).encode())
    path = cache_path(tmp_path, KEY)
    path.write_bytes(content)
    with pytest.warns(RuntimeWarning, match="ignoring the cost-model cache"):
        assert load_cost_model(tmp_path, KEY) is None


def test_cache_of_another_machine_is_not_used(tmp_path):
    save_cost_model(tmp_path, KEY, CostModel(a=0.001, b=0.0, c=0.0, d=0.0))
    other = dict(KEY, machine="gpu:NVIDIA H200")
    assert cache_path(tmp_path, other) != cache_path(tmp_path, KEY)
    assert load_cost_model(tmp_path, other) is None  # its own file: none
    # the other machine's file copied in under this key's name: read, refused
    cache_path(tmp_path, other).write_bytes(cache_path(tmp_path, KEY).read_bytes())
    with pytest.warns(RuntimeWarning, match="key"):
        assert load_cost_model(tmp_path, other) is None


def test_load_or_measure_measures_once(tmp_path):
    run_step, clock, calls = fake_forward(noise=0.0)
    shapes = [Shape(1, 0, 0), Shape(16, 2, 8), Shape(64, 6, 32), Shape(16, 0, 0)]
    m1 = load_or_measure(tmp_path, KEY, run_step, shapes, repeats=2)
    n = len(calls)
    assert n == len(shapes) * 3
    m2 = load_or_measure(tmp_path, KEY, run_step, shapes, repeats=2)
    assert len(calls) == n and (m2.a, m2.b, m2.c, m2.d) == (m1.a, m1.b, m1.c, m1.d)


def test_cache_key_names_model_machine_torch_dtype():
    import torch

    key = cache_key("tiny", torch.float32)
    assert set(key) == {"model", "machine", "torch", "dtype"}
    assert key["model"] == "tiny" and key["dtype"] == "torch.float32"
    assert key["torch"] == torch.__version__ and key["machine"].startswith("cpu:")


# --------------------------------------------------------------------------- acceptance
def test_tracker_counts_are_depth_stats_counts():
    """With decay 1 the own counts are exactly step.DepthStats' tried / accepted."""
    t = AcceptanceTracker(decay=1.0)
    ds = DepthStats()
    for max_depth, acc in [(4, 4), (4, 0), (2, 1), (6, 3), (0, 0), (4, 2)]:
        t.observe("r", "x", "greedy", max_depth, acc)
        ds.record(max_depth, acc)
    steps, tried, accepted = t.counts("r", "x", "greedy")
    assert (steps, tried, accepted) == (ds.steps, ds.tried, ds.accepted)


def test_a_step_of_none_only_moves_the_requests_clock():
    """``tick`` (what ``AutoPolicy.record`` does for ``none``) reads as observing a tree 0
    deep: every drafting candidate's estimate, own and prior, the probe bound included,
    is the same afterwards; without the clock moving, the own counts' staleness differs."""
    kw = dict(decay=0.7, fade=0.5, probe_every=1)
    ticked, observed, still = (AcceptanceTracker(**kw) for _ in range(3))
    for step in range(12):
        for t in (ticked, observed, still):
            if step % 3 == 0:
                t.observe("r", "chain:4", "sampled", 4, step % 5)
                t.observe("q", "chain:4", "sampled", 4, 1)
        if step % 3:
            ticked.tick("r")
            observed.observe("r", "none", "sampled", 0, 0)
        for t in (ticked, observed, still):
            t.end_step()
    for probe in (False, True):
        got = ticked.expected_tokens("r", "chain:4", "sampled", 4, probe)
        assert got == pytest.approx(observed.expected_tokens("r", "chain:4", "sampled", 4, probe))
    assert ticked.expected_tokens("r", "chain:4", "sampled", 4) != pytest.approx(
        still.expected_tokens("r", "chain:4", "sampled", 4)
    )


def test_expected_tokens_by_hand():
    # decay 0.5, no prior: steps 0.5 + 1 = 1.5; accepted [0.5, 0.5, 0]
    t = AcceptanceTracker(decay=0.5, prior_weight=0.0)
    t.observe("r", "chain:3", "greedy", 3, 2)
    t.observe("r", "chain:3", "greedy", 3, 0)
    assert t.accept_probs("r", "chain:3", "greedy", 3) == pytest.approx([1 / 3, 1 / 3, 0])
    assert t.expected_tokens("r", "chain:3", "greedy", 3) == pytest.approx(1 + 2 / 3)

    # defaults: prior_weight 1, optimism 1 with weight 2. One step (depth 2, 1 accepted):
    # prior = 2 pseudo-steps accepting both depths + the step: S = 3, A = [3, 2]
    # -> q = [1, 2/3]; own s = 1, a = [1, 0] -> p = [(1 + 1)/2, (0 + 2/3)/2] = [1, 1/3]
    t = AcceptanceTracker()
    t.observe("r", "chain:2", "greedy", 2, 1)
    assert t.accept_probs("r", "chain:2", "greedy", 2) == pytest.approx([1, 1 / 3])
    assert t.expected_tokens("r", "chain:2", "greedy", 2) == pytest.approx(1 + 1 + 1 / 3)
    # another request has no history: the prior alone
    assert t.expected_tokens("s", "chain:2", "greedy", 2) == pytest.approx(1 + 1 + 2 / 3)
    # nobody tried chain:4, nor anything sampled: optimism, the whole tree
    assert t.expected_tokens("r", "chain:4", "greedy", 4) == 5.0
    assert t.expected_tokens("r", "chain:2", "sampled", 2) == 3.0


def _fresh_read(t: AcceptanceTracker, *args) -> float:
    """``t.expected_tokens(*args)`` computed from the counts, nothing kept read."""
    t._memo.clear()
    t._q.clear()
    return t.expected_tokens(*args)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["observe", "observe", "observe", "end", "forget", "read"]),
            st.sampled_from(["r0", "r1", "r2"]),
            st.sampled_from(["chain:2", "chain:4", "ngram:budget=8"]),
            st.sampled_from(["greedy", "sampled"]),
            st.integers(0, 6),
            st.integers(0, 6),
        ),
        max_size=60,
    )
)
def test_kept_reads_equal_fresh_ones(ops):
    """Reads are kept per candidate until it is observed or its prior's optimism moves
    with the engine step: over any sequence of observations, ended steps and finished
    requests, every read equals one computed from the counts (and a read kept past an
    observation would not: the check below)."""
    t, fresh = AcceptanceTracker(), AcceptanceTracker()
    for op, rid, name, cls, depth, accepted in ops:
        for tr in (t, fresh):
            if op == "observe":
                tr.observe(rid, name, cls, depth, min(accepted, depth))
            elif op == "end":
                tr.end_step()
            elif op == "forget":
                tr.forget(rid)
        for r in ("r0", "r1", "r2"):
            for reached in (False, True):
                args = (r, name, cls, max(depth, 1), False, reached)
                assert t.expected_tokens(*args) == pytest.approx(_fresh_read(fresh, *args), 1e-12)


def test_a_read_kept_past_an_observation_would_be_seen():
    """The check above can fail: with the version left as it was, an observation that
    halves a request's acceptance leaves its kept read at the old value."""
    t = AcceptanceTracker()
    t.observe("r", "chain:2", "greedy", 2, 2)
    before = t.expected_tokens("r", "chain:2", "greedy", 2)
    t._bump = lambda name, cls: None  # a tracker that forgot to move the version
    t.observe("r", "chain:2", "greedy", 2, 0)
    assert t.expected_tokens("r", "chain:2", "greedy", 2) == before
    assert _fresh_read(t, "r", "chain:2", "greedy", 2) < before - 0.1


def test_forget_drops_a_request_but_keeps_the_prior():
    t = AcceptanceTracker()
    t.observe("r", "chain:2", "greedy", 2, 1)
    t.forget("r")
    assert t.counts("r", "chain:2", "greedy") == (0.0, [], [])
    assert t.counts(None, "chain:2", "greedy")[0] == 3.0  # 2 pseudo-steps + 1
    assert t.expected_tokens("r", "chain:2", "greedy", 2) == pytest.approx(1 + 1 + 2 / 3)


steps_st = st.lists(
    st.integers(0, 6).flatmap(lambda d: st.tuples(st.just(d), st.integers(0, d))),
    max_size=30,
)


@given(steps_st, st.integers(0, 8), st.booleans(), st.floats(0.3, 1.0))
def test_expected_tokens_bounded_and_monotone_in_acceptance(steps, depth, probe, decay):
    """1 <= E <= 1 + depth; P(length >= d) non-increasing; more accepted, never fewer."""
    lo, hi = AcceptanceTracker(decay=decay), AcceptanceTracker(decay=decay)
    for d, acc in steps:
        lo.observe("r", "x", "greedy", d, acc // 2)  # the same trees, fewer accepted
        hi.observe("r", "x", "greedy", d, acc)
        lo.observe("other", "x", "greedy", d, acc // 2)
        hi.observe("other", "x", "greedy", d, acc)
        lo.end_step()
        hi.end_step()
    for t in (lo, hi):
        p = t.accept_probs("r", "x", "greedy", depth, probe)
        assert all(0 <= x <= 1 for x in p)
        assert all(a >= b for a, b in zip(p, p[1:]))
        assert 1.0 <= t.expected_tokens("r", "x", "greedy", depth, probe) <= 1.0 + depth
    e_lo = lo.expected_tokens("r", "x", "greedy", depth, probe)
    assert hi.expected_tokens("r", "x", "greedy", depth, probe) >= e_lo - 1e-12


# --------------------------------------------------------------------------- choose
def test_high_acceptance_greedy_request_gets_the_big_tree():
    # p = 0.9: E = 1, 2.71, 4.0951, 5.217 tokens; per ms: 0.0997, 0.239, 0.324, 0.348
    cands = make_candidates(CANDS)
    assert names(choose([rows_for(0.9)], cands, CostModel(**GPU))) == [BIG]


def test_collapsed_acceptance_gets_no_tree():
    # p = 0.05: chain:2 yields 1.0525 tokens in 11.33 ms (0.0929/ms) < none's 1/10.03 ms
    cands = make_candidates(CANDS)
    assert names(choose([rows_for(0.05)], cands, CostModel(**GPU))) == ["none"]
    # p = 0.2: chain:2 (1.24 tokens, 0.109/ms) beats none; chain:4 1.2496 / 12.63 does not
    assert names(choose([rows_for(0.2)], cands, CostModel(**GPU))) == ["chain:2"]


def test_a_large_batch_gets_smaller_trees_than_batch_one():
    cands = make_candidates(CANDS)
    one = choose([rows_for(0.9)], cands, CostModel(**GPU))
    # 64 requests: the per-row costs add up. All BIG: 2112 verify + 1344 draft rows:
    # 10 + 63.4 + 3.6 + 26.9 = 103.8 ms for 64 * 5.217 = 333.9 tokens (3.2/ms); all
    # chain:4: 10 + 9.6 + 2.4 + 5.1 = 27.1 ms for 262.1 tokens (9.7/ms); all chain:2:
    # 10 + 5.8 + 1.2 + 2.6 = 19.5 ms for 173.4 (8.9/ms)
    many = choose([rows_for(0.9)] * 64, cands, CostModel(**GPU))
    assert names(one) == [BIG]
    assert set(names(many)) == {"chain:4"}
    assert max(c.shape.verify_rows for c in many) < one[0].shape.verify_rows


def test_greedy_and_sampled_requests_get_different_trees():
    # a greedy request at p = 0.9 and a sampled one at p = 0.4 (E = 1, 1.56, 1.6496,
    # 1.6637). BIG's 6 draft levels are paid for the greedy request anyway; the sampled
    # one adds only rows: at ~0.4 tokens/ms, chain:4 gains 0.65 tokens for 0.23 ms of rows,
    # BIG 0.66 for 1.41 ms
    cands = make_candidates(CANDS)
    picks = choose([rows_for(0.9), rows_for(0.4)], cands, CostModel(**GPU))
    assert names(picks) == [BIG, "chain:4"]


def test_ties_go_to_the_cheaper_tree_and_bad_input_is_refused():
    cands = make_candidates(["chain:2"])  # none costs 1, chain:2 costs 2: E 2 ties
    cost = CostModel(a=1.0, b=0.0, c=0.5, d=0.0)
    assert names(choose([[1.0, 2.0]], cands, cost)) == ["none"]
    assert names(choose([[1.0, 2.5]], cands, cost)) == ["chain:2"]
    assert names(choose([[None, 2.0]], cands, cost)) == ["chain:2"]
    assert choose([], cands, cost) == []
    with pytest.raises(ValueError):
        choose([[1.0]], cands, cost)
    with pytest.raises(ValueError):
        choose([[None, None]], cands, cost)


def brute_force_rate(expected, cands, cost, weights=None) -> float:
    """max over every assignment of sum(weight * tokens) / (a + b*V + c*max levels + d*R +
    e*B + f*any drafted)."""
    w = weights or [1.0] * len(expected)
    best = 0.0
    for x in itertools.product(range(len(cands)), repeat=len(expected)):
        if any(expected[i][j] is None for i, j in enumerate(x)):
            continue
        tokens = sum(w[i] * expected[i][j] for i, j in enumerate(x))
        sh = [cands[j].shape for j in x]
        sec = (
            cost.a
            + cost.b * sum(s.verify_rows for s in sh)
            + cost.c * max(s.draft_levels for s in sh)
            + cost.d * sum(s.draft_rows for s in sh)
            + cost.e * sum(s.branched for s in sh)
            + cost.f * max(s.drafted for s in sh)
        )
        best = max(best, tokens / sec)
    return best


@given(
    st.lists(st.lists(st.floats(0, 1), min_size=4, max_size=4), min_size=1, max_size=4),
    st.tuples(*[st.floats(0, 0.01)] * 5),
)
def test_choose_is_the_exact_optimum(accepts, bcde):
    """Against every assignment: ``choose`` finds the best batch rate."""
    assert_choose_is_the_optimum(accepts, bcde)


@given(
    st.lists(st.lists(st.floats(0, 1), min_size=4, max_size=4), min_size=1, max_size=4),
    st.tuples(*[st.floats(0, 0.01)] * 6),
    st.floats(1.0, 2.0),
    st.floats(0.0, 0.01),
)
def test_choose_is_the_exact_optimum_of_a_priced_model(accepts, bcdefg, k, o):
    """``CostModel.priced()`` (what ``AutoPolicy`` hands ``choose``) may carry a negative
    ``g`` (``g + (1 - k) b``) and an offset in ``f``; ``choose`` still finds the best
    batch rate over every assignment, each step priced by the model's own ``raw``."""
    cands = make_candidates(CANDS)
    expected = [[1 + c.depth * u for c, u in zip(cands, row)] for row in accepts]
    cost = CostModel(0.01, *bcdefg, drafted_factor=k, drafted_offset=o).priced()

    def rate(x) -> float:
        tokens = sum(expected[i][j] for i, j in enumerate(x))
        return tokens / cost.raw(auto.batch_shape(cands[j].shape for j in x))

    picks = choose(expected, cands, cost)
    best = max(rate(x) for x in itertools.product(range(len(cands)), repeat=len(expected)))
    assert rate([cands.index(c) for c in picks]) == pytest.approx(best, rel=1e-9)


def assert_choose_is_the_optimum(accepts, bcdef, weights=None) -> None:
    """``choose``'s batch rate equals the best over every assignment, for yields ``1 +
    depth_j * u_ij`` (any in ``[1, 1 + depth]``) and a cost ``(0.01, *bcdef)`` (``CANDS``
    has chains and a branched tree, so ``e`` is in play; ``f`` prices any drafted step);
    ``weights``: per request, what its token is worth."""
    cands = make_candidates(CANDS)
    expected = [[1 + c.depth * u for c, u in zip(cands, row)] for row in accepts]
    cost = CostModel(0.01, *bcdef)
    picks = choose(expected, cands, cost, weights=weights)
    idx = [cands.index(c) for c in picks]
    w = weights or [1.0] * len(expected)
    tokens = sum(w[i] * expected[i][j] for i, j in enumerate(idx))
    rate = tokens / cost.raw(auto.batch_shape(c.shape for c in picks))
    assert rate == pytest.approx(brute_force_rate(expected, cands, cost, weights), rel=1e-9)


@given(
    st.lists(
        st.tuples(st.lists(st.floats(0, 1), min_size=4, max_size=4), st.floats(0.01, 4)),
        min_size=1,
        max_size=4,
    ),
    st.tuples(*[st.floats(0, 0.01)] * 5),
)
def test_choose_with_token_weights_is_the_exact_optimum(rows, bcdef):
    """With a weight per request (``makespan_weights``), against every assignment:
    ``choose`` finds the best weighted batch rate."""
    assert_choose_is_the_optimum([r for r, _ in rows], bcdef, [w for _, w in rows])


def test_makespan_weights_send_the_tree_to_the_request_the_batch_waits_for():
    """A wave of two requests, each with a trie yielding 3 tokens for 8 ms more a step
    (plain 18 ms). Counted alike, both draft (6 tokens / 34 ms > 2 / 18 ms). Request "a"
    20 tokens left, "b" 26, both at 3 tokens a step: the batch ends no sooner than 26 / 3
    = 8.7 steps, and "a" undrafted would take 20: both need drafts, weights 1. With "a"
    8 left, it ends within 8.7 steps undrafted: its token saves only its row, (b + g) =
    2 ms of an 18 ms step, weight 2 * 2 / 18; "b" sets the end, weight 2; only "b"
    drafts."""
    cands = make_candidates(["ngram:budget=4"])
    cost = CostModel(a=0.014, b=0.001, c=0.0, d=0.0, f=0.0, g=0.001)
    rows = [[1.0, 3.0], [1.0, 3.0]]
    built = [{1: Shape(9, 0, 0, 0, 1)}] * 2
    assert names(choose(rows, cands, cost, built)) == ["ngram:budget=4"] * 2
    assert auto.makespan_weights([20, 26], [3.0, 3.0], cost) == [1.0, 1.0]
    w = auto.makespan_weights([8, 26], [3.0, 3.0], cost)
    assert w == pytest.approx([2 * 0.002 / 0.018, 2.0])
    assert names(choose(rows, cands, cost, built, w)) == ["none", "ngram:budget=4"]
    with pytest.raises(ValueError, match="weights must be 2 finite numbers > 0"):
        choose(rows, cands, cost, built, [1.0, 0.0])


@given(
    st.lists(st.lists(st.floats(0, 0.15), min_size=4, max_size=4), min_size=1, max_size=4),
    st.tuples(*[st.floats(0, 0.01)] * 5),
)
def test_choose_is_the_exact_optimum_where_little_is_accepted(accepts, bcde):
    """Where drafts are rarely accepted ``choose`` mostly returns ``none`` for everyone
    without solving (a sufficient test); against every assignment it is still the best
    batch rate, and when it is all ``none``, no assignment beats it."""
    assert_choose_is_the_optimum(accepts, bcde)


def test_a_branched_tree_pays_its_tree_attention():
    """Two requests, each with a 3-node trie yielding 1.5 tokens: one a chain, one
    branched. At 10 ms a step and 1 ms a row, both pay; with 4 ms for a branched tree
    (inside vLLM its rows are tree attention in every layer) the branched one does not:
    3.0 tokens / 18 ms < 2.5 / 14 ms. Where tries do not branch, ``e`` changes nothing."""
    cands = make_candidates(["ngram:budget=4"])  # none, the trie
    rows = [[1.0, 1.5], [1.0, 1.5]]
    built = [{1: Shape(3, 0, 0, 0, 1)}, {1: Shape(3, 0, 0, 1, 1)}]
    free = CostModel(a=0.010, b=0.001, c=0.0, d=0.0)
    priced = CostModel(a=0.010, b=0.001, c=0.0, d=0.0, e=0.004)
    assert names(choose(rows, cands, free, built)) == ["ngram:budget=4"] * 2
    assert names(choose(rows, cands, priced, built)) == ["ngram:budget=4", "none"]
    chains = [{1: Shape(3, 0, 0, 0, 1)}] * 2
    assert names(choose(rows, cands, priced, chains)) == ["ngram:budget=4"] * 2


def test_a_drafted_step_pays_its_fixed_cost_once():
    """By hand, vLLM at batch 8: a plain step 6 ms, 3 ms more for any step with a draft
    (``f``: its speculative path), rows free. One request whose trie yields 2.5 tokens:
    9.5 tokens / 9 ms < 8 / 6 ms: none for all (without ``f`` it drafts). Four such
    requests share the 3 ms: 14 / 9 ms > 8 / 6 ms: all four draft. The all-``none``
    step is priced without ``f``; a step with a trie, with it."""
    cands = make_candidates(["ngram:budget=4"])  # none, the trie
    cost = CostModel(a=0.006, b=0.0, c=0.0, d=0.0, f=0.003)
    one = [[1.0, 2.5]] + [[1.0, None]] * 7  # the others' tries found no match
    assert names(choose(one, cands, cost)) == ["none"] * 8
    assert names(choose(one, cands, CostModel(a=0.006, b=0.0, c=0.0, d=0.0)))[0] != "none"
    four = [[1.0, 2.5]] * 4 + [[1.0, None]] * 4
    assert names(choose(four, cands, cost)) == ["ngram:budget=4"] * 4 + ["none"] * 4
    assert cost.raw(auto.batch_shape([cands[0].shape] * 8)) == pytest.approx(0.006)
    assert cost.raw(auto.batch_shape([cands[1].shape] + [cands[0].shape] * 7)) == (
        pytest.approx(0.009)
    )


def test_a_step_trie_knows_whether_it_branches():
    cands = make_candidates(["ngram:budget=8"])
    chain = step_tries([5, 6, 7, 5], cands)["ngram:budget=8"]  # 5 was followed by 6
    fork = step_tries([5, 6, 5, 7, 5], cands)["ngram:budget=8"]  # by 6, then by 7
    assert chain.shape == Shape(4, 0, 0, 0, 1)  # a trie is a draft: never a plain step
    assert fork.shape.branched == 1 and fork.shape.verify_rows == fork.tree.num_nodes
    assert is_branched(fork.tree) == 1 and is_branched([-1]) == 0


def test_nothing_pays_is_decided_without_the_solver(monkeypatch):
    """By hand: 8 requests, each tree's yield 1.02 tokens (nothing accepted, almost):
    none for all without calling the solver; one request whose chain:4 yields 5 tokens
    makes it solve, and that request gets a tree."""
    from tree_dev.auto import chooser

    calls = []
    solve = chooser._best_under_cap
    monkeypatch.setattr(chooser, "_best_under_cap", lambda *a: calls.append(1) or solve(*a))
    cands = make_candidates(["chain:2", "chain:4"])  # none, chain:2, chain:4
    cost = CostModel(a=0.010, b=0.0005, c=0.001, d=0.0)
    rows = [[1.0, 1.02, 1.02] for _ in range(8)]
    assert {c.name for c in choose(rows, cands, cost)} == {"none"} and not calls
    rows[3] = [1.0, 3.0, 5.0]
    assert choose(rows, cands, cost)[3].name == "chain:4" and calls


# --------------------------------------------------------------------------- together
def step_of(req_id, depth: int, accepted: int):
    """A RequestStep-like record: a tree ``depth`` deep, ``accepted`` drafts accepted."""
    return SimpleNamespace(req_id=req_id, max_depth=depth, accepted=list(range(accepted + 1)))


# Collapse scenario: 4 ms fixed, 0.05 ms per verify row, 1.2 ms per draft level, 0.05 ms
# per draft row. none 4.05 ms; chain:2 (3, 2, 2) 6.65 ms; chain:6 (7, 6, 6) 11.85 ms.
# "Acceptance 0.9 per depth" (DepthStats' acceptance_per_depth): 9 steps in 10 accept the
# whole tree, the 10th none. Then chain:6 yields 1 + 0.9 * 6 = 6.4 tokens (0.54/ms),
# chain:2 2.8 (0.42/ms), none 1 (0.25/ms). Acceptance 0: every tree loses to none.
COLLAPSE = dict(a=0.004, b=0.00005, c=0.0012, d=0.00005)


def run_collapse(longest_rest: int = 4, **tracker_kw):
    """130 steps of one greedy request: good 0-29, collapsed 30-69, good again from 70.
    Returns its picks, the policy, and the class's probe interval before each step.
    ``tracker_kw``: the ``AcceptanceTracker``'s arguments besides its defaults;
    ``longest_rest``: the ``AutoPolicy``'s (0: the request never rests)."""
    tracker = AcceptanceTracker(**tracker_kw)
    cost = CostModel(**COLLAPSE)
    policy = AutoPolicy(["chain:2", "chain:6"], cost, tracker, longest_rest=longest_rest)
    picks, intervals = [], []
    for t in range(130):
        good = t < 30 or t >= 70
        intervals.append(policy.tracker.probe_interval("greedy"))
        pick = policy.choose([("r", 0.0)])["r"]
        accepted = pick.depth if good and t % 10 != 9 else 0
        policy.record([step_of("r", pick.depth, accepted)])
        picks.append(pick.name)
    return picks, policy, intervals


def test_collapse_leaves_the_big_tree_and_returns_when_acceptance_recovers():
    picks, policy, intervals = run_collapse()
    tracker = policy.tracker
    longest = tracker.probe_every << tracker.max_backoff  # 32 steps
    assert picks[:30].count("chain:6") >= 27  # good phase: the big tree
    # acceptance collapses at step 30: from step 38 on (8 steps) a tree is rare (a probe,
    # or the draft's drift fading back), mostly nothing is drafted
    assert picks[38:70].count("none") >= 32 - 32 // tracker.probe_every
    # acceptance recovers at step 70: within one longest probe interval a tree again, for
    # good
    back = next(t for t in range(70, 130) if "none" not in picks[t:])
    assert back < 70 + longest
    # the big tree returns, for good, within five base probe periods
    big = next(t for t in range(back, 130) if picks[t] == "chain:6")
    assert big < back + 5 * tracker.probe_every
    assert all(p == "chain:6" for p in picks[big:])
    assert run_collapse()[0] == picks  # deterministic


def test_failed_probes_back_off_and_a_probe_that_pays_resets():
    """The class's probe interval, its probes' cost aside (``probe_budget=0``): 8 steps
    while trees pay, doubled by each probe after which the request went back to none
    (collapse), at most 32; back to 8 once a probe led to drafting again (recovery)."""
    picks, policy, intervals = run_collapse(probe_budget=0.0)
    longest = policy.tracker.probe_every << policy.tracker.max_backoff
    assert set(intervals[:30]) == {8}
    assert intervals[69] == longest and max(intervals) == longest
    assert intervals[-1] == 8 and intervals.index(longest) > 30


def test_a_costly_failed_probe_makes_its_class_wait_longer():
    """The collapse scenario with the default budget (3%). By hand: a chain:6 probe
    (11.85 ms) over none (4.05 ms) adds 7.8 / 4.05 = 1.93 of a step, so once one fails the
    class waits ceil(1.93 / 0.03) = 65 steps, not 32; a cheaper failed probe (chain:2:
    2.6 / 4.05 = 0.64, 22 steps) does not shorten it; one that pays resets it to 8. Each
    further failure in a row doubles what a probe's cost asks for. Fewer
    probes run in the collapse than without the budget, and the big tree still returns
    once acceptance recovers. (The request never rests here: a resting request takes no
    probe slot, which delays probes too.)"""
    picks, policy, intervals = run_collapse(longest_rest=0)
    assert set(intervals[:30]) == {8}
    assert max(intervals) == 65 and 65 in intervals[40:70]
    assert intervals[-1] == 8 and picks[-1] == "chain:6"
    plain_picks = run_collapse(longest_rest=0, probe_budget=0.0)[0]
    assert picks[40:70].count("none") > plain_picks[40:70].count("none")
    tracker = AcceptanceTracker()
    tracker.probe_result("greedy", paid=False, cost=0.06)  # 2 steps: the back-off rules
    assert tracker.probe_interval("greedy") == 16
    tracker.probe_result("greedy", paid=False, cost=3.0)  # the 2nd failure: 2 * 100
    assert tracker.probe_interval("greedy") == 200
    tracker.probe_result("greedy", paid=False, cost=1.0)  # 4 * 34 = 136: the largest kept
    assert tracker.probe_interval("greedy") == 200
    tracker.probe_result("greedy", paid=True, cost=1.0)  # one that paid resets the count
    tracker.probe_result("greedy", paid=False, cost=1.0)
    assert tracker.probe_interval("greedy") == 34
    tracker.probe_result("greedy", paid=False, cost=1.0)  # in a row: doubled
    assert tracker.probe_interval("greedy") == 67
    tracker.probe_result("greedy", paid=False, cost=50.0)
    assert tracker.probe_interval("greedy") == tracker.longest_wait == 256
    assert tracker.probe_interval("sampled") == 8  # per class
    tracker.probe_result("greedy", paid=True, cost=50.0)
    assert tracker.probe_interval("greedy") == 8
    assert AcceptanceTracker(probe_every=0).probe_interval("greedy") == 0
    for bad in ({"probe_budget": 1.5}, {"probe_budget": -0.1}, {"longest_wait": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            AcceptanceTracker(**bad)


def test_probe_slots_are_per_class_whatever_the_batch_and_rotate_over_requests():
    """One probe slot per temperature class every ``probe_interval`` engine steps, however
    many requests the class has in the batch, given to the request that had one longest
    ago (new ones first): after sampled requests' probes kept failing, the 6 sampled
    requests of a batch share a slot every 32 steps and the 2 greedy ones one every 8."""
    tracker = AcceptanceTracker()
    for _ in range(3):
        tracker.probe_result("sampled", paid=False)
    assert tracker.probe_interval("sampled") == 32 and tracker.probe_interval("greedy") == 8
    batch = [(f"s{i}", "sampled") for i in range(6)] + [("g0", "greedy"), ("g1", "greedy")]
    slots = []
    for step in range(1, 97):
        for rid in sorted(tracker.probe_takers(batch)):
            slots.append((step, rid))
            assert tracker.probe(rid, dict(batch)[rid], ["chain:2"]) == "chain:2"
        for rid, cls in batch:
            tracker.observe(rid, "none", cls, 0, 0)
        tracker.end_step()
    sampled = [(t, r) for t, r in slots if r.startswith("s")]
    greedy = [(t, r) for t, r in slots if r.startswith("g")]
    assert sampled == [(32, "s0"), (64, "s1"), (96, "s2")]
    assert [t for t, _ in greedy] == list(range(8, 97, 8))
    assert [r for _, r in greedy] == ["g0", "g1"] * 6
    tracker.forget("s0")  # a finished request's slot history goes; a new one goes first
    assert tracker.probe_takers([("s1", "sampled"), ("new", "sampled")]) == set()
    tracker.probe_result("sampled", paid=True)
    assert tracker.probe_interval("sampled") == 8
    for _ in range(7):
        tracker.end_step()
    assert tracker.probe_takers([("s1", "sampled"), ("new", "sampled")]) == {"new"}


def test_untried_trees_are_discovered_and_stats_count_choices():
    # nothing known: every tree reads optimism (E = 1 + depth): chain:2 3 tokens in
    # 6.65 ms, chain:6 7 tokens in 11.85 ms -> chain:6 first; it always accepts nothing,
    # so the draft's drift discounts chain:2 too (its first draft would have failed as
    # well) until the drift has decayed back a while
    policy = AutoPolicy(["chain:2", "chain:6"], CostModel(**COLLAPSE))
    first = []
    for _ in range(8):
        pick = policy.choose([("r", 0.0)])["r"]
        first.append(pick.name)
        policy.record([step_of("r", pick.depth, 0)])
    assert first[0] == "chain:6" and "chain:2" in first and first.count("none") >= 5
    stats = policy.stats.as_dict()
    assert stats["steps"] == 8
    assert sum(stats["choices"].values()) == 8
    assert stats["choices_by_class"]["sampled"] == {}


def test_greedy_and_sampled_requests_in_one_auto_batch():
    # the greedy request accepts every tree whole, the sampled one nothing. The greedy
    # request pays chain:6's 6 draft levels, so a tree costs the sampled one only its rows
    # (0.25 ms for chain:2): it takes ~10 steps of evidence to drop it
    policy = AutoPolicy(["chain:2", "chain:6"], CostModel(**COLLAPSE))
    g_picks, s_picks = [], []
    for _ in range(15):  # steps 1..15; step 16 would be a probe
        picks = policy.choose([("g", 0.0), ("s", 0.8)])
        g_picks.append(picks["g"].name)
        s_picks.append(picks["s"].name)
        policy.record(
            [step_of("g", picks["g"].depth, picks["g"].depth), step_of("s", picks["s"].depth, 0)]
        )
    assert g_picks[2:] == ["chain:6"] * 13
    assert s_picks[11:] == ["none"] * 4
    by_class = policy.stats.as_dict()["choices_by_class"]
    assert sum(by_class["greedy"].values()) == sum(by_class["sampled"].values()) == 15
    assert by_class["greedy"]["chain:6"] >= 13 and by_class["sampled"]["none"] >= 4


def test_sampled_draft_candidates_only_for_sampled_requests():
    policy = AutoPolicy(["chain:4+sampled"], CostModel(a=0.01, b=0.0, c=0.0001, d=0.0))
    picks = policy.choose([("g", 0.0), ("s", 0.8)])  # optimism: 5 tokens for 10.4 ms
    assert (picks["g"].name, picks["s"].name) == ("none", "chain:4+sampled")


def test_predicted_and_measured_step_seconds_in_the_stats():
    policy = AutoPolicy(["chain:2"], CostModel(a=0.010, b=0.0, c=0.001, d=0.0))
    picks = policy.choose([("r", 0.0)])
    assert picks["r"].name == "chain:2"  # optimism: 3 tokens in 12 ms
    policy.record([step_of("r", 2, 2)], seconds=0.018)  # measured 1.5x the 12 ms predicted
    stats = policy.stats.as_dict()
    assert stats["last_predicted_s"] == pytest.approx(0.012)
    assert stats["last_measured_s"] == pytest.approx(0.018)
    assert stats["mean_abs_rel_error"] == pytest.approx(abs(0.012 / 0.018 - 1))
    assert stats["correction"] == pytest.approx(1.5)
    policy.choose([("r", 0.0)])
    policy.record([step_of("r", 2, 2)], seconds=0.018)
    assert policy.stats.as_dict()["last_predicted_s"] == pytest.approx(0.018)  # corrected
    policy.choose([("r", 0.0)])
    policy.record([step_of("unknown", 2, 2)])  # a request auto did not choose for: skipped
    assert policy.tracker.counts("unknown", "chain:2", "greedy") == (0.0, [], [])


def test_candidate_name_shape_depth():
    c = Candidate(parse_tree_spec("chain:3"), sampled_drafts=True)
    assert (c.name, c.shape, c.depth) == ("chain:3+sampled", (4, 3, 3, 0, 1, 1), 3)


def test_docstring_examples_hold():
    import doctest

    for module in (auto.shapes, auto.cost_model, auto.acceptance, auto.chooser):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_optimistic_start_covers_the_whole_tree():
    # an n-gram trie that found no match (0 deep) first: the prior's 2 optimistic
    # pseudo-steps still cover its 8 depths -> q_d = 2 / 3; own p_d = (0 + 2/3) / 2
    t = AcceptanceTracker()
    t.observe("r", "ngram:budget=8", "greedy", 0, 0, depth=8)
    assert t.accept_probs("s", "ngram:budget=8", "greedy", 8) == pytest.approx([2 / 3] * 8)
    assert t.accept_probs("r", "ngram:budget=8", "greedy", 8) == pytest.approx([1 / 3] * 8)


def test_a_priors_optimism_decays_with_engine_steps_not_with_its_updates():
    """By hand. One failed step of chain:4 makes its prior: 2 optimistic pseudo-steps and
    1 real one, q = 2/3 at every depth. The candidate never runs again; 10 engine steps
    later the pseudo-steps weigh 2 * 0.8**10 = 0.215, q = 0.215 / 1.215: a new request
    no longer reads 2.5 tokens from a tree that has only failed."""
    t = AcceptanceTracker()
    t.observe("r", "chain:4", "greedy", 4, 0)
    assert t.accept_probs("new", "chain:4", "greedy", 4) == pytest.approx([2 / 3] * 4)
    for _ in range(10):
        t.end_step()
    w = 2 * 0.8**10
    assert t.accept_probs("new", "chain:4", "greedy", 4) == pytest.approx([w / (w + 1)] * 4)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="optimism_decay"):
            AcceptanceTracker(optimism_decay=bad)


def test_unavailable_tries_are_neither_chosen_nor_learnt():
    """A trie that finds no match this step (``step_tries``: None) is not offered: the
    request gets the best of the rest, and nothing is recorded for the trie."""
    policy = AutoPolicy(["ngram:budget=8", "chain:2"], CostModel(**COLLAPSE))
    cands = policy.candidates
    assert step_tries([1, 2, 3, 4], cands) == {"ngram:budget=8": None}
    for _ in range(12):
        pick = policy.choose([("r", 0.0)], tries={"r": step_tries([1, 2, 3, 4], cands)})["r"]
        assert pick.name != "ngram:budget=8"
        policy.record([step_of("r", pick.depth, pick.depth)])
    assert policy.tracker.counts("r", "ngram:budget=8", "greedy") == (0.0, [], [])
    # with a match, the untried trie is offered again (its optimistic prior)
    tries = {"r": step_tries([1, 2, 3, 1], cands)}  # the root and 2, 3, 1: 4 nodes
    assert tries["r"]["ngram:budget=8"].tree.num_nodes == 4
    assert policy.choose([("r", 0.0)], tries=tries)["r"].name == "ngram:budget=8"
    assert policy.step_shape == Shape(4, 0, 0, 0, 1)  # the trie as built, not its budget's 9


def test_a_tries_class_drift_is_what_its_runs_accepted_against_their_estimates():
    """Class drift, by hand. r1 (T=0.8) runs the 8-node trie three times (none and
    chain:2 unavailable), accepting one draft a step where the tracker expected e_i:
    the class's factor is the decayed ratio (0.95 per step). A new request of that
    class reads its trie at it; a greedy one, a probe, and the draft model's trees do
    not; unobserved, it returns to 1 at 0.99 per engine step."""
    trie, chain = "ngram:budget=8", "chain:2"
    tracker = AcceptanceTracker(decay=1.0, prior_weight=1.0, optimism_weight=0.0, probe_every=0)
    policy = AutoPolicy([trie, chain], CostModel(a=0.010, b=0.0, c=0.0, d=0.0), tracker)
    expected = []
    for _ in range(3):
        policy.choose([("r1", 0.8)], {"r1": {"none", chain}})
        expected.append(policy._raw["r1", trie])
        policy.record([step_of("r1", 8, 1)])
    assert expected[0] > expected[-1] >= 1.0  # its estimates ran high at first
    ratio = (0.95**2 + 0.95 + 1) / (0.95**2 * expected[0] + 0.95 * expected[1] + expected[2])
    assert policy.class_drift(trie, "sampled") == pytest.approx(ratio) and ratio < 0.5
    assert policy.class_drift(trie, "greedy") == 1.0
    raw = {cls: tracker.expected_tokens("r2", trie, cls, 8) for cls in ("sampled", "greedy")}
    row = policy.expected_row("r2", "sampled")
    assert row[policy._index[trie]] == pytest.approx(1 + ratio * (raw["sampled"] - 1))
    row = policy.expected_row("r2", "greedy")
    assert row[policy._index[trie]] == pytest.approx(raw["greedy"])
    assert policy.drift("r2", trie, "sampled", probe=True) == 1.0
    policy.choose([("r3", 0.8)], {"r3": {"none", trie}})  # chain:2, nothing accepted
    policy.record([step_of("r3", 2, 0)])
    assert policy.drift("r3", "model", "sampled") == 0.0
    assert policy.class_drift("model", "sampled") == 1.0
    for _ in range(50):  # the trie unobserved for 51 engine steps in all
        policy.choose([("r4", 0.8)], {"r4": {trie, chain}})
        policy.record([step_of("r4", 0, 0)])
    back = 1 - (1 - ratio) * 0.99**51
    assert policy.class_drift(trie, "sampled") == pytest.approx(back)


def test_a_built_trie_is_priced_at_its_nodes_and_read_to_its_depth():
    """By hand. The trie always accepted its first token and nothing deeper: a step of
    it yields 2 tokens. Rows cost 2 ms over a 10 ms step: none 1 token in 12 ms (83
    tokens/s); the trie at its budget's 9 rows 2 tokens in 28 ms (71/s): none; the trie
    ``step_tries`` built, 2 nodes (3 rows), 2 tokens in 16 ms (125/s): the trie."""
    tracker = AcceptanceTracker(decay=1.0, prior_weight=0.0, optimism_weight=0.0)
    policy = AutoPolicy(["ngram:budget=8"], CostModel(a=0.010, b=0.002, c=0.0, d=0.0), tracker)
    for _ in range(3):
        policy.choose([("r", 0.0)], {"r": {"none"}})  # the trie forced: none unavailable
        policy.record([step_of("r", 2, 1)])
    assert policy.choose([("r", 0.0)])["r"].name == "none"
    policy.record([step_of("r", 0, 0)])
    tries = {"r": step_tries([5, 6, 5], policy.candidates)}  # continuation 6, 5: 2 nodes
    assert policy.choose([("r", 0.0)], tries=tries)["r"].name == "ngram:budget=8"
    assert policy.step_shape == Shape(3, 0, 0, 0, 1)


def test_a_trie_known_to_reach_a_depth_reads_the_rates_of_trees_that_reached_it():
    """By hand, no decay nor prior: three steps of a trie 1 deep that accepted its token
    and one 3 deep that accepted all three: tried = [4, 1, 1], accepted = [4, 1, 1]. Over
    all steps depths 2 and 3 read 1/4; a trie known to be 3 deep this step reads them
    over the steps that reached them: 1."""
    t = AcceptanceTracker(decay=1.0, prior_weight=0.0, optimism_weight=0.0)
    for depth in (1, 1, 1, 3):
        t.observe("r", "ngram:budget=8", "greedy", depth, depth)
    assert t.accept_probs("r", "ngram:budget=8", "greedy", 3) == pytest.approx([1, 0.25, 0.25])
    assert t.accept_probs("r", "ngram:budget=8", "greedy", 3, reached=True) == [1, 1, 1]
    assert t.expected_tokens("r", "ngram:budget=8", "greedy", 3, reached=True) == 4.0


def test_a_trie_not_run_is_scored_against_the_tokens_that_followed():
    """Trie shadows, by hand (no decay, no prior, no optimism). The trie is built every
    step but never run (the engine says it cannot: ``unavailable``); on the text 1 2 3 4
    1 2 3 4 ... every step from the second 1 on builds the trie whose path (what followed
    the earlier 1 2 3 4) the text then spells: each shadow, once the text has gone past
    its leaf, is a step of the trie that accepted its whole depth. On text that breaks
    the pattern, the shadow accepts what matched."""

    def run(text, steps):
        tracker = AcceptanceTracker(decay=1.0, prior_weight=0.0, optimism_weight=0.0)
        policy = AutoPolicy(["ngram:budget=8"], CostModel(a=0.01, b=0.001, c=0.0, d=0.0), tracker)
        for n in range(4, 4 + steps):  # the context grows a token a step (none)
            tries = {"r": policy.step_tries("r", text[:n])}
            no = {"r": {"ngram:budget=8"}}
            assert policy.choose([("r", 0.0)], no, tries)["r"].name == "none"
            policy.record([step_of("r", 0, 0)])
        return policy, tracker.counts("r", "ngram:budget=8", "greedy")

    policy, (steps, tried, accepted) = run([1, 2, 3, 4] * 5, 12)
    assert steps == policy.stats.trie_shadows > 0
    assert accepted == tried and tried[0] == steps  # every depth reached was accepted
    text = [1, 2, 3, 4, 1, 9, 9, 9, 9, 9, 9, 9]  # at context 1 2 3 4 1 the trie says 2 3 4
    _, (steps, tried, accepted) = run(text, 3)  # 9 follows: the shadow accepts 0
    assert (steps, tried[0], accepted[0]) == (1.0, 1.0, 0.0)


def test_trie_shadows_learn_failures_without_paying_for_them_and_find_the_trie_again():
    """The trie fails on text whose tokens recur with other continuations (a random
    stream of 4 symbols); then the text turns into a repeated 6-token cycle. With
    shadows auto runs the failing trie fewer times than without them (tries built by
    ``shapes.step_tries``, never shadowed: only its runs teach it), and is back on it at
    most its depth (8) steps after the first full cycle."""
    import random

    rnd = random.Random(0)
    novel = [rnd.randrange(4) for _ in range(40)]
    text = novel + [10, 11, 12, 13, 14, 15] * 30
    cycle = len(novel) + 6  # the first full cycle is in the context from here
    cost = CostModel(a=0.010, b=0.001, c=0.0, d=0.0)  # rows 1 ms: a failing trie loses

    def run(shadows: bool) -> tuple[int, int | None]:
        policy = AutoPolicy(["ngram:budget=8"], cost)
        n, novel_runs, back = 8, 0, None
        while n < len(text) - 20:
            ctx = text[:n]
            tries = policy.step_tries("r", ctx) if shadows else step_tries(ctx, policy.candidates)
            pick = policy.choose([("r", 0.0)], tries={"r": tries})["r"]
            trie = tries.get(pick.name)
            got = 0 if trie is None else trie_walk(trie, text[n:])
            if trie is not None and n < len(novel):
                novel_runs += 1
            if trie is not None and n >= cycle and back is None:
                back = n - cycle
            policy.record([step_of("r", 0 if trie is None else trie.tree.max_depth, got)])
            n += got + 1
        return novel_runs, back

    (runs, back), (runs_blind, _) = run(True), run(False)
    assert runs < runs_blind
    assert back is not None and back <= 8


def test_vllm_refit_records_the_realised_step_shape(tmp_path):
    """Inside vLLM the online refit learns from each step's shape as run, not the chosen
    candidates' nominal ones: a trie that matched 3 tokens verifies 4 rows, not its
    budget's 9; a request whose trie found nothing verifies its root alone; a branched
    trie counts as one (tree attention), a chain as none (vLLM's own kernel)."""
    from tree_dev.spec import parse_tree_spec
    from tree_dev.step import RequestStep
    from tree_dev.vllm_plugin.auto_choice import VllmAuto

    policy = parse_tree_spec("auto:ngram:budget=8").for_draft("ngram")
    va = VllmAuto(policy, "m", "d", "float32", "cpu", cost_model=CostModel(**COLLAPSE))
    va.force("ngram:budget=8")
    va.choose([("a", 0.0), ("b", 0.0), ("c", 0.0)])
    va.drafted()
    va.step_begin()
    chain = RequestStep("a", 5, [1] * 6, [-1, 0, 1, 2], [7, 8, 9, 10], 3, [0, 1], [8, 4])
    fork = RequestStep("c", 5, [1] * 6, [-1, 0, 0], [7, 8, 9], 1, [0], [8])
    va.on_step_event(SimpleNamespace(requests=[chain, fork]))  # "b" verified no tree
    va.step_done()
    assert list(va.anchor)[-1][0] == Shape(4 + 1 + 3, 0, 0, 1, 1, 3)  # forced: the anchor
    assert policy_shape(parse_tree_spec("ngram:budget=8")) == Shape(9, 0, 0, 1, 1)


def test_record_sets_the_seconds_against_the_realised_shape():
    """A trie chosen at budget 8 (9 rows nominal) that matched 2 tokens verifies 3 rows:
    the measured seconds are those of 3 rows, so the prediction for 3 rows is no error
    and the correction stays 1 (set against the nominal 9 rows it falls below 0.9)."""
    corrections = []
    for shape in (Shape(3, 0, 0, 0, 1), None):
        policy = AutoPolicy(["ngram:budget=8"], CostModel(a=0.010, b=0.001, c=0.0, d=0.0))
        assert policy.choose([("r", 0.0)])["r"].name == "ngram:budget=8"  # optimism
        assert policy.step_shape == Shape(9, 0, 0, 1, 1)
        policy.record([step_of("r", 2, 1)], seconds=0.013, shape=shape)
        stats = policy.stats.as_dict()
        want = 0.013 if shape is not None else 0.019
        assert stats["last_predicted_s"] == pytest.approx(want)
        corrections.append(stats["correction"])
    assert corrections[0] == pytest.approx(1.0) and corrections[1] < 0.9


def test_probe_slots_and_back_off_pay_where_no_tree_pays_and_cost_nothing_where_trees_do():
    """``bench.auto_sim``: 50-step requests at SmolLM2's measured step cost, 400 steps.
    Where nothing is ever accepted: at 8 concurrent, one probe slot per class leaves auto
    within 6% of no drafts, its first steps' trial of each of its 8 trees included (0.949
    with 8, 0.95 with 7; per-request probes: 0.93x with 7); at batch 1 the back-off gives
    at least 2% more tokens/s than probing every 8 steps. Where drafts are accepted
    (p = 0.9), auto keeps its gain over no drafts, with or without back-off, within 2%."""
    from bench.auto_sim import SMOLLM2_EAGLE, simulate

    def run(p, batch, **kw):
        return simulate(p, batch, SMOLLM2_EAGLE, steps=400, **kw)

    assert run(0.0, 8) >= 0.94
    assert run(0.0, 1) >= run(0.0, 1, max_backoff=0, probe_budget=0.0) + 0.02
    good, good_no_backoff = run(0.9, 8), run(0.9, 8, max_backoff=0, probe_budget=0.0)
    assert good > 1.2 and good >= 0.98 * good_no_backoff


def test_a_trie_without_a_match_after_its_probe_does_not_back_off():
    """A probe of the trie that cannot be judged (the trie finds no match the next step,
    so the request gets none whatever the probe showed) leaves the interval at 8; when the
    trie could run the next step and the request still went back to none, the interval
    doubles."""
    intervals = {}
    for runnable_after in (False, True):
        policy = AutoPolicy(["ngram:budget=8"], CostModel(**COLLAPSE))
        for n in range(1, 41):  # the trie matches on probe steps (and, or not, the next)
            matches = n % 8 == 0 or (runnable_after and n % 8 == 1)
            unavailable = set() if matches else {"ngram:budget=8"}
            pick = policy.choose([("r", 0.0)], {"r": unavailable})["r"]
            policy.record([step_of("r", pick.depth, 0)])
        intervals[runnable_after] = policy.tracker.probe_interval("greedy")
    assert intervals == {False: 8, True: 32}


def test_a_model_tree_is_priced_with_its_catch_up():
    """By hand. 10 ms a step, 1 ms a draft level, 0.5 ms a draft row; chain:4 is (5, 4, 4):
    16 ms. When it accepted 2 drafts every step (3 tokens) it runs 187/s against none's
    100/s; a request 20 tokens behind (its draft last ran 20 steps ago) adds 20 rows: 26
    ms, 115/s, still chain:4; 30 behind: 31 ms, 97/s: none. A catch-up is priced at 32
    rows at most (a first level's), so a tree that accepts everything (5 tokens, 156/s at
    32 behind) is chosen 1000 tokens behind (a long prompt), where its full catch-up
    would price it out for good. A trie is undrafted: no catch-up."""
    picks = {}
    for accepted in (2, 4):
        tracker = AcceptanceTracker(decay=1.0, prior_weight=0.0, optimism_weight=0.0)
        cost = CostModel(a=0.010, b=0.0, c=0.001, d=0.0005)
        policy = AutoPolicy(["chain:4"], cost, tracker)
        for _ in range(3):
            policy.choose([("r", 0.0)], {"r": {"none"}})  # chain:4 forced: none unavailable
            policy.record([step_of("r", 4, accepted)])
        for late in (0, 20, 30, 1000):
            pick = policy.choose([("r", 0.0)], behind={"r": late})["r"].name
            picks[accepted, late] = pick
            if pick != "none":
                assert policy.step_shape == Shape(5, 4, 4 + min(late, 32), 0, 1)
            policy._pending = {}  # not recorded: the estimate stays where it is
    assert picks == {
        (2, 0): "chain:4",
        (2, 20): "chain:4",
        (2, 30): "none",
        (2, 1000): "none",
        (4, 0): "chain:4",
        (4, 20): "chain:4",
        (4, 30): "chain:4",
        (4, 1000): "chain:4",
    }
    assert auto.with_catch_up(Shape(9, 0, 0), 300) == Shape(9, 0, 0)
    assert auto.with_catch_up(Shape(5, 4, 4), 300) == Shape(5, 6, 304)  # 2 chunks first


def test_one_tries_failures_do_not_discount_another_trie():
    """The wide trie (1-token matches) fails three steps running; the long-match trie's
    expected tokens are what they were (each trie has its own drift factor: on
    SmolLM2 a shared one left auto over tries at 0.76x vLLM plain at 8 concurrent greedy,
    0.90x with its own), while the wide trie's fall. The model's trees share one."""
    from tree_dev.auto import chooser

    wide, long = "ngram:budget=8", "ngram:budget=4,min=3"
    policy = AutoPolicy([wide, long, "chain:2", "chain:4"], CostModel(a=0.010, b=0.0, c=0.0, d=0.0))
    names = [c.name for c in policy.candidates]

    def row() -> dict:
        return dict(zip(names, policy.expected_row("r", "greedy")))

    before = row()
    for _ in range(3):  # the wide trie alone can run
        pick = policy.choose([("r", 0.0)], {"r": {"none", long, "chain:2", "chain:4"}})["r"]
        assert pick.name == wide
        policy.record([step_of("r", 8, 0)])
    after = row()
    assert after[long] == before[long]
    assert after[wide] < before[wide]
    key = chooser.drift_key
    assert key(policy._by_name["chain:2"]) == key(policy._by_name["chain:4"]) == "model"
    assert (key(policy._by_name[wide]), key(policy._by_name[long])) == (wide, long)


def test_a_probe_pays_its_whole_catch_up():
    """By hand, the costs of the test above (none 10 ms, chain:4 16 ms plus 0.5 ms a
    catch-up row). chain:4 ran three steps and accepted nothing, so it reads 1 token and
    the request runs none; every engine step is a probe slot (``probe_every=1``, no
    back-off, no wait for a probe's cost), and the offered chain:4 is read at an upper
    bound that the steps without it fade towards the whole tree: 5 tokens. 10 tokens
    behind (21 ms) the bound pays and the probes run; 200 behind, a probe's step would
    forward the 200 rows first (a chunk and 200 rows, 117 ms: 43/s against none's
    100/s), so none runs. A regular choice, priced at 32 rows at most, is not held back by
    the same catch-up (the test above, 1000 behind)."""
    runs = {}
    for late in (10, 200):
        tracker = AcceptanceTracker(
            decay=1.0,
            prior_weight=0.0,
            optimism_weight=0.0,
            probe_every=1,
            max_backoff=0,
            probe_budget=0.0,
        )
        policy = AutoPolicy(["chain:4"], CostModel(a=0.010, b=0.0, c=0.001, d=0.0005), tracker)
        for _ in range(3):
            policy.choose([("r", 0.0)], {"r": {"none"}})  # chain:4 forced: none unavailable
            policy.record([step_of("r", 4, 0)])
        runs[late] = 0
        for _ in range(40):
            pick = policy.choose([("r", 0.0)], behind={"r": late})["r"]
            runs[late] += pick.name == "chain:4"
            if pick.name == "chain:4":
                assert policy.step_shape == auto.with_catch_up(Shape(5, 4, 4, 0, 1), late)
            policy.record([step_of("r", pick.depth, 0)])
    assert runs[10] >= 3, runs  # probes ran (4 of 40 steps: each failure lowers the bound)
    assert runs[200] == 0, runs


def test_a_model_probe_followed_by_a_trie_did_not_pay():
    """chain:2 never accepts; the trie accepts its whole depth whenever it matches, which
    is every step but the probe slots'. A probe of chain:2 there is followed by the trie:
    the model probe did not pay (the request did not keep drafting from the model), so
    the class backs off to one probe in 32 steps or more (counted as paid, it stayed at
    8)."""
    policy = AutoPolicy(["chain:2", "ngram:budget=8"], CostModel(**COLLAPSE))
    model_runs = 0
    for t in range(160):
        unavailable = {"ngram:budget=8"} if t % 8 == 7 else set()
        pick = policy.choose([("r", 0.0)], {"r": unavailable})["r"]
        accepted = pick.depth if pick.name == "ngram:budget=8" else 0
        model_runs += pick.name == "chain:2"
        policy.record([step_of("r", pick.depth, accepted)])
    assert policy.tracker.probe_interval("greedy") >= 32
    assert 2 <= model_runs <= 10


def test_vllm_refit_counts_a_model_trees_catch_up():
    """Inside vLLM a model tree's realised shape carries its catch-up: a chain:2 (3 rows,
    2 levels, 2 draft rows) for a request whose draft was 5 tokens behind forwarded 7
    draft rows; a request given none forwarded nothing, however far behind."""
    from tree_dev.spec import parse_tree_spec
    from tree_dev.step import RequestStep
    from tree_dev.vllm_plugin.auto_choice import VllmAuto

    policy = parse_tree_spec("auto:chain:2").for_draft("eagle")
    va = VllmAuto(policy, "m", "d", "float32", "cpu", cost_model=CostModel(**COLLAPSE))
    va.force("chain:2")
    va.choose([("a", 0.0), ("b", 0.0)], behind={"a": 5, "b": 9})
    va.drafted()
    va.step_begin()
    tree = RequestStep("a", 2, [1] * 3, [-1, 0, 1], [7, 8, 9], 2, [0, 1], [8, 4])
    va.on_step_event(SimpleNamespace(requests=[tree]))  # "b": vLLM verified no tree
    va.step_done()
    assert list(va.anchor)[-1][0] == Shape(3 + 1, 2, 2 + 5, 0, 1, 2)


def test_a_probed_trie_keeps_its_own_nodes_far_behind(monkeypatch):
    """A request far behind in its draft whose probe slot offers a trie: the trie is
    priced at the nodes it has (3 rows), as when not probed; only a model tree's probe
    pays the catch-up (it used to be repriced at the trie's whole budget, 9 rows)."""
    from tree_dev.auto import chooser

    seen = []
    real = chooser.choose

    def spy(expected, candidates, cost_model, shapes=None, weights=None):
        seen.append((list(candidates), shapes))
        return real(expected, candidates, cost_model, shapes, weights)

    monkeypatch.setattr(chooser, "choose", spy)
    tracker = AcceptanceTracker(probe_every=1, max_backoff=0)
    policy = AutoPolicy(["chain:4", "ngram:budget=8"], CostModel(**COLLAPSE), tracker)
    monkeypatch.setattr(tracker, "probe", lambda rid, cls, names: "ngram:budget=8")
    trie = auto.step_tries([5, 6, 7, 5], policy.candidates)["ngram:budget=8"]
    assert trie.tree.num_nodes == 4
    policy.choose([("r", 0.0)], tries={"r": {"ngram:budget=8": trie}}, behind={"r": 100})
    cands, shapes = seen[-1]
    j = [c.name for c in cands].index("ngram:budget=8")
    assert shapes[0][j] == Shape(4, 0, 0, 0, 1)
    k = [c.name for c in cands].index("chain:4")  # the model tree: 32 rows of catch-up
    assert shapes[0][k] == auto.with_catch_up(Shape(5, 4, 4, 0, 1), 32)


def test_vllm_refit_waits_for_distinct_shapes_among_the_kept_samples(tmp_path, monkeypatch):
    """The online refit needs ``MIN_SHAPES`` distinct shapes among the last ``KEEP`` timed
    steps (counted as they come and go, not rescanned each step): shapes that fell out of
    the window do not count, and a fourth distinct shape in it triggers the fit."""
    from tree_dev.spec import parse_tree_spec
    from tree_dev.vllm_plugin import auto_choice

    monkeypatch.setattr(auto_choice, "KEEP", 8)
    monkeypatch.setattr(auto_choice, "REFIT_EVERY", 2)
    policy = parse_tree_spec("auto:ngram:budget=8").for_draft("ngram")
    va = auto_choice.VllmAuto(policy, "m", "d", "float32", "cpu", cache_dir=tmp_path)
    fits = []
    monkeypatch.setattr(va, "_fit", lambda: fits.append(len(va.samples)))

    def timed(rows: int) -> None:
        va._keep_sample(Shape(rows, 0, 0), 0.01 * rows)
        va._since_fit += 1
        va._maybe_refit()

    for rows in (1, 2, 3):  # three distinct shapes, then six repeats push the 1 out
        timed(rows)
    for _ in range(6):
        timed(3)
    assert [s.verify_rows for s, _ in va.samples] == [2, 3, 3, 3, 3, 3, 3, 3]
    timed(4)  # {3, 4}: the 2 fell out (counted forever, {1, 2, 3, 4} would fit here)
    timed(5)  # {3, 4, 5}
    assert fits == []
    timed(6)  # {3, 4, 5, 6}
    assert fits == [8]


def test_vllm_online_refit_caches_its_fit_without_waiting_on_the_disk(tmp_path, monkeypatch):
    """An online refit (every ``REFIT_EVERY`` timed steps) uses its fit at once and writes
    the cache in a background thread: a write held back (a slow ``fsync``) does not hold
    the step that refitted; once it is let go the cache holds that fit."""
    import threading

    from tree_dev.spec import parse_tree_spec
    from tree_dev.vllm_plugin import auto_choice

    monkeypatch.setattr(auto_choice, "REFIT_EVERY", 1)
    policy = parse_tree_spec("auto:ngram:budget=8").for_draft("ngram")
    va = auto_choice.VllmAuto(policy, "m", "d", "float32", "cpu", cache_dir=tmp_path)
    release, waited = threading.Event(), []
    real_save = auto_choice.save_cost_model

    def slow_save(directory, key, model):
        waited.append(release.wait(10))  # False: the refit sat on the write's thread
        return real_save(directory, key, model)

    monkeypatch.setattr(auto_choice, "save_cost_model", slow_save)
    for rows in (1, 2, 3, 4):
        va._keep_sample(Shape(rows, 0, 0), 0.002 + 0.001 * rows)
    va._since_fit = 1
    va._maybe_refit()  # the fit is in use before its write is let go
    assert va.auto.cost_model.b == pytest.approx(0.001, rel=1e-3)
    assert auto.load_cost_model(tmp_path, va.key) is None
    release.set()
    va.wait_saved(10)
    assert waited == [True]
    cached = auto.load_cost_model(tmp_path, va.key)
    assert cached is not None and cached.b == pytest.approx(va.auto.cost_model.b)


def vllm_step(va, prefill: int = 0, seconds_before: float = 0.0) -> None:
    """One step of a ``VllmAuto`` for requests "a" and "b", none verified a tree (a plain
    step of 2 rows), ``prefill`` prompt tokens beside them."""
    va.choose([("a", 0.8), ("b", 0.8)])
    va.drafted()
    va.step_begin(prefill)
    va.step_done()


def test_vllm_a_step_that_prefilled_is_not_timed(tmp_path):
    """A step that also ran prompt tokens (a request admitted beside the decoding ones)
    is no sample of its shape and no correction; its acceptance still counts."""
    from tree_dev.spec import parse_tree_spec
    from tree_dev.vllm_plugin.auto_choice import VllmAuto

    policy = parse_tree_spec("auto:ngram:budget=8").for_draft("ngram")
    va = VllmAuto(policy, "m", "d", "float32", "cpu", cache_dir=tmp_path)
    vllm_step(va)
    assert [s for s, _ in va.samples] == [Shape(2, 0, 0, 0, 0, 2)]  # plain: no draft
    vllm_step(va, prefill=48)
    assert len(va.samples) == 1 and va.stats["prefill_steps"] == 1
    assert va.auto.stats.steps == 2 and va.auto.stats.measured_steps == 1


def test_vllm_refits_keep_the_forced_steps_anchor(tmp_path):
    """The coefficients ``TRUE`` (``f``: 1.5 ms for a step with drafts, ``g`` 0.3 ms a
    request) from forced steps (plain steps of 1 and 4 requests, tries of 2 and 5 nodes
    for 1 and 4 requests) beside served ones that cannot tell ``f`` from a row's cost
    (plain steps of 8 requests; drafted ones of 12 rows): a refit keeps the anchor and
    finds ``f``; served steps alone do not. The anchor is cached with the fit and read
    back by the next engine."""
    from tree_dev.spec import parse_tree_spec
    from tree_dev.vllm_plugin.auto_choice import VllmAuto

    policy = parse_tree_spec("auto:ngram:budget=8").for_draft("ngram")
    va = VllmAuto(policy, "m", "d", "float32", "cpu", cache_dir=tmp_path)
    forced = [Shape(1, 0, 0, 0, 0, 1), Shape(4, 0, 0, 0, 0, 4)]
    forced += [Shape(3, 0, 0, 0, 1, 1), Shape(6, 0, 0, 0, 1, 1)]
    forced += [Shape(12, 0, 0, 0, 1, 4), Shape(24, 0, 0, 0, 1, 4)]
    served = [Shape(8, 0, 0, 0, 0, 8), Shape(12, 0, 0, 0, 1, 8)] * 40
    rng = np.random.default_rng(0)
    va.anchor.extend((sh, true_seconds(sh)) for sh in forced)
    for sh in served:
        va._keep_sample(sh, true_seconds(sh) * (1 + 0.02 * rng.standard_normal()))
    va.fit_now()
    m = va.auto.cost_model
    for k in "abfg":
        assert getattr(m, k) == pytest.approx(TRUE[k], rel=0.2), k
    alone = CostModel.fit(list(va.samples))  # served steps alone: f is not identified
    assert not alone.f == pytest.approx(TRUE["f"], rel=0.2)
    again = VllmAuto(policy, "m", "d", "float32", "cpu", cache_dir=tmp_path)
    assert list(again.anchor) == list(va.anchor) and again.measured
    assert again.auto.cost_model.f == pytest.approx(m.f)


def test_a_request_where_nothing_pays_rests_and_is_not_read():
    """By hand: chain:2 never accepts and costs more than it could yield a sampled
    request; each choice gives none with chain:2 open. After 4 such choices in a row the
    request rests 1 step, then (one more choice of none each time) 2, then 4, 4, ...:
    its row is not read on a resting step (``expected_row`` not called), and the
    ``rested`` count says how many steps went so."""
    cost = CostModel(a=0.004, b=0.0, c=0.004, d=0.0)  # chain:2 12 ms, none 4 ms
    policy = AutoPolicy(["chain:2"], cost, rest_above=0.0)  # rest whatever choosing costs
    reads = []
    real = policy.expected_row
    policy.expected_row = lambda rid, *a: reads.append(rid) or real(rid, *a)
    pattern = ""
    for _ in range(30):
        rest = policy.resting("r")
        pick = policy.choose([("r", 0.8)])["r"]
        policy.record([step_of("r", pick.depth, 0)])
        pattern += "z" if rest else "c" if pick.name == "none" else "T"
    # four choices of none, then rests of 1, 2, 4, 4, ... each after one more choice
    assert pattern == "cccc" + "z" + "c" + "zz" + ("c" + "zzzz") * 4 + "cz", pattern
    assert len(reads) == pattern.count("c") + pattern.count("T")
    assert policy.stats.as_dict()["rested"] == pattern.count("z")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_a_batch_that_rests_whole_is_chosen_as_the_full_path_chooses(seed):
    """Where every request of a step rests, ``choose`` takes a short path
    (``_all_rest``). Random batches (4 requests, greedy and T=0.8, joining and leaving;
    tries built on the steps a request is awake, as an engine does; accepted drafts at
    random) run through a policy with it and one without: every pick, the probes and
    their backoff, the rests, the counts and the step shape agree, step by step, and
    the short path was taken (the first 40 steps: no match, nothing accepted, nobody
    joins, so the requests rest in step)."""
    rng = np.random.default_rng(seed)
    cost = CostModel(a=0.004, b=0.0, c=0.004, d=0.0)
    cands = ["chain:2", "ngram:budget=4"]
    fast = AutoPolicy(cands, cost, rest_above=0.0)
    full = AutoPolicy(cands, cost, rest_above=0.0)
    full._rests_whole_batch = lambda *a: False
    short = 0
    real = fast._all_rest

    def counted(*a):
        nonlocal short
        short += 1
        return real(*a)

    fast._all_rest = counted
    live = {f"r{i}": (float(rng.choice([0.0, 0.8])), [1, 2, 3]) for i in range(4)}
    for t in range(120):
        if t >= 40 and rng.random() < 0.03:  # a request leaves, another joins
            gone = sorted(live)[int(rng.integers(len(live)))]
            del live[gone]
            fast.forget(gone)
            full.forget(gone)
            live[f"n{t}"] = (float(rng.choice([0.0, 0.8])), [1, 2, 3])
        requests = [(rid, temp) for rid, (temp, _) in live.items()]
        luck = {rid: rng.random() if t > 60 else 0.0 for rid in live}  # the same for both
        picks = []
        for policy in (fast, full):
            tries = {
                rid: policy.step_tries(rid, ctx)
                for rid, (_, ctx) in live.items()
                if not policy.resting(rid)
            }
            got = policy.choose(requests, tries=tries)
            picks.append({rid: c.name for rid, c in got.items()})
            steps = []
            for rid, c in got.items():
                trie = tries.get(rid, {}).get(c.name)
                depth = c.depth if trie is None else trie.tree.max_depth
                steps.append(step_of(rid, depth, int(luck[rid] * (depth + 1))))
            policy.record(steps)
        assert picks[0] == picks[1], t
        assert fast.step_shape == full.step_shape
        for _, ctx in live.values():  # new tokens (no match) at first, then repeats too
            ctx.append(int(rng.integers(1, 4)) if t >= 40 and rng.random() < 0.2 else 10 + t)
    assert short > 0
    assert fast.stats.as_dict() == full.stats.as_dict()
    assert fast._rest_left == full._rest_left and fast._none_run == full._none_run
    for cls in ("greedy", "sampled"):
        assert fast.tracker.probe_interval(cls) == full.tracker.probe_interval(cls)


def test_a_resting_request_finds_a_trie_that_begins_to_match():
    """A request rests while its trie finds no match and chain:2 does not pay; from step
    40 the trie matches and is accepted whole: it is chosen within ``longest_rest`` + 1
    steps and the request stops resting. Tries are built only on the steps it is awake
    (as an engine does)."""
    cost = CostModel(a=0.004, b=0.0, c=0.004, d=0.0)
    policy = AutoPolicy(["chain:2", "ngram:budget=4"], cost, rest_above=0.0)
    built, first = 0, None
    for t in range(80):
        ctx = [1, 2, 3, 4, 5, 6, 7, 8] if t < 40 else [1, 2, 3, 1, 2, 3, 1]  # no match: a loop
        tries = {}
        if not policy.resting("r"):
            tries["r"] = policy.step_tries("r", ctx)
            built += 1
        pick = policy.choose([("r", 0.8)], tries=tries)["r"]
        depth = (
            pick.depth if pick.name != "ngram:budget=4" else tries["r"][pick.name].tree.max_depth
        )
        accepted = depth if pick.name == "ngram:budget=4" else 0
        policy.record([step_of("r", depth, accepted)])
        if t >= 40 and first is None and pick.name == "ngram:budget=4":
            first = t
    assert policy.stats.rested > 10 and built < 80 - 10
    assert first is not None and first <= 40 + policy.longest_rest
    assert (
        not policy.resting("r")
        and policy.choose([("r", 0.8)], tries={"r": policy.step_tries("r", [1, 2, 3, 1])})["r"].name
        == "ngram:budget=4"
    )
    for bad in (dict(rest_after=0), dict(longest_rest=-1), dict(rest_above=-0.1)):
        with pytest.raises(ValueError, match="rest_after"):
            AutoPolicy(["chain:2"], cost, **bad)


def test_a_request_rests_only_where_choosing_is_dear():
    """Nothing pays, as above; on a clock where each reading is 1 ms later, choosing
    costs 1 ms a request. With ``rest_above`` 0.005: against measured 4 ms steps (25%)
    the request rests; against 10 s steps (0.01%, below 0.5%) it never does; unmeasured,
    no rest either. With the default (0) it rests alike on all three: timing aside."""
    rested = {}
    for above in (0.005, None):
        for a in (0.004, 10.0, None):
            clock = itertools.count(0.0, 0.001).__next__  # each reading 1 ms later
            cost = CostModel(a=a or 1.0, b=0.0, c=2 * (a or 1.0), d=0.0)  # chain:2: 3x none
            kw = {} if above is None else {"rest_above": above}
            policy = AutoPolicy(["chain:2"], cost, clock=clock, **kw)
            for _ in range(30):
                pick = policy.choose([("r", 0.8)])["r"]
                policy.record([step_of("r", pick.depth, 0)], seconds=a)
            rested[above, a] = policy.stats.rested
    assert rested[0.005, 0.004] > 10 and rested[0.005, 10.0] == 0 and rested[0.005, None] == 0
    assert rested[None, 0.004] == rested[None, 10.0] == rested[None, None] > 10
