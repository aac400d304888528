"""Growing token trees with a draft that lives inside vLLM.

The draft is vLLM's own draft model: the ``draft_model`` proposer's LM, or the ``eagle``
proposer's head (``eagle_model``), each on vLLM's model code with its KV in vLLM's paged
cache, compiled like the target. A request's draft *sequence* is what the draft consumes
position by position: for a draft LM the committed tokens; for EAGLE the pairs
``(x_{k+1}, h_k)`` of the next token and the target's feature at ``k`` (vLLM's convention:
pair ``k`` at position ``k``). Its last element is the *root* (the last sampled token).

The tree step itself (catch-up, level growth, the expansion) is ``tree_dev.step``'s, the
one the local engine runs, so both engines grow the same tree from the same draft scores.
This module is its vLLM half: ``ModelDrafter.forward`` is the step's ``DraftForward`` on
vLLM's model and cache. Each level is one packed draft forward over that level's new
nodes of every request, with tree attention over the prefix and the node's ancestors (a
causal level through vLLM's own kernel); forwarded node ``j`` sits at slot ``root + j``
(the plugin raises the KV slots vLLM reserves past each request's scheduled tokens to
cover them: ``config.lookahead_slots``).

Nothing is recomputed: earlier levels' K/V stay in the draft cache for the later ones.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import numpy as np
import torch

from tree_dev.proposer import expansion_for
from tree_dev.spec import Policy
from tree_dev.step import DraftBatch, DraftRequest, Proposal, grow_trees
from tree_dev.tree import TokenTree
from tree_dev.vllm_plugin.attention import TreeAttentionMetadata, TreeRows, tree_batch


@dataclass
class Draftee:
    """One request to draft for.

    Attributes:
        row: batch row in vLLM's persistent batch (its block table row).
        rid: request id.
        seq: the draft sequence's tokens up to and including the root.
        feats: EAGLE only: ``[len(seq) - start, H]`` target features of the elements from
            ``start`` on (element ``k`` pairs ``seq[k]`` with feature row ``k - start``).
        start: first element the draft has not consumed.
        temperature: draw the children from the draft's distribution at this temperature
            (sampled drafts, static trees); None takes the top-ranked children.
        generator: the request's CPU generator for that draw (None: torch's global one).
        context: the committed tokens, root last (hybrid trees search it for n-grams).
        policy: the tree to grow (``tree: auto`` chooses per request); None: the config's.
    """

    row: int
    rid: str
    seq: list[int]
    start: int
    feats: torch.Tensor | None = None
    temperature: float | None = None
    generator: torch.Generator | None = None
    context: list[int] | None = None
    policy: Policy | None = None


class ModelDrafter:
    """Tree drafting with the proposer's model (methods ``draft_model`` and ``eagle``)."""

    def __init__(self, tree_runner, proposer, layer_names: list[str], eagle: bool):
        if not layer_names:
            raise ValueError("treespec: the draft model has no attention layers with a KV cache")
        self.tr = tree_runner
        self.proposer = proposer
        self.layers = layer_names
        self.eagle = eagle
        self._groups: list | None = None  # the proposer's attention groups, once it has them

    @property
    def groups(self) -> list:
        """The proposer's attention groups of the draft layers, where vLLM's kernel can run
        the causal levels (chains, trunks, catch-up chunks); empty: every level through
        tree attention. vLLM builds them with the KV cache, after the model is loaded.
        ``TREESPEC_DRAFT_ATTENTION=tree`` (a developer switch) keeps them empty."""
        if self._groups is None:
            groups = list(getattr(self.proposer, "draft_attn_groups", None) or [])
            if not groups:
                return []  # the KV cache is not built yet
            covered = {name for g in groups for name in g.layer_names}
            off = os.environ.get("TREESPEC_DRAFT_ATTENTION") == "tree"
            self._groups = [] if off or not set(self.layers) <= covered else groups
        return self._groups

    # ----------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(self, batch: DraftBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One packed draft forward on vLLM's draft model and cache
        (``tree_dev.step.DraftForward``): a batch row per request (``batch.keys``), node
        ``j`` of its tree at slot ``prefix + j``, RoPE position ``prefix + depth``.

        Returns:
            fp32 log-probs ``[sum(len(w)), V]`` at the wanted nodes and the draft's
            outputs there ``[sum(len(w)), H]`` (None, None without ``want``).
        """
        rows, prefixes, trees, new_nodes = batch.keys, batch.prefixes, batch.trees, batch.new_nodes
        tokens, feats, want = batch.tokens, batch.feats, batch.want
        from vllm.forward_context import set_forward_context

        r = self.tr.runner
        bt = r.input_batch.block_table.block_tables[0]
        table, bs = bt.get_numpy_array(), bt.block_size
        causal = bool(self.groups) and (
            self.tr.cfg.debug_disable == "draft_mask" or all(map(_causal_tail, trees, new_nodes))
        )
        lin, pos, brow, qnodes, keep = _level_rows(
            rows, prefixes, trees, new_nodes, want, causal, bt.num_blocks_per_row, bs
        )
        offset = len(lin)
        # index arithmetic in NumPy: a handful of tiny torch ops per level cost more here
        # than the draft's attention (CPU dispatch overhead)
        linear = np.asarray(lin, dtype=np.int64)
        slots = table[np.asarray(brow), linear // bs].astype(np.int64) * bs + linear % bs
        slot_t = torch.from_numpy(slots)
        positions = torch.from_numpy(np.asarray(pos, dtype=np.int64))
        block_rows = torch.from_numpy(table[rows])
        kv_lens = [p + t.num_nodes for p, t in zip(prefixes, trees)]
        if causal:
            metas = self._causal_metadata(block_rows, new_nodes, kv_lens, slot_t, positions)
        else:
            meta = TreeAttentionMetadata(
                TreeRows(
                    batch=tree_batch(tuple(trees)),
                    row_index=torch.arange(offset),
                    prefix_lens=torch.tensor(prefixes, dtype=torch.int64),
                    query_nodes=torch.tensor(qnodes, dtype=torch.int64),
                    block_table=block_rows,
                    kv_lens=kv_lens,
                    backend=self.tr.cfg.kernel_backend,
                ),
                num_actual_tokens=offset,
            )
            metas = {name: meta for name in self.layers}
        self.tr.stats.draft_forwards["causal" if causal else "tree"] += 1
        kwargs = {
            "input_ids": torch.tensor(tokens, dtype=torch.int32),
            "positions": positions,
        }
        if self.eagle:
            kwargs["hidden_states"] = feats
        else:
            kwargs["inputs_embeds"] = None
        model = self.proposer.model
        with set_forward_context(
            metas,
            self.proposer.vllm_config,
            num_tokens=offset,
            slot_mapping={name: slot_t for name in self.layers},
        ):
            hidden = model(**kwargs)
        if not causal:
            self.tr.stats.seconds["tree_attention"] += meta.rows.seconds
        if isinstance(hidden, tuple):
            hidden = hidden[0]
        if want is None:
            return None, None
        h = hidden[:offset] if keep == list(range(offset)) else hidden[torch.tensor(keep)]
        return torch.log_softmax(model.compute_logits(h).float(), dim=-1), h

    def _causal_metadata(
        self,
        block_table: torch.Tensor,
        new_nodes: list[list[int]],
        kv_lens: list[int],
        slot_mapping: torch.Tensor,
        positions: torch.Tensor,
    ) -> dict[str, object]:
        """vLLM's own attention metadata of a forward whose rows are causal: each request's
        new nodes are the last ``len(nodes)`` of ``kv_lens`` cached positions."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        q_lens = [len(n) for n in new_nodes]
        qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
        seq_lens = torch.tensor(kv_lens, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl,
            seq_lens=seq_lens,
            num_reqs=len(new_nodes),
            num_actual_tokens=sum(q_lens),
            max_query_len=max(q_lens),
            max_seq_len=max(kv_lens),
            block_table_tensor=block_table,
            slot_mapping=slot_mapping,
            positions=positions,
            seq_lens_cpu_upper_bound=seq_lens,
        )
        metas: dict[str, object] = {}
        for g in self.groups:
            meta = g.build_metadata_for_drafting(common_attn_metadata=common, draft_index=0)
            metas.update(dict.fromkeys(g.layer_names, meta))
        return metas

    # ----------------------------------------------------------------- propose
    def propose(self, todo: list[Draftee]) -> list[tuple[Proposal, int]]:
        """Each request's tree, grown below the last element of its sequence
        (``tree_dev.step.grow_trees``), and the draft's cached length afterwards (the
        elements it consumed stay in its cache)."""
        policy = self.tr.cfg.policy
        reqs = [
            DraftRequest(
                d.row,
                d.seq[d.start :],
                d.start,
                expansion_for(
                    d.policy or policy,
                    int(d.seq[-1]),
                    d.context,
                    d.temperature,
                    generator=d.generator,
                ),
                d.feats if self.eagle else None,
            )
            for d in todo
        ]
        proposals = grow_trees(reqs, self.forward)
        return [(p, r.prefix) for p, r in zip(proposals, reqs)]


def _level_rows(rows, prefixes, trees, new_nodes, want, causal: bool, nblocks, bs: int):
    """Per packed row of a draft forward: its linear KV position (node ``j`` at slot
    ``prefix + j``), RoPE position (``prefix + depth``), batch row, node in the
    ``TreeBatch`` (tree rows only), and the packed rows whose outputs are wanted.
    RuntimeError when a node would be written past the request's allocated KV blocks."""
    lin, pos, brow, qnodes, keep = [], [], [], [], []
    offset = node_base = 0  # rows so far; nodes of the earlier trees (TreeBatch order)
    for b, (row, p, tree, nodes) in enumerate(zip(rows, prefixes, trees, new_nodes)):
        if (p + nodes[-1]) // bs >= int(nblocks[row]):
            raise RuntimeError(
                f"treespec: draft node {nodes[-1]} of batch row {row} would be written at "
                f"position {p + nodes[-1]}, past the {nblocks[row]} KV "
                f"blocks vLLM allocated for the request (block size {bs})"
            )
        depth = tree.depth_list
        lin += [p + n for n in nodes]
        pos += [p + depth[n] for n in nodes]
        brow += [row] * len(nodes)
        if not causal:
            qnodes += [node_base + n for n in nodes]
            node_base += tree.num_nodes
        if want is not None:
            where = {n: k for k, n in enumerate(nodes)}
            keep.extend(offset + where[n] for n in want[b])
        offset += len(nodes)
    return lin, pos, brow, qnodes, keep


def _causal_tail(tree: TokenTree, nodes: list[int]) -> bool:
    """True when ``tree`` is a chain and ``nodes`` (ascending) are its last nodes: every
    computed row then attends to exactly the rows before it, vLLM's causal mask."""
    n = tree.num_nodes  # the last node at depth n - 1: all n nodes on one path
    return tree.depth_list[-1] == n - 1 and nodes[0] == n - len(nodes) and nodes[-1] == n - 1
