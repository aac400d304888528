"""Where the plugin touches vLLM: method wrappers installed once per process.

Every wrapper first asks whether its object carries tree state (``_treespec``); when it
does not (no ``additional_config["treespec"]["tree"]``), it calls vLLM's method unchanged,
so without the key vLLM behaves exactly as without the plugin.

Wrapped (all in the worker process, except the config check):

- ``VllmConfig.__post_init__``: validates the tree configuration where ``LLM(...)`` or the
  API server builds its config, so a bad spec is a start-up ``ValueError``.
- ``VllmConfig.num_lookahead_tokens`` (a property; read by the scheduler, in the engine
  process, and by the worker's warm-up): the KV slots reserved past a request's scheduled
  tokens cover every draft node a tree forwards (``config.lookahead_slots``), not only
  ``num_speculative_tokens``: a top-K tree forwards ``k * (depth - 1)`` nodes.
- ``GPUModelRunner.__init__`` (the CPU runner subclasses it): creates the ``TreeRunner``
  state and registers the tree attention backend override before the model loads.
- ``load_model``: records which attention layers belong to the target and the draft.
- ``_update_states``: forgets finished / preempted requests.
- ``_prepare_inputs``: depth positions and the tree rows of the verify forward.
- ``_sample``: the tree walk, then KV compaction (vLLM's sampler is skipped when every
  request of the batch is a tree: the walk writes every row).
- ``propose_draft_token_ids``: grows the next trees.
"""

from __future__ import annotations

import functools
from typing import Any

_INSTALLED = False


def _wrap(cls: type, name: str, make) -> None:
    orig = cls.__dict__.get(name)
    if orig is None or getattr(orig, "_treespec_wrapped", False):
        return
    new = make(orig)
    functools.update_wrapper(new, orig)
    new._treespec_wrapped = True
    setattr(cls, name, new)


def install() -> None:
    """Install the wrappers (idempotent; inert until a runner is configured for trees)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    from vllm.config import VllmConfig

    _wrap(VllmConfig, "__post_init__", _config_post_init)
    _wrap_lookahead(VllmConfig)
    _add_worker_methods()
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:  # a vLLM build without the V1 GPU runner module
        return
    _wrap(GPUModelRunner, "__init__", _runner_init)
    _wrap(GPUModelRunner, "load_model", _load_model)
    _wrap(GPUModelRunner, "_update_states", _update_states)
    _wrap(GPUModelRunner, "_prepare_inputs", _prepare_inputs)
    _wrap(GPUModelRunner, "_sample", _sample)
    _wrap(GPUModelRunner, "propose_draft_token_ids", _propose)
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:
        return
    _wrap(CPUModelRunner, "load_model", _load_model)


def _add_worker_methods() -> None:
    """``llm.collective_rpc("treespec_tree_stats")`` / ``("treespec_recorded_trees")`` /
    ``("treespec_set_debug", args=(part, n))`` (tests)."""
    try:
        from vllm.v1.worker.worker_base import WorkerBase
    except ImportError:
        return
    from tree_dev.vllm_plugin import runner

    WorkerBase.treespec_tree_stats = runner.worker_tree_stats
    WorkerBase.treespec_recorded_trees = runner.worker_recorded_trees
    WorkerBase.treespec_set_debug = runner.worker_set_debug


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

    return __post_init__


def _wrap_lookahead(cls: type) -> None:
    orig = cls.__dict__.get("num_lookahead_tokens")
    if not isinstance(orig, property) or getattr(orig.fget, "_treespec_wrapped", False):
        return

    def num_lookahead_tokens(self) -> int:
        n = orig.fget(self)
        from tree_dev.vllm_plugin import config

        section = config.tree_section(getattr(self, "additional_config", None))
        if section is None or self.speculative_config is None:
            return n
        return max(n, config.lookahead_slots(section, self.speculative_config))

    functools.update_wrapper(num_lookahead_tokens, orig.fget)
    num_lookahead_tokens._treespec_wrapped = True
    cls.num_lookahead_tokens = property(num_lookahead_tokens, doc=orig.__doc__)


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
    from vllm.platforms import current_platform
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
        out = orig(self, scheduler_output, num_scheduled_tokens)
        st = getattr(self, "_treespec", None)
        if st is not None:
            st.prepare_verify(scheduler_output, num_scheduled_tokens)
        return out

    return _prepare_inputs


def _sample(orig):
    def _sample(self, logits, spec_decode_metadata):
        st = getattr(self, "_treespec", None)
        if st is None:
            return orig(self, logits, spec_decode_metadata)
        out = st.sampler_output_for_trees(spec_decode_metadata)
        if out is None:  # some row is not a tree: vLLM's sampler for the batch first
            out = orig(self, logits, spec_decode_metadata)
        st.walk_and_compact(logits, spec_decode_metadata, out)
        return out

    return _sample


def _propose(orig):
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        st = getattr(self, "_treespec", None)
        if st is None:
            return orig(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        hidden = args[1] if len(args) > 1 else kwargs.get("hidden_states")
        return st.propose(scheduler_output, sampled_token_ids, hidden)

    return propose_draft_token_ids
