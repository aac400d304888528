"""``python -m accuracy hf-vs-vllm`` on a real pretrained model (SmolLM2-135M-Instruct:
Llama, 30 decoder layers, tied embeddings), eager vLLM in fp32, one engine per run.

Clean, the command exits 0: vLLM matches HF FP32 (two-way, L-inf <= 0.01) and is no
further from HF FP32 than HF BF16 is (three-way, ratio < 1.5) at every captured module
of all 30 decoder layers, every prompt and step. With a planted bug (layer 17's MLP
output scaled by 1.5) it exits 1 and both reports name ``model_layers_17_mlp`` first, in
every prompt and step: nothing upstream deviates.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup installs it)")

from _vllm_accuracy_helpers import ROOT  # noqa: E402

pytestmark = pytest.mark.full  # make test-all only: the real model inside vLLM

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
MAX_TOKENS = 4
LAYERS = 30
PLANTED = "model.layers.17.mlp"
_ROW = re.compile(r"^(\S+)/token\d+\s+(\S+)\s+(\S+)")


def _hf_vs_vllm(model_dir, out, *extra: str) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    cmd = [sys.executable, "-m", "accuracy", "hf-vs-vllm", "--model", str(model_dir)]
    cmd += ["--prompts", str(prompts), "--max-tokens", str(MAX_TOKENS), "--eager"]
    cmd += ["--out", str(out / "run"), *extra]
    env = dict(os.environ, VLLM_PLUGINS="treespec_accuracy", VLLM_CPU_KVCACHE_SPACE="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def _steps(report: str) -> dict[tuple[str, str], list[tuple[str, float]]]:
    """``{(prompt, step): [(module, value), ...]}`` of one report (two-way: L-inf,
    three-way: the larger of the L-inf and L2 ratios), rows in report order."""
    out: dict[tuple[str, str], list[tuple[str, float]]] = {}
    prompt = key = None
    two_way = report.startswith("TENSOR COMPARISON:")
    for ln in report.splitlines():
        if ln.startswith("=== "):
            prompt = ln.strip("= ")
        elif ln.startswith("--- Step"):
            key = (prompt, ln.strip("- "))
            out[key] = []
        elif key and (m := _ROW.match(ln)):
            v = float(m[2]) if two_way else max(float(m[2]), float(m[3]))
            out[key].append((m[1], v))
    return out


def _reports(stdout: str) -> tuple[str, str]:
    two = stdout[stdout.index("TENSOR COMPARISON:") :]
    three = two[two.index("THREE-WAY COMPARISON:") :]
    return two[: two.index("THREE-WAY COMPARISON:")], three


@pytest.fixture(scope="module")
def clean(smollm2_dir, tmp_path_factory):
    return _hf_vs_vllm(smollm2_dir, tmp_path_factory.mktemp("smollm2_clean"))


@pytest.fixture(scope="module")
def planted(smollm2_dir, tmp_path_factory):
    return _hf_vs_vllm(
        smollm2_dir, tmp_path_factory.mktemp("smollm2_bug"), "--plant-bug", f"{PLANTED}=1.5"
    )


def test_hf_vs_vllm_passes_on_smollm2_at_every_decoder_layer(clean):
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    summaries = [ln for ln in clean.stdout.splitlines() if ln.startswith("SUMMARY:")]
    assert summaries == [
        "SUMMARY: 0 deviation(s) > 0.01, 0 shape mismatch(es)",
        "SUMMARY: 0 failure(s) (ratio >= 1.5x), 0 shape mismatch(es)",
    ]
    assert "FIRST DIVERGENCE" not in clean.stdout and "hf-vs-vllm: PASSED" in clean.stdout
    two, three = _reports(clean.stdout)
    assert two.startswith("TENSOR COMPARISON: HF FP32 vs vLLM")
    assert three.startswith("THREE-WAY COMPARISON: HF BF16 & vLLM vs HF FP32")
    for report, limit in ((two, 0.01), (three, 1.5)):
        steps = _steps(report)
        # every prompt: its prefill and MAX_TOKENS - 1 decode steps
        assert len(steps) == len(PROMPTS) * MAX_TOKENS
        for key, rows in steps.items():
            mods = {m for m, _ in rows}
            for i in range(LAYERS):  # every decoder layer: attention, MLP, output
                for suffix in ("_self_attn_0", "_mlp", ""):
                    assert f"model_layers_{i}{suffix}" in mods, (key, i, suffix)
            assert {"model_embed_tokens", "model_norm", "lm_head"} <= mods, key
            worst = max(rows, key=lambda r: r[1])
            assert worst[1] < limit, (key, worst)


def test_planted_bug_in_layer_17_is_named_first_everywhere(planted):
    assert planted.returncode == 1, planted.stdout[-3000:] + planted.stderr[-3000:]
    firsts = [ln for ln in planted.stdout.splitlines() if ln.startswith("FIRST DIVERGENCE")]
    assert firsts == [
        "FIRST DIVERGENCE (two-way): prompt_0 step 0 model_layers_17_mlp/token0",
        "FIRST DIVERGENCE (three-way): prompt_0 step 0 model_layers_17_mlp/token0",
    ]
    two, three = _reports(planted.stdout)
    for report, limit in ((two, 0.01), (three, 1.5)):
        steps = _steps(report)
        assert len(steps) == len(PROMPTS) * MAX_TOKENS
        for key, rows in steps.items():  # in every prompt and step, nothing upstream fails
            bad = next((m for m, v in rows if v >= limit), None)
            assert bad == "model_layers_17_mlp", (key, bad)
