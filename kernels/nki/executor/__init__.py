"""A NumPy executor for NKI kernel source, used when the Neuron SDK is absent.

``nki``, ``nl`` and ``nisa`` mirror ``import nki``, ``nki.language`` and
``nki.isa`` of NKI 0.6 for the subset listed in ``docs/nki_executor.md``
(``nki.jit``, ``nki.simulate``, ``nki.dtype``, ``nki.typing``); every Trainium
rule it enforces raises :class:`NkiRuleError`. ``profile`` counts what each
engine is asked to do. Import kernels' names from ``kernels.nki.runtime``, not
from here.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from kernels.nki.executor import isa as nisa
from kernels.nki.executor import language as nl
from kernels.nki.executor import profile
from kernels.nki.executor.errors import NkiRuleError
from kernels.nki.executor.jit import Kernel, jit, simulate

typing = SimpleNamespace(tensor=nl.Tile, mutable_tensor=nl.Tile, scalar=float)

nki = SimpleNamespace(
    jit=jit,
    simulate=simulate,
    language=nl,
    isa=nisa,
    typing=typing,
    dtype=np.dtype,
    Kernel=Kernel,
    NkiRuleError=NkiRuleError,
    __version__="0.6.0 (NumPy executor)",
)

__all__ = ["NkiRuleError", "nisa", "nki", "nl", "profile"]
