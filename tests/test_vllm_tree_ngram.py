"""The n-gram trie inside vLLM (method ``ngram``, no draft model): lossless, preempted.

The engine gets a KV cache too small for its 8 concurrent requests, so vLLM preempts
requests and later resumes them (recomputing their KV): the trees must stay lossless
through that, with chunked prefill and prefix caching off.

``test_smoke_*`` is the fast tier's one vLLM engine (``make test``): the same trie engine
against the target's plain greedy decoding in Hugging Face, so no second (plain vLLM)
engine starts; the other tests (``make test-all``) prove it against vLLM's own plain
decoding on 50 prompts.
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
def llm():
    """The trie engine. The full tier's tests request ``reference`` before it, so that the
    plain engine, whose metrics would replace these, runs first."""
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


@pytest.mark.full
def test_lossless_at_batch_1(reference, llm):
    assert_lossless(llm, PROMPTS, reference[0], batch1=True)


@pytest.mark.full
def test_lossless_with_8_concurrent_and_preemption(reference, llm):
    assert_lossless(llm, PROMPTS, reference[0], batch1=False)


@pytest.mark.full
def test_chain_only_features_fall_back_to_exact_plain_decoding(reference, llm):
    from vllm_engines import generate

    before = tree_stats(llm)["fallback_requests"]
    outs = generate(llm, FALLBACK, fallback_params())
    assert outs == reference[1]
    assert tree_stats(llm)["fallback_requests"] > before


@pytest.mark.full
def test_trees_beside_plain_requests_skip_vllms_rejection_sampler(reference, llm):
    """Tree requests and requests that get no tree (chain-only sampling features) in one
    batch: every output equals vLLM plain's. With no logprobs asked, the steps are sampled
    without vLLM's rejection sampler (vLLM's sampler on the last rows, then the walk); a
    batch with a logprobs request goes through the rejection sampler, still exact."""
    from vllm_engines import generate, greedy_params

    trees, fallback = PROMPTS[:6], list(FALLBACK)
    params = greedy_params(len(trees)) + fallback_params()
    no_logprobs = [i for i, p in enumerate(params) if p.logprobs is None]
    before = tree_stats(llm)["sampler_steps"]
    outs = generate(
        llm, [(trees + fallback)[i] for i in no_logprobs], [params[i] for i in no_logprobs]
    )
    mid = tree_stats(llm)["sampler_steps"]
    want = reference[0][: len(trees)] + reference[1]
    assert outs == [want[i] for i in no_logprobs]
    assert mid["bonus_rows"] > before["bonus_rows"] and mid["rejection"] == before["rejection"]
    assert generate(llm, trees + fallback, params) == want
    assert tree_stats(llm)["sampler_steps"]["rejection"] > mid["rejection"]


@pytest.mark.full
def test_trie_drafts_are_accepted_and_requests_were_preempted(reference, llm):
    stats = tree_stats(llm)
    assert stats["tree_steps"] > 0 and stats["tokens_per_step"] > 1.2
    assert stats["draft_token_rpcs"] == 0
    assert stats["sampler_steps"]["plain"] > 0
    preempted = [m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"]
    assert preempted and preempted[0] > 0  # the small KV cache did force preemption


def test_smoke_trie_equals_hf_greedy_under_preemption(llm):
    """8 concurrent requests through the trie, preempted by the small KV cache, equal the
    target's plain greedy continuation from Hugging Face ``generate`` (fp32 on both sides),
    and the trie's drafts are accepted. Every step's drafts reached vLLM's scheduler with
    the step's output (``draft_token_rpcs`` 0: the engine core, in its own process, made
    no ``take_draft_token_ids`` round trip), and steps without drafts (the prefills) ran
    vLLM's plain path."""
    import torch
    from vllm_engines import TARGET, generate, greedy_params, max_tokens_for

    from tree_dev.engine import load_causal_lm
    from tree_dev.testing import hf_greedy

    prompts = PROMPTS[:8]
    outs = generate(llm, prompts, greedy_params(len(prompts)))
    model = load_causal_lm(TARGET, dtype=torch.float32)
    want = [hf_greedy(model, p, max_tokens_for(i)) for i, p in enumerate(prompts)]
    diverged = [i for i, (a, b) in enumerate(zip(outs, want)) if a != b]
    assert not diverged, f"prompts {diverged} diverge from the target's plain greedy output"
    stats = tree_stats(llm)
    assert stats["tree_steps"] > 0 and stats["tokens_per_step"] > 1.2
    assert stats["draft_token_rpcs"] == 0
    assert stats["sampler_steps"]["plain"] > 0
