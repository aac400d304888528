"""The local tree speculative-decoding engine, in one file.

A token's life, top to bottom of this file:

1. ``Engine.add_request`` queues a prompt with its ``SamplingParams``.
2. ``Engine.step`` admits queued requests (up to ``max_batch``): the target
   *prefills* the prompt minus its last token into its paged KV cache; the last
   prompt token becomes the request's **root** (committed, not yet processed).
3. The **draft** (a small causal LM, or an EAGLE head over the target's
   features) catches up on the committed tokens it has not seen, then
   **proposes** a token tree below the root: a static tree (``chain:K``,
   ``paths:[...]``, ``medusa:NAME``: the draft's top-ranked tokens at each node)
   or the dynamic top-K tree (``topk:k=,depth=,budget=``: expand the k best nodes
   by cumulative log-probability per level, keep the best ``budget``), or the
   top-K tree merged with the context's n-gram trie (``hybrid:``). Each level is
   one packed draft forward that reuses the draft's KV of earlier levels; the
   catch-up, the levels and the walk are ``tree_dev.step``'s (the tree-growing rules
   ``tree_dev.proposer``'s), shared with the vLLM plugin: this engine is an adapter.
   ``ngram:`` tries (matches of the context's suffix in prompt + output) need no
   draft model; ``none`` proposes the root alone.
4. The **target verifies** every node of every request's tree in one packed
   forward: tree attention (``kernels.tree_attention``) through the
   ``"treespec"`` ``AttentionInterface`` implementation; with the torch backend on
   the CPU, trees of up to ``ROW_PATH_TREE_NODES`` nodes instead take one masked
   SDPA call per request and layer (faster there). Stock HF Llama models run
   through ``tree_dev.lean_forward`` (their own modules, without HF's per-call
   machinery; HF's forward whenever a hook is present).
5. ``kernels.tree_walk`` picks each request's accepted path and a bonus token
   (greedy, or lossless sampling: ``target_only`` for deterministic drafts,
   ``draft_probs`` for sampled drafts), ``kernels.kv_compact`` keeps exactly the
   accepted path's K/V, and the bonus token is the next root.
6. Finished requests leave the batch and their KV blocks are freed.

A step whose every tree is the root alone is a plain decode: one SDPA call per
request and layer over a view of its cache, the next token drawn directly (no
tree attention plan, no walk, no compaction); compaction also runs only when an
accepted path is not already in place.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

import kernels
from kernels.reference import target_probs
from kernels.torchops.tree_walk import sample_inverse_cdf
from tree_dev.attention import TreeForward, register
from tree_dev.kv_cache import PagedKVCache
from tree_dev.lean_forward import lean_supported, llama_forward
from tree_dev.narrow_linear import narrow_available, use_narrow_linears
from tree_dev.onednn_linear import onednn_faster, use_onednn_linears
from tree_dev.proposer import NgramHistory, expansion_for, ngram_trie, tree_of
from tree_dev.spec import (
    HybridPolicy,
    NgramPolicy,
    NoDraftPolicy,
    Policy,
    StaticPolicy,
    parse_tree_spec,
)
from tree_dev.step import (
    DepthStats,
    DraftBatch,
    DraftRequest,
    Proposal,
    grow_trees,
    walk_mode,
    walk_trees,
)
from tree_dev.tree import TokenTree, TreeBatch

PREFILL_CHUNK = 256
_ROOT_ONLY = TokenTree.chain(0)  # plain decoding's tree (immutable, its properties cached)


def _tree_batch(trees: tuple[TokenTree, ...], device: torch.device) -> TreeBatch:
    return TreeBatch(list(trees), device=device)


# one builder, two caches: the verify forward's and the walk's (patched apart in tests)
_batch_of = lru_cache(maxsize=1024)(_tree_batch)
_walk_batch = lru_cache(maxsize=1024)(_tree_batch)


# forwards of at most this many new nodes per request and in all attend row by row
# (one masked SDPA call per request and layer, no tree plan): decode steps and draft
# levels on every backend; with the torch backend on the CPU also tree verifies of up
# to ROW_PATH_TREE_NODES nodes, where one SDPA call over the request's cache view with
# the tree's mask (built once per forward) measured about half the torch tree kernel's
# time per layer (107-171 vs 210-358 us, 5-33 nodes after 150 cached tokens)
ROW_PATH_NODES = 4
ROW_PATH_ROWS = 16
ROW_PATH_TREE_NODES = 64
ROW_PATH_TREE_ROWS = 512


def _visible(tree: TokenTree) -> torch.Tensor:
    """``bool [N, N]``: node i sees node j (j is i or an ancestor): the row path's mask."""
    return tree.ancestor_mask


# --------------------------------------------------------------------------- requests
@dataclass
class SamplingParams:
    """Per-request decoding parameters (OpenAI-style).

    ``temperature == 0`` is greedy. ``seed`` makes sampling reproducible.
    ``stop_token_ids`` end the request (the stop token is kept in the output);
    ``ignore_eos`` keeps going past the model's EOS token.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


@dataclass
class Request:
    """One request's state. The committed text is ``prompt + output``; its last
    token is the ``root``, whose K/V is not in the target cache yet."""

    req_id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    output: list[int] = field(default_factory=list)
    target_len: int = 0  # committed tokens with K/V in the target cache
    draft_len: int = 0  # committed tokens with K/V in the draft cache
    pending: list[int] = field(default_factory=list)  # committed, not in draft cache; last = root
    pending_feats: torch.Tensor | None = None  # EAGLE: target feature before each pending token
    finished: bool = False
    finish_reason: str | None = None
    depth: DepthStats = field(default_factory=DepthStats)  # per-depth acceptance so far
    sampled_drafts: bool = False  # children drawn without replacement from the draft

    @property
    def root(self) -> int:
        return (self.prompt + self.output)[-1]

    @property
    def mode(self) -> str:
        return walk_mode(self.params.temperature, self.sampled_drafts)

    @property
    def steps(self) -> int:
        return self.depth.steps

    @property
    def accepted_drafts(self) -> int:
        return self.depth.accepted_drafts

    @property
    def depth_tried(self) -> list[int]:
        """Per depth: steps whose tree reached it."""
        return self.depth.tried

    @property
    def depth_accepted(self) -> list[int]:
        """Per depth: steps that accepted a draft token there."""
        return self.depth.accepted

    def stats(self) -> dict:
        """Speculative-decoding statistics of this request so far."""
        return {
            "steps": self.steps,
            "accepted_draft_tokens": self.accepted_drafts,
            "mean_accepted_length": (len(self.output) / self.steps) if self.steps else 0.0,
            "acceptance_per_depth": self.depth.acceptance_per_depth(),
        }


@dataclass
class StepOutput:
    """What one ``Engine.step`` produced for one request."""

    req_id: int
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None


@dataclass
class RequestStep:
    """One request in one verify step (``StepEvent``): the tree the target scored and the
    path the walk accepted."""

    req_id: int
    prefix_len: int  # committed tokens cached before the root; the root's position
    context: list[int]  # committed tokens, root last (len prefix_len + 1)
    parents: list[int]  # [N] node parents (-1: the root)
    tokens: list[int]  # [N] node tokens
    max_depth: int  # the tree's depth (0: the root alone)
    accepted: list[int] = field(default_factory=list)  # accepted node ids, root first
    emitted: list[int] = field(default_factory=list)  # the walk's tokens: drafts + bonus


@dataclass
class StepEvent:
    """What one ``Engine.step`` did, for subscribers (``Engine.on_step``): every request's
    tree and accepted path, and the step's draft / verify / walk seconds."""

    requests: list[RequestStep]
    timings: dict[str, float]


# --------------------------------------------------------------------------- model runner
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


def _switch_linears(models, onednn_linear: bool | None, narrow_linear: bool | None) -> None:
    """Route the models' linear layers through oneDNN and/or ``narrow_gemm`` (None: where
    this CPU gains from it)."""
    if onednn_linear is None:
        onednn_linear = onednn_faster()
    if narrow_linear is None:
        narrow_linear = narrow_available()
    for model in models:
        if model is not None and onednn_linear:
            use_onednn_linears(model)
        if model is not None and narrow_linear:  # after oneDNN: it keeps the wide inputs
            use_narrow_linears(model)


# --------------------------------------------------------------------------- engine
class Engine:
    """Tree speculative decoding over a target and a draft (LM or EAGLE head).

    Args:
        target: a ``transformers`` causal LM (Llama-style), or a local path.
        draft: a smaller causal LM sharing the vocabulary, or a path; or None.
        eagle: an EAGLE head (``tree_dev.models.eagle.EagleHead``) instead of a draft LM.
        tree: a tree spec (see ``tree_dev.spec``); ``"none"`` for plain decoding;
            ``ngram:`` tries need no draft (one given is not loaded into a runner).
        max_batch: most requests decoded together.
        max_model_len: longest prompt + output.
        kernel_backend: backend for ``kernels.*`` (``"auto"`` picks per device).
        block_size: KV cache block size.
        eos_token_id: stops requests unless ``ignore_eos``; defaults to the target config's.
        draft_sampling: for sampled requests (temperature > 0) draw each node's
            children without replacement from the draft distribution (Gumbel
            top-k) and verify with ``draft_probs``; static trees only. Default:
            deterministic top-ranked children verified with ``target_only``.
        tree_kernel: verify every tree of more than ``ROW_PATH_NODES`` nodes with
            ``kernels.tree_attention`` even where the row path is faster (the accuracy
            tooling's validation sets it: it exists to prove the kernel in the engine).
        onednn_linear: route the models' fp32 CPU linear layers through oneDNN for
            multi-row inputs (tree verify, prefill; see ``tree_dev.onednn_linear``).
            Switches the given models' layers in place. Default (None): where
            ``onednn_faster()`` (a CPU with AVX-512), else MKL's ``F.linear``.
        narrow_linear: route inputs of at most ``narrow_linear.MAX_ROWS`` rows (a
            decode step, a tree verify, a draft level) through ``narrow_gemm``, which
            costs about the same at 1-4 rows as at 1 (see ``tree_dev.narrow_linear``).
            Switches the given models' layers in place. Default (None): where
            ``narrow_available()`` (x86-64 with AVX2 and a C compiler).
    """

    def __init__(
        self,
        target: PreTrainedModel | str | Path,
        draft: PreTrainedModel | str | Path | None = None,
        eagle: torch.nn.Module | None = None,
        tree: str = "chain:4",
        max_batch: int = 8,
        max_model_len: int = 1024,
        kernel_backend: str = "auto",
        block_size: int = 16,
        eos_token_id: int | None = None,
        draft_sampling: bool = False,
        onednn_linear: bool | None = None,
        narrow_linear: bool | None = None,
        tree_kernel: bool = False,
    ):
        self.policy: Policy = parse_tree_spec(tree)
        # finished requests' tokens, searched by an ngram:...,history=H trie
        self.ngram_history = NgramHistory(getattr(self.policy, "history", 0))
        if draft_sampling and not isinstance(self.policy, StaticPolicy):
            raise ValueError(
                f"draft_sampling needs a static tree (chain/paths/medusa), not {tree!r}: pruning "
                "a sampled dynamic tree would bias the accepted tokens"
            )
        self.draft_sampling = draft_sampling
        if isinstance(target, (str, Path)):
            target = load_causal_lm(target)
        if isinstance(draft, (str, Path)):
            draft = load_causal_lm(draft, dtype=next(target.parameters()).dtype)
        draft, eagle = self._drafter_models(target, draft, eagle, tree)
        if max_batch < 1 or max_model_len < 2:
            raise ValueError(
                f"max_batch must be >= 1 and max_model_len >= 2, got {max_batch}, {max_model_len}"
            )
        self._check_kernel_limit(target, kernel_backend, tree)
        register()
        self.target = target.eval()
        self.target.set_attn_implementation("treespec")
        self.kernel_backend = kernel_backend
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.vocab_size = target.config.vocab_size
        eos = target.config.eos_token_id if eos_token_id is None else eos_token_id
        self.eos_ids = set(
            eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []
        )
        blocks = max_batch * -(
            -(max_model_len + self.policy.max_nodes + PREFILL_CHUNK) // block_size
        )
        self.runner = Runner(
            target,
            *_attn_geometry(target.config),
            blocks,
            block_size,
            kernel_backend,
            tree_kernel=tree_kernel,
        )
        self.draft_runner = self._draft_runner(draft, eagle, blocks, block_size)
        _switch_linears(
            (target, draft if draft is not None else eagle), onednn_linear, narrow_linear
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self._next_id = 0
        self.timings = {"draft": 0.0, "verify": 0.0, "walk": 0.0, "prefill": 0.0}
        self.forwards = {"target": 0, "draft": 0}
        self._step_listeners: list[Callable[[StepEvent], None]] = []

    def _drafter_models(self, target, draft, eagle, tree: str) -> tuple:
        """``(draft, eagle)`` this engine runs: both None where the tree needs no draft
        (plain decoding, n-gram tries); ValueError for a missing, doubled or mismatched
        draft."""
        if draft is not None and eagle is not None:
            raise ValueError("give either a draft model or an EAGLE head, not both")
        uses_draft = not isinstance(self.policy, (NoDraftPolicy, NgramPolicy))
        if uses_draft and draft is None and eagle is None:
            raise ValueError(f"tree {tree!r} needs a draft model or an EAGLE head")
        if not uses_draft:  # plain decoding and n-gram tries run no draft
            return None, None
        vocab = target.config.vocab_size
        drafter = draft if draft is not None else eagle
        if drafter.config.vocab_size != vocab:
            raise ValueError(
                f"draft vocabulary ({drafter.config.vocab_size}) differs from "
                f"the target's ({vocab})"
            )
        return draft, eagle

    def _check_kernel_limit(self, target, kernel_backend: str, tree: str) -> None:
        dev = next(target.parameters()).device
        attn_fn = kernels._resolve("tree_attention", kernel_backend, dev)
        limit = getattr(attn_fn, "max_tree_nodes", None)
        if limit is not None and self.policy.max_nodes > limit:
            raise ValueError(
                f"tree {tree!r} has up to {self.policy.max_nodes} nodes; kernel backend "
                f"{kernel_backend!r} supports at most {limit}"
            )

    def _draft_runner(self, draft, eagle, blocks: int, block_size: int) -> Runner | None:
        """The draft LM's or EAGLE head's runner (None without one)."""
        drafter = draft if draft is not None else eagle
        if drafter is None:
            return None
        drafter.eval()
        if eagle is not None:
            eagle.config._attn_implementation = "treespec"
            eagle.decoder.set_attn_implementation("treespec")
        else:
            drafter.set_attn_implementation("treespec")
        return Runner(
            drafter,
            *_attn_geometry(drafter.config),
            blocks,
            block_size,
            self.kernel_backend,
            eagle=eagle is not None,
        )

    # ----------------------------------------------------------------- public API
    def on_step(self, listener: Callable[[StepEvent], None]) -> None:
        """Call ``listener(StepEvent)`` after every verify step (tests, ``bench.validate``,
        statistics). Without listeners a step builds no event."""
        self._step_listeners.append(listener)

    def add_request(self, prompt: list[int], params: SamplingParams | None = None) -> int:
        """Queue a prompt (token ids); returns the request id."""
        params = params or SamplingParams()
        params.validate()
        if not prompt:
            raise ValueError("empty prompt: give at least one token")
        bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(
                f"prompt token {bad[0]!r} outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len} "
                "(prompt + at least one output token)"
            )
        gen = torch.Generator(device="cpu")
        gen.manual_seed(params.seed if params.seed is not None else torch.seed() % 2**63)
        req = Request(self._next_id, list(prompt), params, gen)
        req.sampled_drafts = self.draft_sampling and params.temperature > 0
        self._next_id += 1
        self.requests[req.req_id] = req
        self.waiting.append(req)
        return req.req_id

    def abort(self, req_id: int) -> None:
        """Drop a request (e.g. its client disconnected) and free its blocks."""
        req = self.requests.get(req_id)
        if req is None or req.finished:
            return
        req.finished, req.finish_reason = True, "abort"
        if req in self.waiting:
            self.waiting.remove(req)
        self._release(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Decode ``prompts`` to completion; returns the output token ids of each."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_work():
            self.step()
        return [self.requests[i].output for i in ids]

    def step(self) -> list[StepOutput]:
        """Admit waiting requests, run one draft-verify-accept step for all running."""
        self._admit()
        if not self.running:
            return []
        batch = list(self.running)
        t0 = time.perf_counter()
        proposals = self._propose(batch)
        t1 = time.perf_counter()
        hidden, logits = self.runner.forward(
            [r.req_id for r in batch],
            [r.target_len for r in batch],
            [p.tree for p in proposals],
            None,
            [t for p in proposals for t in p.tokens],
        )
        self.forwards["target"] += 1
        t2 = time.perf_counter()
        records = None
        if self._step_listeners:
            records = [
                RequestStep(
                    r.req_id,
                    r.target_len,
                    r.prompt + r.output,
                    p.tree.parents.tolist(),
                    p.tokens,
                    p.tree.max_depth,
                )
                for r, p in zip(batch, proposals)
            ]
        paths: dict[int, tuple[list[int], list[int]]] | None = {} if records is not None else None
        outs = self._accept(batch, proposals, hidden, logits, paths)
        t3 = time.perf_counter()
        self.timings["draft"] += t1 - t0
        self.timings["verify"] += t2 - t1
        self.timings["walk"] += t3 - t2
        if records is not None:
            for rec in records:
                rec.accepted, rec.emitted = paths[rec.req_id]
            event = StepEvent(records, {"draft": t1 - t0, "verify": t2 - t1, "walk": t3 - t2})
            for listener in self._step_listeners:
                listener(event)
        return outs

    # ----------------------------------------------------------------- admission
    def _admit(self) -> None:
        new = []
        while self.waiting and len(self.running) + len(new) < self.max_batch:
            new.append(self.waiting.popleft())
        if not new:
            return
        t0 = time.perf_counter()
        ids = [r.req_id for r in new]
        hidden = self.runner.prefill(ids, [0] * len(new), [r.prompt[:-1] for r in new])
        for r, h in zip(new, hidden):
            r.target_len = len(r.prompt) - 1
            if self.draft_runner is not None and self.draft_runner.eagle:
                # the head sees (x_j, feature h_{j-1}) at position j, j = 1..P-1
                r.pending, r.pending_feats, r.draft_len = r.prompt[1:], h, 1
            else:
                r.pending, r.draft_len = list(r.prompt), 0
        self.running.extend(new)
        self.timings["prefill"] += time.perf_counter() - t0

    def _release(self, req: Request) -> None:
        if self.ngram_history.max_tokens and req.finish_reason in ("stop", "length"):
            self.ngram_history.add(req.prompt + req.output)  # no copy when history is off
        if req in self.running:
            self.running.remove(req)
        self.runner.cache.free(req.req_id)
        if self.draft_runner is not None:
            self.draft_runner.cache.free(req.req_id)

    # ----------------------------------------------------------------- drafting
    def _propose(self, batch: list[Request]) -> list[Proposal]:
        if isinstance(self.policy, NoDraftPolicy):
            return [Proposal(_ROOT_ONLY, [r.root]) for r in batch]
        if isinstance(self.policy, NgramPolicy):
            hist = self.ngram_history
            return [Proposal(*ngram_trie(r.prompt + r.output, self.policy, hist)) for r in batch]
        eagle = self.draft_runner.eagle
        reqs = []
        for r in batch:
            can = not eagle or bool(r.pending)  # an EAGLE head needs the root's feature
            expansion = expansion_for(
                self.policy,
                r.root,
                context=r.prompt + r.output if isinstance(self.policy, HybridPolicy) else None,
                sample_temperature=r.params.temperature if r.sampled_drafts else None,
                generator=r.generator,
            )
            trunk, feats = (
                (r.pending, r.pending_feats if eagle else None) if can else ([r.root], None)
            )
            reqs.append(DraftRequest(r.req_id, trunk, r.draft_len, expansion, feats, can))
        proposals = grow_trees(reqs, self._draft_forward)
        for r, d in zip(batch, reqs):  # what the draft consumed is in its cache
            done = d.prefix - r.draft_len
            r.draft_len = d.prefix
            r.pending = r.pending[done:]
            if eagle and r.pending_feats is not None:
                r.pending_feats = r.pending_feats[done:]
        return proposals

    def _draft_forward(self, b: DraftBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The draft runner as ``tree_dev.step.DraftForward``."""
        dr = self.draft_runner
        if b.want is None:  # a catch-up chunk: every node of a chain
            dr.forward(b.keys, b.prefixes, b.trees, None, b.tokens, b.feats, want_logits=False)
            return None, None
        rows, offset = [], 0  # logits only at the wanted rows
        for nodes, w in zip(b.new_nodes, b.want):
            where = {n: k for k, n in enumerate(nodes)}
            rows += [offset + where[n] for n in w]
            offset += len(nodes)
        hidden, logits = dr.forward(
            b.keys, b.prefixes, b.trees, b.new_nodes, b.tokens, b.feats, logit_rows=rows
        )
        self.forwards["draft"] += 1
        return torch.log_softmax(logits.float(), dim=-1), hidden[rows]

    # ----------------------------------------------------------------- acceptance
    def _accept(
        self,
        batch: list[Request],
        proposals: list[Proposal],
        hidden: torch.Tensor,
        logits: torch.Tensor,
        paths: dict[int, tuple[list[int], list[int]]] | None,
    ) -> list[StepOutput]:
        """Walk every tree, compact the KV of the accepted paths, commit the tokens; fills
        ``paths[req_id] = (accepted node ids, emitted tokens)`` unless ``paths`` is None."""
        sizes = [p.tree.num_nodes for p in proposals]
        # the one walk check the engine can't rule out; a finite sum means every logit is
        # finite (an inf or NaN makes it inf or NaN), the full check only when it is not
        if not bool(torch.isfinite(logits.sum())) and not bool(torch.isfinite(logits).all()):
            bad = [r.req_id for r, x in zip(batch, logits.split(sizes)) if not x.isfinite().all()]
            raise RuntimeError(f"target produced non-finite logits for requests {bad}")
        if all(n == 1 for n in sizes):
            return self._accept_roots(batch, hidden, logits, paths)
        dev = logits.device
        res = walk_trees(
            logits.split(sizes),
            proposals,
            [r.mode for r in batch],
            [r.params.temperature for r in batch],
            [r.params.top_p for r in batch],
            [r.generator for r in batch],
            lambda trees: _walk_batch(trees, dev),
            self.kernel_backend,
        )
        self._compact(batch, res.accepted)
        hidden_rows = hidden.split(sizes)
        outs = []
        for i, r in enumerate(batch):
            nodes, emitted = res.accepted[i], res.emitted[i]
            if paths is not None:
                paths[r.req_id] = (list(nodes), list(emitted))
            r.depth.record(proposals[i].tree.max_depth, len(nodes) - 1)
            r.target_len += len(nodes)
            if self.draft_runner is not None:
                r.pending = r.pending + emitted
                if self.draft_runner.eagle:
                    f = hidden_rows[i][torch.tensor(nodes, device=hidden.device)]
                    old = r.pending_feats
                    r.pending_feats = f if old is None or not len(old) else torch.cat([old, f])
            new = self._commit(r, emitted)
            outs.append(StepOutput(r.req_id, new, r.finished, r.finish_reason))
        for r in [r for r in batch if r.finished]:
            self._release(r)
        return outs

    def _compact(self, batch: list[Request], accepted: list[list[int]]) -> None:
        """Move every accepted path's K/V to slots ``target_len + j`` (``kernels.kv_compact``);
        nothing to move when every path is nodes ``0..n-1`` (a chain's accepted prefix)."""
        if all(nodes == list(range(len(nodes))) for nodes in accepted):
            return
        dev = self.runner.device
        width = max(len(nodes) for nodes in accepted)
        acc_nodes = torch.zeros(len(batch), width, dtype=torch.int64)
        for i, nodes in enumerate(accepted):
            acc_nodes[i, : len(nodes)] = torch.tensor(nodes, dtype=torch.int64)
        kernels.kv_compact(
            self.runner.cache.k,
            self.runner.cache.v,
            torch.tensor([r.target_len for r in batch], device=dev),
            acc_nodes.to(dev),
            torch.tensor([len(nodes) for nodes in accepted], device=dev),
            self.runner.cache.block_table([r.req_id for r in batch]),
            backend=self.kernel_backend,
            check_inputs=False,
        )

    def _accept_roots(
        self,
        batch: list[Request],
        hidden: torch.Tensor,
        logits: torch.Tensor,
        paths: dict[int, tuple[list[int], list[int]]] | None,
    ) -> list[StepOutput]:
        """``_accept`` when every tree is its root alone (a plain decode step): the next
        token is the root's bonus token, nothing to walk or compact."""
        outs = []
        for i, (r, t) in enumerate(zip(batch, self._sample_roots(batch, logits).tolist())):
            if paths is not None:
                paths[r.req_id] = ([0], [t])
            r.depth.record(0, 0)
            r.target_len += 1
            if self.draft_runner is not None:
                r.pending = r.pending + [t]
                if self.draft_runner.eagle:
                    f, old = hidden[i : i + 1], r.pending_feats
                    r.pending_feats = f if old is None or not len(old) else torch.cat([old, f])
            new = self._commit(r, [t])
            outs.append(StepOutput(r.req_id, new, r.finished, r.finish_reason))
        for r in [r for r in batch if r.finished]:
            self._release(r)
        return outs

    def _sample_roots(self, batch: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """The next token of every request from its root's logits ``[B, V]``: the
        argmax, or a draw by the walk's own rule (``uniforms [1, 2]`` per request from
        its generator, inverse CDF of the tempered top-p target distribution at
        ``u[0, 1]``), so a root-only tree emits exactly what ``tree_walk`` would."""
        out = torch.empty(len(batch), dtype=torch.int64)
        greedy = [i for i, r in enumerate(batch) if r.mode == "greedy"]
        if greedy:
            out[greedy] = logits[greedy].argmax(-1).cpu()
        rest = [i for i in range(len(batch)) if batch[i].mode != "greedy"]
        if rest:
            u = torch.cat([torch.rand(1, 2, generator=batch[i].generator) for i in rest])
            p = target_probs(
                logits[rest].float().cpu(),
                torch.arange(len(rest)),
                torch.tensor([batch[i].params.temperature for i in rest]),
                1.0
                if all(batch[i].params.top_p >= 1 for i in rest)
                else torch.tensor([batch[i].params.top_p for i in rest]),
            )
            out[rest] = sample_inverse_cdf(p, u[:, 1])
        return out

    def _commit(self, req: Request, emitted: list[int]) -> list[int]:
        """Append tokens up to the first stop condition; returns what was appended."""
        new = []
        for t in emitted:
            new.append(t)
            req.output.append(t)
            if t in req.params.stop_token_ids or (t in self.eos_ids and not req.params.ignore_eos):
                req.finished, req.finish_reason = True, "stop"
                break
            if len(req.output) >= req.params.max_tokens:
                req.finished, req.finish_reason = True, "length"
                break
            if len(req.prompt) + len(req.output) >= self.max_model_len:
                req.finished, req.finish_reason = True, "length"
                break
        return new
