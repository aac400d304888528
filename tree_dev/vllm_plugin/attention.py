"""Tree attention inside vLLM: an override of the platform's attention backend.

On the CPU, vLLM's ``CPU_ATTN`` kernel knows causal masks only. The override (registered
with ``vllm.v1.attention.backends.registry.register_backend`` for ``CPU_ATTN``, see
``hooks``) keeps vLLM's kernel for every row it gets right and recomputes the rows of
token trees with ``kernels.tree_attention``:

- **verify forward** (the target scores every request's tree): the runner puts the
  batch's ``TreeRows`` in vLLM's ``ForwardContext.additional_kwargs`` (``VERIFY_ROWS``)
  for that forward only (``publish_verify_rows``); the layer lets vLLM write K/V and
  run its causal kernel, then overwrites the tree requests' rows with tree attention over
  the request's prefix and the node's ancestors (K/V read back from vLLM's cache through
  the measured ``KVLayout``).
- **draft forwards** (one per tree level): the drafter passes a ``TreeAttentionMetadata``
  instead of vLLM's metadata; every row is a tree row, vLLM's kernel is not called.

Without an active tree the override is vLLM's own implementation, unchanged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

import kernels
from tree_dev.tree import TokenTree, TreeBatch
from tree_dev.vllm_plugin.kv_layout import KVLayout, contiguous_kv


@dataclass
class TreeRows:
    """Trees among the rows of one forward pass.

    Attributes:
        batch: ``TreeBatch`` of the trees (one per listed request).
        req_rows: per tree, the batch row (request index) in vLLM's attention metadata, or
            None when ``block_table`` is given here (draft forwards).
        row_index: ``int64[T]`` token rows of the forward that hold the trees' nodes, in
            ``batch.cu_nodes`` order; for draft forwards the rows being computed.
        prefix_lens: ``int64[B]`` tokens cached before each tree.
        query_nodes: ``int64[T_q]`` tree-batch node of each computed row (None: all nodes).
        block_table: ``int[B, max_blocks]`` (draft forwards; verify uses vLLM's).
    """

    batch: TreeBatch
    row_index: torch.Tensor
    prefix_lens: torch.Tensor
    req_rows: torch.Tensor | None = None
    query_nodes: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    kv_lens: list[int] = field(default_factory=list)
    backend: str = "torch"  # the ``kernels`` backend of tree attention
    seconds: float = 0.0  # spent in ``tree_attend`` over this forward's layers
    _tables: dict = field(default_factory=dict, repr=False)

    @property
    def row_slice(self) -> slice | None:
        """``row_index`` as a slice when it is one run of consecutive rows (else None)."""
        if "slice" not in self._tables:
            idx = self.row_index
            n = idx.numel()
            first = int(idx[0]) if n else 0
            run = n > 0 and int(idx[-1]) == first + n - 1 and bool((idx.diff() == 1).all())
            self._tables["slice"] = slice(first, first + n) if run else None
        return self._tables["slice"]

    def verify_table(self, attn_metadata) -> torch.Tensor:
        """The trees' rows of vLLM's block table (selected once per forward, not per layer)."""
        bt = attn_metadata.block_table
        key = (bt.data_ptr(), tuple(bt.shape))
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = bt[self.req_rows.to(bt.device)]
        return table


@dataclass
class TreeAttentionMetadata:
    """Attention metadata of a draft forward: all rows are tree rows."""

    rows: TreeRows
    num_actual_tokens: int


def verify_tree_rows(
    trees: list[TokenTree],
    first_rows: list[int],
    prefix_lens: list[int],
    req_rows: list[int],
    backend: str,
) -> TreeRows:
    """The ``TreeRows`` of a verify forward: tree ``b``'s nodes are the consecutive query
    rows from ``first_rows[b]``, its request's row in vLLM's metadata is ``req_rows[b]``,
    ``prefix_lens[b]`` tokens are cached before its root."""
    rows = torch.cat(
        [torch.arange(s, s + t.num_nodes, dtype=torch.int64) for s, t in zip(first_rows, trees)]
    )
    return TreeRows(
        batch=tree_batch(tuple(trees)),
        row_index=rows,
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64),
        req_rows=torch.tensor(req_rows, dtype=torch.int64),
        kv_lens=[p + t.num_nodes for p, t in zip(prefix_lens, trees)],
        backend=backend,
    )


VERIFY_ROWS = "treespec_verify_rows"  # key of the verify forward's TreeRows


def publish_verify_rows(rows: TreeRows | None) -> None:
    """Make ``rows`` the tree rows of the forward in flight: stored in vLLM's
    ``ForwardContext.additional_kwargs``, which lives exactly as long as that forward, so
    no other forward (a draft level, a dummy run) can see them. Call inside the forward
    context (``hooks`` does, around ``GPUModelRunner._model_forward``)."""
    if rows is not None:
        from vllm.forward_context import get_forward_context

        get_forward_context().additional_kwargs[VERIFY_ROWS] = rows


def verify_rows() -> TreeRows | None:
    """The tree rows of the verify forward in flight (None: not a tree forward)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    return get_forward_context().additional_kwargs.get(VERIFY_ROWS)


@lru_cache(maxsize=2048)
def tree_batch(trees: tuple[TokenTree, ...]) -> TreeBatch:
    """A ``TreeBatch`` per distinct tuple of shapes: its masks are packed once."""
    return TreeBatch(list(trees))


_LAYOUTS: dict[tuple, KVLayout] = {}


def layout_for(impl, layer, kv_cache: torch.Tensor) -> KVLayout:
    """The measured ``KVLayout`` of this cache (cached per geometry, dtype and ISA)."""
    key = (
        type(impl),
        kv_cache.dtype,
        tuple(kv_cache.shape[1:]),
        getattr(layer, "isa", None),
        getattr(impl, "kv_cache_dtype", None),
    )
    lay = _LAYOUTS.get(key)
    if lay is None:
        lay = _LAYOUTS[key] = KVLayout.discover(impl, layer, kv_cache)
    return lay


def tree_attend(
    impl, layer, query: torch.Tensor, kv_cache: torch.Tensor, rows: TreeRows, block_table
) -> torch.Tensor:
    """Tree attention of ``rows`` (``query [T_rows, Hq, D]``) -> ``[T_rows, Hq, D]``."""
    t0 = time.perf_counter()
    cached = getattr(layer, "_treespec_kv", None)
    if cached is None or cached[0] != kv_cache.data_ptr():
        lay = layout_for(impl, layer, kv_cache)
        cached = (kv_cache.data_ptr(), lay, lay.paged_views(kv_cache))
        layer._treespec_kv = cached
    _, lay, views = cached
    if views is not None and len(rows.kv_lens) == 1:  # in place, through the block table
        k, v = views
        table = block_table
    else:  # several requests (their blocks scattered), or a placement that is not affine
        # (e.g. AMX bf16 pairs): gather each request's blocks into one contiguous tensor
        k, v = contiguous_kv(lay, kv_cache, block_table, rows.kv_lens)
        table = None
    q = query
    if rows.query_nodes is not None:
        full = q.new_zeros(rows.batch.total_nodes, q.shape[1], q.shape[2])
        full[rows.query_nodes] = q
        q = full
    out = kernels.tree_attention(
        q.contiguous(),
        k.to(q.dtype),
        v.to(q.dtype),
        rows.batch,
        rows.prefix_lens,
        table,
        scale=impl.scale,
        backend=rows.backend,
        check_inputs=False,
    )
    if rows.query_nodes is not None:
        out = out[rows.query_nodes]
    rows.seconds += time.perf_counter() - t0
    return out


class TreeRowsMixin:
    """Tree rows on top of any vLLM attention implementation whose cache has the block
    dimension first (``CPU_ATTN``; ``TRITON_ATTN`` on CUDA).

    The base implementation's ``forward`` runs first (it is right for every row that is
    not a tree row); the tree rows are then recomputed and overwritten. Draft forwards
    (``TreeAttentionMetadata``) never reach the base kernel; nor do verify forwards
    whose rows are all tree rows, where the base writes the KV cache in an op of its
    own (``skip_base_for_tree_rows``).
    """

    skip_base_for_tree_rows = False

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hq, d = self.num_heads, self.head_size
        if isinstance(attn_metadata, TreeAttentionMetadata):  # draft forward: all tree rows
            rows = attn_metadata.rows
            n = attn_metadata.num_actual_tokens
            q = query[:n].view(n, hq, d)
            out = tree_attend(self, layer, q, kv_cache, rows, rows.block_table)
            output[:n] = out.reshape(output[:n].shape).to(output.dtype)
            return output
        rows = verify_rows()
        if (
            rows is None
            or attn_metadata is None
            or not self.skip_base_for_tree_rows
            or rows.row_index.numel() != attn_metadata.num_actual_tokens
        ):  # vLLM's kernel is right for the rows that are not tree rows
            super().forward(
                layer,
                query,
                key,
                value,
                kv_cache,
                attn_metadata,
                output,
                output_scale=output_scale,
                output_block_scale=output_block_scale,
            )
        if rows is None or attn_metadata is None:
            return output
        sel = rows.row_slice if rows.row_slice is not None else rows.row_index
        q = query.view(query.shape[0], hq, d)[sel]
        out = tree_attend(self, layer, q, kv_cache, rows, rows.verify_table(attn_metadata))
        out_view = output.view(output.shape[0], hq, d)
        if rows.row_slice is None:
            sel = sel.to(output.device)
        out_view[sel] = out.to(output.dtype)
        return output


class TreeCPUAttentionImpl(TreeRowsMixin, CPUAttentionBackendImpl):
    """vLLM's CPU attention, with tree rows recomputed by ``kernels.tree_attention``.

    vLLM 0.32's CPU decoder attention writes K/V in ``do_kv_cache_update``, not in
    ``forward``: a forward of tree rows only can skip the causal kernel."""

    skip_base_for_tree_rows = True


class TreeCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with tree rows; registered as its override by the plugin."""

    @staticmethod
    def get_impl_cls() -> type[TreeCPUAttentionImpl]:
        return TreeCPUAttentionImpl


def triton_backend() -> type:
    """``TRITON_ATTN`` with tree rows (CUDA; tree rows through the Triton tree kernel).

    Built on first use: vLLM's Triton backend module imports CUDA-only pieces. Written
    against vLLM 0.32's ``TritonAttentionImpl``; not yet run on a GPU.
    """
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

    class TreeTritonAttentionImpl(TreeRowsMixin, TritonAttentionImpl):
        pass

    class TreeTritonAttentionBackend(TritonAttentionBackend):
        @staticmethod
        def get_impl_cls() -> type:
            return TreeTritonAttentionImpl

    return TreeTritonAttentionBackend


def __getattr__(name: str):
    if name == "TreeTritonAttentionBackend":  # the class path register_backend imports
        return triton_backend()
    raise AttributeError(name)
