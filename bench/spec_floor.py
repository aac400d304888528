"""The speculation floor inside vLLM: what an engine with speculation on pays on a step
where nothing drafts, against vLLM plain, in one run.

A user who turns speculation on must not get a slower server where drafts do not pay; a
``tree: auto`` engine then gives every request ``none``, and what is left is this floor.
Engines, each timed in turns with a resident vLLM plain (``bench.vllm_e2e.run_engine``:
the median of same-moment ratios over ``--reps``), on batch 1, 4 and 8 concurrent
requests, greedy and T=0.8:

- vLLM ``ngram`` k=4 that never matches (``prompt_lookup_min`` 64): vLLM's own floor;
- the plugin's ``tree: auto`` over tries, every request forced to ``none`` (its steps
  then run vLLM's non-speculative inputs and sampler, ``TreeRunner.plain_step``, and
  the drafts travel with each step's output, ``TreeRunner.drafts_in_output``);
- the same with ``TREESPEC_SPEC_INPUTS=always`` and ``TREESPEC_DRAFTS_IN_OUTPUT=0``:
  vLLM's speculative inputs on every step and its engine core's ``take_draft_token_ids``
  round trip after every step, as the plugin ran before both (their A/B);
- with an EAGLE head (``smollm2-135m``): ``tree: auto`` over the head's trees, forced to
  ``none`` (the head then never runs; the target keeps its features);
- with a draft LM (a model set such as the toy's): ``tree: auto`` over its trees, forced
  to ``none`` (the draft then never runs; it catches up when a tree does).

    python -m bench.spec_floor                        # smollm2-135m, eager
    python -m bench.spec_floor --model stdlib-v1      # the toy

Writes ``results/spec_floor[_MODEL].json`` and a plot beside it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bench.auto_policy import SCENARIOS, prompt_sets, tree_engine
from bench.common import named_by
from bench.io import atomic_write_json
from bench.vllm_e2e import QUEUE, model_setup, run_beside_plain

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

ROOT = Path(__file__).resolve().parents[1]
# mixed traffic is not a floor; a queue's is its concurrent cell's
CELLS = tuple(s for s in SCENARIOS if isinstance(s[2], float) and not s[0].startswith(QUEUE))


def _auto(method: str, model: str | None, name: str, env: dict | None = None) -> dict:
    """A ``tree: auto`` engine whose every request is forced to ``none``."""
    return {**tree_engine(method, model, "auto", name), "force": "none", "env": env}


def configs(eagle: str | None, draft: str | None = None) -> list[dict]:
    """vLLM plain first, then the engines whose floor is measured."""
    never = {"method": "ngram", "num_speculative_tokens": 4}
    never |= {"prompt_lookup_min": 64, "prompt_lookup_max": 64}
    out = [
        {"name": "vllm plain", "spec": None, "tree": None, "method": None, "budget": 0},
        {
            "name": "vllm ngram k=4, never matching",
            "spec": never,
            "tree": None,
            "method": "ngram",
            "budget": 4,
        },
        _auto("ngram", None, "tree auto (tries), none forced"),
        _auto(
            "ngram",
            None,
            "tree auto (tries), none forced, spec inputs + draft round trip every step",
            {"TREESPEC_SPEC_INPUTS": "always", "TREESPEC_DRAFTS_IN_OUTPUT": "0"},
        ),
    ]
    if eagle is not None:
        out.append(_auto("eagle", eagle, "tree auto (EAGLE head), none forced"))
    if draft is not None:
        out.append(_auto("draft_model", draft, "tree auto (draft LM), none forced"))
    return out


def plot(results: list[dict], title: str, path: Path) -> None:
    """Per cell, each engine's ratio to vLLM plain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.io import save_figure

    engines = results[1:]
    cells = list(engines[0]["scenarios"])
    fig, ax = plt.subplots(figsize=(1.7 * len(cells) + 2, 4.5))
    w = 0.8 / len(engines)
    for k, r in enumerate(engines):
        ys = [r["scenarios"][c]["ratio_to_vllm_plain"] for c in cells]
        xs = [i + (k - (len(engines) - 1) / 2) * w for i in range(len(cells))]
        ax.bar(xs, ys, w, label=r["name"])
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels(cells, rotation=20, fontsize=8)
    ax.set_ylim(0.6, 1.15)
    ax.set_ylabel("tokens/s over vLLM plain (median same-moment ratio)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m or stdlib-v1 (toy)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--batch1-prompts", type=int, default=2, help="prompts of a batch-1 cell")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--only", default=None, help="comma-separated substrings of engine names")
    ap.add_argument("--out", default=None, help="JSON path (default results/spec_floor*.json)")
    args = ap.parse_args()

    need = sum(max(c, args.batch1_prompts) for _, c, _ in CELLS) * args.reps + 2
    setup = model_setup(args.model, need, args.prompt_tokens, args.eager)
    prompts = setup["prompts"]
    sets = prompt_sets(prompts[:-2], args.batch1_prompts, args.reps)  # per SCENARIOS row
    sets = [row for row, s in zip(sets, SCENARIOS) if s in CELLS]
    grid = configs(setup.get("eagle"), setup.get("draft"))
    grid = [grid[0]] + [c for c in grid[1:] if named_by(args.only, c["name"])]
    setup["llm"]["max_num_seqs"] = max(c for _, c, _ in CELLS)
    results = run_beside_plain(
        grid, sets, args.max_tokens, args.reps, setup["llm"], prompts[-2:], CELLS
    )
    suffix = "" if args.model == "stdlib-v1" else f"_{Path(args.model).name}"
    out = Path(args.out or ROOT / "results" / f"spec_floor{suffix}.json")
    atomic_write_json(out, {"args": vars(args), "results": results})
    title = f"speculation on, nothing drafted: vLLM 0.32 CPU, {args.model}, {args.reps} reps"
    plot(results, title, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
