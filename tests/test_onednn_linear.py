"""tree_dev.onednn_linear: fp32 linear layers through oneDNN give F.linear's results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tree_dev.onednn_linear as mod
from tree_dev.onednn_linear import MIN_ROWS, onednn_available, restore_linears, use_onednn_linears


@pytest.fixture
def recorded(monkeypatch) -> list[tuple[tuple[int, ...], bool]]:
    """A stand-in for oneDNN's op that records (input shape, contiguous) per call."""
    calls: list[tuple[tuple[int, ...], bool]] = []

    def fake(x, weight, bias, *args):
        calls.append((tuple(x.shape), x.is_contiguous()))
        return F.linear(x, weight, bias)

    monkeypatch.setattr(mod, "_LINEAR", fake)
    monkeypatch.setattr(mod, "onednn_available", lambda: True)
    return calls


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 64), (3, 64), (9, 64), (2, 5, 64), (1, 40, 64)])
def test_linear_matches_f_linear(bias: bool, shape: tuple[int, ...]):
    """The real op (where torch has oneDNN; else the layer is left alone) against fp64."""
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(64, 300, bias=bias)
    x = torch.randn(*shape, generator=gen)
    want = F.linear(x.double(), layer.weight.double(), None if not bias else layer.bias.double())
    assert use_onednn_linears(layer) == (1 if onednn_available() else 0)
    got = layer(x)
    assert got.shape == (*shape[:-1], 300) and got.dtype == torch.float32
    # fp32 sums of 64 products of O(1) and O(1/8) terms: rounding ~1e-6
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


def test_rows_decide_the_gemm(recorded):
    """Fewer than MIN_ROWS rows keep F.linear; from MIN_ROWS on, oneDNN; a strided
    input is made contiguous first (oneDNN is very slow on strided operands)."""
    layer = torch.nn.Linear(16, 8)
    use_onednn_linears(layer)
    layer(torch.randn(MIN_ROWS - 1, 16))
    assert recorded == []
    out = layer(torch.randn(2, MIN_ROWS, 16))
    layer(torch.randn(16, MIN_ROWS).T)  # [MIN_ROWS, 16], not contiguous
    assert recorded == [((2 * MIN_ROWS, 16), True), ((MIN_ROWS, 16), True)]
    assert out.shape == (2, MIN_ROWS, 8)


def test_only_fp32_cpu_layers_and_restore(recorded):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).bfloat16())
    assert use_onednn_linears(model) == 1  # the bf16 layer keeps its own path
    assert use_onednn_linears(model) == 1  # idempotent
    x = torch.randn(6, 8)
    out = model[0](x)
    assert len(recorded) == 1
    restore_linears(model)
    assert all("forward" not in m.__dict__ for m in model)
    torch.testing.assert_close(model[0](x), out, atol=0, rtol=0)
    assert len(recorded) == 1  # restored: F.linear again


def test_without_onednn_nothing_changes(monkeypatch):
    monkeypatch.setattr(mod, "_LINEAR", None)
    layer = torch.nn.Linear(8, 8)
    assert use_onednn_linears(layer) == 0 and "forward" not in layer.__dict__


@pytest.mark.parametrize(
    "capability, want",
    [("AVX512", True), ("AVX512_BF16", True), ("AVX2", False), ("DEFAULT", False)],
)
def test_faster_only_on_avx512(monkeypatch, capability: str, want: bool):
    """oneDNN is chosen by default only where torch runs AVX-512 code (on AVX2-only
    CPUs it measured slower than MKL), and never without oneDNN."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(mod, "onednn_available", lambda: True)
    assert mod.onednn_faster() is want
    monkeypatch.setattr(mod, "onednn_available", lambda: False)
    assert mod.onednn_faster() is False
