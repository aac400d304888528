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

pytestmark = pytest.mark.full  # make test-all only: five vLLM engines

PROMPTS = ALL_PROMPTS[:10]


@pytest.fixture(scope="module")
def tree_llm():
    """One tree engine for every break, switched at run time (``treespec_set_debug``);
    prefix caching off, so no broken step's KV is reused by a later request."""
    llm = make_llm(
        max_num_seqs=8,
        enable_prefix_caching=False,
        speculative_config={"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 8},
        additional_config={"treespec": {"tree": "topk:k=2,depth=4,budget=8"}},
    )
    yield llm
    shutdown(llm)


def _outputs_with(llm, broken: str | None) -> list[list[int]]:
    llm.collective_rpc("treespec_set_debug", args=(broken,))
    try:
        return generate(llm, PROMPTS, greedy_params(len(PROMPTS)))
    finally:
        llm.collective_rpc("treespec_set_debug", args=(None,))


@pytest.mark.parametrize("broken", ["mask", "positions", "compaction"])
def test_output_diverges_when_a_part_is_disabled(tree_llm, broken):
    reference = plain_outputs(PROMPTS)
    outs = _outputs_with(tree_llm, broken)
    diverged = sum(a != b for a, b in zip(outs, reference))
    assert diverged >= 3, f"only {diverged} of {len(PROMPTS)} outputs changed without the {broken}"


def test_the_same_engine_is_lossless_with_every_part_on(tree_llm):
    """The switch, not the engine, made the difference: switched back, it is lossless."""
    assert _outputs_with(tree_llm, None) == plain_outputs(PROMPTS)


def test_a_bad_switch_is_refused_naming_it(tree_llm):
    with pytest.raises(Exception, match="'everything'"):  # vLLM re-raises the worker's error
        tree_llm.collective_rpc("treespec_set_debug", args=("everything",))
    shutdown(tree_llm)  # the module's engines run one at a time on this machine


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
