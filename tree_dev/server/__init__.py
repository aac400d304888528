"""``serve.py``'s server as a package: one OpenAI-compatible front over two engines.

- ``config``: flags (the project's, vLLM's and SGLang's tree flags) -> ``ServeConfig``;
  ``vllm_argv`` maps it onto vLLM's server arguments.
- ``protocol``: OpenAI request schemas and error bodies (local engine).
- ``worker``: the thread that owns the local ``Engine``, and ``/metrics``.
- ``auto_metrics``: ``tree: auto``'s statistics as Prometheus text (both engines).
- ``app``: the local engine's FastAPI app (``create_app``) and ``load_engine``.
- ``vllm_front``: ``--engine vllm`` runs vLLM's own OpenAI server (``exec_vllm``).
- ``gates``: start-up warnings from the stage gates report.

``main(argv)`` is ``python serve.py``.
"""

from __future__ import annotations

import logging

from tree_dev.server.config import ServeConfig, resolve_config
from tree_dev.server.gates import gate_warnings, read_gates_report

log = logging.getLogger("treespec.serve")

__all__ = ["ServeConfig", "main", "resolve_config"]


def main(argv: list[str] | None = None) -> None:
    """Resolve the flags, warn about gates, then serve with the chosen engine."""
    cfg = resolve_config(argv)
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    report = read_gates_report(cfg.gates_report)
    for w in gate_warnings(report, cfg.tree, cfg.kernel_backend, cfg.engine):
        log.warning("%s (report: %s)", w, cfg.gates_report)
    log.info(
        "serving %s (%s) on engine %s with tree %s [%s], draft %s %s, max_batch %d, "
        "max_model_len %d",
        cfg.served_model_name,
        cfg.model,
        cfg.engine,
        cfg.tree,
        cfg.tree_source,
        cfg.drafter,
        cfg.drafter_path or "",
        cfg.max_batch,
        cfg.max_model_len,
    )
    if cfg.engine == "vllm":
        from tree_dev.server.vllm_front import exec_vllm, for_vllm, vllm_command

        cfg = for_vllm(cfg)  # a project EAGLE head -> its vLLM export
        log.info("exec %s", " ".join(vllm_command(cfg)))
        exec_vllm(cfg)
        return
    from tree_dev.server.app import create_app, load_engine

    engine, tokenizer = load_engine(cfg)
    app = create_app(engine, tokenizer, cfg.served_model_name, cfg.info())
    import uvicorn

    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level)
