"""EAGLE inside vLLM: the target's features a request's draft has not consumed yet.

An EAGLE draft consumes pairs ``(x_{k+1}, h_k)``: the next token and the target's feature
(its last hidden state) at position ``k``. vLLM hands the verify forward's hidden states to
``propose_draft_token_ids``; this history keeps, per request, the features of its newly
committed positions (a tree request's accepted nodes, a plain request's scheduled rows)
until the draft's catch-up consumes them. ``draft_len`` (shared with the runner) is how
many sequence elements the request's draft cache holds.
"""

from __future__ import annotations

import numpy as np
import torch


class FeatureHistory:
    """Per request: ``(first position, [k, H] features)`` of unconsumed committed positions."""

    def __init__(self, draft_len: dict[str, int]):
        self.draft_len = draft_len
        self.feats: dict[str, tuple[int, torch.Tensor]] = {}

    def forget(self, rid: str) -> None:
        self.feats.pop(rid, None)

    def keep(
        self,
        hidden_states: torch.Tensor,
        step: tuple[list[str], np.ndarray, np.ndarray, np.ndarray],
        accepted: dict[str, list[int]],
    ) -> None:
        """Keep this step's features of the newly committed positions.

        Args:
            hidden_states: ``[T, H]`` the verify forward's last hidden states, per query row.
            step: ``(request ids, first query row, computed tokens, scheduled tokens)`` per
                batch row, as the step was prepared.
            accepted: the tree requests' accepted nodes, root first (others committed every
                scheduled row).
        """
        rids, q0, computed, scheduled = step
        for i, rid in enumerate(rids):
            nodes = accepted.get(rid)
            if nodes is not None:
                rows = [int(q0[i]) + j for j in nodes]
            else:
                rows = list(range(int(q0[i]), int(q0[i]) + int(scheduled[i])))
            if not rows:
                continue
            h = hidden_states[torch.tensor(rows, dtype=torch.int64)].clone()
            pos = int(computed[i])
            prev = self.feats.get(rid)
            if prev is not None and prev[0] + len(prev[1]) == pos:
                self.feats[rid] = (prev[0], torch.cat([prev[1], h]))
            elif prev is None and pos == self.draft_len.get(rid, pos):
                self.feats[rid] = (pos, h)
                self.draft_len[rid] = pos
            else:
                self.feats[rid] = (pos, h)
                self.draft_len[rid] = pos  # history lost: draft KV from here on

    def catch_up(self, rid: str, seq_len: int) -> tuple[int, torch.Tensor] | None:
        """``(start, [seq_len - start, H] features)`` for the draft's catch-up of a request
        whose draft sequence has ``seq_len`` elements; None (and the request's history and
        draft cache forgotten) when the features it needs were never kept."""
        start = self.draft_len.get(rid, 0)
        first, feats = self.feats.get(rid, (None, None))
        if first is None or first > start or first + len(feats) != seq_len:
            self.feats.pop(rid, None)
            self.draft_len.pop(rid, None)
            return None
        return start, feats[start - first :]

    def consumed(self, rid: str, cached: int, seq_len: int) -> None:
        """The draft consumed the sequence up to ``cached``: drop those features."""
        if cached == seq_len:
            self.feats.pop(rid, None)  # consumed up to the root
        else:
            first, feats = self.feats[rid]
            self.feats[rid] = (cached, feats[cached - first :])
