"""Tiles and buffers of the NumPy NKI executor.

A :class:`Tile` is a view into a storage (one NumPy array) that lives in one
buffer: ``hbm`` / ``shared_hbm`` (device memory, any shape) or on chip,
``sbuf`` / ``psum`` (axis 0 is the partition axis, <= 128, and at least one
free axis). Values are stored in their NKI dtype (bf16/fp16 through
``ml_dtypes``) and every write rounds to it. On-chip tiles start filled with
NaN (floats) or the dtype's max (integers), so reading before writing shows.
Per-partition SBUF/PSUM use is accounted per kernel launch.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import ml_dtypes
import numpy as np

from kernels.nki.executor.errors import rule

# dtypes are NumPy dtypes; nl.bfloat16 etc. are these objects. fp8 types are the
# ml_dtypes formats the SDK's own simulator stores them in (float8_e4m3 is the
# legacy IEEE-style format with inf, max 240; float8_e4m3fn has no inf, max 448).
float32 = np.dtype(np.float32)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
float8_e8m0fnu = np.dtype(ml_dtypes.float8_e8m0fnu)
# tfloat32 (1S,8E,10M) is stored in 32 bits: a one-field record over float32 so it is a
# dtype of its own; writes round the mantissa to 10 bits (nearest, ties to even).
tfloat32 = np.dtype([("tfloat32", "<f4")])
# x4 packed MX types: 4 fp8 values in 32 bits, 4 fp4 values in 16 bits (storage only).
float8_e4m3fn_x4 = np.dtype([("float8_e4m3fn_x4", "<u4")])
float8_e5m2_x4 = np.dtype([("float8_e5m2_x4", "<u4")])
float4_e2m1fn_x4 = np.dtype([("float4_e2m1fn_x4", "<u2")])
PACKED = {
    float8_e4m3fn_x4: np.dtype(ml_dtypes.float8_e4m3fn),
    float8_e5m2_x4: np.dtype(ml_dtypes.float8_e5m2),
    float4_e2m1fn_x4: np.dtype(ml_dtypes.float4_e2m1fn),
}
int32 = np.dtype(np.int32)
uint32 = np.dtype(np.uint32)
int16 = np.dtype(np.int16)
uint16 = np.dtype(np.uint16)
int8 = np.dtype(np.int8)
uint8 = np.dtype(np.uint8)
bool_ = uint8
FP8 = (float8_e4m3, float8_e4m3fn, float8_e5m2)
SUPPORTED_DTYPES = (
    float32,
    bfloat16,
    float16,
    tfloat32,
    *FP8,
    float8_e8m0fnu,
    *PACKED,
    int32,
    uint32,
    int16,
    uint16,
    int8,
    uint8,
)
DTYPE_NAMES = {
    d: n
    for n, d in (
        ("float32", float32),
        ("bfloat16", bfloat16),
        ("float16", float16),
        ("tfloat32", tfloat32),
        ("float8_e4m3", float8_e4m3),
        ("float8_e4m3fn", float8_e4m3fn),
        ("float8_e5m2", float8_e5m2),
        ("float8_e8m0fnu", float8_e8m0fnu),
        ("float8_e4m3fn_x4", float8_e4m3fn_x4),
        ("float8_e5m2_x4", float8_e5m2_x4),
        ("float4_e2m1fn_x4", float4_e2m1fn_x4),
        ("int32", int32),
        ("uint32", uint32),
        ("int16", int16),
        ("uint16", uint16),
        ("int8", int8),
        ("uint8", uint8),
    )
}

FLOATS = (float32, bfloat16, float16, tfloat32, *FP8, float8_e8m0fnu)

PMAX = 128
PSUM_TILE_BYTES = 2 * 1024  # one PSUM bank per partition
PSUM_PARTITION_BYTES = 16 * 1024  # 8 banks
# SBUF per partition: 192 KiB on NeuronCore-v2 (24 MiB), 224 KiB on v3 (28 MiB, Trn2 guide).
SBUF_PARTITION_BYTES_BY_VERSION = {2: 192 * 1024, 3: 224 * 1024, 4: 224 * 1024}
SBUF_PARTITION_BYTES = SBUF_PARTITION_BYTES_BY_VERSION[3]

# PSUM accumulation state of every byte (see nisa.nc_matmul's ``accumulate``)
PSUM_FRESH, PSUM_MATMUL, PSUM_OTHER, PSUM_READ = 0, 1, 2, 3  # READ: matmul-written, then read

_TARGETS = {"trn1": 2, "inf2": 2, "gen2": 2, "trn2": 3, "gen3": 3, "trn3": 4, "gen4": 4}


def target_version() -> int:
    """NeuronCore generation the executor models: ``NEURON_PLATFORM_TARGET_OVERRIDE``
    (``trn1|inf2|gen2``, ``trn2|gen3``, ``trn3|gen4``, as in the SDK), default Trn2 (3)."""
    value = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "").strip().lower()
    if not value:
        return 3
    if value not in _TARGETS:
        raise rule(
            "NEURON_PLATFORM_TARGET_OVERRIDE",
            f"unknown target {value!r}; one of {sorted(_TARGETS)}",
        )
    return _TARGETS[value]


class Buffer(str):
    """A memory: ``nl.sbuf``, ``nl.psum``, ``nl.hbm``, ``nl.shared_hbm``, ``nl.private_hbm``."""

    @property
    def on_chip(self) -> bool:
        return self in ("sbuf", "psum")


sbuf = Buffer("sbuf")
psum = Buffer("psum")
hbm = Buffer("hbm")
shared_hbm = Buffer("shared_hbm")
private_hbm = Buffer("private_hbm")
BUFFERS = {b: b for b in (sbuf, psum, hbm, shared_hbm, private_hbm)}


class LaunchContext:
    """Per-launch state: on-chip memory use, grid position, shared outputs, registers,
    the NeuronCore generation modelled."""

    def __init__(self, grid: tuple[int, ...] = (1,)):
        self.grid = grid
        self.program = (0,) * len(grid)
        self.used = {"sbuf": 0, "psum": 0}
        self.shared: list[Tile] = []
        self.shared_pos = 0
        self.act_regs = np.zeros(PMAX, dtype=np.float32)  # Scalar Engine accumulators
        self.vec_regs = np.zeros(PMAX, dtype=np.float32)  # Vector Engine accumulators
        self.nc_version = target_version()
        self.sbuf_limit = SBUF_PARTITION_BYTES_BY_VERSION[self.nc_version]


_CTX = [LaunchContext()]


def ctx() -> LaunchContext:
    return _CTX[-1]


def _release(context: LaunchContext, buffer: str, nbytes: int) -> None:
    context.used[buffer] -= nbytes


def as_dtype(dtype: Any) -> np.dtype:
    d = np.dtype(dtype)
    if d == np.float64:
        raise rule("dtype", "float64 is not supported on Trainium (use float32)")
    if d not in SUPPORTED_DTYPES:
        raise rule("dtype", f"{d} is not a supported NKI dtype")
    return d


def dtype_name(dtype: np.dtype) -> str:
    return DTYPE_NAMES.get(np.dtype(dtype), str(dtype))


def partition_bytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize


def is_float(dtype: np.dtype) -> bool:
    return np.dtype(dtype) in FLOATS


def _fill(array: np.ndarray, fill: Any) -> None:
    d = array.dtype
    if d in PACKED:
        bits = array.view(np.dtype(f"u{d.itemsize}"))
        bits[...] = np.iinfo(bits.dtype).max if fill is None else int(fill)
    elif d == tfloat32:
        array.view(np.float32)[...] = np.nan if fill is None else fill
    elif fill is None:  # new memory reads as NaN (floats) / dtype max (ints)
        array[...] = np.nan if is_float(d) else np.iinfo(d).max
    else:
        array[...] = fill


class _Storage:
    """One allocation; frees its on-chip bytes when the last view goes away. PSUM
    storages carry one accumulation-state byte per data byte."""

    def __init__(self, array: np.ndarray, buffer: Buffer, call: str, nbytes: int | None = None):
        self.array = array
        self.buffer = buffer
        self.acc = np.zeros(array.nbytes, np.uint8) if buffer == "psum" else None
        if buffer.on_chip:
            context = ctx()
            if nbytes is None:
                nbytes = partition_bytes(array.shape, array.dtype)
            limit = context.sbuf_limit if buffer == "sbuf" else PSUM_PARTITION_BYTES
            if context.used[buffer] + nbytes > limit:
                raise rule(
                    call,
                    f"allocating {nbytes} B per partition in {buffer} exceeds the "
                    f"{limit // 1024} KiB per partition of {buffer} "
                    f"({context.used[buffer]} B already live)",
                )
            context.used[buffer] += nbytes
            weakref.finalize(self, _release, context, str(buffer), nbytes)


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class Tile:
    """An NKI tensor (``nl.NkiTensor``): a view of a storage in one buffer.

    Attributes: ``shape``, ``dtype`` (NumPy dtype), ``buffer``, ``ndim``, ``size``,
    ``strides`` / ``offset`` (in elements of the storage), ``name``. Indexing with
    ints (negative too), slices (with steps), ``nl.ds`` and old-API ``nl.arange``
    index expressions returns views; so do ``reshape``, ``ap``, ``view``, ``permute``,
    ``broadcast``, ``expand_dim``, ``squeeze_dim``, ``reshape_dim``, ``flatten_dims``,
    ``slice`` and ``select``.
    """

    __slots__ = ("_storage", "array", "buffer", "name", "pdim", "__weakref__")

    def __init__(self, storage: _Storage, array: np.ndarray, name: str = "", pdim: int = 0):
        self._storage = storage
        self.array = array
        self.buffer = storage.buffer
        self.name = name
        self.pdim = pdim  # the partition axis: 0, except old-API block tensors

    # -- construction -------------------------------------------------------
    @classmethod
    def allocate(
        cls,
        shape,
        dtype,
        buffer: Buffer,
        call: str = "ndarray",
        fill: Any = None,
        name: str = "",
        account: bool = True,
    ) -> Tile:
        shape_in = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
        marked = [i for i, s in enumerate(shape_in) if type(s).__name__ == "ParDim"]
        shape = tuple(int(s) for s in shape_in)
        dtype = as_dtype(dtype)
        buffer = BUFFERS.get(buffer, buffer)
        if buffer not in BUFFERS:
            raise rule(call, f"unknown buffer {buffer!r}")
        if marked and marked[0] > 0 and BUFFERS[buffer].on_chip:
            return cls._allocate_blocks(shape, marked[0], dtype, BUFFERS[buffer], call, fill, name)
        if any(s <= 0 for s in shape):
            raise rule(call, f"shape {shape} has an empty or negative dimension")
        if buffer.on_chip:
            check_onchip_shape(call, "tile", shape)
            if buffer == "psum" and partition_bytes(shape, dtype) > PSUM_TILE_BYTES:
                raise rule(
                    call,
                    f"PSUM tile {shape} {dtype_name(dtype)} holds "
                    f"{partition_bytes(shape, dtype)} B per partition > {PSUM_TILE_BYTES} B "
                    "(one 2 KiB PSUM bank)",
                )
        array = np.empty(shape, dtype)
        _fill(array, fill)
        return cls(_Storage(array, buffer, call, None if account else 0), array, name)

    @classmethod
    def _allocate_blocks(cls, shape, k: int, dtype, buffer: Buffer, call, fill, name) -> Tile:
        """Old API: block dims before ``nl.par_dim(p)`` (``(n, par_dim(128), f)``). The
        old compiler allocated (and rotated) such blocks itself, so one block is what
        counts: it must fit (2 KiB per partition in PSUM) and is what is accounted
        live. Stored partition-first, the tile's ``pdim`` is ``k``."""
        block = (shape[k],) + shape[k + 1 :]
        check_onchip_shape(call, "block", block if len(block) > 1 else block + (1,))
        if buffer == "psum" and partition_bytes(block, dtype) > PSUM_TILE_BYTES:
            raise rule(
                call,
                f"PSUM block {block} {dtype_name(dtype)} holds {partition_bytes(block, dtype)} "
                f"B per partition > {PSUM_TILE_BYTES} B (one 2 KiB PSUM bank)",
            )
        array = np.empty((shape[k],) + shape[:k] + shape[k + 1 :], dtype)
        _fill(array, fill)
        storage = _Storage(array, buffer, call, nbytes=partition_bytes(block, dtype))
        order = list(range(1, k + 1)) + [0] + list(range(k + 1, len(shape)))
        return cls(storage, array.transpose(order), name, pdim=k)

    @classmethod
    def wrap(cls, array: np.ndarray, buffer: Buffer = hbm) -> Tile:
        return cls(_Storage(array, buffer, "wrap"), array)

    # -- properties ---------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    @property
    def ndim(self) -> int:
        return self.array.ndim

    @property
    def size(self) -> int:
        return int(self.array.size)

    @property
    def strides(self) -> tuple[int, ...]:
        """Element strides of the view (NumPy's byte strides / itemsize)."""
        return tuple(s // self.array.itemsize for s in self.array.strides)

    @property
    def offset(self) -> int:
        """Element offset of the view's first element in its storage."""
        return (_addr(self.array) - _addr(self._storage.array)) // self.array.itemsize

    def __repr__(self) -> str:
        return f"Tile(shape={self.shape}, dtype={dtype_name(self.dtype)}, buffer={self.buffer})"

    def _view(self, array: np.ndarray, pdim: int = 0) -> Tile:
        return Tile(self._storage, array, self.name, pdim)

    # -- data-dependent control flow cannot compile ---------------------------
    def _no_value(self, what: str):
        raise rule(
            what,
            f"a tile's value is not known when the kernel is compiled; {what}() of {self!r} "
            "would be data-dependent Python control flow (use nl.where / predicated copies)",
        )

    def __bool__(self):
        self._no_value("bool")

    def __int__(self):
        self._no_value("int")

    def __float__(self):
        self._no_value("float")

    def __index__(self):
        self._no_value("index")

    def __len__(self):
        return self.shape[0]

    def __iter__(self):
        raise rule("iter", f"cannot iterate over {self!r}; loop with nl.affine_range")

    # -- views --------------------------------------------------------------
    def _key(self, key) -> tuple:
        if not isinstance(key, tuple):
            key = (key,)
        if any(k is Ellipsis for k in key):
            i = next(i for i, k in enumerate(key) if k is Ellipsis)
            fill = (slice(None),) * (self.ndim - len(key) + 1)
            key = key[:i] + fill + key[i + 1 :]
        if len(key) > self.ndim:
            raise rule("index", f"{len(key)} indices for a {self.ndim}-d tensor {self.shape}")
        out = []
        for axis, k in enumerate(key):
            size = self.shape[axis]
            if isinstance(k, DynSlice):
                k = slice(k.start, k.start + k.size)
            elif hasattr(k, "as_slice"):  # old-API nl.arange / nl.mgrid index expression
                k = k.as_slice(axis)
            if isinstance(k, Tile):
                k.__index__()
            if isinstance(k, slice):
                step = 1 if k.step is None else int(k.step)
                if step < 1:
                    raise rule("index", f"axis {axis}: slice step {step} must be >= 1")
                start = 0 if k.start is None else int(k.start)
                stop = size if k.stop is None else int(k.stop)
                start = start + size if start < 0 else start
                stop = stop + size if stop < 0 else stop
                if not 0 <= start < stop <= size:
                    raise rule(
                        "index",
                        f"axis {axis}: slice {start}:{stop} is empty or outside [0, {size}) "
                        f"of tensor {self.shape}",
                    )
                out.append(slice(start, stop, step))
            else:
                i = int(k)
                i = i + size if i < 0 else i
                if not 0 <= i < size:
                    raise rule("index", f"axis {axis}: index {int(k)} outside [0, {size})")
                # on chip an integer on the partition axis keeps a size-1 partition dim
                on_p = axis == self.pdim and self.buffer.on_chip
                out.append(slice(i, i + 1) if on_p else i)
        return tuple(out)

    def __getitem__(self, key) -> Tile:
        keys = key if isinstance(key, tuple) else (key,)
        if any(hasattr(k, "values") and hasattr(k, "as_slice") for k in keys):
            return self._affine_view(keys)
        norm = self._key(key)
        view = self.array[norm]
        pdim = self.pdim - sum(isinstance(k, int) for k in norm[: self.pdim])
        if self.buffer.on_chip and view.ndim < 2:
            view = view.reshape(view.shape[0], 1)  # on-chip views are at least 2-d
        return self._view(view, pdim)

    def _affine_view(self, keys: tuple) -> Tile:
        """Old-API indexing with ``nl.arange`` / ``nl.mgrid`` expressions: the element
        address must be affine in the index grid; the result is that strided view,
        shaped like the broadcast grid (ints select, slices are not mixed in)."""
        if len(keys) != self.ndim:
            raise rule("index", f"{len(keys)} indices for a {self.ndim}-d tensor {self.shape}")
        exprs = []
        for axis, k in enumerate(keys):
            if isinstance(k, (int, np.integer)):
                exprs.append(np.array(int(k) + (self.shape[axis] if k < 0 else 0)))
            elif hasattr(k, "values"):
                exprs.append(k.values)
            else:
                raise rule("index", f"axis {axis}: mix arange index expressions with ints only")
        try:
            grid = np.broadcast_shapes(*(e.shape for e in exprs))
        except ValueError as exc:
            raise rule("index", f"index expressions do not broadcast: {exc}") from exc
        vals = [np.broadcast_to(e, grid) for e in exprs]
        for axis, v in enumerate(vals):
            if v.size and (v.min() < 0 or v.max() >= self.shape[axis]):
                raise rule(
                    "index",
                    f"axis {axis}: index expression reaches [{v.min()}, {v.max()}] outside "
                    f"[0, {self.shape[axis]}) of tensor {self.shape}",
                )
        strides = self.strides
        addr = sum(v.astype(np.int64) * s for v, s in zip(vals, strides, strict=True))
        addr = np.broadcast_to(np.asarray(addr, np.int64), grid)
        base = int(addr.reshape(-1)[0]) if addr.size else 0
        coef = []
        for g, n in enumerate(grid):
            unit = [0] * len(grid)
            if n > 1:
                unit[g] = 1
                coef.append(int(addr[tuple(unit)]) - base)
            else:
                coef.append(0)
        idx = np.indices(grid).reshape(len(grid), -1) if grid else np.zeros((0, 1), np.int64)
        want = base + (np.asarray(coef, np.int64)[:, None] * idx).sum(axis=0)
        if not np.array_equal(addr.reshape(-1), want):
            raise rule("index", "index expressions are not affine in the index grid")
        if self.buffer.on_chip:
            pv = vals[self.pdim]
            p_only_first = len(grid) >= 2 and all(
                np.all(pv == pv.take([0], axis=g)) for g in range(1, len(grid))
            )
            free_not_first = all(
                np.all(v == v.take([0], axis=0)) for a, v in enumerate(vals) if a != self.pdim
            )
            if not (p_only_first and free_not_first):
                raise rule(
                    "index",
                    "on chip the partition index must vary along the first grid axis only",
                )
        item = self.array.itemsize
        view = np.lib.stride_tricks.as_strided(
            _offset(self.array, base), shape=grid, strides=[c * item for c in coef]
        )
        return self._view(view)

    def __setitem__(self, key, value) -> None:
        dst = self[key]
        if not dst.buffer.on_chip:
            raise rule("setitem", "assign into HBM with nl.store / nisa.dma_copy")
        if (
            isinstance(value, Tile)
            and _addr(value.array) == _addr(dst.array)
            and value.array.strides == dst.array.strides
            and value.shape == dst.shape
        ):
            return  # ``t[k] += v`` writes the updated view back onto itself
        if isinstance(value, Tile):
            check_onchip("setitem", "value", value)
            write(dst, read(value), "setitem")
        else:
            write(dst, np.full(dst.shape, float(value), np.float32), "setitem")

    # -- the old API's operators: ``a + b`` etc. are nl.add etc. ------------------------
    __array_ufunc__ = None  # NumPy scalars on the left defer to the reflected operators

    def _op(self, name: str, other, reverse: bool = False):
        from kernels.nki.executor import language as nl

        fn = getattr(nl, name)
        return fn(other, self) if reverse else fn(self, other)

    def __add__(self, o):
        return self._op("add", o)

    def __radd__(self, o):
        return self._op("add", o, True)

    def __sub__(self, o):
        return self._op("subtract", o)

    def __rsub__(self, o):
        return self._op("subtract", o, True)

    def __mul__(self, o):
        return self._op("multiply", o)

    def __rmul__(self, o):
        return self._op("multiply", o, True)

    def __truediv__(self, o):
        return self._op("divide", o)

    def __rtruediv__(self, o):
        return self._op("divide", o, True)

    def __iadd__(self, o):
        """Old API ``psum[...] += nisa.nc_matmul(...)``: on a PSUM tile the first write to a
        location overwrites and later ones accumulate (a matmul accumulation group);
        elsewhere ``nl.add`` written back in place."""
        if self.buffer != "psum" or not isinstance(o, Tile):
            res = self._op("add", o)
            write(self, read(res), "iadd")
            return self
        check_onchip("iadd", "value", o)
        fresh = acc_state(self) == PSUM_FRESH
        old = np.where(fresh, np.float32(0.0), read(self))
        write(self, old + read(o).reshape(self.shape), "iadd", PSUM_MATMUL)
        return self

    def broadcast_to(self, shape) -> Tile:
        """Old API: ``t.broadcast_to(shape)`` is ``nl.broadcast_to(t, shape)``."""
        from kernels.nki.executor import language as nl

        return nl.broadcast_to(self, shape)

    def __neg__(self):
        from kernels.nki.executor import language as nl

        return nl.negative(self)

    def __lt__(self, o):
        return self._op("less", o)

    def __le__(self, o):
        return self._op("less_equal", o)

    def __gt__(self, o):
        return self._op("greater", o)

    def __ge__(self, o):
        return self._op("greater_equal", o)

    def _check_partition_kept(self, call: str, shape: tuple[int, ...]) -> None:
        if self.buffer.on_chip:
            check_onchip_shape(call, "tile", shape)
            if shape[0] != self.shape[0]:
                raise rule(
                    call,
                    f"on-chip {call} must keep the partition dim {self.shape[0]}, got {shape}",
                )

    def reshape(self, shape) -> Tile:
        shape = tuple(int(s) for s in shape)
        if int(np.prod(shape)) != self.array.size:
            raise rule("reshape", f"cannot reshape {self.shape} to {shape}")
        self._check_partition_kept("reshape", shape)
        view = self.array.view()
        try:
            view.shape = shape
        except AttributeError as exc:
            raise rule("reshape", f"{self!r} is not contiguous; cannot view as {shape}") from exc
        return self._view(view)

    def ap(
        self,
        pattern,
        offset: int | None = None,
        scalar_offset: Tile | None = None,
        vector_offset: Tile | None = None,
        indirect_dim: int = 0,
        dtype=None,
    ) -> Tile:
        """An explicit access pattern ``[[stride, count], ...]`` (elements) over the
        storage, from the view's offset (+ ``offset``, + ``scalar_offset`` times the
        stride of ``indirect_dim``); ``dtype`` reinterprets the storage bytes."""
        base = self._storage.array
        if not base.flags.c_contiguous:
            raise rule("ap", f"the storage of {self!r} is not contiguous")
        flat = base.reshape(-1)
        if dtype is not None:
            new = as_dtype(dtype)
            if flat.nbytes % new.itemsize:
                raise rule("ap", f"storage of {flat.nbytes} B is no whole number of {new}")
            flat = flat.view(np.uint8).view(new)
        item = flat.itemsize
        pat = [(int(s), int(n)) for s, n in pattern]
        if not pat or any(n < 1 for _, n in pat):
            raise rule("ap", f"pattern {pattern} needs >= 1 [stride, count] pairs, counts >= 1")
        start = (_addr(self.array) - _addr(base)) // item + (0 if offset is None else int(offset))
        if vector_offset is not None:
            raise rule("ap", "vector_offset (per-partition indirect DMA) is not modelled")
        if scalar_offset is not None:
            if not 0 <= indirect_dim < len(pat):
                raise rule("ap", f"indirect_dim {indirect_dim} outside the pattern")
            idx = read(scalar_offset).reshape(-1)[0]
            start += int(idx) * pat[indirect_dim][0]
        lo = start + sum(min(0, (n - 1) * s) for s, n in pat)
        hi = start + sum(max(0, (n - 1) * s) for s, n in pat)
        if lo < 0 or hi >= flat.size:
            raise rule(
                "ap",
                f"pattern {pattern} from element {start} reaches [{lo}, {hi}], outside the "
                f"{flat.size} elements of the storage",
            )
        if self.buffer.on_chip:
            row = flat.size // base.shape[0]
            reach = sum(abs(s) * (n - 1) for s, n in pat[1:])
            if pat[0][0] % row or (start % row) + reach >= row or len(pat) < 2:
                raise rule(
                    "ap",
                    f"on-chip pattern {pattern}: the first pair must step whole partitions "
                    f"(stride multiple of {row}) and the others stay inside one partition",
                )
        view = np.lib.stride_tricks.as_strided(
            flat[start:], shape=[n for _, n in pat], strides=[s * item for s, _ in pat]
        )
        return self._view(view)

    def get_pattern(self) -> list[list[int]]:
        """The view's access pattern ``[[stride, count], ...]`` in elements."""
        return [[s, n] for s, n in zip(self.strides, self.shape, strict=True)]

    def is_contiguous(self) -> bool:
        """Free dims (and for HBM the partition dim too) cover storage row-major."""
        first = 1 if self.buffer.on_chip else 0
        expect = 1
        for s, n in reversed(list(zip(self.strides, self.shape, strict=True))[first:]):
            if n != 1 and s != expect:
                return False
            expect *= n
        return True

    def is_indirect(self) -> bool:
        return False

    def view(self, dtype) -> Tile:
        """Reinterpret the bytes as ``dtype`` (last dim scaled by the size ratio)."""
        new = as_dtype(dtype)
        try:
            arr = self.array.view(new)
        except ValueError as exc:
            raise rule("view", f"{self!r} as {dtype_name(new)}: {exc}") from exc
        return self._view(arr)

    reinterpret_cast = view

    def _dim(self, call: str, dim: int, allow_partition: bool = False) -> int:
        nd = self.ndim
        if not -nd <= dim < nd:
            raise rule(call, f"dim {dim} outside the {nd}-d tensor {self.shape}")
        dim %= nd
        if dim == 0 and self.buffer.on_chip and not allow_partition:
            raise rule(call, f"on-chip tensors keep their partition dim 0 ({self!r})")
        return dim

    def permute(self, dims) -> Tile:
        dims = tuple(int(d) for d in dims)
        if sorted(dims) != list(range(self.ndim)):
            raise rule("permute", f"{dims} is not a permutation of {self.ndim} dims")
        if self.buffer.on_chip and dims[0] != 0:
            raise rule("permute", f"on-chip tensors keep the partition dim first, got {dims}")
        return self._view(self.array.transpose(dims))

    def broadcast(self, dim: int, size: int) -> Tile:
        dim = self._dim("broadcast", dim)
        if self.shape[dim] != 1:
            raise rule("broadcast", f"dim {dim} of {self.shape} has size {self.shape[dim]} != 1")
        shape = list(self.shape)
        shape[dim] = int(size)
        strides = list(self.array.strides)
        strides[dim] = 0
        arr = np.lib.stride_tricks.as_strided(self.array, shape, strides, writeable=False)
        return self._view(arr)

    def expand_dim(self, dim: int) -> Tile:
        if not 0 <= dim <= self.ndim or (dim == 0 and self.buffer.on_chip):
            raise rule("expand_dim", f"cannot insert a dim at {dim} of {self!r}")
        return self._view(np.expand_dims(self.array, dim))

    def squeeze_dim(self, dim: int) -> Tile:
        dim = self._dim("squeeze_dim", dim)
        if self.shape[dim] != 1:
            raise rule("squeeze_dim", f"dim {dim} of {self.shape} is not 1")
        return self._view(np.squeeze(self.array, dim))

    def reshape_dim(self, dim: int, shape) -> Tile:
        shape = [int(s) for s in shape]
        dim = self._dim("reshape_dim", dim, allow_partition=len(shape) == 1)
        if shape.count(-1) == 1:
            known = int(np.prod([s for s in shape if s != -1]))
            shape[shape.index(-1)] = self.shape[dim] // max(known, 1)
        if int(np.prod(shape)) != self.shape[dim]:
            raise rule("reshape_dim", f"{shape} does not split dim {dim} of {self.shape}")
        new = self.shape[:dim] + tuple(shape) + self.shape[dim + 1 :]
        return self._view(self.array.reshape(new))

    def flatten_dims(self, start_dim: int, end_dim: int) -> Tile:
        start = self._dim("flatten_dims", start_dim)
        end = self._dim("flatten_dims", end_dim, allow_partition=True)
        if end < start:
            raise rule("flatten_dims", f"end_dim {end_dim} < start_dim {start_dim}")
        new = (
            self.shape[:start]
            + (int(np.prod(self.shape[start : end + 1])),)
            + self.shape[end + 1 :]
        )
        view = self.array.view()
        try:
            view.shape = new
        except AttributeError as exc:
            raise rule(
                "flatten_dims", f"dims {start}..{end} of {self!r} are not contiguous"
            ) from exc
        return self._view(view)

    def slice(self, dim: int, start: int, end: int, step: int = 1) -> Tile:
        dim = self._dim("slice", dim, allow_partition=True)
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim: int, index) -> Tile:
        dim = self._dim("select", dim, allow_partition=not self.buffer.on_chip)
        if isinstance(index, Tile):  # dynamic: the executor reads the index now
            index = int(read(index).reshape(-1)[0])
        key: list[Any] = [slice(None)] * self.ndim
        key[dim] = int(index)
        return self[tuple(key)]


class DynSlice:
    """``nl.ds(start, size)``: the slice ``start:start+size``."""

    __slots__ = ("start", "size")

    def __init__(self, start: int, size: int):
        self.start, self.size = int(start), int(size)


def check_onchip_shape(call: str, name: str, shape: tuple[int, ...]) -> None:
    if len(shape) < 2:
        raise rule(
            call,
            f"{name} shape {shape} has {len(shape)} dim(s); SBUF/PSUM tiles need >= 2 dims "
            "(partition axis + free axes)",
        )
    if shape[0] > PMAX:
        raise rule(
            call,
            f"{name} shape {shape} has partition dim {shape[0]} > {PMAX} (nl.tile_size.pmax)",
        )


def _offset(a: np.ndarray, elements: int) -> np.ndarray:
    """A 1-element view ``elements`` items past ``a``'s first element."""
    line = np.lib.stride_tricks.as_strided(a, shape=(elements + 1,), strides=(a.itemsize,))
    return line[elements:]


def check_onchip(call: str, name: str, t: Any) -> Tile:
    if not isinstance(t, Tile):
        raise rule(call, f"{name} must be a tile, got {type(t).__name__}")
    if t.pdim != 0:
        raise rule(
            call,
            f"{name} {t!r} has block dims before its partition dim; index them first",
        )
    if not t.buffer.on_chip:
        raise rule(
            call,
            f"{name} is in {t.buffer}; compute engines read/write only SBUF or PSUM "
            "(nl.load it first)",
        )
    return t


def _packed(call: str, t: Tile) -> None:
    raise rule(
        call,
        f"{dtype_name(t.dtype)} is a packed MX dtype: only copies, memset(0) and .view() "
        "handle it here (nc_matmul_mx / quantize_mx are not modelled)",
    )


def note_read(t: Tile) -> np.ndarray:
    """``t``'s raw array; reading matmul results out of PSUM is remembered (an
    accumulation group that was read and is then accumulated onto with
    ``accumulate=None`` draws a warning in ``nc_matmul``)."""
    if t._storage.acc is not None:
        state = acc_bytes(t)
        state[state == PSUM_MATMUL] = PSUM_READ
    return t.array


def read(t: Tile, call: str = "read") -> np.ndarray:
    """The tile's values as float32 (how the engines compute)."""
    if t.dtype in PACKED:
        _packed(call, t)
    note_read(t)
    if t.dtype == tfloat32:
        return t.array.view(np.float32).astype(np.float32)
    return t.array.astype(np.float32)


def round_tf32(values: np.ndarray) -> np.ndarray:
    """float32 -> the nearest tfloat32 (10 mantissa bits, ties to even), as float32."""
    v = np.ascontiguousarray(values, np.float32)
    bits = v.view(np.uint32).astype(np.uint64)
    lsb = (bits >> 13) & 1
    rounded = ((bits + 0xFFF + lsb) & ~np.uint64(0x1FFF)).astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(v), rounded, v)


def acc_bytes(t: Tile) -> np.ndarray:
    """The PSUM accumulation-state bytes of a view: shape ``t.shape + (itemsize,)``."""
    st = t._storage
    off = _addr(t.array) - _addr(st.array)
    return np.lib.stride_tricks.as_strided(
        st.acc[off:],
        shape=t.array.shape + (t.array.itemsize,),
        strides=t.array.strides + (1,),
    )


def mark(dst: Tile, state: int, where: np.ndarray | None = None) -> None:
    """Record who last wrote ``dst`` (PSUM only): a matmul or another instruction."""
    if dst._storage.acc is None:
        return
    view = acc_bytes(dst)
    if where is None:
        view[...] = state
    else:
        view[np.broadcast_to(where, dst.shape)] = state


def acc_state(t: Tile) -> np.ndarray:
    """Per-element PSUM state (``PSUM_FRESH`` / ``PSUM_MATMUL`` / ``PSUM_OTHER``)."""
    return acc_bytes(t)[..., 0]


def assign(dst: Tile, values: np.ndarray, state: int = PSUM_OTHER) -> None:
    """Bit-exact write of values already in ``dst.dtype``."""
    dst.array[...] = values
    mark(dst, state)


def write(dst: Tile, values: np.ndarray, call: str, state: int = PSUM_OTHER) -> None:
    """Write ``values`` into ``dst``, rounding to its dtype (shape must hold the same
    elements per partition). Floats round to nearest-even (``ml_dtypes``); float to
    integer rounds to nearest-even and saturates (NaN -> 0)."""
    values = np.asarray(values)
    if dst.dtype in PACKED:
        _packed(call, dst)
    if values.shape != dst.shape:
        same_p = values.ndim >= 1 and dst.ndim >= 1 and values.shape[0] == dst.shape[0]
        if same_p and values.size == dst.array.size:
            values = values.reshape(dst.shape)
        else:
            raise rule(call, f"result shape {values.shape} does not fit dst {dst.shape}")
    if dst.dtype == tfloat32:
        dst.array.view(np.float32)[...] = round_tf32(values.astype(np.float32))
    elif dst.dtype.kind in "iu" and not is_float(dst.dtype):
        if values.dtype.kind == "f" or is_float(values.dtype):
            info = np.iinfo(dst.dtype)
            with np.errstate(invalid="ignore"):
                v = np.clip(np.rint(values.astype(np.float64)), info.min, info.max)
            values = np.nan_to_num(v, nan=0.0)
        dst.array[...] = values.astype(dst.dtype)
    else:
        dst.array[...] = values.astype(np.float32).astype(dst.dtype)
    mark(dst, state)
