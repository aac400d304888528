"""TensorComparePlugin: one object holding a model's reconstruction and thresholds,
so a model-specific comparison (e.g. a hidden-dim unshuffle) is set up once."""

from __future__ import annotations

import sys
from typing import TextIO

from .alignment import align_decode_captures, default_reconstruction
from .compare import (
    AlignmentFn,
    DynamicThresholdConfig,
    ReconstructionFn,
    compare_captures_three_way,
    compare_captures_two_way,
)
from .report import ReportSummary, print_comparison_report, print_three_way_report
from .tensor_io import CapturedForwardPass, read


class TensorComparePlugin:
    """Compare capture directories (or lists) with a custom ``reconstruction_fn``.

    Args:
        reconstruction_fn: applied to the captures under test (four-argument protocol).
        reference_reconstruction_fn: applied to reference/baseline captures
            (default: TP rank 0).
        alignment_fn: default :func:`accuracy.align_and_truncate_hidden`.
        threshold: two-way L-inf threshold; config: three-way multipliers.
        align_decode: run :func:`align_decode_captures` on the reference side(s).
    """

    def __init__(
        self,
        reconstruction_fn: ReconstructionFn | None = None,
        reference_reconstruction_fn: ReconstructionFn | None = None,
        alignment_fn: AlignmentFn | None = None,
        threshold: float = 0.01,
        config: DynamicThresholdConfig | None = None,
        module_order: list[str] | None = None,
        phase: str | None = None,
        align_decode: bool = True,
    ) -> None:
        self.reconstruction_fn = reconstruction_fn or default_reconstruction
        self.reference_reconstruction_fn = reference_reconstruction_fn or default_reconstruction
        self.alignment_fn = alignment_fn
        self.threshold = threshold
        self.config = config or DynamicThresholdConfig()
        self.module_order = module_order
        self.phase = phase
        self.align_decode = align_decode

    @staticmethod
    def _load(x: str | list[CapturedForwardPass]) -> list[CapturedForwardPass]:
        return read(x) if isinstance(x, str) else x

    def compare(
        self,
        reference: str | list[CapturedForwardPass],
        test: str | list[CapturedForwardPass],
        baseline: str | list[CapturedForwardPass] | None = None,
        file: TextIO | None = None,
        labels: tuple[str, str] = ("Ref", "Test"),
    ) -> tuple[dict, ReportSummary]:
        """Two-way (or three-way with an FP32 ``baseline``) comparison + printed report.

        ``file=None`` prints to stdout; pass ``io.StringIO()`` to keep it quiet.
        Returns ``(results, summary)``.
        """
        ref, tst = self._load(reference), self._load(test)
        if self.align_decode:
            ref = align_decode_captures(ref, tst)
        out = file if file is not None else sys.stdout
        if baseline is None:
            res = compare_captures_two_way(
                ref,
                tst,
                self.reference_reconstruction_fn,
                self.reconstruction_fn,
                self.alignment_fn,
                self.module_order,
                self.phase,
            )
            return res, print_comparison_report(res, self.threshold, *labels, file=out)
        base = self._load(baseline)
        if self.align_decode:
            base = align_decode_captures(base, tst)
        res = compare_captures_three_way(
            base,
            ref,
            tst,
            self.reference_reconstruction_fn,
            self.reconstruction_fn,
            self.alignment_fn,
            self.module_order,
            self.phase,
            self.config,
        )
        summary = print_three_way_report(
            res, labels[0], labels[1], multiplier=self.config.linf_multiplier, file=out
        )
        return res, summary


__all__ = ["TensorComparePlugin"]
