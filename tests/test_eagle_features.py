"""The EAGLE feature history inside vLLM keeps exactly the committed positions' features."""

from __future__ import annotations

import numpy as np
import torch

from tree_dev.vllm_plugin.eagle_features import FeatureHistory

H = 3


def hidden(rows: int, step: int) -> torch.Tensor:
    """``[rows, H]``: row ``r`` of step ``step`` holds ``1000 * step + r`` everywhere, so a
    kept feature names the row it came from."""
    return (1000.0 * step + torch.arange(rows, dtype=torch.float32))[:, None].repeat(1, H)


def step_of(rids, q0, computed, scheduled):
    return (list(rids), np.array(q0), np.array(computed), np.array(scheduled))


def test_history_keeps_committed_rows_across_steps_and_joins_them_once():
    draft_len: dict[str, int] = {"a": 4, "b": 6}
    fh = FeatureHistory(draft_len)
    # step 1: "a" plain (1 row at query row 0, position 4), "b" a tree of 3 nodes at
    # query rows 1..3 (position 6) whose nodes 0 and 2 were accepted
    fh.keep(hidden(4, 1), step_of(["a", "b"], [0, 1], [4, 6], [1, 3]), {"b": [0, 2]})
    # step 2: both plain, one row each: "a" at position 5, "b" at 8
    fh.keep(hidden(2, 2), step_of(["a", "b"], [0, 1], [5, 8], [1, 1]), {})
    # step 3: "a" alone, position 6
    fh.keep(hidden(1, 3), step_of(["a"], [0], [6], [1]), {})
    start, feats = fh.catch_up("a", 7)  # positions 4, 5, 6 kept; the draft holds 4
    assert start == 4 and feats[:, 0].tolist() == [1000.0, 2000.0, 3000.0]
    start, feats = fh.catch_up("b", 9)  # positions 6, 7 (tree nodes 0, 2), 8
    assert start == 6 and feats[:, 0].tolist() == [1001.0, 1003.0, 2001.0]
    draft_len["b"] = 8  # the draft consumed up to position 8 (the proposer's record)
    fh.consumed("b", 8, 9)  # one row left
    fh.keep(hidden(1, 4), step_of(["b"], [0], [9], [1]), {})
    start, feats = fh.catch_up("b", 10)
    assert start == 8 and feats[:, 0].tolist() == [2001.0, 4000.0]


def test_a_gap_in_the_history_restarts_the_draft_from_the_new_rows():
    draft_len = {"a": 4}
    fh = FeatureHistory(draft_len)
    fh.keep(hidden(1, 1), step_of(["a"], [0], [4], [1]), {})
    fh.keep(hidden(1, 2), step_of(["a"], [0], [7], [1]), {})  # positions 5, 6 never kept
    assert draft_len["a"] == 7
    start, feats = fh.catch_up("a", 8)
    assert start == 7 and feats[:, 0].tolist() == [2000.0]
    assert fh.catch_up("a", 9) is None  # position 8's feature was never kept
    assert "a" not in draft_len
