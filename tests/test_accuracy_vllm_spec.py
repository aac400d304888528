"""Replacement and capture under vLLM speculative decoding (draft model, 3 tokens).

One eager engine: a planted bug (layer 2's MLP scaled by 3), every decoder layer replaced
with HF's outputs loaded from files (the ``api_server --additional-config`` form), and
capture of the target (``lm_head``) and of the draft model. Replacement is indexed by the
verify passes' ``1 + k`` slots per request (``tokens_per_req``): vLLM's logits then equal
HF's within fp32 tolerance at every slot, the bug notwithstanding, and the output is HF's
greedy decoding.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _vllm_accuracy_helpers import (  # noqa: E402
    DRAFT,
    PROMPTS,
    have_vllm,
    hf_greedy,
    hf_model,
    hf_outputs,
    make_llm,
    tokenize,
)

pytestmark = [
    pytest.mark.full,  # make test-all only: a vLLM engine
    pytest.mark.skipif(not have_vllm(), reason="vLLM is not installed (scripts/setup)"),
]

STEPS, K = 12, 3
LAYERS = [f"model.layers.{i}" for i in range(6)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from vllm import SamplingParams

    from accuracy.replacement import save_reference_captures
    from accuracy.tensor_io import read

    root = tmp_path_factory.mktemp("vllm_spec")
    hf = hf_model()
    prompts = tokenize(PROMPTS[:2])
    greedy = [hf_greedy(hf, p, STEPS + K + 2) for p in prompts]
    refs = [hf_outputs(hf, p + g, LAYERS) for p, g in zip(prompts, greedy, strict=True)]
    save_reference_captures(
        str(root / "ref.safetensors"), [{m: [r[m]] for m in LAYERS} for r in refs]
    )
    (root / "ids.json").write_text(json.dumps(prompts))
    cfg = {
        "treespec": {
            "tensor_replacement": {
                "tensors_path": str(root / "ref.safetensors"),
                "prompt_token_ids_path": str(root / "ids.json"),
            },
            "tensor_capture": {
                "modules": ["lm_head", "model.layers.2.mlp"],
                "draft_modules": ["model.layers.0"],
                "capture_dir": str(root / "v"),
            },
            "fault_injection": {"module": "model.layers.2.mlp", "scale": 3.0},
        }
    }
    spec = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": K}
    llm = make_llm(cfg, speculative_config=spec)
    sp = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    del llm
    return {
        "outs": outs,
        "prompts": prompts,
        "greedy": greedy,
        "refs": refs,
        "target": read(str(root / "v")),
        "draft": read(str(root / "v" / "draft")),
    }


def test_output_is_hf_greedy_despite_the_planted_bug(run):
    for o, g in zip(run["outs"], run["greedy"], strict=True):
        assert list(o.outputs[0].token_ids) == g[:STEPS]


def test_verify_passes_use_tokens_per_req_and_logits_equal_hf(run):
    hf = hf_model()
    logits = []
    with torch.no_grad():
        for p, g in zip(run["prompts"], run["greedy"], strict=True):
            logits.append(hf(input_ids=torch.tensor([p + g])).logits[0])
    verify = [
        f
        for f in run["target"]
        if not f.is_prefill and set(f.metadata.extra["num_spec_tokens"]) == {K}
    ]
    assert verify, "no decode pass verified K draft tokens per request"
    assert all(len(f.metadata.positions) == len(f.metadata.req_ids) * (1 + K) for f in verify)
    rows = 0
    for f in run["target"]:
        prompt_of = f.metadata.extra["replacement_prompt_idx"]
        for r, (off, cnt) in enumerate(f.metadata.extra["slot_table"]):
            pi = prompt_of[f.metadata.req_ids[r]]
            pos = f.metadata.positions[off : off + cnt]
            got = f.tensors["lm_head"][0][off : off + cnt]
            torch.testing.assert_close(got, logits[pi][pos], rtol=1e-4, atol=1e-4)
            rows += cnt
            # the planted bug is still there, upstream of the replaced layer output
            mlp = f.tensors["model.layers.2.mlp"][0][off : off + cnt]
            assert mlp.abs().max() > 0
    assert rows >= 2 * STEPS


def test_draft_model_captured_in_its_own_directory(run):
    draft = run["draft"]
    assert draft and all(f.module_names == ["model.layers.0"] for f in draft)
    assert all(f.metadata.extra.get("model") == "draft" for f in draft)
    assert all(f.tensors["model.layers.0"][0].shape[-1] == 128 for f in draft)  # draft width
    req_ids = {r for f in run["target"] for r in f.metadata.req_ids}
    assert {r for f in draft for r in f.metadata.req_ids} <= req_ids
