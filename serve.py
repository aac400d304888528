#!/usr/bin/env python
"""OpenAI-compatible HTTP server on the local tree speculative-decoding engine.

``python serve.py`` with no arguments serves the project's tiny trained model set
(``checkpoints/stdlib-v1``: target + EAGLE head) with the best measured tree policy
(``results/e2e.json`` key ``best_policy``, else ``DEFAULT_TREE``) on
http://127.0.0.1:8000. See ``docs/serve.md`` for every flag, the vLLM / SGLang flag
mapping, the endpoints and the ``treespec`` extension field.

Design: one background thread owns the (not thread-safe) ``Engine`` and runs
``Engine.step`` while there is work (continuous batching: requests join and leave
between steps). HTTP handlers hand requests to it through a thread-safe queue and
receive their tokens through an ``asyncio.Queue`` (``loop.call_soon_threadsafe``).
A client that disconnects, or a stop string that matches, aborts its request in
the engine, which frees its KV blocks.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

REPO = Path(__file__).resolve().parent
DEFAULT_MODEL_SET = REPO / "checkpoints" / "stdlib-v1"
E2E_REPORT = REPO / "results" / "e2e.json"
GATES_REPORT = REPO / "results" / "gates.json"
#: Tree policy when ``results/e2e.json`` has no ``best_policy``: measured by
#: ``python -m bench.e2e`` on the committed tiny set (EAGLE head, batch 1, CPU) at
#: 1.48x autoregressive tokens/s, tau 6.17 (chain:8 1.51x, tau 5.82; the best in that
#: run, topk:k=2,depth=4,budget=4, 1.57x; medians of 3 rounds, per-round spread
#: 0.1-0.2), and with top-K tau >= the chain's at the same node budget (the propose
#: gate).
DEFAULT_TREE = "topk:k=2,depth=8,budget=8,temp=0.3"
GATE_STAGES = ("kernels", "verify", "propose", "serve")
DISCONNECT_POLL_S = 0.5  # how often a handler asks whether its client is still there
#: The chat format used when the tokenizer has no chat template (see docs/serve.md).
PLAIN_CHAT_FORMAT = "{role}: {content}\n"
PLAIN_CHAT_GENERATION_PROMPT = "assistant:"
VLLM_METHODS = {"eagle": "eagle", "eagle3": "eagle", "draft_model": "draft"}
SGLANG_ALGORITHMS = {"EAGLE": "eagle", "EAGLE3": "eagle", "STANDALONE": "draft"}

log = logging.getLogger("treespec.serve")


# =========================================================================== flags
@dataclass
class ServeConfig:
    """Everything ``main`` needs, after flag mapping and defaults."""

    model: Path
    tokenizer: Path | None
    drafter: str | None  # "eagle", "draft" or None
    drafter_path: Path | None
    tree: str
    tree_source: str  # which flag (or default) chose the tree
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 16
    max_model_len: int = 1024
    kernel_backend: str = "auto"
    served_model_name: str = "treespec"
    dtype: str = "float32"
    device: str = "auto"
    torch_threads: int | None = None
    gates_report: Path = GATES_REPORT
    log_level: str = "info"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="serve.py",
        description="OpenAI-compatible server on the local tree speculative-decoding engine.",
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        type=Path,
        help="target checkpoint directory, or a model set directory with target/, eagle/, "
        f"draft/, tokenizer/ (default: {DEFAULT_MODEL_SET.relative_to(REPO)})",
    )
    g.add_argument("--draft-model", type=Path, help="a small causal LM as the draft")
    g.add_argument("--eagle-head", type=Path, help="an EAGLE head as the draft")
    g.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: found)")
    g.add_argument("--served-model-name", help="model id in the API (default: the model dir)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (auto: cuda if any)")
    t = p.add_argument_group("tree policy")
    t.add_argument("--tree", help="tree spec: none, chain:K, paths:[...], medusa:NAME, topk:...")
    t.add_argument(
        "--speculative-config",
        help="vLLM-style JSON: method, model, num_speculative_tokens, speculative_token_tree",
    )
    t.add_argument("--speculative-algorithm", help="SGLang: EAGLE, EAGLE3 or STANDALONE")
    t.add_argument("--speculative-draft-model-path", type=Path, help="SGLang: the draft")
    t.add_argument("--speculative-eagle-topk", type=int, help="SGLang: k of the top-K tree")
    t.add_argument("--speculative-num-steps", type=int, help="SGLang: depth of the tree")
    t.add_argument(
        "--speculative-num-draft-tokens", type=int, help="SGLang: tree nodes incl. the root"
    )
    s = p.add_argument_group("server")
    s.add_argument("--kernel-backend", default="auto", help="auto, torch, triton, nki, reference")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-batch", type=int, default=16, help="most requests decoded together")
    s.add_argument("--max-model-len", type=int, default=1024, help="longest prompt + output")
    s.add_argument("--torch-threads", type=int, help="torch.set_num_threads (default: torch's)")
    s.add_argument("--gates-report", type=Path, default=GATES_REPORT)
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def read_best_policy(path: Path | None = None) -> tuple[str, str]:
    """``(tree spec, where it came from)``: ``best_policy`` of the e2e report, else the default.

    ``best_policy`` may be a spec string or an object with a ``tree`` (or ``spec``) key
    and optionally ``drafter`` (``"eagle"`` or ``"draft"``, see ``read_best_drafter``).
    """
    from tree_dev.spec import parse_tree_spec

    path = E2E_REPORT if path is None else path
    try:
        best = json.loads(Path(path).read_text())["best_policy"]
        spec = best if isinstance(best, str) else best.get("tree") or best.get("spec")
        parse_tree_spec(spec)
        return spec, f"best_policy of {path}"
    except FileNotFoundError:
        return DEFAULT_TREE, f"default (no {path})"
    except (KeyError, TypeError, AttributeError, ValueError, json.JSONDecodeError) as e:
        log.warning("ignoring best_policy of %s (%s); using %s", path, e, DEFAULT_TREE)
        return DEFAULT_TREE, f"default ({path} has no valid best_policy)"


def read_best_drafter(path: Path | None = None) -> str | None:
    """``"eagle"`` or ``"draft"`` when ``best_policy`` is an object naming its ``drafter``."""
    try:
        best = json.loads(Path(E2E_REPORT if path is None else path).read_text())["best_policy"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        return None
    kind = best.get("drafter") if isinstance(best, dict) else None
    return kind if kind in ("eagle", "draft") else None


class _FlagError(Exception):
    pass


def _vllm_speculative_config(raw: str) -> tuple[str | None, tuple[str, Path] | None, str]:
    """vLLM ``--speculative-config`` -> (tree spec or None, (drafter kind, path) or None, flag)."""
    flag = "--speculative-config"
    try:
        sc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise _FlagError(f"argument {flag}: not valid JSON ({e})") from None
    if not isinstance(sc, dict):
        raise _FlagError(f"argument {flag}: expected a JSON object")
    known = {"method", "model", "num_speculative_tokens", "speculative_token_tree"}
    for key in sorted(set(sc) - known):
        log.warning("%s: ignoring key %r (not used by the local engine)", flag, key)
    method, model = sc.get("method"), sc.get("model")
    if method is None:
        method = "draft_model" if model else None
    if method is not None and method not in VLLM_METHODS:
        raise _FlagError(
            f"argument {flag}: method {method!r} is not supported; use one of "
            f"{sorted(VLLM_METHODS)}"
        )
    drafter = None
    if model is not None:
        if not isinstance(model, str) or not model:
            raise _FlagError(f"argument {flag}: 'model' must be a path string")
        drafter = (VLLM_METHODS[method], Path(model))
    k = sc.get("num_speculative_tokens")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise _FlagError(f"argument {flag}: num_speculative_tokens must be an integer >= 1")
    tree_raw = sc.get("speculative_token_tree")
    if tree_raw is not None:
        try:
            paths = ast.literal_eval(tree_raw) if isinstance(tree_raw, str) else tree_raw
            paths = [tuple(p) for p in paths]
        except (ValueError, SyntaxError, TypeError):
            raise _FlagError(
                f"argument {flag}: speculative_token_tree is not a list of tuples"
            ) from None
        depth = max((len(p) for p in paths), default=0)
        if k is not None and k != depth:
            raise _FlagError(
                f"argument {flag}: num_speculative_tokens={k} contradicts "
                f"speculative_token_tree of depth {depth}"
            )
        return f"paths:{paths!r}", drafter, flag
    if k is not None:
        return f"chain:{k}", drafter, flag
    return None, drafter, flag


def _sglang_flags(a: argparse.Namespace) -> tuple[str | None, tuple[str, Path] | None, str]:
    """SGLang's flags -> (tree spec or None, (drafter kind, path) or None, flag named)."""
    algo = a.speculative_algorithm
    if algo is not None and algo.upper() not in SGLANG_ALGORITHMS:
        raise _FlagError(
            f"argument --speculative-algorithm: {algo!r} is not supported; use one of "
            f"{sorted(SGLANG_ALGORITHMS)}"
        )
    kind = SGLANG_ALGORITHMS[algo.upper()] if algo else "eagle"
    drafter = None
    if a.speculative_draft_model_path is not None:
        drafter = (kind, a.speculative_draft_model_path)
    topk, steps, ntok = (
        a.speculative_eagle_topk,
        a.speculative_num_steps,
        a.speculative_num_draft_tokens,
    )
    for name, v in (
        ("--speculative-eagle-topk", topk),
        ("--speculative-num-steps", steps),
        ("--speculative-num-draft-tokens", ntok),
    ):
        if v is not None and v < 1:
            raise _FlagError(f"argument {name}: must be >= 1, got {v}")
    flags = [
        n
        for n, v in (
            ("--speculative-eagle-topk", topk),
            ("--speculative-num-steps", steps),
            ("--speculative-num-draft-tokens", ntok),
        )
        if v is not None
    ]
    if not flags:
        return None, drafter, "--speculative-algorithm"
    topk = 1 if topk is None else topk
    if steps is None:
        if topk == 1 and ntok is not None:
            steps = ntok - 1
        else:
            raise _FlagError(f"argument {flags[0]}: needs --speculative-num-steps (the tree depth)")
    if topk == 1:
        if ntok is not None and ntok != steps + 1:
            raise _FlagError(
                f"argument --speculative-num-draft-tokens: {ntok} contradicts "
                f"--speculative-num-steps {steps} with top-k 1 (a chain needs steps + 1)"
            )
        if steps < 1:
            raise _FlagError("argument --speculative-num-draft-tokens: must be >= 2")
        return f"chain:{steps}", drafter, flags[0]
    budget = (ntok - 1) if ntok is not None else topk * steps
    if budget < 1:
        raise _FlagError("argument --speculative-num-draft-tokens: must be >= 2")
    return f"topk:k={topk},depth={steps},budget={budget}", drafter, flags[0]


def resolve_config(argv: list[str] | None = None) -> ServeConfig:
    """Parse flags, map vLLM/SGLang forms onto tree specs, apply defaults.

    Contradictory flags exit with status 2 (argparse error) naming both flags.
    """
    from tree_dev.spec import parse_tree_spec

    parser = build_parser()
    a = parser.parse_args(argv)
    trees: dict[str, str] = {}  # flag -> tree spec
    drafters: dict[str, tuple[str, Path]] = {}  # flag -> (kind, path)
    try:
        if a.tree is not None:
            trees["--tree"] = a.tree
        if a.draft_model is not None:
            drafters["--draft-model"] = ("draft", a.draft_model)
        if a.eagle_head is not None:
            drafters["--eagle-head"] = ("eagle", a.eagle_head)
        if a.speculative_config is not None:
            spec, drafter, flag = _vllm_speculative_config(a.speculative_config)
            if spec is not None:
                trees[flag] = spec
            if drafter is not None:
                drafters[flag] = drafter
        sglang = (
            a.speculative_algorithm,
            a.speculative_draft_model_path,
            a.speculative_eagle_topk,
            a.speculative_num_steps,
            a.speculative_num_draft_tokens,
        )
        if any(v is not None for v in sglang):
            spec, drafter, flag = _sglang_flags(a)
            if spec is not None:
                trees[flag] = spec
            if drafter is not None:
                drafters["--speculative-draft-model-path"] = drafter
    except _FlagError as e:
        parser.error(str(e))
    if len(trees) > 1:
        (f1, t1), (f2, t2) = list(trees.items())[:2]
        parser.error(f"argument {f2}: not allowed with {f1} (tree {t2!r} vs {t1!r})")
    if len(drafters) > 1:
        (f1, d1), (f2, d2) = list(drafters.items())[:2]
        if d1 != d2:
            parser.error(
                f"argument {f2}: not allowed with {f1} (draft {d2[0]} {d2[1]} vs {d1[0]} {d1[1]})"
            )
    for flag, spec in trees.items():
        try:
            parse_tree_spec(spec)
        except ValueError as e:
            parser.error(f"argument {flag}: {e}")
    if a.max_batch < 1 or a.max_model_len < 2:
        parser.error("argument --max-batch/--max-model-len: must be >= 1 / >= 2")

    model = a.model if a.model is not None else DEFAULT_MODEL_SET
    tokenizer = a.tokenizer
    drafter = next(iter(drafters.values()), None)
    drafter_flag = next(iter(drafters), None)
    tree_flag = next(iter(trees), None)
    tree = trees.get(tree_flag) if tree_flag else None
    if tree == "none" and drafter is not None:
        parser.error(f"argument {drafter_flag}: not allowed with {tree_flag} none (unused draft)")
    if a.model is None or (model / "target").is_dir():
        # a model set: target/, eagle/ and/or draft/, tokenizer/ (the default set may not
        # be trained yet: its paths are used as they are, and loading says what is missing)
        if tokenizer is None:
            tokenizer = model / "tokenizer"
        if drafter is None and tree != "none":
            has_draft, has_eagle = (model / "draft").is_dir(), (model / "eagle").is_dir()
            use_draft = has_draft and (
                not has_eagle or (tree is None and read_best_drafter() == "draft")
            )
            drafter = ("draft", model / "draft") if use_draft else ("eagle", model / "eagle")
        model = model / "target"
    if tree is None:
        tree, source = read_best_policy() if drafter is not None else ("none", "no draft given")
    else:
        source = tree_flag
    if tree != "none" and drafter is None:
        parser.error(
            f"argument {tree_flag}: tree {tree!r} needs a draft (--draft-model or --eagle-head)"
        )
    name = a.served_model_name
    if name is None:
        name = model.parent.name if model.name == "target" else model.name
    return ServeConfig(
        model=model,
        tokenizer=tokenizer,
        drafter=drafter[0] if drafter else None,
        drafter_path=drafter[1] if drafter else None,
        tree=tree,
        tree_source=source,
        host=a.host,
        port=a.port,
        max_batch=a.max_batch,
        max_model_len=a.max_model_len,
        kernel_backend=a.kernel_backend,
        served_model_name=name,
        dtype=a.dtype,
        device=a.device,
        torch_threads=a.torch_threads,
        gates_report=a.gates_report,
        log_level=a.log_level,
    )


# =========================================================================== gates
def gate_warnings(report: dict | None, tree: str, kernel_backend: str = "auto") -> list[str]:
    """Warnings for stages of this configuration whose gate failed or never ran.

    ``report`` is ``results/gates.json`` (``python -m bench.gates``):
    ``{"stages": [{"name", "passed", "measured", "threshold"}, ...], "config": {...}}``.
    Plain decoding (``tree == "none"``) needs the kernels and serve gates; a tree
    policy needs all four. A report whose ``config.tree`` or ``config.kernel_backend``
    differs from this server's does not vouch for it.
    """
    needed = ("kernels", "serve") if tree == "none" else GATE_STAGES
    if report is None:
        return [
            f"gate '{s}' never ran (no gates report): run python -m bench.gates" for s in needed
        ]
    out = []
    cfg = report.get("config") or {}
    for key, ours in (("tree", tree), ("kernel_backend", kernel_backend)):
        if key in cfg and cfg[key] != ours:
            out.append(
                f"gates report was measured with {key}={cfg[key]!r}, this server uses {ours!r}"
            )
    stages = {s.get("name"): s for s in report.get("stages", []) if isinstance(s, dict)}
    for name in needed:
        s = stages.get(name)
        if s is None or s.get("passed") is None:
            out.append(f"gate '{name}' never ran")
        elif not s.get("passed"):
            out.append(
                f"gate '{name}' FAILED: measured {s.get('measured')!r}, "
                f"threshold {s.get('threshold')!r}"
            )
    return out


def read_gates_report(path: Path) -> dict | None:
    try:
        report = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        log.warning("cannot read gates report %s: %s", path, e)
        return None
    return report if isinstance(report, dict) else None


# =========================================================================== metrics
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """Counters for ``GET /metrics`` (Prometheus text format 0.0.4), written by hand."""

    def __init__(self, max_accept: int):
        self.lock = threading.Lock()
        self.requests = {}  # finish_reason -> count
        self.rejected = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.step_buckets = [0] * len(STEP_BUCKETS)
        self.step_count = 0
        self.step_sum = 0.0
        self.accept_edges = tuple(range(1, max(max_accept, 1) + 1))
        self.accept_buckets = [0] * len(self.accept_edges)
        self.accept_count = 0
        self.accept_sum = 0
        self.depth_tried: list[int] = []
        self.depth_accepted: list[int] = []
        self.running = 0
        self.waiting = 0

    def observe_step(self, seconds: float) -> None:
        with self.lock:
            self.step_count += 1
            self.step_sum += seconds
            for i, edge in enumerate(STEP_BUCKETS):
                if seconds <= edge:
                    self.step_buckets[i] += 1

    def observe_accept(self, length: int, tried: list[int], accepted: list[int]) -> None:
        with self.lock:
            self.accept_count += 1
            self.accept_sum += length
            for i, edge in enumerate(self.accept_edges):
                if length <= edge:
                    self.accept_buckets[i] += 1
            for d, (t, a) in enumerate(zip(tried, accepted)):
                while len(self.depth_tried) <= d:
                    self.depth_tried.append(0)
                    self.depth_accepted.append(0)
                self.depth_tried[d] += t
                self.depth_accepted[d] += a

    def render(self) -> str:
        with self.lock:
            lines = [
                "# HELP treespec_requests_total Requests that ended, by finish reason.",
                "# TYPE treespec_requests_total counter",
            ]
            for reason in sorted(set(self.requests) | {"stop", "length", "abort"}):
                n = self.requests.get(reason, 0)
                lines.append(f'treespec_requests_total{{finish_reason="{reason}"}} {n}')
            lines += [
                "# HELP treespec_requests_rejected_total Requests refused with a 4xx.",
                "# TYPE treespec_requests_rejected_total counter",
                f"treespec_requests_rejected_total {self.rejected}",
                "# HELP treespec_requests_running Requests in the running batch.",
                "# TYPE treespec_requests_running gauge",
                f"treespec_requests_running {self.running}",
                "# HELP treespec_requests_waiting Requests queued for admission.",
                "# TYPE treespec_requests_waiting gauge",
                f"treespec_requests_waiting {self.waiting}",
                "# HELP treespec_prompt_tokens_total Prompt tokens of admitted requests.",
                "# TYPE treespec_prompt_tokens_total counter",
                f"treespec_prompt_tokens_total {self.prompt_tokens}",
                "# HELP treespec_generation_tokens_total Tokens generated.",
                "# TYPE treespec_generation_tokens_total counter",
                f"treespec_generation_tokens_total {self.generation_tokens}",
                "# HELP treespec_step_latency_seconds Wall time of one engine step.",
                "# TYPE treespec_step_latency_seconds histogram",
            ]
            for edge, n in zip(STEP_BUCKETS, self.step_buckets):
                lines.append(f'treespec_step_latency_seconds_bucket{{le="{edge}"}} {n}')
            lines += [
                f'treespec_step_latency_seconds_bucket{{le="+Inf"}} {self.step_count}',
                f"treespec_step_latency_seconds_sum {self.step_sum}",
                f"treespec_step_latency_seconds_count {self.step_count}",
                "# HELP treespec_accepted_length Tokens emitted per request per step "
                "(accepted drafts + bonus).",
                "# TYPE treespec_accepted_length histogram",
            ]
            for edge, n in zip(self.accept_edges, self.accept_buckets):
                lines.append(f'treespec_accepted_length_bucket{{le="{edge}"}} {n}')
            lines += [
                f'treespec_accepted_length_bucket{{le="+Inf"}} {self.accept_count}',
                f"treespec_accepted_length_sum {self.accept_sum}",
                f"treespec_accepted_length_count {self.accept_count}",
                "# HELP treespec_acceptance_per_depth Fraction of steps whose tree reached "
                "depth d that accepted a draft token at depth d.",
                "# TYPE treespec_acceptance_per_depth gauge",
            ]
            for d, (t, a) in enumerate(zip(self.depth_tried, self.depth_accepted)):
                rate = a / t if t else 0.0
                lines.append(f'treespec_acceptance_per_depth{{depth="{d + 1}"}} {rate}')
            return "\n".join(lines) + "\n"


# =========================================================================== engine worker
@dataclass
class Job:
    """One request's link between its HTTP handler and the engine thread."""

    prompt: list[int]
    params: Any  # tree_dev.engine.SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    req_id: int | None = None
    seen_steps: int = 0
    seen_drafts: int = 0
    seen_tried: list[int] = field(default_factory=list)
    seen_accepted: list[int] = field(default_factory=list)


class EngineWorker:
    """Owns the engine in one thread; the only code that ever touches it.

    Events delivered to ``Job.events``: ``("accepted", req_id)`` or ``("error", msg)``
    first, then ``("tokens", [ids])`` any number of times, then
    ``("done", finish_reason, stats)``.
    """

    def __init__(self, engine, metrics: Metrics):
        self.engine = engine
        self.metrics = metrics
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: dict[int, Job] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="treespec-engine", daemon=True)
        self.idle = threading.Event()  # set when the engine has nothing to do

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> None:
        self._inbox.put(("add", job, None))

    def abort(self, job: Job, reason: str = "abort") -> None:
        self._inbox.put(("abort", job, reason))

    @staticmethod
    def _deliver(job: Job, event: tuple) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, event)
        except RuntimeError:  # the handler's loop is closed: nobody listens any more
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._once()
            except Exception as e:  # keep serving: fail the requests in flight, not the server
                log.exception("engine step failed; failing %d requests", len(self._jobs))
                for job in list(self._jobs.values()):
                    try:
                        self.engine.abort(job.req_id)
                    except Exception:
                        log.exception("abort of request %s failed", job.req_id)
                    self._finish(job, "abort", error=f"engine error: {type(e).__name__}: {e}")
        self.idle.set()

    def _once(self) -> None:
        """Take new commands, then run one engine step if there is work."""
        eng = self.engine
        cmds = []
        if not eng.has_work():
            self.idle.set()
            try:
                cmds.append(self._inbox.get(timeout=0.05))
            except queue.Empty:
                return
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for cmd, job, reason in cmds:
            if cmd == "add":
                self._add(job)
            elif job.req_id in self._jobs:
                eng.abort(job.req_id)
                self._finish(job, reason)
        self._gauges()
        if not eng.has_work():
            return
        self.idle.clear()
        t0 = time.perf_counter()
        outs = eng.step()
        self.metrics.observe_step(time.perf_counter() - t0)
        for o in outs:
            job = self._jobs.get(o.req_id)
            if job is None:
                continue
            self._observe(job, eng.requests[o.req_id])
            if o.new_tokens:
                with self.metrics.lock:
                    self.metrics.generation_tokens += len(o.new_tokens)
                self._deliver(job, ("tokens", list(o.new_tokens)))
            if o.finished:
                self._finish(job, o.finish_reason)
        self._gauges()

    def _gauges(self) -> None:
        with self.metrics.lock:
            self.metrics.running = len(self.engine.running)
            self.metrics.waiting = len(self.engine.waiting)

    def _add(self, job: Job) -> None:
        try:
            rid = self.engine.add_request(job.prompt, job.params)
        except ValueError as e:
            with self.metrics.lock:
                self.metrics.rejected += 1
            self._deliver(job, ("error", str(e)))
            return
        job.req_id = rid
        self._jobs[rid] = job
        with self.metrics.lock:
            self.metrics.prompt_tokens += len(job.prompt)
        self._deliver(job, ("accepted", rid))

    def _observe(self, job: Job, req) -> None:
        """Per-step deltas of the request's speculative counters -> metrics."""
        if req.steps == job.seen_steps:
            return
        tried = [t - s for t, s in zip(req.depth_tried, job.seen_tried + [0] * 64)]
        acc = [a - s for a, s in zip(req.depth_accepted, job.seen_accepted + [0] * 64)]
        length = (req.accepted_drafts - job.seen_drafts) // max(req.steps - job.seen_steps, 1)
        self.metrics.observe_accept(length + 1, tried, acc)
        job.seen_steps, job.seen_drafts = req.steps, req.accepted_drafts
        job.seen_tried, job.seen_accepted = list(req.depth_tried), list(req.depth_accepted)

    def _finish(self, job: Job, reason: str | None, error: str | None = None) -> None:
        req = self.engine.requests.pop(job.req_id, None)  # the engine keeps no history
        self._jobs.pop(job.req_id, None)
        stats = req.stats() if req is not None else {}
        with self.metrics.lock:
            key = reason or "abort"
            self.metrics.requests[key] = self.metrics.requests.get(key, 0) + 1
        if error is not None:
            self._deliver(job, ("error", error))
        self._deliver(job, ("done", reason, stats))


# =========================================================================== API schema
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM extension: usage in every chunk


class _SamplingFields(_Strict):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: Any = None
    ignore_eos: bool = False  # vLLM extension
    stop_token_ids: list[int] | None = None  # vLLM extension
    return_token_ids: bool = False  # vLLM extension: generated ids in each choice


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatTextPart(_Strict):
    type: str
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[ChatTextPart] | None = None


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None


class APIError(Exception):
    """An OpenAI-style error response."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type,
        )

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.type)


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    type: str = "invalid_request_error",
) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


# =========================================================================== text output
class TextAssembler:
    """Token ids -> text deltas, with stop strings trimmed and held back.

    Text that could still become a stop string, or that ends in an incomplete
    UTF-8 sequence, is held back until it is safe; a matched stop string and all
    that follows it is never sent.
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.tok = tokenizer
        self.stops = [s for s in stops if s]
        self.ids: list[int] = []
        self.sent = 0
        self.text = ""
        self.stopped = False

    def feed(self, ids: list[int]) -> str:
        """Append tokens; returns the new safe text. Sets ``stopped`` on a stop string."""
        self.ids.extend(ids)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.text = text[: min(hits)]
            return self._take(len(self.text))
        self.text = text
        end = len(text)
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        for k in range(
            min(max((len(s) for s in self.stops), default=1) - 1, end - self.sent), 0, -1
        ):
            if any(s.startswith(text[end - k : end]) for s in self.stops):
                end -= k
                break
        return self._take(end)

    def flush(self) -> str:
        """At the end of the request: everything not sent yet."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out


# =========================================================================== app
class Server:
    """The HTTP layer: request validation, tokenization, streaming."""

    def __init__(self, worker: EngineWorker, tokenizer, model_name: str, info: dict):
        self.worker = worker
        self.tok = tokenizer
        self.model_name = model_name
        self.info = info
        self.max_model_len = worker.engine.max_model_len
        self.vocab_size = worker.engine.vocab_size
        self.created = int(time.time())

    # ------------------------------------------------------------------ helpers
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
                type="NotFoundError",
            )

    def _params(self, body: _SamplingFields, max_tokens: int | None, prompt_len: int):
        from tree_dev.engine import SamplingParams

        if body.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(body, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported", param=name)
        if body.logprobs not in (None, False):
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if max_tokens is None:
            max_tokens = self.max_model_len - prompt_len
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        temperature = 1.0 if body.temperature is None else body.temperature
        if not 0 <= temperature:
            raise APIError(400, f"temperature must be >= 0, got {temperature}", "temperature")
        top_p = 1.0 if body.top_p is None else body.top_p
        if not 0 < top_p <= 1:
            raise APIError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
        if body.seed is not None and not 0 <= body.seed < 2**63:
            raise APIError(400, f"seed must be in [0, 2**63), got {body.seed}", param="seed")
        stop_ids = tuple(body.stop_token_ids or ())
        if any(not 0 <= t < self.vocab_size for t in stop_ids):
            raise APIError(400, "stop_token_ids outside the vocabulary", param="stop_token_ids")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=body.seed,
            stop_token_ids=stop_ids,
            ignore_eos=body.ignore_eos,
        )

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if len(ids) >= self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {len(ids)} tokens (at least one output token must fit).",
                param="prompt",
                code="context_length_exceeded",
            )
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"prompt token {bad} outside [0, {self.vocab_size})", "prompt")

    @staticmethod
    def _stops(stop: str | list[str] | None) -> list[str]:
        return [stop] if isinstance(stop, str) else list(stop or [])

    async def _start(self, ids: list[int], params) -> Job:
        loop = asyncio.get_running_loop()
        job = Job(ids, params, loop, asyncio.Queue())
        self.worker.submit(job)
        try:
            event = await job.events.get()
        except asyncio.CancelledError:  # the client left before admission
            self.worker.abort(job)
            raise
        if event[0] == "error":
            raise APIError(400, event[1], param="prompt")
        return job

    async def _events(self, job: Job, request: Request, asm: TextAssembler) -> AsyncIterator:
        """``(text delta, new token ids, finish_reason, stats)`` until the request ends.

        Aborts the engine request when the client goes away (including when this
        generator is cancelled) or when a stop string matches.
        """
        done, checked = False, time.monotonic()
        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), timeout=DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    event = None
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if event is None:
                    continue
                if event[0] == "tokens":
                    if asm.stopped:
                        continue
                    delta = asm.feed(event[1])
                    if asm.stopped:
                        self.worker.abort(job, "stop")
                    yield delta, event[1], None, None
                elif event[0] == "done":
                    done = True
                    reason = "stop" if asm.stopped else event[1]
                    yield asm.flush(), [], reason, event[2]
                    return
                elif event[0] == "error":
                    raise APIError(500, event[1], type="server_error")
        finally:
            if not done:
                self.worker.abort(job)

    def _usage(self, prompt: int, completion: int) -> dict:
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _treespec(self, stats: dict | None) -> dict:
        return {"tree": self.info["tree"], **(stats or {})}

    # ------------------------------------------------------------------ endpoints
    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        if body.echo or (body.best_of not in (None, 1)) or body.suffix:
            raise APIError(400, "echo, best_of > 1 and suffix are not supported", param="echo")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, "batched prompts are not supported: send one", "prompt")
            prompt = prompt[0]
        ids = (
            self.tok.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
        )
        self._check_prompt(list(ids))
        params = self._params(body, body.max_tokens, len(ids))
        return await self._respond(body, request, list(ids), params, chat=False)

    def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        """The tokenizer's chat template, else ``PLAIN_CHAT_FORMAT`` per message."""
        msgs = []
        for m in messages:
            content = m.content
            if isinstance(content, list):
                if any(p.type != "text" for p in content):
                    raise APIError(400, "only text content parts are supported", "messages")
                content = "".join(p.text for p in content)
            msgs.append({"role": m.role, "content": content or ""})
        if not msgs:
            raise APIError(400, "messages is empty", param="messages")
        if getattr(self.tok, "chat_template", None):
            text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        else:
            text = "".join(PLAIN_CHAT_FORMAT.format(**m) for m in msgs)
            text += PLAIN_CHAT_GENERATION_PROMPT
        return self.tok.encode(text, add_special_tokens=False)

    async def chat(self, body: ChatRequest, request: Request):
        self._check_model(body.model)
        ids = self.chat_prompt(body.messages)
        self._check_prompt(ids)
        max_tokens = body.max_completion_tokens
        max_tokens = body.max_tokens if max_tokens is None else max_tokens
        params = self._params(body, max_tokens, len(ids))
        return await self._respond(body, request, ids, params, chat=True)

    async def _respond(self, body, request: Request, ids: list[int], params, chat: bool):
        asm = TextAssembler(self.tok, self._stops(body.stop))
        job = await self._start(ids, params)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            opts = body.stream_options or StreamOptions()
            gen = self._stream(body, job, request, asm, rid, created, len(ids), chat, opts)
            return StreamingResponse(gen, media_type="text/event-stream")
        reason, stats, parts = None, None, []
        async for delta, _, fin, st in self._events(job, request, asm):
            parts.append(delta)
            reason, stats = fin or reason, st or stats
        text, n_tokens = "".join(parts), len(asm.ids)
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if body.return_token_ids:
            choice["token_ids"] = list(asm.ids)
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [choice],
                "usage": self._usage(len(ids), n_tokens),
                "treespec": self._treespec(stats),
            }
        )

    async def _stream(self, body, job, request, asm, rid, created, n_prompt, chat, opts):
        obj = "chat.completion.chunk" if chat else "text_completion"
        total = 0

        def chunk(delta: str | None, reason: str | None, ids=(), first: bool = False) -> dict:
            if chat:
                d = {"role": "assistant", "content": delta or ""} if first else {}
                if delta and not first:
                    d = {"content": delta}
                c = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
            else:
                c = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
            if body.return_token_ids:
                c["token_ids"] = list(ids)
            out = {"id": rid, "object": obj, "created": created, "model": self.model_name}
            out["choices"] = [c]
            if opts.include_usage and opts.continuous_usage_stats:
                out["usage"] = self._usage(n_prompt, total)
            return out

        def sse(obj: dict) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        try:
            if chat:
                yield sse(chunk("", None, first=True))
            async for delta, ids, reason, stats in self._events(job, request, asm):
                total += len(ids)
                if reason is not None:
                    if delta:
                        yield sse(chunk(delta, None))
                    last = chunk(None, reason)
                    last["treespec"] = self._treespec(stats)
                    yield sse(last)
                    if opts.include_usage:
                        u = {"id": rid, "object": obj, "created": created, "model": self.model_name}
                        yield sse({**u, "choices": [], "usage": self._usage(n_prompt, total)})
                    break
                if delta or ids:
                    yield sse(chunk(delta, None, ids))
        except APIError as e:
            yield sse(
                {"error": {"message": e.message, "type": e.type, "param": None, "code": None}}
            )
        yield "data: [DONE]\n\n"

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "treespec",
                    "root": str(self.info.get("model", "")),
                    "max_model_len": self.max_model_len,
                    "treespec": self.info,
                }
            ],
        }


def _union_tag(part) -> bool:
    """Pydantic names the member of a union in an error location (``str``, ``list[int]``)."""
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool", "none") or "[" in part or part[:1].isupper()
    )


def create_app(engine, tokenizer, model_name: str = "treespec", info: dict | None = None):
    """A FastAPI app serving ``engine``; its worker thread runs during the app's lifespan.

    ``app.state.worker`` is the ``EngineWorker``, ``app.state.metrics`` the ``Metrics``.
    """
    info = {"tree": engine.policy.spec, **(info or {})}
    metrics = Metrics(max_accept=max(engine.policy.max_nodes, 1))
    worker = EngineWorker(engine, metrics)
    server = Server(worker, tokenizer, model_name, info)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="treespec", lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.server = worker, metrics, server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if exc.status < 500:
            with metrics.lock:
                metrics.rejected += 1
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        with metrics.lock:
            metrics.rejected += 1
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _union_tag(p)]
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg = f"malformed JSON body: {first.get('ctx', {}).get('error', msg)}"
        elif loc:
            msg = f"{'.'.join(loc)}: {msg}"
        return error_response(400, msg, param=".".join(loc) or None, code=first.get("type"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), type="invalid_request_error")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await server.chat(body, request)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/health")
    async def health():
        if not worker.alive():
            return error_response(503, "engine thread is not running", type="server_error")
        return {"status": "ok", "running": metrics.running, "waiting": metrics.waiting}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    return app


# =========================================================================== main
def load_engine(cfg: ServeConfig):
    """Load the models and the tokenizer of ``cfg``; returns ``(engine, tokenizer)``."""
    import torch
    from transformers import AutoTokenizer

    from tree_dev.engine import Engine, load_causal_lm

    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    dtype = getattr(torch, cfg.dtype)
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not (cfg.model / "config.json").is_file():
        hint = ""
        if cfg.model.parent == DEFAULT_MODEL_SET:
            hint = " (train it: python -m tree_dev.models train, or give --model PATH)"
        raise SystemExit(f"serve.py: no model at {cfg.model}{hint}")
    target = load_causal_lm(cfg.model, dtype=dtype).to(device)
    draft = eagle = None
    if cfg.drafter == "draft":
        draft = load_causal_lm(cfg.drafter_path, dtype=dtype).to(device)
    elif cfg.drafter == "eagle":
        from tree_dev.models.eagle import EagleHead

        eagle = EagleHead.from_pretrained(cfg.drafter_path, target=target, torch_dtype=dtype)
        eagle = eagle.to(device)
    tok_dir = cfg.tokenizer
    if tok_dir is None:
        for cand in (cfg.model, cfg.model.parent / "tokenizer"):
            if (cand / "tokenizer.json").is_file() or (cand / "tokenizer_config.json").is_file():
                tok_dir = cand
                break
    if tok_dir is None:
        raise SystemExit(f"serve.py: no tokenizer next to {cfg.model}; give --tokenizer PATH")
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    engine = Engine(
        target,
        draft=draft,
        eagle=eagle,
        tree=cfg.tree,
        max_batch=cfg.max_batch,
        max_model_len=cfg.max_model_len,
        kernel_backend=cfg.kernel_backend,
        eos_token_id=tokenizer.eos_token_id if target.config.eos_token_id is None else None,
    )
    return engine, tokenizer


def main(argv: list[str] | None = None) -> None:
    cfg = resolve_config(argv)
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for w in gate_warnings(read_gates_report(cfg.gates_report), cfg.tree, cfg.kernel_backend):
        log.warning("%s (report: %s)", w, cfg.gates_report)
    engine, tokenizer = load_engine(cfg)
    info = {
        "model": str(cfg.model),
        "drafter": cfg.drafter,
        "drafter_path": str(cfg.drafter_path) if cfg.drafter_path else None,
        "tree_source": cfg.tree_source,
        "kernel_backend": cfg.kernel_backend,
    }
    log.info(
        "serving %s (%s) with tree %s [%s], draft %s %s, max_batch %d, max_model_len %d",
        cfg.served_model_name,
        cfg.model,
        cfg.tree,
        cfg.tree_source,
        cfg.drafter,
        cfg.drafter_path or "",
        cfg.max_batch,
        cfg.max_model_len,
    )
    app = create_app(engine, tokenizer, cfg.served_model_name, info)
    import uvicorn

    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level)


if __name__ == "__main__":
    main()
