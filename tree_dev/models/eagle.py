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

Draft vocabulary (optional, EAGLE-3's reduced vocabulary): a head trained over the
``Vd`` tokens most frequent in its data drafts over those alone.  Its ``lm_head`` is then
a :class:`DraftVocabHead`: the target's rows at ``draft_vocab int64[Vd]`` (a ``Vd x H``
product instead of ``V x H``, the bulk of a draft step on a memory-bound CPU), with
logits ``-inf`` outside, so ``logits`` keep their ``[B, T, V]`` shape and a token outside
the draft vocabulary has draft probability zero (lossless: the target decides).

On disk: ``config.json`` (the decoder's ``LlamaConfig`` plus an ``"eagle"`` section, and
``draft_vocab_size`` when the vocabulary is reduced) and ``model.safetensors`` with
``fc.*``, ``decoder.*`` and, when reduced, ``draft_vocab int64[Vd]`` (the shared
embedding and ``lm_head`` are not stored; they come from the target: ``eagle["target"]``
is ``named:NAME``, a model of ``named.NAMED_MODELS``, or a path).
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


def check_draft_vocab(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``ids`` as a draft vocabulary of a ``vocab_size`` target: ``int64[Vd]``, sorted,
    unique, within ``[0, vocab_size)``.  Raises ``ValueError`` naming what is wrong."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"draft vocabulary must be a non-empty 1-D tensor, got {shape}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"draft vocabulary must hold integer token ids, got {ids.dtype}")
    ids = ids.long()
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise ValueError(
            f"draft vocabulary token {int(bad[0])} outside the target vocabulary [0, {vocab_size})"
        )
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        at = int((ids[1:] <= ids[:-1]).nonzero()[0]) + 1
        raise ValueError(
            f"draft vocabulary must be sorted and unique: entry {at} is {int(ids[at])} "
            f"after {int(ids[at - 1])}"
        )
    return ids


class DraftVocabHead(nn.Module):
    """The target's ``lm_head`` restricted to a draft vocabulary.

    ``weight float[Vd, H]`` is a copy of the target head's rows ``draft_ids int64[Vd]``;
    ``forward(x float[..., H]) -> float[..., V]`` gives the full head's logits at
    ``draft_ids`` and ``-inf`` at every other token.

    >>> full = nn.Linear(4, 10, bias=False)
    >>> small = DraftVocabHead(full, torch.tensor([1, 5]))
    >>> small(torch.ones(4)).isinf().sum().item()
    8
    """

    def __init__(self, lm_head: nn.Linear, draft_ids: torch.Tensor):
        super().__init__()
        if getattr(lm_head, "bias", None) is not None:
            raise ValueError("a draft vocabulary needs an lm_head without bias")
        self.vocab_size = lm_head.weight.shape[0]
        ids = check_draft_vocab(draft_ids, self.vocab_size)
        self.register_buffer("draft_ids", ids, persistent=False)
        self.weight = nn.Parameter(lm_head.weight.detach()[ids].clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = torch.nn.functional.linear(x, self.weight)
        out = small.new_full((*x.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.draft_ids] = small
        return out


class EagleHead(nn.Module):
    """EAGLE-style head sharing ``embed`` and ``lm_head`` with its target (see module doc).

    ``draft_vocab``: optional ``int64[Vd]`` token ids the head drafts over (see
    :class:`DraftVocabHead`); ``None`` drafts over the whole vocabulary.
    """

    def __init__(
        self,
        config: LlamaConfig,
        embed: nn.Embedding,
        lm_head: nn.Linear,
        target: str = "",
        draft_vocab: torch.Tensor | None = None,
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
        if draft_vocab is not None:
            self.restrict_vocab(draft_vocab)

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """The draft vocabulary ``int64[Vd]``, or ``None`` when it is the whole vocabulary."""
        return self.lm_head.draft_ids if isinstance(self.lm_head, DraftVocabHead) else None

    def restrict_vocab(self, ids: torch.Tensor) -> None:
        """Draft over ``ids`` alone from now on (sorted unique ``int64[Vd]``).  The rows are
        taken from the full shared ``lm_head``; restricting twice is an error."""
        if isinstance(self.lm_head, DraftVocabHead):
            raise ValueError("the head's vocabulary is already restricted")
        self.lm_head = DraftVocabHead(self.lm_head, ids)
        self.config.draft_vocab_size = int(self.lm_head.draft_ids.numel())

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
        if self.draft_vocab is not None:
            sd["draft_vocab"] = self.draft_vocab.to(torch.int64).cpu().contiguous()
        cfg = self.config.to_dict()
        if self.draft_vocab is None:
            cfg.pop("draft_vocab_size", None)
        cfg["eagle"] = {
            "target": self.target_path,
            "feature": FEATURE,
            "output": "decoder final norm -> target lm_head (no target final norm)",
            "torch_dtype": str(next(iter(sd.values())).dtype).removeprefix("torch."),
        }
        _atomic_write(p / "config.json", json.dumps(cfg, indent=2, sort_keys=True).encode())
        save_safetensors_atomic(sd, p / "model.safetensors", {"format": "pt"})

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
        draft_size = raw.pop("draft_vocab_size", None)
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
        sd = load_file(str(w_file))
        draft_vocab = sd.pop("draft_vocab", None)
        if (draft_vocab is None) != (draft_size is None) or (
            draft_vocab is not None and draft_vocab.numel() != draft_size
        ):
            got = None if draft_vocab is None else draft_vocab.numel()
            raise ValueError(
                f"{p}: config draft_vocab_size {draft_size} but the weights hold a "
                f"draft_vocab of {got} tokens"
            )
        head = cls(
            cfg,
            target.get_input_embeddings(),
            target.get_output_embeddings(),
            target=eagle["target"],
            draft_vocab=draft_vocab,
        )
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


def save_safetensors_atomic(
    tensors: dict[str, torch.Tensor], path: Path, meta: dict | None = None
) -> None:
    """``tensors`` to ``path`` (safetensors, ``meta`` as string metadata) through a
    temporary sibling renamed into place: a crash leaves the old file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={k: str(v) for k, v in (meta or {}).items()})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
