"""NKI KV compaction: move the accepted nodes' K/V right after each prefix.

The kernel builds, per request, the one-hot selection ``sel[i, d] = (node_d == i)``
from the accepted node ids (``iota`` + a partition broadcast through the Tensor
Engine + ``equal``; no data-dependent control flow) and computes the compacted
rows ``out[d] = sum_i sel[i, d] * region[i]`` with ``nc_matmul`` (exact: one
nonzero term per output, fp32 PSUM), 128 region rows x 512 features at a time.

Host glue (torch): gathers each request's tree region (positions
``prefix + 0 .. prefix + max(accepted) ``, all layers, K and V side by side) from
the paged or contiguous cache into one HBM tensor, and writes the first
``accepted_len`` compacted rows back to positions ``prefix + 0 .. prefix + len - 1``
(in place). The region must be finite (0 * inf would poison a row).
"""

from __future__ import annotations

import torch

from kernels.nki.runtime import nisa, nki, nl
from kernels.reference import slot_index

F_TILE = 512


@nki.jit
def kv_compact_kernel(region, nodes):
    """region ``[B, R, F]`` (float), nodes ``fp32 [B, 1, S]`` (accepted node ids, -1 padded,
    ``S <= 128``). Grid: ``(B,)``. Returns ``out [B, S, F]``: row d = region row nodes[d]
    (zero where nodes[d] = -1)."""
    batch, rows, feat = region.shape
    s = nodes.shape[2]
    b = nl.program_id(0)
    out = nl.ndarray((batch, s, feat), dtype=region.dtype, buffer=nl.shared_hbm)
    node_row = nl.load(nodes[b])  # [1, S]
    ones = nl.full((1, 128), 1.0, dtype=nl.float32)
    sels = []
    for r0 in nl.static_range(0, rows, 128):
        rw = min(128, rows - r0)
        bcast = nl.ndarray((rw, s), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(bcast, ones[:, 0:rw], node_row)  # node ids on every partition
        row_id = nl.ndarray((rw, s), dtype=nl.float32)
        nisa.iota(row_id, [[0, s]], r0, channel_multiplier=1)
        sel = nl.ndarray((rw, s), dtype=region.dtype)
        nisa.tensor_tensor(sel, row_id, bcast, nl.equal)
        sels.append((r0, rw, sel))
    for f0 in nl.static_range(0, feat, F_TILE):
        fw = min(F_TILE, feat - f0)
        acc = nl.ndarray((s, fw), dtype=nl.float32, buffer=nl.psum)
        for r0, rw, sel in sels:
            chunk = nl.load(region[b, r0 : r0 + rw, f0 : f0 + fw])
            nisa.nc_matmul(acc, sel, chunk, accumulate=r0 > 0)
        res = nl.ndarray((s, fw), dtype=region.dtype)
        nisa.tensor_copy(res, acc)
        nl.store(out[b, :, f0 : f0 + fw], res)
    return out


def kv_compact(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    accepted_len: torch.Tensor,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """KV compaction on NKI, in place (see ``kernels.kv_compact``).

    Args:
        k_cache, v_cache: paged ``[blocks, block_size, H, D]`` / contiguous ``[B, S, H, D]``,
            optionally with a leading layer dim; float dtypes.
        prefix_lens ``int[B]``; accepted_nodes ``[B, S]`` (S <= 128); accepted_len ``[B]``;
        block_table ``int[B, max_blocks]`` or None.

    Returns:
        ``int64[B]`` new lengths ``prefix_lens + accepted_len``.
    """
    slots_max = accepted_nodes.shape[1]
    if slots_max > 128:
        raise ValueError(f"nki kv_compact supports paths of <= 128 nodes, got {slots_max}")
    layered = k_cache.dim() == 5
    caches = (k_cache, v_cache) if layered else (k_cache[None], v_cache[None])
    flats = [c.view(c.shape[0], -1, c.shape[-2], c.shape[-1]) for c in caches]
    bs = k_cache.shape[-3]
    lens = prefix_lens.cpu().tolist()
    alen = accepted_len.cpu().tolist()
    nodes = accepted_nodes.cpu().to(torch.int64)
    valid = torch.arange(slots_max) < accepted_len.cpu()[:, None]
    nodes = torch.where(valid, nodes, torch.full_like(nodes, -1))
    rows = int(nodes.max()) + 1
    batch = len(lens)
    feat = 2 * flats[0].shape[0] * flats[0].shape[2] * flats[0].shape[3]
    region = torch.zeros(batch, rows, feat, dtype=k_cache.dtype)
    dst_slots = []
    for b in range(batch):
        r = int(nodes[b].max()) + 1
        pos = lens[b] + torch.arange(r, device=k_cache.device)
        src = slot_index(block_table, b, pos, bs)
        parts = [f[:, src].transpose(0, 1).reshape(r, -1) for f in flats]  # [r, L*H*D] each
        region[b, :r] = torch.cat(parts, dim=1).cpu()
        dpos = lens[b] + torch.arange(alen[b], device=k_cache.device)
        dst_slots.append(slot_index(block_table, b, dpos, bs))
    out = kv_compact_kernel[batch](region, nodes[:, None, :].to(torch.float32))
    half = feat // 2
    for b in range(batch):
        n = alen[b]
        for i, f in enumerate(flats):
            rows_b = out[b, :n, i * half : (i + 1) * half].to(f.device)
            f[:, dst_slots[b]] = rows_b.reshape(n, f.shape[0], f.shape[2], f.shape[3]).transpose(
                0, 1
            )
    return prefix_lens.to(torch.int64) + accepted_len.to(torch.int64)
