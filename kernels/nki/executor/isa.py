"""``nki.isa`` (``nisa``) of the NumPy NKI executor, NKI 0.6: ``dst`` first.

Each instruction checks its operands' buffers, shapes and dtypes against
Trainium's rules before computing (fp32 math, rounding on the write), and
reports itself to :mod:`kernels.nki.executor.profile`. The old value-returning
forms (``neuronxcc.nki``: ``nisa.tensor_copy(src, dtype=)``,
``nisa.nc_matmul(stationary, moving)``, ``nisa.activation(op, data)``, ...) are
accepted where they map 1:1: the executor allocates ``dst`` and returns it.
"""

from __future__ import annotations

import enum
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from kernels.nki.executor import language as nl
from kernels.nki.executor import profile as prof
from kernels.nki.executor import tiles as T
from kernels.nki.executor.errors import NkiRuleError, rule
from kernels.nki.executor.tiles import Tile

NkiValidationError = NkiRuleError


class NkiAccumulationWarning(UserWarning):
    """A PSUM accumulation pattern that may not do on hardware what it does here."""


class engine(enum.Enum):  # noqa: N801  (NKI spelling)
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


tensor_engine, vector_engine = engine.tensor, engine.vector
scalar_engine, gpsimd_engine, unknown_engine = engine.scalar, engine.gpsimd, engine.unknown


class reduce_cmd(enum.Enum):  # noqa: N801
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


_CMD = reduce_cmd  # the enum, where a parameter named reduce_cmd shadows it


class dge_mode(enum.Enum):  # noqa: N801
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


_DGE = dge_mode


class oob_mode(enum.Enum):  # noqa: N801
    error = 0
    skip = 1


class matmul_perf_mode(enum.Enum):  # noqa: N801
    none = "none"
    double_row = "double_row"


class nc_version(enum.Enum):  # noqa: N801
    gen2 = 2
    gen3 = 3
    gen4 = 4


def get_nc_version() -> nc_version:
    """The NeuronCore generation modelled (``NEURON_PLATFORM_TARGET_OVERRIDE``, default gen3)."""
    return nc_version(T.ctx().nc_version)


def get_nc_sub_version() -> int:
    return 0


def _engine(e: Any, default: str, allowed: tuple[str, ...], call: str) -> str:
    if e is None or e == engine.unknown:
        return default
    name = e.name if isinstance(e, engine) else str(e)
    if name not in allowed:
        raise rule(call, f"engine {name} cannot run {call}; allowed: {allowed}")
    return name


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
    if isinstance(op, np.ufunc):  # the old API also took NumPy ufuncs (np.add, ...)
        op = getattr(nl, {"true_divide": "divide"}.get(op.__name__, op.__name__), op)
    fn = getattr(op, "_np", None)
    if fn is None:
        raise rule(call, f"unsupported op {op!r}; pass an nl function such as nl.add")
    return fn


def _apply(call: str, op: Any, a, b, raw_a=None, raw_b=None):
    """``op(a, b)`` in fp32, or on the integer bit patterns for bitvec ops."""
    if getattr(op, "_bitvec", False):
        if raw_a is None or (raw_b is None and not np.isscalar(b)):
            raise rule(call, f"bitvec op {op.__name__} needs integer operands")
        return op._np(raw_a, raw_b if raw_b is not None else np.int64(b)).astype(np.float64)
    return _np_op(call, op)(a, b)


def _raw_int(t: Tile) -> np.ndarray | None:
    if t.dtype.kind in "iu" and not T.is_float(t.dtype):
        return t.array.reshape(t.shape[0], -1).astype(np.int64)
    return None


def _scalar_or_vector(call: str, name: str, x: Any, p: int):
    """A compile-time scalar, or a [P, 1] on-chip vector broadcast along the free axis."""
    if isinstance(x, Tile):
        T.check_onchip(call, name, x)
        if x.shape[0] != p or _elems(x) != 1:
            raise rule(call, f"{name} must be a scalar or a [{p}, 1] vector, got {x.shape}")
        return T.read(x, call).reshape(p, 1)
    if isinstance(x, (bool, int, float, np.floating, np.integer)):
        return np.float32(x)
    raise rule(call, f"{name} must be a scalar or a tile, got {type(x).__name__}")


def _flat(t: Tile, call: str = "read") -> np.ndarray:
    return T.read(t, call).reshape(t.shape[0], -1)


def _write_flat(dst: Tile, values: np.ndarray, call: str) -> None:
    T.write(dst, np.asarray(values, np.float32).reshape(dst.shape), call)


# -- the old value-returning forms ----------------------------------------------------


def _dst_first(is_legacy: Callable[[dict], bool], make_dst: Callable[[dict, Any], Tile]):
    """Accept ``fn(dst, ...)`` (NKI 0.6) and the old ``fn(...) -> tile`` form.

    ``is_legacy`` looks at the arguments bound to the new signature; ``make_dst`` gets
    them bound to the old one (the new minus ``dst``) and the old ``dtype=``.
    """

    def deco(fn):
        sig = inspect.signature(fn)
        names = list(sig.parameters)

        def binds(args, kw) -> bool:
            try:
                sig.bind(*args, **kw)
            except TypeError:
                return False
            return True

        @functools.wraps(fn)
        def wrapper(*args, **kw):
            dtype = kw.pop("dtype", None)
            if kw.pop("mask", None) is not None:
                raise rule(fn.__name__, "mask= (old-API predicates) is not modelled; slice instead")
            new = dict(zip(names, args, strict=False)) | kw
            if "dst" in kw or (args and binds(args, kw) and not is_legacy(new)):
                if dtype is not None and isinstance(new.get("dst"), Tile):
                    if T.as_dtype(dtype) != new["dst"].dtype:
                        raise rule(fn.__name__, f"dtype {dtype} != dst dtype {new['dst'].dtype}")
                return fn(*args, **kw)
            old = dict(zip(names[1:], args, strict=False)) | kw
            dst = make_dst(old, dtype)
            fn(dst, *args, **kw)
            return dst

        return wrapper

    return deco


def _like(key: str, buffer=T.sbuf, fp32_if=()):
    def make(old: dict, dtype) -> Tile:
        src = old[key]
        if not isinstance(src, Tile):
            raise rule("isa", f"{key} must be a tile, got {type(src).__name__}")
        if dtype is None:
            dtype = src.dtype
            if any(isinstance(old.get(k), Tile) and old[k].dtype == T.float32 for k in fp32_if):
                dtype = T.float32
        return Tile.allocate(src.shape, dtype, buffer, "isa")

    return make


# -- tensor engine ----------------------------------------------------------------


def _matmul_dst(old: dict, dtype) -> Tile:
    st, mv = old["stationary"], old["moving"]
    return Tile.allocate((st.shape[-1], mv.shape[-1]), T.float32, T.psum, "nc_matmul")


def _check_matmul_inputs(c: str, stationary: Tile, moving: Tile) -> None:
    """Check both matmul inputs are on-chip tiles in SBUF."""
    for n, t in (("stationary", stationary), ("moving", moving)):
        T.check_onchip(c, n, t)
        if t.buffer != "sbuf":
            raise rule(c, f"{n} is in {t.buffer}; the Tensor Engine reads its inputs from SBUF")


def _check_matmul_layout(
    c: str, stationary: Tile, moving: Tile, double: bool, version: int, tile_size
) -> None:
    """Check the input ranks: ``[K, 2, F]`` fp8 for double_row, else 2-d."""
    if double:
        if version < 3:
            raise rule(c, "perf_mode=double_row needs NeuronCore-v3 or newer")
        for n, t in (("stationary", stationary), ("moving", moving)):
            if t.ndim != 3 or t.shape[1] != 2 or t.dtype not in T.FP8:
                raise rule(c, f"double_row: {n} {t.shape} {t.dtype} must be [K, 2, F] fp8")
        if tile_size and tuple(tile_size)[1] != 128:
            raise rule(c, "double_row cannot be combined with column tiling")
    else:
        for n, t in (("stationary", stationary), ("moving", moving)):
            if t.ndim != 2:
                raise rule(c, f"{n} {t.shape} must be a 2-d tile")


def _matmul_tile_limits(c: str, tile_position, tile_size, version: int) -> tuple[int, int]:
    """Check the tiling-mode arguments; return the (rows, cols) of the PE array in use."""
    rows, cols = 128, 128
    if tile_position or tile_size:
        if not (tile_position and tile_size):
            raise rule(c, "tile_position and tile_size must both be set for tiling mode")
        rows, cols = (int(v) for v in tile_size)
        r0, c0 = (int(v) for v in tile_position)
        allowed = (32, 64, 128) if version >= 3 else (64, 128)
        if rows not in allowed or cols not in allowed:
            raise rule(c, f"tile_size {tuple(tile_size)}: sizes must be in {allowed}")
        if r0 % rows or c0 % cols or r0 + rows > 128 or c0 + cols > 128:
            raise rule(c, f"tile_position {tuple(tile_position)} does not fit tile_size")
    return rows, cols


def _check_matmul_sizes(c: str, k: int, k2: int, m: int, n: int, rows: int, cols: int) -> None:
    """Check the contraction and free sizes against the PE array and PSUM limits."""
    if k != k2:
        raise rule(c, f"contraction (partition) dims differ: stationary {k}, moving {k2}")
    if k > rows:
        raise rule(c, f"contraction dim {k} > {rows} (nl.tile_size.pmax / tile_size rows)")
    if m > cols:
        raise rule(c, f"stationary free size {m} > {cols} (nl.tile_size.gemm_stationary_fmax)")
    if n > 512:
        raise rule(c, f"moving free size {n} > 512 (nl.tile_size.gemm_moving_fmax)")


def _check_matmul_dtypes(c: str, stationary: Tile, moving: Tile, fp32: tuple) -> None:
    """Check fp32 is on both inputs or neither, and the two fp8 e4m3 flavours are not mixed."""
    if (stationary.dtype in fp32) != (moving.dtype in fp32):
        raise rule(
            c,
            f"stationary {T.dtype_name(stationary.dtype)} and moving "
            f"{T.dtype_name(moving.dtype)}: fp32 must be on both sides or neither",
        )
    legacy_fp8 = {T.float8_e4m3} & {stationary.dtype, moving.dtype}
    if legacy_fp8 and T.float8_e4m3fn in (stationary.dtype, moving.dtype):
        raise rule(c, "float8_e4m3 and float8_e4m3fn cannot be mixed in one matmul")


def _check_matmul_dst(c: str, dst: Tile, m: int, n: int) -> None:
    """Check ``dst`` is an on-chip ``[m, n]`` PSUM tile."""
    T.check_onchip(c, "dst", dst)
    if dst.buffer != "psum":
        raise rule(c, f"dst is in {dst.buffer}; the Tensor Engine writes only to PSUM")
    if dst.shape != (m, n):
        raise rule(c, f"dst shape {dst.shape} != [{m}, {n}] (stationary free x moving free)")


def _matmul_transpose(
    c: str, dst: Tile, stationary: Tile, moving: Tile, version: int, k: int, m: int, n: int
) -> None:
    """The ``is_transpose=True`` form: ``dst = stationary.T`` with an identity ``moving``."""
    if version < 3:
        raise rule(c, "is_transpose=True needs NeuronCore-v3 or newer")
    if dst.dtype != stationary.dtype:
        raise rule(c, f"is_transpose: dst dtype {dst.dtype} != data dtype {stationary.dtype}")
    if not np.array_equal(_flat(moving, c), np.eye(k, n, dtype=np.float32)):
        raise rule(c, "is_transpose: moving must be an identity matrix")
    prof.matmul(k, m, n, fp32=False)
    T.assign(dst, stationary.array.T, T.PSUM_MATMUL)


def _matmul_add_mask(c: str, dst: Tile, accumulate: bool | None, version: int) -> np.ndarray:
    """Which ``dst`` locations the matmul adds onto (vs overwrites), per ``accumulate``."""
    state = T.acc_state(dst)
    if accumulate is None:
        add = state != T.PSUM_FRESH
        if (state == T.PSUM_READ).any():
            warnings.warn(
                f"{c}: accumulate=None adds onto a PSUM accumulation group whose result was "
                "already read out; if a new group was meant, pass accumulate=False (the "
                "compiler's inference may differ)",
                NkiAccumulationWarning,
                stacklevel=4,  # helper -> nc_matmul -> wrapper -> the kernel's call
            )
    elif accumulate:
        if (state == T.PSUM_FRESH).any():
            raise rule(
                c,
                "accumulate=True onto PSUM locations no matmul has written: undefined "
                "behaviour on hardware (start the group with accumulate=False)",
            )
        add = np.ones(dst.shape, bool)
    else:
        add = np.zeros(dst.shape, bool)
    if version < 4 and (add & (state == T.PSUM_OTHER)).any():
        raise rule(
            c,
            "accumulating onto PSUM locations a non-matmul instruction (memset, "
            "tensor_copy, ...) initialised: undefined behaviour on NeuronCore-v2/v3 "
            "(overwrite with accumulate=False)",
        )
    return add


@_dst_first(lambda a: a.get("moving") is None, _matmul_dst)
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
    perf_mode=matmul_perf_mode.none,
    name=None,
    _call: str = "nc_matmul",
) -> None:
    """``dst[M, N] (+)= stationary[K, M].T @ moving[K, N]`` on the Tensor Engine.

    SBUF inputs, PSUM fp32 dst; K <= 128, M <= 128, N <= 512; fp32 on both inputs
    or neither. ``accumulate``: ``False`` overwrites (starts an accumulation group),
    ``True`` adds onto what earlier matmuls wrote, ``None`` (default) overwrites the
    PSUM locations no matmul has written yet and accumulates onto the others. Adding
    onto a location never written (``True``), or onto one a non-matmul instruction
    wrote (``True``/``None``, NeuronCore-v2/v3), is undefined on hardware and raises.
    ``perf_mode=double_row`` (fp8, v3+): tiles ``[K, 2, M]`` / ``[K, 2, N]``.
    """
    c = _call
    _check_matmul_inputs(c, stationary, moving)
    double = perf_mode == matmul_perf_mode.double_row
    version = T.ctx().nc_version
    _check_matmul_layout(c, stationary, moving, double, version, tile_size)
    k, m = stationary.shape[0], stationary.shape[-1]
    k2, n = moving.shape[0], moving.shape[-1]
    rows, cols = _matmul_tile_limits(c, tile_position, tile_size, version)
    _check_matmul_sizes(c, k, k2, m, n, rows, cols)
    fp32 = (T.float32, T.tfloat32)
    _check_matmul_dtypes(c, stationary, moving, fp32)
    _check_matmul_dst(c, dst, m, n)
    if is_transpose:
        _matmul_transpose(c, dst, stationary, moving, version, k, m, n)
        return
    if dst.dtype != T.float32:
        raise rule(c, f"dst dtype {dst.dtype}: matmul results accumulate in a float32 PSUM tile")
    st = T.read(stationary, c).reshape(k, -1, m)
    mv = T.read(moving, c).reshape(k, -1, n)
    res = np.einsum("kim,kin->mn", st, mv, dtype=np.float32, optimize=True)
    add = _matmul_add_mask(c, dst, accumulate, version)
    if add.any():
        res = np.where(add, T.read(dst, c) + res, res)
    prof.matmul(k * (2 if double else 1), m, n, fp32=stationary.dtype in fp32)
    T.write(dst, res, c, T.PSUM_MATMUL)


def _transpose_dst(old: dict, dtype) -> Tile:
    d = old["data"]
    return Tile.allocate(d.shape[::-1], d.dtype if dtype is None else dtype, T.psum, "nc_transpose")


@_dst_first(lambda a: a.get("data") is None, _transpose_dst)
def nc_transpose(dst: Tile, data: Tile, engine: engine = engine.unknown, name=None) -> None:
    """``dst[F, P] = data[P, F].T``: Tensor Engine (P, F <= 128, dst in PSUM) or
    Vector Engine (``engine=vector``: P, F <= 32, dst in SBUF or PSUM)."""
    c = "nc_transpose"
    T.check_onchip(c, "data", data)
    T.check_onchip(c, "dst", dst)
    eng = _engine(engine, "tensor", ("tensor", "vector"), c)
    limit = 128 if eng == "tensor" else 32
    if data.ndim != 2 or data.shape[1] > limit or data.shape[0] > limit:
        raise rule(c, f"data {data.shape} must be 2-d with both sizes <= {limit} ({eng} engine)")
    if dst.shape != data.shape[::-1]:
        raise rule(c, f"dst shape {dst.shape} != {data.shape[::-1]}")
    if eng == "tensor":
        if dst.buffer != "psum":
            raise rule(c, f"dst is in {dst.buffer}; the Tensor Engine writes only to PSUM")
        prof.matmul(data.shape[0], data.shape[1], data.shape[0], fp32=data.dtype == T.float32)
        state = T.PSUM_MATMUL
    else:
        prof.vector(data.shape, 1, (data.dtype, dst.dtype))
        state = T.PSUM_OTHER
    T.write(dst, T.read(data, c).T, c, state)


# -- copies -------------------------------------------------------------------------


@_dst_first(lambda a: a.get("src") is None, _like("src"))
def tensor_copy(dst: Tile, src: Tile, engine: engine = engine.unknown, name=None) -> None:
    """``dst = src`` (bit exact for equal dtypes, else through fp32) on the Vector,
    Scalar or GpSimd Engine (GpSimd cannot access PSUM; Scalar only from v3 on)."""
    c = "tensor_copy"
    T.check_onchip(c, "src", src)
    T.check_onchip(c, "dst", dst)
    _same_layout(c, "dst", dst, "src", src)
    eng = _engine(engine, "vector", ("vector", "scalar", "gpsimd"), c)
    if eng == "gpsimd" and "psum" in (src.buffer, dst.buffer):
        raise rule(c, "the GpSimd Engine cannot access PSUM")
    if eng == "scalar" and T.ctx().nc_version == 2:
        raise rule(c, "NeuronCore-v2 has no tensor_copy on the Scalar Engine (use activation)")
    prof.engine_op(eng, src.shape, 1, (src.dtype, dst.dtype))
    if dst.dtype == src.dtype:
        T.assign(dst, T.note_read(src).reshape(dst.shape))
    else:
        T.write(dst, T.read(src, c).reshape(dst.shape), c)


def _memset_legacy(a: dict) -> bool:
    return isinstance(a.get("dst"), (tuple, list, int))


def _memset_dst(old: dict, dtype) -> Tile:
    raise rule("memset", "the old nisa.memset(shape, value, dtype) form: use nl.full")


@_dst_first(_memset_legacy, _memset_dst)
def memset(dst: Tile, value, engine: engine = engine.unknown, name=None) -> None:
    """Fill ``dst`` with the compile-time constant ``value`` (Vector or GpSimd Engine;
    packed x4 dtypes only with 0)."""
    c = "memset"
    T.check_onchip(c, "dst", dst)
    eng = _engine(engine, "vector", ("vector", "gpsimd"), c)
    if eng == "gpsimd" and dst.buffer == "psum":
        raise rule(c, "the GpSimd Engine cannot access PSUM")
    prof.engine_op(eng, dst.shape, 1, (dst.dtype,))
    if dst.dtype in T.PACKED:
        if value != 0:
            raise rule(c, f"packed {T.dtype_name(dst.dtype)} can only be memset to 0")
        T.assign(dst, np.zeros((), dst.dtype))
        return
    T.write(dst, np.full(dst.shape, value, np.float32), c)


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
        values = T.note_read(src).reshape(dst.shape)
    else:
        values = np.full(dst.shape, src, np.float32).astype(dst.dtype)
    pred = predicate.array.reshape(dst.shape) != 0
    if reverse_pred:
        pred = ~pred
    prof.vector(dst.shape, 2, (dst.dtype, predicate.dtype))
    dst.array[pred] = values[pred]
    T.mark(dst, T.PSUM_OTHER, pred)


def _dma_check(call: str, dst: Any, src: Any) -> None:
    for n, t in (("dst", dst), ("src", src)):
        if not isinstance(t, Tile):
            raise rule(call, f"{n} must be a tensor, got {type(t).__name__}")
        if t.buffer == "psum":
            raise rule(call, f"{n} is in PSUM; DMA moves data between HBM and SBUF")


def dma_copy(
    dst: Tile,
    src: Tile,
    dst_rmw_op=None,
    oob_mode=oob_mode.error,
    dge_mode=dge_mode.unknown,
    priority=None,
    engine=engine.unknown,
    name=None,
) -> None:
    """DMA ``src`` -> ``dst`` between HBM and SBUF (same number of elements); with
    ``dst_rmw_op`` (e.g. ``nl.add``) the DMA reads ``dst``, combines and writes."""
    c = "dma_copy"
    _dma_check(c, dst, src)
    if dst.array.size != src.array.size:
        raise rule(c, f"dst {dst.shape} and src {src.shape} differ in size")
    prof.dma(src.buffer, dst.buffer, src.array.nbytes)
    if dst_rmw_op is not None:
        res = _np_op(c, dst_rmw_op)(T.read(dst, c), T.read(src, c).reshape(dst.shape))
        T.write(dst, res, c)
    elif dst.dtype == src.dtype:
        T.assign(dst, src.array.reshape(dst.shape))
    else:
        T.write(dst, T.read(src, c).reshape(dst.shape), c)


_DMA_TRANSPOSE_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def dma_transpose(
    dst: Tile,
    src: Tile,
    axes=None,
    priority=None,
    dge_mode=dge_mode.unknown,
    oob_mode=oob_mode.error,
    name=None,
) -> None:
    """Transpose on the DMA engines, HBM or SBUF -> SBUF: 2-d ``(1, 0)``, 3-d
    ``(2, 1, 0)``, 4-d ``(3, 1, 2, 0)``; 2-byte dtypes, ``src.shape[-1] <= 128``;
    ``dge_mode=hwdge`` (v3+) also needs ``src.shape[0]`` 16 (2-d) or in
    {1, 2, 4, 8, 16} with ``src.shape[0] * src.shape[-2] % 16 == 0`` (3/4-d)."""
    c = "dma_transpose"
    _dma_check(c, dst, src)
    if dst.buffer != "sbuf":
        raise rule(c, f"dst is in {dst.buffer}; dma_transpose writes SBUF")
    if src.ndim not in _DMA_TRANSPOSE_AXES:
        raise rule(c, f"src {src.shape} must be 2-, 3- or 4-d")
    perm = _DMA_TRANSPOSE_AXES[src.ndim]
    if axes is not None and tuple(axes) != perm:
        raise rule(c, f"axes {tuple(axes)} unsupported for a {src.ndim}-d src; only {perm}")
    if src.dtype != dst.dtype:
        raise rule(c, f"src dtype {src.dtype} != dst dtype {dst.dtype}")
    if src.dtype.itemsize != 2:
        raise rule(c, f"src dtype {T.dtype_name(src.dtype)} must be 2 bytes")
    if src.shape[-1] > 128:
        raise rule(c, f"src.shape[-1] = {src.shape[-1]} > 128")
    if dge_mode not in (_DGE.unknown, _DGE.hwdge):
        raise rule(c, f"dge_mode {dge_mode} unsupported for a direct transpose")
    if dge_mode == _DGE.hwdge:
        if T.ctx().nc_version < 3:
            raise rule(c, "hardware DGE needs NeuronCore-v3 or newer")
        p0 = src.shape[0]
        ok = p0 == 16 if src.ndim == 2 else p0 in (1, 2, 4, 8, 16) and p0 * src.shape[-2] % 16 == 0
        if not ok:
            raise rule(c, f"hwdge: src.shape {src.shape} breaks the src.shape[0] rule")
    want = tuple(src.shape[a] for a in perm)
    if dst.shape != want:
        raise rule(c, f"dst shape {dst.shape} != {want} (src {src.shape} permuted {perm})")
    prof.dma(src.buffer, dst.buffer, src.array.nbytes)
    T.assign(dst, src.array.transpose(perm))


# -- scalar / vector engine -----------------------------------------------------------

ACTIVATIONS = (
    "exp",
    "log",
    "copy",
    "reciprocal",
    "negative",
    "abs",
    "rsqrt",
    "sqrt",
    "square",
    "silu",
    "sigmoid",
    "tanh",
    "relu",
    "gelu",
    "gelu_apprx_tanh",
    "softplus",
    "mish",
    "gelu_apprx_sigmoid",
    "silu_dx",
    "gelu_dx",
    "erf_dx",
    "erf",
    "sin",
    "cos",
    "sign",
    "bypass",
)


def _activation_dst(old: dict, dtype) -> Tile:
    data = old["op"]  # old form: activation(op, data, ...) binds data to the new ``op`` slot
    return Tile.allocate(data.shape, data.dtype if dtype is None else dtype, T.sbuf, "activation")


def _activation_legacy(new: dict) -> bool:
    return callable(new.get("dst")) and not isinstance(new.get("dst"), Tile)


def activation(
    dst: Tile | None = None,
    op=None,
    data: Tile | None = None,
    bias=None,
    scale=1.0,
    reduce_op=None,
    reduce_res: Tile | None = None,
    reduce_cmd: reduce_cmd = reduce_cmd.idle,
    name=None,
    dtype=None,
    mask=None,
):
    """``dst = op(data * scale + bias)`` on the Scalar Engine.

    ``bias``/``scale``: scalars or ``[P, 1]`` vectors. Optional free-axis sum of
    the result into the per-partition registers (``reduce_op=nl.add``), driven
    by ``reduce_cmd`` (reset / reduce / reset_reduce / idle); if ``reduce_res``
    (``[P, 1]``) is given the registers are read out into it. The old form
    ``activation(op, data, bias, scale, ..., dtype=)`` returns a new tile.
    """
    if mask is not None:
        raise rule("activation", "mask= (old-API predicates) is not modelled; slice instead")
    if dst is None:  # the old form with keywords: activation(op=, data=, ...)
        dst, op, data = op, data, None
    if _activation_legacy({"dst": dst}):
        old_op, old_data = dst, op
        if data is not None:  # third positional of the old form is the bias
            bias = data
        out = _activation_dst({"op": old_data}, dtype)
        _activation(out, old_op, old_data, bias, scale, reduce_op, reduce_res, reduce_cmd)
        return out
    if dtype is not None and T.as_dtype(dtype) != dst.dtype:
        raise rule("activation", f"dtype {dtype} != dst dtype {dst.dtype}")
    _activation(dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd)
    return None


def _activation(dst, op, data, bias, scale, reduce_op, reduce_res, cmd) -> None:
    c = "activation"
    T.check_onchip(c, "data", data)
    T.check_onchip(c, "dst", dst)
    _same_layout(c, "dst", dst, "data", data)
    if getattr(op, "__name__", None) not in ACTIVATIONS:
        raise rule(c, f"unsupported activation {op!r}; supported: {ACTIVATIONS}")
    p = data.shape[0]
    x = _flat(data, c) * _scalar_or_vector(c, "scale", scale, p)
    if bias is not None:
        x = x + _scalar_or_vector(c, "bias", bias, p)
    with np.errstate(all="ignore"):
        y = op._np(x).astype(np.float32)
    prof.scalar(data.shape)
    if reduce_op is not None or reduce_res is not None or cmd != reduce_cmd.idle:
        _registers(c, p, y, reduce_op, reduce_res, cmd, dst)
    else:
        T.write(dst, y.reshape(dst.shape), c)


def _registers(c: str, p: int, y: np.ndarray, reduce_op, reduce_res, cmd, dst) -> None:
    """Write ``dst`` first, then the registers into ``reduce_res`` (so a ``reduce_res``
    that aliases ``dst`` ends up holding the reduction, as on hardware)."""
    regs = T.ctx().act_regs
    if cmd in (reduce_cmd.reduce, reduce_cmd.reset_reduce) or reduce_res is not None:
        if reduce_op is not nl.add:
            raise rule(
                c, f"reduce_op must be nl.add (Scalar Engine registers sum), got {reduce_op}"
            )
    if reduce_res is not None:
        T.check_onchip(c, "reduce_res", reduce_res)
        if reduce_res.shape != (p, 1):
            raise rule(c, f"reduce_res must be [{p}, 1], got {reduce_res.shape}")
    T.write(dst, y.reshape(dst.shape), c)
    if cmd in (reduce_cmd.reset, reduce_cmd.reset_reduce):
        regs[:p] = 0.0
    if cmd in (reduce_cmd.reduce, reduce_cmd.reset_reduce):
        regs[:p] += y.sum(axis=1, dtype=np.float32)
    if reduce_res is not None:
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


REDUCE_FNS = {
    "add": np.sum,
    "sum": np.sum,
    "maximum": np.max,
    "max": np.max,
    "minimum": np.min,
    "min": np.min,
    "multiply": np.prod,
}


def tensor_reduce(
    dst: Tile | None = None,
    op=None,
    data: Tile | None = None,
    axis=None,
    negate: bool = False,
    keepdims: bool = False,
    name=None,
    dtype=None,
    mask=None,
):
    """``dst = op-reduce(data, axis)`` over the last free axes (``-`` if ``negate``);
    the old form ``tensor_reduce(op, data, axis, ...)`` returns a new tile."""
    if mask is not None:
        raise rule("tensor_reduce", "mask= (old-API predicates) is not modelled")
    if dst is None:  # the old form with keywords: tensor_reduce(op=, data=, axis=)
        dst, op, data = op, data, None
    if callable(dst) and not isinstance(dst, Tile):  # old form: (op, data, axis)
        op, data, axis = dst, op, data if axis is None else axis
        T.check_onchip("tensor_reduce", "data", data)
        axes = nl.check_free_axes("tensor_reduce", data, axis)
        if keepdims:
            shape = tuple(1 if i in axes else s for i, s in enumerate(data.shape))
        else:
            shape = tuple(s for i, s in enumerate(data.shape) if i not in axes)
        if len(shape) < 2:
            shape = (data.shape[0], 1)
        out = Tile.allocate(shape, data.dtype if dtype is None else dtype, T.sbuf, "tensor_reduce")
        _tensor_reduce(out, op, data, axis, negate, keepdims)
        return out
    _tensor_reduce(dst, op, data, axis, negate, keepdims)
    return None


def _tensor_reduce(dst, op, data, axis, negate, keepdims) -> None:
    c = "tensor_reduce"
    T.check_onchip(c, "data", data)
    T.check_onchip(c, "dst", dst)
    axes = nl.check_free_axes(c, data, axis)
    if sorted(axes) != list(range(data.ndim - len(axes), data.ndim)):
        raise rule(c, f"axis {axis} must be the last contiguous free axes of {data.shape}")
    opname = getattr(op, "__name__", None)
    if opname not in REDUCE_FNS:
        raise rule(c, f"unsupported reduce op {op!r}")
    res = REDUCE_FNS[opname](T.read(data, c), axis=axes, keepdims=keepdims)
    if negate:
        res = -res
    if dst.shape[0] != data.shape[0] or _elems(dst) != int(np.prod(res.shape[1:])):
        raise rule(c, f"dst {dst.shape} does not hold the reduction of {data.shape} over {axes}")
    prof.vector(data.shape, 1, (data.dtype, dst.dtype))
    T.write(dst, res.reshape(dst.shape), c)


def _ts_legacy(new: dict) -> bool:
    return callable(new.get("data")) and not isinstance(new.get("data"), Tile)


@_dst_first(_ts_legacy, _like("data"))
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
    """``dst = (data op0 operand0) op1 operand1``; operands scalars or ``[P, 1]`` vectors
    (Vector, Scalar or GpSimd Engine)."""
    c = "tensor_scalar"
    T.check_onchip(c, "data", data)
    T.check_onchip(c, "dst", dst)
    _same_layout(c, "dst", dst, "data", data)
    eng = _engine(engine, "vector", ("vector", "scalar", "gpsimd"), c)
    p = data.shape[0]
    x = _flat(data, c)
    raw = _raw_int(data)
    with np.errstate(all="ignore"):
        a = _scalar_or_vector(c, "operand0", operand0, p)
        x = _apply(c, op0, a, x, None, raw) if reverse0 else _apply(c, op0, x, a, raw, None)
        if op1 is not None:
            b = _scalar_or_vector(c, "operand1", operand1, p)
            raw1 = x.astype(np.int64) if getattr(op1, "_bitvec", False) else None
            x = _apply(c, op1, b, x, None, raw1) if reverse1 else _apply(c, op1, x, b, raw1, None)
        elif operand1 is not None:
            raise rule(c, "operand1 given without op1")
    prof.engine_op(eng, data.shape, 1, (data.dtype, dst.dtype))
    _write_flat(dst, x, c)


def _tt_legacy(new: dict) -> bool:
    return callable(new.get("data2")) and not isinstance(new.get("data2"), Tile)


@_dst_first(_tt_legacy, _like("data1", fp32_if=("data1", "data2")))
def tensor_tensor(
    dst: Tile, data1: Tile, data2: Tile, op, engine: engine = engine.unknown, name=None
) -> None:
    """``dst = data1 op data2`` elementwise; all three with the same layout, no broadcast;
    ``data1`` and ``data2`` not both in PSUM (Vector or GpSimd Engine)."""
    c = "tensor_tensor"
    for n, t in (("data1", data1), ("data2", data2), ("dst", dst)):
        T.check_onchip(c, n, t)
    _same_layout(c, "data1", data1, "data2", data2)
    _same_layout(c, "dst", dst, "data1", data1)
    if data1.buffer == "psum" and data2.buffer == "psum":
        raise rule(c, "data1 and data2 may not both be in PSUM")
    eng = _engine(engine, "vector", ("vector", "gpsimd"), c)
    if eng == "gpsimd" and "psum" in (data1.buffer, data2.buffer, dst.buffer):
        raise rule(c, "the GpSimd Engine cannot access PSUM")
    with np.errstate(all="ignore"):
        res = _apply(c, op, _flat(data1, c), _flat(data2, c), _raw_int(data1), _raw_int(data2))
    prof.engine_op(eng, data1.shape, 2, (data1.dtype, data2.dtype, dst.dtype))
    _write_flat(dst, res, c)


@_dst_first(_ts_legacy, _like("data"))
def scalar_tensor_tensor(
    dst: Tile,
    data: Tile,
    op0,
    operand0,
    op1,
    operand1: Tile,
    reverse0: bool = False,
    reverse1: bool = False,
    name=None,
) -> None:
    """``dst = (data op0 operand0) op1 operand1`` on the Vector Engine: ``operand0`` a
    scalar or ``[P, 1]`` vector, ``operand1`` a tile of ``data``'s layout; ``data`` and
    ``operand1`` not both in PSUM; arithmetic ops only (no bitvec)."""
    c = "scalar_tensor_tensor"
    T.check_onchip(c, "data", data)
    T.check_onchip(c, "dst", dst)
    T.check_onchip(c, "operand1", operand1)
    _same_layout(c, "dst", dst, "data", data)
    _same_layout(c, "operand1", operand1, "data", data)
    if data.buffer == "psum" and operand1.buffer == "psum":
        raise rule(c, "data and operand1 may not both be in PSUM")
    for n, op in (("op0", op0), ("op1", op1)):
        if getattr(op, "_bitvec", False):
            raise rule(c, f"{n} {op.__name__} is a bitvec op; only arithmetic ops are allowed")
    p = data.shape[0]
    with np.errstate(all="ignore"):
        a = _scalar_or_vector(c, "operand0", operand0, p)
        f0, f1 = _np_op(c, op0), _np_op(c, op1)
        x = _flat(data, c)
        x = f0(a, x) if reverse0 else f0(x, a)
        b = _flat(operand1, c)
        x = f1(b, x) if reverse1 else f1(x, b)
    prof.vector(data.shape, 2, (data.dtype, operand1.dtype, dst.dtype))
    _write_flat(dst, x, c)


@_dst_first(lambda a: a.get("data") is None, _like("data"))
def reciprocal(dst: Tile, data: Tile, name=None) -> None:
    """``dst = 1 / data`` on the Vector Engine (fp32 math; SBUF or PSUM)."""
    c = "reciprocal"
    T.check_onchip(c, "data", data)
    T.check_onchip(c, "dst", dst)
    _same_layout(c, "dst", dst, "data", data)
    with np.errstate(all="ignore"):
        res = np.float32(1.0) / _flat(data, c)
    prof.vector(data.shape, 1, (data.dtype, dst.dtype))
    _write_flat(dst, res, c)


def _scan_legacy(new: dict) -> bool:
    return callable(new.get("initial")) and not isinstance(new.get("initial"), Tile)


@_dst_first(_scan_legacy, _like("data0", fp32_if=("data0", "data1")))
def tensor_tensor_scan(
    dst: Tile,
    data0: Tile,
    data1: Tile,
    initial,
    op0,
    op1,
    reverse0: bool = False,
    reverse1: bool = False,
    name=None,
) -> None:
    """Per partition, over the free elements in order (fp32 state):
    ``r[i] = op1(op0(data0[i], r[i-1]), data1[i])`` with ``r[-1] = initial``
    (``reverse0``: ``op0(r[i-1], data0[i])``; ``reverse1``: ``op1(data1[i], .)``).
    ``initial``: a scalar or a ``[P, 1]`` tile; ``data0``/``data1`` not both in PSUM."""
    c = "tensor_tensor_scan"
    for n, t in (("data0", data0), ("data1", data1), ("dst", dst)):
        T.check_onchip(c, n, t)
    _same_layout(c, "data0", data0, "data1", data1)
    _same_layout(c, "dst", dst, "data0", data0)
    if data0.buffer == "psum" and data1.buffer == "psum":
        raise rule(c, "data0 and data1 may not both be in PSUM")
    p = data0.shape[0]
    state = np.broadcast_to(_scalar_or_vector(c, "initial", initial, p), (p, 1)).reshape(p)
    state = state.astype(np.float32)
    f0, f1 = _np_op(c, op0), _np_op(c, op1)
    x0, x1 = _flat(data0, c), _flat(data1, c)
    out = np.empty_like(x0)
    with np.errstate(all="ignore"):
        for i in range(x0.shape[1]):
            t = f0(state, x0[:, i]) if reverse0 else f0(x0[:, i], state)
            state = (f1(x1[:, i], t) if reverse1 else f1(t, x1[:, i])).astype(np.float32)
            out[:, i] = state
    prof.vector(data0.shape, 2, (data0.dtype, data1.dtype, dst.dtype))
    _write_flat(dst, out, c)


def _start_partition(t: Tile) -> int:
    row = t._storage.array.size // t._storage.array.shape[0]
    return (t.offset // row) if t.buffer.on_chip else 0


def nc_stream_shuffle(dst: Tile, src: Tile, shuffle_mask, name=None) -> None:
    """Cross-partition move inside each 32-partition quadrant (Vector Engine):
    ``dst[q*32 + i] = src[q*32 + shuffle_mask[i]]``; 255 leaves ``dst[q*32 + i]`` as is.
    Same dtype and elements per partition; start partitions follow the active-partition
    rule (96/128 active: 0; 64: 0 or 64; 32: 0, 32, 64 or 96)."""
    c = "nc_stream_shuffle"
    T.check_onchip(c, "src", src)
    T.check_onchip(c, "dst", dst)
    mask = [int(m) for m in shuffle_mask]
    if len(mask) != 32:
        raise rule(c, f"shuffle_mask has {len(mask)} entries; needs 32")
    if any(not (0 <= m < 32 or m == 255) for m in mask):
        raise rule(c, f"shuffle_mask {mask}: entries must be 0..31 or 255")
    if src.dtype != dst.dtype:
        raise rule(c, f"src dtype {src.dtype} != dst dtype {dst.dtype}")
    if _elems(src) != _elems(dst):
        raise rule(c, f"src {src.shape} and dst {dst.shape} differ in elements per partition")
    active = -(-max(src.shape[0], dst.shape[0]) // 32) * 32
    allowed = {128: (0,), 96: (0,), 64: (0, 64), 32: (0, 32, 64, 96)}[active]
    for n, t in (("src", src), ("dst", dst)):
        if _start_partition(t) not in allowed:
            raise rule(
                c,
                f"{n} starts at partition {_start_partition(t)}; with {active} active "
                f"partitions it must start at one of {allowed}",
            )
    x = T.note_read(src).reshape(src.shape[0], -1).copy()
    out = dst.array.reshape(dst.shape[0], -1).copy()
    for i in range(dst.shape[0]):
        m = mask[i % 32]
        if m == 255:
            continue
        j = (i // 32) * 32 + m
        if j >= src.shape[0]:
            raise rule(c, f"dst partition {i} reads src partition {j} of {src.shape[0]}")
        out[i] = x[j]
    prof.vector(src.shape, 1, (src.dtype, dst.dtype))
    T.assign(dst, out.reshape(dst.shape))


# -- Vector Engine accumulator instructions -------------------------------------------

FP32_MIN = float(np.finfo(np.float32).min)
_IDENTITY = {"add": 0.0, "subtract": 0.0, "multiply": 1.0, "maximum": -np.inf, "minimum": np.inf}
_ROW_REDUCE = {"add": np.sum, "multiply": np.prod, "maximum": np.max, "minimum": np.min}
_REDUCE_ALIASES = {"max": "maximum", "min": "minimum", "sum": "add"}


def _reduce_name(call: str, op, allowed: tuple[str, ...]) -> str:
    name = getattr(op, "__name__", None)
    name = _REDUCE_ALIASES.get(name, name)
    if name not in allowed:
        raise rule(call, f"reduce op {op!r} unsupported; one of {allowed}")
    return name


def _vec_accumulate(
    call: str, p: int, values: np.ndarray, op: str, cmd, init, reduce_res, negate=False
) -> None:
    """Fold ``values [P, F]`` into the Vector Engine's per-partition accumulators as
    ``cmd`` says, then read them out into ``reduce_res`` ``[P, 1]`` (if given)."""
    regs = T.ctx().vec_regs
    if cmd == reduce_cmd.idle:
        if reduce_res is not None:
            raise rule(call, "reduce_res given with reduce_cmd=idle")
        return
    if cmd == reduce_cmd.reset_reduce:
        regs[:p] = _IDENTITY[op]
    elif cmd == reduce_cmd.load_reduce:
        if init is None:
            raise rule(call, "reduce_cmd=load_reduce needs reduce_init")
        regs[:p] = np.broadcast_to(_scalar_or_vector(call, "reduce_init", init, p), (p, 1))[:, 0]
    elif cmd != reduce_cmd.reduce:
        raise rule(call, f"reduce_cmd {cmd} unsupported")
    part = _ROW_REDUCE[op](values, axis=1)
    regs[:p] = {
        "add": np.add,
        "multiply": np.multiply,
        "maximum": np.maximum,
        "minimum": np.minimum,
    }[op](regs[:p], part).astype(np.float32)
    if reduce_res is not None:
        T.check_onchip(call, "reduce_res", reduce_res)
        if reduce_res.shape[0] != p or _elems(reduce_res) != 1:
            raise rule(call, f"reduce_res must be [{p}, 1], got {reduce_res.shape}")
        out = -regs[:p] if negate else regs[:p]
        T.write(reduce_res, out.reshape(reduce_res.shape), call)


@_dst_first(_ts_legacy, _like("data"))
def tensor_scalar_reduce(
    dst: Tile,
    data: Tile,
    op0,
    operand0,
    reduce_op,
    reduce_res: Tile | None = None,
    reverse0: bool = False,
    reduce_cmd: reduce_cmd = reduce_cmd.reset_reduce,
    reduce_init=None,
    reduce_res_negate: bool = False,
    name=None,
) -> None:
    """``dst = data op0 operand0`` and a reduction (``add``/``multiply``/``max``/``min``)
    over all its free elements into the Vector Engine accumulators (``reduce_cmd``:
    ``reset_reduce`` / ``reduce`` / ``load_reduce`` from ``reduce_init``), read out into
    ``reduce_res`` ``[P, 1]`` when given (negated if ``reduce_res_negate``)."""
    c = "tensor_scalar_reduce"
    T.check_onchip(c, "data", data)
    T.check_onchip(c, "dst", dst)
    _same_layout(c, "dst", dst, "data", data)
    if getattr(op0, "_bitvec", False):
        raise rule(c, "op0 must be an arithmetic op (bitvec ops are not supported)")
    if reverse0:
        raise rule(c, "reverse0 is not supported yet (per the NKI 0.6 reference)")
    op = _reduce_name(c, reduce_op, ("add", "multiply", "maximum", "minimum"))
    if reduce_init is not None and reduce_cmd != _CMD.load_reduce:
        raise rule(c, "reduce_init is only for reduce_cmd=load_reduce")
    p = data.shape[0]
    with np.errstate(all="ignore"):
        x = _np_op(c, op0)(_flat(data, c), _scalar_or_vector(c, "operand0", operand0, p))
    prof.vector(data.shape, 1, (data.dtype, dst.dtype))
    _write_flat(dst, x, c)
    _vec_accumulate(
        c, p, x.astype(np.float32), op, reduce_cmd, reduce_init, reduce_res, reduce_res_negate
    )


def tensor_scalar_cumulative(
    dst: Tile,
    src: Tile,
    op0,
    op1,
    imm0,
    imm1=None,
    reduce_cmd: reduce_cmd = reduce_cmd.reset_reduce,
    name=None,
) -> None:
    """Running ``reg = op1(op0(src[i], imm0), reg)`` over the free elements, ``dst[i] = reg``
    (``reset_reduce``: reg = the identity of op1; ``load_reduce``: ``imm1``; ``reduce``:
    carry the Vector Engine accumulator). op1 in add/subtract/multiply/max/min; no
    int32/uint32 operands."""
    c = "tensor_scalar_cumulative"
    T.check_onchip(c, "src", src)
    T.check_onchip(c, "dst", dst)
    _same_layout(c, "dst", dst, "src", src)
    for n, t in (("src", src), ("dst", dst)):
        if t.dtype in (T.int32, T.uint32, T.tfloat32):
            raise rule(c, f"{n} dtype {T.dtype_name(t.dtype)} is not supported")
    name1 = _reduce_name(c, op1, ("add", "subtract", "multiply", "maximum", "minimum"))
    p = src.shape[0]
    regs = T.ctx().vec_regs
    if reduce_cmd == _CMD.reset_reduce:
        regs[:p] = _IDENTITY[name1]
    elif reduce_cmd == _CMD.load_reduce:
        if imm1 is None:
            raise rule(c, "reduce_cmd=load_reduce needs imm1")
        regs[:p] = np.broadcast_to(_scalar_or_vector(c, "imm1", imm1, p), (p, 1))[:, 0]
    elif reduce_cmd != _CMD.reduce:
        raise rule(c, f"reduce_cmd {reduce_cmd} unsupported")
    f0, f1 = _np_op(c, op0), _np_op(c, op1)
    a = np.broadcast_to(_scalar_or_vector(c, "imm0", imm0, p), (p, 1))[:, 0]
    x = _flat(src, c)
    out = np.empty_like(x)
    reg = regs[:p].astype(np.float32)
    with np.errstate(all="ignore"):
        for i in range(x.shape[1]):
            reg = np.asarray(f1(f0(x[:, i], a), reg), np.float32)
            out[:, i] = reg
    regs[:p] = reg
    prof.vector(src.shape, 1, (src.dtype, dst.dtype))
    _write_flat(dst, out, c)


def exponential(
    dst: Tile,
    src: Tile,
    max_value=0.0,
    reduce_res: Tile | None = None,
    reduce_cmd: reduce_cmd = reduce_cmd.idle,
    reduce_init=0.0,
    name=None,
) -> None:
    """``dst = exp(src - max_value)`` on the Vector Engine (NeuronCore-v4+), optionally
    summed into the accumulators (``reduce_cmd``) and read out into ``reduce_res``."""
    c = "exponential"
    if T.ctx().nc_version < 4:
        raise rule(c, "nisa.exponential is available only on NeuronCore-v4 and newer")
    T.check_onchip(c, "src", src)
    T.check_onchip(c, "dst", dst)
    _same_layout(c, "dst", dst, "src", src)
    p = src.shape[0]
    with np.errstate(all="ignore"):
        y = np.exp(_flat(src, c) - _scalar_or_vector(c, "max_value", max_value, p))
    prof.vector(src.shape, 1, (src.dtype, dst.dtype))
    _write_flat(dst, y, c)
    if reduce_cmd != _CMD.load_reduce and reduce_init not in (None, 0, 0.0):
        raise rule(c, "reduce_init must be unset or 0.0 unless reduce_cmd=load_reduce")
    _vec_accumulate(c, p, y.astype(np.float32), "add", reduce_cmd, reduce_init, reduce_res)


def select_reduce(
    dst: Tile,
    predicate: Tile,
    on_true: Tile,
    on_false,
    reduce_res: Tile | None = None,
    reduce_cmd: reduce_cmd = reduce_cmd.idle,
    reduce_op=nl.maximum,
    reverse_pred: bool = False,
    name=None,
) -> None:
    """``dst = where(predicate, on_true, on_false)`` (Vector Engine), with an optional
    max-reduction into the accumulators / ``reduce_res``. ``on_false``: a scalar or a
    ``[P, 1]`` vector; predicate an 8/16-bit integer tile; not both of ``on_true`` and
    ``predicate`` in PSUM."""
    c = "select_reduce"
    for n, t in (("dst", dst), ("predicate", predicate), ("on_true", on_true)):
        T.check_onchip(c, n, t)
    _same_layout(c, "dst", dst, "on_true", on_true)
    _same_layout(c, "dst", dst, "predicate", predicate)
    if predicate.dtype not in (T.int8, T.uint8, T.int16, T.uint16):
        raise rule(c, f"predicate dtype {predicate.dtype}; must be int8/uint8/int16/uint16")
    if on_true.dtype in (T.tfloat32, T.int32, T.uint32):
        raise rule(c, f"on_true dtype {T.dtype_name(on_true.dtype)} is not supported")
    if on_true.buffer == "psum" and predicate.buffer == "psum":
        raise rule(c, "on_true and predicate may not both be in PSUM")
    _reduce_name(c, reduce_op, ("maximum",))
    p = on_true.shape[0]
    pred = predicate.array.reshape(p, -1) != 0
    if reverse_pred:
        pred = ~pred
    res = np.where(pred, _flat(on_true, c), _scalar_or_vector(c, "on_false", on_false, p))
    prof.vector(on_true.shape, 2, (on_true.dtype, dst.dtype))
    _write_flat(dst, res, c)
    _vec_accumulate(c, p, res.astype(np.float32), "maximum", reduce_cmd, None, reduce_res)


def range_select(
    dst: Tile,
    on_true_tile: Tile,
    comp_op0,
    comp_op1,
    bound0: Tile,
    bound1: Tile,
    reduce_cmd: reduce_cmd = reduce_cmd.reset_reduce,
    reduce_res: Tile | None = None,
    reduce_op=nl.maximum,
    range_start: int = 0,
    on_false_value: float = FP32_MIN,
    name=None,
) -> None:
    """``dst = on_true`` where ``comp_op0(idx, bound0) & comp_op1(idx, bound1)`` with
    ``idx = range_start + free index`` (fp32), else ``on_false_value`` (must be FP32_MIN);
    a max-reduction into the accumulators / ``reduce_res``. NeuronCore-v3+."""
    c = "range_select"
    if T.ctx().nc_version < 3:
        raise rule(c, "range_select needs NeuronCore-v3 or newer")
    for n, t in (
        ("dst", dst),
        ("on_true_tile", on_true_tile),
        ("bound0", bound0),
        ("bound1", bound1),
    ):
        T.check_onchip(c, n, t)
    _same_layout(c, "dst", dst, "on_true_tile", on_true_tile)
    allowed = ("equal", "less", "less_equal", "greater", "greater_equal")
    for n, op in (("comp_op0", comp_op0), ("comp_op1", comp_op1)):
        if getattr(op, "__name__", None) not in allowed:
            raise rule(c, f"{n} must be one of {allowed}")
    if not T.is_float(on_true_tile.dtype):
        raise rule(c, f"on_true_tile dtype {on_true_tile.dtype} must be a float type")
    for n, t in (("bound0", bound0), ("bound1", bound1)):
        if t.dtype != T.float32:
            raise rule(c, f"{n} must be float32, got {T.dtype_name(t.dtype)}")
    if np.float32(on_false_value) != np.float32(FP32_MIN):
        raise rule(c, f"on_false_value must be FP32_MIN ({FP32_MIN}), got {on_false_value}")
    _reduce_name(c, reduce_op, ("maximum",))
    p = on_true_tile.shape[0]
    idx = np.float32(range_start) + np.arange(_elems(on_true_tile), dtype=np.float32)[None, :]
    b0 = _scalar_or_vector(c, "bound0", bound0, p)
    b1 = _scalar_or_vector(c, "bound1", bound1, p)
    keep = (comp_op0._np(idx, b0) != 0) & (comp_op1._np(idx, b1) != 0)
    res = np.where(keep, _flat(on_true_tile, c), np.float32(FP32_MIN))
    prof.vector(on_true_tile.shape, 1, (on_true_tile.dtype, dst.dtype))
    _write_flat(dst, res, c)
    _vec_accumulate(c, p, res.astype(np.float32), "maximum", reduce_cmd, None, reduce_res)


def bn_stats(dst: Tile, data: Tile, name=None) -> None:
    """Per partition, 6 values: count, mean and variance*count of the even elements, then
    of the odd elements (Vector Engine; <= 512 elements, ``nl.tile_size.bn_stats_fmax``)."""
    c = "bn_stats"
    T.check_onchip(c, "data", data)
    T.check_onchip(c, "dst", dst)
    if _elems(data) > 512:
        raise rule(c, f"data has {_elems(data)} elements per partition > 512 (bn_stats_fmax)")
    if dst.shape[0] != data.shape[0] or _elems(dst) != 6:
        raise rule(c, f"dst must hold 6 elements per partition of data, got {dst.shape}")
    x = _flat(data, c)
    out = []
    for half in (x[:, 0::2], x[:, 1::2]):
        n = half.shape[1]
        mean = half.mean(axis=1) if n else np.zeros(x.shape[0], np.float32)
        m2 = ((half - mean[:, None]) ** 2).sum(axis=1) if n else np.zeros_like(mean)
        out += [np.full(x.shape[0], n, np.float32), mean, m2]
    prof.vector(data.shape, 1, (data.dtype, dst.dtype))
    _write_flat(dst, np.stack(out, axis=1), c)


def bn_aggr(dst: Tile, data: Tile, name=None) -> None:
    """Combine ``(count, mean, variance*count)`` triples (from ``bn_stats``) into the mean
    and the (population) variance per partition (Vector Engine)."""
    c = "bn_aggr"
    T.check_onchip(c, "data", data)
    T.check_onchip(c, "dst", dst)
    if _elems(data) % 3:
        raise rule(c, f"data holds {_elems(data)} elements per partition; needs a multiple of 3")
    if dst.shape[0] != data.shape[0] or _elems(dst) != 2:
        raise rule(c, f"dst must hold 2 elements per partition, got {dst.shape}")
    t = _flat(data, c).reshape(data.shape[0], -1, 3).astype(np.float64)
    cnt, mean, m2 = t[..., 0], t[..., 1], t[..., 2]
    total = cnt.sum(axis=1)
    with np.errstate(all="ignore"):
        mu = (cnt * mean).sum(axis=1) / total
        var = (m2 + cnt * (mean - mu[:, None]) ** 2).sum(axis=1) / total
    prof.vector(data.shape, 1, (data.dtype, dst.dtype))
    _write_flat(dst, np.stack([mu, var], axis=1), c)


def tensor_partition_reduce(dst: Tile, op, data: Tile, name=None) -> None:
    """Reduce ``data [P, ...]`` across its partitions into ``dst [1, ...]`` on the GpSimd
    Engine: ``add``, ``average``, ``maximum``, ``bitwise_or``, ``bitwise_and``."""
    c = "tensor_partition_reduce"
    T.check_onchip(c, "data", data)
    T.check_onchip(c, "dst", dst)
    if "psum" in (data.buffer, dst.buffer):
        raise rule(c, "the GpSimd Engine cannot access PSUM")
    if dst.shape[0] != 1 or _elems(dst) != _elems(data):
        raise rule(c, f"dst must be [1, {_elems(data)} elements], got {dst.shape}")
    name_ = getattr(op, "__name__", None)
    name_ = _REDUCE_ALIASES.get(name_, name_)
    if name_ in ("bitwise_or", "bitwise_and"):
        raw = _raw_int(data)
        if raw is None:
            raise rule(c, f"{name_} needs an integer tile")
        fn = np.bitwise_or.reduce if name_ == "bitwise_or" else np.bitwise_and.reduce
        prof.gpsimd(data.shape)
        T.assign(dst, fn(raw, axis=0).astype(dst.dtype).reshape(dst.shape))
        return
    fns = {"add": np.sum, "average": np.mean, "maximum": np.max}
    if name_ not in fns:
        raise rule(c, f"op {op!r} unsupported; add, average, maximum, bitwise_or, bitwise_and")
    prof.gpsimd(data.shape)
    T.write(dst, fns[name_](_flat(data, c), axis=0).reshape(dst.shape), c)


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


def iota(dst: Tile, pattern, offset: int = 0, channel_multiplier: int = 0, name=None) -> None:
    """``dst[p, i] = offset + p * channel_multiplier + sum_k idx_k * step_k`` (int32 math);
    ``pattern = [[step, num], ...]`` innermost last. dst in SBUF."""
    T.check_onchip("iota", "dst", dst)
    prof.gpsimd(dst.shape)
    if dst.buffer != "sbuf":
        raise rule("iota", f"dst is in {dst.buffer}; iota writes SBUF")
    vals = _affine("iota", dst.shape, pattern, offset, channel_multiplier)
    if T.is_float(dst.dtype):
        T.write(dst, vals.astype(np.float32).reshape(dst.shape), "iota")
    else:
        T.assign(dst, vals.astype(np.int32).astype(dst.dtype).reshape(dst.shape))


def affine_select(
    dst: Tile,
    pattern,
    channel_multiplier: int,
    on_true_tile: Tile,
    on_false_value: float,
    cmp_op=nl.equal,
    offset: int = 0,
    name=None,
) -> None:
    """``dst = on_true_tile`` where ``cmp_op(affine, 0)`` else ``on_false_value``; the
    affine value is the one ``iota`` would generate."""
    c = "affine_select"
    T.check_onchip(c, "dst", dst)
    T.check_onchip(c, "on_true_tile", on_true_tile)
    _same_layout(c, "dst", dst, "on_true_tile", on_true_tile)
    if dst.buffer == "psum" or on_true_tile.buffer == "psum":
        raise rule(c, "the GpSimd Engine cannot access PSUM")
    aff = _affine(c, dst.shape, pattern, offset, channel_multiplier)
    prof.gpsimd(dst.shape)
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
    prof.vector(src.shape, 1, (src.dtype,))
    T.write(dst, top, "max8")


def nc_match_replace8(
    dst: Tile, data: Tile, vals: Tile, imm: float, dst_idx: Tile | None = None, name=None
) -> None:
    """``dst`` = ``data`` with the first occurrence of each of the 8 ``vals`` replaced by
    ``imm`` (Vector Engine), vals taken in reverse order (7..0) so duplicate vals pair
    with successive occurrences, the first one in the highest slot; ``dst_idx``
    (``[P, 8]``, uint16/uint32) gets the matched positions (all-ones when unmatched)."""
    c = "nc_match_replace8"
    for n, t in (("data", data), ("vals", vals), ("dst", dst)):
        T.check_onchip(c, n, t)
    _check8(c, "data", data)
    _same_layout(c, "dst", dst, "data", data)
    if _elems(vals) != 8 or vals.shape[0] != data.shape[0]:
        raise rule(c, f"vals must hold 8 values per partition of data, got {vals.shape}")
    if dst_idx is not None:
        T.check_onchip(c, "dst_idx", dst_idx)
        if dst_idx.shape != (data.shape[0], 8) or dst_idx.dtype not in (T.uint16, T.uint32):
            raise rule(c, f"dst_idx must be [{data.shape[0]}, 8] uint16/uint32")
    x, v = _flat(data, c).copy(), _flat(vals, c)
    idx = np.full(v.shape, -1, np.int64)
    for p in range(x.shape[0]):
        for j in range(7, -1, -1):
            hits = np.flatnonzero(x[p] == v[p, j])
            if hits.size:
                idx[p, j] = hits[0]
                x[p, hits[0]] = np.float32(imm)
    prof.vector(data.shape, 1, (data.dtype, dst.dtype))
    _write_flat(dst, x, c)
    if dst_idx is not None:
        ones = np.iinfo(dst_idx.dtype).max
        T.assign(dst_idx, np.where(idx < 0, ones, idx).astype(dst_idx.dtype))


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
    prof.vector(data.shape, 1, (data.dtype,))
    T.assign(dst, out.astype(dst.dtype))
