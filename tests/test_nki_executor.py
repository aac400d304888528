"""The NumPy NKI executor: every op against NumPy, every Trainium rule it enforces,
and two real kernels (tiled matmul, row softmax) against torch.

These tests exercise ``kernels.nki.executor`` directly (they do not need and do
not use the Neuron SDK); the example kernels go through ``kernels.nki.runtime``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from kernels.nki import examples
from kernels.nki.executor import NkiRuleError, nisa, nki, nl
from kernels.nki.executor import tiles as T

RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def fresh_launch():
    """Each test gets its own on-chip memory accounting (as one kernel launch)."""
    T._CTX.append(T.LaunchContext())
    yield
    T._CTX.pop()


def hbm(a: np.ndarray):
    return T.Tile.wrap(np.ascontiguousarray(a), T.hbm)


def sb(a: np.ndarray, dtype=None):
    """An SBUF tile holding ``a`` (loaded from HBM, optionally cast)."""
    return nl.load(hbm(a), dtype=dtype)


def val(t) -> np.ndarray:
    return t.array.astype(np.float32)


def rand(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# -- tiles, buffers, data movement ------------------------------------------------------


def test_new_tiles_are_nan_or_dtype_max_and_zeros_full_fill():
    assert np.isnan(val(nl.ndarray((4, 8), nl.float32))).all()
    assert np.isnan(val(nl.ndarray((4, 8), nl.bfloat16, buffer=nl.psum))).all()
    assert (nl.ndarray((4, 8), nl.int32).array == np.iinfo(np.int32).max).all()
    assert (val(nl.zeros((4, 8), nl.float32)) == 0).all()
    assert (val(nl.full((4, 8), 2.5, nl.bfloat16)) == 2.5).all()


def test_load_store_slices_ds_reshape_roundtrip():
    a = rand(6, 10)
    out = hbm(np.zeros((6, 10), np.float32))
    t = nl.load(hbm(a)[1:5, nl.ds(2, 6)])
    np.testing.assert_array_equal(val(t), a[1:5, 2:8])
    nl.store(out[1:5, 2:8], t)
    np.testing.assert_array_equal(out.array[1:5, 2:8], a[1:5, 2:8])
    assert (out.array[0] == 0).all()
    r = hbm(a).reshape((3, 20))
    np.testing.assert_array_equal(val(nl.load(r)), a.reshape(3, 20))
    t3 = nl.load(hbm(a.reshape(6, 2, 5)))
    np.testing.assert_array_equal(val(t3.reshape((6, 10))), a)
    np.testing.assert_array_equal(val(t3[:, 1, :]), a.reshape(6, 2, 5)[:, 1, :])


def test_dma_copy_both_directions_and_casting_load():
    a = rand(8, 16)
    t = nl.ndarray((8, 16), nl.float32)
    nisa.dma_copy(t, hbm(a))
    out = hbm(np.zeros((8, 16), np.float32))
    nisa.dma_copy(out, t)
    np.testing.assert_array_equal(out.array, a)
    b = nl.load(hbm(a), dtype=nl.bfloat16)
    np.testing.assert_array_equal(b.array, a.astype(ml_dtypes.bfloat16))


def test_bf16_rounds_on_every_write_and_computes_in_fp32():
    a = np.array([[1.0, 1.0 + 2**-9, 3.0, 1000.0]], np.float32)
    x = sb(a, nl.bfloat16)
    np.testing.assert_array_equal(val(x), a.astype(ml_dtypes.bfloat16).astype(np.float32))
    y = nl.add(x, 2**-9, dtype=nl.bfloat16)  # 1 + 2^-9 rounds back to 1 in bf16
    expect = (val(x) + np.float32(2**-9)).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(val(y), expect)
    z = nl.add(x, 2**-9, dtype=nl.float32)
    np.testing.assert_array_equal(val(z), val(x) + np.float32(2**-9))


def test_copy_casts_and_tensor_copy_is_exact():
    a = rand(4, 8)
    c = nl.copy(sb(a), dtype=nl.float16)
    np.testing.assert_array_equal(c.array, a.astype(np.float16))
    d = nl.ndarray((4, 8), nl.float32)
    nisa.tensor_copy(d, sb(a))
    np.testing.assert_array_equal(val(d), a)
    m = nl.ndarray((4, 8), nl.float32)
    nisa.memset(m, -3.0)
    assert (val(m) == -3.0).all()


# -- elementwise, reductions -------------------------------------------------------------

BINARY = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "divide": np.divide,
    "equal": lambda a, b: (a == b).astype(np.float32),
    "greater_equal": lambda a, b: (a >= b).astype(np.float32),
    "abs_max": lambda a, b: np.where(np.abs(a) > np.abs(b), a, b),
    "abs_min": lambda a, b: np.where(np.abs(a) < np.abs(b), a, b),
    "logical_and": lambda a, b: ((a != 0) & (b != 0)).astype(np.float32),
    "logical_xor": lambda a, b: ((a != 0) ^ (b != 0)).astype(np.float32),
    "fmod": np.fmod,
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_ops_match_numpy_with_scalar_and_column_broadcast(name):
    a, b = rand(16, 32), rand(16, 32)
    b[::3] = a[::3]  # some equal entries for equal / greater_equal
    col = rand(16, 1)
    fn, ref = getattr(nl, name), BINARY[name]
    np.testing.assert_allclose(val(fn(sb(a), sb(b))), ref(a, b), rtol=1e-6)
    np.testing.assert_allclose(val(fn(sb(a), sb(col))), ref(a, col), rtol=1e-6)
    np.testing.assert_allclose(val(fn(sb(a), 0.5)), ref(a, np.float32(0.5)), rtol=1e-6)


@pytest.mark.parametrize(
    "name,ref",
    [
        ("exp", np.exp),
        ("log", np.log),
        ("reciprocal", np.reciprocal),
        ("sqrt", np.sqrt),
        ("tanh", np.tanh),
        ("sin", np.sin),
        ("cos", np.cos),
        ("arctan", np.arctan),
        ("softplus", lambda a: np.log1p(np.exp(a))),
        ("sigmoid", lambda a: 1 / (1 + np.exp(-a))),
        ("ceil", np.ceil),
        ("floor", np.floor),
        ("sign", np.sign),
    ],
)
def test_unary_ops_match_numpy(name, ref):
    a = np.abs(rand(8, 64)) + 0.1
    a[:, ::2] *= -1 if name not in ("log", "sqrt") else 1
    np.testing.assert_allclose(val(getattr(nl, name)(sb(a))), ref(a), rtol=1e-5, atol=1e-6)


def test_relu_gelu_power_and_bitvec_ops():
    a = rand(8, 32)
    np.testing.assert_array_equal(val(nl.relu(sb(a))), np.maximum(a, 0))
    erf = np.vectorize(__import__("math").erf)
    np.testing.assert_allclose(
        val(nl.gelu(sb(a))), 0.5 * a * (1 + erf(a / np.sqrt(2))), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(val(nl.power(sb(np.abs(a)), 1.5)), np.abs(a) ** 1.5, rtol=1e-5)
    x = RNG.integers(0, 1 << 20, (4, 16)).astype(np.int32)
    y = RNG.integers(0, 1 << 20, (4, 16)).astype(np.int32)
    assert np.array_equal(nl.bitwise_and(sb(x), sb(y)).array, x & y)
    assert np.array_equal(nl.bitwise_xor(sb(x), sb(y)).array, x ^ y)
    assert np.array_equal(nl.left_shift(sb(x), 3).array, x << 3)
    assert np.array_equal(nl.right_shift(sb(x), 2).array, x >> 2)
    assert np.array_equal(nl.invert(sb(x)).array, ~x)
    with pytest.raises(NkiRuleError, match="needs an integer dtype"):
        nl.bitwise_or(sb(a), sb(a))
    t = nl.ndarray((4, 16), nl.int32)
    nisa.tensor_tensor(t, sb(x), sb(y), nl.bitwise_or)  # bit patterns, not fp32 math
    assert np.array_equal(t.array, x | y)


def test_allocation_helpers_loops_and_transposing_load():
    assert (val(nl.ones((4, 8), nl.bfloat16)) == 1).all()
    z = nl.zeros_like(nl.ndarray((4, 8), nl.float16))
    assert z.dtype == nl.float16 and (val(z) == 0).all()
    assert np.array_equal(val(nl.shared_identity_matrix(16, dtype=nl.float32)), np.eye(16))
    seen = []
    nl.fori_loop(2, 11, seen.append, step=3)
    assert seen == [2, 5, 8]
    a = rand(64, 16)
    np.testing.assert_array_equal(val(nl.load_transpose2d(hbm(a))), a.T)
    np.testing.assert_allclose(val(nl.mean(sb(a), axis=1)), a.mean(1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(val(nl.var(sb(a), axis=1)), a.var(1, keepdims=True), rtol=1e-4)
    out = hbm(np.ones((64, 16), np.float32))
    nisa.dma_copy(out, sb(a), dst_rmw_op=nl.add)  # DMA read-modify-write
    np.testing.assert_allclose(out.array, a + 1, rtol=1e-6)


def test_tensor_engine_tiling_transpose_mode_and_vector_transpose():
    a, b = rand(32, 16), rand(32, 64)
    acc = nl.ndarray((16, 64), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(acc, sb(a), sb(b), tile_position=(32, 0), tile_size=(32, 32))
    np.testing.assert_allclose(val(acc), a.T @ b, rtol=1e-5, atol=1e-5)
    with pytest.raises(NkiRuleError, match="contraction dim 64 > 32"):
        nisa.nc_matmul(
            acc, sb(rand(64, 16)), sb(rand(64, 64)), tile_position=(0, 0), tile_size=(32, 32)
        )
    with pytest.raises(NkiRuleError, match="does not fit tile_size"):
        nisa.nc_matmul(acc, sb(a), sb(b), tile_position=(16, 0), tile_size=(32, 32))
    x = rand(16, 16).astype(ml_dtypes.bfloat16)
    x[0, 0] = np.nan  # transpose mode is bit accurate, NaN included
    t = nl.ndarray((16, 16), nl.bfloat16, buffer=nl.psum)
    nisa.nc_matmul(t, sb(x), sb(np.eye(16, dtype=np.float32), nl.bfloat16), is_transpose=True)
    np.testing.assert_array_equal(t.array.view(np.uint16), x.T.view(np.uint16))
    v = nl.ndarray((16, 8), nl.float32)
    nisa.nc_transpose(v, sb(rand(8, 16)), engine=nisa.engine.vector)
    with pytest.raises(NkiRuleError, match="<= 32"):
        nisa.nc_transpose(
            nl.ndarray((64, 8), nl.float32), sb(rand(8, 64)), engine=nisa.engine.vector
        )
    with pytest.raises(NkiRuleError, match="cannot access PSUM"):
        nisa.tensor_copy(nl.ndarray((4, 4), nl.float32), acc[0:4, 0:4], engine=nisa.engine.gpsimd)


def test_where_selects_by_nonzero_condition():
    a, b = rand(8, 16), rand(8, 16)
    cond = (rand(8, 16) > 0).astype(np.float32)
    np.testing.assert_array_equal(val(nl.where(sb(cond), sb(a), sb(b))), np.where(cond, a, b))
    np.testing.assert_array_equal(val(nl.where(sb(cond), sb(a), -1.0)), np.where(cond, a, -1))


@pytest.mark.parametrize("name,ref", [("max", np.max), ("min", np.min), ("sum", np.sum)])
def test_nl_reductions_over_free_axes(name, ref):
    a = rand(8, 4, 16)
    fn = getattr(nl, name)
    np.testing.assert_allclose(val(fn(sb(a), axis=2)), ref(a, axis=2), rtol=1e-5)
    r = fn(sb(a), axis=(1, 2), keepdims=True)
    assert r.shape == (8, 1, 1)
    np.testing.assert_allclose(val(r), ref(a, axis=(1, 2), keepdims=True), rtol=1e-5)


def test_tensor_reduce_ops_negate_keepdims():
    a = rand(8, 3, 10)
    for op, ref in ((nl.add, np.sum), (nl.maximum, np.max), (nl.minimum, np.min)):
        d = nl.ndarray((8, 3), nl.float32)
        nisa.tensor_reduce(d, op, sb(a), axis=2)
        np.testing.assert_allclose(val(d), ref(a, axis=2), rtol=1e-5)
    d = nl.ndarray((8, 1), nl.float32)
    nisa.tensor_reduce(d, nl.maximum, sb(a), axis=(1, 2), negate=True, keepdims=True)
    np.testing.assert_allclose(val(d), -a.max(axis=(1, 2)).reshape(8, 1))


def test_tensor_scalar_two_ops_vectors_and_reverse():
    a, v = rand(8, 16), rand(8, 1)
    d = nl.ndarray((8, 16), nl.float32)
    nisa.tensor_scalar(d, sb(a), nl.subtract, sb(v), op1=nl.multiply, operand1=3.0)
    np.testing.assert_allclose(val(d), (a - v) * 3.0, rtol=1e-6)
    nisa.tensor_scalar(d, sb(a), nl.subtract, 1.0, reverse0=True)
    np.testing.assert_allclose(val(d), 1.0 - a, rtol=1e-6)
    nisa.tensor_scalar(d, sb(a), nl.divide, sb(v), reverse0=True)
    np.testing.assert_allclose(val(d), v / a, rtol=1e-6)


def test_tensor_tensor_ops():
    a, b = rand(8, 16), rand(8, 16)
    for op, ref in ((nl.add, np.add), (nl.multiply, np.multiply), (nl.maximum, np.maximum)):
        d = nl.ndarray((8, 16), nl.float32)
        nisa.tensor_tensor(d, sb(a), sb(b), op)
        np.testing.assert_allclose(val(d), ref(a, b), rtol=1e-6)


def test_activation_bias_scale_and_reduce_registers():
    a, bias, scale = rand(8, 32), rand(8, 1), rand(8, 1)
    d = nl.ndarray((8, 32), nl.float32)
    s = nl.ndarray((8, 1), nl.float32)
    nisa.activation(
        d,
        nl.exp,
        sb(a),
        bias=sb(bias),
        scale=sb(scale),
        reduce_op=nl.add,
        reduce_res=s,
        reduce_cmd=nisa.reduce_cmd.reset_reduce,
    )
    ref = np.exp(a * scale + bias)
    np.testing.assert_allclose(val(d), ref, rtol=1e-5)
    np.testing.assert_allclose(val(s), ref.sum(1, keepdims=True), rtol=1e-5)
    # reduce accumulates on top of the registers; idle + reduce_res reads them out
    nisa.activation(
        d, nl.copy, sb(a), scale=2.0, reduce_op=nl.add, reduce_cmd=nisa.reduce_cmd.reduce
    )
    nisa.activation(d, nl.copy, sb(a), reduce_op=nl.add, reduce_res=s)
    np.testing.assert_allclose(val(s), (ref.sum(1) + 2 * a.sum(1)).reshape(8, 1), rtol=1e-5)
    nisa.activation(d, nl.log, sb(np.abs(a) + 1), bias=0.5)
    np.testing.assert_allclose(val(d), np.log(np.abs(a) + 1 + 0.5), rtol=1e-6)
    nisa.activation_reduce(d, nl.exp, sb(a), reduce_op=nl.add, reduce_res=s)
    np.testing.assert_allclose(val(s), np.exp(a).sum(1, keepdims=True), rtol=1e-5)


def test_tensor_copy_predicated_tile_and_reversed_scalar():
    dst0, src = rand(8, 16), rand(8, 16)
    pred = (rand(8, 16) > 0).astype(np.uint8)
    d = sb(dst0)
    nisa.tensor_copy_predicated(d, sb(src), sb(pred))
    np.testing.assert_array_equal(val(d), np.where(pred, src, dst0))
    nisa.tensor_copy_predicated(d, -np.inf, sb(pred), reverse_pred=True)
    np.testing.assert_array_equal(val(d), np.where(pred, src, -np.inf))


# -- tensor engine ---------------------------------------------------------------------


def test_nc_matmul_overwrite_and_accumulate():
    s1, m1, s2, m2 = rand(64, 32), rand(64, 100), rand(64, 32), rand(64, 100)
    acc = nl.ndarray((32, 100), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(acc, sb(s1), sb(m1))
    np.testing.assert_allclose(val(acc), s1.T @ m1, rtol=1e-5, atol=1e-5)
    nisa.nc_matmul(acc, sb(s2), sb(m2), accumulate=True)
    np.testing.assert_allclose(val(acc), s1.T @ m1 + s2.T @ m2, rtol=1e-5, atol=1e-5)


def test_bf16_matmul_accumulates_in_fp32():
    s, m = rand(128, 16), rand(128, 64)
    sb16, mb16 = sb(s, nl.bfloat16), sb(m, nl.bfloat16)
    acc = nl.ndarray((16, 64), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(acc, sb16, mb16)
    exact = val(sb16).astype(np.float64).T @ val(mb16).astype(np.float64)
    np.testing.assert_allclose(val(acc), exact, rtol=1e-5, atol=1e-4)


def test_nl_matmul_both_layouts_and_transposes():
    x, y = rand(32, 64), rand(64, 80)
    r = nl.matmul(sb(x), sb(y))
    assert r.buffer == "psum" and r.dtype == nl.float32
    np.testing.assert_allclose(val(r), x @ y, rtol=1e-5, atol=1e-5)
    r2 = nl.matmul(sb(x.T.copy()), sb(y), transpose_x=True)
    np.testing.assert_allclose(val(r2), x @ y, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(val(nl.transpose(sb(x))), x.T)
    d = nl.ndarray((64, 32), nl.float32, buffer=nl.psum)
    nisa.nc_transpose(d, sb(x))
    np.testing.assert_array_equal(val(d), x.T)


# -- gpsimd / top-8 -------------------------------------------------------------------


def test_iota_and_affine_select_follow_the_pattern():
    d = nl.ndarray((4, 6), nl.int32)
    nisa.iota(d, [[2, 2], [1, 3]], offset=5, channel_multiplier=10)
    p, w, x = np.arange(4)[:, None, None], np.arange(2)[None, :, None], np.arange(3)[None, None]
    np.testing.assert_array_equal(d.array, (5 + 10 * p + 2 * w + x).reshape(4, 6))
    a = rand(8, 8)
    s = nl.ndarray((8, 8), nl.float32)
    # causal mask: keep j <= i  <=>  i - j >= 0
    nisa.affine_select(s, [[-1, 8]], 1, sb(a), -1e9, cmp_op=nl.greater_equal)
    np.testing.assert_array_equal(val(s), np.where(np.tril(np.ones((8, 8))) > 0, a, -1e9))


def test_max8_and_nc_find_index8():
    a = rand(6, 40)
    a[0, [3, 7]] = 9.0  # a duplicated maximum: two successive occurrences
    top = nl.ndarray((6, 8), nl.float32)
    nisa.max8(top, sb(a))
    np.testing.assert_array_equal(val(top), -np.sort(-a, axis=1)[:, :8])
    idx = nl.ndarray((6, 8), nl.uint32)
    nisa.nc_find_index8(idx, sb(a), top)
    np.testing.assert_array_equal(np.take_along_axis(a, idx.array.astype(np.int64), 1), val(top))
    assert list(idx.array[0, :2]) == [3, 7]
    missing = nl.full((6, 8), 123.0, nl.float32)
    nisa.nc_find_index8(idx, sb(a), missing)
    assert (idx.array == np.iinfo(np.uint32).max).all()


# -- jit, grid, ranges -------------------------------------------------------------------


@nki.jit
def _grid_kernel(x):
    out = nl.ndarray((nl.num_programs(0) * 2, x.shape[1]), dtype=x.dtype, buffer=nl.shared_hbm)
    i = nl.program_id(0)
    t = nl.load(x[i * 2 : i * 2 + 2, :])
    nl.store(out[i * 2 : i * 2 + 2, :], nl.multiply(t, float(i + 1)))
    return out


def test_grid_launch_shares_outputs_and_returns_torch():
    x = torch.randn(8, 5)
    out = _grid_kernel[4](x)
    assert isinstance(out, torch.Tensor) and out.shape == (8, 5)
    scale = torch.arange(1, 5).repeat_interleave(2)[:, None].float()
    torch.testing.assert_close(out, x * scale)
    xb = torch.randn(2, 5).bfloat16()
    assert _grid_kernel(xb).dtype == torch.bfloat16


def test_ranges_and_device_print(capsys):
    assert list(nl.affine_range(3)) == [0, 1, 2]
    assert list(nl.sequential_range(1, 4)) == [1, 2, 3]
    assert list(nl.static_range(2)) == [0, 1]
    nl.device_print("tile:", sb(np.ones((2, 2), np.float32)))
    assert "tile:" in capsys.readouterr().out
    assert nl.tile_size.pmax == 128 and nl.tile_size.psum_fmax == 512
    assert nl.tile_size.gemm_stationary_fmax == 128 and nl.tile_size.gemm_moving_fmax == 512


# -- the rules: each violated once, each error checked ---------------------------------


def _psum_overflow():
    keep = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(8)]
    nl.ndarray((128, 1), nl.float32, buffer=nl.psum)
    return keep


def _sbuf_overflow():
    keep = [nl.ndarray((128, 16 * 1024), nl.float32) for _ in range(4)]
    return keep


@nki.jit
def _float64_kernel(x):
    return x


RULES = [
    ("sbuf 1-d", lambda: nl.ndarray((128,), nl.float32), ">= 2 dims"),
    ("sbuf 129 partitions", lambda: nl.ndarray((129, 4), nl.float32), "partition dim 129 > 128"),
    (
        "psum 129 partitions",
        lambda: nl.ndarray((129, 4), nl.float32, buffer=nl.psum),
        "partition dim 129 > 128",
    ),
    ("load > 128 partitions", lambda: nl.load(hbm(rand(200, 4))), "partition dim 200 > 128"),
    ("compute on HBM", lambda: nl.exp(hbm(rand(4, 4))), "x is in hbm"),
    (
        "isa on HBM",
        lambda: nisa.tensor_copy(nl.ndarray((4, 4), nl.float32), hbm(rand(4, 4))),
        "src is in hbm",
    ),
    (
        "matmul input in PSUM",
        lambda: nisa.nc_matmul(
            nl.ndarray((4, 4), nl.float32, buffer=nl.psum),
            nl.zeros((4, 4), nl.float32, buffer=nl.psum),
            sb(rand(4, 4)),
        ),
        "stationary is in psum; the Tensor Engine reads its inputs from SBUF",
    ),
    (
        "matmul dst in SBUF",
        lambda: nisa.nc_matmul(nl.ndarray((4, 4), nl.float32), sb(rand(4, 4)), sb(rand(4, 4))),
        "writes only to PSUM",
    ),
    (
        "matmul dst bf16",
        lambda: nisa.nc_matmul(
            nl.ndarray((4, 4), nl.bfloat16, buffer=nl.psum), sb(rand(4, 4)), sb(rand(4, 4))
        ),
        "float32 PSUM tile",
    ),
    (
        "contraction > 128",
        lambda: nl.matmul(sb(rand(4, 129)), sb(rand(8, 4))),
        "contraction dim 129 > 128",
    ),
    (
        "stationary free > 128",
        lambda: nisa.nc_matmul(
            nl.ndarray((128, 4), nl.float32, buffer=nl.psum), sb(rand(8, 129)), sb(rand(8, 4))
        ),
        "stationary free size 129 > 128",
    ),
    (
        "moving free > 512",
        lambda: nisa.nc_matmul(
            nl.ndarray((4, 513), nl.bfloat16, buffer=nl.psum), sb(rand(8, 4)), sb(rand(8, 513))
        ),
        "moving free size 513 > 512",
    ),
    (
        "fp32 on one side only",
        lambda: nl.matmul(sb(rand(8, 4)), sb(rand(4, 8), nl.bfloat16)),
        "fp32 must be on both sides or neither",
    ),
    (
        "psum tile > 2 KiB",
        lambda: nl.ndarray((128, 513), nl.float32, buffer=nl.psum),
        "2052 B per partition > 2048 B",
    ),
    ("psum total > 16 KiB", _psum_overflow, "exceeds the 16 KiB per partition of psum"),
    ("sbuf total > 224 KiB (Trn2)", _sbuf_overflow, "exceeds the 224 KiB per partition of sbuf"),
    ("reduce partition axis", lambda: nl.sum(sb(rand(8, 8)), axis=0), "partition axis 0"),
    (
        "tensor_reduce partition axis",
        lambda: nisa.tensor_reduce(nl.ndarray((1, 8), nl.float32), nl.add, sb(rand(8, 8)), 0),
        "partition axis 0",
    ),
    (
        "broadcast along partitions",
        lambda: nl.add(sb(rand(8, 16)), sb(rand(1, 16))),
        "never broadcast along the partition axis",
    ),
    (
        "broadcast a [P, 2]",
        lambda: nl.add(sb(rand(8, 16)), sb(rand(8, 2))),
        "only a [P, 1] operand broadcasts",
    ),
    ("bool(tile)", lambda: bool(sb(rand(2, 2))), "bool() of"),
    ("int(tile)", lambda: int(sb(rand(2, 2))), "int() of"),
    ("float(tile)", lambda: float(sb(rand(2, 2))), "float() of"),
    ("tile as index", lambda: [1, 2, 3][sb(rand(2, 2))], "index() of"),
    ("if tile:", lambda: 1 if nl.greater(sb(rand(2, 2)), 0.0) else 0, "data-dependent"),
    ("float64 input", lambda: _float64_kernel(torch.zeros(2, 2, dtype=torch.float64)), "float64"),
    ("float64 ndarray", lambda: nl.ndarray((2, 2), np.float64), "float64 is not supported"),
    ("slice out of bounds", lambda: hbm(rand(4, 4))[0:5, :], "outside [0, 4)"),
    (
        "store into SBUF",
        lambda: nl.store(nl.ndarray((2, 2), nl.float32), sb(rand(2, 2))),
        "dst is in sbuf",
    ),
    (
        "max8 < 8 elements",
        lambda: nisa.max8(nl.ndarray((2, 8), nl.float32), sb(rand(2, 4))),
        "needs 8..16384",
    ),
    (
        "float predicate",
        lambda: nisa.tensor_copy_predicated(sb(rand(2, 2)), sb(rand(2, 2)), sb(rand(2, 2))),
        "must be uint8, uint16 or uint32",
    ),
    (
        "activation reduce_op max",
        lambda: nisa.activation(
            nl.ndarray((2, 8), nl.float32),
            nl.exp,
            sb(rand(2, 8)),
            reduce_op=nl.maximum,
            reduce_res=nl.ndarray((2, 1), nl.float32),
        ),
        "reduce_op must be nl.add",
    ),
]


@pytest.mark.parametrize("fn,message", [(f, m) for _, f, m in RULES], ids=[r[0] for r in RULES])
def test_rule_violation_raises_naming_the_limit(fn, message):
    with pytest.raises(NkiRuleError) as err:
        fn()
    assert message in str(err.value)


def test_at_least_fifteen_distinct_rules_are_checked():
    assert len({m for _, _, m in RULES}) >= 15


def test_psum_and_sbuf_are_freed_when_tiles_die():
    for _ in range(20):  # 20 x 2 KiB > 16 KiB: only works if dead tiles are released
        t = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
    del t
    assert T.ctx().used["psum"] == 0


# -- real kernels ------------------------------------------------------------------------


@pytest.mark.parametrize("m,k,n", [(256, 384, 1024), (128, 128, 200)])
def test_tiled_matmul_kernel_matches_torch(m, k, n):
    g = torch.Generator().manual_seed(m + k + n)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    # fp32 with fp32 accumulation over K <= 384: ~1e-5 relative error
    torch.testing.assert_close(examples.matmul(a, b), a @ b, rtol=1e-5, atol=1e-4)
    ab, bb = a.bfloat16(), b.bfloat16()
    ref = (ab.float() @ bb.float()).bfloat16()
    # bf16 output: one bf16 rounding (2^-8 relative) of an fp32-exact-ish sum
    torch.testing.assert_close(examples.matmul(ab, bb), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows,cols", [(200, 1000), (7, 16)])
def test_softmax_kernel_matches_torch(rows, cols):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols, generator=g) * 4
    torch.testing.assert_close(examples.softmax(x), torch.softmax(x, -1), rtol=1e-5, atol=1e-6)
    xb = x.bfloat16()
    ref = torch.softmax(xb.float(), -1).bfloat16()
    torch.testing.assert_close(examples.softmax(xb), ref, rtol=1e-2, atol=1e-3)


# -- the cost counters ------------------------------------------------------------------


def test_profile_counts_the_tiled_matmul_by_hand():
    """matmul_kernel on [256, 256] @ [256, 1024] fp32: 2x2 output tiles of 128x512, two
    K tiles each. Counts and bytes below are worked out from the kernel's loops."""
    from kernels.nki.executor import profile as prof

    a, b = torch.randn(256, 256), torch.randn(256, 1024)
    with prof.profile() as p:
        c = examples.matmul(a, b)
    torch.testing.assert_close(c, a @ b, rtol=1e-4, atol=1e-3)
    assert p.instructions == {"tensor": 8, "vector": 4, "scalar": 0, "gpsimd": 0, "dma": 20}
    assert p.hbm_to_sbuf == 8 * (128 * 128 + 128 * 512) * 4
    assert p.sbuf_to_hbm == 256 * 1024 * 4
    assert p.matmul_flops == 2 * 256 * 256 * 1024
    assert p.cycles["tensor"] == 8 * (512 * 4 + 60)  # fp32 inputs: 4x the bf16 rate
    assert p.cycles["vector"] == 4 * (512 / 2 + 60)  # PSUM -> SBUF copies, fp32: 2 lanes
    est = p.estimate()
    assert est["dma"] == (p.hbm_to_sbuf + p.sbuf_to_hbm) / 368e9
    assert est["tensor"] == p.cycles["tensor"] / 2.4e9
    assert est["roofline_s"] == max(est[e] for e in prof.ENGINES)
    assert not prof.active()
