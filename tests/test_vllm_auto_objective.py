"""``auto_objective: makespan`` inside the plugin (no engine needed): the proposer weighs
requests' tokens only when the scheduler says no request waits, from each request's
tokens left (its ``max_tokens`` less its output, or the model length), and not at all
under the default ``tokens`` objective."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from tree_dev.auto import CostModel, makespan_weights

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup installs it)")

from tree_dev.vllm_plugin.proposing import TreeProposer  # noqa: E402

COST = CostModel(a=0.040, b=0.001, c=0.0, d=0.0, g=0.001)


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
    p = TreeProposer(tr)
    p.auto = NS(auto=NS(cost_model=COST))
    return p


# (batch row, request, committed tokens: prompt + output)
TODO = [(0, "a", 130), (1, "b", 110), (2, "c", 400)]


def test_makespan_weighs_tokens_once_no_request_waits():
    p = proposer("makespan")
    got = p._weights(NS(treespec_waiting=0), TODO)
    want = makespan_weights([34, 54, 112], COST)  # "c" sets the batch's end
    assert got == {"a": want[0], "b": want[1], "c": want[2]}
    assert got["c"] == 3.0 and got["a"] == got["b"] < 1.0


@pytest.mark.parametrize("waiting", [1, 5, None])
def test_makespan_counts_tokens_alike_while_requests_wait_or_nothing_says(waiting):
    out = NS() if waiting is None else NS(treespec_waiting=waiting)
    assert proposer("makespan")._weights(out, TODO) is None


def test_the_tokens_objective_never_weighs():
    assert proposer("tokens")._weights(NS(treespec_waiting=0), TODO) is None
