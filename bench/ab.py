"""A/B of two commits on one benchmark, side by side in one run.

Each commit gets a git worktree (under ``--workdir``); the benchmark runs in turns,
before, after, before, after, ... (``--rounds`` each), with this checkout's Python (its
``.venv``) and the worktree as the working directory, so each run imports that commit's
code. Every run writes its own JSON under ``OUT/<commit>/round<k>/``. The benchmarks'
own within-run ratios (``bench.e2e``'s ``speedup_vs_hf``, ``bench.vllm_e2e``'s
``ratio_to_vllm_plain``: each policy over a baseline measured beside it in the same run)
are compared, median over rounds, so the machine's drift between runs cancels; ``tau``
is compared too. Writes ``OUT/ab.json``.

    python -m bench.ab --before 120440e --after HEAD --rounds 2 --out results/ab_e2e -- \\
        -m bench.e2e --quick --families chain,topk,ngram,hybrid --budgets 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench.io import atomic_write_json

REPO = Path(__file__).resolve().parents[1]
RATIO_KEYS = ("speedup_vs_hf", "ratio_to_vllm_plain", "tau")


def _rev(rev: str) -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise ValueError(f"--before/--after: {rev!r} is not a commit here: {out.stderr.strip()}")
    return out.stdout.strip()


def _worktree(sha: str, workdir: Path) -> Path:
    path = workdir / sha
    if not (path / ".git").exists():
        workdir.mkdir(parents=True, exist_ok=True)
        cmd = ["git", "worktree", "add", "--detach", "--force", str(path), sha]
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return path


def flatten(report: dict) -> dict[str, float]:
    """``{"<row> | <scenario> | <key>": value}`` for every ratio of a benchmark report
    (``bench.e2e``: rows and peers by drafter, spec and temperature; ``bench.vllm_e2e``:
    rows by name, per scenario)."""
    flat: dict[str, float] = {}
    for row in list(report.get("results", [])) + list(report.get("peers", [])):
        if "scenarios" in row:
            for scen, cell in row["scenarios"].items():
                for k in RATIO_KEYS:
                    if isinstance(cell.get(k), (int, float)):
                        flat[f"{row['name']} | {scen} | {k}"] = float(cell[k])
            continue
        name = f"{row.get('drafter')} {row.get('spec')} T={row.get('temperature')}"
        for k in RATIO_KEYS:
            if isinstance(row.get(k), (int, float)):
                flat[f"{name} | {k}"] = float(row[k])
    return flat


def compare(runs: dict[str, list[dict[str, float]]], before: str, after: str) -> list[dict]:
    """Per figure: the median over rounds of each commit's value, and after / before."""
    keys = sorted(set.intersection(*(set(r) for rs in runs.values() for r in rs)))
    rows = []
    for key in keys:
        b = statistics.median(r[key] for r in runs[before])
        a = statistics.median(r[key] for r in runs[after])
        rows.append(
            {"figure": key, "before": b, "after": a, "after_over_before": a / b if b else None}
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True)
    p.add_argument("--after", default="HEAD")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="results/ab")
    p.add_argument("--workdir", default="/tmp/treespec-ab")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the python arguments")
    a = p.parse_args(argv)
    bench = a.bench[1:] if a.bench[:1] == ["--"] else a.bench
    if not bench or a.rounds < 1:
        p.error("give the benchmark after --, e.g. -- -m bench.e2e --quick; --rounds >= 1")
    before, after = _rev(a.before), _rev(a.after)
    out = (REPO / a.out).resolve()
    trees = {sha: _worktree(sha, Path(a.workdir)) for sha in (before, after)}
    runs: dict[str, list[dict[str, float]]] = {before: [], after: []}
    for k in range(a.rounds):
        for sha in (before, after):
            dest = out / sha / f"round{k}"
            cmd = [sys.executable, *bench, "--out", f"{dest}/"]  # a folder, for every bench
            print(f"[ab] round {k + 1}/{a.rounds}, {sha}: {' '.join(bench)}", flush=True)
            subprocess.run(cmd, cwd=trees[sha], check=True)
            report = next(dest.glob("*.json"))
            runs[sha].append(flatten(json.loads(report.read_text())))
    rows = compare(runs, before, after)
    atomic_write_json(
        out / "ab.json",
        {"before": before, "after": after, "bench": bench, "rounds": a.rounds, "figures": rows},
    )
    for r in rows:
        ratio = r["after_over_before"]
        print(
            f"{r['figure']:<60} {r['before']:8.3f} {r['after']:8.3f} "
            f"{'' if ratio is None else f'{ratio:6.3f}x'}"
        )
    print(f"wrote {out / 'ab.json'}")


if __name__ == "__main__":
    main()
