"""Captures under vLLM tensor parallelism (``tensor_parallel_size=2``, issue 18).

Two engines with only the accuracy plugin: TP=1 and TP=2 (one core per rank), both
capturing the same greedy run of layer 0's sharded and replicated modules. Proven here:

- under TP=2 every pass directory holds ``rank0`` and ``rank1`` files per module;
- vLLM's sharded modules rebuilt from the ranks equal the TP=1 capture: column-parallel
  outputs (``qkv_proj``: q, k, v each split by heads; ``gate_up_proj``: gate and up each
  split; the attention output split by heads) concatenated in rank order per part,
  all-reduced outputs (``o_proj``, ``down_proj``, the decoder layer, the embedding, the
  final norm) taken from rank 0 and equal on both ranks;
- what is still missing in ``accuracy/`` (strict xfails, see their reasons): the pass
  metadata keeping every rank's shapes, ``vllm_reconstruct`` handling sharded modules, and
  ``hf-vs-vllm --tensor-parallel-size``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _vllm_accuracy_helpers import PROMPTS, TARGET, have_vllm, make_llm, tokenize  # noqa: E402

pytestmark = pytest.mark.skipif(not have_vllm(), reason="vLLM is not installed (scripts/setup)")

STEPS = 6
L0 = "model.layers.0"
# name -> how TP=2 splits its output: "cat" one column-parallel block, a tuple the sizes
# (per rank) of the parts that are each column-parallel, "reduced" all-reduced (full).
SHARDING: dict[str, object] = {
    "model.embed_tokens": "reduced",
    f"{L0}.self_attn.qkv_proj": "qkv",
    f"{L0}.self_attn.attn": "cat",
    f"{L0}.self_attn.o_proj": "reduced",
    f"{L0}.mlp.gate_up_proj": "gate_up",
    f"{L0}.mlp.down_proj": "reduced",
    L0: "reduced",
    "model.norm": "reduced",
}


def _capture(tmp: str, tp: int) -> tuple[list[list[int]], list]:
    from accuracy.tensor_io import read

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1" if tp == 2 else "0"
    try:
        cfg = {"treespec": {"tensor_capture": {"modules": list(SHARDING), "capture_dir": tmp}}}
        llm = make_llm(cfg, tensor_parallel_size=tp)
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in tokenize(PROMPTS)], sp)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        from vllm_engines import shutdown

        shutdown(llm)
    return tokens, read(tmp)


@pytest.fixture(scope="module")
def caps(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_capture")
    t1 = _capture(str(root / "tp1"), 1)
    t2 = _capture(str(root / "tp2"), 2)
    return {"root": root, 1: t1, 2: t2}


def _split_sizes(kind: object, width: int) -> list[int]:
    """Per-rank sizes of the column-parallel parts of one rank's ``width`` features."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(TARGET)
    hd = c.hidden_size // c.num_attention_heads
    if kind == "qkv":
        q, kv = c.num_attention_heads * hd // 2, c.num_key_value_heads * hd // 2
        sizes = [q, kv, kv]
    elif kind == "gate_up":
        sizes = [c.intermediate_size // 2] * 2
    else:
        sizes = [width]
    assert sum(sizes) == width, f"{kind}: parts {sizes} do not add up to {width}"
    return sizes


def rebuild(kind: object, ranks: list[torch.Tensor]) -> torch.Tensor:
    """The TP=1 tensor from TP ranks' ``[..., F_r]`` captures (see ``SHARDING``)."""
    if kind == "reduced":
        return ranks[0]
    sizes = _split_sizes(kind, ranks[0].shape[-1])
    parts = [r.split(sizes, dim=-1) for r in ranks]
    return torch.cat([torch.cat([p[i] for p in parts], -1) for i in range(len(sizes))], -1)


def test_tp2_greedy_output_equals_tp1(caps):
    assert caps[2][0] == caps[1][0]


def test_tp2_writes_rank0_and_rank1_files_per_module(caps):
    fwds = caps[2][1]
    assert fwds, "no pass captured under TP=2"
    root = caps["root"] / "tp2" / "dp0"
    for fwd in fwds:
        for name in SHARDING:
            files = sorted(os.listdir(root / fwd.dir_name / name))
            assert files == ["rank0.safetensors", "rank1.safetensors"], (fwd.dir_name, name)


def _by_request(fwds: list) -> dict[tuple[str, str, int], object]:
    """Per-request passes keyed by (request number, phase, k-th pass of that phase): the
    two engines batch the prompts differently, each request's passes are the same."""
    from accuracy.vllm_compare import split_by_request

    out, seen = {}, {}
    for f in split_by_request(fwds):
        rid = f.metadata.req_ids[0].split("-")[0]  # vLLM's "{counter}-{random}"
        k = seen.get((rid, f.phase), 0)
        seen[(rid, f.phase)] = k + 1
        out[(rid, f.phase, k)] = f
    return out


def test_reconstructed_tp2_equals_tp1_capture(caps):
    """Measured here: qkv_proj and attn exact, gate_up_proj 2.4e-6, all-reduced 2.7e-5."""
    f1, f2 = _by_request(caps[1][1]), _by_request(caps[2][1])
    assert set(f1) == set(f2)
    assert len(f1) == len(PROMPTS) * (1 + STEPS - 1)  # prefill + (STEPS - 1) decodes each
    for key in sorted(f1):
        a, b = f1[key], f2[key]
        for name, kind in SHARDING.items():
            ref = a.rank_tensors(name)[0]
            ranks = b.rank_tensors(name)
            assert len(ranks) == 2, (key, name)
            if kind == "reduced":
                torch.testing.assert_close(ranks[1], ranks[0], rtol=1e-5, atol=1e-5)
            else:
                assert ranks[0].shape[-1] * 2 == ref.shape[-1], (name, ranks[0].shape, ref.shape)
            got = rebuild(kind, ranks)
            assert got.shape == ref.shape, (key, name, got.shape, ref.shape)
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4, msg=f"{key} {name}")


@pytest.mark.xfail(
    strict=True,
    reason="accuracy.tensor_io.write: each rank writes the pass's *_meta.json with only its "
    "own rank's shapes, the last writer wins (design limitation not lifted yet)",
)
def test_pass_metadata_keeps_every_ranks_shapes(caps):
    import json

    root = caps["root"] / "tp2" / "dp0"
    for fwd in caps[2][1]:
        meta = json.loads((root / fwd.dir_name / f"{fwd.dir_name}_meta.json").read_text())
        for name in SHARDING:
            assert sorted(meta["shapes"][name]) == ["0", "1"], (fwd.dir_name, name)


@pytest.mark.xfail(
    strict=True,
    reason="accuracy.vllm_compare.vllm_reconstruct takes rank 0 only: a column-parallel "
    "module's TP=2 capture reconstructs to half its features",
)
def test_vllm_reconstruct_handles_sharded_modules(caps):
    from accuracy.vllm_compare import vllm_reconstruct

    a, b = caps[1][1][0], caps[2][1][0]
    for name in (f"{L0}.self_attn.qkv_proj", f"{L0}.mlp.gate_up_proj"):
        ref = vllm_reconstruct(a.rank_tensors(name), name, a.phase, [])
        got = vllm_reconstruct(b.rank_tensors(name), name, b.phase, [])
        assert got.shape[-1] == ref.shape[-1], (name, got.shape, ref.shape)  # features


@pytest.mark.xfail(
    strict=True, reason="python -m accuracy hf-vs-vllm has no --tensor-parallel-size flag"
)
def test_hf_vs_vllm_passes_with_tensor_parallel_size_2(tmp_path):
    import json

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS[:2]))
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    cmd = [sys.executable, "-m", "accuracy", "hf-vs-vllm", "--model", TARGET]
    cmd += ["--prompts", str(prompts), "--max-tokens", "4", "--out", str(tmp_path / "out")]
    cmd += ["--eager", "--tensor-parallel-size", "2"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "SUMMARY:" in r.stdout
