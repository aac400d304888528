"""A paged KV cache in the kernels' layout, with a block allocator.

``k`` and ``v`` are ``[num_layers, num_blocks, block_size, kv_heads, head_dim]``
(vLLM's per-layer paged layout, stacked so ``kernels.kv_compact`` moves every
layer at once). Each request owns a list of blocks; token position ``p`` of a
request lives in block ``blocks[p // block_size]`` at offset ``p % block_size``.
"""

from __future__ import annotations

import torch


class PagedKVCache:
    """Paged K/V storage for one model plus a free-list block allocator.

    Args:
        num_layers, kv_heads, head_dim: the model's attention geometry.
        num_blocks: total blocks (shared by all requests).
        block_size: tokens per block.
        dtype, device: storage dtype/device.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self.blocks: dict[int, list[int]] = {}

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, req_id: int, num_tokens: int) -> int:
        """Extra blocks request ``req_id`` needs to hold ``num_tokens`` tokens."""
        have = len(self.blocks.get(req_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def reserve(self, req_id: int, num_tokens: int) -> None:
        """Make sure request ``req_id`` owns enough blocks for ``num_tokens`` tokens."""
        need = self.blocks_needed(req_id, num_tokens)
        if need > len(self._free):
            raise RuntimeError(
                f"KV cache out of blocks: request {req_id} needs {need}, {len(self._free)} free"
            )
        owned = self.blocks.setdefault(req_id, [])
        for _ in range(need):
            owned.append(self._free.pop())

    def free(self, req_id: int) -> None:
        """Return all blocks of ``req_id`` to the free list."""
        self._free.extend(reversed(self.blocks.pop(req_id, [])))

    def block_table(self, req_ids: list[int]) -> torch.Tensor:
        """``int32[B, max_blocks]`` block table of the given requests (0-padded)."""
        width = max(1, max(len(self.blocks.get(r, ())) for r in req_ids))
        table = torch.zeros(len(req_ids), width, dtype=torch.int32)
        for i, r in enumerate(req_ids):
            owned = self.blocks.get(r, [])
            table[i, : len(owned)] = torch.tensor(owned, dtype=torch.int32)
        return table.to(self.k.device)

    def slots(self, req_id: int, positions: torch.Tensor) -> torch.Tensor:
        """Flat slot ids (into ``[num_blocks * block_size]``) of token positions."""
        owned = torch.tensor(self.blocks[req_id], dtype=torch.int64)
        pos = positions.to(torch.int64).cpu()
        return (owned[pos // self.block_size] * self.block_size + pos % self.block_size).to(
            self.k.device
        )

    def slot(self, req_id: int, position: int) -> int:
        """Flat slot id of one token position (host int, no tensor op)."""
        bs = self.block_size
        return self.blocks[req_id][position // bs] * bs + position % bs

    def causal_slots(self, req_id: int, length: int) -> slice | torch.Tensor:
        """Flat slots of positions ``0..length-1`` in order: a ``slice`` when they are
        consecutive (the request's blocks follow each other: a view, no copy), else an
        ``int64`` index tensor."""
        bs = self.block_size
        owned = self.blocks[req_id][: -(-length // bs)]
        first = owned[0]
        if owned[-1] - first == len(owned) - 1 and owned == list(range(first, first + len(owned))):
            return slice(first * bs, first * bs + length)
        return self.slots(req_id, torch.arange(length))
