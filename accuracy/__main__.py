"""Command line: ``python -m accuracy compare REF TEST [--baseline DIR]``,
``python -m accuracy tree DENSE TREE``, ``python -m accuracy inspect DIR`` and
``python -m accuracy hf-vs-vllm --model DIR --prompts FILE.json --max-tokens N --out DIR``.

``compare`` prints the designed two-way report (REF vs TEST) or, with
``--baseline``, the three-way report (REF = expected, e.g. HF BF16; TEST = actual;
DIR = FP32 baseline). Exit status: 0 all pass, 1 failures/mismatches, 2 bad input.
"""

from __future__ import annotations

import argparse
import sys

from .alignment import (
    align_decode_captures,
    default_reconstruction,
    hf_reference_reconstruction,
    llama_reconstruct,
)
from .compare import DynamicThresholdConfig, compare_captures_three_way, compare_captures_two_way
from .report import first_divergence, print_comparison_report, print_three_way_report
from .tensor_io import read

RECONSTRUCTIONS = {
    "rank0": default_reconstruction,
    "hf": hf_reference_reconstruction,
    "llama": llama_reconstruct,
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m accuracy", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare", help="compare two capture directories (three with --baseline)")
    c.add_argument(
        "ref", help="reference capture dir (two-way) / expected, e.g. HF BF16 (three-way)"
    )
    c.add_argument("test", help="capture dir under test")
    c.add_argument("--baseline", help="FP32 baseline capture dir: three-way comparison")
    c.add_argument("--threshold", type=float, default=0.01, help="two-way L-inf threshold")
    c.add_argument("--multiplier", type=float, default=1.5, help="three-way ratio threshold")
    c.add_argument("--phase", choices=["prefill", "decode"], default=None)
    c.add_argument("--ref-reconstruction", choices=sorted(RECONSTRUCTIONS), default="rank0")
    c.add_argument("--test-reconstruction", choices=sorted(RECONSTRUCTIONS), default="rank0")
    c.add_argument("--no-align", action="store_true", help="skip align_decode_captures")
    c.add_argument("--label-ref", default=None)
    c.add_argument("--label-test", default="Test")
    c.add_argument("--plot", default=None, help="write a PNG of errors per module and step")
    c.add_argument("--color", action=argparse.BooleanOptionalAction, default=None)
    t = sub.add_parser("tree", help="compare tree verification passes with dense decoding")
    t.add_argument("dense", help="capture dir of dense autoregressive decoding (token_ids saved)")
    t.add_argument("tree", help="capture dir holding passes saved with tree metadata")
    t.add_argument("--accepted", default=None, help="accepted node ids, e.g. 0,1,3")
    t.add_argument("--threshold", type=float, default=0.01)
    t.add_argument("--plot", default=None, help="write a PNG of error per tree depth")
    t.add_argument(
        "--hf-model",
        default=None,
        help="vLLM tree captures: first capture HF dense decoding of every node's "
        "root-to-node path from this checkpoint into DENSE",
    )
    h = sub.add_parser(
        "hf-vs-vllm",
        help="capture vLLM, HF FP32 and HF BF16 on the same tokens; two- and three-way reports",
    )
    h.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    h.add_argument("--prompts", required=True, help="JSON file: a list of prompt strings")
    h.add_argument("--max-tokens", type=int, required=True, help="greedy tokens per prompt")
    h.add_argument("--out", required=True, help="output dir (vllm/, hf_fp32/, hf_bf16/)")
    h.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    h.add_argument("--modules", nargs="+", default=None, help="capture patterns (default: all)")
    h.add_argument("--eager", action="store_true", help="enforce_eager (skip torch.compile)")
    h.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="vLLM tensor-parallel ranks (captures merged per rank; on CPU "
        "VLLM_CPU_OMP_THREADS_BIND defaults to one core group per rank)",
    )
    h.add_argument("--threshold", type=float, default=None, help="two-way L-inf threshold")
    h.add_argument("--multiplier", type=float, default=1.5, help="three-way ratio threshold")
    h.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of this process (HF capture, compare); 1 is fastest on the "
        "tiny models, many small ops",
    )
    h.add_argument(
        "--plant-bug",
        default=None,
        metavar="MODULE=SCALE",
        help="self-test: scale one vLLM module's output (e.g. model.layers.2.mlp=1.5)",
    )
    i = sub.add_parser("inspect", help="list steps, modules, shapes and dtypes of a capture dir")
    i.add_argument("dir")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "inspect":
            from .inspect_captures import inspect_dir

            inspect_dir(args.dir)
            return 0
        if args.cmd == "tree":
            return _tree(args)
        if args.cmd == "hf-vs-vllm":
            return _hf_vs_vllm(args)
        ref, test = read(args.ref), read(args.test)
        rfn = RECONSTRUCTIONS[args.ref_reconstruction]
        tfn = RECONSTRUCTIONS[args.test_reconstruction]
        if args.baseline:
            base = read(args.baseline)
            if not args.no_align:
                base, ref = align_decode_captures(base, test), align_decode_captures(ref, test)
            cfg = DynamicThresholdConfig(args.multiplier, args.multiplier)
            results = compare_captures_three_way(
                base, ref, test, rfn, tfn, phase=args.phase, config=cfg
            )
            summary = print_three_way_report(
                results,
                args.label_ref or "Ref",
                args.label_test,
                "Baseline",
                args.multiplier,
                colorize=args.color,
            )
            threshold = args.multiplier
        else:
            if not args.no_align:
                ref = align_decode_captures(ref, test)
            results = compare_captures_two_way(ref, test, rfn, tfn, phase=args.phase)
            summary = print_comparison_report(
                results,
                args.threshold,
                args.label_ref or "Ref",
                args.label_test,
                colorize=args.color,
            )
            threshold = args.threshold
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    first = first_divergence(results, threshold)
    if first:
        print(f"FIRST DIVERGENCE: {first[0]} step {first[1]} {first[2]}")
    if args.plot:
        from .plots import plot_errors

        print(f"plot: {plot_errors(results, args.plot, threshold)}")
    return 0 if summary.ok else 1


def _tree(args) -> int:
    from .plots import plot_tree_errors
    from .tree_compare import compare_tree_with_dense, errors_by_depth, print_tree_report

    tree_fwds = read(args.tree)
    if any("tree_batch" in f.metadata.extra for f in tree_fwds):
        return _tree_vllm(args, tree_fwds)
    dense = read(args.dense)
    passes = [f for f in tree_fwds if f.metadata.tree is not None]
    if not passes:
        raise ValueError(f"{args.tree}: no pass carries tree metadata")
    accepted = [int(x) for x in args.accepted.split(",")] if args.accepted else None
    rows = []
    for fwd in passes:
        rows += compare_tree_with_dense(fwd, dense, accepted_nodes=accepted)
    bad = print_tree_report(rows, args.threshold)
    if args.plot:
        print(f"plot: {plot_tree_errors(errors_by_depth(rows), args.plot)}")
    return 1 if bad else 0


def _tree_vllm(args, tree_fwds) -> int:
    """Tree verify passes of a vLLM capture vs HF dense decoding of each node's path."""
    import torch

    from .compare import normalize_name
    from .plots import plot_tree_errors
    from .tree_compare import errors_by_depth, print_tree_report
    from .vllm_compare import (
        capture_hf_tree_reference,
        compare_vllm_tree,
        load_hf_model,
        read_tp_layout,
        vllm_tree_passes,
    )

    passes = vllm_tree_passes(tree_fwds)
    if not passes:
        raise ValueError(f"{args.tree}: no tree verify pass")
    if args.hf_model:
        model = load_hf_model(args.hf_model, torch.float32)
        capture_hf_tree_reference(model, passes, passes[0].module_names, args.dense)
    rows = compare_vllm_tree(read(args.dense), passes, read_tp_layout(args.tree))
    bad = print_tree_report(rows, args.threshold, "HF dense", "vLLM tree")
    first = next((r for r in rows if r.result.deviates(args.threshold)), None)
    if first is not None:
        print(f"FIRST DIVERGENT LAYER: {normalize_name(first.module)} ({first.result.name})")
    if args.plot:
        print(f"plot: {plot_tree_errors(errors_by_depth(rows), args.plot)}")
    return 1 if bad else 0


def _hf_vs_vllm(args) -> int:
    import torch

    from .vllm_compare import hf_vs_vllm, load_prompts

    prompts = load_prompts(args.prompts)
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    fault = None
    if args.plant_bug:
        mod, _, scale = args.plant_bug.partition("=")
        try:
            fault = {"module": mod, "scale": float(scale or 2.0)}
        except ValueError as e:
            raise ValueError(f"--plant-bug {args.plant_bug!r}: expected MODULE=SCALE") from e
    res = hf_vs_vllm(
        args.model,
        prompts,
        args.max_tokens,
        args.out,
        dtype=args.dtype,
        modules=args.modules,
        enforce_eager=args.eager,
        fault=fault,
        threshold=args.threshold,
        multiplier=args.multiplier,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    for label, first in (("two-way", res.first_two_way), ("three-way", res.first_three_way)):
        if first:
            print(f"FIRST DIVERGENCE ({label}): {first[0]} step {first[1]} {first[2]}")
    times = ", ".join(f"{k} {v:.1f}s" for k, v in res.seconds.items())
    print(f"hf-vs-vllm: {'PASSED' if res.ok else 'FAILED'} ({times})")
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
