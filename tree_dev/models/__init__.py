"""A tiny target / draft / EAGLE-head model set trained on Python's standard library.

``load()`` returns the committed checkpoint (``checkpoints/stdlib-v1``) in fp32::

    from tree_dev.models import load
    m = load()            # m.target, m.draft (LlamaForCausalLM), m.eagle (EagleHead), m.tokenizer

``python -m tree_dev.models train|eval`` re-trains / evaluates (see docs/models.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .eagle import EagleHead

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CHECKPOINT = REPO_ROOT / "checkpoints" / "stdlib-v1"
SUBDIRS = ("target", "draft", "eagle", "tokenizer")

__all__ = ["DEFAULT_CHECKPOINT", "SUBDIRS", "EagleHead", "ModelSet", "load"]


@dataclass
class ModelSet:
    """The three models and their shared tokenizer, loaded from one directory."""

    target: torch.nn.Module
    draft: torch.nn.Module
    eagle: EagleHead
    tokenizer: object
    path: Path


def load(
    path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
) -> ModelSet:
    """Load ``{target,draft,eagle,tokenizer}`` from ``path`` (default: the committed set).

    Models are returned in ``dtype`` (fp32 by default; stored bf16 weights are upcast),
    in eval mode, with no network access.  Raises ``FileNotFoundError`` naming the
    missing directory or file.
    """
    from transformers import AutoModelForCausalLM

    from .data import load_tokenizer

    p = Path(path) if path is not None else DEFAULT_CHECKPOINT
    if not p.is_dir():
        raise FileNotFoundError(f"model directory {p} does not exist")
    for sub in SUBDIRS:
        if not (p / sub).is_dir():
            raise FileNotFoundError(f"model directory {p} lacks {sub}/")
    kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    lms = {}
    for sub in ("target", "draft"):
        for f in ("config.json", "model.safetensors"):
            if not (p / sub / f).is_file():
                raise FileNotFoundError(f"missing {p / sub / f}")
        lms[sub] = AutoModelForCausalLM.from_pretrained(
            str(p / sub), dtype=dtype, local_files_only=True, **kw
        ).eval()
    eagle = EagleHead.from_pretrained(
        p / "eagle",
        target=lms["target"],
        torch_dtype=dtype,
        attn_implementation=attn_implementation,
    )
    return ModelSet(lms["target"], lms["draft"], eagle, load_tokenizer(p / "tokenizer"), p)
