"""The engine thread of the local server and its Prometheus metrics.

One background thread owns the (not thread-safe) ``tree_dev.engine.Engine`` and runs
``Engine.step`` while there is work (continuous batching: requests join and leave
between steps). HTTP handlers hand ``Job``s to it through a thread-safe queue and
receive their tokens through an ``asyncio.Queue`` (``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from tree_dev.server.auto_metrics import auto_metrics_lines
from tree_dev.step import DepthStats

log = logging.getLogger("treespec.serve")

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """Counters for ``GET /metrics`` (Prometheus text format 0.0.4), written by hand.

    ``auto``: with ``tree: auto``, the engine's latest ``auto_stats()`` (snapshotted by the
    engine thread after each step), rendered by ``auto_metrics_lines``; None otherwise.
    """

    def __init__(self, max_accept: int):
        self.lock = threading.Lock()
        self.requests = {}  # finish_reason -> count
        self.rejected = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.step_buckets = [0] * len(STEP_BUCKETS)
        self.step_count = 0
        self.step_sum = 0.0
        self.accept_edges = tuple(range(1, max(max_accept, 1) + 1))
        self.accept_buckets = [0] * len(self.accept_edges)
        self.accept_count = 0
        self.accept_sum = 0
        self.depth = DepthStats()  # per-depth acceptance over every verify step
        self.running = 0
        self.waiting = 0
        self.auto: dict[str, Any] | None = None

    def observe_auto(self, stats: dict[str, Any] | None) -> None:
        """``tree: auto``'s statistics after a step (None: the tree is not auto)."""
        with self.lock:
            self.auto = stats

    def observe_step(self, seconds: float) -> None:
        with self.lock:
            self.step_count += 1
            self.step_sum += seconds
            for i, edge in enumerate(STEP_BUCKETS):
                if seconds <= edge:
                    self.step_buckets[i] += 1

    def observe_accept(self, length: int, max_depth: int) -> None:
        """One request's verify step: it emitted ``length`` tokens from a tree
        ``max_depth`` deep (``length - 1`` accepted drafts)."""
        with self.lock:
            self.accept_count += 1
            self.accept_sum += length
            for i, edge in enumerate(self.accept_edges):
                if length <= edge:
                    self.accept_buckets[i] += 1
            self.depth.record(max_depth, length - 1)

    def render(self) -> str:
        with self.lock:
            lines = [
                "# HELP treespec_requests_total Requests that ended, by finish reason.",
                "# TYPE treespec_requests_total counter",
            ]
            for reason in sorted(set(self.requests) | {"stop", "length", "abort"}):
                n = self.requests.get(reason, 0)
                lines.append(f'treespec_requests_total{{finish_reason="{reason}"}} {n}')
            lines += [
                "# HELP treespec_requests_rejected_total Requests refused with a 4xx.",
                "# TYPE treespec_requests_rejected_total counter",
                f"treespec_requests_rejected_total {self.rejected}",
                "# HELP treespec_requests_running Requests in the running batch.",
                "# TYPE treespec_requests_running gauge",
                f"treespec_requests_running {self.running}",
                "# HELP treespec_requests_waiting Requests queued for admission.",
                "# TYPE treespec_requests_waiting gauge",
                f"treespec_requests_waiting {self.waiting}",
                "# HELP treespec_prompt_tokens_total Prompt tokens of admitted requests.",
                "# TYPE treespec_prompt_tokens_total counter",
                f"treespec_prompt_tokens_total {self.prompt_tokens}",
                "# HELP treespec_generation_tokens_total Tokens generated.",
                "# TYPE treespec_generation_tokens_total counter",
                f"treespec_generation_tokens_total {self.generation_tokens}",
                "# HELP treespec_step_latency_seconds Wall time of one engine step.",
                "# TYPE treespec_step_latency_seconds histogram",
            ]
            for edge, n in zip(STEP_BUCKETS, self.step_buckets):
                lines.append(f'treespec_step_latency_seconds_bucket{{le="{edge}"}} {n}')
            lines += [
                f'treespec_step_latency_seconds_bucket{{le="+Inf"}} {self.step_count}',
                f"treespec_step_latency_seconds_sum {self.step_sum}",
                f"treespec_step_latency_seconds_count {self.step_count}",
                "# HELP treespec_accepted_length Tokens emitted per request per step "
                "(accepted drafts + bonus).",
                "# TYPE treespec_accepted_length histogram",
            ]
            for edge, n in zip(self.accept_edges, self.accept_buckets):
                lines.append(f'treespec_accepted_length_bucket{{le="{edge}"}} {n}')
            lines += [
                f'treespec_accepted_length_bucket{{le="+Inf"}} {self.accept_count}',
                f"treespec_accepted_length_sum {self.accept_sum}",
                f"treespec_accepted_length_count {self.accept_count}",
                "# HELP treespec_acceptance_per_depth Fraction of steps whose tree reached "
                "depth d that accepted a draft token at depth d.",
                "# TYPE treespec_acceptance_per_depth gauge",
            ]
            for d, rate in enumerate(self.depth.acceptance_per_depth()):
                lines.append(f'treespec_acceptance_per_depth{{depth="{d + 1}"}} {rate}')
            if self.auto is not None:
                lines += auto_metrics_lines(self.auto)
            return "\n".join(lines) + "\n"


@dataclass
class Job:
    """One request's link between its HTTP handler and the engine thread."""

    prompt: list[int]
    params: Any  # tree_dev.engine.SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    req_id: int | None = None


class EngineWorker:
    """Owns the engine in one thread; the only code that ever touches it.

    Events delivered to ``Job.events``: ``("accepted", req_id)`` or ``("error", msg)``
    first, then ``("tokens", [ids])`` any number of times, then
    ``("done", finish_reason, stats)``.
    """

    def __init__(self, engine, metrics: Metrics):
        self.engine = engine
        self.metrics = metrics
        engine.on_step(self._observe)
        # tree: auto's statistics (None for a fixed tree), read in the engine's thread
        stats_of = getattr(engine, "auto_stats", None)
        first = stats_of() if stats_of is not None else None
        self._auto_stats = stats_of if first is not None else None
        metrics.observe_auto(first)
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: dict[int, Job] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="treespec-engine", daemon=True)
        self.idle = threading.Event()  # set when the engine has nothing to do

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> None:
        self._inbox.put(("add", job, None))

    def abort(self, job: Job, reason: str = "abort") -> None:
        self._inbox.put(("abort", job, reason))

    @staticmethod
    def _deliver(job: Job, event: tuple) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, event)
        except RuntimeError:  # the handler's loop is closed: nobody listens any more
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._once()
            except Exception as e:  # keep serving: fail the requests in flight, not the server
                log.exception("engine step failed; failing %d requests", len(self._jobs))
                for job in list(self._jobs.values()):
                    try:
                        self.engine.abort(job.req_id)
                    except Exception:
                        log.exception("abort of request %s failed", job.req_id)
                    self._finish(job, "abort", error=f"engine error: {type(e).__name__}: {e}")
        self.idle.set()

    def _once(self) -> None:
        """Take new commands, then run one engine step if there is work."""
        eng = self.engine
        cmds = []
        if not eng.has_work():
            self.idle.set()
            try:
                cmds.append(self._inbox.get(timeout=0.05))
            except queue.Empty:
                return
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for cmd, job, reason in cmds:
            if cmd == "add":
                self._add(job)
            elif job.req_id in self._jobs:
                eng.abort(job.req_id)
                self._finish(job, reason)
        self._gauges()
        if not eng.has_work():
            return
        self.idle.clear()
        t0 = time.perf_counter()
        outs = eng.step()
        self.metrics.observe_step(time.perf_counter() - t0)
        if self._auto_stats is not None:  # before the step's tokens reach their clients
            self.metrics.observe_auto(self._auto_stats())
        for o in outs:
            job = self._jobs.get(o.req_id)
            if job is None:
                continue
            if o.new_tokens:
                with self.metrics.lock:
                    self.metrics.generation_tokens += len(o.new_tokens)
                self._deliver(job, ("tokens", list(o.new_tokens)))
            if o.finished:
                self._finish(job, o.finish_reason)
        self._gauges()

    def _gauges(self) -> None:
        with self.metrics.lock:
            self.metrics.running = len(self.engine.running)
            self.metrics.waiting = len(self.engine.waiting)

    def _add(self, job: Job) -> None:
        try:
            rid = self.engine.add_request(job.prompt, job.params)
        except ValueError as e:
            with self.metrics.lock:
                self.metrics.rejected += 1
            self._deliver(job, ("error", str(e)))
            return
        job.req_id = rid
        self._jobs[rid] = job
        with self.metrics.lock:
            self.metrics.prompt_tokens += len(job.prompt)
        self._deliver(job, ("accepted", rid))

    def _observe(self, event) -> None:
        """Each request's accepted length and per-depth acceptance of one verify step
        (``Engine.on_step``) -> metrics."""
        for rec in event.requests:
            self.metrics.observe_accept(len(rec.accepted), rec.max_depth)

    def _finish(self, job: Job, reason: str | None, error: str | None = None) -> None:
        req = self.engine.requests.pop(job.req_id, None)  # the engine keeps no history
        self._jobs.pop(job.req_id, None)
        stats = req.stats() if req is not None else {}
        with self.metrics.lock:
            key = reason or "abort"
            self.metrics.requests[key] = self.metrics.requests.get(key, 0) + 1
        if error is not None:
            self._deliver(job, ("error", error))
        self._deliver(job, ("done", reason, stats))
