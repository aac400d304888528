"""On-disk format, nested outputs, registries, patterns and bad input."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

from accuracy import (
    CaptureWriter,
    ModelCapture,
    TensorRegistry,
    TreeMetadata,
    capture_tensor,
    match_modules,
    setup_model_captures,
)
from accuracy.registry import flatten_output
from accuracy.tensor_io import read, read_manifest


@dataclass
class Out:
    last: torch.Tensor
    aux: tuple


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        return Out(y, (y * 2, None, {"z": y + 1}))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Nested() for _ in range(3)])
        self.visual = nn.Sequential(nn.Linear(4, 4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).last
        capture_tensor("final", x)
        capture_tensor("final", x * 0)
        return x


def _run(cap, net, x, **kw):
    cap.clear()
    cap.setup_tensor_capture()
    with torch.no_grad():
        net(x)
    return cap.save_tensor_captures(kw.pop("positions", list(range(x.shape[0]))), **kw)


def test_flatten_output_names_nested_structures():
    t = torch.ones(1)
    names = [n for n, _ in flatten_output("m", (t, None, {"k": t, "l": [t, t]}, Out(t, (t,))))]
    assert names == ["m.0", "m.2.k", "m.2.l.0", "m.2.l.1", "m.3.last", "m.3.aux.0"]
    od = OrderedDict(logits=t, hidden=(t,))  # what HF ModelOutput is
    assert [n for n, _ in flatten_output("out", od)] == ["out.logits", "out.hidden.0"]
    assert flatten_output("x", t)[0][0] == "x"
    from transformers.modeling_outputs import BaseModelOutputWithPast

    mo = BaseModelOutputWithPast(last_hidden_state=t, hidden_states=(t, t))
    assert [n for n, _ in flatten_output("model", mo)] == [
        "model.last_hidden_state",
        "model.hidden_states.0",
        "model.hidden_states.1",
    ]


def test_roundtrip_nested_outputs_manual_and_metadata(tmp_path):
    torch.manual_seed(0)
    net = Net()
    cap = ModelCapture(net, ["layers.0-1"], str(tmp_path))
    cap.enable()
    x = torch.randn(5, 4)
    tree = TreeMetadata(parents=[-1, 0, 0, 1, -1], cu_nodes=[0, 4, 5], tokens=[9, 8, 7, 6, 5])
    path = _run(
        cap,
        net,
        x,
        is_prefill=False,
        req_ids=["a", "b"],
        tree=tree,
        padding_mask=[0, 0, 0, 0, 1],
        extra={"note": "t"},
    )
    assert path.endswith(os.path.join("dp0", "decode_b5_0"))
    (fwd,) = read(str(tmp_path))
    assert fwd.module_names == [
        "layers.0.last",
        "layers.0.aux.0",
        "layers.0.aux.2.z",
        "layers.1.last",
        "layers.1.aux.0",
        "layers.1.aux.2.z",
        "manual.final",
        "manual.final_1",
    ]
    with torch.no_grad():
        y0 = net.layers[0](x)
    torch.testing.assert_close(fwd.tensors["layers.0.aux.2.z"][0], y0.last + 1)
    torch.testing.assert_close(fwd.tensors["manual.final_1"][0], torch.zeros(5, 4))
    m = fwd.metadata
    assert m.req_ids == ["a", "b"] and m.positions == [0, 1, 2, 3, 4]
    assert m.padding_mask == [False] * 4 + [True] and m.extra == {"note": "t"}
    assert m.tree.depths == [0, 1, 1, 2, 0] and m.tree.cu_nodes == [0, 4, 5]
    assert m.tree.path_slots(3) == [0, 1, 3]
    assert m.shapes["layers.0.last"] == {"0": [[5, 4], "float32"]}
    man = read_manifest(str(tmp_path))
    assert man["modules"][0] == "layers.0.last" and man["config"]["matched"] == [
        "layers.0",
        "layers.1",
    ]
    # no temp files left behind
    for root, _, files in os.walk(tmp_path):
        assert not [f for f in files if f.startswith(".tmp-")], root


def test_counters_per_phase_and_bucket_and_tp_ranks(tmp_path):
    net = Net()
    caps = [ModelCapture(net, ["layers.2"], str(tmp_path), tp_rank=r) for r in (0, 1)]
    for c in caps:
        c.enable()
    x = torch.randn(4, 4)
    for phase in (True, False, False, True):
        for c in caps:
            _run(c, net, x, is_prefill=phase, req_ids=["r"])
    fwds = read(str(tmp_path))
    assert [f.dir_name for f in fwds] == [
        "prefill_s4_0",
        "decode_b4_0",
        "decode_b4_1",
        "prefill_s4_1",
    ]
    assert sorted(fwds[0].tensors["layers.2.last"]) == [0, 1]
    assert len(fwds[0].rank_tensors("layers.2.last")) == 2


def test_capture_filter_disable_and_registry_isolation(tmp_path):
    net = Net()
    cap = ModelCapture(
        net, ["layers.0", "layers.1"], str(tmp_path), capture_filter={"layers.1.last"}
    )
    x = torch.randn(2, 4)
    assert _run(cap, net, x, is_prefill=True) is None  # disabled until enable()
    cap.enable()
    _run(cap, net, x, is_prefill=True)
    (fwd,) = read(str(tmp_path))
    assert fwd.module_names == ["layers.1.last"]
    # setup/save restore the previous global registry (multi-model isolation)
    TensorRegistry.reset_instance()
    outer = TensorRegistry()
    TensorRegistry._instance = outer
    cap.setup_tensor_capture()
    assert TensorRegistry._instance is cap.registry
    cap.save_tensor_captures([0, 1], True)
    assert TensorRegistry._instance is outer
    TensorRegistry.reset_instance()


def test_target_draft_vision_subdirectories(tmp_path):
    target, draft = Net(), Net()
    caps = setup_model_captures(
        {
            "modules": ["layers.0", "visual.0"],
            "draft_modules": ["layers.1"],
            "capture_dir": str(tmp_path),
        },
        target,
        draft_model=draft,
        vision_model=target.visual,
    )
    assert set(caps) == {"target", "draft", "vision"}
    assert TensorRegistry._instance is caps["target"].registry
    x = torch.randn(2, 4)
    for name, c in caps.items():
        c.enable()
        c.clear()
        c.setup_tensor_capture()
        with torch.no_grad():
            (target.visual if name == "vision" else target if name == "target" else draft)(x)
        c.save_tensor_captures([0, 1], True, ["r"])
    assert read(str(tmp_path))[0].module_names[0] == "layers.0.last"
    assert read(str(tmp_path / "draft"))[0].module_names[0] == "layers.1.last"
    assert read(str(tmp_path / "vision"))[0].module_names == ["visual.0"]
    TensorRegistry.reset_instance()


# ----------------------------------------------------------------------- bad input


def test_unknown_module_pattern_names_it():
    with pytest.raises(ValueError, match=r"unknown module pattern.*layers\.7.*closest"):
        match_modules(Net(), ["layers.0", "layers.7"])
    with pytest.raises(ValueError, match=r"unknown module pattern.*layers\.3"):
        ModelCapture(Net(), ["layers.0-3"], "/nonexistent/never-created")
    assert not os.path.exists("/nonexistent/never-created")
    with pytest.raises(ValueError, match="not a valid regex"):
        match_modules(Net(), ["layers.(0"])
    assert match_modules(Net(), ["layers.9"], strict=False) == []
    assert match_modules(Net(), [r"layers\.\d+"]) == ["layers.0", "layers.1", "layers.2"]


def test_malformed_range_in_capture(tmp_path):
    with pytest.raises(ValueError, match="malformed range '2-0'"):
        ModelCapture(Net(), ["layers.2-0"], str(tmp_path))


def _one_capture(tmp_path):
    net = Net()
    cap = ModelCapture(net, ["layers.0"], str(tmp_path))
    cap.enable()
    _run(cap, net, torch.randn(3, 4), is_prefill=True, req_ids=["r"])
    return tmp_path / "dp0" / "prefill_s3_0"


def test_truncated_tensor_file(tmp_path):
    fdir = _one_capture(tmp_path)
    f = fdir / "layers.0.last" / "rank0.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(ValueError, match="corrupted or truncated"):
        read(str(tmp_path))


def test_corrupted_tensor_file(tmp_path):
    fdir = _one_capture(tmp_path)
    f = fdir / "layers.0.aux.0" / "rank0.safetensors"
    f.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="corrupted or truncated"):
        read(str(tmp_path))


def test_missing_and_broken_metadata(tmp_path):
    fdir = _one_capture(tmp_path)
    meta = fdir / "prefill_s3_0_meta.json"
    d = json.loads(meta.read_text())
    del d["positions"]
    meta.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="missing field 'positions'"):
        read(str(tmp_path))
    meta.write_text("{not json")
    with pytest.raises(ValueError, match="unreadable metadata"):
        read(str(tmp_path))
    meta.unlink()
    with pytest.raises(ValueError, match="missing metadata"):
        read(str(tmp_path))


def test_metadata_listing_a_module_without_files(tmp_path):
    fdir = _one_capture(tmp_path)
    for f in (fdir / "layers.0.last").iterdir():
        f.unlink()
    with pytest.raises(ValueError, match="no tensor files.*layers.0.last"):
        read(str(tmp_path))


def test_legacy_pt_read_with_weights_only(tmp_path):
    fdir = _one_capture(tmp_path)
    sf = fdir / "layers.0.last" / "rank0.safetensors"
    t = read(str(tmp_path))[0].tensors["layers.0.last"][0]
    sf.unlink()
    torch.save(t, fdir / "layers.0.last" / "rank0.pt")
    torch.testing.assert_close(read(str(tmp_path))[0].tensors["layers.0.last"][0], t)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"x": Evil()}, fdir / "layers.0.last" / "rank0.pt")
    with pytest.raises(ValueError, match="corrupted or truncated"):
        read(str(tmp_path))


def test_failed_write_leaves_nothing_half_written(tmp_path, monkeypatch):
    w = CaptureWriter(str(tmp_path))
    w.enable()
    import accuracy.tensor_io as tio

    real = tio.os.replace
    calls = {"n": 0}

    def flaky_replace(src, dst):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return real(src, dst)

    monkeypatch.setattr(tio.os, "replace", flaky_replace)
    with pytest.raises(OSError, match="disk full"):
        w.write([torch.ones(2), torch.ones(2)], ["a", "b"], ["r"], [0, 1], True)
    monkeypatch.setattr(tio.os, "replace", real)
    files = [f for _, _, fs in os.walk(tmp_path) for f in fs]
    assert not [f for f in files if f.startswith(".tmp-")]
    # the pass has no metadata, so it reads as incomplete rather than as data
    with pytest.raises(ValueError, match="missing metadata"):
        read(str(tmp_path))


def test_invalid_names_tree_and_lengths(tmp_path):
    w = CaptureWriter(str(tmp_path))
    w.enable()
    with pytest.raises(ValueError, match="invalid capture name"):
        w.write([torch.ones(1)], ["a/b"], ["r"], [0], True)
    with pytest.raises(ValueError, match="padding_mask has 1 entries"):
        w.write([torch.ones(2)], ["a"], ["r"], [0, 1], True, padding_mask=[True])
    with pytest.raises(ValueError, match="parent 2 must be -1 or an earlier node"):
        TreeMetadata(parents=[-1, 2, 0])
    with pytest.raises(ValueError, match=r"tree.depths\[2\]"):
        TreeMetadata(parents=[-1, 0, 1], depths=[0, 1, 1])
    with pytest.raises(ValueError, match="not a directory"):
        read(str(tmp_path / "nope"))


def test_dp_ranks_have_their_own_directories(tmp_path):
    net = Net()
    x = torch.randn(2, 4)
    for dp in (0, 1):
        cap = ModelCapture(net, ["layers.0"], str(tmp_path), dp_rank=dp)
        cap.enable()
        _run(cap, net, x, is_prefill=True, req_ids=[f"r{dp}"])
    assert sorted(os.listdir(tmp_path)) == ["dp0", "dp1", "manifest.json"]
    fwds = read(str(tmp_path))
    assert [(f.metadata.dp_rank, f.metadata.req_ids) for f in fwds] == [(0, ["r0"]), (1, ["r1"])]
    assert [f.metadata.dp_rank for f in read(str(tmp_path / "dp1"))] == [1]


def test_metadata_with_wrong_types(tmp_path):
    fdir = _one_capture(tmp_path)
    meta = fdir / "prefill_s3_0_meta.json"
    d = json.loads(meta.read_text())
    meta.write_text(json.dumps({**d, "positions": ["a", "b"]}))
    with pytest.raises(ValueError, match="positions must be integers"):
        read(str(tmp_path))
    meta.write_text(json.dumps({**d, "tree": {"parents": [-1], "colour": 1}}))
    with pytest.raises(ValueError, match="bad tree metadata"):
        read(str(tmp_path))


def test_setup_starts_a_fresh_forward_without_clear_hook(tmp_path):
    net = Net()
    cap = ModelCapture(net, ["layers.1"], str(tmp_path))
    cap.enable()
    xs = [torch.randn(2, 4), torch.randn(2, 4)]
    for x in xs:
        cap.setup_tensor_capture()
        with torch.no_grad():
            net(x)
        cap.save_tensor_captures([0, 1], True, ["r"])
    fwds = read(str(tmp_path))
    assert [len(f.tensors) for f in fwds] == [5, 5]  # 3 from layers.1, 2 inline
    with torch.no_grad():
        h = net.layers[0](xs[1]).last
        torch.testing.assert_close(fwds[1].tensors["layers.1.last"][0], net.layers[1](h).last)
    TensorRegistry.reset_instance()


def test_remove_and_attach_hooks(tmp_path):
    net = Net()
    cap = ModelCapture(net, ["layers.0"], str(tmp_path))
    x = torch.randn(2, 4)
    for attached, expected in ((False, 2), (True, 5)):  # 2 = inline captures only
        cap.remove() if not attached else cap.attach()
        cap.setup_tensor_capture()
        with torch.no_grad():
            net(x)
        cap.save_tensor_captures([0, 1], True)
        assert len(cap.registry.get_all()) == expected
    cap.attach()  # idempotent
    assert len(cap._hooks) == 1
    TensorRegistry.reset_instance()


def test_atomic_write_mode_directories_and_errors_naming_the_file(tmp_path):
    import stat

    import accuracy.tensor_io as tio

    path = tmp_path / "new" / "dir" / "rank0.safetensors"
    tio.atomic_write_bytes(str(path), b"abc")  # missing directories are made
    assert path.read_bytes() == b"abc"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # a plain open()'s mode
    tio.atomic_write_bytes(str(path), b"de")  # replaced in place
    assert path.read_bytes() == b"de"
    assert os.listdir(path.parent) == ["rank0.safetensors"]  # no temp file left
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match=f"cannot write {tmp_path}/file/sub/rank0.safetensors"):
        tio.atomic_write_bytes(str(tmp_path / "file" / "sub" / "rank0.safetensors"), b"x")


_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
           torch.float8_e4m3fn]  # fmt: skip


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 5), (7,), (), (0, 4)], ids=str)
def test_safetensors_bytes_are_read_by_safetensors_itself(dtype, shape, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load

    from accuracy.tensor_io import safetensors_bytes

    t = (torch.randn(shape) * 50).to(dtype)
    if len(shape) == 3:
        t = t.transpose(0, 2)  # not contiguous
    data = safetensors_bytes(t, {"name": "model.layers.0", "rank": "0"})
    back = load(data)["tensor"]
    assert back.dtype == t.dtype and back.shape == t.shape

    def bits(x):
        return x.contiguous().reshape(-1).view(torch.uint8)

    assert torch.equal(bits(back), bits(t))
    path = tmp_path / "rank0.safetensors"
    path.write_bytes(data)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"name": "model.layers.0", "rank": "0"}
        assert torch.equal(bits(f.get_tensor("tensor")), bits(t))
