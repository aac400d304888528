"""vLLM tensor parallelism (TP=1 vs TP=2) for plain decoding and the plugin's trees.

On held-out standard-library prompts (the committed tiny models, fp32), greedy, at batch 1
and at 4 concurrent requests, each configuration at ``tensor_parallel_size`` 1 and 2 (TP=2:
one core per rank, ``VLLM_CPU_OMP_THREADS_BIND="0|1"``; TP=1 gets the same two cores,
``"0-1"``):

- vLLM plain decoding and vLLM's own ``ngram`` chain (what a user would pick instead);
- the plugin's draft-LM top-K tree and n-gram trie.

Reported per engine and scenario: output tokens/s, tau (vLLM's spec-decode counters) and,
for trees, the plugin's own cost per tree step from ``treespec_tree_stats``' ``"seconds"``
(walk, compaction, proposing, tree attention; the largest over the ranks), also as a
fraction of the wall time. On a 2-core machine TP=2 is not expected to be faster; the point
is that the plugin's share of a step does not grow under TP.

    python -m bench.vllm_tp             # 8 prompts x 96 new tokens, compiled
    python -m bench.vllm_tp --quick     # 3 prompts x 48 tokens, enforce_eager

Writes ``results/vllm_tp.json`` and ``results/vllm_tp.png``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from bench.common import bench_llm
from tree_dev.testing import shutdown_engine

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ROOT = Path(__file__).resolve().parents[1]
CK = ROOT / "checkpoints" / "stdlib-v1"
SCENARIOS = (("batch1", 1), ("conc4", 4))
TPS = (1, 2)
# the same two cores either way: TP=1 runs 2 OpenMP threads, TP=2 one per rank
BIND = {1: "0-1", 2: "0|1"}


def configs() -> list[dict]:
    """Engine configurations: name, speculative_config, tree spec (None: vLLM's own)."""
    from tree_dev.spec import TreeSettings

    draft = str(CK / "draft")
    topk = TreeSettings.parse("topk:k=2,depth=4,budget=8", draft="draft")
    trie = TreeSettings.parse("ngram:budget=8")
    return [
        {"name": "vllm plain", "spec": None, "tree": None},
        {
            "name": "vllm ngram chain k=4",
            "spec": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
            "tree": None,
        },
        {
            "name": f"tree draft {topk.spec}",
            "spec": topk.vllm_speculative_config(draft),
            "tree": topk.spec,
        },
        {"name": f"tree {trie.spec}", "spec": trie.vllm_speculative_config(), "tree": trie.spec},
    ]


def _plugin_seconds(llm) -> list[float]:
    """Per rank: seconds the plugin spent so far (walk + compact + propose + attention)."""
    return [sum(s["seconds"].values()) for s in llm.collective_rpc("treespec_tree_stats")]


def _tree_steps(llm) -> list[int]:
    return [int(s["tree_steps"]) for s in llm.collective_rpc("treespec_tree_stats")]


def run_engine(cfg: dict, tp: int, prompts: list[list[int]], max_tokens: int, eager: bool):
    """Start one engine at ``tp`` ranks, warm it, time every scenario."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from bench.vllm_e2e import _acceptance, _counters

    llm, startup = bench_llm(
        cfg, {"VLLM_CPU_OMP_THREADS_BIND": BIND[tp]}, tensor_parallel_size=tp, enforce_eager=eager
    )
    toks = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(toks[:2], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    res = {"name": cfg["name"], "tp": tp, "startup_s": startup, "scenarios": {}}
    tree = cfg["tree"] is not None
    try:
        for label, conc in SCENARIOS:
            before = _counters(llm)
            p0 = _plugin_seconds(llm) if tree else None
            s0 = _tree_steps(llm) if tree else None
            t = time.perf_counter()
            if conc == 1:
                outs = [llm.generate([p], params, use_tqdm=False)[0] for p in toks]
            else:
                outs = llm.generate(toks, params, use_tqdm=False)
            dt = time.perf_counter() - t
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            row = {
                "tokens_per_s": n_out / dt,
                "seconds": dt,
                "output_tokens": n_out,
                "token_ids": [list(o.outputs[0].token_ids) for o in outs],
                **_acceptance(before, _counters(llm)),
            }
            if tree:
                spent = [b - a for a, b in zip(p0, _plugin_seconds(llm))]
                steps = [b - a for a, b in zip(s0, _tree_steps(llm))]
                row["plugin_seconds_per_rank"] = spent
                row["tree_steps_per_rank"] = steps
                row["plugin_ms_per_step"] = 1e3 * max(spent) / max(1, steps[0])
                row["plugin_fraction_of_wall"] = max(spent) / dt
            res["scenarios"][label] = row
            print(f"  TP={tp} {cfg['name']:40s} {label}: {n_out / dt:7.1f} tok/s", flush=True)
    finally:
        shutdown_engine(llm)
    return res


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.io import save_figure

    names = list(dict.fromkeys(r["name"] for r in results))
    by = {(r["name"], r["tp"]): r for r in results}
    fig, axes = plt.subplots(1, len(SCENARIOS) + 1, figsize=(5 * (len(SCENARIOS) + 1), 4.5))
    for ax, (label, _) in zip(axes, SCENARIOS):
        for j, tp in enumerate(TPS):
            vals = [by[(n, tp)]["scenarios"][label]["tokens_per_s"] for n in names]
            ax.barh([i + 0.4 * j for i in range(len(names))], vals, height=0.4, label=f"TP={tp}")
        ax.set_yticks([i + 0.2 for i in range(len(names))])
        ax.set_yticklabels(names if ax is axes[0] else [""] * len(names), fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{label}: output tokens/s")
        ax.legend(fontsize=8)
    ax = axes[-1]
    trees = [n for n in names if n.startswith("tree")]
    for j, tp in enumerate(TPS):
        vals = [100 * by[(n, tp)]["scenarios"]["batch1"]["plugin_fraction_of_wall"] for n in trees]
        ax.barh([i + 0.4 * j for i in range(len(trees))], vals, height=0.4, label=f"TP={tp}")
    ax.set_yticks([i + 0.2 for i in range(len(trees))])
    ax.set_yticklabels(trees, fontsize=8)
    ax.invert_yaxis()
    ax.set_title("plugin's share of wall time, batch1 (%)")
    ax.legend(fontsize=8)
    fig.suptitle("vLLM 0.32 on CPU: TP=1 vs TP=2 (one core per rank)")
    fig.tight_layout()
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 prompts x 48 tokens, eager")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (skip torch.compile)")
    ap.add_argument("--out", default=str(ROOT / "results" / "vllm_tp.json"))
    args = ap.parse_args()
    from tqdm import tqdm

    from bench.io import atomic_write_json
    from bench.vllm_e2e import held_out

    n = args.prompts or (3 if args.quick else 8)
    max_tokens = args.max_tokens or (48 if args.quick else 96)
    eager = args.eager or args.quick
    prompts = held_out(n, args.prompt_tokens)
    grid = [(c, tp) for c in configs() for tp in TPS]
    out = Path(args.out)
    results = []
    for c, tp in tqdm(grid, "engines"):
        results.append(run_engine(c, tp, prompts, max_tokens, eager))
        # engines are slow on a shared machine: what is measured so far is kept
        atomic_write_json(out.with_suffix(".partial.json"), {"results": results})
    plain = {r["tp"]: r for r in results if r["name"] == "vllm plain"}
    for r in results:
        for label, row in r["scenarios"].items():
            base = plain[r["tp"]]["scenarios"][label]
            row["ratio_to_vllm_plain_same_tp"] = row["tokens_per_s"] / base["tokens_per_s"]
            row["equals_plain_tp1"] = row["token_ids"] == plain[1]["scenarios"][label]["token_ids"]
            print(
                f"TP={r['tp']} {r['name']:40s} {label}: {row['tokens_per_s']:7.1f} tok/s "
                f"({row['ratio_to_vllm_plain_same_tp']:.2f}x plain), tau {row['tau']}, "
                f"plugin {row.get('plugin_ms_per_step', float('nan')):.2f} ms/step, "
                f"= TP1 plain: {row['equals_plain_tp1']}"
            )
    doc = {
        "prompts": n,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": max_tokens,
        "enforce_eager": eager,
        "omp_threads_bind": BIND,
        "results": results,
    }
    atomic_write_json(out, doc)
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
