"""Where a ``tree: auto`` step's time goes inside vLLM: the plugin's choice, its n-gram
tries and the draft model's tree growth, timed around the plugin's own functions in one
in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), beside the whole run's seconds.

    python -m bench.auto_overhead                         # SmolLM2 + its EAGLE head, 8 x 64
    python -m bench.auto_overhead --concurrency 4 --max-tokens 128

Per temperature (greedy, then T=0.8): the run's seconds and engine steps, and per timed
function its calls, total milliseconds, milliseconds per call and share of the run. A
fresh engine explores (its first requests try each tree), so this profiles the cost of a
tree step, not auto's steady state. Writes ``results/auto_overhead.json``.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: (module, class, method, label): what is timed
TIMED = (
    ("tree_dev.vllm_plugin.proposing", "TreeProposer", "propose", "propose (all drafting)"),
    ("tree_dev.vllm_plugin.proposing", "TreeProposer", "_propose_model", "model trees"),
    ("tree_dev.vllm_plugin.drafter", "ModelDrafter", "forward", "draft forwards"),
    ("tree_dev.vllm_plugin.proposing", "TreeProposer", "_propose_ngram", "n-gram tries run"),
    ("tree_dev.vllm_plugin.auto_choice", "VllmAuto", "choose", "auto: choose"),
    ("tree_dev.vllm_plugin.auto_choice", "VllmAuto", "step_done", "auto: record"),
    ("tree_dev.auto.chooser", "AutoPolicy", "step_tries", "auto: tries and shadows"),
)


def _instrument(acc: dict[str, list[float]]) -> None:
    """Wrap every ``TIMED`` method to add its calls and seconds to ``acc[label]``."""
    import importlib

    for module, cls_name, name, label in TIMED:
        cls = getattr(importlib.import_module(module), cls_name)
        f = getattr(cls, name)

        @functools.wraps(f)
        def timed(*a, _f=f, _label=label, **k):
            t = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                slot = acc.setdefault(_label, [0, 0.0])
                slot[0] += 1
                slot[1] += time.perf_counter() - t

        setattr(cls, name, timed)


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the plugin runs in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from bench.auto_policy import tree_engine
    from bench.io import atomic_write_json
    from bench.vllm_e2e import model_setup, start_engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "results" / "auto_overhead.json"))
    args = ap.parse_args()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    setup = model_setup(args.model, args.concurrency, 96, None)
    if "eagle" not in setup:
        raise SystemExit(f"{args.model}: no EAGLE head to draft with")
    acc: dict[str, list[float]] = {}
    _instrument(acc)
    llm, _ = start_engine(tree_engine("eagle", setup["eagle"], "auto", "auto eagle"), setup["llm"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p in setup["prompts"][: args.concurrency]]
    runs = []
    for temp in (0.0, 0.8):
        acc.clear()
        sp = SamplingParams(temperature=temp, max_tokens=args.max_tokens, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        seconds = time.perf_counter() - t
        steps = int(acc.get("propose (all drafting)", [0])[0])
        parts = {
            label: {"calls": int(n), "ms": s * 1e3, "ms_per_call": s * 1e3 / max(n, 1)}
            for label, (n, s) in acc.items()
        }
        runs.append(
            {
                "temperature": temp,
                "seconds": seconds,
                "steps": steps,
                "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "parts": parts,
            }
        )
        print(f"T={temp}: {seconds:.2f} s, {steps} steps ({seconds / max(steps, 1) * 1e3:.1f} ms)")
        for label, p in parts.items():
            share = p["ms"] / 1e3 / seconds
            print(
                f"  {label:26s} {p['calls']:5d} calls {p['ms']:8.1f} ms "
                f"({p['ms_per_call']:6.2f} ms/call, {share:5.1%} of the run)"
            )
    atomic_write_json(Path(args.out), {"args": vars(args), "runs": runs})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
