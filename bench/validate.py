"""Validate the engine's tree verification against dense decoding, layer by layer.

    python -m bench.validate [--dtype fp32|bf16] [--tree SPEC] [--prompts N] [--steps S]
                             [--out DIR] [--random] [--threshold X] [--full]

The engine (``tree_dev.engine.Engine``) decodes a few prompts; in every verify step
its target runs one packed forward over all tree nodes through the ``"treespec"``
attention (paged KV, ``kernels.tree_attention``). ``accuracy.ModelCapture`` records
that forward's per-layer outputs (every ``model.layers.i.self_attn``, every decoder
layer ``model.layers.i``, ``model.norm``, ``lm_head``) with the tree's metadata
(parents, depths, positions ``prefix + depth``, tokens). The same weights, as a
plain Hugging Face model with its normal (sdpa/eager) attention, then decode every
root-to-node path of the tree one token per step from a ``DynamicCache`` of the
committed text: one dense step per tree node, captured the same way. The accuracy
tooling pairs each tree node with the dense step of the same root-to-node path
(``pair_tree_nodes_with_dense_steps``, along every root-to-leaf path, which checks
the tokens) and compares them per layer:

- ``--dtype fp32``: two-way (``compare_tree_with_dense``), relative L-inf per node
  against ``--threshold``; and the engine's greedy output along the accepted path
  must equal the dense model's argmax.
- ``--dtype bf16``: three-way: engine bf16 and dense HF bf16 against dense HF fp32
  along the same tree (``compare_tensors_three_way`` on each step's paired nodes,
  pooled per module by ``compute_aggregate_metrics``: error ratios < 1.5, BC >= 0.99).

Prints the designed reports and a verdict naming the first divergent layer; exits
1 on failure. Writes ``report.json``, ``errors.png`` (error per layer and per tree
depth) and the captures under ``--out`` (default ``results/validate/<dtype>``).
Models: the trained set ``tree_dev.models.load()`` when present, else (or with
``--random``) a tiny random Llama target and a perturbed copy as draft.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import DynamicCache

from accuracy import (
    ComparisonResult,
    DynamicThresholdConfig,
    ModelCapture,
    ThreeWayComparisonResult,
    TreeMetadata,
    TreeNodeComparison,
    TreeNodePair,
    compare_tensors_three_way,
    compare_tree_with_dense,
    compute_aggregate_metrics,
    errors_by_depth,
    pair_tree_nodes_with_dense_steps,
    print_comparison_report,
    print_three_way_report,
    print_tree_report,
    tensor_io,
)
from accuracy.compare import normalize_name
from accuracy.plots import save_figure
from tree_dev.engine import Engine, RequestStep, SamplingParams, StepEvent
from tree_dev.hf_compat import cache_kwargs
from tree_dev.testing import perturbed, tiny_llama

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_TREE = "topk:k=4,depth=5,budget=32"
# fp32 tree attention vs sdpa differ only in summation order (~1e-6 relative per layer);
# a node that sees a wrong token is off by O(1e-1). 1e-4 leaves room for 6+ layers.
FP32_THRESHOLD = 1e-4
PROMPT_TEXTS = [
    "import os\nimport sys\n\n\ndef main(argv=None):\n    ",
    'class Config:\n    """Settings of the application."""\n\n    def __init__(self, ',
    "    for i, line in enumerate(lines):\n        if ",
    "def read_file(path, encoding='utf-8'):\n    with open(path",
    "        except (OSError, ValueError) as exc:\n            raise ",
    "    @property\n    def name(self):\n        return self.",
    "if __name__ == '__main__':\n    ",
    "    result = []\n    for key, value in sorted(items.items()):\n",
]


# --------------------------------------------------------------------------- models
def tiny_random_pair(seed: int = 0, layers: int = 2, hidden: int = 64, vocab: int = 64):
    """A tiny random Llama target and a correlated draft (its copy with 30% weight noise)."""
    target = tiny_llama(seed, vocab=vocab, hidden=hidden, layers=layers, max_positions=1024)
    return target, perturbed(target, 0.3, seed + 1)


def load_models(random: bool = False, path: str | os.PathLike | None = None):
    """``(target, draft, tokenizer or None, description)``: the trained set (``path``,
    default ``checkpoints/stdlib-v1``), else a tiny random pair."""
    if not random:
        from tree_dev.engine import load_causal_lm
        from tree_dev.models import DEFAULT_CHECKPOINT, load
        from tree_dev.models.data import load_tokenizer

        try:
            ms = load(path)
            return ms.target, ms.draft, ms.tokenizer, f"trained model set {ms.path}"
        except (FileNotFoundError, OSError) as e:
            # the validation needs no EAGLE head: target + draft LMs are enough
            p = Path(path) if path is not None else DEFAULT_CHECKPOINT
            try:
                lms = [load_causal_lm(p / sub) for sub in ("target", "draft")]
                tok = load_tokenizer(p / "tokenizer")
                return *lms, tok, f"trained target + draft LMs of {p}"
            except (ValueError, FileNotFoundError, OSError):
                pass
            print(
                f"NOTE: trained model set not available ({e}); "
                "falling back to a tiny random Llama pair",
                file=sys.stderr,
            )
    target, draft = tiny_random_pair()
    return target, draft, None, "tiny random Llama pair (2 layers, hidden 64, vocab 64)"


def make_prompts(n: int, tokenizer=None, vocab: int = 64, seed: int = 0) -> list[list[int]]:
    """``n`` prompts: Python snippets through ``tokenizer``, else random token ids."""
    if tokenizer is not None:
        texts = [PROMPT_TEXTS[i % len(PROMPT_TEXTS)] for i in range(n)]
        return [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in lengths]


def capture_modules(num_layers: int) -> list[str]:
    """Captured modules in forward order: per layer its attention, then the layer."""
    out = []
    for i in range(num_layers):
        out += [f"model.layers.{i}.self_attn", f"model.layers.{i}"]
    return out + ["model.norm", "lm_head"]


# --------------------------------------------------------------------------- engine side
class _StepTracer:
    """Keeps the last verify step's trees, prefix lengths and accepted paths, as the
    engine reports them (``Engine.on_step``)."""

    def __init__(self, engine: Engine):
        self.last: list[RequestStep] = []
        engine.on_step(self._record)

    def _record(self, event: StepEvent) -> None:
        self.last = event.requests


def tree_positions(rec: RequestStep) -> list[int]:
    depth = []
    for p in rec.parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return [rec.prefix_len + d for d in depth]


def run_engine(
    engine: Engine, prompts: list[list[int]], steps: int, cap: ModelCapture
) -> list[list[RequestStep]]:
    """Run ``steps`` engine steps over ``prompts``; save every verify forward's captures
    (one tree pass per step, all requests' trees packed, with ``TreeMetadata``)."""
    tracer = _StepTracer(engine)
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    out = []
    for s in tqdm(range(steps), desc="engine steps", leave=False):
        if not engine.has_work():
            break
        engine.step()
        recs = tracer.last
        parents = [p for r in recs for p in r.parents]
        cu = [0]
        for r in recs:
            cu.append(cu[-1] + len(r.parents))
        positions = [q for r in recs for q in tree_positions(r)]
        tokens = [t for r in recs for t in r.tokens]
        tree = TreeMetadata(parents=parents, cu_nodes=cu, positions=positions, tokens=tokens)
        cap.save_tensor_captures(
            positions,
            is_prefill=False,
            req_ids=[f"req{r.req_id}" for r in recs],
            tree=tree,
            padding_mask=[False] * len(positions),
            token_ids=tokens,
            extra={"step": s, "accepted": [r.accepted for r in recs]},
        )
        out.append(recs)
    return out


# --------------------------------------------------------------------------- dense side
@torch.inference_mode()
def dense_tree_decode(model, cap: ModelCapture, rec: RequestStep, step: int, index: int) -> None:
    """Dense autoregressive decoding of every root-to-node path of ``rec``'s tree.

    Prefills the committed tokens before the root into a ``DynamicCache``, then
    visits the nodes depth first: cache cropped to the node's ancestors, one
    forward of the node's token at position ``prefix + depth``, captured as one
    decode pass (``extra``: step, request index, node).
    """
    dev = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    plen = rec.prefix_len
    if plen:
        ids = torch.tensor([rec.context[:plen]], device=dev)
        model(input_ids=ids, use_cache=True, **cache_kwargs(cache))
    positions = tree_positions(rec)
    kids: dict[int, list[int]] = {}
    for c, p in enumerate(rec.parents):
        kids.setdefault(p, []).append(c)
    stack = [0]
    while stack:
        n = stack.pop()
        pos = positions[n]
        extra = cache.get_seq_length() - pos
        if extra > 0:
            cache.crop(-extra)
        model(
            input_ids=torch.tensor([[rec.tokens[n]]], device=dev),
            position_ids=torch.tensor([[pos]], device=dev),
            use_cache=True,
            **cache_kwargs(cache),
        )
        cap.save_tensor_captures(
            [pos],
            is_prefill=False,
            req_ids=[f"step{step}-req{rec.req_id}"],
            token_ids=[rec.tokens[n]],
            extra={"step": step, "request": index, "node": n},
        )
        stack.extend(reversed(kids.get(n, [])))


def dense_model(target, dtype: torch.dtype, device: str | torch.device = "cpu"):
    """A copy of ``target`` in ``dtype`` on ``device`` with Hugging Face's own attention."""
    m = copy.deepcopy(target).to(device, dtype).eval()
    if m.config._attn_implementation not in ("sdpa", "eager"):
        m.set_attn_implementation("sdpa")
    return m


def _new_capture(model, modules: list[str], path: Path, clear_on) -> ModelCapture:
    cap = ModelCapture(model, modules, str(path))
    cap.register_clear_hook(clear_on)
    cap.enable()
    return cap


def _dense_index(passes) -> dict[tuple[int, int], dict[int, Any]]:
    """``{(step, request): {node: pass}}`` of dense captures."""
    out: dict[tuple[int, int], dict[int, Any]] = {}
    for f in passes:
        e = f.metadata.extra
        out.setdefault((e["step"], e["request"]), {})[e["node"]] = f
    return out


def pair_nodes(tree_pass, dense: dict[int, list], recs: list[RequestStep]) -> list[TreeNodePair]:
    """Pair every tree node with its dense step, one root-to-leaf path at a time
    (``pair_tree_nodes_with_dense_steps`` checks each path's tokens and positions).
    ``dense[r][n]`` is request ``r``'s dense pass of node ``n``."""
    pairs: dict[tuple[int, int], TreeNodePair] = {}
    for r, rec in enumerate(recs):
        has_kid = {p for p in rec.parents if p >= 0}
        for leaf in (n for n in range(len(rec.parents)) if n not in has_kid):
            path = [leaf]
            while rec.parents[path[-1]] >= 0:
                path.append(rec.parents[path[-1]])
            path.reverse()
            found = pair_tree_nodes_with_dense_steps(
                tree_pass, {r: [dense[r][a] for a in path]}, accepted_nodes={r: path}
            )
            for pr in found:
                pairs.setdefault((r, pr.node), replace(pr, dense_index=path[pr.dense_index]))
    missing = [(r, n) for r, rec in enumerate(recs) for n in range(len(rec.parents))]
    missing = [k for k in missing if k not in pairs]
    if missing:
        raise ValueError(f"tree nodes without a dense step (request, node): {missing[:5]}")
    return [pairs[k] for k in sorted(pairs)]


def _rows_of(fwd, module: str) -> torch.Tensor:
    name = module if module in fwd.tensors else f"{module}.0"
    if name not in fwd.tensors:
        raise ValueError(f"module '{module}' not captured in {fwd.dir_name}")
    t = fwd.rank_tensors(name)[0]
    return t[0] if t.dim() >= 3 and t.shape[0] == 1 else t


# --------------------------------------------------------------------------- result
@dataclass
class Divergence:
    """The first failing module in forward order, and where it first fails."""

    module: str
    step: int
    request: int
    node: int
    depth: int
    error: float
    metric: str = "relative L-inf"

    def __str__(self) -> str:
        return (
            f"{self.module} (step {self.step}, request {self.request}, node {self.node}, "
            f"depth {self.depth}; {self.metric} {self.error:.3g})"
        )


@dataclass
class ValidationResult:
    """Outcome of :func:`validate`. ``rows`` are two-way node rows per step (fp32, or
    the bf16 engine vs dense bf16 for information); ``three_way`` the per-step
    three-way results and ``aggregate`` their pooled per-module verdicts (bf16)."""

    passed: bool
    mode: str
    modules: list[str]
    threshold: float
    first_divergence: Divergence | None
    steps: list[list[RequestStep]]
    rows: dict[int, list[TreeNodeComparison]]
    greedy_mismatches: list[dict]
    three_way: dict[str, dict[int, list[ThreeWayComparisonResult]]] | None = None
    aggregate: dict[str, Any] | None = None
    nodes_compared: int = 0
    bc_bins: int | None = None

    def per_module(self) -> dict[str, float]:
        """Max two-way relative L-inf per module over all nodes and steps."""
        out = {m: 0.0 for m in self.modules}
        for rows in self.rows.values():
            for row in rows:
                v = row.result.linf_rel
                out[row.module] = max(out[row.module], v) if v == v else math.nan
        return out

    def step_rows_over(self, multiplier: float = 1.5) -> int:
        """Three-way per-(request, step) rows whose L-inf or L2 ratio is >= ``multiplier``."""
        rows = [r for st in (self.three_way or {}).values() for rs in st.values() for r in rs]
        return sum(1 for r in rows if not (r.linf_ratio < multiplier and r.l2_ratio < multiplier))

    def per_depth(self) -> dict[str, dict[int, float]]:
        return errors_by_depth([row for rows in self.rows.values() for row in rows])


def _first_two_way(rows_by_step, modules, threshold) -> Divergence | None:
    for m in modules:
        for s in sorted(rows_by_step):
            for row in rows_by_step[s]:
                if row.module == m and row.result.deviates(threshold):
                    p = row.pair
                    return Divergence(m, s, p.request, p.node, p.depth, row.result.linf_rel)
    return None


# --------------------------------------------------------------------------- validate
_ThreeWay = dict[str, dict[int, list[ThreeWayComparisonResult]]]  # prompt -> step -> modules


def _engine_pass(
    target,
    draft,
    prompts: list[list[int]],
    steps: int,
    modules: list[str],
    cap_root: Path,
    *,
    tree: str,
    tdtype: torch.dtype,
    kernel_backend: str,
    device: str | torch.device,
) -> list[list[RequestStep]]:
    """Run the engine on copies of the models in ``tdtype`` for ``steps`` verify steps,
    capturing every verify forward under ``cap_root/engine``."""
    # engine: copies in the engine dtype (the engine switches its target to "treespec")
    eng_target = copy.deepcopy(target).to(device, tdtype).eval()
    eng_draft = copy.deepcopy(draft).to(device, tdtype).eval() if draft is not None else None
    engine = Engine(
        eng_target,
        eng_draft,
        tree=tree if eng_draft is not None else "none",
        max_batch=len(prompts),
        kernel_backend=kernel_backend,
        tree_kernel=True,  # the verify forward under test is the tree-attention kernel's
    )
    eng_cap = _new_capture(eng_target, modules, cap_root / "engine", eng_target.model)
    records = run_engine(engine, prompts, steps, eng_cap)
    eng_cap.remove()
    return records


def _dense_passes(
    target,
    records: list[list[RequestStep]],
    dense_dtypes: list[str],
    modules: list[str],
    cap_root: Path,
    device: str | torch.device,
) -> dict[str, dict[tuple[int, int], dict[int, Any]]]:
    """Dense references along every root-to-node path of every verified tree, per dtype:
    ``{dtype: {(step, request): {node: pass}}}``, captured under ``cap_root/dense_<dtype>``."""
    dense_passes = {}
    for dd in dense_dtypes:
        model = dense_model(target, DTYPES[dd], device)
        cap = _new_capture(model, modules, cap_root / f"dense_{dd}", model)
        work = [(s, r, rec) for s, recs in enumerate(records) for r, rec in enumerate(recs)]
        for s, r, rec in tqdm(work, desc=f"dense {dd}", leave=False):
            dense_tree_decode(model, cap, rec, s, r)
        cap.remove()
        dense_passes[dd] = _dense_index(tensor_io.read(str(cap_root / f"dense_{dd}")))
    return dense_passes


def _greedy_mismatches(
    step: int, recs: list[RequestStep], dense_lists: dict[int, list]
) -> list[dict]:
    """Tokens the engine emitted in ``step`` that differ from the dense argmax along the
    accepted path."""
    bad = []
    for r, rec in enumerate(recs):
        for i, node in enumerate(rec.accepted):
            if i >= len(rec.emitted):
                break
            want = int(_rows_of(dense_lists[r][node], "lm_head")[0].argmax())
            if want != rec.emitted[i]:
                bad.append(dict(step=step, request=r, node=node, engine=rec.emitted[i], dense=want))
    return bad


def _compare_two_way(
    records: list[list[RequestStep]],
    tree_passes: dict[int, Any],
    dense_ref: dict[tuple[int, int], dict[int, Any]],
    modules: list[str],
) -> tuple[dict[int, list[TreeNodeComparison]], dict[int, list[TreeNodePair]], list[dict], int]:
    """Pair every tree node with its dense step and compare them per module, and check the
    greedy tokens: ``(rows per step, pairs per step, greedy mismatches, nodes compared)``."""
    rows: dict[int, list[TreeNodeComparison]] = {}
    pairs_by_step: dict[int, list[TreeNodePair]] = {}
    greedy_bad: list[dict] = []
    nodes = 0
    for s, recs in enumerate(records):
        dense = {r: dense_ref[(s, r)] for r in range(len(recs))}
        dense_lists = {r: [d[n] for n in range(len(d))] for r, d in dense.items()}
        pairs = pair_nodes(tree_passes[s], dense_lists, recs)
        pairs_by_step[s] = pairs
        nodes += len(pairs)
        rows[s] = compare_tree_with_dense(tree_passes[s], dense_lists, pairs, module_order=modules)
        # engine greedy == dense argmax along the accepted path
        greedy_bad += _greedy_mismatches(s, recs, dense_lists)
    return rows, pairs_by_step, greedy_bad, nodes


def _three_way_request(
    tree_pass,
    base_f: dict[int, Any],
    exp_f: dict[int, Any],
    prs: list[TreeNodePair],
    modules: list[str],
    config: DynamicThresholdConfig,
) -> list[ThreeWayComparisonResult]:
    """Three-way results per module of one request's nodes in one step."""
    res = []
    for m in modules:
        tree_rows = _rows_of(tree_pass, m)
        b = torch.stack([_rows_of(base_f[p.node], m)[0] for p in prs])
        e = torch.stack([_rows_of(exp_f[p.node], m)[0] for p in prs])
        a = torch.stack([tree_rows[p.tree_slot] for p in prs])
        res.append(compare_tensors_three_way(b, e, a, normalize_name(m), config))
    return res


def _three_way(
    records: list[list[RequestStep]],
    pairs_by_step: dict[int, list[TreeNodePair]],
    tree_passes: dict[int, Any],
    dense_passes: dict[str, dict[tuple[int, int], dict[int, Any]]],
    modules: list[str],
    config: DynamicThresholdConfig,
) -> _ThreeWay:
    """Three-way results of every (request, step): baseline dense fp32, expected dense
    bf16, actual engine bf16."""
    three: _ThreeWay = {}
    for s, recs in enumerate(records):
        for r, rec in enumerate(recs):
            prs = [p for p in pairs_by_step[s] if p.request == r]
            three.setdefault(f"prompt_{rec.req_id}", {})[s] = _three_way_request(
                tree_passes[s],
                dense_passes["fp32"][(s, r)],
                dense_passes["bf16"][(s, r)],
                prs,
                modules,
                config,
            )
    return three


def _three_way_verdict(
    result: ValidationResult,
    pairs_by_step: dict[int, list[TreeNodePair]],
    tree_passes: dict[int, Any],
    dense_passes: dict[str, dict[tuple[int, int], dict[int, Any]]],
    config: DynamicThresholdConfig | None,
) -> None:
    """Fill in ``result``'s three-way results, pooled aggregate and verdict (bf16)."""
    modules, records = result.modules, result.steps
    if config is None:
        width = min(_rows_of(tree_passes[0], m).shape[-1] for m in modules)
        config = DynamicThresholdConfig(bc_bins=bc_bins_for(result.nodes_compared * width))
    three = _three_way(records, pairs_by_step, tree_passes, dense_passes, modules, config)
    agg = compute_aggregate_metrics(three, config)
    result.three_way, result.aggregate, result.bc_bins = three, agg, config.bc_bins
    for m in modules:
        a = agg.get(normalize_name(m))
        if a is not None and not a.passed:
            where = _first_three_way(three, m, records, result.rows)
            result.first_divergence = Divergence(m, *where, a.linf_ratio, "pooled L-inf ratio")
            break
    result.passed = result.first_divergence is None


def validate(
    target,
    draft,
    prompts: list[list[int]],
    tree: str = DEFAULT_TREE,
    dtype: str = "fp32",
    steps: int = 3,
    out_dir: str | os.PathLike = "results/validate",
    threshold: float = FP32_THRESHOLD,
    kernel_backend: str = "auto",
    config: DynamicThresholdConfig | None = None,
    device: str | torch.device = "cpu",
) -> ValidationResult:
    """Run the engine on ``prompts`` for ``steps`` verify steps and validate each
    tree verification forward against dense decoding of the same model.

    Args:
        target, draft: ``transformers`` causal LMs (fp32 weights; not modified: the
            engine and the dense references get copies).
        prompts: token ids per request (decoded together, ragged trees).
        tree: engine tree spec (``chain:4``, ``paths:[...]``, ``topk:k=,depth=,budget=``).
        dtype: ``"fp32"`` (two-way, ``threshold`` on relative L-inf per node) or
            ``"bf16"`` (three-way against the fp32 dense baseline, ``config``).
        out_dir: captures go to ``out_dir/captures/{engine,dense_fp32,dense_bf16}``.
        device: where the engine and the dense references run (``"cuda"``: the engine's
            ``"auto"`` kernels are Triton).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if steps < 1 or not prompts:
        raise ValueError(f"need steps >= 1 and at least one prompt, got {steps}, {len(prompts)}")
    modules = capture_modules(target.config.num_hidden_layers)
    cap_root = Path(out_dir) / "captures"
    for sub in ("engine", "dense_fp32", "dense_bf16"):  # no stale passes of an earlier run
        shutil.rmtree(cap_root / sub, ignore_errors=True)
    records = _engine_pass(
        target,
        draft,
        prompts,
        steps,
        modules,
        cap_root,
        tree=tree,
        tdtype=DTYPES[dtype],
        kernel_backend=kernel_backend,
        device=device,
    )
    dense_dtypes = ["fp32"] if dtype == "fp32" else ["fp32", "bf16"]
    dense_passes = _dense_passes(target, records, dense_dtypes, modules, cap_root, device)
    tree_passes = {f.metadata.extra["step"]: f for f in tensor_io.read(str(cap_root / "engine"))}
    ref = "fp32" if dtype == "fp32" else "bf16"
    rows, pairs_by_step, greedy_bad, nodes = _compare_two_way(
        records, tree_passes, dense_passes[ref], modules
    )
    result = ValidationResult(
        passed=False,
        mode="two-way" if dtype == "fp32" else "three-way",
        modules=modules,
        threshold=threshold,
        first_divergence=None,
        steps=records,
        rows=rows,
        greedy_mismatches=greedy_bad,
        nodes_compared=nodes,
    )
    if dtype == "fp32":
        result.first_divergence = _first_two_way(rows, modules, threshold)
        result.passed = result.first_divergence is None and not greedy_bad
        return result
    _three_way_verdict(result, pairs_by_step, tree_passes, dense_passes, config)
    return result


def bc_bins_for(samples: int) -> int:
    """Histogram bins for the pooled Bhattacharyya coefficient of ``samples`` errors per side.

    Two histograms of ``n`` samples each from the same distribution with ``B`` bins
    have ``E[1 - BC] ~ (B - 1) / (4 n)``; ``B = 1 + 0.008 n`` keeps that finite-sample
    bias at 0.002, a fifth of the 0.99 threshold's margin. Clamped to [10, 100]
    (100: the designed default, reached from ~12k samples).
    """
    return int(min(100, max(10, 1 + 0.008 * samples)))


def _first_three_way(three, module, records, rows) -> tuple[int, int, int, int]:
    """(step, request, node, depth) where ``module`` first fails three-way: the first
    (step, request) whose row fails (else the first one), and in it the node farthest
    from the dense bf16 reference (from the two-way ``rows``)."""
    name, where = normalize_name(module), None
    for s, recs in enumerate(records):
        for r, rec in enumerate(recs):
            row = next(x for x in three[f"prompt_{rec.req_id}"][s] if x.name == name)
            if where is None or not row.passed:
                where = (s, r)
            if not row.passed:
                break
        else:
            continue
        break
    s, r = where
    mine = [x for x in rows[s] if x.module == module and x.pair.request == r]
    worst = max(mine, key=lambda x: _nan_big(x.result.linf_rel))
    return s, r, worst.pair.node, worst.pair.depth


# --------------------------------------------------------------------------- report
def _worst_rows(res: ValidationResult) -> dict[str, dict[int, list[ComparisonResult]]]:
    """``{prompt_<req>: {step: [worst node row per module]}}`` for the designed report."""
    out: dict[str, dict[int, list[ComparisonResult]]] = {}
    for s, rows in res.rows.items():
        for r, rec in enumerate(res.steps[s]):
            worst = []
            for m in res.modules:
                mine = [x for x in rows if x.module == m and x.pair.request == r]
                if mine:
                    worst.append(max(mine, key=lambda x: _nan_big(x.result.linf_rel)).result)
            out.setdefault(f"prompt_{rec.req_id}", {})[s] = worst
    return out


def _nan_big(v: float) -> float:
    return math.inf if v != v else v


def print_report(res: ValidationResult, full: bool = False, file=None) -> None:
    """The designed two-way / three-way reports, the depth table and the verdict."""
    file = file or sys.stdout
    print(
        f"{res.nodes_compared} tree nodes compared over {len(res.steps)} verify step(s), "
        f"{len(res.modules)} modules each",
        file=file,
    )
    for s, recs in enumerate(res.steps):
        for r, rec in enumerate(recs):
            print(
                f"  step {s} request {r} (req{rec.req_id}): prefix {rec.prefix_len}, "
                f"{len(rec.parents)} nodes, accepted nodes {rec.accepted}",
                file=file,
            )
    if res.mode == "two-way":
        print("\nPer (request, step): the worst tree node of each module\n", file=file)
        print_comparison_report(
            _worst_rows(res), res.threshold, "Dense HF", "Tree engine", file=file
        )
        if full:
            for s, rows in res.rows.items():
                print(f"\n--- step {s}: every node ---", file=file)
                print_tree_report(rows, res.threshold, file=file)
    else:
        print_three_way_report(res.three_way, "HF BF16", "Tree engine BF16", "HF FP32", file=file)
        over = res.step_rows_over()
        print(
            f"{over} per-(request, step) row(s) at >= 1.5x: each pools one tree's nodes, and "
            "a ratio of two maxima over so few samples is noisy; the verdict is the\n"
            f"AGGREGATE (pooled over requests, steps, nodes; BC over {res.bc_bins} bins):",
            file=file,
        )
        print(f"{'Module':<40}{'L-inf Ratio':>13}{'L2 Ratio':>13}{'BC':>9}  pass", file=file)
        for a in res.aggregate.values():
            print(
                f"{a.name:<40}{a.linf_ratio:>13.4f}{a.l2_ratio:>13.4f}{a.bc:>9.4f}  "
                f"{'yes' if a.passed else 'NO'}",
                file=file,
            )
    depth = res.per_depth()
    depths = sorted({d for v in depth.values() for d in v})
    label = "relative L-inf (tree vs dense" + (" bf16)" if res.mode == "three-way" else ")")
    print(f"\nMax {label} per tree depth:", file=file)
    print(f"{'Module':<32}" + "".join(f"{'d' + str(d):>10}" for d in depths), file=file)
    for m in res.modules:
        vals = depth.get(m, {})
        print(f"{m:<32}" + "".join(f"{vals.get(d, math.nan):>10.2e}" for d in depths), file=file)
    if res.greedy_mismatches:
        note = " (information only: bf16 near-ties may flip)" if res.mode == "three-way" else ""
        print(
            f"\nGREEDY: {len(res.greedy_mismatches)} emitted token(s) differ from the dense "
            f"argmax{note}, first {res.greedy_mismatches[0]}",
            file=file,
        )
    if res.passed:
        what = (
            f"every node within relative L-inf {res.threshold:g} of dense decoding, "
            "greedy tokens identical"
            if res.mode == "two-way"
            else "every module's pooled error ratios < 1.5x and BC >= 0.99 vs HF bf16"
        )
        print(f"\nVERDICT: PASS ({res.mode}): {what}", file=file)
    else:
        first = res.first_divergence
        print(
            f"\nVERDICT: FAIL ({res.mode}): first divergent layer: "
            + (str(first) if first else "none (greedy tokens differ)"),
            file=file,
        )


def to_json(res: ValidationResult) -> dict[str, Any]:
    def num(v: float) -> float | None:
        return None if v != v or v in (math.inf, -math.inf) else v

    out: dict[str, Any] = {
        "passed": res.passed,
        "mode": res.mode,
        "threshold": res.threshold,
        "nodes_compared": res.nodes_compared,
        "first_divergence": vars(res.first_divergence) if res.first_divergence else None,
        "max_linf_rel_per_module": {k: num(v) for k, v in res.per_module().items()},
        "max_linf_rel_per_depth": {
            m: {str(d): num(v) for d, v in dd.items()} for m, dd in res.per_depth().items()
        },
        "greedy_mismatches": res.greedy_mismatches,
        "steps": [
            [
                {
                    "req_id": rec.req_id,
                    "prefix_len": rec.prefix_len,
                    "parents": rec.parents,
                    "tokens": rec.tokens,
                    "accepted_nodes": rec.accepted,
                    "emitted": rec.emitted,
                }
                for rec in recs
            ]
            for recs in res.steps
        ],
    }
    if res.aggregate is not None:
        out["bc_bins"] = res.bc_bins
        out["three_way_step_rows_over_1.5x"] = res.step_rows_over()
        out["three_way_aggregate"] = {
            k: {f: num(getattr(a, f)) for f in ("linf_ratio", "l2_ratio", "bc")}
            | {
                "passed": a.passed,
                "max_base_linf": num(a.max_base_linf),
                "max_tgt_linf": num(a.max_tgt_linf),
            }
            for k, a in res.aggregate.items()
        }
    return out


def plot(res: ValidationResult, path: str | os.PathLike, title: str = "") -> str:
    """Two panels: max error per captured module (forward order) and per tree depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    names = res.modules
    x = list(range(len(names)))
    if res.mode == "two-way":
        per = res.per_module()
        vals = [max(per[m], 1e-12) if per[m] == per[m] else 1.0 for m in names]
        colours = ["tab:red" if v > res.threshold else "tab:blue" for v in vals]
        ax1.bar(x, vals, color=colours)
        ax1.axhline(res.threshold, color="k", ls="--", lw=0.8, label="threshold")
        ax1.set_ylabel("max relative L-inf, tree engine vs dense HF")
    else:
        agg = res.aggregate
        base = [max(agg[normalize_name(m)].max_base_linf, 1e-12) for m in names]
        tgt = [max(agg[normalize_name(m)].max_tgt_linf, 1e-12) for m in names]
        ax1.bar([i - 0.2 for i in x], base, width=0.4, label="HF bf16 vs HF fp32")
        ax1.bar([i + 0.2 for i in x], tgt, width=0.4, label="tree engine bf16 vs HF fp32")
        ax1.set_ylabel("max relative L-inf vs fp32 baseline")
    ax1.set_yscale("log")
    ax1.set_xticks(x, names, rotation=90, fontsize=7)
    ax1.legend(fontsize=7)
    ax1.set_title("error per layer (all nodes, all steps)")
    depth = res.per_depth()
    shown = [m for m in names if not m.endswith("self_attn")]
    for m in shown:
        d = depth.get(m, {})
        ks = sorted(d)
        ax2.plot(ks, [max(d[k], 1e-12) for k in ks], marker="o", lw=0.8, label=m)
    ax2.set_yscale("log")
    ax2.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax2.set_xlabel("tree depth (0 = root)")
    ax2.set_ylabel(
        "max relative L-inf vs dense" + (" (bf16 vs bf16)" if res.mode == "three-way" else "")
    )
    ax2.set_title("error per tree depth (decoder layers, norm, lm_head)")
    ax2.legend(fontsize=6)
    fig.suptitle(title or f"tree verification vs dense decoding ({res.mode})")
    fig.tight_layout()
    save_figure(fig, str(path))
    plt.close(fig)
    return str(path)


# --------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.validate",
        description="Validate tree verification against dense decoding, layer by layer.",
    )
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--tree", default=DEFAULT_TREE, help=f"tree spec (default {DEFAULT_TREE})")
    ap.add_argument("--prompts", type=int, default=4, help="requests decoded together")
    ap.add_argument("--steps", type=int, default=3, help="verify steps validated")
    ap.add_argument("--out", default=None, help="output dir (default results/validate/<dtype>)")
    ap.add_argument("--random", action="store_true", help="tiny random models, not the trained")
    ap.add_argument("--models", default=None, help="model set dir (default checkpoints/stdlib-v1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: shared CPU)")
    ap.add_argument("--threshold", type=float, default=FP32_THRESHOLD, help="fp32 rel. L-inf")
    ap.add_argument("--backend", default="auto", help="kernels backend of the engine")
    ap.add_argument("--device", default="cpu", help="torch device (cuda: Triton kernels)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--full", action="store_true", help="print every node row")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.prompts < 1 or args.steps < 1:
        print("error: --prompts and --steps must be >= 1", file=sys.stderr)
        return 2
    out = Path(args.out or f"results/validate/{args.dtype}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    target, draft, tok, desc = load_models(args.random, args.models)
    prompts = make_prompts(args.prompts, tok, target.config.vocab_size, args.seed)
    print(
        f"models: {desc}; engine dtype {args.dtype}; tree {args.tree}; "
        f"{len(prompts)} prompts of {[len(p) for p in prompts]} tokens; {args.steps} steps"
    )
    t0 = time.perf_counter()
    res = validate(
        target,
        draft,
        prompts,
        tree=args.tree,
        dtype=args.dtype,
        steps=args.steps,
        out_dir=out,
        threshold=args.threshold,
        kernel_backend=args.backend,
        device=args.device,
    )
    elapsed = time.perf_counter() - t0
    print_report(res, full=args.full)
    data = to_json(res) | {
        "command": "python -m bench.validate " + " ".join(sys.argv[1:] if argv is None else argv),
        "models": desc,
        "dtype": args.dtype,
        "tree": args.tree,
        "prompt_lengths": [len(p) for p in prompts],
        "seconds": round(elapsed, 2),
    }
    out.mkdir(parents=True, exist_ok=True)
    tensor_io.atomic_write_json(str(out / "report.json"), data)
    png = plot(res, out / "errors.png", f"{desc}: engine {args.dtype}, tree {args.tree}")
    print(
        f"wrote {out / 'report.json'}, {png} and captures in {out / 'captures'} ({elapsed:.1f} s)"
    )
    return 0 if res.passed else 1


if __name__ == "__main__":
    sys.exit(main())
