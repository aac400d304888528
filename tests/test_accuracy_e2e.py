"""End to end on a tiny Llama built from a config: HF fp32, HF bf16 and a second
implementation (bf16, KV-cache decoding, layer 1's MLP perturbed) are captured to
disk, read back and compared; the tooling must name the perturbed layer first."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch

import accuracy as A
from accuracy.tensor_io import read

sys.path.insert(0, os.path.dirname(__file__))
from _accuracy_llama import (  # noqa: E402
    capture_full_recompute,
    capture_kv_decode,
    greedy_tokens,
    tiny_llama,
    variants,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

PROMPT = [5, 17, 33, 2, 90, 11]
STEPS = 3


@pytest.fixture(scope="module")
def caps(tmp_path_factory):
    d = tmp_path_factory.mktemp("caps")
    fp32, bf16, pert = variants(tiny_llama())
    tokens = greedy_tokens(fp32, PROMPT, STEPS)
    capture_full_recompute(fp32, tokens, len(PROMPT), str(d / "hf_fp32"))
    capture_full_recompute(bf16, tokens, len(PROMPT), str(d / "hf_bf16"))
    capture_kv_decode(pert, tokens, len(PROMPT), str(d / "impl"))
    capture_kv_decode(bf16, tokens, len(PROMPT), str(d / "impl_ok"))
    return d, tokens


def test_layout_manifest_and_metadata(caps):
    d, tokens = caps
    root = d / "hf_fp32"
    dirs = sorted(os.listdir(root / "dp0"))
    assert dirs == ["decode_b7_0", "decode_b8_0", "decode_b9_0", "prefill_s6_0"]
    assert (root / "dp0" / "prefill_s6_0" / "model.layers.0" / "rank0.safetensors").is_file()
    assert (root / "dp0" / "prefill_s6_0" / "prefill_s6_0_meta.json").is_file()
    # tuple output of self_attn captured with a .0 suffix (attention weights are None)
    assert (root / "dp0" / "prefill_s6_0" / "model.layers.0.self_attn.0").is_dir()
    m = json.loads((root / "manifest.json").read_text())
    assert m["versions"]["torch"] == torch.__version__ and "transformers" in m["versions"]
    assert m["dtypes"] == ["float32"] and "model.layers.2.mlp" in m["modules"]
    assert m["config"]["modules"][1] == "model.layers.0-2.self_attn"
    assert "git_revision" in m
    impl = read(str(d / "impl"))
    assert [f.dir_name for f in impl] == [
        "prefill_s6_0",
        "decode_b1_0",
        "decode_b1_1",
        "decode_b1_2",
    ]
    assert impl[2].metadata.positions == [7] and impl[2].metadata.token_ids == [tokens[7]]
    assert impl[0].tensors["model.layers.1"][0].dtype == torch.bfloat16
    assert impl[0].tensors["model.layers.1"][0].shape == (1, 6, 64)


def test_two_way_names_perturbed_layer_first(caps):
    d, _ = caps
    ref = read(str(d / "hf_bf16"))
    test = read(str(d / "impl"))
    ref = A.align_decode_captures(ref, test)
    res = A.compare_captures_two_way(ref, test, A.hf_reference_reconstruction, A.llama_reconstruct)
    assert list(res) == ["prompt_0"] and list(res["prompt_0"]) == [0, 1, 2, 3]
    buf = io.StringIO()
    s = A.print_comparison_report(res, threshold=0.05, label1="HF BF16", label2="Impl", file=buf)
    assert s.first_failure == ("prompt_0", 0, "model_layers_1_mlp/token0")
    assert A.first_divergence(res, 0.05)[2].startswith("model_layers_1_mlp")
    # everything upstream of the perturbation matches within bf16 noise
    for step in res["prompt_0"].values():
        for r in step:
            if r.name.startswith(("model_embed", "model_layers_0", "model_layers_1_self_attn")):
                assert r.linf_rel < 0.05, r


def test_three_way_names_perturbed_layer_and_passes_clean_impl(caps):
    d, _ = caps
    fp32, bf16 = read(str(d / "hf_fp32")), read(str(d / "hf_bf16"))
    for impl, expect_first in (("impl", "model_layers_1_mlp"), ("impl_ok", None)):
        test = read(str(d / impl))
        f, b = A.align_decode_captures(fp32, test), A.align_decode_captures(bf16, test)
        res = A.compare_captures_three_way(
            f,
            b,
            test,
            A.hf_reference_reconstruction,
            A.llama_reconstruct,
        )
        first = A.first_divergence(res)
        if expect_first is None:
            assert first is None
        else:
            assert first[:2] == ("prompt_0", 0) and first[2].startswith(expect_first)
            agg = A.compute_aggregate_metrics(res)
            assert not agg["model_layers_1_mlp"].passed and agg["model_layers_1_mlp"].linf_ratio > 5
            assert agg["model_layers_0_mlp"].linf_ratio < 1.5
        buf = io.StringIO()
        s = A.print_three_way_report(res, "HF BF16", "Impl", file=buf)
        assert s.ok == (expect_first is None)


def test_cli_compare_exit_codes_and_plot(caps, tmp_path, capsys):
    from accuracy.__main__ import main

    d, _ = caps
    rec = ["--ref-reconstruction", "hf", "--test-reconstruction", "llama", "--no-color"]
    three = [str(d / "hf_bf16"), "--baseline", str(d / "hf_fp32"), *rec]
    png = tmp_path / "err.png"
    assert main(["compare", three[0], str(d / "impl"), *three[1:], "--plot", str(png)]) == 1
    out = capsys.readouterr().out
    assert "THREE-WAY COMPARISON" in out
    assert "FIRST DIVERGENCE: prompt_0 step 0 model_layers_1_mlp" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["compare", three[0], str(d / "impl_ok"), *three[1:]]) == 0
    assert "SUMMARY: 0 failure(s)" in capsys.readouterr().out
    assert main(["compare", str(d / "hf_bf16"), str(d / "impl"), "--threshold", "0.05", *rec]) == 1
    assert "TENSOR COMPARISON" in capsys.readouterr().out
    assert main(["compare", str(tmp_path), str(d / "impl")]) == 2
    assert "no forward-pass directories" in capsys.readouterr().err


def test_cli_inspect_as_module(caps):
    d, _ = caps
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    insp = subprocess.run(
        [sys.executable, "-m", "accuracy", "inspect", str(d / "impl")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert insp.returncode == 0, insp.stderr
    assert "decode_b1_2" in insp.stdout and "[1, 1, 64]" in insp.stdout
    assert "bfloat16" in insp.stdout and "model.layers.1.mlp" in insp.stdout


def test_compare_plugin_with_custom_reconstruction(caps):
    """A model-specific reconstruction (here: undo a hidden-dim shuffle) plugged in once."""
    d, _ = caps
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    shuffled = []
    for f in read(str(d / "impl_ok")):
        f.tensors = {m: {r: t[..., perm] for r, t in rk.items()} for m, rk in f.tensors.items()}
        shuffled.append(f)
    inv = torch.argsort(perm)

    def unshuffle(rank_tensors, module_name, phase, positions):
        return A.llama_reconstruct(rank_tensors, module_name, phase, positions)[..., inv]

    quiet = io.StringIO()
    plain = A.TensorComparePlugin(
        A.llama_reconstruct, A.hf_reference_reconstruction, threshold=0.05
    )
    _, s = plain.compare(str(d / "hf_bf16"), shuffled, file=quiet)
    assert not s.ok  # shuffled hidden dim: everything deviates
    plugin = A.TensorComparePlugin(unshuffle, A.hf_reference_reconstruction, threshold=0.05)
    _, s = plugin.compare(str(d / "hf_bf16"), shuffled, file=quiet)
    assert s.ok
    plugin3 = A.TensorComparePlugin(unshuffle, A.hf_reference_reconstruction)
    _, s = plugin3.compare(str(d / "hf_bf16"), shuffled, baseline=str(d / "hf_fp32"), file=quiet)
    assert s.ok
