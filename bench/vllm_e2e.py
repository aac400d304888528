"""Tree speculation inside vLLM against vLLM's own methods, in one run.

On held-out standard-library prompts (the committed tiny models, fp32, torch.compile on),
at batch 1 and at 4 concurrent requests, greedy and temperature 0.8:

- vLLM plain decoding, vLLM ``ngram`` (chain), vLLM ``suffix`` (SuffixDecoding; needs
  ``arctic_inference``, see ``scripts/setup_suffix``, else skipped), vLLM ``draft_model``
  chain with the committed draft LM, vLLM ``eagle`` chain with the exported EAGLE head;
- the project's trees through the plugin: draft-LM top-K trees, EAGLE top-K trees and the
  n-gram trie, at a few budgets; and static chains with sampled drafts (``draft_sampling``:
  at temperature > 0 the children are drawn from the draft and verified by the residual
  rule; at temperature 0 they are the top-ranked ones).

Reported per configuration and scenario: output tokens/s, tau (tokens per target forward,
from vLLM's spec-decode counters), acceptance per depth, and the ratio to vLLM plain of the
same scenario. Every engine decodes the same prompts with the same parameters, a fresh set
for every scenario and rep (an engine that reuses earlier requests, vLLM's ``suffix`` or the
trie's ``history=``, must not meet a request it has decoded before). vLLM plain
stays up for the whole run and every other engine is timed in turns with it, scenario by
scenario (``--reps`` times, the order alternating): the ratio to vLLM plain is the median
of those same-moment ratios, since this shared machine's speed drifts by up to 2x over a
run. Engines are idle while the other one decodes.

    python -m bench.vllm_e2e            # full grid (about 15 minutes here)
    python -m bench.vllm_e2e --quick    # budget-8 trees and the sampled chain:4s, fewer prompts

vLLM's chains run at every tree budget (k = 4 and 8), so each tree is also compared with
vLLM's chain of the same draft and node budget (``tree_vs_same_budget_chain``).

``--model smollm2-135m`` runs the real pretrained model (fetched by name, eager) on the
held-out code and chat prompts with its self-distilled EAGLE head
(``checkpoints/smollm2-135m-eagle``): vLLM plain, ``ngram``, ``suffix``, ``eagle`` and the
plugin's EAGLE trees and n-gram trie.

Writes ``results/vllm_e2e.json`` and ``results/vllm_e2e.png``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import bench_llm
from tree_dev.testing import shutdown_engine

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

ROOT = Path(__file__).resolve().parents[1]
CK = ROOT / "checkpoints" / "stdlib-v1"
CHAIN_LENGTHS = (4, 8)  # the trees' node budgets; 16 only in the full grid's EAGLE tree
SCENARIOS = (("batch1", 1, 0.0), ("batch1", 1, 0.8), ("conc4", 4, 0.0), ("conc4", 4, 0.8))
#: a scenario's temperature ``MIXED``: every other request greedy, the rest at T=0.8
MIXED = "mixed"
#: a scenario whose label starts with ``QUEUE`` (``queue8``): ``QUEUE_DEPTH`` requests per
#: slot of its concurrency (the engine's ``max_num_seqs``) in one ``generate``, each with
#: its own output length (``queue_lengths``): a request that ends frees its slot for the
#: next, as on a server whose clients send again, so the cell does not wait on one wave's
#: slowest request
QUEUE = "queue"
QUEUE_DEPTH = 3


def queue_lengths(n: int, mean: int) -> list[int]:
    """Output lengths of a queue cell's ``n`` requests: spread evenly over
    ``[mean / 2, 3 * mean / 2]`` (mean ``mean``), in a fixed shuffled order.

    >>> queue_lengths(5, 64)
    [64, 48, 32, 96, 80]
    """
    if n < 1 or mean < 2:
        raise ValueError(f"queue_lengths: n={n} requests of mean length {mean}")
    spread = [round(mean * (0.5 + k / max(n - 1, 1))) for k in range(n)]
    order = list(range(n))
    random.Random(0).shuffle(order)
    return [spread[k] for k in order]


def cell_prompts(label: str, conc: int, batch1: int = 1) -> int:
    """Prompts of one rep of a scenario: ``QUEUE_DEPTH`` per slot of a queue cell, else
    its concurrency (``batch1`` one after another at batch 1)."""
    if label.startswith(QUEUE):
        return QUEUE_DEPTH * conc
    return max(conc, batch1)


def configs(quick: bool, eagle_dir: str | None, draft: str | None = None) -> list[dict]:
    """Engine configurations: name, speculative_config, tree spec (None: vLLM's own).

    ``eagle_dir`` / ``draft``: the EAGLE head (vLLM's format) and draft LM of the target;
    None drops every configuration that needs them (a pretrained model without a draft
    keeps plain decoding, vLLM's ``ngram`` / ``suffix`` and the plugin's n-gram trie)."""
    out = [{"name": "vllm plain", "spec": None, "tree": None, "method": None, "budget": 0}]
    builtins = [("ngram", {"prompt_lookup_max": 4})]
    # vLLM's sampled drafts: the draft's distribution in the ratio test (at T > 0)
    sampled = {"draft_sample_method": "probabilistic"}
    if draft is not None:
        builtins += [
            ("draft_model", {"model": draft}),
            ("draft_model", {"model": draft, **sampled}),
        ]
    if eagle_dir is not None:
        builtins += [("eagle", {"model": eagle_dir}), ("eagle", {"model": eagle_dir, **sampled})]
    # SuffixDecoding (k: its most tokens a step; tree depth etc. at vLLM's defaults)
    if importlib.util.find_spec("arctic_inference") is None:
        print("skipping vllm suffix: arctic_inference is not installed (scripts/setup_suffix)")
    else:
        builtins.insert(1, ("suffix", {}))
    for k in CHAIN_LENGTHS:  # vLLM's own chains at each tree budget (same draft, same nodes)
        for method, extra in builtins:
            draftless = method in ("ngram", "suffix")
            name = f"vllm {method} k={k}" if draftless else f"vllm {method} chain k={k}"
            if "draft_sample_method" in extra:
                if quick and k != CHAIN_LENGTHS[0]:
                    continue
                name += " probabilistic"
            spec = {"method": method, "num_speculative_tokens": k, **extra}
            out.append({"name": name, "spec": spec, "tree": None, "method": method, "budget": k})
    trees = [  # (method, draft, tree spec, sampled drafts, in the quick grid)
        ("draft_model", draft, "topk:k=2,depth=3,budget=4", False, False),
        ("draft_model", draft, "topk:k=2,depth=4,budget=8", False, True),
        ("eagle", eagle_dir, "topk:k=2,depth=3,budget=4", False, False),
        ("eagle", eagle_dir, "topk:k=2,depth=4,budget=8", False, True),
        ("eagle", eagle_dir, "topk:k=2,depth=8,budget=16", False, False),
        # the head's top-K tree and the context's n-gram trie under one budget
        ("eagle", eagle_dir, "hybrid:k=2,depth=4,budget=8", False, True),
        # a ranking temperature < 1 sharpens the under-confident head's scores: deeper trees
        ("eagle", eagle_dir, "topk:k=2,depth=8,budget=8,temp=0.5", False, False),
        ("eagle", eagle_dir, "topk:k=2,depth=8,budget=8,temp=0.25", False, False),
        ("ngram", None, "ngram:budget=8", False, True),
        ("ngram", None, "ngram:budget=16", False, False),
        # the trie searching the engine's earlier requests too (SuffixDecoding's reuse)
        ("ngram", None, "ngram:budget=8,history=4096", False, True),
        ("ngram", None, "ngram:budget=16,history=4096", False, False),
        ("draft_model", draft, "chain:4", True, True),
        ("eagle", eagle_dir, "chain:4", True, True),
        ("eagle", eagle_dir, "chain:8", True, False),
    ]
    from tree_dev.spec import DRAFT_OF_VLLM_METHOD, TreeSettings

    for method, model, tree, sampled, in_quick in trees:
        if quick and not in_quick:
            continue
        if method != "ngram" and model is None:  # no such draft for this target
            continue
        settings = TreeSettings.parse(tree, sampled, draft=DRAFT_OF_VLLM_METHOD[method])
        out.append(
            {
                "name": f"tree {method} {tree}" + (" sampled drafts" if sampled else ""),
                "spec": settings.vllm_speculative_config(model),
                "tree": tree,
                "draft_sampling": sampled,
                "method": method,
                "budget": settings.draft_budget,
            }
        )
    # the same EAGLE chain with every draft level through tree attention (the plugin's
    # TREESPEC_DRAFT_ATTENTION=tree): what sending causal levels to vLLM's kernel saves
    chain = next((c for c in out if c["name"] == "tree eagle chain:4 sampled drafts"), None)
    if chain is not None:
        out.append(
            {**chain, "name": f"{chain['name']}, draft tree attention", "draft_attention": "tree"}
        )
    return out


def held_out(n: int, length: int) -> list[list[int]]:
    from bench.e2e import held_out_prompts
    from tree_dev.models.data import load_tokenizer

    return held_out_prompts(load_tokenizer(CK / "tokenizer"), n, length)


def model_setup(model: str, n: int, prompt_tokens: int, eager: bool | None) -> dict:
    """The target of a run by name or directory: the ``LLM`` arguments of every engine,
    the prompts, and the draft / EAGLE head it has (a model set such as ``stdlib-v1``:
    both; a pretrained model such as ``smollm2-135m``: its committed EAGLE head, if it has
    one, ``named.EAGLE_HEADS``; a directory: neither). A model set's
    prompts are held-out standard-library windows of ``prompt_tokens``; a pretrained
    model's are the held-out code and chat prompts (``tree_dev.models.prompts``).
    ``eager`` None: compiled for the toy, eager for a real model (compiled start-up is
    minutes per engine on a 30-layer model here)."""
    from tree_dev.models.named import eagle_head_dir, resolve_model

    path = resolve_model(model)
    if (path / "target").is_dir():  # a model set: target, draft LM, EAGLE head
        from tree_dev.models.export_vllm import export_eagle_for_vllm

        return {
            "llm": {"model": str(path / "target"), "enforce_eager": bool(eager)},
            "prompts": held_out(n, prompt_tokens),
            "draft": str(path / "draft"),
            "eagle": str(export_eagle_for_vllm(head_dir=path / "eagle")),
        }
    from transformers import AutoTokenizer

    from tree_dev.models.prompts import heldout_prompt_ids, heldout_texts

    have = len(heldout_texts())
    prompts = heldout_prompt_ids(AutoTokenizer.from_pretrained(path), min(n, have))
    if n > have:
        print(f"note: {n} prompts asked, the held-out set has {have}: some repeat")
        prompts = [prompts[i % have] for i in range(n)]
    eager = True if eager is None else eager
    setup = {"llm": {"model": str(path), "enforce_eager": eager}, "prompts": prompts}
    head = eagle_head_dir(model)
    if head is not None:  # the EAGLE head made here (distill-eagle), in vLLM's format
        from tree_dev.models.export_vllm import export_eagle_for_vllm

        setup["eagle"] = str(export_eagle_for_vllm(head_dir=head))
    return setup


def start_engine(cfg: dict, llm_kw: dict | None = None, warm_prompts=None):
    """One warmed ``LLM`` of a configuration and its start-up seconds. ``cfg["env"]``:
    environment for its start; ``cfg["force"]``: the candidate a ``tree: auto`` engine
    gives every request (``treespec_auto_force``), after its calibration."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    env = dict(cfg.get("env") or {})
    if cfg.get("draft_attention") == "tree":
        env["TREESPEC_DRAFT_ATTENTION"] = "tree"
    llm, startup = bench_llm(cfg, env or None, **(llm_kw or {}))
    if (cfg.get("tree") or "").startswith("auto"):  # its cost model: cached, or measured now
        from tree_dev.vllm_plugin.auto_choice import calibrate_auto

        t = time.perf_counter()
        calibrate_auto(llm)
        startup += time.perf_counter() - t
        if cfg.get("force") is not None:
            llm.collective_rpc("treespec_auto_force", args=(cfg["force"],))
    warm = [TokensPrompt(prompt_token_ids=p) for p in (warm_prompts or held_out(2, 32))[:2]]
    llm.generate(warm, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    return llm, startup


def time_scenario(
    llm,
    prompts: list[list[int]],
    max_tokens: int,
    conc: int,
    temp: float | str,
    lengths: list[int] | None = None,
):
    """Output tokens/s of one scenario and the engine's spec-decode counters around it.
    ``temp`` ``MIXED``: request ``i`` greedy for even ``i``, else at T=0.8. ``lengths``:
    per request its output length (a queue cell's, ``queue_lengths``), else
    ``max_tokens`` each.

    Sampling is unseeded: with a seed per request, vLLM 0.32's own chain proposers
    accepted nothing at temperature 0.8 here (tau exactly 1.00 where unseeded runs give
    1.2-1.6), which would flatter every tree beside them.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    toks = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    temps = [(0.0 if i % 2 == 0 else 0.8) if temp == MIXED else temp for i in range(len(toks))]
    if lengths is not None and len(lengths) != len(toks):
        raise ValueError(f"time_scenario: {len(lengths)} lengths for {len(toks)} prompts")
    n_tok = lengths or [max_tokens] * len(toks)
    params = [
        SamplingParams(temperature=t, max_tokens=n, ignore_eos=True) for t, n in zip(temps, n_tok)
    ]
    before = _counters(llm)
    t = time.perf_counter()
    if conc == 1:
        n_out = sum(
            len(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids)
            for p, sp in zip(toks, params)
        )
    else:
        outs = llm.generate(toks, params, use_tqdm=False)
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    dt = time.perf_counter() - t
    return n_out, dt, _acceptance(before, _counters(llm))


def prompt_sets(
    prompts: list[list[int]], per: int, reps: int, scenarios=SCENARIOS
) -> list[list[list[list[int]]]]:
    """``[scenario][rep]`` -> ``per`` prompts, disjoint while ``prompts`` lasts: an engine
    that reuses earlier requests (vLLM's ``suffix``, the trie's ``history=``) never sees
    a request it has decoded before, which would flatter it (greedy repeats its output)."""
    out, k = [], 0
    for _ in scenarios:
        row = []
        for _ in range(reps):
            row.append([prompts[(k + i) % len(prompts)] for i in range(per)])
            k += per
        out.append(row)
    return out


def run_engine(
    cfg: dict,
    sets: list[list[list[list[int]]]],
    max_tokens: int,
    plain=None,
    reps: int = 1,
    llm_kw: dict | None = None,
    warm: list[list[int]] | None = None,
    scenarios=SCENARIOS,
) -> dict:
    """Start one engine and time every scenario ``reps`` times, each time side by side
    with the resident vLLM ``plain`` engine (the two in turns, the order alternating):
    ``ratio_to_vllm_plain`` is the median of those same-moment ratios, so the machine's
    drift over a long run does not enter it. Without ``plain``: this engine alone."""
    llm, startup = start_engine(cfg, llm_kw, warm)
    res = {
        "name": cfg["name"],
        "method": cfg["method"],
        "budget": cfg["budget"],
        "tree": cfg["tree"],
        "draft_sampling": bool(cfg.get("draft_sampling")),
        "draft_attention": cfg.get("draft_attention"),  # "tree": the A/B twin, no policy
        "startup_s": startup,
        "scenarios": {},
    }
    auto = (cfg.get("tree") or "").startswith("auto")
    try:
        for si, (label, conc, temp) in enumerate(scenarios):
            mine, base, ratios, n_out = [], [], [], 0
            chosen_before = _auto_choices(llm) if auto else None
            counters_before = _counters(llm)  # acceptance over every rep of the cell
            queued = label.startswith(QUEUE)
            for rep in range(reps):
                order = [llm, plain] if rep % 2 == 0 else [plain, llm]
                prompts = sets[si][rep]
                lengths = queue_lengths(len(prompts), max_tokens) if queued else None
                for engine in order:
                    if engine is None:
                        continue
                    n, dt, _ = time_scenario(engine, prompts, max_tokens, conc, temp, lengths)
                    if engine is llm:
                        mine.append(n / dt)
                        n_out = n
                    else:
                        base.append(n / dt)
                if plain is not None:
                    ratios.append(mine[-1] / base[-1])
            acc = _acceptance(counters_before, _counters(llm))
            row = {
                "tokens_per_s": statistics.median(mine),
                "output_tokens": n_out,
                "ratio_to_vllm_plain": statistics.median(ratios) if ratios else 1.0,
                **acc,
            }
            if plain is not None:
                row["vllm_plain_tokens_per_s"] = statistics.median(base)
            if auto:  # what auto gave the requests of this cell, over its reps
                row["auto_choices"] = choices_since(chosen_before, _auto_choices(llm))
            res["scenarios"][f"{label} T={temp}"] = row
            print(
                f"  {cfg['name']:45s} {label} T={temp}: {row['tokens_per_s']:7.1f} tok/s "
                f"({row['ratio_to_vllm_plain']:.2f}x vLLM plain beside it)",
                flush=True,
            )
    finally:
        shutdown_engine(llm)
    return res


def _auto_choices(llm) -> dict[str, dict[str, int]]:
    """A ``tree: auto`` engine's request-steps per temperature class and tree so far."""
    return llm.collective_rpc("treespec_tree_stats")[0]["auto"]["choices_by_class"]


def choices_since(before: dict, after: dict) -> dict[str, dict[str, int]]:
    """``after - before`` per class and tree, zeros dropped."""
    out = {}
    for cls, per in after.items():
        d = {k: n - before.get(cls, {}).get(k, 0) for k, n in per.items()}
        if any(d.values()):
            out[cls] = {k: n for k, n in d.items() if n}
    return out


def _counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = getattr(m, "values", None) or getattr(m, "value", 0)
    return out


def _acceptance(before: dict, after: dict) -> dict:
    drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get(
        "vllm:spec_decode_num_drafts", 0
    )
    if not drafts:
        return {"tau": None, "acceptance_per_depth": []}
    acc = after["vllm:spec_decode_num_accepted_tokens"] - before.get(
        "vllm:spec_decode_num_accepted_tokens", 0
    )
    per_a = after.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    per_b = before.get("vllm:spec_decode_num_accepted_tokens_per_pos") or [0] * len(per_a)
    per = [(a - b) / drafts for a, b in zip(per_a, per_b)]
    while per and per[-1] == 0:
        per.pop()
    # vLLM counts a step's accepted tokens by position; for a tree that is by depth
    return {"tau": 1 + acc / drafts, "acceptance_per_depth": per}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.io import save_figure

    names = [r["name"] for r in results]
    scen = list(results[0]["scenarios"])
    fig, axes = plt.subplots(1, len(scen), figsize=(5 * len(scen), 0.45 * len(names) + 2))
    for ax, s in zip(axes, scen):
        vals = [r["scenarios"][s]["tokens_per_s"] for r in results]
        colors = ["tab:gray" if r["name"].startswith("vllm") else "tab:green" for r in results]
        ax.barh(range(len(vals)), vals, color=colors)
        for i, (v, r) in enumerate(zip(vals, results)):
            # the median same-moment ratio to vLLM plain (bars: this engine's own tok/s,
            # measured at different moments of a drifting machine)
            ratio = r["scenarios"][s]["ratio_to_vllm_plain"]
            ax.text(v, i, f" {ratio:.2f}x", va="center", fontsize=8)
        ax.set_yticks(range(len(vals)))
        ax.set_yticklabels(names if ax is axes[0] else [""] * len(names), fontsize=8)
        ax.invert_yaxis()
        ax.set_title(s)
        ax.set_xlabel("output tokens/s")
    fig.suptitle(
        "vLLM 0.32 on CPU: plain, vLLM's own speculation, and treespec trees "
        "(labels: median ratio to vLLM plain timed beside it)"
    )
    fig.tight_layout()
    save_figure(fig, path)


def _parse_args() -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--model",
        default="stdlib-v1",
        help="a model name (stdlib-v1: the committed toy set with its draft LM and EAGLE "
        "head; smollm2-135m: SmolLM2-135M-Instruct with its self-distilled EAGLE head) or a "
        "directory",
    )
    ap.add_argument(
        "--eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM eager mode (default: compiled for the toy, eager for a real model)",
    )
    ap.add_argument("--prompts", type=int, default=None, help="held-out prompts (default 8)")
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--reps", type=int, default=1, help="times each scenario beside vLLM plain (median)"
    )
    ap.add_argument(
        "--only", default=None, help="comma-separated substrings: run the matching engines only"
    )
    ap.add_argument(
        "--out",
        default=str(ROOT / "results" / "vllm_e2e.json"),
        help="JSON file (a folder gets vllm_e2e.json in it); the plot goes beside it",
    )
    return ap.parse_args()


@dataclass
class _Plan:
    """What one run times: the engine grid (vLLM plain first), the prompts of every
    scenario and rep, the warm-up prompts and the ``LLM`` arguments."""

    n: int  # prompts per scenario and rep
    grid: list[dict]
    sets: list[list[list[list[int]]]]
    warm: list[list[int]]
    llm_kw: dict


def _plan(args: argparse.Namespace) -> _Plan:
    """The model's prompts and engine grid (``--only``: vLLM plain and the matching ones)."""
    n = args.prompts or (4 if args.quick else 8)
    total = n * len(SCENARIOS) * args.reps  # fresh prompts for every scenario and rep
    setup = model_setup(args.model, total + 2, args.prompt_tokens, args.eager)
    sets, llm_kw = prompt_sets(setup["prompts"][:total], n, args.reps), setup["llm"]
    warm = setup["prompts"][total:]  # two more, for every engine's warm-up
    grid = configs(args.quick, setup.get("eagle"), setup.get("draft"))
    if args.only:
        keep = [w.strip() for w in args.only.split(",")]
        grid = [grid[0]] + [c for c in grid[1:] if any(w in c["name"] for w in keep)]
    return _Plan(n, grid, sets, warm, llm_kw)


def run_beside_plain(
    grid: list[dict],
    sets: list[list[list[list[int]]]],
    max_tokens: int,
    reps: int,
    llm_kw: dict | None = None,
    warm: list[list[int]] | None = None,
    scenarios=SCENARIOS,
) -> list[dict]:
    """Every engine's results: ``grid[0]`` (vLLM plain) alone, then each other engine
    timed in turns with a resident vLLM plain (``run_engine``)."""
    from tqdm import tqdm

    kw = dict(llm_kw=llm_kw, warm=warm, scenarios=scenarios)
    results = [run_engine(grid[0], sets, max_tokens, reps=reps, **kw)]
    plain, _ = start_engine(grid[0], llm_kw, warm)
    try:
        for cfg in tqdm(grid[1:], desc="engines"):
            results.append(run_engine(cfg, sets, max_tokens, plain, reps, **kw))
    finally:
        shutdown_engine(plain)
    return results


def _same_budget_chains(s: str, trees: list[dict], builtins: list[dict]) -> dict[str, dict]:
    """Each tree over vLLM's chain with the same draft and node budget in scenario ``s``."""
    matched = {}
    for t in trees:  # vLLM's chain with the same draft and node budget
        same = [b for b in builtins if (b["method"], b["budget"]) == (t["method"], t["budget"])]
        if same:
            # both measured beside vLLM plain: the ratio of their ratios
            ratio = (
                t["scenarios"][s]["ratio_to_vllm_plain"]
                / same[0]["scenarios"][s]["ratio_to_vllm_plain"]
            )
            matched[t["name"]] = {"chain": same[0]["name"], "ratio": ratio}
            print(f"    {t['name']} vs {same[0]['name']}: {ratio:.2f}x")
    return matched


def _causal_vs_tree_attention(s: str, trees: list[dict], twins: list[dict]) -> dict[str, float]:
    """Each tree over its twin with draft tree attention in scenario ``s``: causal draft
    levels through vLLM's kernel vs tree attention."""
    out = {}
    for twin in twins:
        base = next((r for r in trees if twin["name"].startswith(r["name"] + ",")), None)
        if base is None:
            continue
        ratio = (
            base["scenarios"][s]["ratio_to_vllm_plain"]
            / twin["scenarios"][s]["ratio_to_vllm_plain"]
        )
        out[base["name"]] = ratio
        print(f"    {base['name']}: {ratio:.2f}x its twin with draft tree attention")
    return out


def _summarize(results: list[dict]) -> dict:
    """Per scenario: the best tree and the best vLLM method against vLLM plain, each tree
    against vLLM's chain of the same budget and against its draft-tree-attention twin."""
    summary = {}
    trees = [r for r in results if r["name"].startswith("tree") and not r["draft_attention"]]
    twins = [r for r in results if r["draft_attention"]]
    builtins = [r for r in results[1:] if not r["name"].startswith("tree")]
    for s in results[0]["scenarios"]:
        if not trees or not builtins:
            break
        best = max(trees, key=lambda r: r["scenarios"][s]["ratio_to_vllm_plain"])
        builtin = max(builtins, key=lambda r: r["scenarios"][s]["ratio_to_vllm_plain"])
        summary[s] = {
            "best_tree": best["name"],
            "best_tree_ratio": best["scenarios"][s]["ratio_to_vllm_plain"],
            "best_builtin": builtin["name"],
            "best_builtin_ratio": builtin["scenarios"][s]["ratio_to_vllm_plain"],
        }
        print(
            f"{s}: best tree {best['name']} {summary[s]['best_tree_ratio']:.2f}x vLLM plain; "
            f"best vLLM method {builtin['name']} {summary[s]['best_builtin_ratio']:.2f}x"
        )
        summary[s]["tree_vs_same_budget_chain"] = _same_budget_chains(s, trees, builtins)
        causal = _causal_vs_tree_attention(s, trees, twins)
        if causal:
            summary[s]["causal_draft_levels_vs_tree_attention"] = causal
    return summary


def _write(args: argparse.Namespace, plan: _Plan, results: list[dict], summary: dict) -> None:
    """Write the JSON report (``--out``; a folder: ``vllm_e2e.json`` in it) and the plot."""
    from bench.io import atomic_write_json

    out = Path(args.out)
    if out.is_dir() or args.out.endswith("/"):  # a folder: the default file name in it
        out = out / "vllm_e2e.json"
    doc = {
        "model": args.model,
        "enforce_eager": plan.llm_kw["enforce_eager"],
        "prompts": plan.n,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "results": results,
        "summary": summary,
    }
    atomic_write_json(out, doc)
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def main() -> None:
    """Plan the grid, time every engine beside vLLM plain, summarize and write."""
    args = _parse_args()
    plan = _plan(args)
    results = run_beside_plain(
        plan.grid, plan.sets, args.max_tokens, args.reps, plan.llm_kw, plan.warm
    )
    summary = _summarize(results)
    _write(args, plan, results, summary)


if __name__ == "__main__":
    main()
