"""A static tree and a chain through the plugin, with the draft LM inside vLLM.

The static tree's engine runs with prefix caching on (vLLM's default) and the same prompt
prefixes shared across requests, and with sampled drafts (``draft_sampling``: greedy
requests keep the top-ranked children, sampled ones draw them from the draft); the chain's
with prefix caching off.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup installs it)")

from vllm_engines import (  # noqa: E402
    DRAFT,
    PROMPTS,
    SHARED,
    assert_first_tree_token_is_targets,
    assert_lossless,
    generate,
    greedy_params,
    make_llm,
    plain_outputs,
    shutdown,
    tree_stats,
)

pytestmark = pytest.mark.full  # make test-all only: vLLM engines, 50-prompt proofs

PATHS = "paths:[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]"


def engine(tree: str, n: int, treespec: dict | None = None, **kw):
    return make_llm(
        max_num_seqs=8,
        speculative_config={"method": "draft_model", "model": DRAFT, "num_speculative_tokens": n},
        additional_config={"treespec": {"tree": tree, **(treespec or {})}},
        **kw,
    )


@pytest.fixture(scope="module")
def static_llm():
    llm = engine(PATHS, 8, {"draft_sampling": True})
    yield llm
    shutdown(llm)


def test_static_tree_lossless_batch_1_and_concurrent(static_llm):
    reference = plain_outputs(SHARED)
    assert_lossless(static_llm, SHARED, reference, batch1=True)
    assert_lossless(static_llm, SHARED, reference, batch1=False)
    stats = tree_stats(static_llm)
    assert stats["tokens_per_step"] > 1.5
    assert len(stats["acceptance_per_depth"]) == 4
    assert stats["draft_forwards"]["tree"] > 0  # the branched levels


def test_sampled_drafts_are_lossless(static_llm):
    """Children drawn from the draft, verified by the residual rule (``draft_probs``):
    the first token a tree step emits is distributed as the target's."""
    assert_first_tree_token_is_targets(static_llm, PROMPTS[3][:24], mode="draft_probs")
    assert tree_stats(static_llm)["walks"]["greedy"] > 0  # greedy requests walked greedily


def test_step_events_describe_every_tree_step(static_llm):
    """``TreeRunner.on_step`` subscribers (here ``treespec_record_steps``) see each verify
    step as the core's ``StepEvent``: the accepted nodes are a root-first path of the
    tree, the emitted tokens are the accepted drafts' then the bonus, they continue the
    request's output where its context ends, and ``Stats`` counts the same steps."""
    prompts = SHARED[:6]
    static_llm.collective_rpc("treespec_record_steps", args=(100_000,))
    before = tree_stats(static_llm)
    outs = generate(static_llm, prompts, greedy_params(len(prompts)))
    events = static_llm.collective_rpc("treespec_recorded_steps")[0]
    after = tree_stats(static_llm)
    steps = [r for e in events for r in e["requests"]]
    assert len(steps) == after["tree_steps"] - before["tree_steps"] > len(prompts)
    assert all(set(e["timings"]) == {"walk", "compact", "tree_attention"} for e in events)
    full = [p + o for p, o in zip(prompts, outs)]
    for r in steps:
        acc, parents, tokens = r["accepted"], r["parents"], r["tokens"]
        assert acc[0] == 0 and all(parents[b] == a for a, b in zip(acc, acc[1:])), r
        assert r["emitted"][:-1] == [tokens[n] for n in acc[1:]] and len(r["emitted"]) == len(acc)
        assert r["mode"] == "greedy" and 1 <= r["max_depth"] <= 4
        ctx = r["context"]
        assert len(ctx) == r["prefix_len"] + 1 and ctx[-1] == tokens[0]
        owner = [f for f in full if f[: len(ctx)] == ctx]
        assert owner, "a step's context is no request's prompt + output"
        rest = owner[0][len(ctx) :]
        assert r["emitted"][: len(rest)] == rest[: len(r["emitted"])]


def test_chain_lossless_without_prefix_caching(static_llm):
    shutdown(static_llm)  # one engine at a time on this machine
    llm = engine("chain:4", 4, enable_prefix_caching=False)
    try:
        reference = plain_outputs(PROMPTS)
        assert_lossless(llm, PROMPTS, reference, batch1=True)
        assert_lossless(llm, PROMPTS, reference, batch1=False)
        stats = tree_stats(llm)
        assert stats["tokens_per_step"] > 1.5
        # a chain's every draft level is causal: all of them through vLLM's own kernel
        assert stats["draft_forwards"]["tree"] == 0 < stats["draft_forwards"]["causal"]
    finally:
        shutdown(llm)
