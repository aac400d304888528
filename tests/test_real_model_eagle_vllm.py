"""The self-distilled EAGLE head of SmolLM2-135M-Instruct inside vLLM.

The head, exported for vLLM (``export_eagle_for_vllm``), drives the plugin's EAGLE trees:
a chain, the top-K tree and the hybrid tree (the head's top-K tree and the trie under one
budget), switched on one running engine, each decode the 50 held-out prompts 8 concurrent
token for token as vLLM's plain greedy decoding, with tau > 1; sampled tree tokens at
T=0.8 follow the target (chi-square) for the top-K tree (sampled drafts with this head are
proven in the local engine, and inside vLLM on the toy set: test_vllm_tree_static). vLLM's
own ``eagle`` method loads the same export and its drafts are accepted.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup installs it)")

from vllm_engines import (  # noqa: E402
    assert_first_tree_token_is_targets,
    generate,
    real_model_llm,
    real_model_plain,
    shutdown,
    tree_stats,
)

pytestmark = pytest.mark.full  # make test-all only: vLLM engines on the real model

MAX_TOKENS = 32
CHAIN = "chain:8"  # the start-up tree: it reserves the most KV slots of the three
SWITCHED = ["topk:k=2,depth=4,budget=8", "hybrid:k=2,depth=4,budget=8"]
TOPK = SWITCHED[0]


def _llm(model_dir, tree=None, spec=None):
    """vLLM on the model; with ``tree`` the plugin's EAGLE tree, with ``spec`` vLLM's own
    speculative method, both drafting with the committed head (exported for vLLM)."""
    from tree_dev.models.export_vllm import export_eagle_for_vllm
    from tree_dev.models.named import EAGLE_HEADS
    from tree_dev.spec import TreeSettings

    kw = {}
    head = str(export_eagle_for_vllm(head_dir=EAGLE_HEADS["smollm2-135m"]))
    if tree is not None:
        settings = TreeSettings.parse(tree, draft="eagle")
        kw["speculative_config"] = settings.vllm_speculative_config(head)
        kw["additional_config"] = {"treespec": settings.treespec_section()}
    elif spec is not None:
        kw["speculative_config"] = {**spec, "model": head}
    return real_model_llm(model_dir, **kw)


def _greedy(n: int):
    from vllm import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=MAX_TOKENS) for _ in range(n)]


@pytest.fixture(scope="module")
def prompts(smollm2_prompts):
    return smollm2_prompts


@pytest.fixture(scope="module")
def plain(smollm2_dir, prompts):
    return real_model_plain(smollm2_dir, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def llm(smollm2_dir, plain):  # after the plain engine: one engine at a time
    engine = _llm(smollm2_dir, CHAIN)
    yield engine
    shutdown(engine)


def _lossless_with_tau(llm, prompts, plain, tree) -> float:
    before = tree_stats(llm)
    got = generate(llm, prompts, _greedy(len(prompts)))
    after = tree_stats(llm)
    bad = [i for i, (g, w) in enumerate(zip(got, plain, strict=True)) if g != w]
    assert not bad, f"{tree}: prompts {bad[:5]} differ from vLLM's plain greedy output"
    assert after["tree"] == tree
    steps = after["tree_steps"] - before["tree_steps"]
    emitted = after["tokens_per_step"] * after["tree_steps"]
    emitted -= before["tokens_per_step"] * before["tree_steps"]
    tau = emitted / steps
    print(f"{tree}: tau {tau:.2f} over {steps} tree steps")
    return tau


def test_chain_is_lossless_at_8_concurrent(llm, prompts, plain):
    assert _lossless_with_tau(llm, prompts, plain, CHAIN) > 1.2


@pytest.mark.parametrize("tree", SWITCHED)
def test_topk_and_hybrid_are_lossless_at_8_concurrent(llm, prompts, plain, tree):
    llm.collective_rpc("treespec_set_tree", args=(tree,))
    try:
        assert _lossless_with_tau(llm, prompts, plain, tree) > 1.2
    finally:
        llm.collective_rpc("treespec_set_tree", args=(CHAIN,))


def test_topk_tree_tokens_follow_the_target_at_t08(llm, smollm2_dir):
    from transformers import AutoTokenizer

    text = "Once upon a time there was a girl. Once upon a time there was a"
    prompt = AutoTokenizer.from_pretrained(smollm2_dir).encode(text)
    llm.collective_rpc("treespec_set_tree", args=(TOPK,))
    try:
        assert_first_tree_token_is_targets(llm, prompt, 0.8, n=640, model_dir=smollm2_dir)
    finally:
        llm.collective_rpc("treespec_set_tree", args=(CHAIN,))


def test_vllms_own_eagle_method_loads_the_head(smollm2_dir, prompts, plain, llm):
    """vLLM's ``eagle`` proposer (no plugin tree) runs the same export: greedy output is
    vLLM's plain output and its drafts are accepted (vLLM's spec-decode counters)."""
    engine = _llm(smollm2_dir, spec={"method": "eagle", "num_speculative_tokens": 4})
    try:
        got = generate(engine, prompts[:16], _greedy(16))
        assert got == plain[:16]
        metrics = {m.name: getattr(m, "value", None) for m in engine.get_metrics()}
        steps = metrics["vllm:spec_decode_num_drafts"]
        accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
        print(f"vLLM eagle: {accepted} tokens accepted over {steps} draft steps")
        assert steps > 0 and accepted / steps > 0.25  # tau = 1 + accepted / steps
    finally:
        shutdown(engine)
