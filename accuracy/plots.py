"""PNG plots of comparison errors (matplotlib, Agg backend)."""

from __future__ import annotations

import io

from .compare import ThreeWayComparisonResult
from .tensor_io import atomic_write_bytes


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str) -> None:
    """savefig into memory, then an atomic write of the PNG."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    atomic_write_bytes(path, buf.getvalue())


def _metric(r) -> float:
    return r.linf_ratio if isinstance(r, ThreeWayComparisonResult) else r.linf_rel


def error_per_module(results: dict[str, dict[int, list]]) -> dict[str, float]:
    """Max L-inf (two-way) or L-inf ratio (three-way) per module, over tokens/steps/prompts,
    in first-seen order."""
    out: dict[str, float] = {}
    for steps in results.values():
        for res in steps.values():
            for r in res:
                if r.shape_match and not r.missing:
                    m = r.name.split("/token")[0]
                    out[m] = max(out.get(m, 0.0), _metric(r))
    return out


def error_per_step(results: dict[str, dict[int, list]]) -> dict[str, dict[int, float]]:
    """``{module: {step: max metric}}`` (prompts pooled)."""
    out: dict[str, dict[int, float]] = {}
    for steps in results.values():
        for step, res in steps.items():
            for r in res:
                if r.shape_match and not r.missing:
                    d = out.setdefault(r.name.split("/token")[0], {})
                    d[step] = max(d.get(step, 0.0), _metric(r))
    return out


def plot_errors(
    results: dict[str, dict[int, list]],
    path: str,
    threshold: float | None = None,
    title: str = "",
) -> str:
    """Two panels: max error per module (bar, log scale) and per decode step (lines).

    ``path`` is the PNG written; returns it.
    """
    plt = _plt()
    per_mod = error_per_module(results)
    per_step = error_per_step(results)
    three = any(
        isinstance(r, ThreeWayComparisonResult)
        for s in results.values()
        for x in s.values()
        for r in x
    )
    ylabel = "L-inf ratio (tgt/base)" if three else "relative L-inf"
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 0.35 * len(per_mod)), 8))
    names = list(per_mod)
    vals = [max(v, 1e-12) for v in per_mod.values()]
    colours = ["tab:red" if threshold is not None and v > threshold else "tab:blue" for v in vals]
    ax1.bar(range(len(names)), vals, color=colours)
    ax1.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
    ax1.set_yscale("log")
    ax1.set_ylabel(ylabel)
    ax1.set_title(title or "max error per module")
    if threshold is not None:
        ax1.axhline(threshold, color="k", ls="--", lw=0.8)
    for m, d in per_step.items():
        steps = sorted(d)
        ax2.plot(steps, [max(d[s], 1e-12) for s in steps], marker=".", lw=0.8, label=m)
    ax2.set_yscale("log")
    ax2.set_xlabel("step (0 = prefill)")
    ax2.set_ylabel(ylabel)
    if len(per_step) <= 12:
        ax2.legend(fontsize=6)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def plot_tree_errors(by_depth: dict[str, dict[int, float]], path: str, title: str = "") -> str:
    """Max relative L-inf per tree depth, one line per module (from ``errors_by_depth``)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for m, d in by_depth.items():
        depths = sorted(d)
        ax.plot(depths, [max(d[k], 1e-12) for k in depths], marker="o", lw=0.8, label=m)
    ax.set_yscale("log")
    ax.set_xlabel("tree depth")
    ax.set_ylabel("relative L-inf vs dense")
    ax.set_title(title or "tree vs dense error per depth")
    if len(by_depth) <= 12:
        ax.legend(fontsize=6)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path
