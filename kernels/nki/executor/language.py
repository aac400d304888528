"""``nki.language`` (``nl``) of the NumPy NKI executor: allocation, DMA, ranges,
grid queries and value-returning tile math.

Value-returning ops allocate their result in SBUF (``nl.matmul`` in PSUM, fp32).
Elementwise math reads operands as fp32 and rounds on the write. A Python
scalar broadcasts everywhere; of the tiles, only a ``[P, 1]`` operand
broadcasts, and only along the free axis.
"""

from __future__ import annotations

import builtins
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np

from kernels.nki.executor import tiles as T
from kernels.nki.executor.errors import rule
from kernels.nki.executor.tiles import (  # noqa: F401  (re-exported as nl.*)
    DynSlice,
    Tile,
    bfloat16,
    bool_,
    float16,
    float32,
    hbm,
    int8,
    int16,
    int32,
    private_hbm,
    psum,
    sbuf,
    shared_hbm,
    uint8,
    uint16,
    uint32,
)

tile_size = SimpleNamespace(
    pmax=128,
    psum_fmax=512,
    gemm_stationary_fmax=128,
    gemm_moving_fmax=512,
    psum_partition_bytes=T.PSUM_PARTITION_BYTES,
    sbuf_partition_bytes=T.SBUF_PARTITION_BYTES,
)

# -- allocation -----------------------------------------------------------------


def ndarray(shape, dtype, buffer=sbuf, name: str = "") -> Tile:
    """A new tensor; on-chip and HBM memory starts as NaN (floats) / dtype max (ints).

    ``buffer=nl.shared_hbm`` outputs are shared by all programs of a grid launch
    (the i-th such allocation of every program is the same tensor).
    """
    buffer = sbuf if buffer is None else buffer
    if buffer == "shared_hbm":
        c = T.ctx()
        shape_t = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if c.shared_pos < len(c.shared):
            t = c.shared[c.shared_pos]
            if t.shape != shape_t or t.dtype != np.dtype(dtype):
                raise rule(
                    "ndarray",
                    f"program {c.program} allocates shared_hbm output #{c.shared_pos} as "
                    f"{shape_t} {np.dtype(dtype)}, program 0 as {t.shape} {t.dtype}",
                )
        else:
            t = Tile.allocate(shape_t, dtype, buffer, "ndarray")
            c.shared.append(t)
        c.shared_pos += 1
        return t
    return Tile.allocate(shape, dtype, buffer, "ndarray")


def zeros(shape, dtype, buffer=sbuf, name: str = "") -> Tile:
    return Tile.allocate(shape, dtype, buffer, "zeros", fill=0)


def full(shape, fill_value, dtype, buffer=sbuf, name: str = "") -> Tile:
    return Tile.allocate(shape, dtype, buffer, "full", fill=fill_value)


def ds(start: int, size: int) -> DynSlice:
    """Dynamic slice ``start:start+size`` (start may depend on loop indices)."""
    return DynSlice(start, size)


# -- data movement ----------------------------------------------------------------


def _hbm(call: str, name: str, t: Any) -> Tile:
    if not isinstance(t, Tile):
        raise rule(call, f"{name} must be a tensor, got {type(t).__name__}")
    if t.buffer.on_chip:
        raise rule(call, f"{name} is in {t.buffer}; {call} moves data between HBM and SBUF")
    return t


def load(src: Tile, dtype=None, mask=None) -> Tile:
    """HBM -> a new SBUF tile of the same shape (optionally cast to ``dtype``)."""
    _hbm("load", "src", src)
    out = Tile.allocate(src.shape, src.dtype if dtype is None else dtype, sbuf, "load")
    if dtype is None or np.dtype(dtype) == src.dtype:
        out.array[...] = src.array
    else:
        T.write(out, T.read(src), "load")
    return out


def store(dst: Tile, value, mask=None) -> None:
    """An SBUF/PSUM tile (or scalar) -> HBM ``dst`` of the same shape."""
    _hbm("store", "dst", dst)
    if isinstance(value, Tile):
        T.check_onchip("store", "value", value)
        if value.shape != dst.shape:
            raise rule("store", f"value shape {value.shape} != dst shape {dst.shape}")
        if value.dtype == dst.dtype:
            dst.array[...] = value.array
        else:
            T.write(dst, T.read(value), "store")
    else:
        T.write(dst, np.full(dst.shape, float(value), np.float32), "store")


# -- loops and the grid -----------------------------------------------------------


def affine_range(*args) -> range:
    """Loop with independent iterations (the executor runs them in order)."""
    return builtins.range(*args)


def sequential_range(*args) -> range:
    """Loop with a carried dependency."""
    return builtins.range(*args)


def static_range(*args) -> range:
    """Fully unrolled loop."""
    return builtins.range(*args)


def program_id(axis: int) -> int:
    c = T.ctx()
    if not 0 <= axis < len(c.grid):
        raise rule("program_id", f"axis {axis} outside the {len(c.grid)}-d launch grid")
    return c.program[axis]


def num_programs(axis: int | None = None) -> int | tuple[int, ...]:
    c = T.ctx()
    if axis is None:
        return c.grid
    if not 0 <= axis < len(c.grid):
        raise rule("num_programs", f"axis {axis} outside the {len(c.grid)}-d launch grid")
    return c.grid[axis]


def program_ndim() -> int:
    return len(T.ctx().grid)


def device_print(prefix: str, x: Any) -> None:
    """Print a tile's values (fp32) from inside the kernel."""
    val = T.read(x) if isinstance(x, Tile) else x
    print(prefix, val, file=sys.stdout)


# -- math helpers -------------------------------------------------------------------


def _operand(call: str, name: str, x: Any):
    if isinstance(x, Tile):
        T.check_onchip(call, name, x)
        return x
    if isinstance(x, (bool, int, float, np.floating, np.integer)):
        return float(x)
    raise rule(call, f"{name} must be a tile or a Python scalar, got {type(x).__name__}")


def broadcast(call: str, xs: list[tuple[str, Any]]) -> tuple[tuple[int, ...], list]:
    """Shape of an elementwise result; only scalars and ``[P, 1]`` tiles broadcast."""
    tiles = [(n, x) for n, x in xs if isinstance(x, Tile)]
    if not tiles:
        raise rule(call, "needs at least one tile operand")
    full_shape = builtins.max((x.shape for _, x in tiles), key=lambda s: int(np.prod(s)))
    vals = []
    for name, x in xs:
        if not isinstance(x, Tile):
            vals.append(np.float32(x))
            continue
        v = T.read(x)
        if x.shape != full_shape:
            if x.shape[0] != full_shape[0]:
                raise rule(
                    call,
                    f"{name} shape {x.shape} vs {full_shape}: tiles never broadcast along the "
                    "partition axis (partition dims must match)",
                )
            if not (x.ndim == 2 and x.shape[1] == 1):
                raise rule(
                    call,
                    f"{name} shape {x.shape} vs {full_shape}: only a [P, 1] operand broadcasts "
                    "(along the free axis)",
                )
            v = v.reshape((x.shape[0],) + (1,) * (len(full_shape) - 1))
        vals.append(v)
    return full_shape, vals


def _result_dtype(xs: list[Any], dtype) -> np.dtype:
    if dtype is not None:
        return T.as_dtype(dtype)
    dts = [x.dtype for x in xs if isinstance(x, Tile)]
    if float32 in dts:
        return float32
    return dts[0]


def _elementwise(call: str, fn, args: list[tuple[str, Any]], dtype=None) -> Tile:
    args = [(n, _operand(call, n, x)) for n, x in args]
    shape, vals = broadcast(call, args)
    with np.errstate(all="ignore"):
        res = np.broadcast_to(fn(*vals), shape).astype(np.float32)
    out = Tile.allocate(shape, _result_dtype([x for _, x in args], dtype), sbuf, call)
    T.write(out, res, call)
    return out


def _binary(name: str, fn):
    def op(x, y, dtype=None, mask=None, **kwargs) -> Tile:
        return _elementwise(name, fn, [("x", x), ("y", y)], dtype)

    op.__name__ = name
    op.__doc__ = f"Elementwise ``{name}(x, y)`` -> new SBUF tile (fp32 math)."
    op._np = fn
    return op


def _unary(name: str, fn):
    def op(x, dtype=None, mask=None, **kwargs) -> Tile:
        return _elementwise(name, fn, [("x", x)], dtype)

    op.__name__ = name
    op.__doc__ = f"Elementwise ``{name}(x)`` -> new SBUF tile (fp32 math)."
    op._np = fn
    return op


def _f(cmp):
    return lambda a, b: cmp(a, b).astype(np.float32)


add = _binary("add", np.add)
subtract = _binary("subtract", np.subtract)
multiply = _binary("multiply", np.multiply)
maximum = _binary("maximum", np.maximum)
minimum = _binary("minimum", np.minimum)
divide = _binary("divide", np.divide)
equal = _binary("equal", _f(np.equal))
not_equal = _binary("not_equal", _f(np.not_equal))
greater = _binary("greater", _f(np.greater))
greater_equal = _binary("greater_equal", _f(np.greater_equal))
less = _binary("less", _f(np.less))
less_equal = _binary("less_equal", _f(np.less_equal))
exp = _unary("exp", np.exp)
log = _unary("log", np.log)
reciprocal = _unary("reciprocal", np.reciprocal)
negative = _unary("negative", np.negative)
abs = _unary("abs", np.abs)  # noqa: A001
copy = _unary("copy", lambda a: a)
copy.__doc__ = "A copy of ``x`` as a new SBUF tile (optionally cast to ``dtype``)."


def where(condition, x, y, dtype=None, mask=None) -> Tile:
    """``x`` where ``condition`` is nonzero, else ``y`` (new SBUF tile)."""
    if dtype is None:
        values = [t for t in (x, y) if isinstance(t, Tile)] or [condition]
        dtype = _result_dtype(values, None)
    return _elementwise(
        "where",
        lambda c, a, b: np.where(c != 0, a, b),
        [("condition", condition), ("x", x), ("y", y)],
        dtype,
    )


# -- reductions ---------------------------------------------------------------------


def check_free_axes(call: str, x: Tile, axis) -> tuple[int, ...]:
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    axes = tuple(a % x.ndim for a in axes)
    if 0 in axes:
        raise rule(
            call,
            f"axis {axis} includes the partition axis 0 of {x.shape}; engines reduce only "
            "free axes (transpose first, or reduce with a matmul)",
        )
    return axes


def _reduce(name: str, fn):
    def op(x, axis, dtype=None, keepdims: bool = False, mask=None, **kwargs) -> Tile:
        T.check_onchip(name, "x", x)
        axes = check_free_axes(name, x, axis)
        res = fn(T.read(x), axis=axes, keepdims=True)
        shape = (
            res.shape if keepdims else tuple(s for i, s in enumerate(res.shape) if i not in axes)
        )
        if len(shape) < 2:
            shape = (x.shape[0], 1)
        out = Tile.allocate(shape, x.dtype if dtype is None else dtype, sbuf, name)
        T.write(out, res.reshape(shape), name)
        return out

    op.__name__ = name
    op.__doc__ = f"``{name}`` over free ``axis`` -> new SBUF tile ``[P, 1]`` (or keepdims)."
    op._np = fn
    return op


max = _reduce("max", np.max)  # noqa: A001
min = _reduce("min", np.min)  # noqa: A001
sum = _reduce("sum", np.sum)  # noqa: A001


# -- tensor engine -------------------------------------------------------------------


def matmul(x: Tile, y: Tile, transpose_x: bool = False, mask=None, **kwargs) -> Tile:
    """``x @ y`` (or ``x.T @ y``) on the Tensor Engine -> new PSUM fp32 tile.

    With ``transpose_x=True``, ``x`` is ``[K, M]`` (K on partitions) as
    ``nc_matmul`` takes it; otherwise ``x`` is ``[M, K]``. Limits: K <= 128,
    M <= 128, N <= 512.
    """
    from kernels.nki.executor import isa

    T.check_onchip("matmul", "x", x)
    T.check_onchip("matmul", "y", y)
    if x.ndim != 2 or y.ndim != 2:
        raise rule("matmul", f"x {x.shape} and y {y.shape} must be 2-d tiles")
    m = x.shape[1] if transpose_x else x.shape[0]
    out = Tile.allocate((m, y.shape[1]), float32, psum, "matmul")
    stationary = x if transpose_x else _transposed_view(x)
    isa.nc_matmul(out, stationary, y, _call="matmul")
    return out


def _transposed_view(x: Tile) -> Tile:
    """x.T as an SBUF tile (the compiler inserts this transpose for nl.matmul)."""
    if x.shape[1] > T.PMAX:
        raise rule(
            "matmul",
            f"x {x.shape}: contraction dim {x.shape[1]} > {T.PMAX} (nl.tile_size.pmax)",
        )
    t = Tile.allocate((x.shape[1], x.shape[0]), x.dtype, sbuf, "matmul")
    t.array[...] = x.array.T
    return t


def transpose(x: Tile, dtype=None, mask=None) -> Tile:
    """Swap the partition and free axis of a 2-d tile (both <= 128) -> new SBUF tile."""
    T.check_onchip("transpose", "x", x)
    if x.ndim != 2:
        raise rule("transpose", f"x {x.shape} must be a 2-d tile")
    if x.shape[1] > T.PMAX:
        raise rule("transpose", f"x {x.shape}: free dim {x.shape[1]} > {T.PMAX} partitions")
    out = Tile.allocate(
        (x.shape[1], x.shape[0]), x.dtype if dtype is None else dtype, sbuf, "transpose"
    )
    T.write(out, T.read(x).T, "transpose")
    return out
