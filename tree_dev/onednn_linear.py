"""fp32 ``nn.Linear`` layers of a CPU model through oneDNN instead of MKL.

PyTorch's CPU ``linear`` calls MKL's SGEMM, which on AMD CPUs runs its AVX2 code
even where the CPU has AVX-512: there oneDNN's fp32 GEMM (AVX-512) runs about twice
as fast. On a CPU without AVX-512 oneDNN has no such edge and was measured slower
than MKL for this project's layer shapes on an AVX2-only EPYC, so ``onednn_faster()``
says whether to switch (figures: docs/design_figures.md, "oneDNN linear").
A tree verify forward feeds every linear layer ``N`` rows (one per tree node) and
is GEMM bound, so it gains on AVX-512; a single-token decode step (one row) is
memory bound and MKL is as fast there, so layers called with fewer than
``min_rows`` rows keep ``F.linear``. Same fp32 arithmetic (no reduced-precision
shortcut); only the summation order differs, by rounding.

``use_onednn_linears(model)`` switches a model's layers in place (its modules'
``forward``); ``restore_linears(model)`` switches them back.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

__all__ = ["onednn_available", "onednn_faster", "restore_linears", "use_onednn_linears"]

_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
MIN_ROWS = 4  # fewer rows: memory bound, MKL is as fast (docs/design_figures.md, "oneDNN linear")


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's linear op."""
    return _LINEAR is not None and torch.backends.mkldnn.is_available()


def onednn_faster() -> bool:
    """Whether oneDNN's fp32 GEMM is expected to beat MKL's here: oneDNN is available
    and torch runs this CPU's AVX-512 code (``torch.backends.cpu.get_cpu_capability``)."""
    return onednn_available() and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows >= self._onednn_min_rows and x.dtype == torch.float32 and x.device.type == "cpu":
        flat = x.reshape(rows, x.shape[-1]).contiguous()
        out = _LINEAR(flat, self.weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])
    return F.linear(x, self.weight, self.bias)


def use_onednn_linears(model: torch.nn.Module, min_rows: int = MIN_ROWS) -> int:
    """Route ``model``'s fp32 CPU ``nn.Linear`` layers through oneDNN for inputs of at
    least ``min_rows`` rows. Returns how many layers were switched (0 when torch has
    no oneDNN, or the model is not fp32 on the CPU). Idempotent."""
    if not onednn_available():
        return 0
    count = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if (
            isinstance(module, torch.nn.Linear)
            and w is not None
            and w.dtype == torch.float32
            and w.device.type == "cpu"
            and w.is_contiguous()
        ):
            module._onednn_min_rows = min_rows
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count


def restore_linears(model: torch.nn.Module) -> None:
    """Undo ``use_onednn_linears``: every layer back to ``nn.Linear.forward``."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and "forward" in module.__dict__:
            del module.forward
            module.__dict__.pop("_onednn_min_rows", None)
