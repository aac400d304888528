"""KV compaction inside vLLM: after the walk, the accepted nodes' K/V move to the slots
of a linear sequence, through each attention backend's own cache write.

A tree of ``N`` nodes was verified with node ``j`` at slot ``P + j`` (``P``: the tokens
cached before the root). The walk accepts a root-first path ``nodes``; node ``nodes[k]``
then belongs at ``P + k``, where vLLM's scheduler expects position ``P + k`` once it
rewinds ``num_computed_tokens`` to ``P + len(nodes)``.
"""

from __future__ import annotations

import torch

from tree_dev.vllm_plugin.attention import layout_for


def slot_of(block_row: torch.Tensor, block_size: int, pos: int) -> int:
    """The cache slot of position ``pos`` of a request (``block_row``: its block ids)."""
    return int(block_row[pos // block_size]) * block_size + pos % block_size


def compact_accepted(model_runner, layer_names: list[str], moves: list[tuple[int, int, list[int]]]):
    """Move accepted nodes ``P + nodes[k]`` -> slots ``P + k`` in every layer of
    ``layer_names``.

    Args:
        model_runner: vLLM's ``GPUModelRunner`` (its persistent batch's block table and
            the layers' caches).
        layer_names: the target's attention layers.
        moves: per tree request ``(batch row, P, accepted nodes root first)``.
    """
    src, dst = [], []
    bt = model_runner.input_batch.block_table.block_tables[0]
    table, bs = bt.get_cpu_tensor(), bt.block_size
    for i, p, nodes in moves:
        for j, node in enumerate(nodes):
            if node != j:
                src.append(slot_of(table[i], bs, p + node))
                dst.append(slot_of(table[i], bs, p + j))
    if not src:
        return
    src_t = torch.tensor(src, dtype=torch.int64)
    dst_t = torch.tensor(dst, dtype=torch.int64)
    ctx = model_runner.compilation_config.static_forward_context
    for name in layer_names:
        layer = ctx[name]
        kv = layer.kv_cache
        kv = kv[0] if isinstance(kv, list) else kv
        lay = layout_for(layer.impl, layer, kv)
        k, v = lay.gather_slots(kv, src_t)
        layer.impl.do_kv_cache_update(layer, k.clone(), v.clone(), kv, dst_t)
