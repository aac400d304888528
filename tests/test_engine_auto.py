"""``tree="auto"`` in the local engine: lossless with mixed temperatures in one batch, exact
sampling at T=0.8, a policy that leaves a tree whose acceptance collapses, the measured
cost model cached per model and machine, and bad candidates refused up front.

Tiny random Llama models; the draft is the target with perturbed weights (or the target
itself where acceptance must be high). A fixed cost model keeps the choices deterministic,
except in the calibration test, which measures one.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tree_dev.engine_auto as engine_auto
from tests.factories import (
    break_tree_mask,
    chisquare_pvalue,
    engine_models,
    first_token_counts,
    perturbed,
    prompts_with_greedy,
    tiny_llama,
)
from tree_dev.auto import CostModel, cache_path
from tree_dev.engine import Engine, SamplingParams
from tree_dev.models.eagle import EagleHead
from tree_dev.spec import MODEL_DRAFTS

VOCAB = 64
# drafting pays on these toy steps: verify rows and draft levels cheap against a step
PAYS = CostModel(a=0.010, b=0.0001, c=0.0005, d=0.00002)


@pytest.fixture(scope="module")
def models():
    return engine_models()


@pytest.fixture(scope="module")
def prompts_and_greedy(models):
    return prompts_with_greedy(models[1])


def _engine(models, draft_kind: str | None, **kw) -> Engine:
    target, _, draft = models
    if draft_kind == "eagle":
        torch.manual_seed(0)
        kw["eagle"] = EagleHead.from_target(target).eval()
    elif draft_kind == "draft":
        kw["draft"] = draft
    return Engine(target, tree=kw.pop("tree", "auto"), auto_cost_model=PAYS, **kw)


@pytest.mark.parametrize(
    "draft_kind, objective",
    [("draft", "tokens"), ("eagle", "tokens"), (None, "tokens"), ("draft", "makespan")],
)
def test_auto_is_lossless_with_mixed_temperatures_in_one_batch(
    models, prompts_and_greedy, draft_kind, objective
):
    """50 prompts, every other one at T=0.8, one batch of 16: every greedy request is the
    target's greedy output token for token, while auto gives the two classes trees; under
    the makespan objective the last wave's tokens are weighted (none waits then)."""
    prompts, want = prompts_and_greedy
    engine = _engine(models, draft_kind, max_batch=16, auto_objective=objective)
    params = [
        SamplingParams(max_tokens=12)
        if i % 2 == 0
        else SamplingParams(max_tokens=12, temperature=0.8, seed=i)
        for i in range(len(prompts))
    ]
    got = engine.generate(prompts, params)
    bad = [i for i in range(0, len(prompts), 2) if got[i] != want[i]]
    assert not bad, f"auto ({draft_kind}): greedy prompts {bad[:5]} differ from the target's"
    stats = engine.auto_stats()
    for cls in ("greedy", "sampled"):
        trees = {n: k for n, k in stats["choices_by_class"][cls].items() if n != "none"}
        assert trees, f"auto never gave a {cls} request a tree: the proof proves nothing"
    if draft_kind in MODEL_DRAFTS:  # model trees were chosen, not only tries
        assert any(not n.startswith(("ngram", "none")) for n in stats["choices"])
    accepted = sum(engine.requests[i].accepted_drafts for i in range(0, len(prompts), 2))
    assert accepted > 0, "no greedy draft was ever accepted: the proof proves nothing"
    assert engine.runner.cache.free_blocks == engine.runner.cache.num_blocks
    assert stats["measured_steps"] == stats["steps"] > 0
    assert stats["trie_shadows"] > 0  # tries built and not run were scored
    if objective == "makespan":
        assert stats["weighted_steps"] > 0, "the last wave's tokens were never weighted"
    else:
        assert stats["weighted_steps"] == 0


def test_auto_proof_fails_without_the_tree_mask(models, prompts_and_greedy, monkeypatch):
    """The same proof sees a broken mask: trees verified under a causal chain mask."""
    prompts, want = prompts_and_greedy
    break_tree_mask(monkeypatch)
    engine = _engine(models, "draft", max_batch=16)
    got = engine.generate(prompts, SamplingParams(max_tokens=12))
    assert sum(g != w for g, w in zip(got, want)) > 0


@pytest.mark.parametrize("tree", ["auto:chain:4+sampled", "auto:chain:2"])
def test_auto_samples_the_target_distribution_at_t08(tree):
    """First tokens of 3000 seeded T=0.8 requests under auto (greedy requests in the same
    batches) follow the target's softmax(z/0.8), for each verification rule: sampled
    drafts (``draft_probs``) and top-ranked ones (``target_only``). Drafting is free in
    this cost model (a step costs its fixed part alone), so auto drafts on nearly every
    draw."""
    vocab = 12
    target = tiny_llama(11, vocab=vocab)
    draft = perturbed(target, 0.5, seed=2)
    prompt = [3, 1, 4, 1, 5, 1, 9, 1]
    with torch.no_grad():
        p = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double() / 0.8, -1)
    free = CostModel(a=0.010, b=0.0, c=0.0, d=0.0)
    engine = Engine(target, draft, tree=tree, max_batch=128, auto_cost_model=free)
    for _ in range(64):  # greedy neighbours in the batches
        engine.add_request(prompt, SamplingParams(max_tokens=3))
    counts = first_token_counts(engine, prompt, 3000, temperature=0.8)
    sampled = engine.auto_stats()["choices_by_class"]["sampled"]
    assert sampled.get(tree.removeprefix("auto:"), 0) > 2000, sampled
    accepted = sum(r.accepted_drafts for r in engine.requests.values() if r.mode != "greedy")
    assert accepted > 300, "sampled drafts were rarely accepted: the test would prove little"
    assert chisquare_pvalue(counts, p) > 1e-3


def test_auto_leaves_a_draft_whose_acceptance_collapses(models):
    """A greedy request runs with a draft equal to the target (every draft accepted); after
    12 steps the draft goes wrong (its output layer shifted by one token: nothing is
    accepted). Within 6 steps auto stops growing model trees for it, and keeps off them
    bar its probes."""
    target, reference, _ = models
    draft = copy.deepcopy(reference)
    cands = "auto:chain:2;chain:6;topk:k=2,depth=4,budget=8"
    engine = Engine(target, draft, tree=cands, max_batch=1, auto_cost_model=PAYS)
    picks: list[str] = []
    choose = engine.auto.choose

    def recording(batch, waiting=None):
        out = choose(batch, waiting)
        picks.append(out[0].spec)
        if len(picks) == 12:  # the draft goes wrong from the next step on
            head = engine.draft_runner.model.lm_head.weight
            with torch.no_grad():
                head.copy_(head.roll(1, dims=0))
        return out

    engine.auto.choose = recording
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=150, ignore_eos=True))
    before, after = picks[:12], picks[12:]
    assert sum(p != "none" for p in before[2:]) >= 8, before
    assert len(after) >= 30, "the request ended before the test could see the policy move"
    first_none = after.index("none")
    assert first_none <= 6, after[:12]
    settled = after[first_none:]
    assert sum(p == "none" for p in settled) >= 0.75 * len(settled), settled


def test_auto_cost_model_is_measured_once_and_cached(models, tmp_path, monkeypatch):
    """Without a given cost model, the engine times its own steps once, writes the fit to
    the cache (JSON, one file per model and machine) and the next engine loads it."""
    target, _, draft = models
    first = Engine(target, draft, tree="auto", max_batch=4, auto_cache_dir=tmp_path)
    model = first.auto.auto.cost_model
    assert model.samples >= 2 * len(first.auto.candidates) and model.rel_rms < 1.0
    assert model.b > 0 or model.c > 0 or model.d > 0  # bigger steps were seen to cost more
    key = engine_auto.engine_cache_key(first)
    assert [p.name for p in tmp_path.iterdir()] == [cache_path(tmp_path, key).name]
    assert not first.has_work() and first.runner.cache.free_blocks == first.runner.cache.num_blocks

    def no_calibration(self, engine, *a, **k):
        raise AssertionError("calibrated although a cost model was cached")

    monkeypatch.setattr(engine_auto.LocalAuto, "calibrate", no_calibration)
    second = Engine(target, draft, tree="auto", max_batch=4, auto_cache_dir=tmp_path)
    got = second.auto.auto.cost_model
    assert (got.a, got.b, got.c, got.d) == (model.a, model.b, model.c, model.d)


def test_auto_choices_are_deterministic_for_a_given_cost_model(models, prompts_and_greedy):
    prompts, _ = prompts_and_greedy
    runs = []
    for _ in range(2):
        engine = _engine(models, "draft", max_batch=8)
        params = [SamplingParams(max_tokens=10, temperature=0.8, seed=i) for i in range(12)]
        out = engine.generate(prompts[:12], params)
        runs.append((out, engine.auto_stats()["choices_by_class"]))
    assert runs[0] == runs[1]


def test_auto_candidates_follow_the_draft(models):
    target, _, draft = models
    trie = Engine(target, tree="auto", auto_cost_model=PAYS)
    assert trie.draft_runner is None
    assert {c.name for c in trie.auto.candidates} == {
        "none",
        "ngram:budget=4",
        "ngram:budget=8",
        "ngram:budget=16",
        "ngram:budget=4,min=3",  # the long-match trie
    }
    drafted = Engine(target, draft, tree="auto", auto_cost_model=PAYS)
    names = {c.name for c in drafted.auto.candidates}
    want = {"chain:4+sampled", "hybrid:k=2,depth=6,budget=16", "ngram:budget=8"}
    assert want | {"ngram:budget=4,min=3"} <= names
    # KV sized for the largest candidate: 16 draft nodes
    assert drafted.policy.max_nodes == 17


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"tree": "auto:chain:2;ngram:budget=8"}, "candidate 'chain:2' needs a draft"),
        ({"tree": "auto", "draft_sampling": True}, "chain:K\\+sampled"),
        ({"tree": "auto:topk:k=2,depth=2,budget=4+sampled"}, "sampled drafts need a static"),
        ({"tree": "auto:chain:2;;none"}, "empty candidate"),
        ({"tree": "auto", "auto_objective": "speed"}, "auto objective 'speed'"),
    ],
)
def test_bad_auto_specs_fail_before_any_work(models, kw, match):
    target, _, _ = models
    with pytest.raises(ValueError, match=match):
        Engine(target, **kw)
