"""The plugin's statistics, as subscribers of the runner's step events.

``Stats`` is what ``llm.collective_rpc("treespec_tree_stats")`` and the server's
``/metrics`` report: per-depth acceptance, walks per mode, fallbacks, draft forwards by
attention path and seconds by phase. ``StepRecorder`` keeps the next ``n`` step events
for tests (``llm.collective_rpc("treespec_record_steps", args=(n,))``). Both subscribe
to ``TreeRunner.on_step`` with ``tree_dev.step.StepEvent``, the event the local engine's
``Engine.on_step`` sends.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tree_dev.step import DepthStats, StepEvent


@dataclass
class Stats:
    """One runner's tree steps: per-depth acceptance, fallbacks, walks, timings."""

    depth: DepthStats = field(default_factory=DepthStats)
    fallback_requests: int = 0
    walks: dict[str, int] = field(default_factory=dict)  # requests walked per mode
    # draft forwards by attention path: "causal" (vLLM's kernel), "tree" (tree attention)
    draft_forwards: dict[str, int] = field(default_factory=lambda: {"causal": 0, "tree": 0})
    # steps by what sampled them: "plain" (no draft in the batch: vLLM's non-speculative
    # inputs and sampler), "trees_only" (the walk alone), "bonus_rows" (vLLM's sampler on
    # the requests' last rows, then the walk), "rejection" (vLLM's rejection sampler:
    # logprobs asked)
    sampler_steps: dict[str, int] = field(
        default_factory=lambda: {"plain": 0, "trees_only": 0, "bonus_rows": 0, "rejection": 0}
    )
    # take_draft_token_ids calls from vLLM's engine core (0 while the drafts travel with
    # each step's output: TreeRunner.drafts_in_output)
    draft_token_rpcs: int = 0
    seconds: dict[str, float] = field(
        default_factory=lambda: {"walk": 0.0, "compact": 0.0, "propose": 0.0, "tree_attention": 0.0}
    )

    def record(self, event: StepEvent) -> None:
        """Count one verify step (a ``TreeRunner.on_step`` subscriber)."""
        for req in event.requests:
            self.depth.record(req.max_depth, len(req.accepted) - 1)
            self.walks[req.mode] = self.walks.get(req.mode, 0) + 1
        for phase, seconds in event.timings.items():
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def as_dict(self) -> dict:
        d = self.depth
        return {
            "tree_steps": d.steps,
            "tokens_per_step": d.tokens_per_step(),
            "acceptance_per_depth": d.acceptance_per_depth(),
            "depth_tried": list(d.tried),
            "depth_accepted": list(d.accepted),
            "fallback_requests": self.fallback_requests,
            "walks": dict(self.walks),
            "draft_forwards": dict(self.draft_forwards),
            "sampler_steps": dict(self.sampler_steps),
            "draft_token_rpcs": self.draft_token_rpcs,
            "seconds": dict(self.seconds),
        }


@dataclass
class StepRecorder:
    """Keeps the next ``limit`` step events, as plain dicts (they cross processes)."""

    limit: int = 0
    events: list[dict] = field(default_factory=list)

    def record(self, event: StepEvent) -> None:
        if len(self.events) < self.limit:
            self.events.append(dataclasses.asdict(event))
