"""Text reports of capture comparisons (the designed formats)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TextIO

from .compare import ComparisonResult, ThreeWayComparisonResult

RED, RESET = "\033[91m", "\033[0m"


@dataclass
class ReportSummary:
    """Counts of a report: failures (deviations or ratio failures), shape mismatches,
    missing modules, and the first failing ``(prompt, step, name)``."""

    failures: int = 0
    shape_mismatches: int = 0
    missing: int = 0
    first_failure: tuple | None = None

    @property
    def ok(self) -> bool:
        return self.failures == 0 and self.shape_mismatches == 0 and self.missing == 0


def _colour(line: str, on: bool, red: bool) -> str:
    return f"{RED}{line}{RESET}" if on and red else line


def _use_colour(file: TextIO, colorize: bool | None) -> bool:
    if colorize is not None:
        return colorize
    return bool(getattr(file, "isatty", lambda: False)())


def _sections(results, file):
    for prompt, steps in results.items():
        print(f"\n=== {prompt} ===", file=file)
        for step, res in steps.items():
            print(f"\n--- Step {step} ---", file=file)
            yield prompt, step, res
    print("", file=file)


def print_comparison_report(
    results: dict[str, dict[int, list[ComparisonResult]]],
    threshold: float = 0.01,
    label1: str = "Ref",
    label2: str = "Test",
    file: TextIO | None = None,
    colorize: bool | None = None,
) -> ReportSummary:
    """Print a two-way report; rows with ``L-inf > threshold`` in red. Returns the counts."""
    file = file or sys.stdout
    col = _use_colour(file, colorize)
    s = ReportSummary()
    print(f"TENSOR COMPARISON: {label1} vs {label2}", file=file)
    print("=" * 80, file=file)
    print(f"Threshold: L-inf > {threshold:g} highlighted in red", file=file)
    for prompt, step, res in _sections(results, file):
        print(f"{'Module':<45}{'L-inf':>13}{'L2':>13}{'Max Abs':>13}", file=file)
        print("-" * 80, file=file)
        for r in res:
            if r.missing:
                s.missing += 1
                print(_colour(f"{r.name:<45}  MISSING in {r.missing}", col, True), file=file)
                continue
            if not r.shape_match:
                s.shape_mismatches += 1
                line = f"{r.name:<45}  SHAPE MISMATCH {list(r.shape1)} vs {list(r.shape2)}"
                print(_colour(line, col, True), file=file)
                continue
            bad = r.deviates(threshold)
            if bad:
                s.failures += 1
                s.first_failure = s.first_failure or (prompt, step, r.name)
            line = f"{r.name:<45}{r.linf_rel:>13.2e}{r.l2_rel:>13.2e}{r.max_abs:>13.2e}"
            print(_colour(line, col, bad), file=file)
    extra = f", {s.missing} missing module(s)/step(s)" if s.missing else ""
    print(
        f"SUMMARY: {s.failures} deviation(s) > {threshold:g}, "
        f"{s.shape_mismatches} shape mismatch(es){extra}",
        file=file,
    )
    return s


def print_three_way_report(
    results: dict[str, dict[int, list[ThreeWayComparisonResult]]],
    label_expected: str = "BF16",
    label_actual: str = "Neuron",
    label_baseline: str = "FP32",
    multiplier: float = 1.5,
    file: TextIO | None = None,
    colorize: bool | None = None,
) -> ReportSummary:
    """Print a three-way report; rows whose ratio >= ``multiplier`` (or not passed) in red."""
    file = file or sys.stdout
    col = _use_colour(file, colorize)
    s = ReportSummary()
    print(f"THREE-WAY COMPARISON: {label_expected} & {label_actual} vs {label_baseline}", file=file)
    print("=" * 90, file=file)
    print(f"Ratio = Tgt/Base error. Red if ratio >= {multiplier:g}x", file=file)
    for prompt, step, res in _sections(results, file):
        print(f"{'Module':<40}{'L-inf Ratio':>13}{'L2 Ratio':>13}{'BC':>9}", file=file)
        print("-" * 90, file=file)
        for r in res:
            if r.missing:
                s.missing += 1
                print(_colour(f"{r.name:<40}  MISSING in {r.missing}", col, True), file=file)
                continue
            if not r.shape_match:
                s.shape_mismatches += 1
                print(_colour(f"{r.name:<40}  SHAPE MISMATCH", col, True), file=file)
                continue
            bad = not (r.linf_ratio < multiplier and r.l2_ratio < multiplier) or not r.passed
            if bad:
                s.failures += 1
                s.first_failure = s.first_failure or (prompt, step, r.name)
            line = f"{r.name:<40}{r.linf_ratio:>13.4f}{r.l2_ratio:>13.4f}{r.bc:>9.4f}"
            print(_colour(line, col, bad), file=file)
    extra = f", {s.missing} missing module(s)/step(s)" if s.missing else ""
    print(
        f"SUMMARY: {s.failures} failure(s) (ratio >= {multiplier:g}x), "
        f"{s.shape_mismatches} shape mismatch(es){extra}",
        file=file,
    )
    return s


def first_divergence(
    results: dict[str, dict[int, list]], threshold: float = 0.01
) -> tuple[str, int, str] | None:
    """``(prompt, step, name)`` of the first failing row in report order, or None.

    Two-way rows fail when ``linf_rel > threshold``; three-way rows when not passed.
    """
    for prompt, steps in results.items():
        for step, res in steps.items():
            for r in res:
                if isinstance(r, ThreeWayComparisonResult):
                    if r.shape_match and not r.missing and not r.passed:
                        return prompt, step, r.name
                elif r.deviates(threshold):
                    return prompt, step, r.name
    return None
