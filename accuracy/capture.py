"""ModelCapture: forward hooks + registry + writer for one model (target, draft or vision)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .patterns import match_modules, split_vision_patterns
from .registry import TensorRegistry
from .tensor_io import TreeMetadata
from .writer import CaptureWriter
from .writer_process import WriterProcess

logger = logging.getLogger(__name__)


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """``torch.compile`` wrapper -> the original module (``_orig_mod``); else ``model``."""
    return getattr(model, "_orig_mod", model)


def register_capture_hooks(
    model: nn.Module, module_names: list[str], registry: TensorRegistry, name_prefix: str = ""
) -> list[Any]:
    """Forward hooks that put each named module's (whole, nested) output in ``registry``."""
    modules = dict(model.named_modules())
    handles = []
    for name in module_names:
        if name not in modules:
            raise ValueError(f"no submodule named '{name}' in {type(model).__name__}")
        cap_name = f"{name_prefix}.{name}" if name_prefix else name

        def hook(_mod, _inp, output, _n=cap_name, _r=registry):
            _r.register_module_tensor(_n, output)

        handles.append(modules[name].register_forward_hook(hook))
    return handles


class ModelCapture:
    """Tensor capture for one model, compiled or not.

    Create it after ``torch.compile`` and before the first (warmup) call: the hooks
    sit on ``_orig_mod``'s submodules, so dynamo traces them into the graph once.

    Args:
        model: the module (a ``torch.compile`` wrapper is unwrapped automatically).
        modules: patterns (ranges, regexes) of submodules whose outputs are captured.
        capture_dir: root directory; writes go to ``{capture_dir}/{subdirectory}/dp{dp}/``.
        dp_rank / tp_rank: parallel ranks of this process.
        capture_filter: capture names to write (None = all).
        subdirectory: e.g. ``"draft"`` or ``"vision"``.
        name_prefix: prefix of capture names (``"visual"`` for a vision encoder).
        strict: raise ValueError when a pattern matches no module.
        config: extra JSON data for the manifest.
    """

    def __init__(
        self,
        model: nn.Module,
        modules: list[str],
        capture_dir: str,
        dp_rank: int = 0,
        tp_rank: int = 0,
        capture_filter: set[str] | list[str] | None = None,
        subdirectory: str = "",
        name_prefix: str = "",
        strict: bool = True,
        config: dict[str, Any] | None = None,
    ) -> None:
        model = unwrap_compiled(model)
        self._registry = TensorRegistry()
        self._registry.configure(enabled=True)
        self._prev_instance: TensorRegistry | None = None
        self._clear_hook_handle = None
        self._model, self._name_prefix = model, name_prefix
        self._capture_names = match_modules(model, list(modules), strict=strict)
        self._hooks = register_capture_hooks(
            model, self._capture_names, self._registry, name_prefix
        )
        write_dir = os.path.join(capture_dir, subdirectory) if subdirectory else capture_dir
        cfg = {"modules": list(modules), "matched": self._capture_names, "name_prefix": name_prefix}
        cfg.update(config or {})
        self._writer = CaptureWriter(write_dir, dp_rank, tp_rank, capture_filter, config=cfg)
        self.writes: WriterProcess | None = None  # set: passes go to that writer process

    @property
    def capture_names(self) -> list[str]:
        return list(self._capture_names)

    @property
    def registry(self) -> TensorRegistry:
        return self._registry

    @property
    def writer(self) -> CaptureWriter:
        return self._writer

    def enable(self) -> None:
        """Write captures to disk from now on (call after warmup)."""
        self._writer.enable()

    def disable(self) -> None:
        self._writer.disable()

    @property
    def enabled(self) -> bool:
        return self._writer.enabled

    def clear(self) -> None:
        self._registry.clear()

    def register_clear_hook(self, compiled_model: nn.Module) -> None:
        """Clear the registry in a pre-forward hook of the (compiled) wrapper."""
        if self._clear_hook_handle is not None:
            self._clear_hook_handle.remove()
        self._clear_hook_handle = compiled_model.register_forward_pre_hook(
            lambda _m, _args, _kwargs: self._registry.clear(), with_kwargs=True
        )

    def setup_tensor_capture(self) -> None:
        """Start a forward: clear the registry and make it the global one for inline
        ``capture_tensor`` calls (the previous one is restored by ``save_tensor_captures``)."""
        self._registry.clear()
        self._prev_instance = TensorRegistry._instance
        TensorRegistry._instance = self._registry

    def save_tensor_captures(
        self,
        positions: torch.Tensor | list[int] | None,
        is_prefill: bool,
        req_ids: list[str] | None = None,
        tree: TreeMetadata | dict | None = None,
        padding_mask: torch.Tensor | list[bool] | None = None,
        token_ids: torch.Tensor | list[int] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str | None:
        """Restore the previous global registry, then write this pass (when enabled).

        ``positions`` may be empty/None: then ``0..T-1`` with ``T`` the token count
        of the first capture (dim 1 of a ``[1, T, ...]`` tensor, else dim 0).
        Returns the forward-pass directory written, or None (also when the pass went to
        :attr:`writes`, a :class:`~accuracy.writer_process.WriterProcess` of this
        writer's settings, which writes it later).
        """
        TensorRegistry._instance = self._prev_instance
        self._prev_instance = None
        if not self._writer.enabled:
            return None
        items = self._registry.get_all()
        if not items:
            return None
        if (
            positions is None
            or (isinstance(positions, torch.Tensor) and positions.numel() == 0)
            or (isinstance(positions, (list, tuple)) and len(positions) == 0)
        ):
            t = items[0][1]
            n = t.shape[1] if t.dim() >= 3 and t.shape[0] == 1 else t.shape[0]
            positions = list(range(int(n)))
        elif isinstance(positions, torch.Tensor) and positions.dim() > 1:
            positions = positions.reshape(-1)
        if self.writes is not None:
            pos = positions.tolist() if isinstance(positions, torch.Tensor) else list(positions)
            self.writes.submit(
                f"a pass under {self._writer.capture_dir}",
                [t for _, t in items],
                [n for n, _ in items],
                req_ids,
                [int(p) for p in pos],
                is_prefill,
                tree=tree.to_dict() if isinstance(tree, TreeMetadata) else tree,
                padding_mask=padding_mask,
                token_ids=token_ids,
                extra=extra,
            )
            return None
        return self._writer.write(
            [t for _, t in items],
            [n for n, _ in items],
            req_ids,
            positions,
            is_prefill,
            tree=tree,
            padding_mask=padding_mask,
            token_ids=token_ids,
            extra=extra,
        )

    def attach(self) -> None:
        """Re-register the capture hooks after :meth:`remove` (no-op when attached)."""
        if not self._hooks:
            self._hooks = register_capture_hooks(
                self._model, self._capture_names, self._registry, self._name_prefix
            )

    def remove(self) -> None:
        """Remove the capture hooks and the clear hook (a compiled graph keeps its traced
        copy until it recompiles)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._clear_hook_handle is not None:
            self._clear_hook_handle.remove()
            self._clear_hook_handle = None


@dataclass
class TensorCaptureConfig:
    """The ``tensor_capture`` section of a config: target, draft and vision patterns.

    ``modules`` entries starting with ``visual.`` go to the vision encoder.
    """

    modules: list[str] = field(default_factory=list)
    capture_dir: str = "captures"
    draft_modules: list[str] = field(default_factory=list)
    capture_filter: list[str] | None = None
    strict: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorCaptureConfig:
        unknown = set(d) - {"modules", "capture_dir", "draft_modules", "capture_filter", "strict"}
        if unknown:
            raise ValueError(f"unknown tensor_capture keys: {sorted(unknown)}")
        return cls(**d)


def setup_model_captures(
    config: TensorCaptureConfig | dict[str, Any],
    model: nn.Module,
    draft_model: nn.Module | None = None,
    vision_model: nn.Module | None = None,
    dp_rank: int = 0,
    tp_rank: int = 0,
) -> dict[str, ModelCapture]:
    """One :class:`ModelCapture` per sub-model, each with its own registry and directory.

    Returns ``{"target": ..., "draft": ..., "vision": ...}`` (only those configured);
    the target lives in ``capture_dir``, the others in ``capture_dir/draft`` and
    ``capture_dir/vision``. Sets ``TensorRegistry._instance`` to the target registry.
    """
    if isinstance(config, dict):
        config = TensorCaptureConfig.from_dict(config)
    text, vision = split_vision_patterns(config.modules)
    out: dict[str, ModelCapture] = {}
    common = dict(dp_rank=dp_rank, tp_rank=tp_rank, strict=config.strict)
    if text:
        out["target"] = ModelCapture(
            model, text, config.capture_dir, capture_filter=config.capture_filter, **common
        )
        TensorRegistry._instance = out["target"].registry
    if vision:
        if vision_model is None:
            raise ValueError(f"vision patterns {vision} given but no vision_model")
        out["vision"] = ModelCapture(
            vision_model,
            vision,
            config.capture_dir,
            subdirectory="vision",
            name_prefix="visual",
            **common,
        )
    if config.draft_modules:
        if draft_model is None:
            raise ValueError("draft_modules given but no draft_model")
        out["draft"] = ModelCapture(
            draft_model, config.draft_modules, config.capture_dir, subdirectory="draft", **common
        )
    return out
