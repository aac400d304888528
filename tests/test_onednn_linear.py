"""tree_dev.onednn_linear: fp32 linear layers through oneDNN give F.linear's results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tree_dev.onednn_linear import (
    MIN_ROWS,
    onednn_available,
    restore_linears,
    use_onednn_linears,
)

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 64), (3, 64), (9, 64), (2, 5, 64), (1, 40, 64)])
def test_linear_matches_f_linear(bias: bool, shape: tuple[int, ...]):
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(64, 300, bias=bias)
    x = torch.randn(*shape, generator=gen)
    want = F.linear(x.double(), layer.weight.double(), None if not bias else layer.bias.double())
    assert use_onednn_linears(layer) == 1
    got = layer(x)
    assert got.shape == (*shape[:-1], 300) and got.dtype == torch.float32
    # fp32 sums of 64 products of N(0, 1/64)-scaled terms: rounding ~1e-6
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


@needs_onednn
def test_rows_decide_the_gemm(monkeypatch):
    """Fewer than MIN_ROWS rows keep F.linear; from MIN_ROWS on, oneDNN; a strided
    input is made contiguous first (oneDNN is very slow on strided operands)."""
    import tree_dev.onednn_linear as mod

    calls = []
    real = mod._LINEAR

    def spy(x, *args):
        calls.append((tuple(x.shape), x.is_contiguous()))
        return real(x, *args)

    monkeypatch.setattr(mod, "_LINEAR", spy)
    layer = torch.nn.Linear(16, 8)
    use_onednn_linears(layer)
    layer(torch.randn(MIN_ROWS - 1, 16))
    assert calls == []
    layer(torch.randn(16, MIN_ROWS).T)  # [MIN_ROWS, 16], not contiguous
    assert calls == [((MIN_ROWS, 16), True)]


@needs_onednn
def test_only_fp32_cpu_layers_and_restore():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).bfloat16())
    assert use_onednn_linears(model) == 1  # the bf16 layer keeps its own path
    assert use_onednn_linears(model) == 1  # idempotent
    assert "forward" in model[0].__dict__ and "forward" not in model[1].__dict__
    x = torch.randn(6, 8)
    out = model[0](x)
    restore_linears(model)
    assert "forward" not in model[0].__dict__
    torch.testing.assert_close(model[0](x), out, atol=1e-6, rtol=1e-6)


def test_without_onednn_nothing_changes(monkeypatch):
    import tree_dev.onednn_linear as mod

    monkeypatch.setattr(mod, "_LINEAR", None)
    layer = torch.nn.Linear(8, 8)
    assert use_onednn_linears(layer) == 0 and "forward" not in layer.__dict__
