"""bench.ab: the figures it reads from each benchmark's report, and the comparison."""

from __future__ import annotations

import pytest

from bench.ab import compare, flatten


def test_flatten_reads_e2e_rows_and_peers():
    report = {
        "results": [
            {"spec": "chain:4", "drafter": "eagle", "temperature": 0.0, "speedup_vs_hf": 1.5},
            {"spec": "none", "drafter": None, "temperature": 0.8, "tau": 1.0, "other": 3},
        ],
        "peers": [{"spec": "hf-lookup", "drafter": None, "temperature": 0.0, "tau": 2.5}],
    }
    assert flatten(report) == {
        "eagle chain:4 T=0.0 | speedup_vs_hf": 1.5,
        "None none T=0.8 | tau": 1.0,
        "None hf-lookup T=0.0 | tau": 2.5,
    }


def test_flatten_reads_vllm_e2e_scenarios():
    report = {
        "results": [
            {
                "name": "trie",
                "scenarios": {
                    "batch1 T=0.0": {"ratio_to_vllm_plain": 1.2, "tau": 2.0, "tokens_per_s": 9},
                    "conc4 T=0.8": {"ratio_to_vllm_plain": 0.9, "tau": None},
                },
            }
        ]
    }
    assert flatten(report) == {
        "trie | batch1 T=0.0 | ratio_to_vllm_plain": 1.2,
        "trie | batch1 T=0.0 | tau": 2.0,
        "trie | conc4 T=0.8 | ratio_to_vllm_plain": 0.9,
    }


def test_compare_takes_medians_over_rounds_of_shared_figures():
    runs = {
        "a": [{"x": 1.0, "y": 2.0}, {"x": 3.0, "y": 2.0}, {"x": 2.0, "y": 2.0}],
        "b": [{"x": 4.0, "y": 1.0}, {"x": 4.0}, {"x": 4.0, "y": 3.0}],
    }
    (row,) = compare(runs, "a", "b")  # y is missing in one round of b: not compared
    assert row == {"figure": "x", "before": 2.0, "after": 4.0, "after_over_before": 2.0}
    assert compare({"a": [{"x": 0.0}], "b": [{"x": 1.0}]}, "a", "b")[0]["after_over_before"] is None


def test_a_revision_that_is_not_a_commit_is_refused():
    from bench.ab import _rev

    with pytest.raises(ValueError, match="'no-such-rev' is not a commit"):
        _rev("no-such-rev")
