"""KV compaction as a Triton kernel.

Grid ``(requests, layers, row blocks)``; each program copies one block of the
``heads * head_dim`` row of every accepted path entry, in path order. In-place
safety: entry ``j`` reads position ``prefix + accepted_nodes[j]`` (>= ``prefix + j``,
path node indices grow with depth) and writes ``prefix + j``, so walking ``j``
upwards never reads a slot this program has already overwritten, and every
element is read and written by the same thread (same block layout each step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["kv_compact"]


@triton.jit
def _compact_kernel(
    k_ptr,
    v_ptr,
    prefix_ptr,  # int[B]
    nodes_ptr,  # int[B, D1]
    len_ptr,  # int[B]
    bt_ptr,  # int[B, max_blocks] (PAGED only)
    D1,
    bt_cols,
    slots,  # block size (paged) or cache length (contiguous)
    layer_stride,
    block_stride,
    slot_stride,
    ROW: tl.constexpr,  # heads * head_dim, contiguous
    PAGED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    m = offs < ROW
    plen = tl.load(prefix_ptr + b).to(tl.int64)
    n = tl.load(len_ptr + b)
    for j in range(1, n):
        src = plen + tl.load(nodes_ptr + b * D1 + j).to(tl.int64)
        dst = plen + j
        if PAGED:
            src_blk = tl.load(bt_ptr + b * bt_cols + src // slots).to(tl.int64)
            dst_blk = tl.load(bt_ptr + b * bt_cols + dst // slots).to(tl.int64)
        else:
            src_blk = b.to(tl.int64)
            dst_blk = b.to(tl.int64)
        s_off = layer * layer_stride + src_blk * block_stride + (src % slots) * slot_stride
        d_off = layer * layer_stride + dst_blk * block_stride + (dst % slots) * slot_stride
        tl.store(k_ptr + d_off + offs, tl.load(k_ptr + s_off + offs, mask=m), mask=m)
        tl.store(v_ptr + d_off + offs, tl.load(v_ptr + s_off + offs, mask=m), mask=m)


def kv_compact(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    accepted_len: torch.Tensor,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Move accepted nodes' K/V right after each prefix, in place (see ``reference.kv_compact``).

    Args:
        k_cache, v_cache: paged ``[num_blocks, block_size, H, D]`` (with ``block_table``)
            or contiguous ``[B, S, H, D]``, optionally with a leading layer dim; any
            dtype; the ``[H, D]`` row of a slot must be contiguous and both caches
            must have the same strides.
        prefix_lens: ``int[B]``; accepted_nodes ``int[B, D+1]``; accepted_len ``int[B]``.
        block_table: ``int32/int64 [B, max_blocks]`` or None.

    Returns:
        ``int64[B]`` new lengths ``prefix_lens + accepted_len``.
    """
    k5 = k_cache if k_cache.dim() == 5 else k_cache[None]
    v5 = v_cache if v_cache.dim() == 5 else v_cache[None]
    heads, dim = k5.shape[-2], k5.shape[-1]
    if k5.stride()[-2:] != (dim, 1) or k5.stride() != v5.stride():
        raise ValueError(
            f"kv_compact (triton) needs contiguous [heads, head_dim] rows and equal strides, "
            f"got k {k5.stride()} v {v5.stride()}"
        )
    b = prefix_lens.shape[0]
    row = heads * dim
    block = min(triton.next_power_of_2(row), 1024)
    nodes = accepted_nodes.contiguous()
    paged = block_table is not None
    bt = block_table.contiguous() if paged else nodes
    grid = (b, k5.shape[0], triton.cdiv(row, block))
    _compact_kernel[grid](
        k5,
        v5,
        prefix_lens,
        nodes,
        accepted_len,
        bt,
        nodes.shape[1],
        bt.shape[1],
        k5.shape[2],
        k5.stride(0),
        k5.stride(1),
        k5.stride(2),
        ROW=row,
        PAGED=paged,
        BLOCK=block,
    )
    return prefix_lens.to(torch.int64) + accepted_len.to(torch.int64)
