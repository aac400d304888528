"""Reading and writing vLLM's paged KV cache in whatever layout its attention backend uses.

vLLM's CPU attention backend keeps one tensor per layer, ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]``, and inside each block the ISA-specific kernel decides where a
token's K and V elements go (for fp32 K is stored transposed per block and head; bf16 with
AMX packs pairs). Nothing outside the C++ op documents that placement, so it is *measured*:
``KVLayout.discover`` writes tokens whose values encode (slot, head, dim) into a one-block
scratch cache through the backend's own cache-update op (``impl.do_kv_cache_update``) and
records where every element landed. Reading K/V back is then a gather with that map, and
writing (KV compaction) always goes through the backend's own op, so any layout works.

Shapes: K/V rows are ``[T, num_kv_heads, head_size]`` in the cache dtype; slots are flat
``block_id * block_size + offset`` int64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Where each (slot-in-block, head, dim) element of K and V sits inside one block.

    Attributes:
        block_size: tokens per block.
        num_kv_heads, head_size: per-layer geometry.
        k_index, v_index: ``int64[block_size, num_kv_heads, head_size]`` element offsets
            within a block's flattened storage.
        k_strides, v_strides: ``(offset, slot, head, dim)`` element strides when the
            placement is affine (then the cache can be read in place), else None.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    k_index: torch.Tensor
    v_index: torch.Tensor
    k_strides: tuple[int, int, int, int] | None = None  # (offset, slot, head, dim) if affine
    v_strides: tuple[int, int, int, int] | None = None

    def paged_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Zero-copy ``[num_blocks, block_size, Hkv, D]`` views of K and V (the layout
        ``kernels.tree_attention`` reads with a block table), when both placements are
        affine (fp32 on x86: K transposed per block and head, V row-major); else None."""
        ks, vs = self.k_strides, self.v_strides
        if ks is None or vs is None:
            return None
        nb = kv_cache.shape[0]
        block = kv_cache[0].numel()
        shape = (nb, self.block_size, self.num_kv_heads, self.head_size)
        off = kv_cache.storage_offset()
        k = kv_cache.as_strided(shape, (block, *ks[1:]), off + ks[0])
        v = kv_cache.as_strided(shape, (block, *vs[1:]), off + vs[0])
        return k, v

    @staticmethod
    def discover(impl, layer, kv_cache: torch.Tensor) -> KVLayout:
        """Measure the layout of ``kv_cache`` (block dim first) with the backend's own write.

        Raises:
            ValueError: the cache is quantized (fp8) or its layout is not a permutation of
                the K/V elements (nothing here could read it back faithfully).
        """
        if kv_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(
                f"treespec: KV cache dtype {kv_cache.dtype} is not supported by tree "
                "verification (use kv_cache_dtype='auto')"
            )
        dev = kv_cache.device
        bs, hkv, d = _geometry(impl, kv_cache)
        scratch = torch.zeros((1, *kv_cache.shape[1:]), dtype=kv_cache.dtype, device=dev)
        slots = torch.arange(bs, dtype=torch.int64, device=dev)
        grids = torch.meshgrid(
            *(torch.arange(n, device=dev) for n in (bs, hkv, d)), indexing="ij"
        )  # s, h, d coordinates, each [bs, hkv, d]
        where: dict[str, torch.Tensor] = {}
        coords: dict[str, list[torch.Tensor]] = {"k": [], "v": []}
        for which in ("k", "v"):
            for grid in grids:
                scratch.zero_()
                vals = (grid + 1).to(kv_cache.dtype)  # exact: <= 256 in every supported dtype
                zeros = torch.zeros_like(vals)
                k, v = (vals, zeros) if which == "k" else (zeros, vals)
                impl.do_kv_cache_update(layer, k, v, scratch, slots)
                flat = scratch.reshape(-1).float().cpu()
                nz = torch.nonzero(flat).flatten()
                if which not in where:
                    where[which] = nz
                elif not torch.equal(where[which], nz):
                    raise ValueError("treespec: KV cache layout is not a fixed placement")
                coords[which].append(flat[nz].long() - 1)
        index = {}
        for which in ("k", "v"):
            s, h, dd = coords[which]
            if where[which].numel() != bs * hkv * d:
                raise ValueError(
                    f"treespec: the KV cache stores {where[which].numel()} {which.upper()} "
                    f"elements per block, expected {bs * hkv * d}; layout unsupported"
                )
            idx = torch.full((bs, hkv, d), -1, dtype=torch.int64)
            idx[s, h, dd] = where[which]
            if bool((idx < 0).any()):
                raise ValueError(f"treespec: KV cache layout loses {which.upper()} elements")
            index[which] = idx
        k_idx, v_idx = index["k"].to(dev), index["v"].to(dev)
        return KVLayout(bs, hkv, d, k_idx, v_idx, _affine(k_idx), _affine(v_idx))

    def gather_blocks(
        self, kv_cache: torch.Tensor, block_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks, token-major: ``[len(block_ids) * block_size, Hkv, D]``."""
        rows = kv_cache.view(kv_cache.shape[0], -1).index_select(0, block_ids)
        n = block_ids.numel() * self.block_size
        k = rows[:, self.k_index.view(-1)].view(n, self.num_kv_heads, self.head_size)
        v = rows[:, self.v_index.view(-1)].view(n, self.num_kv_heads, self.head_size)
        return k, v

    def gather_slots(
        self, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at flat ``slots`` (int64 ``[T]``): ``[T, Hkv, D]`` each."""
        slots = slots.to(self.k_index.device)
        blocks, offs = slots // self.block_size, slots % self.block_size
        views = self.paged_views(kv_cache)
        if views is not None:
            return views[0][blocks, offs], views[1][blocks, offs]
        flat = kv_cache.view(kv_cache.shape[0], -1)
        rows = flat.index_select(0, blocks)  # [T, E]
        k = torch.gather(rows, 1, self.k_index[offs].view(slots.numel(), -1))
        v = torch.gather(rows, 1, self.v_index[offs].view(slots.numel(), -1))
        shape = (slots.numel(), self.num_kv_heads, self.head_size)
        return k.view(shape), v.view(shape)


def _affine(idx: torch.Tensor) -> tuple[int, int, int, int] | None:
    """``idx[s, h, d] == base + s*ss + h*sh + d*sd`` for all entries: the strides, else None."""
    bs, h, d = idx.shape
    base = int(idx[0, 0, 0])
    st = [int(idx[1, 0, 0]) - base if bs > 1 else 0]
    st.append(int(idx[0, 1, 0]) - base if h > 1 else 0)
    st.append(int(idx[0, 0, 1]) - base if d > 1 else 0)
    grid = torch.meshgrid(*(torch.arange(n, device=idx.device) for n in (bs, h, d)), indexing="ij")
    pred = base + sum(g * s for g, s in zip(grid, st))
    return (base, *st) if torch.equal(pred, idx) else None


def _geometry(impl, kv_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block_size, num_kv_heads, head_size) of a block-first cache."""
    hkv = int(getattr(impl, "num_kv_heads", 0))
    d = int(getattr(impl, "head_size", 0))
    per_block = kv_cache[0].numel()
    if not hkv or not d or per_block % (2 * hkv * d):
        _, hkv, bs, two_d = kv_cache.shape  # CPU_ATTN: [blocks, Hkv, block_size, 2 * D]
        return bs, hkv, two_d // 2
    return per_block // (2 * hkv * d), hkv, d


def contiguous_kv(
    layout: KVLayout,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's first ``kv_lens[b]`` tokens as contiguous ``[B, S, Hkv, D]`` K and V.

    ``block_table`` is ``int[B, max_blocks]``; ``S`` is ``max(kv_lens)`` rounded up to whole
    blocks (the tail beyond a request's length is never read by tree attention).
    """
    bs = layout.block_size
    nblk = max(-(-n // bs) for n in kv_lens)
    ids = block_table[:, :nblk].to(torch.int64).reshape(-1)
    k, v = layout.gather_blocks(kv_cache, ids)
    shape = (len(kv_lens), nblk * bs, layout.num_kv_heads, layout.head_size)
    return k.view(shape), v.view(shape)
