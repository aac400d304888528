"""Tree-aware comparison: pair each node of a tree verification pass with the dense
reference step that computed the same root-to-node path, then compare per layer.

A tree pass (``metadata.tree`` set) scores N nodes at positions ``seq_len + depth``.
A dense reference decodes one token per step along a path. Node ``n`` pairs with
the dense slot at the node's position when the dense tokens at the positions of
every node on the root-to-``n`` path equal the node tokens (or when ``n`` is on the
caller's ``accepted_nodes`` path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .alignment import default_reconstruction, num_real_tokens
from .compare import ComparisonResult, call_reconstruction, compare_tensors, normalize_name
from .compare import _resolve as resolve_capture
from .tensor_io import CapturedForwardPass, TreeMetadata


@dataclass(frozen=True)
class TreeNodePair:
    """Node ``node`` (request-local) of request ``request`` at tree slot ``tree_slot``
    pairs with row ``dense_slot`` of dense pass ``dense_index``."""

    request: int
    node: int
    depth: int
    position: int
    tree_slot: int
    dense_index: int
    dense_slot: int


@dataclass
class TreeNodeComparison:
    """One module at one tree node against its dense counterpart."""

    module: str
    pair: TreeNodePair
    result: ComparisonResult


def _tree_of(fwd: CapturedForwardPass) -> TreeMetadata:
    if fwd.metadata.tree is None:
        raise ValueError(f"{fwd.dir_name}: no tree metadata (pass tree= when saving)")
    return fwd.metadata.tree


def _real_slots(fwd: CapturedForwardPass) -> list[int]:
    meta = fwd.metadata
    if meta.padding_mask is not None:
        return [i for i, m in enumerate(meta.padding_mask) if not m]
    return list(range(num_real_tokens(meta.positions)))


def _dense_index(dense: list[CapturedForwardPass]) -> dict[int, tuple[int, int, int | None]]:
    """position -> (pass index, slot, token); the pass where it is the newest wins."""
    newest: dict[int, tuple[int, int, int | None]] = {}
    any_: dict[int, tuple[int, int, int | None]] = {}
    for i, fwd in enumerate(dense):
        slots = _real_slots(fwd)
        if not slots:
            continue
        pos = fwd.metadata.positions
        toks = fwd.metadata.token_ids
        top = max(pos[j] for j in slots)
        for j in slots:
            entry = (i, j, toks[j] if toks is not None else None)
            any_[pos[j]] = entry
            if pos[j] == top:
                newest[pos[j]] = entry
    return {**any_, **newest}


def _per_request_inputs(
    tree: TreeMetadata,
    dense_passes: list[CapturedForwardPass] | dict[int, list[CapturedForwardPass]],
    accepted_nodes: list[int] | dict[int, list[int]] | None,
) -> tuple[dict[int, list[CapturedForwardPass]], dict[int, list[int]] | None]:
    """``dense_passes`` and ``accepted_nodes`` as ``{request: ...}`` dicts."""
    R = tree.num_requests
    if isinstance(dense_passes, dict):
        dense_by_req = dense_passes
    elif R == 1:
        dense_by_req = {0: dense_passes}
    else:
        raise ValueError(f"tree has {R} requests: pass dense_passes as {{request: passes}}")
    if accepted_nodes is not None and not isinstance(accepted_nodes, dict):
        if R != 1:
            raise ValueError(f"tree has {R} requests: pass accepted_nodes as {{request: nodes}}")
        accepted_nodes = {0: list(accepted_nodes)}
    return dense_by_req, accepted_nodes


def _candidate_slots(
    tree: TreeMetadata,
    r: int,
    accepted_nodes: dict[int, list[int]] | None,
    tokens: list[int] | None,
) -> list[int] | None:
    """Tree slots of request ``r`` to try pairing (None: request has no accepted path)."""
    base = tree.cu_nodes[r]
    slots = range(base, tree.cu_nodes[r + 1])
    if accepted_nodes is None:
        if tokens is None:
            raise ValueError("no tree tokens: pass accepted_nodes or store tokens")
        return list(slots)
    acc = accepted_nodes.get(r)
    if acc is None:
        return None
    for a, b in zip(acc, acc[1:], strict=False):
        if not 0 <= b < len(slots) or tree.parents[base + b] != a:
            raise ValueError(f"request {r}: accepted node {b} is not a child of {a}")
    if acc and tree.parents[base + acc[0]] != -1:
        raise ValueError(f"request {r}: accepted path must start at the root")
    return [base + n for n in acc]


def _path_matches(
    tree: TreeMetadata,
    r: int,
    s: int,
    index: dict[int, tuple[int, int, int | None]],
    positions: list[int],
    tokens: list[int] | None,
    accepted: bool,
) -> bool:
    """Whether the dense reference covers slot ``s``'s root-to-node path with its tokens."""
    base = tree.cu_nodes[r]
    for p in tree.path_slots(s):
        hit = index.get(positions[p])
        if hit is None:
            return False
        if tokens is not None and hit[2] is not None and hit[2] != tokens[p]:
            if accepted:
                raise ValueError(
                    f"request {r}: accepted node {p - base} has token {tokens[p]} but "
                    f"the dense reference has {hit[2]} at position {positions[p]}"
                )
            return False
        if tokens is not None and hit[2] is None and not accepted:
            raise ValueError("dense passes carry no token_ids: pass accepted_nodes")
    return True


def pair_tree_nodes_with_dense_steps(
    tree_pass: CapturedForwardPass,
    dense_passes: list[CapturedForwardPass] | dict[int, list[CapturedForwardPass]],
    accepted_nodes: list[int] | dict[int, list[int]] | None = None,
) -> list[TreeNodePair]:
    """Pair tree nodes with the dense reference steps of the same root-to-node path.

    Args:
        tree_pass: a pass saved with ``tree=TreeMetadata(...)``; node positions from
            ``tree.positions`` or the pass positions, tokens from ``tree.tokens`` or
            ``metadata.token_ids``.
        dense_passes: the dense reference passes of the request (a list, for a
            single-request tree), or ``{request index: passes}``.
        accepted_nodes: request-local node ids of the accepted root-to-leaf path
            (list, or dict per request). Without it, pairing needs tokens on both
            sides and pairs every node whose whole path matches the dense tokens.
    Returns:
        pairs sorted by (request, slot). Raises ValueError on inconsistent input
        (accepted path not a path, token mismatch on it, missing tokens/positions).
    """
    tree = _tree_of(tree_pass)
    dense_by_req, accepted_nodes = _per_request_inputs(tree, dense_passes, accepted_nodes)
    positions = tree.positions or tree_pass.metadata.positions
    if len(positions) < len(tree.parents):
        raise ValueError(f"{tree_pass.dir_name}: fewer positions than tree nodes")
    tokens = tree.tokens or tree_pass.metadata.token_ids
    pairs: list[TreeNodePair] = []
    for r in range(tree.num_requests):
        if r not in dense_by_req:
            continue
        index = _dense_index(dense_by_req[r])
        candidates = _candidate_slots(tree, r, accepted_nodes, tokens)
        if candidates is None:
            continue
        for s in candidates:
            if _path_matches(tree, r, s, index, positions, tokens, accepted_nodes is not None):
                i, j, _ = index[positions[s]]
                pairs.append(
                    TreeNodePair(r, tree.node_ids[s], tree.depths[s], positions[s], s, i, j)
                )
    return pairs


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t[0] if t.dim() >= 3 and t.shape[0] == 1 else t


def compare_tree_with_dense(
    tree_pass: CapturedForwardPass,
    dense_passes: list[CapturedForwardPass] | dict[int, list[CapturedForwardPass]],
    pairs: list[TreeNodePair] | None = None,
    accepted_nodes: list[int] | dict[int, list[int]] | None = None,
    module_order: list[str] | None = None,
    tree_reconstruction_fn=None,
    dense_reconstruction_fn=None,
) -> list[TreeNodeComparison]:
    """Compare every captured module at every paired node (rows of ``[T, ...]`` or
    ``[1, T, ...]`` tensors). Results are named ``{module}/node{n}``; hidden dims are
    truncated to the smaller side. Returns rows in (module, request, node) order."""
    if pairs is None:
        pairs = pair_tree_nodes_with_dense_steps(tree_pass, dense_passes, accepted_nodes)
    dense_by_req = dense_passes if isinstance(dense_passes, dict) else {0: dense_passes}
    tfn = tree_reconstruction_fn or default_reconstruction
    dfn = dense_reconstruction_fn or default_reconstruction
    modules = module_order or tree_pass.module_names
    cache: dict[tuple[int, int, str], torch.Tensor] = {}
    out: list[TreeNodeComparison] = []
    for m in modules:
        tn = resolve_capture(tree_pass, m)
        if tn is None:
            raise ValueError(f"module '{m}' not captured in the tree pass {tree_pass.dir_name}")
        tree_t = _rows(call_reconstruction(tfn, tree_pass, tn))
        for pr in pairs:
            dfwd = dense_by_req[pr.request][pr.dense_index]
            dn = resolve_capture(dfwd, m)
            if dn is None:
                raise ValueError(f"module '{m}' not captured in dense pass {dfwd.dir_name}")
            key = (pr.request, pr.dense_index, dn)
            if key not in cache:
                cache[key] = _rows(call_reconstruction(dfn, dfwd, dn))
            a, b = cache[key][pr.dense_slot].float(), tree_t[pr.tree_slot].float()
            h = min(a.shape[-1], b.shape[-1]) if a.dim() and b.dim() else None
            if h is not None:
                a, b = a[..., :h], b[..., :h]
            name = f"{normalize_name(m)}/node{pr.node}"
            if pr.request:
                name = f"{normalize_name(m)}/req{pr.request}/node{pr.node}"
            out.append(TreeNodeComparison(m, pr, compare_tensors(a, b, name)))
    return out


def errors_by_depth(rows: list[TreeNodeComparison]) -> dict[str, dict[int, float]]:
    """``{module: {depth: max linf_rel}}`` of tree comparison rows."""
    out: dict[str, dict[int, float]] = {}
    for row in rows:
        d = out.setdefault(row.module, {})
        d[row.pair.depth] = max(d.get(row.pair.depth, 0.0), row.result.linf_rel)
    return out


def print_tree_report(
    rows: list[TreeNodeComparison],
    threshold: float = 0.01,
    label1="Dense",
    label2="Tree",
    file=None,
) -> int:
    """Two-way style table of tree rows (Node, Depth, Position columns); returns the
    number of rows with ``L-inf > threshold``."""
    import sys

    file = file or sys.stdout
    print(f"TREE COMPARISON: {label1} vs {label2}", file=file)
    print("=" * 96, file=file)
    print(
        f"{'Module/node':<45}{'Depth':>6}{'Pos':>6}{'L-inf':>13}{'L2':>13}{'Max Abs':>13}",
        file=file,
    )
    print("-" * 96, file=file)
    bad = 0
    for row in rows:
        r = row.result
        bad += r.deviates(threshold)
        print(
            f"{r.name:<45}{row.pair.depth:>6}{row.pair.position:>6}"
            f"{r.linf_rel:>13.2e}{r.l2_rel:>13.2e}{r.max_abs:>13.2e}",
            file=file,
        )
    print(f"\nSUMMARY: {bad} deviation(s) > {threshold:g} over {len(rows)} node row(s)", file=file)
    return bad
