"""Capture and replacement inside torch.compile(fullgraph=True) on the CPU.

The backend is a CompileCounter (dynamo traces the hooks into one FX graph and the
counter runs it): what is checked is dynamo's behaviour, which is the same for any
backend — captures come out of the compiled graph, replacements change its output,
and nothing recompiles across steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from accuracy import (
    ModelCapture,
    TensorReplacer,
    capture_tensor,
    get_replacement_tensor,
    set_active_context,
)
from accuracy.tensor_io import read


class Block(nn.Module):
    def __init__(self, i: int):
        super().__init__()
        self.i = i
        self.proj = nn.Linear(8, 8)
        self.router = nn.Linear(8, 4)

    def forward(self, x):
        logits = self.router(x)
        rep = get_replacement_tensor(f"layers.{self.i}.router")
        if rep is not None:
            logits = rep.reshape(logits.shape)
        capture_tensor(f"router_logits_{self.i}", logits)
        h = x + self.proj(x) * logits.softmax(-1).sum(-1, keepdim=True)
        return h, {"logits": logits}  # nested output: captured as .0 and .1.logits


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(0), Block(1)])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for layer in self.layers:
            x, _ = layer(x)
        return self.head(x)


def test_compiled_capture_and_replacement_without_recompiles(tmp_path):
    torch.manual_seed(0)
    model = Tiny().eval()
    cc = CompileCounter()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=cc, fullgraph=True)
    cap = ModelCapture(compiled._orig_mod, ["layers.0-1", "head"], str(tmp_path))
    cap.register_clear_hook(compiled)
    ref = [{"layers.1.router": [torch.randn(1, 6, 4)]}]
    replacer = TensorReplacer(ref, prompt_token_ids=[[1, 2, 3, 4, 5, 6]])
    replacer.register_request("r", [1, 2, 3, 4, 5, 6])

    with torch.no_grad():
        # warmup: writer disabled, replacement context shaped like the real ones
        cap.setup_tensor_capture()
        set_active_context(replacer.warmup_context(6))
        compiled(torch.randn(6, 8))
        cap.save_tensor_captures(list(range(6)), is_prefill=True, req_ids=["warm"])
        assert not (tmp_path / "dp0").exists()  # disabled during warmup
        cap.enable()
        xs = [torch.randn(6, 8) for _ in range(3)]
        outs = []
        for step, x in enumerate(xs):
            cap.setup_tensor_capture()
            set_active_context(replacer.build_context(["r"], range(6), True))
            outs.append(compiled(x))
            cap.save_tensor_captures(list(range(6)), is_prefill=True, req_ids=[f"p{step}"])
        set_active_context(None)

    assert cc.frame_count == 1, f"recompiled: {cc.frame_count} frames"
    assert counters["stats"]["unique_graphs"] == 1
    fwds = read(str(tmp_path))
    assert len(fwds) == 3
    names = fwds[0].module_names
    assert names == [
        "layers.0.0",
        "layers.0.1.logits",
        "layers.1.0",
        "layers.1.1.logits",
        "head",
        "manual.router_logits_0",
        "manual.router_logits_1",
    ]
    with torch.no_grad():
        for x, out, fwd in zip(xs, outs, fwds, strict=True):
            # eager recomputation of the same forward with the same replacement
            set_active_context({"layers.1.router": ref[0]["layers.1.router"][0]})
            h0, _ = model.layers[0](x)
            h1, d1 = model.layers[1](h0)
            set_active_context(None)
            torch.testing.assert_close(fwd.tensors["layers.0.0"][0], h0)
            torch.testing.assert_close(fwd.tensors["layers.1.0"][0], h1)
            torch.testing.assert_close(fwd.tensors["head"][0], out)
            # the replacement took effect inside the compiled graph
            torch.testing.assert_close(
                fwd.tensors["manual.router_logits_1"][0], ref[0]["layers.1.router"][0][0]
            )
            torch.testing.assert_close(fwd.tensors["layers.1.1.logits"][0], d1["logits"])
            assert not torch.allclose(
                fwd.tensors["manual.router_logits_0"][0], ref[0]["layers.1.router"][0][0]
            )
    cap.remove()


PATTERNS = ["model.layers.0-2", "model.norm", "model"]


def test_compiled_tiny_llama_layer_captures_match_eager(tmp_path):
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from _accuracy_llama import tiny_llama

    model = tiny_llama()
    torch._dynamo.reset()
    cc = CompileCounter()
    compiled = torch.compile(model, backend=cc, fullgraph=True)
    cap = ModelCapture(compiled, PATTERNS, str(tmp_path / "c"))
    cap.register_clear_hook(compiled)
    cap.enable()
    seqs = [
        torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(i)) for i in range(3)
    ]
    with torch.no_grad():
        for ids in seqs:
            cap.setup_tensor_capture()
            compiled(input_ids=ids, use_cache=False)
            cap.save_tensor_captures(list(range(5)), True, req_ids=[str(ids.sum().item())])
    assert cc.frame_count == 1
    eager = ModelCapture(model, PATTERNS, str(tmp_path / "e"))
    eager.enable()
    with torch.no_grad():
        for ids in seqs:
            eager.clear()
            eager.setup_tensor_capture()
            model(input_ids=ids, use_cache=False)
            eager.save_tensor_captures(list(range(5)), True, req_ids=[str(ids.sum().item())])
    for c, e in zip(read(str(tmp_path / "c")), read(str(tmp_path / "e")), strict=True):
        assert (
            c.module_names
            == e.module_names
            == ["model.layers.0", "model.layers.1", "model.layers.2", "model.norm"]
            + ["model.last_hidden_state"]  # the LlamaModel's HF ModelOutput, by key
        )
        for m in c.module_names:
            torch.testing.assert_close(c.tensors[m][0], e.tensors[m][0], rtol=1e-5, atol=1e-5)


@pytest.mark.full  # the inductor compile: ~30 s
def test_inductor_backend_capture_and_replacement(tmp_path):
    """Same as the CompileCounter test with the real (inductor) backend: ~30 s on CPU."""
    torch.manual_seed(0)
    model = Tiny().eval()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True)
    cap = ModelCapture(compiled, ["layers.0-1", "head"], str(tmp_path))
    cap.register_clear_hook(compiled)
    cap.enable()
    rep = torch.randn(6, 4)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(6, 8)
            cap.setup_tensor_capture()
            set_active_context({"layers.1.router": rep})
            out = compiled(x)
            set_active_context(None)
            cap.save_tensor_captures(list(range(6)), True, ["r"])
    assert counters["stats"]["unique_graphs"] == 1
    last = read(str(tmp_path))[-1]
    torch.testing.assert_close(last.tensors["head"][0], out)
    torch.testing.assert_close(last.tensors["manual.router_logits_1"][0], rep)
    torch.testing.assert_close(last.tensors["layers.1.1.logits"][0], rep)
