"""Test factories, one definition each (the benchmarks share them through ``bench.common``).

from tests.factories import BACKENDS, random_tree, tiny_llama, tiny_llama_config
"""

from __future__ import annotations

from bench.common import (
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
