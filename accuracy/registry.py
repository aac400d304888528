"""Side-channel store for tensors captured during a (possibly compiled) forward pass."""

from __future__ import annotations

import dataclasses

import torch


def flatten_output(name: str, output) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a nested module output, named with ``.index`` / ``.key`` suffixes.

    A plain tensor keeps ``name``; tuples/lists add ``.0``, ``.1``; dicts and HF
    ``ModelOutput`` add ``.key``; dataclasses add ``.field``. ``None`` and other
    leaves are skipped.
    """
    if isinstance(output, torch.Tensor):
        return [(name, output)]
    items: list = []
    if isinstance(output, dict):  # includes transformers' ModelOutput (an OrderedDict)
        items = [(str(k), v) for k, v in output.items()]
    elif isinstance(output, (tuple, list)):
        items = [(str(i), v) for i, v in enumerate(output)]
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        items = [(f.name, getattr(output, f.name)) for f in dataclasses.fields(output)]
    out = []
    for key, value in items:
        out.extend(flatten_output(f"{name}.{key}", value))
    return out


class TensorRegistry:
    """Captured tensors of one model, in registration order.

    Two modes: forward hooks call :meth:`register_module_tensor`; inline
    :func:`accuracy.capture_tensor` calls :meth:`register_manual_tensor` on the
    global ``TensorRegistry._instance``. Storage is plain lists (dynamo replays
    list appends after a compiled graph without recompiling).
    """

    _instance: TensorRegistry | None = None

    @classmethod
    def get_instance(cls) -> TensorRegistry:
        if cls._instance is None:
            cls._instance = TensorRegistry()
        return cls._instance

    @classmethod
    def reset_instance(cls) -> None:
        cls._instance = None

    def __init__(self) -> None:
        self._module_items: list[tuple[str, torch.Tensor]] = []
        self._manual_items: list[tuple[str, torch.Tensor]] = []
        self._enabled = False

    def configure(self, enabled: bool = True) -> None:
        """Enable/disable registration (changing it under torch.compile recompiles)."""
        self._enabled = bool(enabled)

    @property
    def enabled(self) -> bool:
        return self._enabled

    def clear(self) -> None:
        self._module_items.clear()
        self._manual_items.clear()

    def register_module_tensor(self, name: str, tensor) -> None:
        """Store a detached clone of a module output (nested outputs are flattened)."""
        if self._enabled:
            for key, t in flatten_output(name, tensor):
                self._module_items.append((key, t.detach().clone()))

    def register_manual_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Store ``tensor`` as ``manual.{name}`` (``_1``, ``_2`` ... on repeats)."""
        if self._enabled:
            key = f"manual.{name}"
            existing = {n for n, _ in self._manual_items}
            if key in existing:
                i = 1
                while f"{key}_{i}" in existing:
                    i += 1
                key = f"{key}_{i}"
            self._manual_items.append((key, tensor.detach().clone()))

    def get_all_tensors(self) -> list[torch.Tensor]:
        """Tensors in registration order: hook captures first, then inline ones."""
        return [t for _, t in self._module_items] + [t for _, t in self._manual_items]

    def get_all_names(self) -> list[str]:
        return [n for n, _ in self._module_items] + [n for n, _ in self._manual_items]

    def get_all(self) -> list[tuple[str, torch.Tensor]]:
        return list(self._module_items) + list(self._manual_items)


def capture_tensor(name: str, tensor: torch.Tensor) -> None:
    """Capture ``tensor`` from model code into the active registry (no-op when none).

    The registry must be active (``ModelCapture.setup_tensor_capture``) before
    warmup so that dynamo traces the call as live code.
    """
    registry = TensorRegistry._instance
    if registry is not None:
        registry.register_manual_tensor(name, tensor)
