"""Where the plugin touches vLLM: every target in one catalogue (``CATALOGUE``), checked
whole before anything is installed.

Every wrapper first asks whether its object carries tree state (``_treespec``); when it
does not (no ``additional_config["treespec"]["tree"]``), it calls vLLM's method unchanged,
so without the key vLLM behaves exactly as without the plugin.

``install`` resolves every catalogued target in the running vLLM first. A required target
that is missing (a vLLM rename) is a ``RuntimeError`` naming it and the vLLM version the
catalogue was written for, and nothing is installed: never half the hooks. A vLLM whose
version is not ``WRITTEN_FOR`` gets a warning naming both versions.
``python -m tree_dev.vllm_plugin.hooks`` prints the catalogue and whether each target
resolves here.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WRITTEN_FOR = "0.32"  # the vLLM release every target below was read in
_INSTALLED = False
_log = logging.getLogger("treespec")


@dataclass(frozen=True)
class Patch:
    """One vLLM touch point.

    Attributes:
        target: ``"module:Class.attribute"`` (or ``"module:name"``) in vLLM.
        why: what the plugin needs there.
        how: ``"wrap"`` (the method, calling vLLM's), ``"property"`` (wrap the getter),
            or ``"use"`` (called or set through vLLM's own API, not changed).
        make: for ``wrap`` / ``property``: ``make(original) -> replacement``.
        required: False for targets only some vLLM builds have (the CPU runner module).
    """

    target: str
    why: str
    how: str
    make: Callable | None = None
    required: bool = True


def _resolve(target: str) -> tuple[Any, str]:
    """``(owner, attribute)`` of ``target``; ``LookupError`` naming the missing part."""
    module_name, _, path = target.partition(":")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise LookupError(f"{target}: module {module_name} does not import ({e})") from e
    *owners, attr = path.split(".")
    for name in owners:
        if not hasattr(owner, name):
            raise LookupError(f"{target}: {module_name} has no {name}")
        owner = getattr(owner, name)
    if attr and not (hasattr(owner, attr) or attr in getattr(owner, "__dict__", {})):
        raise LookupError(f"{target}: {getattr(owner, '__name__', owner)} has no {attr}")
    return owner, attr


def missing_targets(catalogue: tuple[Patch, ...]) -> list[str]:
    """The required targets of ``catalogue`` the running vLLM lacks, each with why."""
    out = []
    for patch in catalogue:
        if not patch.required:
            continue
        try:
            _resolve(patch.target)
        except LookupError as e:
            out.append(str(e))
    return out


def installed(patch: Patch) -> bool:
    """Whether ``patch`` is in place now (``wrap`` / ``property``); True for the others."""
    if patch.how not in ("wrap", "property"):
        return True
    try:
        owner, attr = _resolve(patch.target)
    except LookupError:
        return False
    value = owner.__dict__.get(attr)
    fn = value.fget if isinstance(value, property) else value
    return bool(getattr(fn, "_treespec_wrapped", False))


def apply(catalogue: tuple[Patch, ...]) -> None:
    """Install ``catalogue`` all or nothing: every required target is resolved first."""
    missing = missing_targets(catalogue)
    if missing:
        raise RuntimeError(
            f"treespec: this vLLM lacks {len(missing)} target(s) the plugin patches (written "
            f"for vLLM {WRITTEN_FOR}); nothing was installed: " + "; ".join(missing)
        )
    for patch in catalogue:
        if patch.how not in ("wrap", "property"):
            continue
        try:
            owner, attr = _resolve(patch.target)
        except LookupError:  # an optional target this build lacks
            continue
        if patch.how == "wrap":
            _wrap(owner, attr, patch.make)
        else:
            _wrap_property(owner, attr, patch.make)


def _wrap(cls: type, name: str, make) -> None:
    orig = cls.__dict__.get(name)
    if orig is None or getattr(orig, "_treespec_wrapped", False):
        return
    new = make(orig)
    functools.update_wrapper(new, orig)
    new._treespec_wrapped = True
    setattr(cls, name, new)


def _wrap_property(cls: type, name: str, make) -> None:
    orig = cls.__dict__.get(name)
    if not isinstance(orig, property) or getattr(orig.fget, "_treespec_wrapped", False):
        return
    fget = make(orig.fget)
    functools.update_wrapper(fget, orig.fget)
    fget._treespec_wrapped = True
    setattr(cls, name, property(fget, doc=orig.__doc__))


def _check_version() -> None:
    import vllm

    version = getattr(vllm, "__version__", "?")
    if not str(version).startswith(WRITTEN_FOR):
        _log.warning(
            "treespec: the vLLM plugin was written for vLLM %s; this is vLLM %s. Every "
            "patched target resolves, but their behaviour may have changed.",
            WRITTEN_FOR,
            version,
        )


def install() -> None:
    """Install the catalogue (idempotent; inert until a runner is configured for trees)."""
    global _INSTALLED
    if _INSTALLED:
        return
    apply(CATALOGUE)
    _check_version()
    _INSTALLED = True


def _config_post_init(orig):
    def __post_init__(self, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        from tree_dev.vllm_plugin import config

        section = config.tree_section(getattr(self, "additional_config", None))
        if section is not None:
            config.parse(
                section,
                self.speculative_config,
                kv_cache_dtype=getattr(self.cache_config, "cache_dtype", "auto"),
                device=str(getattr(self.device_config, "device_type", "cpu")),
            )
            from tree_dev.vllm_plugin.worker_methods import extension_for

            pc = self.parallel_config  # the treespec_* collective_rpc entry points
            pc.worker_extension_cls = extension_for(pc.worker_extension_cls)

    return __post_init__


def _lookahead(orig_fget):
    def num_lookahead_tokens(self) -> int:
        n = orig_fget(self)
        from tree_dev.vllm_plugin import config

        section = config.tree_section(getattr(self, "additional_config", None))
        if section is None or self.speculative_config is None:
            return n
        return max(n, config.lookahead_slots(section, self.speculative_config))

    return num_lookahead_tokens


def _runner_init(orig):
    def __init__(self, vllm_config, *args: Any, **kwargs: Any) -> None:
        from tree_dev.vllm_plugin import config

        section = config.tree_section(getattr(vllm_config, "additional_config", None))
        tree_cfg = None
        if section is not None:
            tree_cfg = config.parse(
                section,
                vllm_config.speculative_config,
                kv_cache_dtype=getattr(vllm_config.cache_config, "cache_dtype", "auto"),
                device=str(getattr(vllm_config.device_config, "device_type", "cpu")),
            )
            _register_attention_override()
            _force_triton_on_cuda(vllm_config)
        orig(self, vllm_config, *args, **kwargs)
        if tree_cfg is not None:
            from tree_dev.vllm_plugin.runner import TreeRunner

            self._treespec = TreeRunner(self, tree_cfg)

    return __init__


def _register_attention_override() -> None:
    """Point ``CPU_ATTN`` (CPU) / ``TRITON_ATTN`` (CUDA) at the tree backends, and forget
    the backends vLLM's selector resolved before (``_cached_get_attn_backend`` is a
    ``functools.cache``): a plain engine built earlier in the same process (V1
    multiprocessing off) left the plain backend there, and the tree engine's layers got
    it, verifying trees with the causal kernel (5 of 8 greedy outputs changed on the
    toy). ``TreeRunner.on_model_loaded`` checks every layer got a tree backend."""
    from vllm.platforms import current_platform
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        register_backend(
            AttentionBackendEnum.CPU_ATTN,
            "tree_dev.vllm_plugin.attention.TreeCPUAttentionBackend",
        )
    elif current_platform.is_cuda():
        register_backend(
            AttentionBackendEnum.TRITON_ATTN,
            "tree_dev.vllm_plugin.attention.TreeTritonAttentionBackend",
        )
    else:
        raise ValueError(
            "treespec: tree verification inside vLLM runs on the CPU and CUDA attention "
            f"backends; platform {current_platform.device_type!r} is not supported"
        )
    selector._cached_get_attn_backend.cache_clear()


def _force_triton_on_cuda(vllm_config) -> None:
    """On CUDA the tree rows live in the Triton backend: select it for the engine."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        vllm_config.attention_config.backend = AttentionBackendEnum.TRITON_ATTN


def _load_model(orig):
    def load_model(self, *args: Any, **kwargs: Any):
        out = orig(self, *args, **kwargs)
        st = getattr(self, "_treespec", None)
        if st is not None:
            st.on_model_loaded()
        return out

    return load_model


def _update_states(orig):
    def _update_states(self, scheduler_output):
        st = getattr(self, "_treespec", None)
        if st is not None:
            st.on_update_states(scheduler_output)
        return orig(self, scheduler_output)

    return _update_states


def _prepare_inputs(orig):
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        st = getattr(self, "_treespec", None)
        if st is None:
            return orig(self, scheduler_output, num_scheduled_tokens)
        if st.plain_step(scheduler_output):  # vLLM's non-speculative inputs and sampler
            spec, self.speculative_config = self.speculative_config, None
            try:
                out = orig(self, scheduler_output, num_scheduled_tokens)
            finally:
                self.speculative_config = spec
        else:
            out = orig(self, scheduler_output, num_scheduled_tokens)
        st.prepare_verify(scheduler_output, num_scheduled_tokens)
        return out

    return _prepare_inputs


def _model_forward(orig):
    def _model_forward(self, *args: Any, **kwargs: Any):
        st = getattr(self, "_treespec", None)
        if st is not None:
            from tree_dev.vllm_plugin.attention import publish_verify_rows

            publish_verify_rows(st.verify_rows)
        return orig(self, *args, **kwargs)

    return _model_forward


def _sample(orig):
    def _sample(self, logits, spec_decode_metadata):
        st = getattr(self, "_treespec", None)
        if st is None:
            return orig(self, logits, spec_decode_metadata)
        out = st.sampler_output(logits, spec_decode_metadata)
        if out is None:  # no tree, or logprobs asked: vLLM's samplers for the batch first
            out = orig(self, logits, spec_decode_metadata)
        st.walk_and_compact(logits, spec_decode_metadata, out)
        return out

    return _sample


_NO_DRAFTS = object()  # a model output that carries no treespec drafts


def _sample_tokens(orig):
    def sample_tokens(self, *args: Any, **kwargs: Any):
        out = orig(self, *args, **kwargs)
        st = getattr(self, "_treespec", None)
        if st is not None and st.drafts_in_output:
            from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

            if isinstance(out, ModelRunnerOutput) and out is not EMPTY_MODEL_RUNNER_OUTPUT:
                st.taking_drafts_for_output = True
                try:
                    out.treespec_draft_token_ids = self.take_draft_token_ids()
                finally:
                    st.taking_drafts_for_output = False
        return out

    return sample_tokens


def _take_draft_token_ids(orig):
    def take_draft_token_ids(self):
        st = getattr(self, "_treespec", None)
        if st is not None and not st.taking_drafts_for_output:
            st.stats.draft_token_rpcs += 1
        return orig(self)

    return take_draft_token_ids


def _scheduler_update(orig):
    def update_from_output(self, scheduler_output, model_runner_output):
        out = orig(self, scheduler_output, model_runner_output)
        drafts = getattr(model_runner_output, "treespec_draft_token_ids", _NO_DRAFTS)
        if drafts is not _NO_DRAFTS:  # the step's drafts came with its output
            if drafts is not None:
                self.update_draft_token_ids(drafts)
            self._treespec_drafts_taken = True
        return out

    return update_from_output


def _schedule(orig):
    def schedule(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        try:  # requests waiting for a slot (tree auto's makespan objective reads it)
            out.treespec_waiting = self.get_request_counts()[1]
        except (AttributeError, TypeError):
            pass  # no count: the proposer treats the batch as a server's
        return out

    return schedule


def _post_step(orig):
    def post_step(self, model_executed: bool) -> None:
        scheduler = getattr(self, "scheduler", None)
        if getattr(scheduler, "_treespec_drafts_taken", False):
            scheduler._treespec_drafts_taken = False  # taken in update_from_output
            return
        return orig(self, model_executed)

    return post_step


def _propose(orig):
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        st = getattr(self, "_treespec", None)
        if st is None:
            return orig(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        hidden = args[1] if len(args) > 1 else kwargs.get("hidden_states")
        return st.propose(scheduler_output, sampled_token_ids, hidden)

    return propose_draft_token_ids


_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
CATALOGUE: tuple[Patch, ...] = (
    Patch(
        "vllm.config:VllmConfig.__post_init__",
        "refuse a bad tree config where LLM(...) or the API server builds its config",
        "wrap",
        _config_post_init,
    ),
    Patch(
        "vllm.config:VllmConfig.num_lookahead_tokens",
        "reserve KV slots past the scheduled tokens for every draft node a tree forwards "
        "(a top-K tree forwards k * (depth - 1), not num_speculative_tokens)",
        "property",
        _lookahead,
    ),
    Patch(
        "vllm.config.parallel:ParallelConfig.worker_extension_cls",
        "collective_rpc entry points (worker_methods.TreeWorkerExtension, set by the config "
        "check above): treespec_tree_stats, treespec_recorded_trees, treespec_set_debug, "
        "treespec_set_tree, treespec_record_steps, treespec_recorded_steps, "
        "treespec_auto_force, treespec_auto_fit, treespec_auto_rest",
        "use",
    ),
    Patch(
        f"{_RUNNER}.__init__",
        "create the TreeRunner state and register the tree attention override before the "
        "model loads (the CPU runner subclasses this runner)",
        "wrap",
        _runner_init,
    ),
    Patch(
        f"{_RUNNER}.load_model",
        "record which attention layers belong to the target and to the draft",
        "wrap",
        _load_model,
    ),
    Patch(
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model",
        "the same on the CPU runner, which overrides load_model",
        "wrap",
        _load_model,
        required=False,
    ),
    Patch(
        f"{_RUNNER}._update_states", "forget finished / preempted requests", "wrap", _update_states
    ),
    Patch(
        f"{_RUNNER}._prepare_inputs",
        "depth positions and the tree rows of the verify forward; on a step where no "
        "request is scheduled with drafts, vLLM's non-speculative inputs (the runner's "
        "speculative_config is None for that call only, the one attribute 0.32's "
        "_prepare_inputs reads to choose): no spec-decode metadata, and the step samples "
        "with vLLM's plain sampler, as an engine without speculation does",
        "wrap",
        _prepare_inputs,
    ),
    Patch(
        f"{_RUNNER}._model_forward",
        "hand the verify forward's tree rows to the attention override through vLLM's "
        "ForwardContext.additional_kwargs (scoped to that forward: no module global)",
        "wrap",
        _model_forward,
    ),
    Patch(
        f"{_RUNNER}._sample",
        "the tree walk, then KV compaction; vLLM's rejection sampler is skipped on a step "
        "with trees (every drafted request is a tree the walk decides; requests without a "
        "draft get vLLM's sampler on their last row, as the rejection sampler samples them)",
        "wrap",
        _sample,
    ),
    Patch(f"{_RUNNER}.propose_draft_token_ids", "grow the next trees", "wrap", _propose),
    Patch(
        f"{_RUNNER}.sample_tokens",
        "send the step's drafts with its ModelRunnerOutput (treespec_draft_token_ids) "
        "when the engine schedules synchronously (no async scheduling, one pipeline "
        "stage): the engine core then needs no take_draft_token_ids round trip per step",
        "wrap",
        _sample_tokens,
    ),
    Patch(
        f"{_RUNNER}.take_draft_token_ids",
        "count the round trips the engine core still makes for drafts "
        "(stats draft_token_rpcs; 0 when the drafts came with the output)",
        "wrap",
        _take_draft_token_ids,
    ),
    Patch(
        "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
        "engine core: right after the step's outputs, hand the drafts that came with the "
        "model output to the scheduler (update_draft_token_ids, as post_step does)",
        "wrap",
        _scheduler_update,
    ),
    Patch(
        "vllm.v1.core.sched.scheduler:Scheduler.schedule",
        "engine core: note on each SchedulerOutput how many requests wait for a slot "
        "(treespec_waiting; get_request_counts), which tree auto's makespan objective "
        "reads: while requests wait, a request that ends frees a slot for the next",
        "wrap",
        _schedule,
    ),
    Patch(
        "vllm.v1.engine.core:EngineCore.post_step",
        "engine core: skip the take_draft_token_ids call on a step whose drafts came "
        "with the output (in 0.32 that call is all post_step does)",
        "wrap",
        _post_step,
    ),
    Patch(
        "vllm.v1.attention.backends.registry:register_backend",
        "override CPU_ATTN (CPU) / TRITON_ATTN (CUDA) with the tree attention backends",
        "use",
    ),
    Patch(
        "vllm.v1.attention.selector:_cached_get_attn_backend",
        "cleared when the override is registered: it keeps the backend a plain engine of "
        "the same process resolved before",
        "use",
    ),
    Patch(
        "vllm.v1.attention.backends.registry:AttentionBackendEnum.CPU_ATTN",
        "the CPU backend the override replaces",
        "use",
    ),
    Patch(
        "vllm.v1.attention.backends.registry:AttentionBackendEnum.TRITON_ATTN",
        "the CUDA backend the override replaces",
        "use",
    ),
)


def main() -> int:
    """Print the catalogue and whether each target resolves in the installed vLLM."""
    import vllm

    print(f"vLLM {vllm.__version__} (catalogue written for {WRITTEN_FOR})")
    missing = 0
    for patch in CATALOGUE:
        try:
            _resolve(patch.target)
            state = "ok"
        except LookupError as e:
            state = f"MISSING ({e})" if patch.required else "absent (optional)"
            missing += patch.required
        print(f"{state:10s} {patch.how:8s} {patch.target}\n           {patch.why}")
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
