"""The vLLM plugin on a real pretrained model (SmolLM2-135M-Instruct, fetched by name).

The plugin's n-gram trie inside vLLM (method ``ngram``) decodes the 50 held-out prompts
(code raw, chat through the chat template) token for token as vLLM's own plain greedy
decoding does, 8 concurrent (and 16 of them one at a time); tau > 1 with its acceptance per depth;
sampled tokens at T=0.8 that a tree step emits follow the target (chi-square).
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
BATCH1 = 16  # of the 50, one request at a time (all 50 run 8 concurrent)


_llm = real_model_llm


def _params(n: int):
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
    engine = _llm(
        smollm2_dir,
        speculative_config={"method": "ngram", "num_speculative_tokens": 8},
        # with earlier requests' tokens searched too: the cross-request path is proven
        additional_config={"treespec": {"tree": "ngram:budget=8,history=4096"}},
    )
    yield engine
    shutdown(engine)


def test_trie_is_lossless_at_8_concurrent(llm, prompts, plain):
    got = generate(llm, prompts, _params(len(prompts)))
    bad = [i for i, (g, w) in enumerate(zip(got, plain, strict=True)) if g != w]
    assert not bad, f"prompts {bad[:5]} differ from vLLM's plain greedy output"


def test_trie_is_lossless_at_batch_1(llm, prompts, plain):
    got = [generate(llm, [p], _params(1))[0] for p in prompts[:BATCH1]]
    bad = [i for i, (g, w) in enumerate(zip(got, plain[:BATCH1], strict=True)) if g != w]
    assert not bad, f"prompts {bad[:5]} differ from vLLM's plain greedy output"


def test_trie_drafts_pay_with_acceptance_per_depth(llm):
    stats = tree_stats(llm)
    per_depth = stats["acceptance_per_depth"]
    print(f"tau {stats['tokens_per_step']:.2f}, acceptance per depth {per_depth[:4]}")
    assert stats["tree_steps"] > 0 and stats["tokens_per_step"] > 1.05
    assert per_depth[0] > 0.1


def test_sampled_tree_tokens_follow_the_target_at_t08(llm, smollm2_dir):
    from transformers import AutoTokenizer

    # the likely first token (' girl', p 0.63) occurred before: the trie proposes what
    # followed it, and the next token is spread over several likely ones
    text = "Once upon a time there was a girl. Once upon a time there was a"
    prompt = AutoTokenizer.from_pretrained(smollm2_dir).encode(text)
    assert_first_tree_token_is_targets(
        llm, prompt, 0.8, n=640, model_dir=smollm2_dir, min_tree_steps=300
    )
