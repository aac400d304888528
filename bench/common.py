"""Metrics shared by the end-to-end benchmarks."""

from __future__ import annotations


def distinct_ratio(outputs: list[list[int]]) -> float:
    """Mean over outputs of distinct tokens / tokens (1.0: no token repeats; a loop
    of a few tokens gives a small ratio)."""
    ratios = [len(set(o)) / len(o) for o in outputs if o]
    return sum(ratios) / len(ratios) if ratios else 0.0
