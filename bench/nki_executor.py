"""Executor cost of two NKI kernels (tiled matmul, row softmax) at a few sizes.

    python -m bench.nki_executor [--reps 5] [--out results/nki_executor.json]

Writes JSON (median seconds per call, next to torch's time for the same op)
and a PNG plot. This measures the NumPy executor on the CPU, i.e. how long
kernel tests take here; it says nothing about Trainium speed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.io import atomic_write_json, save_figure
from kernels.nki import examples
from kernels.nki.runtime import backend_note

MATMUL_SIZES = [(128, 128, 512), (256, 256, 1024), (512, 512, 2048)]
SOFTMAX_SIZES = [(128, 1024), (512, 4096), (1024, 8192)]


def _median_time(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(reps: int) -> list[dict]:
    rows = []
    cases = [("matmul", s) for s in MATMUL_SIZES] + [("softmax", s) for s in SOFTMAX_SIZES]
    for kind, size in tqdm(cases, desc="nki executor"):
        g = torch.Generator().manual_seed(0)
        if kind == "matmul":
            m, k, n = size
            a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
            nki_s = _median_time(lambda a=a, b=b: examples.matmul(a, b), reps)
            torch_s = _median_time(lambda a=a, b=b: a @ b, reps)
            err = float((examples.matmul(a, b) - a @ b).abs().max())
        else:
            r, c = size
            x = torch.randn(r, c, generator=g)
            nki_s = _median_time(lambda x=x: examples.softmax(x), reps)
            torch_s = _median_time(lambda x=x: torch.softmax(x, -1), reps)
            err = float((examples.softmax(x) - torch.softmax(x, -1)).abs().max())
        rows.append(
            {
                "kernel": kind,
                "shape": list(size),
                "executor_s": nki_s,
                "torch_s": torch_s,
                "ratio": nki_s / torch_s,
                "max_abs_err": err,
            }
        )
    return rows


def _write_json(path: Path, payload: dict) -> None:
    atomic_write_json(path, payload)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['kernel']}\n{'x'.join(map(str, r['shape']))}" for r in rows]
    ax.bar(labels, [r["executor_s"] * 1e3 for r in rows])
    ax.set_ylabel("executor ms / call (median)")
    ax.set_yscale("log")
    ax.set_title("NumPy NKI executor cost")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("results/nki_executor.json"))
    args = ap.parse_args()
    rows = run(args.reps)
    payload = {"runtime": backend_note(), "torch_threads": torch.get_num_threads(), "rows": rows}
    _write_json(args.out, payload)
    _plot(rows, args.out.with_suffix(".png"))
    for r in rows:
        print(
            f"{r['kernel']:8s} {'x'.join(map(str, r['shape'])):>14s}  executor "
            f"{r['executor_s'] * 1e3:8.2f} ms  torch {r['torch_s'] * 1e3:7.3f} ms  "
            f"x{r['ratio']:7.1f}  max|err| {r['max_abs_err']:.1e}"
        )
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
