"""The local engine's requests: sampling parameters, per-request state (with the commit
of a step's tokens and the stop rules), and what a step reports (``StepOutput``; the
core's ``StepEvent`` goes to ``Engine.on_step`` subscribers)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tree_dev.step import DepthStats, RequestStep, StepEvent, walk_mode

__all__ = ["Request", "RequestStep", "SamplingParams", "StepEvent", "StepOutput"]


@dataclass
class SamplingParams:
    """Per-request decoding parameters (OpenAI-style).

    ``temperature == 0`` is greedy. ``seed`` makes sampling reproducible.
    ``stop_token_ids`` end the request (the stop token is kept in the output);
    ``ignore_eos`` keeps going past the model's EOS token.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


@dataclass
class Request:
    """One request's state. The committed text is ``prompt + output``; its last
    token is the ``root``, whose K/V is not in the target cache yet."""

    req_id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    output: list[int] = field(default_factory=list)
    target_len: int = 0  # committed tokens with K/V in the target cache
    draft_len: int = 0  # committed tokens with K/V in the draft cache
    pending: list[int] = field(default_factory=list)  # committed, not in draft cache; last = root
    pending_feats: torch.Tensor | None = None  # EAGLE: target feature before each pending token
    finished: bool = False
    finish_reason: str | None = None
    depth: DepthStats = field(default_factory=DepthStats)  # per-depth acceptance so far
    sampled_drafts: bool = False  # children drawn without replacement from the draft

    @property
    def root(self) -> int:
        return (self.prompt + self.output)[-1]

    @property
    def mode(self) -> str:
        return walk_mode(self.params.temperature, self.sampled_drafts)

    @property
    def steps(self) -> int:
        return self.depth.steps

    @property
    def accepted_drafts(self) -> int:
        return self.depth.accepted_drafts

    @property
    def depth_tried(self) -> list[int]:
        """Per depth: steps whose tree reached it."""
        return self.depth.tried

    @property
    def depth_accepted(self) -> list[int]:
        """Per depth: steps that accepted a draft token there."""
        return self.depth.accepted

    def commit(self, emitted: list[int], eos_ids: set[int], max_model_len: int) -> list[int]:
        """Append ``emitted`` up to the first stop condition (a stop token, an EOS token of
        ``eos_ids`` unless ``ignore_eos``: kept in the output, reason ``"stop"``;
        ``max_tokens`` or ``max_model_len`` reached: ``"length"``); returns what was
        appended."""
        new = []
        for t in emitted:
            new.append(t)
            self.output.append(t)
            if t in self.params.stop_token_ids or (t in eos_ids and not self.params.ignore_eos):
                self.finished, self.finish_reason = True, "stop"
                break
            if len(self.output) >= self.params.max_tokens:
                self.finished, self.finish_reason = True, "length"
                break
            if len(self.prompt) + len(self.output) >= max_model_len:
                self.finished, self.finish_reason = True, "length"
                break
        return new

    def stats(self) -> dict:
        """Speculative-decoding statistics of this request so far."""
        return {
            "steps": self.steps,
            "accepted_draft_tokens": self.accepted_drafts,
            "mean_accepted_length": (len(self.output) / self.steps) if self.steps else 0.0,
            "acceptance_per_depth": self.depth.acceptance_per_depth(),
        }


@dataclass
class StepOutput:
    """What one ``Engine.step`` produced for one request."""

    req_id: int
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None
