"""The ``python -m bench`` kernel report (bench/report.py) on tiny shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

import kernels
from bench import report
from kernels import reference


@pytest.fixture
def fake_backend(monkeypatch):
    """A backend with a wrong tree_walk, a tree_attention that raises, and no kv_compact."""
    module = types.ModuleType("fake_backend_for_tests")

    def tree_walk(logits, tokens, tree, mode, **kwargs):
        res = reference.tree_walk(logits, tokens, tree, mode, **kwargs)
        return res._replace(output_tokens=res.output_tokens + 1)  # off by one

    def tree_attention(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    module.tree_walk = tree_walk
    module.tree_attention = tree_attention
    monkeypatch.setitem(sys.modules, "fake_backend_for_tests", module)
    monkeypatch.setitem(kernels.BACKENDS, "fake", "fake_backend_for_tests")
    return "fake"


def test_report_rows(monkeypatch, fake_backend):
    real_status = kernels.backend_status

    def status(name):
        if name == "nki":
            return False, "Neuron SDK not installed (test)"
        return real_status(name)

    monkeypatch.setattr(kernels, "backend_status", status)
    rows, info = report.run_report(
        "tiny", backends=["reference", "nki", fake_backend], repeats=1, progress=False
    )
    cases = report.build_cases("tiny")
    assert len(rows) == 3 * len(cases)
    assert {c.op for c in cases} == set(kernels.OPS)
    assert info["nki"] == {"available": False, "note": "Neuron SDK not installed (test)"}
    by = {}
    for r in rows:
        by.setdefault((r.backend, r.op), []).append(r)

    for r in (r for r in rows if r.backend == "reference"):
        assert r.status == "ok" and r.exact is True, r
        assert r.median_ms is not None and r.median_ms > 0 and r.runs == 1
        if r.op == "tree_attention":
            assert r.max_err == 0.0
    for r in (r for r in rows if r.backend == "nki"):
        assert r.status == "absent" and r.note == "Neuron SDK not installed (test)"
        assert r.median_ms is None and r.max_err is None
    for r in by[(fake_backend, "tree_walk")]:
        assert r.status == "mismatch" and r.exact is False
    for r in by[(fake_backend, "tree_attention")]:
        assert r.status == "error" and "RuntimeError: kernel exploded" in r.note
    for r in by[(fake_backend, "kv_compact")]:
        assert r.status == "not available" and "kv_compact" in r.note

    text = report.format_table(rows, info)
    assert "nki        ABSENT: Neuron SDK not installed (test)" in text
    assert "absent: Neuron SDK not installed (test)" in text
    assert "not available: AttributeError" in text
    assert "exact: NO" in text and "exact: yes" in text


def test_report_measures_errors_against_the_reference(monkeypatch, fake_backend):
    # an attention backend that is off by 1e-3 is reported with that error, as a mismatch
    def off(*args, **kwargs):
        out, lse = reference.tree_attention(*args, **kwargs)
        return out + 1e-3, lse

    monkeypatch.setattr(sys.modules["fake_backend_for_tests"], "tree_attention", off)
    rows, _ = report.run_report(
        "tiny", backends=[fake_backend], repeats=0, ops=["tree_attention"], progress=False
    )
    fp32 = [r for r in rows if "float32" in r.case]
    bf16 = [r for r in rows if "bfloat16" in r.case]
    assert fp32 and bf16
    for r in fp32:  # 1e-3 is above the fp32 tolerance
        assert r.status == "mismatch" and r.max_err == pytest.approx(1e-3, rel=1e-2)
    for r in bf16:  # and within bf16's (the added 1e-3 rounds away or to one bf16 ulp)
        assert r.status == "ok" and r.max_err < report.TOLERANCE[torch.bfloat16]
    assert all(r.runs == 0 and r.median_ms is None for r in rows)


def test_main_writes_json_and_returns_failure_on_mismatch(tmp_path, capsys, fake_backend):
    out = tmp_path / "report.json"
    code = report.main(
        ["--size", "tiny", "--backends", "reference", "--ops", "tree_walk,kv_compact",
         "--repeats", "1", "--out", str(out), "--no-plot"]
    )  # fmt: skip
    assert code == 0
    payload = json.loads(out.read_text())
    assert {b for b in payload["backends"]} == {"reference"}
    assert payload["backends"]["reference"]["available"] is True
    assert {r["op"] for r in payload["rows"]} == {"tree_walk", "kv_compact"}
    assert all(r["status"] == "ok" and r["exact"] for r in payload["rows"])
    assert list(tmp_path.iterdir()) == [out]  # no temp file left behind
    assert "exact: yes" in capsys.readouterr().out
    code = report.main(
        ["--size", "tiny", "--backends", f"reference,{fake_backend}", "--ops", "tree_walk",
         "--repeats", "0", "--out", str(out), "--no-plot"]
    )  # fmt: skip
    assert code == 1


def test_importing_bench_sets_triton_interpret_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: Triton runs natively (no GPU on CI)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import os, bench; print(os.environ.get('TRITON_INTERPRET'))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "1"
