"""The tree plugin's worker methods (``llm.collective_rpc("treespec_...")``) and its
developer profiler: a window onto a running engine's ``TreeRunner`` for tests and
benchmarks.

They reach vLLM's workers as a worker extension (``TreeWorkerExtension``, vLLM's
``parallel_config.worker_extension_cls``): the plugin sets it when an engine asks for a
tree (``hooks``). A user's own extension class is kept: the plugin names a class that
derives from both (``extension_for``).
"""

from __future__ import annotations

import importlib

from tree_dev.proposer import NgramHistory
from tree_dev.spec import AutoTreePolicy


def _tree_runner(worker, method: str | None = None):
    """The worker's ``TreeRunner``; None without one, or a ValueError naming ``method``
    when given (a method that changes the tree needs one)."""
    from tree_dev.vllm_plugin.runner import tree_runner_of

    st = tree_runner_of(getattr(worker, "model_runner", None))
    if st is None and method is not None:
        raise ValueError(f"{method}: this engine has no treespec tree (no 'tree' key)")
    return st


def worker_tree_stats(worker) -> dict:
    """Per-depth acceptance of a worker's runner: ``llm.collective_rpc("treespec_tree_stats")``."""
    st = _tree_runner(worker)
    if st is None:
        return {}
    out = {"tree": st.cfg.spec, **st.stats.as_dict()}
    if st.proposer.auto is not None:  # tree: auto's choices, predicted vs measured seconds
        out["auto"] = st.proposer.auto.stats
    return out


def worker_recorded_trees(worker) -> list[dict]:
    """The first ``record_trees`` proposals: request id, context, parents, tokens."""
    st = _tree_runner(worker)
    return list(st.proposer.recorded) if st is not None else []


def worker_record_steps(worker, n: int) -> None:
    """``llm.collective_rpc("treespec_record_steps", args=(n,))``: keep the next ``n``
    step events (``tree_dev.step.StepEvent``, as dicts) for ``worker_recorded_steps``."""
    from tree_dev.vllm_plugin.stats import StepRecorder

    if not isinstance(n, int) or n < 0:
        raise ValueError(f"treespec_record_steps: n = {n!r}; expected an int >= 0")
    st = _tree_runner(worker, "treespec_record_steps")
    if getattr(st, "step_recorder", None) is None:
        st.step_recorder = StepRecorder()
        st.on_step(st.step_recorder.record)
    st.step_recorder.limit, st.step_recorder.events = n, []


def worker_recorded_steps(worker) -> list[dict]:
    """The step events kept since ``treespec_record_steps``: per event ``requests`` (each
    ``req_id``, ``prefix_len``, ``context``, ``parents``, ``tokens``, ``max_depth``,
    ``accepted``, ``emitted``, ``mode``) and ``timings``."""
    st = _tree_runner(worker)
    rec = getattr(st, "step_recorder", None)
    return list(rec.events) if rec is not None else []


def worker_set_debug(worker, disable: str | None, record_trees: int = 0) -> None:
    """Tests' switch on a running engine: ``llm.collective_rpc("treespec_set_debug",
    args=(part, n))`` turns off ``part`` of tree verification (one of
    ``config.DEBUG_SWITCHES``, or None to turn it back on) from the next step, and restarts
    recording the next ``n`` proposed trees. The proofs that can fail run on one engine
    this way; use it with prefix caching off (a broken step's KV must not be reused)."""
    import dataclasses

    from tree_dev.vllm_plugin.config import DEBUG_SWITCHES

    if disable is not None and disable not in DEBUG_SWITCHES:
        raise ValueError(
            f"treespec_set_debug: disable = {disable!r}; expected one of {DEBUG_SWITCHES}"
        )
    if not isinstance(record_trees, int) or record_trees < 0:
        raise ValueError(
            f"treespec_set_debug: record_trees = {record_trees!r}; expected an int >= 0"
        )
    st = _tree_runner(worker, "treespec_set_debug")
    st.cfg = dataclasses.replace(st.cfg, debug_disable=disable, record_trees=record_trees)
    st.proposer.recorded.clear()


def worker_set_tree(worker, spec: str) -> None:
    """Tests' switch of the tree kind on a running engine: ``llm.collective_rpc(
    "treespec_set_tree", args=(spec,))`` proposes ``spec`` from the next step on. The new
    tree must pass the start-up checks (``config.parse``) against the engine's speculative
    config (so its budget is ``num_speculative_tokens``) and forward no more draft nodes
    than the KV slots vLLM reserves for the start-up tree (``config.lookahead_slots``).
    One compiled engine then proves several tree kinds. Trees already proposed are
    verified as they are (any tree is exact); the next ones follow ``spec``."""
    from tree_dev.vllm_plugin import config

    st = _tree_runner(worker, "treespec_set_tree")
    cur = st.cfg
    section = {"tree": spec, "kernel_backend": cur.kernel_backend}
    section["draft_sampling"] = cur.draft_sampling
    new = config.parse(section, st.runner.speculative_config)
    if st.proposer.auto is not None or isinstance(new.policy, AutoTreePolicy):
        raise ValueError(
            f"treespec_set_tree: {spec!r} from {cur.spec!r}: tree auto is chosen at start-up "
            "(it sets up its chooser and cost model), not switched to or from"
        )
    reserved, needed = config.draft_slots(st.start_policy), config.draft_slots(new.policy)
    if needed > reserved:
        raise ValueError(
            f"treespec_set_tree: {spec!r} forwards {needed} draft nodes past the root; the "
            f"engine reserved KV slots for {reserved} (its start-up tree {st.start_policy.spec!r})"
        )
    st.cfg = cur.with_policy(new.policy)
    st.proposer.history = NgramHistory(getattr(new.policy, "history", 0))


def worker_auto_force(worker, name: str | None) -> None:
    """``tree: auto``'s calibration: every request gets candidate ``name`` (None: the
    chooser again): ``llm.collective_rpc("treespec_auto_force", args=(name,))``."""
    st = _tree_runner(worker, "treespec_auto_force")
    if st.proposer.auto is None:
        raise ValueError(f"treespec_auto_force: the engine's tree is {st.cfg.spec!r}, not auto")
    st.proposer.auto.force(name)


def worker_auto_rest(worker, rest_above: float) -> None:
    """``tree: auto``'s rest threshold (``AutoPolicy``'s ``rest_above``: 0 rests wherever
    nothing pays, timing aside, as tests need): ``llm.collective_rpc("treespec_auto_rest",
    args=(rest_above,))``."""
    st = _tree_runner(worker, "treespec_auto_rest")
    if st.proposer.auto is None:
        raise ValueError(f"treespec_auto_rest: the engine's tree is {st.cfg.spec!r}, not auto")
    if not isinstance(rest_above, (int, float)) or not rest_above >= 0:
        raise ValueError(f"treespec_auto_rest: rest_above = {rest_above!r}; expected a number >= 0")
    st.proposer.auto.auto.rest_above = float(rest_above)


def worker_auto_fit(worker) -> dict:
    """``tree: auto``: fit the cost model to the timed steps now, cache it, return the auto
    statistics (``llm.collective_rpc("treespec_auto_fit")``)."""
    st = _tree_runner(worker, "treespec_auto_fit")
    if st.proposer.auto is None:
        raise ValueError(f"treespec_auto_fit: the engine's tree is {st.cfg.spec!r}, not auto")
    return st.proposer.auto.fit_now()


class TreeWorkerExtension:
    """vLLM worker extension: the ``treespec_*`` entry points of ``llm.collective_rpc``."""

    treespec_tree_stats = worker_tree_stats
    treespec_recorded_trees = worker_recorded_trees
    treespec_set_debug = worker_set_debug
    treespec_set_tree = worker_set_tree
    treespec_record_steps = worker_record_steps
    treespec_recorded_steps = worker_recorded_steps
    treespec_auto_force = worker_auto_force
    treespec_auto_fit = worker_auto_fit
    treespec_auto_rest = worker_auto_rest


EXTENSION = f"{__name__}.TreeWorkerExtension"
_WITH = "TreeWorkerExtension_with_"  # + a user's extension qualname, "." spelled "__"


def extension_for(user_extension: str) -> str:
    """The ``worker_extension_cls`` an engine with a tree gets: ``EXTENSION``, or, when
    the user named an extension of their own, a class deriving from both.

    >>> extension_for("")
    'tree_dev.vllm_plugin.worker_methods.TreeWorkerExtension'
    >>> extension_for("my_pkg.ext.MyExtension")
    'tree_dev.vllm_plugin.worker_methods.TreeWorkerExtension_with_my_pkg__ext__MyExtension'
    """
    if not user_extension or user_extension == EXTENSION or _WITH in user_extension:
        return EXTENSION if not user_extension else user_extension
    if "__" in user_extension:
        raise ValueError(
            f"worker_extension_cls = {user_extension!r}: the tree plugin combines it with its "
            "own extension and cannot name a qualname that contains '__'"
        )
    return f"{__name__}.{_WITH}{user_extension.replace('.', '__')}"


def __getattr__(name: str) -> type:
    """The combined extension classes ``extension_for`` names (built on first import)."""
    if not name.startswith(_WITH):
        raise AttributeError(name)
    module_name, _, cls_name = name[len(_WITH) :].replace("__", ".").rpartition(".")
    user = getattr(importlib.import_module(module_name), cls_name)
    combined = type(name, (TreeWorkerExtension, user), {})
    globals()[name] = combined
    return combined


class Profiler:
    """Developer switch: ``TREESPEC_PROFILE=FILE`` profiles the worker (cProfile) after
    ``TREESPEC_PROFILE_SKIP`` proposing steps (default 0: from start-up on) and rewrites
    FILE every 50 steps (worker processes are killed, not exited, at shutdown)."""

    def __init__(self, path: str, skip: int = 0):
        import cProfile

        self.path, self.steps, self.skip = path, 0, skip
        self.prof = cProfile.Profile()
        if skip == 0:
            self.prof.enable()

    @classmethod
    def from_env(cls) -> Profiler | None:
        import os

        path = os.environ.get("TREESPEC_PROFILE")
        skip = int(os.environ.get("TREESPEC_PROFILE_SKIP", "0"))
        return cls(path, skip) if path else None

    def tick(self) -> None:
        self.steps += 1
        if self.steps == self.skip:
            self.prof.enable()
        elif self.steps > self.skip and (self.steps - self.skip) % 50 == 0:
            self.prof.disable()
            self.prof.dump_stats(self.path)
            self.prof.enable()
