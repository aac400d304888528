"""End-to-end tree speculative decoding on the tiny trained model set: the main job.

On held-out standard-library prompts at batch 1, in one run, side by side:

- the peers, on the same target and prompts: Hugging Face ``generate`` plain
  (greedy / sampling), HF prompt lookup (``prompt_lookup_num_tokens=10``, no draft
  model) and HF assisted generation with the draft LM;
- the engine's plain decoding (``--tree none``) and its grid: chain, static tree and
  dynamic top-K policies at node budgets 4..64 with the EAGLE head and the draft LM,
  the draft-free n-gram trie (``ngram:``) and the hybrid tree (top-K + n-gram trie,
  ``hybrid:``);

at temperature 0 (greedy) and 0.8 (HF sampling vs the engine's lossless sampling;
the tiny target loops under greedy decoding, which flatters n-gram drafting). For
each: tau (tokens per target forward), acceptance per depth, tokens/s, the speedup
over HF's plain ``generate`` and over the engine's own plain decoding, the draft's
share of the decode time, the distinct-token ratio of the outputs (how loopy the
text was) and, greedy, whether every output equals HF greedy's token for token.

The grid runs in ``--rounds`` rounds, each between two HF-plain and two engine-plain
runs; a speedup is the median over rounds of tokens/s over the round's baseline (this
shared machine drifts by 10-20% within minutes). Tokens per second of process CPU
time are recorded too (``cpu_tokens_per_s``): less sensitive to other processes.

The best policy for this machine is the greedy one with the highest *measured*
tokens/s among those that pass the propose gate. Writes ``results/e2e.json``
(``best_policy`` is read by ``serve.py``) and ``results/e2e.png``.

    python -m bench.e2e            # full grid, both temperatures, 3 rounds
    python -m bench.e2e --quick    # budgets 8 and 16, fewer prompts, 1 round
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.common import distinct_ratio
from bench.io import atomic_write_json, save_figure
from tree_dev.engine import Engine, SamplingParams
from tree_dev.tree import MC_SIM_7B_63

BUDGETS = (4, 8, 16, 32, 64)
# budget -> (k, depth) of the dynamic top-K tree. "topk": as deep as the chain of the
# same budget (up to 16 levels), so tau is compared at equal nodes *and* reach;
# "topk-fast": half as deep, fewer draft forwards per step (depth = draft forwards).
# Budgets 1 and 2 (one draft forward) are for sampling, where acceptance collapses
# past the first level and the cheapest tree wins (``--budgets 1,2,4``).
TOPK_SHAPES = {1: (1, 1), 2: (2, 1), 4: (2, 4), 8: (2, 8), 16: (2, 12), 32: (3, 16), 64: (4, 16)}
TOPK_FAST_SHAPES = {1: (1, 1), 2: (2, 1), 4: (2, 2), 8: (2, 4), 16: (2, 6), 32: (3, 8), 64: (4, 8)}
FAMILIES = (
    "chain", "static", "topk", "topk-fast", "hybrid", "ngram", "ngram-history", "chain-sampled"
)  # fmt: skip
DRAFT_FREE = ("ngram", "ngram-history")  # families that run no draft model
NGRAM_HISTORY = 4096  # tokens of earlier requests the ngram-history trie searches
# Sampling only (T > 0): the chain's drafts drawn from the draft's distribution and
# verified against it (``Engine(draft_sampling=True)``: SpecInfer's residual rule), which
# accepts where top-ranked drafts fail on diverse sampled text. At T = 0 it is "chain".
SAMPLED_ONLY = ("chain-sampled",)
# The trained drafts are right more often than their probabilities say: ranking nodes
# with log-probs sharpened by 1/0.3 favours depth (it lifts top-K's tau at budget 16 from
# below the chain's to above it with the EAGLE head: docs/design_figures.md, "Top-K
# ranking temperature"). It only shapes the tree.
RANK_TEMP = 0.3
PEERS = ("hf", "hf-lookup", "hf-assisted")  # HF generate: plain, prompt lookup, assisted
LOOKUP_TOKENS = 10


def policies(budget: int) -> dict[str, str]:
    """Tree specs with ``budget`` draft nodes: chain, static (Medusa order), dynamic
    top-K, the hybrid (top-K-fast + n-gram trie), the draft-free n-gram trie and the
    chain with sampled drafts."""
    paths = ",".join(str(p) for p in MC_SIM_7B_63[: min(budget, len(MC_SIM_7B_63))])
    k, depth = TOPK_SHAPES[budget]
    kf, df = TOPK_FAST_SHAPES[budget]
    return {
        "chain": f"chain:{budget}",
        "static": f"paths:[{paths}]",
        "topk": f"topk:k={k},depth={depth},budget={budget},temp={RANK_TEMP}",
        "topk-fast": f"topk:k={kf},depth={df},budget={budget},temp={RANK_TEMP}",
        "hybrid": f"hybrid:k={kf},depth={df},budget={budget},temp={RANK_TEMP}",
        "ngram": f"ngram:budget={budget}",
        "ngram-history": f"ngram:budget={budget},history={NGRAM_HISTORY}",
        "chain-sampled": f"chain:{budget}",
    }


def held_out_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens from held-out standard-library files."""
    from tree_dev.models.data import corpus_files, read_texts

    _, val = corpus_files()
    prompts = []
    for text in read_texts(val):
        ids = tokenizer.encode(text)
        if len(ids) >= 4 * length:
            start = len(ids) // 3  # past the license header / imports
            prompts.append(ids[start : start + length])
        if len(prompts) == n:
            break
    if len(prompts) < n:
        raise ValueError(f"only {len(prompts)} held-out files are long enough for {n} prompts")
    return prompts


def run_policy(
    models,
    spec: str,
    drafter: str,
    prompts: list[list[int]],
    max_tokens: int,
    backend: str,
    temperature: float = 0.0,
    draft_sampling: bool = False,
) -> dict:
    """Decode every prompt alone (batch 1) through the engine; returns measurements and
    outputs (``temperature > 0``: lossless sampling, seeded per prompt; ``draft_sampling``:
    drafts drawn from the draft's distribution and verified against it)."""
    draft = models.draft if drafter == "draft" and spec != "none" else None
    eagle = models.eagle if drafter == "eagle" and spec != "none" else None
    engine = Engine(
        models.target,
        draft,
        eagle=eagle,
        tree=spec,
        max_batch=1,
        max_model_len=len(prompts[0]) + max_tokens + 8,
        kernel_backend=backend,
        draft_sampling=draft_sampling,
    )
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    for key in engine.timings:
        engine.timings[key] = 0.0
    engine.forwards = {"target": 0, "draft": 0}
    outputs, tried, accepted = [], [], []
    start, cpu = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=temperature, seed=i
        )
        rid = engine.add_request(p, params)
        while engine.has_work():
            engine.step()
        req = engine.requests[rid]
        outputs.append(req.output)
        for d, (t, a) in enumerate(zip(req.depth_tried, req.depth_accepted)):
            while len(tried) <= d:
                tried.append(0)
                accepted.append(0)
            tried[d] += t
            accepted[d] += a
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o) for o in outputs)
    decode = engine.timings["draft"] + engine.timings["verify"] + engine.timings["walk"]
    return {
        "spec": spec,
        "drafter": drafter if spec != "none" else None,
        "temperature": temperature,
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "cpu_tokens_per_s": tokens / cpu,
        "target_forwards": engine.forwards["target"],
        "draft_forwards": engine.forwards["draft"],
        "tau": tokens / max(1, engine.forwards["target"]),
        "acceptance_per_depth": [a / t if t else 0.0 for a, t in zip(accepted, tried)],
        "draft_share": engine.timings["draft"] / decode if decode else 0.0,
        "distinct_ratio": distinct_ratio(outputs),
        "outputs": outputs,
    }


def run_hf(
    hf_models, kind: str, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0
) -> dict:
    """Hugging Face ``generate`` on its own copy of the target (SDPA attention): plain,
    prompt lookup (``prompt_lookup_num_tokens=10``) or assisted by the draft LM, greedy
    or sampling (``temperature``, no top-k / top-p truncation), no EOS stop."""
    target = hf_models.target
    kw: dict = dict(max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kw.update(do_sample=False)
    if kind == "hf-lookup":
        kw["prompt_lookup_num_tokens"] = LOOKUP_TOKENS
    elif kind == "hf-assisted":
        kw["assistant_model"] = hf_models.draft
    elif kind != "hf":
        raise ValueError(f"unknown HF method {kind!r}; expected one of {PEERS}")

    def one(p: list[int]) -> list[int]:
        ids = torch.tensor([p])
        with torch.inference_mode():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        return out[0, len(p) :].tolist()

    one(prompts[0][:16])  # warm-up
    outputs = []
    start, cpu = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        torch.manual_seed(i)
        outputs.append(one(p))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o) for o in outputs)
    return {
        "spec": kind,
        "drafter": "draft" if kind == "hf-assisted" else None,
        "temperature": temperature,
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "cpu_tokens_per_s": tokens / cpu,
        "distinct_ratio": distinct_ratio(outputs),
        "outputs": outputs,
    }


def verify_cost(models, prefix: int, sizes: tuple[int, ...], backend: str, reps: int = 7) -> dict:
    """Median ms of one target verify forward for a tree of ``n`` nodes after ``prefix``."""
    from tree_dev.tree import TokenTree

    engine = Engine(
        models.target, tree="none", max_batch=1, max_model_len=prefix + 80, kernel_backend=backend
    )
    runner = engine.runner
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, engine.vocab_size, (prefix,), generator=gen).tolist()
    runner.prefill([0], [0], [prompt])
    out = {}
    for n in sizes:
        tree = TokenTree.from_paths(MC_SIM_7B_63[: n - 1]) if n > 1 else TokenTree.chain(0)
        tokens = torch.randint(0, engine.vocab_size, (n,), generator=gen).tolist()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            runner.forward([0], [prefix], [tree], None, tokens)
            times.append(time.perf_counter() - t0)
        out[n] = 1000 * statistics.median(times)
    runner.cache.free(0)
    return out


def draft_level_ms(
    models, backend: str, prefix: int = 96, reps: int = 100, drafters=("eagle", "draft")
) -> dict:
    """CPU ms (thread time, min over ``reps``: robust to other processes) of one draft
    forward per kind of level, for the EAGLE head and the draft LM, at batch 1:
    ``level0``: the trunk (5 accepted tokens ending in the root, logits at the root
    only); ``topk-level``: 2 new nodes below 2 earlier ones; ``chain-level``: the next
    node of a chain."""
    from tree_dev.proposer import tree_of

    gen = torch.Generator().manual_seed(0)
    cases = {
        "level0": (tree_of((-1, 0, 1, 2, 3)), [0, 1, 2, 3, 4], [4]),
        "topk-level": (tree_of((-1, 0, 0, 1, 1)), [3, 4], [0, 1]),
        "chain-level": (tree_of((-1, 0, 1, 2)), [3], [0]),
    }
    out = {}
    for drafter in drafters:
        kw = {"eagle": models.eagle} if drafter == "eagle" else {"draft": models.draft}
        engine = Engine(
            models.target,
            tree="chain:4",
            max_batch=1,
            max_model_len=prefix + 80,
            kernel_backend=backend,
            **kw,
        )
        dr = engine.draft_runner
        vocab = engine.vocab_size
        prompt = torch.randint(0, vocab, (prefix + 1,), generator=gen).tolist()
        hidden = models.target.config.hidden_size
        feats = torch.randn(prefix, hidden, generator=gen)
        dr.prefill([0], [0], [prompt[:prefix]], [feats] if dr.eagle else None)
        for name, (tree, nodes, rows) in cases.items():
            f = feats[: len(nodes)] if dr.eagle else None
            times = []
            for _ in range(reps):
                t0 = time.thread_time()
                dr.forward([0], [prefix], [tree], [nodes], prompt[-1:] * len(nodes), f, True, rows)
                times.append(time.thread_time() - t0)
            out[f"{drafter}/{name}"] = 1000 * min(times)
        dr.cache.free(0)
    return out


def _drafter(row: dict) -> str | None:
    """A row's drafter for the plot: ``"eagle"``, ``"draft"``, or None (draft-free rows
    say ``"none"``: the n-gram trie)."""
    return None if row["drafter"] in (None, "none") else row["drafter"]


def plot(rows: list[dict], peers: list[dict], verify_ms: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, 2 + len(temps), figsize=(6 + 5 * len(temps), 4.4))
    greedy = [r for r in rows if r["temperature"] == 0]
    for family, marker in zip(FAMILIES, "os^vDx*"):
        for drafter, style in (("eagle", "-"), ("draft", "--"), (None, ":")):
            sel = [r for r in greedy if r.get("family") == family and _drafter(r) == drafter]
            if sel:
                axes[0].plot(
                    [r["budget"] for r in sel],
                    [r["tau"] for r in sel],
                    style,
                    marker=marker,
                    label=f"{family} ({drafter or 'no draft'})",
                )
    axes[0].set(xscale="log", xlabel="draft nodes (budget)", ylabel="tau", title="tau, greedy")
    for ax, temp in zip(axes[1:], temps):
        for family, marker in zip(FAMILIES, "os^vDx*"):
            for drafter, style in (("eagle", "-"), ("draft", "--"), (None, ":")):
                sel = [
                    r
                    for r in rows
                    if r["temperature"] == temp
                    and r.get("family") == family
                    and _drafter(r) == drafter
                ]
                if sel:
                    ax.plot(
                        [r["budget"] for r in sel],
                        [r["speedup_vs_hf"] for r in sel],
                        style,
                        marker=marker,
                        label=f"{family} ({drafter or 'no draft'})",
                    )
        for peer, color in zip(peers, ("k", "tab:red", "tab:purple", "tab:gray")):
            if peer["temperature"] == temp and "speedup_vs_hf" in peer:
                ax.axhline(peer["speedup_vs_hf"], color=color, lw=0.9, ls="-.", label=peer["spec"])
        ax.set(
            xscale="log",
            xlabel="draft nodes (budget)",
            ylabel="tokens/s over HF generate",
            title=f"batch 1, temperature {temp}",
        )
    sizes = sorted(verify_ms)
    axes[-1].plot(sizes, [verify_ms[s] for s in sizes], marker="o")
    axes[-1].set(xscale="log", xlabel="tree nodes", ylabel="ms", title="Target verify forward")
    budgets = sorted({r["budget"] for r in rows})
    for ax in axes[:-1]:
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.legend(fontsize=6)
    axes[-1].set_xticks(sizes, [str(s) for s in sizes])
    axes[-1].minorticks_off()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def load_models(model: str | None, n_prompts: int, args) -> tuple:
    """``(engine models, untouched HF copies, prompts)`` for a model set (the committed
    toy by default: target, draft LM, EAGLE head; held-out standard-library windows) or a
    pretrained model by name or directory (``smollm2-135m``: the target and its committed
    EAGLE head, ``named.EAGLE_HEADS``, where it has one; the held-out code and chat prompts
    of ``tree_dev.models.prompts``)."""
    from tree_dev.models import EagleHead, ModelSet, load
    from tree_dev.models.named import eagle_head_dir, resolve_model

    path = resolve_model(model) if model is not None else None
    if path is None or (path / "target").is_dir():
        models, hf_models = load(path), load(path)  # the copies keep SDPA for HF generate
        return models, hf_models, held_out_prompts(models.tokenizer, n_prompts, args.prompt_tokens)
    from transformers import AutoTokenizer

    from tree_dev.engine import load_causal_lm
    from tree_dev.models.prompts import heldout_prompt_ids

    tok = AutoTokenizer.from_pretrained(path)
    head = eagle_head_dir(model) if model is not None else None
    sets = []
    for _ in range(2):
        target = load_causal_lm(path)
        eagle = EagleHead.from_pretrained(head, target=target) if head is not None else None
        sets.append(ModelSet(target, None, eagle, tok, path))
    return sets[0], sets[1], heldout_prompt_ids(tok, n_prompts)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="budgets 8 and 16, 4 prompts, 1 round")
    ap.add_argument("--prompts", type=int, default=None, help="held-out prompts (default 8)")
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per prompt (default 128)")
    ap.add_argument("--drafter", choices=("eagle", "draft", "both"), default="both")
    ap.add_argument("--budgets", default=None, help="comma-separated (default 4,8,16,32,64)")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated")
    ap.add_argument(
        "--temperatures", default="0,0.8", help="comma-separated (0: greedy; default 0,0.8)"
    )
    ap.add_argument("--kernel-backend", default="torch")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument(
        "--rounds", type=int, default=None, help="rounds of the grid (default 3; --quick: 1)"
    )
    ap.add_argument("--models", default=None, help="model set directory (default: committed)")
    ap.add_argument(
        "--model",
        default=None,
        help="a model name or directory instead of --models: smollm2-135m (SmolLM2-135M-"
        "Instruct, fetched on first use; no draft, so the draft-free families and HF's "
        "plain / prompt-lookup peers on the held-out code and chat prompts)",
    )
    ap.add_argument("--out", default="results")
    return ap.parse_args(argv)


_Job = tuple[str, str, str, int, float]  # (tree spec, drafter, family, budget, temperature)


@dataclass
class _Plan:
    """What one run measures: the grid's axes, the HF peers and the grid's jobs."""

    budgets: tuple[int, ...]
    families: tuple[str, ...]
    temps: tuple[float, ...]
    n_prompts: int
    max_tokens: int
    drafters: tuple[str, ...]
    rounds: int
    peer_kinds: tuple[str, ...] = PEERS[1:]
    jobs: list[_Job] = field(default_factory=list)


def _plan(args: argparse.Namespace) -> _Plan:
    """The grid's axes from the command line (its jobs need the models: ``_plan_jobs``)."""
    if args.budgets:
        budgets = tuple(int(b) for b in args.budgets.split(","))
        bad = [b for b in budgets if b not in TOPK_SHAPES]
        if bad:
            raise ValueError(f"--budgets: {bad} not in {sorted(TOPK_SHAPES)}")
    else:
        budgets = (8, 16) if args.quick else BUDGETS
    families = tuple(f.strip() for f in args.families.split(","))
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"--families: unknown {unknown}; known {FAMILIES}")
    return _Plan(
        budgets=budgets,
        families=families,
        temps=tuple(float(t) for t in args.temperatures.split(",")),
        n_prompts=args.prompts or (4 if args.quick else 8),
        max_tokens=args.max_tokens or (64 if args.quick else 128),
        drafters=("eagle", "draft") if args.drafter == "both" else (args.drafter,),
        rounds=args.rounds or (1 if args.quick else 3),
    )


def _plan_jobs(plan: _Plan, has: tuple[str, ...]) -> None:
    """Fill in ``plan.jobs``: every (policy, drafter, temperature) of the grid, for the
    drafters the models ``has`` (``"eagle"``, ``"draft"``); without a draft LM no HF
    assisted generation, and without any draft (a pretrained model alone) only the
    draft-free families."""
    plan.drafters = tuple(d for d in plan.drafters if d in has)
    if "draft" not in has:
        plan.peer_kinds = tuple(k for k in plan.peer_kinds if k != "hf-assisted")
    if not plan.drafters:
        plan.families = tuple(f for f in plan.families if f in DRAFT_FREE)
    for temp in plan.temps:
        for b in plan.budgets:
            for family, spec in policies(b).items():
                if family not in plan.families or (family in SAMPLED_ONLY and temp == 0):
                    continue
                for drafter in ("none",) if family in DRAFT_FREE else plan.drafters:
                    plan.jobs.append((spec, drafter, family, b, temp))


@dataclass
class _Inputs:
    """The engine's models, the untouched HF copies, the prompts and the kernel backend."""

    models: Any
    hf_models: Any
    prompts: list[list[int]]
    backend: str


@dataclass
class _Measured:
    """Raw runs: baselines ``(key, temp) -> [round][run]``, HF peers ``(kind, temp) ->
    [round]`` and the grid's jobs ``[job][round]``."""

    base_runs: dict[tuple[str, float], list[list[dict]]]
    peer_runs: dict[tuple[str, float], list[dict]]
    runs: list[list[dict]]


def _run_baselines(plan: _Plan, inp: _Inputs, measured: _Measured, rnd: int) -> None:
    """One run of HF plain and of the engine's plain decoding at every temperature."""
    for temp in plan.temps:
        for key, fn in (
            ("hf", lambda t=temp: run_hf(inp.hf_models, "hf", inp.prompts, plan.max_tokens, t)),
            (
                "none",
                lambda t=temp: run_policy(
                    inp.models, "none", "none", inp.prompts, plan.max_tokens, inp.backend, t
                ),
            ),
        ):
            runs = measured.base_runs.setdefault((key, temp), [[] for _ in range(plan.rounds)])
            runs[rnd].append(fn())


def _run_grid(plan: _Plan, inp: _Inputs) -> _Measured:
    """Rounds of the whole grid and the HF peers, each between two runs of the baselines:
    a speedup is the median over rounds of tokens/s over its round's baseline, so drift
    within a round hits both sides alike."""
    measured = _Measured({}, {}, [[] for _ in plan.jobs])
    for rnd in range(plan.rounds):
        _run_baselines(plan, inp, measured, rnd)
        for temp in plan.temps:
            for kind in plan.peer_kinds:
                r = run_hf(inp.hf_models, kind, inp.prompts, plan.max_tokens, temp)
                measured.peer_runs.setdefault((kind, temp), []).append(r)
        for j, (spec, drafter, family, budget, temp) in enumerate(
            tqdm(plan.jobs, desc=f"policies, round {rnd + 1}/{plan.rounds}")
        ):
            r = run_policy(
                inp.models,
                spec,
                drafter,
                inp.prompts,
                plan.max_tokens,
                inp.backend,
                temp,
                draft_sampling=family in SAMPLED_ONLY,
            )
            r.update(family=family, budget=budget)
            measured.runs[j].append(r)
        _run_baselines(plan, inp, measured, rnd)
    return measured


def _round_base(measured: _Measured, key: str, temp: float) -> list[float]:
    """Per round, the median tokens/s of baseline ``key`` at ``temp``."""
    return [
        statistics.median(x["tokens_per_s"] for x in rr) for rr in measured.base_runs[(key, temp)]
    ]


def _summarize(
    per_round: list[dict], temp: float, measured: _Measured, hf_greedy: list | None
) -> dict:
    """One result row from a method's runs of every round: medians over rounds of tokens/s
    and of the speedups over the round's baselines; greedy, whether it equals HF greedy."""
    r = dict(per_round[0])  # tau, acceptance: deterministic per seed, the same every round
    for key, name in (("hf", "speedup_vs_hf"), ("none", "speedup_vs_plain")):
        ratios = [
            x["tokens_per_s"] / b for x, b in zip(per_round, _round_base(measured, key, temp))
        ]
        r[name] = statistics.median(ratios)
        r[name + "_rounds"] = ratios
    r["tokens_per_s"] = statistics.median(x["tokens_per_s"] for x in per_round)
    r["cpu_tokens_per_s"] = statistics.median(x["cpu_tokens_per_s"] for x in per_round)
    if "draft_share" in r:
        r["draft_share"] = statistics.median(x["draft_share"] for x in per_round)
    if temp == 0 and hf_greedy is not None:
        r["equals_hf_greedy"] = all(x["outputs"] == hf_greedy for x in per_round)
    return r


def _summaries(plan: _Plan, measured: _Measured) -> tuple[list[dict], list[dict]]:
    """``(rows, peers)``: the grid's jobs, and the baselines and HF peers, over rounds."""
    hf_greedy = measured.base_runs[("hf", 0.0)][0][0]["outputs"] if 0.0 in plan.temps else None
    rows = [
        _summarize(pr, plan.jobs[j][4], measured, hf_greedy) for j, pr in enumerate(measured.runs)
    ]
    peers = []
    for temp in plan.temps:
        for key in ("hf", "none"):
            flat = [x for rr in measured.base_runs[(key, temp)] for x in rr]
            peers.append(_summarize(flat[::2], temp, measured, hf_greedy))
        for kind in plan.peer_kinds:
            peers.append(_summarize(measured.peer_runs[(kind, temp)], temp, measured, hf_greedy))
    return rows, peers


def _compare_to_chain(greedy: list[dict]) -> dict[str, float]:
    """Set ``tau_over_chain`` on the greedy top-K rows (tau over the chain's at the same
    drafter and budget); returns the ``topk`` family's ratios by ``drafter@budget``."""
    chain_vs_topk = {}
    chain_tau = {(r["drafter"], r["budget"]): r["tau"] for r in greedy if r["family"] == "chain"}
    for r in greedy:
        ref = chain_tau.get((r["drafter"], r["budget"]))
        if r["family"].startswith("topk") and ref:
            r["tau_over_chain"] = r["tau"] / ref
            if r["family"] == "topk":
                chain_vs_topk[f"{r['drafter']}@{r['budget']}"] = r["tau_over_chain"]
    return chain_vs_topk


def _best_policy(greedy: list[dict]) -> dict | None:
    """The fastest greedy policy that also passes the propose gate (a top-K tree must reach
    at least the chain's tau at its node budget), so serve.py's default is gate-clean."""
    eligible = [r for r in greedy if r.get("tau_over_chain", 1.0) >= 1.0] or greedy
    return max(eligible, key=lambda r: r["speedup_vs_plain"]) if eligible else None


def _print_table(peers: list[dict], rows: list[dict]) -> None:
    """The peers' and the grid's rows, one line each."""
    print(
        f"\n{'method':11} {'drafter':7} {'policy':13} {'budget':>6} {'T':>3} {'tau':>5} "
        f"{'tok/s':>7} {'cpu t/s':>7} {'/HF':>5} {'/plain':>6} {'draft%':>6} {'distinct':>8} "
        f"{'=HF':>5}  acceptance per depth"
    )
    for r in peers + rows:
        acc = " ".join(f"{a:.2f}" for a in r.get("acceptance_per_depth", []))
        tau = f"{r['tau']:5.2f}" if "tau" in r else "    -"
        share = f"{100 * r['draft_share']:5.0f}%" if "draft_share" in r else "     -"
        print(
            f"{('engine' if 'family' in r or r['spec'] == 'none' else r['spec']):11} "
            f"{str(r['drafter'] or '-'):7} {r.get('family', r['spec']):13} "
            f"{r.get('budget', '-'):>6} {r['temperature']:3.1f} {tau} {r['tokens_per_s']:7.1f} "
            f"{r['cpu_tokens_per_s']:7.1f} {r['speedup_vs_hf']:5.2f} {r['speedup_vs_plain']:6.2f} "
            f"{share} {r['distinct_ratio']:8.2f} {str(r.get('equals_hf_greedy', '-')):>5}  {acc}"
        )


def _greedy_goals(greedy: list[dict], peer_of: dict[tuple[str, float], dict]) -> dict:
    """The temperature-0 goals: plain vs HF greedy, the best tree vs HF greedy and prompt
    lookup, and every greedy output equal to HF greedy's."""
    goals: dict = {}
    best0 = max(greedy, key=lambda r: r["speedup_vs_hf"]) if greedy else None
    plain0 = peer_of[("none", 0.0)]
    goals["plain_at_least_1.0x_hf_greedy"] = plain0["speedup_vs_hf"] >= 1.0
    if best0 is not None:
        lookup = peer_of[("hf-lookup", 0.0)]
        goals["best_tree_at_least_1.2x_hf_prompt_lookup"] = (
            best0["tokens_per_s"] / lookup["tokens_per_s"] >= 1.2
        )
        goals["best_tree_at_least_1.5x_hf_greedy"] = best0["speedup_vs_hf"] >= 1.5
        goals["best_tree_t0"] = {
            "tree": best0["spec"],
            "family": best0["family"],
            "drafter": best0["drafter"],
            "speedup_vs_hf": best0["speedup_vs_hf"],
            "over_hf_prompt_lookup": best0["tokens_per_s"] / lookup["tokens_per_s"],
        }
    goals["every_greedy_output_equals_hf_greedy"] = all(
        r.get("equals_hf_greedy", True) for r in greedy + [plain0]
    )
    return goals


def _sampled_goals(rows: list[dict]) -> dict:
    """The temperature-0.8 goal: the best tree vs HF sampling."""
    sampled = [r for r in rows if r["temperature"] == 0.8]
    if not sampled:
        return {}
    best8 = max(sampled, key=lambda r: r["speedup_vs_hf"])
    return {
        "best_tree_at_least_1.3x_hf_sampling_t0.8": best8["speedup_vs_hf"] >= 1.3,
        "best_tree_t0.8": {
            "tree": best8["spec"],
            "family": best8["family"],
            "draft_sampling": best8["family"] in SAMPLED_ONLY,
            "drafter": best8["drafter"],
            "speedup_vs_hf": best8["speedup_vs_hf"],
            "speedup_vs_plain": best8["speedup_vs_plain"],
        },
    }


def _goals(temps: tuple[float, ...], rows: list[dict], peers: list[dict]) -> dict:
    """The run's goals at the temperatures it measured."""
    greedy = [r for r in rows if r["temperature"] == 0]
    peer_of = {(p["spec"], p["temperature"]): p for p in peers}
    goals = {}
    if 0.0 in temps:
        goals.update(_greedy_goals(greedy, peer_of))
    if 0.8 in temps:
        goals.update(_sampled_goals(rows))
    return goals


def _print_best(best: dict | None) -> None:
    """The best gate-clean greedy policy, if any."""
    if best is not None:
        print(
            f"best greedy policy here (gate-clean): {best['spec']} with {best['drafter']} "
            f"({best['tokens_per_s']:.1f} tok/s, {best['speedup_vs_hf']:.2f}x HF greedy, "
            f"{best['speedup_vs_plain']:.2f}x plain, tau {best['tau']:.2f})"
        )


def _write_report(
    args: argparse.Namespace,
    plan: _Plan,
    rows: list[dict],
    peers: list[dict],
    *,
    verify_ms: dict,
    level_ms: dict,
    chain_vs_topk: dict[str, float],
    goals: dict,
    best: dict | None,
) -> None:
    """Write ``e2e.json`` (outputs left out) and ``e2e.png`` under ``--out``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    strip = lambda r: {k: v for k, v in r.items() if k != "outputs"}  # noqa: E731
    report = {
        "config": {
            "model": args.model or args.models or "stdlib-v1",
            "prompts": plan.n_prompts,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": plan.max_tokens,
            "kernel_backend": args.kernel_backend,
            "threads": args.threads,
            "batch": 1,
            "rounds": plan.rounds,
            "temperatures": list(plan.temps),
            "budgets": list(plan.budgets),
            "families": list(plan.families),
        },
        "peers": [strip(p) for p in peers],
        "verify_ms_by_nodes": verify_ms,
        "draft_level_cpu_ms": level_ms,
        "topk_over_chain_tau": chain_vs_topk,
        "goals": goals,
        "results": [strip(r) for r in rows],
    }
    if best is not None:
        report["best_policy"] = {"tree": best["spec"], "drafter": best["drafter"]}
        report["best_speedup"] = best["speedup_vs_plain"]
        report["best_speedup_vs_hf"] = best["speedup_vs_hf"]
    atomic_write_json(out / "e2e.json", report)
    plot(rows, peers, verify_ms, out / "e2e.png")
    print(f"wrote {out / 'e2e.json'} and {out / 'e2e.png'}")


def main(argv: list[str] | None = None) -> int:
    """Plan the grid, run it, print and write the report; 1 if a greedy output is not HF's."""
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    plan = _plan(args)
    models, hf_models, prompts = load_models(args.model or args.models, plan.n_prompts, args)
    has = tuple(d for d in ("eagle", "draft") if getattr(models, d) is not None)
    _plan_jobs(plan, has)
    measured = _run_grid(plan, _Inputs(models, hf_models, prompts, args.kernel_backend))
    rows, peers = _summaries(plan, measured)
    verify_ms = verify_cost(models, args.prompt_tokens, (1, 5, 9, 17, 33, 64), args.kernel_backend)
    level_ms = draft_level_ms(
        models, args.kernel_backend, args.prompt_tokens, drafters=plan.drafters
    )
    greedy = [r for r in rows if r["temperature"] == 0]
    chain_vs_topk = _compare_to_chain(greedy)
    best = _best_policy(greedy)
    _print_table(peers, rows)
    print("verify cost (ms) by tree nodes:", {k: round(v, 2) for k, v in verify_ms.items()})
    print("draft forward CPU ms per level:", {k: round(v, 3) for k, v in level_ms.items()})
    goals = _goals(plan.temps, rows, peers)
    print("goals:", goals)
    _print_best(best)
    _write_report(
        args,
        plan,
        rows,
        peers,
        verify_ms=verify_ms,
        level_ms=level_ms,
        chain_vs_topk=chain_vs_topk,
        goals=goals,
        best=best,
    )
    lossless = all(r.get("equals_hf_greedy", True) for r in greedy)
    return 0 if lossless else 1


if __name__ == "__main__":
    raise SystemExit(main())
