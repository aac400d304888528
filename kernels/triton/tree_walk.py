"""Tree walk as Triton kernels: one program per request.

What runs in torch before the kernel (documented preprocessing, timed apart in
``bench.walk``): ``greedy`` takes ``argmax(logits, -1)`` per node; the
stochastic modes take ``kernels.reference.target_probs`` (softmax with
temperature and top-p, float64) and its row sums, plus the child table
(``int64[T, K]``, the r-th child of every node) derived from the tree.

- ``greedy`` (one launch): every node of the request is tested at once
  (``token == argmax at the parent``); a node is on the path iff no node among
  its ancestors (and itself) failed, read from the packed ancestor words
  ``tree.packed_mask``. No loops over nodes; fixed shapes.
- ``target_only`` / ``draft_probs``: a scalar walk down the levels, trying the
  children in sibling order with the same uniforms as the reference. The
  ``draft_probs`` residual ``p <- norm(max(p - q, 0))`` (kept if all zero),
  ``q <- norm(q - {t})``
  is updated over the vocabulary in per-request float64 scratch rows. The bonus
  token is the reference's inverse-CDF draw (count of CDF entries <= u * mass,
  clamped to the last supported token), computed over vocabulary blocks.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.reference import WalkResult, target_probs
from kernels.torchops.tree_walk import child_table, level_fanout

__all__ = ["greedy_from_argmax", "tree_walk", "walk_from_probs"]


@triton.jit
def _greedy_kernel(
    amax_ptr,  # int64[T] argmax per node
    tokens_ptr,  # int[T]
    parents_ptr,  # int64[T] local parent, -1 for the root
    depth_ptr,  # int64[T]
    cu_ptr,  # int64[B+1]
    packed_ptr,  # int64[T, W] ancestor words
    len_ptr,  # int64[B] out
    nodes_ptr,  # int64[B, D1] out
    toks_ptr,  # int64[B, D1] out
    D1,
    W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    s = tl.load(cu_ptr + pid)
    n = tl.load(cu_ptr + pid + 1) - s
    offs = tl.arange(0, BLOCK_N)
    m = offs < n
    par = tl.load(parents_ptr + s + offs, mask=m, other=-1)
    tok = tl.load(tokens_ptr + s + offs, mask=m, other=-1).to(tl.int64)
    am = tl.load(amax_ptr + s + tl.maximum(par, 0), mask=m, other=-2)
    fail = m & (par >= 0) & (tok != am)
    on = m
    for w in tl.static_range(W):
        bit = offs - w * 64
        inword = (bit >= 0) & (bit < 64)
        bits = tl.full([BLOCK_N], 1, tl.int64) << (bit & 63).to(tl.int64)
        fail_word = tl.sum(tl.where(fail & inword, bits, 0), axis=0)  # disjoint bits: sum == or
        anc = tl.load(packed_ptr + (s + offs) * W + w, mask=m, other=0)
        on = on & ((anc & fail_word) == 0)
    onp = on & (par >= 0)
    length = 1 + tl.sum(onp.to(tl.int64), axis=0)
    stop = tl.max(tl.where(onp, offs, 0), axis=0)  # deepest path node has the largest index
    dep = tl.load(depth_ptr + s + offs, mask=m, other=0)
    row = pid.to(tl.int64) * D1
    tl.store(nodes_ptr + row + dep, offs.to(tl.int64), mask=onp)
    tl.store(toks_ptr + row + dep - 1, tok, mask=onp)
    d = tl.arange(0, BLOCK_D)
    dm = d < D1
    tl.store(
        nodes_ptr + row + d,
        tl.where(d == 0, 0, -1).to(tl.int64),
        mask=dm & ((d == 0) | (d >= length)),
    )
    bonus = tl.load(amax_ptr + s + stop)
    tl.store(toks_ptr + row + d, tl.where(d == length - 1, bonus, -1), mask=dm & (d >= length - 1))
    tl.store(len_ptr + pid, length)


@triton.jit
def _stochastic_kernel(
    probs_ptr,  # float64[T, V] target probabilities
    rowsum_ptr,  # float64[T] their row sums
    q_ptr,  # [T, V] draft probabilities (DRAFT only)
    tokens_ptr,  # int[T]
    table_ptr,  # int64[T, K] global child index, -1 padded
    u_ptr,  # [T, 2] uniforms
    cu_ptr,  # int64[B+1]
    work_p_ptr,  # float64[B, V] scratch (DRAFT only)
    work_q_ptr,  # float64[B, V] scratch (DRAFT only)
    len_ptr,
    nodes_ptr,
    toks_ptr,
    V,
    D1,
    LEVELS,
    K: tl.constexpr,
    DRAFT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    s = tl.load(cu_ptr + pid)
    row = pid.to(tl.int64) * D1
    wrow = pid.to(tl.int64) * V
    vo = tl.arange(0, BLOCK_V)
    node = s
    active = pid * 0 + 1
    length = pid * 0 + 1
    for _level in range(LEVELS):
        if active != 0:
            prow = node.to(tl.int64) * V
            if DRAFT:
                for v0 in range(0, V, BLOCK_V):
                    vm = v0 + vo < V
                    p = tl.load(probs_ptr + prow + v0 + vo, mask=vm, other=0.0)
                    q = tl.load(q_ptr + prow + v0 + vo, mask=vm, other=0.0).to(tl.float64)
                    tl.store(work_p_ptr + wrow + v0 + vo, p, mask=vm)
                    tl.store(work_q_ptr + wrow + v0 + vo, q, mask=vm)
                tl.debug_barrier()
            mass = tl.load(rowsum_ptr + node)
            acc = node * 0 - 1
            for r in range(K):
                c = tl.load(table_ptr + node.to(tl.int64) * K + r)
                if (c >= 0) & (acc < 0):
                    t = tl.load(tokens_ptr + c).to(tl.int64)
                    u0 = tl.load(u_ptr + c * 2).to(tl.float64)
                    if DRAFT:
                        pt = tl.load(work_p_ptr + wrow + t)
                        qt = tl.load(work_q_ptr + wrow + t)
                        if u0 * qt < pt:
                            acc = c
                        else:
                            # residual p <- norm(max(p - q, 0)) (kept if all zero),
                            # q <- norm(q without t): sums first, then one update pass
                            zp = tl.zeros([BLOCK_V], tl.float64)
                            zq = tl.zeros([BLOCK_V], tl.float64)
                            for v0 in range(0, V, BLOCK_V):
                                vm = v0 + vo < V
                                p = tl.load(work_p_ptr + wrow + v0 + vo, mask=vm, other=0.0)
                                q = tl.load(work_q_ptr + wrow + v0 + vo, mask=vm, other=0.0)
                                zp += tl.maximum(p - q, 0.0)
                                zq += tl.where(v0 + vo == t, 0.0, q)
                            sp = tl.sum(zp, axis=0)
                            sq = tl.sum(zq, axis=0)
                            for v0 in range(0, V, BLOCK_V):
                                vm = v0 + vo < V
                                p = tl.load(work_p_ptr + wrow + v0 + vo, mask=vm, other=0.0)
                                q = tl.load(work_q_ptr + wrow + v0 + vo, mask=vm, other=0.0)
                                res = tl.maximum(p - q, 0.0) / tl.where(sp > 0, sp, 1.0)
                                p = tl.where(sp > 0, res, p)
                                q = tl.where(v0 + vo == t, 0.0, q)
                                q = q / tl.where(sq > 0, sq, 1.0)
                                tl.store(work_p_ptr + wrow + v0 + vo, p, mask=vm)
                                tl.store(work_q_ptr + wrow + v0 + vo, q, mask=vm)
                            tl.debug_barrier()
                    else:
                        pt = tl.load(probs_ptr + prow + t)
                        if u0 * mass < pt:
                            acc = c
                        else:
                            mass = mass - pt
            if acc >= 0:
                tl.store(nodes_ptr + row + length, (acc - s).to(tl.int64))
                tl.store(toks_ptr + row + length - 1, tl.load(tokens_ptr + acc).to(tl.int64))
                length += 1
                node = acc
            else:
                active = active * 0
    # Bonus: inverse CDF over the stop node's distribution. target_only: the target row
    # with the (all rejected) children's tokens removed; draft_probs: the residual row.
    ko = tl.arange(0, BLOCK_K)
    if DRAFT:
        base = work_p_ptr + wrow
        kid_tok = tl.full([BLOCK_K], -1, tl.int64)
    else:
        base = probs_ptr + node.to(tl.int64) * V
        kid = tl.load(table_ptr + node.to(tl.int64) * K + ko, mask=ko < K, other=-1)
        kid_tok = tl.load(tokens_ptr + tl.maximum(kid, 0), mask=kid >= 0, other=-1).to(tl.int64)
    tot = tl.zeros([BLOCK_V], tl.float64)
    last = tl.full([BLOCK_V], -1, tl.int64)
    for v0 in range(0, V, BLOCK_V):
        vid = v0 + vo
        vm = vid < V
        p = tl.load(base + vid, mask=vm, other=0.0)
        gone = tl.sum((vid[:, None].to(tl.int64) == kid_tok[None, :]).to(tl.int32), axis=1) > 0
        p = tl.where(gone, 0.0, p)
        tot += p
        last = tl.maximum(last, tl.where(p > 0, vid.to(tl.int64), -1))
    u1 = tl.load(u_ptr + node * 2 + 1).to(tl.float64)
    target = u1 * tl.sum(tot, axis=0)
    carry = tl.zeros([], tl.float64)
    count = tl.zeros([], tl.int64)
    for v0 in range(0, V, BLOCK_V):
        vid = v0 + vo
        vm = vid < V
        p = tl.load(base + vid, mask=vm, other=0.0)
        gone = tl.sum((vid[:, None].to(tl.int64) == kid_tok[None, :]).to(tl.int32), axis=1) > 0
        p = tl.where(gone, 0.0, p)
        cdf = carry + tl.cumsum(p, axis=0)
        count += tl.sum((vm & (cdf <= target)).to(tl.int64), axis=0)
        carry = carry + tl.sum(p, axis=0)
    bonus = tl.minimum(count, tl.max(last, axis=0))
    d = tl.arange(0, BLOCK_D)
    dm = d < D1
    tl.store(
        nodes_ptr + row + d,
        tl.where(d == 0, 0, -1).to(tl.int64),
        mask=dm & ((d == 0) | (d >= length)),
    )
    tl.store(toks_ptr + row + d, tl.where(d == length - 1, bonus, -1), mask=dm & (d >= length - 1))
    tl.store(len_ptr + pid, length)


def _outputs(b: int, d1: int, device: torch.device):
    e = lambda *shape: torch.empty(*shape, dtype=torch.int64, device=device)
    return e(b), e(b, d1), e(b, d1)


def greedy_from_argmax(amax: torch.Tensor, tokens: torch.Tensor, tree: Any) -> WalkResult:
    """Greedy walk from the argmax per node ``int64[T]``: exactly one kernel launch.

    ``tokens`` ``int[T]`` contiguous; the tree's tensors on the same device.
    """
    b, d1 = tree.num_requests, tree.max_depth + 1
    acc_len, nodes, toks = _outputs(b, d1, amax.device)
    packed = tree.packed_mask.contiguous()
    _greedy_kernel[(b,)](
        amax,
        tokens,
        tree.parents,
        tree.depth,
        tree.cu_nodes,
        packed,
        acc_len,
        nodes,
        toks,
        d1,
        W=packed.shape[1],
        BLOCK_N=triton.next_power_of_2(tree.max_nodes),
        BLOCK_D=triton.next_power_of_2(d1),
    )
    return WalkResult(acc_len, nodes, toks)


def walk_from_probs(
    probs: torch.Tensor,
    tokens: torch.Tensor,
    tree: Any,
    mode: str,
    uniforms: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    block_v: int | None = None,
) -> WalkResult:
    """Stochastic walk from ``probs = reference.target_probs(...)`` (float64 ``[T, V]``).

    One launch (plus the row sums and the child table, derived in torch).
    """
    if mode not in ("target_only", "draft_probs"):
        raise ValueError(f"unknown walk mode {mode!r}")
    b, d1 = tree.num_requests, tree.max_depth + 1
    dev = probs.device
    acc_len, nodes, toks = _outputs(b, d1, dev)
    draft = mode == "draft_probs"
    probs = probs.contiguous()
    vocab = probs.shape[1]
    kmax = max([1, *level_fanout(tree)])
    table = child_table(tree, kmax).contiguous()
    if block_v is None:
        block_v = 1024 if dev.type == "cuda" else triton.next_power_of_2(vocab)
    if draft:
        q = draft_probs.contiguous()
        work_p = torch.empty(b, vocab, dtype=torch.float64, device=dev)
        work_q = torch.empty(b, vocab, dtype=torch.float64, device=dev)
    else:
        q = work_p = work_q = probs
    _stochastic_kernel[(b,)](
        probs,
        probs.sum(-1),
        q,
        tokens.contiguous(),
        table,
        uniforms.contiguous(),
        tree.cu_nodes,
        work_p,
        work_q,
        acc_len,
        nodes,
        toks,
        vocab,
        d1,
        d1 if draft else d1 - 1,  # draft: one more level copies a leaf's row for the bonus
        K=kmax,
        DRAFT=draft,
        BLOCK_V=block_v,
        BLOCK_K=triton.next_power_of_2(kmax),
        BLOCK_D=triton.next_power_of_2(d1),
    )
    return WalkResult(acc_len, nodes, toks)


def tree_walk(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tree: Any,
    mode: str = "greedy",
    uniforms: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    top_p: float | torch.Tensor = 1.0,
    block_v: int | None = None,
) -> WalkResult:
    """Triton tree walk; arguments and result as ``kernels.reference.tree_walk``.

    Args:
        logits: ``[T, V]`` fp32/fp16/bf16 on CUDA (or CPU under ``TRITON_INTERPRET=1``).
        tokens: ``int[T]``; tree: ``TreeBatch`` on the same device.
        mode, uniforms ``[T, 2]``, draft_probs ``[T, V]``, temperature, top_p: as the
            reference.
        block_v: vocabulary block of the stochastic kernel (default: 1024 on CUDA,
            the whole vocabulary on the interpreter, whose cost is per block).

    Returns:
        ``WalkResult`` of int64 ``[B]``, ``[B, D+1]``, ``[B, D+1]``, -1 padded.
    """
    tokens = tokens.contiguous()
    if mode == "greedy":
        return greedy_from_argmax(torch.argmax(logits, dim=-1), tokens, tree)
    if mode not in ("target_only", "draft_probs"):
        raise ValueError(f"unknown walk mode {mode!r}")
    probs = target_probs(logits, tree.request_ids, temperature, top_p)
    return walk_from_probs(probs, tokens, tree, mode, uniforms, draft_probs, block_v)
