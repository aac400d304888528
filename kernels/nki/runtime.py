"""The one import point of NKI kernels: ``from kernels.nki.runtime import nki, nl, nisa``.

Resolves to the real Neuron SDK (``import nki``, ``nki.language``, ``nki.isa``)
when ``nki.isa`` is importable, else to the project's NumPy executor
(``kernels.nki.executor``), which runs the same kernel source on the CPU and
enforces Trainium's rules. ``TREESPEC_NKI_EXECUTOR=1`` forces the executor.
"""

from __future__ import annotations

import os

USING_SDK = False
if os.environ.get("TREESPEC_NKI_EXECUTOR") != "1":
    try:
        import nki  # type: ignore[import-not-found]
        import nki.isa as nisa  # type: ignore[import-not-found]
        import nki.language as nl  # type: ignore[import-not-found]

        USING_SDK = True
    except Exception:  # ImportError, or the empty PyPI placeholder failing otherwise
        USING_SDK = False

if not USING_SDK:
    from kernels.nki.executor import nisa, nki, nl  # noqa: F811

RuleError: type[Exception]
if USING_SDK:
    RuleError = Exception
else:
    from kernels.nki.executor import NkiRuleError as RuleError


def backend_note() -> str:
    """Which NKI runtime is in use, in one line."""
    if USING_SDK:
        version = getattr(nki, "__version__", "unknown version")
        return f"Neuron SDK nki {version}"
    return "Neuron SDK not installed, running on the NumPy NKI executor"


__all__ = ["USING_SDK", "RuleError", "backend_note", "nisa", "nki", "nl"]
