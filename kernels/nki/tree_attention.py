"""NKI tree attention (flash-style, online softmax in fp32).

Per request and KV head (grid axis 0 = KV head), for each query head of the
group and each tile of <= 128 tree nodes on the partition axis:

* scores ``S = Q K^T`` on the Tensor Engine, K/V tiles of up to 512 keys on the
  free axis; prefix tiles without any mask, then one tree tile (the request's
  own nodes) masked with ``tensor_copy_predicated`` (-inf where a node is not an
  ancestor-or-self);
* online softmax: running max ``m``, ``P = exp(S - m)`` by ``nisa.activation``
  with a per-row ``bias`` and the row sum from its fused reduction, rescale by
  ``exp(m_old - m_new)``; ``P V`` through ``nc_transpose`` + ``nc_matmul`` in
  128-key chunks accumulated in PSUM; ``out = acc / l``, ``lse = m + log l``.

Host glue (torch, outside the kernel): gathers each request's paged K/V into
contiguous HBM tensors (``K^T [Hkv, D, L]``, ``V [Hkv, L, D]``), lays q out as
``Q^T [Hq, D, N]`` and unpacks the tree's ancestor bits into a ``uint8 [N, N]``
predicate; one kernel launch per request. Head dim <= 128, tree <= 512 nodes.

Given a dense ``uint8 [N, L]`` mask instead (:func:`dense_masked_attention`), the
same kernel masks every K/V tile: the dense-masked alternative (the layout of a
generic masked attention kernel), kept as the baseline ``bench.nki_executor``
compares against.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kernels.nki.runtime import nisa, nki, nl
from kernels.reference import gather_kv, unpack_bits

MAX_TREE_NODES = 512  # the tree tile is one moving tile (<= 512 keys)
KV_TILE = 512
Q_TILE = 128


@nki.jit
def tree_attention_kernel(q_t, k_t, v, mask, scale):
    """One request. q_t ``[Hq, D, N]``, k_t ``[Hkv, D, L]``, v ``[Hkv, L, D]`` (same dtype),
    mask ``uint8 [N, N]`` (1 = visible; tree tile only) or ``uint8 [N, L]`` (dense: every
    tile masked), ``L = prefix + N``. Grid: ``(Hkv,)``.

    Returns ``out [Hq, N, D]`` (q's dtype) and ``lse [Hq, N, 1]`` fp32.
    """
    hq, d, n = q_t.shape
    hkv, _, total = k_t.shape
    plen = total - n
    group = hq // hkv
    kv = nl.program_id(0)
    dense = mask.shape[1] == total and plen > 0
    out = nl.ndarray((hq, n, d), dtype=q_t.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((hq, n, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    if dense:  # the dense-masked alternative: every tile of <= 512 keys masked
        tiles = [(j, min(KV_TILE, total - j), True) for j in range(0, total, KV_TILE)]
    else:
        tiles = [(j, min(KV_TILE, plen - j), False) for j in range(0, plen, KV_TILE)]
        tiles.append((plen, n, True))
    for g in nl.static_range(group):
        h = kv * group + g
        for q0 in nl.static_range(0, n, Q_TILE):
            nq = min(Q_TILE, n - q0)
            q_tile = nl.load(q_t[h, :, q0 : q0 + nq])
            m = nl.full((nq, 1), -math.inf, dtype=nl.float32)
            l_sum = nl.zeros((nq, 1), dtype=nl.float32)
            acc = nl.zeros((nq, d), dtype=nl.float32)
            for j0, w, masked in tiles:
                k_tile = nl.load(k_t[kv, :, j0 : j0 + w])
                s_ps = nl.ndarray((nq, w), dtype=nl.float32, buffer=nl.psum)
                nisa.nc_matmul(s_ps, q_tile, k_tile)
                s = nl.ndarray((nq, w), dtype=nl.float32)
                nisa.activation(s, nl.copy, s_ps, scale=scale)
                if masked:
                    cols = slice(j0, j0 + w) if dense else slice(0, n)
                    visible = nl.load(mask[q0 : q0 + nq, cols])
                    nisa.tensor_copy_predicated(s, -math.inf, visible, reverse_pred=True)
                tile_max = nl.ndarray((nq, 1), dtype=nl.float32)
                nisa.tensor_reduce(tile_max, nl.maximum, s, axis=1, keepdims=True)
                m_new = nl.ndarray((nq, 1), dtype=nl.float32)
                nisa.tensor_tensor(m_new, m, tile_max, nl.maximum)
                neg_m = nl.ndarray((nq, 1), dtype=nl.float32)
                nisa.tensor_scalar(neg_m, m_new, nl.multiply, -1.0)
                p = nl.ndarray((nq, w), dtype=v.dtype)
                row_sum = nl.ndarray((nq, 1), dtype=nl.float32)
                nisa.activation(
                    p,
                    nl.exp,
                    s,
                    bias=neg_m,
                    reduce_op=nl.add,
                    reduce_res=row_sum,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce,
                )
                alpha = nl.ndarray((nq, 1), dtype=nl.float32)
                nisa.activation(alpha, nl.exp, m, bias=neg_m)
                nisa.tensor_scalar(l_sum, l_sum, nl.multiply, alpha, op1=nl.add, operand1=row_sum)
                nisa.tensor_scalar(acc, acc, nl.multiply, alpha)
                pv = nl.ndarray((nq, d), dtype=nl.float32, buffer=nl.psum)
                for c0 in nl.static_range(0, w, 128):
                    cw = min(128, w - c0)
                    p_t_ps = nl.ndarray((cw, nq), dtype=p.dtype, buffer=nl.psum)
                    nisa.nc_transpose(p_t_ps, p[:, c0 : c0 + cw])
                    p_t = nl.ndarray((cw, nq), dtype=v.dtype)
                    nisa.tensor_copy(p_t, p_t_ps)
                    v_tile = nl.load(v[kv, j0 + c0 : j0 + c0 + cw, :])
                    nisa.nc_matmul(pv, p_t, v_tile, accumulate=c0 > 0)
                nisa.tensor_tensor(acc, acc, pv, nl.add)
                nisa.tensor_copy(m, m_new)
            inv = nl.reciprocal(l_sum)
            o = nl.ndarray((nq, d), dtype=q_t.dtype)
            nisa.tensor_scalar(o, acc, nl.multiply, inv)
            nl.store(out[h, q0 : q0 + nq, :], o)
            log_l = nl.ndarray((nq, 1), dtype=nl.float32)
            nisa.activation(log_l, nl.log, l_sum)
            nisa.tensor_tensor(log_l, log_l, m, nl.add)
            nl.store(lse[h, q0 : q0 + nq, :], log_l)
    return out, lse


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
    """Tree attention on NKI (see ``kernels.tree_attention`` for the arguments).

    Args:
        q: ``[T, Hq, D]`` fp32/fp16/bf16, ``D <= 128``.
        k_cache, v_cache: paged ``[blocks, block_size, Hkv, D]`` or contiguous ``[B, S, Hkv, D]``.
        tree: ``TreeBatch`` (<= 512 nodes per tree).
        prefix_lens: ``int[B]``; block_table: ``int[B, max_blocks]`` or None.

    Returns:
        ``out [T, Hq, D]`` in q's dtype (and ``lse [T, Hq]`` fp32).
    """
    out, lse = _run(q, k_cache, v_cache, tree, prefix_lens, block_table, scale, dense=False)
    return (out, lse) if return_lse else out


def _run(q, k_cache, v_cache, tree, prefix_lens, block_table, scale, dense: bool):
    total, hq, d = q.shape
    if d > 128:
        raise ValueError(f"nki tree_attention supports head_dim <= 128, got {d}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.empty_like(q)
    lse = torch.empty(total, hq, dtype=torch.float32, device=q.device)
    cu = tree.cu_nodes.tolist()
    lens = prefix_lens.tolist()
    hkv = k_cache.shape[2]
    for b in range(tree.num_requests):
        s, e = cu[b], cu[b + 1]
        n, plen = e - s, int(lens[b])
        k = gather_kv(k_cache, block_table, b, plen + n)  # [L, Hkv, D]
        v = gather_kv(v_cache, block_table, b, plen + n)
        mask = unpack_bits(tree.packed_mask[s:e], n).to(torch.uint8)
        if dense:  # [N, L]: the prefix visible, the tree block by ancestry
            mask = torch.cat([torch.ones(n, plen, dtype=torch.uint8), mask], dim=1)
        o, ls = tree_attention_kernel[hkv](
            q[s:e].permute(1, 2, 0).contiguous(),
            k.permute(1, 2, 0).contiguous(),
            v.permute(1, 0, 2).contiguous(),
            mask.contiguous(),
            scale,
        )
        out[s:e] = o.permute(1, 0, 2).to(q.device)
        lse[s:e] = ls[..., 0].transpose(0, 1).to(q.device)
    return out, lse


def dense_masked_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tree: Any,
    prefix_lens: torch.Tensor,
    block_table: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The dense-masked alternative to :func:`tree_attention` (same arguments, same
    result): a ``uint8 [N, prefix + N]`` mask from HBM applied to every K/V tile.
    Not an op of the ``nki`` backend; ``bench.nki_executor`` measures it."""
    return _run(q, k_cache, v_cache, tree, prefix_lens, block_table, scale, dense=True)[0]


tree_attention.max_tree_nodes = MAX_TREE_NODES
