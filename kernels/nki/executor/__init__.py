"""A NumPy executor for NKI kernel source, used when the Neuron SDK is absent.

``nki``, ``nl`` and ``nisa`` mirror ``import nki``, ``nki.language`` and
``nki.isa`` for the subset listed in ``docs/nki_executor.md``; every
Trainium rule it enforces raises :class:`NkiRuleError`. Import kernels'
names from ``kernels.nki.runtime``, not from here.
"""

from __future__ import annotations

from types import SimpleNamespace

from kernels.nki.executor import isa as nisa
from kernels.nki.executor import language as nl
from kernels.nki.executor.errors import NkiRuleError
from kernels.nki.executor.jit import Kernel, jit

nki = SimpleNamespace(jit=jit, language=nl, isa=nisa, Kernel=Kernel, NkiRuleError=NkiRuleError)

__all__ = ["NkiRuleError", "nisa", "nki", "nl"]
