"""EAGLE-style draft head: one Llama decoder layer over the target's features.

Forward contract (what the engine must feed it)
-----------------------------------------------
Let ``x_0 .. x_n`` be the tokens of a sequence and ``h_i`` the target's feature at
position ``i``: **the target's final-norm output**, i.e.
``target.model(...).last_hidden_state[:, i]`` (identical to
``target(..., output_hidden_states=True).hidden_states[-1][:, i]``), the vector the
target's ``lm_head`` turns into the distribution of ``x_{i+1}``.

At its position ``i + 1`` the head takes the pair ``(x_{i+1}, h_i)`` and computes::

    e  = embed(x_{i+1})                       # the target's own embedding (shared)
    z  = fc(cat([e, h_i], -1))                # Linear(2 * hidden, hidden, bias=True)
    g  = decoder(inputs_embeds=z, position_ids=i + 1, past_key_values, attention_mask)
    logits = lm_head(g)                       # the target's own lm_head (shared)

``decoder`` is a ``transformers.LlamaModel`` with ``num_hidden_layers=1``; its output
``g`` already went through the decoder's *own* final RMSNorm and is fed to the
target's ``lm_head`` **directly, without the target's final norm**.  ``g`` is trained
to regress ``h_{i+1}`` (so it can stand in for ``h_{i+1}`` when the head is chained
to draft further tokens) and ``logits`` to match the target's distribution of
``x_{i+2}``.  ``position_ids`` are the positions of ``input_ids`` in the sequence.
The decoder's attention goes through ``config._attn_implementation``, so a tree
attention registered with ``transformers.AttentionInterface`` applies to it, with a
regular ``transformers`` cache (``DynamicCache``) as ``past_key_values`` (passed on to
``LlamaModel.forward(cache=...)``, the name transformers >= 5.2x uses).

Shapes: ``input_ids int64[B, T]``, ``hidden_states float[B, T, hidden]``; returns
``EagleOutput(hidden_states float[B, T, hidden], logits float[B, T, vocab],
past_key_values)``.

On disk: ``config.json`` (the decoder's ``LlamaConfig`` plus an ``"eagle"`` section)
and ``model.safetensors`` with ``fc.*`` and ``decoder.*`` (the shared embedding and
``lm_head`` are not stored; they come from the target, by default the checkpoint
at ``eagle["target"]`` relative to the head's directory).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaModel

from tree_dev.hf_compat import cache_kwargs

FEATURE = "target.model(...).last_hidden_state (after the target's final norm)"


@dataclass
class EagleOutput:
    hidden_states: torch.Tensor
    logits: torch.Tensor
    past_key_values: object = None


class EagleHead(nn.Module):
    """EAGLE-style head sharing ``embed`` and ``lm_head`` with its target (see module doc)."""

    def __init__(
        self, config: LlamaConfig, embed: nn.Embedding, lm_head: nn.Linear, target: str = ""
    ):
        super().__init__()
        if config.num_hidden_layers != 1:
            raise ValueError(f"EAGLE decoder must have 1 layer, got {config.num_hidden_layers}")
        if embed.weight.shape != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"embedding shape {tuple(embed.weight.shape)} != "
                f"(vocab_size={config.vocab_size}, hidden_size={config.hidden_size})"
            )
        if lm_head.weight.shape != (config.vocab_size, config.hidden_size):
            raise ValueError(f"lm_head shape {tuple(lm_head.weight.shape)} does not match config")
        self.config = config
        self.target_path = target
        d = config.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.decoder = LlamaModel(config)
        # The decoder is only ever called with inputs_embeds; its embedding *is* the target's.
        self.decoder.embed_tokens = embed
        self.lm_head = lm_head

    @classmethod
    def from_target(cls, target, seed: int = 0, **overrides) -> EagleHead:
        """A fresh head for ``target`` (a ``LlamaForCausalLM``): same width, heads and rope."""
        tc = target.config
        kw = dict(
            vocab_size=tc.vocab_size,
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=tc.num_key_value_heads,
            max_position_embeddings=tc.max_position_embeddings,
            rope_parameters=getattr(tc, "rope_parameters", None),
            rms_norm_eps=tc.rms_norm_eps,
            tie_word_embeddings=False,
            bos_token_id=tc.bos_token_id,
            eos_token_id=tc.eos_token_id,
            pad_token_id=tc.pad_token_id,
        )
        kw.update(overrides)
        if kw["rope_parameters"] is None:
            kw.pop("rope_parameters")
        cfg = LlamaConfig(**kw)
        cfg._attn_implementation = tc._attn_implementation
        torch.manual_seed(seed)
        head = cls(cfg, target.get_input_embeddings(), target.get_output_embeddings())
        return head.to(target.dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        past_key_values=None,
        attention_mask=None,
        use_cache: bool = False,
        **kwargs,
    ) -> EagleOutput:
        if input_ids.shape != hidden_states.shape[:-1]:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and hidden_states "
                f"{tuple(hidden_states.shape)} disagree on [B, T]"
            )
        z = self.fc(torch.cat([self.embed(input_ids), hidden_states.to(self.fc.weight.dtype)], -1))
        out = self.decoder(
            inputs_embeds=z,
            position_ids=position_ids,
            attention_mask=attention_mask,
            **cache_kwargs(past_key_values),
            use_cache=use_cache,
            **kwargs,
        )
        g = out.last_hidden_state
        return EagleOutput(g, self.lm_head(g), getattr(out, "past_key_values", None))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights owned by the head: ``fc.*`` and ``decoder.*`` minus the shared embedding."""
        sd = self.state_dict()
        return {
            k: v
            for k, v in sd.items()
            if k.startswith("fc.") or k.startswith("decoder.")
            if k != "decoder.embed_tokens.weight"
        }

    def save_pretrained(self, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        """Write ``config.json`` + ``model.safetensors`` atomically (``dtype``: storage dtype)."""
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        sd = {
            k: v.detach().to(dtype or v.dtype).contiguous()
            for k, v in self.trainable_state_dict().items()
        }
        cfg = self.config.to_dict()
        cfg["eagle"] = {
            "target": self.target_path,
            "feature": FEATURE,
            "output": "decoder final norm -> target lm_head (no target final norm)",
            "torch_dtype": str(next(iter(sd.values())).dtype).removeprefix("torch."),
        }
        _atomic_write(p / "config.json", json.dumps(cfg, indent=2, sort_keys=True).encode())
        fd, tmp = tempfile.mkstemp(dir=p, suffix=".tmp")
        os.close(fd)
        try:
            save_file(sd, tmp, metadata={"format": "pt"})
            os.replace(tmp, p / "model.safetensors")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        target=None,
        torch_dtype: torch.dtype = torch.float32,
        attn_implementation: str | None = None,
    ) -> EagleHead:
        """Load a head saved by :meth:`save_pretrained`.

        ``target``: the ``LlamaForCausalLM`` whose embedding and ``lm_head`` the head
        shares; when ``None`` it is loaded from ``config["eagle"]["target"]``, a path
        relative to ``path`` or ``named:NAME`` (``named.NAMED_MODELS``), in ``torch_dtype``.  Raises
        ``FileNotFoundError`` naming a missing file.
        """
        p = Path(path)
        cfg_file, w_file = p / "config.json", p / "model.safetensors"
        for f in (cfg_file, w_file):
            if not f.is_file():
                raise FileNotFoundError(f"EAGLE head file missing: {f}")
        raw = json.loads(cfg_file.read_text())
        eagle = raw.pop("eagle", None)
        if eagle is None:
            raise ValueError(f"{cfg_file} has no 'eagle' section: not an EAGLE head checkpoint")
        cfg = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("torch_dtype", "dtype")})
        if attn_implementation is not None:
            cfg._attn_implementation = attn_implementation
        if target is None:
            from transformers import AutoModelForCausalLM

            tpath = _target_dir(p, eagle["target"])
            if not eagle["target"] or not tpath.is_dir():
                raise FileNotFoundError(f"target checkpoint of EAGLE head {p} not found: {tpath}")
            target = AutoModelForCausalLM.from_pretrained(
                str(tpath), dtype=torch_dtype, local_files_only=True
            )
        head = cls(
            cfg,
            target.get_input_embeddings(),
            target.get_output_embeddings(),
            target=eagle["target"],
        )
        sd = load_file(str(w_file))
        missing = set(head.trainable_state_dict()) - set(sd)
        unexpected = set(sd) - set(head.trainable_state_dict())
        if missing or unexpected:
            raise ValueError(
                f"{w_file}: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
        head.load_state_dict(sd, strict=False)
        head.fc.to(torch_dtype)
        head.decoder.layers.to(torch_dtype)
        head.decoder.norm.to(torch_dtype)
        head.decoder.rotary_emb.to(torch_dtype)
        return head.eval()


def _target_dir(head_dir: Path, target: str) -> Path:
    """The head's target checkpoint: ``named:NAME`` is a model of ``named.NAMED_MODELS``
    (fetched into the cache on first use), anything else a path relative to the head."""
    if target.startswith("named:"):
        from .named import resolve_model

        return resolve_model(target.removeprefix("named:"))
    return (head_dir / target).resolve()


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
