"""Tree attention inside Hugging Face models, through ``transformers.AttentionInterface``.

``register()`` adds the attention implementation ``"treespec"``. A model set to
it (``model.set_attn_implementation("treespec")``) must be called with a
``tree_ctx=TreeForward(...)`` keyword: every attention layer then writes the new
tokens' K/V into the paged cache and calls ``kernels.tree_attention`` over the
request's prefix and tree. Inputs are packed: ``input_ids [1, T_new]`` holds the
new nodes of all requests, ``position_ids [1, T_new]`` their RoPE positions
(``prefix + depth``); no dense mask is ever built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

import kernels
from tree_dev.kv_cache import PagedKVCache
from tree_dev.tree import TreeBatch

ATTN_IMPLEMENTATION = "treespec"


@dataclass
class TreeForward:
    """Everything one packed forward needs besides the token ids.

    Attributes:
        cache: the model's paged KV cache.
        tree: ``TreeBatch`` of every request's whole tree, including nodes whose
            K/V is already cached from an earlier forward.
        prefix_lens: ``int64[B]`` committed tokens cached before each tree.
        block_table: ``int32[B, max_blocks]``.
        write_slots: ``int64[T_new]`` flat cache slots for the new tokens' K/V.
        new_rows: ``int64[T_new]`` rows of ``tree`` computed by this forward, or
            None when all rows are new.
        backend: kernels backend.
        causal_kv: small forwards only (``tree`` unused): per request, the flat
            cache slots of its first ``L`` tokens in position order (a ``slice`` of
            consecutive slots, or an ``int64`` index tensor) and a bool mask
            ``[rows, L]`` of what each new row sees (None: everything).
        causal_rows: with ``causal_kv``, the number of new rows of each request.
    """

    cache: PagedKVCache
    tree: TreeBatch | None
    prefix_lens: torch.Tensor | None
    block_table: torch.Tensor | None
    write_slots: torch.Tensor
    new_rows: torch.Tensor | None
    backend: str = "auto"
    causal_kv: list[tuple[slice | torch.Tensor, torch.Tensor | None]] | None = None
    causal_rows: list[int] | None = None


def _causal_decode(
    query: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, ctx: TreeForward, scaling
) -> torch.Tensor:
    """``query [1, Hq, T_new, D]`` (a few rows per request) -> ``[1, T_new, Hq, D]``: one
    SDPA call per request over its cached tokens, masked by ``ctx.causal_kv``."""
    hq, hkv = query.shape[1], k_flat.shape[1]
    rows = ctx.causal_rows or [1] * len(ctx.causal_kv)
    outs, start = [], 0
    for (kv, mask), t in zip(ctx.causal_kv, rows):
        k = k_flat[kv].transpose(0, 1)[None]  # [1, Hkv, L, D]
        v = v_flat[kv].transpose(0, 1)[None]
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, start : start + t],
                k,
                v,
                attn_mask=mask,
                scale=scaling,
                enable_gqa=hq != hkv,
            )
        )
        start += t
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2)


def treespec_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    tree_ctx: TreeForward | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface function: ``query [1, Hq, T_new, D]`` -> ``[1, T_new, Hq, D]``."""
    if tree_ctx is None:
        raise ValueError(
            "attn_implementation 'treespec' needs tree_ctx=TreeForward(...) in the model call"
        )
    if query.shape[0] != 1:
        raise ValueError(f"treespec attention takes packed inputs of batch 1, got {query.shape[0]}")
    ctx = tree_ctx
    layer = module.layer_idx
    k_cache, v_cache = ctx.cache.k[layer], ctx.cache.v[layer]
    hkv, d = k_cache.shape[-2], k_cache.shape[-1]
    k_flat, v_flat = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    k_flat[ctx.write_slots] = key[0].transpose(0, 1).to(k_cache.dtype)
    v_flat[ctx.write_slots] = value[0].transpose(0, 1).to(v_cache.dtype)
    if ctx.causal_kv is not None:
        return _causal_decode(query, k_flat, v_flat, ctx, scaling), None
    q = query[0].transpose(0, 1)
    if ctx.new_rows is not None:
        full = q.new_zeros(ctx.tree.total_nodes, q.shape[1], q.shape[2])
        full[ctx.new_rows] = q
        q = full
    out = kernels.tree_attention(
        q.contiguous(),
        k_cache,
        v_cache,
        ctx.tree,
        ctx.prefix_lens,
        ctx.block_table,
        scale=scaling,
        backend=ctx.backend,
        check_inputs=False,
    )
    if ctx.new_rows is not None:
        out = out[ctx.new_rows]
    return out[None], None


def register() -> str:
    """Register the ``"treespec"`` attention implementation (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, treespec_attention)
    return ATTN_IMPLEMENTATION
