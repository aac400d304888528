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

import weakref
from typing import Any

import ml_dtypes
import numpy as np

from kernels.nki.executor.errors import rule

# dtypes are NumPy dtypes; nl.bfloat16 etc. are these objects
float32 = np.dtype(np.float32)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
int32 = np.dtype(np.int32)
uint32 = np.dtype(np.uint32)
int16 = np.dtype(np.int16)
uint16 = np.dtype(np.uint16)
int8 = np.dtype(np.int8)
uint8 = np.dtype(np.uint8)
bool_ = uint8
SUPPORTED_DTYPES = (float32, bfloat16, float16, int32, uint32, int16, uint16, int8, uint8)

PMAX = 128
PSUM_TILE_BYTES = 2 * 1024  # one PSUM bank per partition
PSUM_PARTITION_BYTES = 16 * 1024  # 8 banks
SBUF_PARTITION_BYTES = 192 * 1024  # trn1/trn2: 24 MiB / 128 partitions


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
    """Per-launch state: on-chip memory use, grid position, shared outputs, registers."""

    def __init__(self, grid: tuple[int, ...] = (1,)):
        self.grid = grid
        self.program = (0,) * len(grid)
        self.used = {"sbuf": 0, "psum": 0}
        self.shared: list[Tile] = []
        self.shared_pos = 0
        self.act_regs = np.zeros(PMAX, dtype=np.float32)


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


def partition_bytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize


def is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype == bfloat16


def _fill_value(dtype: np.dtype):
    return np.nan if is_float(dtype) else np.iinfo(dtype).max


class _Storage:
    """One allocation; frees its on-chip bytes when the last view goes away."""

    def __init__(self, array: np.ndarray, buffer: Buffer, call: str):
        self.array = array
        self.buffer = buffer
        if buffer.on_chip:
            context = ctx()
            nbytes = partition_bytes(array.shape, array.dtype)
            limit = SBUF_PARTITION_BYTES if buffer == "sbuf" else PSUM_PARTITION_BYTES
            if context.used[buffer] + nbytes > limit:
                raise rule(
                    call,
                    f"allocating {nbytes} B per partition in {buffer} exceeds the "
                    f"{limit // 1024} KiB per partition of {buffer} "
                    f"({context.used[buffer]} B already live)",
                )
            context.used[buffer] += nbytes
            weakref.finalize(self, _release, context, str(buffer), nbytes)


class Tile:
    """An NKI tensor: a view of a storage in one buffer.

    Attributes: ``shape``, ``dtype`` (NumPy dtype), ``buffer``, ``ndim``.
    Indexing with ints, slices and ``nl.ds`` returns views; ``reshape`` too.
    """

    __slots__ = ("_storage", "array", "buffer", "__weakref__")

    def __init__(self, storage: _Storage, array: np.ndarray):
        self._storage = storage
        self.array = array
        self.buffer = storage.buffer

    # -- construction -------------------------------------------------------
    @classmethod
    def allocate(
        cls, shape, dtype, buffer: Buffer, call: str = "ndarray", fill: Any = None
    ) -> Tile:
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        dtype = as_dtype(dtype)
        buffer = BUFFERS.get(buffer, buffer)
        if buffer not in BUFFERS:
            raise rule(call, f"unknown buffer {buffer!r}")
        if any(s <= 0 for s in shape):
            raise rule(call, f"shape {shape} has an empty or negative dimension")
        if buffer.on_chip:
            check_onchip_shape(call, "tile", shape)
            if buffer == "psum" and partition_bytes(shape, dtype) > PSUM_TILE_BYTES:
                raise rule(
                    call,
                    f"PSUM tile {shape} {dtype} holds {partition_bytes(shape, dtype)} B per "
                    f"partition > {PSUM_TILE_BYTES} B (one 2 KiB PSUM bank)",
                )
        if fill is None:  # new memory reads as NaN (floats) / dtype max (ints)
            fill = _fill_value(dtype)
        array = np.full(shape, fill, dtype)
        return cls(_Storage(array, buffer, call), array)

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

    def __repr__(self) -> str:
        return f"Tile(shape={self.shape}, dtype={self.dtype}, buffer={self.buffer})"

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
            if isinstance(k, Tile):
                k.__index__()
            if isinstance(k, slice):
                if k.step not in (None, 1):
                    raise rule("index", f"axis {axis}: strided slices (step {k.step}) unsupported")
                start = 0 if k.start is None else int(k.start)
                stop = size if k.stop is None else int(k.stop)
                if not 0 <= start < stop <= size:
                    raise rule(
                        "index",
                        f"axis {axis}: slice {start}:{stop} is empty or outside [0, {size}) "
                        f"of tensor {self.shape}",
                    )
                out.append(slice(start, stop))
            else:
                i = int(k)
                if not 0 <= i < size:
                    raise rule("index", f"axis {axis}: index {i} outside [0, {size})")
                out.append(i)
        return tuple(out)

    def __getitem__(self, key) -> Tile:
        view = self.array[self._key(key)]
        if self.buffer.on_chip and view.ndim < 2:
            raise rule(
                "index",
                f"indexing {self!r} with {key!r} leaves a {view.ndim}-d on-chip tile; "
                "SBUF/PSUM tiles need a partition axis and a free axis (slice, don't index)",
            )
        return Tile(self._storage, view)

    def __setitem__(self, key, value) -> None:
        dst = self[key]
        if not dst.buffer.on_chip:
            raise rule("setitem", "assign into HBM with nl.store / nisa.dma_copy")
        if isinstance(value, Tile):
            check_onchip("setitem", "value", value)
            write(dst, read(value), "setitem")
        else:
            write(dst, np.full(dst.shape, float(value), np.float32), "setitem")

    def reshape(self, shape) -> Tile:
        shape = tuple(int(s) for s in shape)
        if int(np.prod(shape)) != self.array.size:
            raise rule("reshape", f"cannot reshape {self.shape} to {shape}")
        if self.buffer.on_chip:
            check_onchip_shape("reshape", "tile", shape)
            if shape[0] != self.shape[0]:
                raise rule(
                    "reshape",
                    f"on-chip reshape must keep the partition dim {self.shape[0]}, got {shape}",
                )
        view = self.array.view()
        try:
            view.shape = shape
        except AttributeError as exc:
            raise rule("reshape", f"{self!r} is not contiguous; cannot view as {shape}") from exc
        return Tile(self._storage, view)


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


def check_onchip(call: str, name: str, t: Any) -> Tile:
    if not isinstance(t, Tile):
        raise rule(call, f"{name} must be a tile, got {type(t).__name__}")
    if not t.buffer.on_chip:
        raise rule(
            call,
            f"{name} is in {t.buffer}; compute engines read/write only SBUF or PSUM "
            "(nl.load it first)",
        )
    return t


def read(t: Tile) -> np.ndarray:
    """The tile's values as float32 (how the engines compute)."""
    return t.array.astype(np.float32)


def write(dst: Tile, values: np.ndarray, call: str) -> None:
    """Write ``values`` into ``dst``, rounding to its dtype (shape must hold the same
    elements per partition)."""
    values = np.asarray(values)
    if values.shape != dst.shape:
        same_p = values.ndim >= 1 and dst.ndim >= 1 and values.shape[0] == dst.shape[0]
        if same_p and values.size == dst.array.size:
            values = values.reshape(dst.shape)
        else:
            raise rule(call, f"result shape {values.shape} does not fit dst {dst.shape}")
    if dst.dtype.kind in "iu" and values.dtype.kind == "f":
        info = np.iinfo(dst.dtype)
        with np.errstate(invalid="ignore"):
            values = np.clip(np.rint(values), info.min, info.max)
        values = np.nan_to_num(values, nan=0.0)
    dst.array[...] = values.astype(dst.dtype)
