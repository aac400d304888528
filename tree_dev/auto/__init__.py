"""``tree: "auto"``'s decision core: per step, per request, the tree that maximises the
batch's expected tokens per second (issue 34). Engine-independent: no models, no engines.

Four parts, each usable alone:

1. **What a candidate costs** (``shapes``: ``policy_shape``, ``Candidate``): a policy's
   verify rows, draft levels, draft rows and whether its tree branches, and its depth.
2. **What a step costs** (``cost_model``: ``CostModel``): seconds = ``a + b*verify_rows
   + c*draft_levels + d*draft_rows + e*branched``, non-negative coefficients fitted by
   least squares on steps timed at start-up (``measure``), cached as JSON per model and machine
   (``load_cost_model`` / ``save_cost_model`` / ``load_or_measure``), corrected online by
   a decayed, bounded ratio of measured to predicted seconds.
3. **What a candidate yields** (``acceptance``: ``AcceptanceTracker``): per request, per
   candidate, per temperature class (greedy / sampled), decayed per-depth acceptance
   counts, blended with a shared prior per (candidate, class); expected tokens per step =
   ``1 + sum_d P(accepted length >= d)``. Untried trees start optimistic, and every few
   engine steps one request per temperature class is offered a tree it has not run
   lately at an upper bound (a deterministic probe slot), so acceptance that recovers is
   found again. N-gram tries cost nothing to build: each step's are built before the
   choice (``step_tries``), priced at their own nodes, and scored whether run or not
   (trie shadows, ``trie_walk``).
4. **The choice** (``chooser``: ``choose``): per request, the candidate maximising the
   batch's ``sum(expected tokens) / predicted step seconds``; ``AutoPolicy`` ties 2-4
   together for an engine (choose before a step, record its ``RequestStep``s and seconds
   after) and keeps ``AutoStats``.

The choice only shapes trees: verification stays lossless whatever is chosen. It depends
on the recorded steps and the cost model's coefficients only (no clock inside; the online
correction scales every cost alike, so it never changes a choice): with a cached or given
cost model, the same steps give the same choices.
"""

from tree_dev.auto.acceptance import AcceptanceTracker
from tree_dev.auto.chooser import (
    OBJECTIVES,
    AutoPolicy,
    AutoStats,
    StepOutcome,
    StepRecord,
    batch_shape,
    check_objective,
    choose,
    makespan_applies,
    makespan_weights,
)
from tree_dev.auto.cost_model import (
    CostModel,
    cache_key,
    cache_path,
    default_cache_dir,
    default_shapes,
    load_cost_model,
    load_or_measure,
    machine_fingerprint,
    measure,
    save_cost_model,
)
from tree_dev.auto.shapes import (
    CLASSES,
    Candidate,
    Shape,
    Trie,
    is_branched,
    make_candidates,
    policy_shape,
    step_tries,
    temperature_class,
    tree_depth,
    trie_walk,
    with_catch_up,
)

__all__ = [
    "CLASSES",
    "OBJECTIVES",
    "AcceptanceTracker",
    "AutoPolicy",
    "AutoStats",
    "Candidate",
    "CostModel",
    "Shape",
    "StepOutcome",
    "StepRecord",
    "batch_shape",
    "cache_key",
    "cache_path",
    "check_objective",
    "default_cache_dir",
    "choose",
    "default_shapes",
    "is_branched",
    "load_cost_model",
    "load_or_measure",
    "machine_fingerprint",
    "make_candidates",
    "makespan_applies",
    "makespan_weights",
    "measure",
    "policy_shape",
    "save_cost_model",
    "temperature_class",
    "tree_depth",
    "Trie",
    "step_tries",
    "trie_walk",
    "with_catch_up",
]
