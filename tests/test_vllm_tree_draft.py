"""Draft-LM top-K and hybrid trees inside vLLM (compiled): lossless greedy and sampling,
real acceptance, the local engine's trees.

One engine for the module: the committed target with the committed draft LM as vLLM's
``draft_model`` proposer, a top-K tree through the plugin, torch.compile on, up to 8
concurrent requests, a small token budget so long prompts are chunk-prefilled, prefix
caching on (vLLM's default).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup installs it)")

from vllm_engines import (  # noqa: E402
    DRAFT,
    PROMPTS,
    TARGET,
    assert_first_tree_token_is_targets,
    assert_lossless,
    generate,
    greedy_params,
    make_llm,
    plain_outputs,
    shutdown,
    spec_metrics,
    tree_stats,
)

pytestmark = pytest.mark.full  # make test-all only: compiled vLLM engines, 50-prompt proofs

TREE = "topk:k=2,depth=4,budget=8"


@pytest.fixture(scope="module")
def reference():
    return plain_outputs(PROMPTS, enforce_eager=False)


@pytest.fixture(scope="module")
def llm(reference):
    # after the plain engine: vLLM keeps its metrics in one registry per process, and a
    # new engine replaces the earlier one's
    engine = make_llm(
        enforce_eager=False,
        max_num_seqs=8,
        max_num_batched_tokens=96,
        speculative_config={"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 8},
        additional_config={"treespec": {"tree": TREE, "record_trees": 6}},
    )
    yield engine
    shutdown(engine)


def test_lossless_at_batch_1(llm, reference):
    assert_lossless(llm, PROMPTS, reference, batch1=True)


def test_lossless_with_8_concurrent_mixed_lengths(llm, reference):
    assert_lossless(llm, PROMPTS, reference, batch1=False)


def test_drafts_are_accepted_and_counted_per_depth(llm):
    generate(llm, PROMPTS[:8], greedy_params(8))  # tree steps even when run alone
    stats = tree_stats(llm)
    assert stats["tree_steps"] > 0
    assert stats["tokens_per_step"] > 1.5  # tau: tokens per target forward
    acc = stats["acceptance_per_depth"]
    assert len(acc) == 4 and acc[0] > 0.3
    counts = stats["depth_accepted"]  # a path accepted at depth d+1 was accepted at d
    assert all(a >= b for a, b in zip(counts, counts[1:])), counts
    # vLLM's own counter "accepted per position" is, for trees, accepted per depth
    vllm_counts = spec_metrics(llm)["spec_decode_num_accepted_tokens_per_pos"]
    assert list(vllm_counts[:4]) == stats["depth_accepted"][:4]
    assert not any(vllm_counts[4:])  # no tree here is deeper than 4


def test_sampling_is_lossless(llm):
    """The first token a tree step emits is distributed as the target's (chi-square)."""
    assert_first_tree_token_is_targets(llm, PROMPTS[3][:24], mode="target_only")


def _trees_unlike_the_local_engines(recorded: list[dict], tree: str = TREE) -> list[str]:
    """Request ids of the plugin's recorded trees that the local engine (HF draft, same
    context, same expansion, tree spec ``tree``) does not grow token for token."""
    from tree_dev.engine import Engine
    from tree_dev.engine import SamplingParams as LocalParams

    engine = Engine(TARGET, DRAFT, tree=tree, max_batch=1, max_model_len=512)
    proposals = []
    grow = engine._propose
    engine._propose = lambda *a: proposals.append(grow(*a)) or proposals[-1]
    unlike = []
    for rec in recorded:
        proposals.clear()
        engine.generate([rec["context"]], LocalParams(max_tokens=1, ignore_eos=True))
        local = proposals[0][0]
        if local.tree.parents.tolist() != rec["parents"] or list(local.tokens) != rec["tokens"]:
            unlike.append(rec["req_id"])
    return unlike


def test_both_engines_grow_the_same_tree(llm):
    """The plugin's first trees (vLLM's draft model) equal the local engine's (HF draft)
    from the same context: one expansion module, two engines. The plugin's first level
    (the trunk: a causal run) went through vLLM's own kernel, the branched ones through
    tree attention."""
    recorded = llm.collective_rpc("treespec_recorded_trees")[0]
    assert len(recorded) == 6
    assert _trees_unlike_the_local_engines(recorded) == []
    forwards = tree_stats(llm)["draft_forwards"]
    assert forwards["causal"] > 0 and forwards["tree"] > 0, forwards


HYBRID = "hybrid:k=2,depth=3,budget=8"


def test_hybrid_tree_is_lossless_and_grown_as_the_local_engine_does(llm, reference):
    """The hybrid tree (the draft's top-K tree and the context's n-gram trie under one
    budget), switched on the running engine (``treespec_set_tree``): lossless on every
    prompt, 8 concurrent; drafts accepted; its first trees are the local engine's hybrid
    trees from the same context, and not all of them are the top-K tree alone (the trie
    added nodes)."""
    llm.collective_rpc("treespec_set_tree", args=(HYBRID,))
    llm.collective_rpc("treespec_set_debug", args=(None, 6))  # record the next 6 trees
    try:
        before = tree_stats(llm)
        assert_lossless(llm, PROMPTS, reference, batch1=False)
        after = tree_stats(llm)
        recorded = llm.collective_rpc("treespec_recorded_trees")[0]
        assert after["tree"] == HYBRID
    finally:
        llm.collective_rpc("treespec_set_tree", args=(TREE,))
    steps = after["tree_steps"] - before["tree_steps"]
    emitted = after["tokens_per_step"] * after["tree_steps"]
    emitted -= before["tokens_per_step"] * before["tree_steps"]
    assert steps > 0 and emitted / steps > 1.5, (steps, emitted)
    assert len(recorded) == 6
    assert _trees_unlike_the_local_engines(recorded, HYBRID) == []
    assert _trees_unlike_the_local_engines(recorded, "topk:k=2,depth=3,budget=8")


def test_a_tree_switch_the_engine_cannot_serve_is_refused(llm):
    """A tree whose budget is not num_speculative_tokens, or that forwards more draft nodes
    than the KV slots reserved at start-up, is refused naming why; the engine keeps its
    tree."""
    with pytest.raises(Exception, match="has 4 draft nodes"):
        llm.collective_rpc("treespec_set_tree", args=("chain:4",))
    with pytest.raises(Exception, match="forwards 16 draft nodes"):
        llm.collective_rpc("treespec_set_tree", args=("topk:k=4,depth=5,budget=8",))
    assert tree_stats(llm)["tree"] == TREE


def test_the_same_tree_check_fails_without_the_draft_mask(llm, reference):
    """With the draft's tree mask dropped (``debug_disable: "draft_mask"``, switched on the
    running engine: every level through vLLM's causal kernel), the plugin's trees are not
    the local engine's; the output stays lossless, since only the drafts are wrong."""
    llm.collective_rpc("treespec_set_debug", args=("draft_mask", 6))
    try:
        forwards_before = tree_stats(llm)["draft_forwards"]["tree"]
        assert_lossless(llm, PROMPTS[:6], reference[:6], batch1=True)
        recorded = llm.collective_rpc("treespec_recorded_trees")[0]
        assert tree_stats(llm)["draft_forwards"]["tree"] == forwards_before
    finally:
        shutdown(llm)  # the module's last test: one engine at a time on this machine
    assert len(recorded) == 6
    # 2 of these 6 first trees differ (a sibling seeing its sibling shifts the ranking)
    assert _trees_unlike_the_local_engines(recorded)
