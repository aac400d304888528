"""Tree attention in plain PyTorch: fused prefix SDPA + small masked tree block, LSE merge.

Per request, the ``n`` tree nodes' queries attend to

* the prefix (positions ``0..P-1``): every node sees all of it, so this is plain,
  unmasked attention, done by PyTorch's fused flash kernel for the CPU
  (``aten._scaled_dot_product_flash_attention_for_cpu``, which also returns the
  log-sum-exp); on other devices, or torch builds without it, by an fp32 matmul
  pass chunked over the prefix;
* the tree block (positions ``P..P+n-1``): an ``[n, n]`` score matrix with the
  ancestor mask unpacked from ``tree.packed_mask``;

and the two partial results are merged by log-sum-exp. No ``[n, P + n]`` mask is
ever built. GQA: the ``G = Hq / Hkv`` query heads of a KV head are folded into the
query-row dimension (``[Hkv, n * G, D]``), so each K/V row is read once per KV head,
never expanded. Requests with the same ``(prefix length, tree size)`` are batched
into one prefix call; contiguous caches and consecutive paged blocks are read as
strided views, other paged layouts are gathered once.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["tree_attention"]

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CHUNK = 4096  # prefix tokens per step of the device-agnostic fallback


def _unpack(words: torch.Tensor, n: int) -> torch.Tensor:
    """``int64[..., W]`` -> ``bool[..., n]`` (bit ``j`` of each row)."""
    j = torch.arange(n, device=words.device)
    return ((words[..., j // 64] >> (j % 64)) & 1).bool()


def _prefix_kv(
    cache: torch.Tensor, block_table: torch.Tensor | None, reqs: list[int], plen: int
) -> torch.Tensor:
    """Prefix K or V of requests ``reqs``: ``[R, Hkv, plen, D]`` (a view when possible)."""
    r0, count = reqs[0], len(reqs)
    consecutive = reqs == list(range(r0, r0 + count))
    if block_table is None:
        rows = cache[r0 : r0 + count] if consecutive else cache[reqs]
        return rows[:, :plen].transpose(1, 2)
    bs = cache.shape[1]
    nblk = (plen + bs - 1) // bs
    blocks = block_table[reqs, :nblk].to(torch.int64)
    first = blocks[:, :1]
    if count == 1 and bool((blocks == first + torch.arange(nblk, device=blocks.device)).all()):
        start = int(first)  # one run of consecutive blocks: a view, no copy
        flat = cache[start : start + nblk].reshape(1, nblk * bs, cache.shape[2], cache.shape[3])
    else:
        flat = cache[blocks].reshape(count, nblk * bs, cache.shape[2], cache.shape[3])
    return flat[:, :plen].transpose(1, 2)


def _tree_kv(
    cache: torch.Tensor, block_table: torch.Tensor | None, reqs: list[int], plen: int, n: int
) -> torch.Tensor:
    """The tree nodes' K or V of requests ``reqs``: ``[R, Hkv, n, D]``."""
    pos = torch.arange(plen, plen + n, device=cache.device)
    bs = cache.shape[1]
    if block_table is None:  # contiguous [B, S, ...] viewed as [B*S, ...]
        slots = torch.tensor(reqs, device=cache.device)[:, None] * bs + pos
    else:
        slots = block_table[reqs][:, pos // bs].to(torch.int64) * bs + pos % bs
    rows = cache.reshape(-1, cache.shape[2], cache.shape[3])[slots]
    return rows.transpose(1, 2)


def _prefix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention ``q [R, H, M, D]`` over ``k, v [R, H, P, D]`` (P >= 1).

    Returns ``out [R, H, M, D]`` (q's dtype, or fp32 on the fallback) and fp32
    ``lse [R, H, M]``.
    """
    if _FLASH_CPU is not None and q.device.type == "cpu":
        out, lse = _FLASH_CPU(q, k, v, scale=scale)
        return out, lse
    # Device-agnostic fallback: fp32 matmuls in prefix chunks, merged online.
    qf = q.float() * scale
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    for s in range(0, k.shape[2], _CHUNK):
        scores = qf @ k[:, :, s : s + _CHUNK].float().transpose(-1, -2)
        chunk_lse = torch.logsumexp(scores, dim=-1)
        part = torch.exp(scores - chunk_lse[..., None]) @ v[:, :, s : s + _CHUNK].float()
        new = torch.logaddexp(lse, chunk_lse)
        out = out * torch.exp(lse - new)[..., None] + part * torch.exp(chunk_lse - new)[..., None]
        lse = new
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
    """Tree attention: prefix by fused SDPA (no mask), tree block masked, LSE merge.

    Args:
        q: ``[T, Hq, D]`` fp32/fp16/bf16 queries of all tree nodes, ``tree.cu_nodes`` order.
        k_cache, v_cache: paged ``[num_blocks, block_size, Hkv, D]`` with ``block_table``
            or contiguous ``[B, S, Hkv, D]``; q's dtype; ``Hq % Hkv == 0``.
        tree: ``TreeBatch`` (uses ``cu_nodes`` and ``packed_mask``).
        prefix_lens: ``int[B]`` prefix length per request (0 allowed).
        block_table: ``int[B, max_blocks]`` or None (contiguous).
        scale: softmax scale, default ``1/sqrt(D)``.
        return_lse: also return ``lse [T, Hq]`` fp32 (natural log).

    Returns:
        ``out [T, Hq, D]`` in q's dtype (and ``lse [T, Hq]`` fp32 if asked).
    """
    total, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.empty_like(q)
    lse = torch.empty(total, hq, dtype=torch.float32, device=q.device)
    cu = tree.cu_nodes.tolist()
    plens = prefix_lens.tolist()
    groups: dict[tuple[int, int], list[int]] = {}
    for b in range(len(plens)):
        groups.setdefault((int(plens[b]), cu[b + 1] - cu[b]), []).append(b)
    for (plen, n), reqs in groups.items():
        count = len(reqs)
        rows = torch.cat([torch.arange(cu[b], cu[b] + n) for b in reqs]).to(q.device)
        starts = [cu[b] for b in reqs]
        contiguous_rows = starts == list(range(starts[0], starts[0] + count * n, n))
        q_req = q[starts[0] : starts[0] + count * n] if contiguous_rows else q[rows]
        # [R*n, Hkv*G, D] -> [R, Hkv, n*G, D]: row r of KV head h is node r // G, head h*G + r % G
        qf = q_req.view(count, n, hkv, g, d).transpose(1, 2).reshape(count, hkv, n * g, d)

        # Tree block: fp32 scores [R, Hkv, n*G, n] under the ancestor mask.
        kt = _tree_kv(k_cache, block_table, reqs, plen, n).float()
        vt = _tree_kv(v_cache, block_table, reqs, plen, n).float()
        scores = (qf.float() * scale) @ kt.transpose(-1, -2)
        words = tree.packed_mask[rows].view(count, n, -1)
        visible = _unpack(words, n).repeat_interleave(g, dim=1)  # [R, n*G, n]
        scores.masked_fill_(~visible[:, None], float("-inf"))
        lse_t = torch.logsumexp(scores, dim=-1)  # finite: a node always sees itself
        out_t = torch.exp(scores - lse_t[..., None]) @ vt

        if plen > 0:
            kp = _prefix_kv(k_cache, block_table, reqs, plen)
            vp = _prefix_kv(v_cache, block_table, reqs, plen)
            out_p, lse_p = _prefix_attention(qf, kp, vp, scale)
            lse_all = torch.logaddexp(lse_p, lse_t)
            w_p = torch.exp(lse_p - lse_all)[..., None]
            w_t = torch.exp(lse_t - lse_all)[..., None]
            out_all = out_p.float() * w_p + out_t * w_t
        else:
            out_all, lse_all = out_t, lse_t

        o = out_all.view(count, hkv, n, g, d).transpose(1, 2).reshape(count * n, hq, d)
        s = lse_all.view(count, hkv, n, g).transpose(1, 2).reshape(count * n, hq)
        if contiguous_rows:
            out[starts[0] : starts[0] + count * n] = o
            lse[starts[0] : starts[0] + count * n] = s
        else:
            out[rows] = o.to(q.dtype)
            lse[rows] = s
    return (out, lse) if return_lse else out
