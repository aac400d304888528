"""Input validation shared by every backend of every op.

Each public op calls its ``check_*`` function before any kernel runs, so bad
input fails with a ``ValueError`` naming the tensor, shape or node instead of
crashing inside a kernel or returning garbage. The checks read a few small
tensors (lengths, block-table extents) back to the host; engines that have
already validated their inputs can pass ``check_inputs=False`` to the op.

``tree`` is anything shaped like ``tree_dev.tree.TreeBatch`` (kernels never
import ``tree_dev``): ``num_requests``, ``max_nodes``, ``max_depth`` and the
int64 tensors ``cu_nodes [B+1]``, ``num_nodes [B]``, ``parents``, ``depth``,
``first_child``, ``next_sibling``, ``sibling_rank``, ``request_ids`` ``[T]`` and
``packed_mask [T, W]``.
"""

from __future__ import annotations

from typing import Any

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
WALK_MODES = ("greedy", "target_only", "draft_probs")


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_tree(tree: Any) -> None:
    for name in ("cu_nodes", "num_nodes", "packed_mask", "parents", "request_ids"):
        if not isinstance(getattr(tree, name, None), torch.Tensor):
            raise ValueError(f"tree has no tensor {name!r}: pass a tree_dev.tree.TreeBatch")


def check_device(device: torch.device, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} (same device as q)")


def _check_attention_tensors(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Check the ranks, shapes and dtypes of ``q`` and the KV caches."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be [total_nodes, num_q_heads, head_dim], got {_shape(q)}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q has dtype {q.dtype}; supported: float32, float16, bfloat16")
    if k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            f"k_cache/v_cache must be 4-D ([num_blocks, block_size, kv_heads, head_dim] paged "
            f"or [batch, max_len, kv_heads, head_dim] contiguous), got {_shape(k_cache)} "
            f"and {_shape(v_cache)}"
        )
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {_shape(k_cache)} and v_cache {_shape(v_cache)} differ")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"dtype mismatch: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
        )


def _check_attention_sizes(
    q: torch.Tensor, k_cache: torch.Tensor, tree: Any, max_tree_nodes: int | None
) -> None:
    """Check head dims, head counts and node counts of ``q`` against the cache and tree."""
    total, hq, d = q.shape
    hkv, dk = k_cache.shape[2], k_cache.shape[3]
    if dk != d:
        raise ValueError(f"head_dim mismatch: q has {d}, k_cache has {dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    if total != int(tree.cu_nodes[-1]):
        raise ValueError(
            f"q has {total} rows but the tree batch has {int(tree.cu_nodes[-1])} nodes"
        )
    if max_tree_nodes is not None and tree.max_nodes > max_tree_nodes:
        raise ValueError(
            f"a tree has {tree.max_nodes} nodes; this backend supports at most {max_tree_nodes}"
        )


def _check_prefix_lens(prefix_lens: torch.Tensor, b: int) -> torch.Tensor:
    """Check ``prefix_lens`` is a non-negative integer ``[b]`` tensor; return it as int64 on CPU."""
    if prefix_lens.shape != (b,) or prefix_lens.dtype.is_floating_point:
        raise ValueError(
            f"prefix_lens must be an integer tensor of shape ({b},), got "
            f"{_shape(prefix_lens)} {prefix_lens.dtype}"
        )
    lens = prefix_lens.detach().cpu().to(torch.int64)
    if (lens < 0).any():
        raise ValueError(f"prefix_lens has a negative entry: {lens.tolist()}")
    return lens


def _check_block_entries(
    block_table: torch.Tensor, blocks: torch.Tensor, num_blocks: int, b: int
) -> None:
    """Check the block_table entries each request uses lie in ``[0, num_blocks)``."""
    bt = block_table.detach().cpu()
    for r in range(b):
        used = bt[r, : int(blocks[r])]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
            raise ValueError(
                f"request {r}: block_table entries {used.tolist()} outside [0, {num_blocks})"
            )


def _check_attention_contiguous(k_cache: torch.Tensor, needed: torch.Tensor, b: int) -> None:
    """Check a contiguous KV cache has one row per request, long enough for prefix + tree."""
    if k_cache.shape[0] != b:
        raise ValueError(
            f"contiguous KV has batch {k_cache.shape[0]}, the tree batch has {b} requests"
        )
    worst = int(torch.argmax(needed))
    if int(needed[worst]) > k_cache.shape[1]:
        raise ValueError(
            f"request {worst}: prefix + tree = {int(needed[worst])} slots, contiguous KV "
            f"holds {k_cache.shape[1]}"
        )


def _check_attention_paged(
    k_cache: torch.Tensor, block_table: torch.Tensor, needed: torch.Tensor, b: int
) -> None:
    """Check a paged KV cache's block_table: shape, dtype, width and entry range."""
    if block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table must be [{b}, max_blocks], got {_shape(block_table)}")
    if block_table.dtype.is_floating_point:
        raise ValueError(f"block_table must be integer, got {block_table.dtype}")
    bs = k_cache.shape[1]
    blocks = (needed + bs - 1) // bs
    worst = int(torch.argmax(blocks))
    if int(blocks[worst]) > block_table.shape[1]:
        raise ValueError(
            f"request {worst}: needs {int(blocks[worst])} blocks of {bs} for prefix + tree "
            f"= {int(needed[worst])} tokens, block_table has {block_table.shape[1]} columns"
        )
    _check_block_entries(block_table, blocks, k_cache.shape[0], b)


def check_tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tree: Any,
    prefix_lens: torch.Tensor,
    block_table: torch.Tensor | None,
    max_tree_nodes: int | None = None,
) -> None:
    """Validate tree-attention inputs (see ``kernels.tree_attention``)."""
    check_tree(tree)
    _check_attention_tensors(q, k_cache, v_cache)
    check_device(
        q.device,
        k_cache=k_cache,
        v_cache=v_cache,
        prefix_lens=prefix_lens,
        block_table=block_table,
        **{"tree.packed_mask": tree.packed_mask},
    )
    _check_attention_sizes(q, k_cache, tree, max_tree_nodes)
    b = tree.num_requests
    lens = _check_prefix_lens(prefix_lens, b)
    needed = lens + tree.num_nodes.cpu()
    if block_table is None:
        _check_attention_contiguous(k_cache, needed, b)
    else:
        _check_attention_paged(k_cache, block_table, needed, b)


def _check_walk_shapes(logits: torch.Tensor, tokens: torch.Tensor, total: int) -> int:
    """Check the shapes and dtypes of ``logits`` and ``tokens``; return the vocab size."""
    if logits.dim() != 2 or logits.shape[0] != total:
        raise ValueError(
            f"logits must be [{total}, vocab] (one row per node), got {_shape(logits)}"
        )
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    vocab = logits.shape[1]
    if tokens.shape != (total,) or tokens.dtype.is_floating_point:
        raise ValueError(
            f"tokens must be an integer tensor of shape ({total},), got {_shape(tokens)}"
        )
    return vocab


def _check_logits_values(logits: torch.Tensor) -> None:
    """Reject logits rows with NaN, +inf, or -inf everywhere."""
    if torch.isnan(logits).any():
        row = int(torch.nonzero(torch.isnan(logits).any(-1))[0])
        raise ValueError(f"logits row {row} (node) contains NaN")
    if torch.isposinf(logits).any():
        row = int(torch.nonzero(torch.isposinf(logits).any(-1))[0])
        raise ValueError(f"logits row {row} (node) contains +inf")
    dead = torch.isneginf(logits).all(-1)
    if dead.any():
        raise ValueError(f"logits row {int(torch.nonzero(dead)[0])} (node) is -inf everywhere")


def _check_draft_tokens(tokens: torch.Tensor, tree: Any, vocab: int) -> None:
    """Check non-root tokens are in the vocabulary and no two siblings share a token."""
    is_root = tree.parents < 0
    draft = tokens[~is_root]
    if draft.numel() and (int(draft.min()) < 0 or int(draft.max()) >= vocab):
        bad = int(torch.nonzero(((tokens < 0) | (tokens >= vocab)) & ~is_root)[0])
        raise ValueError(
            f"node {bad}: token {int(tokens[bad])} outside the vocabulary [0, {vocab})"
        )
    if draft.numel():
        glob_parent = (tree.parents + tree.cu_nodes[tree.request_ids])[~is_root]
        key = glob_parent * vocab + draft.to(torch.int64)
        uniq, counts = torch.unique(key, return_counts=True)
        if (counts > 1).any():
            k = int(uniq[counts > 1][0])
            raise ValueError(
                f"duplicate sibling tokens: node {k // vocab} (global index) has two children "
                f"with token {k % vocab}"
            )


def _check_sampling_params(
    mode: str, temperature: float | torch.Tensor, top_p: float | torch.Tensor, b: int
) -> None:
    """Check ``temperature`` and ``top_p``: shape, finiteness and range for ``mode``."""
    for name, val, lo_open in (("temperature", temperature, True), ("top_p", top_p, True)):
        v = torch.as_tensor(val, dtype=torch.float32)
        if v.dim() not in (0, 1) or (v.dim() == 1 and v.shape[0] != b):
            raise ValueError(f"{name} must be a float or a tensor of shape ({b},), got {_shape(v)}")
        if mode != "greedy" and not bool(torch.isfinite(v).all()):
            raise ValueError(f"{name} must be finite, got {v.tolist()}")
        if mode != "greedy" and lo_open and bool((v <= 0).any()):
            raise ValueError(f"{name} must be > 0 for mode {mode!r}, got {v.tolist()}")
    if mode != "greedy" and bool((torch.as_tensor(top_p, dtype=torch.float32) > 1).any()):
        raise ValueError(f"top_p must be <= 1, got {top_p}")


def _check_uniforms(uniforms: torch.Tensor, total: int) -> None:
    """Check ``uniforms`` is a floating ``[total, 2]`` tensor with values in ``[0, 1)``."""
    if uniforms.shape != (total, 2):
        raise ValueError(
            f"uniforms must be [{total}, 2] (one pair per node), got {_shape(uniforms)}"
        )
    if not uniforms.dtype.is_floating_point:
        raise ValueError(f"uniforms must be floating point, got {uniforms.dtype}")
    if bool(((uniforms < 0) | (uniforms >= 1)).any()):
        raise ValueError("uniforms must lie in [0, 1)")


def _check_draft_probs(draft_probs: torch.Tensor | None, logits: torch.Tensor, tree: Any) -> None:
    """Check ``draft_probs``: present, shaped like logits, rows of nodes with children sum to 1."""
    if draft_probs is None:
        raise ValueError("mode 'draft_probs' needs draft_probs [total_nodes, vocab]")
    if draft_probs.shape != logits.shape:
        raise ValueError(
            f"draft_probs must match logits {_shape(logits)}, got {_shape(draft_probs)}"
        )
    has_kids = tree.first_child >= 0
    rows = draft_probs[has_kids].to(torch.float32)
    if rows.numel():
        if bool((rows < 0).any()) or not bool(torch.isfinite(rows).all()):
            raise ValueError("draft_probs has negative or non-finite entries")
        sums = rows.sum(-1)
        bad = (sums - 1).abs() > 1e-3
        if bad.any():
            node = int(torch.nonzero(has_kids)[int(torch.nonzero(bad)[0])])
            raise ValueError(
                f"draft_probs row {node} (a node with children) sums to "
                f"{float(sums[bad][0]):.6f}, not 1"
            )


def check_tree_walk(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tree: Any,
    mode: str,
    uniforms: torch.Tensor | None,
    draft_probs: torch.Tensor | None,
    temperature: float | torch.Tensor,
    top_p: float | torch.Tensor,
) -> None:
    """Validate tree-walk inputs (see ``kernels.tree_walk``)."""
    check_tree(tree)
    if mode not in WALK_MODES:
        raise ValueError(f"unknown walk mode {mode!r}; expected one of {WALK_MODES}")
    total = int(tree.cu_nodes[-1])
    vocab = _check_walk_shapes(logits, tokens, total)
    check_device(logits.device, tokens=tokens, uniforms=uniforms, draft_probs=draft_probs)
    _check_logits_values(logits)
    _check_draft_tokens(tokens, tree, vocab)
    _check_sampling_params(mode, temperature, top_p, tree.num_requests)
    if uniforms is not None:
        _check_uniforms(uniforms, total)
    if mode == "draft_probs":
        _check_draft_probs(draft_probs, logits, tree)
    elif draft_probs is not None:
        raise ValueError(f"draft_probs given but mode is {mode!r}; use mode='draft_probs'")


def _check_compact_shapes(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    accepted_len: torch.Tensor,
) -> int:
    """Check the ranks and shapes of the KV-compaction inputs; return the batch size."""
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {_shape(k_cache)} and v_cache {_shape(v_cache)} differ")
    if k_cache.dim() not in (4, 5):
        raise ValueError(
            f"caches must be [blocks|batch, slots, heads, dim] or with a leading layer dim, "
            f"got {_shape(k_cache)}"
        )
    b = prefix_lens.shape[0] if prefix_lens.dim() == 1 else -1
    if prefix_lens.dim() != 1 or prefix_lens.dtype.is_floating_point:
        raise ValueError(f"prefix_lens must be integer [batch], got {_shape(prefix_lens)}")
    if accepted_nodes.dim() != 2 or accepted_nodes.shape[0] != b:
        raise ValueError(f"accepted_nodes must be [{b}, depth+1], got {_shape(accepted_nodes)}")
    if accepted_len.shape != (b,):
        raise ValueError(f"accepted_len must be [{b}], got {_shape(accepted_len)}")
    return b


def _check_accepted(
    accepted_nodes: torch.Tensor, accepted_len: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check accepted lengths and node ids; return the nodes on CPU and their validity mask."""
    alen = accepted_len.detach().cpu()
    if bool(((alen < 1) | (alen > accepted_nodes.shape[1])).any()):
        raise ValueError(
            f"accepted_len must be in [1, {accepted_nodes.shape[1]}], got {alen.tolist()}"
        )
    nodes = accepted_nodes.detach().cpu()
    valid = torch.arange(nodes.shape[1]) < alen[:, None]
    if bool((nodes[valid] < 0).any()):
        raise ValueError("accepted_nodes has a negative node inside accepted_len")
    if bool((nodes[:, 0] != 0).any()):
        raise ValueError("accepted_nodes must start with the root (node 0) for every request")
    return nodes, valid


def _check_compact_paged(
    k_cache: torch.Tensor, block_table: torch.Tensor, top: torch.Tensor, slots_dim: int, b: int
) -> None:
    """Check a paged cache's block_table covers every accepted node with valid entries."""
    if block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table must be [{b}, max_blocks], got {_shape(block_table)}")
    need = (top + slots_dim - 1) // slots_dim
    if bool((need > block_table.shape[1]).any()):
        r = int(torch.nonzero(need > block_table.shape[1])[0])
        raise ValueError(
            f"request {r}: accepted nodes reach block {int(need[r]) - 1}, block_table has "
            f"{block_table.shape[1]} columns"
        )
    if block_table.dtype.is_floating_point:
        raise ValueError(f"block_table must be integer, got {block_table.dtype}")
    _check_block_entries(block_table, need, k_cache.shape[-4], b)


def check_kv_compact(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    accepted_len: torch.Tensor,
    block_table: torch.Tensor | None,
) -> None:
    """Validate KV-compaction inputs (see ``kernels.kv_compact``)."""
    b = _check_compact_shapes(k_cache, v_cache, prefix_lens, accepted_nodes, accepted_len)
    check_device(
        k_cache.device,
        v_cache=v_cache,
        prefix_lens=prefix_lens,
        accepted_nodes=accepted_nodes,
        accepted_len=accepted_len,
        block_table=block_table,
    )
    nodes, valid = _check_accepted(accepted_nodes, accepted_len)
    slots_dim = k_cache.shape[-3]
    lens = prefix_lens.detach().cpu().to(torch.int64)
    top = lens + torch.where(valid, nodes, torch.zeros_like(nodes)).max(-1).values + 1
    if block_table is None:
        batch = k_cache.shape[-4]
        if batch != b:
            raise ValueError(f"contiguous KV has batch {batch}, prefix_lens has {b}")
        if bool((top > slots_dim).any()):
            raise ValueError(f"an accepted node lies beyond the cache length {slots_dim}")
    else:
        _check_compact_paged(k_cache, block_table, top, slots_dim, b)
