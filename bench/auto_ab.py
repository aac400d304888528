"""A/B of a ``tree: auto`` setting inside one vLLM engine: waves of the same requests run
with setting A and setting B in turn, paired wave by wave.

Two engines side by side on this 2-core machine read a few percent apart from noise
alone; one engine whose setting is switched between waves, each pair of waves on the
same prompts one after the other (A first on even waves, B first on odd), sees a small
effect that a grid of separate engines cannot. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so its auto (``VllmAuto``) is at hand.

A setting is a comma-separated list of (empty: as the engine is):

- ``force=TREE``: every request gets candidate ``TREE`` (``none`` included), through the
  worker's ``treespec_auto_force``; without it, auto chooses;
- ``NAME=VALUE``: an attribute of the ``AutoPolicy`` (``longest_rest=8``);
- ``cost.NAME=VALUE``: an attribute of its cost model, set again after every online
  refit (which makes a new model): ``cost.drafted_bounds=0.5:2``.

Values are ints, floats, or ``:``-separated tuples of numbers.

    python -m bench.auto_ab --b longest_rest=0 --concurrency 8 --temperature 0
    python -m bench.auto_ab --b "cost.drafted_bounds=0.5:2" --concurrency 8 --temperature 0
    python -m bench.auto_ab --b "force=ngram:budget=4,min=3" --concurrency 8 --temperature 0
    python -m bench.auto_ab --model smollm2-135m --b force=none --concurrency 8 --prompts 24

Per wave: tokens/s of A and of B and their ratio B / A, and what auto chose (its
``choices`` counters; a forced tree is not a choice: not counted); then the median
ratio and the median without the first wave (whatever auto explored first). Writes
``results/auto_ab.json`` and a plot of the ratios beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def parse_setting(text: str) -> dict[str, Any]:
    """``"force=none,longest_rest=8,cost.drafted_bounds=0.5:2"`` -> ``{"force": "none",
    "longest_rest": 8, "cost.drafted_bounds": (0.5, 2.0)}``; ``ValueError`` naming the
    item that is not ``NAME=VALUE`` or whose value is not a number (``force`` takes a tree
    spec, which may hold commas: everything after ``force=`` up to the next ``NAME=`` item
    is its tree).

    >>> parse_setting("force=ngram:budget=4,min=3,longest_rest=8")
    {'force': 'ngram:budget=4,min=3', 'longest_rest': 8}
    >>> parse_setting("")
    {}
    """
    out: dict[str, Any] = {}
    items = [i for i in text.split(",") if i.strip()]
    k = 0
    while k < len(items):
        name, sep, value = items[k].strip().partition("=")
        if not sep or not name or not value:
            raise ValueError(f"setting item {items[k]!r} is not NAME=VALUE")
        if name == "force":  # a tree spec: its own commas belong to it
            while k + 1 < len(items) and not _is_setting(items[k + 1]):
                k += 1
                value += "," + items[k].strip()
            out[name] = value
        else:
            out[name] = _number(name, value)
        k += 1
    return out


def _is_setting(item: str) -> bool:
    """Whether ``item`` starts a new ``NAME=VALUE`` of ``parse_setting`` (its name is an
    attribute name, ``force`` or ``cost.NAME``), not a part of a tree spec (``min=3``)."""
    name = item.strip().partition("=")[0]
    return name == "force" or name.startswith("cost.") or name in _policy_settings()


def _policy_settings() -> frozenset[str]:
    """``AutoPolicy``'s number settings (its keyword arguments, but the objects it is
    given): the names ``parse_setting`` tells from the ``key=value`` parts of a forced
    tree spec."""
    import inspect

    from tree_dev.auto import AutoPolicy

    params = inspect.signature(AutoPolicy.__init__).parameters
    return frozenset(params) - {"self", "candidates", "cost_model", "tracker", "clock"}


def _number(name: str, value: str) -> int | float | tuple[float, ...]:
    try:
        if ":" in value:
            return tuple(float(v) for v in value.split(":"))
        return int(value) if value.lstrip("-").isdigit() else float(value)
    except ValueError:
        raise ValueError(f"setting {name}={value!r}: not a number or numbers a:b") from None


def _owner(name: str, policy) -> tuple[Any, str]:
    """The object a setting ``name`` sets and its attribute: ``(policy.cost_model,
    NAME)`` for ``cost.NAME``, else ``(policy, name)``."""
    if name.startswith("cost."):
        return policy.cost_model, name[5:]
    return policy, name


def check_setting(setting: dict[str, Any], policy) -> None:
    """``ValueError`` naming an attribute of ``setting`` that ``policy`` (an
    ``AutoPolicy``; for ``cost.NAME``, its cost model) does not have: a typo must not
    run an A/B of nothing."""
    for name in setting:
        if name == "force":
            continue
        target, attr = _owner(name, policy)
        if not hasattr(target, attr):
            raise ValueError(f"setting {name!r}: {type(target).__name__} has no {attr!r}")


def paired_summary(a: list[float], b: list[float]) -> dict[str, Any]:
    """Per wave the ratio ``b / a`` (tokens/s of the same prompts), their median, and the
    median without the first wave (None with fewer than 3 waves).

    >>> paired_summary([100.0, 100.0, 50.0], [110.0, 90.0, 60.0])["median"]
    1.1
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_summary: {len(a)} A waves and {len(b)} B waves")
    ratios = [y / x for x, y in zip(a, b)]
    later = statistics.median(ratios[1:]) if len(ratios) >= 3 else None
    return {"ratios": ratios, "median": statistics.median(ratios), "median_after_first": later}


def _apply(setting: dict[str, Any], auto, llm, base: dict[str, Any]) -> None:
    """Set ``setting`` on ``auto`` (a ``VllmAuto``) and its engine; names of the other
    setting not in this one go back to ``base`` (their values before the A/B)."""
    llm.collective_rpc("treespec_auto_force", args=(setting.get("force"),))
    for name, value in {**base, **setting}.items():
        if name != "force":
            setattr(*_owner(name, auto.auto), value)


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # auto runs in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="stdlib-v1", help="stdlib-v1 (toy) or smollm2-135m")
    ap.add_argument("--a", default="", help="setting A (default: the engine as it is)")
    ap.add_argument("--b", required=True, help="setting B")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight (slots)")
    ap.add_argument("--prompts", type=int, default=None, help="requests a wave (default: slots)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--waves", type=int, default=8, help="pairs of waves")
    ap.add_argument("--out", default=str(ROOT / "results" / "auto_ab.json"))
    args = ap.parse_args()
    a_set, b_set = parse_setting(args.a), parse_setting(args.b)

    from tqdm import tqdm

    from bench.auto_policy import tree_engine
    from bench.io import atomic_write_json, save_figure
    from bench.vllm_e2e import model_setup, start_engine, time_scenario
    from tree_dev.vllm_plugin import auto_choice
    from tree_dev.vllm_plugin.runner import tree_runner_of

    n_prompts = args.prompts or args.concurrency
    setup = model_setup(args.model, 48, 96, True)
    method, draft = ("draft_model", setup["draft"]) if "draft" in setup else ("eagle", None)
    if draft is None:
        if "eagle" not in setup:
            raise SystemExit(f"{args.model}: no draft model or EAGLE head to draft with")
        draft = setup["eagle"]
    llm, _ = start_engine(
        tree_engine(method, draft, "auto", "auto"),
        dict(setup["llm"], max_num_seqs=args.concurrency),
    )
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    auto = tree_runner_of(runner).proposer.auto
    for s in (a_set, b_set):
        check_setting(s, auto.auto)
    base = {  # what a setting's names were before: the other setting restores them
        name: getattr(*_owner(name, auto.auto)) for name in {**a_set, **b_set} if name != "force"
    }
    current: dict[str, Any] = {}
    refit = auto_choice.VllmAuto._fit

    def fit_keeping_setting(self) -> None:  # a refit makes a new cost model
        refit(self)
        for name, value in {**base, **current}.items():
            if name.startswith("cost."):
                setattr(*_owner(name, self.auto), value)

    auto_choice.VllmAuto._fit = fit_keeping_setting
    prompts = setup["prompts"]
    tok_s: dict[str, list[float]] = {"A": [], "B": []}
    choices: dict[str, list[dict]] = {"A": [], "B": []}
    for wave in tqdm(range(args.waves), desc="auto_ab waves"):
        ps = [prompts[(wave * n_prompts + i) % len(prompts)] for i in range(n_prompts)]
        order = ("A", "B") if wave % 2 == 0 else ("B", "A")
        for side in order:
            current = a_set if side == "A" else b_set
            _apply(current, auto, llm, base)
            before = dict(auto.auto.stats.as_dict()["choices"])
            n, dt, _ = time_scenario(llm, ps, args.max_tokens, args.concurrency, args.temperature)
            after = auto.auto.stats.as_dict()["choices"]
            chose = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
            tok_s[side].append(n / dt)
            choices[side].append(chose)
    summary = paired_summary(tok_s["A"], tok_s["B"])
    for w, r in enumerate(summary["ratios"]):
        print(f"wave {w}: A {tok_s['A'][w]:.1f} tok/s, B {tok_s['B'][w]:.1f} tok/s, B/A {r:.3f}")
        print(f"    A chose {choices['A'][w]}\n    B chose {choices['B'][w]}")
    later = summary["median_after_first"]
    print(
        f"B ({args.b}) / A ({args.a or 'as is'}): median {summary['median']:.3f} over "
        f"{args.waves} waves" + (f", {later:.3f} without the first" if later else "")
    )
    out = Path(args.out)
    atomic_write_json(
        out, {"args": vars(args), "tokens_per_s": tok_s, "choices": choices, **summary}
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(range(args.waves), summary["ratios"], "o-")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(summary["median"], color="C1", ls="--", label=f"median {summary['median']:.3f}")
    ax.set_xlabel("wave (the same prompts for A and B)")
    ax.set_ylabel("B / A tokens/s")
    ax.set_title(f"{args.model}, {args.concurrency} slots, T={args.temperature:g}: B = {args.b}")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
