"""bench.nki_executor on its smallest case: tree attention's counts beside the
dense-masked alternative, and the walk's equality with the torch backend."""

from __future__ import annotations

from bench import nki_executor as bench


def test_tree_attention_moves_less_and_estimates_faster_than_dense_masked():
    (row,) = bench.attention_rows([16], [1024])
    tree, dense = row["tree"], row["dense_masked"]
    # the dense mask is read tile by tile: [16, 1024 + 16] uint8 more from HBM
    assert dense["hbm_to_sbuf_bytes"] - tree["hbm_to_sbuf_bytes"] == 16 * (1024 + 16) - 16 * 16
    assert dense["instructions"]["vector"] > tree["instructions"]["vector"]
    assert tree["instructions"]["tensor"] == dense["instructions"]["tensor"]
    assert 0 < row["est_ratio_tree_over_dense"] < 1
    assert row["max_abs_err_vs_torch"] < 2e-2 and row["dense_max_abs_err_vs_torch"] < 2e-2


def test_walk_rows_equal_torch_backend_and_count_engines():
    rows = bench.walk_rows(2, 16, 64)
    assert [r["kernel"] for r in rows] == ["tree_walk_greedy", "tree_walk_target_only"]
    for r in rows:
        assert r["equal_to_torch_backend"]
        assert r["profile"]["instructions"]["tensor"] > 0 and r["profile"]["launches"] == 1
