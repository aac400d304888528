"""The kernel report: every backend of every op against ``kernels/reference.py``.

    python -m bench [--size small|tiny] [--backends reference,torch,...] [--ops ...]
                    [--repeats 5] [--threads 1] [--out results/bench_report.json] [--no-plot]

For each op (``kernels.OPS``) and a few small cases, runs every backend of
``kernels.BACKENDS`` through the public op (inputs are validated the same way),
compares its output with the reference backend's (float outputs: max absolute
error, integer outputs: exact match) and times it (median of a few calls after a
warm-up call, which is also the one compared). Backends that do not import, or
lack an op, are listed with the reason. Prints a table, writes JSON (and a PNG
of the times) under ``results/``. On a CPU machine, Triton runs on its
interpreter and NKI on the project's NumPy executor: their times say how long
tests take here, not how fast the kernels are on a GPU or Trainium.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import kernels
from bench.io import atomic_write_text, save_figure
from tree_dev.tree import TokenTree, TreeBatch

__all__ = ["Row", "build_cases", "format_table", "main", "run_report", "write_json"]

# Largest max-abs error counted as agreement, by the dtype of the compared output.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
CPU_ONLY_BACKENDS = ("nki",)  # the NumPy NKI executor takes CPU tensors


@dataclass
class Row:
    """One line of the report: one op, one case, one backend."""

    op: str
    case: str
    backend: str
    status: str  # ok | mismatch | absent | not available | rejected | error
    max_err: float | None = None  # float outputs vs the reference
    exact: bool | None = None  # integer (and moved) outputs equal the reference
    median_ms: float | None = None
    runs: int = 0
    note: str = ""


@dataclass
class Case:
    """Inputs of one op call; ``make(device)`` returns fresh keyword arguments."""

    op: str
    name: str
    make: Callable[[torch.device], dict[str, Any]]
    exact_only: bool = False  # compare every output exactly (walk, kv moves)
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- inputs
def _trees(size: str) -> list[TokenTree]:
    if size == "tiny":
        return [TokenTree.chain(2), TokenTree.from_parents([-1, 0, 0, 1])]
    return [
        TokenTree.preset("mc_sim_7b_63"),
        TokenTree.chain(4),
        TokenTree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]),
    ]


def _block_table(lens: list[int], block_size: int, gen: torch.Generator):
    """A random block table for requests of ``lens`` tokens (+2 blocks nobody owns)."""
    need = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    return table, num_blocks


def _scatter(rows: list[torch.Tensor], table: torch.Tensor, num_blocks: int, block_size: int):
    """Paged cache holding request ``b``'s token rows ``rows[b] [len, H, D]``."""
    cache = torch.zeros(num_blocks, block_size, *rows[0].shape[1:], dtype=rows[0].dtype)
    for b, r in enumerate(rows):
        for pos in range(r.shape[0]):
            cache[int(table[b, pos // block_size]), pos % block_size] = r[pos]
    return cache


def _attention_case(size: str, dtype: torch.dtype, paged: bool) -> Case:
    trees = _trees(size)
    prefix = [3, 0] if size == "tiny" else [37, 0, 100]
    hq, hkv, d = (2, 1, 16) if size == "tiny" else (8, 2, 64)
    block_size = 4 if size == "tiny" else 16
    gen = torch.Generator().manual_seed(0)
    batch = TreeBatch(trees)
    lens = [p + t.num_nodes for p, t in zip(prefix, trees, strict=True)]
    q = torch.randn(batch.total_nodes, hq, d, generator=gen).to(dtype)
    ks = [torch.randn(n, hkv, d, generator=gen).to(dtype) for n in lens]
    vs = [torch.randn(n, hkv, d, generator=gen).to(dtype) for n in lens]
    if paged:
        table, num_blocks = _block_table(lens, block_size, gen)
        k_cache = _scatter(ks, table, num_blocks, block_size)
        v_cache = _scatter(vs, table, num_blocks, block_size)
    else:
        table = None
        k_cache = torch.zeros(len(trees), max(lens), hkv, d, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        for b in range(len(trees)):
            k_cache[b, : lens[b]], v_cache[b, : lens[b]] = ks[b], vs[b]
    prefix_lens = torch.tensor(prefix, dtype=torch.int64)

    def make(device: torch.device) -> dict[str, Any]:
        return dict(
            q=q.to(device),
            k_cache=k_cache.to(device),
            v_cache=v_cache.to(device),
            tree=batch.to(device),
            prefix_lens=prefix_lens.to(device),
            block_table=None if table is None else table.to(device),
            return_lse=True,
        )

    layout = f"paged bs{block_size}" if paged else "contiguous"
    shape_name = f"{len(trees)} trees ({'+'.join(str(t.num_nodes) for t in trees)} nodes)"
    name = f"{shape_name}, prefix {'/'.join(map(str, prefix))}, {layout}, "
    name += f"{str(dtype).replace('torch.', '')}, Hq{hq}/Hkv{hkv} D{d}"
    return Case("tree_attention", name, make)


def _walk_case(size: str, mode: str) -> Case:
    trees = _trees(size)
    vocab = 16 if size == "tiny" else 128
    gen = torch.Generator().manual_seed(1)
    batch = TreeBatch(trees)
    tokens, logits = [], []
    for tree in trees:
        kids: list[list[int]] = [[] for _ in range(tree.num_nodes)]
        for i in range(1, tree.num_nodes):
            kids[int(tree.parents[i])].append(i)
        tok = [0] * tree.num_nodes
        lg = torch.randn(tree.num_nodes, vocab, generator=gen)
        for p in range(tree.num_nodes):
            perm = torch.randperm(vocab, generator=gen)[: len(kids[p])].tolist()
            for c, t in zip(kids[p], perm, strict=True):
                tok[c] = t
            if kids[p]:  # make the first child the target's favourite: long greedy walks
                lg[p, tok[kids[p][0]]] += 6.0
        tokens += tok
        logits.append(lg)
    logits_t = torch.cat(logits)
    tokens_t = torch.tensor(tokens, dtype=torch.int64)
    uniforms = torch.rand(batch.total_nodes, 2, generator=gen)
    draft = torch.softmax(torch.randn(batch.total_nodes, vocab, generator=gen), -1)
    temperature, top_p = (0.8, 0.9) if mode != "greedy" else (1.0, 1.0)

    def make(device: torch.device) -> dict[str, Any]:
        return dict(
            logits=logits_t.to(device),
            tokens=tokens_t.to(device),
            tree=batch.to(device),
            mode=mode,
            uniforms=None if mode == "greedy" else uniforms.to(device),
            draft_probs=draft.to(device) if mode == "draft_probs" else None,
            temperature=temperature,
            top_p=top_p,
        )

    name = f"{mode}, {len(trees)} trees, vocab {vocab}"
    if mode != "greedy":
        name += f", T={temperature} top-p={top_p}"
    return Case("tree_walk", name, make, exact_only=True)


def _compact_case(size: str, paged: bool, layers: int | None) -> Case:
    trees = _trees(size)
    prefix = [3, 0] if size == "tiny" else [37, 0, 100]
    heads, d, block_size = (2, 8, 4) if size == "tiny" else (4, 64, 16)
    gen = torch.Generator().manual_seed(2)
    depth = max(t.max_depth for t in trees)
    nodes = torch.full((len(trees), depth + 1), -1, dtype=torch.int64)
    acc = []
    for b, tree in enumerate(trees):  # the path to the deepest leaf
        path = tree.path_to(int(torch.argmax(tree.depth)))
        nodes[b, : len(path)] = torch.tensor(path)
        acc.append(len(path))
    lens = [p + t.num_nodes for p, t in zip(prefix, trees, strict=True)]
    lead = () if layers is None else (layers,)
    if paged:
        table, num_blocks = _block_table(lens, block_size, gen)
        shape = (*lead, num_blocks, block_size, heads, d)
    else:
        table = None
        shape = (*lead, len(trees), max(lens), heads, d)
    k = torch.randn(shape, generator=gen)
    v = torch.randn(shape, generator=gen)
    prefix_lens = torch.tensor(prefix, dtype=torch.int64)
    accepted_len = torch.tensor(acc, dtype=torch.int64)

    def make(device: torch.device) -> dict[str, Any]:  # fresh caches: the op is in place
        return dict(
            k_cache=k.clone().to(device),
            v_cache=v.clone().to(device),
            prefix_lens=prefix_lens.to(device),
            accepted_nodes=nodes.to(device),
            accepted_len=accepted_len.to(device),
            block_table=None if table is None else table.to(device),
        )

    name = f"{'paged' if paged else 'contiguous'}, "
    name += f"{layers} layers" if layers else "one layer"
    name += f", {len(trees)} requests, accepted {'/'.join(map(str, acc))}"
    return Case("kv_compact", name, make, exact_only=True)


def build_cases(size: str = "small", ops: Sequence[str] | None = None) -> list[Case]:
    """The report's cases for ``size`` ("small": seconds per backend; "tiny": tests)."""
    if size not in ("small", "tiny"):
        raise ValueError(f"size must be 'small' or 'tiny', got {size!r}")
    cases = [
        _attention_case(size, torch.float32, paged=True),
        _attention_case(size, torch.bfloat16, paged=False),
        *(_walk_case(size, mode) for mode in ("greedy", "target_only", "draft_probs")),
        _compact_case(size, paged=True, layers=2),
        _compact_case(size, paged=False, layers=None),
    ]
    return [c for c in cases if ops is None or c.op in ops]


# ----------------------------------------------------------------------------- running
def _call(case: Case, backend: str, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Run the public op; return its outputs as a flat list of tensors."""
    fn = getattr(kernels, case.op)
    if case.op == "tree_walk":
        args = (kwargs.pop("logits"), kwargs.pop("tokens"), kwargs.pop("tree"), kwargs.pop("mode"))
        return list(fn(*args, backend=backend, **kwargs))
    if case.op == "tree_attention":
        return list(fn(backend=backend, **kwargs))
    if case.op == "kv_compact":
        lens = fn(backend=backend, **kwargs)
        return [lens, kwargs["k_cache"], kwargs["v_cache"]]
    raise ValueError(f"unknown op {case.op!r}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compare(case: Case, want: list[torch.Tensor], got: list[torch.Tensor]):
    """``(max_err, exact, agrees)`` of ``got`` against the reference outputs ``want``."""
    max_err, exact, agrees = None, True, True
    for w, g in zip(want, got, strict=True):
        g = g.detach().cpu()
        if g.shape != w.shape:
            return None, False, False
        same = bool(torch.equal(g, w))
        exact &= same
        if w.is_floating_point():
            err = float((g.double() - w.double()).abs().max()) if w.numel() else 0.0
            err = err if not math.isnan(err) else math.inf
            max_err = err if max_err is None else max(max_err, err)
            if not case.exact_only and err > TOLERANCE.get(g.dtype, 1e-4):
                agrees = False
        elif not same:
            agrees = False
    if case.exact_only:
        return None, exact, exact
    return max_err, exact, agrees


def _op_available(backend: str, op: str) -> str | None:
    """None if ``backend`` has ``op``, else the reason it does not."""
    try:
        module = importlib.import_module(kernels.BACKENDS[backend])
        getattr(module, op)
    except Exception as exc:  # noqa: BLE001  (any failure makes the op unusable: say why)
        return f"{type(exc).__name__}: {exc}"
    return None


def _device_for(backend: str) -> torch.device:
    if backend in CPU_ONLY_BACKENDS or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


def run_report(
    size: str = "small",
    backends: Sequence[str] | None = None,
    repeats: int = 5,
    time_budget_s: float = 4.0,
    ops: Sequence[str] | None = None,
    progress: bool = True,
) -> tuple[list[Row], dict[str, dict[str, Any]]]:
    """Run every case on every backend.

    Args:
        size: "small" (the report) or "tiny" (tests).
        backends: names from ``kernels.BACKENDS`` (default: all of them).
        repeats: timed calls after the warm-up call (fewer when a backend
            exceeds ``time_budget_s`` on a case).
        ops: restrict to these ops.

    Returns:
        ``(rows, backend_info)``: one ``Row`` per (case, backend), and for each
        backend ``{"available": bool, "note": str}`` from ``kernels.backend_status``.
    """
    names = list(kernels.BACKENDS) if backends is None else list(backends)
    if "reference" not in kernels.BACKENDS:
        raise ValueError("kernels.BACKENDS has no 'reference' backend to compare with")
    info: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            available, note = kernels.backend_status(name)
        except Exception as exc:  # noqa: BLE001
            available, note = False, f"{type(exc).__name__}: {exc}"
        info[name] = {"available": available, "note": note}
    cases = build_cases(size, ops)
    rows: list[Row] = []
    tasks = [(c, n) for c in cases for n in names]
    bar = tqdm(tasks, desc="kernel report", disable=not progress, file=sys.stderr, leave=False)
    reference_out: dict[int, list[torch.Tensor]] = {}
    for case, name in bar:
        bar.set_postfix_str(f"{case.op} {name}")
        if id(case) not in reference_out:
            want = _call(case, "reference", case.make(torch.device("cpu")))
            reference_out[id(case)] = [w.detach().cpu() for w in want]
        rows.append(
            _run_one(case, name, info[name], reference_out[id(case)], repeats, time_budget_s)
        )
    return rows, info


def _run_one(case, name, status, want, repeats, time_budget_s) -> Row:
    row = Row(case.op, case.name, name, "ok")
    if not status["available"]:
        row.status, row.note = "absent", status["note"]
        return row
    missing = _op_available(name, case.op)
    if missing is not None:
        row.status, row.note = "not available", missing
        return row
    device = _device_for(name)
    try:
        got = _call(case, name, case.make(device))
        _sync(device)
    except ValueError as exc:
        row.status, row.note = "rejected", str(exc)
        return row
    except Exception as exc:  # noqa: BLE001  (a broken backend is a report line, not a crash)
        row.status, row.note = "error", f"{type(exc).__name__}: {exc}"
        return row
    row.max_err, row.exact, agrees = _compare(case, want, got)
    row.status = "ok" if agrees else "mismatch"
    times: list[float] = []
    spent = 0.0
    for _ in range(max(0, repeats)):
        kwargs = case.make(device)
        _sync(device)
        start = time.perf_counter()
        _call(case, name, kwargs)
        _sync(device)
        times.append(time.perf_counter() - start)
        spent += times[-1]
        if spent > time_budget_s:
            break
    row.runs = len(times)
    row.median_ms = statistics.median(times) * 1e3 if times else None
    row.note = status["note"]
    return row


# ----------------------------------------------------------------------------- output
def _fmt_err(row: Row) -> str:
    """Float outputs: max abs error; exactly compared outputs (walk, KV moves): yes/no."""
    if row.max_err is not None:
        return "0" if row.max_err == 0 else f"{row.max_err:.1e}"
    if row.exact is not None:
        return "exact: yes" if row.exact else "exact: NO"
    return "-"


def format_table(rows: Sequence[Row], info: dict[str, dict[str, Any]]) -> str:
    """The report as aligned plain text: backend notes, then one line per row."""
    lines = ["Backends:"]
    for name, st in info.items():
        state = "available" if st["available"] else "ABSENT"
        lines.append(f"  {name:<10} {state}" + (f": {st['note']}" if st["note"] else ""))
    lines.append("")
    header = ("op", "case", "backend", "status", "max err|exact", "median ms")
    table = [header]
    for r in rows:
        status = r.status if r.status in ("ok", "mismatch") else f"{r.status}: {r.note}"
        ms = "-" if r.median_ms is None else f"{r.median_ms:.3g}"
        table.append((r.op, r.case, r.backend, status, _fmt_err(r), ms))
    fixed = [max(len(t[i]) for t in table) for i in range(3)]
    for t in table:
        left = "  ".join(t[i].ljust(fixed[i]) for i in range(3))
        lines.append(f"{left}  {t[4]:>16}  {t[5]:>10}  {t[3]}")
        if t is header:
            lines.append("-" * (sum(fixed) + 6 + 16 + 2 + 10 + 2 + 20))
    return "\n".join(lines)


def write_json(path: Path, rows: Sequence[Row], info: dict[str, dict[str, Any]]) -> None:
    """Write the report atomically (temp file + rename)."""
    payload = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "torch_threads": torch.get_num_threads(),
        "backends": info,
        "rows": [asdict(r) for r in rows],
    }
    atomic_write_text(path, json.dumps(payload, indent=2, allow_nan=False, default=str))


def write_plot(path: Path, rows: Sequence[Row]) -> bool:
    """Median time per case and backend (log scale) as a PNG; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    timed = [r for r in rows if r.median_ms is not None]
    if not timed:
        return False
    cases = list(dict.fromkeys((r.op, r.case) for r in timed))
    backends = list(dict.fromkeys(r.backend for r in timed))
    width = 0.8 / len(backends)
    fig, ax = plt.subplots(figsize=(max(8, 2.2 * len(cases)), 6))
    for j, backend in enumerate(backends):
        xs, ys = [], []
        for i, key in enumerate(cases):
            for r in timed:
                if (r.op, r.case) == key and r.backend == backend:
                    xs.append(i + j * width)
                    ys.append(r.median_ms)
        ax.bar(xs, ys, width=width, label=backend)
    ax.set_yscale("log")
    ax.set_ylabel("median ms per call")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    labels = [op + "\n" + textwrap.fill(case, 26, max_lines=4) for op, case in cases]
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_title("Kernel report: time per call (this machine)")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=["small", "tiny"], default="small")
    parser.add_argument("--backends", default=None, help="comma-separated (default: all)")
    parser.add_argument("--ops", default=None, help="comma-separated (default: all)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("results/bench_report.json"))
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: stable timings on a shared machine; 0 = torch's)",
    )
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    backends = args.backends.split(",") if args.backends else None
    ops = args.ops.split(",") if args.ops else None
    start = time.perf_counter()
    rows, info = run_report(args.size, backends, args.repeats, ops=ops)
    print(format_table(rows, info))
    write_json(args.out, rows, info)
    print(f"\nwrote {args.out}", end="")
    if not args.no_plot and write_plot(args.out.with_suffix(".png"), rows):
        print(f" and {args.out.with_suffix('.png')}", end="")
    print(f" in {time.perf_counter() - start:.0f} s")
    bad = [r for r in rows if r.status in ("mismatch", "error")]
    if bad:
        print(f"{len(bad)} backend/case pairs disagree with the reference or fail", file=sys.stderr)
    return 1 if bad else 0
