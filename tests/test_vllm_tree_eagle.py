"""EAGLE top-K trees inside vLLM: the exported head as vLLM's ``eagle`` proposer.

The tree is SGLang-shaped (top-4 per level, depth 5, 8 draft nodes): it forwards 16 draft
nodes, twice ``num_speculative_tokens``, so vLLM's scheduler must reserve the plugin's
larger lookahead (``config.lookahead_slots``) for the drafter's KV.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup installs it)")

from vllm_engines import (  # noqa: E402
    PROMPTS,
    assert_lossless,
    make_llm,
    plain_outputs,
    shutdown,
    tree_stats,
)

pytestmark = pytest.mark.full  # make test-all only: vLLM engines, 50-prompt proofs

TREE = "topk:k=4,depth=5,budget=8"


@pytest.fixture(scope="module")
def llm():
    from tree_dev.models.export_vllm import export_eagle_for_vllm

    engine = make_llm(
        max_num_seqs=8,
        speculative_config={
            "method": "eagle",
            "model": str(export_eagle_for_vllm()),
            "num_speculative_tokens": 8,
        },
        additional_config={"treespec": {"tree": TREE}},
    )
    yield engine
    shutdown(engine)


@pytest.fixture(scope="module")
def reference():
    return plain_outputs(PROMPTS)


def test_lossless_at_batch_1(llm, reference):
    assert_lossless(llm, PROMPTS, reference, batch1=True)


def test_lossless_with_8_concurrent_mixed_lengths(llm, reference):
    assert_lossless(llm, PROMPTS, reference, batch1=False)


def test_eagle_drafts_are_accepted(llm):
    stats = tree_stats(llm)
    assert stats["tree_steps"] > 0 and stats["tokens_per_step"] > 2.0
    assert stats["acceptance_per_depth"][0] > 0.5
    assert len(stats["acceptance_per_depth"]) == 5  # trees of depth 5 were verified
