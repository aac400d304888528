"""The plugin's configuration: ``additional_config["treespec"]``, checked at start-up.

>>> LLM(model=TARGET,
...     speculative_config={"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 8},
...     additional_config={"treespec": {"tree": "topk:k=2,depth=4,budget=8"}})

Keys of the ``treespec`` dict read here (other keys belong to the accuracy tooling):

- ``tree``: a tree spec (``tree_dev.spec``): ``topk:...``, ``chain:K``, ``paths:[...]``,
  ``medusa:NAME``, ``hybrid:...`` (the draft's top-K tree and the context's n-gram trie
  under one budget) with ``method`` ``draft_model`` or ``eagle``; ``ngram:budget=N,...``
  with ``method`` ``ngram``.
- ``kernel_backend``: ``kernels`` backend for tree attention and the walk (default: triton
  on CUDA, torch on the CPU).
- ``debug_disable``: ``"mask"``, ``"positions"`` or ``"compaction"`` turns that part of tree
  verification off; ``"draft_mask"`` drops the tree mask from the draft's forwards (every
  level through vLLM's causal kernel: wrong drafts, still lossless output). For tests that
  prove the checks can fail; never for serving.
- ``record_trees``: keep the first N proposed trees in the worker (for tests comparing the
  two engines' trees; ``worker_methods.worker_recorded_trees``).
- ``draft_sampling``: ``true`` draws a sampled request's (temperature > 0) draft children
  without replacement from the draft's distribution at the request's temperature (Gumbel
  top-k) and verifies them against those distributions (``tree_walk`` mode
  ``draft_probs``, SpecInfer's residual rule), as the local engine's
  ``Engine(draft_sampling=True)``. Static trees (``chain``/``paths``/``medusa``) with
  ``draft_model`` or ``eagle`` only. Greedy requests keep the top-ranked children.

Every mistake is a ``ValueError`` naming the field, raised when vLLM builds its config
(in the process that calls ``LLM(...)`` or starts the server), before any model loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tree_dev.spec import (
    DRAFT_OF_VLLM_METHOD,
    MODEL_DRAFTS,
    VLLM_METHOD,
    AutoTreePolicy,
    NoDraftPolicy,
    Policy,
    TreeSettings,
    draft_slots,
    is_ngram,
    parse_tree_spec,
)

KEY = "treespec"
MODEL_METHODS = tuple(VLLM_METHOD[kind] for kind in MODEL_DRAFTS)  # draft_model, eagle
DEBUG_SWITCHES = ("mask", "positions", "compaction", "draft_mask")
KERNEL_BACKENDS = ("auto", "torch", "reference", "triton")


@dataclass(frozen=True)
class TreeConfig:
    """The validated tree configuration of one engine: its ``TreeSettings`` (the tree, the
    draft kind of vLLM's method, draft sampling) and the plugin's own switches.

    >>> cfg = TreeConfig(TreeSettings.parse("chain:4", draft="eagle"))
    >>> cfg.method, cfg.num_draft_tokens, cfg.uses_draft_model
    ('eagle', 4, True)
    >>> cfg.with_policy(parse_tree_spec("chain:2")).spec
    'chain:2'
    """

    settings: TreeSettings
    kernel_backend: str = "auto"
    debug_disable: str | None = None
    record_trees: int = 0
    auto_objective: str = "tokens"

    def with_policy(self, policy: Policy) -> TreeConfig:
        """The same config with another tree of the same draft (``treespec_set_tree``)."""
        return dataclasses.replace(self, settings=dataclasses.replace(self.settings, policy=policy))

    @property
    def spec(self) -> str:
        return self.settings.spec

    @property
    def policy(self) -> Policy:
        return self.settings.policy

    @property
    def draft_sampling(self) -> bool:
        return self.settings.draft_sampling

    @property
    def method(self) -> str:
        """vLLM's speculative method: ``draft_model``, ``eagle`` or ``ngram``."""
        return self.settings.vllm_method

    @property
    def num_draft_tokens(self) -> int:
        """The tree's draft-node budget (= vLLM's ``num_speculative_tokens``)."""
        return self.settings.draft_budget

    @property
    def uses_draft_model(self) -> bool:
        return self.method in MODEL_METHODS


def lookahead_slots(section: dict, speculative_config: Any) -> int:
    """KV slots vLLM must reserve past a request's scheduled tokens for this tree.

    After a step that accepted ``a`` of its ``n`` scheduled drafts, the new root sits at
    ``C + a + 1`` (``C``: the step's first position) and the drafter writes forwarded node
    ``j`` at ``root + j``, up to ``root + draft_slots``; vLLM reserved up to ``C + n +
    lookahead``. With ``a = n`` (a chain, or a tree the scheduler cut to a chain, all
    accepted) that needs ``draft_slots + 1``: for ``chain:K`` exactly vLLM's own ``K``.
    0 for the n-gram trie (nothing is forwarded). A malformed section gives 0 here; the
    config check names its error.
    """
    if getattr(speculative_config, "method", None) not in MODEL_METHODS:
        return 0
    try:
        return draft_slots(parse_tree_spec(section.get("tree"))) + 1
    except (ValueError, TypeError, AttributeError):
        return 0


def tree_section(additional_config: Any) -> dict | None:
    """The ``treespec`` dict of an ``additional_config``, if the tree plugin is asked for."""
    if not isinstance(additional_config, dict):
        return None
    section = additional_config.get(KEY)
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ValueError(f"additional_config[{KEY!r}] must be a dict, got {type(section).__name__}")
    return section if "tree" in section else None


def parse(
    section: dict, speculative_config: Any, kv_cache_dtype: str = "auto", device: str = "cpu"
) -> TreeConfig:
    """Validate the ``treespec`` section against vLLM's speculative config."""
    settings = _settings(section, speculative_config)
    policy = settings.policy
    if is_ngram(policy) and not policy.range_given:
        policy = _with_lookup_range(policy, speculative_config)
        settings = dataclasses.replace(settings, policy=policy)
    elif isinstance(policy, AutoTreePolicy):  # each trie candidate takes the range too
        cands = tuple(
            (
                _with_lookup_range(p, speculative_config)
                if is_ngram(p) and not p.range_given
                else p,
                s,
            )
            for p, s in policy.candidates
        )
        policy = dataclasses.replace(policy, candidates=cands)
        settings = dataclasses.replace(settings, policy=policy)
    settings.check_num_speculative_tokens(
        getattr(speculative_config, "num_speculative_tokens", None),
        field="speculative_config num_speculative_tokens",
    )
    backend = _kernel_backend(section, policy, settings.spec, device)
    debug, record = _options(section, kv_cache_dtype)
    return TreeConfig(settings, backend, debug, record, _auto_objective(section, policy))


def _auto_objective(section: dict, policy: Policy) -> str:
    """The ``auto_objective`` key of ``tree: auto``: what a step's choice maximises
    (``auto.makespan_applies``, ``auto.makespan_weights``). ``tokens`` (the default):
    the batch's expected tokens per second, every request's token alike (a server: a
    request that ends frees its slot for the next). ``makespan``: the same while
    requests wait for a slot; once none waits (an offline batch's last wave), a token is
    worth what it shortens the batch."""
    from tree_dev.auto import OBJECTIVES

    objective = section.get("auto_objective", "tokens")
    if objective not in OBJECTIVES:
        raise ValueError(
            f"additional_config['treespec']['auto_objective'] = {objective!r}; "
            f"expected one of {OBJECTIVES}"
        )
    if "auto_objective" in section and not isinstance(policy, AutoTreePolicy):
        raise ValueError(
            "additional_config['treespec']['auto_objective'] is for tree 'auto'; "
            f"the tree is {section.get('tree')!r}"
        )
    return objective


def _settings(section: dict, speculative_config: Any) -> TreeSettings:
    """The ``tree`` key (a spec string other than ``none``) with ``draft_sampling``, drafted
    by the kind of vLLM's method (``TreeSettings.parse`` checks that it runs the tree)."""
    key = f"additional_config[{KEY!r}]"
    spec = section.get("tree")
    if not isinstance(spec, str):
        raise ValueError(f"{key}['tree'] must be a tree spec string, got {spec!r}")
    try:
        policy = parse_tree_spec(spec)
    except ValueError as e:
        raise ValueError(f"{key}['tree']: {e}") from None
    if isinstance(policy, NoDraftPolicy):
        raise ValueError(f"{key}['tree'] is 'none': drop speculative_config instead")
    method = _method(spec, speculative_config)
    return TreeSettings.parse(
        policy,
        section.get("draft_sampling", False),
        draft=DRAFT_OF_VLLM_METHOD[method],
        sampling_field=f"{key}['draft_sampling']",
        draft_field=f"{key}['tree'] does not fit speculative_config method {method!r}",
    )


def _method(spec: str, speculative_config: Any) -> str:
    """vLLM's speculative method, one the plugin can draft trees with."""
    if speculative_config is None:
        raise ValueError(
            f"additional_config['treespec']['tree'] = {spec!r} needs a speculative_config "
            "(method draft_model, eagle or ngram, num_speculative_tokens = the tree's budget)"
        )
    method = getattr(speculative_config, "method", None)
    if method not in DRAFT_OF_VLLM_METHOD:
        raise ValueError(
            f"speculative_config method {method!r} cannot run trees; use draft_model, "
            "eagle or ngram with additional_config['treespec']['tree']"
        )
    return method


def _kernel_backend(section: dict, policy: Policy, spec: str, device: str) -> str:
    """The ``kernel_backend`` key, resolved, checked to hold the tree's nodes."""
    backend = section.get("kernel_backend", "auto")
    if backend not in KERNEL_BACKENDS:
        raise ValueError(
            f"additional_config['treespec']['kernel_backend'] = {backend!r}; "
            f"expected one of {KERNEL_BACKENDS}"
        )
    if backend == "auto":
        backend = "triton" if device == "cuda" else "torch"
    import kernels

    fn = kernels._resolve("tree_attention", backend, _device(device))
    limit = getattr(fn, "max_tree_nodes", None)
    if limit is not None and policy.max_nodes > limit:
        raise ValueError(
            f"additional_config['treespec']['tree'] = {spec!r} has {policy.max_nodes} nodes; "
            f"the {backend!r} tree attention supports at most {limit}"
        )
    return backend


def _options(section: dict, kv_cache_dtype: str) -> tuple[str | None, int]:
    """``debug_disable`` and ``record_trees`` (and the KV dtype), checked."""
    debug = section.get("debug_disable")
    if debug is not None and debug not in DEBUG_SWITCHES:
        raise ValueError(
            f"additional_config['treespec']['debug_disable'] = {debug!r}; "
            f"expected one of {DEBUG_SWITCHES}"
        )
    if kv_cache_dtype not in ("auto", None) and "fp8" in str(kv_cache_dtype):
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} is not supported with tree verification "
            "(use 'auto')"
        )
    record = section.get("record_trees", 0)
    if isinstance(record, bool) or not isinstance(record, int) or record < 0:
        raise ValueError(
            f"additional_config['treespec']['record_trees'] = {record!r}; expected an int >= 0"
        )
    return debug, record


#: What vLLM 0.32 writes into ``prompt_lookup_min`` / ``prompt_lookup_max`` when the user
#: gives neither (``SpeculativeConfig.__post_init__``; "arbitrarily chosen" in its source).
#: The plugin cannot tell that pair from one the user gave, and reads it as "not given":
#: on the real model's held-out text 5-grams cut the trie's tau from 1.51 to 1.21
#: (``bench.trie_replay``). ``ngram:...,min=5,max=5`` asks for 5-grams explicitly.
VLLM_LOOKUP_FILL = (5, 5)


def _with_lookup_range(policy: Policy, speculative_config: Any) -> Policy:
    """An ``ngram:`` trie without ``min=``/``max=`` takes vLLM's ``prompt_lookup_min`` /
    ``prompt_lookup_max`` (the n-gram range of vLLM's own ``ngram`` method) where the
    user set them (not vLLM's fill-in ``VLLM_LOOKUP_FILL``)."""
    lo = getattr(speculative_config, "prompt_lookup_min", None)
    hi = getattr(speculative_config, "prompt_lookup_max", None)
    if not lo or not hi or (lo, hi) == VLLM_LOOKUP_FILL:
        return policy
    if lo > hi:
        raise ValueError(
            f"speculative_config prompt_lookup_min = {lo} exceeds prompt_lookup_max = {hi}"
        )
    return dataclasses.replace(policy, min_n=int(lo), max_n=int(hi), range_given=True)


def _device(device: str):
    import torch

    return torch.device("cuda" if device == "cuda" else "cpu")
