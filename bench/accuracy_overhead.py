"""Capture overhead of ``accuracy.ModelCapture`` on a ~25M-parameter Llama forward.

    python -m bench.accuracy_overhead [--reps 30] [--seq 128] [--threads 1]
        [--out results/accuracy_overhead.json]

Side by side, interleaved rep by rep on the same model and input: a plain forward,
a forward with every decoder layer captured (hooks + clones into the registry), the
same plus ``save_tensor_captures`` (safetensors to a temp dir), and a forward with
every layer's ``self_attn``, ``mlp``, norms and ``lm_head`` captured too. Writes JSON
with medians and ratios, and a PNG. Measures; never fails on a time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time

import torch
from tqdm import tqdm

from accuracy import ModelCapture
from accuracy.plots import save_figure
from accuracy.tensor_io import atomic_write_json
from tree_dev.testing import tiny_llama


def build_model(layers: int = 6):
    return tiny_llama(
        0,
        vocab=6144,
        hidden=512,
        intermediate=1376,
        layers=layers,
        heads=8,
        kv_heads=8,
        max_positions=1024,
        eos_token_id=2,
    )


def run(reps: int, seq: int) -> dict:
    model = build_model()
    n_params = sum(p.numel() for p in model.parameters())
    L = model.config.num_hidden_layers
    ids = torch.randint(
        0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0)
    )
    configs = {
        "layers": [f"model.layers.0-{L - 1}"],
        "layers+save": [f"model.layers.0-{L - 1}"],
        "all_submodules": [
            "model.embed_tokens",
            f"model.layers.0-{L - 1}",
            f"model.layers.0-{L - 1}.(self_attn|mlp|input_layernorm|post_attention_layernorm)",
            "model.norm",
            "lm_head",
        ],
    }
    tmp = tempfile.mkdtemp(prefix="acc_overhead_")
    caps = {}
    for name, pats in configs.items():
        caps[name] = ModelCapture(model, pats, os.path.join(tmp, name))
        if name.endswith("+save"):
            caps[name].enable()  # the others keep their writer disabled
        caps[name].remove()
    times: dict[str, list[float]] = {"none": [], **{k: [] for k in configs}}
    n_captured = {}

    def forward():
        with torch.no_grad():
            model(ids, use_cache=False)

    for _ in range(3):
        forward()
    try:
        for rep in tqdm(range(reps), desc="capture overhead"):
            order = ["none", *configs]
            random.Random(rep).shuffle(order)  # no fixed position in the rep
            for name in order:
                if name == "none":
                    t0 = time.perf_counter()
                    forward()
                    times["none"].append(time.perf_counter() - t0)
                    continue
                cap = caps[name]
                cap.attach()
                t0 = time.perf_counter()
                cap.setup_tensor_capture()
                forward()
                if name.endswith("+save"):
                    cap.save_tensor_captures(list(range(seq)), True, ["bench"])
                else:  # capture only: restore the global registry, keep tensors in memory
                    cap.save_tensor_captures(None, True)
                times[name].append(time.perf_counter() - t0)
                n_captured[name] = len(cap.registry.get_all())
                cap.remove()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "params": n_params,
        "seq": seq,
        "reps": reps,
        "threads": torch.get_num_threads(),
        "median_s": med,
        "min_s": {k: min(v) for k, v in times.items()},
        "ratio_vs_none": {k: med[k] / med["none"] for k in med},
        "captured_tensors": n_captured,
        "note": "'layers' = every decoder layer output captured (hooks + clone); '+save' adds "
        "writing safetensors; interleaved reps (shuffled order) on one model and input",
    }


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["median_s"])
    vals = [res["median_s"][n] * 1e3 for n in names]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, vals, color=["tab:gray"] + ["tab:blue"] * (len(names) - 1))
    for i, n in enumerate(names):
        ax.text(i, vals[i], f"x{res['ratio_vs_none'][n]:.3f}", ha="center", va="bottom")
    ax.set_ylabel("median forward time (ms)")
    ax.set_title(f"capture overhead, {res['params'] / 1e6:.1f}M-param Llama, seq {res['seq']}")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: stable on a shared CPU)"
    )
    ap.add_argument("--out", default="results/accuracy_overhead.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res = run(args.reps, args.seq)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    atomic_write_json(args.out, res)
    plot(res, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps({k: res[k] for k in ("params", "median_s", "ratio_vs_none")}, indent=1))


if __name__ == "__main__":
    main()
