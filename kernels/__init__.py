"""treespec kernels: one public function per op, several backends each.

Backends: ``"reference"`` (dense torch oracle), ``"torch"`` (fast CPU path),
``"triton"`` (GPU; CPU through the Triton interpreter), ``"nki"`` (Trainium;
CPU through the project's NumPy NKI executor) and ``"auto"`` (triton on CUDA
tensors, nki on a Neuron device, torch otherwise).

A backend is a package (``kernels.reference``, ``kernels.torchops``,
``kernels.triton``, ``kernels.nki``) exposing a function per op with the
reference signature. Inputs are validated once here (``kernels.checks``)
before any backend runs.
"""

from __future__ import annotations

import importlib
import os
import types
from collections.abc import Callable
from typing import Any

import torch

from kernels import checks
from kernels.reference import WalkResult

__all__ = [
    "BACKENDS",
    "WalkResult",
    "backend_status",
    "kv_compact",
    "tree_attention",
    "tree_walk",
]

BACKENDS: dict[str, str] = {
    "reference": "kernels.reference",
    "torch": "kernels.torchops",
    "triton": "kernels.triton",
    "nki": "kernels.nki",
}
OPS = ("tree_attention", "tree_walk", "kv_compact")


def backend_status(name: str) -> tuple[bool, str]:
    """``(available, note)`` for a backend: whether it imports, and how it runs here."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(BACKENDS)} or 'auto'")
    try:
        module = importlib.import_module(BACKENDS[name])
    except ImportError as exc:
        return False, f"not importable: {exc}"
    note = getattr(module, "BACKEND_NOTE", "")
    if callable(note):
        note = note()
    if name == "triton" and not torch.cuda.is_available():
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        note = note or (
            "no CUDA device, running on the Triton interpreter"
            if interp
            else "no CUDA device and TRITON_INTERPRET is not 1"
        )
    return True, note


def _resolve(op: str, backend: str, device: torch.device) -> Callable[..., Any]:
    if backend == "auto":
        if device.type == "cuda":
            backend = "triton"
        elif device.type in ("xla", "neuron", "privateuseone"):
            backend = "nki"
        else:
            backend = "torch"
    if backend not in BACKENDS:
        raise ValueError(
            f"unknown backend {backend!r}; expected one of {sorted(BACKENDS)} or 'auto'"
        )
    try:
        module = importlib.import_module(BACKENDS[backend])
    except ImportError as exc:
        raise ValueError(f"backend {backend!r} is not available here: {exc}") from exc
    try:
        fn = getattr(module, op)
        if isinstance(fn, types.ModuleType):  # once imported, the submodule shadows the op
            fn = getattr(fn, op)
        return fn
    except (AttributeError, ImportError) as exc:
        raise ValueError(f"backend {backend!r} has no usable {op} op: {exc!r}") from exc


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tree: Any,
    prefix_lens: torch.Tensor,
    block_table: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    check_inputs: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Tree attention: every tree node attends to its prefix and its ancestors.

    Args:
        q: ``[T, Hq, D]`` queries of the ``T`` tree nodes of all requests, in
            ``tree.cu_nodes`` order; fp32, fp16 or bf16.
        k_cache, v_cache: vLLM paged layout ``[num_blocks, block_size, Hkv, D]``
            with ``block_table``, or contiguous ``[B, S, Hkv, D]``. Request b's
            prefix is at positions ``0..prefix_lens[b]-1``, its tree nodes' K/V
            right after, in node order. Same dtype as q; ``Hq % Hkv == 0`` (GQA).
        tree: ``tree_dev.tree.TreeBatch`` on q's device.
        prefix_lens: ``int[B]`` tokens before each tree (0 allowed).
        block_table: ``int32/int64 [B, max_blocks]``, or None for contiguous KV.
        scale: softmax scale, default ``1/sqrt(D)``.
        return_lse: also return ``lse [T, Hq]`` fp32 (natural log).
        backend: ``"reference" | "torch" | "triton" | "nki" | "auto"``.
        check_inputs: validate shapes/dtypes/devices first (reads a few small
            tensors on the host); engines that already did can skip it.

    Returns:
        ``out [T, Hq, D]`` in q's dtype (and ``lse`` if asked).
    """
    fn = _resolve("tree_attention", backend, q.device)
    if check_inputs:
        checks.check_tree_attention(
            q,
            k_cache,
            v_cache,
            tree,
            prefix_lens,
            block_table,
            max_tree_nodes=getattr(fn, "max_tree_nodes", None),
        )
    return fn(
        q, k_cache, v_cache, tree, prefix_lens, block_table, scale=scale, return_lse=return_lse
    )


def tree_walk(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tree: Any,
    mode: str = "greedy",
    *,
    uniforms: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    top_p: float | torch.Tensor = 1.0,
    generator: torch.Generator | None = None,
    backend: str = "auto",
    check_inputs: bool = True,
) -> WalkResult:
    """Accepted path and bonus token of every request (see ``reference.tree_walk``).

    Args:
        logits: ``[T, V]`` target logits at every tree node.
        tokens: ``int64[T]`` draft token of each node (root entry ignored).
        tree: ``TreeBatch``.
        mode: ``"greedy"``, ``"target_only"`` or ``"draft_probs"``.
        uniforms: ``[T, 2]`` uniforms in [0, 1) (acceptance test, bonus draw per
            node); drawn from ``generator`` when None in stochastic modes.
        draft_probs: ``[T, V]`` draft distributions (``draft_probs`` mode).
        temperature, top_p: scalars or ``[B]`` tensors.

    Returns:
        ``WalkResult(accepted_len [B], accepted_nodes [B, D+1], output_tokens [B, D+1])``,
        int64, -1 padded.
    """
    fn = _resolve("tree_walk", backend, logits.device)
    if uniforms is None and mode != "greedy":
        uniforms = torch.rand(
            logits.shape[0], 2, generator=generator, device=logits.device, dtype=torch.float32
        )
    if check_inputs:
        checks.check_tree_walk(
            logits, tokens, tree, mode, uniforms, draft_probs, temperature, top_p
        )
        limit = getattr(fn, "max_tree_nodes", None)
        if limit is not None and tree.max_nodes > limit:
            raise ValueError(
                f"a tree has {tree.max_nodes} nodes; the {backend!r} tree_walk supports at most "
                f"{limit}"
            )
    return fn(
        logits,
        tokens,
        tree,
        mode,
        uniforms=uniforms,
        draft_probs=draft_probs,
        temperature=temperature,
        top_p=top_p,
    )


def kv_compact(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    accepted_len: torch.Tensor,
    block_table: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    check_inputs: bool = True,
) -> torch.Tensor:
    """Move accepted nodes' K/V right after each prefix, in place.

    Args:
        k_cache, v_cache: paged ``[num_blocks, block_size, H, D]`` or contiguous
            ``[B, S, H, D]``, optionally with a leading layer dim (all layers at once).
        prefix_lens: ``int[B]``.
        accepted_nodes, accepted_len: ``tree_walk`` outputs.
        block_table: ``int[B, max_blocks]`` or None (contiguous).

    Returns:
        ``int64[B]`` new KV lengths, ``prefix_lens + accepted_len``.
    """
    fn = _resolve("kv_compact", backend, k_cache.device)
    if check_inputs:
        checks.check_kv_compact(
            k_cache, v_cache, prefix_lens, accepted_nodes, accepted_len, block_table
        )
    return fn(k_cache, v_cache, prefix_lens, accepted_nodes, accepted_len, block_table)
