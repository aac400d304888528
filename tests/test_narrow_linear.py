"""tree_dev.narrow_linear: the few-row fp32 GEMM against an fp64 reference, its batch
invariance, the layer routing, and the clear errors and fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tree_dev.narrow_linear as mod
from tree_dev.narrow_linear import (
    narrow_available,
    narrow_gemm,
    pack_weight,
    restore_narrow_linears,
    use_narrow_linears,
)
from tree_dev.onednn_linear import use_onednn_linears

needs_kernel = pytest.mark.skipif(
    not narrow_available(), reason="needs an x86-64 CPU with AVX2 + FMA and a C compiler"
)


def _case(m: int, n: int, k: int, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    return x, w, b


def _check(m: int, n: int, k: int, bias: bool, seed: int = 0) -> None:
    x, w, b = _case(m, n, k, bias, seed)
    got = narrow_gemm(x, pack_weight(w), n, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == (m, n) and got.dtype == torch.float32
    # fp32 sums of k products of O(1) and O(1/sqrt(k)) terms: rounding ~1e-6 * sqrt(k)
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33])
@pytest.mark.parametrize("n, k", [(1, 1), (15, 7), (16, 64), (17, 64), (64, 256), (300, 33)])
def test_matches_fp64_reference(m: int, n: int, k: int, bias: bool):
    """Every row-block shape (1-4 rows, 4-row blocks plus a tail) and panel case (one
    partial panel, exact panels, a partial last panel, 4-panel groups)."""
    _check(m, n, k, bias)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 200),
    k=st.integers(1, 300),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_match_fp64_reference(m: int, n: int, k: int, bias: bool, seed: int):
    _check(m, n, k, bias, seed)


@needs_kernel
def test_rows_are_batch_invariant():
    """A row's result is bit for bit the same whatever rows share its call: the
    engine's verify of a node equals its one-row decode."""
    x, w, b = _case(11, 70, 96, True)
    panels = pack_weight(w)
    together = narrow_gemm(x, panels, 70, b)
    for i in range(11):
        assert torch.equal(together[i], narrow_gemm(x[i : i + 1], panels, 70, b)[0]), i
    assert torch.equal(together[5:8], narrow_gemm(x[5:8], panels, 70, b))


@needs_kernel
def test_non_finite_inputs_propagate():
    x, w, _ = _case(3, 20, 8, False)
    x[1, 2] = float("nan")
    x[2, 0] = float("inf")
    got = narrow_gemm(x, pack_weight(w), 20)
    assert torch.isnan(got[1]).all() and not torch.isfinite(got[2]).any()
    assert torch.isfinite(got[0]).all()


@needs_kernel
def test_layers_route_by_rows_and_restore():
    """Inputs of at most ``max_rows`` rows take the kernel (bitwise ``narrow_gemm``),
    more rows the layer's previous forward (bitwise ``F.linear``); ``restore`` puts
    ``nn.Linear.forward`` back."""
    layer = torch.nn.Linear(48, 40)
    panels = pack_weight(layer.weight)
    assert use_narrow_linears(layer, max_rows=3) == 1
    assert use_narrow_linears(layer, max_rows=3) == 1  # idempotent
    few, many = torch.randn(2, 3, 48), torch.randn(4, 48)
    got = layer(few[0])
    assert torch.equal(got, narrow_gemm(few[0], panels, 40, layer.bias))
    assert torch.equal(layer(many), F.linear(many, layer.weight, layer.bias))
    assert torch.equal(layer(few), F.linear(few, layer.weight, layer.bias))  # 6 rows > 3
    restore_narrow_linears(layer)
    assert "forward" not in layer.__dict__ and not hasattr(layer, "_narrow_panels")


@needs_kernel
def test_weight_written_in_place_is_repacked():
    layer = torch.nn.Linear(16, 20, bias=False)
    use_narrow_linears(layer)
    x = torch.randn(2, 16)
    layer(x)
    with torch.no_grad():
        layer.weight.mul_(2.0)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_wide_inputs_keep_onednn_and_restore_returns_to_it(monkeypatch):
    """On top of ``use_onednn_linears`` the wide inputs still go to oneDNN's forward;
    restoring the narrow route leaves the oneDNN forward in place."""
    import tree_dev.onednn_linear as onednn

    calls = []
    monkeypatch.setattr(onednn, "onednn_available", lambda: True)
    monkeypatch.setattr(
        onednn, "_LINEAR", lambda x, w, b, *a: calls.append(x.shape) or F.linear(x, w, b)
    )
    layer = torch.nn.Linear(8, 8)
    use_onednn_linears(layer, min_rows=4)
    onednn_forward = layer.__dict__["forward"]
    use_narrow_linears(layer, max_rows=8)
    layer(torch.randn(8, 8))
    assert calls == []  # 8 rows: the narrow kernel
    layer(torch.randn(9, 8))
    assert calls == [(9, 8)]
    restore_narrow_linears(layer)
    assert layer.__dict__["forward"] is onednn_forward


def test_only_fp32_cpu_layers_are_switched():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).bfloat16())
    want = 1 if narrow_available() else 0
    assert use_narrow_linears(model) == want
    assert "forward" not in model[1].__dict__
    restore_narrow_linears(model)
    assert "forward" not in model[0].__dict__


def test_bad_operands_name_the_field():
    with pytest.raises(ValueError, match="weight"):
        pack_weight(torch.ones(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="weight"):
        pack_weight(torch.ones(4))
    with pytest.raises(ValueError, match="max_rows"):
        use_narrow_linears(torch.nn.Linear(2, 2), max_rows=0)
    if not narrow_available():
        return
    w = torch.ones(20, 8)
    with pytest.raises(ValueError, match="panels"):
        narrow_gemm(torch.ones(2, 8), pack_weight(w), 40)  # panels for 20 outputs
    with pytest.raises(ValueError, match="panels"):
        narrow_gemm(torch.ones(2, 9), pack_weight(w), 20)  # K mismatch
    with pytest.raises(ValueError, match="x"):
        narrow_gemm(torch.ones(2, 8).double(), pack_weight(w), 20)
    with pytest.raises(ValueError, match="bias"):
        narrow_gemm(torch.ones(2, 8), pack_weight(w), 20, torch.ones(19))


def test_unavailable_where_it_cannot_run(monkeypatch, tmp_path):
    """Not x86-64, or no compiler: unavailable with the reason, nothing switched, and
    the op says why instead of running."""
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    try:
        mod._library.cache_clear()
        monkeypatch.setattr(mod.platform, "machine", lambda: "aarch64")
        assert not narrow_available()
        assert use_narrow_linears(torch.nn.Linear(4, 4)) == 0
        with pytest.raises(RuntimeError, match="aarch64"):
            narrow_gemm(torch.ones(1, 4), pack_weight(torch.ones(4, 4)), 4)
        monkeypatch.undo()
        monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
        monkeypatch.setenv("CC", "/bin/false")
        mod._library.cache_clear()
        if mod.platform.machine().lower() in ("x86_64", "amd64"):
            assert not narrow_available()
            assert "/bin/false" in mod._why_unavailable
            assert list(tmp_path.iterdir()) == []  # a failed build leaves no file behind
    finally:
        monkeypatch.undo()
        mod._library.cache_clear()
