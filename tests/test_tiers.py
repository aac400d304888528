"""The test tiers' guards (``tests/conftest.py``), run on probe modules in a subprocess:
the fast tier fails when a second vLLM engine starts, and a real-model test without the
``full`` mark is refused at collection."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAST = "not full and not gpu and not neuron"
ALL = "not gpu and not neuron"


def _pytest(markexpr: str, probe: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", markexpr]
    cmd += [*extra, f"tests/probes/{probe}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_fast_tier_fails_on_a_second_engine_start():
    fast = _pytest(FAST, "tier_engines.py")
    assert fast.returncode == 1, fast.stdout[-2000:]
    assert "the fast tier started 2 vLLM engines (at most 1)" in fast.stdout
    assert "1 passed" in fast.stdout  # the test itself passed: the guard failed the run
    full = _pytest(ALL, "tier_engines.py")
    assert full.returncode == 0, full.stdout[-2000:]
    assert "0 in-process (vllm.LLM), 2 server processes" in full.stdout


def test_a_real_model_test_without_the_full_mark_is_refused_by_name():
    run = _pytest(ALL, "tier_real_model.py")
    assert run.returncode == 4, run.stdout[-2000:] + run.stderr[-2000:]
    out = run.stdout + run.stderr
    assert "must be marked full" in out and "test_asks_for_the_real_model_unmarked" in out


def test_engine_start_ups_are_reported_from_xdist_workers():
    """``make test-all`` runs two pytest-xdist workers: the start-ups they record reach
    the controller's report (a worker's own report is never shown)."""
    run = _pytest(ALL, "tier_engines.py", "-n", "2")
    assert run.returncode == 0, run.stdout[-2000:]
    assert "0 in-process (vllm.LLM), 2 server processes" in run.stdout
