"""``tree: auto``'s choices in simulation: requests of known acceptance, a known step cost,
no model, in seconds instead of hours.

Each cell runs ``--batch`` concurrent requests (each ``--request-steps`` steps long, then
replaced by a new one, as a server's short requests are) for ``--steps`` engine steps.
A request accepts each draft depth with probability ``p`` given the depth before it (a
tree of depth ``D`` yields ``1 + sum_{d<=D} p**d`` tokens on average); the step's seconds
are the cost model's for the chosen shapes (default: the one fitted inside vLLM on
SmolLM2-135M with its EAGLE head on this machine). Reported per cell, as a ratio to
decoding without drafts: auto as it is, auto without probe back-off (``max_backoff=0``
and ``probe_budget=0``, the policy before 2026-12-06), and the best single candidate
given to every request (an oracle that knows ``p``).

    python -m bench.auto_sim                       # batch 1/4/8, p = 0 .. 0.9
    python -m bench.auto_sim --temperature 0       # greedy requests

Writes ``results/auto_sim.json`` and a plot beside it.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from tree_dev.auto import (
    AcceptanceTracker,
    AutoPolicy,
    CostModel,
    Shape,
    StepOutcome,
    batch_shape,
    make_candidates,
)
from tree_dev.spec import AUTO_MODEL_CANDIDATES
from tree_dev.step import GREEDY_TEMPERATURE

ROOT = Path(__file__).resolve().parents[1]
#: ``CostModel.fit`` of the vLLM plugin's calibration, SmolLM2-135M + its EAGLE head, here
SMOLLM2_EAGLE = CostModel(a=0.0461, b=0.00396, c=0.00259, d=0.0)


def expected_tokens(p: float, depth: int) -> float:
    """``1 + sum_{d=1..depth} p**d``: tokens a step of a ``depth``-deep tree yields."""
    return 1.0 + sum(p**d for d in range(1, depth + 1))


def no_draft_rate(batch: int, cost: CostModel) -> float:
    """Tokens per second of ``batch`` requests decoded without drafts at ``cost``."""
    return batch / cost.raw(Shape(batch, 0, 0, 0, 0, batch))


def simulate(
    p: float,
    batch: int,
    cost: CostModel,
    steps: int = 400,
    request_steps: int = 50,
    temperature: float = 0.8,
    max_backoff: int | None = None,
    probe_budget: float | None = None,
    seed: int = 0,
    prompt: int = 0,
) -> float:
    """Tokens per second of ``tree: auto`` over ``AUTO_MODEL_CANDIDATES``, as a ratio to
    decoding without drafts (``batch`` tokens a step of ``cost``'s ``batch`` rows).
    ``max_backoff``, ``probe_budget`` None: the tracker's defaults. The draft's catch-up is
    simulated too: a request starts ``prompt`` tokens behind; a model tree forwards what
    it is behind (priced by ``cost.d`` as draft rows) and leaves it its accepted drafts
    behind; a step without the draft model puts it further behind by the tokens it
    emits."""
    rnd = random.Random(seed)
    kw = {} if max_backoff is None else {"max_backoff": max_backoff}
    kw |= {} if probe_budget is None else {"probe_budget": probe_budget}
    policy = AutoPolicy(AUTO_MODEL_CANDIDATES, cost, AcceptanceTracker(**kw))
    live = {f"r{i}": 0 for i in range(batch)}
    behind = dict.fromkeys(live, prompt)
    made, tokens, seconds = batch, 0, 0.0
    for _ in range(steps):
        picks = policy.choose([(r, temperature) for r in live], behind=behind)
        records = []
        for rid, cand in picks.items():
            accepted = 0
            while accepted < cand.depth and rnd.random() < p:
                accepted += 1
            tokens += 1 + accepted
            records.append(StepOutcome(rid, cand.depth, list(range(accepted + 1))))
            drafted = cand.shape.draft_levels > 0
            behind[rid] = accepted if drafted else behind[rid] + 1 + accepted
        seconds += cost.raw(policy.step_shape)
        policy.record(records)
        for rid in list(live):
            live[rid] += 1
            if live[rid] >= request_steps:
                policy.forget(rid)
                del live[rid], behind[rid]
                live[f"r{made}"], behind[f"r{made}"] = 0, prompt
                made += 1
    return tokens / seconds / no_draft_rate(batch, cost)


def best_fixed(p: float, batch: int, cost: CostModel, temperature: float = 0.8) -> tuple:
    """``(name, ratio to no drafts)`` of the best candidate given to every request (a
    model tree's catch-up: its accepted drafts of the step before, on average)."""
    greedy = temperature < GREEDY_TEMPERATURE
    out = []
    for c in make_candidates(AUTO_MODEL_CANDIDATES):
        if c.sampled_drafts and greedy:
            continue
        tokens = expected_tokens(p, c.depth)
        shape = c.shape  # run every step, the draft is behind by the last step's drafts
        if shape.draft_levels:
            shape = shape._replace(draft_rows=shape.draft_rows + tokens - 1)
        rate = batch * tokens / cost.raw(batch_shape([shape] * batch))
        out.append((c.name, rate))
    name, rate = max(out, key=lambda x: x[1])
    return name, rate / no_draft_rate(batch, cost)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.io import save_figure

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(
        1, len(batches), figsize=(4.2 * len(batches), 3.8), sharey=True, squeeze=False
    )
    axes = axes[0]
    for ax, b in zip(axes, batches):
        rs = [r for r in rows if r["batch"] == b]
        ps = [r["p"] for r in rs]
        ax.plot(ps, [r["auto"] for r in rs], "o-", label="auto")
        ax.plot(ps, [r["auto_no_backoff"] for r in rs], "s--", label="auto, no probe back-off")
        ax.plot(ps, [r["best_fixed"] for r in rs], "k:", label="best fixed tree (oracle)")
        ax.axhline(1.0, color="gray", lw=1)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("acceptance per depth p")
    axes[0].set_ylabel("tokens/s over no drafts (simulated)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def main() -> None:
    from bench.io import atomic_write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,4,8")
    ap.add_argument("--accept", default="0,0.2,0.4,0.6,0.8,0.9")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--request-steps", type=int, default=50)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--out", default=str(ROOT / "results" / "auto_sim.json"))
    args = ap.parse_args()
    cost = SMOLLM2_EAGLE
    rows = []
    for b in (int(x) for x in args.batch.split(",")):
        for p in (float(x) for x in args.accept.split(",")):
            kw = dict(steps=args.steps, request_steps=args.request_steps)
            kw["temperature"] = args.temperature
            name, fixed = best_fixed(p, b, cost, args.temperature)
            row = {
                "batch": b,
                "p": p,
                "auto": simulate(p, b, cost, **kw),
                "auto_no_backoff": simulate(p, b, cost, max_backoff=0, probe_budget=0.0, **kw),
                "best_fixed": fixed,
                "best_fixed_tree": name,
            }
            rows.append(row)
            print(
                f"batch {b} p={p:.1f}: auto {row['auto']:.3f}x, no back-off "
                f"{row['auto_no_backoff']:.3f}x, best fixed {name} {fixed:.3f}x"
            )
    out = Path(args.out)
    cm = cost.coefficients()
    atomic_write_json(out, {"args": vars(args), "cost_model": cm, "rows": rows})
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
