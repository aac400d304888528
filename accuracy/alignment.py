"""Alignment and reconstruction helpers (the design's ``tensor_alignment_utils``).

Reconstruction functions follow the four-argument protocol
``fn(rank_tensors, module_name, phase, positions) -> Tensor``; the compare
framework also passes ``padding_mask=`` to functions that accept it.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .tensor_io import CapturedForwardPass


def num_real_tokens(positions: list[int], padding_mask: list[bool] | None = None) -> int:
    """Real (non-padded) slots: the explicit mask's False count, else the design's
    inference (slot 0 plus every slot whose position rises over its predecessor)."""
    if padding_mask is not None:
        return sum(1 for m in padding_mask if not m)
    return sum(1 for i, p in enumerate(positions) if i == 0 or p > positions[i - 1])


def default_reconstruction(rank_tensors, module_name, phase, positions):
    """TP-rank-0 default: every rank holds the full (all-reduced) tensor."""
    return rank_tensors[0]


def llama_reconstruct(rank_tensors, module_name, phase, positions, padding_mask=None):
    """All ranks identical after all-reduce. Use rank 0, strip padding.

    Padding is the explicit ``padding_mask`` (True = pad) when given, else inferred
    from positions that stop rising. Works on ``[T, ...]`` tensors.
    """
    tensor = rank_tensors[0]
    if padding_mask is not None:
        keep = torch.tensor([not m for m in padding_mask], dtype=torch.bool)
        if tensor.shape[0] != keep.numel():
            raise ValueError(
                f"{module_name}: padding_mask has {keep.numel()} slots, tensor {list(tensor.shape)}"
            )
        return tensor[keep]
    if positions:
        real = num_real_tokens(positions)
        if tensor.shape[0] > real:
            return tensor[:real]
    return tensor


def hf_reference_reconstruction(rank_tensors, module_name, phase, positions):
    """Single rank; extract last token for decode."""
    tensor = rank_tensors[0]
    if phase != "prefill" and tensor.dim() >= 2:
        return tensor[:, -1:, :] if tensor.dim() == 3 else tensor[-1:, :]
    return tensor


def align_and_truncate_hidden(t1, t2, t3):
    """Normalise three tensors for comparison.

    1. promote 2-D ``[T, H]`` to 3-D ``[1, T, H]``; 2. truncate the last (hidden)
    dim to the minimum of the three (hardware padding); 3. squeeze batch 1 back to
    2-D; 4. cast to float32. Returns ``(t1, t2, t3, shapes_match)``; on a mismatch of
    any other dim, the float32 inputs come back unchanged with ``shapes_match=False``.
    1-D tensors are only truncated.
    """
    ts = [t.detach().float() for t in (t1, t2, t3)]
    if all(t.dim() == 1 for t in ts):
        h = min(t.shape[0] for t in ts)
        return ts[0][:h], ts[1][:h], ts[2][:h], True
    if any(t.dim() == 0 for t in ts):
        ok = all(t.shape == ts[0].shape for t in ts)
        return ts[0], ts[1], ts[2], ok
    ts3 = [
        t.unsqueeze(0) if t.dim() == 2 else (t.view(1, 1, -1) if t.dim() == 1 else t) for t in ts
    ]
    if len({t.dim() for t in ts3}) != 1 or len({tuple(t.shape[:-1]) for t in ts3}) != 1:
        return ts[0], ts[1], ts[2], False
    h = min(t.shape[-1] for t in ts3)
    out = [t[..., :h] for t in ts3]
    if out[0].dim() == 3 and out[0].shape[0] == 1:
        out = [t.squeeze(0) for t in out]
    return out[0], out[1], out[2], True


def group_by_prompt(fwds: list[CapturedForwardPass]) -> OrderedDict[str, list[CapturedForwardPass]]:
    """``prompt_{i}`` -> that prompt's forward passes in order (step 0 = prefill).

    A pass belongs to the prompt of its first request id; prompts are numbered in
    order of first appearance. Passes without request ids form ``prompt_0``.
    """
    keys: dict[str, str] = {}
    out: OrderedDict[str, list[CapturedForwardPass]] = OrderedDict()
    for fwd in fwds:
        rid = fwd.metadata.req_ids[0] if fwd.metadata.req_ids else ""
        if rid not in keys:
            keys[rid] = f"prompt_{len(keys)}"
        out.setdefault(keys[rid], []).append(fwd)
    return out


def _max_pos(fwd: CapturedForwardPass) -> int:
    return max(fwd.metadata.positions) if fwd.metadata.positions else -1


def align_decode_captures(
    ref: list[CapturedForwardPass], target: list[CapturedForwardPass]
) -> list[CapturedForwardPass]:
    """Keep the ref decode steps whose position has a matching target decode step.

    Per prompt (numbered in order of appearance on each side): decode passes are
    sorted by ``max(positions)``; a ref step is kept when a target step has the same
    ``max(positions)`` (first one wins on duplicates). Prefill passes are kept as is.
    """
    tgt_groups = list(group_by_prompt(target).values())
    out: list[CapturedForwardPass] = []
    for i, fwds in enumerate(group_by_prompt(ref).values()):
        tgt = tgt_groups[i] if i < len(tgt_groups) else []
        tgt_pos = {_max_pos(f) for f in tgt if not f.is_prefill}
        out.extend(f for f in fwds if f.is_prefill)
        seen: set[int] = set()
        for f in sorted((f for f in fwds if not f.is_prefill), key=_max_pos):
            p = _max_pos(f)
            if p in tgt_pos and p not in seen:
                seen.add(p)
                out.append(f)
    return out
