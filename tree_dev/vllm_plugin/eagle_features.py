"""EAGLE inside vLLM: the target's features a request's draft has not consumed yet.

An EAGLE draft consumes pairs ``(x_{k+1}, h_k)``: the next token and the target's feature
(its last hidden state) at position ``k``. vLLM hands the verify forward's hidden states to
``propose_draft_token_ids``; this history keeps, per request, the features of its newly
committed positions (a tree request's accepted nodes, a plain request's scheduled rows)
until the draft's catch-up consumes them. ``draft_len`` (shared with the runner) is how
many sequence elements the request's draft cache holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class _Kept:
    """One request's kept features: positions ``first`` to ``end`` (exclusive), in
    ``chunks`` of ``[k, H]`` as the steps kept them."""

    first: int
    chunks: list[torch.Tensor]
    end: int

    def joined(self) -> torch.Tensor:
        """``[end - first, H]``, the chunks joined once (and kept joined)."""
        if len(self.chunks) > 1:
            self.chunks = [torch.cat(self.chunks)]
        return self.chunks[0]


class FeatureHistory:
    """Per request: ``(first position, [k, H] features)`` of unconsumed committed positions.

    A request that drafts nothing for many steps gains one row a step: its rows are kept
    as the steps' chunks and joined once, when its draft catches up (``catch_up``), not
    copied whole every step.
    """

    def __init__(self, draft_len: dict[str, int]):
        self.draft_len = draft_len
        self._kept: dict[str, _Kept] = {}

    def forget(self, rid: str) -> None:
        self._kept.pop(rid, None)

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
        rows: list[int] = []
        spans = []  # (request, its first position, its rows' span in ``rows``)
        for i, rid in enumerate(rids):
            nodes = accepted.get(rid)
            start = int(q0[i])
            if nodes is not None:
                rows.extend(start + j for j in nodes)
            else:
                rows.extend(range(start, start + int(scheduled[i])))
            spans.append((rid, int(computed[i]), len(rows)))
        if not rows:
            return
        picked = hidden_states[torch.tensor(rows, dtype=torch.int64)]  # one gather, a copy
        begin = 0
        for rid, pos, end in spans:
            if end == begin:
                continue
            h = picked[begin:end]
            begin = end
            kept = self._kept.get(rid)
            if kept is not None and kept.end == pos:  # contiguous
                kept.chunks.append(h)
                kept.end += len(h)
            else:  # the first rows, or the history lost: the draft KV from here on
                self._kept[rid] = _Kept(pos, [h], pos + len(h))
                self.draft_len[rid] = pos

    def catch_up(self, rid: str, seq_len: int) -> tuple[int, torch.Tensor] | None:
        """``(start, [seq_len - start, H] features)`` for the draft's catch-up of a request
        whose draft sequence has ``seq_len`` elements; None (and the request's history and
        draft cache forgotten) when the features it needs were never kept."""
        start = self.draft_len.get(rid, 0)
        kept = self._kept.get(rid)
        if kept is None or kept.first > start or kept.end != seq_len:
            self.forget(rid)
            self.draft_len.pop(rid, None)
            return None
        return start, kept.joined()[start - kept.first :]

    def consumed(self, rid: str, cached: int, seq_len: int) -> None:
        """The draft consumed the sequence up to ``cached``: drop those features."""
        if cached == seq_len:
            self.forget(rid)  # consumed up to the root
            return
        kept = self._kept[rid]
        kept.chunks = [kept.joined()[cached - kept.first :]]
        kept.first = cached
