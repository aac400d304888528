"""The tree plugin under vLLM tensor parallelism (``tensor_parallel_size=2``, issue 18).

The target is sharded over two ranks (one CPU core each, ``VLLM_CPU_OMP_THREADS_BIND``).
Every rank runs the plugin's verify, walk and compaction on its own KV shard; greedy
outputs must be token for token vLLM's plain TP=1 output, for the draft-LM top-K tree and
the n-gram trie, on 50 held-out prompts submitted together (8 concurrent requests of
mixed lengths). That is also vLLM's plain TP=2 output here (fp32: the all-reduce sums two
halves where TP=1 sums one whole, and these models' greedy tokens do not move: a TP=2
plain engine gave the TP=1 output on these 50 prompts in every run of this module's
former premise test, through 2026-12), so no TP=2 plain engine is started: a failure here
names TP=1 plain as the reference. The ranks' statistics must agree (same trees,
same accepted paths) and show accepted drafts (tau > 1).

Engines started: TP=1 plain (shared through ``vllm_engines.plain_outputs``), TP=2 draft-LM
tree, TP=2 n-gram trie; each one is shut down before the next starts.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup installs it)")

from vllm_engines import (  # noqa: E402
    DRAFT,
    generate,
    greedy_params,
    held_out_prompts,
    make_llm,
    plain_outputs,
    shutdown,
)

pytestmark = pytest.mark.full  # make test-all only: TP=2 vLLM engines

PROMPTS = held_out_prompts(50, seed=1)
TP = 2
TREES = {
    "draft_topk": (
        {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 8},
        "topk:k=2,depth=4,budget=8",
    ),
    "ngram_trie": ({"method": "ngram", "num_speculative_tokens": 8}, "ngram:budget=8"),
}


def _tp_engine(**kw):
    """A TP=2 engine, one core per rank (the engine processes inherit the binding)."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    try:
        return make_llm(tensor_parallel_size=TP, max_num_seqs=8, **kw)
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


@pytest.fixture(scope="module")
def tp1_plain() -> list[list[int]]:
    return plain_outputs(PROMPTS)


@pytest.fixture(scope="module")
def tp2_trees() -> dict[str, tuple[list[list[int]], list[dict]]]:
    """Per tree kind: the TP=2 outputs and every rank's ``treespec_tree_stats``."""
    out = {}
    for name, (spec, tree) in TREES.items():
        llm = _tp_engine(speculative_config=spec, additional_config={"treespec": {"tree": tree}})
        try:
            outs = generate(llm, PROMPTS, greedy_params(len(PROMPTS)))
            out[name] = (outs, llm.collective_rpc("treespec_tree_stats"))
        finally:
            shutdown(llm)
    return out


def _diverged(a: list[list[int]], b: list[list[int]]) -> list[int]:
    assert len(a) == len(b) == len(PROMPTS)
    return [i for i, (x, y) in enumerate(zip(a, b)) if x != y]


@pytest.mark.parametrize("name", sorted(TREES))
def test_tree_under_tp2_is_lossless(name, tp2_trees, tp1_plain):
    outs, _ = tp2_trees[name]
    assert not (d := _diverged(outs, tp1_plain)), f"{name}: prompts {d} differ from TP=1 plain"


@pytest.mark.parametrize("name", sorted(TREES))
def test_ranks_agree_and_drafts_are_accepted(name, tp2_trees):
    _, stats = tp2_trees[name]
    assert len(stats) == TP, f"{name}: one stats dict per rank expected, got {len(stats)}"
    for k in ("tree_steps", "tokens_per_step", "depth_tried", "depth_accepted"):
        assert stats[1][k] == stats[0][k], f"{name}: ranks disagree on {k}: {stats}"
    assert stats[0]["tree_steps"] > 0
    assert stats[0]["tokens_per_step"] > 1.0, f"{name}: tau {stats[0]['tokens_per_step']}"
