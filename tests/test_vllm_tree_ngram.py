"""The n-gram trie inside vLLM (method ``ngram``, no draft model): lossless, preempted.

The engine gets a KV cache too small for its 8 concurrent requests, so vLLM preempts
requests and later resumes them (recomputing their KV): the trees must stay lossless
through that, with chunked prefill and prefix caching off.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup installs it)")

from vllm_engines import (  # noqa: E402
    FALLBACK,
    PROMPTS,
    assert_lossless,
    fallback_params,
    make_llm,
    plain_outputs,
    shutdown,
    tree_stats,
)


@pytest.fixture(scope="module")
def reference():
    from vllm_engines import greedy_params

    both = plain_outputs(PROMPTS + FALLBACK, params=greedy_params(len(PROMPTS)) + fallback_params())
    return both[: len(PROMPTS)], both[len(PROMPTS) :]


@pytest.fixture(scope="module")
def llm(reference):  # after the plain engine, whose metrics would replace these
    engine = make_llm(
        max_num_seqs=8,
        max_num_batched_tokens=128,
        num_gpu_blocks_override=12,  # 12 x 128 slots for up to 8 x 256: preemption
        enable_prefix_caching=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 8},
        additional_config={"treespec": {"tree": "ngram:budget=8"}},
    )
    yield engine
    shutdown(engine)


def test_lossless_at_batch_1(llm, reference):
    assert_lossless(llm, PROMPTS, reference[0], batch1=True)


def test_lossless_with_8_concurrent_and_preemption(llm, reference):
    assert_lossless(llm, PROMPTS, reference[0], batch1=False)


def test_chain_only_features_fall_back_to_exact_plain_decoding(llm, reference):
    from vllm_engines import generate

    before = tree_stats(llm)["fallback_requests"]
    outs = generate(llm, FALLBACK, fallback_params())
    assert outs == reference[1]
    assert tree_stats(llm)["fallback_requests"] > before


def test_trie_drafts_are_accepted_and_requests_were_preempted(llm):
    stats = tree_stats(llm)
    assert stats["tree_steps"] > 0 and stats["tokens_per_step"] > 1.2
    preempted = [m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"]
    assert preempted and preempted[0] > 0  # the small KV cache did force preemption
