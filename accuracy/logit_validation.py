"""Logit validation with teacher forcing: run any generate function, compare its
logits token by token with reference logits, and re-prompt after each divergence
with the reference tokens appended (so every position is validated in the
reference context)."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .compare import DynamicThresholdConfig, bhattacharyya_coefficient

DEFAULT_TOLERANCE_MAP: dict[str, tuple[float, float]] = {
    "5": (1e-5, 0.011),
    "50": (1e-5, 0.02),
    "1000": (1e-5, 0.03),
    "all": (1e-5, 0.05),
}
DEFAULT_DIVERGENCE_DIFFERENCE_TOLERANCE = 0.001

MATCHED = "matched"
TOPK_ERRORS = "topk_errors"
ACCEPTABLE_DIVERGENCE = "acceptable_divergence"
DIVERGED = "diverged"


@dataclass
class TokenValidation:
    """Validation of one generated token (output index ``index`` of batch row ``batch``).

    ``errors[k]`` is the max relative error over the reference's top-k logits
    (``"all"`` = whole vocabulary) after removing the mean additive shift;
    ``divergence_difference`` is ``actual[actual_token] - actual[expected_token]``.
    """

    index: int
    batch: int
    expected_token: int
    actual_token: int
    status: str
    passed: bool
    errors: dict[str, float] = field(default_factory=dict)
    divergence_difference: float = 0.0
    three_way: dict[str, float] | None = None


def _ulp(x: float, mantissa_bits: int) -> float:
    if x == 0 or not math.isfinite(x):
        return 2.0 ** (-126 - mantissa_bits)
    return 2.0 ** (math.floor(math.log2(abs(x))) - mantissa_bits)


def _rel_errors(expected: torch.Tensor, actual: torch.Tensor, tol_map) -> dict[str, tuple]:
    shift = (actual - expected).mean()
    diff = (actual - shift - expected).abs()
    out = {}
    for k, (atol, rtol) in tol_map.items():
        if k == "all":
            idx = torch.arange(expected.numel())
        else:
            idx = torch.topk(expected, min(int(k), expected.numel())).indices
        denom = float(expected[idx].abs().max())
        err = (
            float(((diff[idx] - atol).clamp(min=0)).max()) / denom
            if denom
            else float(diff[idx].max())
        )
        out[k] = (err, err <= rtol)
    return out


def validate_token_logits(
    expected: torch.Tensor,
    actual: torch.Tensor,
    tol_map: dict[str, tuple[float, float]] | None = None,
    divergence_difference_tol: float | None = None,
    actual_token: int | None = None,
    baseline: torch.Tensor | None = None,
    dynamic_threshold_config: DynamicThresholdConfig | dict | None = None,
    divergence_n_ulps: int | None = 1,
    mantissa_bits: int = 7,
    index: int = 0,
    batch: int = 0,
) -> TokenValidation:
    """Validate one token's logits ``[vocab]``; see :class:`TokenValidation`.

    Status: ``matched`` (same argmax, all top-k within tolerance), ``topk_errors``,
    ``acceptable_divergence`` (argmax differs by a near tie: the difference is within
    ``divergence_n_ulps`` ULPs, or ``divergence_difference_tol`` when that is None) or
    ``diverged``. Three-way (``baseline`` given) also needs the L-inf/L2 error ratios
    against the baseline under the multipliers.
    """
    tol_map = tol_map or DEFAULT_TOLERANCE_MAP
    if expected.shape != actual.shape or expected.dim() != 1:
        raise ValueError(
            f"logits must be [vocab] of equal shape: {expected.shape} vs {actual.shape}"
        )
    e, a = expected.float(), actual.float()
    exp_tok = int(e.argmax())
    act_tok = int(a.argmax()) if actual_token is None else int(actual_token)
    errs = _rel_errors(e, a, tol_map)
    topk_ok = all(ok for _, ok in errs.values())
    diff = float(a.max() - a[exp_tok])
    if act_tok == exp_tok:
        status = MATCHED if topk_ok else TOPK_ERRORS
    else:
        if divergence_n_ulps is not None:
            tol = divergence_n_ulps * _ulp(
                max(abs(float(a.max())), abs(float(a[exp_tok]))), mantissa_bits
            )
        else:
            tol = divergence_difference_tol
            if tol is None:
                tol = DEFAULT_DIVERGENCE_DIFFERENCE_TOLERANCE
        status = ACCEPTABLE_DIVERGENCE if diff <= tol else DIVERGED
    passed = status in (MATCHED, ACCEPTABLE_DIVERGENCE)
    three = None
    if baseline is not None:
        cfg = dynamic_threshold_config or DynamicThresholdConfig()
        if isinstance(cfg, dict):
            cfg = DynamicThresholdConfig(**cfg)
        b = baseline.float()
        bd, td = (e - b).abs(), (a - b).abs()
        bmax, bnorm = float(b.abs().max()) or 1.0, float(b.norm()) or 1.0
        three = {
            "base_linf": float(bd.max()) / bmax,
            "tgt_linf": float(td.max()) / bmax,
            "base_l2": float(bd.norm()) / bnorm,
            "tgt_l2": float(td.norm()) / bnorm,
            "bc": bhattacharyya_coefficient(bd, td, cfg.bc_bins),
        }
        ok3 = three["tgt_linf"] <= cfg.linf_multiplier * three["base_linf"] and (
            three["tgt_l2"] <= cfg.l2_multiplier * three["base_l2"]
        )
        passed = passed and ok3
    return TokenValidation(
        index,
        batch,
        exp_tok,
        act_tok,
        status,
        passed,
        {k: v[0] for k, v in errs.items()},
        diff,
        three,
    )


@dataclass
class LogitValidationResult:
    """All token validations (``tokens[batch][i]``), the pass flag, and how many
    ``generate_fn`` calls (1 + number of teacher-forcing retries) were made."""

    passed: bool
    tokens: list[list[TokenValidation]]
    num_generate_calls: int
    divergence_indices: list[int]


def _first_divergence(teacher: torch.Tensor, actual: torch.Tensor) -> int | None:
    mism = (teacher != actual).any(dim=0).nonzero()
    return int(mism[0]) if mism.numel() else None


def logit_validation(
    input_ids: list[list[int]],
    generate_fn: Callable[..., Any],
    expected_logits: torch.Tensor,
    tol_map: dict[str, tuple[float, float]] | None = None,
    divergence_difference_tol: float | None = None,
    suppress_passing: bool = True,
    baseline_logits: torch.Tensor | None = None,
    dynamic_threshold_config: DynamicThresholdConfig | dict | None = None,
    label: str | None = None,
    divergence_n_ulps: int | None = 1,
    mantissa_bits: int = 7,
    return_details: bool = False,
    max_generate_calls: int | None = None,
    file=None,
):
    """Teacher-forced logit validation of ``generate_fn`` against ``expected_logits``.

    Args:
        input_ids: prompts, one token list per batch row (not modified).
        generate_fn: ``fn(input_ids) -> logits [gen, batch, vocab]`` or
            ``(logits, sequences [batch, gen])``; any model, any engine.
        expected_logits: reference ``[seq, batch, vocab]``.
        baseline_logits: FP32 ``[seq, batch, vocab]`` for three-way mode (its argmax
            drives teacher forcing then).
        return_details: return a :class:`LogitValidationResult` instead.
    Returns:
        two-way: ``passed``; three-way: ``(passed, results)``; or the details object.

    Each round validates the generated tokens up to and including the first one whose
    argmax differs from the reference (in any batch row), appends the reference tokens
    to the prompts and calls ``generate_fn`` again from there.
    """
    if expected_logits.dim() != 3 or expected_logits.shape[1] != len(input_ids):
        raise ValueError(
            f"expected_logits must be [seq, batch={len(input_ids)}, vocab], got "
            f"{list(expected_logits.shape)}"
        )
    if baseline_logits is not None and baseline_logits.shape != expected_logits.shape:
        raise ValueError(
            f"baseline_logits {list(baseline_logits.shape)} != "
            f"expected_logits {list(expected_logits.shape)}"
        )
    teacher_logits = baseline_logits if baseline_logits is not None else expected_logits
    teacher = teacher_logits.argmax(-1).T  # [batch, seq]
    S, B = expected_logits.shape[0], expected_logits.shape[1]
    ids = [list(map(int, x)) for x in input_ids]
    results: list[list[TokenValidation]] = [[] for _ in range(B)]
    start, calls, divs = 0, 0, []
    limit = max_generate_calls or S + 1
    while start < S:
        if calls >= limit:
            raise ValueError(f"generate_fn made no progress after {calls} calls")
        out = generate_fn(ids)
        calls += 1
        seqs = None
        if isinstance(out, tuple):
            logits, seqs = out
        else:
            logits = out
        if logits.dim() != 3 or logits.shape[1] != B or logits.shape[0] == 0:
            raise ValueError(
                f"generate_fn returned logits {list(logits.shape)}; need [gen>0, {B}, vocab]"
            )
        act = seqs.to(teacher.device) if seqs is not None else logits.argmax(-1).T
        n = min(logits.shape[0], S - start)
        first = _first_divergence(teacher[:, start : start + n], act[:, :n])
        upto = n if first is None else first + 1
        if first is not None:
            divs.append(start + first)
        for b in range(B):
            for t in range(upto):
                g = start + t
                results[b].append(
                    validate_token_logits(
                        expected_logits[g, b],
                        logits[t, b],
                        tol_map,
                        divergence_difference_tol,
                        int(act[b, t]),
                        baseline_logits[g, b] if baseline_logits is not None else None,
                        dynamic_threshold_config,
                        divergence_n_ulps,
                        mantissa_bits,
                        index=g,
                        batch=b,
                    )
                )
        for b in range(B):
            ids[b].extend(int(x) for x in teacher[b, start : start + upto])
        start += upto
    passed = all(tv.passed for row in results for tv in row)
    _print_summary(results, passed, calls, suppress_passing, label, file or sys.stdout)
    details = LogitValidationResult(passed, results, calls, divs)
    if return_details:
        return details
    if baseline_logits is not None:
        return passed, results
    return passed


def _print_summary(results, passed, calls, suppress_passing, label, file) -> None:
    title = f"LOGIT VALIDATION{': ' + label if label else ''}"
    print(title, file=file)
    print("=" * 80, file=file)
    print(f"{'Batch':>5} {'Token':>5} {'Exp':>7} {'Act':>7}  {'Status':<22} Errors", file=file)
    for row in results:
        for tv in row:
            if suppress_passing and tv.status == MATCHED and tv.passed:
                continue
            errs = " ".join(f"{k}={v:.3g}" for k, v in tv.errors.items())
            print(
                f"{tv.batch:>5} {tv.index:>5} {tv.expected_token:>7} {tv.actual_token:>7}  "
                f"{tv.status:<22} {errs}",
                file=file,
            )
    n = sum(len(r) for r in results)
    bad = sum(not tv.passed for r in results for tv in r)
    print(
        f"SUMMARY: {'PASSED' if passed else 'FAILED'} - {bad}/{n} token(s) failing, "
        f"{calls} generate call(s)",
        file=file,
    )
