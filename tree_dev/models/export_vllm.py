"""Export the project's EAGLE head for vLLM's ``eagle`` proposer.

``python -m tree_dev.models export-eagle-vllm [--out DIR] [--head DIR]`` or
:func:`export_eagle_for_vllm` writes a directory vLLM loads with::

    LLM(model=TARGET, speculative_config={"method": "eagle", "model": DIR,
                                          "num_speculative_tokens": K})

No vLLM EAGLE architecture computes this head (fc with a bias, the layer's input
norm, a final norm: see ``tree_dev/vllm_plugin/eagle_model.py``), so the export names
the project's own architecture, ``EagleTreespecLlamaForCausalLM``, which the
``treespec_tree`` vLLM plugin registers in every vLLM process.

Layout (safetensors only, no embedding: vLLM shares the target's)::

    DIR/config.json        the head's LlamaConfig, architectures=[EagleTreespecLlamaForCausalLM],
                           plus a "treespec_eagle" section (source digest, feature contract)
    DIR/model.safetensors  fc.weight [d, 2d], fc.bias [d], layers.0.* (HF Llama names),
                           norm.weight [d]; the head's stored dtype, values unchanged

A head with a draft vocabulary (``draft_vocab``, see ``eagle.py``) adds EAGLE-3's reduced
vocabulary: ``draft_vocab_size`` in the config, ``lm_head.weight [Vd, d]`` (the target's
``lm_head`` rows of those tokens, read from the target checkpoint: ``lm_head.weight``, or
the embedding of a tied model) and ``d2t int64[Vd]`` (EAGLE-3's offsets: the target id of
draft token ``i`` is ``i + d2t[i]``).  A head without one shares the target's whole
``lm_head``.

The head's weights are renamed, never recomputed (``decoder.layers.*`` -> ``layers.*``,
``decoder.norm`` -> ``norm``).  A directory is written whole into a temporary sibling
and renamed into place.  Without ``out_dir`` the export is cached under
``results/vllm_eagle/<digest>/``, keyed by the sha256 of the head's files and the
format version, so repeated calls cost one hash of the head (~4 MB).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import DEFAULT_CHECKPOINT, REPO_ROOT
from .eagle import _target_dir, check_draft_vocab

ARCHITECTURE = "EagleTreespecLlamaForCausalLM"  # == tree_dev.vllm_plugin.eagle_model.ARCHITECTURE
FORMAT_VERSION = 2
DEFAULT_HEAD = DEFAULT_CHECKPOINT / "eagle"
CACHE_DIR = REPO_ROOT / "results" / "vllm_eagle"
_LAYER_KEYS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def head_digest(head_dir: str | os.PathLike = DEFAULT_HEAD) -> str:
    """sha256 (hex) of the head's ``config.json`` and ``model.safetensors`` + format version."""
    h = hashlib.sha256(f"treespec-eagle-vllm-v{FORMAT_VERSION}\n".encode())
    for name in ("config.json", "model.safetensors"):
        f = Path(head_dir) / name
        if not f.is_file():
            raise FileNotFoundError(f"EAGLE head file missing: {f}")
        h.update(name.encode() + b"\n")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _convert(head_dir: Path, digest: str) -> tuple[dict, dict]:
    """The vLLM ``config.json`` dict and renamed tensors of the head in ``head_dir``.

    Raises ``ValueError`` naming the offending field or tensor before anything is written.
    """
    raw = json.loads((head_dir / "config.json").read_text())
    eagle = raw.pop("eagle", None)
    if not isinstance(eagle, dict):
        raise ValueError(f"{head_dir / 'config.json'}: no 'eagle' section: not an EAGLE head")
    if raw.get("model_type") != "llama":
        raise ValueError(f"config.json model_type must be 'llama', got {raw.get('model_type')!r}")
    for field in ("hidden_size", "vocab_size", "num_attention_heads", "intermediate_size"):
        if not isinstance(raw.get(field), int) or raw[field] <= 0:
            raise ValueError(
                f"config.json {field} must be a positive integer, got {raw.get(field)!r}"
            )
    if raw.get("num_hidden_layers") != 1:
        raise ValueError(
            f"config.json num_hidden_layers must be 1 for an EAGLE head, "
            f"got {raw.get('num_hidden_layers')!r}"
        )
    d = raw["hidden_size"]
    expected = {"fc.weight": (d, 2 * d), "fc.bias": (d,), "decoder.norm.weight": (d,)}
    expected.update({f"decoder.layers.0.{k}": None for k in _LAYER_KEYS})
    tensors = {}
    with safe_open(str(head_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        draft_vocab = f.get_tensor("draft_vocab") if "draft_vocab" in keys else None
        keys.discard("draft_vocab")
        unexpected = sorted(keys - set(expected))
        missing = sorted(set(expected) - keys)
        if unexpected or missing:
            raise ValueError(
                f"{head_dir / 'model.safetensors'}: unexpected tensors {unexpected}, "
                f"missing {missing}"
            )
        for key, shape in expected.items():
            t = f.get_tensor(key)
            if shape is not None and tuple(t.shape) != shape:
                raise ValueError(f"tensor {key} has shape {tuple(t.shape)}, expected {shape}")
            tensors[key.removeprefix("decoder.")] = t.contiguous()
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values()}
    if len(dtypes) != 1:
        raise ValueError(f"tensors of the head have mixed dtypes {sorted(dtypes)}")
    cfg = {k: v for k, v in raw.items() if k not in ("torch_dtype", "dtype", "_name_or_path")}
    shared = ["embed_tokens", "lm_head"]
    if draft_vocab is not None:
        ids = check_draft_vocab(draft_vocab, raw["vocab_size"])
        if raw.get("draft_vocab_size") != ids.numel():
            raise ValueError(
                f"config.json draft_vocab_size {raw.get('draft_vocab_size')!r} but the head "
                f"holds a draft_vocab of {ids.numel()} tokens"
            )
        rows = _target_lm_head(head_dir, eagle.get("target", ""), raw)[ids]
        tensors["lm_head.weight"] = rows.to(next(iter(tensors.values())).dtype).contiguous()
        tensors["d2t"] = (ids - torch.arange(ids.numel())).contiguous()
        shared = ["embed_tokens"]
    elif "draft_vocab_size" in cfg:
        raise ValueError("config.json has draft_vocab_size but the head holds no draft_vocab")
    cfg.update(
        architectures=[ARCHITECTURE],
        model_type="llama",
        dtype=dtypes.pop(),
        tie_word_embeddings=False,
        treespec_eagle={
            "format_version": FORMAT_VERSION,
            "source": _display(head_dir),
            "source_sha256": digest,
            "feature": eagle.get("feature"),
            "output": eagle.get("output"),
            "shared_from_target": shared,
            "loads_with": "the treespec_tree vLLM plugin (registers the architecture)",
        },
    )
    return cfg, tensors


def _target_lm_head(head_dir: Path, target: str, raw: dict) -> torch.Tensor:
    """The target's ``lm_head`` weight ``[V, d]`` read from its safetensors (the input
    embedding of a model with tied embeddings)."""
    tdir = _target_dir(head_dir, target)
    files = sorted(tdir.glob("*.safetensors")) if tdir.is_dir() else []
    if not target or not files:
        raise FileNotFoundError(
            f"target checkpoint of EAGLE head {head_dir} (needed for its draft vocabulary "
            f"rows) not found: {tdir}"
        )
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                if name in f.keys():
                    w = f.get_tensor(name)
                    if tuple(w.shape) != (raw["vocab_size"], raw["hidden_size"]):
                        raise ValueError(
                            f"{file}: {name} has shape {tuple(w.shape)}, expected "
                            f"({raw['vocab_size']}, {raw['hidden_size']})"
                        )
                    return w
    raise ValueError(f"target checkpoint {tdir} has neither lm_head.weight nor an embedding")


def _display(path: Path) -> str:
    """``path`` relative to the repository when inside it (no machine-specific prefix)."""
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path.resolve())


def _is_current(out: Path, digest: str) -> bool:
    try:
        cfg = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return False
    meta = cfg.get("treespec_eagle") if isinstance(cfg, dict) else None
    return (
        isinstance(meta, dict)
        and meta.get("source_sha256") == digest
        and (out / "model.safetensors").is_file()
    )


def export_eagle_for_vllm(
    out_dir: str | os.PathLike | None = None, head_dir: str | os.PathLike | None = None
) -> Path:
    """Write (or reuse) the vLLM export of the EAGLE head; returns its directory.

    ``head_dir``: an ``EagleHead.save_pretrained`` directory (default: the committed head).
    ``out_dir``: where to write; default ``results/vllm_eagle/<digest[:16]>``.  An
    ``out_dir`` that already holds the export of the same head (same digest) is returned
    untouched; any other content there is replaced atomically.
    """
    head = Path(head_dir) if head_dir is not None else DEFAULT_HEAD
    digest = head_digest(head)
    out = Path(out_dir) if out_dir is not None else CACHE_DIR / digest[:16]
    if _is_current(out, digest):
        return out
    cfg, tensors = _convert(head, digest)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    old = None
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out.exists():
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
            os.replace(out, old / out.name)
        try:
            os.replace(tmp, out)
        except OSError:
            # another process put an export there in the meantime: fine if it is this one
            if not _is_current(out, digest):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out
