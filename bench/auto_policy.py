"""``tree: auto`` against every fixed tree it chooses from, inside vLLM, in one run.

Per cell (batch 1, 4 and 8 concurrent; greedy and T=0.8; mixed traffic: 4 concurrent,
every other request greedy, the rest at T=0.8; and a queue for 8 slots): output tokens/s
of vLLM plain, of ``tree: auto`` (with ``auto_objective`` ``tokens`` and ``makespan``:
the second weighs a token by what it shortens the batch once no request waits), of
each of auto's candidates as a fixed tree, and of
vLLM's own methods (``draft_model`` chain, ``ngram``, ``suffix``), each engine timed in
turns with a resident vLLM plain (``bench.vllm_e2e.run_engine``: the ratio is the median
of same-moment ratios over ``--reps``). Reported per cell: auto's ratio to vLLM plain, to
the best and the worst fixed tree of the cell (issue 34's goals: >= 1.0x plain, >= 0.95x
the best fixed tree; mixed traffic ahead of every fixed tree).

    python -m bench.auto_policy                        # the toy: draft LM candidates
    python -m bench.auto_policy --model smollm2-135m   # the real model: its EAGLE head's
    python -m bench.auto_policy --model smollm2-135m --drafter none   # trie candidates

The auto engine's cost model is the cached one of this machine, else measured at its
start (``calibrate_auto``; its seconds are in ``startup_s``).

A concurrent cell is one wave: ``c`` prompts of equal length (``ignore_eos``) in one
``generate``, so it lasts as long as its slowest request. Drafts accepted for the others
end them early and leave the batch smaller for its last steps; they raise tokens per
step, not the wave's throughput. Under a queue or clients that send again (a server:
``bench.serve_load``) a request that ends early frees its slot for the next one: the
``queue8`` cells (greedy, T=0.8) queue 24 requests of output lengths spread over half
to 1.5 times ``--max-tokens`` for 8 slots (``bench.vllm_e2e.queue_lengths``).
Writes ``results/auto_policy[_MODEL][_eagle].json`` and a plot beside it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bench.common import named_by
from bench.io import atomic_write_json
from bench.vllm_e2e import MIXED, cell_prompts, model_setup, run_beside_plain
from tree_dev.spec import (
    AUTO_MODEL_CANDIDATES,
    AUTO_TRIE_CANDIDATES,
    DRAFT_OF_VLLM_METHOD,
    TreeSettings,
    parse_tree_spec,
)

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = (
    ("batch1", 1, 0.0),
    ("batch1", 1, 0.8),
    ("conc4", 4, 0.0),
    ("conc4", 4, 0.8),
    ("conc8", 8, 0.0),
    ("conc8", 8, 0.8),
    ("conc4", 4, MIXED),
    ("queue8", 8, 0.0),
    ("queue8", 8, 0.8),
)


def tree_engine(method: str, model: str | None, tree: str, label: str | None = None) -> dict:
    """The engine configuration of plugin tree ``tree`` (``+sampled``: sampled drafts) on
    vLLM method ``method`` with draft ``model``; ``label`` None: a fixed tree of the grid."""
    sampled = tree.endswith("+sampled")
    spec = tree.removesuffix("+sampled")
    settings = TreeSettings.parse(spec, sampled, draft=DRAFT_OF_VLLM_METHOD[method])
    return {
        "name": label or f"tree {method} {tree}",
        "spec": settings.vllm_speculative_config(model),
        "tree": spec,
        "draft_sampling": sampled,
        "method": method,
        "budget": settings.draft_budget,
        "fixed": label is None,
    }


def makespan(cfg: dict) -> dict:
    """An auto engine with ``auto_objective: makespan`` (what an offline batch, as every
    cell here is, would set: see ``vllm_plugin.config``)."""
    return {**cfg, "treespec": {"auto_objective": "makespan"}}


def configs(draft: str | None, have_suffix: bool, method: str = "draft_model") -> list[dict]:
    """vLLM plain; auto; every candidate of auto as a fixed tree; vLLM's own methods.
    ``draft``: the draft model (``method`` ``draft_model``) or EAGLE export (``eagle``)
    auto chooses over, with ``AUTO_MODEL_CANDIDATES``; None: tries alone."""
    out = [{"name": "vllm plain", "spec": None, "tree": None, "method": None, "budget": 0}]
    if draft is not None:
        out.append(tree_engine(method, draft, "auto", f"auto {method}"))
        out.append(makespan(tree_engine(method, draft, "auto", f"auto {method} makespan")))
        for c in AUTO_MODEL_CANDIDATES:
            kind = "ngram" if c.startswith("ngram") else method
            out.append(tree_engine(kind, None if kind == "ngram" else draft, c))
        spec = {"method": method, "model": draft, "num_speculative_tokens": 4}
        out.append({"name": f"vllm {method} chain k=4", "spec": spec, "tree": None})
    else:
        out.append(tree_engine("ngram", None, "auto", "auto ngram"))
        out.append(makespan(tree_engine("ngram", None, "auto", "auto ngram makespan")))
        for c in AUTO_TRIE_CANDIDATES:
            out.append(tree_engine("ngram", None, c))
    out.append(
        {
            "name": "vllm ngram k=4",
            "spec": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
            "tree": None,
        }
    )
    if have_suffix:
        out.append(
            {
                "name": "vllm suffix k=8",
                "spec": {"method": "suffix", "num_speculative_tokens": 8},
                "tree": None,
            }
        )
    for c in out:
        c.setdefault("method", (c.get("spec") or {}).get("method"))
        c.setdefault("budget", (c.get("spec") or {}).get("num_speculative_tokens", 0))
        c.setdefault("fixed", False)
    return out


def prompt_sets(prompts: list[list[int]], batch1: int, reps: int) -> list[list[list[list[int]]]]:
    """``[scenario][rep]`` -> its prompts (``batch1`` at batch 1, else the concurrency),
    disjoint while the prompts last (engines that reuse earlier requests never meet one)."""
    out, k = [], 0
    for label, conc, _ in SCENARIOS:
        per, row = cell_prompts(label, conc, batch1), []
        for _ in range(reps):
            row.append([prompts[(k + i) % len(prompts)] for i in range(per)])
            k += per
        out.append(row)
    return out


def summarize(results: list[dict]) -> dict:
    """Per cell: auto's ratio to vLLM plain, the best and worst fixed tree, vLLM's best."""
    autos = [r for r in results if r["name"].startswith("auto")]
    auto = autos[0]
    fixed = [r for r in results if r.get("fixed")]
    builtin = [r for r in results[1:] if r["name"].startswith("vllm")]
    out = {}
    for s in auto["scenarios"]:

        def ratio(r: dict, s: str = s) -> float:
            return r["scenarios"][s]["ratio_to_vllm_plain"]

        best, worst = max(fixed, key=ratio), min(fixed, key=ratio)
        row = {
            "auto": ratio(auto),
            "best_fixed": best["name"],
            "best_fixed_ratio": ratio(best),
            "worst_fixed": worst["name"],
            "worst_fixed_ratio": ratio(worst),
            "auto_vs_best_fixed": ratio(auto) / ratio(best),
            "auto_tau": auto["scenarios"][s].get("tau"),
            "auto_choices": auto["scenarios"][s].get("auto_choices"),
        }
        for other in autos[1:]:  # auto_objective makespan beside the default
            row["auto_makespan"] = ratio(other)
            row["auto_makespan_vs_best_fixed"] = ratio(other) / ratio(best)
        if builtin:
            b = max(builtin, key=ratio)
            row.update(best_vllm=b["name"], best_vllm_ratio=ratio(b))
        out[s] = row
        print(
            f"{s:18s} auto {row['auto']:.2f}x plain | best fixed {best['name']} "
            f"{row['best_fixed_ratio']:.2f}x | worst {worst['name']} "
            f"{row['worst_fixed_ratio']:.2f}x | auto / best {row['auto_vs_best_fixed']:.2f}"
            + (f" | makespan {row['auto_makespan']:.2f}x" if "auto_makespan" in row else "")
        )
    return out


def plot(summary: dict, title: str, path: Path) -> None:
    """Per cell: auto, the best and the worst fixed tree and vLLM's best own method (where
    the run had one), as ratios to vLLM plain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.io import save_figure

    cells = list(summary)
    x = range(len(cells))
    fig, ax = plt.subplots(figsize=(1.6 * len(cells) + 2, 4.5))
    bars = [
        ("worst_fixed_ratio", "tab:red", "worst fixed tree"),
        ("best_fixed_ratio", "tab:blue", "best fixed tree"),
        ("auto", "tab:green", "auto"),
    ]
    if all("auto_makespan" in summary[c] for c in cells):
        bars.append(("auto_makespan", "yellowgreen", "auto, objective makespan"))
    if all(summary[c].get("best_vllm_ratio") is not None for c in cells):
        bars.append(("best_vllm_ratio", "tab:gray", "vLLM's best own method"))
    w = 0.8 / len(bars)
    for k, (key, color, label) in enumerate(bars):
        off = (k - (len(bars) - 1) / 2) * w
        ax.bar([i + off for i in x], [summary[c][key] for c in cells], w, color=color, label=label)
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_xticks(list(x))
    ax.set_xticklabels(cells, rotation=20, fontsize=8)
    ax.set_ylabel("tokens/s over vLLM plain (median same-moment ratio)")
    ax.set_title(title)
    top = max(summary[c][key] for c in cells for key, _, _ in bars)
    ax.set_ylim(0, top * 1.2)
    ax.legend(fontsize=8, loc="upper center", ncol=len(bars))
    fig.tight_layout()
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="stdlib-v1", help="stdlib-v1 (toy) or smollm2-135m")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch1-prompts", type=int, default=2, help="prompts of a batch-1 cell")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--drafter",
        choices=("auto", "draft_model", "eagle", "none"),
        default="auto",
        help="what auto drafts with: the model set's draft LM, the EAGLE head, or tries "
        "alone (none); auto: the draft LM of a model set, else the model's EAGLE head",
    )
    ap.add_argument("--only", default=None, help="comma-separated substrings of engine names")
    ap.add_argument(
        "--cells", default=None, help="comma-separated substrings of cells ('conc8', 'T=0.8')"
    )
    ap.add_argument("--out", default=None, help="JSON path (default results/auto_policy*.json)")
    args = ap.parse_args()
    from importlib.util import find_spec

    need = sum(cell_prompts(s, c, args.batch1_prompts) for s, c, _ in SCENARIOS) * args.reps + 2
    try:
        setup = model_setup(args.model, need, args.prompt_tokens, args.eager)
    except ValueError as e:  # the toy's held-out set is smaller than every cell's prompts
        print(f"note: {e}: prompts repeat across cells (this flatters vllm suffix)")
        setup = model_setup(args.model, 48, args.prompt_tokens, args.eager)
    prompts = setup["prompts"]
    sets = prompt_sets(prompts[:-2], args.batch1_prompts, args.reps)
    keep = [named_by(args.cells, f"{s} T={t}") for s, _, t in SCENARIOS]
    cells = tuple(c for c, k in zip(SCENARIOS, keep) if k)
    sets = [row for row, k in zip(sets, keep) if k]
    if not cells:
        raise SystemExit(f"--cells {args.cells!r} keeps no cell")
    method = args.drafter
    if method == "auto":
        method = "draft_model" if setup.get("draft") else "eagle" if setup.get("eagle") else "none"
    draft = None if method == "none" else setup.get("draft" if method == "draft_model" else method)
    if method != "none" and draft is None:
        raise SystemExit(f"--drafter {method}: {args.model} has none")
    grid = configs(draft, find_spec("arctic_inference") is not None, method)
    grid = [grid[0]] + [c for c in grid[1:] if named_by(args.only, c["name"])]
    named = {"auto": any(c["name"].startswith("auto") for c in grid)}
    named["fixed tree"] = any(c.get("fixed") for c in grid)
    missing = [what for what, there in named.items() if not there]
    if missing:  # the summary sets auto against the fixed trees: say so before any engine
        raise SystemExit(f"--only {args.only!r} keeps no {' and no '.join(missing)}")
    for c in grid:
        if c.get("tree"):
            parse_tree_spec(c["tree"])  # a bad spec fails before any engine starts
    setup["llm"]["max_num_seqs"] = max(c for _, c, _ in SCENARIOS)  # conc8 runs 8 at once
    results = run_beside_plain(
        grid, sets, args.max_tokens, args.reps, setup["llm"], prompts[-2:], cells
    )
    for res, cfg in zip(results, grid):
        res["fixed"] = cfg["fixed"]
    summary = summarize(results)
    suffix = "" if args.model == "stdlib-v1" else f"_{Path(args.model).name}"
    suffix += "_eagle" if method == "eagle" else ""
    out = Path(args.out or ROOT / "results" / f"auto_policy{suffix}.json")
    atomic_write_json(out, {"args": vars(args), "results": results, "summary": summary})
    title = f"tree: auto vs fixed trees, vLLM 0.32 CPU, {args.model}, {args.reps} reps"
    plot(summary, title, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
