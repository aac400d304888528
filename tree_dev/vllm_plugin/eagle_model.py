"""The project's EAGLE head as a vLLM model, for vLLM's own ``eagle`` proposer.

vLLM 0.32 ships no EAGLE architecture that computes the project's head
(``tree_dev/models/eagle.py``).  Per draft token, with ``e`` the target's embedding of
the input token and ``h`` the target's feature (its final-norm output: vLLM's Llama
returns exactly that as the hidden state it hands to the proposer)::

    project head:            z = fc(cat(e, h)) + b       one Llama layer WITH its input norm,
                             g = norm(layer(z))          then its own final norm
    vLLM EagleLlama (EAGLE-1): fc has no bias; layer 0 drops its input norm; no final norm
    vLLM Eagle3Llama:        qkv(cat(norm(e), norm(h))): no fc over the pair, other norms
    vLLM EagleMistral:       fc has no bias, and the embedding is always the target's
                             (a bias cannot be folded into it)
    vLLM EagleLlama4:        Llama 4 layers (interleaved rope, no-rope layers, MoE config)

So the head is registered here as its own architecture, built from vLLM's parts
(``VocabParallelEmbedding``, ``ReplicatedLinear``, the Llama decoder layer with its
input norm, ``RMSNorm``), and ``register_eagle_model()`` (called by the plugin's
``register()`` in every vLLM process: the CPU platform spawns its processes, so a
registration in the caller alone does not reach the workers) adds it to vLLM's
``ModelRegistry``.  The export
(``python -m tree_dev.models export-eagle-vllm``) writes ``config.json`` with
``"architectures": ["EagleTreespecLlamaForCausalLM"]``; the name starts with ``Eagle`` so
vLLM's ``EAGLEConfig`` keeps it as is.

Contract inside vLLM (``forward``): ``input_ids int64[T]``, ``positions int64[T]``,
``hidden_states float[T, hidden]`` (target features) -> ``(g, g)``, both
``float[T, hidden]``: the post-norm output is what the target's shared ``lm_head``
reads *and* the feature fed back for the next draft step, as in the project's engine.
vLLM gives the pair ``(x_{i+1}, h_i)`` position ``i`` where the project uses ``i + 1``;
rotary attention depends only on position differences, so the result is the same.
The embedding and ``lm_head`` are not in the checkpoint: vLLM's proposer shares the
target's (``has_own_embed_tokens`` / ``has_own_lm_head`` stay False).  A head with a
draft vocabulary (``draft_vocab_size`` < ``vocab_size``, EAGLE-3's reduced vocabulary)
carries its own ``lm_head [Vd, d]`` (the target's rows of those tokens) and ``d2t``
(target id of draft token ``i`` = ``i + d2t[i]``); ``compute_logits`` then returns
``float[R, V]`` with ``-inf`` outside the draft vocabulary, as EAGLE-3 does in vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
from vllm.model_executor.models.llama_eagle import LlamaDecoderLayer as EagleDecoderLayer
from vllm.model_executor.models.llama_eagle import LlamaModel as EagleLlamaModel
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    get_draft_quant_config,
    maybe_prefix,
)

ARCHITECTURE = "EagleTreespecLlamaForCausalLM"


def register_eagle_model() -> None:
    """Add ``EagleTreespecLlamaForCausalLM`` to vLLM's ``ModelRegistry`` (idempotent)."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, EagleTreespecLlamaForCausalLM)


@support_torch_compile(
    # explicit: with postponed annotations the decorator cannot read the tensor hints
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "hidden_states": 0, "inputs_embeds": 0}
)
class TreespecEagleModel(nn.Module):
    """fc (with bias) -> Llama layer(s) with input norm -> final RMSNorm."""

    hf_to_vllm_mapper = EagleLlamaModel.hf_to_vllm_mapper

    def __init__(self, *, vllm_config, prefix: str = "", start_layer_id: int = 0) -> None:
        super().__init__()
        self.config = config = vllm_config.speculative_config.draft_model_config.hf_config
        quant_config = get_draft_quant_config(vllm_config)
        d = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, d, prefix=maybe_prefix(prefix, "embed_tokens")
        )
        self.fc = ReplicatedLinear(
            input_size=2 * d,
            output_size=d,
            bias=True,
            params_dtype=vllm_config.model_config.dtype,
            quant_config=quant_config,
            prefix=maybe_prefix(prefix, "fc"),
            return_bias=False,
        )
        self.layers = nn.ModuleList(
            [
                EagleDecoderLayer(
                    vllm_config,
                    disable_input_layernorm=False,
                    prefix=maybe_prefix(prefix, f"layers.{i + start_layer_id}"),
                    config=config,
                )
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(d, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids int64[T]``, ``positions int64[T]``, ``hidden_states float[T, d]``."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        x = self.fc(torch.cat((inputs_embeds, hidden_states), dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        g, _ = self.norm(x, residual)
        return g, g

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)


class EagleTreespecLlamaForCausalLM(EagleLlamaForCausalLM):
    """vLLM's EAGLE-1 Llama wrapper around :class:`TreespecEagleModel`."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        nn.Module.__init__(self)
        self.config = vllm_config.speculative_config.draft_model_config.hf_config
        if getattr(self.config, "draft_vocab_size", None) is None:
            self.config.draft_vocab_size = self.config.vocab_size
        target_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        self.model = TreespecEagleModel(
            vllm_config=vllm_config,
            prefix=maybe_prefix(prefix, "model"),
            start_layer_id=target_layers,
        )
        draft_vocab = self.config.draft_vocab_size
        self.reduced_vocab = draft_vocab != self.config.vocab_size
        scale = getattr(self.config, "logit_scale", 1.0)
        self.logits_processor = LogitsProcessor(draft_vocab, scale=scale)
        if self.reduced_vocab:
            if not 0 < draft_vocab < self.config.vocab_size:
                raise ValueError(
                    f"draft_vocab_size {draft_vocab} must be in (0, vocab_size="
                    f"{self.config.vocab_size}]"
                )
            self.lm_head = ParallelLMHead(
                draft_vocab,
                self.config.hidden_size,
                quant_config=get_draft_quant_config(vllm_config),
                prefix=maybe_prefix(prefix, "lm_head"),
            )
            self.has_own_lm_head = True  # vLLM's proposer must not share the target's
            self.draft_id_to_target_id = nn.Parameter(
                torch.zeros(draft_vocab, dtype=torch.long), requires_grad=False
            )
            self._target_ids: torch.Tensor | None = None

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """``float[R, d]`` -> ``float[R, V]`` (``-inf`` outside a draft vocabulary)."""
        logits = self.logits_processor(self.lm_head, hidden_states)
        if not self.reduced_vocab or logits is None:
            return logits
        if self._target_ids is None:  # d2t is loaded after __init__
            base = torch.arange(self.config.draft_vocab_size, device=logits.device)
            self._target_ids = base + self.draft_id_to_target_id
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self._target_ids] = logits
        return full

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load ``fc.*``, ``layers.*``, ``norm.*`` (and ``lm_head.weight`` + ``d2t`` with a
        draft vocabulary); an embedding, or an ``lm_head`` without one, is an error.

        Returns the loaded names plus the embedding the proposer shares from the target,
        so vLLM's loader rejects a checkpoint that leaves any other weight unset.
        """

        def renamed():
            for name, w in weights:
                if self.reduced_vocab and name in ("lm_head.weight", "d2t"):
                    yield ("draft_id_to_target_id" if name == "d2t" else name), w
                    continue
                if "lm_head" in name or "embed_tokens" in name or name == "d2t":
                    raise ValueError(
                        f"{name}: an exported treespec EAGLE head without a draft vocabulary "
                        "shares the target's embedding and lm_head; the checkpoint must "
                        "not carry them"
                    )
                yield "model." + name, w

        loaded = set(AutoWeightsLoader(self).load_weights(renamed()))
        if self.reduced_vocab and not {"lm_head.weight", "draft_id_to_target_id"} <= loaded:
            raise ValueError(
                f"draft_vocab_size {self.config.draft_vocab_size} < vocab_size: the "
                "checkpoint must carry lm_head.weight and d2t"
            )
        return loaded | {"model.embed_tokens.weight"}


class EagleCaptureExtension:
    """Worker extension recording the EAGLE draft's forwards, for checks against HF.

    ``LLM(..., worker_extension_cls="tree_dev.vllm_plugin.eagle_model.EagleCaptureExtension")``
    then ``llm.collective_rpc("treespec_eagle_capture", args=(True,))`` starts recording
    every draft forward and logits call of the worker's proposer, and
    ``llm.collective_rpc("treespec_eagle_captured")`` returns (and clears) them: per call
    a dict of lists, ``{"kind": "forward", "input_ids": [T], "positions": [T],
    "hidden_states": [T][d], "output": [T][d]}`` or ``{"kind": "logits", "logits": [R][V]}``.
    """

    def treespec_eagle_capture(self, on: bool) -> None:
        model = self.model_runner.drafter.model
        if not on:
            model.__dict__.pop("forward", None)
            model.__dict__.pop("compute_logits", None)
            return
        records = self.__dict__.setdefault("_treespec_eagle_records", [])
        forward, compute_logits = type(model).forward, type(model).compute_logits

        def recorded_forward(*args, **kwargs):
            out = forward(model, *args, **kwargs)
            b = dict(zip(("input_ids", "positions", "hidden_states"), args)) | kwargs
            records.append(
                {
                    "kind": "forward",
                    "input_ids": b["input_ids"].tolist(),
                    "positions": b["positions"].tolist(),
                    "hidden_states": b["hidden_states"].float().tolist(),
                    "output": out[0].float().tolist(),
                }
            )
            return out

        def recorded_logits(hidden_states):
            logits = compute_logits(model, hidden_states)
            records.append({"kind": "logits", "logits": logits.float().tolist()})
            return logits

        model.forward = recorded_forward
        model.compute_logits = recorded_logits

    def treespec_eagle_captured(self) -> list[dict]:
        records = self.__dict__.get("_treespec_eagle_records", [])
        out = list(records)
        records.clear()
        return out


# Importing this module (the plugin's register(), or vLLM resolving the worker extension
# above in a worker) makes the architecture available to that process.
register_eagle_model()
