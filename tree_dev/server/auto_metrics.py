"""``tree: auto``'s statistics as Prometheus text, for both engines' ``/metrics``.

``auto_metrics_lines(stats)`` renders the statistics dict of ``tree: auto`` (the local
``Engine.auto_stats()``, or the ``"auto"`` key of the vLLM plugin's
``treespec_tree_stats``): which tree it chose for how many requests-steps, per request
class (greedy, sampled), and its cost model's predicted against measured step seconds.
Pure Python: the vLLM front imports it in vLLM's server process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _label(value: object) -> str:
    """A Prometheus label value, escaped (backslash, double quote, newline)."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: object) -> float | int:
    """A sample value: ints stay ints, bools become 0/1, anything else a float (NaN if
    it is not a number)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return float("nan")


def _metric(name: str, kind: str, help_text: str, samples: list[tuple[str, object]]) -> list[str]:
    """``# HELP`` / ``# TYPE`` and one line per ``(labels, value)`` (labels: ``""`` or
    ``'{a="b"}'``)."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{labels} {_number(value)}" for labels, value in samples]
    return lines


#: ``(stats key, metric, type, help)`` of the one-value metrics rendered when present
OPTIONAL = (
    (
        "mean_abs_rel_error",
        "treespec_auto_step_seconds_abs_rel_error",
        "gauge",
        "Mean |predicted / measured - 1| of the step seconds.",
    ),
    (
        "correction",
        "treespec_auto_cost_correction",
        "gauge",
        "Online correction factor of the cost model's predictions.",
    ),
    (
        "drafted_factor",
        "treespec_auto_cost_drafted_factor",
        "gauge",
        "Online factor on what a step's drafts add to its seconds over the cost model's.",
    ),
    (
        "drafted_offset",
        "treespec_auto_cost_drafted_offset_seconds",
        "gauge",
        "Online seconds (before the correction) a step with drafts takes beyond the model.",
    ),
    (
        "trie_shadows",
        "treespec_auto_trie_shadows_total",
        "counter",
        "N-gram tries built but not run, scored against the tokens that followed.",
    ),
    (
        "rested",
        "treespec_auto_rested_total",
        "counter",
        "Request-steps given none without a choice: requests where nothing paid, resting.",
    ),
    (
        "weighted_steps",
        "treespec_auto_weighted_steps_total",
        "counter",
        "Choices where requests' tokens were weighted by what they shorten the batch "
        "(auto_objective makespan, no request waiting).",
    ),
    (
        "cost_model_measured",
        "treespec_auto_cost_model_measured",
        "gauge",
        "1 when the cost model was fitted on this machine's steps, 0 for the start-up guess.",
    ),
)


def parse_samples(text: str, prefix: str = "") -> dict[str, float]:
    """Prometheus text -> ``{'name{labels}': value}`` of its samples whose metric name
    starts with ``prefix`` (comments and blank lines skipped): what a client of
    ``/metrics`` reads back (``bench.serve_load``, the tests).

    >>> parse_samples('# HELP x\\ntreespec_auto_steps_total 7\\nvllm:x 1\\n', "treespec_")
    {'treespec_auto_steps_total': 7.0}
    """
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and line.startswith(prefix):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def auto_metrics_lines(stats: Mapping[str, Any]) -> list[str]:
    """Prometheus text lines of ``tree: auto``'s statistics (``auto.AutoStats.as_dict``,
    plus the vLLM plugin's ``cost_model`` and ``cost_model_measured`` when present).

    ``treespec_auto_choices_total{class, tree}`` counts requests-steps per chosen tree
    (``none`` included), so its sum is the number of requests-steps auto decided;
    ``treespec_auto_predicted_step_seconds`` / ``treespec_auto_measured_step_seconds`` are
    the means over the measured steps.

    >>> s = {"steps": 2, "choices_by_class": {"greedy": {"chain:4": 3}, "sampled": {}},
    ...      "measured_steps": 2, "mean_predicted_s": 0.01, "mean_measured_s": 0.02}
    >>> [ln for ln in auto_metrics_lines(s) if not ln.startswith("#")][:2]
    ['treespec_auto_steps_total 2', 'treespec_auto_choices_total{class="greedy",tree="chain:4"} 3']
    """
    by_class = stats.get("choices_by_class") or {}
    choices = [
        (f'{{class="{_label(cls)}",tree="{_label(tree)}"}}', n)
        for cls, per in sorted(by_class.items())
        for tree, n in sorted((per or {}).items())
    ]
    lines = _metric(
        "treespec_auto_steps_total",
        "counter",
        "Engine steps whose trees were chosen by tree: auto.",
        [("", stats.get("steps", 0))],
    )
    lines += _metric(
        "treespec_auto_choices_total",
        "counter",
        "Requests-steps per tree chosen by tree: auto (none included), by request class.",
        choices,
    )
    lines += _metric(
        "treespec_auto_measured_steps_total",
        "counter",
        "Steps whose seconds were measured against the cost model's prediction.",
        [("", stats.get("measured_steps", 0))],
    )
    for key, name, what in (
        ("mean_predicted_s", "treespec_auto_predicted_step_seconds", "predicted by the cost model"),
        ("mean_measured_s", "treespec_auto_measured_step_seconds", "measured"),
        (
            "last_predicted_s",
            "treespec_auto_last_predicted_step_seconds",
            "predicted, of the last measured step",
        ),
        ("last_measured_s", "treespec_auto_last_measured_step_seconds", "measured, last step"),
    ):
        if key in stats:
            help_text = f"Step seconds {what}" + (
                " (mean over measured steps)." if key.startswith("mean") else "."
            )
            lines += _metric(name, "gauge", help_text, [("", stats[key])])
    for key, name, kind, help_text in OPTIONAL:
        if key in stats:
            lines += _metric(name, kind, help_text, [("", stats[key])])
    cost = stats.get("cost_model")
    if isinstance(cost, Mapping) and cost:
        lines += _metric(
            "treespec_auto_cost_model_coefficient",
            "gauge",
            "The step cost model's coefficients: seconds = a + b*verify_rows + "
            "c*draft_levels + d*draft_rows + e*branched + f*drafted + g*requests "
            "(before the correction).",
            [(f'{{name="{_label(k)}"}}', v) for k, v in sorted(cost.items())],
        )
    return lines
