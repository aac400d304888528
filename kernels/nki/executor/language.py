"""``nki.language`` (``nl``) of the NumPy NKI executor: dtypes, allocation, DMA,
ranges, grid queries, value-returning tile math, and the old ``neuronxcc.nki``
names that map 1:1 (``nl.arange`` / ``nl.mgrid`` index expressions, ``nl.par_dim``).

Value-returning ops allocate their result in SBUF (``nl.matmul`` in PSUM, fp32).
Elementwise math reads operands as fp32 and rounds on the write. A Python
scalar broadcasts everywhere; of the tiles, only a ``[P, 1]`` operand
broadcasts, and only along the free axis (``nl.broadcast_to`` makes the rest
explicit).
"""

from __future__ import annotations

import builtins
import contextlib
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np

from kernels.nki.executor import profile as prof
from kernels.nki.executor import tiles as T
from kernels.nki.executor.errors import rule
from kernels.nki.executor.tiles import (  # noqa: F401  (re-exported as nl.*)
    DynSlice,
    Tile,
    bfloat16,
    bool_,
    float4_e2m1fn_x4,
    float8_e4m3,
    float8_e4m3fn,
    float8_e4m3fn_x4,
    float8_e5m2,
    float8_e5m2_x4,
    float8_e8m0fnu,
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
    tfloat32,
    uint8,
    uint16,
    uint32,
)

NkiTensor = Tile
DynamicSlice = DynSlice


class NKIObject:
    """Base class of NKI kernel dataclasses and configuration objects (keyword
    arguments become attributes). As in NKI, a ``@dataclass`` subclass may declare its
    fields as plain class attributes (``section_idx = None``): they become fields with
    that default."""

    def __init__(self, **kwargs: Any) -> None:
        for k, v in kwargs.items():
            setattr(self, k, v)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        ann = dict(cls.__dict__.get("__annotations__", {}))
        for k, v in list(cls.__dict__.items()):
            if k.startswith("_") or k in ann or callable(v):
                continue
            if isinstance(v, (property, classmethod, staticmethod)):
                continue
            ann[k] = Any
        cls.__annotations__ = ann


tile_size = SimpleNamespace(
    pmax=128,
    psum_fmax=512,
    psum_bank_fmax=512,
    psum_bank_fmax_bytes=T.PSUM_TILE_BYTES,
    psum_num_banks=T.PSUM_PARTITION_BYTES // T.PSUM_TILE_BYTES,
    gemm_stationary_fmax=128,
    gemm_moving_fmax=512,
    bn_stats_fmax=512,
    psum_partition_bytes=T.PSUM_PARTITION_BYTES,
    sbuf_partition_bytes=T.SBUF_PARTITION_BYTES,
    sbuf_fmax_bytes=T.SBUF_PARTITION_BYTES,
    sbuf_fmax=T.SBUF_PARTITION_BYTES // 4,
    sbuf_size_bytes=T.SBUF_PARTITION_BYTES * T.PMAX,
    total_available_sbuf_size=T.SBUF_PARTITION_BYTES,
)


def is_hbm(buffer) -> bool:
    return str(buffer) in ("hbm", "shared_hbm", "private_hbm")


def is_on_chip(buffer) -> bool:
    return str(buffer) in ("sbuf", "psum")


def is_psum(buffer) -> bool:
    return str(buffer) == "psum"


def is_sbuf(buffer) -> bool:
    return str(buffer) == "sbuf"


# -- the old API's index expressions (neuronxcc.nki) -------------------------------------


class IndexExpr:
    """``nl.arange(n)`` (and ``nl.mgrid``) of the old API: an integer index grid.

    ``[:, None]`` / ``[None, :]`` place it on an axis, ``+``, ``-``, ``*`` by integers
    keep it affine; used as an index it must be an arithmetic progression with a
    positive step, and becomes that slice.
    """

    __array_priority__ = 100

    def __init__(self, values: np.ndarray):
        self.values = np.asarray(values, np.int64)

    def __getitem__(self, key) -> IndexExpr:
        return IndexExpr(self.values[key])

    def _num(self, other):
        if isinstance(other, (int, np.integer)):
            return int(other)
        if isinstance(other, IndexExpr):
            return other.values
        raise rule(
            "arange", f"index expressions combine with integers and each other, not {other!r}"
        )

    def __add__(self, o):
        return IndexExpr(self.values + self._num(o))

    __radd__ = __add__

    def __sub__(self, o):
        return IndexExpr(self.values - self._num(o))

    def __rsub__(self, o):
        return IndexExpr(self._num(o) - self.values)

    def __mul__(self, o):
        if isinstance(o, IndexExpr):
            raise rule("arange", "the product of two index expressions is not affine")
        return IndexExpr(self.values * self._num(o))

    __rmul__ = __mul__

    def as_slice(self, axis: int) -> slice:
        v = self.values
        varying = [a for a in range(v.ndim) if not np.all(v == v.take([0], axis=a))]
        if len(varying) > 1:
            raise rule("index", f"axis {axis}: index expression varies along several axes")
        if varying:
            idx: list = [0] * v.ndim
            idx[varying[0]] = slice(None)
            flat = v[tuple(idx)].reshape(-1)
        else:
            flat = v.reshape(-1)
        if flat.size == 1:
            return slice(int(flat[0]), int(flat[0]) + 1)
        step = int(flat[1] - flat[0])
        if step < 1 or not np.array_equal(flat, flat[0] + step * np.arange(flat.size)):
            raise rule("index", f"axis {axis}: index expression is not an increasing affine range")
        return slice(int(flat[0]), int(flat[-1]) + 1, step)

    def _mask(self, *a, **k):
        raise rule("arange", "comparisons of index expressions (old-API masks) are not modelled")

    __lt__ = __le__ = __gt__ = __ge__ = _mask


def arange(*args) -> IndexExpr:
    """Old API: ``nl.arange(n)`` / ``nl.arange(start, stop)`` as an index expression."""
    return IndexExpr(np.arange(*args))


class _MGrid:
    def __getitem__(self, key) -> tuple[IndexExpr, ...]:
        key = key if isinstance(key, tuple) else (key,)
        return tuple(IndexExpr(g) for g in np.mgrid[key])


mgrid = _MGrid()


def nc(n: int) -> int:
    """Old API: ``nl.nc(k)``, k NeuronCores for an SPMD grid dim (see :func:`spmd_dim`)."""
    return int(n)


def spmd_dim(size: int, *cores) -> int:
    """Old API: ``kernel[nl.spmd_dim(n, nl.nc(k)), m]`` runs ``n`` programs on each of
    ``k`` cores along that grid dim: ``n * k`` programs, run in order here."""
    total = int(size)
    for c in cores:
        total *= int(c)
    return total


class ParDim(int):
    """``nl.par_dim(p)``: an int that marks the partition dim of an old-API shape."""


def par_dim(size: int) -> ParDim:
    """Old API: marks the partition dim of a shape. First (the usual case) it is just
    ``p``; after leading block dims (``(n, nl.par_dim(128), f)``) the tile is stored
    partition-first and must be indexed on its block dims before compute."""
    return ParDim(int(size))


# -- allocation -----------------------------------------------------------------


def ndarray(shape, dtype, buffer=sbuf, name: str = "", address=None) -> Tile:
    """A new tensor; on-chip and HBM memory starts as NaN (floats) / dtype max (ints).

    ``buffer=nl.shared_hbm`` outputs are shared by all programs of a grid launch
    (the i-th such allocation of every program is the same tensor). ``address=
    (partition_offset, byte_offset)`` places an on-chip tensor by hand: it must fit
    inside the partitions and the per-partition capacity, and is not counted live (the
    kernel manages its placement); tensors placed on the same bytes do not alias here.
    """
    buffer = sbuf if buffer is None else buffer
    if address is not None:
        return _placed(shape, dtype, buffer, name, address)
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
            t = Tile.allocate(shape_t, dtype, buffer, "ndarray", name=name)
            c.shared.append(t)
        c.shared_pos += 1
        return t
    return Tile.allocate(shape, dtype, buffer, "ndarray", name=name)


def _placed(shape, dtype, buffer, name: str, address) -> Tile:
    if str(buffer) not in ("sbuf", "psum"):
        raise rule("ndarray", f"address= places SBUF/PSUM tensors, not {buffer}")
    p0, off = (int(a) for a in address)
    t = Tile.allocate(shape, dtype, buffer, "ndarray", name=name, account=False)
    limit = T.ctx().sbuf_limit if str(buffer) == "sbuf" else T.PSUM_PARTITION_BYTES
    nbytes = T.partition_bytes(t._storage.array.shape, t.dtype)
    if p0 < 0 or p0 + t._storage.array.shape[0] > T.PMAX:
        raise rule("ndarray", f"address partition {p0} + {t.shape[0]} partitions > {T.PMAX}")
    if off < 0 or off + nbytes > limit:
        raise rule(
            "ndarray",
            f"address byte offset {off} + {nbytes} B exceeds the {limit} B per partition of "
            f"{buffer}",
        )
    return t


def _filled(call: str, shape, dtype, buffer, fill, name: str) -> Tile:
    t = Tile.allocate(shape, dtype, buffer, call, name=name)
    if t.buffer.on_chip:
        prof.vector(t.shape, 1, (t.dtype,))  # a memset
    T.write(t, np.full(t.shape, fill, np.float32), call)
    return t


def zeros(shape, dtype, buffer=sbuf, name: str = "") -> Tile:
    return _filled("zeros", shape, dtype, buffer, 0.0, name)


def ones(shape, dtype, buffer=sbuf, name: str = "") -> Tile:
    return _filled("ones", shape, dtype, buffer, 1.0, name)


def full(shape, fill_value, dtype, buffer=sbuf, name: str = "") -> Tile:
    return _filled("full", shape, dtype, buffer, fill_value, name)


def zeros_like(x: Tile, dtype=None, buffer=None, name: str = "") -> Tile:
    return zeros(x.shape, x.dtype if dtype is None else dtype, buffer or x.buffer, name)


def empty_like(x: Tile, dtype=None, buffer=None, name: str = "") -> Tile:
    return ndarray(x.shape, x.dtype if dtype is None else dtype, buffer or x.buffer, name)


def shared_constant(constant, dtype=None) -> Tile:
    """A compile-time constant (a NumPy array) as a read-only HBM tensor."""
    arr = np.asarray(constant)
    arr = arr.astype(T.as_dtype(dtype if dtype is not None else arr.dtype))
    return Tile.wrap(np.ascontiguousarray(arr), hbm)


def static_cast(x, dtype):
    """Old API: a NumPy array cast to ``dtype`` (nearest-even), or a tile copied to it."""
    if isinstance(x, Tile):
        return copy(x, dtype=dtype)
    return np.asarray(x).astype(np.float32).astype(T.as_dtype(dtype))


def shared_identity_matrix(n: int, dtype=uint8, dst: Tile | None = None) -> Tile:
    """An ``[n, n]`` identity matrix in SBUF (``dst`` if given)."""
    out = Tile.allocate((n, n), dtype, sbuf, "shared_identity_matrix") if dst is None else dst
    T.write(out, np.eye(n, dtype=np.float32), "shared_identity_matrix")
    return out


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


def _no_mask(call: str, mask) -> None:
    if mask is not None:
        raise rule(call, "mask= (old-API predicates) is not modelled; slice the tensor instead")


def load(src: Tile, dtype=None, mask=None) -> Tile:
    """HBM -> a new SBUF tile of the same shape (optionally cast to ``dtype``); a 1-d
    HBM view (``a[0:128, j]``) loads as a ``[n, 1]`` tile, as in the old API."""
    _no_mask("load", mask)
    _hbm("load", "src", src)
    if src.ndim == 1:
        src = src._view(src.array.reshape(src.shape[0], 1))
    out = Tile.allocate(src.shape, src.dtype if dtype is None else dtype, sbuf, "load")
    prof.dma(src.buffer, out.buffer, src.array.nbytes)
    if dtype is None or np.dtype(dtype) == src.dtype:
        T.assign(out, src.array)
    else:
        T.write(out, T.read(src, "load"), "load")
    return out


def load_transpose2d(src: Tile, dtype=None) -> Tile:
    """HBM ``[F, P]`` -> SBUF ``[P, F]`` (a DMA transpose; P <= 128)."""
    _hbm("load_transpose2d", "src", src)
    if src.ndim != 2:
        raise rule("load_transpose2d", f"src {src.shape} must be 2-d")
    out = Tile.allocate(src.shape[::-1], src.dtype if dtype is None else dtype, sbuf, "load")
    prof.dma(src.buffer, out.buffer, src.array.nbytes)
    T.write(out, T.read(src, "load_transpose2d").T, "load_transpose2d")
    return out


def store(dst: Tile, value, mask=None) -> None:
    """An SBUF/PSUM tile (or scalar) -> HBM ``dst`` of the same shape."""
    _no_mask("store", mask)
    _hbm("store", "dst", dst)
    if isinstance(value, Tile):
        T.check_onchip("store", "value", value)
        if value.shape != dst.shape:
            raise rule("store", f"value shape {value.shape} != dst shape {dst.shape}")
        prof.dma(value.buffer, dst.buffer, dst.array.nbytes)
        if value.dtype == dst.dtype:
            T.assign(dst, T.note_read(value))
        else:
            T.write(dst, T.read(value, "store"), "store")
    else:
        T.write(dst, np.full(dst.shape, float(value), np.float32), "store")


# -- loops and the grid -----------------------------------------------------------


def affine_range(*args, **hints) -> range:
    """Loop with independent iterations (the executor runs them in order)."""
    return builtins.range(*args)


def sequential_range(*args, **hints) -> range:
    """Loop with a carried dependency."""
    return builtins.range(*args)


def static_range(*args, **hints) -> range:
    """Fully unrolled loop."""
    return builtins.range(*args)


def dynamic_range(*args) -> range:
    """Loop with a runtime trip count (deprecated in 0.6; the executor runs it in order)."""
    return builtins.range(*(int(a) for a in args))


def fori_loop(lower: int, upper: int, body_fun, step: int = 1):
    """``for i in range(lower, upper, step): body_fun(i)`` (the runtime loop of NKI 0.6)."""
    for i in builtins.range(int(lower), int(upper), int(step)):
        body_fun(i)


def while_loop(init, body_fun):
    raise rule("while_loop", "data-dependent loops are not modelled by the executor")


@contextlib.contextmanager
def no_reorder():
    """A region the scheduler must not reorder; the executor runs everything in order."""
    yield


def program_id(axis: int = 0) -> int:
    c = T.ctx()
    if not 0 <= axis < len(c.grid):
        raise rule("program_id", f"axis {axis} outside the {len(c.grid)}-d launch grid")
    return c.program[axis]


def num_programs(axes: int | None = 0, axis: int | None = None) -> int | tuple[int, ...]:
    """Programs along grid axis ``axes`` (NKI 0.6 spelling; ``axis=`` too); ``None``: the
    whole grid as a tuple."""
    c = T.ctx()
    axis = axes if axis is None else axis
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


def _elementwise(call: str, fn, args: list[tuple[str, Any]], dtype=None, engine="vector") -> Tile:
    args = [(n, _operand(call, n, x)) for n, x in args]
    shape, vals = broadcast(call, args)
    with np.errstate(all="ignore"):
        res = np.broadcast_to(fn(*vals), shape).astype(np.float32)
    out = Tile.allocate(shape, _result_dtype([x for _, x in args], dtype), sbuf, call)
    tiles = [x for _, x in args if isinstance(x, Tile)]
    if engine == "scalar":
        prof.scalar(shape)
    else:
        prof.vector(shape, len(tiles), [t.dtype for t in tiles] + [out.dtype])
    T.write(out, res, call)
    return out


def _binary(name: str, fn):
    def op(x, y, dtype=None, mask=None, **kwargs) -> Tile:
        _no_mask(name, mask)
        return _elementwise(name, fn, [("x", x), ("y", y)], dtype)

    op.__name__ = name
    op.__doc__ = f"Elementwise ``{name}(x, y)`` -> new SBUF tile (fp32 math, Vector Engine)."
    op._np = fn
    return op


def _unary(name: str, fn, engine: str = "scalar"):
    def op(x, dtype=None, mask=None, **kwargs) -> Tile:
        _no_mask(name, mask)
        return _elementwise(name, fn, [("x", x)], dtype, engine)

    op.__name__ = name
    op.__doc__ = f"Elementwise ``{name}(x)`` -> new SBUF tile (fp32 math, {engine} engine)."
    op._np = fn
    return op


def _bitvec(name: str, fn):
    """Bit-pattern ops on integer tiles (``nl.bitwise_and`` ...), exact on the integers."""

    def op(x, y=None, dtype=None, mask=None, **kwargs) -> Tile:
        _no_mask(name, mask)
        xs = [v for v in (x, y) if v is not None]
        tiles = [v for v in xs if isinstance(v, Tile)]
        if not tiles:
            raise rule(name, "needs at least one tile operand")
        for t in tiles:
            T.check_onchip(name, "x", t)
            if T.is_float(t.dtype):
                raise rule(name, f"bitvec op on {T.dtype_name(t.dtype)}; needs an integer dtype")
        shape = tiles[0].shape
        vals = [v.array.astype(np.int64) if isinstance(v, Tile) else np.int64(v) for v in xs]
        for t in tiles:
            if t.shape != shape:
                raise rule(name, f"operand shapes {t.shape} and {shape} differ")
        out = Tile.allocate(shape, tiles[0].dtype if dtype is None else dtype, sbuf, name)
        prof.vector(shape, len(tiles), [t.dtype for t in tiles])
        res = fn(*vals)
        info = np.iinfo(out.dtype) if out.dtype.kind in "iu" else None
        if info is not None:
            res = res & ((1 << (8 * out.dtype.itemsize)) - 1)
            res = res.astype(np.dtype(f"u{out.dtype.itemsize}")).view(out.dtype)
        T.assign(out, np.asarray(res).astype(out.dtype))
        return out

    op.__name__ = name
    op.__doc__ = f"Bitwise ``{name}`` of integer tiles -> new SBUF tile (Vector Engine)."
    op._np = fn
    op._bitvec = True
    return op


def _f(cmp):
    return lambda a, b: cmp(a, b).astype(np.float32)


def _gelu(a):
    from math import sqrt

    erf = np.vectorize(__import__("math").erf, otypes=[np.float64])
    return (0.5 * a * (1.0 + erf(a / sqrt(2.0)))).astype(np.float32)


def _erf(a):
    erf = np.vectorize(__import__("math").erf, otypes=[np.float64])
    return erf(a).astype(np.float32)


add = _binary("add", np.add)
subtract = _binary("subtract", np.subtract)
multiply = _binary("multiply", np.multiply)
maximum = _binary("maximum", np.maximum)
minimum = _binary("minimum", np.minimum)
divide = _binary("divide", np.divide)
power = _binary("power", np.power)
fmod = _binary("fmod", np.fmod)
mod = _binary("mod", np.mod)
abs_max = _binary("abs_max", lambda a, b: np.where(np.abs(a) > np.abs(b), a, b))
abs_min = _binary("abs_min", lambda a, b: np.where(np.abs(a) < np.abs(b), a, b))
equal = _binary("equal", _f(np.equal))
not_equal = _binary("not_equal", _f(np.not_equal))
greater = _binary("greater", _f(np.greater))
greater_equal = _binary("greater_equal", _f(np.greater_equal))
less = _binary("less", _f(np.less))
less_equal = _binary("less_equal", _f(np.less_equal))
logical_and = _binary("logical_and", _f(lambda a, b: (a != 0) & (b != 0)))
logical_or = _binary("logical_or", _f(lambda a, b: (a != 0) | (b != 0)))
logical_xor = _binary("logical_xor", _f(lambda a, b: (a != 0) ^ (b != 0)))
logical_not = _unary("logical_not", lambda a: (a == 0).astype(np.float32), "vector")
bitwise_and = _bitvec("bitwise_and", np.bitwise_and)
bitwise_or = _bitvec("bitwise_or", np.bitwise_or)
bitwise_xor = _bitvec("bitwise_xor", np.bitwise_xor)
left_shift = _bitvec("left_shift", np.left_shift)
right_shift = _bitvec("right_shift", lambda a, b: (a & 0xFFFFFFFF) >> b)  # logical
invert = _bitvec("invert", np.invert)
exp = _unary("exp", np.exp)
log = _unary("log", np.log)
sqrt = _unary("sqrt", np.sqrt)
rsqrt = _unary("rsqrt", lambda a: np.float32(1.0) / np.sqrt(a))
square = _unary("square", np.square)
reciprocal = _unary("reciprocal", np.reciprocal, "vector")
negative = _unary("negative", np.negative)
abs = _unary("abs", np.abs)  # noqa: A001
sign = _unary("sign", np.sign)
tanh = _unary("tanh", np.tanh)
sigmoid = _unary("sigmoid", lambda a: np.float32(1.0) / (np.float32(1.0) + np.exp(-a)))
silu = _unary("silu", lambda a: a / (np.float32(1.0) + np.exp(-a)))
relu = _unary("relu", lambda a: np.maximum(a, np.float32(0.0)))
gelu = _unary("gelu", _gelu)
gelu_apprx_tanh = _unary(
    "gelu_apprx_tanh",
    lambda a: 0.5 * a * (1.0 + np.tanh(np.float32(0.7978845608) * (a + 0.044715 * a**3))),
)
softplus = _unary("softplus", lambda a: np.logaddexp(np.float32(0.0), a))
mish = _unary("mish", lambda a: a * np.tanh(np.logaddexp(np.float32(0.0), a)))
gelu_apprx_sigmoid = _unary(
    "gelu_apprx_sigmoid", lambda a: a / (np.float32(1.0) + np.exp(np.float32(-1.702) * a))
)
silu_dx = _unary(
    "silu_dx",
    lambda a: (1 / (1 + np.exp(-a))) * (1 + a * (1 - 1 / (1 + np.exp(-a)))),
)
gelu_dx = _unary(
    "gelu_dx", lambda a: 0.5 * (1 + _erf(a / np.sqrt(2.0))) + a * np.exp(-0.5 * a * a) / 2.5066283
)
erf_dx = _unary("erf_dx", lambda a: np.float32(1.1283792) * np.exp(-a * a))
erf = _unary("erf", _erf)
sin = _unary("sin", np.sin)
cos = _unary("cos", np.cos)
tan = _unary("tan", np.tan)
arctan = _unary("arctan", np.arctan)
ceil = _unary("ceil", np.ceil, "vector")
floor = _unary("floor", np.floor, "vector")
trunc = _unary("trunc", np.trunc, "vector")
bypass = _unary("bypass", lambda a: a)
copy = _unary("copy", lambda a: a, "vector")
copy.__doc__ = (
    "A copy of ``x`` (SBUF or PSUM) as a new SBUF tile of the same layout, by "
    "``tensor_copy`` on the Vector Engine: bit exact for the same dtype, else cast."
)


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


def broadcast_to(x: Tile, shape, dtype=None) -> Tile:
    """``x`` broadcast to ``shape`` (same rank; each dim equal or from 1) -> a new SBUF
    tile; ``x`` itself if the shape already matches and no cast is asked for. A
    partition-dim broadcast goes through the Tensor Engine (ones-matmul), the rest
    through the Vector Engine."""
    T.check_onchip("broadcast_to", "x", x)
    shape = tuple(int(s) for s in shape)
    if len(shape) != x.ndim:
        raise rule("broadcast_to", f"shape {shape} must have the rank of x {x.shape}")
    for i, (a, b) in enumerate(zip(x.shape, shape, strict=True)):
        if a != b and a != 1:
            raise rule("broadcast_to", f"dim {i}: {a} cannot broadcast to {b}")
    if shape == x.shape and (dtype is None or T.as_dtype(dtype) == x.dtype):
        return x
    T.check_onchip_shape("broadcast_to", "result", shape)
    out = Tile.allocate(shape, x.dtype if dtype is None else dtype, sbuf, "broadcast_to")
    if shape[0] != x.shape[0]:
        prof.matmul(1, shape[0], int(np.prod(shape[1:])), fp32=x.dtype == float32)
    prof.vector(shape, 1, (x.dtype, out.dtype))
    T.write(out, np.broadcast_to(T.read(x, "broadcast_to"), shape), "broadcast_to")
    return out


def expand_dims(x: Tile, axis: int) -> Tile:
    """A view of ``x`` with a size-1 axis inserted at ``axis``."""
    return x.expand_dim(axis)


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
        prof.vector(x.shape, 1, (x.dtype, out.dtype))
        T.write(out, res.reshape(shape), name)
        return out

    op.__name__ = name
    op.__doc__ = f"``{name}`` over free ``axis`` -> new SBUF tile ``[P, 1]`` (or keepdims)."
    op._np = fn
    return op


max = _reduce("max", np.max)  # noqa: A001
min = _reduce("min", np.min)  # noqa: A001
sum = _reduce("sum", np.sum)  # noqa: A001
mean = _reduce("mean", np.mean)
average = _reduce("average", np.mean)
prod = _reduce("prod", np.prod)
var = _reduce("var", np.var)


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
    prof.matmul(x.shape[0], x.shape[1], x.shape[0], fp32=x.dtype == float32)
    T.assign(t, x.array.T)
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
    prof.matmul(x.shape[0], x.shape[1], x.shape[0], fp32=x.dtype == float32)
    prof.vector(out.shape, 1, (x.dtype, out.dtype))  # PSUM -> SBUF copy
    T.write(out, T.read(x).T, "transpose")
    return out
