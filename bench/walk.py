"""Tree walk benchmark: time per call of every available backend, vocabulary part apart.

    python -m bench.walk [--quick] [--device cpu|cuda] [--out results]

Grid: batch {1, 8, 64} x tree nodes {8, 64, 256} x vocab {32K, 128K}, bf16 logits,
random bushy trees whose first child always carries the parent's argmax (so greedy
walks go deep). ``--quick``: batch {1, 8} x nodes {8, 64} x vocab 32K.

Columns (medians, measured side by side at each point):

* ``vocab_argmax`` (greedy) / ``vocab_probs`` (stochastic): the vocabulary part,
  ``argmax(logits, -1)`` or ``reference.target_probs`` (softmax, temperature 0.8,
  top-p 0.95, float64) over all ``T`` nodes, what every backend needs before a
  walk over all nodes (on the CPU the torch backend computes them level by level
  at the visited nodes only, so its total can be below this column);
* ``<backend>_walk``: the walk alone, from the argmax / probabilities
  (``greedy_from_argmax`` / ``walk_from_probs``);
* ``<backend>_total``: ``kernels.tree_walk(..., check_inputs=False)`` end to end;
* ``reference_total``: the dense oracle, on the points where it is affordable.

Stochastic modes (``target_only``, ``draft_probs``) run where ``T * V`` is small
enough for float64 probabilities on this machine (``--max-stochastic``); greedy
where the logits fit (``--max-elements``); skipped points are listed with the
reason. On the CPU, Triton runs on its interpreter and NKI on the NumPy executor:
neither is a performance path, so neither is timed there (the JSON says so). CPU
timing: interleaved rounds, process CPU time with one thread (``--clock wall
--threads N`` on a quiet machine). CUDA: ``triton.testing.do_bench`` medians of
CUDA-graph replays where the call captures, else eager; the goal figure is the
Triton greedy walk at batch 64 x 64 nodes (one launch, < 15 us excluding the
vocabulary part), with the number of kernels it launched counted by the profiler.
Writes ``results/walk_<device>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

import kernels
from bench.io import atomic_write_bytes, save_figure
from bench.timing import graph_or_eager
from kernels.reference import target_probs
from tree_dev.testing import random_tree
from tree_dev.tree import TreeBatch

GOAL = dict(mode="greedy", batch=64, nodes=64, vocab=32768, limit_us=15.0)


def make_case(batch: int, nodes: int, vocab: int, device: str, seed: int = 0) -> dict:
    """Inputs of one grid point, generated on ``device`` (bf16 logits, fp32 draft probs)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    tb = TreeBatch(
        [random_tree(nodes, seed + r, max_children=8) for r in range(batch)], device=device
    )
    t = tb.total_nodes
    rand = lambda *shape, **kw: torch.randn(*shape, generator=gen, device=device, **kw)
    logits = rand(t, vocab, dtype=torch.bfloat16) * 3
    amax = logits.argmax(-1)
    gparent = tb.parents.clamp(min=0) + tb.cu_nodes[tb.request_ids]
    tokens = (amax[gparent] + tb.sibling_rank * 7919) % vocab  # rank 0 = the argmax
    return dict(
        tree=tb,
        logits=logits,
        tokens=tokens,
        uniforms=torch.rand(t, 2, generator=gen, device=device),
        draft_probs=torch.softmax(rand(t, vocab) * 2, -1),
    )


def backend_module(name: str, op: str = "tree_walk"):
    return importlib.import_module(f"{kernels.BACKENDS[name]}.{op}")


def columns(case: dict, mode: str, backends: list[str], with_ref: bool) -> dict[str, Callable]:
    c = case
    temp, top_p = 0.8, 0.95
    fns: dict[str, Callable] = {}
    if mode == "greedy":
        amax = torch.argmax(c["logits"], -1)
        fns["vocab_argmax"] = lambda: torch.argmax(c["logits"], -1)
        for b in backends:
            mod = backend_module(b)
            fns[f"{b}_walk"] = lambda mod=mod: mod.greedy_from_argmax(amax, c["tokens"], c["tree"])
    else:
        probs = target_probs(c["logits"], c["tree"].request_ids, temp, top_p)
        fns["vocab_probs"] = lambda: target_probs(c["logits"], c["tree"].request_ids, temp, top_p)
        dp = c["draft_probs"] if mode == "draft_probs" else None
        for b in backends:
            mod = backend_module(b)
            fns[f"{b}_walk"] = lambda mod=mod: mod.walk_from_probs(
                probs, c["tokens"], c["tree"], mode, c["uniforms"], dp
            )
    for b in backends + (["reference"] if with_ref else []):
        fns[f"{b}_total"] = lambda b=b: kernels.tree_walk(
            c["logits"],
            c["tokens"],
            c["tree"],
            mode,
            uniforms=None if mode == "greedy" else c["uniforms"],
            draft_probs=c["draft_probs"] if mode == "draft_probs" else None,
            temperature=temp,
            top_p=top_p,
            backend=b,
            check_inputs=False,
        )
    return fns


def time_cpu(fns: dict[str, Callable], min_rounds: int, budget_s: float, clock: str):
    """Median ms per column, columns interleaved round by round (drift hits all alike)."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    for fn in fns.values():
        fn()  # warm-up
    samples: dict[str, list[float]] = {k: [] for k in fns}
    start, rounds = time.perf_counter(), 0
    while rounds < min_rounds or (time.perf_counter() - start < budget_s and rounds < 30):
        for name, fn in fns.items():
            t0 = now()
            fn()
            samples[name].append((now() - t0) * 1e3)
        rounds += 1
    return {k: statistics.median(v) for k, v in samples.items()}


def time_cuda(fns: dict[str, Callable]) -> tuple[dict[str, float], dict[str, bool]]:
    from triton.testing import do_bench

    out, graphed = {}, {}
    for name, fn in fns.items():
        run, graphed[name] = (fn, False) if name == "reference_total" else graph_or_eager(fn)
        out[name] = float(do_bench(run, warmup=10, rep=50, return_mode="median"))
    return out, graphed


def count_launches(fn: Callable) -> int:
    """CUDA kernels launched by one call of ``fn`` (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def goal_figure(device: str) -> dict:
    """Triton greedy walk, batch 64 x 64 nodes: eager, graph replay, launches."""
    from triton.testing import do_bench

    case = make_case(GOAL["batch"], GOAL["nodes"], GOAL["vocab"], device)
    mod = backend_module("triton")
    amax = torch.argmax(case["logits"], -1)
    walk = lambda: mod.greedy_from_argmax(amax, case["tokens"], case["tree"])
    replay, graphed = graph_or_eager(walk)
    res = dict(GOAL)
    res["launches"] = count_launches(walk)
    res["eager_us"] = 1e3 * float(do_bench(walk, warmup=10, rep=100, return_mode="median"))
    res["graph_us"] = 1e3 * float(do_bench(replay, warmup=10, rep=100, return_mode="median"))
    res["graphed"] = graphed
    res["vocab_argmax_us"] = 1e3 * float(
        do_bench(lambda: torch.argmax(case["logits"], -1), warmup=10, rep=50, return_mode="median")
    )
    res["met"] = res["launches"] == 1 and res["graph_us"] < GOAL["limit_us"]
    return res


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted(
        {r["mode"] for r in rows if r.get("ms")}, key=["greedy", "target_only", "draft_probs"].index
    )
    fig, axes = plt.subplots(len(modes), 1, figsize=(12, 3.6 * len(modes)), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        sel = [r for r in rows if r["mode"] == mode and r.get("ms")]
        labels = [f"B{r['batch']}\nN{r['nodes']}\nV{r['vocab'] // 1024}K" for r in sel]
        names = sorted({k for r in sel for k in r["ms"]})
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            xs = [j + i * width for j in range(len(sel))]
            ax.bar(xs, [r["ms"].get(name, float("nan")) for r in sel], width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sel))], labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("ms per call")
        ax.set_title(f"{title}: {mode}")
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small grid")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="results")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (torch)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--budget", type=float, default=1.0, help="CPU seconds per point")
    ap.add_argument("--max-elements", type=float, default=2**28, help="greedy: max T*V (CPU)")
    ap.add_argument("--max-stochastic", type=float, default=2**24, help="stochastic: max T*V (CPU)")
    ap.add_argument("--ref-max-nodes", type=int, default=2048, help="reference: max T")
    ap.add_argument("--modes", default="greedy,target_only,draft_probs")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    if not cuda:
        torch.set_num_threads(args.threads)
    max_el = float("inf") if cuda else args.max_elements
    max_st = 2**30 if cuda else args.max_stochastic
    backends, notes = [], {}
    for b in ("torch", "triton", "nki"):
        ok, why = kernels.backend_status(b)
        if not ok:
            notes[b] = f"not timed: {why}"
        elif b == "triton" and not cuda:
            notes[b] = "not timed: no CUDA device, Triton runs on its interpreter here"
        elif b == "nki":
            notes[b] = "not timed: runs on the NumPy NKI executor here (a simulator)"
        else:
            backends.append(b)
    batches, sizes, vocabs = (
        ([1, 8], [8, 64], [32768])
        if args.quick
        else (
            [1, 8, 64],
            [8, 64, 256],
            [32768, 131072],
        )
    )
    points = [
        (m, b, n, v) for m in args.modes.split(",") for v in vocabs for n in sizes for b in batches
    ]
    rows = []
    for mode, batch, nodes, vocab in tqdm(points, desc="walk bench"):
        row = dict(mode=mode, batch=batch, nodes=nodes, vocab=vocab)
        elems = batch * nodes * vocab
        cap = max_el if mode == "greedy" else max_st
        if elems > cap:
            row["skipped"] = f"T*V = {elems:.3g} > {cap:.3g} on {args.device} (memory/time)"
            rows.append(row)
            continue
        case = make_case(batch, nodes, vocab, args.device)
        fns = columns(case, mode, backends, with_ref=batch * nodes <= args.ref_max_nodes)
        if cuda:
            row["ms"], row["graphed"] = time_cuda(fns)
        else:
            row["ms"] = time_cpu(fns, 3, args.budget, args.clock)
        res = {k: fn() for k, fn in fns.items() if k.endswith("_total")}
        first = next(iter(res.values()))
        row["agree"] = all(
            all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(r, first, strict=True))
            for r in res.values()
        )
        row["mean_accepted"] = float(first.accepted_len.double().mean())
        rows.append(row)
        del case, fns, res
    report = dict(
        device=torch.cuda.get_device_name() if cuda else "cpu",
        torch=torch.__version__,
        threads=None if cuda else args.threads,
        clock="cuda do_bench median" if cuda else args.clock,
        notes=notes,
        rows=rows,
    )
    if cuda and "triton" in backends:
        report["goal"] = goal_figure(args.device)
    out = Path(args.out)
    name = f"walk_{'cuda' if cuda else 'cpu'}"
    atomic_write_bytes(out / f"{name}.json", json.dumps(report, indent=1).encode())
    plot(rows, out / f"{name}.png", f"tree walk ({report['device']})")
    print_table(report)
    print(f"wrote {out / name}.json and .png")
    return 0


def print_table(report: dict) -> None:
    for b, note in report["notes"].items():
        print(f"{b}: {note}")
    for r in report["rows"]:
        head = f"{r['mode']:<12} B={r['batch']:<3} N={r['nodes']:<4} V={r['vocab'] // 1024}K"
        if "skipped" in r:
            print(f"{head}  skipped: {r['skipped']}")
            continue
        cols = "  ".join(f"{k}={v:.3f}" for k, v in r["ms"].items())
        ratio = ""
        if "reference_total" in r["ms"] and "torch_total" in r["ms"]:
            ratio = (
                f"  torch/ref speed-up x{r['ms']['reference_total'] / r['ms']['torch_total']:.1f}"
            )
        print(f"{head}  ms: {cols}{ratio}  agree={r['agree']}")
    if "goal" in report:
        g = report["goal"]
        print(
            f"GOAL greedy triton walk B={g['batch']} N={g['nodes']}: {g['graph_us']:.2f} us "
            f"(graph replay), {g['eager_us']:.2f} us eager, {g['launches']} launch(es); "
            f"vocab argmax {g['vocab_argmax_us']:.2f} us; goal < {g['limit_us']} us: "
            f"{'MET' if g['met'] else 'NOT MET'}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
