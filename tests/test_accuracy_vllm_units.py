"""The vLLM integration's pieces that need no engine: config parsing and checks,
start-up validation against a model, vLLM layouts (request split, deferred residual)."""

from __future__ import annotations

import json
import pickle
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from accuracy import in_vllm
from accuracy.tensor_io import CapturedForwardPass, ForwardPassMetadata
from accuracy.vllm_compare import split_by_request, vllm_reconstruct

H, V = 8, 16


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(H, H)

    def forward(self, x, residual):
        return self.mlp(x), x + residual


class _Model(nn.Module):
    """vLLM-style names: model.layers.{i}(.mlp), lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([_Layer(), _Layer()])
        self.lm_head = nn.Linear(H, V)


def _runner(cfg: dict, tmp_path) -> SimpleNamespace:
    r = SimpleNamespace(
        model=_Model(),
        model_config=SimpleNamespace(
            hf_text_config=SimpleNamespace(hidden_size=H, vocab_size=V),
            model="stub",
            dtype=torch.float32,
            enforce_eager=True,
        ),
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_rank=0)),
    )
    setattr(r, in_vllm._STATE_ATTR, in_vllm._RunnerState(cfg))
    return r


def test_accuracy_config_reads_both_sections_and_ignores_foreign_keys():
    add = {
        "neuron_config": {"tensor_capture": {"modules": ["a"], "capture_dir": "x"}},
        "treespec": {"tree": "topk:4", "fault_injection": {"module": "m"}},
    }
    cfg = in_vllm.accuracy_config(add)
    assert set(cfg) == {"tensor_capture", "fault_injection"}
    assert in_vllm.accuracy_config({"treespec": {"tree": "chain:4"}}) == {}
    assert in_vllm.accuracy_config(None) == {}


def test_capture_config_errors_name_the_field(tmp_path):
    ok = {"modules": ["model.layers.0"], "capture_dir": str(tmp_path / "c")}
    assert in_vllm.check_capture_config(ok) is ok
    with pytest.raises(ValueError, match="unknown keys.*'bogus'"):
        in_vllm.check_capture_config({**ok, "bogus": 1})
    with pytest.raises(ValueError, match="capture_dir is required"):
        in_vllm.check_capture_config({"modules": ["a"]})
    with pytest.raises(ValueError, match="tensor_capture.modules must be a list"):
        in_vllm.check_capture_config({**ok, "modules": "model.layers.0"})
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=f"capture_dir '{blocker}/sub' is not writable"):
        in_vllm.check_capture_config({**ok, "capture_dir": str(blocker / "sub")})


def test_in_memory_replacement_is_json_hashable_and_pickles_its_tensors():
    t = [{"model.layers.0": [torch.randn(1, 3, H), torch.randn(1, 1, H)]}]
    rc = in_vllm.replacement_config(t, [[1, 2, 3]])
    summary = json.loads(json.dumps({"treespec": {"tensor_replacement": rc}}, sort_keys=True))
    assert summary["treespec"]["tensor_replacement"]["modules"] == ["model.layers.0"]
    back = pickle.loads(pickle.dumps(rc))
    assert torch.equal(back.tensors[0]["model.layers.0"][1], t[0]["model.layers.0"][1])
    assert back.prompt_token_ids == [[1, 2, 3]] and back["digest"] == rc["digest"]


def test_setup_rejects_unknown_patterns_and_bad_replacement_shapes(tmp_path):
    cap = {"modules": ["model.layers.0-1", "model.layerz.0"], "capture_dir": str(tmp_path)}
    with pytest.raises(ValueError, match=r"unknown module pattern\(s\) \['model.layerz.0'\]"):
        in_vllm._setup(_runner({"tensor_capture": cap}, tmp_path))
    bad = in_vllm.replacement_config([{"model.layers.1": [torch.zeros(1, 3, H + 1)]}], [[1, 2, 3]])
    with pytest.raises(ValueError, match=r"module 'model.layers.1' have feature shape \[9\]"):
        in_vllm._setup(_runner({"tensor_replacement": bad}, tmp_path))
    missing = in_vllm.replacement_config([{"model.layers.7": [torch.zeros(1, 3, H)]}], [[1, 2, 3]])
    with pytest.raises(ValueError, match=r"unknown module\(s\) \['model.layers.7'\]"):
        in_vllm._setup(_runner({"tensor_replacement": missing}, tmp_path))
    with pytest.raises(ValueError, match="fault_injection.module: no submodule named 'x'"):
        in_vllm._setup(_runner({"fault_injection": {"module": "x", "scale": 2}}, tmp_path))


def test_capture_hooks_stack_decoder_pairs_and_replacement_zeroes_the_residual(tmp_path):
    cap = {"modules": ["model.layers.0", "model.layers.0.mlp"], "capture_dir": str(tmp_path)}
    ref = torch.randn(1, 3, H)
    rep = in_vllm.replacement_config([{"model.layers.0": [ref]}], [[1, 2, 3]])
    r = _runner({"tensor_capture": cap, "tensor_replacement": rep}, tmp_path)
    in_vllm._setup(r)
    st = in_vllm.runner_state(r)
    st.replacer.register_request("a", [1, 2, 3])
    ctx = st.replacer.build_context(["a"], [0, 1, 2], True)
    in_vllm.set_active_context(ctx)
    x = torch.randn(3, H)
    st.target.setup_tensor_capture()
    hidden, residual = r.model.model.layers[0](x, x)
    in_vllm.set_active_context(None)
    items = dict(st.target.registry.get_all())
    assert torch.equal(hidden + residual, ref[0])  # the next layer's deferred add gives HF's
    assert items["model.layers.0"].shape == (2, 3, H)  # captured after the override
    assert torch.equal(items["model.layers.0"][0], ref[0])


def _pass(name, req_ids, positions, table, prefilling, t):
    md = ForwardPassMetadata(
        req_ids=req_ids,
        positions=positions,
        token_ids=[p + 100 for p in positions],
        modules=["model.layers.0", "model.norm"],
        extra={"slot_table": table, "prefilling": prefilling},
    )
    return CapturedForwardPass(
        name, md, {"model.layers.0": {0: torch.stack([t, -t])}, "model.norm": {0: t}}
    )


def test_split_by_request_unmixes_passes_and_merges_prefill_chunks():
    t0 = torch.arange(4.0).repeat(H, 1).T  # rows 0..3
    t1 = torch.arange(10.0, 13.0).repeat(H, 1).T
    fwds = [
        _pass("prefill_s4_0", ["a", "b"], [0, 1, 0, 1], [[0, 2], [2, 2]], [True, True], t0),
        _pass("prefill_s3_0", ["a", "b"], [2, 2, 3], [[0, 1], [1, 2]], [False, True], t1),
    ]
    out = split_by_request(fwds)
    names = [(f.dir_name, f.metadata.req_ids[0]) for f in out]
    assert names == [("prefill_s2_0", "a"), ("prefill_s4_0", "b"), ("decode_b1_0", "a")]
    b = out[1]
    assert b.metadata.positions == [0, 1, 2, 3] and b.metadata.token_ids == [100, 101, 102, 103]
    assert b.tensors["model.norm"][0][:, 0].tolist() == [2.0, 3.0, 11.0, 12.0]
    assert b.tensors["model.layers.0"][0].shape == (2, 4, H)
    rec = vllm_reconstruct(b.rank_tensors("model.layers.0"), "model_layers_0", "prefill", [])
    assert rec.abs().max() == 0  # hidden + residual with residual = -hidden
    assert out[2].tensors["model.norm"][0][:, 0].tolist() == [10.0]


def test_vllm_reconstruct_strips_padding_and_keeps_plain_tensors():
    t = torch.randn(2, 4, H)
    got = vllm_reconstruct([t], "model_layers_3", "decode", [5, 6, 6, 6])
    assert torch.allclose(got, (t[0] + t[1])[:2])
    plain = torch.randn(4, H)
    mask = [False, True, False, True]
    assert torch.equal(vllm_reconstruct([plain], "model_norm", "decode", [], mask), plain[[0, 2]])
    assert torch.equal(vllm_reconstruct([t], "model_layers_3_mlp", "decode", []), t)


def test_register_is_idempotent_and_inert_without_config(monkeypatch):
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup installs it)")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    in_vllm.register()
    init = GPUModelRunner.__init__
    in_vllm.register()
    assert GPUModelRunner.__init__ is init
    r = SimpleNamespace(vllm_config=SimpleNamespace(additional_config={"treespec": {"tree": 1}}))
    in_vllm._init_runner(r)
    assert not hasattr(r, in_vllm._STATE_ATTR) and not hasattr(r, "load_model")


def test_hf_vs_vllm_rejects_bad_input_before_starting_vllm(tmp_path, capsys):
    from accuracy.__main__ import main

    bad = tmp_path / "p.json"
    bad.write_text('{"not": "a list"}')
    args = ["hf-vs-vllm", "--model", str(tmp_path), "--prompts", str(bad)]
    assert main(args + ["--max-tokens", "4", "--out", str(tmp_path / "o")]) == 2
    assert "--prompts" in capsys.readouterr().err
    bad.write_text('["ok"]')
    assert main(args + ["--max-tokens", "4", "--out", str(tmp_path / "o")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(args + ["--max-tokens", "0", "--out", str(tmp_path / "o")]) == 2
    assert "--max-tokens must be >= 1" in capsys.readouterr().err


def test_capture_config_checks_the_writer_options(tmp_path):
    base = {"modules": ["model.layers.0"], "capture_dir": str(tmp_path)}
    in_vllm.check_capture_config({**base, "async_writes": False, "max_pending": 2})
    with pytest.raises(ValueError, match="async_writes"):
        in_vllm.check_capture_config({**base, "async_writes": "no"})
    with pytest.raises(ValueError, match="max_pending"):
        in_vllm.check_capture_config({**base, "max_pending": 0})
