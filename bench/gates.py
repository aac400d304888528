"""Stage gates: one benchmark with a threshold per serve-integration stage.

    python -m bench.gates [--quick] [--engine local|vllm] [--config bench/gates.toml]
                          [--out results/gates.json] [--tree SPEC] [--models DIR]
                          [--kernel-backend NAME] [--random-tiny]

Runs the stages in order and stops at the first failure, printing what it measured
and the threshold (the stages after it are reported as never run):

1. ``kernels``: every available backend of every op agrees with the reference on the
   kernel report's cases (``bench/report.py``), and the torch backend of tree attention
   is no slower than one dense masked SDPA (``bench/attention.py``), timed side by side.
2. ``verify``: the engine's greedy output, with the configured tree policy, is token for
   token the target's plain autoregressive greedy decoding (Hugging Face, dense
   attention) on held-out prompts.
3. ``propose``: dynamic top-K tau (tokens per target forward) is at least chain tau at
   the same node budget, on held-out prompts with the trained models.
4. ``serve``: ``serve.py`` in a subprocess on a free 127.0.0.1 port returns the offline
   engine's greedy outputs over HTTP, and its throughput with the tree policy is at
   least that of ``--tree none`` at concurrency 1 (servers measured side by side).

With ``--engine vllm`` (report ``results/gates_vllm.json``) the same four stages vouch
for ``serve.py --engine vllm``: the kernels stage is the same (the plugin runs the same
ops); ``verify`` runs ``vllm.LLM`` with exactly the engine arguments the server passes
and compares its greedy output with the target's; ``propose`` compares the plugin's
top-K tree tau with vLLM's own chain at the same budget (vLLM's spec-decode counters);
``serve`` starts ``serve.py --engine vllm`` (policy, and ``--tree none``) and checks
the HTTP greedy outputs against the target's and the throughput ratio.

Sizes and thresholds live in ``bench/gates.toml`` (``[quick.*]`` tables override them
under ``--quick``). The model set, tree policy and drafter are chosen exactly as
``serve.py`` chooses them from the same flags, so the report vouches for the server's
configuration. Writes ``results/gates.json`` atomically after every stage::

    {"stages": [{"name", "passed", "measured", "threshold", "detail", "seconds"}],
     "config": {"tree", "drafter", "kernel_backend", "quick", ...},
     "created": ISO time, "git_revision": sha}

``passed`` is ``null`` for a stage that never ran; ``measured`` and ``threshold`` map
each check of the stage to its value and to ``"<op> <value>"`` (e.g. ``">= 1.0"``).
``serve.py`` reads this file at start-up and warns about failed or never-run gates.
Exit status: 0 when every gate passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import operator
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from bench.io import atomic_write_json
from tree_dev.server import config as serve_config
from tree_dev.spec import is_ngram

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = Path(__file__).with_name("gates.toml")
DEFAULT_OUT = ROOT / "results" / "gates.json"
STAGES = ("kernels", "verify", "propose", "serve")  # the order they run in (serve.py agrees)

# --------------------------------------------------------------------------- config
#: Every key of the config file and its type; a missing, unknown or mistyped key is an error.
SCHEMA: dict[str, dict[str, type | tuple[type, ...]]] = {
    "run": {"engine": str, "models": str, "tree": str, "kernel_backend": str, "threads": int},
    "kernels": {
        "report_size": str,
        "repeats": int,
        "min_agree": float,
        "shapes": list,
        "dtypes": list,
        "heads": list,
        "seconds_per_shape": float,
        "max_sdpa_ratio": float,
    },
    "verify": {"prompts": int, "prompt_tokens": int, "max_tokens": int, "min_identical": float},
    "propose": {
        "topk": str,
        "fallback": str,
        "vllm_fallback": str,
        "prompts": int,
        "prompt_tokens": int,
        "max_tokens": int,
        "min_tau_ratio": float,
    },
    "serve": {
        "prompts": int,
        "max_tokens": int,
        "min_identical": float,
        "rounds": int,
        "requests_per_round": int,
        "throughput_max_tokens": int,
        "min_throughput_ratio": float,
    },
}


class ConfigError(ValueError):
    """The gates config file is missing, not TOML, or has a bad key or value."""


def _type_name(t: type | tuple[type, ...]) -> str:
    return " or ".join(x.__name__ for x in t) if isinstance(t, tuple) else t.__name__


def _check_table(path: Path, where: str, table: Any, required: bool) -> None:
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [{where}] must be a table, got {type(table).__name__}")
    section = where.removeprefix("quick.")
    schema = SCHEMA[section]
    for key, value in table.items():
        if key not in schema:
            raise ConfigError(
                f"{path}: unknown key {key!r} in [{where}] (known: {', '.join(schema)})"
            )
        want = schema[key]
        ok = isinstance(value, want) and not isinstance(value, bool)
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True  # 1 is as good as 1.0
        if not ok:
            raise ConfigError(
                f"{path}: [{where}] {key} must be {_type_name(want)}, "
                f"got {type(value).__name__} {value!r}"
            )
        if isinstance(value, (int, float)) and value < 0:
            raise ConfigError(f"{path}: [{where}] {key} must be >= 0, got {value!r}")
    if required:
        missing = [k for k in schema if k not in table]
        if missing:
            raise ConfigError(f"{path}: [{where}] lacks {', '.join(missing)}")


def load_config(path: str | Path | None = None, quick: bool = False) -> dict[str, dict[str, Any]]:
    """Read and check the gates config; with ``quick`` merge its ``[quick.*]`` tables over it.

    Returns ``{section: {key: value}}`` for the sections of ``SCHEMA``. Raises
    ``ConfigError`` (a ``ValueError``) naming the file and the bad section or key.
    """
    path = Path(DEFAULT_CONFIG if path is None else path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    for name in raw:
        if name not in SCHEMA and name != "quick":
            raise ConfigError(
                f"{path}: unknown section [{name}] (known: {', '.join([*SCHEMA, 'quick'])})"
            )
    for name in SCHEMA:
        if name not in raw:
            raise ConfigError(f"{path}: missing section [{name}]")
        _check_table(path, name, raw[name], required=True)
    overrides = raw.get("quick", {})
    if not isinstance(overrides, dict):
        raise ConfigError(f"{path}: [quick] must hold tables like [quick.serve]")
    for name, table in overrides.items():
        if name not in SCHEMA:
            raise ConfigError(
                f"{path}: unknown section [quick.{name}] (known: {', '.join(SCHEMA)})"
            )
        _check_table(path, f"quick.{name}", table, required=False)
    cfg = {name: dict(raw[name]) for name in SCHEMA}
    if quick:
        for name, table in overrides.items():
            cfg[name].update(table)
    _check_values(path, cfg)
    return cfg


def _check_values(path: Path, cfg: dict[str, dict[str, Any]]) -> None:
    if cfg["run"]["engine"] not in serve_config.ENGINES:
        raise ConfigError(
            f"{path}: [run] engine must be one of {', '.join(serve_config.ENGINES)}, "
            f"got {cfg['run']['engine']!r}"
        )
    k = cfg["kernels"]
    if k["report_size"] not in ("small", "tiny"):
        raise ConfigError(f"{path}: [kernels] report_size must be 'small' or 'tiny'")
    for shape in k["shapes"]:
        if not (
            isinstance(shape, list)
            and len(shape) == 3
            and all(isinstance(x, int) and x >= 1 for x in shape)
        ):
            raise ConfigError(
                f"{path}: [kernels] shapes must be [batch, nodes, prefix] lists of "
                f"positive integers, got {shape!r}"
            )
    if not k["shapes"] or not k["dtypes"]:
        raise ConfigError(f"{path}: [kernels] shapes and dtypes must not be empty")
    for dt in k["dtypes"]:
        if dt not in ("fp32", "bf16"):
            raise ConfigError(f"{path}: [kernels] dtypes: {dt!r} is not 'fp32' or 'bf16'")
    heads = k["heads"]
    if not (len(heads) == 3 and all(isinstance(x, int) and x >= 1 for x in heads)):
        raise ConfigError(f"{path}: [kernels] heads must be [q_heads, kv_heads, head_dim]")
    if heads[0] % heads[1]:
        raise ConfigError(f"{path}: [kernels] heads: {heads[0]} query heads not a multiple of KV")
    for section, key in (
        ("verify", "prompts"),
        ("verify", "max_tokens"),
        ("propose", "prompts"),
        ("propose", "max_tokens"),
        ("serve", "prompts"),
        ("serve", "max_tokens"),
        ("serve", "rounds"),
        ("serve", "requests_per_round"),
        ("serve", "throughput_max_tokens"),
    ):
        if cfg[section][key] < 1:
            raise ConfigError(f"{path}: [{section}] {key} must be >= 1")


# --------------------------------------------------------------------------- thresholds
OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
}


def passes(measured: float | None, op: str, threshold: float) -> bool:
    """``measured <op> threshold``; a missing or NaN measurement never passes."""
    if op not in OPS:
        raise ValueError(f"unknown comparison {op!r}; expected one of {list(OPS)}")
    if measured is None or (isinstance(measured, float) and math.isnan(measured)):
        return False
    return bool(OPS[op](measured, threshold))


@dataclass
class Check:
    """One measured value of a stage and the threshold it must meet."""

    name: str
    measured: float | None
    op: str
    threshold: float
    timing: bool = False  # a wall-clock measurement (advisory under --timing-advisory)

    @property
    def passed(self) -> bool:
        return passes(self.measured, self.op, self.threshold)

    def describe(self) -> str:
        m = "none" if self.measured is None else f"{self.measured:.4g}"
        verdict = "ok" if self.passed else ("FAILED (timing)" if self.timing else "FAILED")
        return f"{self.name} = {m} (threshold {self.op} {self.threshold:g}): {verdict}"


@dataclass
class StageResult:
    """One line of the report. ``passed`` is None when the stage never ran."""

    name: str
    passed: bool | None
    measured: dict[str, float | None] | None
    threshold: dict[str, str] | None
    detail: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None


def stage_result(
    name: str,
    checks: Sequence[Check],
    detail: dict[str, Any],
    seconds: float,
    timing_advisory: bool = False,
) -> StageResult:
    """Fold a stage's checks into its report line; a stage with no check fails.

    With ``timing_advisory`` a missed wall-clock threshold is listed in
    ``detail["timing_misses"]`` but does not fail the stage (CI: benchmarks on a
    shared machine measure, they never fail a build on a time).
    """
    if not checks:
        detail = {**detail, "error": detail.get("error", "the stage measured nothing")}
    gating = [c for c in checks if not (timing_advisory and c.timing)]
    misses = [c.name for c in checks if timing_advisory and c.timing and not c.passed]
    if misses:
        detail = {**detail, "timing_misses": misses}
    return StageResult(
        name=name,
        passed=bool(checks) and all(c.passed for c in gating),
        measured={c.name: c.measured for c in checks},
        threshold={c.name: f"{c.op} {c.threshold:g}" for c in checks},
        detail=detail,
        seconds=round(seconds, 2),
    )


# --------------------------------------------------------------------------- context
@dataclass
class Context:
    """What the stages share: the resolved configuration and the models, loaded once.

    ``serve_cfg`` is serve.py's ``ServeConfig`` for the same flags (tree, drafter, paths).
    """

    run: dict[str, Any]
    quick: bool = False
    log_dir: Path = ROOT / "results"
    progress: bool = True
    _serve_cfg: Any = None
    _models: Any = None

    def serve_argv(self, tree: str | None = None) -> list[str]:
        argv = ["--engine", self.engine, "--kernel-backend", self.run["kernel_backend"]]
        if self.run["models"]:
            argv += ["--model", self.run["models"]]
        spec = self.run["tree"] if tree is None else tree
        if spec:
            argv += ["--tree", spec]
        if self.run["threads"]:
            argv += ["--torch-threads", str(self.run["threads"])]
        return argv

    @property
    def engine(self) -> str:
        """``local`` or ``vllm``: whose server the gates vouch for ([run] engine)."""
        return self.run.get("engine") or "local"

    @property
    def serve_cfg(self):
        if self._serve_cfg is None:
            if self.run["tree"]:
                from tree_dev.spec import parse_tree_spec

                parse_tree_spec(self.run["tree"])  # a clear ValueError before serve's parser
            self._serve_cfg = serve_config.resolve_config(self.serve_argv())
        return self._serve_cfg

    @property
    def tree(self) -> str:
        return self.serve_cfg.tree

    def drafter(self) -> tuple[str, Path]:
        """``(kind, path)`` of the drafter: serve.py's, or its default when the tree is none."""
        cfg = self.serve_cfg
        if cfg.drafter is None:  # --tree none: the drafter serve.py would pick for a tree
            cfg = serve_config.resolve_config(self.serve_argv(tree=""))
        return cfg.drafter, cfg.drafter_path

    def models(self) -> SimpleNamespace:
        """``target``, ``draft`` / ``eagle`` (one of them None) and ``tokenizer``, fp32."""
        if self._models is None:
            import torch
            from transformers import AutoTokenizer

            from tree_dev.engine import load_causal_lm

            cfg = self.serve_cfg
            if not (cfg.model / "config.json").is_file():
                raise FileNotFoundError(
                    f"no model at {cfg.model}: train the set (python -m tree_dev.models train), "
                    "or give --models DIR, or --random-tiny"
                )
            target = load_causal_lm(cfg.model)
            kind, path = self.drafter()
            draft = eagle = None
            if kind == "draft":
                draft = load_causal_lm(path)
            elif kind == "eagle":
                from tree_dev.models.eagle import EagleHead

                eagle = EagleHead.from_pretrained(path, target=target, torch_dtype=torch.float32)
            tok_dir = cfg.tokenizer or cfg.model.parent / "tokenizer"
            tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
            self._models = SimpleNamespace(
                target=target, draft=draft, eagle=eagle, tokenizer=tokenizer, drafter=kind
            )
        return self._models

    def report_config(self) -> dict[str, Any]:
        cfg = self.serve_cfg
        return {
            "engine": self.engine,
            "tree": cfg.tree,
            "drafter": cfg.drafter,
            "drafter_path": str(cfg.drafter_path) if cfg.drafter_path else None,
            "model": str(cfg.model),
            "kernel_backend": cfg.kernel_backend,
            "quick": self.quick,
        }


# --------------------------------------------------------------------------- stages
StageFn = Callable[[Context, dict[str, Any]], tuple[list[Check], dict[str, Any]]]


def stage_kernels(ctx: Context, cfg: dict[str, Any]) -> tuple[list[Check], dict[str, Any]]:
    """Backends vs the reference (kernel report), torch tree attention vs dense masked SDPA."""
    import torch

    from bench import attention
    from bench.report import run_report

    rows, info = run_report(cfg["report_size"], repeats=cfg["repeats"], progress=ctx.progress)
    compared = [r for r in rows if r.status in ("ok", "mismatch", "error")]
    bad = [r for r in compared if r.status != "ok"]
    agree = (len(compared) - len(bad)) / len(compared) if compared else None
    detail: dict[str, Any] = {
        "backends": {k: v["available"] for k, v in info.items()},
        "pairs_compared": len(compared),
        "disagreeing": [f"{r.op} [{r.case}] {r.backend}: {r.status} {r.note}" for r in bad],
        "not_compared": sorted({f"{r.backend}: {r.status}" for r in rows if r not in compared}),
    }
    checks = [Check("backends_agree", agree, ">=", cfg["min_agree"])]
    if not checks[0].passed:  # stop here: timing a wrong kernel says nothing
        return checks, detail

    heads, kv_heads, head_dim = cfg["heads"]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    per_shape = []
    for dt in cfg["dtypes"]:
        for batch, nodes, prefix in cfg["shapes"]:
            case = attention.make_case(
                batch, nodes, prefix, heads, kv_heads, head_dim, dtypes[dt], "cpu"
            )
            fns = attention.methods(case, ["torch"])
            fns = {k: fns[k] for k in ("torch", "dense_sdpa")}
            row: dict[str, Any] = dict(dtype=dt, batch=batch, nodes=nodes, prefix=prefix)
            try:
                med = attention.time_cpu(
                    fns, min_rounds=3, budget_s=cfg["seconds_per_shape"], clock="cpu"
                )
            except Exception as e:  # noqa: BLE001 - a backend that crashes fails the gate
                row["error"] = f"{type(e).__name__}: {e}"
            else:
                row["torch_ms"], row["dense_sdpa_ms"] = med["torch"], med["dense_sdpa"]
                row["ratio"] = med["torch"] / med["dense_sdpa"]
            per_shape.append(row)
            del case, fns
    detail["sdpa_shapes"] = per_shape
    errors = [s for s in per_shape if "error" in s]
    ratios = [s["ratio"] for s in per_shape if "ratio" in s]
    if errors:
        detail["error"] = f"torch tree attention failed on {len(errors)} shape(s): " + (
            f"{errors[0]['dtype']} B={errors[0]['batch']} N={errors[0]['nodes']} "
            f"prefix={errors[0]['prefix']}: {errors[0]['error']}"
        )
    detail["sdpa_worst_ratio"] = max(ratios) if ratios else None
    detail["summary"] = "torch / dense masked SDPA per shape: " + ", ".join(
        f"{r['dtype']} B{r['batch']} N{r['nodes']} {r['prefix']}: "
        + (f"{r['ratio']:.2f}" if "ratio" in r else "error")
        for r in per_shape
    )
    detail["sdpa_timing"] = (
        f"median process CPU time, {torch.get_num_threads()} thread(s), heads "
        f"{heads}/{kv_heads}x{head_dim}, interleaved rounds"
    )
    median = statistics.median(ratios) if ratios and not errors else None
    checks.append(Check("torch_over_dense_sdpa", median, "<=", cfg["max_sdpa_ratio"], timing=True))
    return checks, detail


_CACHE_KW: str | None = None


def _cache_kw() -> str:
    """``cache`` (transformers >= 5.x) or ``past_key_values`` (older): the KV cache argument."""
    import inspect

    from transformers import LlamaForCausalLM

    params = inspect.signature(LlamaForCausalLM.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache(out):
    return out["cache"] if "cache" in out.keys() else out["past_key_values"]


def greedy_reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Plain autoregressive greedy decoding with the model's own (dense) attention and KV cache."""
    import torch

    global _CACHE_KW
    _CACHE_KW = _CACHE_KW or _cache_kw()
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        tokens = []
        for _ in range(max_tokens):
            nxt = int(out.logits[0, -1].argmax())
            tokens.append(nxt)
            if len(tokens) == max_tokens:
                break
            out = model(torch.tensor([[nxt]]), **{_CACHE_KW: _cache(out)}, use_cache=True)
    return tokens


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def stage_verify(ctx: Context, cfg: dict[str, Any]) -> tuple[list[Check], dict[str, Any]]:
    """Engine greedy output with the configured tree vs autoregressive decoding of the target."""
    from tqdm import tqdm

    from bench.e2e import held_out_prompts
    from tree_dev.engine import Engine, SamplingParams, load_causal_lm

    m = ctx.models()
    prompts = held_out_prompts(m.tokenizer, cfg["prompts"], cfg["prompt_tokens"])
    reference_model = load_causal_lm(ctx.serve_cfg.model)  # untouched attention implementation
    want = [
        greedy_reference(reference_model, p, cfg["max_tokens"])
        for p in tqdm(prompts, desc="verify: autoregressive", disable=not ctx.progress)
    ]
    tree = ctx.tree
    engine = Engine(
        m.target,
        None if tree == "none" else m.draft,
        eagle=None if tree == "none" else m.eagle,
        tree=tree,
        max_batch=len(prompts),
        max_model_len=cfg["prompt_tokens"] + cfg["max_tokens"] + 8,
        kernel_backend=ctx.run["kernel_backend"],
    )
    got = engine.generate(prompts, SamplingParams(max_tokens=cfg["max_tokens"], ignore_eos=True))
    same = [g == w for g, w in zip(got, want)]
    detail = {
        "tree": tree,
        "prompts": len(prompts),
        "max_tokens": cfg["max_tokens"],
        "reference": "Hugging Face forward with its own attention and KV cache, argmax",
        "differing_prompts": {
            str(i): f"first difference at output token {_first_difference(g, w)}"
            for i, (g, w, s) in enumerate(zip(got, want, same))
            if not s
        },
        # tokens per target verify step of each request (a batched forward serves many)
        "tau": sum(len(g) for g in got) / max(1, sum(r.steps for r in engine.requests.values())),
    }
    detail["summary"] = (
        f"{sum(same)}/{len(same)} prompts identical ({tree}, {cfg['max_tokens']} tokens each, "
        f"tau {detail['tau']:.2f})"
    )
    return [Check("identical_fraction", sum(same) / len(same), ">=", cfg["min_identical"])], detail


def propose_specs(tree: str, topk: str, fallback: str) -> tuple[str, str, int]:
    """``(top-K spec, chain spec, budget)``: the top-K policy to gate and a chain of its budget.

    ``topk`` (when given), else ``tree`` when it is a top-K policy, else ``fallback``.
    """
    from tree_dev.spec import TopKPolicy, parse_tree_spec

    for spec in (topk, tree if tree.startswith("topk") else "", fallback):
        if spec:
            policy = parse_tree_spec(spec)
            if not isinstance(policy, TopKPolicy):
                raise ValueError(f"propose: {spec!r} is not a top-K policy (topk:k=,depth=,...)")
            return spec, f"chain:{policy.budget}", policy.budget
    raise ValueError("propose: no top-K policy configured")


def stage_propose(ctx: Context, cfg: dict[str, Any]) -> tuple[list[Check], dict[str, Any]]:
    """Dynamic top-K tau vs chain tau at the same node budget (held-out prompts, batch 1)."""
    from bench.e2e import held_out_prompts, run_policy

    m = ctx.models()
    topk, chain, budget = propose_specs(ctx.tree, cfg["topk"], cfg["fallback"])
    prompts = held_out_prompts(m.tokenizer, cfg["prompts"], cfg["prompt_tokens"])
    backend = ctx.run["kernel_backend"]
    runs = {
        name: run_policy(m, spec, m.drafter, prompts, cfg["max_tokens"], backend)
        for name, spec in (("topk", topk), ("chain", chain))
    }
    detail = {
        "drafter": m.drafter,
        "budget": budget,
        "prompts": len(prompts),
        "max_tokens": cfg["max_tokens"],
    }
    for name, r in runs.items():
        detail[name] = {
            "spec": r["spec"],
            "tau": r["tau"],
            "tokens_per_s": r["tokens_per_s"],
            "acceptance_per_depth": r["acceptance_per_depth"],
        }
    ratio = runs["topk"]["tau"] / runs["chain"]["tau"]
    detail["summary"] = (
        f"{m.drafter} drafter, budget {budget}: tau {topk} = {runs['topk']['tau']:.3f}, "
        f"{chain} = {runs['chain']['tau']:.3f}"
    )
    return [Check("topk_over_chain_tau", ratio, ">=", cfg["min_tau_ratio"])], detail


async def _http_greedy(base: str, model: str, prompts: list[str], max_tokens: int) -> list[dict]:
    """Non-streaming greedy completions of every prompt, sent concurrently."""
    import httpx

    body = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True}
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:

        async def one(prompt: str) -> dict:
            r = await client.post("/v1/completions", json={**body, "prompt": prompt})
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            return r.json()

        return await asyncio.gather(*(one(p) for p in prompts))


def stage_serve(ctx: Context, cfg: dict[str, Any]) -> tuple[list[Check], dict[str, Any]]:
    """serve.py over HTTP: greedy outputs vs the offline engine, throughput tree vs none."""
    from bench.serve_load import ServerProcess, make_prompts
    from tree_dev.server.app import load_engine

    scfg = ctx.serve_cfg
    per_round = cfg["requests_per_round"]
    texts = make_prompts(max(cfg["prompts"], per_round * cfg["rounds"]))
    # The offline engine built by serve.py's own loader from the same configuration.
    engine, tokenizer = load_engine(scfg)
    from tree_dev.engine import SamplingParams

    offline_prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    offline = engine.generate(
        offline_prompts[: cfg["prompts"]],
        SamplingParams(max_tokens=cfg["max_tokens"], ignore_eos=True),
    )
    del engine
    # Every choice of serve.py pinned explicitly: both servers run what the report names.
    common = ["--engine", "local", "--model", str(scfg.model)]
    common += ["--kernel-backend", scfg.kernel_backend]
    common += ["--max-batch", str(max(4, cfg["prompts"]))]
    if scfg.tokenizer is not None:
        common += ["--tokenizer", str(scfg.tokenizer)]
    if ctx.run["threads"]:
        common += ["--torch-threads", str(ctx.run["threads"])]
    tree_argv = ["--tree", scfg.tree]
    if scfg.drafter is not None:
        flag = "--eagle-head" if scfg.drafter == "eagle" else "--draft-model"
        tree_argv += [flag, str(scfg.drafter_path)]
    ctx.log_dir.mkdir(parents=True, exist_ok=True)
    servers: dict[str, ServerProcess] = {}
    detail: dict[str, Any] = {"tree": scfg.tree, "drafter": scfg.drafter}
    try:
        for name, argv in (("tree", tree_argv), ("none", ["--tree", "none"])):
            servers[name] = ServerProcess(common + argv, ctx.log_dir / f"gates.serve-{name}.log")
        infos = {name: s.wait_ready() for name, s in servers.items()}
        detail["server_tree"] = infos["tree"].get("treespec", {}).get("tree")
        detail["server_logs"] = [str(s.log_path) for s in servers.values()]
        replies = asyncio.run(
            _http_greedy(
                servers["tree"].base,
                infos["tree"]["id"],
                texts[: cfg["prompts"]],
                cfg["max_tokens"],
            )
        )
        got = [r["choices"][0]["token_ids"] for r in replies]
        same = [g == w for g, w in zip(got, offline)]
        detail["differing_prompts"] = {
            str(i): f"first difference at output token {_first_difference(g, w)}"
            for i, (g, w, s) in enumerate(zip(got, offline, same))
            if not s
        }
        checks = [
            Check("http_identical_fraction", sum(same) / len(same), ">=", cfg["min_identical"])
        ]
        if not checks[0].passed:
            return checks, detail
        checks.append(_throughput_check(servers, infos, texts, cfg, detail, same))
        return checks, detail
    except Exception as e:
        tails = "".join(_log_tail(s.log_path) for s in servers.values())
        raise RuntimeError(f"{e}{tails}") from e
    finally:
        for s in servers.values():
            s.stop()


def _throughput_check(
    servers: dict,
    infos: dict,
    texts: list[str],
    cfg: dict,
    detail: dict,
    same: list[bool],
    count_cpu: bool = True,
) -> Check:
    """Interleaved concurrency-1 rounds on the ``tree`` and ``none`` servers; fills
    ``detail`` and returns the gated tree / none throughput check (median over rounds).
    ``count_cpu``: also report tokens per server CPU second (one-process servers only)."""
    from bench.serve_load import run_level

    per_round = cfg["requests_per_round"]
    tps: dict[str, list[float]] = {"tree": [], "none": []}
    cpu_tps: dict[str, list[float]] = {"tree": [], "none": []}
    taus: list[float] = []
    for name, s in servers.items():  # warm-up
        asyncio.run(run_level(s.base, infos[name]["id"], 1, 1, texts, 8))
    for r in range(cfg["rounds"]):
        # Round r: the same fresh prompts for both servers, which go in alternating order.
        prompts = texts[r * per_round :] + texts[: r * per_round]
        for name in ("tree", "none") if r % 2 == 0 else ("none", "tree"):
            s = servers[name]
            cpu0 = _cpu_seconds(s.proc.pid) if count_cpu else None
            lv = asyncio.run(
                run_level(
                    s.base,
                    infos[name]["id"],
                    1,
                    per_round,
                    prompts,
                    cfg["throughput_max_tokens"],
                )
            )
            cpu1 = _cpu_seconds(s.proc.pid)
            tps[name].append(lv["throughput_tok_s"])
            if cpu0 is not None and cpu1 is not None and cpu1 > cpu0:
                cpu_tps[name].append(lv["output_tokens"] / (cpu1 - cpu0))
            if name == "tree" and lv["acceptance_length"]:
                taus.append(lv["acceptance_length"])
    # Each round's tree / none ratio (neighbours' load hits both alike), median over rounds.
    ratios = [t / n for t, n in zip(tps["tree"], tps["none"])]
    med = {k: statistics.median(v) for k, v in tps.items()}
    detail["throughput_tok_s"] = {k: [round(x, 2) for x in v] for k, v in tps.items()}
    detail["throughput_ratio_per_round"] = [round(x, 3) for x in ratios]
    detail["throughput_median_tok_s"] = med
    if all(len(v) == len(ratios) for v in cpu_tps.values()):
        detail["tokens_per_server_cpu_second"] = {
            k: [round(x, 2) for x in v] for k, v in cpu_tps.items()
        }
        detail["tree_over_none_per_cpu_second"] = statistics.median(
            t / n for t, n in zip(cpu_tps["tree"], cpu_tps["none"])
        )
    detail["acceptance_length"] = statistics.median(taus) if taus else None
    detail["summary"] = (
        f"{sum(same)}/{len(same)} HTTP outputs identical; tokens/s at concurrency 1: "
        f"tree {med['tree']:.1f} vs none {med['none']:.1f} (medians), ratio per round "
        f"{detail['throughput_ratio_per_round']}, server tau "
        f"{detail['acceptance_length'] or 0:.2f}"
    )
    if "tree_over_none_per_cpu_second" in detail:
        detail["summary"] += (
            f"; per server CPU second: {detail['tree_over_none_per_cpu_second']:.2f}x"
        )
    detail["throughput_setup"] = (
        f"concurrency 1, {cfg['rounds']} rounds of {per_round} streaming greedy requests x "
        f"{cfg['throughput_max_tokens']} tokens on each server, servers alternating; "
        "gated on the median over rounds of the round's tree / none tokens/s (wall clock)"
    )
    return Check(
        "tree_over_none_throughput",
        statistics.median(ratios),
        ">=",
        cfg["min_throughput_ratio"],
        timing=True,
    )


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``; else None)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _log_tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return f"\n--- last lines of {path}:\n" + "\n".join(text) if text else ""


# --------------------------------------------------------------------------- vLLM stages
def _vllm_llm(scfg, max_model_len: int, max_num_seqs: int):
    """``vllm.LLM`` with exactly the engine arguments ``serve.py --engine vllm`` passes."""
    import dataclasses

    from tree_dev.server.config import vllm_engine_kwargs
    from tree_dev.server.vllm_front import for_vllm

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    scfg = dataclasses.replace(for_vllm(scfg), max_model_len=max_model_len, max_batch=max_num_seqs)
    return LLM(**vllm_engine_kwargs(scfg), seed=0, disable_log_stats=False)  # tau counters


def _vllm_generate(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy token ids of every prompt (batched by vLLM)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def _vllm_tau(llm) -> dict[str, Any]:
    """Tokens per target forward (1 + accepted / drafts) from vLLM's spec-decode counters."""
    counts: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
            counts[m.name.removeprefix("vllm:spec_decode_")] = float(m.value)
    drafts = counts.get("num_drafts", 0.0)
    tau = 1 + counts.get("num_accepted_tokens", 0.0) / drafts if drafts else 1.0
    return {"tau": tau, "counters": counts}


def _shutdown(llm) -> None:
    import gc

    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()


def stage_verify_vllm(ctx: Context, cfg: dict[str, Any]) -> tuple[list[Check], dict[str, Any]]:
    """vLLM with the configured policy vs autoregressive decoding of the target (HF)."""
    from tqdm import tqdm

    from bench.e2e import held_out_prompts
    from tree_dev.engine import load_causal_lm

    scfg = ctx.serve_cfg
    tokenizer = ctx.models().tokenizer
    prompts = held_out_prompts(tokenizer, cfg["prompts"], cfg["prompt_tokens"])
    reference_model = load_causal_lm(scfg.model)
    want = [
        greedy_reference(reference_model, p, cfg["max_tokens"])
        for p in tqdm(prompts, desc="verify: autoregressive", disable=not ctx.progress)
    ]
    del reference_model
    llm = _vllm_llm(scfg, cfg["prompt_tokens"] + cfg["max_tokens"] + 8, len(prompts))
    try:
        got = _vllm_generate(llm, prompts, cfg["max_tokens"])
        tau = _vllm_tau(llm)
    finally:
        _shutdown(llm)
    same = [g == w for g, w in zip(got, want)]
    detail = {
        "engine": "vllm",
        "tree": scfg.tree,
        "drafter": scfg.drafter,
        "prompts": len(prompts),
        "max_tokens": cfg["max_tokens"],
        "reference": "Hugging Face forward with its own attention and KV cache, argmax",
        "differing_prompts": {
            str(i): f"first difference at output token {_first_difference(g, w)}"
            for i, (g, w, s) in enumerate(zip(got, want, same))
            if not s
        },
        "tau": tau["tau"],
        "spec_decode_counters": tau["counters"],
    }
    detail["summary"] = (
        f"{sum(same)}/{len(same)} prompts identical through vLLM ({scfg.drafter} "
        f"{scfg.tree}, {cfg['max_tokens']} tokens each, tau {tau['tau']:.2f})"
    )
    return [Check("identical_fraction", sum(same) / len(same), ">=", cfg["min_identical"])], detail


def stage_propose_vllm(ctx: Context, cfg: dict[str, Any]) -> tuple[list[Check], dict[str, Any]]:
    """Inside vLLM: top-K tree tau (the plugin) vs vLLM's own chain at the same budget."""
    import dataclasses

    from bench.e2e import held_out_prompts
    from tree_dev.server.config import vllm_plugin_available

    topk, chain, budget = propose_specs(ctx.tree, cfg["topk"], cfg["vllm_fallback"])
    if not vllm_plugin_available():
        raise RuntimeError("the vLLM tree plugin (tree_dev.vllm_plugin) is not installed")
    scfg = ctx.serve_cfg
    if scfg.drafter not in ("eagle", "draft"):  # e.g. n-gram: the model set's draft for a tree
        scfg = serve_config.resolve_config(ctx.serve_argv(tree=topk))
    tokenizer = ctx.models().tokenizer
    prompts = held_out_prompts(tokenizer, cfg["prompts"], cfg["prompt_tokens"])
    detail: dict[str, Any] = {"engine": "vllm", "drafter": scfg.drafter, "budget": budget}
    for name, spec in (("topk", topk), ("chain", chain)):
        llm = _vllm_llm(
            dataclasses.replace(scfg, tree=spec), cfg["prompt_tokens"] + cfg["max_tokens"] + 8, 1
        )
        try:
            t0 = time.perf_counter()
            got = [_vllm_generate(llm, [p], cfg["max_tokens"])[0] for p in prompts]  # batch 1
            seconds = time.perf_counter() - t0
            detail[name] = {"spec": spec, **_vllm_tau(llm)}
            detail[name]["tokens_per_s"] = sum(len(g) for g in got) / seconds
        finally:
            _shutdown(llm)
    ratio = detail["topk"]["tau"] / detail["chain"]["tau"]
    detail["summary"] = (
        f"vLLM, {scfg.drafter} drafter, budget {budget}: tau {topk} = "
        f"{detail['topk']['tau']:.3f}, {chain} = {detail['chain']['tau']:.3f}"
    )
    return [Check("topk_over_chain_tau", ratio, ">=", cfg["min_tau_ratio"])], detail


def stage_serve_vllm(ctx: Context, cfg: dict[str, Any]) -> tuple[list[Check], dict[str, Any]]:
    """serve.py --engine vllm over HTTP: greedy outputs vs the target's own greedy decoding,
    throughput with the policy vs ``--tree none`` (both vLLM's server) at concurrency 1."""
    from bench.serve_load import ServerProcess, make_prompts
    from tree_dev.engine import load_causal_lm

    scfg = ctx.serve_cfg
    per_round = cfg["requests_per_round"]
    texts = make_prompts(max(cfg["prompts"], per_round * cfg["rounds"]))
    tokenizer = ctx.models().tokenizer
    reference_model = load_causal_lm(scfg.model)
    want = [
        greedy_reference(reference_model, tokenizer.encode(t, add_special_tokens=False), n)
        for t, n in zip(texts[: cfg["prompts"]], [cfg["max_tokens"]] * cfg["prompts"])
    ]
    del reference_model
    common = ["--engine", "vllm", "--model", str(scfg.model)]
    common += ["--max-batch", str(max(4, cfg["prompts"]))]
    if scfg.tokenizer is not None:
        common += ["--tokenizer", str(scfg.tokenizer)]
    tree_argv = ["--tree", scfg.tree]
    if scfg.drafter in ("eagle", "draft"):
        flag = "--eagle-head" if scfg.drafter == "eagle" else "--draft-model"
        tree_argv += [flag, str(scfg.drafter_path)]
    elif scfg.drafter == "ngram" and not is_ngram(scfg.tree):  # vLLM's n-gram chain
        sc = serve_config.vllm_speculative_config(scfg)
        tree_argv = ["--speculative-config", json.dumps(sc)]
    ctx.log_dir.mkdir(parents=True, exist_ok=True)
    servers: dict[str, ServerProcess] = {}
    detail: dict[str, Any] = {"engine": "vllm", "tree": scfg.tree, "drafter": scfg.drafter}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        for name, argv in (("tree", tree_argv), ("none", ["--tree", "none"])):
            log_path = ctx.log_dir / f"gates_vllm.serve-{name}.log"
            servers[name] = ServerProcess(common + argv, log_path)
            servers[name].wait_ready()  # one vLLM start-up at a time on a small machine
        infos = {name: s.wait_ready() for name, s in servers.items()}
        detail["server_tree"] = infos["tree"].get("treespec", {}).get("tree")
        detail["server_logs"] = [str(s.log_path) for s in servers.values()]
        replies = asyncio.run(
            _http_greedy(
                servers["tree"].base,
                infos["tree"]["id"],
                texts[: cfg["prompts"]],
                cfg["max_tokens"],
            )
        )
        got = [r["choices"][0]["token_ids"] for r in replies]
        same = [g == w for g, w in zip(got, want)]
        detail["reference"] = "Hugging Face greedy decoding of the target"
        detail["differing_prompts"] = {
            str(i): f"first difference at output token {_first_difference(g, w)}"
            for i, (g, w, s) in enumerate(zip(got, want, same))
            if not s
        }
        checks = [
            Check("http_identical_fraction", sum(same) / len(same), ">=", cfg["min_identical"])
        ]
        if not checks[0].passed:
            return checks, detail
        checks.append(_throughput_check(servers, infos, texts, cfg, detail, same, count_cpu=False))
        return checks, detail
    except Exception as e:
        tails = "".join(_log_tail(s.log_path) for s in servers.values())
        raise RuntimeError(f"{e}{tails}") from e
    finally:
        for s in servers.values():
            s.stop()


STAGE_FNS: dict[str, StageFn] = {
    "kernels": stage_kernels,
    "verify": stage_verify,
    "propose": stage_propose,
    "serve": stage_serve,
}
#: The stages of ``--engine vllm``: the same kernels, the rest through vLLM.
VLLM_STAGE_FNS: dict[str, StageFn] = {
    "kernels": stage_kernels,
    "verify": stage_verify_vllm,
    "propose": stage_propose_vllm,
    "serve": stage_serve_vllm,
}


# --------------------------------------------------------------------------- running
def git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def make_report(results: Sequence[StageResult], config: dict[str, Any]) -> dict[str, Any]:
    """The JSON report: every stage in order (never-run ones with ``passed: null``)."""
    done = {r.name for r in results}
    stages = [asdict(r) for r in results]
    stages += [asdict(StageResult(n, None, None, None)) for n in STAGES if n not in done]
    return {
        "stages": stages,
        "config": config,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_revision": git_revision(),
    }


def run_gates(
    ctx: Context,
    cfg: dict[str, dict[str, Any]],
    out: Path | None = None,
    stage_fns: dict[str, StageFn] | None = None,
    log: Callable[[str], None] = print,
    timing_advisory: bool = False,
) -> list[StageResult]:
    """Run the stages in ``STAGES`` order, stopping at the first failure.

    A stage that raises fails with the error in ``detail``. The report is written
    to ``out`` (atomically) before the first stage and after every stage.
    """
    if stage_fns is None:
        stage_fns = VLLM_STAGE_FNS if ctx.engine == "vllm" else STAGE_FNS
    fns = stage_fns
    try:
        config = ctx.report_config()
    except Exception as e:  # noqa: BLE001 - e.g. a bad tree spec: reported, not a traceback
        config = {"tree": ctx.run["tree"] or None, "kernel_backend": ctx.run["kernel_backend"]}
        config |= {"quick": ctx.quick, "error": f"{type(e).__name__}: {e}"}
    results: list[StageResult] = []
    if out is not None:
        atomic_write_json(out, make_report(results, config))
    for name in STAGES:
        log(f"[{name}] running ...")
        start = time.perf_counter()
        try:
            checks, detail = fns[name](ctx, cfg[name])
        except Exception as e:  # noqa: BLE001 - a crashed stage is a failed gate, with the reason
            checks = []
            detail = {
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(limit=-6),
            }
        result = stage_result(name, checks, detail, time.perf_counter() - start, timing_advisory)
        results.append(result)
        if out is not None:
            atomic_write_json(out, make_report(results, config))
        for c in checks:
            log(f"[{name}]   {c.describe()}")
        if detail.get("summary"):
            log(f"[{name}]   {detail['summary']}")
        if result.passed:
            misses = result.detail.get("timing_misses")
            note = f" (timing advisory, missed: {', '.join(misses)})" if misses else ""
            log(f"[{name}] PASSED in {result.seconds:.1f} s{note}")
            continue
        failed = [c for c in checks if not c.passed and not (timing_advisory and c.timing)]
        if failed:
            c = failed[0]
            why = f"measured {c.name} = {c.measured!r}, threshold {c.op} {c.threshold:g}"
        else:
            why = detail.get("error", "no measurement")
        log(f"[{name}] FAILED in {result.seconds:.1f} s: {why}")
        rest = [n for n in STAGES if n not in {r.name for r in results}]
        if rest:
            log(f"stopping at the first failure; not run: {', '.join(rest)}")
        break
    return results


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gates", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the [quick.*] sizes (about 2 min)")
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument(
        "--out",
        type=Path,
        help="report (default: results/gates.json, results/gates_vllm.json for vllm)",
    )
    ap.add_argument(
        "--engine", choices=serve_config.ENGINES, help="whose server to gate (default: [run])"
    )
    ap.add_argument("--tree", help="tree policy (default: [run] tree, else serve.py's)")
    ap.add_argument("--models", help="model set directory (default: [run] models, else serve.py's)")
    ap.add_argument("--kernel-backend", help="default: [run] kernel_backend")
    ap.add_argument(
        "--random-tiny",
        action="store_true",
        help="a tiny random model set in a temporary directory (smoke run; figures mean nothing)",
    )
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--timing-advisory",
        action="store_true",
        help="report missed wall-clock thresholds without failing (CI on a shared machine)",
    )
    args = ap.parse_args(argv)
    if args.tree:
        from tree_dev.spec import parse_tree_spec

        try:
            parse_tree_spec(args.tree)
        except ValueError as e:
            ap.error(f"argument --tree: {e}")
    try:
        cfg = load_config(args.config, quick=args.quick)
    except ConfigError as e:
        ap.error(str(e))
    run = dict(cfg["run"])
    for key in ("tree", "models", "kernel_backend", "engine"):
        if getattr(args, key) is not None:
            run[key] = getattr(args, key)
    if args.out is None:
        args.out = DEFAULT_OUT if run["engine"] == "local" else serve_config.GATES_REPORTS["vllm"]
    import torch

    if run["threads"]:
        torch.set_num_threads(run["threads"])
    tmp = None
    if args.random_tiny:
        from bench.serve_load import write_random_tiny

        tmp = tempfile.TemporaryDirectory(prefix="gates-tiny-")
        run["models"] = str(write_random_tiny(Path(tmp.name)))
    ctx = Context(run, quick=args.quick, log_dir=args.out.parent, progress=not args.no_progress)
    start = time.perf_counter()
    try:
        results = run_gates(ctx, cfg, args.out, timing_advisory=args.timing_advisory)
    finally:
        if tmp is not None:
            tmp.cleanup()
    ok = len(results) == len(STAGES) and all(r.passed for r in results)
    print(
        f"gates: {'ALL PASSED' if ok else 'FAILED'} in {time.perf_counter() - start:.0f} s; "
        f"wrote {args.out}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
