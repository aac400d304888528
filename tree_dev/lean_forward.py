"""Hugging Face Llama decoders in the engine, without HF's per-call machinery.

``LlamaModel.forward`` wraps a forward in decorators (output capturing, config
defaults), builds a causal mask the engine never uses (its attention takes
``tree_ctx``), and reaches every submodule through ``nn.Module.__call__`` (hook
dispatch, about 80 calls per forward for a 6-layer model). On a small model on the
CPU that machinery is a large share of a decode step: a small Llama's 1-token
forward is measurably faster through this module than through
``LlamaModel.forward`` (figures: docs/design_figures.md, "Lean forward").

``llama_forward`` runs the *same* modules' own ``forward`` methods in HF's order
(embedding, rotary embedding, per layer: input norm, q/k/v projections, HF's
``apply_rotary_pos_emb``, the ``"treespec"`` attention function, o_proj and the
residual, post-attention norm, MLP and the residual; the final norm): the same ops
on the same tensors, so the hidden states are bit for bit HF's. Patched layer
forwards (``tree_dev.onednn_linear``) are honoured. It applies only where
``lean_supported`` says so: a stock ``LlamaModel`` (exact classes, no subclass)
set to the ``"treespec"`` attention, with no forward hook or pre-hook on any of
its modules and none registered globally; anything else (e.g. the accuracy
tooling's capture hooks) takes HF's own forward.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.nn.modules import module as _module
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from tree_dev.attention import ATTN_IMPLEMENTATION, TreeForward, treespec_attention

__all__ = ["forget", "lean_supported", "llama_forward"]

_LAYER_PARTS = (
    ("self_attn", LlamaAttention),
    ("mlp", LlamaMLP),
    ("input_layernorm", LlamaRMSNorm),
    ("post_attention_layernorm", LlamaRMSNorm),
)


def _stock_structure(model: torch.nn.Module) -> bool:
    if type(model) is not LlamaModel or type(model.norm) is not LlamaRMSNorm:
        return False
    if type(model.rotary_emb) is not LlamaRotaryEmbedding:
        return False
    if len(model.layers) != model.config.num_hidden_layers:
        return False
    return all(
        type(layer) is LlamaDecoderLayer
        and all(type(getattr(layer, name)) is cls for name, cls in _LAYER_PARTS)
        for layer in model.layers
    )


# per model: its modules (None: not a stock LlamaModel), checked once; a model whose
# structure changes after its first lean forward must be dropped from here (``forget``)
_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _hooked(modules: list[torch.nn.Module]) -> bool:
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def lean_supported(model: torch.nn.Module) -> bool:
    """Whether ``llama_forward`` may stand in for ``model.forward`` right now: a stock
    ``transformers`` ``LlamaModel`` on the ``"treespec"`` attention, in eval mode,
    with no forward hooks (checked on every call: hooks can come and go; the
    structure is checked once per model)."""
    if model.training or getattr(model.config, "_attn_implementation", None) != (
        ATTN_IMPLEMENTATION
    ):
        return False
    if model not in _MODULES:
        _MODULES[model] = list(model.modules()) if _stock_structure(model) else None
    modules = _MODULES[model]
    return modules is not None and not _hooked(modules)


def forget(model: torch.nn.Module) -> None:
    """Drop ``model``'s cached structure check (after replacing any of its modules)."""
    _MODULES.pop(model, None)


def _linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` without ``__call__``: a patched forward where there is one (e.g.
    ``tree_dev.onednn_linear``), else ``F.linear`` as ``nn.Linear.forward`` calls it."""
    if "forward" in layer.__dict__:
        return layer.forward(x)
    return F.linear(x, layer.weight, layer.bias)


def llama_forward(
    model: LlamaModel,
    position_ids: torch.Tensor,
    tree_ctx: TreeForward,
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
) -> torch.Tensor:
    """``LlamaModel.forward``'s last hidden state, through the modules' own forwards.

    Args:
        model: a ``LlamaModel`` for which ``lean_supported(model)`` holds.
        position_ids: ``int64 [1, T]`` RoPE positions.
        tree_ctx: the packed forward's ``TreeForward``.
        input_ids: ``int64 [1, T]``, or None with ``inputs_embeds``.
        inputs_embeds: ``[1, T, H]`` in the model's dtype, or None with ``input_ids``.

    Returns:
        ``[1, T, H]``: the final norm's output, exactly what
        ``model(..., tree_ctx=tree_ctx).last_hidden_state`` gives.
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("llama_forward: give exactly one of input_ids or inputs_embeds")
    h = model.embed_tokens.forward(input_ids) if inputs_embeds is None else inputs_embeds
    cos, sin = model.rotary_emb.forward(h, position_ids)
    shape = h.shape[:-1]
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        x = layer.input_layernorm.forward(h)
        split = (*shape, -1, attn.head_dim)
        q = _linear(attn.q_proj, x).view(split).transpose(1, 2)
        k = _linear(attn.k_proj, x).view(split).transpose(1, 2)
        v = _linear(attn.v_proj, x).view(split).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out, _ = treespec_attention(attn, q, k, v, None, scaling=attn.scaling, tree_ctx=tree_ctx)
        h = h + _linear(attn.o_proj, out.reshape(*shape, -1).contiguous())
        x = layer.post_attention_layernorm.forward(h)
        gate = mlp.act_fn.forward(_linear(mlp.gate_proj, x))
        h = h + _linear(mlp.down_proj, gate * _linear(mlp.up_proj, x))
    return model.norm.forward(h)
