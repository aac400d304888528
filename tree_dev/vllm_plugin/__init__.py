"""Tree speculative decoding inside vLLM 0.32 (the "top-K proposer patch"), as a plugin.

Loaded by vLLM through the ``vllm.general_plugins`` entry point ``treespec_tree`` in every
process (main, engine core, workers). It changes nothing unless the engine's
``additional_config`` carries a ``"treespec"`` dict with a ``"tree"`` spec.
"""

from __future__ import annotations


def register() -> None:
    """vLLM plugin entry point: install the tree hooks (idempotent, inert without config)."""
    from tree_dev.vllm_plugin import hooks
    from tree_dev.vllm_plugin.eagle_model import register_eagle_model

    hooks.install()
    register_eagle_model()
