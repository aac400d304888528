"""The ``torch`` backend: fast CPU (and any-device) paths in plain PyTorch.

One module per op (``tree_attention.py``, ``tree_walk.py``, ``kv_compact.py``), each
defining a function of that name with the signature of ``kernels.reference``.
They are imported on first use, so a missing optional dependency only
disables this backend.
"""

from __future__ import annotations

import importlib

OPS = ("tree_attention", "tree_walk", "kv_compact")


def __getattr__(name: str):
    if name in OPS:
        return getattr(importlib.import_module(f"{__name__}.{name}"), name)
    raise AttributeError(name)
