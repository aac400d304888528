"""``auto_objective: makespan`` inside the plugin (no engine needed): the proposer hands
the chooser each request's tokens left (its ``max_tokens`` less its output, or the model
length), to weigh tokens by, only when the scheduler says no request waits, and never
under the default ``tokens`` objective."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup installs it)")

from tree_dev.vllm_plugin.proposing import TreeProposer  # noqa: E402


def proposer(objective: str) -> TreeProposer:
    """A proposer over three requests: "a" 30 tokens out of max_tokens 64, "b" 10 of 64,
    "c" without max_tokens, 400 tokens into a 512-token model (112 left)."""

    def state(max_tokens, out):
        return NS(sampling_params=NS(max_tokens=max_tokens), output_token_ids=[0] * out)

    runner = NS(
        requests={"a": state(64, 30), "b": state(64, 10), "c": state(None, 300)},
        max_model_len=512,
    )
    tr = NS(cfg=NS(policy=None, auto_objective=objective), runner=runner)
    return TreeProposer(tr)


# (batch row, request, committed tokens: prompt + output)
TODO = [(0, "a", 130), (1, "b", 110), (2, "c", 400)]


def test_makespan_hands_over_the_tokens_left_once_no_request_waits():
    got = proposer("makespan")._remaining(NS(treespec_waiting=0), TODO)
    assert got == {"a": 34, "b": 54, "c": 112}  # c: 512 - 400, no max_tokens


@pytest.mark.parametrize("waiting", [1, 5, None])
def test_makespan_counts_tokens_alike_while_requests_wait_or_nothing_says(waiting):
    out = NS() if waiting is None else NS(treespec_waiting=waiting)
    assert proposer("makespan")._remaining(out, TODO) is None


def test_the_tokens_objective_never_weighs():
    assert proposer("tokens")._remaining(NS(treespec_waiting=0), TODO) is None
