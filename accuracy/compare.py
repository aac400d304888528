"""Tensor- and capture-level comparison: two-way (static threshold) and three-way
(dynamic threshold against an FP32 baseline, with the Bhattacharyya coefficient)."""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .alignment import align_and_truncate_hidden, default_reconstruction, group_by_prompt
from .tensor_io import CapturedForwardPass

ReconstructionFn = Callable[..., torch.Tensor]
AlignmentFn = Callable[..., tuple]
_ERR_SAMPLE = 1 << 16


@dataclass
class ComparisonResult:
    """Two-way result; ``t2`` compared against the reference ``t1``.

    ``linf_rel = max|t2-t1| / max|t1|``, ``l2_rel = ||t2-t1|| / ||t1||``,
    ``max_abs = max|t2-t1|``. ``shape_match=False`` (metrics NaN) when the tensors
    could not be aligned; ``missing`` names the side lacking the module.
    """

    name: str
    linf_rel: float = float("nan")
    l2_rel: float = float("nan")
    max_abs: float = float("nan")
    shape_match: bool = True
    shape1: tuple = ()
    shape2: tuple = ()
    missing: str | None = None

    def deviates(self, threshold: float) -> bool:
        """True when the comparison ran and ``linf_rel`` exceeds ``threshold`` (or is NaN)."""
        return self.shape_match and not self.missing and not (self.linf_rel <= threshold)


@dataclass
class DynamicThresholdConfig:
    """Three-way pass rule: ``tgt_err < multiplier * base_err`` for L-inf and L2.

    ``bc_bins`` histogram bins for the Bhattacharyya coefficient; ``bc_threshold``
    is used by :func:`compute_aggregate_metrics` on pooled errors.
    """

    linf_multiplier: float = 1.5
    l2_multiplier: float = 1.5
    bc_bins: int = 100
    bc_threshold: float = 0.99


@dataclass
class ThreeWayComparisonResult:
    """Three-way result: ``base_*`` = expected vs baseline, ``tgt_*`` = actual vs baseline.

    ``linf_ratio = tgt_linf / base_linf`` (0 when both are 0, inf when only the
    base is 0), likewise ``l2_ratio``; ``bc`` compares the two error histograms.
    ``base_errors`` / ``tgt_errors`` hold a strided sample (<= 65536) of the
    absolute errors, for :func:`compute_aggregate_metrics`.
    """

    name: str
    base_linf: float = float("nan")
    tgt_linf: float = float("nan")
    base_l2: float = float("nan")
    tgt_l2: float = float("nan")
    linf_ratio: float = float("nan")
    l2_ratio: float = float("nan")
    bc: float = float("nan")
    passed: bool = False
    shape_match: bool = True
    missing: str | None = None
    base_errors: torch.Tensor | None = field(default=None, repr=False)
    tgt_errors: torch.Tensor | None = field(default=None, repr=False)


def _rel(diff_max: float, ref_max: float) -> float:
    if ref_max == 0.0:
        return 0.0 if diff_max == 0.0 else math.inf
    return diff_max / ref_max


def _errors(ref: torch.Tensor, act: torch.Tensor) -> tuple[torch.Tensor, float, float, float]:
    ref = ref.detach().float()
    diff = (act.detach().float() - ref).abs()
    if diff.numel() == 0:
        return diff, 0.0, 0.0, 0.0
    max_abs = float(diff.max())
    linf = _rel(max_abs, float(ref.abs().max()))
    l2 = _rel(float(torch.linalg.vector_norm(diff)), float(torch.linalg.vector_norm(ref)))
    return diff, max_abs, linf, l2


def _check_shapes(name: str, shapes: list[tuple]) -> None:
    if len(set(shapes)) != 1:
        raise ValueError(f"'{name}': shape mismatch {' vs '.join(str(list(s)) for s in shapes)}")


def compare_tensors(t1: torch.Tensor, t2: torch.Tensor, name: str = "") -> ComparisonResult:
    """Compare ``t2`` against reference ``t1`` (any dtypes; computed in float32).

    Raises ValueError naming ``name`` and both shapes when they differ.
    """
    _check_shapes(name, [tuple(t1.shape), tuple(t2.shape)])
    _, max_abs, linf, l2 = _errors(t1, t2)
    return ComparisonResult(name, linf, l2, max_abs, True, tuple(t1.shape), tuple(t2.shape))


def compare_rows(t1: torch.Tensor, t2: torch.Tensor, name: str) -> list[ComparisonResult]:
    """``compare_tensors`` of every row ``t1[i]`` vs ``t2[i]`` (named ``{name}/token{i}``),
    computed in one vectorised pass. Same metric definitions and zero rules."""
    _check_shapes(name, [tuple(t1.shape), tuple(t2.shape)])
    r = t1.detach().float().reshape(t1.shape[0], -1)
    d = (t2.detach().float().reshape(t2.shape[0], -1) - r).abs()
    row_shape = tuple(t1.shape[1:])
    if d.shape[1] == 0:
        return [
            ComparisonResult(f"{name}/token{i}", 0.0, 0.0, 0.0, True, row_shape, row_shape)
            for i in range(t1.shape[0])
        ]
    max_abs = d.amax(1).tolist()
    ref_max = r.abs().amax(1).tolist()
    dn = torch.linalg.vector_norm(d, dim=1).tolist()
    rn = torch.linalg.vector_norm(r, dim=1).tolist()
    return [
        ComparisonResult(
            f"{name}/token{i}",
            _rel(max_abs[i], ref_max[i]),
            _rel(dn[i], rn[i]),
            max_abs[i],
            True,
            row_shape,
            row_shape,
        )
        for i in range(len(max_abs))
    ]


def _bc_rows(p: torch.Tensor, q: torch.Tensor, bins: int) -> torch.Tensor:
    """Row-wise BC of ``p[i]`` vs ``q[i]`` (``[T, n]``): ``bins`` equal bins over the row's
    common finite range; 1.0 when the range is a single value, NaN without finite data."""
    fp, fq = torch.isfinite(p), torch.isfinite(q)
    inf = float("inf")
    lo = torch.minimum(torch.where(fp, p, inf).amin(1), torch.where(fq, q, inf).amin(1))
    hi = torch.maximum(torch.where(fp, p, -inf).amax(1), torch.where(fq, q, -inf).amax(1))
    span = hi - lo
    safe = torch.where(span > 0, span, torch.ones_like(span))

    def hist(x: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        idx = ((x - lo[:, None]) * bins / safe[:, None]).floor().clamp(0, bins - 1)
        idx = torch.where(finite, idx, torch.zeros_like(idx)).long()
        h = torch.zeros(x.shape[0], bins).scatter_add_(1, idx, finite.float())
        return h / h.sum(1, keepdim=True)

    bc = torch.sqrt(hist(p, fp) * hist(q, fq)).sum(1).clamp(max=1.0)
    return torch.where(span == 0, torch.ones_like(bc), bc)


def bhattacharyya_coefficient(
    p_errors: torch.Tensor, q_errors: torch.Tensor, bins: int = 100
) -> float:
    """BC = sum_i sqrt(p_i q_i) of the two error histograms over their common range.

    ``bins`` equal bins spanning [min, max] of both (finite) error sets. 1.0 for
    identical distributions (and when all errors are one value), ~0.0 for no overlap,
    NaN when either set has no finite value.
    """
    p = p_errors.detach().float().reshape(1, -1)
    q = q_errors.detach().float().reshape(1, -1)
    if p.numel() == 0 or q.numel() == 0:
        return float("nan")
    if p.shape != q.shape:  # different sizes: pad with NaN (ignored as non-finite)
        n = max(p.shape[1], q.shape[1])
        p = torch.nn.functional.pad(p, (0, n - p.shape[1]), value=float("nan"))
        q = torch.nn.functional.pad(q, (0, n - q.shape[1]), value=float("nan"))
    return float(_bc_rows(p, q, bins)[0])


def _sample(diff: torch.Tensor) -> torch.Tensor:
    flat = diff.reshape(-1)
    if flat.numel() > _ERR_SAMPLE:
        flat = flat[:: math.ceil(flat.numel() / _ERR_SAMPLE)]
    return flat.clone()


def _ratio(tgt: float, base: float) -> float:
    if base == 0.0:
        return 0.0 if tgt == 0.0 else math.inf
    return tgt / base


def compare_tensors_three_way(
    baseline: torch.Tensor,
    expected: torch.Tensor,
    actual: torch.Tensor,
    name: str = "",
    config: DynamicThresholdConfig | None = None,
) -> ThreeWayComparisonResult:
    """Errors of ``expected`` (reference quantized) and ``actual`` (target) vs ``baseline``.

    ``passed`` iff ``linf_ratio < linf_multiplier`` and ``l2_ratio < l2_multiplier``.
    Raises ValueError when the three shapes differ.
    """
    config = config or DynamicThresholdConfig()
    _check_shapes(name, [tuple(baseline.shape), tuple(expected.shape), tuple(actual.shape)])
    bdiff, _, blinf, bl2 = _errors(baseline, expected)
    tdiff, _, tlinf, tl2 = _errors(baseline, actual)
    lr, l2r = _ratio(tlinf, blinf), _ratio(tl2, bl2)
    bc = bhattacharyya_coefficient(bdiff, tdiff, config.bc_bins) if bdiff.numel() else 1.0
    passed = lr < config.linf_multiplier and l2r < config.l2_multiplier
    return ThreeWayComparisonResult(
        name,
        blinf,
        tlinf,
        bl2,
        tl2,
        lr,
        l2r,
        bc,
        bool(passed),
        True,
        None,
        _sample(bdiff),
        _sample(tdiff),
    )


def compare_rows_three_way(
    baseline: torch.Tensor,
    expected: torch.Tensor,
    actual: torch.Tensor,
    name: str,
    config: DynamicThresholdConfig | None = None,
) -> list[ThreeWayComparisonResult]:
    """``compare_tensors_three_way`` of every row (``{name}/token{i}``), vectorised."""
    config = config or DynamicThresholdConfig()
    _check_shapes(name, [tuple(baseline.shape), tuple(expected.shape), tuple(actual.shape)])
    T = baseline.shape[0]
    b = baseline.detach().float().reshape(T, -1)
    bd = (expected.detach().float().reshape(T, -1) - b).abs()
    td = (actual.detach().float().reshape(T, -1) - b).abs()
    if b.shape[1] == 0:
        return [
            ThreeWayComparisonResult(f"{name}/token{i}", 0, 0, 0, 0, 0, 0, 1.0, True)
            for i in range(T)
        ]
    bmax, bnorm = b.abs().amax(1).tolist(), torch.linalg.vector_norm(b, dim=1).tolist()
    be_max, te_max = bd.amax(1).tolist(), td.amax(1).tolist()
    be_n = torch.linalg.vector_norm(bd, dim=1).tolist()
    te_n = torch.linalg.vector_norm(td, dim=1).tolist()
    bcs = _bc_rows(bd, td, config.bc_bins).tolist()
    out = []
    for i in range(T):
        bl, tl = _rel(be_max[i], bmax[i]), _rel(te_max[i], bmax[i])
        b2, t2 = _rel(be_n[i], bnorm[i]), _rel(te_n[i], bnorm[i])
        lr, l2r = _ratio(tl, bl), _ratio(t2, b2)
        passed = lr < config.linf_multiplier and l2r < config.l2_multiplier
        out.append(
            ThreeWayComparisonResult(
                f"{name}/token{i}",
                bl,
                tl,
                b2,
                t2,
                lr,
                l2r,
                bcs[i],
                bool(passed),
                True,
                None,
                _sample(bd[i]),
                _sample(td[i]),
            )
        )
    return out


# --------------------------------------------------------------------------- capture level


def normalize_name(name: str) -> str:
    """Module name as used in reports and reconstruction calls: dots -> underscores."""
    return name.replace(".", "_")


def call_reconstruction(fn: ReconstructionFn, fwd: CapturedForwardPass, name: str) -> torch.Tensor:
    """Call ``fn(rank_tensors, module_name, phase, positions)``, adding ``padding_mask=``
    when ``fn`` accepts it."""
    args = (fwd.rank_tensors(name), normalize_name(name), fwd.phase, list(fwd.metadata.positions))
    try:
        params = inspect.signature(fn).parameters
        takes_mask = "padding_mask" in params or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
        )
    except (TypeError, ValueError):
        takes_mask = False
    if takes_mask:
        return fn(*args, padding_mask=fwd.metadata.padding_mask)
    return fn(*args)


def _resolve(fwd: CapturedForwardPass, name: str) -> str | None:
    """The capture of ``fwd`` that stands for ``name`` (``X`` <-> ``X.0`` aliases)."""
    if name in fwd.tensors:
        return name
    if f"{name}.0" in fwd.tensors:
        return f"{name}.0"
    if name.endswith(".0") and name[:-2] in fwd.tensors:
        return name[:-2]
    return None


def _aliases(name: str) -> set[str]:
    out = {name, f"{name}.0"}
    if name.endswith(".0"):
        out.add(name[:-2])
    return out


def _module_list(sides: list[CapturedForwardPass], module_order: list[str] | None) -> list[str]:
    """Modules to compare: ``module_order`` (dotted or underscored names) or the union of
    the sides' capture names in registration order, ``X``/``X.0`` aliases counted once."""
    if module_order is not None:
        norm = {normalize_name(m): m for s in sides for m in s.tensors}
        return [m if any(m in s.tensors for s in sides) else norm.get(m, m) for m in module_order]
    names: list[str] = []
    for s in sides:
        for m in s.module_names:
            if not (_aliases(m) & set(names)):
                names.append(m)
    return names


def _pair_steps(
    groups: list[list[CapturedForwardPass]], phase: str | None
) -> list[tuple[CapturedForwardPass | None, ...]]:
    """Pair the passes of one prompt across sides: prefills by order, decodes by
    ``max(positions)`` when every first-side decode position exists on the others,
    else by order. A side without a counterpart is ``None`` in the tuple."""
    if phase is not None and phase not in ("prefill", "decode"):
        raise ValueError(f"phase must be 'prefill', 'decode' or None, got {phase!r}")
    pre = [[f for f in g if f.is_prefill] for g in groups]
    dec = [[f for f in g if not f.is_prefill] for g in groups]
    pairs: list[tuple] = []
    if phase in (None, "prefill"):
        pairs.extend(itertools.zip_longest(*pre))
    if phase in (None, "decode"):
        maps = [{max(f.metadata.positions, default=-1): f for f in reversed(d)} for d in dec]
        keys = [max(f.metadata.positions, default=-1) for f in dec[0]]
        if (
            keys
            and len(set(keys)) == len(keys)
            and all(all(k in m for k in keys) for m in maps[1:])
        ):
            for f, k in zip(dec[0], keys, strict=True):
                pairs.append(tuple([f] + [m[k] for m in maps[1:]]))
        else:
            pairs.extend(itertools.zip_longest(*dec))
    return pairs


_SIDES2 = ("ref", "test")
_SIDES3 = ("baseline", "expected", "actual")


def _unpaired_name(fwds: tuple) -> str:
    f = next(x for x in fwds if x is not None)
    return f"(step {f.dir_name})"


def compare_captures_two_way(
    ref: list[CapturedForwardPass],
    test: list[CapturedForwardPass],
    ref_reconstruction_fn: ReconstructionFn | None = None,
    test_reconstruction_fn: ReconstructionFn | None = None,
    alignment_fn: AlignmentFn | None = None,
    module_order: list[str] | None = None,
    phase: str | None = None,
    strict: bool = False,
) -> dict[str, dict[int, list[ComparisonResult]]]:
    """Compare two capture lists module by module, token by token.

    Reconstruction defaults to TP rank 0; ``alignment_fn`` (default
    :func:`align_and_truncate_hidden`) is called as ``fn(ref, test, test)``.
    Returns ``{prompt: {step: [ComparisonResult]}}`` with names
    ``{module_with_underscores}/token{i}``. A module that cannot be aligned gives a
    ``shape_match=False`` result, or ValueError with ``strict=True``.
    """
    rfn = ref_reconstruction_fn or default_reconstruction
    tfn = test_reconstruction_fn or default_reconstruction
    afn = alignment_fn or align_and_truncate_hidden
    rg, tg = group_by_prompt(ref), list(group_by_prompt(test).values())
    out: dict[str, dict[int, list[ComparisonResult]]] = {}
    for pi, (prompt, rfwds) in enumerate(rg.items()):
        out[prompt] = {}
        tfwds = tg[pi] if pi < len(tg) else []
        for step, (rf, tf) in enumerate(_pair_steps([rfwds, tfwds], phase)):
            if rf is None or tf is None:
                side = _SIDES2[(rf, tf).index(None)]
                out[prompt][step] = [
                    ComparisonResult(_unpaired_name((rf, tf)), shape_match=False, missing=side)
                ]
                continue
            res: list[ComparisonResult] = []
            for m in _module_list([rf, tf], module_order):
                rn, tn = _resolve(rf, m), _resolve(tf, m)
                nm = normalize_name(m)
                if rn is None or tn is None:
                    res.append(
                        ComparisonResult(
                            nm, shape_match=False, missing="ref" if rn is None else "test"
                        )
                    )
                    continue
                r = call_reconstruction(rfn, rf, rn)
                t = call_reconstruction(tfn, tf, tn)
                r2, t2, _, ok = afn(r, t, t)
                if not ok:
                    if strict:
                        _check_shapes(nm, [tuple(r.shape), tuple(t.shape)])
                    res.append(
                        ComparisonResult(
                            nm, shape_match=False, shape1=tuple(r.shape), shape2=tuple(t.shape)
                        )
                    )
                    continue
                if r2.dim() >= 2:
                    res.extend(compare_rows(r2, t2, nm))
                else:
                    res.append(compare_tensors(r2, t2, nm))
            out[prompt][step] = res
    return out


def compare_captures_three_way(
    baseline: list[CapturedForwardPass],
    expected: list[CapturedForwardPass],
    actual: list[CapturedForwardPass],
    reference_reconstruction_fn: ReconstructionFn | None = None,
    target_reconstruction_fn: ReconstructionFn | None = None,
    alignment_fn: AlignmentFn | None = None,
    module_order: list[str] | None = None,
    phase: str | None = None,
    config: DynamicThresholdConfig | None = None,
    strict: bool = False,
) -> dict[str, dict[int, list[ThreeWayComparisonResult]]]:
    """Three-way comparison of capture lists (baseline FP32, expected, actual).

    ``reference_reconstruction_fn`` applies to baseline and expected,
    ``target_reconstruction_fn`` to actual. Returns ``{prompt: {step: [results]}}``.
    """
    config = config or DynamicThresholdConfig()
    rfn = reference_reconstruction_fn or default_reconstruction
    tfn = target_reconstruction_fn or default_reconstruction
    afn = alignment_fn or align_and_truncate_hidden
    bg = group_by_prompt(baseline)
    eg, ag = list(group_by_prompt(expected).values()), list(group_by_prompt(actual).values())
    out: dict[str, dict[int, list[ThreeWayComparisonResult]]] = {}
    for pi, (prompt, bfwds) in enumerate(bg.items()):
        out[prompt] = {}
        efwds = eg[pi] if pi < len(eg) else []
        afwds = ag[pi] if pi < len(ag) else []
        for step, (bf, ef, af) in enumerate(_pair_steps([bfwds, efwds, afwds], phase)):
            if None in (bf, ef, af):
                side = _SIDES3[(bf, ef, af).index(None)]
                out[prompt][step] = [
                    ThreeWayComparisonResult(
                        _unpaired_name((bf, ef, af)), shape_match=False, missing=side
                    )
                ]
                continue
            res: list[ThreeWayComparisonResult] = []
            for m in _module_list([bf, ef, af], module_order):
                names = [_resolve(f, m) for f in (bf, ef, af)]
                nm = normalize_name(m)
                if None in names:
                    side = ("baseline", "expected", "actual")[names.index(None)]
                    res.append(ThreeWayComparisonResult(nm, shape_match=False, missing=side))
                    continue
                b = call_reconstruction(rfn, bf, names[0])
                e = call_reconstruction(rfn, ef, names[1])
                a = call_reconstruction(tfn, af, names[2])
                b2, e2, a2, ok = afn(b, e, a)
                if not ok:
                    if strict:
                        _check_shapes(nm, [tuple(b.shape), tuple(e.shape), tuple(a.shape)])
                    res.append(ThreeWayComparisonResult(nm, shape_match=False))
                    continue
                if b2.dim() >= 2:
                    res.extend(compare_rows_three_way(b2, e2, a2, nm, config))
                else:
                    res.append(compare_tensors_three_way(b2, e2, a2, nm, config))
            out[prompt][step] = res
    return out


@dataclass
class AggregateMetrics:
    """Pooled three-way metrics of one module (token suffix stripped) across prompts/steps."""

    name: str
    count: int
    max_base_linf: float
    max_tgt_linf: float
    max_base_l2: float
    max_tgt_l2: float
    linf_ratio: float
    l2_ratio: float
    bc: float
    passed: bool


def compute_aggregate_metrics(
    results: dict[str, dict[int, list[ThreeWayComparisonResult]]],
    config: DynamicThresholdConfig | None = None,
) -> dict[str, AggregateMetrics]:
    """Pool three-way results over prompts, steps and tokens, per module.

    Ratios are of the max errors; BC is computed on the pooled error samples;
    ``passed`` needs both ratios under their multipliers and ``bc >= bc_threshold``.
    """
    config = config or DynamicThresholdConfig()
    acc: dict[str, list[ThreeWayComparisonResult]] = {}
    for steps in results.values():
        for res in steps.values():
            for r in res:
                if r.shape_match and not r.missing:
                    acc.setdefault(r.name.split("/token")[0], []).append(r)
    out = {}
    for name, rs in acc.items():
        mb, mt = max(r.base_linf for r in rs), max(r.tgt_linf for r in rs)
        mb2, mt2 = max(r.base_l2 for r in rs), max(r.tgt_l2 for r in rs)
        be = [r.base_errors for r in rs if r.base_errors is not None]
        te = [r.tgt_errors for r in rs if r.tgt_errors is not None]
        bc = (
            bhattacharyya_coefficient(torch.cat(be), torch.cat(te), config.bc_bins)
            if be
            else float("nan")
        )
        lr, l2r = _ratio(mt, mb), _ratio(mt2, mb2)
        passed = (
            lr < config.linf_multiplier and l2r < config.l2_multiplier and bc >= config.bc_threshold
        )
        out[name] = AggregateMetrics(name, len(rs), mb, mt, mb2, mt2, lr, l2r, bc, bool(passed))
    return out
