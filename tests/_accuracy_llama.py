"""Tiny Llama helpers for the accuracy end-to-end tests (no download)."""

from __future__ import annotations

import copy

import torch

from accuracy import ModelCapture
from tests.factories import tiny_llama as _tiny_llama

MODULES = [
    "model.embed_tokens",
    "model.layers.0-2.self_attn",
    "model.layers.0-2.mlp",
    "model.layers.0-2",
    "model.norm",
    "lm_head",
]
PERTURBED = "model.layers.1.mlp"


def tiny_llama(seed: int = 0):
    """A 3-layer random Llama (vocab 128, width 64) in SDPA attention, eval mode."""
    return _tiny_llama(
        seed, vocab=128, hidden=64, layers=3, max_positions=64, attn_implementation="sdpa"
    )


def variants(model):
    """HF fp32, HF bf16, and a 'second implementation': bf16 with layer 1's MLP perturbed."""
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    pert = copy.deepcopy(bf16)
    with torch.no_grad():
        pert.model.layers[1].mlp.down_proj.weight.mul_(1.25)
    return model, bf16, pert


def greedy_tokens(model, prompt: list[int], steps: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], 1)
    return ids[0].tolist()


@torch.no_grad()
def capture_full_recompute(model, tokens, prompt_len, capture_dir, req_id="prompt-0"):
    """HF-style: every step runs the whole sequence; captures are [1, seq, H]."""
    cap = ModelCapture(model, MODULES, capture_dir)
    cap.enable()
    for end in range(prompt_len, len(tokens) + 1):
        cap.clear()
        cap.setup_tensor_capture()
        model(torch.tensor([tokens[:end]]))
        cap.save_tensor_captures(
            list(range(end)), is_prefill=end == prompt_len, req_ids=[req_id], token_ids=tokens[:end]
        )
    cap.remove()


@torch.no_grad()
def capture_kv_decode(model, tokens, prompt_len, capture_dir, req_id="req-xyz"):
    """Engine-style: prefill then one token per decode step with a KV cache ([1, 1, H])."""
    cap = ModelCapture(model, MODULES, capture_dir)
    cap.enable()
    cap.setup_tensor_capture()
    out = model(torch.tensor([tokens[:prompt_len]]), use_cache=True)
    cap.save_tensor_captures(list(range(prompt_len)), True, [req_id], token_ids=tokens[:prompt_len])
    pkv = out.past_key_values
    for p in range(prompt_len, len(tokens)):
        cap.clear()
        cap.setup_tensor_capture()
        out = model(torch.tensor([[tokens[p]]]), past_key_values=pkv, use_cache=True)
        pkv = out.past_key_values
        cap.save_tensor_captures([p], False, [req_id], token_ids=[tokens[p]])
    cap.remove()
