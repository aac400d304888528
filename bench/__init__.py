"""Benchmarks and stage gates (``python -m bench`` is the kernel report).

Importing any ``bench`` module sets ``TRITON_INTERPRET=1`` when no CUDA device is
present (and the variable is unset), so Triton kernels run on the CPU through the
interpreter: it must be set before any ``@triton.jit`` function is defined.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
