"""Helpers shared by the end-to-end benchmarks."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TARGET = Path(__file__).resolve().parents[1] / "checkpoints" / "stdlib-v1" / "target"


def named_by(words: str | None, name: str) -> bool:
    """Whether ``name`` holds one of the comma-separated substrings ``words`` (a
    benchmark's ``--only`` / ``--cells``); None or empty: every name.

    >>> named_by("auto,min=3", "tree ngram ngram:budget=4,min=3"), named_by(None, "x")
    (True, True)
    """
    if not words:
        return True
    return any(w.strip() and w.strip() in name for w in words.split(","))


def distinct_ratio(outputs: list[list[int]]) -> float:
    """Mean over outputs of distinct tokens / tokens (1.0: no token repeats; a loop
    of a few tokens gives a small ratio)."""
    ratios = [len(set(o)) / len(o) for o in outputs if o]
    return sum(ratios) / len(ratios) if ratios else 0.0


@contextlib.contextmanager
def environ(env: dict[str, str] | None) -> Iterator[None]:
    """Set ``env`` for the block and restore what was there (vLLM's workers read their
    switches from the environment when an engine starts)."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bench_llm(cfg: dict[str, Any], env: dict[str, str] | None = None, **kw: Any):
    """A vLLM ``LLM`` on the committed tiny target (fp32, 512 tokens, at most 4
    sequences, stats logged, seed 0) for one benchmark configuration, and its start-up
    seconds.

    ``cfg``: ``spec`` (a ``speculative_config`` or None), ``tree`` (the plugin's tree spec
    or None) and optionally ``draft_sampling``; ``env`` is set while the engine starts;
    ``kw`` overrides or adds ``LLM`` arguments."""
    from vllm import LLM

    from tree_dev.spec import TreeSettings

    args: dict[str, Any] = dict(
        model=str(TARGET),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=4,
        disable_log_stats=False,
        seed=0,
    )
    if cfg.get("spec") is not None:
        args["speculative_config"] = dict(cfg["spec"])
    if cfg.get("tree") is not None:  # the plugin's section, as TreeSettings writes it
        settings = TreeSettings.parse(cfg["tree"], bool(cfg.get("draft_sampling")))
        section = {**settings.treespec_section(), **(cfg.get("treespec") or {})}
        args["additional_config"] = {"treespec": section}
    args.update(kw)
    t0 = time.perf_counter()
    with environ(env):
        llm = LLM(**args)
    return llm, time.perf_counter() - t0
