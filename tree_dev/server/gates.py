"""Start-up warnings from the stage gates report (``python -m bench.gates``).

The report (``results/gates.json`` for the local engine, ``results/gates_vllm.json``
for vLLM) is ``{"stages": [{"name", "passed", "measured", "threshold"}, ...],
"config": {"engine", "tree", "kernel_backend", ...}}``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

GATE_STAGES = ("kernels", "verify", "propose", "serve")

log = logging.getLogger("treespec.serve")


def gate_warnings(
    report: dict | None, tree: str, kernel_backend: str = "auto", engine: str = "local"
) -> list[str]:
    """Warnings for stages of this configuration whose gate failed or never ran.

    Plain decoding (``tree == "none"``) needs the kernels and serve gates; a tree
    policy needs all four. A report whose ``config.engine``, ``config.tree`` or
    ``config.kernel_backend`` differs from this server's does not vouch for it (a
    report without ``config.engine`` is the local engine's).
    """
    needed = ("kernels", "serve") if tree == "none" else GATE_STAGES
    if report is None:
        return [
            f"gate '{s}' never ran for engine {engine} (no gates report): run "
            f"python -m bench.gates --engine {engine}"
            for s in needed
        ]
    out = []
    cfg = dict(report.get("config") or {})
    cfg.setdefault("engine", "local")
    for key, ours in (("engine", engine), ("tree", tree), ("kernel_backend", kernel_backend)):
        if key in cfg and cfg[key] != ours:
            out.append(
                f"gates report was measured with {key}={cfg[key]!r}, this server uses {ours!r}"
            )
    stages = {s.get("name"): s for s in report.get("stages", []) if isinstance(s, dict)}
    for name in needed:
        s = stages.get(name)
        if s is None or s.get("passed") is None:
            out.append(f"gate '{name}' never ran for engine {engine}")
        elif not s.get("passed"):
            out.append(
                f"gate '{name}' FAILED for engine {engine}: measured {s.get('measured')!r}, "
                f"threshold {s.get('threshold')!r}"
            )
    return out


def read_gates_report(path: Path) -> dict | None:
    """The report as a dict, or None when it is absent or unreadable (warned about)."""
    try:
        report = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        log.warning("cannot read gates report %s: %s", path, e)
        return None
    return report if isinstance(report, dict) else None
