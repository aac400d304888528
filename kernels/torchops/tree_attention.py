"""Tree attention in plain PyTorch: two routes, neither builds a dense mask.

The fused route (fp16, trees of several hundred nodes, devices other than the CPU,
groups of small requests):
per request, the ``n`` tree nodes' queries attend to

* the prefix (positions ``0..P-1``): every node sees all of it, so this is plain,
  unmasked attention, done by PyTorch's fused flash kernel for the CPU
  (``aten._scaled_dot_product_flash_attention_for_cpu``, which also returns the
  log-sum-exp), in 2K-token pieces on long prefixes; on other devices, or torch
  builds without it, by fp32 matmuls chunked over the prefix;
* the tree block (positions ``P..P+n-1``): the same fused kernel with a small
  ``[n, n]`` additive mask unpacked from ``tree.packed_mask`` (shared by all heads);

and the partial results are merged by log-sum-exp. No ``[n, P + n]`` mask is ever
built. GQA: for the prefix, the ``G = Hq / Hkv`` query heads of a KV head are
stacked as one block of ``G * n`` query rows (``[R, Hkv, G * n, D]``), so each
K/V tile is shared by all of them and never expanded. Requests with the same
``(prefix length, tree size)`` go through one kernel call; contiguous caches and
consecutive paged blocks are read as strided views, other paged layouts are
gathered once into a reused workspace.

The row-tile route: bf16 and fp32 on the CPU take it (unless a tree is so big that
one query head's scores over one key piece exceed ``_TILE_BYTES_MAX``), as the fused CPU
kernel leaves speed unused: its GEMMs are MKL's, which on AMD CPUs run AVX2 code
(oneDNN's fp32 GEMM runs about twice as fast on one core here), and its bf16 GEMMs run
at that fp32 speed without AMX (a bf16 ``matmul`` is several times faster; figures:
docs/design_figures.md, "oneDNN linear").
So each request and KV head is done in row tiles of at most ``_TILE_BYTES`` of fp32
scores: ``Q K^T`` in fp32 through oneDNN (exactly what the fused kernel computes) over
a piece of at most ``_ROW_TILE_KEYS`` prefix keys, the tree's keys appended to the
last piece with the ``[n, n]`` ancestor bias added to their columns only, one fp32
softmax per row, then ``P V``: bf16 ``matmul`` with ``P`` in bf16 (as the fused kernel
does; in fp32 on CPUs without AVX-512, whose bf16 GEMM is tens of times slower), or
fp32 through oneDNN (``matmul`` for small trees, where copying V^T costs more than it
saves); several pieces are merged by LSE in fp32. No mask beyond ``[n, n]``,
and the workspace is a bounded tile, never ``[N, P + N]``. A small request (all its
heads' scores within ``_SMALL_TILE_BYTES``, e.g. a decode step of a small model) is
one tile of all its heads in a handful of batched ops instead, since there the number
of ops, not the GEMMs, sets the time; several small requests of one shape take the
fused route together (one kernel call for all of them). The time of dense masked SDPA here
(``python -m bench.attention``): see the README.

The grouping of requests, each group's path and the unpacked ``[n, n]`` biases depend
only on the ``TreeBatch``, the prefix lengths, the dtype, the number of query heads
and ``route``; they are computed once and reused by every later call with the same
(every layer of a decoding step).
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["tree_attention"]

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CHUNK = 4096  # prefix tokens per step of the device-agnostic fallback
_KV_SPLIT = 2048  # prefix tokens per fused-kernel call on long prefixes (cache locality)
_WORKSPACE = threading.local()
_TILE_BYTES = 2 << 20  # fp32 score tile of the row-tile path (about the L2 size)
_TILE_BYTES_MAX = 8 << 20  # ... unless one query head's scores need more (big trees)
_SMALL_TILE_BYTES = 256 << 10  # a request's scores up to this: one tile of all heads
_ROW_TILE_KEYS = 4096  # keys per piece of the row-tile path (long prefixes: several)
_PLANS: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()
_PLANS_PER_TREE = 8  # plans kept per TreeBatch (distinct prefix lengths / dtypes)
_PLANS_LOCK = threading.Lock()
_ONEDNN_LINEAR = (
    getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if torch.backends.mkldnn.is_available()
    else None
)
_PV_ONEDNN_ROWS = 64  # fp32 query rows per KV head from which P V goes through oneDNN
# A CPU without AVX-512 has no fast bf16 GEMM: a bf16 ``bmm`` measured tens of times
# slower than fp32 on an AVX2-only AMD EPYC, where an upcast costs about what the fp32
# GEMM does (figures: docs/design_figures.md, "bf16 P V"). There the tiles' ``P V``
# runs in fp32.
_LOWP_PV_FAST = torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2")
_CONSTS: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def _tree_bias(words: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed ancestor words ``int64[R, n, W]`` -> additive mask ``[R, 1, n, n]``.

    0 where node i sees node j (bit j of row i), -inf elsewhere.
    """
    key = (words.device, dtype)
    consts = _CONSTS.get(key)
    if consts is None:  # (bit shifts, lookup table bit -> bias)
        shifts = torch.arange(64, device=words.device)
        table = torch.tensor([float("-inf"), 0.0], dtype=dtype, device=words.device)
        consts = _CONSTS[key] = (shifts, table)
    shifts, table = consts
    bits = (words[..., None] >> shifts).bitwise_and_(1)  # [R, n, W, 64]
    return table[bits.view(words.shape[0], 1, n, -1)[..., :n]]


def _workspace(
    slot: str, numel: int, like: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A reusable flat buffer of at least ``numel`` elements (per thread, dtype, device).

    Fresh memory of a megabyte or so costs a page fault per 4 KiB page on every call
    (the allocator hands it back to the OS on free); reusing the buffer avoids that.
    It holds the largest size seen. ``dtype`` defaults to ``like``'s.
    """
    # Tensors made under inference_mode cannot be written outside it: one set per mode.
    key = (slot, dtype or like.dtype, like.device, torch.is_inference_mode_enabled())
    cache = _WORKSPACE.__dict__.setdefault("buffers", {})
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = cache[key] = torch.empty(numel, dtype=key[1], device=like.device)
    return buf[:numel]


def _kv_window(cache: torch.Tensor, r0: int, count: int, start: int, length: int) -> torch.Tensor:
    """``cache[r0:r0+count, start:start+length].transpose(1, 2)`` of a contiguous
    ``[B, S, Hkv, D]`` cache as one strided view: ``[count, Hkv, length, D]``."""
    sb, ss, sh, sd = cache.stride()
    return cache.as_strided(
        (count, cache.shape[2], length, cache.shape[3]),
        (sb, sh, ss, sd),
        cache.storage_offset() + r0 * sb + start * ss,
    )


def _group_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    reqs: list[int],
    length: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first ``length`` positions of requests ``reqs``: ``[R, Hkv, length,
    D]`` each.

    Views of a contiguous cache (consecutive requests) or of one request's run of
    consecutive paged blocks; otherwise copies (paged blocks gathered into reused
    workspaces, the block ids read once for both).
    """
    r0, count = reqs[0], len(reqs)
    caches = (k_cache, v_cache)
    if block_table is None:
        if reqs == list(range(r0, r0 + count)):
            k, v = (_kv_window(c, r0, count, 0, length) for c in caches)
        else:
            k, v = (c[reqs, :length].transpose(1, 2) for c in caches)
        return k, v
    bs, h, d = k_cache.shape[1:]
    nblk = (length + bs - 1) // bs
    ids = block_table[reqs, :nblk]
    first = int(ids[0, 0])
    if count == 1 and ids[0].tolist() == list(range(first, first + nblk)):
        flats = [c[first : first + nblk].reshape(1, nblk * bs, h, d) for c in caches]
    else:
        flats = []
        for c, slot in zip(caches, ("k", "v"), strict=True):
            buf = _workspace(slot, count * nblk * bs * h * d, c).view(count * nblk, bs, h, d)
            torch.index_select(c, 0, ids.reshape(-1), out=buf)
            flats.append(buf.view(count, nblk * bs, h, d))
    return flats[0][:, :length].transpose(1, 2), flats[1][:, :length].transpose(1, 2)


def _tree_kv(
    cache: torch.Tensor, block_table: torch.Tensor | None, reqs: list[int], plen: int, n: int
) -> torch.Tensor:
    """The tree nodes' K or V of requests ``reqs``: ``[R, Hkv, n, D]`` (a view when possible)."""
    r0, count = reqs[0], len(reqs)
    if block_table is None and reqs == list(range(r0, r0 + count)):
        return _kv_window(cache, r0, count, plen, n)
    pos = torch.arange(plen, plen + n, device=cache.device)
    bs = cache.shape[1]
    if block_table is None:  # contiguous [B, S, ...] viewed as [B*S, ...]
        slots = torch.tensor(reqs, device=cache.device)[:, None] * bs + pos
    else:
        slots = block_table[reqs][:, pos // bs].to(torch.int64) * bs + pos % bs
    return cache.reshape(-1, cache.shape[2], cache.shape[3])[slots].transpose(1, 2)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [R, Hq, M, D]`` over ``k, v [R, Hkv, L, D]`` (L >= 1, GQA).

    ``bias``: None or an additive mask broadcastable to ``[R, Hq, M, L]``. Returns
    ``out [R, Hq, M, D]`` (q's dtype on the CPU kernel, fp32 on the fallback) and
    fp32 ``lse [R, Hq, M]``. Every row must see at least one key.
    """
    if _FLASH_CPU is not None and q.device.type == "cpu":
        return _FLASH_CPU(q, k, v, attn_mask=bias, scale=scale)
    # Device-agnostic fallback: fp32 matmuls in key chunks, merged online.
    count, hq, m, d = q.shape
    g = hq // k.shape[1]
    qf = q.float().view(count, k.shape[1], g * m, d) * scale
    out = torch.zeros(qf.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(qf.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    for s in range(0, k.shape[2], _CHUNK):
        scores = qf @ k[:, :, s : s + _CHUNK].float().transpose(-1, -2)
        if bias is not None:
            chunk_bias = bias[..., s : s + _CHUNK].float().expand(count, hq, m, -1)
            scores = scores + chunk_bias.reshape(scores.shape)
        chunk_lse = torch.logsumexp(scores, dim=-1)
        part = torch.exp(scores - chunk_lse[..., None]) @ v[:, :, s : s + _CHUNK].float()
        new = torch.logaddexp(lse, chunk_lse)
        out = out * torch.exp(lse - new)[..., None] + part * torch.exp(chunk_lse - new)[..., None]
        lse = new
    return out.view(count, hq, m, d), lse.view(count, hq, m)


def _merge_(
    out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor
) -> None:
    """In place, ``(out, lse)`` <- their LSE merge with a partial result over other keys.

    ``out [..., D]`` fp32, ``lse [...]`` fp32; ``part`` any float dtype.
    """
    out.lerp_(part.float(), torch.sigmoid(part_lse - lse).unsqueeze(-1))
    torch.logaddexp(lse, part_lse, out=lse)


def _prefix_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention over a prefix, in ``_KV_SPLIT``-token pieces when it is long.

    Each piece's K/V stays in cache while every query block of the fused kernel
    reads it (about 10% faster at 32K on the CPU); the pieces are merged by LSE
    into an fp32 running output.
    """
    p = k.shape[2]
    if _FLASH_CPU is None or q.device.type != "cpu" or p < 2 * _KV_SPLIT:
        return _attend(q, k, v, None, scale)
    bounds = list(range(0, p - _KV_SPLIT // 2, _KV_SPLIT)) + [p]  # no tiny last piece
    out, lse = None, None
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        o_c, l_c = _FLASH_CPU(q, k[:, :, s:e], v[:, :, s:e], scale=scale)
        if out is None:
            out, lse = o_c.float(), l_c
        else:
            _merge_(out, lse, o_c, l_c)
    return out, lse


@dataclass
class _Group:
    """Requests ``reqs`` sharing ``(plen, n)``; ``rows`` their query rows (slice if
    consecutive and in order); ``path`` how they are computed (``"small"``: one tile
    of a lone request, ``"rows"``: row tiles, ``"fused"``: fused prefix pass + tree
    block); ``bias`` the ``[R, 1, n, n]`` additive ancestor mask, in the dtype the
    path adds it in (fp32 scores of the tiles, else the fused kernel's q dtype)."""

    plen: int
    n: int
    reqs: list[int]
    rows: slice | torch.Tensor
    path: str
    bias: torch.Tensor
    full_bias: dict[int, torch.Tensor] = field(default_factory=dict)  # small path, per G


def _plan(
    tree: Any, prefix_lens: torch.Tensor, dtype: torch.dtype, heads: int, route: str = "auto"
) -> list[_Group]:
    """Group the requests, choose their paths and unpack their masks, once per (tree
    batch, lengths, dtype, query heads, route)."""
    plens = tuple(prefix_lens.tolist())
    # Inference tensors cannot be used in autograd: one plan per inference mode too.
    key = (plens, dtype, heads, route, torch.is_inference_mode_enabled())
    try:
        with _PLANS_LOCK:
            cache = _PLANS.setdefault(tree, {})
    except TypeError:  # not weak-referenceable: no caching
        cache = {}
    groups = cache.get(key)
    if groups is not None:
        return groups
    cu = tree.cu_nodes.tolist()
    by_shape: dict[tuple[int, int], list[int]] = {}
    for b, plen in enumerate(plens):
        by_shape.setdefault((int(plen), cu[b + 1] - cu[b]), []).append(b)
    groups = []
    for (plen, n), reqs in by_shape.items():
        first, count = cu[reqs[0]], len(reqs)
        if [cu[b] for b in reqs] == list(range(first, first + count * n, n)):
            rows: slice | torch.Tensor = slice(first, first + count * n)
        else:
            idx = torch.cat([torch.arange(cu[b], cu[b] + n) for b in reqs])
            rows = idx.to(tree.packed_mask.device)
        path = _choose_path(tree.packed_mask.device, dtype, route, heads, plen, n, count)
        bias_dtype = dtype if path == "fused" else torch.float32
        bias = _tree_bias(tree.packed_mask[rows].view(count, n, -1), n, bias_dtype)
        groups.append(_Group(plen, n, reqs, rows, path, bias))
    with _PLANS_LOCK:  # several threads may plan for one TreeBatch
        while len(cache) >= _PLANS_PER_TREE:
            cache.pop(next(iter(cache)))
        cache[key] = groups
    return groups


def _choose_path(
    device: torch.device, dtype: torch.dtype, route: str, heads: int, plen: int, n: int, count: int
) -> str:
    """``"small"``, ``"rows"`` or ``"fused"`` for ``count`` requests of ``n`` nodes
    after ``plen`` prefix tokens. Small requests (all heads' fp32 scores within
    ``_SMALL_TILE_BYTES``) cost per op: one alone is one tile; several of one shape go
    together through the fused route, one kernel call for all of them."""
    if route == "fused" or not _use_row_tiles(device, dtype, n):
        return "fused"
    if heads * n * (plen + n) * 4 <= _SMALL_TILE_BYTES:
        return "small" if count == 1 else "fused"
    return "rows"


def _use_row_tiles(device: torch.device, dtype: torch.dtype, n: int) -> bool:
    """The row-tile route: CPU, bf16 or fp32, and one query head's fp32 scores over one
    key piece (``[n, _ROW_TILE_KEYS + n]``) fit in ``_TILE_BYTES_MAX``."""
    return (
        device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float32)
        and n * (_ROW_TILE_KEYS + n) * 4 <= _TILE_BYTES_MAX
    )


def _key_pieces(plen: int, n: int) -> list[tuple[int, int]]:
    """Key ranges of the row-tile path: the prefix in ``_ROW_TILE_KEYS`` pieces, the
    tree's ``n`` keys appended to the last one."""
    starts = list(range(0, plen, _ROW_TILE_KEYS)) or [0]
    ends = starts[1:] + [plen + n]
    return list(zip(starts, ends, strict=True))


def _gemm_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b [N, K]^T -> [M, N]``, fp32, both contiguous.

    On the CPU through oneDNN's fp32 GEMM when torch has it: about 2x the MKL
    ``matmul`` on AMD CPUs, where MKL takes its AVX2 code (about half oneDNN's speed on one
    core here), and as fast elsewhere. Same fp32 arithmetic, no lower precision.
    """
    # (oneDNN is orders of magnitude slower on strided operands: contiguous ones only)
    cpu = a.device.type == "cpu"
    if _ONEDNN_LINEAR is not None and cpu and a.is_contiguous() and b.is_contiguous():
        return _ONEDNN_LINEAR(a, b, None, "none", [], "")
    return a @ b.T


def _small_group(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    grp: _Group,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None,
) -> None:
    """A small lone request (``grp`` has one) as one tile of all its heads.

    Same arithmetic as ``_row_tile_group`` (fp32 scores and softmax, ``P`` in q's
    dtype) in a handful of batched ops: at small shapes the per-op overhead, not the
    GEMMs, is the cost. The request's ``P + n`` keys and values are gathered into
    contiguous ``[P + n, Hkv, D]`` rows (one ``index_select`` of its blocks each: a
    strided view would make both GEMMs copy), and the ``Q K^T`` GEMM adds the group's fp32 bias
    ``[G * n, P + n]`` (zeros over the prefix, the ancestor mask over the tree; no
    bigger than the scores) as it goes. Scores ``[Hkv, G * n, P + n]`` fp32, at most
    ``_SMALL_TILE_BYTES``.
    """
    _, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    n, plen, (r,) = grp.n, grp.plen, grp.reqs
    length = plen + n
    k, v = (_request_rows_kv(c, block_table, r, length) for c in (k_cache, v_cache))
    qs = q[grp.rows].view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)
    s = torch.baddbmm(
        _full_bias(grp, g), qs.float(), k.float().permute(1, 2, 0), alpha=scale
    )  # [Hkv, G * n, L] fp32
    m = s.amax(-1) if lse is not None else None
    p = torch.softmax(s, -1)
    if _LOWP_PV_FAST:  # P in q's dtype, as the fused kernel does
        o = torch.bmm(p.to(q.dtype), v.transpose(0, 1))  # [Hkv, G * n, D]
    else:
        o = torch.bmm(p, v.float().transpose(0, 1))
    out[grp.rows] = o.view(hq, n, d).transpose(0, 1)
    if lse is not None:  # p's row max is exp(0) / sum: lse = m + log(sum)
        lse[grp.rows] = (m - torch.log(p.amax(-1))).view(hq, n).T


def _request_rows_kv(
    cache: torch.Tensor, block_table: torch.Tensor | None, r: int, length: int
) -> torch.Tensor:
    """Request ``r``'s first ``length`` positions of a K or V cache as contiguous rows
    ``[length, Hkv, D]``: its paged blocks gathered with one ``index_select`` (the cache
    may be a strided view, e.g. of vLLM's cache: only the request's blocks are read), or
    a view of a contiguous ``[B, S, Hkv, D]`` cache."""
    if block_table is None:
        return cache[r, :length]
    bs, h, d = cache.shape[1:]
    nblk = (length + bs - 1) // bs
    blocks = block_table[r, :nblk].to(torch.int64)
    return cache.index_select(0, blocks).view(nblk * bs, h, d)[:length]


def _full_bias(grp: _Group, g: int) -> torch.Tensor:
    """The small path's fp32 bias ``[G * n, P + n]``: 0 over the prefix, the ancestor
    mask over the tree's columns, repeated for the ``G`` query heads of a KV head.
    Made once per group and ``G`` (the group is cached by the plan)."""
    full = grp.full_bias.get(g)
    if full is None:
        n, plen = grp.n, grp.plen
        full = grp.bias.new_zeros(g, n, plen + n)
        full[..., plen:] = grp.bias[0, 0]
        full = grp.full_bias[g] = full.view(g * n, plen + n)
    return full


def _request_rows(grp: _Group, i: int) -> slice | torch.Tensor:
    """Query rows of the group's ``i``-th request."""
    n = grp.n
    if isinstance(grp.rows, slice):
        return slice(grp.rows.start + i * n, grp.rows.start + (i + 1) * n)
    return grp.rows[i * n : (i + 1) * n]


def _row_tile_group(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    grp: _Group,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None,
) -> None:
    """Row tiles over prefix + tree keys, per request and KV head (see the module doc).

    Keys go in pieces of ``_ROW_TILE_KEYS`` (the tree's keys in the last piece); with
    one piece this is a single pass, with several the pieces' partial outputs are
    merged by LSE in fp32. Writes ``out[rows]`` (and ``lse[rows]`` if given).
    """
    _, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    n, plen = grp.n, grp.plen
    length = plen + n
    pieces = _key_pieces(plen, n)
    widest = max(e - s for s, e in pieces)
    fp32 = q.dtype == torch.float32
    pv_fp32 = fp32 or not _LOWP_PV_FAST  # P V in fp32 (bf16 without a fast bf16 GEMM)
    # fp32 P V through oneDNN too, when V^T's copy (per KV head and key piece) pays off.
    pv_onednn = pv_fp32 and g * n >= _PV_ONEDNN_ROWS
    # A tile: ``gs`` query heads of one KV head (gs * n rows), fp32 scores <= _TILE_BYTES.
    unit = n * widest * 4
    gs = max(1, min(g, _TILE_BYTES // unit))
    tile = gs * unit // 4  # fp32 elements of the largest tile
    p_buf = _workspace("probs", tile, q, torch.float32)
    pb_buf = None if pv_fp32 else _workspace("probs_lowp", tile, q)
    k_buf = _workspace("k_fp32", widest * d, q, torch.float32)
    v_buf = _workspace("v_rows", widest * d, q, torch.float32) if pv_onednn else None
    vt_buf = _workspace("v_fp32_t", widest * d, q, torch.float32) if pv_onednn else None
    q_buf = _workspace("q_fp32", hq * n * d, q, torch.float32)
    need_lse = lse is not None or len(pieces) > 1
    for i, r in enumerate(grp.reqs):
        rows = _request_rows(grp, i)
        k_r, v_r = (t[0] for t in _group_kv(k_cache, v_cache, block_table, [r], length))
        # [Hkv, G, n, D] fp32 queries, pre-scaled, contiguous; head h = kv_head * G + g.
        qr = q_buf.view(hkv, g, n, d)
        qr.copy_(q[rows].view(n, hkv, g, d).permute(1, 2, 0, 3)).mul_(scale)
        o_r = torch.empty(hkv, g, n, d, dtype=q.dtype if len(pieces) == 1 else torch.float32)
        lse_r = torch.empty(hkv, g, n, dtype=torch.float32) if need_lse else None
        for c, (c0, c1) in enumerate(pieces):
            width = c1 - c0
            for h in range(hkv):
                kf = k_buf[: width * d].view(width, d).copy_(k_r[h, c0:c1])
                if pv_onednn:  # V^T for the second GEMM: [D, width], via a contiguous copy
                    v_rows = v_buf[: width * d].view(width, d).copy_(v_r[h, c0:c1])
                    vt = vt_buf[: width * d].view(d, width).copy_(v_rows.T)
                elif pv_fp32:  # once per KV head and piece, not per tile (a view if fp32)
                    v_f = v_r[h, c0:c1].float()
                for g0 in range(0, g, gs):
                    g1 = min(g, g0 + gs)
                    rows_t = (g1 - g0) * n
                    s = _gemm_nt(qr[h, g0:g1].reshape(rows_t, d), kf)  # [rows_t, width]
                    if c1 > plen:  # the [n, n] ancestor bias, on the tree's columns only
                        s.view(g1 - g0, n, width)[..., plen - c0 :] += grp.bias[i, 0]
                    if need_lse:
                        m = s.amax(-1)
                    p = p_buf[: rows_t * width].view(rows_t, width)
                    torch.ops.aten._softmax.out(s, -1, False, out=p)
                    if pv_onednn:
                        o_t = _gemm_nt(p, vt)
                    elif pv_fp32:
                        o_t = torch.matmul(p, v_f)
                    else:  # P in q's dtype, as the fused kernel does
                        pb = pb_buf[: rows_t * width].view(rows_t, width).copy_(p)
                        o_t = torch.matmul(pb, v_r[h, c0:c1])
                    o_t = o_t.view(g1 - g0, n, d)
                    dst = o_r[h, g0:g1]
                    if need_lse:  # p's row max is exp(0) / sum: lse = m + log(sum)
                        lse_t = (m - torch.log(p.amax(-1))).view(g1 - g0, n)
                        dst_lse = lse_r[h, g0:g1]
                    if c == 0:
                        dst.copy_(o_t)
                        if need_lse:
                            dst_lse.copy_(lse_t)
                    else:  # LSE merge with the earlier pieces, fp32
                        _merge_(dst, dst_lse, o_t, lse_t)
        out[rows] = o_r.permute(2, 0, 1, 3).reshape(n, hq, d).to(q.dtype)
        if lse is not None:
            lse[rows] = lse_r.permute(2, 0, 1).reshape(n, hq)


def _split_group(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    grp: _Group,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Fused unmasked prefix pass + masked tree block, merged by LSE, for one group."""
    _, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    plen, n, reqs, rows = grp.plen, grp.n, grp.reqs, grp.rows
    count = len(reqs)
    # Queries [R, Hq, n, D]. Viewed as [R, Hkv, G*n, D], the G query heads of a KV
    # head form one block of rows: the prefix pass reads each K/V row once for all.
    qh = q[rows].view(count, n, hq, d).transpose(1, 2).contiguous()
    kt = _tree_kv(k_cache, block_table, reqs, plen, n)
    vt = _tree_kv(v_cache, block_table, reqs, plen, n)
    bias = grp.bias
    out_t, lse_t = _attend(qh, kt, vt, bias, scale)  # tree block, [R, Hq, n, *]

    # Merge in [R, Hkv, G, n, (D)] views of every operand: no copies.
    if isinstance(rows, slice):  # write straight into the outputs (fresh, contiguous)
        first = rows.start
        dst = out.as_strided(
            (count, hkv, g, n, d), (n * hq * d, g * d, d, hq * d, 1), first * hq * d
        )
        dst_lse = lse.as_strided((count, hkv, g, n), (n * hq, g, 1, hq), first * hq)
    else:
        dst = torch.empty(count, hkv, g, n, d, dtype=q.dtype, device=q.device)
        dst_lse = torch.empty(count, hkv, g, n, dtype=torch.float32, device=q.device)
    out_t = out_t.view(count, hkv, g, n, d)
    lse_t = lse_t.view(count, hkv, g, n)
    if plen > 0:
        kp, vp = _group_kv(k_cache, v_cache, block_table, reqs, plen)
        out_p, lse_p = _prefix_attend(qh.view(count, hkv, g * n, d), kp, vp, scale)
        out_p, lse_p = out_p.view(out_t.shape), lse_p.view(lse_t.shape)
        # LSE merge: out = out_p + w * (out_t - out_p), w = the tree block's share.
        w = torch.sigmoid(lse_t - lse_p).unsqueeze(-1)
        torch.logaddexp(lse_p, lse_t, out=dst_lse)
        if out_p.dtype == out_t.dtype == dst.dtype:
            torch.lerp(out_p, out_t, w if w.dtype == dst.dtype else w.to(dst.dtype), out=dst)
        else:
            dst.copy_(torch.lerp(out_p.float(), out_t.float(), w))
    else:
        dst.copy_(out_t)
        dst_lse.copy_(lse_t)
    if not isinstance(rows, slice):
        out[rows] = dst.permute(0, 3, 1, 2, 4).reshape(count * n, hq, d)
        lse[rows] = dst_lse.permute(0, 3, 1, 2).reshape(count * n, hq)


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tree: Any,
    prefix_lens: torch.Tensor,
    block_table: torch.Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    route: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Tree attention without a dense mask: row tiles or fused prefix + tree block.

    Args:
        q: ``[T, Hq, D]`` fp32/fp16/bf16 queries of all tree nodes, ``tree.cu_nodes`` order.
        k_cache, v_cache: paged ``[num_blocks, block_size, Hkv, D]`` with ``block_table``
            or contiguous ``[B, S, Hkv, D]``; q's dtype; ``Hq % Hkv == 0``.
        tree: ``TreeBatch`` (uses ``cu_nodes`` and ``packed_mask``; treated as
            immutable: its grouping and unpacked masks are cached per prefix lengths).
        prefix_lens: ``int[B]`` prefix length per request (0 allowed).
        block_table: ``int[B, max_blocks]`` or None (contiguous).
        scale: softmax scale, default ``1/sqrt(D)``.
        return_lse: also return ``lse [T, Hq]`` fp32 (natural log).
        route: ``"auto"`` (row tiles where they apply, see the module doc) or
            ``"fused"`` (always the fused prefix pass + masked tree block, for
            comparison).

    Returns:
        ``out [T, Hq, D]`` in q's dtype (and ``lse [T, Hq]`` fp32 if asked).
    """
    if route not in ("auto", "fused"):
        raise ValueError(f"route must be 'auto' or 'fused', got {route!r}")
    total, hq, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.empty_like(q)
    lse = torch.empty(total, hq, dtype=torch.float32, device=q.device)
    for grp in _plan(tree, prefix_lens, q.dtype, hq, route):
        if grp.path == "fused":
            _split_group(q, k_cache, v_cache, block_table, grp, scale, out, lse)
        else:
            tiles = _small_group if grp.path == "small" else _row_tile_group
            tiles(q, k_cache, v_cache, block_table, grp, scale, out, lse if return_lse else None)
    return (out, lse) if return_lse else out
