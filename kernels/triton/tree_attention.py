"""Tree attention as one flash-style Triton kernel (+ a split-KV merge kernel).

One program per (query block[, prefix split], KV head, request). GQA: the ``G``
query heads of a KV head are folded into the query rows (row ``r`` is node
``r // G``, query head ``kv_head * G + r % G``), so every K/V tile is loaded once
for all of them. Each program

1. runs over its share of the prefix in ``BLOCK_N`` tiles with no mask (only the
   last, partial tile is bounds-masked),
2. then (last split only) over the request's tree nodes, masking scores with the
   bit-packed ancestor words (``tree.packed_mask``, up to 4 int64 words = 256 nodes),

with an online softmax in fp32 (base-2 exponentials; fp32 inputs use IEEE fp32
dots, not TF32). K/V are read through the
block table (vLLM paged layout); a contiguous ``[B, S, Hkv, D]`` cache is read as
a paged one with block size ``S`` and block table ``[[0], [1], ...]``.

When the grid would be too small to fill the GPU (few requests, long prefixes),
the prefix is split across programs (flash-decoding); partial outputs and LSEs
are merged by a second kernel.

Under ``TRITON_INTERPRET=1`` the wrapper accepts CPU tensors and upcasts tiles to
fp32 before ``tl.dot`` (the interpreter's low-precision dot is wrong).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["tree_attention"]

MAX_TREE_NODES = 256
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@triton.jit
def _tree_attn_fwd(
    Q,
    K,
    V,
    BT,
    PLEN,
    CU,
    MASK,
    OUT,
    LSE,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_mt,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    block_size,
    num_splits,
    num_qblocks,
    scale_log2,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Axis 0 = split * num_qblocks + query block: programs that stream the same K/V
    # tiles (same split, other query blocks) are launched next to each other.
    split = tl.program_id(0) // num_qblocks
    qblk = tl.program_id(0) % num_qblocks
    kvh = tl.program_id(1)
    b = tl.program_id(2)

    start = tl.load(CU + b)
    n = (tl.load(CU + b + 1) - start).to(tl.int32)
    plen = tl.load(PLEN + b).to(tl.int32)
    bt_row = BT + b.to(tl.int64) * stride_bt

    rows = qblk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n * G
    active = qblk * BLOCK_M < n * G
    node = (start + rows // G).to(tl.int64)
    head = kvh * G + rows % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q = tl.load(
        Q + node[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    k_head = K + kvh * stride_kh
    v_head = V + kvh * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # This split's share of the prefix, in whole tiles; inactive programs get none.
    chunk = tl.cdiv(tl.cdiv(plen, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, plen)
    hi = tl.where(active & (hi > lo), hi, lo)
    full_hi = lo + ((hi - lo) // BLOCK_N) * BLOCK_N

    # Prefix, whole tiles: every node sees every prefix token, no mask.
    for s in range(lo, full_hi, BLOCK_N):
        pos = s + tl.arange(0, BLOCK_N)
        slot = tl.load(bt_row + pos // block_size).to(tl.int64)
        off = pos % block_size
        k_ptr = k_head + slot[:, None] * stride_kb + off[:, None] * stride_ks + d[None, :]
        v_ptr = v_head + slot[:, None] * stride_vb + off[:, None] * stride_vs + d[None, :]
        if BLOCK_D == HEAD_DIM:  # no mask at all on the hot loop
            k = tl.load(k_ptr)
            v = tl.load(v_ptr)
        else:
            k = tl.load(k_ptr, mask=d_ok[None, :], other=0.0)
            v = tl.load(v_ptr, mask=d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # Prefix tail (at most one partial tile): bounds mask only.
    for s in range(full_hi, hi, BLOCK_N):
        pos = s + tl.arange(0, BLOCK_N)
        pos_ok = pos < hi
        slot = tl.load(bt_row + pos // block_size, mask=pos_ok, other=0).to(tl.int64)
        off = pos % block_size
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_head + slot[:, None] * stride_kb + off[:, None] * stride_ks + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_head + slot[:, None] * stride_vb + off[:, None] * stride_vs + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        qk = tl.where(pos_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # Tree block (last split only): node i sees node j iff bit j of its packed row is set.
    # Tile 0 holds the root, an ancestor of every node, so m_i is finite after it.
    tree_hi = tl.where(active & (split == num_splits - 1), n, 0)
    for j0 in range(0, tree_hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < n
        pos = plen + j
        slot = tl.load(bt_row + pos // block_size, mask=j_ok, other=0).to(tl.int64)
        off = pos % block_size
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_head + slot[:, None] * stride_kb + off[:, None] * stride_ks + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_head + slot[:, None] * stride_vb + off[:, None] * stride_vs + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        words = tl.load(
            MASK + node[:, None] * stride_mt + (j // 64)[None, :],
            mask=row_ok[:, None] & j_ok[None, :],
            other=0,
        )
        bit = (words >> (j % 64).to(tl.int64)[None, :]) & 1
        visible = (bit != 0) | (~row_ok[:, None])  # padded rows: anything finite
        visible = visible & j_ok[None, :]
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    has = l_i > 0  # False only for an empty split
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    out_ptr = (
        OUT + split * stride_os + node[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    )
    tl.store(out_ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, -1e30)
        tl.store(LSE + split * stride_ls + node * stride_lt + head, lse, mask=row_ok)


@triton.jit
def _merge_splits(
    PART,
    PLSE,
    OUT,
    LSE,
    num_splits,
    stride_ps,
    stride_ls,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """One program per (node, query head): LSE-weighted sum of the split partials."""
    row = tl.program_id(0).to(tl.int64)  # flat (node, head) index into [T * Hq]
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(PLSE + s * stride_ls + row, mask=s_ok, other=-1e30)
    m = tl.max(lse, 0)
    w = tl.exp(lse - m)
    w = tl.where(s_ok, w, 0.0)
    total = tl.sum(w, 0)
    part = tl.load(
        PART + s[:, None] * stride_ps + row * HEAD_DIM + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    out = tl.sum(part * w[:, None], 0) / total
    tl.store(OUT + row * HEAD_DIM + d, out.to(OUT.dtype.element_ty), mask=d_ok)
    if WRITE_LSE:
        tl.store(LSE + row, m + tl.log(total))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _default_config(q: torch.Tensor, rows: int, d: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for ``rows`` folded query rows."""
    block_m = max(16, min(triton.next_power_of_2(rows), 128))
    if _interpreting():  # the interpreter pays per program and per loop step
        return max(16, min(triton.next_power_of_2(rows), 256)), 128, 4, 1
    # 16-bit K/V tiles of 64 keys fit beside a 128-row Q tile in two stages; fp32 halves them.
    block_n = 64 if d <= 64 or block_m <= 64 or q.element_size() <= 2 else 32
    return block_m, block_n, (8 if block_m >= 128 else 4), 2


def _default_splits(q: torch.Tensor, programs: int, capacity: int, block_n: int) -> int:
    """Prefix splits so that a small grid still fills the GPU (no host sync)."""
    if q.device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    if programs >= sms:
        return 1
    # One wave: the largest power of two of splits whose programs all run at once (on
    # an H200 that beat more splits spread over more than one wave; figures:
    # docs/design_figures.md, "Prefix splits").
    fit = 1 << ((sms // programs).bit_length() - 1)
    return max(1, min(fit, capacity // (4 * block_n), 64))


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tree: Any,
    prefix_lens: torch.Tensor,
    block_table: torch.Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Flash-style tree attention (see the module docstring).

    Args:
        q: ``[T, Hq, D]`` fp32/fp16/bf16 queries of all tree nodes (``tree.cu_nodes`` order).
        k_cache, v_cache: paged ``[num_blocks, block_size, Hkv, D]`` with ``block_table``
            or contiguous ``[B, S, Hkv, D]``; q's dtype, last dim contiguous.
        tree: ``TreeBatch`` with at most 256 nodes per tree.
        prefix_lens: ``int[B]`` prefix length per request (0 allowed).
        block_table: ``int32/int64 [B, max_blocks]`` or None (contiguous).
        scale: softmax scale, default ``1/sqrt(D)``.
        return_lse: also return ``lse [T, Hq]`` fp32 (natural log).

    Returns:
        ``out [T, Hq, D]`` in q's dtype (and ``lse [T, Hq]`` fp32 if asked).
    """
    return _tree_attention(
        q, k_cache, v_cache, tree, prefix_lens, block_table, scale=scale, return_lse=return_lse
    )


tree_attention.max_tree_nodes = MAX_TREE_NODES


def _tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tree: Any,
    prefix_lens: torch.Tensor,
    block_table: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``tree_attention`` with explicit ``num_splits`` and ``(BLOCK_M, BLOCK_N, warps, stages)``."""
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"the triton backend needs CUDA tensors (got {q.device}) or TRITON_INTERPRET=1"
        )
    if tree.max_nodes > MAX_TREE_NODES:
        raise ValueError(f"a tree has {tree.max_nodes} nodes; the triton kernel supports 256")
    total, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    batch = tree.num_requests
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1:
        k_cache = k_cache.contiguous()
    if v_cache.stride(-1) != 1:
        v_cache = v_cache.contiguous()
    if block_table is None:  # contiguous [B, S, ...]: one block of S slots per request
        block_size = k_cache.shape[1]
        block_table = torch.arange(batch, dtype=torch.int32, device=q.device)[:, None]
        capacity = block_size
    else:
        block_size = k_cache.shape[1]
        capacity = block_table.shape[1] * block_size
    prefix_lens = prefix_lens.to(device=q.device)
    cu = tree.cu_nodes
    mask = tree.packed_mask

    rows = tree.max_nodes * g
    block_m, block_n, warps, stages = config or _default_config(q, rows, d)
    qblocks = triton.cdiv(rows, block_m)
    if num_splits is None:
        num_splits = _default_splits(q, batch * hkv * qblocks, capacity, block_n)
    block_d = triton.next_power_of_2(d)
    upcast = _interpreting() and q.dtype != torch.float32

    out = torch.empty(total, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(total, hq, dtype=torch.float32, device=q.device) if return_lse else None
    if num_splits == 1:
        part, part_lse = out, (lse if return_lse else out)
        stride_os, stride_ls = 0, 0
    else:
        part = torch.empty(num_splits, total, hq, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_splits, total, hq, dtype=torch.float32, device=q.device)
        stride_os, stride_ls = part.stride(0), part_lse.stride(0)
    write_lse = num_splits > 1 or return_lse
    lse_t = part_lse.stride(-2) if write_lse else 0
    grid = (qblocks * num_splits, hkv, batch)
    _tree_attn_fwd[grid](
        q,
        k_cache,
        v_cache,
        block_table,
        prefix_lens,
        cu,
        mask,
        part,
        part_lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        mask.stride(0),
        stride_os,
        part.stride(-3),
        part.stride(-2),
        stride_ls,
        lse_t,
        block_size,
        num_splits,
        qblocks,
        scale * _LOG2E,
        G=g,
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        UPCAST=upcast,
        WRITE_LSE=write_lse,
        PRECISION="ieee" if q.dtype == torch.float32 or _interpreting() else "tf32",
        num_warps=warps,
        num_stages=stages,
    )
    if num_splits > 1:
        _merge_splits[(total * hq,)](
            part,
            part_lse,
            out,
            lse if return_lse else out,
            num_splits,
            part.stride(0),
            part_lse.stride(0),
            HEAD_DIM=d,
            BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(num_splits),
            WRITE_LSE=return_lse,
            num_warps=1 if d <= 64 else 2,
        )
    return (out, lse) if return_lse else out
