"""The ``nki`` backend: NKI kernels (Trainium; the CPU through the NumPy NKI executor).

One module per op (``tree_attention.py``, ``tree_walk.py``, ``kv_compact.py``), each
defining a function of that name with the signature of ``kernels.reference``.
They are imported on first use, so a missing optional dependency only
disables this backend. Kernels import ``nki``, ``nl`` and ``nisa`` from
``kernels.nki.runtime``: the real Neuron SDK when installed, else the NumPy
executor in ``kernels/nki/executor/`` (see ``docs/nki_executor.md``).
"""

from __future__ import annotations

import importlib
import sys
import types

OPS = ("tree_attention", "tree_walk", "kv_compact")


def BACKEND_NOTE() -> str:  # noqa: N802  (attribute name read by kernels.backend_status)
    """Which NKI runtime is in use (real Neuron SDK or the NumPy executor)."""
    from kernels.nki.runtime import backend_note

    return backend_note()


def __getattr__(name: str):
    if name in OPS:
        return getattr(importlib.import_module(f"{__name__}.{name}"), name)
    raise AttributeError(name)


class _Backend(types.ModuleType):
    """Keeps ``kernels.nki.<op>`` the op function: importing the submodule of the same
    name would otherwise shadow it with the module."""

    def __setattr__(self, name: str, value) -> None:
        if name in OPS and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Backend
