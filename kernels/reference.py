"""Dense reference ops: the ground truth of every kernel test.

Obviously right, not fast: Python loops over requests and tree nodes, dense
masks, fp32 (float64 for the walk's probabilities) everywhere. Every other
backend must agree with these functions; they are themselves checked against
independent oracles in ``tests/test_reference.py``.

``tree`` is a ``tree_dev.tree.TreeBatch`` (see ``kernels.checks``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

__all__ = [
    "WalkResult",
    "gather_kv",
    "kv_compact",
    "target_probs",
    "tree_attention",
    "tree_walk",
    "unpack_bits",
]


class WalkResult(NamedTuple):
    """Fixed-shape output of ``tree_walk`` (B requests, D = deepest tree depth).

    accepted_len ``int64[B]``: number of valid entries in the two rows below,
        i.e. accepted draft tokens + 1.
    accepted_nodes ``int64[B, D+1]``: local node indices of the accepted path,
        starting with the root 0, -1 padded.
    output_tokens ``int64[B, D+1]``: the accepted draft tokens then the bonus
        token, -1 padded.
    """

    accepted_len: torch.Tensor
    accepted_nodes: torch.Tensor
    output_tokens: torch.Tensor


def unpack_bits(words: torch.Tensor, n: int) -> torch.Tensor:
    """``int64[R, W]`` packed words -> ``bool[R, n]`` (bit ``j`` of row ``r``)."""
    j = torch.arange(n, device=words.device)
    return ((words[:, j // 64] >> (j % 64)) & 1).bool()


def slot_index(block_table: torch.Tensor | None, req: int, pos: torch.Tensor, block_size: int):
    """Flat slot of token position ``pos`` of request ``req`` in a paged cache."""
    if block_table is None:
        return req * block_size + pos  # contiguous [B, S, ...] viewed as [B*S, ...]
    return block_table[req, pos // block_size].to(torch.int64) * block_size + pos % block_size


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor | None, req: int, length: int
) -> torch.Tensor:
    """Tokens ``0..length-1`` of request ``req``: ``[length, kv_heads, head_dim]``.

    ``cache`` is paged ``[num_blocks, block_size, H, D]`` with ``block_table``, or
    contiguous ``[B, S, H, D]`` with ``block_table=None``.
    """
    flat = cache.reshape(-1, cache.shape[-2], cache.shape[-1])
    pos = torch.arange(length, device=cache.device)
    return flat[slot_index(block_table, req, pos, cache.shape[1])]


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
    """Dense masked tree attention.

    Args:
        q: ``[T, Hq, D]`` queries of every tree node of every request (fp32/fp16/bf16).
        k_cache, v_cache: paged ``[num_blocks, block_size, Hkv, D]`` (with
            ``block_table``) or contiguous ``[B, S, Hkv, D]``. Request ``b``'s
            prefix occupies positions ``0..prefix_lens[b]-1`` and its tree nodes
            the next ``num_nodes[b]`` positions, in node order.
        tree: the ``TreeBatch``.
        prefix_lens: ``int[B]`` committed tokens before each tree.
        block_table: ``int[B, max_blocks]`` or None for contiguous KV.
        scale: softmax scale, default ``1/sqrt(D)``.
        return_lse: also return the natural-log sum-exp of the scaled scores.

    Returns:
        ``out [T, Hq, D]`` in q's dtype, and ``lse [T, Hq]`` fp32 if asked.
    """
    total, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.empty_like(q)
    lse = torch.empty(total, hq, dtype=torch.float32, device=q.device)
    cu = tree.cu_nodes.tolist()
    for b in range(tree.num_requests):
        s, e = cu[b], cu[b + 1]
        n, plen = e - s, int(prefix_lens[b])
        k = gather_kv(k_cache, block_table, b, plen + n).float().repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, block_table, b, plen + n).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,shd->hns", q[s:e].float(), k) * scale
        visible = torch.ones(n, plen + n, dtype=torch.bool, device=q.device)
        visible[:, plen:] = unpack_bits(tree.packed_mask[s:e], n)
        scores = scores.masked_fill(~visible, float("-inf"))
        lse[s:e] = torch.logsumexp(scores, dim=-1).transpose(0, 1)
        out[s:e] = torch.einsum("hns,shd->nhd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return (out, lse) if return_lse else out


def target_probs(
    logits: torch.Tensor,
    request_ids: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    top_p: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Softmax of ``logits / temperature`` restricted to the top-p nucleus.

    ``logits [T, V]``; ``temperature``/``top_p`` scalars or ``[B]`` per request,
    indexed by ``request_ids [T]``. The nucleus is the smallest set of most
    likely tokens whose mass reaches ``top_p`` (ties broken by token id);
    A Python ``top_p >= 1`` keeps every token without sorting (a tensor is never
    read on the host: no device synchronisation).
    Returns float64 ``[T, V]`` rows summing to 1.
    """
    temp = torch.as_tensor(temperature, dtype=torch.float64, device=logits.device)
    topp = torch.as_tensor(top_p, dtype=torch.float64, device=logits.device)
    if temp.dim() == 1:
        temp = temp[request_ids][:, None]
    if topp.dim() == 1:
        topp = topp[request_ids][:, None]
    probs = torch.softmax(logits.double() / temp, dim=-1)
    if not torch.is_tensor(top_p) and top_p >= 1:  # the whole distribution: no sort
        return probs / probs.sum(-1, keepdim=True)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep_sorted = mass_before < topp
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum(-1, keepdim=True)


def sample_from(p: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample of the unnormalised 1-D ``p`` with a uniform ``u``."""
    cdf = torch.cumsum(p, 0)
    idx = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    return min(idx, int(torch.nonzero(p > 0).max()))  # never past the last supported token


def tree_walk(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tree: Any,
    mode: str = "greedy",
    uniforms: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    top_p: float | torch.Tensor = 1.0,
) -> WalkResult:
    """Pick the accepted root-to-node path and the bonus token of every request.

    Args:
        logits: ``[T, V]`` target logits at every node (row = next-token logits
            after that node).
        tokens: ``int[T]`` draft token of every node (the root's entry is ignored).
        tree: the ``TreeBatch``.
        mode: ``"greedy"``: follow the child whose token is the argmax; bonus is
            the argmax at the last accepted node. ``"target_only"`` (lossless for
            deterministic drafts, e.g. top-K): try the children in order, accept
            child c with probability p'(c), p' the target distribution with the
            already rejected siblings removed and renormalised; if all fail,
            sample the bonus from p'. ``"draft_probs"`` (lossless for children
            drawn without replacement from ``draft_probs[parent]``): accept with
            ``min(1, p(c)/q(c))``; on rejection ``p <- norm(max(p - q, 0))`` (p
            kept if that is all zero, i.e. p == q up to rounding) and the tried
            token is removed from q (recursive rejection sampling).
        uniforms: ``[T, 2]`` in [0, 1): column 0 is node i's acceptance test,
            column 1 the bonus draw when the walk stops at node i.
        draft_probs: ``[T, V]`` row i = the draft distribution node i's children
            were drawn from (``draft_probs`` mode only).
        temperature, top_p: applied to the target logits (stochastic modes).

    Returns:
        ``WalkResult`` with fixed shapes ``[B]``, ``[B, D+1]``, ``[B, D+1]``.
    """
    b_count, d = tree.num_requests, tree.max_depth
    dev = logits.device
    acc_len, acc_nodes, out_tokens = [], [], []  # Python lists: the loop is per element
    probs = None
    if mode != "greedy":
        probs = target_probs(logits, tree.request_ids, temperature, top_p)
    cu = tree.cu_nodes.tolist()
    first_child = tree.first_child.tolist()
    next_sibling = tree.next_sibling.tolist()
    tok = tokens.tolist()
    unif = uniforms.tolist() if uniforms is not None else None
    for b in range(b_count):
        s = cu[b]
        node, path, emitted = 0, [0], []
        while True:
            children = []
            c = first_child[s + node]
            while c != -1:
                children.append(c)
                c = next_sibling[s + c]
            accepted = None
            if mode == "greedy":
                best = int(torch.argmax(logits[s + node]))
                for c in children:
                    if tok[s + c] == best:
                        accepted = c
                        break
                bonus_dist = None
            else:
                p = probs[s + node].clone()
                q = draft_probs[s + node].double().clone() if mode == "draft_probs" else None
                for c in children:
                    t = tok[s + c]
                    u = unif[s + c][0]
                    if mode == "target_only":
                        ok = u * float(p.sum()) < float(p[t])
                    else:
                        ok = u * float(q[t]) < float(p[t])
                    if ok:
                        accepted = c
                        break
                    if mode == "target_only":
                        p[t] = 0.0
                    else:
                        residual = torch.clamp(p - q, min=0.0)
                        if float(residual.sum()) > 0:  # else p <= q: p == q up to rounding
                            p = residual / residual.sum()
                        q[t] = 0.0
                        q = q / q.sum() if float(q.sum()) > 0 else q
                bonus_dist = p
            if accepted is None:
                if mode == "greedy":
                    emitted.append(best)
                else:
                    emitted.append(sample_from(bonus_dist, unif[s + node][1]))
                break
            path.append(accepted)
            emitted.append(tok[s + accepted])
            node = accepted
        acc_len.append(len(path))
        acc_nodes.append(path + [-1] * (d + 1 - len(path)))
        out_tokens.append(emitted + [-1] * (d + 1 - len(emitted)))
    as_tensor = lambda rows: torch.tensor(rows, dtype=torch.int64, device=dev)
    return WalkResult(as_tensor(acc_len), as_tensor(acc_nodes), as_tensor(out_tokens))


def kv_compact(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    accepted_len: torch.Tensor,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Move the accepted nodes' K/V to the slots right after each prefix, in place.

    Args:
        k_cache, v_cache: paged ``[num_blocks, block_size, H, D]`` (with
            ``block_table``) or contiguous ``[B, S, H, D]``; an optional leading
            layer dimension compacts every layer at once.
        prefix_lens: ``int[B]``; node i of request b lives at position
            ``prefix_lens[b] + i``.
        accepted_nodes, accepted_len: from ``tree_walk`` (``[B, D+1]``, ``[B]``).
        block_table: ``int[B, max_blocks]`` or None.

    Returns:
        ``int64[B]`` new lengths ``prefix_lens + accepted_len`` (the bonus token
        has no K/V yet: it is the next step's root).
    """
    layered = k_cache.dim() == 5
    caches = (k_cache, v_cache) if layered else (k_cache[None], v_cache[None])
    bs = k_cache.shape[-3]
    for b in range(prefix_lens.shape[0]):
        plen, n = int(prefix_lens[b]), int(accepted_len[b])
        src_pos = plen + accepted_nodes[b, :n].to(torch.int64)
        dst_pos = plen + torch.arange(n, device=k_cache.device)
        src = slot_index(block_table, b, src_pos, bs)
        dst = slot_index(block_table, b, dst_pos, bs)
        for cache in caches:
            flat = cache.view(cache.shape[0], -1, cache.shape[-2], cache.shape[-1])
            flat[:, dst] = flat[:, src].clone()
    return prefix_lens.to(torch.int64) + accepted_len.to(torch.int64)
