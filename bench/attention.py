"""Tree attention benchmark: backends vs dense masked SDPA vs single-query decode.

    python -m bench.attention [--quick] [--device cpu|cuda] [--out results]

Grid: tree nodes N in {8, 32, 64, 128}, prefix in {1K, 8K, 32K}, batch in {1, 8},
bf16 and fp32 (``--quick``: N in {8, 64}, prefix in {1K, 8K}, batch 1). Heads:
``--heads/--kv-heads/--head-dim``, default 8/2/128 on the CPU (one TP=4 shard of a
Llama-3-8B layer) and 32/8/128 on CUDA (a whole layer). Columns, all over the same
KV and measured side by side (CPU: interleaved rounds, median of the process CPU
time with one thread by default, ``--clock wall --threads N`` on a quiet machine;
CUDA: CUDA-graph replays through ``triton.testing.do_bench``, median):

* ``torch`` / ``triton``: ``kernels.tree_attention`` on a contiguous cache, and
  ``*_paged`` on a vLLM paged cache (block size 16, shuffled blocks);
* ``torch_fused``: the torch backend forced onto its fused route (PyTorch's fused
  SDPA kernel for the prefix, a masked tree block, LSE merge), which its CPU row
  tiles replace for bf16 and fp32;
* ``dense_sdpa``: what a user would otherwise write, one
  ``scaled_dot_product_attention`` with a dense ``[B, 1, N, prefix + N]`` bool mask
  (mask built outside the timed region);
* ``dense_sdpa_paged``: the same on the paged cache, i.e. after gathering each
  request's pages through the block table (what that user writes first); the
  ``*_paged`` columns are also reported against it, timed side by side with it in a
  second group on the CPU (the gather's large short-lived tensors would disturb
  the allocator state of the other columns);
* ``decode_sdpa``: single-query decode attention over the same ``prefix + N`` keys,
  the memory-bound floor of a tree step.

On the CPU the Triton backend runs on the interpreter, which is not a performance
path, so it is left out of the timing grid. Writes ``results/attention_<device>.json``
and ``.png``; prints the ratios the issue asks for.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import kernels
from bench.io import atomic_write_bytes, save_figure
from bench.timing import graph_or_eager
from tree_dev.testing import random_tree
from tree_dev.tree import TreeBatch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PAGE = 16


def make_case(
    batch: int,
    n: int,
    prefix: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> dict:
    """Inputs of every method for one shape: same keys/values in every layout."""
    gen = torch.Generator(device=device).manual_seed(seed)
    trees = [random_tree(n, seed + r) for r in range(batch)]
    tb = TreeBatch(trees, device=device)
    length = prefix + n
    pad = math.ceil(length / PAGE) * PAGE

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    q = randn(batch * n, heads, head_dim)
    k = randn(batch, pad, kv_heads, head_dim)
    v = randn(batch, pad, kv_heads, head_dim)
    # Paged copy: block i of the flat [B * pad / PAGE] sequence goes to slot perm[i].
    nblk = pad // PAGE
    perm = torch.randperm(batch * nblk, generator=gen, device=device)
    k_paged = torch.empty(batch * nblk, PAGE, kv_heads, head_dim, dtype=dtype, device=device)
    v_paged = torch.empty_like(k_paged)
    k_paged[perm] = k.reshape(batch * nblk, PAGE, kv_heads, head_dim)
    v_paged[perm] = v.reshape(batch * nblk, PAGE, kv_heads, head_dim)
    table = perm.view(batch, nblk).to(torch.int32)
    # Dense baseline: [B, Hq, N, D] queries, [B, Hkv, prefix+N, D] keys, bool mask.
    visible = torch.ones(batch, 1, n, length, dtype=torch.bool, device=device)
    for r, t in enumerate(trees):
        visible[r, 0, :, prefix:] = t.ancestor_mask.to(device)
    return dict(
        tree=tb,
        q=q,
        k=k,
        v=v,
        k_paged=k_paged,
        v_paged=v_paged,
        table=table,
        plens=torch.full((batch,), prefix, dtype=torch.int64, device=device),
        q_dense=q.view(batch, n, heads, head_dim).transpose(1, 2),
        k_dense=k[:, :length].transpose(1, 2),
        v_dense=v[:, :length].transpose(1, 2),
        mask=visible,
    )


def methods(case: dict, backends: list[str]) -> dict[str, Callable[[], torch.Tensor]]:
    """The timed closures for one case."""
    c = case
    fns: dict[str, Callable[[], torch.Tensor]] = {}
    for name in backends:
        fns[name] = lambda name=name: kernels.tree_attention(
            c["q"], c["k"], c["v"], c["tree"], c["plens"], backend=name, check_inputs=False
        )
        fns[f"{name}_paged"] = lambda name=name: kernels.tree_attention(
            c["q"],
            c["k_paged"],
            c["v_paged"],
            c["tree"],
            c["plens"],
            c["table"],
            backend=name,
            check_inputs=False,
        )
    if "torch" in backends:  # the torch backend's fused route, for comparison
        from kernels.torchops.tree_attention import tree_attention as torch_tree_attention

        fns["torch_fused"] = lambda: torch_tree_attention(
            c["q"], c["k"], c["v"], c["tree"], c["plens"], route="fused"
        )
    fns["dense_sdpa"] = lambda: F.scaled_dot_product_attention(
        c["q_dense"], c["k_dense"], c["v_dense"], attn_mask=c["mask"], enable_gqa=True
    )
    fns["dense_sdpa_paged"] = lambda: F.scaled_dot_product_attention(
        c["q_dense"], *dense_kv_from_pages(c), attn_mask=c["mask"], enable_gqa=True
    )
    fns["decode_sdpa"] = lambda: F.scaled_dot_product_attention(
        c["q_dense"][:, :, :1], c["k_dense"], c["v_dense"], enable_gqa=True
    )
    return fns


def dense_kv_from_pages(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """What a dense-SDPA user with a vLLM paged cache writes first: gather each
    request's pages through the block table. ``[B, Hkv, prefix + N, D]`` K and V."""
    table = case["table"].to(torch.int64)
    batch, length = case["mask"].shape[0], case["mask"].shape[-1]

    def gather(paged: torch.Tensor) -> torch.Tensor:
        flat = paged[table.view(-1)].view(batch, -1, *paged.shape[2:])  # [B, pages*16, H, D]
        return flat[:, :length].transpose(1, 2)

    return gather(case["k_paged"]), gather(case["v_paged"])


def time_cpu(
    fns: dict[str, Callable], min_rounds: int, budget_s: float, clock: str
) -> dict[str, float]:
    """Median ms per method, methods interleaved round by round (drift hits all alike).

    ``clock="cpu"`` measures the process's CPU time (with one thread: the work done,
    whatever the neighbours on a shared machine do); ``"wall"`` the elapsed time.
    """
    now = time.process_time if clock == "cpu" else time.perf_counter
    for _ in range(3):  # warm-up: lazy init, allocator growth, caches
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    start = time.perf_counter()
    rounds = 0
    while rounds < min_rounds or (time.perf_counter() - start < budget_s and rounds < 50):
        for name, fn in fns.items():
            t0 = now()
            fn()
            samples[name].append((now() - t0) * 1e3)
        rounds += 1
    return {k: statistics.median(v) for k, v in samples.items()}


def time_cuda(fns: dict[str, Callable], graphs: bool) -> dict[str, float]:
    """Median ms per method on CUDA (CUDA-graph replay when possible, L2 flushed)."""
    from triton.testing import do_bench

    out = {}
    for name, fn in fns.items():
        run = fn
        if graphs:
            run, captured = graph_or_eager(fn)
            if not captured:
                print(f"  {name}: no CUDA graph (host sync?), timing eagerly")
        out[name] = float(do_bench(run, warmup=10, rep=60, return_mode="median"))
    return out


SWEEP_CONFIGS = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages) for the Triton kernel
    (64, 64, 4, 2),
    (64, 32, 4, 3),
    (128, 32, 4, 2),
    (128, 64, 8, 2),
    (128, 64, 4, 3),
    (64, 128, 4, 2),
    (256, 32, 8, 2),
]


def sweep_cuda(heads: int, kv_heads: int, head_dim: int, graphs: bool) -> list[dict]:
    """Triton configs x prefix splits at the goal shape (N=64, 8K prefix, bf16), vs decode."""
    from kernels.triton.tree_attention import _tree_attention

    rows = []
    for batch in (1, 8):
        case = make_case(batch, 64, 8192, heads, kv_heads, head_dim, torch.bfloat16, "cuda")
        base = time_cuda(methods(case, []), graphs)  # dense_sdpa, decode_sdpa
        fns = {}
        for cfg in SWEEP_CONFIGS:
            for splits in (None, 1, 8, 32):
                fns[(cfg, splits)] = lambda cfg=cfg, splits=splits, c=case: _tree_attention(
                    c["q"], c["k"], c["v"], c["tree"], c["plens"], config=cfg, num_splits=splits
                )
        for (cfg, splits), fn in fns.items():
            try:
                ms = time_cuda({"t": fn}, graphs)["t"]
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: skip
                print(f"  config {cfg} splits {splits}: failed ({type(exc).__name__})")
                continue
            rows.append(
                dict(
                    batch=batch,
                    config=list(cfg),
                    splits=splits,
                    ms=ms,
                    vs_decode=ms / base["decode_sdpa"],
                    dense_speedup=base["dense_sdpa"] / ms,
                )
            )
        best = min((r for r in rows if r["batch"] == batch), key=lambda r: r["ms"])
        print(
            f"SWEEP B={batch}: best config {best['config']} splits {best['splits']}: "
            f"{best['ms']:.4f} ms = {best['vs_decode']:.2f}x decode "
            f"({base['decode_sdpa']:.4f} ms), {best['dense_speedup']:.2f}x faster than dense "
            f"({base['dense_sdpa']:.4f} ms)"
        )
        del case
    return rows


def max_error(fns: dict[str, Callable], case: dict) -> dict[str, float]:
    """Max |out - dense_sdpa| of each tree-attention column (a sanity check, not a test)."""
    ref = fns["dense_sdpa"]().float().transpose(1, 2).reshape(case["q"].shape)
    errs = {}
    for name, fn in fns.items():
        if name not in ("dense_sdpa", "dense_sdpa_paged", "decode_sdpa"):
            errs[name] = float((fn().float() - ref).abs().max())
    return errs


def plot(rows: list[dict], path: Path, title: str) -> None:

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["dtype"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(
        2, len(panels), figsize=(5.5 * len(panels), 8), squeeze=False, sharex="col"
    )
    for col, (dtype, batch) in enumerate(panels):
        sel = [r for r in rows if r["dtype"] == dtype and r["batch"] == batch]
        labels = [f"N={r['nodes']}\n{r['prefix'] // 1024}K" for r in sel]
        x = range(len(sel))
        top, bottom = axes[0][col], axes[1][col]
        for name in sel[0]["median_ms"]:
            top.plot(x, [r["median_ms"][name] for r in sel], "o-", label=name, ms=3)
        top.set_yscale("log")
        top.set_ylabel("median ms")
        top.set_title(f"{dtype}, batch {batch}")
        top.legend(fontsize=7)
        for key in [k for k in sel[0] if k.endswith("/dense_sdpa")]:
            bottom.plot(x, [r[key] for r in sel], "o-", label=key, ms=3)
        bottom.axhline(1.0, color="k", lw=0.8, ls="--")
        bottom.set_ylabel("time / dense masked SDPA")
        bottom.set_xticks(list(x), labels, fontsize=7)
        bottom.legend(fontsize=7)
        for ax in (top, bottom):
            ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true", help="small grid")
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--nodes", type=int, nargs="*")
    ap.add_argument("--prefix", type=int, nargs="*")
    ap.add_argument("--batch", type=int, nargs="*")
    ap.add_argument("--dtypes", nargs="*", choices=list(DTYPES))
    ap.add_argument("--budget", type=float, default=1.0, help="CPU: seconds per shape")
    ap.add_argument("--threads", type=int, default=1, help="CPU: torch threads")
    ap.add_argument(
        "--clock",
        default="cpu",
        choices=["cpu", "wall"],
        help="CPU: process CPU time (robust on a shared machine) or wall time",
    )
    ap.add_argument("--no-graphs", action="store_true", help="CUDA: time eagerly")
    ap.add_argument(
        "--sweep", action="store_true", help="CUDA: Triton configs x splits at the goal shape"
    )
    ap.add_argument("--out", default="results")
    return ap.parse_args(argv)


def _backends(cuda: bool) -> tuple[list[str], dict[str, str]]:
    """``(backends timed, {backend left out: why})`` on this device."""
    backends, notes = [], {}
    for name in ("torch", "triton", "nki"):
        ok, note = kernels.backend_status(name)
        if not ok:
            notes[name] = f"absent: {note}"
        elif name == "triton" and not cuda:
            notes[name] = "skipped on CPU: the Triton interpreter is not a performance path"
        elif name == "nki":
            notes[name] = "skipped: the NumPy NKI executor is not a performance path"
        elif name == "torch" and cuda:
            notes[name] = "skipped on CUDA: the torch backend is the CPU path"
        else:
            backends.append(name)
    return backends, notes


@dataclass
class _Plan:
    """What one run times: the head shape, the backends and the grid of shapes."""

    cuda: bool
    heads: int
    kv_heads: int
    backends: list[str]
    notes: dict[str, str]
    grid: list[tuple[str, int, int, int]]  # (dtype, batch, nodes, prefix)


def _plan(args: argparse.Namespace, cuda: bool) -> _Plan:
    """The head shape, backends and shape grid from the command line (CUDA: goal shape first)."""
    heads = args.heads or (32 if cuda else 8)
    kv_heads = args.kv_heads or (8 if cuda else 2)
    nodes = args.nodes or ([8, 64] if args.quick else [8, 32, 64, 128])
    prefixes = args.prefix or ([1024, 8192] if args.quick else [1024, 8192, 32768])
    batches = args.batch or ([1] if args.quick else [1, 8])
    dtypes = args.dtypes or (["bf16"] if args.quick and cuda else list(DTYPES))
    backends, notes = _backends(cuda)
    grid = [(dt, b, n, p) for dt in dtypes for b in batches for p in prefixes for n in nodes]
    if cuda:  # the goal shape first, so a cut-short run still answers the question
        grid.sort(key=lambda s: (s[2], s[3]) != (64, 8192))
    return _Plan(cuda, heads, kv_heads, backends, notes, grid)


def _print_header(args: argparse.Namespace, plan: _Plan) -> None:
    """The device, head shape, backends and clock, and why any backend is left out."""
    clock = (
        "CUDA-graph replays"
        if plan.cuda
        else f"{args.clock} time, {torch.get_num_threads()} thread(s)"
    )
    print(
        f"device {args.device}, heads {plan.heads}/{plan.kv_heads}x{args.head_dim}, "
        f"backends {plan.backends}, medians of {clock}"
    )
    for name, note in plan.notes.items():
        print(f"  {name}: {note}")


def _time_shape(
    args: argparse.Namespace, plan: _Plan, fns: dict[str, Callable]
) -> dict[str, float]:
    """Median ms of every column at one shape (CPU: the paged columns in a second group)."""
    if plan.cuda:
        return time_cuda(fns, graphs=not args.no_graphs)
    # Two side-by-side groups: the page gather's big short-lived tensors would
    # disturb the allocator state the other columns run in.
    paged = [f"{b}_paged" for b in plan.backends] + ["dense_sdpa_paged"]
    main_fns = {k: f for k, f in fns.items() if k != "dense_sdpa_paged"}
    med = time_cpu(main_fns, min_rounds=3, budget_s=args.budget, clock=args.clock)
    med2 = time_cpu(
        {k: fns[k] for k in paged}, min_rounds=3, budget_s=args.budget, clock=args.clock
    )
    med["dense_sdpa_paged"] = med2.pop("dense_sdpa_paged")
    med.update({f"{k} (paged group)": v for k, v in med2.items()})
    return med


def _ratios(row: dict, med: dict[str, float], backends: list[str]) -> None:
    """Add each backend's time over dense masked SDPA and decode SDPA to ``row``."""
    if "torch_fused" in med:
        row["torch_fused/dense_sdpa"] = med["torch_fused"] / med["dense_sdpa"]
    for name in backends:
        row[f"{name}/dense_sdpa"] = med[name] / med["dense_sdpa"]
        row[f"{name}/decode_sdpa"] = med[name] / med["decode_sdpa"]
        row[f"{name}_paged/dense_sdpa"] = med[f"{name}_paged"] / med["dense_sdpa"]
        paged_ms = med.get(f"{name}_paged (paged group)", med[f"{name}_paged"])
        row[f"{name}_paged/dense_sdpa_paged"] = paged_ms / med["dense_sdpa_paged"]


def _print_goal(dt: str, b: int, med: dict[str, float]) -> None:
    """CUDA, the goal shape: Triton against decode and dense SDPA."""
    tqdm.write(
        f"GOAL {dt} B={b} N=64 prefix=8K: triton {med['triton']:.4f} ms "
        f"(paged {med['triton_paged']:.4f}), decode {med['decode_sdpa']:.4f} ms -> "
        f"{med['triton'] / med['decode_sdpa']:.2f}x decode (goal <= 1.3x); dense "
        f"{med['dense_sdpa']:.4f} ms -> {med['dense_sdpa'] / med['triton']:.2f}x "
        "faster than dense (goal >= 3x)"
    )


def _measure_shape(args: argparse.Namespace, plan: _Plan, dt: str, b: int, n: int, p: int) -> dict:
    """One row of the report: every column timed at one shape, errors and ratios."""
    case = make_case(b, n, p, plan.heads, plan.kv_heads, args.head_dim, DTYPES[dt], args.device)
    fns = methods(case, plan.backends)
    errs = max_error(fns, case)
    med = _time_shape(args, plan, fns)
    row = dict(dtype=dt, batch=b, nodes=n, prefix=p, median_ms=med, max_abs_err=errs)
    row["dense_mask_bytes"] = b * n * (p + n)  # bool mask of the dense baseline
    _ratios(row, med, plan.backends)
    if plan.cuda and "triton" in plan.backends and (n, p) == (64, 8192):
        _print_goal(dt, b, med)
    return row


def _print_summary(rows: list[dict], backends: list[str]) -> None:
    """The ratio table and each backend's worst shape against dense masked SDPA."""
    cols = [f"{b}/dense_sdpa" for b in backends] + [f"{b}_paged/dense_sdpa" for b in backends]
    cols += ["torch_fused/dense_sdpa"] if "torch" in backends else []
    cols += [f"{b}_paged/dense_sdpa_paged" for b in backends]
    cols += [f"{b}/decode_sdpa" for b in backends]
    print(f"\n{'dtype':5} {'B':>2} {'N':>4} {'prefix':>6} " + " ".join(f"{c:>28}" for c in cols))
    for r in rows:
        vals = " ".join(f"{r[c]:28.3f}" for c in cols)
        print(f"{r['dtype']:5} {r['batch']:2d} {r['nodes']:4d} {r['prefix']:6d} {vals}")
    for b in backends:
        worst = max(rows, key=lambda r, b=b: r[f"{b}/dense_sdpa"])
        print(
            f"{b}: worst {b}/dense_sdpa = {worst[f'{b}/dense_sdpa']:.3f} at {worst['dtype']} "
            f"B={worst['batch']} N={worst['nodes']} prefix={worst['prefix']} "
            f"(<= 1.0 means not slower than dense masked SDPA)"
        )


def main(argv: list[str] | None = None) -> dict:
    """Time the grid, writing the report after every shape; returns the report."""
    args = _parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    if not cuda:
        torch.set_num_threads(args.threads)
    plan = _plan(args, cuda)
    _print_header(args, plan)

    sweep = []
    if cuda and args.sweep and "triton" in plan.backends:
        sweep = sweep_cuda(plan.heads, plan.kv_heads, args.head_dim, graphs=not args.no_graphs)

    rows = []
    out = Path(args.out)
    report = dict(
        device=args.device,
        device_name=torch.cuda.get_device_name() if cuda else "cpu",
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        clock="cuda events" if cuda else args.clock,
        heads=plan.heads,
        kv_heads=plan.kv_heads,
        head_dim=args.head_dim,
        page_size=PAGE,
        notes=plan.notes,
        rows=rows,
        sweep=sweep,
    )
    for dt, b, n, p in tqdm(plan.grid, desc="shapes"):
        rows.append(_measure_shape(args, plan, dt, b, n, p))
        atomic_write_bytes(
            out / f"attention_{args.device}.json", json.dumps(report, indent=1).encode()
        )

    plot(rows, out / f"attention_{args.device}.png", f"tree attention, {args.device}")
    _print_summary(rows, plan.backends)
    print(f"wrote {out / f'attention_{args.device}.json'} and .png")
    return report


if __name__ == "__main__":
    main()
