"""KV compaction in plain PyTorch: one gather and one scatter for all requests and layers."""

from __future__ import annotations

import torch

__all__ = ["kv_compact", "compaction_slots"]


def compaction_slots(
    prefix_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    accepted_len: torch.Tensor,
    block_table: torch.Tensor | None,
    slots_per_row: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat source and destination slots ``int64[B * (D+1)]`` of the compaction copy.

    Entry ``j`` of request ``b`` moves position ``prefix_lens[b] + accepted_nodes[b, j]``
    to ``prefix_lens[b] + j``. Entries past ``accepted_len`` copy the root's slot onto
    itself (a no-op), so the shapes stay fixed and nothing is read back to the host.
    ``slots_per_row`` is the block size (paged) or the cache length (contiguous).
    """
    b, width = accepted_nodes.shape
    dev = accepted_nodes.device
    plen = prefix_lens.to(torch.int64)[:, None]
    j = torch.arange(width, device=dev)[None, :]
    valid = j < accepted_len.to(torch.int64)[:, None]
    src = plen + torch.where(valid, accepted_nodes.to(torch.int64), 0)
    dst = plen + torch.where(valid, j, 0)
    if block_table is None:
        base = torch.arange(b, device=dev)[:, None] * slots_per_row
        return (base + src).flatten(), (base + dst).flatten()
    bt = block_table.to(torch.int64)

    def slot(pos: torch.Tensor) -> torch.Tensor:
        return bt.gather(1, pos // slots_per_row) * slots_per_row + pos % slots_per_row

    return slot(src).flatten(), slot(dst).flatten()


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
            or contiguous ``[B, S, H, D]``, optionally with a leading layer dim; any dtype.
        prefix_lens: ``int[B]``.
        accepted_nodes, accepted_len: ``int[B, D+1]``, ``int[B]`` from ``tree_walk``.
        block_table: ``int32/int64 [B, max_blocks]`` or None.

    Returns:
        ``int64[B]`` new lengths ``prefix_lens + accepted_len``.
    """
    src, dst = compaction_slots(
        prefix_lens, accepted_nodes, accepted_len, block_table, k_cache.shape[-3]
    )
    for cache in (k_cache, v_cache):
        layered = cache if cache.dim() == 5 else cache[None]
        flat = layered.view(layered.shape[0], -1, cache.shape[-2], cache.shape[-1])
        flat[:, dst] = flat[:, src]  # advanced indexing gathers a copy before the scatter
    return prefix_lens.to(torch.int64) + accepted_len.to(torch.int64)
