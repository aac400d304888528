"""``nki.jit`` and grid launch (``kernel[grid](...)``) for the NumPy NKI executor.

Tensor arguments (torch tensors or NumPy arrays) become HBM tensors that share
memory with the caller's array where possible (so a kernel may update an
input in place); float64 is rejected. The kernel runs once per program of the
grid (``kernel[n]``: in NKI 0.6 the LNC degree, here n SPMD programs), in
row-major order; what it returns (tensors allocated in ``nl.shared_hbm``) comes
back as torch tensors if any argument was a torch tensor, else as NumPy arrays
(as ``nki.simulate`` does).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import numpy as np
import torch

from kernels.nki.executor import profile as prof
from kernels.nki.executor import tiles as T
from kernels.nki.executor.errors import rule
from kernels.nki.executor.tiles import Tile

_TORCH_TO_NP = {
    torch.float32: T.float32,
    torch.float16: T.float16,
    torch.bfloat16: T.bfloat16,
    torch.float8_e4m3fn: T.float8_e4m3fn,
    torch.float8_e5m2: T.float8_e5m2,
    torch.int32: T.int32,
    torch.int16: T.int16,
    torch.int8: T.int8,
    torch.uint8: T.uint8,
    torch.uint16: T.uint16,
    torch.uint32: T.uint32,
}
_NP_TO_TORCH = {v: k for k, v in _TORCH_TO_NP.items()}


def to_hbm(name: str, x: Any) -> Any:
    """A kernel argument as an HBM tensor (non-tensors pass through)."""
    if isinstance(x, Tile):
        return x
    if isinstance(x, torch.Tensor):
        if x.dtype not in _TORCH_TO_NP:
            raise rule(
                "jit",
                f"argument {name!r} has dtype {x.dtype}; supported: float32, bfloat16, "
                "float16, float8_e4m3fn, float8_e5m2, int32, int16, int8, uint32, uint16, "
                "uint8 (float64/int64 do not exist on Trainium)",
            )
        if x.device.type != "cpu":
            raise rule("jit", f"argument {name!r} is on {x.device}; the executor runs on the CPU")
        t = x.detach()
        np_dtype = _TORCH_TO_NP[t.dtype]
        if t.dtype.itemsize <= 2 and t.dtype.is_floating_point and t.dtype != torch.float16:
            bits = torch.int16 if t.dtype.itemsize == 2 else torch.uint8
            arr = t.view(bits).numpy().view(np_dtype)
        else:
            arr = t.numpy()
        return Tile.wrap(arr, T.hbm)
    if isinstance(x, np.ndarray):
        if x.dtype == np.float64:
            raise rule("jit", f"argument {name!r} is float64; Trainium has no float64")
        T.as_dtype(x.dtype)
        return Tile.wrap(x, T.hbm)
    return x


def to_torch(x: Any) -> Any:
    if isinstance(x, Tile):
        arr = np.ascontiguousarray(x.array)
        target = _NP_TO_TORCH.get(arr.dtype)
        if target is None:
            raise rule("jit", f"output dtype {T.dtype_name(arr.dtype)} has no torch dtype")
        if target.itemsize <= 2 and target.is_floating_point and target != torch.float16:
            bits = np.int16 if target.itemsize == 2 else np.uint8
            return torch.from_numpy(arr.view(bits).copy()).view(target)
        return torch.from_numpy(arr.copy())
    if isinstance(x, (tuple, list)):
        return type(x)(to_torch(v) for v in x)
    return x


def to_numpy(x: Any) -> Any:
    if isinstance(x, Tile):
        return np.ascontiguousarray(x.array).copy()
    if isinstance(x, (tuple, list)):
        return type(x)(to_numpy(v) for v in x)
    return x


class Kernel:
    """A jitted kernel; call it directly (grid ``(1,)``) or as ``kernel[grid](...)``."""

    def __init__(self, fn, grid: tuple[int, ...] = (1,)):
        self.fn = fn
        self.grid = grid
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid) -> Kernel:
        grid = (grid,) if isinstance(grid, int) else tuple(int(g) for g in grid)
        if not grid or any(g < 1 for g in grid):
            raise rule("jit", f"grid {grid} must be positive")
        return Kernel(self.fn, grid)

    def __call__(self, *args, **kwargs):
        names = self.fn.__code__.co_varnames
        use_torch = any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))
        args = tuple(to_hbm(names[i] if i < len(names) else str(i), a) for i, a in enumerate(args))
        kwargs = {k: to_hbm(k, v) for k, v in kwargs.items()}
        context = T.LaunchContext(self.grid)
        T._CTX.append(context)
        try:
            result = None
            for pid in itertools.product(*(range(g) for g in self.grid)):
                context.program = pid
                context.shared_pos = 0
                prof.launch()
                result = self.fn(*args, **kwargs)
        finally:
            T._CTX.pop()
        return to_torch(result) if use_torch else to_numpy(result)


def jit(fn=None, *, mode: str | None = None, **options):
    """``@nki.jit`` / ``@nki.jit(mode=...)``: make a kernel launchable on the executor."""
    if fn is None:
        return lambda f: Kernel(f)
    return Kernel(fn)


def simulate(kernel) -> Kernel:
    """``nki.simulate(kernel)(*args)``: run ``kernel`` (jitted or a plain function) on
    the executor; NumPy in, NumPy out; torch in, torch out."""
    return kernel if isinstance(kernel, Kernel) else Kernel(kernel)
