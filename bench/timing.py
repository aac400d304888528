"""Shared GPU timing helper for the kernel benchmarks."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_or_eager(fn: Callable) -> tuple[Callable, bool]:
    """A CUDA-graph replay of ``fn`` when it captures (no host sync), else ``fn``.

    Returns ``(callable, captured)``; warms ``fn`` up twice on a side stream first.
    """
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay, True
    except Exception:  # noqa: BLE001 - a function with a host sync is timed eagerly
        torch.cuda.synchronize()
        return fn, False
