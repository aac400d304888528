"""The lossless proofs can fail: disable the tree mask, the depth positions or the KV
compaction in turn (``additional_config["treespec"]["debug_disable"]``) and the greedy
output diverges from vLLM's plain decoding."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup installs it)")

from vllm_engines import (  # noqa: E402
    DRAFT,
    generate,
    greedy_params,
    make_llm,
    plain_outputs,
    shutdown,
)
from vllm_engines import PROMPTS as ALL_PROMPTS  # noqa: E402

PROMPTS = ALL_PROMPTS[:10]


@pytest.mark.parametrize("broken", ["mask", "positions", "compaction"])
def test_output_diverges_when_a_part_is_disabled(broken):
    reference = plain_outputs(PROMPTS)
    llm = make_llm(
        max_num_seqs=8,
        speculative_config={"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 8},
        additional_config={
            "treespec": {"tree": "topk:k=2,depth=4,budget=8", "debug_disable": broken}
        },
    )
    try:
        outs = generate(llm, PROMPTS, greedy_params(len(PROMPTS)))
    finally:
        shutdown(llm)
    diverged = sum(a != b for a, b in zip(outs, reference))
    assert diverged >= 3, f"only {diverged} of {len(PROMPTS)} outputs changed without the {broken}"


def _chain_run(monkeypatch, plugins: str | None):
    """vLLM's own draft_model chain (no treespec key): outputs and spec-decode counters."""
    from vllm_engines import spec_metrics

    if plugins is not None:
        monkeypatch.setenv("VLLM_PLUGINS", plugins)  # inherited by the engine's processes
    llm = make_llm(
        max_num_seqs=8,
        speculative_config={"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4},
    )
    try:
        outs = generate(llm, PROMPTS, greedy_params(len(PROMPTS)))
        return outs, spec_metrics(llm)
    finally:
        shutdown(llm)
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)


def test_without_the_key_vllm_is_unchanged(monkeypatch):
    """With the plugin loaded but no ``treespec`` key, vLLM's own chain speculation gives the
    same tokens and the same acceptance counts as with the plugin not loaded at all."""
    with_plugin = _chain_run(monkeypatch, None)
    without = _chain_run(monkeypatch, "treespec_accuracy")  # every plugin but the tree one
    assert with_plugin[0] == without[0] == plain_outputs(PROMPTS)
    assert with_plugin[1] == without[1]
    assert with_plugin[1]["spec_decode_num_drafts"] > 0
