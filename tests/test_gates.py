"""bench.gates: threshold logic, config parsing, stop-at-first-failure and the report format.

Stages are replaced by fakes (the real ones load models and start servers); the
kernels stage runs for real on the tiny kernel-report cases, and the report is fed
to serve.py's own reader to prove the two agree on the format.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path

import pytest
import torch

from bench import gates
from bench.gates import Check, ConfigError, Context, load_config, passes

# ----------------------------------------------------------------------------- thresholds


@pytest.mark.parametrize(
    ("measured", "op", "threshold", "want"),
    [
        (1.0, ">=", 1.0, True),
        (0.999, ">=", 1.0, False),
        (1.2, ">=", 1.0, True),
        (1.0, "<=", 1.0, True),
        (1.001, "<=", 1.0, False),
        (0.5, "<=", 1.0, True),
        (3, "==", 3, True),
        (2, "==", 3, False),
        (None, ">=", 0.0, False),
        (math.nan, "<=", 1.0, False),
        (math.nan, ">=", -1.0, False),
    ],
)
def test_passes(measured, op, threshold, want):
    assert passes(measured, op, threshold) is want


def test_unknown_comparison_is_an_error():
    with pytest.raises(ValueError, match="unknown comparison '>'"):
        passes(1.0, ">", 0.0)


def test_stage_result_fails_when_any_check_fails_or_nothing_was_measured():
    ok, bad = Check("a", 1.0, ">=", 1.0), Check("b", 1.5, "<=", 1.0)
    r = gates.stage_result("kernels", [ok, bad], {}, 1.234)
    assert r.passed is False
    assert r.measured == {"a": 1.0, "b": 1.5}
    assert r.threshold == {"a": ">= 1", "b": "<= 1"}
    assert r.seconds == 1.23
    assert gates.stage_result("kernels", [ok], {}, 0.0).passed is True
    empty = gates.stage_result("kernels", [], {}, 0.0)
    assert empty.passed is False and "measured nothing" in empty.detail["error"]
    assert "FAILED" in bad.describe() and "<= 1" in bad.describe()


# ----------------------------------------------------------------------------- config
GOOD = """
[run]
engine = "local"
models = ""
tree = "chain:3"
kernel_backend = "torch"
threads = 1

[kernels]
report_size = "small"
repeats = 3
min_agree = 1
shapes = [[1, 8, 64]]
dtypes = ["fp32"]
heads = [4, 2, 16]
seconds_per_shape = 0.5
max_sdpa_ratio = 1.0

[verify]
prompts = 16
prompt_tokens = 32
max_tokens = 20
min_identical = 1.0

[propose]
topk = ""
fallback = "topk:k=2,depth=3,budget=6"
vllm_fallback = "topk:k=2,depth=3,budget=6"
prompts = 8
prompt_tokens = 32
max_tokens = 20
min_tau_ratio = 1.0

[serve]
prompts = 5
max_tokens = 30
min_identical = 1.0
rounds = 3
requests_per_round = 2
throughput_max_tokens = 64
min_throughput_ratio = 1.0

[quick.serve]
prompts = 2
rounds = 1

[quick.kernels]
report_size = "tiny"
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gates.toml"
    path.write_text(text)
    return path


def test_config_quick_overrides_only_what_it_names(tmp_path):
    path = _write(tmp_path, GOOD)
    full, quick = load_config(path), load_config(path, quick=True)
    assert full["serve"]["prompts"] == 5 and full["serve"]["rounds"] == 3
    assert quick["serve"]["prompts"] == 2 and quick["serve"]["rounds"] == 1
    assert quick["serve"]["max_tokens"] == 30  # not overridden
    assert (full["kernels"]["report_size"], quick["kernels"]["report_size"]) == ("small", "tiny")
    assert full["run"]["tree"] == "chain:3" and full["kernels"]["shapes"] == [[1, 8, 64]]


def test_committed_config_parses_in_both_modes():
    for quick in (False, True):
        cfg = load_config(gates.DEFAULT_CONFIG, quick=quick)
        assert set(cfg) == set(gates.SCHEMA)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace("prompts = 16", "prompts = = 16"), "not valid TOML"),
        (lambda t: t.replace("prompts = 16", "promts = 16"), r"unknown key 'promts' in \[verify\]"),
        (lambda t: t.replace("repeats = 3", 'repeats = "3"'), r"\[kernels\] repeats must be int"),
        (
            lambda t: t.replace("min_agree = 1", "min_agree = true"),
            r"\[kernels\] min_agree must be float",
        ),
        (lambda t: t.replace("[verify]", "[verfy]"), r"unknown section \[verfy\]"),
        (lambda t: t.replace("max_tokens = 20\nmin_identical", "min_identical"), "lacks max_tok"),
        (lambda t: t + "\n[quick.nope]\nx = 1\n", r"unknown section \[quick.nope\]"),
        (lambda t: t + "\n[quick.verify]\nprompts = 0\n", r"\[verify\] prompts must be >= 1"),
        (lambda t: t.replace("[[1, 8, 64]]", "[[1, 8]]"), "shapes must be"),
        (lambda t: t.replace('["fp32"]', '["fp64"]'), "'fp64' is not"),
        (lambda t: t.replace("rounds = 3", "rounds = -3"), "rounds must be >= 0"),
        (lambda t: t.replace('engine = "local"', 'engine = "sglang"'), r"\[run\] engine must be"),
    ],
)
def test_bad_config_names_the_problem(tmp_path, edit, message):
    path = _write(tmp_path, edit(GOOD))
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path, quick=True)
    assert str(path) in str(info.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.toml")


def test_cli_reports_a_bad_config_and_exits_2(tmp_path, capsys):
    path = _write(tmp_path, GOOD.replace("[serve]", "[serve]\nbogus = 1"))
    with pytest.raises(SystemExit) as info:
        gates.main(["--config", str(path), "--out", str(tmp_path / "g.json")])
    assert info.value.code == 2
    assert "unknown key 'bogus' in [serve]" in capsys.readouterr().err
    assert not (tmp_path / "g.json").exists()


# ----------------------------------------------------------------------------- running
CONFIG = {
    "tree": "topk:k=2,depth=3,budget=6",
    "drafter": "eagle",
    "kernel_backend": "auto",
    "quick": True,
}


def _fake_stages(outcomes: dict[str, object], calls: list[str]):
    """Stage functions returning one check each: a measured value >= 1.0 passes."""

    def make(name):
        def fn(ctx, cfg):
            calls.append(name)
            value = outcomes[name]
            if isinstance(value, Exception):
                raise value
            return [Check(f"{name}_value", value, ">=", 1.0)], {"seen": cfg["marker"]}

        return fn

    return {name: make(name) for name in gates.STAGES}


@pytest.fixture
def ctx(monkeypatch):
    monkeypatch.setattr(Context, "report_config", lambda self: dict(CONFIG))
    return Context({"models": "", "tree": "", "kernel_backend": "auto", "threads": 1}, quick=True)


def _cfg():
    return {name: {"marker": name} for name in gates.STAGES}


def test_all_stages_run_in_order_and_the_report_has_the_format(ctx, tmp_path):
    calls: list[str] = []
    out = tmp_path / "sub" / "gates.json"
    stages = _fake_stages({n: 1.0 + i for i, n in enumerate(gates.STAGES)}, calls)
    results = gates.run_gates(ctx, _cfg(), out, stage_fns=stages, log=lambda s: None)
    assert calls == ["kernels", "verify", "propose", "serve"]
    assert [r.passed for r in results] == [True] * 4
    report = json.loads(out.read_text())
    assert set(report) == {"stages", "config", "created", "git_revision"}
    assert [s["name"] for s in report["stages"]] == list(gates.STAGES)
    for i, s in enumerate(report["stages"]):
        assert set(s) == {"name", "passed", "measured", "threshold", "detail", "seconds"}
        assert s["passed"] is True
        assert s["measured"] == {f"{s['name']}_value": 1.0 + i}
        assert s["threshold"] == {f"{s['name']}_value": ">= 1"}
        assert s["detail"] == {"seen": s["name"]}  # each stage got its own config table
        assert isinstance(s["seconds"], float) and s["seconds"] >= 0
    assert report["config"] == CONFIG
    assert datetime.fromisoformat(report["created"]).tzinfo is not None
    rev = report["git_revision"]
    assert rev is None or (len(rev) == 40 and all(c in "0123456789abcdef" for c in rev))
    assert not list(out.parent.glob("*.tmp"))  # atomic write leaves no temp file


def test_stops_at_the_first_failure_and_says_why(ctx, tmp_path):
    calls: list[str] = []
    lines: list[str] = []
    out = tmp_path / "gates.json"
    stages = _fake_stages({"kernels": 1.0, "verify": 0.75, "propose": 2.0, "serve": 2.0}, calls)
    results = gates.run_gates(ctx, _cfg(), out, stage_fns=stages, log=lines.append)
    assert calls == ["kernels", "verify"]
    assert [(r.name, r.passed) for r in results] == [("kernels", True), ("verify", False)]
    failure = [ln for ln in lines if "FAILED in" in ln]
    assert len(failure) == 1 and failure[0].startswith("[verify]")
    assert "0.75" in failure[0] and ">= 1" in failure[0]
    assert any("not run: propose, serve" in ln for ln in lines)
    report = json.loads(out.read_text())
    by_name = {s["name"]: s for s in report["stages"]}
    assert by_name["verify"]["passed"] is False
    assert by_name["verify"]["measured"] == {"verify_value": 0.75}
    for name in ("propose", "serve"):
        assert by_name[name]["passed"] is None and by_name[name]["measured"] is None


def test_a_crashing_stage_fails_with_its_error(ctx, tmp_path):
    calls: list[str] = []
    stages = _fake_stages(
        {"kernels": RuntimeError("server died"), "verify": 1, "propose": 1, "serve": 1}, calls
    )
    results = gates.run_gates(ctx, _cfg(), tmp_path / "g.json", stage_fns=stages, log=print)
    assert calls == ["kernels"] and results[0].passed is False
    assert results[0].detail["error"] == "RuntimeError: server died"
    assert results[0].measured == {}


def test_main_exit_status_and_report(ctx, tmp_path, monkeypatch, capsys):
    out = tmp_path / "gates.json"
    path = _write(tmp_path, GOOD)
    calls: list[str] = []
    for outcome, status in ((2.0, 0), (0.5, 1)):
        fakes = _fake_stages(dict.fromkeys(gates.STAGES, 2.0) | {"serve": outcome}, calls)
        for name, fn in fakes.items():
            monkeypatch.setitem(gates.STAGE_FNS, name, lambda c, cfg, fn=fn: fn(c, {"marker": 1}))
        assert gates.main(["--quick", "--config", str(path), "--out", str(out)]) == status
        stages = json.loads(out.read_text())["stages"]
        assert stages[-1]["passed"] is (status == 0)
    assert "gates: FAILED" in capsys.readouterr().out


def test_serve_py_reads_the_report(ctx, tmp_path):
    """serve.py's start-up check agrees with the report: silent when every gate passed,
    naming the failed and never-run stages otherwise."""
    from tree_dev.server import gates as serve

    out = tmp_path / "gates.json"
    fakes = _fake_stages(dict.fromkeys(gates.STAGES, 1.0), [])
    gates.run_gates(ctx, _cfg(), out, stage_fns=fakes, log=lambda s: None)
    report = serve.read_gates_report(out)
    assert serve.gate_warnings(report, CONFIG["tree"], "auto") == []
    assert any("tree=" in w for w in serve.gate_warnings(report, "chain:4", "auto"))
    fakes = _fake_stages({"kernels": 1.0, "verify": 1.0, "propose": 0.5, "serve": 1.0}, [])
    gates.run_gates(ctx, _cfg(), out, stage_fns=fakes, log=lambda s: None)
    warnings = serve.gate_warnings(serve.read_gates_report(out), CONFIG["tree"], "auto")
    assert any("'propose' FAILED" in w and "0.5" in w for w in warnings)
    assert any("'serve' never ran" in w for w in warnings)
    assert not any("'kernels'" in w or "'verify'" in w for w in warnings)


def test_vllm_engine_runs_the_vllm_stages_and_serve_py_tells_the_engines_apart(
    ctx, tmp_path, monkeypatch
):
    """``[run] engine = "vllm"``: the vLLM stage functions run (the kernels stage is
    shared), the report names the engine, and only a vLLM server takes it as its own."""
    from tree_dev.server import gates as serve

    assert gates.VLLM_STAGE_FNS["kernels"] is gates.STAGE_FNS["kernels"]
    assert [gates.VLLM_STAGE_FNS[n] for n in ("verify", "propose", "serve")] == [
        gates.stage_verify_vllm,
        gates.stage_propose_vllm,
        gates.stage_serve_vllm,
    ]
    calls: list[str] = []
    for name, fn in _fake_stages(dict.fromkeys(gates.STAGES, 1.0), calls).items():
        monkeypatch.setitem(gates.VLLM_STAGE_FNS, name, fn)
    ctx.run["engine"] = "vllm"
    monkeypatch.setattr(Context, "report_config", lambda self: {**CONFIG, "engine": self.engine})
    out = tmp_path / "gates_vllm.json"
    gates.run_gates(ctx, _cfg(), out, log=lambda s: None)
    assert calls == list(gates.STAGES)
    report = serve.read_gates_report(out)
    assert report["config"]["engine"] == "vllm"
    assert serve.gate_warnings(report, CONFIG["tree"], "auto", engine="vllm") == []
    local = serve.gate_warnings(report, CONFIG["tree"], "auto", engine="local")
    assert any("engine='vllm'" in w for w in local)


# ----------------------------------------------------------------------------- stage pieces
def test_propose_specs():
    topk = "topk:k=4,depth=5,budget=32"
    assert gates.propose_specs(topk, "", "topk:k=2,depth=2,budget=4") == (topk, "chain:32", 32)
    fallback = "topk:k=2,depth=3,budget=6"
    assert gates.propose_specs("chain:4", "", fallback) == (fallback, "chain:6", 6)
    assert gates.propose_specs("none", "", fallback) == (fallback, "chain:6", 6)
    override = "topk:k=3,depth=3,budget=9"
    assert gates.propose_specs(topk, override, fallback) == (override, "chain:9", 9)
    with pytest.raises(ValueError, match="not a top-K policy"):
        gates.propose_specs("none", "chain:4", fallback)


def test_greedy_reference_matches_recomputing_the_whole_sequence():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    prompt = [5, 17, 3, 88, 41, 2]
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(12):  # no KV cache: the whole sequence every step
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert gates.greedy_reference(model, prompt, 12) == ids[len(prompt) :]


def _kernel_cfg(**over):
    cfg = {
        "report_size": "tiny",
        "repeats": 1,
        "min_agree": 1.0,
        "shapes": [[1, 4, 32]],
        "dtypes": ["fp32"],
        "heads": [2, 1, 16],
        "seconds_per_shape": 0.05,
        "max_sdpa_ratio": 100.0,
    }
    return cfg | over


def test_kernels_stage_on_the_tiny_report(ctx):
    checks, detail = gates.stage_kernels(ctx, _kernel_cfg())
    by_name = {c.name: c for c in checks}
    assert by_name["backends_agree"].measured == 1.0, detail["disagreeing"]
    assert detail["pairs_compared"] >= 7  # 7 tiny cases on at least the reference backend
    ratio = by_name["torch_over_dense_sdpa"].measured
    (shape,) = detail["sdpa_shapes"]
    assert ratio == pytest.approx(shape["torch_ms"] / shape["dense_sdpa_ms"])


def test_kernels_stage_fails_on_a_disagreeing_backend_without_timing(ctx, monkeypatch):
    from bench import attention, report

    real = report.run_report

    def broken(*args, **kwargs):
        rows, info = real(*args, **kwargs)
        rows[1].status, rows[1].note = "mismatch", "off by one"
        return rows, info

    monkeypatch.setattr(report, "run_report", broken)
    monkeypatch.setattr(attention, "time_cpu", lambda *a, **k: pytest.fail("timed anyway"))
    checks, detail = gates.stage_kernels(ctx, _kernel_cfg())
    assert [c.name for c in checks] == ["backends_agree"]
    n = detail["pairs_compared"]
    assert checks[0].measured == pytest.approx((n - 1) / n) and not checks[0].passed
    assert len(detail["disagreeing"]) == 1 and "off by one" in detail["disagreeing"][0]


def test_cli_rejects_a_bad_tree_before_running_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        gates.main(["--tree", "chain:x", "--out", str(tmp_path / "g.json")])
    assert info.value.code == 2
    assert "argument --tree" in capsys.readouterr().err
    assert not (tmp_path / "g.json").exists()


def test_timing_advisory_reports_a_missed_time_without_failing(ctx, tmp_path):
    def timed(ctx, cfg):
        return [
            Check("outputs_identical", 1.0, ">=", 1.0),
            Check("tree_over_none_throughput", 0.8, ">=", 1.0, timing=True),
        ], {}

    def wrong(ctx, cfg):
        return [
            Check("outputs_identical", 0.5, ">=", 1.0),
            Check("t", 2.0, ">=", 1.0, timing=True),
        ], {}

    stages = {n: timed for n in gates.STAGES}
    strict = gates.run_gates(ctx, _cfg(), None, stage_fns=stages, log=lambda s: None)
    assert [r.passed for r in strict] == [False]  # without the flag a missed time fails
    lines: list[str] = []
    advisory = gates.run_gates(
        ctx, _cfg(), None, stage_fns=stages, log=lines.append, timing_advisory=True
    )
    assert [r.passed for r in advisory] == [True] * 4
    assert advisory[0].detail["timing_misses"] == ["tree_over_none_throughput"]
    assert advisory[0].measured["tree_over_none_throughput"] == 0.8  # still reported
    assert any("timing advisory, missed: tree_over_none_throughput" in ln for ln in lines)
    # a correctness check still fails the gate under the flag
    stages = {n: wrong for n in gates.STAGES}
    failed = gates.run_gates(
        ctx, _cfg(), None, stage_fns=stages, log=lambda s: None, timing_advisory=True
    )
    assert [r.passed for r in failed] == [False]
