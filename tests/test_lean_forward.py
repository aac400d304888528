"""tree_dev.lean_forward: the engine's Llama forward without HF's call machinery is bit
for bit HF's, and steps aside whenever a hook or a non-stock module is present."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import tree_dev.model_runner as runner_mod
from tests.factories import tiny_llama
from tree_dev.attention import register
from tree_dev.lean_forward import forget, lean_supported
from tree_dev.model_runner import Runner
from tree_dev.models.eagle import EagleHead
from tree_dev.narrow_linear import narrow_available, use_narrow_linears
from tree_dev.onednn_linear import use_onednn_linears
from tree_dev.testing import random_tree

VOCAB = 64


@pytest.fixture
def lean_calls(monkeypatch) -> list[int]:
    """How many forwards took the lean path."""
    calls: list[int] = []
    real = runner_mod.llama_forward
    monkeypatch.setattr(
        runner_mod, "llama_forward", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    return calls


def _model(eagle: bool, linears: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model the engine would run (target or EAGLE head) and its ``LlamaModel``."""
    register()
    target = tiny_llama(4, vocab=VOCAB)
    model = EagleHead.from_target(target, seed=2) if eagle else target
    decoder = model.decoder if eagle else model.model
    decoder.set_attn_implementation("treespec")
    if eagle:
        model.config._attn_implementation = "treespec"
    if linears == "onednn":
        use_onednn_linears(model, min_rows=1)
    elif linears == "narrow":
        if not narrow_available():
            pytest.skip("the narrow GEMM needs an x86-64 CPU with AVX2 + FMA and a C compiler")
        use_narrow_linears(model)
    return model.eval(), decoder


def _runner(model: torch.nn.Module, decoder: torch.nn.Module, eagle: bool) -> Runner:
    """A fresh runner: a new cache, so every run places K/V in the same slots."""
    cfg = decoder.config
    heads = cfg.num_key_value_heads
    return Runner(model, cfg.num_hidden_layers, heads, cfg.head_dim, 64, 4, "torch", eagle)


@pytest.mark.parametrize("linears", ["f-linear", "onednn", "narrow"])
@pytest.mark.parametrize("eagle", [False, True], ids=["target", "eagle-head"])
def test_lean_forward_is_bitwise_hf(lean_calls, eagle: bool, linears: str):
    """Prefill, a draft level below cached nodes and whole verify trees (row path and
    tree kernel) give exactly the same hidden states and logits through the lean
    forward as through HF's ``LlamaModel.forward`` (forced by a hook)."""
    model, decoder = _model(eagle, linears)
    hidden_size = decoder.config.hidden_size
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (11, 30)]
    prompt_feats = [torch.randn(n, hidden_size, generator=gen) for n in (11, 30)]
    trees = [random_tree(9, seed=1), random_tree(40, seed=2)]

    def run_all() -> list[torch.Tensor]:
        runner = _runner(model, decoder, eagle)
        g = torch.Generator().manual_seed(9)
        out = runner.prefill([0, 1], [0, 0], prompts, prompt_feats if eagle else None)
        for new_nodes, row_nodes in (([[0, 1, 2], [0]], 64), (None, 64), (None, 0)):
            runner.row_nodes = row_nodes  # 0: the tree kernel
            n = sum(t.num_nodes for t in trees) if new_nodes is None else 4
            tokens = torch.randint(0, VOCAB, (n,), generator=g).tolist()
            f = torch.randn(n, hidden_size, generator=g) if eagle else None
            out += list(runner.forward([0, 1], [11, 30], trees, new_nodes, tokens, feats=f))
        return out

    lean = run_all()
    assert len(lean_calls) == 4  # prefill + three forwards, all lean
    seen = []
    handle = decoder.layers[0].mlp.register_forward_hook(lambda *a: seen.append(1))
    try:
        hf = run_all()
    finally:
        handle.remove()
    assert len(lean_calls) == 4 and len(seen) == 4  # HF's forward ran: the hook fired
    assert len(lean) == len(hf)
    diffs = [(a - b).abs().max().item() for a, b in zip(lean, hf)]
    assert diffs == [0.0] * len(diffs), diffs


def test_lean_supported_only_for_stock_unhooked_eval_models():
    register()
    model = tiny_llama(1, vocab=VOCAB)
    decoder = model.model
    assert not lean_supported(decoder)  # HF's own attention: the engine's needs treespec
    decoder.set_attn_implementation("treespec")
    assert lean_supported(decoder.eval())
    assert not lean_supported(decoder.train())
    decoder.eval()
    handle = decoder.layers[1].self_attn.q_proj.register_forward_pre_hook(lambda *a: None)
    assert not lean_supported(decoder)
    handle.remove()
    assert lean_supported(decoder)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert not lean_supported(decoder)  # a global hook sees every module
    finally:
        handle.remove()
    assert lean_supported(decoder)

    class MyLayer(LlamaDecoderLayer):
        pass

    custom = MyLayer(decoder.config, 0)
    custom.load_state_dict(decoder.layers[0].state_dict())
    decoder.layers[0] = custom
    forget(decoder)  # the structure is checked once per model
    assert not lean_supported(decoder)
