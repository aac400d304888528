"""What the project's NKI kernels ask of a Trainium2 NeuronCore, without the hardware.

    python -m bench.nki_executor [--quick] [--out results/nki_executor.json]

Runs the kernels on the NumPy NKI executor under ``kernels.nki.executor.profile``
and reports, per kernel run: instructions per engine (Tensor, Vector, Scalar,
GpSimd, DMA), bytes moved HBM->SBUF and SBUF->HBM, matmul FLOPs, and an
**estimated** time from published Trainium2 peak figures (a roofline: the busiest
engine's time under the cost model in ``kernels/nki/executor/profile.py``, and
the no-overlap sum). These are estimates, not measurements; the figures and
their sources are in ``docs/nki_executor.md``.

Cases: tree attention at N = 16..128 tree nodes x 1K..32K prefix (one KV head,
one query head, head dim 128, bf16), beside the dense-masked alternative (the
same flash kernel given one ``[N, prefix + N]`` mask applied to every K/V tile,
which is what a generic masked attention kernel does); the tree walk at batch 64
x 64 nodes (greedy over a 32000-token vocabulary, and target-only sampling);
the two example kernels (tiled matmul, row softmax) as a sanity check of the
model (the bf16 matmul should sit near the Tensor Engine peak). Writes JSON and
a PNG plot; ``executor_s`` is the CPU wall time of the NumPy run (not Trainium
time).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

import kernels
from bench.io import atomic_write_json, save_figure
from kernels.nki import examples
from kernels.nki.executor import profile as prof
from kernels.nki.runtime import USING_SDK, backend_note
from kernels.nki.tree_attention import dense_masked_attention
from tree_dev.tree import TokenTree, TreeBatch

NODES = [16, 32, 64, 128]
PREFIX = [1024, 4096, 16384, 32768]
HEAD_DIM = 128
WALK_BATCH, WALK_NODES, WALK_VOCAB = 64, 64, 32000


def _tree(n: int, seed: int) -> TokenTree:
    """A bushy random tree of ``n`` nodes (parents among the previous 4 nodes)."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(max(0, i - 4), i, (1,), generator=g)) for i in range(1, n)]
    return TokenTree.from_parents(parents)


def _profiled(fn) -> tuple[dict, float, object]:
    t0 = time.perf_counter()
    with prof.profile() as p:
        result = fn()
    return p.as_dict(), time.perf_counter() - t0, result


def attention_rows(nodes: list[int], prefixes: list[int]) -> list[dict]:
    rows = []
    cases = [(n, L) for n in nodes for L in prefixes]
    for n, plen in tqdm(cases, desc="tree attention"):
        g = torch.Generator().manual_seed(n * 7 + plen)
        tb = TreeBatch([_tree(n, n)])
        q = torch.randn(n, 1, HEAD_DIM, generator=g).bfloat16()
        k = torch.randn(1, plen + n, 1, HEAD_DIM, generator=g).bfloat16()
        v = torch.randn(1, plen + n, 1, HEAD_DIM, generator=g).bfloat16()
        plens = torch.tensor([plen])
        ref = kernels.tree_attention(q, k, v, tb, plens, backend="torch").float()
        tree_p, tree_s, out = _profiled(
            lambda: kernels.tree_attention(q, k, v, tb, plens, backend="nki")  # noqa: B023
        )
        dense_p, dense_s, dense_out = _profiled(
            lambda: dense_masked_attention(q, k, v, tb, plens)  # noqa: B023
        )
        rows.append(
            {
                "kernel": "tree_attention",
                "nodes": n,
                "prefix": plen,
                "tree": tree_p,
                "dense_masked": dense_p,
                "tree_executor_s": tree_s,
                "dense_executor_s": dense_s,
                "est_ratio_tree_over_dense": tree_p["estimate_s"]["roofline_s"]
                / dense_p["estimate_s"]["roofline_s"],
                "max_abs_err_vs_torch": float((out.float() - ref).abs().max()),
                "dense_max_abs_err_vs_torch": float((dense_out.float() - ref).abs().max()),
            }
        )
    return rows


def walk_rows(batch: int, nodes: int, vocab: int) -> list[dict]:
    rows = []
    trees = [_tree(nodes, 100 + b) for b in range(batch)]
    tb = TreeBatch(trees)
    g = torch.Generator().manual_seed(5)
    t = tb.total_nodes
    logits = torch.randn(t, vocab, generator=g) * 3
    # the i-th child of a node drafts its parent's i-th most likely token (distinct
    # siblings; greedy accepts first children), as a top-K draft does
    order = torch.argsort(logits, dim=-1, descending=True)[:, :nodes]
    gparent = tb.parents.clamp(min=0) + tb.cu_nodes[tb.request_ids]
    tokens = torch.where(tb.parents >= 0, order[gparent, tb.sibling_rank], 0)
    for mode in tqdm(["greedy", "target_only"], desc="tree walk"):
        kw = {} if mode == "greedy" else {"uniforms": torch.rand(t, 2, generator=g)}
        want = kernels.tree_walk(logits, tokens, tb, mode, backend="torch", **kw)
        p, secs, got = _profiled(
            lambda: kernels.tree_walk(logits, tokens, tb, mode, backend="nki", **kw)  # noqa: B023
        )
        rows.append(
            {
                "kernel": f"tree_walk_{mode}",
                "batch": batch,
                "nodes": nodes,
                "vocab": vocab,
                "profile": p,
                "executor_s": secs,
                "equal_to_torch_backend": all(
                    torch.equal(a, b) for a, b in zip(got, want, strict=True)
                ),
            }
        )
    return rows


def example_rows() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(512, 1024, generator=g).bfloat16()
    b = torch.randn(1024, 2048, generator=g).bfloat16()
    p, secs, c = _profiled(lambda: examples.matmul(a, b))
    err = float((c.float() - a.float() @ b.float()).abs().max())
    x = torch.randn(512, 4096, generator=g)
    p2, secs2, y = _profiled(lambda: examples.softmax(x))
    err2 = float((y - torch.softmax(x, -1)).abs().max())
    flops = 2 * 512 * 1024 * 2048
    return [
        {
            "kernel": "matmul_512x1024x2048_bf16",
            "profile": p,
            "executor_s": secs,
            "max_abs_err": err,
            "est_tflops": flops / p["estimate_s"]["roofline_s"] / 1e12,
        },
        {
            "kernel": "softmax_512x4096_fp32",
            "profile": p2,
            "executor_s": secs2,
            "max_abs_err": err2,
        },
    ]


def _plot(att: list[dict], walks: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    nodes = sorted({r["nodes"] for r in att})
    for n in nodes:
        rs = sorted((r for r in att if r["nodes"] == n), key=lambda r: r["prefix"])
        xs = [r["prefix"] for r in rs]
        (line,) = axes[0].plot(
            xs, [r["tree"]["estimate_s"]["roofline_s"] * 1e6 for r in rs], "o-", label=f"tree N={n}"
        )
        axes[0].plot(
            xs,
            [r["dense_masked"]["estimate_s"]["roofline_s"] * 1e6 for r in rs],
            "x--",
            color=line.get_color(),
            label=f"dense N={n}",
        )
        axes[1].plot(
            xs,
            [(r["tree"]["hbm_to_sbuf_bytes"] + r["tree"]["sbuf_to_hbm_bytes"]) / 2**20 for r in rs],
            "o-",
            color=line.get_color(),
        )
        axes[1].plot(
            xs,
            [
                (r["dense_masked"]["hbm_to_sbuf_bytes"] + r["dense_masked"]["sbuf_to_hbm_bytes"])
                / 2**20
                for r in rs
            ],
            "x--",
            color=line.get_color(),
        )
    for ax, title in (
        (axes[0], "estimated time (roofline, us), one head"),
        (axes[1], "HBM<->SBUF MiB (solid tree, dashed dense)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prefix length")
        ax.set_title(title)
    axes[0].legend(fontsize=7, ncol=2)
    engines = list(prof.ENGINES)
    width = 0.8 / max(len(walks), 1)
    for i, w in enumerate(walks):
        est = w["profile"]["estimate_s"]
        axes[2].bar(
            [j + i * width for j in range(len(engines))],
            [est[e] * 1e6 for e in engines],
            width,
            label=w["kernel"],
        )
    axes[2].set_xticks([j + 0.4 - width / 2 for j in range(len(engines))], engines)
    axes[2].set_title(f"tree walk {WALK_BATCH}x{WALK_NODES}: est. us per engine")
    axes[2].legend(fontsize=7)
    fig.suptitle("NKI kernels on Trainium2: estimates from the executor's counts (not measured)")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N in {16, 128}, prefix in {1K, 4K}")
    ap.add_argument("--out", type=Path, default=Path("results/nki_executor.json"))
    args = ap.parse_args()
    if USING_SDK:
        raise SystemExit(
            "bench.nki_executor counts instructions on the NumPy executor; "
            "run it with TREESPEC_NKI_EXECUTOR=1"
        )
    nodes = [16, 128] if args.quick else NODES
    prefixes = [1024, 4096] if args.quick else PREFIX
    walk = (8, 64, 4096) if args.quick else (WALK_BATCH, WALK_NODES, WALK_VOCAB)
    att = attention_rows(nodes, prefixes)
    walks = walk_rows(*walk)
    ex = example_rows()
    payload = {
        "runtime": backend_note(),
        "note": "estimated Trainium2 (NeuronCore-v3) times from instruction counts and "
        "published peaks; not measured on hardware",
        "model": {
            "clock_hz": prof.CLOCK_HZ,
            "dma_bytes_per_s": prof.DMA_BYTES_PER_S,
            "matmul_min_cycles": prof.MATMUL_MIN_CYCLES,
            "access_overhead_cycles": prof.ACCESS_OVERHEAD_CYCLES,
            "tensor_bf16_peak_flops": prof.TENSOR_BF16_FLOPS,
        },
        "shapes": {"head_dim": HEAD_DIM, "q_heads": 1, "kv_heads": 1, "dtype": "bfloat16"},
        "tree_attention": att,
        "tree_walk": walks,
        "examples": ex,
    }
    atomic_write_json(args.out, payload)
    _plot(att, walks, args.out.with_suffix(".png"))
    print(
        f"{'N':>4s} {'prefix':>6s} | {'tree est us':>11s} {'bound':>6s} {'MiB':>7s} | "
        f"{'dense est us':>12s} {'bound':>6s} {'MiB':>7s} | tree/dense"
    )
    for r in att:
        t, d = r["tree"], r["dense_masked"]
        tb = (t["hbm_to_sbuf_bytes"] + t["sbuf_to_hbm_bytes"]) / 2**20
        db = (d["hbm_to_sbuf_bytes"] + d["sbuf_to_hbm_bytes"]) / 2**20
        print(
            f"{r['nodes']:4d} {r['prefix']:6d} | {t['estimate_s']['roofline_s'] * 1e6:11.1f} "
            f"{t['estimate_s']['bound']:>6s} {tb:7.2f} | "
            f"{d['estimate_s']['roofline_s'] * 1e6:12.1f} {d['estimate_s']['bound']:>6s} "
            f"{db:7.2f} | {r['est_ratio_tree_over_dense']:.2f}"
        )
    for w in walks + ex:
        p = w["profile"]
        print(
            f"{w['kernel']}: instructions {p['instructions']}, HBM->SBUF "
            f"{p['hbm_to_sbuf_bytes'] / 2**20:.2f} MiB, est. "
            f"{p['estimate_s']['roofline_s'] * 1e6:.1f} us ({p['estimate_s']['bound']}-bound)"
            + (f", {w['est_tflops']:.1f} TFLOPS" if "est_tflops" in w else "")
        )
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
