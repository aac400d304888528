"""Module-name patterns: ranges (``model.layers.0-31``), regexes, the ``visual.`` prefix."""

from __future__ import annotations

import difflib
import itertools
import re

import torch.nn as nn

VISION_PREFIX = "visual."
_RANGE_RE = re.compile(r"^(\d+)-(\d+)$")
_BAD_RANGE_RE = re.compile(r"^\d*-\d*$|^\d+-\w*$|^\w*-\d+$")


def expand_patterns(patterns: list[str]) -> list[str]:
    """Expand numeric ranges in dotted patterns, keep everything else verbatim.

    ``"model.layers.0-2"`` -> ``model.layers.0``, ``.1``, ``.2``; a range may sit
    anywhere (``model.layers.0-1.self_attn``) and several ranges expand as a product.
    Raises ValueError for a malformed range (``5-2``, ``0-``, ``1-x``).
    """
    if isinstance(patterns, str):
        raise ValueError("patterns must be a list of strings, not a single string")
    out: list[str] = []
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"invalid module pattern {pattern!r}")
        parts = pattern.split(".")
        choices: list[list[str]] = []
        for part in parts:
            m = _RANGE_RE.match(part)
            if m:
                lo, hi = int(m.group(1)), int(m.group(2))
                if lo > hi:
                    raise ValueError(
                        f"malformed range '{part}' in pattern '{pattern}': {lo} > {hi}"
                    )
                choices.append([str(i) for i in range(lo, hi + 1)])
            elif "-" in part and _BAD_RANGE_RE.match(part) and any(c.isdigit() for c in part):
                raise ValueError(
                    f"malformed range '{part}' in pattern '{pattern}' (expected <start>-<end>)"
                )
            else:
                choices.append([part])
        out.extend(".".join(c) for c in itertools.product(*choices))
    return out


def _compile(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"module pattern '{pattern}' is not a valid regex: {e}") from e


def match_modules(model: nn.Module, patterns: list[str], strict: bool = True) -> list[str]:
    """Names of ``model``'s submodules matching any pattern, in ``named_modules`` order.

    Every pattern is a regex matched with ``fullmatch`` after range expansion.
    With ``strict`` (default) a pattern that matches no module raises ValueError
    naming it and the closest module names.
    """
    expanded = expand_patterns(patterns)
    compiled = [(p, _compile(p)) for p in expanded]
    names = [n for n, _ in model.named_modules() if n]
    matched: list[str] = []
    hits = {p: 0 for p in expanded}
    for name in names:
        for raw, rx in compiled:
            if rx.fullmatch(name):
                hits[raw] += 1
                if name not in matched:
                    matched.append(name)
    if strict:
        missing = [p for p, h in hits.items() if h == 0]
        if missing:
            hint = difflib.get_close_matches(missing[0], names, n=3, cutoff=0.5)
            raise ValueError(
                f"unknown module pattern(s) {missing}: no submodule of "
                f"{type(model).__name__} matches" + (f"; closest names: {hint}" if hint else "")
            )
    return matched


def split_vision_patterns(patterns: list[str]) -> tuple[list[str], list[str]]:
    """Split into (text patterns, vision patterns with the ``visual.`` prefix stripped)."""
    text, vision = [], []
    for p in patterns:
        if p.startswith(VISION_PREFIX):
            vision.append(p[len(VISION_PREFIX) :])
        else:
            text.append(p)
    return text, vision
