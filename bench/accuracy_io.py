"""Reading and comparing ~1 GB of tensor captures.

    python -m bench.accuracy_io [--gb 1.0] [--hidden 2048] [--out results/accuracy_io.json]

Writes two capture directories (reference, and reference + noise) totalling
``--gb`` GB of safetensors in a temp dir: prompts of a 512-token prefill plus 16
decode steps, 16 layers x (layer output, mlp output), fp32. Then evicts them from
the page cache (fsync + posix_fadvise DONTNEED) and times ``tensor_io.read`` of
both, ``compare_captures_two_way`` (per module, per token) and the report. The temp
dir is removed afterwards. Writes JSON and a PNG; never fails on a time.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import tempfile
import time

import torch
from tqdm import tqdm

from accuracy import CaptureWriter, compare_captures_two_way, print_comparison_report
from accuracy.plots import save_figure
from accuracy.tensor_io import atomic_write_json, read

LAYERS, PREFILL, DECODE = 16, 512, 16


def _names() -> list[str]:
    return [n for i in range(LAYERS) for n in (f"model.layers.{i}", f"model.layers.{i}.mlp")]


def write_captures(root: str, gb: float, hidden: int) -> dict:
    names = _names()
    per_prompt = len(names) * (PREFILL + DECODE) * hidden * 4 * 2  # both sides
    prompts = max(1, round(gb * 1e9 / per_prompt))
    writers = {side: CaptureWriter(os.path.join(root, side)) for side in ("ref", "test")}
    for w in writers.values():
        w.enable()
    g = torch.Generator().manual_seed(0)
    for p in tqdm(range(prompts), desc="writing captures"):
        steps = [(list(range(PREFILL)), True)] + [([PREFILL + k], False) for k in range(DECODE)]
        for pos, pre in steps:
            ref = [torch.randn(len(pos), hidden, generator=g) for _ in names]
            test = [t + 1e-3 * torch.randn(t.shape, generator=g) for t in ref]
            writers["ref"].write(ref, names, [f"p{p}"], pos, pre)
            writers["test"].write(test, names, [f"p{p}"], pos, pre)
    nbytes = 0
    os.sync()
    for d, _, files in os.walk(root):
        for f in files:
            path = os.path.join(d, f)
            nbytes += os.path.getsize(path)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return {"prompts": prompts, "bytes_on_disk": nbytes, "modules": len(names)}


def run(gb: float, hidden: int) -> dict:
    root = tempfile.mkdtemp(prefix="acc_io_")
    try:
        t0 = time.perf_counter()
        info = write_captures(root, gb, hidden)
        t_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref = read(os.path.join(root, "ref"))
        test = read(os.path.join(root, "test"))
        t_read = time.perf_counter() - t0
        t0 = time.perf_counter()
        results = compare_captures_two_way(ref, test)
        t_cmp = time.perf_counter() - t0
        t0 = time.perf_counter()
        summary = print_comparison_report(results, file=io.StringIO(), colorize=False)
        t_rep = time.perf_counter() - t0
        rows = sum(len(r) for s in results.values() for r in s.values())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        **info,
        "gb_on_disk": info["bytes_on_disk"] / 1e9,
        "hidden": hidden,
        "rows_compared": rows,
        "deviations": summary.failures,
        "write_s": t_write,
        "read_s": t_read,
        "compare_s": t_cmp,
        "report_s": t_rep,
        "read_compare_report_s": t_read + t_cmp + t_rep,
        "threads": torch.get_num_threads(),
    }


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = ["read_s", "compare_s", "report_s"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    left = 0.0
    for p in parts:
        ax.barh([0], [res[p]], left=left, label=f"{p[:-2]} {res[p]:.2f}s")
        left += res[p]
    ax.set_yticks([])
    ax.set_xlabel("seconds")
    ax.set_title(
        f"read + compare {res['gb_on_disk']:.2f} GB of captures ({res['rows_compared']} rows)"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="results/accuracy_io.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res = run(args.gb, args.hidden)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    atomic_write_json(args.out, res)
    plot(res, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
