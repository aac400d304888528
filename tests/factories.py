"""Test factories, one definition each (in ``tree_dev.testing``, shared with the benchmarks).

from tests.factories import BACKENDS, random_tree, tiny_llama, tiny_llama_config
"""

from __future__ import annotations

from tree_dev.testing import (
    KERNEL_BACKENDS,
    hf_greedy,
    perturbed,
    random_tree,
    tiny_llama,
    tiny_llama_config,
)

BACKENDS = list(KERNEL_BACKENDS)  # every kernel test runs these against kernels.reference

__all__ = [
    "BACKENDS",
    "hf_greedy",
    "perturbed",
    "random_tree",
    "tiny_llama",
    "tiny_llama_config",
]
