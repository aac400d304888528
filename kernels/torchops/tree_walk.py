"""Tree walk in plain PyTorch, vectorised over requests and nodes.

No Python loop over nodes and no host synchronisation: the only Python loops
run over depth levels and sibling ranks, whose bounds come from the tree's
host-side structure (``tree.max_depth`` and the fan-out of each level), so a
fixed tree shape gives a fixed sequence of kernels (CUDA-graph friendly).
Same integers as ``kernels.reference.tree_walk`` for the same uniforms:
probabilities are float64 from the same ``target_probs``, and the bonus token
is drawn by the same inverse CDF (``reference.sample_from``).

- ``greedy``: node c passes iff its token is the argmax at its parent. On the CPU
  the walk goes level by level and takes the argmax only at the current node of
  each request (``D * B`` rows, not ``T``); elsewhere one argmax over all nodes.
- ``target_only``: child c of rank r passes iff ``u_c * S < p[t_c]`` where
  ``S`` is the parent's mass minus a running sum of the earlier siblings'
  target probabilities (rejected siblings removed, unnormalised). Given the
  probabilities of every node (``walk_from_probs``, and on CUDA) all nodes are
  tested at once; from logits on the CPU the same test runs level by level on
  the current nodes only, so ``target_probs`` (a sort over the vocabulary) runs
  on ``D * B`` rows instead of ``T``.
- ``draft_probs``: the residual update (``p`` kept when ``max(p - q, 0)`` is all
  zero, as in the reference) is sequential over siblings, so this
  mode walks level by level (one current node per request) and loops over
  sibling rank, vectorised over requests and the vocabulary; the target
  probabilities are computed for the visited nodes only.

A node is on the accepted path iff its parent is, it passes, and all its
earlier siblings failed.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.reference import WalkResult, target_probs

__all__ = [
    "child_table",
    "greedy_from_argmax",
    "level_fanout",
    "sample_inverse_cdf",
    "tree_walk",
    "walk_from_probs",
]


def level_fanout(tree: Any) -> list[int]:
    """Max number of children of a node at each depth ``0..max_depth-1`` (host ints).

    Read from the host-side ``TokenTree`` objects of a ``TreeBatch`` (no device
    sync); trees without them fall back to reading ``parents``/``depth`` back.
    """
    d = tree.max_depth
    fan = [0] * d
    trees = getattr(tree, "trees", None)
    if trees is not None:
        for t in trees:
            for depth, kids in zip(t.depth.tolist(), t.num_children.tolist(), strict=True):
                if depth < d:
                    fan[depth] = max(fan[depth], kids)
        return fan
    parents = tree.parents.cpu()
    cu = tree.cu_nodes.cpu()[tree.request_ids.cpu()]
    depth = tree.depth.cpu()
    nonroot = parents >= 0
    counts = torch.bincount((parents + cu)[nonroot], minlength=parents.shape[0])
    for lvl in range(d):
        sel = counts[depth == lvl]
        fan[lvl] = int(sel.max()) if sel.numel() else 0
    return fan


def child_table(tree: Any, kmax: int) -> torch.Tensor:
    """``int64[T, kmax]``: global index of the r-th child of every node, -1 padded."""
    total = tree.parents.shape[0]
    dev = tree.parents.device
    table = torch.full((total, kmax + 1), -1, dtype=torch.int64, device=dev)
    idx = torch.arange(total, device=dev)
    nonroot = tree.parents >= 0
    gparent = tree.parents.clamp(min=0) + tree.cu_nodes[tree.request_ids]
    # Roots are written to a spare column of their own row, so no boolean indexing.
    row = torch.where(nonroot, gparent, idx)
    col = torch.where(nonroot, tree.sibling_rank, torch.full_like(idx, kmax))
    table[row, col] = torch.where(nonroot, idx, torch.full_like(idx, -1))
    return table[:, :kmax]


def sample_inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row-wise ``reference.sample_from``: ``p [B, V]`` unnormalised, ``u [B]`` -> ``int64[B]``."""
    cdf = torch.cumsum(p, dim=-1)
    target = (u.to(cdf.dtype) * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]
    vocab_ids = torch.arange(p.shape[1], device=p.device)
    last = torch.where(p > 0, vocab_ids, torch.zeros_like(vocab_ids)).amax(-1)
    return torch.minimum(idx, last)


def _path_outputs(on, tree, tokens, d):
    """From the on-path flags ``bool[T]`` to (len, nodes, drafted tokens, stop node)."""
    b = tree.num_requests
    dev = on.device
    total = on.shape[0]
    local = torch.arange(total, device=dev) - tree.cu_nodes[tree.request_ids]
    nonroot = tree.parents >= 0
    on = on & nonroot
    acc_len = torch.ones(b, dtype=torch.int64, device=dev)
    acc_len.index_add_(0, tree.request_ids, on.to(torch.int64))
    # Scatter into one spare column (d + 1) for nodes that are not on the path.
    col = torch.where(on, tree.depth, torch.full_like(tree.depth, d + 1))
    nodes = torch.full((b, d + 2), -1, dtype=torch.int64, device=dev)
    nodes[tree.request_ids, col] = torch.where(on, local, torch.full_like(local, -1))
    nodes[:, 0] = 0
    toks = torch.full((b, d + 2), -1, dtype=torch.int64, device=dev)
    col_t = torch.where(on, tree.depth - 1, torch.full_like(tree.depth, d + 1))
    toks[tree.request_ids, col_t] = torch.where(on, tokens.to(torch.int64), -1)
    stop = torch.zeros(b, dtype=torch.int64, device=dev)
    stop.scatter_reduce_(0, tree.request_ids, torch.where(on, local, 0), reduce="amax")
    return acc_len, nodes[:, : d + 1], toks[:, : d + 1], stop


def _finish(acc_len, nodes, toks, bonus):
    toks.scatter_(1, (acc_len - 1)[:, None], bonus[:, None].to(torch.int64))
    return WalkResult(acc_len, nodes, toks)


def _propagate(passes: torch.Tensor, tree: Any) -> torch.Tensor:
    """On-path flags: a node is on the path iff it and all its ancestors pass."""
    gparent = tree.parents.clamp(min=0) + tree.cu_nodes[tree.request_ids]
    is_root = tree.parents < 0
    on = passes | is_root
    for _ in range(tree.max_depth):
        on = (passes & on[gparent]) | is_root
    return on


def greedy_from_argmax(amax: torch.Tensor, tokens: torch.Tensor, tree: Any) -> WalkResult:
    """Greedy walk from the target's argmax per node ``int64[T]`` (the vocabulary part done)."""
    gparent = tree.parents.clamp(min=0) + tree.cu_nodes[tree.request_ids]
    passes = tokens.to(torch.int64) == amax[gparent]
    acc_len, nodes, toks, stop = _path_outputs(
        _propagate(passes, tree), tree, tokens, tree.max_depth
    )
    return _finish(acc_len, nodes, toks, amax[tree.cu_nodes[:-1] + stop])


def _row_argmax(rows: torch.Tensor) -> torch.Tensor:
    """``argmax(-1)`` (first maximum); half-precision rows upcast first (exact, and
    several times faster than the CPU's bf16/fp16 argmax)."""
    if rows.dtype in (torch.bfloat16, torch.float16):
        rows = rows.float()
    return torch.argmax(rows, dim=-1)


# Greedy on the CPU: up to this many logits, one argmax over every node and the
# vectorised walk (fewer ops, so faster on small trees); above it, level by level, where
# the argmax over every node would dominate (figures: docs/design_figures.md, "Greedy walk").
_ARGMAX_ALL_MAX = 1 << 19


# ... and up to this many nodes in all, the walk itself in Python over the argmax list
# (one host read, many times faster on a small tree, where each of the vectorised walk's
# many small tensor ops has a fixed cost; figures: docs/design_figures.md, "Greedy walk").
# Other devices keep the vectorised, sync-free form.
_PY_WALK_MAX_NODES = 256


def _host_tree(tree: Any) -> tuple[list[int], list[int], list[list[int]]]:
    """Host lists for the Python walks: every node's global parent (-1 for roots), the
    requests' first nodes ``cu [B + 1]`` and every node's children in sibling order."""
    parents, cu = tree.parents.tolist(), tree.cu_nodes.tolist()
    gparent = [p + cu[r] if p >= 0 else -1 for p, r in zip(parents, tree.request_ids.tolist())]
    rank = tree.sibling_rank.tolist()
    children: list[list[int]] = [[] for _ in gparent]
    for c in sorted((c for c, g in enumerate(gparent) if g >= 0), key=lambda c: rank[c]):
        children[gparent[c]].append(c)
    return gparent, cu, children


def _host_walk(tree: Any, cu: list[int], accept) -> tuple[list, list, list, list[int]]:
    """Walk every request from its root: ``accept(cur)`` returns the accepted child of
    node ``cur`` (global index) or None. Returns the -1 padded host lists (accepted
    length, path nodes, emitted tokens without the bonus) and the stop nodes."""
    b, width = tree.num_requests, tree.max_depth + 1
    acc_len = [1] * b
    nodes = [[0] + [-1] * (width - 1) for _ in range(b)]
    out = [[-1] * width for _ in range(b)]
    stops = []
    for r in range(b):
        cur = cu[r]
        while (nxt := accept(cur)) is not None:
            out[r][acc_len[r] - 1] = nxt
            nodes[r][acc_len[r]] = nxt - cu[r]
            acc_len[r] += 1
            cur = nxt
        stops.append(cur)
    return acc_len, nodes, out, stops


def _host_result(acc_len, nodes, out, tokens: list[int], bonus: list[int]) -> WalkResult:
    """``WalkResult`` from ``_host_walk``'s lists (``out`` holds accepted node indices,
    turned into their tokens here) and each request's bonus token."""
    for r, n in enumerate(acc_len):
        row = out[r]
        for j in range(n - 1):
            row[j] = tokens[row[j]]
        row[n - 1] = bonus[r]
    return WalkResult(
        torch.tensor(acc_len, dtype=torch.int64),
        torch.tensor(nodes, dtype=torch.int64),
        torch.tensor(out, dtype=torch.int64),
    )


def _greedy_python(amax: torch.Tensor, tokens: torch.Tensor, tree: Any) -> WalkResult:
    """Greedy walk from the argmax per node ``int64[T]``, in Python (CPU, small trees):
    the child whose token is its parent's argmax (siblings are distinct), then the
    stop node's argmax as the bonus token."""
    best, toks = amax.tolist(), tokens.tolist()
    _, cu, children = _host_tree(tree)

    def accept(cur: int) -> int | None:
        return next((c for c in children[cur] if toks[c] == best[cur]), None)

    acc_len, nodes, out, stops = _host_walk(tree, cu, accept)
    return _host_result(acc_len, nodes, out, toks, [best[s] for s in stops])


def _target_only_python(
    probs: torch.Tensor, tokens: torch.Tensor, tree: Any, uniforms: torch.Tensor
) -> WalkResult:
    """``target_only`` from every node's probabilities ``float64 [T, V]``, the walk in
    Python (CPU, small trees): ``_target_only``'s test, ``u_c * (S - sum of earlier
    siblings' p) < p[t_c]`` with the first passing sibling winning, over host floats
    read once (each child's ``p`` at its token, each node's mass), then one batched
    bonus draw at the stop nodes."""
    tok = tokens.to(torch.int64)
    gparent, cu, children = _host_tree(tree)
    child_rows = torch.tensor([max(g, 0) for g in gparent], dtype=torch.int64)
    pt = probs[child_rows, tok].tolist()  # p[parent, token of the child]
    mass = probs.sum(-1).tolist()
    u = uniforms.to(torch.float64)
    u_accept = u[:, 0].tolist()

    def accept(cur: int) -> int | None:
        before = 0.0
        for c in children[cur]:
            cum = before + pt[c]
            # S - (cumsum - pt) as the vectorised form computes it: bit for bit
            if u_accept[c] * (mass[cur] - (cum - pt[c])) < pt[c]:
                return c
            before = cum
        return None

    acc_len, nodes, out, stops = _host_walk(tree, cu, accept)
    stop = torch.tensor(stops, dtype=torch.int64)
    kids = [children[s] for s in stops]
    kmax = max([1, *map(len, kids)])
    table = torch.tensor([k + [-1] * (kmax - len(k)) for k in kids], dtype=torch.int64)
    bonus = sample_inverse_cdf(_remove_children(probs[stop], table, tok), u[stop, 1])
    return _host_result(acc_len, nodes, out, tok.tolist(), bonus.tolist())


def _draft_probs_python(
    probs: torch.Tensor,
    tokens: torch.Tensor,
    tree: Any,
    uniforms: torch.Tensor,
    draft_probs: torch.Tensor,
) -> WalkResult:
    """``draft_probs`` from every node's target probabilities ``float64 [T, V]``, the
    walk in Python (CPU, small trees): ``_draft_probs``'s rule (accept child ``c`` when
    ``u_c * q[t_c] < p[t_c]``; after a rejection ``p <- norm(max(p - q, 0))`` and ``q``
    loses ``t_c``), with the same tensor ops on one ``[1, V]`` row at a time, the
    accept tests on host floats, and one batched bonus draw."""
    toks = tokens.to(torch.int64).tolist()
    _, cu, children = _host_tree(tree)
    u = uniforms.to(torch.float64)
    u_accept = u[:, 0].tolist()
    residual: dict[int, torch.Tensor] = {}  # stop node -> its (residual) target row

    def accept(cur: int) -> int | None:
        p = probs[cur : cur + 1]
        q = draft_probs[cur : cur + 1].to(torch.float64)
        for c in children[cur]:
            t = toks[c]
            if u_accept[c] * float(q[0, t]) < float(p[0, t]):
                return c
            new_p = torch.clamp(p - q, min=0.0)
            s = new_p.sum(-1, keepdim=True)
            p = torch.where(s > 0, new_p / s, p)  # no residual mass (p <= q): keep p
            new_q = q.scatter(1, torch.tensor([[t]]), 0.0)
            sq = new_q.sum(-1, keepdim=True)
            q = torch.where(sq > 0, new_q / sq, new_q)
        residual[cur] = p
        return None

    acc_len, nodes, out, stops = _host_walk(tree, cu, accept)
    rows = torch.cat([residual[s] for s in stops])
    bonus = sample_inverse_cdf(rows, u[torch.tensor(stops), 1])
    return _host_result(acc_len, nodes, out, toks, bonus.tolist())


def _greedy_levels(logits: torch.Tensor, tokens: torch.Tensor, tree: Any) -> WalkResult:
    """Greedy walk level by level: the argmax only at the B current nodes of each level.

    ``D * B`` vocabulary rows instead of ``T``: the faster form on the CPU, where the
    argmax over every node's logits dominates.
    """
    d, b = tree.max_depth, tree.num_requests
    dev = logits.device
    fan = level_fanout(tree)
    table = child_table(tree, max([1, *fan]))
    tok = tokens.to(torch.int64)
    cur = tree.cu_nodes[:-1].clone()
    active = torch.ones(b, dtype=torch.bool, device=dev)
    acc_len = torch.ones(b, dtype=torch.int64, device=dev)
    nodes = torch.full((b, d + 1), -1, dtype=torch.int64, device=dev)
    nodes[:, 0] = 0
    toks = torch.full((b, d + 1), -1, dtype=torch.int64, device=dev)
    best = _row_argmax(logits[cur])
    for level in range(d):
        kids = table[cur, : max(1, fan[level])]
        match = (kids >= 0) & (tok[kids.clamp(min=0)] == best[:, None])  # distinct siblings
        hit = (match.to(torch.int64) * kids).sum(-1)  # at most one match
        step = active & match.any(-1)
        nodes[:, level + 1] = torch.where(step, hit - tree.cu_nodes[:-1], -1)
        toks[:, level] = torch.where(step, tok[hit], -1)
        acc_len = acc_len + step.to(torch.int64)
        active = step
        cur = torch.where(step, hit, cur)
        best = torch.where(step, _row_argmax(logits[cur]), best)
    return _finish(acc_len, nodes, toks, best)


def _target_only(probs, tokens, tree, uniforms):
    d = tree.max_depth
    kmax = max([1, *level_fanout(tree)])
    total, vocab = probs.shape
    tok = tokens.to(torch.int64)
    u = uniforms.to(torch.float64)
    table = child_table(tree, kmax)  # [T, K]
    has = table >= 0
    kid = table.clamp(min=0)
    rows = torch.arange(total, device=probs.device)[:, None].expand(-1, kmax)
    pt = torch.where(has, probs[rows, tok[kid]], 0.0)  # p[parent, token of r-th child]
    mass = probs.sum(-1, keepdim=True) - (torch.cumsum(pt, dim=1) - pt)  # rejected removed
    ok = has & (u[kid, 0] * mass < pt)
    first = ok & (torch.cumsum(ok.to(torch.int64), dim=1) == 1)
    gparent = tree.parents.clamp(min=0) + tree.cu_nodes[tree.request_ids]
    passes = first[gparent, tree.sibling_rank] & (tree.parents >= 0)
    acc_len, nodes, toks, stop = _path_outputs(_propagate(passes, tree), tree, tokens, d)
    gstop = tree.cu_nodes[:-1] + stop
    p = _remove_children(probs[gstop], table[gstop], tok)  # its children were all rejected
    return _finish(acc_len, nodes, toks, sample_inverse_cdf(p, u[gstop, 1]))


def _remove_children(p: torch.Tensor, kids: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """Zero ``p [B, V]`` at the tokens of the (all rejected) children ``kids [B, K]``."""
    hit = torch.zeros(p.shape, dtype=torch.int32, device=p.device)
    hit.scatter_add_(1, torch.where(kids >= 0, tok[kids.clamp(min=0)], 0), (kids >= 0).int())
    return torch.where(hit > 0, torch.zeros_like(p), p)


def _target_only_levels(rows, tokens, tree, uniforms):
    """``target_only`` level by level, probabilities only at the current nodes (CPU form).

    Same test as ``_target_only`` restricted to each request's current node:
    ``u_c * (S - sum of earlier siblings' p) < p[t_c]``, first passing sibling wins.
    """
    d, b = tree.max_depth, tree.num_requests
    dev = tokens.device
    fan = level_fanout(tree)
    table = child_table(tree, max([1, *fan]))
    tok = tokens.to(torch.int64)
    u = uniforms.to(torch.float64)
    cur = tree.cu_nodes[:-1].clone()
    active = torch.ones(b, dtype=torch.bool, device=dev)
    acc_len = torch.ones(b, dtype=torch.int64, device=dev)
    nodes = torch.full((b, d + 1), -1, dtype=torch.int64, device=dev)
    nodes[:, 0] = 0
    toks = torch.full((b, d + 1), -1, dtype=torch.int64, device=dev)
    p = rows(cur)
    for level in range(d):
        kids = table[cur, : max(1, fan[level])]
        has = active[:, None] & (kids >= 0)
        pt = torch.where(has, p.gather(1, tok[kids.clamp(min=0)]), 0.0)
        mass = p.sum(-1, keepdim=True) - (torch.cumsum(pt, dim=1) - pt)
        ok = has & (u[kids.clamp(min=0), 0] * mass < pt)
        first = ok & (torch.cumsum(ok.to(torch.int64), dim=1) == 1)
        hit = (first.to(torch.int64) * kids).sum(-1)
        step = first.any(-1)
        nodes[:, level + 1] = torch.where(step, hit - tree.cu_nodes[:-1], -1)
        toks[:, level] = torch.where(step, tok[hit], -1)
        acc_len = acc_len + step.to(torch.int64)
        active = step
        cur = torch.where(step, hit, cur)
        p = torch.where(step[:, None], rows(cur), p)
    p = _remove_children(p, table[cur], tok)
    return _finish(acc_len, nodes, toks, sample_inverse_cdf(p, u[cur, 1]))


def _draft_probs(rows, vocab, tokens, tree, uniforms, draft_probs):
    """``rows(cur)``: float64 target probabilities ``[B, V]`` of the current nodes."""
    d = tree.max_depth
    fan = level_fanout(tree)
    b = tree.num_requests
    dev = tokens.device
    tok = tokens.to(torch.int64)
    u = uniforms.to(torch.float64)
    table = child_table(tree, max([0, *fan]))
    cur = tree.cu_nodes[:-1].clone()
    active = torch.ones(b, dtype=torch.bool, device=dev)
    bonus_p = torch.zeros(b, vocab, dtype=torch.float64, device=dev)
    acc_len = torch.ones(b, dtype=torch.int64, device=dev)
    nodes = torch.full((b, d + 1), -1, dtype=torch.int64, device=dev)
    nodes[:, 0] = 0
    toks = torch.full((b, d + 1), -1, dtype=torch.int64, device=dev)
    for level in range(d):
        p = rows(cur)
        q = draft_probs[cur].to(torch.float64)
        accepted = torch.full((b,), -1, dtype=torch.int64, device=dev)
        for r in range(fan[level]):
            c = table[cur, r]
            live = active & (c >= 0) & (accepted < 0)
            t = tok[c.clamp(min=0)][:, None]
            pt, qt = p.gather(1, t)[:, 0], q.gather(1, t)[:, 0]
            ok = live & (u[c.clamp(min=0), 0] * qt < pt)
            accepted = torch.where(ok, c, accepted)
            rej = (live & ~ok)[:, None]
            new_p = torch.clamp(p - q, min=0.0)
            s = new_p.sum(-1, keepdim=True)
            new_p = torch.where(s > 0, new_p / s, p)  # no residual mass (p <= q): keep p
            new_q = q.scatter(1, t, 0.0)
            sq = new_q.sum(-1, keepdim=True)
            new_q = torch.where(sq > 0, new_q / sq, new_q)
            p = torch.where(rej, new_p, p)
            q = torch.where(rej, new_q, q)
        stopping = active & (accepted < 0)
        bonus_p = torch.where(stopping[:, None], p, bonus_p)
        step = active & (accepted >= 0)
        a = accepted.clamp(min=0)
        nodes[:, level + 1] = torch.where(step, a - tree.cu_nodes[:-1], -1)
        toks[:, level] = torch.where(step, tok[a], -1)
        acc_len = acc_len + step.to(torch.int64)
        active = step
        cur = torch.where(step, a, cur)
    bonus_p = torch.where(active[:, None], rows(cur), bonus_p)  # walked down to a leaf
    return _finish(acc_len, nodes, toks, sample_inverse_cdf(bonus_p, u[cur, 1]))


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
    """Vectorised tree walk; arguments and result as ``kernels.reference.tree_walk``.

    Args:
        logits: ``[T, V]`` fp32/fp16/bf16 target logits per node.
        tokens: ``int[T]`` draft token per node.
        tree: ``TreeBatch`` on logits' device.
        mode: ``"greedy" | "target_only" | "draft_probs"``.
        uniforms: ``[T, 2]`` (acceptance test, bonus draw) for stochastic modes.
        draft_probs: ``[T, V]`` (``draft_probs`` mode).
        temperature, top_p: scalars or ``[B]``.

    Returns:
        ``WalkResult`` of int64 ``[B]``, ``[B, D+1]``, ``[B, D+1]``, -1 padded.
    """
    cpu = logits.device.type == "cpu"
    if mode == "greedy":
        if cpu and logits.numel() > _ARGMAX_ALL_MAX:
            return _greedy_levels(logits, tokens, tree)
        amax = torch.argmax(logits, dim=-1)
        if cpu and tokens.shape[0] <= _PY_WALK_MAX_NODES:
            return _greedy_python(amax, tokens, tree)
        return greedy_from_argmax(amax, tokens, tree)
    ids = torch.arange(tree.num_requests, device=logits.device)
    rows = lambda cur: target_probs(logits[cur], ids, temperature, top_p)  # visited nodes only
    small = cpu and tokens.shape[0] <= _PY_WALK_MAX_NODES and logits.numel() <= _ARGMAX_ALL_MAX
    if small and mode in ("target_only", "draft_probs"):
        probs = target_probs(logits, tree.request_ids, temperature, top_p)
        if mode == "draft_probs":
            return _draft_probs_python(probs, tokens, tree, uniforms, draft_probs)
        return _target_only_python(probs, tokens, tree, uniforms)
    if mode == "draft_probs":
        return _draft_probs(rows, logits.shape[1], tokens, tree, uniforms, draft_probs)
    if mode == "target_only" and cpu:
        return _target_only_levels(rows, tokens, tree, uniforms)
    probs = target_probs(logits, tree.request_ids, temperature, top_p)
    return walk_from_probs(probs, tokens, tree, mode, uniforms, draft_probs)


def walk_from_probs(
    probs: torch.Tensor,
    tokens: torch.Tensor,
    tree: Any,
    mode: str,
    uniforms: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> WalkResult:
    """Stochastic walk from ``probs = reference.target_probs(...)`` (float64 ``[T, V]``)."""
    if mode == "target_only":
        return _target_only(probs, tokens, tree, uniforms)
    if mode == "draft_probs":
        return _draft_probs(
            lambda cur: probs[cur], probs.shape[1], tokens, tree, uniforms, draft_probs
        )
    raise ValueError(f"unknown walk mode {mode!r}")
