"""The local engine on a real pretrained model (SmolLM2-135M-Instruct, fetched by name).

Greedy over the n-gram trie is token-for-token the engine's own plain decoding on the 50
held-out prompts (code fed raw, chat through the chat template); tau > 1 with the
acceptance per depth; sampled first tokens at T=0.8 follow the target's distribution
(chi-square); and the proof fails when the tree mask is broken.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from tests.factories import break_tree_mask, engine_tau
from tree_dev.engine import Engine, SamplingParams

pytestmark = pytest.mark.full  # make test-all only: the real model, 50-prompt proofs

MAX_TOKENS = 24
TRIES = ["ngram:budget=8", "ngram:budget=8,history=4096"]


@pytest.fixture(scope="module")
def target(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(smollm2_prompts):
    return smollm2_prompts


@pytest.fixture(scope="module")
def plain(target, prompts):
    engine = Engine(target, tree="none", max_batch=25, max_model_len=512)
    return engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))


def _run(target, prompts, spec):
    engine = Engine(target, tree=spec, max_batch=25, max_model_len=512)
    return engine, engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))


@pytest.mark.parametrize("spec", TRIES)
def test_trie_is_lossless_on_50_held_out_prompts(target, prompts, plain, spec):
    engine, got = _run(target, prompts, spec)
    bad = [i for i, (g, w) in enumerate(zip(got, plain, strict=True)) if g != w]
    assert not bad, f"{spec}: prompts {bad[:5]} differ from the engine's plain greedy"
    tau, per_depth = engine_tau(engine, depths=3)
    print(f"{spec}: tau {tau:.2f}, acceptance per depth {[round(p, 2) for p in per_depth]}")
    assert tau > 1.05, f"{spec}: tau {tau:.2f}: the trie's drafts were hardly accepted"
    assert per_depth and per_depth[0] > 0.1


def test_greedy_proof_fails_without_the_tree_mask(target, prompts, plain, monkeypatch):
    """Verify the trie's trees under a causal chain mask (siblings see each other): the
    outputs leave plain greedy, so the lossless test above can fail."""
    break_tree_mask(monkeypatch)
    _, got = _run(target, prompts[:16], "ngram:budget=8,matches=4")
    assert sum(g != w for g, w in zip(got, plain[:16])) > 0


def test_sampled_first_tokens_follow_the_target_at_t08(smollm2_dir, target, prompts):
    """T=0.8 over the trie (target_only walk): the first output token, which the tree step
    picks, is distributed as the target's softmax(logits / 0.8)."""
    from transformers import AutoModelForCausalLM

    head = prompts[0][:12]
    prompt = head + head[:6]  # the root occurred before: the trie proposes what followed it
    fresh = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # a fresh copy: the engines switched `target`'s attention
        logits = fresh(torch.tensor([prompt])).logits[0, -1].double()
    p = torch.softmax(logits / 0.8, -1)
    engine = Engine(target, tree="ngram:budget=8", max_batch=100, max_model_len=512)
    draws = 400
    ids = [
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.8, seed=s))
        for s in range(draws)
    ]
    while engine.has_work():
        engine.step()
    counts = torch.zeros(p.numel(), dtype=torch.float64)
    for i in ids:
        counts[engine.requests[i].output[0]] += 1
    accepted = sum(r.accepted_drafts for r in engine.requests.values())
    print(f"T=0.8 first token: {accepted} of {draws} drafts accepted")
    assert accepted > draws // 20, "the trie's drafts were rarely accepted: the test proves little"
    expected = p * draws
    keep = expected >= 5
    obs = counts[keep].tolist() + [float(counts[~keep].sum())]
    exp = expected[keep].tolist() + [float(expected[~keep].sum())]
    assert chisquare(obs, exp).pvalue > 1e-3
