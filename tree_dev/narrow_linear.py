"""fp32 ``nn.Linear`` layers of a CPU model through a GEMM for a few rows.

A decode step feeds every linear layer one row, a small tree's verify forward or a
draft level a few (one per node). PyTorch's CPU ``linear`` (MKL's SGEMM, on this
project's AMD EPYC machines its AVX2 code) costs much more at 2-5 rows than at 1,
in a single layer and in a whole small target forward (most of which is
``aten::mm``). So a tree step costs far more than a plain one, and under sampling,
where trees accept few tokens per step, no tree paid for itself (figures:
docs/design_figures.md, "Narrow linear").

``narrow_gemm`` (``tree_dev/csrc/narrow_gemm.c``, AVX2 + FMA, built on first use
with the system C compiler) packs each weight once into panels of 16 output columns
and streams a panel once per block of up to 4 rows with the rows' sums in registers:
at 1-4 rows it costs about what 1 row does, and it stays well below MKL up to a few
blocks of rows (measured side by side; figures: docs/design_figures.md, "Narrow
linear").

Same fp32 arithmetic (no reduced-precision shortcut): each output is one sequential
FMA sum over the input features, so only the rounding differs from MKL, and a row's
result does not depend on how many rows share the call (batch invariant).

``use_narrow_linears(model)`` switches a model's layers in place (their modules'
``forward``) for inputs of at most ``max_rows`` rows, calling the layer's previous
``forward`` (``F.linear``, or ``tree_dev.onednn_linear``'s) for more;
``restore_narrow_linears(model)`` switches them back. Where the CPU has no AVX2/FMA,
is not x86, or no C compiler builds the kernel, ``narrow_available()`` is False and
nothing is switched.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import types
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = [
    "MAX_ROWS",
    "narrow_available",
    "narrow_gemm",
    "pack_weight",
    "restore_narrow_linears",
    "use_narrow_linears",
]

# more rows: the general GEMM's blocking wins on some shapes (docs/design_figures.md,
# "Narrow linear")
MAX_ROWS = 24
PANEL = 16  # output columns per packed panel (two AVX2 vectors), as in the C source
_SOURCE = Path(__file__).with_name("csrc") / "narrow_gemm.c"
_FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")
_BUILD_LOCK = threading.Lock()


def _cache_dir() -> Path:
    root = os.environ.get("TREESPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "treespec"
    )
    return Path(root)


def _build(source: Path, out: Path) -> None:
    """Compile ``source`` into the shared library ``out``, atomically (a temporary
    file in the same folder, then renamed: a concurrent or interrupted build never
    leaves a half-written library behind)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name, suffix=".tmp")
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *_FLAGS, "-o", tmp, str(source)], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {source}: {proc.stderr.strip()[:2000]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """The compiled kernel (built once per source version into the cache folder), or
    None where it cannot run here (the reason is kept in ``_why_unavailable``)."""
    global _why_unavailable
    if platform.machine().lower() not in ("x86_64", "amd64"):
        _why_unavailable = f"not an x86-64 CPU ({platform.machine()})"
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    if not (capability == "AVX2" or capability.startswith("AVX512")):
        _why_unavailable = f"torch reports CPU capability {capability!r}, not AVX2/AVX-512"
        return None
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()
    path = _cache_dir() / f"narrow_gemm-{digest[:16]}.so"
    try:
        with _BUILD_LOCK:
            if not path.exists():
                _build(_SOURCE, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as exc:
        _why_unavailable = str(exc)
        return None
    fn = lib.narrow_gemm
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr]
    fn.restype = None
    _why_unavailable = ""
    return lib


_why_unavailable = ""


def narrow_available() -> bool:
    """Whether the kernel runs here (x86-64 with AVX2 + FMA, and it was built)."""
    return _library() is not None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's weight ``[N, K]`` (fp32, CPU) as ``narrow_gemm``'s panels
    ``[ceil(N/16), K, 16]``: column block ``b`` holds outputs ``16b..16b+15`` (zero
    padding past ``N``), for ``k`` ascending.

    >>> pack_weight(torch.ones(20, 3)).shape
    torch.Size([2, 3, 16])
    """
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(
            f"weight: expected a 2-D fp32 CPU tensor, got shape {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device}"
        )
    n, k = weight.shape
    blocks = -(-n // PANEL)
    padded = torch.zeros(blocks * PANEL, k, dtype=torch.float32)
    padded[:n] = weight.detach()
    return padded.view(blocks, PANEL, k).transpose(1, 2).contiguous()


def narrow_gemm(
    x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T + bias`` for a few rows, with ``W`` given as ``pack_weight(W)``.

    Args:
        x: ``[M, K]`` fp32 CPU activations (any ``M``; meant for ``M <= MAX_ROWS``).
        panels: ``[ceil(N/16), K, 16]`` fp32, from ``pack_weight``.
        out_features: ``N``, the weight's rows.
        bias: ``[N]`` fp32 or None.

    Returns:
        ``[M, N]`` fp32.

    >>> w = torch.randn(20, 8); x = torch.randn(3, 8)
    >>> torch.allclose(narrow_gemm(x, pack_weight(w), 20), x @ w.T, atol=1e-5)
    True
    """
    lib = _library()
    if lib is None:
        raise RuntimeError(f"narrow_gemm cannot run here: {_why_unavailable}")
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(
            f"x: expected a 2-D fp32 CPU tensor, got shape {tuple(x.shape)} {x.dtype} on {x.device}"
        )
    m, k = x.shape
    want = (-(-out_features // PANEL), k, PANEL)
    if tuple(panels.shape) != want or panels.dtype != torch.float32 or not panels.is_contiguous():
        raise ValueError(
            f"panels: expected contiguous fp32 {want} for {out_features} outputs and {k} "
            f"inputs, got {tuple(panels.shape)} {panels.dtype}"
        )
    if bias is not None and (tuple(bias.shape) != (out_features,) or bias.dtype != torch.float32):
        raise ValueError(f"bias: expected fp32 [{out_features}], got {tuple(bias.shape)}")
    bias = None if bias is None else bias.detach().contiguous()
    return _run(lib, x, panels, out_features, bias)


def _run(lib, x, panels, n, bias) -> torch.Tensor:
    """The kernel call itself, unchecked: ``x [M, K]`` fp32 CPU (made contiguous here),
    ``panels`` / ``bias`` contiguous and of matching shapes."""
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        lib.narrow_gemm(
            x.data_ptr(),
            m,
            k,
            panels.data_ptr(),
            n,
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
        )
    return y


def _panels(layer: torch.nn.Linear) -> torch.Tensor:
    """The layer's packed weight, re-packed when the weight was written since."""
    version = layer.weight._version
    if layer._narrow_version != version:
        layer._narrow_panels = pack_weight(layer.weight)
        layer._narrow_version = version
    return layer._narrow_panels


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if 0 < rows <= self._narrow_max_rows and x.dtype == torch.float32 and x.device.type == "cpu":
        # narrow_gemm without its checks: the layer's own panels and bias fit by
        # construction, and the per-call cost is what this path exists to cut
        n = self.out_features
        out = _run(_library(), x.reshape(rows, k), _panels(self), n, self.bias)
        return out.view(*x.shape[:-1], n)
    previous = self._narrow_previous
    if previous is not None:
        return previous(x)
    return F.linear(x, self.weight, self.bias)


def use_narrow_linears(model: torch.nn.Module, max_rows: int = MAX_ROWS) -> int:
    """Route ``model``'s fp32 CPU ``nn.Linear`` layers through ``narrow_gemm`` for
    inputs of at most ``max_rows`` rows (more rows: the layer's previous forward).
    Returns how many layers were switched (0 where ``narrow_available()`` is False).
    Idempotent; call after ``use_onednn_linears`` to keep oneDNN for the wide inputs.

    The packed weights are a second copy of each layer's weight (the same size).
    """
    if max_rows < 1:
        raise ValueError(f"max_rows: expected >= 1, got {max_rows}")
    if not narrow_available():
        return 0
    count = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not (
            isinstance(module, torch.nn.Linear)
            and w is not None
            and w.dtype == torch.float32
            and w.device.type == "cpu"
            and (module.bias is None or module.bias.dtype == torch.float32)
        ):
            continue
        if "_narrow_max_rows" not in module.__dict__:
            module._narrow_previous = module.__dict__.get("forward")
            module._narrow_version = None
            module.forward = types.MethodType(_forward, module)
        module._narrow_max_rows = max_rows
        count += 1
    return count


def restore_narrow_linears(model: torch.nn.Module) -> None:
    """Undo ``use_narrow_linears``: every layer back to the forward it had before."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and "_narrow_max_rows" in module.__dict__:
            previous = module.__dict__.pop("_narrow_previous")
            if previous is None:
                del module.forward
            else:
                module.forward = previous
            for name in ("_narrow_max_rows", "_narrow_panels", "_narrow_version"):
                module.__dict__.pop(name, None)
