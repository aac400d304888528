"""NKI tree walk: vectorised acceptance, no data-dependent control flow.

Requests are packed whole into tiles of <= 128 nodes (nodes on the partition
axis, <= 128 requests per tile); grid axis 0 = tile. In the kernel, for every
node at once:

* acceptance test: ``greedy``: the node's token equals its parent's argmax
  (argmax over the vocabulary by ``max8`` + ``nc_find_index8`` per 16K chunk,
  the parent's value gathered by a matmul with the parent matrix);
  ``target_only``: ``u * (S - C) < p`` with ``p`` the node's token probability
  under the parent's target distribution, ``S`` that distribution's mass and
  ``C`` the running sum of the earlier siblings' ``p`` (a matmul with the
  earlier-sibling matrix): the conditional probability of accepting the i-th
  sibling after the earlier ones were rejected; ``draft_probs``: ``u * q' < p'``;
* a node *wins* when it is accepted and no earlier sibling is (sibling matmul);
  it is on the path when it and all its ancestors win (ancestor matmul);
* the deepest on-path node of each request by ``max8`` / ``nc_find_index8`` over
  ``(depth + 1) * on_path``: its value is the accepted length;
* the path, its tokens and the bonus token are scattered into the fixed-shape
  outputs by matmuls with depth one-hot tables (exact in fp32).

Host preprocessing in torch (documented in ``docs/nki_executor.md``): tree
structure tables (0/1 matrices), padding; for the stochastic modes the target
distribution (``reference.target_probs``: temperature, top-p, softmax, float64),
the gathers ``p``, ``S`` (and for ``draft_probs`` the residual recursion
``p' = norm(max(p - q, 0))``, ``q'`` without the tried token, which gives the
``p'``, ``q'`` at each sibling), and every node's bonus candidate: an inverse-CDF
draw with ``uniforms[:, 1]`` from the distribution left when all its children
are rejected. The kernel selects which candidate is emitted. Token ids travel
as fp32 (exact below 2**24).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.nki.runtime import nisa, nki, nl
from kernels.reference import WalkResult, target_probs, unpack_bits

MAX_TREE_NODES = 128  # one tree per tile of <= 128 partitions
VOCAB_CHUNK = 16384  # max8 / nc_find_index8 read <= 16384 elements per partition
# columns of the per-node vector input
TOKEN, UNIFORM, X1, X2, BONUS, DEPTH, LOCAL, ROOT = range(8)


def _argmax_rows(logits_t, nt: int):
    """fp32 ``[nt, 1]`` first-occurrence argmax of each row of the HBM ``[nt, V]`` view."""
    vocab = logits_t.shape[1]
    best_v = best_i = None
    for c0 in nl.static_range(0, vocab, VOCAB_CHUNK):
        w = min(VOCAB_CHUNK, vocab - c0)
        if w < 8:  # max8 needs >= 8 elements: re-read the last 8 (ties keep the first)
            c0, w = vocab - 8, 8
        chunk = nl.load(logits_t[:, c0 : c0 + w])
        top = nl.ndarray((nt, 8), dtype=nl.float32)
        nisa.max8(top, chunk)
        idx = nl.ndarray((nt, 8), dtype=nl.uint32)
        nisa.nc_find_index8(idx, chunk, top)
        idx_f = nl.ndarray((nt, 1), dtype=nl.float32)
        nisa.tensor_scalar(idx_f, idx[:, 0:1], nl.add, float(c0))
        if best_v is None:
            best_v = nl.ndarray((nt, 1), dtype=nl.float32)
            nisa.tensor_copy(best_v, top[:, 0:1])
            best_i = idx_f
        else:
            better = nl.greater(top[:, 0:1], best_v)
            best_i = nl.where(better, idx_f, best_i, dtype=nl.float32)
            nisa.tensor_tensor(best_v, best_v, top[:, 0:1], nl.maximum)
    return best_i


def _matvec(stationary, vector, rows: int):
    """``stationary.T @ vector`` -> PSUM fp32 ``[rows, 1]``."""
    res = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(res, stationary, vector)
    return res


@nki.jit
def tree_walk_kernel(vec, anc_t, sib_t, par_t, member, slot, prev_slot, logits, mode):
    """One tile of whole requests per program (grid: ``(tiles,)``).

    vec ``[tiles, N, 8]`` fp32 per-node columns (token, u, x1, x2, bonus, depth,
    local index, is_root); anc_t / sib_t / par_t ``[tiles, N, N]`` fp32: ``[j, i] = 1``
    if j is an ancestor-or-self / an earlier sibling / the parent of i; member
    ``[tiles, N, Bt]`` node-in-request; slot / prev_slot ``[tiles, N, S]``: depth
    (depth - 1) one-hot; logits ``[tiles, N, V]`` (greedy; else unused); mode 0 greedy,
    1 target_only, 2 draft_probs. Returns int32 ``acc_len [tiles, Bt, 1]``,
    ``nodes [tiles, Bt, S]``, ``tokens [tiles, Bt, S]``.
    """
    tiles, n, _ = vec.shape
    bt = member.shape[2]
    s = slot.shape[2]
    t = nl.program_id(0)
    out_len = nl.ndarray((tiles, bt, 1), dtype=nl.int32, buffer=nl.shared_hbm)
    out_nodes = nl.ndarray((tiles, bt, s), dtype=nl.int32, buffer=nl.shared_hbm)
    out_tokens = nl.ndarray((tiles, bt, s), dtype=nl.int32, buffer=nl.shared_hbm)

    v = nl.load(vec[t])
    token, u, x1, x2 = (
        v[:, TOKEN : TOKEN + 1],
        v[:, UNIFORM : UNIFORM + 1],
        v[:, X1 : X1 + 1],
        v[:, X2 : X2 + 1],
    )
    anc = nl.load(anc_t[t])
    sib = nl.load(sib_t[t])
    mem = nl.load(member[t])

    # -- every node's acceptance test, all depths at once
    accept = nl.ndarray((n, 1), dtype=nl.float32)
    if mode == 0:
        amax = _argmax_rows(logits[t], n)
        parent_amax = _matvec(nl.load(par_t[t]), amax, n)
        nisa.tensor_tensor(accept, token, parent_amax, nl.equal)
        bonus = amax
    else:
        bonus = v[:, BONUS : BONUS + 1]
        mass = nl.ndarray((n, 1), dtype=nl.float32)
        if mode == 1:  # conditional prob after earlier siblings were rejected: running sum
            earlier_p = _matvec(sib, x1, n)
            nisa.tensor_tensor(mass, x2, earlier_p, nl.subtract)
        else:
            nisa.tensor_copy(mass, x2)
        nisa.tensor_tensor(mass, mass, u, nl.multiply)
        nisa.tensor_tensor(accept, mass, x1, nl.less)
        positive = nl.ndarray((n, 1), dtype=nl.float32)
        nisa.tensor_scalar(positive, x1, nl.greater, 0.0)
        nisa.tensor_tensor(accept, accept, positive, nl.multiply)

    # -- first accepted sibling wins; on the path iff every ancestor-or-self wins
    earlier_acc = _matvec(sib, accept, n)
    wins = nl.ndarray((n, 1), dtype=nl.float32)
    nisa.tensor_scalar(wins, earlier_acc, nl.equal, 0.0)
    nisa.tensor_tensor(wins, wins, accept, nl.multiply)
    nisa.tensor_tensor(wins, wins, v[:, ROOT : ROOT + 1], nl.maximum)
    lose = nl.ndarray((n, 1), dtype=nl.float32)
    nisa.tensor_scalar(lose, wins, nl.subtract, 1.0, reverse0=True)
    lost_above = _matvec(anc, lose, n)
    on_path = nl.ndarray((n, 1), dtype=nl.float32)
    nisa.tensor_scalar(on_path, lost_above, nl.equal, 0.0)

    # -- deepest on-path node per request: max8 / nc_find_index8 over (depth + 1) * on_path
    score = nl.ndarray((n, 1), dtype=nl.float32)
    nisa.tensor_scalar(score, v[:, DEPTH : DEPTH + 1], nl.add, 1.0)
    nisa.tensor_tensor(score, score, on_path, nl.multiply)
    per_req = nl.ndarray((n, bt), dtype=nl.float32)
    nisa.tensor_scalar(per_req, mem, nl.multiply, score)
    per_req_t_ps = nl.ndarray((bt, n), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(per_req_t_ps, per_req)
    per_req_t = nl.ndarray((bt, n), dtype=nl.float32)
    nisa.tensor_copy(per_req_t, per_req_t_ps)
    top = nl.ndarray((bt, 8), dtype=nl.float32)
    nisa.max8(top, per_req_t)
    where = nl.ndarray((bt, 8), dtype=nl.uint32)
    nisa.nc_find_index8(where, per_req_t, top)
    deepest = nl.ndarray((bt, 1), dtype=nl.float32)
    nisa.tensor_copy(deepest, where[:, 0:1])
    mem_t_ps = nl.ndarray((bt, n), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(mem_t_ps, mem)
    mem_t = nl.ndarray((bt, n), dtype=nl.float32)
    nisa.tensor_copy(mem_t, mem_t_ps)
    my_deepest = _matvec(mem_t, deepest, n)
    node_id = nl.ndarray((n, 1), dtype=nl.float32)
    nisa.iota(node_id, [[0, 1]], 0, channel_multiplier=1)
    is_deepest = nl.ndarray((n, 1), dtype=nl.float32)
    nisa.tensor_tensor(is_deepest, my_deepest, node_id, nl.equal)
    nisa.tensor_tensor(is_deepest, is_deepest, on_path, nl.multiply)

    # -- fixed-shape outputs: one-hot scatter by depth through the Tensor Engine
    def weights(column):
        w = nl.ndarray((n, bt), dtype=nl.float32)
        nisa.tensor_scalar(w, mem, nl.multiply, column)
        return w

    slot_t = nl.load(slot[t])
    prev_t = nl.load(prev_slot[t])
    path_tok = nl.multiply(on_path, token)
    deep_bonus = nl.multiply(is_deepest, bonus)
    path_local = nl.multiply(on_path, v[:, LOCAL : LOCAL + 1])
    w_on, w_deep = weights(on_path), weights(is_deepest)
    tok_ps = nl.ndarray((bt, s), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(tok_ps, weights(path_tok), prev_t)
    nisa.nc_matmul(tok_ps, weights(deep_bonus), slot_t, accumulate=True)
    nisa.nc_matmul(tok_ps, w_on, prev_t, accumulate=True)  # +1 on valid slots
    nisa.nc_matmul(tok_ps, w_deep, slot_t, accumulate=True)
    node_ps = nl.ndarray((bt, s), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(node_ps, weights(path_local), slot_t)
    nisa.nc_matmul(node_ps, w_on, slot_t, accumulate=True)
    tok_i = nl.ndarray((bt, s), dtype=nl.int32)
    nisa.tensor_scalar(tok_i, tok_ps, nl.subtract, 1.0)  # invalid slots: 0 - 1 = -1
    node_i = nl.ndarray((bt, s), dtype=nl.int32)
    nisa.tensor_scalar(node_i, node_ps, nl.subtract, 1.0)
    len_i = nl.ndarray((bt, 1), dtype=nl.int32)
    nisa.tensor_copy(len_i, top[:, 0:1])
    nl.store(out_len[t], len_i)
    nl.store(out_nodes[t], node_i)
    nl.store(out_tokens[t], tok_i)
    return out_len, out_nodes, out_tokens


def _sample_rows(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row-wise ``reference.sample_from``: inverse-CDF draw from unnormalised rows."""
    cdf = torch.cumsum(p, -1)
    idx = torch.searchsorted(cdf, u[:, None].double() * cdf[:, -1:], right=True)[:, 0]
    ar = torch.arange(p.shape[1], device=p.device)
    last = torch.where(p > 0, ar, torch.zeros_like(ar)).max(-1).values
    return torch.minimum(idx, last)


def _stochastic_inputs(logits, tokens, tree, mode, uniforms, draft_probs, temperature, top_p):
    """Per node ``x1, x2, bonus`` (float64) for the stochastic modes."""
    probs = target_probs(logits, tree.request_ids, temperature, top_p)
    nodes = torch.nonzero(tree.parents >= 0)[:, 0]
    gp = (tree.parents + tree.cu_nodes[tree.request_ids])[nodes]
    tok = tokens[nodes].to(torch.int64)
    x1 = torch.zeros(probs.shape[0], dtype=torch.float64)
    x2 = torch.zeros_like(x1)
    if mode == "target_only":
        x1[nodes] = probs[gp, tok]
        x2[nodes] = probs.sum(-1)[gp]
        rest = probs.clone()
        rest[gp, tok] = 0.0  # the distribution left once every child is rejected
    else:
        p, q = probs.clone(), draft_probs.double().clone()
        rank = tree.sibling_rank[nodes]
        for k in range(int(rank.max()) + 1 if nodes.numel() else 0):
            sel = rank == k  # each parent has at most one child of rank k
            ids, par, tk = nodes[sel], gp[sel], tok[sel]
            x1[ids], x2[ids] = p[par, tk], q[par, tk]
            pp = torch.clamp(p[par] - q[par], min=0.0)
            ps = pp.sum(-1, keepdim=True)
            p[par] = torch.where(ps > 0, pp / ps, p[par])  # p <= q everywhere: keep p (reference)
            qq = q[par]
            qq[torch.arange(qq.shape[0]), tk] = 0.0
            qs = qq.sum(-1, keepdim=True)
            q[par] = torch.where(qs > 0, qq / qs, qq)
        rest = p
    bonus = _sample_rows(rest, uniforms[:, 1])
    return x1, x2, bonus


def _pack(tree) -> list[tuple[int, int]]:
    """Consecutive requests packed into tiles of <= 128 nodes and <= 128 requests."""
    sizes = tree.num_nodes.tolist()
    tiles, start, nodes = [], 0, 0
    for b, n in enumerate(sizes):
        if b > start and (nodes + n > 128 or b - start >= 128):
            tiles.append((start, b))
            start, nodes = b, 0
        nodes += n
    tiles.append((start, len(sizes)))
    return tiles


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
    """Tree walk on NKI (see ``kernels.tree_walk``); trees of <= 128 nodes.

    Args:
        logits: ``[T, V]`` target logits; tokens: ``int[T]``; tree: ``TreeBatch``.
        mode: ``"greedy" | "target_only" | "draft_probs"``; uniforms ``[T, 2]``;
        draft_probs ``[T, V]``; temperature, top_p: scalars or ``[B]``.

    Returns:
        ``WalkResult`` int64 ``[B]``, ``[B, D+1]``, ``[B, D+1]``, equal to the reference.
    """
    dev = logits.device
    logits, tokens = logits.cpu(), tokens.cpu()
    tree = tree.to("cpu")
    total, vocab = logits.shape
    cu = tree.cu_nodes.tolist()
    slots = tree.max_depth + 1
    packs = _pack(tree)
    n_tile = max(8, max(cu[e] - cu[s] for s, e in packs))
    b_tile = max(e - s for s, e in packs)
    n_tiles = len(packs)

    local = torch.arange(total) - tree.cu_nodes[tree.request_ids]
    vec = torch.zeros(total, 8, dtype=torch.float64)
    vec[:, TOKEN] = tokens.to(torch.float64)
    vec[:, DEPTH] = tree.depth.double()
    vec[:, LOCAL] = local.double()
    vec[:, ROOT] = (tree.parents < 0).double()
    mode_id = {"greedy": 0, "target_only": 1, "draft_probs": 2}[mode]
    if mode_id:
        vec[:, UNIFORM] = uniforms[:, 0].cpu().double()
        x1, x2, bonus = _stochastic_inputs(
            logits, tokens, tree, mode, uniforms.cpu(), draft_probs, temperature, top_p
        )
        vec[:, X1], vec[:, X2], vec[:, BONUS] = x1, x2, bonus.double()

    vec_t = torch.zeros(n_tiles, n_tile, 8)
    vec_t[:, :, TOKEN] = -1.0  # padding nodes: never accepted, never on a path
    anc = torch.zeros(n_tiles, n_tile, n_tile)
    sib = torch.zeros_like(anc)
    par = torch.zeros_like(anc)
    member = torch.zeros(n_tiles, n_tile, b_tile)
    slot = torch.zeros(n_tiles, n_tile, slots)
    prev = torch.zeros_like(slot)
    ldtype = logits.dtype if logits.dtype in (torch.float32, torch.bfloat16) else torch.float32
    vp = max(vocab, 8)
    lg = torch.full(
        (n_tiles, n_tile, vp) if mode_id == 0 else (1, 1, 8), float("-inf"), dtype=ldtype
    )
    depth = tree.depth
    for k, (b0, b1) in enumerate(packs):
        ns, ne = cu[b0], cu[b1]
        m = ne - ns
        rows = torch.arange(m)
        vec_t[k, :m] = vec[ns:ne].float()
        req = tree.request_ids[ns:ne]
        off = tree.cu_nodes[req] - ns  # tile row of each node's root
        gp = torch.where(tree.parents[ns:ne] >= 0, tree.parents[ns:ne] + off, -1)
        bits = unpack_bits(tree.packed_mask[ns:ne], tree.max_nodes)  # [m, max_nodes] local
        cols = off[:, None] + torch.arange(tree.max_nodes)
        ok = bits & (torch.arange(tree.max_nodes) < tree.num_nodes[req][:, None])
        a = torch.zeros(m, m)
        a[rows[:, None].expand_as(cols)[ok], cols[ok]] = 1.0
        anc[k, :m, :m] = a.t()
        rank = tree.sibling_rank[ns:ne]
        same = (gp[:, None] == gp[None, :]) & (gp[:, None] >= 0)
        sib[k, :m, :m] = (same & (rank[:, None] < rank[None, :])).float()  # [j, i]
        has_parent = gp >= 0
        par[k, gp[has_parent], rows[has_parent]] = 1.0
        member[k, rows, req - b0] = 1.0
        d = depth[ns:ne]
        slot[k, rows, d] = 1.0
        prev[k, rows[d > 0], d[d > 0] - 1] = 1.0
        if mode_id == 0:
            lg[k, :m, :vocab] = logits[ns:ne].to(ldtype)

    out_len, out_nodes, out_tok = tree_walk_kernel[n_tiles](
        vec_t, anc, sib, par, member, slot, prev, lg, mode_id
    )
    sel_t = torch.repeat_interleave(torch.arange(n_tiles), torch.tensor([e - s for s, e in packs]))
    sel_b = torch.cat([torch.arange(e - s) for s, e in packs])
    return WalkResult(
        out_len[sel_t, sel_b, 0].to(torch.int64).to(dev),
        out_nodes[sel_t, sel_b].to(torch.int64).to(dev),
        out_tok[sel_t, sel_b].to(torch.int64).to(dev),
    )


tree_walk.max_tree_nodes = MAX_TREE_NODES
