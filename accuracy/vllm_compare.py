"""Comparing vLLM captures with Hugging Face: vLLM's layouts, the HF reference, the workflow.

vLLM captures (written by :mod:`accuracy.in_vllm`) hold one pass per scheduler step:
several requests' slots concatenated, prefill chunks and decodes mixed in one pass.
:func:`split_by_request` turns them into the designed per-request passes (a prefill,
then one decode per step), :func:`vllm_reconstruct` undoes vLLM's deferred residual add,
and :func:`capture_hf_reference` records HF (any dtype) teacher-forced on the tokens vLLM
processed, so both sides see the same inputs. :func:`hf_vs_vllm` runs the compare
design's whole workflow (``python -m accuracy hf-vs-vllm``).

Imports neither vLLM nor anything else of this project; vLLM is only started by
:func:`run_vllm`.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from .alignment import align_decode_captures, hf_reference_reconstruction, llama_reconstruct
from .capture import ModelCapture
from .compare import DynamicThresholdConfig, compare_captures_three_way, compare_captures_two_way
from .report import ReportSummary, first_divergence, print_comparison_report, print_three_way_report
from .tensor_io import CapturedForwardPass, ForwardPassMetadata, read
from .writer import CaptureWriter

_LAYER_NAME_RE = re.compile(r"(^|.*_)layers_\d+$")


def read_tp_layout(capture_dir: str) -> dict[str, dict[str, Any]]:
    """The ``tp_layout`` a vLLM capture recorded in its manifest (see
    :func:`accuracy.in_vllm.tp_layout`); ``{}`` for captures without one (one rank)."""
    from .tensor_io import read_manifest

    man = read_manifest(capture_dir) or {}
    layout = (man.get("config") or {}).get("tp_layout") or {}
    if not isinstance(layout, dict):
        raise ValueError(f"{capture_dir}: manifest config.tp_layout is not an object")
    return layout


def merge_tp_ranks(
    rank_tensors: Sequence[torch.Tensor], module_name: str, layout: dict[str, Any] | None
) -> torch.Tensor:
    """The one-rank tensor from TP ranks' captures of ``module_name`` (rank order).

    ``layout`` maps module names (dotted or with underscores) to the entries of
    :func:`accuracy.in_vllm.tp_layout`. Column-parallel ``[..., F_r]`` shards: each logical
    part (q, k, v; gate, up) concatenated over ranks in rank order, parts in order, along
    the last dim (a part replicated ``r`` times is taken from every ``r``-th rank);
    partial sums added; replicated (all-reduced) tensors taken from rank 0. One rank is
    returned as it is. ValueError when several ranks have no layout entry or their
    shards do not match it.
    """
    if not rank_tensors:
        raise ValueError(f"{module_name}: no rank tensors")
    if len(rank_tensors) == 1:
        return rank_tensors[0]
    key = module_name.replace(".", "_")
    entry = next((v for k, v in (layout or {}).items() if k.replace(".", "_") == key), None)
    if entry is None:
        raise ValueError(
            f"{module_name}: {len(rank_tensors)} TP ranks but no tp_layout entry (pass the "
            f"capture's layout: read_tp_layout(capture_dir))"
        )
    kind = entry.get("kind")
    shapes = {tuple(t.shape) for t in rank_tensors}
    if len(shapes) != 1:
        raise ValueError(f"{module_name}: TP ranks have different shapes {sorted(shapes)}")
    if kind == "replicated":
        return rank_tensors[0]
    if kind == "partial_sum":
        return torch.stack(list(rank_tensors)).sum(0)
    if kind != "column":
        raise ValueError(f"{module_name}: unknown tp_layout kind {kind!r}")
    width = rank_tensors[0].shape[-1]
    parts = entry.get("parts") or [width]
    reps = entry.get("replicas") or [1] * len(parts)
    if sum(parts) != width or len(reps) != len(parts):
        raise ValueError(
            f"{module_name}: tp_layout parts {parts} (replicas {reps}) do not match the "
            f"rank shard width {width}"
        )
    split = [t.split(list(parts), dim=-1) for t in rank_tensors]
    cols = [torch.cat([s[i] for s in split[:: int(reps[i])]], -1) for i in range(len(parts))]
    return torch.cat(cols, -1)


def vllm_reconstruct(
    rank_tensors, module_name, phase, positions, padding_mask=None, layout=None
) -> torch.Tensor:
    """vLLM tensor -> HF-equivalent: TP ranks merged, padding stripped, deferred residual
    added.

    Several TP ranks are merged by :func:`merge_tp_ranks` with ``layout`` (the capture's
    :func:`read_tp_layout`; bind it with ``functools.partial`` for the compare functions).
    A vLLM decoder layer returns ``(hidden, residual)`` and the next layer adds them; the
    capture stores the pair stacked as ``[2, T, H]``, so the HF layer output is
    ``hidden + residual`` (``[T, H]``). Everything else is ``[T, ...]`` already.
    """
    t = merge_tp_ranks(rank_tensors, module_name, layout)
    if t.dim() == 3 and t.shape[0] == 2 and _LAYER_NAME_RE.match(module_name):
        t = t[0] + t[1]
    return llama_reconstruct([t], module_name, phase, positions, padding_mask=padding_mask)


def _rows(t: torch.Tensor, name: str, lo: int, hi: int) -> torch.Tensor:
    """Slots ``lo:hi`` of a vLLM capture (dim 1 of a stacked decoder pair, else dim 0)."""
    if t.dim() == 3 and t.shape[0] == 2 and _LAYER_NAME_RE.match(name.replace(".", "_")):
        return t[:, lo:hi]
    return t[lo:hi]


def _cat(a: torch.Tensor, b: torch.Tensor, name: str) -> torch.Tensor:
    pair = a.dim() == 3 and a.shape[0] == 2 and _LAYER_NAME_RE.match(name.replace(".", "_"))
    return torch.cat([a, b], 1 if pair else 0)


def split_by_request(fwds: list[CapturedForwardPass]) -> list[CapturedForwardPass]:
    """One pass per (request, scheduler step): the designed per-request layout.

    Uses the ``slot_table`` / ``prefilling`` metadata :mod:`accuracy.in_vllm` stores.
    Consecutive prefill chunks of one request are merged into one prefill pass. A pass
    of a request is named ``prefill_s{n}_{k}`` or ``decode_b{n}_{k}`` (``n`` its slots),
    in scheduler order. Passes without that metadata (not from vLLM) are kept as they are.
    """
    out: list[CapturedForwardPass] = []
    open_prefill: dict[str, CapturedForwardPass] = {}
    seq = 0
    for fwd in fwds:
        meta = fwd.metadata
        table = meta.extra.get("slot_table")
        if table is None:
            out.append(fwd)
            continue
        prefilling = meta.extra.get("prefilling") or [fwd.is_prefill] * len(table)
        for r, (off, cnt) in enumerate(table):
            rid = meta.req_ids[r]
            rows = {
                n: {k: _rows(t, n, off, off + cnt) for k, t in ranks.items()}
                for n, ranks in fwd.tensors.items()
            }
            pos = meta.positions[off : off + cnt]
            toks = meta.token_ids[off : off + cnt] if meta.token_ids else None
            if prefilling[r] and rid in open_prefill:  # a further chunk of the same prompt
                prev = open_prefill[rid]
                for n, ranks in rows.items():
                    if n in prev.tensors:
                        prev.tensors[n] = {
                            k: _cat(prev.tensors[n][k], t, n) for k, t in ranks.items()
                        }
                prev.metadata.positions += pos
                if toks is not None and prev.metadata.token_ids is not None:
                    prev.metadata.token_ids += toks
                continue
            phase = "prefill" if prefilling[r] else "decode"
            md = ForwardPassMetadata(
                req_ids=[rid],
                positions=list(pos),
                dp_rank=meta.dp_rank,
                token_ids=list(toks) if toks is not None else None,
                tree=None,
                modules=list(meta.modules),
                seq=seq,
                extra={"source_pass": fwd.dir_name, "slots": [off, cnt]},
            )
            seq += 1
            name = f"{phase}_{'s' if phase == 'prefill' else 'b'}{cnt}_0"  # renamed below
            new = CapturedForwardPass(name, md, rows)
            out.append(new)
            if phase == "prefill":
                open_prefill[rid] = new
            else:
                open_prefill.pop(rid, None)
    final: dict[tuple[str, int], int] = {}
    for f in out:  # names from the final (merged) sizes, counters per (phase, size)
        if f.metadata.extra.get("slots") is None:
            continue
        n = len(f.metadata.positions)
        k = final.get((f.phase, n), 0)
        final[(f.phase, n)] = k + 1
        f.dir_name = f"{f.phase}_{'s' if f.is_prefill else 'b'}{n}_{k}"
    return out


# ----------------------------------------------------------------------------- HF side


def hf_module_patterns(num_layers: int) -> list[str]:
    """The default comparison set: embeddings, each layer's attention, MLP and output,
    the final norm and ``lm_head`` (names shared by HF and vLLM Llama-style models)."""
    last = num_layers - 1
    return [
        "model.embed_tokens",
        f"model.layers.0-{last}.self_attn",
        f"model.layers.0-{last}.mlp",
        f"model.layers.0-{last}",
        "model.norm",
        "lm_head",
    ]


def load_hf_model(model_dir: str, dtype: torch.dtype):
    """``AutoModelForCausalLM`` from a local directory, eval mode, SDPA attention (its
    ``self_attn`` returns no attention weights, like vLLM's)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


@torch.no_grad()
def capture_hf_reference(
    model,
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    modules: list[str],
    capture_dir: str,
    req_prefix: str = "prompt",
) -> str:
    """Capture HF teacher-forced on ``(prompt_ids, generated_ids)`` per prompt.

    One full forward over ``prompt + generated[:-1]`` (the tokens a decoding engine
    processes) per prompt; it is written as the designed passes: ``prefill_s{L}`` with
    rows ``0..L-1``, then one ``decode_b1`` per generated token except the last (row
    ``L+k-1``, the position decode step ``k`` computes). Causal attention makes each row
    what incremental decoding would compute. Tensors keep HF's ``[1, T, ...]`` layout.
    Returns ``capture_dir``.
    """
    cap = ModelCapture(model, modules, capture_dir, config={"engine": "hf"})
    writer = CaptureWriter(capture_dir, config={"engine": "hf", "modules": list(modules)})
    writer.enable()
    for i, (prompt, gen) in enumerate(sequences):
        prompt, gen = [int(t) for t in prompt], [int(t) for t in gen]
        if not prompt:
            raise ValueError(f"prompt {i}: no tokens")
        ids = prompt + gen[:-1]
        cap.setup_tensor_capture()
        model(input_ids=torch.tensor([ids]), use_cache=False)
        items = cap.registry.get_all()
        cap.save_tensor_captures(None, True)  # writer disabled: restores the registry
        names = [n for n, _ in items]
        L, rid = len(prompt), f"{req_prefix}{i}"
        writer.write(
            [t[:, :L] if t.dim() >= 2 else t for _, t in items],
            names,
            [rid],
            list(range(L)),
            True,
            token_ids=ids[:L],
        )
        for p in range(L, len(ids)):
            writer.write(
                [t[:, p : p + 1] if t.dim() >= 2 else t for _, t in items],
                names,
                [rid],
                [p],
                False,
                token_ids=[ids[p]],
            )
    cap.remove()
    return capture_dir


# ----------------------------------------------------------------------------- workflow


@dataclass
class HFvsVLLMResult:
    """Outcome of :func:`hf_vs_vllm`: both report summaries, first divergences, timings."""

    two_way: ReportSummary
    three_way: ReportSummary
    first_two_way: tuple | None
    first_three_way: tuple | None
    seconds: dict[str, float]
    tokens: list[list[int]]

    @property
    def ok(self) -> bool:
        return self.two_way.ok and self.three_way.ok


def load_prompts(path: str) -> list[str]:
    """A JSON file holding a non-empty list of prompt strings."""
    try:
        with open(path) as f:
            prompts = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--prompts {path}: cannot read a JSON list ({e})") from e
    if not isinstance(prompts, list) or not prompts:
        raise ValueError(f"--prompts {path}: expected a non-empty JSON list of strings")
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p:
            raise ValueError(f"--prompts {path}: entry {i} is not a non-empty string")
    return prompts


def run_vllm(
    model_dir: str,
    prompts: list[str] | list[list[int]],
    max_tokens: int,
    dtype: str,
    additional_config: dict[str, Any],
    enforce_eager: bool = False,
    max_model_len: int | None = None,
    tensor_parallel_size: int = 1,
    **llm_kwargs: Any,
) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy generation with an offline ``LLM`` (spawns its engine processes; call it
    under ``if __name__ == "__main__":``). Returns ``(prompt token ids, output token ids)``
    in prompt order.

    ``tensor_parallel_size > 1`` shards the model over that many worker processes; on
    vLLM's CPU backend ``VLLM_CPU_OMP_THREADS_BIND`` defaults to one core per rank
    (:func:`cpu_threads_bind`) when unset.
    """
    if tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(tensor_parallel_size)
    from vllm import LLM, SamplingParams

    if max_model_len is None:
        with open(os.path.join(model_dir, "config.json")) as f:
            max_model_len = min(int(json.load(f).get("max_position_embeddings", 2048)), 2048)
    llm = LLM(
        model=model_dir,
        dtype=dtype,
        max_model_len=max_model_len,
        enforce_eager=enforce_eager,
        additional_config=additional_config,
        tensor_parallel_size=tensor_parallel_size,
        **llm_kwargs,
    )
    inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    outs = llm.generate(inputs, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    from .in_vllm import flush_captures

    flush_captures()  # an in-process engine's background writes (no-op otherwise)
    del llm
    return [list(o.prompt_token_ids) for o in outs], [list(o.outputs[0].token_ids) for o in outs]


def cpu_threads_bind(ranks: int, cores: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``ranks`` TP ranks its own cores:
    this process's usable cores split into ``ranks`` equal contiguous groups, ranks
    separated by ``|`` (2 ranks on 2 cores: ``"0|1"``; on 8 cores ``"0-3|4-7"``).
    ValueError when there are fewer cores than ranks."""
    if cores is None:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        cores = cores or list(range(os.cpu_count() or 1))
    if ranks < 1 or len(cores) < ranks:
        raise ValueError(f"--tensor-parallel-size {ranks}: only {len(cores)} CPU cores to bind")
    per = len(cores) // ranks

    def spell(g: list[int]) -> str:
        if len(g) == 1:
            return str(g[0])
        if g[-1] - g[0] == len(g) - 1:  # contiguous
            return f"{g[0]}-{g[-1]}"
        return ",".join(str(c) for c in g)

    return "|".join(spell(cores[i * per : (i + 1) * per]) for i in range(ranks))


def compare_hf_vllm(
    hf_fp32: str,
    hf_bf16: str,
    vllm_dir: str,
    vllm_dtype: str = "float32",
    threshold: float | None = None,
    multiplier: float = 1.5,
    file: TextIO | None = None,
) -> tuple[ReportSummary, ReportSummary, tuple | None, tuple | None]:
    """Two-way (vLLM vs HF of vLLM's dtype, static threshold) and three-way (HF BF16 &
    vLLM vs HF FP32) reports of capture directories; returns both summaries and the first
    divergence of each."""
    file = file or sys.stdout
    fp32, bf16 = read(hf_fp32), read(hf_bf16)
    vl = split_by_request(read(vllm_dir))
    recon = functools.partial(vllm_reconstruct, layout=read_tp_layout(vllm_dir))
    fp32, bf16 = align_decode_captures(fp32, vl), align_decode_captures(bf16, vl)
    same = bf16 if vllm_dtype == "bfloat16" else fp32
    if threshold is None:
        threshold = 0.05 if vllm_dtype == "bfloat16" else 0.01
    label = "HF BF16" if vllm_dtype == "bfloat16" else "HF FP32"
    two = compare_captures_two_way(same, vl, hf_reference_reconstruction, recon)
    s2 = print_comparison_report(two, threshold, label, "vLLM", file=file)
    cfg = DynamicThresholdConfig(multiplier, multiplier)
    three = compare_captures_three_way(
        fp32, bf16, vl, hf_reference_reconstruction, recon, config=cfg
    )
    s3 = print_three_way_report(three, "HF BF16", "vLLM", "HF FP32", multiplier, file=file)
    f2, f3 = first_divergence(two, threshold), first_divergence(three)
    return s2, s3, f2, f3


def hf_vs_vllm(
    model_dir: str,
    prompts: list[str],
    max_tokens: int,
    out_dir: str,
    dtype: str = "float32",
    modules: list[str] | None = None,
    enforce_eager: bool = False,
    fault: dict[str, Any] | None = None,
    threshold: float | None = None,
    multiplier: float = 1.5,
    file: TextIO | None = None,
    tensor_parallel_size: int = 1,
) -> HFvsVLLMResult:
    """The compare design's workflow end to end: capture vLLM, then HF FP32 and HF BF16
    teacher-forced on vLLM's tokens, align, print the two-way and three-way reports.

    ``out_dir`` receives ``vllm/``, ``hf_fp32/``, ``hf_bf16/`` and ``tokens.json``.
    ``fault`` (``{"module": ..., "scale": ...}``) plants a bug in vLLM (self-test).
    ``tensor_parallel_size`` shards vLLM (one capture file per rank, merged with the
    capture's ``tp_layout`` before comparing); HF runs unsharded.
    """
    if tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"--model {model_dir}: no config.json")
    file = file or sys.stdout
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    modules = modules or hf_module_patterns(int(cfg["num_hidden_layers"]))
    dirs = {k: os.path.join(out_dir, k) for k in ("vllm", "hf_fp32", "hf_bf16")}
    for d in dirs.values():
        if os.path.isdir(d) and os.listdir(d):
            raise ValueError(f"--out {out_dir}: {d} is not empty (use a fresh directory)")
    treespec: dict[str, Any] = {"tensor_capture": {"modules": modules, "capture_dir": dirs["vllm"]}}
    if fault:
        treespec["fault_injection"] = fault
    secs: dict[str, float] = {}
    t0 = time.perf_counter()
    prompt_ids, gen_ids = run_vllm(
        model_dir,
        prompts,
        max_tokens,
        dtype,
        {"treespec": treespec},
        enforce_eager,
        tensor_parallel_size=tensor_parallel_size,
    )
    secs["vllm"] = time.perf_counter() - t0
    from .tensor_io import atomic_write_json

    atomic_write_json(
        os.path.join(out_dir, "tokens.json"), {"prompt_token_ids": prompt_ids, "output": gen_ids}
    )
    seqs = list(zip(prompt_ids, gen_ids, strict=True))
    for key, dt in (("hf_fp32", torch.float32), ("hf_bf16", torch.bfloat16)):
        t0 = time.perf_counter()
        capture_hf_reference(load_hf_model(model_dir, dt), seqs, modules, dirs[key])
        secs[key] = time.perf_counter() - t0
    t0 = time.perf_counter()
    s2, s3, f2, f3 = compare_hf_vllm(
        dirs["hf_fp32"], dirs["hf_bf16"], dirs["vllm"], dtype, threshold, multiplier, file
    )
    secs["compare"] = time.perf_counter() - t0
    return HFvsVLLMResult(s2, s3, f2, f3, secs, gen_ids)


# ----------------------------------------------------------------------------- trees


def vllm_tree_passes(fwds: list[CapturedForwardPass]) -> list[CapturedForwardPass]:
    """One pass per (request, tree verify forward) of vLLM captures made with the tree
    plugin: the request's node rows, ``TreeMetadata`` (parents, tokens, positions =
    prefix + depth) and, in ``extra["context"]``, the committed tokens up to and
    including the root. Passes without a tree are skipped."""
    from .tensor_io import TreeMetadata

    out: list[CapturedForwardPass] = []
    k = 0
    for fwd in fwds:
        meta = fwd.metadata
        tb = meta.extra.get("tree_batch")
        if not tb:
            continue
        table = meta.extra["slot_table"]
        ctx = meta.extra.get("tree_context") or {}
        for j, rid in enumerate(tb["req_ids"]):
            if rid not in meta.req_ids:
                continue
            r = meta.req_ids.index(rid)
            off, cnt = table[r]
            n = len(tb["parents"][j])
            if n > cnt:
                raise ValueError(
                    f"{fwd.dir_name}: request {rid} has a {n}-node tree but {cnt} slots"
                )
            pos = meta.positions[off : off + n]
            tree = TreeMetadata(parents=tb["parents"][j], tokens=tb["tokens"][j], positions=pos)
            md = ForwardPassMetadata(
                req_ids=[rid],
                positions=list(pos),
                token_ids=list(tb["tokens"][j]),
                tree=tree,
                modules=list(meta.modules),
                seq=k,
                extra={"source_pass": fwd.dir_name, "context": ctx.get(rid)},
            )
            rows = {
                name: {rk: _rows(t, name, off, off + n) for rk, t in ranks.items()}
                for name, ranks in fwd.tensors.items()
            }
            out.append(CapturedForwardPass(f"decode_b{n}_{k}", md, rows))
            k += 1
    return out


@torch.no_grad()
def capture_hf_tree_reference(
    model, tree_passes: list[CapturedForwardPass], modules: list[str], capture_dir: str
) -> str:
    """HF dense decoding of every tree node's root-to-node path, as a capture directory.

    For node ``n`` of a tree whose root sits at position ``P``: one forward over the
    committed tokens ``context[:P]`` followed by the path's tokens; its last row is
    what the tree verify forward must produce at ``n``. One ``decode_b1`` pass per node
    (``extra``: source pass and node). Raises ValueError when a pass lacks its context or
    its root token is not the context's last token.
    """
    cap = ModelCapture(model, modules, capture_dir, config={"engine": "hf"})
    writer = CaptureWriter(capture_dir, config={"engine": "hf", "tree_reference": True})
    writer.enable()
    for fwd in tree_passes:
        tree, ctx = fwd.metadata.tree, fwd.metadata.extra.get("context")
        P = fwd.metadata.positions[0]
        if not ctx or len(ctx) != P + 1 or ctx[P] != tree.tokens[0]:
            raise ValueError(
                f"{fwd.dir_name} ({fwd.metadata.extra.get('source_pass')}): the committed "
                f"context does not end with the tree root at position {P}"
            )
        for n in range(len(tree.parents)):
            path = tree.path_slots(n)
            ids = list(ctx[:P]) + [tree.tokens[s] for s in path]
            cap.setup_tensor_capture()
            model(input_ids=torch.tensor([ids]), use_cache=False)
            items = cap.registry.get_all()
            cap.save_tensor_captures(None, False)
            writer.write(
                [t[:, -1:] for _, t in items],
                [nm for nm, _ in items],
                fwd.metadata.req_ids,
                [P + tree.depths[n]],
                False,
                token_ids=[tree.tokens[n]],
                extra={"source_pass": fwd.metadata.extra.get("source_pass"), "node": n},
            )
    cap.remove()
    return capture_dir


def compare_vllm_tree(
    dense: list[CapturedForwardPass],
    tree_passes: list[CapturedForwardPass],
    layout: dict[str, Any] | None = None,
) -> list:
    """Every captured module at every tree node vs HF's dense decoding of the node's
    path (:func:`capture_hf_tree_reference`), paired by (request, source pass, node).
    ``layout``: the tree capture's :func:`read_tp_layout` (needed under TP).
    Returns :class:`accuracy.TreeNodeComparison` rows in forward (module) order."""
    from .compare import _resolve as resolve_capture
    from .compare import compare_tensors, normalize_name
    from .tree_compare import TreeNodeComparison, TreeNodePair

    index = {
        (f.metadata.req_ids[0], f.metadata.extra.get("source_pass"), f.metadata.extra["node"]): (
            i,
            f,
        )
        for i, f in enumerate(dense)
        if "node" in f.metadata.extra
    }
    rows: list[TreeNodeComparison] = []
    modules = [m for m in (tree_passes[0].module_names if tree_passes else [])]
    for m in modules:
        for tp in tree_passes:
            tree, rid = tp.metadata.tree, tp.metadata.req_ids[0]
            src = tp.metadata.extra.get("source_pass")
            got = vllm_reconstruct(
                tp.rank_tensors(m), normalize_name(m), "decode", [], None, layout
            )
            for n in range(len(tree.parents)):
                hit = index.get((rid, src, n))
                if hit is None:
                    raise ValueError(f"no dense reference for {rid} {src} node {n}")
                i, df = hit
                dn = resolve_capture(df, m)
                if dn is None:
                    raise ValueError(f"module '{m}' not captured in the dense pass {df.dir_name}")
                ref = df.rank_tensors(dn)[0].reshape(-1).float()
                pair = TreeNodePair(0, n, tree.depths[n], tp.metadata.positions[n], n, i, 0)
                name = f"{normalize_name(m)}/{src}/node{n}"
                res = compare_tensors(ref, got[n].reshape(-1).float(), name)
                rows.append(TreeNodeComparison(m, pair, res))
    return rows
