"""``nki.isa`` (``nisa``) of the NumPy NKI executor, NKI 0.3 style: ``dst`` first.

Each instruction checks its operands' buffers, shapes and dtypes against
Trainium's rules before computing (fp32 math, rounding on the write).
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from kernels.nki.executor import language as nl
from kernels.nki.executor import tiles as T
from kernels.nki.executor.errors import rule
from kernels.nki.executor.tiles import Tile


class engine(enum.Enum):  # noqa: N801  (NKI spelling)
    unknown = 0
    tensor = 1
    vector = 2
    scalar = 3
    gpsimd = 4


tensor_engine, vector_engine = engine.tensor, engine.vector
scalar_engine, gpsimd_engine, unknown_engine = engine.scalar, engine.gpsimd, engine.unknown


class reduce_cmd(enum.Enum):  # noqa: N801
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3


def _elems(t: Tile) -> int:
    return int(np.prod(t.shape[1:]))


def _same_layout(call: str, a_name: str, a: Tile, b_name: str, b: Tile) -> None:
    if a.shape[0] != b.shape[0] or _elems(a) != _elems(b):
        raise rule(
            call,
            f"{a_name} {a.shape} and {b_name} {b.shape} must have the same partition dim and "
            "elements per partition",
        )


def _np_op(call: str, op: Any):
    fn = getattr(op, "_np", None)
    if fn is None:
        raise rule(call, f"unsupported op {op!r}; pass an nl function such as nl.add")
    return fn


def _scalar_or_vector(call: str, name: str, x: Any, p: int):
    """A compile-time scalar, or a [P, 1] on-chip vector broadcast along the free axis."""
    if isinstance(x, Tile):
        T.check_onchip(call, name, x)
        if x.shape != (p, 1):
            raise rule(call, f"{name} must be a scalar or a [{p}, 1] vector, got {x.shape}")
        return T.read(x).reshape(p, 1)
    if isinstance(x, (bool, int, float, np.floating, np.integer)):
        return np.float32(x)
    raise rule(call, f"{name} must be a scalar or a tile, got {type(x).__name__}")


def _flat(t: Tile) -> np.ndarray:
    return T.read(t).reshape(t.shape[0], -1)


# -- tensor engine ----------------------------------------------------------------


def nc_matmul(
    dst: Tile,
    stationary: Tile,
    moving: Tile,
    is_stationary_onezero: bool = False,
    is_moving_onezero: bool = False,
    is_transpose: bool = False,
    accumulate: bool | None = None,
    tile_position=(),
    tile_size=(),
    perf_mode=None,
    name=None,
    _call: str = "nc_matmul",
) -> None:
    """``dst[M, N] (+)= stationary[K, M].T @ moving[K, N]`` on the Tensor Engine.

    SBUF inputs, PSUM fp32 dst; K <= 128, M <= 128, N <= 512; fp32 on both
    inputs or neither. ``accumulate=True`` adds into dst (False/None overwrite).
    """
    c = _call
    for n, t in (("stationary", stationary), ("moving", moving)):
        T.check_onchip(c, n, t)
        if t.buffer != "sbuf":
            raise rule(c, f"{n} is in {t.buffer}; the Tensor Engine reads its inputs from SBUF")
        if t.ndim != 2:
            raise rule(c, f"{n} {t.shape} must be a 2-d tile")
    k, m = stationary.shape
    k2, n = moving.shape
    if k != k2:
        raise rule(c, f"contraction (partition) dims differ: stationary {k}, moving {k2}")
    if k > 128:
        raise rule(c, f"contraction dim {k} > 128 (nl.tile_size.pmax)")
    if m > 128:
        raise rule(c, f"stationary free size {m} > 128 (nl.tile_size.gemm_stationary_fmax)")
    if n > 512:
        raise rule(c, f"moving free size {n} > 512 (nl.tile_size.gemm_moving_fmax)")
    if (stationary.dtype == T.float32) != (moving.dtype == T.float32):
        raise rule(
            c,
            f"stationary {stationary.dtype} and moving {moving.dtype}: fp32 must be on both "
            "sides or neither",
        )
    T.check_onchip(c, "dst", dst)
    if dst.buffer != "psum":
        raise rule(c, f"dst is in {dst.buffer}; the Tensor Engine writes only to PSUM")
    if dst.dtype != T.float32:
        raise rule(c, f"dst dtype {dst.dtype}: matmul results accumulate in a float32 PSUM tile")
    if dst.shape != (m, n):
        raise rule(c, f"dst shape {dst.shape} != [{m}, {n}] (stationary free x moving free)")
    res = T.read(stationary).T.astype(np.float32) @ T.read(moving)
    if accumulate:
        res = T.read(dst) + res
    T.write(dst, res, c)


def nc_transpose(dst: Tile, data: Tile, engine: engine = engine.unknown, name=None) -> None:
    """``dst[F, P] = data[P, F].T`` (Tensor Engine: P, F <= 128; dst in PSUM or SBUF)."""
    T.check_onchip("nc_transpose", "data", data)
    T.check_onchip("nc_transpose", "dst", dst)
    if data.ndim != 2 or data.shape[1] > 128:
        raise rule("nc_transpose", f"data {data.shape} must be 2-d with free size <= 128")
    if dst.shape != data.shape[::-1]:
        raise rule("nc_transpose", f"dst shape {dst.shape} != {data.shape[::-1]}")
    T.write(dst, T.read(data).T, "nc_transpose")


# -- copies -------------------------------------------------------------------------


def tensor_copy(dst: Tile, src: Tile, engine: engine = engine.unknown, name=None) -> None:
    """``dst = src`` (bit exact for equal dtypes, else through fp32)."""
    T.check_onchip("tensor_copy", "src", src)
    T.check_onchip("tensor_copy", "dst", dst)
    _same_layout("tensor_copy", "dst", dst, "src", src)
    if dst.dtype == src.dtype:
        dst.array[...] = src.array.reshape(dst.shape)
    else:
        T.write(dst, T.read(src).reshape(dst.shape), "tensor_copy")


def memset(dst: Tile, value, engine: engine = engine.unknown, name=None) -> None:
    """Fill ``dst`` with the scalar ``value``."""
    T.check_onchip("memset", "dst", dst)
    T.write(dst, np.full(dst.shape, value, np.float32), "memset")


def tensor_copy_predicated(
    dst: Tile, src, predicate: Tile, reverse_pred: bool = False, name=None
) -> None:
    """``dst = src`` where ``predicate`` is nonzero (zero if ``reverse_pred``); else unchanged.

    ``predicate`` is uint8/uint16/uint32 with dst's layout; ``src`` a tile of
    dst's dtype or a scalar (``reverse_pred`` only with a scalar src).
    """
    c = "tensor_copy_predicated"
    T.check_onchip(c, "dst", dst)
    T.check_onchip(c, "predicate", predicate)
    if predicate.dtype not in (T.uint8, T.uint16, T.uint32):
        raise rule(c, f"predicate dtype {predicate.dtype}; must be uint8, uint16 or uint32")
    _same_layout(c, "dst", dst, "predicate", predicate)
    if isinstance(src, Tile):
        T.check_onchip(c, "src", src)
        _same_layout(c, "dst", dst, "src", src)
        if src.dtype != dst.dtype:
            raise rule(c, f"src dtype {src.dtype} != dst dtype {dst.dtype}")
        if src.buffer == "psum" and predicate.buffer == "psum":
            raise rule(c, "src and predicate may not both be in PSUM")
        if reverse_pred:
            raise rule(c, "reverse_pred=True needs a scalar src")
        values = src.array.reshape(dst.shape)
    else:
        values = np.full(dst.shape, src, np.float32).astype(dst.dtype)
    pred = predicate.array.reshape(dst.shape) != 0
    if reverse_pred:
        pred = ~pred
    dst.array[pred] = values[pred]


def dma_copy(
    dst: Tile, src: Tile, dst_rmw_op=None, oob_mode=None, dge_mode=None, name=None
) -> None:
    """DMA ``src`` -> ``dst`` between any memories (same number of elements)."""
    for n, t in (("dst", dst), ("src", src)):
        if not isinstance(t, Tile):
            raise rule("dma_copy", f"{n} must be a tensor, got {type(t).__name__}")
    if dst.array.size != src.array.size:
        raise rule("dma_copy", f"dst {dst.shape} and src {src.shape} differ in size")
    if dst.dtype == src.dtype:
        dst.array[...] = src.array.reshape(dst.shape)
    else:
        T.write(dst, T.read(src).reshape(dst.shape), "dma_copy")


# -- scalar / vector engine -----------------------------------------------------------

ACTIVATIONS = ("exp", "log", "copy", "reciprocal", "negative", "abs")


def activation(
    dst: Tile,
    op,
    data: Tile,
    bias=None,
    scale=1.0,
    reduce_op=None,
    reduce_res: Tile | None = None,
    reduce_cmd: reduce_cmd = reduce_cmd.idle,
    name=None,
) -> None:
    """``dst = op(data * scale + bias)`` on the Scalar Engine.

    ``bias``/``scale``: scalars or ``[P, 1]`` vectors. Optional free-axis sum of
    the result into the per-partition registers (``reduce_op=nl.add``), driven
    by ``reduce_cmd`` (reset / reduce / reset_reduce / idle); if ``reduce_res``
    (``[P, 1]``) is given the registers are read out into it.
    """
    c = "activation"
    T.check_onchip(c, "data", data)
    T.check_onchip(c, "dst", dst)
    _same_layout(c, "dst", dst, "data", data)
    if getattr(op, "__name__", None) not in ACTIVATIONS:
        raise rule(c, f"unsupported activation {op!r}; supported: {ACTIVATIONS}")
    p = data.shape[0]
    x = _flat(data) * _scalar_or_vector(c, "scale", scale, p)
    if bias is not None:
        x = x + _scalar_or_vector(c, "bias", bias, p)
    with np.errstate(all="ignore"):
        y = op._np(x).astype(np.float32)
    T.write(dst, y.reshape(dst.shape), c)
    if reduce_op is not None or reduce_res is not None or reduce_cmd != reduce_cmd.idle:
        _registers(c, p, y, reduce_op, reduce_res, reduce_cmd)


def _registers(c: str, p: int, y: np.ndarray, reduce_op, reduce_res, cmd) -> None:
    regs = T.ctx().act_regs
    if cmd in (reduce_cmd.reduce, reduce_cmd.reset_reduce) or reduce_res is not None:
        if reduce_op is not nl.add:
            raise rule(
                c, f"reduce_op must be nl.add (Scalar Engine registers sum), got {reduce_op}"
            )
    if cmd in (reduce_cmd.reset, reduce_cmd.reset_reduce):
        regs[:p] = 0.0
    if cmd in (reduce_cmd.reduce, reduce_cmd.reset_reduce):
        regs[:p] += y.sum(axis=1, dtype=np.float32)
    if reduce_res is not None:
        T.check_onchip(c, "reduce_res", reduce_res)
        if reduce_res.shape != (p, 1):
            raise rule(c, f"reduce_res must be [{p}, 1], got {reduce_res.shape}")
        T.write(reduce_res, regs[:p].reshape(p, 1), c)


def activation_reduce(
    dst: Tile, op, data: Tile, reduce_op, reduce_res: Tile, bias=None, scale=1.0, name=None
) -> None:
    """``activation`` with ``reduce_cmd=reset_reduce`` into ``reduce_res``."""
    activation(
        dst,
        op,
        data,
        bias=bias,
        scale=scale,
        reduce_op=reduce_op,
        reduce_res=reduce_res,
        reduce_cmd=reduce_cmd.reset_reduce,
    )


REDUCE_OPS = ("add", "maximum", "minimum", "multiply", "max", "min", "sum")


def tensor_reduce(
    dst: Tile, op, data: Tile, axis, negate: bool = False, keepdims: bool = False, name=None
) -> None:
    """``dst = op-reduce(data, axis)`` over the last free axes (``-`` if ``negate``)."""
    c = "tensor_reduce"
    T.check_onchip(c, "data", data)
    T.check_onchip(c, "dst", dst)
    axes = nl.check_free_axes(c, data, axis)
    if sorted(axes) != list(range(data.ndim - len(axes), data.ndim)):
        raise rule(c, f"axis {axis} must be the last contiguous free axes of {data.shape}")
    opname = getattr(op, "__name__", None)
    if opname not in REDUCE_OPS:
        raise rule(c, f"unsupported reduce op {op!r}")
    fn = {
        "add": np.sum,
        "sum": np.sum,
        "maximum": np.max,
        "max": np.max,
        "minimum": np.min,
        "min": np.min,
        "multiply": np.prod,
    }[opname]
    res = fn(T.read(data), axis=axes, keepdims=keepdims)
    if negate:
        res = -res
    if dst.shape[0] != data.shape[0] or _elems(dst) != int(np.prod(res.shape[1:])):
        raise rule(c, f"dst {dst.shape} does not hold the reduction of {data.shape} over {axes}")
    T.write(dst, res.reshape(dst.shape), c)


def tensor_scalar(
    dst: Tile,
    data: Tile,
    op0,
    operand0,
    reverse0: bool = False,
    op1=None,
    operand1=None,
    reverse1: bool = False,
    engine: engine = engine.unknown,
    name=None,
) -> None:
    """``dst = (data op0 operand0) op1 operand1``; operands scalars or ``[P, 1]`` vectors."""
    c = "tensor_scalar"
    T.check_onchip(c, "data", data)
    T.check_onchip(c, "dst", dst)
    _same_layout(c, "dst", dst, "data", data)
    p = data.shape[0]
    x = _flat(data)
    with np.errstate(all="ignore"):
        a = _scalar_or_vector(c, "operand0", operand0, p)
        f0 = _np_op(c, op0)
        x = f0(a, x) if reverse0 else f0(x, a)
        if op1 is not None:
            b = _scalar_or_vector(c, "operand1", operand1, p)
            f1 = _np_op(c, op1)
            x = f1(b, x) if reverse1 else f1(x, b)
        elif operand1 is not None:
            raise rule(c, "operand1 given without op1")
    T.write(dst, np.asarray(x, np.float32).reshape(dst.shape), c)


def tensor_tensor(
    dst: Tile, data1: Tile, data2: Tile, op, engine: engine = engine.unknown, name=None
) -> None:
    """``dst = data1 op data2`` elementwise; all three with the same layout, no broadcast."""
    c = "tensor_tensor"
    for n, t in (("data1", data1), ("data2", data2), ("dst", dst)):
        T.check_onchip(c, n, t)
    _same_layout(c, "data1", data1, "data2", data2)
    _same_layout(c, "dst", dst, "data1", data1)
    if data1.buffer == "psum" and data2.buffer == "psum":
        raise rule(c, "data1 and data2 may not both be in PSUM")
    with np.errstate(all="ignore"):
        res = _np_op(c, op)(_flat(data1), _flat(data2))
    T.write(dst, np.asarray(res, np.float32).reshape(dst.shape), c)


# -- gpsimd: iota / affine_select ------------------------------------------------------


def _affine(call: str, shape: tuple[int, ...], pattern, offset: int, channel_multiplier: int):
    pat = [list(map(int, pq)) for pq in pattern]
    if len(pat) > 4:
        raise rule(call, f"pattern has {len(pat)} dims; at most 4")
    steps = [s for s, _ in pat]
    nums = [n for _, n in pat]
    per_partition = int(np.prod(shape[1:]))
    if int(np.prod(nums)) != per_partition:
        raise rule(
            call,
            f"pattern {pattern} generates {int(np.prod(nums))} values per partition, "
            f"dst holds {per_partition}",
        )
    val = np.full(nums, 0, np.int64)
    for axis, (s, n) in enumerate(zip(steps, nums, strict=True)):
        sh = [1] * len(nums)
        sh[axis] = n
        val = val + (np.arange(n, dtype=np.int64) * s).reshape(sh)
    chan = np.arange(shape[0], dtype=np.int64).reshape(-1, 1) * int(channel_multiplier)
    return int(offset) + chan + val.reshape(1, -1)


def iota(dst: Tile, pattern, offset: int, channel_multiplier: int = 0, name=None) -> None:
    """``dst[p, i] = offset + p * channel_multiplier + sum_k idx_k * step_k`` (int32 math);
    ``pattern = [[step, num], ...]`` innermost last. dst in SBUF."""
    T.check_onchip("iota", "dst", dst)
    if dst.buffer != "sbuf":
        raise rule("iota", f"dst is in {dst.buffer}; iota writes SBUF")
    vals = _affine("iota", dst.shape, pattern, offset, channel_multiplier)
    if T.is_float(dst.dtype):
        T.write(dst, vals.astype(np.float32).reshape(dst.shape), "iota")
    else:
        dst.array[...] = vals.astype(np.int32).astype(dst.dtype).reshape(dst.shape)


def affine_select(
    dst: Tile,
    pattern,
    offset: int,
    channel_multiplier: int,
    on_true_tile: Tile,
    on_false_value: float,
    cmp_op=nl.equal,
    name=None,
) -> None:
    """``dst = on_true_tile`` where ``cmp_op(affine, 0)`` else ``on_false_value``; the
    affine value is the one ``iota`` would generate."""
    c = "affine_select"
    T.check_onchip(c, "dst", dst)
    T.check_onchip(c, "on_true_tile", on_true_tile)
    _same_layout(c, "dst", dst, "on_true_tile", on_true_tile)
    aff = _affine(c, dst.shape, pattern, offset, channel_multiplier)
    pred = _np_op(c, cmp_op)(aff.astype(np.float64), 0.0) != 0
    res = np.where(pred, _flat(on_true_tile), np.float32(on_false_value))
    T.write(dst, res.reshape(dst.shape), c)


# -- top-8 --------------------------------------------------------------------------


def _check8(call: str, name: str, t: Tile) -> int:
    n = _elems(t)
    if not 8 <= n <= 16384:
        raise rule(call, f"{name} {t.shape} has {n} elements per partition; needs 8..16384")
    return n


def max8(dst: Tile, src: Tile, name=None) -> None:
    """``dst[P, 8]``: the 8 largest values of each partition of ``src``, descending."""
    T.check_onchip("max8", "src", src)
    T.check_onchip("max8", "dst", dst)
    _check8("max8", "src", src)
    if dst.shape != (src.shape[0], 8):
        raise rule("max8", f"dst must be [{src.shape[0]}, 8], got {dst.shape}")
    x = _flat(src)
    part = -np.partition(-x, 7, axis=1)[:, :8] if x.shape[1] > 8 else x
    top = -np.sort(-part, axis=1)
    T.write(dst, top, "max8")


def nc_find_index8(dst: Tile, data: Tile, vals: Tile, name=None) -> None:
    """``dst[P, 8]`` (uint16/uint32): index of the first occurrence of each of the 8
    ``vals`` in each partition of ``data`` (repeated vals take successive
    occurrences); all-ones when a value is absent."""
    c = "nc_find_index8"
    for n, t in (("data", data), ("vals", vals), ("dst", dst)):
        T.check_onchip(c, n, t)
    _check8(c, "data", data)
    if _elems(vals) != 8 or vals.shape[0] != data.shape[0]:
        raise rule(c, f"vals must hold 8 values per partition of data, got {vals.shape}")
    if dst.shape != (data.shape[0], 8) or dst.dtype not in (T.uint16, T.uint32):
        raise rule(
            c, f"dst must be [{data.shape[0]}, 8] uint16/uint32, got {dst.shape} {dst.dtype}"
        )
    x, v = _flat(data), _flat(vals)
    out = np.full(v.shape, np.iinfo(dst.dtype).max, dtype=np.int64)
    for p in range(x.shape[0]):
        used: dict[float, int] = {}
        for j in range(8):
            hits = np.flatnonzero(x[p] == v[p, j])
            k = used.get(float(v[p, j]), 0)
            if k < hits.size:
                out[p, j] = hits[k]
                used[float(v[p, j])] = k + 1
    dst.array[...] = out.astype(dst.dtype)
