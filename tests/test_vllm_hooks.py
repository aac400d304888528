"""The plugin's vLLM touch points (``tree_dev.vllm_plugin.hooks.CATALOGUE``): every target
resolves in the installed vLLM, ``install`` puts every hook in place, and a target a vLLM
rename removed is refused by name with nothing installed (no engine needed)."""

from __future__ import annotations

import logging
import os
import sys
import types

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup installs it)")

from tree_dev.vllm_plugin import hooks  # noqa: E402


def test_every_catalogued_target_resolves_in_this_vllm():
    assert hooks.missing_targets(hooks.CATALOGUE) == []
    assert {p.how for p in hooks.CATALOGUE} <= {"wrap", "property", "use"}
    assert all(p.why for p in hooks.CATALOGUE)


WORKER_METHODS = (
    "treespec_tree_stats",
    "treespec_recorded_trees",
    "treespec_set_debug",
    "treespec_set_tree",
    "treespec_record_steps",
    "treespec_recorded_steps",
)


def test_install_puts_every_hook_in_place():
    from vllm.v1.worker.worker_base import WorkerBase

    hooks.install()
    not_in_place = [p.target for p in hooks.CATALOGUE if not hooks.installed(p)]
    assert not_in_place == []
    # the worker methods come as vLLM's worker extension: vLLM's classes are not changed
    assert not any(hasattr(WorkerBase, name) for name in WORKER_METHODS)


def test_an_engine_with_a_tree_gets_the_worker_extension_and_keeps_the_users(monkeypatch):
    """``VllmConfig``'s check sets ``parallel_config.worker_extension_cls`` for an engine
    with a tree (and only then); vLLM resolves it to a class with every ``treespec_*``
    method, combined with the user's own extension when there is one."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm_engines import DRAFT, TARGET

    from tree_dev.vllm_plugin.worker_methods import EXTENSION

    module = types.ModuleType("fake_extension_for_tests")

    class UserExtension:
        def my_call(self) -> str:
            return "mine"

    module.UserExtension = UserExtension
    monkeypatch.setitem(sys.modules, "fake_extension_for_tests", module)
    load_general_plugins()

    def extension(tree: str | None, **kw) -> str:
        sc = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4}
        extra = {"additional_config": {"treespec": {"tree": tree}}} if tree else {}
        args = EngineArgs(model=TARGET, max_model_len=512, speculative_config=sc, **extra, **kw)
        return args.create_engine_config().parallel_config.worker_extension_cls

    assert extension(None) == ""  # no tree: vLLM's config untouched
    assert extension("chain:4") == EXTENSION
    ext = resolve_obj_by_qualname(EXTENSION)
    assert all(callable(getattr(ext, name)) for name in WORKER_METHODS)
    combined = resolve_obj_by_qualname(
        extension("chain:4", worker_extension_cls="fake_extension_for_tests.UserExtension")
    )
    assert issubclass(combined, UserExtension) and issubclass(combined, ext)
    assert combined().my_call() == "mine"
    with pytest.raises(ValueError, match="my__pkg.Ext"):
        extension("chain:4", worker_extension_cls="my__pkg.Ext")


@pytest.fixture
def fake_vllm(monkeypatch):
    """A module ``fake_vllm_for_tests`` with one class to patch."""
    module = types.ModuleType("fake_vllm_for_tests")

    class Runner:
        def step(self) -> str:
            return "vllm"

        @property
        def slots(self) -> int:
            return 1

    module.Runner = Runner
    monkeypatch.setitem(sys.modules, "fake_vllm_for_tests", module)
    return module


def _tagged(orig):
    def step(self):
        return "tree+" + orig(self)

    return step


def test_apply_wraps_once(fake_vllm):
    catalogue = (
        hooks.Patch("fake_vllm_for_tests:Runner.step", "why", "wrap", _tagged),
        hooks.Patch("fake_vllm_for_tests:Runner.slots", "why", "property", lambda f: f),
    )
    hooks.apply(catalogue)
    hooks.apply(catalogue)  # idempotent: not wrapped twice
    assert fake_vllm.Runner().step() == "tree+vllm"
    assert all(hooks.installed(p) for p in catalogue)


def test_a_missing_target_is_refused_by_name_and_nothing_is_installed(fake_vllm):
    catalogue = (
        hooks.Patch("fake_vllm_for_tests:Runner.step", "why", "wrap", _tagged),
        hooks.Patch("fake_vllm_for_tests:Runner.renamed_in_a_new_vllm", "why", "wrap", _tagged),
        hooks.Patch("fake_vllm_for_tests:Gone.step", "why", "wrap", _tagged),
        hooks.Patch("no_such_vllm_module:X.y", "why", "use"),
    )
    with pytest.raises(RuntimeError) as err:
        hooks.apply(catalogue)
    msg = str(err.value)
    for name in ("renamed_in_a_new_vllm", "Gone", "no_such_vllm_module", hooks.WRITTEN_FOR):
        assert name in msg
    assert "Runner.step:" not in msg  # the target that resolves is not named
    assert fake_vllm.Runner().step() == "vllm"  # all or nothing: the good one untouched
    assert not hooks.installed(catalogue[0])


def test_an_optional_target_may_be_absent(fake_vllm):
    catalogue = (
        hooks.Patch("fake_vllm_for_tests:Runner.step", "why", "wrap", _tagged),
        hooks.Patch("fake_vllm_for_tests:CpuOnly.step", "why", "wrap", _tagged, required=False),
    )
    hooks.apply(catalogue)
    assert fake_vllm.Runner().step() == "tree+vllm"


def test_another_vllm_version_is_warned_about(monkeypatch, caplog):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.99.1")
    with caplog.at_level(logging.WARNING, logger="treespec"):
        hooks._check_version()
    assert "0.99.1" in caplog.text and hooks.WRITTEN_FOR in caplog.text
    caplog.clear()
    monkeypatch.setattr(vllm, "__version__", f"{hooks.WRITTEN_FOR}.0")
    with caplog.at_level(logging.WARNING, logger="treespec"):
        hooks._check_version()
    assert caplog.text == ""


def test_the_catalogue_cli_exits_0_here(capsys):
    assert hooks.main() == 0
    out = capsys.readouterr().out
    assert "MISSING" not in out
    assert all(p.target in out for p in hooks.CATALOGUE)


def test_drafts_that_came_with_the_output_go_to_the_scheduler_and_skip_the_round_trip():
    """Engine-core side of ``TreeRunner.drafts_in_output``: a model output carrying
    ``treespec_draft_token_ids`` hands them to the scheduler in ``update_from_output``,
    and that step's ``post_step`` makes no ``take_draft_token_ids`` call; an output
    without them (vLLM plain, or a worker that sent none) leaves ``post_step`` to vLLM."""
    from vllm.v1.outputs import DraftTokenIds

    class Scheduler:
        def __init__(self):
            self.applied = []

        def update_from_output(self, scheduler_output, model_runner_output):
            return "outputs"

        def update_draft_token_ids(self, drafts):
            self.applied.append(drafts)

    class Executor:
        calls = 0

        def take_draft_token_ids(self):
            Executor.calls += 1
            return None

    class Core:
        def __init__(self):
            self.scheduler, self.model_executor = Scheduler(), Executor()

        def post_step(self, model_executed):  # vLLM 0.32's, reduced to its one call
            if model_executed:
                self.model_executor.take_draft_token_ids()

    update = hooks._scheduler_update(Scheduler.update_from_output)
    post_step = hooks._post_step(Core.post_step)
    core = Core()
    drafts = DraftTokenIds(["r0"], [[5, 6]])
    with_drafts = types.SimpleNamespace(treespec_draft_token_ids=drafts)
    assert update(core.scheduler, None, with_drafts) == "outputs"
    assert core.scheduler.applied == [drafts]
    post_step(core, True)
    assert Executor.calls == 0  # taken with the output
    update(core.scheduler, None, types.SimpleNamespace())  # no drafts attached
    post_step(core, True)
    assert Executor.calls == 1 and core.scheduler.applied == [drafts]
    update(core.scheduler, None, types.SimpleNamespace(treespec_draft_token_ids=None))
    post_step(core, True)  # the worker sent "no drafts": nothing to apply, no round trip
    assert Executor.calls == 1 and core.scheduler.applied == [drafts]


def test_a_layer_without_a_tree_backend_is_refused_at_load(monkeypatch):
    """``TreeRunner.on_model_loaded`` refuses an engine whose attention layers did not get
    the tree backend (they would verify tree rows with the causal kernel), naming the
    layers and the implementation they got; layers that did pass."""
    from types import SimpleNamespace

    import vllm.config

    from tree_dev.vllm_plugin.attention import TreeRowsMixin
    from tree_dev.vllm_plugin.runner import TreeRunner

    Plain = type("Plain", (), {})
    Tree = type("Tree", (TreeRowsMixin,), {})

    st = TreeRunner.__new__(TreeRunner)
    st.runner = SimpleNamespace(vllm_config=None)
    st.cfg = SimpleNamespace(uses_draft_model=False)
    layers = {"model.layers.0.attn": SimpleNamespace(impl=Tree())}
    monkeypatch.setattr(vllm.config, "get_layers_from_vllm_config", lambda *a: layers)
    st.on_model_loaded()
    assert st.target_layers == ["model.layers.0.attn"]
    layers["model.layers.1.attn"] = SimpleNamespace(impl=Plain())
    with pytest.raises(ValueError, match=r"model.layers.1.attn.*got Plain"):
        st.on_model_loaded()


SAME_PROCESS = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, {tests!r})
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm_engines import TARGET, held_out_prompts
kw = dict(model=TARGET, dtype="float32", max_model_len=512, max_num_seqs=4, enforce_eager=True,
          seed=0)
prompts = [TokensPrompt(prompt_token_ids=p) for p in held_out_prompts(8, lo=24, hi=96)]
sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
plain = LLM(**kw)
want = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, sp, use_tqdm=False)]
spec = {{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}}
tree = LLM(**kw, speculative_config=spec,
           additional_config={{"treespec": {{"tree": "ngram:budget=8"}}}})
got = [list(o.outputs[0].token_ids) for o in tree.generate(prompts, sp, use_tqdm=False)]
stats = tree.collective_rpc("treespec_tree_stats")[0]
print("RESULT " + json.dumps({{"want": want, "got": got, "stats": stats}}))
"""


@pytest.mark.full
def test_a_tree_engine_after_a_plain_one_in_the_same_process_is_lossless(tmp_path):
    """A plain vLLM engine built first in the same process (V1 multiprocessing off) left
    its attention backend in vLLM's selector cache; the tree engine after it got that
    backend and verified its trees with the causal kernel: 5 of 8 greedy outputs
    changed (toy, n-gram trie). The override now clears that cache: in a fresh process,
    plain then tree, the tree engine's greedy outputs equal the plain engine's, token
    for token, with drafts accepted (its trees were verified, not skipped)."""
    import json
    import subprocess
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    script = tmp_path / "same_process.py"
    script.write_text(SAME_PROCESS.format(tests=tests))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["got"] == out["want"]
    assert out["stats"]["tree_steps"] > 0 and sum(out["stats"]["depth_accepted"]) > 0, out["stats"]
