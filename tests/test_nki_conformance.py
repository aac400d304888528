"""Conformance of the NumPy NKI executor with the NKI 0.6 documentation.

Each kernel here is written from the description in the SDK's API reference
(``nki.isa`` / ``nki.language`` docstrings, the tutorials' kernel structure) and
checked against NumPy written independently in the test, including the
accumulation rules of ``nc_matmul``, the dtype rules (fp8 / bf16 / tf32
rounding to nearest-even, fp32 PSUM, float->int saturation) and the cases the
docs call an error or undefined behaviour.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest
import torch

from kernels.nki.executor import NkiRuleError, nisa, nki, nl
from kernels.nki.executor import tiles as T

RNG = np.random.default_rng(7)


@pytest.fixture(autouse=True)
def fresh_launch():
    T._CTX.append(T.LaunchContext())
    yield
    T._CTX.pop()


def rand(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def hbm(a: np.ndarray):
    return T.Tile.wrap(np.ascontiguousarray(a), T.hbm)


def sb(a: np.ndarray, dtype=None):
    return nl.load(hbm(a), dtype=dtype)


def val(t) -> np.ndarray:
    return T.read(t)


def bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16).astype(np.float32)


# -- nc_matmul accumulation (the tiled-matmul tutorial structure) ---------------------


@nki.jit
def tiled_matmul_default_accumulate(lhs_t, rhs):
    """The tutorial's tiled matmul: one PSUM tile per output tile, ``accumulate``
    omitted (the first matmul write overwrites, the later K tiles accumulate)."""
    k_dim, m_dim = lhs_t.shape
    _, n_dim = rhs.shape
    out = nl.ndarray((m_dim, n_dim), dtype=lhs_t.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(m_dim // 128):
        for n in nl.affine_range(n_dim // 512):
            acc = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
            for k in nl.affine_range(k_dim // 128):
                a = nl.ndarray((128, 128), dtype=lhs_t.dtype, buffer=nl.sbuf)
                b = nl.ndarray((128, 512), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=lhs_t[k * 128 : (k + 1) * 128, m * 128 : (m + 1) * 128])
                nisa.dma_copy(dst=b, src=rhs[k * 128 : (k + 1) * 128, n * 512 : (n + 1) * 512])
                nisa.nc_matmul(dst=acc, stationary=a, moving=b)
            res = nl.ndarray((128, 512), dtype=out.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res, src=acc)
            nisa.dma_copy(dst=out[m * 128 : (m + 1) * 128, n * 512 : (n + 1) * 512], src=res)
    return out


@nki.jit
def tiled_matmul_explicit_accumulate(lhs_t, rhs):
    """Same result, one PSUM tile reused for every output tile: ``accumulate=(k > 0)``
    restarts the group at each output tile."""
    k_dim, m_dim = lhs_t.shape
    _, n_dim = rhs.shape
    out = nl.ndarray((m_dim, n_dim), dtype=nl.float32, buffer=nl.shared_hbm)
    acc = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
    for m in nl.affine_range(m_dim // 128):
        for n in nl.affine_range(n_dim // 512):
            for k in nl.affine_range(k_dim // 128):
                a = nl.load(lhs_t[k * 128 : (k + 1) * 128, m * 128 : (m + 1) * 128])
                b = nl.load(rhs[k * 128 : (k + 1) * 128, n * 512 : (n + 1) * 512])
                nisa.nc_matmul(acc, a, b, accumulate=k > 0)
            res = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(res, acc)
            nl.store(out[m * 128 : (m + 1) * 128, n * 512 : (n + 1) * 512], res)
    return out


def test_tiled_matmul_with_accumulate_omitted_matches_numpy_bf16():
    k, m, n = 512, 256, 1024
    a = rand(k, m).astype(ml_dtypes.bfloat16)
    b = rand(k, n).astype(ml_dtypes.bfloat16)
    got = nki.simulate(tiled_matmul_default_accumulate)(a, b)
    assert isinstance(got, np.ndarray) and got.dtype == ml_dtypes.bfloat16
    want = a.astype(np.float64).T @ b.astype(np.float64)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-2, atol=0.1)


def test_reused_psum_tile_restarts_each_group_with_accumulate_false():
    k, m, n = 256, 256, 1024
    a, b = rand(k, m), rand(k, n)
    got = tiled_matmul_explicit_accumulate(torch.from_numpy(a), torch.from_numpy(b))
    assert isinstance(got, torch.Tensor)
    np.testing.assert_allclose(got.numpy(), a.T.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)


def _psum(shape=(4, 8)):
    return nl.ndarray(shape, nl.float32, buffer=nl.psum)


def test_accumulate_none_overwrites_fresh_psum_then_accumulates():
    a, b = rand(8, 4), rand(8, 8)
    acc = _psum()  # NaN-filled: accumulating onto it would give NaN
    nisa.nc_matmul(acc, sb(a), sb(b))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nisa.nc_matmul(acc, sb(a), sb(b))  # not read in between: accumulates, no warning
    np.testing.assert_allclose(val(acc), 2 * (a.T @ b), rtol=1e-5, atol=1e-5)
    with pytest.warns(nisa.NkiAccumulationWarning, match="already read out"):
        nisa.nc_matmul(acc, sb(a), sb(b))  # read (val) then accumulated onto: warned
    np.testing.assert_allclose(val(acc), 3 * (a.T @ b), rtol=1e-5, atol=1e-5)
    nisa.nc_matmul(acc, sb(a), sb(b), accumulate=False)
    np.testing.assert_allclose(val(acc), a.T @ b, rtol=1e-5, atol=1e-5)
    nisa.nc_matmul(acc, sb(a), sb(b), accumulate=True)
    np.testing.assert_allclose(val(acc), 2 * (a.T @ b), rtol=1e-5, atol=1e-5)


def test_overlapping_psum_regions_accumulate_only_where_written():
    """The convolution pattern: a second matmul over [2:6] adds on [2:4] only."""
    a, b = rand(8, 4), rand(8, 4)
    acc = _psum((4, 6))
    nisa.nc_matmul(acc[:, 0:4], sb(a), sb(b))
    nisa.nc_matmul(acc[:, 2:6], sb(a), sb(b))
    p = a.T @ b
    want = np.concatenate([p[:, :2], p[:, 2:] + p[:, :2], p[:, 2:]], axis=1)
    np.testing.assert_allclose(val(acc), want, rtol=1e-5, atol=1e-5)


def test_accumulate_true_on_a_location_no_matmul_wrote_is_an_error():
    acc = _psum()
    with pytest.raises(NkiRuleError, match="no matmul has written"):
        nisa.nc_matmul(acc, sb(rand(8, 4)), sb(rand(8, 8)), accumulate=True)


@pytest.mark.parametrize("accumulate", [None, True])
@pytest.mark.parametrize("init", ["memset", "tensor_copy"])
def test_accumulating_onto_non_matmul_initialised_psum_is_undefined_on_v3(init, accumulate):
    acc = _psum()
    if init == "memset":
        nisa.memset(acc, 0.0)
    else:
        nisa.tensor_copy(acc, sb(np.zeros((4, 8), np.float32)))
    with pytest.raises(NkiRuleError, match="non-matmul instruction"):
        nisa.nc_matmul(acc, sb(rand(8, 4)), sb(rand(8, 8)), accumulate=accumulate)
    a, b = rand(8, 4), rand(8, 8)
    nisa.nc_matmul(acc, sb(a), sb(b), accumulate=False)  # overwriting is fine
    np.testing.assert_allclose(val(acc), a.T @ b, rtol=1e-5, atol=1e-5)


def test_accumulating_onto_memset_psum_is_allowed_on_v4(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    T._CTX.append(T.LaunchContext())
    try:
        assert nisa.get_nc_version() == nisa.nc_version.gen4
        acc = _psum()
        nisa.memset(acc, 1.0)
        a, b = rand(8, 4), rand(8, 8)
        nisa.nc_matmul(acc, sb(a), sb(b))
        np.testing.assert_allclose(val(acc), 1.0 + a.T @ b, rtol=1e-5, atol=1e-5)
    finally:
        T._CTX.pop()


def test_nc_version_defaults_to_trn2_and_follows_the_override(monkeypatch):
    assert nisa.get_nc_version() == nisa.nc_version.gen3
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
    assert T.LaunchContext().nc_version == 2
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn9")
    with pytest.raises(NkiRuleError, match="unknown target"):
        T.LaunchContext()


def test_bf16_matmul_accumulates_in_fp32_psum_and_bf16_dst_is_refused_on_v3():
    k = 128
    a = np.full((k, 1), 1.0, np.float32)
    b = np.full((k, 1), 2.0**-8, np.float32)  # each product rounds away in bf16 sums
    acc = _psum((1, 1))
    nisa.nc_matmul(acc, sb(a, nl.bfloat16), sb(b, nl.bfloat16))
    assert val(acc)[0, 0] == 0.5  # 128 * 2^-8, exact in fp32
    with pytest.raises(NkiRuleError, match="float32 PSUM tile"):
        nisa.nc_matmul(
            nl.ndarray((1, 1), nl.bfloat16, buffer=nl.psum),
            sb(a, nl.bfloat16),
            sb(b, nl.bfloat16),
        )


def test_double_row_fp8_matmul_contracts_over_partition_and_pair():
    a = rand(128, 2, 4)
    b = rand(128, 2, 8)
    st = sb(a, nl.float8_e4m3)
    mv = sb(b, nl.float8_e4m3)
    acc = _psum((4, 8))
    nisa.nc_matmul(acc, st, mv, perf_mode=nisa.matmul_perf_mode.double_row)
    qa = a.astype(ml_dtypes.float8_e4m3).astype(np.float64).reshape(256, 4)
    qb = b.astype(ml_dtypes.float8_e4m3).astype(np.float64).reshape(256, 8)
    np.testing.assert_allclose(val(acc), qa.T @ qb, rtol=1e-5, atol=1e-4)
    with pytest.raises(NkiRuleError, match="cannot be mixed"):
        nisa.nc_matmul(
            _psum((4, 8)), sb(rand(8, 4), nl.float8_e4m3), sb(rand(8, 8), nl.float8_e4m3fn)
        )


# -- dtypes and rounding -----------------------------------------------------------------

# (dtype, input, expected) worked out by hand from each format's bits
ROUNDING = [
    ("float8_e4m3fn", 1.0625, 1.0),  # tie between 1.0 and 1.125 -> even mantissa 000
    ("float8_e4m3fn", 1.1875, 1.25),  # tie between 1.125 (001) and 1.25 (010) -> 1.25
    ("float8_e4m3fn", 448.0, 448.0),  # largest finite value
    ("float8_e4m3", 240.0, 240.0),  # legacy IEEE-style e4m3: largest finite value
    ("float8_e4m3", 1000.0, np.inf),  # overflows to inf (the format has inf)
    ("float8_e5m2", 1.125, 1.0),  # tie between 1.0 (00) and 1.25 (01) -> 1.0
    ("float8_e5m2", 1.375, 1.5),  # tie between 1.25 (01) and 1.5 (10) -> 1.5
    ("float8_e5m2", 57344.0, 57344.0),  # largest finite e5m2
    ("bfloat16", 1.0 + 2.0**-8, 1.0),  # tie -> even
    ("bfloat16", 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-6),  # tie -> even (up)
    ("tfloat32", 1.0 + 2.0**-11, 1.0),  # 10 mantissa bits: tie -> even
    ("tfloat32", 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-9),
    ("tfloat32", 1.0 + 2.0**-10 + 2.0**-12, 1.0 + 2.0**-10),  # below half: down
    ("int8", 2.5, 2.0),  # float -> int: nearest, ties to even
    ("int8", 3.5, 4.0),
    ("int8", -2.5, -2.0),
    ("int8", 300.0, 127.0),  # saturates
    ("uint8", -1.0, 0.0),
    ("int32", 2.0**40, 2.0**31 - 1),
]


@pytest.mark.parametrize("name,x,want", ROUNDING, ids=[f"{r[0]}-{r[1]}" for r in ROUNDING])
def test_writes_round_to_nearest_even_and_saturate_integers(name, x, want):
    src = sb(np.array([[x]], np.float32))
    dst = nl.ndarray((1, 1), getattr(nl, name))
    nisa.tensor_copy(dst, src)
    assert val(dst)[0, 0] == np.float32(want)


def test_fp8_tile_through_activation_rounds_every_element():
    x = rand(16, 64) * 10
    out = nl.ndarray((16, 64), nl.float8_e4m3fn)
    nisa.activation(out, nl.copy, sb(x))
    # every result is an e4m3fn value and the nearest one: |err| <= half a step (2^-3 rel)
    got = val(out)
    assert np.all(np.abs(got - x) <= np.abs(x) * 2.0**-4 + 2.0**-10)
    grid = np.unique(
        np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    )
    assert np.isin(got, grid).all()


def test_packed_x4_dtypes_store_bits_only():
    t = nl.ndarray((4, 2), nl.float8_e4m3fn_x4)
    nisa.memset(t, 0)
    assert (t.view(nl.uint32).array == 0).all()
    assert t.view(nl.uint8).shape == (4, 8)
    with pytest.raises(NkiRuleError, match="only be memset to 0"):
        nisa.memset(t, 1.0)
    with pytest.raises(NkiRuleError, match="packed MX dtype"):
        nl.exp(t)
    assert nl.float4_e2m1fn_x4.itemsize == 2 and nl.float8_e5m2_x4.itemsize == 4


# -- DMA transpose -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,perm", [((16, 8), (1, 0)), ((4, 6, 8), (2, 1, 0)), ((3, 2, 4, 5), (3, 1, 2, 0))]
)
def test_dma_transpose_permutes_as_documented(shape, perm):
    x = rand(*shape).astype(ml_dtypes.bfloat16)
    dst = nl.ndarray(tuple(shape[p] for p in perm), nl.bfloat16)
    nisa.dma_transpose(dst, hbm(x))
    np.testing.assert_array_equal(dst.array, x.transpose(perm))


@pytest.mark.parametrize(
    "fn,message",
    [
        (lambda: nisa.dma_transpose(nl.ndarray((8, 16), nl.float32), hbm(rand(16, 8))), "2 bytes"),
        (
            lambda: nisa.dma_transpose(
                nl.ndarray((129, 16), nl.bfloat16), hbm(rand(16, 129).astype(ml_dtypes.bfloat16))
            ),
            "> 128",
        ),
        (
            lambda: nisa.dma_transpose(
                nl.ndarray((8, 8), nl.bfloat16),
                hbm(rand(8, 8).astype(ml_dtypes.bfloat16)),
                dge_mode=nisa.dge_mode.hwdge,
            ),
            "breaks the src",
        ),
        (
            lambda: nisa.dma_transpose(
                nl.ndarray((8, 16), nl.bfloat16),
                hbm(rand(16, 8).astype(ml_dtypes.bfloat16)),
                axes=(0, 1),
            ),
            "unsupported",
        ),
    ],
    ids=["fp32", "last dim > 128", "hwdge partitions", "axes"],
)
def test_dma_transpose_errors(fn, message):
    with pytest.raises(NkiRuleError, match=message):
        fn()


# -- vector engine instructions --------------------------------------------------------


def test_scalar_tensor_tensor_with_vector_operand_and_reversals():
    d, v, o = rand(8, 16), rand(8, 1), rand(8, 16)
    out = nl.ndarray((8, 16), nl.float32)
    nisa.scalar_tensor_tensor(out, sb(d), nl.subtract, sb(v), nl.multiply, sb(o))
    np.testing.assert_allclose(val(out), (d - v) * o, rtol=1e-6)
    nisa.scalar_tensor_tensor(
        out, sb(d), nl.subtract, 2.0, nl.subtract, sb(o), reverse0=True, reverse1=True
    )
    np.testing.assert_allclose(val(out), o - (2.0 - d), rtol=1e-6, atol=1e-6)
    ps = nl.ndarray((8, 16), nl.float32, buffer=nl.psum)
    nisa.tensor_copy(ps, sb(d))
    ps2 = nl.ndarray((8, 16), nl.float32, buffer=nl.psum)
    nisa.tensor_copy(ps2, sb(o))
    with pytest.raises(NkiRuleError, match="both be in PSUM"):
        nisa.scalar_tensor_tensor(out, ps, nl.add, 1.0, nl.add, ps2)


def test_reciprocal_and_rsqrt_square_silu():
    x = np.abs(rand(8, 32)) + 0.1
    out = nl.ndarray((8, 32), nl.float32)
    nisa.reciprocal(out, sb(x))
    np.testing.assert_allclose(val(out), 1.0 / x, rtol=1e-6)
    np.testing.assert_allclose(val(nl.rsqrt(sb(x))), x**-0.5, rtol=1e-6)
    np.testing.assert_allclose(val(nl.square(sb(x))), x * x, rtol=1e-6)
    y = rand(8, 32)
    np.testing.assert_allclose(val(nl.silu(sb(y))), y / (1 + np.exp(-y)), rtol=1e-5, atol=1e-6)
    act = nl.ndarray((8, 32), nl.float32)
    nisa.activation(act, nl.rsqrt, sb(x), scale=4.0)
    np.testing.assert_allclose(val(act), (4 * x) ** -0.5, rtol=1e-6)


def test_tensor_tensor_scan_is_the_documented_recurrence():
    a, b = rand(4, 12), rand(4, 12)
    init = rand(4, 1)
    out = nl.ndarray((4, 12), nl.float32)
    nisa.tensor_tensor_scan(out, sb(a), sb(b), sb(init), nl.multiply, nl.add)
    want = np.empty_like(a)
    r = init[:, 0].astype(np.float64)
    for i in range(12):  # r_i = a_i * r_{i-1} + b_i (a linear recurrence, as in Mamba)
        r = a[:, i] * r + b[:, i]
        want[:, i] = r
    np.testing.assert_allclose(val(out), want, rtol=1e-4, atol=1e-5)
    nisa.tensor_tensor_scan(out, sb(a), sb(b), 1.0, nl.subtract, nl.subtract, reverse0=True)
    r = np.ones(4)
    for i in range(12):  # reverse0: op0(r, data0) = r - a; then - b
        r = (r - a[:, i]) - b[:, i]
        want[:, i] = r
    np.testing.assert_allclose(val(out), want, rtol=1e-4, atol=1e-4)


def test_nc_stream_shuffle_moves_within_quadrants_and_255_keeps():
    x = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    mask = [31 - i for i in range(32)]
    mask[5] = 255
    dst = nl.zeros((64, 3), nl.float32)
    nisa.nc_stream_shuffle(dst, sb(x), mask)
    want = np.concatenate([x[31::-1], x[63:31:-1]])
    want[5] = 0.0
    want[37] = 0.0
    np.testing.assert_array_equal(val(dst), want)
    big = nl.zeros((128, 3), nl.float32)
    with pytest.raises(NkiRuleError, match="must start at one of"):
        nisa.nc_stream_shuffle(big[32:96, :], sb(x), list(range(32)))


def test_broadcast_to_free_and_partition_dims():
    col = rand(8, 1)
    row = rand(1, 16)
    np.testing.assert_array_equal(val(nl.broadcast_to(sb(col), (8, 16))), np.tile(col, (1, 16)))
    np.testing.assert_array_equal(val(nl.broadcast_to(sb(row), (8, 16))), np.tile(row, (8, 1)))
    t = sb(col)
    assert nl.broadcast_to(t, (8, 1)) is t
    with pytest.raises(NkiRuleError, match="rank"):
        nl.broadcast_to(sb(col), (8, 1, 4))
    with pytest.raises(NkiRuleError, match="cannot broadcast"):
        nl.broadcast_to(sb(rand(8, 2)), (8, 16))


# -- old API forms that map 1:1 -------------------------------------------------------


def test_value_returning_isa_forms_of_the_old_api():
    x, w = rand(8, 16), rand(8, 4)
    c = nisa.tensor_copy(sb(x), dtype=nl.bfloat16)
    assert c.dtype == nl.bfloat16 and c.buffer == "sbuf"
    np.testing.assert_array_equal(val(c), bf16(x))
    e = nisa.activation(nl.exp, sb(x), scale=0.5)
    np.testing.assert_allclose(val(e), np.exp(0.5 * x), rtol=1e-6)
    mm = nisa.nc_matmul(sb(w), sb(x))
    assert mm.buffer == "psum" and mm.shape == (4, 16)
    np.testing.assert_allclose(val(mm), w.T @ x, rtol=1e-5, atol=1e-5)
    tt = nisa.tensor_tensor(sb(x), sb(x), nl.multiply)
    np.testing.assert_allclose(val(tt), x * x, rtol=1e-6)
    ts = nisa.tensor_scalar(sb(x), nl.add, 1.0, op1=nl.multiply, operand1=3.0)
    np.testing.assert_allclose(val(ts), (x + 1) * 3, rtol=1e-6)
    red = nisa.tensor_reduce(nl.maximum, sb(x), axis=1)
    np.testing.assert_array_equal(val(red), x.max(axis=1, keepdims=True))
    with pytest.raises(NkiRuleError, match="dtype"):
        nisa.tensor_copy(nl.ndarray((8, 16), nl.float32), sb(x), dtype=nl.bfloat16)


@nki.jit
def old_api_add_kernel(a, b):
    """The old tutorial style: arange index grids, par_dim shapes, nl.load / nl.store."""
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    i_p = nl.arange(64)[:, None]
    i_f = nl.arange(32)[None, :]
    for t in nl.affine_range(a.shape[0] // 64):
        x = nl.load(a[t * 64 + i_p, i_f])
        y = nl.load(b[t * 64 + i_p, i_f])
        acc = nl.ndarray((nl.par_dim(64), 32), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(acc, x, y, nl.add)
        nl.store(out[t * 64 + i_p, i_f], value=acc)
    return out


def test_old_api_arange_mgrid_par_dim():
    a, b = rand(128, 32), rand(128, 32)
    np.testing.assert_array_equal(nki.simulate(old_api_add_kernel)(a, b), a + b)
    g_p, g_f = nl.mgrid[0:4, 2:8]
    t = sb(rand(8, 10))
    assert t[g_p, g_f].shape == (4, 6)
    with pytest.raises(NkiRuleError, match="not modelled"):
        _ = nl.arange(4) < 2  # old-API masks
    with pytest.raises(NkiRuleError, match="not modelled"):
        nl.load(hbm(a), mask=object())
    with pytest.raises(NkiRuleError, match="not affine"):
        _ = nl.arange(4) * nl.arange(4)
    with pytest.raises(NkiRuleError, match="partition index"):
        _ = t[g_f - 2, g_p]  # the partition index varying along the second grid axis


@nki.jit
def old_api_flat_transpose(x, rows: int, cols: int):
    """Old-API style: every partition holds a row-major [rows, cols] matrix; write its
    transpose with 3-d arange grids (free index ``f2 * rows + f1``)."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x)
    o = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    i_p = nl.arange(x.shape[0])[:, None, None]
    i_1 = nl.arange(rows)[None, :, None]
    i_2 = nl.arange(cols)[None, None, :]
    o[i_p, i_2 * rows + i_1] = nl.copy(t[i_p, i_1 * cols + i_2])
    nl.store(out, value=o)
    return out


@nki.jit
def old_api_block_accumulate(x):
    """A ``(blocks, par_dim(P), F)`` SBUF tensor indexed per block, tile operators."""
    blocks, p, f = x.shape
    acc = nl.zeros((blocks, nl.par_dim(p), f), dtype=nl.float32)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    for b in nl.affine_range(blocks):
        t = nl.load(x[b])
        acc[b, :, :] += t * 2.0 - 1.0
        nl.store(out[b], value=acc[b])
    return out


def test_old_api_affine_grids_block_tensors_and_tile_operators():
    x = rand(8, 12)
    got = nki.simulate(old_api_flat_transpose)(x, 3, 4)
    np.testing.assert_array_equal(got, x.reshape(8, 3, 4).transpose(0, 2, 1).reshape(8, 12))
    y = rand(3, 16, 8)
    np.testing.assert_allclose(nki.simulate(old_api_block_accumulate)(y), 2 * y - 1, rtol=1e-6)
    block = nl.zeros((3, nl.par_dim(16), 8), nl.float32)
    with pytest.raises(NkiRuleError, match="block dims"):
        nl.exp(block)
    assert block[1].shape == (16, 8) and block.shape == (3, 16, 8)
    with pytest.raises(NkiRuleError, match="data-dependent"):
        bool(sb(x) < 0.0)
    assert nl.spmd_dim(4, nl.nc(2)) == 8  # 4 programs on each of 2 cores
    left = np.float32(3.0) * sb(x)  # a NumPy scalar on the left defers to the tile
    assert isinstance(left, T.Tile)
    np.testing.assert_allclose(val(left), 3 * x, rtol=1e-6)


# -- tensors: access patterns, views, NKIObject ---------------------------------------


def test_ap_access_patterns_and_dtype_reinterpretation():
    x = rand(4, 6)
    h = hbm(x)
    np.testing.assert_array_equal(h.ap([[1, 6], [6, 4]]).array, x.T)  # transposed view
    np.testing.assert_array_equal(h.ap([[6, 2], [1, 3]], offset=8).array, x[1:3, 2:5])
    np.testing.assert_array_equal(h[1:3, :].ap([[6, 2], [1, 6]]).array, x[1:3])
    s = sb(rand(128, 32))
    np.testing.assert_array_equal(s.ap([[32, 128], [1, 32]]).array, s.array)
    np.testing.assert_array_equal(s.ap([[32, 128], [2, 16]]).array, s.array[:, ::2])
    assert h.ap([[12, 4], [1, 12]], dtype=nl.bfloat16).shape == (4, 12)
    with pytest.raises(NkiRuleError, match="outside"):
        h.ap([[6, 4], [1, 7]])
    with pytest.raises(NkiRuleError, match="whole partitions"):
        s.ap([[16, 128], [1, 32]])
    assert h.get_pattern() == [[6, 4], [1, 6]] and h[1:3, 2:4].offset == 8


def test_tensor_views_follow_the_documented_constraints():
    t = sb(rand(128, 24))
    assert t.reshape_dim(1, (4, -1)).shape == (128, 4, 6)
    assert t.reshape_dim(1, (4, 6)).permute((0, 2, 1)).shape == (128, 6, 4)
    assert t.expand_dim(1).broadcast(1, 8).shape == (128, 8, 24)
    assert t.reshape_dim(1, (2, 3, 4)).flatten_dims(1, 2).shape == (128, 6, 4)
    assert t.slice(1, 0, 24, 2).shape == (128, 12)
    assert t[3].shape == (1, 24)  # an integer on the partition dim keeps it
    assert t[:, 5].shape == (128, 1)  # on-chip views stay 2-d
    assert t.view(nl.uint8).shape == (128, 96)
    assert t.is_contiguous() and not t.permute((0, 1)).is_indirect()
    with pytest.raises(NkiRuleError, match="partition dim first"):
        t.permute((1, 0))
    with pytest.raises(NkiRuleError, match="keep their partition dim"):
        t.squeeze_dim(0)
    np.testing.assert_array_equal(t[-1].array, t.array[127:128])


@dataclass
class TileConfig(nl.NKIObject):
    rows: int = 64
    scale: float = 2.0


@nki.jit
def configured_scale(x, cfg: TileConfig):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x[0 : cfg.rows, :])
    nl.store(out[0 : cfg.rows, :], nl.multiply(t, cfg.scale))
    return out


@dataclass
class Plain(nl.NKIObject):
    offset = None  # an unannotated class attribute is a field, as NKI allows
    count: int = 0


def test_nkiobject_plain_attributes_are_fields_and_placed_allocation():
    p = Plain(offset=3, count=2)
    assert (p.offset, p.count) == (3, 2) and Plain().offset is None
    t = nl.ndarray((32, 64), nl.float32, buffer=nl.sbuf, address=(96, 1024))
    assert t.shape == (32, 64) and T.ctx().used["sbuf"] == 0  # placed by hand: not live
    with pytest.raises(NkiRuleError, match="partitions > 128"):
        nl.ndarray((64, 64), nl.float32, buffer=nl.sbuf, address=(96, 0))
    with pytest.raises(NkiRuleError, match="exceeds the"):
        nl.ndarray((8, 512), nl.float32, buffer=nl.psum, address=(0, 15 * 1024))
    assert nl.num_programs(axes=0) == 1 and nl.num_programs(None) == (1,)


def test_nkiobject_config_and_simulate_formats():
    x = rand(64, 8)
    got = nki.simulate(configured_scale)(x, TileConfig(scale=3.0))
    assert isinstance(got, np.ndarray)
    np.testing.assert_allclose(got, 3 * x, rtol=1e-6)
    got_t = nki.simulate(configured_scale)(torch.from_numpy(x), TileConfig())
    assert isinstance(got_t, torch.Tensor)
    np.testing.assert_allclose(got_t.numpy(), 2 * x, rtol=1e-6)
    assert nl.NKIObject(a=1).a == 1
    assert nki.typing.tensor is nl.NkiTensor and nki.dtype(nl.bfloat16) == nl.bfloat16


def test_nl_copy_from_psum_is_bit_exact():
    ps = nl.ndarray((4, 8), nl.float32, buffer=nl.psum)
    x = rand(4, 8)
    nisa.nc_matmul(ps, sb(np.eye(4, dtype=np.float32)), sb(x))
    c = nl.copy(ps)
    assert c.buffer == "sbuf" and c.dtype == nl.float32
    np.testing.assert_array_equal(c.array, ps.array)


# -- Vector Engine accumulator instructions ---------------------------------------------


def test_tensor_scalar_reduce_chains_through_the_accumulator():
    a, b = rand(8, 16), rand(8, 16)
    out = nl.ndarray((8, 16), nl.float32)
    res = nl.ndarray((8, 1), nl.float32)
    nisa.tensor_scalar_reduce(out, sb(a), nl.multiply, 2.0, nl.add, reduce_res=None)
    nisa.tensor_scalar_reduce(
        out, sb(b), nl.multiply, 2.0, nl.add, reduce_res=res, reduce_cmd=nisa.reduce_cmd.reduce
    )
    np.testing.assert_allclose(val(out), 2 * b, rtol=1e-6)
    np.testing.assert_allclose(val(res)[:, 0], 2 * (a.sum(1) + b.sum(1)), rtol=1e-4, atol=1e-4)
    init = rand(8, 1)
    nisa.tensor_scalar_reduce(
        out,
        sb(a),
        nl.add,
        sb(init),
        nl.maximum,
        reduce_res=res,
        reduce_cmd=nisa.reduce_cmd.load_reduce,
        reduce_init=sb(np.full((8, 1), 100.0, np.float32)),
        reduce_res_negate=True,
    )
    np.testing.assert_allclose(val(res)[:, 0], -np.maximum(100.0, (a + init).max(1)), rtol=1e-6)
    with pytest.raises(NkiRuleError, match="only for reduce_cmd=load_reduce"):
        nisa.tensor_scalar_reduce(out, sb(a), nl.add, 0.0, nl.add, reduce_init=1.0)


def test_tensor_scalar_cumulative_is_the_documented_running_register():
    x = rand(4, 10)
    out = nl.ndarray((4, 10), nl.float32)
    nisa.tensor_scalar_cumulative(out, sb(x), nl.multiply, nl.add, 3.0)
    np.testing.assert_allclose(val(out), np.cumsum(3 * x, axis=1), rtol=1e-5, atol=1e-5)
    nisa.tensor_scalar_cumulative(
        out, sb(x), nl.add, nl.maximum, 0.0, imm1=1.0, reduce_cmd=nisa.reduce_cmd.load_reduce
    )
    np.testing.assert_array_equal(val(out), np.maximum.accumulate(np.maximum(x, 1.0), axis=1))
    with pytest.raises(NkiRuleError, match="int32"):
        nisa.tensor_scalar_cumulative(
            nl.ndarray((4, 10), nl.int32), sb(x, nl.int32), nl.add, nl.add, 0.0
        )


def test_select_reduce_and_range_select_with_max_reduction():
    x = rand(8, 32)
    pred = (RNG.random((8, 32)) < 0.5).astype(np.uint8)
    out = nl.ndarray((8, 32), nl.float32)
    res = nl.ndarray((8, 1), nl.float32)
    nisa.select_reduce(
        out, sb(pred), sb(x), -5.0, reduce_res=res, reduce_cmd=nisa.reduce_cmd.reset_reduce
    )
    want = np.where(pred != 0, x, -5.0)
    np.testing.assert_array_equal(val(out), want)
    np.testing.assert_array_equal(val(res)[:, 0], want.max(1))
    lo = np.arange(8, dtype=np.float32)[:, None]  # keep lo <= idx < lo + 4 (a sliding window)
    nisa.range_select(
        out, sb(x), nl.greater_equal, nl.less, sb(lo), sb(lo + 4), reduce_res=res, range_start=0
    )
    idx = np.arange(32)[None, :]
    keep = (idx >= lo) & (idx < lo + 4)
    want = np.where(keep, x, np.finfo(np.float32).min)
    np.testing.assert_array_equal(val(out), want)
    np.testing.assert_array_equal(val(res)[:, 0], want.max(1))
    with pytest.raises(NkiRuleError, match="FP32_MIN"):
        nisa.range_select(
            out, sb(x), nl.greater_equal, nl.less, sb(lo), sb(lo + 4), on_false_value=-1e9
        )


def test_exponential_is_v4_only_and_sums_into_reduce_res(monkeypatch):
    x = rand(4, 16)
    with pytest.raises(NkiRuleError, match="NeuronCore-v4"):
        nisa.exponential(nl.ndarray((4, 16), nl.float32), sb(x))
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "gen4")
    T._CTX.append(T.LaunchContext())
    try:
        out, res = nl.ndarray((4, 16), nl.float32), nl.ndarray((4, 1), nl.float32)
        m = x.max(1, keepdims=True)
        nisa.exponential(
            out, sb(x), max_value=sb(m), reduce_res=res, reduce_cmd=nisa.reduce_cmd.reset_reduce
        )
        np.testing.assert_allclose(val(out), np.exp(x - m), rtol=1e-6)
        np.testing.assert_allclose(val(res)[:, 0], np.exp(x - m).sum(1), rtol=1e-5)
    finally:
        T._CTX.pop()


def test_bn_stats_then_bn_aggr_give_mean_and_variance_over_tiles():
    x = rand(8, 1024) * 3 + 1
    stats = nl.ndarray((8, 12), nl.float32)
    for i in range(2):  # two 512-element tiles into one stats tensor
        nisa.bn_stats(stats[:, 6 * i : 6 * i + 6], sb(x[:, 512 * i : 512 * (i + 1)]))
    np.testing.assert_array_equal(val(stats)[:, 0], 256.0)  # even-element count
    np.testing.assert_allclose(val(stats)[:, 1], x[:, 0:512:2].mean(1), rtol=1e-5)
    out = nl.ndarray((8, 2), nl.float32)
    nisa.bn_aggr(out, stats)
    np.testing.assert_allclose(val(out)[:, 0], x.mean(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(val(out)[:, 1], x.var(1), rtol=1e-4)
    with pytest.raises(NkiRuleError, match="512"):
        nisa.bn_stats(nl.ndarray((8, 6), nl.float32), sb(rand(8, 513)))


def test_tensor_partition_reduce_across_partitions():
    x = rand(16, 8)
    out = nl.ndarray((1, 8), nl.float32)
    nisa.tensor_partition_reduce(out, nl.add, sb(x))
    np.testing.assert_allclose(val(out)[0], x.sum(0), rtol=1e-5, atol=1e-6)
    nisa.tensor_partition_reduce(out, nl.maximum, sb(x))
    np.testing.assert_array_equal(val(out)[0], x.max(0))
    bits = RNG.integers(0, 256, (16, 8)).astype(np.int32)
    ob = nl.ndarray((1, 8), nl.int32)
    nisa.tensor_partition_reduce(ob, nl.bitwise_or, sb(bits))
    np.testing.assert_array_equal(ob.array[0], np.bitwise_or.reduce(bits, axis=0))


@pytest.mark.parametrize("fn,dfn", [("silu", "silu_dx"), ("gelu", "gelu_dx"), ("erf", "erf_dx")])
def test_derivative_activations_match_finite_differences(fn, dfn):
    x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(2, 32)
    h = np.float32(1e-2)
    f = getattr(nl, fn)
    fd = (val(f(sb(x + h))) - val(f(sb(x - h)))) / (2 * h)
    np.testing.assert_allclose(val(getattr(nl, dfn)(sb(x))), fd, atol=2e-3)
    out = nl.ndarray((2, 32), nl.float32)
    nisa.activation(out, getattr(nl, dfn), sb(x))
    np.testing.assert_allclose(val(out), fd, atol=2e-3)


def test_mish_and_gelu_apprx_sigmoid():
    x = rand(4, 16)
    np.testing.assert_allclose(
        val(nl.mish(sb(x))), x * np.tanh(np.log1p(np.exp(x))), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        val(nl.gelu_apprx_sigmoid(sb(x))), x / (1 + np.exp(-1.702 * x)), rtol=1e-5, atol=1e-6
    )


@nki.jit
def old_api_psum_accumulate(a_t, b):
    """Old style: ``psum[...] += nisa.nc_matmul(...)`` accumulates over K tiles, value-
    returning keyword calls, a NumPy ufunc as the op, a 1-d HBM column loaded as [P, 1]."""
    k_dim, m = a_t.shape
    n = b.shape[1]
    out = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.shared_hbm)
    acc = nl.ndarray((nl.par_dim(m), n), dtype=nl.float32, buffer=nl.psum)
    for k in nl.affine_range(k_dim // 128):
        acc[...] += nisa.nc_matmul(
            stationary=nl.load(a_t[k * 128 : (k + 1) * 128, :]),
            moving=nl.load(b[k * 128 : (k + 1) * 128, :]),
        )
    col = nl.load(b[0:m, 0])  # [m, 1]
    res = nisa.tensor_scalar(data=acc, op0=np.add, operand0=col)
    nl.store(out, value=res)
    return out


def test_old_api_psum_plus_equals_is_an_accumulation_group():
    a, b = rand(256, 64), rand(256, 32)
    got = nki.simulate(old_api_psum_accumulate)(a, b)
    np.testing.assert_allclose(got, a.T @ b + b[:64, 0:1], rtol=1e-5, atol=1e-4)
    x = np.linspace(-2, 2, 8, dtype=np.float32)
    np.testing.assert_array_equal(nl.static_cast(x, nl.bfloat16), bf16(x))
    const = nl.shared_constant(np.eye(4, dtype=np.int8), dtype=nl.float32)
    assert const.buffer == "hbm" and const.dtype == nl.float32
    with nl.no_reorder():
        assert nl.affine_range(3, directives=None) == range(3)
    with pytest.raises(NkiRuleError, match="one 2 KiB PSUM bank"):
        nl.ndarray((4, nl.par_dim(128), 513), nl.float32, buffer=nl.psum)
    blocks = nl.ndarray((64, nl.par_dim(128), 512), nl.float32, buffer=nl.psum)
    assert blocks[3].shape == (128, 512)  # old-API blocks: one block accounted live


def test_nc_match_replace8_pairs_duplicate_vals_in_reverse_as_documented():
    """The reference's own example: data [1, 2, 3, 4, 8 x 7], vals [3, 8 x 7]."""
    data = np.array([[1, 2, 3, 4] + [8] * 7], np.float32)
    vals = np.array([[3] + [8] * 7], np.float32)
    out = nl.ndarray((1, 11), nl.float32)
    idx = nl.ndarray((1, 8), nl.uint32)
    nisa.nc_match_replace8(out, sb(data), sb(vals), imm=-1.0, dst_idx=idx)
    assert idx.array[0].tolist() == [2, 10, 9, 8, 7, 6, 5, 4]
    assert val(out)[0].tolist() == [1, 2, -1, 4] + [-1] * 7
    # nc_find_index8 pairs the same duplicates in ascending order
    fidx = nl.ndarray((1, 8), nl.uint32)
    nisa.nc_find_index8(fidx, sb(data), sb(vals))
    assert fidx.array[0].tolist() == [2, 4, 5, 6, 7, 8, 9, 10]
