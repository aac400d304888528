"""``--engine vllm``: run vLLM's own OpenAI server (not a reimplementation of it).

``exec_vllm(cfg)`` replaces this process with ``python -m
vllm.entrypoints.openai.api_server`` and the arguments of ``config.vllm_argv`` (the
tree plugin is loaded by vLLM itself, through its ``vllm.general_plugins`` entry
point, from ``--speculative-config`` / ``--additional-config``). The only addition is
``treespec_models``, an HTTP middleware that vLLM loads through its public
``--middleware`` option: it adds a ``treespec`` object (engine, tree, draft) to every
model card of ``GET /v1/models``. It reads that object from the environment variable
``TREESPEC_SERVE_INFO`` (JSON), which ``exec_vllm`` sets. With ``tree: auto`` a second
middleware, ``treespec_metrics``, appends auto's statistics (choices per request class,
predicted vs measured step seconds, ``auto_metrics.auto_metrics_lines``) to vLLM's
``GET /metrics``: it asks the engine's workers for them (``treespec_tree_stats``, key
``"auto"``, through the engine client's ``collective_rpc``). This module never imports
vLLM.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tree_dev.server.auto_metrics import auto_metrics_lines
from tree_dev.server.config import ServeConfig, vllm_argv

INFO_ENV = "TREESPEC_SERVE_INFO"
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: The longest a ``GET /metrics`` waits for the workers' tree statistics.
TREE_STATS_TIMEOUT_S = 10.0

log = logging.getLogger("treespec.serve")


def is_project_eagle_head(path: Path | None) -> bool:
    """Whether ``path`` holds the project's EAGLE head format (``config.json`` key ``eagle``)."""
    try:
        return "eagle" in json.loads((Path(path) / "config.json").read_text())
    except (OSError, TypeError, json.JSONDecodeError):
        return False


def for_vllm(cfg: ServeConfig) -> ServeConfig:
    """``cfg`` with a project-format EAGLE head replaced by its vLLM export (cached).

    ``tree_dev.models.export_vllm`` writes it under ``results/vllm_eagle/<digest>/``.
    """
    if cfg.drafter != "eagle" or not is_project_eagle_head(cfg.drafter_path):
        return cfg
    from tree_dev.models.export_vllm import export_eagle_for_vllm

    return replace(cfg, drafter_path=export_eagle_for_vllm(head_dir=cfg.drafter_path))


def vllm_command(cfg: ServeConfig) -> list[str]:
    """The full command line of vLLM's server for ``cfg``."""
    return [sys.executable, "-m", VLLM_SERVER_MODULE, *vllm_argv(cfg)]


def vllm_env(cfg: ServeConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of vLLM's server: ``base`` (default ``os.environ``) + the policy info."""
    env = dict(os.environ if base is None else base)
    env[INFO_ENV] = json.dumps(cfg.info())
    if cfg.tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        env["VLLM_CPU_OMP_THREADS_BIND"] = rank_core_groups(cfg.tensor_parallel_size)
    return env


def rank_core_groups(ranks: int, cores: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` TP ranks on the CPU: the usable cores in
    ``ranks`` equal groups (2 ranks on 2 cores ``"0|1"``, on 8 cores ``"0,1,2,3|4,5,6,7"``).

    vLLM's default (``auto``) binds by NUMA node, one list for a one-node machine, which
    TP > 1 refuses. (``accuracy.vllm_compare.cpu_threads_bind`` applies the same rule for
    ``hf-vs-vllm``; ``accuracy`` imports nothing of ``tree_dev``, nor the reverse.)

    Raises:
        ValueError: fewer usable cores than ranks.
    """
    if cores is None:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        cores = cores or list(range(os.cpu_count() or 1))
    if len(cores) < ranks:
        raise ValueError(f"--tensor-parallel-size {ranks}: only {len(cores)} CPU cores to bind")
    per = len(cores) // ranks
    return "|".join(",".join(map(str, cores[i * per : (i + 1) * per])) for i in range(ranks))


def exec_vllm(cfg: ServeConfig) -> None:
    """Replace this process with vLLM's OpenAI server for ``cfg`` (never returns)."""
    cfg = for_vllm(cfg)
    cmd = vllm_command(cfg)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], cmd, vllm_env(cfg))


def _info() -> dict[str, Any]:
    try:
        info = json.loads(os.environ.get(INFO_ENV, "{}"))
    except json.JSONDecodeError:
        info = {}
    return info if isinstance(info, dict) else {}


async def treespec_models(request: Request, call_next) -> Response:
    """HTTP middleware: ``GET /v1/models`` cards gain ``treespec`` (engine, tree, draft)."""
    response = await call_next(request)
    if request.method != "GET" or request.url.path != "/v1/models":
        return response
    if response.status_code != 200:
        return response
    body = b"".join([chunk async for chunk in response.body_iterator])
    try:
        payload = json.loads(body)
    except json.JSONDecodeError:
        return Response(body, status_code=response.status_code, media_type="application/json")
    info = _info()
    for card in payload.get("data", []) if isinstance(payload, dict) else []:
        if isinstance(card, dict):
            card["treespec"] = info
    return JSONResponse(payload, status_code=response.status_code)


async def _auto_stats(request: Request) -> dict[str, Any] | None:
    """``tree: auto``'s statistics of the first worker (``treespec_tree_stats``' ``"auto"``
    key) through vLLM's engine client (``app.state.engine_client``); None when the engine
    has no auto tree or cannot be asked (logged)."""
    client = getattr(request.app.state, "engine_client", None)
    if client is None:
        return None
    try:
        results = await client.collective_rpc("treespec_tree_stats", timeout=TREE_STATS_TIMEOUT_S)
    except Exception as e:  # /metrics keeps serving vLLM's own metrics
        log.warning("/metrics: treespec_tree_stats failed: %s: %s", type(e).__name__, e)
        return None
    first = results[0] if isinstance(results, list | tuple) and results else None
    stats = first.get("auto") if isinstance(first, dict) else None
    return stats if isinstance(stats, dict) else None


async def treespec_metrics(request: Request, call_next) -> Response:
    """HTTP middleware: ``GET /metrics`` gains ``tree: auto``'s statistics
    (``auto_metrics_lines``) after vLLM's own, as plain Prometheus text."""
    response = await call_next(request)
    if request.method != "GET" or request.url.path.rstrip("/") != "/metrics":
        return response
    if response.status_code != 200:
        return response
    body = b"".join([chunk async for chunk in response.body_iterator])
    headers = {
        k: v
        for k, v in response.headers.items()
        if k.lower() not in ("content-length", "content-encoding")
    }
    if response.headers.get("content-encoding") == "gzip":
        body = gzip.decompress(body)
    stats = await _auto_stats(request)
    if stats is not None:
        if body and not body.endswith(b"\n"):
            body += b"\n"
        body += ("\n".join(auto_metrics_lines(stats)) + "\n").encode()
    return Response(body, status_code=response.status_code, headers=headers)
