"""The local engine's set-up: its models loaded and checked against the tree, the paged KV
caches' size, the target's and the drafter's runners, and the linear layers' CPU routes.

``Engine.__init__`` (``tree_dev.engine``) calls these in order; each raises the
``ValueError`` a wrong argument deserves before anything is built.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedModel

import kernels
from tree_dev.attention import register
from tree_dev.model_runner import PREFILL_CHUNK, Runner, _attn_geometry, load_causal_lm
from tree_dev.narrow_linear import narrow_available, use_narrow_linears
from tree_dev.onednn_linear import onednn_faster, use_onednn_linears
from tree_dev.spec import AutoTreePolicy, NgramPolicy, NoDraftPolicy, Policy

__all__ = [
    "cache_blocks",
    "check_kernel_limit",
    "draft_runner",
    "drafter_models",
    "eos_token_ids",
    "load_models",
    "switch_linears",
    "target_runner",
]


def load_models(
    target: PreTrainedModel | str | Path, draft: PreTrainedModel | str | Path | None
) -> tuple[PreTrainedModel, PreTrainedModel | None]:
    """``(target, draft)`` with every path loaded (``load_causal_lm``; the draft in the
    target's dtype); models pass through as given."""
    if isinstance(target, (str, Path)):
        target = load_causal_lm(target)
    if isinstance(draft, (str, Path)):
        draft = load_causal_lm(draft, dtype=next(target.parameters()).dtype)
    return target, draft


def drafter_models(
    policy: Policy,
    target: PreTrainedModel,
    draft: PreTrainedModel | None,
    eagle: torch.nn.Module | None,
    tree: str,
) -> tuple[PreTrainedModel | None, torch.nn.Module | None]:
    """``(draft, eagle)`` the engine runs: both None where the tree needs no draft
    (plain decoding, n-gram tries); ValueError for a missing, doubled or mismatched
    draft."""
    if draft is not None and eagle is not None:
        raise ValueError("give either a draft model or an EAGLE head, not both")
    if isinstance(policy, AutoTreePolicy):
        uses_draft = policy.needs_model
    else:
        uses_draft = not isinstance(policy, (NoDraftPolicy, NgramPolicy))
    if uses_draft and draft is None and eagle is None:
        raise ValueError(f"tree {tree!r} needs a draft model or an EAGLE head")
    if not uses_draft:  # plain decoding and n-gram tries run no draft
        return None, None
    vocab = target.config.vocab_size
    drafter = draft if draft is not None else eagle
    if drafter.config.vocab_size != vocab:
        raise ValueError(
            f"draft vocabulary ({drafter.config.vocab_size}) differs from the target's ({vocab})"
        )
    return draft, eagle


def check_kernel_limit(
    policy: Policy, target: PreTrainedModel, kernel_backend: str, tree: str
) -> None:
    """ValueError where the tree can grow more nodes than the tree-attention kernel of
    ``kernel_backend`` (on the target's device) takes."""
    dev = next(target.parameters()).device
    attn_fn = kernels._resolve("tree_attention", kernel_backend, dev)
    limit = getattr(attn_fn, "max_tree_nodes", None)
    if limit is not None and policy.max_nodes > limit:
        raise ValueError(
            f"tree {tree!r} has up to {policy.max_nodes} nodes; kernel backend "
            f"{kernel_backend!r} supports at most {limit}"
        )


def eos_token_ids(config: PretrainedConfig, eos_token_id: int | None) -> set[int]:
    """The token ids that stop a request (unless ``ignore_eos``): ``eos_token_id``, else
    the model config's (one id, a list of them, or none)."""
    eos = config.eos_token_id if eos_token_id is None else eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])


def cache_blocks(max_batch: int, max_model_len: int, max_nodes: int, block_size: int) -> int:
    """KV blocks of each model's paged cache: every running request's longest context, its
    largest tree and a prefill chunk of slack, rounded up to whole blocks."""
    return max_batch * -(-(max_model_len + max_nodes + PREFILL_CHUNK) // block_size)


def target_runner(
    target: PreTrainedModel, blocks: int, block_size: int, kernel_backend: str, tree_kernel: bool
) -> Runner:
    """The target's runner; registers the ``"treespec"`` attention and switches the target
    (in eval mode) to it."""
    register()
    target.eval()
    target.set_attn_implementation("treespec")
    return Runner(
        target,
        *_attn_geometry(target.config),
        blocks,
        block_size,
        kernel_backend,
        tree_kernel=tree_kernel,
    )


def draft_runner(
    draft: PreTrainedModel | None,
    eagle: torch.nn.Module | None,
    blocks: int,
    block_size: int,
    kernel_backend: str,
) -> Runner | None:
    """The draft LM's or EAGLE head's runner (None without one), its attention switched to
    ``"treespec"``."""
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
        kernel_backend,
        eagle=eagle is not None,
    )


def switch_linears(
    models: Iterable[torch.nn.Module | None], onednn_linear: bool | None, narrow_linear: bool | None
) -> None:
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
