"""The local engine's model runner: one Hugging Face model (target, draft LM or EAGLE
head) over its own paged KV cache, running packed forwards over token-tree rows.

``Runner.forward`` computes the new nodes of several requests' trees in one forward:
tree attention (``kernels.tree_attention`` through the ``"treespec"``
``AttentionInterface``), or, for a few rows (a decode step, a draft level; with the torch
backend on the CPU whole trees of up to ``ROW_PATH_TREE_NODES`` nodes), one masked SDPA
call per request and layer over a view of its cache. Stock HF Llama models run through
``tree_dev.lean_forward``. ``Runner.prefill`` pushes committed chains in chunks.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from tree_dev.attention import TreeForward
from tree_dev.kv_cache import PagedKVCache
from tree_dev.lean_forward import lean_supported, llama_forward
from tree_dev.proposer import tree_of
from tree_dev.tree import TokenTree, TreeBatch

PREFILL_CHUNK = 256


def _tree_batch(trees: tuple[TokenTree, ...], device: torch.device) -> TreeBatch:
    return TreeBatch(list(trees), device=device)


# one builder, two caches: the verify forward's (here) and the walk's
# (tree_dev.acceptance's), patched apart in tests
_batch_of = lru_cache(maxsize=1024)(_tree_batch)


# forwards of at most this many new nodes per request and in all attend row by row
# (one masked SDPA call per request and layer, no tree plan): decode steps and draft
# levels on every backend; with the torch backend on the CPU also tree verifies of up
# to ROW_PATH_TREE_NODES nodes, where one SDPA call over the request's cache view with
# the tree's mask (built once per forward) measured about half the torch tree kernel's
# time per layer (figures: docs/design_figures.md, "Row path")
ROW_PATH_NODES = 4
ROW_PATH_ROWS = 16
ROW_PATH_TREE_NODES = 64
ROW_PATH_TREE_ROWS = 512


def _visible(tree: TokenTree) -> torch.Tensor:
    """``bool [N, N]``: node i sees node j (j is i or an ancestor): the row path's mask."""
    return tree.ancestor_mask


class Runner:
    """One model (target, draft LM or EAGLE head) with its own paged KV cache.

    ``forward`` runs one packed forward over new tree nodes of several requests;
    ``prefill`` pushes committed token chains into the cache in chunks.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        backend: str,
        eagle: bool = False,
        tree_kernel: bool = False,
    ):
        p = next(model.parameters())
        self.model = model
        self.eagle = eagle
        self.backend = backend
        self.cache = PagedKVCache(
            num_layers, num_blocks, block_size, kv_heads, head_dim, p.dtype, p.device
        )
        self.device = p.device
        cpu_torch = self.device.type == "cpu" and backend in ("auto", "torch") and not tree_kernel
        self.row_nodes = ROW_PATH_TREE_NODES if cpu_torch else ROW_PATH_NODES
        self.row_rows = ROW_PATH_TREE_ROWS if cpu_torch else ROW_PATH_ROWS

    @torch.inference_mode()
    def forward(
        self,
        req_ids: list[int],
        prefix_lens: list[int],
        trees: list[TokenTree],
        new_nodes: list[list[int]] | None,
        tokens: list[int],
        feats: torch.Tensor | None = None,
        want_logits: bool = True,
        logit_rows: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compute the new nodes of each request's tree.

        Args:
            req_ids, prefix_lens, trees: per request; the tree's nodes live at
                cache positions ``prefix_len + node``.
            new_nodes: per request, the local nodes computed now (ascending), or
                None for all nodes. Other nodes' K/V must already be cached.
            tokens: token id of every new node, packed in request order.
            feats: EAGLE only, ``[T_new, H]`` target features paired with tokens.
            logit_rows: the packed rows whose logits are wanted (None: all).

        Returns:
            ``hidden [T_new, H]`` (the model's final hidden state) and
            ``logits [len(logit_rows) or T_new, V]`` (None unless ``want_logits``).
        """
        nodes_per = [range(t.num_nodes) for t in trees] if new_nodes is None else new_nodes
        if max(len(n) for n in nodes_per) <= self.row_nodes and sum(map(len, nodes_per)) <= (
            self.row_rows
        ):
            return self._forward_rows(
                req_ids, prefix_lens, trees, nodes_per, tokens, feats, want_logits, logit_rows
            )
        batch = _batch_of(tuple(trees), self.device)
        positions, slots, rows = [], [], []
        for r, (rid, plen, tree) in enumerate(zip(req_ids, prefix_lens, trees)):
            self.cache.reserve(rid, plen + tree.num_nodes)
            nodes_t = torch.tensor(list(nodes_per[r]), dtype=torch.int64)
            positions.append(plen + tree.depth[nodes_t])
            slots.append(self.cache.slots(rid, plen + nodes_t))
            rows.append(int(batch.cu_nodes[r]) + nodes_t)
        ctx = TreeForward(
            cache=self.cache,
            tree=batch,
            prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64, device=self.device),
            block_table=self.cache.block_table(req_ids),
            write_slots=torch.cat(slots).to(self.device),
            new_rows=None if new_nodes is None else torch.cat(rows).to(self.device),
            backend=self.backend,
        )
        pos = torch.cat(positions).to(self.device)
        return self._run(tokens, pos, ctx, feats, want_logits, logit_rows)

    def _forward_rows(
        self, req_ids, prefix_lens, trees, nodes_per, tokens, feats, want_logits, logit_rows
    ):
        """``forward`` of a few new nodes (a decode step, a draft level): per request,
        one SDPA call per layer over a view of its cache (prefix + tree nodes, when its
        blocks are consecutive), masked to each node's prefix and root path (no mask for
        a single node that sees everything: a plain decode step)."""
        cache, positions, slots, kv = self.cache, [], [], []
        for rid, plen, tree, nodes in zip(req_ids, prefix_lens, trees, nodes_per):
            n_all = tree.num_nodes
            cache.reserve(rid, plen + n_all)
            if n_all == 1:
                positions.append(plen)
                slots.append(cache.slot(rid, plen))
                kv.append((cache.causal_slots(rid, plen + 1), None))
                continue
            depth = tree.depth.tolist()
            last = max(nodes)
            for n in nodes:
                positions.append(plen + depth[n])
                slots.append(cache.slot(rid, plen + n))
            mask = None
            if len(nodes) > 1 or depth[last] != last:  # else: a chain's last node
                mask = torch.ones(len(nodes), plen + last + 1, dtype=torch.bool)
                mask[:, plen:] = _visible(tree)[list(nodes), : last + 1]
                mask = mask.to(self.device)
            kv.append((cache.causal_slots(rid, plen + last + 1), mask))
        ctx = TreeForward(
            cache=cache,
            tree=None,
            prefix_lens=None,
            block_table=None,
            write_slots=torch.tensor(slots, dtype=torch.int64, device=self.device),
            new_rows=None,
            backend=self.backend,
            causal_kv=kv,
            causal_rows=[len(n) for n in nodes_per],
        )
        pos_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        return self._run(tokens, pos_t, ctx, feats, want_logits, logit_rows)

    def _run(self, tokens, positions, ctx, feats, want_logits, logit_rows=None):
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)[None]
        pos = positions[None]
        m = self.model
        if self.eagle:  # EagleHead.forward, with the lm_head on the wanted rows only
            z = m.fc(torch.cat([m.embed(ids), feats[None].to(m.fc.weight.dtype)], -1))
            if lean_supported(m.decoder):
                hidden = llama_forward(m.decoder, pos, ctx, inputs_embeds=z)[0]
            else:
                out = m.decoder(inputs_embeds=z, position_ids=pos, use_cache=False, tree_ctx=ctx)
                hidden = out.last_hidden_state[0]
        elif lean_supported(m.model):
            hidden = llama_forward(m.model, pos, ctx, input_ids=ids)[0]
        else:
            out = m.model(input_ids=ids, position_ids=pos, use_cache=False, tree_ctx=ctx)
            hidden = out.last_hidden_state[0]
        head = m.lm_head
        if not want_logits:
            return hidden, None
        return hidden, head(hidden if logit_rows is None else hidden[logit_rows])

    def prefill(
        self,
        req_ids: list[int],
        starts: list[int],
        chains: list[list[int]],
        feats: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Append committed token chains to the cache (causal = chain trees).

        Returns each request's hidden states ``[len(chain), H]``.
        """
        hidden: list[list[torch.Tensor]] = [[] for _ in req_ids]
        offset = 0
        longest = max((len(c) for c in chains), default=0)
        while offset < longest:
            idx = [i for i, c in enumerate(chains) if len(c) > offset]
            parts = [chains[i][offset : offset + PREFILL_CHUNK] for i in idx]
            f = None
            if feats is not None:
                f = torch.cat([feats[i][offset : offset + len(p)] for i, p in zip(idx, parts)])
            h, _ = self.forward(
                [req_ids[i] for i in idx],
                [starts[i] + offset for i in idx],
                [tree_of((-1, *range(len(p) - 1))) for p in parts],
                None,
                [t for p in parts for t in p],
                feats=f,
                want_logits=False,
            )
            for i, part in zip(idx, h.split([len(p) for p in parts])):
                hidden[i].append(part)
            offset += PREFILL_CHUNK
        return [torch.cat(h) if h else torch.empty(0) for h in hidden]


def _attn_geometry(config) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, config.num_key_value_heads or heads, head_dim


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained`` from a local directory, no network.

    ``path`` is a model directory, a model-set directory (its ``target/`` is loaded) or a
    model name of ``tree_dev.models.named`` (``smollm2-135m`` is fetched on first use).
    """
    from .models.named import resolve_model

    p = resolve_model(path)
    if not (p / "config.json").is_file() and (p / "target" / "config.json").is_file():
        p = p / "target"
    if not (p / "config.json").is_file():
        raise ValueError(f"{p} is not a model directory (no config.json)")
    return AutoModelForCausalLM.from_pretrained(p, dtype=dtype, local_files_only=True).eval()
