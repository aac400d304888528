"""The accuracy tooling inside a vLLM 0.32 model runner (capture, replacement, fault injection).

Loaded by vLLM through the ``vllm.general_plugins`` entry point ``treespec_accuracy`` in
every process. :func:`register` patches one method, ``GPUModelRunner.__init__`` (the CPU
runner subclasses it), with a check of ``additional_config``: a runner whose
``additional_config["treespec"]`` (or the designs' ``"neuron_config"``) holds none of
``tensor_capture`` / ``tensor_replacement`` / ``fault_injection`` is left untouched. Other
keys of those dicts (the tree plugin's ``"tree"``) are ignored here.

An enabled runner gets per-instance wrappers (so they compose with other plugins' class
patches):

- ``load_model``: after vLLM has built the model (its ``@support_torch_compile`` wrapper
  in place, nothing traced yet) the capture, replacement and fault hooks are registered on
  the model's submodules, before warmup; dynamo traces them into the compiled graph once.
- ``execute_model``: remembers the scheduler output, registers new requests with the
  :class:`~accuracy.TensorReplacer` (longest verified prefix match).
- ``_model_forward``: builds the replacement context from the scheduler's request ids and
  positions, brackets the forward with ``setup_tensor_capture`` / ``save_tensor_captures``
  and writes ``dp0/{prefill_s*,decode_b*}_{i}`` with the scheduler metadata.
- the worker's ``compile_or_warm_up_model``: enables disk writes after warmup; its
  ``shutdown`` flushes the queued writes.

Writes run in a child process (:class:`~accuracy.writer_process.WriterProcess`, on the
CPUs the worker's forward is not bound to): the forward only copies the captured bytes
and the pass's metadata into a frame, held until the next step starts and then sent
down a pipe, so the disk I/O and the file-format work never compete with it for the GIL,
and the child works while the forward runs rather than beside the EngineCore between
steps (``TREESPEC_CAPTURE_HOLD=0``, a developer switch, sends each pass at once). Every
queued pass is on disk before a step that may finish a request returns its output, at
worker shutdown, at exit and after :func:`flush_captures`. A write error is re-raised
(``RuntimeError`` naming the pass and the file) by the next step and by every flush.
``"async_writes": False`` writes each pass in the worker before the next step;
``"max_pending"`` (default 64) bounds the passes in flight.

The draft model of speculative decoding (``draft_modules``) is captured around each of its
forward calls into ``capture_dir/draft``.

Configuration (all keys optional except ``capture_dir`` / a tensor source)::

    additional_config={"treespec": {
        "tensor_capture": {"modules": ["model.layers.0-5", "lm_head"], "capture_dir": D,
                           "draft_modules": [...], "capture_filter": [...],
                           "async_writes": True, "max_pending": 64},
        "tensor_replacement": replacement_config(tensors, prompt_token_ids)   # in memory
                           | {"tensors_path": P, "prompt_token_ids_path": Q,
                              "modules": [...]},                          # from disk
        "fault_injection": {"module": "model.layers.2.mlp", "scale": 1.5},
    }}

``"lm_head"`` in vLLM is applied through ``compute_logits`` on the sampled rows only;
capturing it stores ``compute_logits`` of every slot's final hidden state (``[T, vocab]``,
the layout of HF's ``lm_head`` output). Decoder layers return ``(hidden, residual)`` with
the residual add deferred; their capture stacks both as ``[2, T, H]`` (see
:func:`accuracy.vllm_compare.vllm_reconstruct`).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .capture import ModelCapture
from .patterns import match_modules
from .registry import TensorRegistry
from .replacement import (
    TensorReplacementConfig,
    TensorReplacer,
    get_replacement_tensor,
    set_active_context,
)
from .writer_process import WriterProcess

logger = logging.getLogger(__name__)

CONFIG_SECTIONS = ("neuron_config", "treespec")  # later wins
MY_KEYS = ("tensor_capture", "tensor_replacement", "fault_injection")
_CAPTURE_KEYS = {
    "modules",
    "capture_dir",
    "draft_modules",
    "capture_filter",
    "strict",
    "async_writes",
    "max_pending",
}
_LAYER_RE = re.compile(r"(^|.*\.)layers\.\d+$")
_STATE_ATTR = "_treespec_accuracy"
_installed = {"done": False}


# ----------------------------------------------------------------------------- config


class InMemoryReplacement(dict):
    """Replacement tensors passed to an offline ``LLM`` through ``additional_config``.

    vLLM hashes ``additional_config`` with ``json.dumps``: this dict holds only a JSON
    summary (module names, prompt count, a content hash) and keeps the tensors in
    attributes, which travel to the workers with the config.
    """

    def __init__(
        self,
        tensors: list[dict[str, list[torch.Tensor]]],
        prompt_token_ids: list[list[int]] | None = None,
        modules: list[str] | None = None,
    ) -> None:
        if not isinstance(tensors, (list, tuple)) or not tensors:
            raise ValueError("tensor_replacement: tensors must be a non-empty list of dicts")
        names = sorted({m for caps in tensors for m in caps})
        digest = _tensor_digest(tensors)
        super().__init__(in_memory=True, modules=modules or names, prompts=len(tensors))
        self["digest"] = digest
        self.tensors = tensors
        self.prompt_token_ids = prompt_token_ids

    def __reduce__(self):  # keep the tensors when pickled to the workers
        return (
            InMemoryReplacement,
            (self.tensors, self.prompt_token_ids, list(self["modules"])),
        )


def _tensor_digest(tensors: list[dict[str, list[torch.Tensor]]]) -> str:
    import hashlib

    h = hashlib.sha1()
    for caps in tensors:
        for m in sorted(caps):
            h.update(m.encode())
            for t in caps[m]:
                h.update(str(tuple(t.shape)).encode())
                h.update(t.detach().float().reshape(-1)[:64].numpy().tobytes())
    return h.hexdigest()


def replacement_config(
    tensors: list[dict[str, list[torch.Tensor]]],
    prompt_token_ids: list[list[int]] | None = None,
    modules: list[str] | None = None,
) -> InMemoryReplacement:
    """The ``tensor_replacement`` value for an offline ``LLM``: reference captures (one
    ``{module: [step tensors]}`` per prompt, the :class:`~accuracy.TensorReplacer` input)
    and the prompts' token ids; ``modules`` limits which ones are injected."""
    return InMemoryReplacement(tensors, prompt_token_ids, modules)


def accuracy_config(additional_config: Any) -> dict[str, Any]:
    """This tool's keys of ``additional_config`` (``neuron_config`` then ``treespec``)."""
    out: dict[str, Any] = {}
    if not isinstance(additional_config, dict):
        return out
    for section in CONFIG_SECTIONS:
        sec = additional_config.get(section)
        if isinstance(sec, dict):
            out.update({k: v for k, v in sec.items() if k in MY_KEYS and v is not None})
    return out


def check_capture_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Validate a ``tensor_capture`` dict (keys, module lists, a writable ``capture_dir``)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"tensor_capture must be a dict, got {type(cfg).__name__}")
    unknown = set(cfg) - _CAPTURE_KEYS
    if unknown:
        raise ValueError(f"tensor_capture: unknown keys {sorted(unknown)}")
    if not cfg.get("capture_dir"):
        raise ValueError("tensor_capture: capture_dir is required")
    for key in ("modules", "draft_modules", "capture_filter"):
        v = cfg.get(key)
        if v is not None and (isinstance(v, str) or not all(isinstance(x, str) and x for x in v)):
            raise ValueError(f"tensor_capture.{key} must be a list of non-empty strings: {v!r}")
    if not isinstance(cfg.get("async_writes", True), bool):
        raise ValueError(f"tensor_capture.async_writes must be a bool: {cfg['async_writes']!r}")
    mp = cfg.get("max_pending", 64)
    if isinstance(mp, bool) or not isinstance(mp, int) or mp < 1:
        raise ValueError(f"tensor_capture.max_pending must be an int >= 1: {mp!r}")
    if not cfg.get("modules") and not cfg.get("draft_modules"):
        raise ValueError("tensor_capture: modules (or draft_modules) must list something")
    check_writable(cfg["capture_dir"], "tensor_capture.capture_dir")
    return cfg


def check_writable(path: str, what: str) -> None:
    """ValueError naming ``path`` unless a file can be created in it."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path, prefix=".write-test-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise ValueError(f"{what} '{path}' is not writable ({e.strerror or e})") from e


def _replacement_source(cfg: Any) -> tuple[list, list | None, list[str] | None]:
    if isinstance(cfg, InMemoryReplacement):
        return cfg.tensors, cfg.prompt_token_ids, list(cfg["modules"])
    if isinstance(cfg, TensorReplacementConfig):
        tensors, ids = cfg.load()
        return tensors, ids, None
    if isinstance(cfg, dict):
        d = dict(cfg)
        modules = d.pop("modules", None)
        tensors, ids = TensorReplacementConfig.from_dict(d).load()
        return tensors, ids, modules
    raise ValueError(f"tensor_replacement: unsupported value of type {type(cfg).__name__}")


# ----------------------------------------------------------------------------- hooks


def _decoder_pair(out: Any) -> bool:
    return (
        isinstance(out, tuple)
        and len(out) == 2
        and all(isinstance(t, torch.Tensor) for t in out)
        and out[0].shape == out[1].shape
    )


def _capture_hooks(model: nn.Module, names: list[str], registry: TensorRegistry) -> list[Any]:
    """Capture hooks. A decoder layer's ``(hidden, residual)`` is stored as ``[2, T, H]``;
    of any other tuple output (vLLM's fused add-norms return ``(normed, residual)``) the
    first tensor is stored, under the module's own name, as in HF."""
    mods = dict(model.named_modules())
    handles = []
    for name in names:
        is_layer = bool(_LAYER_RE.match(name))

        def hook(_m, _inp, out, _n=name, _r=registry, _layer=is_layer):
            if _layer and _decoder_pair(out):
                if _r.enabled:  # the stack is already a copy: no second clone
                    _r._module_items.append((_n, torch.stack([t.detach() for t in out])))
            elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
                _r.register_module_tensor(_n, out[0])
            else:
                _r.register_module_tensor(_n, out)

        handles.append(mods[name].register_forward_hook(hook))
    return handles


def _replacement_hooks(model: nn.Module, names: list[str]) -> list[Any]:
    """Output overrides: a module returns its active replacement (``[T, E]``, the
    scheduler's slot layout). A decoder layer returns ``(replacement, 0)`` so that the
    next layer's deferred residual add yields the replacement exactly."""
    mods = dict(model.named_modules())
    handles = []
    for name in names:

        def hook(_m, _inp, out, _n=name):
            rep = get_replacement_tensor(_n)
            if rep is None:
                return None
            if _decoder_pair(out):
                h = rep[: out[0].shape[0]].to(out[0].dtype)
                return h, torch.zeros_like(out[1])
            if isinstance(out, tuple):
                return (rep[: out[0].shape[0]].to(out[0].dtype), *out[1:])
            return rep[: out.shape[0]].to(out.dtype)

        handles.append(mods[name].register_forward_hook(hook))
    return handles


def _fault_hook(model: nn.Module, cfg: dict[str, Any]) -> Any:
    """Scale one module's (first) output: a deliberately planted numerical bug."""
    if not isinstance(cfg, dict) or set(cfg) - {"module", "scale"} or "module" not in cfg:
        raise ValueError(f"fault_injection must be {{'module': name, 'scale': x}}, got {cfg!r}")
    mods = dict(model.named_modules())
    name, scale = cfg["module"], float(cfg.get("scale", 2.0))
    if name not in mods:
        raise ValueError(f"fault_injection.module: no submodule named '{name}'")

    def hook(_m, _inp, out):
        if isinstance(out, tuple):
            return (out[0] * scale, *out[1:])
        return out * scale

    return mods[name].register_forward_hook(hook)


def _expected_features(model: nn.Module, name: str, hidden: int, vocab: int) -> int | None:
    """Feature size of ``name``'s output where it is known without running the model."""
    mod = dict(model.named_modules())[name]
    if name.split(".")[-1] in ("lm_head", "logits_processor"):
        return vocab
    for attr in ("output_size_per_partition", "out_features"):
        v = getattr(mod, attr, None)
        if isinstance(v, int):
            return v
    last = name.split(".")[-1]
    if (
        _LAYER_RE.match(name)
        or last in ("mlp", "self_attn", "norm", "embed_tokens")
        or (last.endswith("layernorm"))
    ):
        return hidden
    return None


# ----------------------------------------------------------------------------- async writes


_WRITERS: weakref.WeakSet[WriterProcess] = weakref.WeakSet()


def flush_captures() -> None:
    """Wait until every capture pass queued in this process is on disk (raises the first
    write error). Readers in the engine's process call it before reading; an offline
    ``LLM``'s captures are already flushed when ``generate`` returns."""
    errors = []
    for w in list(_WRITERS):
        try:
            w.flush()
        except RuntimeError as e:
            errors.append(e)
    if errors:
        raise errors[0]


@atexit.register
def _flush_at_exit() -> None:
    try:
        flush_captures()
    except RuntimeError as e:  # nothing left to raise into at exit
        logger.error("%s", e)


# ----------------------------------------------------------------------------- runner state


@dataclass
class _RunnerState:
    """Per-runner accuracy state (attached to the runner as ``_treespec_accuracy``)."""

    cfg: dict[str, Any]
    target: ModelCapture | None = None
    draft: ModelCapture | None = None
    lm_head: bool = False
    replacer: TensorReplacer | None = None
    replace_modules: list[str] = field(default_factory=list)
    scheduler_output: Any = None
    req_prompt: dict[str, int] = field(default_factory=dict)
    step_meta: dict[str, Any] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)
    warmup_stats: dict[str, int] = field(default_factory=dict)
    async_writes: bool = True
    seq: int = 0

    def writer_processes(self) -> list[WriterProcess]:
        """The writer processes of the target's and the draft's captures."""
        return [c.writes for c in (self.target, self.draft) if c is not None and c.writes]


def compile_stats() -> dict[str, int]:
    """Compilation counters of this process: dynamo's unique graphs and vLLM's
    ``compilation_counter`` (graphs seen, backend / inductor compiles)."""
    out: dict[str, int] = {}
    try:
        from torch._dynamo.utils import counters

        out["dynamo_unique_graphs"] = int(counters["stats"].get("unique_graphs", 0))
    except Exception:  # pragma: no cover - private API
        pass
    try:
        from vllm.compilation.counter import compilation_counter as cc

        for k in ("num_graphs_seen", "num_backend_compilations", "num_inductor_compiles"):
            out[k] = int(getattr(cc, k, 0))
    except Exception:  # pragma: no cover
        pass
    return out


def _ranks(runner) -> tuple[int, int]:
    pc = runner.vllm_config.parallel_config
    tp = 0
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        tp = int(get_tensor_model_parallel_rank())
    except Exception:
        tp = 0
    return int(getattr(pc, "data_parallel_rank", 0) or 0), tp


def _setup(runner) -> None:
    """After ``load_model``: validate the config against the model and register hooks."""
    st: _RunnerState = getattr(runner, _STATE_ATTR)
    model = runner.model
    hf = runner.model_config.hf_text_config
    hidden, vocab = int(hf.hidden_size), int(hf.vocab_size)
    dp, tp = _ranks(runner)
    if "fault_injection" in st.cfg:
        st.handles.append(_fault_hook(model, st.cfg["fault_injection"]))
    rep_cfg = st.cfg.get("tensor_replacement")
    if rep_cfg is not None:
        _setup_replacement(st, model, rep_cfg, hidden, vocab)
    cap = st.cfg.get("tensor_capture")
    if cap is not None:
        _setup_capture(runner, st, model, cap, dp, tp)
    if st.target is not None:
        TensorRegistry._instance = st.target.registry
    if cap is not None and st.async_writes:  # started now: start-up overlaps compile, warmup
        _start_writers(st, cap)


def _setup_replacement(
    st: _RunnerState, model: nn.Module, rep_cfg: Any, hidden: int, vocab: int
) -> None:
    """Build the replacer, check its modules against the model and register the hooks."""
    tensors, ids, modules = _replacement_source(rep_cfg)
    st.replacer = TensorReplacer(tensors, prompt_token_ids=ids)
    names = list(modules or st.replacer.modules)
    known = dict(model.named_modules())
    missing = [n for n in names if n not in known]
    if missing:
        raise ValueError(
            f"tensor_replacement: unknown module(s) {missing} in {type(model).__name__}"
        )
    for n in names:
        if n not in st.replacer.modules:
            raise ValueError(f"tensor_replacement: no reference tensors for module '{n}'")
        feat = tuple(st.replacer.flat[0][n].shape[1:])
        want = _expected_features(model, n, hidden, vocab)
        if want is not None and feat != (want,):
            raise ValueError(
                f"tensor_replacement: tensors for module '{n}' have feature shape "
                f"{list(feat)} but the module outputs [T, {want}]"
            )
    st.replace_modules = names
    st.handles += _replacement_hooks(model, names)


def _setup_capture(
    runner, st: _RunnerState, model: nn.Module, cap: dict[str, Any], dp: int, tp: int
) -> None:
    """Set up the target model's capture and, with ``draft_modules``, the draft's."""
    modules = list(cap.get("modules") or [])
    st.lm_head = any(re.fullmatch(p, "lm_head") for p in modules if p)
    hook_patterns = [p for p in modules if p != "lm_head"]
    common = dict(dp_rank=dp, tp_rank=tp, capture_filter=cap.get("capture_filter"))
    if modules:
        _setup_target_capture(runner, st, model, cap, hook_patterns, common)
    if cap.get("draft_modules"):
        _setup_draft_capture(runner, st, cap, common)


def _setup_target_capture(
    runner,
    st: _RunnerState,
    model: nn.Module,
    cap: dict[str, Any],
    hook_patterns: list[str],
    common: dict[str, Any],
) -> None:
    """Create the target model's :class:`ModelCapture` and register its hooks."""
    names = (
        match_modules(model, hook_patterns, strict=cap.get("strict", True))
        if (hook_patterns)
        else []
    )
    if st.lm_head and "lm_head" in names:
        names.remove("lm_head")  # never called: logits come from compute_logits
    layout = tp_layout(model, names)
    if st.lm_head:  # compute_logits all-gathers the vocabulary shards
        layout["lm_head"] = {"kind": "replicated"}
    st.target = ModelCapture(
        model,
        [],
        cap["capture_dir"],
        strict=False,
        config=_manifest_cfg(runner, cap, layout),
        **common,
    )
    st.target._capture_names = names + (["lm_head"] if st.lm_head else [])
    st.handles += _capture_hooks(model, names, st.target.registry)


def _setup_draft_capture(
    runner, st: _RunnerState, cap: dict[str, Any], common: dict[str, Any]
) -> None:
    """Create the draft model's :class:`ModelCapture` and register its hooks and bracket."""
    drafter = getattr(runner, "drafter", None)
    dmodel = getattr(drafter, "model", None)
    if dmodel is None:
        raise ValueError(
            "tensor_capture.draft_modules given but speculative decoding with a "
            "draft model is not configured"
        )
    dnames = match_modules(dmodel, list(cap["draft_modules"]), strict=True)
    st.draft = ModelCapture(
        dmodel,
        [],
        cap["capture_dir"],
        subdirectory="draft",
        strict=False,
        config=_manifest_cfg(runner, cap, tp_layout(dmodel, dnames)),
        **common,
    )
    st.draft._capture_names = dnames
    st.handles += _capture_hooks(dmodel, dnames, st.draft.registry)
    st.handles += _draft_bracket(runner, dmodel)


def _start_writers(st: _RunnerState, cap: dict[str, Any]) -> None:
    """Start a :class:`WriterProcess` for each capture (target, draft) that exists."""
    for mc in (st.target, st.draft):
        if mc is not None:
            mc.writes = WriterProcess(
                mc.writer.settings(),
                cap.get("max_pending", 64),
                hold=os.environ.get("TREESPEC_CAPTURE_HOLD", "1") == "1",
            )
            _WRITERS.add(mc.writes)


def _manifest_cfg(runner, cap: dict[str, Any], layout: dict[str, Any]) -> dict[str, Any]:
    mc = runner.model_config
    return {
        "engine": "vllm",
        "model": str(mc.model),
        "dtype": str(mc.dtype).replace("torch.", ""),
        "enforce_eager": bool(mc.enforce_eager),
        "tensor_parallel_size": int(
            getattr(runner.vllm_config.parallel_config, "tensor_parallel_size", 1) or 1
        ),
        "tp_layout": layout,
        "requested": {k: v for k, v in cap.items() if k != "capture_dir"},
    }


def tp_layout(model: nn.Module, names: list[str]) -> dict[str, dict[str, Any]]:
    """How each captured module's output ``[T, F_r]`` is split over the TP ranks.

    Read from vLLM's layer objects (``accuracy.vllm_compare.merge_tp_ranks`` undoes it):

    - ``{"kind": "column", "parts": [F_1, ...], "replicas": [1, ...]}``: each rank holds
      its shard of every logical part (``qkv_proj``: q, k, v; ``gate_up_proj``: gate, up;
      ``output_partition_sizes`` of a ``ColumnParallelLinear`` without ``gather_output``);
      ``replicas[i] > 1`` when ranks hold copies of part ``i`` (KV heads replicated when
      ``tp_size > num_kv_heads``). ``parts`` is None for one block: the ``Attention``
      output (its heads), activations and rotary embeddings (inputs column-parallel in
      vLLM's models).
    - ``{"kind": "partial_sum"}``: a ``RowParallelLinear`` with ``reduce_results=False``.
    - ``{"kind": "replicated"}``: everything else, all-reduced or computed on replicated
      inputs (row-parallel linears, the embedding, norms, decoder layers, ``self_attn``,
      ``mlp``): every rank holds the full tensor.
    """
    from vllm.model_executor.layers import activation
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    mods = dict(model.named_modules())
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        m = mods[name]
        kind: dict[str, Any] = {"kind": "replicated"}
        if isinstance(m, ColumnParallelLinear) and m.tp_size > 1 and not m.gather_output:
            parts = [int(p) for p in m.output_partition_sizes]
            reps = [1] * len(parts)
            if isinstance(m, QKVParallelLinear) and len(parts) == 3:
                reps = [1, int(m.num_kv_head_replicas), int(m.num_kv_head_replicas)]
            kind = {"kind": "column", "parts": parts, "replicas": reps}
        elif isinstance(m, RowParallelLinear) and m.tp_size > 1 and not m.reduce_results:
            kind = {"kind": "partial_sum"}
        elif isinstance(m, (Attention, RotaryEmbeddingBase)) or (
            type(m).__module__ == activation.__name__
        ):
            kind = {"kind": "column", "parts": None, "replicas": None}
        out[name] = kind
    return out


def _draft_bracket(runner, dmodel: nn.Module) -> list[Any]:
    """Pre/post hooks on the draft model's top module: one saved pass per draft forward."""
    st: _RunnerState = getattr(runner, _STATE_ATTR)

    def pre(_m, args, kwargs):
        st.draft.setup_tensor_capture()

    def post(_m, args, kwargs, out):
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        meta = st.step_meta
        st.draft.save_tensor_captures(
            pos if pos is not None else [],
            bool(meta.get("is_prefill", False)),
            req_ids=meta.get("req_ids"),
            extra={"model": "draft", "target_seq": meta.get("seq")},
        )

    return [
        dmodel.register_forward_pre_hook(pre, with_kwargs=True),
        dmodel.register_forward_hook(post, with_kwargs=True),
    ]


def _step_metadata(runner, positions: torch.Tensor | None, input_ids) -> dict[str, Any]:
    """Scheduler metadata of the pass about to run (request order = slot order)."""
    so = runner_state(runner).scheduler_output
    ib = runner.input_batch
    req_ids = list(ib.req_ids)
    n = len(req_ids)
    sched = [int(so.num_scheduled_tokens[r]) for r in req_ids] if so is not None else []
    computed = [int(ib.num_computed_tokens_cpu[i]) for i in range(n)]
    prompt_len = [int(ib.num_prompt_tokens[i]) for i in range(n)]
    spec = so.scheduled_spec_decode_tokens if so is not None else {}
    n_spec = [len(spec.get(r, ())) for r in req_ids]
    prefilling = [c < p for c, p in zip(computed, prompt_len, strict=True)]
    total = sum(sched)
    pos = positions.reshape(-1)[: max(total, 0)] if positions is not None else None
    slots = positions.reshape(-1).shape[0] if positions is not None else total
    offsets, off = [], 0
    for c in sched:
        offsets.append([off, c])
        off += c
    return {
        "req_ids": req_ids,
        "num_scheduled_tokens": sched,
        "num_computed_tokens": computed,
        "num_prompt_tokens": prompt_len,
        "num_spec_tokens": n_spec,
        "prefilling": prefilling,
        "slot_table": offsets,
        "is_prefill": any(prefilling),
        "num_slots": int(slots),
        "num_real": int(total),
        "positions": pos,
        "all_positions": positions.reshape(-1).tolist() if positions is not None else [],
        "input_ids": input_ids,
    }


def runner_state(runner) -> _RunnerState:
    return getattr(runner, _STATE_ATTR)


def _tree_meta(runner, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The tree plugin's trees of this pass (``tree_dev.vllm_plugin.runner.verify_trees``)
    as :class:`TreeMetadata` fields (slots of each request's tree, in request order), or
    None."""
    from tree_dev.vllm_plugin.runner import verify_trees

    trees = verify_trees(runner)
    if trees is None:
        return None
    tb = trees.as_dict()
    parents, tokens, cu = [], [], [0]
    order = {r: i for i, r in enumerate(tb["req_ids"])}
    for r in meta["req_ids"]:
        if r not in order:
            continue
        i = order[r]
        parents += [int(p) for p in tb["parents"][i]]
        tokens += [int(t) for t in tb["tokens"][i]]
        cu.append(len(parents))
    return {"parents": parents, "tokens": tokens, "cu_nodes": cu, "raw": tb}


def _wrap_model_forward(runner, orig: Callable) -> Callable:
    st = runner_state(runner)

    @functools.wraps(orig)
    def model_forward(*args, **kwargs):
        positions = kwargs.get("positions")
        input_ids = kwargs.get("input_ids")
        meta = _step_metadata(runner, positions, input_ids)
        st.step_meta = meta
        if st.replacer is not None:
            _set_replacement(st, meta, positions)
        if st.target is not None:
            st.target.setup_tensor_capture()
        try:
            out = orig(*args, **kwargs)
        finally:
            if st.replacer is not None:
                set_active_context(None)
        if st.target is not None:
            _save_target(runner, st, meta, out)
        return out

    return model_forward


def _set_replacement(st: _RunnerState, meta: dict[str, Any], positions) -> None:
    slots = meta["num_slots"]
    pos = positions.reshape(-1).tolist() if positions is not None else []
    mask = [i >= meta["num_real"] for i in range(slots)]
    sched = meta["num_scheduled_tokens"]
    decode_counts = set(sched)
    kwargs: dict[str, Any]
    if not meta["is_prefill"] and len(decode_counts) == 1:
        kwargs = {"tokens_per_req": sched[0] if sched else 1}  # 1 + num spec tokens
    else:
        kwargs = {"slot_table": [tuple(x) for x in meta["slot_table"]]}
    ctx = st.replacer.build_context(
        meta["req_ids"],
        pos,
        meta["is_prefill"] and len(sched) == 1 and "slot_table" not in kwargs,
        padding_mask=mask,
        **kwargs,
    )
    set_active_context({m: ctx[m] for m in st.replace_modules})


def _save_target(runner, st: _RunnerState, meta: dict[str, Any], out: Any) -> None:
    cap = st.target
    if not cap.enabled:
        cap.save_tensor_captures(None, False)  # restores the previous registry only
        return
    if st.lm_head:
        hidden = out[0] if isinstance(out, tuple) else out
        if isinstance(hidden, torch.Tensor):
            with torch.no_grad():
                logits = runner.model.compute_logits(hidden[: meta["num_slots"]])
            if logits is not None:
                cap.registry.register_module_tensor("lm_head", logits)
    slots = meta["num_slots"]
    positions = meta["all_positions"]
    ids = meta["input_ids"]
    token_ids = ids.reshape(-1)[:slots].tolist() if isinstance(ids, torch.Tensor) else None
    padding = [i >= meta["num_real"] for i in range(slots)]
    tree = _tree_meta(runner, meta)
    extra = {
        k: meta[k]
        for k in (
            "num_scheduled_tokens",
            "num_computed_tokens",
            "num_prompt_tokens",
            "num_spec_tokens",
            "prefilling",
            "slot_table",
        )
    }
    extra["engine"] = "vllm"
    extra["compile_stats"] = compile_stats()
    extra["compile_stats_after_warmup"] = st.warmup_stats
    if st.replacer is not None:
        extra["replacement_prompt_idx"] = {
            r: st.replacer._req_to_prompt.get(r) for r in meta["req_ids"]
        }
    tree_md = None
    if tree is not None:
        raw = tree.pop("raw")
        extra["tree_batch"] = {k: raw[k] for k in ("req_ids", "parents", "tokens", "prefix_lens")}
        ib = runner.input_batch
        extra["tree_context"] = {  # committed tokens before each tree's root (position P)
            rid: ib.token_ids_cpu[i, : meta["num_computed_tokens"][i] + 1].tolist()
            for i, rid in enumerate(meta["req_ids"])
            if rid in raw["req_ids"]
        }
        if len(tree["parents"]) == meta["num_real"]:  # every real slot is a tree node
            tree_md = tree
    meta["seq"] = st.seq
    items = cap.registry.get_all()
    TensorRegistry._instance, cap._prev_instance = cap._prev_instance, None
    if not items:
        return
    # both routes copy the tensors before the next step (the forward's outputs may live
    # in reused buffers on an accelerator): the writer process's pipe takes their bytes now
    tensors, names = [t for _, t in items], [n for n, _ in items]
    args = dict(
        req_ids=meta["req_ids"],
        positions=positions,
        is_prefill=meta["is_prefill"],
        tree=tree_md,
        padding_mask=padding,
        token_ids=token_ids,
        extra=extra,
    )
    seq, st.seq = st.seq, st.seq + 1
    if cap.writes is None:  # "async_writes": False: on disk before the next step
        cap.writer.write(tensors, names, **args)
        return
    phase = "prefill" if meta["is_prefill"] else "decode"
    where = os.path.join(cap.writer.capture_dir, f"dp{cap.writer.dp_rank}")
    cap.writes.submit(f"capture pass {seq} ({phase}, {slots} slots) under {where}",
                      tensors, names, **args)  # fmt: skip


def _wrap_execute_model(runner, orig: Callable) -> Callable:
    st = runner_state(runner)

    @functools.wraps(orig)
    def execute_model(scheduler_output, *args, **kwargs):
        for w in st.writer_processes():  # the last step's passes: written during this one
            w.release()
        st.scheduler_output = scheduler_output
        if st.replacer is not None:
            for new in scheduler_output.scheduled_new_reqs:
                if new.prompt_token_ids is not None:
                    st.replacer.register_request(new.req_id, new.prompt_token_ids)
        return orig(scheduler_output, *args, **kwargs)

    return execute_model


def _may_finish(runner, output: Any) -> bool:
    """Whether a request of this step may have finished (a stop token sampled, or its
    token budget nearly spent): then its captures are flushed before the output leaves."""
    req_ids = getattr(output, "req_ids", None)
    sampled = getattr(output, "sampled_token_ids", None)
    if req_ids is None or sampled is None:
        return True
    for i, rid in enumerate(req_ids):
        rs = runner.requests.get(rid)
        sp = getattr(rs, "sampling_params", None)
        if sp is None or sp.max_tokens is None or getattr(sp, "stop", None):
            return True  # stop strings finish a request in the front end, unseen here
        toks = list(sampled[i]) if i < len(sampled) else []
        if set(toks) & set(sp.all_stop_token_ids or ()):
            return True
        if len(rs.output_token_ids) + len(toks) + 2 + runner.num_spec_tokens >= sp.max_tokens:
            return True
    return False


def _wrap_sample_tokens(runner, orig: Callable) -> Callable:
    st = runner_state(runner)

    @functools.wraps(orig)
    def sample_tokens(*args, **kwargs):
        out = orig(*args, **kwargs)
        if st.writer_processes() and _may_finish(runner, out):
            for w in st.writer_processes():
                w.flush()
        return out

    return sample_tokens


def _wrap_load_model(runner, orig: Callable) -> Callable:
    @functools.wraps(orig)
    def load_model(*args, **kwargs):
        out = orig(*args, **kwargs)
        _setup(runner)
        return out

    return load_model


def enable_capture(runner) -> None:
    """Start writing captures (the worker calls it after warmup)."""
    st = getattr(runner, _STATE_ATTR, None)
    if st is None:
        return
    st.warmup_stats = compile_stats()
    for cap in (st.target, st.draft):
        if cap is not None:
            cap.enable()


# ----------------------------------------------------------------------------- install


def _init_runner(runner) -> None:
    cfg = accuracy_config(runner.vllm_config.additional_config)
    if not cfg:
        return
    if "tensor_capture" in cfg:
        check_capture_config(cfg["tensor_capture"])
    st = _RunnerState(cfg)
    st.async_writes = bool(cfg.get("tensor_capture", {}).get("async_writes", True))
    setattr(runner, _STATE_ATTR, st)
    runner.load_model = _wrap_load_model(runner, runner.load_model)
    runner.execute_model = _wrap_execute_model(runner, runner.execute_model)
    runner._model_forward = _wrap_model_forward(runner, runner._model_forward)
    runner.sample_tokens = _wrap_sample_tokens(runner, runner.sample_tokens)


def _patch_worker(cls) -> None:
    orig = cls.compile_or_warm_up_model
    if getattr(orig, "_treespec_accuracy", False):
        return

    @functools.wraps(orig)
    def compile_or_warm_up_model(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        enable_capture(getattr(self, "model_runner", None))
        return out

    compile_or_warm_up_model._treespec_accuracy = True
    cls.compile_or_warm_up_model = compile_or_warm_up_model
    orig_shutdown = getattr(cls, "shutdown", None)
    if orig_shutdown is not None:

        @functools.wraps(orig_shutdown)
        def shutdown(self, *args, **kwargs):
            st = getattr(getattr(self, "model_runner", None), _STATE_ATTR, None)
            for w in st.writer_processes() if st is not None else []:
                w.close()  # engine shutdown: every queued pass reaches the disk
            return orig_shutdown(self, *args, **kwargs)

        cls.shutdown = shutdown


def _patch_config_check() -> None:
    """Validate this tool's config in the process that builds the engine config, so a
    bad ``capture_dir`` or replacement source fails before any worker starts."""
    from vllm.config import VllmConfig

    orig = VllmConfig.__post_init__
    if getattr(orig, "_treespec_accuracy", False):
        return

    @functools.wraps(orig)
    def __post_init__(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        cfg = accuracy_config(self.additional_config)
        if "tensor_capture" in cfg:
            check_capture_config(cfg["tensor_capture"])
        rep = cfg.get("tensor_replacement")
        if isinstance(rep, dict) and not isinstance(rep, InMemoryReplacement):
            for key in ("tensors_path", "prompt_token_ids_path"):
                if rep.get(key) and not os.path.isfile(rep[key]):
                    raise ValueError(f"tensor_replacement.{key} '{rep[key]}' does not exist")
        return out

    __post_init__._treespec_accuracy = True
    VllmConfig.__post_init__ = __post_init__


def register() -> None:
    """vLLM plugin entry point (every process; idempotent). Installs only the config
    checks; runners are changed only when ``additional_config`` asks for this tool."""
    if _installed["done"]:
        return
    _installed["done"] = True
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig_init = GPUModelRunner.__init__

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        _init_runner(self)

    GPUModelRunner.__init__ = __init__
    for mod, name in (
        ("vllm.v1.worker.cpu_worker", "CPUWorker"),
        ("vllm.v1.worker.gpu_worker", "Worker"),
    ):
        try:
            import importlib

            _patch_worker(getattr(importlib.import_module(mod), name))
        except Exception as e:  # a platform without that worker
            logger.debug("treespec accuracy: %s.%s not patched (%s)", mod, name, e)
    _patch_config_check()


__all__ = [
    "InMemoryReplacement",
    "accuracy_config",
    "check_capture_config",
    "enable_capture",
    "flush_captures",
    "register",
    "replacement_config",
]
