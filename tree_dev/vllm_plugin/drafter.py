"""Growing token trees with a draft model that lives inside vLLM.

The draft is vLLM's own draft model (the ``draft_model`` proposer's ``model``: vLLM's model
code, its KV in vLLM's paged cache, compiled like the target). Drafting a request:

- **catch-up**: the committed tokens the draft has not seen (the last step's accepted
  tokens and the new root; the whole prompt on the first step) are written at their own
  positions. Long catch-ups go first in chunks; a short one rides along as the *trunk* of
  the first level.
- **levels**: each level is one packed draft forward over that level's new nodes of every
  request, with tree attention over the prefix and the node's ancestors; node ``j`` of the
  forwarded tree sits at slot ``root + j`` (vLLM reserves ``num_speculative_tokens`` draft
  slots per request, which bounds the nodes a tree may forward; ``config`` checks it).
  The next nodes come from ``tree_dev.proposer.TreeExpansion``, the same expansion the local
  engine runs, so both engines grow the same tree from the same draft scores.

Nothing is recomputed: earlier levels' K/V stay in the draft cache for the later ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tree_dev.proposer import TreeExpansion, tree_of
from tree_dev.tree import TokenTree, TreeBatch
from tree_dev.vllm_plugin.attention import TreeAttentionMetadata, TreeRows

TRUNK_LIMIT = 32  # catch-ups up to this long ride along in the first level
CHUNK = 256  # longer ones are prefilled in chunks of this many tokens first


@dataclass
class _Grower:
    """One request's forwarded draft tree (trunk chain, then expanded nodes)."""

    row: int  # batch row in vLLM's persistent batch
    rid: str
    prefix: int  # draft KV valid for positions < prefix
    expansion: TreeExpansion
    parents: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    cand_fwd: dict[int, int] = field(default_factory=dict)
    new: list[int] = field(default_factory=list)


class ModelDrafter:
    """Tree drafting with vLLM's draft model (``speculative_config`` method ``draft_model``)."""

    def __init__(self, tree_runner, proposer, layer_names: list[str]):
        if not layer_names:
            raise ValueError("treespec: the draft model has no attention layers with a KV cache")
        self.tr = tree_runner
        self.proposer = proposer
        self.layers = layer_names

    # ----------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(
        self,
        rows: list[int],
        prefixes: list[int],
        trees: list[TokenTree],
        new_nodes: list[list[int]],
        tokens: list[int],
        want: list[list[int]] | None,
    ) -> torch.Tensor | None:
        """One packed draft forward; returns fp32 log-probs at the ``want`` nodes.

        Args:
            rows: batch rows of the requests; prefixes: draft KV length before each tree.
            trees: each request's forwarded tree (node ``j`` at position ``prefix + j``).
            new_nodes: per request, the nodes computed now (ascending).
            tokens: token of every new node, packed.
            want: per request, nodes (among ``new_nodes``) whose next-token log-probs are
                returned, packed ``[sum(len(w)), V]``; None returns nothing.
        """
        from vllm.forward_context import set_forward_context

        r = self.tr.runner
        bt = r.input_batch.block_table.block_tables[0]
        table, bs = bt.get_cpu_tensor(), bt.block_size
        batch = TreeBatch(trees)
        pos, slots, qnodes, keep = [], [], [], []
        offset = 0
        for b, (row, p, tree, nodes) in enumerate(zip(rows, prefixes, trees, new_nodes)):
            nt = torch.tensor(nodes, dtype=torch.int64)
            linear = p + nt
            pos.append(p + tree.depth[nt])
            blocks = table[row].to(torch.int64)[linear // bs]
            slots.append(blocks * bs + linear % bs)
            qnodes.append(int(batch.cu_nodes[b]) + nt)
            if want is not None:
                where = {n: k for k, n in enumerate(nodes)}
                keep.extend(offset + where[n] for n in want[b])
            offset += len(nodes)
        meta = TreeAttentionMetadata(
            TreeRows(
                batch=batch,
                row_index=torch.arange(offset),
                prefix_lens=torch.tensor(prefixes, dtype=torch.int64),
                query_nodes=torch.cat(qnodes),
                block_table=table[rows],
                kv_lens=[p + t.num_nodes for p, t in zip(prefixes, trees)],
            ),
            num_actual_tokens=offset,
        )
        slot_t = torch.cat(slots)
        ids = torch.tensor(tokens, dtype=torch.int32)
        positions = torch.cat(pos)
        model = self.proposer.model
        with set_forward_context(
            {name: meta for name in self.layers},
            self.proposer.vllm_config,
            num_tokens=offset,
            slot_mapping={name: slot_t for name in self.layers},
        ):
            hidden = model(input_ids=ids, positions=positions, inputs_embeds=None)
        if isinstance(hidden, tuple):
            hidden = hidden[0]
        if want is None:
            return None
        logits = model.compute_logits(hidden[torch.tensor(keep, dtype=torch.int64)])
        return torch.log_softmax(logits.float(), dim=-1)

    # ----------------------------------------------------------------- propose
    def propose(self, todo: list[tuple[int, str, int]]) -> list[tuple[TokenTree, list[int]]]:
        """Trees for ``(batch row, request id, committed tokens)``; the last token is the root."""
        r = self.tr.runner
        policy = self.tr.cfg.policy
        token_ids = r.input_batch.token_ids_cpu
        growers = []
        for row, rid, n_tokens in todo:
            root = n_tokens - 1
            start = min(self.tr.draft_len.get(rid, 0), root)
            growers.append(
                _Grower(row, rid, start, TreeExpansion(policy, int(token_ids[row, root])))
            )
        self._catch_up(growers, token_ids, [n - 1 for _, _, n in todo])
        for g, (_, _, n_tokens) in zip(growers, todo):
            trunk = token_ids[g.row, g.prefix : n_tokens].tolist()
            g.parents = list(range(-1, len(trunk) - 1))
            g.tokens = trunk
            g.cand_fwd = {-1: len(trunk) - 1}
            g.new = list(range(len(trunk)))
        active = [g for g in growers if g.expansion.frontier()]
        while active:
            want = [[g.cand_fwd[c] for c in g.expansion.frontier()] for g in active]
            logprobs = self.forward(
                [g.row for g in active],
                [g.prefix for g in active],
                [tree_of(tuple(g.parents)) for g in active],
                [g.new for g in active],
                [g.tokens[n] for g in active for n in g.new],
                want,
            )
            for g, lp in zip(active, logprobs.split([len(w) for w in want])):
                g.expansion.absorb(lp)
                g.new = []
                for c in g.expansion.frontier():
                    g.parents.append(g.cand_fwd[g.expansion.parent(c)])
                    g.tokens.append(g.expansion.token(c))
                    g.cand_fwd[c] = len(g.parents) - 1
                    g.new.append(len(g.parents) - 1)
            active = [g for g in active if g.new]
        results = []
        for g, (_, _, n_tokens) in zip(growers, todo):
            self.tr.draft_len[g.rid] = n_tokens  # trunk and root now in the draft cache
            tree, tokens, _ = g.expansion.result()
            results.append((tree, tokens))
        return results

    def _catch_up(self, growers: list[_Grower], token_ids, roots: list[int]) -> None:
        """Prefill long catch-ups (everything before the root beyond TRUNK_LIMIT) in chunks."""
        while True:
            todo = [(g, root) for g, root in zip(growers, roots) if root - g.prefix > TRUNK_LIMIT]
            if not todo:
                return
            chunks = [min(CHUNK, root - g.prefix) for g, root in todo]
            toks = [
                token_ids[g.row, g.prefix : g.prefix + n].tolist()
                for (g, _), n in zip(todo, chunks)
            ]
            self.forward(
                [g.row for g, _ in todo],
                [g.prefix for g, _ in todo],
                [tree_of((-1, *range(n - 1))) for n in chunks],
                [list(range(n)) for n in chunks],
                [t for part in toks for t in part],
                None,
            )
            for (g, _), n in zip(todo, chunks):
                g.prefix += n
