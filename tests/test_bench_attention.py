"""bench.attention compares like with like: every timed column computes the same attention."""

from __future__ import annotations

import pytest
import torch

from bench.attention import dense_kv_from_pages, make_case, max_error, methods


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_every_column_is_the_same_attention(dtype: torch.dtype, tol: float):
    case = make_case(
        batch=2, n=9, prefix=40, heads=4, kv_heads=2, head_dim=64, dtype=dtype, device="cpu"
    )
    errs = max_error(methods(case, ["torch"]), case)
    assert set(errs) == {"torch", "torch_paged", "torch_fused"}
    assert max(errs.values()) <= tol, errs
    fns = methods(case, [])
    torch.testing.assert_close(fns["dense_sdpa_paged"](), fns["dense_sdpa"](), atol=0, rtol=0)


def test_pages_gathered_in_block_table_order():
    case = make_case(1, 3, 50, 2, 1, 64, torch.float32, "cpu")
    k, v = dense_kv_from_pages(case)
    assert torch.equal(k, case["k_dense"]) and torch.equal(v, case["v_dense"])
    assert not torch.equal(case["table"][0], torch.sort(case["table"][0]).values)  # shuffled
