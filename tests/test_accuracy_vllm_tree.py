"""Tree-aware capture inside vLLM with the tree plugin (``tree_dev.vllm_plugin``).

The tree plugin describes each verify forward's trees (``runner.verify_trees``); the
accuracy plugin stores it (and each request's committed context) with the pass. Then
``python -m accuracy tree DENSE TREE --hf-model TARGET`` pairs every node with HF dense
decoding of its root-to-node path: it passes on the real plugin, and with the tree mask
deliberately dropped (``debug_disable: "mask"``) it fails and names layer 0's attention,
the first layer a wrong mask can change.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _vllm_accuracy_helpers import (  # noqa: E402
    DRAFT,
    PROMPTS,
    ROOT,
    TARGET,
    have_vllm,
    make_llm,
    tokenize,
)

pytestmark = [
    pytest.mark.full,  # make test-all only: a vLLM engine
    pytest.mark.skipif(not have_vllm(), reason="vLLM is not installed (scripts/setup)"),
]

MODULES = ["model.layers.0-5.self_attn", "model.layers.0-5", "lm_head"]


def _capture(root, broken: str | None) -> str:
    from vllm import SamplingParams

    cap = str(root / "vllm")
    ts = {
        "tree": "topk:k=2,depth=4,budget=8",
        "tensor_capture": {"modules": MODULES, "capture_dir": cap},
    }
    if broken:
        ts["debug_disable"] = broken
    llm = make_llm(
        {"treespec": ts},
        plugins="treespec_accuracy,treespec_tree",
        speculative_config={"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 8},
    )
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in tokenize(PROMPTS[:2])], sp, use_tqdm=False)
    del llm
    return cap


def _tree_cli(root, cap: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accuracy", "tree", str(root / "dense"), cap]
    cmd += ["--hf-model", TARGET]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_verify_passes_carry_the_tree_and_match_dense_hf_per_node(tmp_path):
    from accuracy.tensor_io import read
    from accuracy.vllm_compare import vllm_tree_passes

    cap = _capture(tmp_path, None)
    fwds = read(cap)
    tagged = [f for f in fwds if f.metadata.extra.get("tree_batch")]
    assert tagged, "no pass carries the tree plugin's verify trees"
    passes = vllm_tree_passes(fwds)
    assert len(passes) >= len(tagged)
    branching = [
        p for p in passes if len(set(p.metadata.tree.depths)) < len(p.metadata.tree.depths)
    ]
    assert branching, "no verified tree has two nodes at one depth"
    for p in passes:  # positions are prefix + depth, the root is the last committed token
        t = p.metadata.tree
        assert p.metadata.positions == [p.metadata.positions[0] + d for d in t.depths]
        assert p.metadata.extra["context"][-1] == t.tokens[0]
    res = _tree_cli(tmp_path, cap)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert " 0 deviation(s) > 0.01" in res.stdout
    assert "FIRST DIVERGENT LAYER" not in res.stdout


def test_a_broken_tree_mask_fails_and_names_the_first_divergent_layer(tmp_path):
    cap = _capture(tmp_path, "mask")
    res = _tree_cli(tmp_path, cap)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    first = [ln for ln in res.stdout.splitlines() if ln.startswith("FIRST DIVERGENT LAYER:")]
    assert first and first[0].split()[3] == "model_layers_0_self_attn"
