"""The n-gram trie replayed on recorded greedy outputs: tau per policy, no model needed.

Greedy tree decoding is lossless, so the text a trie policy decodes is the target's plain
greedy output, and how many tokens each step accepts follows from that text alone: at
output position ``t`` the trie is built from ``prompt + output[:t]``, the step accepts
the longest root-to-leaf path that matches ``output[t:]`` plus one bonus token. This
replays every policy on the same recorded outputs in seconds, so n-gram ranges, budgets
ranking rules and the cross-request history (``history=H``: requests replayed one after
the other, each searching the ones before it) are compared on exactly the same text.
Besides tau: the share of steps that have a trie, the share of its drafts accepted, and
the speedup at batch 1, 4 and 8 under a step-cost model ``a + b * rows`` (``--cost``;
what each verify row costs decides whether a trie pays in a batch; the measured speed is
the end-to-end benchmarks' business).

``--auto`` also replays ``tree: auto`` over the trie candidates (``AUTO_TRIE_CANDIDATES``)
as the engines run it (``step_tries``, ``choose``, ``record`` with each step's seconds),
batch 1, 4 and 8 requests in lockstep, each replaced by the next when it ends, beside
each candidate fixed in the same lockstep: how close the chooser comes to the best trie
of a batch size, on greedy text and a known cost, without the engines' noise.

    python -m bench.trie_replay --model smollm2-135m [--prompts 50] [--max-tokens 128]
        [--policies "ngram:budget=8;ngram:budget=8,min=5,max=5"] [--auto]

The greedy outputs come from vLLM's plain decoding (eager; or HF ``generate`` with
``--hf``), recorded once per model / prompts / length in ``results/greedy_<model>.json``
and reused. Writes ``results/trie_replay.json`` and prints tau per policy.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tree_dev.spec import NgramPolicy, parse_tree_spec

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_POLICIES = (
    "ngram:budget=8",
    "ngram:budget=8,min=2,max=4",
    "ngram:budget=8,min=4,max=4",
    "ngram:budget=8,min=5,max=5",
    "ngram:budget=16",
    "ngram:budget=16,min=2,max=4",
    "ngram:budget=8,history=1024",
    "ngram:budget=8,history=4096",
    "ngram:budget=8,history=16384",
    "ngram:budget=16,history=4096",
)


def accepted_length(parents: tuple[int, ...], tokens: list[int], truth: list[int]) -> int:
    """Draft tokens a greedy walk accepts: the deepest node whose path from the root
    spells a prefix of ``truth`` (the target's next tokens)."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            children.setdefault(p, []).append(i)
    node, depth = 0, 0
    while depth < len(truth):
        nxt = next((c for c in children.get(node, ()) if tokens[c] == truth[depth]), None)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


def replay(policy: NgramPolicy, prompt: list[int], output: list[int], history=None) -> dict:
    """Steps, accepted drafts per depth and tau of one greedy request under ``policy``
    (``history``: the ``NgramHistory`` of the requests before it)."""
    from tree_dev.proposer import ngram_trie

    ctx = list(prompt)
    t, steps, per_depth, drafts = 0, 0, [0] * (policy.depth + 1), []
    while t < len(output):
        tree, toks = ngram_trie(ctx, policy, history)
        n = accepted_length(tuple(tree.parents.tolist()), toks, output[t:])
        for d in range(1, n + 1):
            per_depth[d] += 1
        drafts.append(tree.num_nodes - 1)
        step = min(n + 1, len(output) - t)  # the accepted drafts and the bonus token
        ctx.extend(output[t : t + step])
        t += step
        steps += 1
    return {
        "steps": steps,
        "tokens": len(output),
        "accepted_per_depth": per_depth,
        "drafts_per_step": drafts,
    }


def batch_ratio(runs: list[dict], batch: int, a: float, b: float) -> float:
    """Tokens/s of the replayed requests against plain decoding when each runs in a batch
    of ``batch`` at a step cost of ``a + b * rows`` (seconds; a request's share of a step:
    ``a / batch`` plus ``b`` per row it verifies, its root and its drafts): the trie's
    speedup where a verify row costs what this cost model says, as at 4 or 8 concurrent
    requests where a row is a large share of a step."""
    tokens = sum(r["tokens"] for r in runs)
    plain = tokens * (a / batch + b)
    spent = sum(a / batch + b * (1 + n) for r in runs for n in r["drafts_per_step"])
    return plain / spent


class _Fixed:
    """One trie policy on every step (``replay_batch``'s ``planner``)."""

    def __init__(self, policy: NgramPolicy):
        self.policy, self.name = policy, policy.spec

    def plan(self, contexts: dict[int, list[int]]) -> dict[int, tuple[str, object | None]]:
        from tree_dev.auto.shapes import Candidate, step_tries

        cand = [Candidate(self.policy)]
        tries = {r: step_tries(c, cand)[cand[0].name] for r, c in contexts.items()}
        return {r: ("none", None) if t is None else (self.name, t) for r, t in tries.items()}

    def record(self, outcomes, seconds: float, rows: int) -> None:
        """A fixed trie learns nothing from a step."""

    def forget(self, rid: int) -> None:
        """A fixed trie keeps nothing per request."""


class _Auto:
    """``tree: auto`` over trie candidates, as the engines run it (``replay_batch``'s
    ``planner``): ``step_tries``, ``choose``, ``record`` with the step's seconds."""

    def __init__(self, candidates, cost):
        from tree_dev.auto import AutoPolicy, CostModel

        self.name = "auto"
        self.auto = AutoPolicy(candidates, CostModel(a=cost[0], b=cost[1], c=0.0, d=0.0))

    def plan(self, contexts: dict[int, list[int]]) -> dict[int, tuple[str, object | None]]:
        tries = {r: self.auto.step_tries(r, c) for r, c in contexts.items()}
        picks = self.auto.choose([(r, 0.0) for r in contexts], tries=tries)
        return {r: (c.name, tries[r].get(c.name)) for r, c in picks.items()}

    def record(self, outcomes, seconds: float, rows: int) -> None:
        from tree_dev.auto import Shape

        drafted = int(rows > len(outcomes))  # a trie ran: more rows than requests
        self.auto.record(outcomes, seconds, Shape(rows, 0, 0, 0, drafted, len(outcomes)))

    def forget(self, rid: int) -> None:
        self.auto.forget(rid)


def replay_batch(
    planner: _Fixed | _Auto,
    prompts: list[list[int]],
    outputs: list[list[int]],
    batch: int,
    cost: tuple[float, float],
) -> dict:
    """Greedy requests replayed ``batch`` at a time in lockstep, each replaced by the next
    when it ends, as a server runs them: per step the ``planner`` gives each request a
    trie (or none), the step costs ``a + b * rows`` seconds and each request advances by
    the drafts its truth accepts plus one. Returns tokens, seconds, the ratio to plain
    decoding in the same lockstep and, per trie name, the steps it ran and their drafts
    accepted."""
    from tree_dev.auto import StepOutcome

    a, b = cost
    todo = list(range(len(prompts)))[::-1]
    pos: dict[int, int] = {}
    tokens = seconds = 0.0
    ran: dict[str, list[int]] = {}
    while todo or pos:
        while todo and len(pos) < batch:
            pos[todo.pop()] = 0
        ctx = {r: list(prompts[r]) + list(outputs[r][:t]) for r, t in pos.items()}
        plan = planner.plan(ctx)
        rows, outcomes = 0, []
        for r, (name, trie) in plan.items():
            t = pos[r]
            n = (
                0
                if trie is None
                else accepted_length(tuple(trie.tree.parents.tolist()), trie.tokens, outputs[r][t:])
            )
            rows += 1 if trie is None else trie.tree.num_nodes
            depth = 0 if trie is None else trie.tree.max_depth
            outcomes.append(StepOutcome(r, depth, list(range(n + 1))))
            step = min(n + 1, len(outputs[r]) - t)
            tokens += step
            pos[r] = t + step
            got = ran.setdefault(name, [0, 0])
            got[0], got[1] = got[0] + 1, got[1] + n
        sec = a + b * rows
        seconds += sec
        planner.record(outcomes, sec, rows)
        for r in [r for r, t in pos.items() if t >= len(outputs[r])]:
            del pos[r]
            planner.forget(r)
    plain_steps = _plain_steps([len(o) for o in outputs], batch)
    plain = sum(a + b * k for k in plain_steps)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "ratio": (tokens / seconds) / (sum(len(o) for o in outputs) / plain),
        "ran": {k: {"steps": v[0], "accepted": v[1]} for k, v in sorted(ran.items())},
    }


def _plain_steps(lengths: list[int], batch: int) -> list[int]:
    """The requests per step of plain decoding, ``batch`` at a time in lockstep."""
    todo, left, out = lengths[::-1], [], []
    while todo or left:
        while todo and len(left) < batch:
            left.append(todo.pop())
        out.append(len(left))
        left = [n - 1 for n in left if n > 1]
    return out


def record_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int, hf: bool):
    """The target's plain greedy outputs (vLLM eager, or HF ``generate``)."""
    if hf:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        outs = []
        for p in prompts:
            ids = torch.tensor([p])
            with torch.inference_mode():
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                    do_sample=False, eos_token_id=None, pad_token_id=0,
                )  # fmt: skip
            outs.append(out[0, len(p) :].tolist())
        return outs
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vLLM's CPU default takes most RAM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tree_dev.testing import shutdown_engine

    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=1024, enforce_eager=True)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        got = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        return [list(o.outputs[0].token_ids) for o in got]
    finally:
        shutdown_engine(llm)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model name or directory")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--policies", default=";".join(DEFAULT_POLICIES), help="';'-separated")
    ap.add_argument("--hf", action="store_true", help="record with HF generate, not vLLM")
    ap.add_argument(
        "--cost",
        type=lambda v: tuple(float(x) for x in v.split(",")),
        default=(0.0358, 0.00163),
        metavar="A,B",
        help="step seconds a + b * rows for the batch ratios (default: the vLLM plugin's "
        "fit on SmolLM2-135M with its EAGLE head, on the project's 2-core CPU)",
    )
    ap.add_argument(
        "--auto",
        action="store_true",
        help="also replay batch 1/4/8 in lockstep: tree: auto over the trie candidates "
        "against each of them fixed",
    )
    ap.add_argument("--out", default=str(ROOT / "results" / "trie_replay.json"))
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from bench.io import atomic_write_json
    from tree_dev.models.named import resolve_model
    from tree_dev.models.prompts import heldout_prompt_ids

    model_dir = resolve_model(args.model)
    policies = [parse_tree_spec(s.strip()) for s in args.policies.split(";") if s.strip()]
    bad = [p.spec for p in policies if not isinstance(p, NgramPolicy)]
    if bad:
        raise SystemExit(f"--policies: not n-gram tries: {bad}")
    prompts = heldout_prompt_ids(AutoTokenizer.from_pretrained(model_dir), args.prompts)
    cache = ROOT / "results" / f"greedy_{model_dir.name}_{args.prompts}x{args.max_tokens}.json"
    if cache.is_file() and json.loads(cache.read_text())["prompts"] == prompts:
        outputs = json.loads(cache.read_text())["outputs"]
    else:
        outputs = record_greedy(model_dir, prompts, args.max_tokens, args.hf)
        atomic_write_json(cache, {"prompts": prompts, "outputs": outputs})
    from tree_dev.proposer import NgramHistory

    rows = []
    for pol in policies:
        history, runs = NgramHistory(pol.history), []
        for p, o in zip(prompts, outputs):  # one request after the other, as at batch 1
            runs.append(replay(pol, p, o, history))
            history.add(p + o)
        steps = sum(r["steps"] for r in runs)
        tokens = sum(r["tokens"] for r in runs)
        deepest = min(4, pol.depth)  # the first four depths (fewer for a shallower trie)
        per = [sum(r["accepted_per_depth"][d] for r in runs) / steps for d in range(1, deepest + 1)]
        drafted = [n for r in runs for n in r["drafts_per_step"]]
        accepted = tokens - steps  # every step's bonus token is not a draft
        row = {
            "policy": pol.spec,
            "tau": tokens / steps,
            "acceptance_per_depth": per,
            "steps_with_a_trie": sum(n > 0 for n in drafted) / steps,
            "accepted_per_draft": accepted / max(sum(drafted), 1),
            "batch_ratio": {b: batch_ratio(runs, b, *args.cost) for b in (1, 4, 8)},
        }
        rows.append(row)
        ratios = "  ".join(f"B{b} {x:.2f}x" for b, x in row["batch_ratio"].items())
        print(
            f"{pol.spec:40s} tau {tokens / steps:5.2f}  per depth {[round(x, 2) for x in per]}"
            f"  trie on {row['steps_with_a_trie']:.2f} of steps, "
            f"{row['accepted_per_draft']:.2f} of drafts accepted  {ratios}"
        )
    lockstep = {}
    if args.auto:
        from tqdm import tqdm

        from tree_dev.spec import AUTO_TRIE_CANDIDATES

        cells = [(b, name) for b in (1, 4, 8) for name in ("auto", *AUTO_TRIE_CANDIDATES)]
        for b, name in tqdm(cells, desc="lockstep replays"):
            planner = (
                _Auto(AUTO_TRIE_CANDIDATES, args.cost)
                if name == "auto"
                else _Fixed(parse_tree_spec(name))
            )
            lockstep.setdefault(b, {})[name] = replay_batch(planner, prompts, outputs, b, args.cost)
        for b, got in lockstep.items():
            line = "  ".join(f"{n} {r['ratio']:.2f}x" for n, r in got.items())
            print(f"lockstep B{b}: {line}")
            print(f"  auto ran: {got['auto']['ran']}")
    atomic_write_json(
        Path(args.out),
        {
            "model": args.model,
            "prompts": args.prompts,
            "max_tokens": args.max_tokens,
            "cost": args.cost,
            "rows": rows,
            "lockstep": lockstep,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
