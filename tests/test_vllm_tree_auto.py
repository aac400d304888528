"""``tree: "auto"`` inside vLLM: per request and step the plugin picks none, an n-gram
trie or a draft-model tree; lossless greedy with sampled requests in the same batches,
exact sampling at T=0.8, the choices and the cost model's predicted vs measured step
seconds in the stats, the cost model refitted on this machine's steps and cached.

Two eager engines, one after the other: the committed target with the committed draft
LM as vLLM's ``draft_model`` proposer, then with the exported EAGLE head as ``eagle``;
``tree: auto`` (its model candidates; 16 draft nodes for the largest), up to 8
concurrent requests; the first with ``auto_objective`` ``tokens``, the second
``makespan``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup installs it)")

from vllm_engines import (  # noqa: E402
    DRAFT,
    PROMPTS,
    assert_first_tree_token_is_targets,
    generate,
    greedy_params,
    make_llm,
    plain_outputs,
    shutdown,
    tree_stats,
)

pytestmark = pytest.mark.full  # make test-all only: an engine, 50-prompt proofs


#: each engine's auto_objective: every proof below runs under both
OBJECTIVE = {"draft_model": "tokens", "eagle": "makespan"}


@pytest.fixture(scope="module")
def reference():
    return plain_outputs(PROMPTS)


@pytest.fixture(scope="module", params=["draft_model", "eagle"])
def llm(request, reference):
    """One engine per draft: the draft LM, then the EAGLE head (its features must follow
    requests that draft on some steps and not on others)."""
    if request.param == "eagle":
        from tree_dev.models.export_vllm import export_eagle_for_vllm

        model = str(export_eagle_for_vllm())
    else:
        model = DRAFT
    engine = make_llm(
        max_num_seqs=8,
        speculative_config={
            "method": request.param,
            "model": model,
            "num_speculative_tokens": 16,
        },
        additional_config={
            "treespec": {"tree": "auto", "auto_objective": OBJECTIVE[request.param]}
        },
    )
    engine.objective = OBJECTIVE[request.param]
    yield engine
    shutdown(engine)


def test_auto_samples_the_target_distribution(llm):
    """The T=0.8 first-token proof on auto's first top-K tree, forced on every request so
    that every second token comes from a tree step: which trees auto itself runs at T=0.8
    follows measured costs (on the EAGLE engine, once drafted steps were priced at what
    they are measured to add, 77 of 1500), and the distribution must hold whichever it
    runs."""
    names = tree_stats(llm)["auto"]["candidates"]
    topk = next(n for n in names if n.startswith("topk"))
    llm.collective_rpc("treespec_auto_force", args=(topk,))
    try:
        assert_first_tree_token_is_targets(llm, PROMPTS[3][:24])
    finally:
        llm.collective_rpc("treespec_auto_force", args=(None,))


def test_auto_is_lossless_with_mixed_temperatures(llm, reference):
    """50 prompts, every other one at T=0.8, submitted together: each greedy request is
    vLLM's plain greedy output token for token; both classes got trees."""
    from vllm import SamplingParams

    greedy = greedy_params(len(PROMPTS))
    params = [
        greedy[i]
        if i % 2 == 0
        else SamplingParams(temperature=0.8, max_tokens=greedy[i].max_tokens, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    # rest wherever nothing pays (the default), however cheap choosing is here now
    llm.collective_rpc("treespec_auto_rest", args=(0.0,))
    outs = generate(llm, PROMPTS, params)
    bad = [i for i in range(0, len(PROMPTS), 2) if outs[i] != reference[i]]
    assert not bad, f"greedy prompts {bad} diverge from vLLM's plain greedy output"
    stats = tree_stats(llm)
    assert stats["tree"] == "auto"
    auto = stats["auto"]
    for cls in ("greedy", "sampled"):
        trees = {n: k for n, k in auto["choices_by_class"][cls].items() if n != "none"}
        assert trees, f"auto never gave a {cls} request a tree: the proof proves nothing"
    assert any(not n.startswith(("ngram", "none")) for n in auto["choices"])
    assert auto["rested"] > 0, "no request rested: the proof does not cover resting steps"
    if llm.objective == "makespan":  # 50 requests for 8 slots: weighted once none waits
        assert auto["weighted_steps"] > 0, "the last wave's tokens were never weighted"
    else:
        assert auto["weighted_steps"] == 0, auto["weighted_steps"]
    assert stats["tokens_per_step"] > 1.3
    assert auto["measured_steps"] > 50
    assert auto["mean_predicted_s"] > 0 and auto["mean_measured_s"] > 0


def test_steps_without_drafts_run_vllms_plain_path_and_trees_resume_after(llm, reference):
    """``none`` forced on every request: no step has a draft, so every step runs vLLM's
    non-speculative inputs and sampler (``sampler_steps["plain"]``; no walk, no bonus
    rows), and the outputs are vLLM plain's. Released, the chooser drafts again, and the
    drafts that follow (the EAGLE head's features included, kept across the plain
    steps) are still exact."""
    prompts, want = PROMPTS[:8], reference[:8]
    before = tree_stats(llm)
    llm.collective_rpc("treespec_auto_force", args=("none",))
    try:
        assert generate(llm, prompts, greedy_params(len(prompts))) == want
    finally:
        llm.collective_rpc("treespec_auto_force", args=(None,))
    mid = tree_stats(llm)
    was, now = before["sampler_steps"], mid["sampler_steps"]
    steps = {k: now[k] - was[k] for k in was}
    new_tokens = sum(len(w) for w in want)
    assert steps["plain"] >= new_tokens // len(prompts), steps
    assert steps["trees_only"] == steps["bonus_rows"] == steps["rejection"] == 0, steps
    assert mid["tree_steps"] == before["tree_steps"]
    assert generate(llm, PROMPTS[8:16], greedy_params(16)[8:]) == reference[8:16]
    assert tree_stats(llm)["tree_steps"] > mid["tree_steps"]


def test_auto_cost_model_is_fitted_on_this_machine_and_cached(llm):
    """Served steps refit the cost model (not the start-up guess), which is cached as
    JSON under ``$TREESPEC_CACHE_DIR/auto``: served until ``REFIT_EVERY`` steps were
    timed (a step that prefilled is not; how many the runs above timed varies)."""
    from vllm import SamplingParams

    from tree_dev.vllm_plugin.auto_choice import REFIT_EVERY

    auto = tree_stats(llm)["auto"]
    for _ in range(2 * REFIT_EVERY // 64):
        if auto["cost_model_measured"]:
            break
        params = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)] * 8
        generate(llm, PROMPTS[:8], params)
        auto = tree_stats(llm)["auto"]
    assert auto["cost_model_measured"], (auto["cost_model"], auto["samples"])
    cached = list((Path(os.environ["TREESPEC_CACHE_DIR"]) / "auto").glob("cost-model-*.json"))
    assert cached, "no cost model was cached"


def test_calibration_times_every_candidate_and_fits_the_cost(llm):
    """``calibrate_auto``: each candidate forced on 1 and 4 requests, the steps timed in
    the worker (drafting plus verify, idle time excluded), a cost model fitted in which
    bigger steps cost more, and the chooser back in charge afterwards."""
    from tree_dev.vllm_plugin.auto_choice import calibrate_auto

    before = tree_stats(llm)["auto"]
    stats = calibrate_auto(llm, force=True)
    assert stats["cost_model_measured"]
    # the forced steps are the anchor every later refit keeps, cached with the fit
    assert stats["anchor_samples"] > before["anchor_samples"] + 2 * len(stats["candidates"])
    cost = stats["cost_model"]
    assert cost["a"] > 0 and (cost["b"] > 0 or cost["c"] > 0 or cost["d"] > 0), cost
    assert stats["steps"] == before["steps"]  # forced steps teach no acceptance
    with pytest.raises(Exception, match="rest_above = -1"):
        llm.collective_rpc("treespec_auto_rest", args=(-1,))
    with pytest.raises(Exception, match="no candidate 'chain:9'"):
        llm.collective_rpc("treespec_auto_force", args=("chain:9",))
    with pytest.raises(Exception, match="auto is chosen at start-up"):
        llm.collective_rpc("treespec_set_tree", args=("topk:k=2,depth=4,budget=16",))
