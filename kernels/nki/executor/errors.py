"""The error every Trainium rule violation raises in the NumPy NKI executor."""

from __future__ import annotations


class NkiRuleError(ValueError):
    """A kernel broke a rule that the Neuron compiler or hardware enforces.

    The message names the call, the operand and the limit, e.g.
    ``nc_matmul: stationary has free size 130 > 128 (gemm_stationary_fmax)``.
    """


def rule(call: str, message: str) -> NkiRuleError:
    """Build the error for ``call`` (an NKI API name) with a human message."""
    return NkiRuleError(f"{call}: {message}")
