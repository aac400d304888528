"""The accuracy tooling inside vLLM: capture overhead on decode, and the HF-vs-vLLM workflow.

    python -m bench.accuracy_vllm [--reps 5] [--max-tokens 64] [--rounds 1] [--skip-workflow]
        [--out results/accuracy_vllm.json]

1. Capture overhead, side by side in one run: compiled engines on the committed tiny
   target (fp32), one at a time: plain; capturing every decoder layer
   (``model.layers.0-5``, written to disk) with synchronous writes
   (``"async_writes": False``, each pass written in the worker before the next step);
   capturing with the default writer process (each pass handed to it as the next
   step starts); and the same with each pass handed over as soon as it is captured
   (``TREESPEC_CAPTURE_HOLD=0``, what the hold saves). The engines are resident
   together and timed back to back in every rep. Batch 1 and 4. Decode time per step
   = (time of ``max_tokens`` tokens - time of 1 token) / (``max_tokens`` - 1), median
   over ``reps`` x ``rounds``. Overhead = capture / plain - 1 (target <= 15%), also as
   the median of each rep's paired ratio.
2. ``python -m accuracy hf-vs-vllm`` on 8 prompts x 32 tokens (compiled), wall time
   (target: within 2 minutes) and its verdict.

Writes JSON and a PNG; measures, never fails on a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import environ
from tree_dev.testing import shutdown_engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "checkpoints", "stdlib-v1", "target")
PROMPTS = [
    "def __init__(self, name, value=None):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Queue:\n    def put(self, item):\n",
    "    for key, value in sorted(items.items()):\n",
    "# Copyright 2001 Python Software Foundation\n",
    'def read_config(path):\n    """Read',
    "    try:\n        return self._cache[key]\n    except",
    "if __name__ == '__main__':\n",
]


MODES = {  # name -> tensor_capture extras (None: no capture)
    "plain": None,
    "capture_sync": {"async_writes": False},  # each pass on disk before the next step
    "capture": {},  # the default: writes in a child process
    "capture_unheld": {},  # the same, each pass sent to the child as soon as it is captured
}
ENV = {"capture_unheld": {"TREESPEC_CAPTURE_HOLD": "0"}}  # mode -> worker environment
LABELS = {
    "capture_sync": "synchronous writes",
    "capture": "writer process",
    "capture_unheld": "writer process, passes sent at once",
}


def _engine(mode: str, capture_dir: str):
    from vllm import LLM

    cfg = {}
    if MODES[mode] is not None:
        cap = {"modules": ["model.layers.0-5"], "capture_dir": capture_dir, **MODES[mode]}
        cfg = {"treespec": {"tensor_capture": cap}}
    with environ(ENV.get(mode)):  # read by the workers at start-up
        return LLM(
            model=TARGET,
            dtype="float32",
            max_model_len=512,
            enforce_eager=False,
            additional_config=cfg,
        )


def _time(llm, prompts: list[str], n: int) -> float:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t


def overhead(reps: int, max_tokens: int, rounds: int = 1) -> dict:
    """Decode ms/step of a plain engine, a capturing engine writing synchronously (each
    pass on disk before the next step) and one writing through its writer process (the
    default), compiled, batch 1 and 4.

    The three engines are resident together (each idles while another runs) and every
    rep times them back to back, so the machine's drifting load hits the three alike;
    ``rounds`` repeats the whole grid. The figure of a mode is the median of its
    samples; ``paired_overhead`` is the median over reps of each rep's own ratio."""
    from tqdm import tqdm

    tmp = tempfile.mkdtemp(prefix="acc_vllm_bench_")
    per: dict[str, dict[str, list[float]]] = {str(b): {m: [] for m in MODES} for b in (1, 4)}
    out: dict = {"modes": {m: MODES[m] for m in MODES}, "startup_s": {}, "batches": {}}
    engines = {}
    try:
        for mode in MODES:
            t0 = time.perf_counter()
            engines[mode] = _engine(mode, os.path.join(tmp, mode))
            out["startup_s"][mode] = time.perf_counter() - t0
        for batch in (1, 4):
            prompts = PROMPTS[:batch]
            for llm in engines.values():
                _time(llm, prompts, max_tokens)  # warm
            for _ in tqdm(range(rounds * reps), desc=f"batch {batch}, {len(MODES)} engines"):
                for mode, llm in engines.items():
                    full = _time(llm, prompts, max_tokens)
                    first = _time(llm, prompts, 1)
                    per[str(batch)][mode].append(1e3 * (full - first) / (max_tokens - 1))
        for b, samples in per.items():
            med = {k: statistics.median(v) for k, v in samples.items()}
            paired = {
                k: statistics.median(
                    c / p - 1.0 for c, p in zip(samples[k], samples["plain"], strict=True)
                )
                for k in samples
                if k != "plain"
            }
            out["batches"][b] = {
                "decode_ms_per_step": med,
                "samples_ms": samples,
                "overhead": {k: med[k] / med["plain"] - 1.0 for k in med if k != "plain"},
                "paired_overhead": paired,
            }
    finally:
        for llm in engines.values():
            shutdown_engine(llm)
        passes = {}
        for mode in MODES:
            dp0 = os.path.join(tmp, mode, "dp0")
            if os.path.isdir(dp0):
                passes[mode] = len(os.listdir(dp0))
        out["passes_written"] = passes
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def workflow(max_tokens: int = 32) -> dict:
    """Wall time and verdict of ``python -m accuracy hf-vs-vllm`` on the 8 prompts."""
    tmp = tempfile.mkdtemp(prefix="acc_hf_vs_vllm_")
    prompts = os.path.join(tmp, "prompts.json")
    with open(prompts, "w") as f:
        json.dump(PROMPTS, f)
    cmd = [sys.executable, "-m", "accuracy", "hf-vs-vllm", "--model", TARGET]
    cmd += ["--prompts", prompts, "--max-tokens", str(max_tokens), "--out", f"{tmp}/out"]
    t = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t
    verdict = [ln for ln in res.stdout.splitlines() if ln.startswith("hf-vs-vllm:")]
    summaries = [ln for ln in res.stdout.splitlines() if ln.startswith("SUMMARY:")]
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "command": " ".join(cmd[1:]),
        "prompts": len(PROMPTS),
        "max_tokens": max_tokens,
        "wall_s": wall,
        "returncode": res.returncode,
        "verdict": verdict[-1] if verdict else res.stderr[-500:],
        "summaries": summaries,
    }


def plot(result: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wf = result.get("workflow")
    fig, axes = plt.subplots(1, 2 if wf else 1, figsize=(10 if wf else 6, 4), squeeze=False)
    ax = axes[0][0]
    batches = sorted(result["overhead"]["batches"], key=int)
    w = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        vals = [result["overhead"]["batches"][b]["decode_ms_per_step"][mode] for b in batches]
        ax.bar([j + i * w for j in range(len(batches))], vals, w, label=mode)
        for j, b in enumerate(batches):
            ov = result["overhead"]["batches"][b]["overhead"].get(mode)
            if ov is not None:
                ax.annotate(
                    f"{100 * ov:+.0f}%", (j + i * w, vals[j]), ha="center", va="bottom", fontsize=8
                )
    mid = w * (len(MODES) - 1) / 2
    ax.set_xticks([j + mid for j in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("decode ms / step (compiled vLLM)")
    ax.set_title("capture of every decoder layer")
    ax.legend(loc="lower right", fontsize=8)
    if wf:
        bx = axes[0][1]
        bx.bar(["hf-vs-vllm"], [wf["wall_s"]])
        bx.axhline(120, color="red", linestyle="--", label="2 min target")
        bx.set_ylabel("seconds")
        bx.set_title(f"{wf['prompts']} prompts x {wf['max_tokens']} tokens")
        bx.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="repeats of the reps")
    p.add_argument("--skip-workflow", action="store_true")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "accuracy_vllm.json"))
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = {"overhead": overhead(args.reps, args.max_tokens, args.rounds)}
    if not args.skip_workflow:
        result["workflow"] = workflow()
    from accuracy.tensor_io import atomic_write_json

    atomic_write_json(args.out, result)
    png = plot(result, os.path.splitext(args.out)[0] + ".png")
    for b, r in result["overhead"]["batches"].items():
        m, ov, po = r["decode_ms_per_step"], r["overhead"], r["paired_overhead"]
        modes = ", ".join(
            f"{m[k]:.2f} {LABELS[k]} ({100 * ov[k]:+.1f}%, paired {100 * po[k]:+.1f}%)"
            for k in MODES
            if k != "plain"
        )
        print(f"batch {b}: decode {m['plain']:.2f} ms/step plain; {modes}")
    if "workflow" in result:
        wf = result["workflow"]
        print(f"hf-vs-vllm 8x32: {wf['wall_s']:.1f} s, rc {wf['returncode']}: {wf['verdict']}")
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
