"""``python -m accuracy hf-vs-vllm`` on a compiled vLLM engine (torch.compile, not
``enforce_eager``): the hooks are traced into the graph once, capture causes no
recompilation, the captures match HF and the command exits 0 with both reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _vllm_accuracy_helpers import PROMPTS, ROOT, TARGET, have_vllm  # noqa: E402

pytestmark = [
    pytest.mark.full,  # make test-all only: a compiled vLLM engine
    pytest.mark.skipif(not have_vllm(), reason="vLLM is not installed (scripts/setup)"),
]


def _run_cli(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    env = dict(os.environ, VLLM_PLUGINS="treespec_accuracy", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, "-m", "accuracy", "hf-vs-vllm", "--model", TARGET]
    cmd += ["--prompts", str(prompts), "--max-tokens", "6", "--out", str(tmp_path / "out")]
    return subprocess.run(
        cmd + list(extra), cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_vs_vllm")
    return d, _run_cli(d)


def test_hf_vs_vllm_passes_with_both_reports(compiled):
    d, res = compiled
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert "TENSOR COMPARISON: HF FP32 vs vLLM" in out
    assert "THREE-WAY COMPARISON: HF BF16 & vLLM vs HF FP32" in out
    summaries = [ln for ln in out.splitlines() if ln.startswith("SUMMARY:")]
    assert summaries == [
        "SUMMARY: 0 deviation(s) > 0.01, 0 shape mismatch(es)",
        "SUMMARY: 0 failure(s) (ratio >= 1.5x), 0 shape mismatch(es)",
    ]
    for p in range(len(PROMPTS)):  # every prompt, its prefill and its decode steps
        assert f"=== prompt_{p} ===" in out
    assert "model_layers_5_mlp/token0" in out and "lm_head/token0" in out


def test_compiled_capture_layout_and_no_recompilation(compiled):
    from accuracy.tensor_io import read, read_manifest

    d, res = compiled
    assert res.returncode == 0
    vdir = str(d / "out" / "vllm")
    manifest = read_manifest(vdir)
    assert manifest["config"]["enforce_eager"] is False
    fwds = read(vdir)
    assert fwds[0].dir_name.startswith("prefill_s")
    assert any(f.dir_name.startswith(f"decode_b{len(PROMPTS)}_") for f in fwds)
    stats = [f.metadata.extra["compile_stats"] for f in fwds]
    warm = fwds[0].metadata.extra["compile_stats_after_warmup"]
    assert warm["dynamo_unique_graphs"] >= 1  # dynamo traced the model (with the hooks) ...
    assert all(s == warm for s in stats)  # ... and nothing compiled again while capturing
    sizes = {len(f.metadata.positions) for f in fwds}
    assert len(sizes) >= 2  # over the prefill and the decode shapes


# a second engine; test_accuracy_vllm names a planted bug in-process
def test_hf_vs_vllm_exits_1_and_names_a_planted_bug(tmp_path):
    res = _run_cli(tmp_path, "--eager", "--plant-bug", "model.layers.3.mlp=1.5")
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("FIRST DIVERGENCE")]
    assert len(lines) == 2 and all("prompt_0 step 0 model_layers_3_mlp/" in ln for ln in lines)
