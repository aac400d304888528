"""Tensor replacement: inject reference tensors into a forward pass by position.

``TensorReplacer`` flattens step-wise reference captures into one
``[total_positions, E]`` tensor per (prompt, module) and builds, per forward pass,
``{module: Tensor[num_slots, E]}`` from the scheduler's request ids and positions
(zero rows for padding). Model code reads it with :func:`get_replacement_tensor`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

# One persistent dict, mutated in place: torch.compile guards on its keys and the
# tensors' metadata, so new values of the same shape do not recompile.
_ACTIVE: dict[str, torch.Tensor] = {}
_STATE = {"active": False}


def set_active_context(ctx: dict[str, torch.Tensor] | None) -> None:
    """Install ``ctx`` (``{module_name: tensor}``) for the next forward; None clears."""
    _ACTIVE.clear()
    _STATE["active"] = ctx is not None
    if ctx:
        _ACTIVE.update(ctx)


def get_replacement_tensor(name: str) -> torch.Tensor | None:
    """The active replacement for ``name``, or None when not configured."""
    return _ACTIVE.get(name)


def _hash_tokens(tokens: Sequence[int]) -> str:
    return hashlib.sha1(json.dumps([int(t) for t in tokens]).encode()).hexdigest()


def _slot_table_owners(
    num_slots: int, num_reqs: int, slot_table: Sequence[tuple[int, int]]
) -> list[int | None]:
    """Slot owners from an explicit per-request ``(offset, count)`` table."""
    owners: list[int | None] = [None] * num_slots
    if len(slot_table) != num_reqs:
        raise ValueError(f"slot_table has {len(slot_table)} entries for {num_reqs} requests")
    for r, (off, cnt) in enumerate(slot_table):
        if off < 0 or cnt < 0 or off + cnt > num_slots:
            raise ValueError(f"slot_table[{r}]=({off}, {cnt}) outside {num_slots} slots")
        for s in range(off, off + cnt):
            if owners[s] is not None:
                raise ValueError(f"slot_table: slot {s} claimed by requests {owners[s]} and {r}")
            owners[s] = r
    return owners


def _prefill_owners(num_slots: int, num_reqs: int, positions: Sequence[int]) -> list[int | None]:
    """Prefill slot owners: request 0 until the first repeated position (padding after)."""
    owners: list[int | None] = [None] * num_slots
    if num_reqs != 1:
        raise ValueError(f"prefill serves one request per pass, got {num_reqs}")
    seen: set[int] = set()
    for s, p in enumerate(positions):
        if p in seen:
            break
        seen.add(p)
        owners[s] = 0
    return owners


def _decode_owners(num_slots: int, num_reqs: int, tokens_per_req: int) -> list[int | None]:
    """Decode slot owners: ``slot // tokens_per_req``, padding beyond ``num_reqs``."""
    owners: list[int | None] = [None] * num_slots
    if tokens_per_req < 1:
        raise ValueError(f"tokens_per_req must be >= 1, got {tokens_per_req}")
    for s in range(num_slots):
        r = s // tokens_per_req
        owners[s] = r if r < num_reqs else None
    return owners


class TensorReplacer:
    """Context builder over flattened reference captures.

    Args:
        reference_captures: one ``{module: [step tensors]}`` per prompt; step 0 is
            the prefill ``[1, L, E]`` (or ``[L, E]``), step k the decode output
            ``[1, L+k, E]`` (HF full recompute) or ``[1, 1, E]`` (KV cache); the last
            row of each decode step is the new position.
        prompt_token_ids: token ids of each prompt, for :meth:`register_request`.
    """

    def __init__(
        self,
        reference_captures: list[dict[str, list[torch.Tensor]]],
        prompt_token_ids: list[list[int]] | None = None,
    ) -> None:
        if not isinstance(reference_captures, (list, tuple)) or not reference_captures:
            raise ValueError("reference_captures must be a non-empty list (one dict per prompt)")
        self.flat: dict[int, dict[str, torch.Tensor]] = {}
        self.modules: list[str] = []
        for pi, caps in enumerate(reference_captures):
            if not isinstance(caps, dict):
                raise ValueError(f"prompt {pi}: expected {{module: [step tensors]}}")
            self.flat[pi] = {}
            for module, steps in caps.items():
                self.flat[pi][module] = self._flatten(pi, module, steps)
                if module not in self.modules:
                    self.modules.append(module)
        self._prompts: list[list[int]] = []
        self._by_hash: dict[tuple[int, str], list[int]] = {}
        if prompt_token_ids is not None:
            if len(prompt_token_ids) != len(reference_captures):
                raise ValueError(
                    f"{len(prompt_token_ids)} prompts of token ids for "
                    f"{len(reference_captures)} prompts of captures"
                )
            for pi, toks in enumerate(prompt_token_ids):
                toks = [int(t) for t in (toks.tolist() if isinstance(toks, torch.Tensor) else toks)]
                self._prompts.append(toks)
                self._by_hash.setdefault((len(toks), _hash_tokens(toks)), []).append(pi)
        self._lengths = sorted({len(p) for p in self._prompts})
        self._req_to_prompt: dict[str, int] = {}

    @staticmethod
    def _flatten(pi: int, module: str, steps: Sequence[torch.Tensor]) -> torch.Tensor:
        rows = []
        for k, t in enumerate(steps):
            if not isinstance(t, torch.Tensor) or t.dim() < 2:
                raise ValueError(
                    f"prompt {pi} module '{module}' step {k}: need a [.., T, E] tensor"
                )
            t = t[0] if t.dim() >= 3 else t
            if k == 0:
                rows.append(t)
                n = t.shape[0]
            else:
                if t.shape[0] not in (1, n + 1):
                    raise ValueError(
                        f"prompt {pi} module '{module}' step {k}: {t.shape[0]} tokens, expected "
                        f"1 (KV cache) or {n + 1} (full recompute)"
                    )
                if t.shape[1:] != rows[0].shape[1:]:
                    raise ValueError(
                        f"prompt {pi} module '{module}' step {k}: feature shape changed"
                    )
                rows.append(t[-1:])
                n += 1
        if not rows:
            raise ValueError(f"prompt {pi} module '{module}': no steps")
        return torch.cat(rows, 0)

    # ----------------------------------------------------------------- requests

    def register_request(self, req_id: str, prompt_token_ids: Sequence[int]) -> int:
        """Map ``req_id`` to the stored prompt with the longest verified prefix match."""
        toks = [int(t) for t in prompt_token_ids]
        best, best_len = None, -1
        for plen in self._lengths:
            if plen > len(toks):
                continue
            for pi in self._by_hash.get((plen, _hash_tokens(toks[:plen])), []):
                if self._prompts[pi] == toks[:plen] and plen > best_len:
                    best, best_len = pi, plen
        if best is None:
            raise ValueError(f"request '{req_id}': its tokens match no stored prompt")
        self._req_to_prompt[req_id] = best
        return best

    def _resolve_prompt_idx(self, req_id: str) -> int:
        if req_id in self._req_to_prompt:
            return self._req_to_prompt[req_id]
        if not self._prompts and len(self.flat) == 1:
            return 0
        raise ValueError(f"request '{req_id}' was never registered (call register_request)")

    # ----------------------------------------------------------------- contexts

    def warmup_context(self, num_tokens: int, device=None) -> dict[str, torch.Tensor]:
        """Zero tensors ``[num_tokens, E]`` per module (shapes/dtypes for compile warmup)."""
        ref = self.flat[0]
        return {
            m: torch.zeros((num_tokens, *ref[m].shape[1:]), dtype=ref[m].dtype, device=device)
            for m in self.modules
        }

    def slot_owners(
        self,
        num_slots: int,
        num_reqs: int,
        is_prefill: bool,
        positions: Sequence[int],
        tokens_per_req: int = 1,
        slot_table: Sequence[tuple[int, int]] | None = None,
        padding_mask: Sequence[bool] | None = None,
    ) -> list[int | None]:
        """Request index owning each slot (None = padding) under the designed rules.

        Prefill: one request; the first repeated position starts the padding.
        Decode: ``slot // tokens_per_req`` (beyond ``num_reqs`` is padding), or the
        explicit ``slot_table`` of per-request ``(offset, count)``. An explicit
        ``padding_mask`` (True = pad) overrides the inferred padding.
        """
        if slot_table is not None:
            owners = _slot_table_owners(num_slots, num_reqs, slot_table)
        elif is_prefill:
            owners = _prefill_owners(num_slots, num_reqs, positions)
        else:
            owners = _decode_owners(num_slots, num_reqs, tokens_per_req)
        if padding_mask is not None:
            if len(padding_mask) != num_slots:
                raise ValueError(
                    f"padding_mask has {len(padding_mask)} entries for {num_slots} slots"
                )
            if slot_table is None and is_prefill:
                owners = [0] * num_slots
            owners = [None if m else o for o, m in zip(owners, padding_mask, strict=True)]
        return owners

    def build_context(
        self,
        req_ids: Sequence[str],
        positions: torch.Tensor | Sequence[int],
        is_prefill: bool,
        device=None,
        tokens_per_req: int = 1,
        slot_table: Sequence[tuple[int, int]] | None = None,
        padding_mask: torch.Tensor | Sequence[bool] | None = None,
    ) -> dict[str, torch.Tensor]:
        """``{module: Tensor[len(positions), E]}`` indexed at each slot's position.

        Args:
            req_ids: request ids in batch order.
            positions: int[T] slot positions (padding included).
            is_prefill: prefill (one request) or decode.
            tokens_per_req: consecutive slots per request in decode (spec decode: 1 + k).
            slot_table: per request ``(offset, count)`` of its slots (ragged trees).
            padding_mask: bool[T], True marks padding (overrides inference).
        Raises:
            ValueError: unknown request, position outside the reference, bad table.
        """
        if isinstance(positions, torch.Tensor):
            positions = positions.reshape(-1).tolist()
        positions = [int(p) for p in positions]
        if isinstance(padding_mask, torch.Tensor):
            padding_mask = padding_mask.reshape(-1).tolist()
        owners = self.slot_owners(
            len(positions),
            len(req_ids),
            is_prefill,
            positions,
            tokens_per_req,
            slot_table,
            padding_mask,
        )
        prompt_of = [self._resolve_prompt_idx(r) for r in req_ids]
        by_prompt: dict[int, tuple[list[int], list[int]]] = {}
        for s, r in enumerate(owners):
            if r is None:
                continue
            slots, pos = by_prompt.setdefault(prompt_of[r], ([], []))
            slots.append(s)
            pos.append(positions[s])
        ctx = self.warmup_context(len(positions))
        for pi, (slots, pos) in by_prompt.items():
            idx = torch.tensor(pos, dtype=torch.long)
            sidx = torch.tensor(slots, dtype=torch.long)
            for m, out in ctx.items():
                flat = self.flat[pi].get(m)
                if flat is None:
                    raise ValueError(f"prompt {pi} has no reference for module '{m}'")
                bad = [p for p in pos if not 0 <= p < flat.shape[0]]
                if bad:
                    raise ValueError(
                        f"prompt {pi} module '{m}': position {bad[0]} outside the reference "
                        f"(0..{flat.shape[0] - 1})"
                    )
                out[sidx] = flat[idx].to(out.dtype)
        if device is not None:
            ctx = {m: t.to(device) for m, t in ctx.items()}
        return ctx


def install_replacement_hooks(model: nn.Module, names: Sequence[str]) -> list[Any]:
    """Forward hooks making each named submodule return its active replacement.

    For plain PyTorch / HF models without ``get_replacement_tensor`` calls: when a
    replacement is active for ``name``, the module's tensor output (or the first
    element of a tuple output) is replaced by it, reshaped to the output's shape.
    """
    mods = dict(model.named_modules())
    handles = []
    for name in names:
        if name not in mods:
            raise ValueError(f"no submodule named '{name}' in {type(model).__name__}")

        def hook(_m, _inp, out, _n=name):
            rep = get_replacement_tensor(_n)
            if rep is None:
                return None
            if isinstance(out, tuple):
                return (rep.reshape(out[0].shape).to(out[0].dtype), *out[1:])
            return rep.reshape(out.shape).to(out.dtype)

        handles.append(mods[name].register_forward_hook(hook))
    return handles


# ----------------------------------------------------------------------- persistence


def save_reference_captures(path: str, reference_captures: list[dict[str, list[torch.Tensor]]]):
    """Write captures as safetensors with keys ``{prompt}/{step}/{module}`` (atomic)."""
    from safetensors.torch import save

    from .tensor_io import atomic_write_bytes

    flat = {}
    for pi, caps in enumerate(reference_captures):
        for m, steps in caps.items():
            for k, t in enumerate(steps):
                flat[f"{pi}/{k}/{m}"] = t.detach().cpu().contiguous()
    atomic_write_bytes(path, save(flat))


def load_reference_captures(path: str) -> list[dict[str, list[torch.Tensor]]]:
    """Read captures from safetensors (``save_reference_captures``) or a ``.pt`` file
    (``torch.load(weights_only=True)``; never unpickles arbitrary objects)."""
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            flat = load_file(path)
        else:
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{path}: cannot load reference captures ({e})") from e
    out: dict[int, dict[str, dict[int, torch.Tensor]]] = {}
    for key, t in flat.items():
        try:
            pi, k, m = key.split("/", 2)
            out.setdefault(int(pi), {}).setdefault(m, {})[int(k)] = t
        except ValueError as e:
            raise ValueError(f"{path}: bad key '{key}' (expected prompt/step/module)") from e
    return [
        {m: [steps[k] for k in sorted(steps)] for m, steps in out[pi].items()} for pi in sorted(out)
    ]


def _load_token_ids(path: str) -> list[list[int]]:
    try:
        if path.endswith(".json"):
            with open(path) as f:
                return json.load(f)
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{path}: cannot load prompt token ids ({e})") from e
    return [t.tolist() if isinstance(t, torch.Tensor) else list(t) for t in obj]


@dataclass
class TensorReplacementConfig:
    """Replacement configuration: in memory (``tensors``, ``prompt_token_ids``) or
    from disk (``tensors_path``, ``prompt_token_ids_path``)."""

    tensors: list[dict[str, list[torch.Tensor]]] | None = None
    prompt_token_ids: list[list[int]] | None = None
    tensors_path: str | None = None
    prompt_token_ids_path: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorReplacementConfig:
        unknown = set(d) - {"tensors", "prompt_token_ids", "tensors_path", "prompt_token_ids_path"}
        if unknown:
            raise ValueError(f"unknown tensor_replacement keys: {sorted(unknown)}")
        return cls(**d)

    def load(self) -> tuple[list[dict[str, list[torch.Tensor]]], list[list[int]] | None]:
        tensors, ids = self.tensors, self.prompt_token_ids
        if tensors is None:
            if not self.tensors_path:
                raise ValueError("tensor_replacement needs tensors or tensors_path")
            if not os.path.isfile(self.tensors_path):
                raise ValueError(f"tensors_path {self.tensors_path} does not exist")
            tensors = load_reference_captures(self.tensors_path)
        if ids is None and self.prompt_token_ids_path:
            ids = _load_token_ids(self.prompt_token_ids_path)
        return tensors, ids

    def build_replacer(self) -> TensorReplacer:
        tensors, ids = self.load()
        return TensorReplacer(tensors, prompt_token_ids=ids)
