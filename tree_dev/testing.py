"""Factories shared by the tests and the benchmarks: small trees and tiny models.

``tests/factories.py`` re-exports them to the tests; the benchmarks import them from here
(nothing imports ``bench`` or ``tests``).

- ``random_tree``: a random topologically ordered ``TokenTree``.
- ``tiny_llama_config`` / ``tiny_llama`` / ``perturbed``: tiny random Llama models and a
  correlated draft (the model with weight noise).
- ``KERNEL_BACKENDS``: the non-reference backends every kernel has.
- ``hf_greedy``: Hugging Face ``generate`` greedy continuation, the losslessness oracle.
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Iterator
from pathlib import Path

import torch

from tree_dev.tree import TokenTree

KERNEL_BACKENDS = ("torch", "triton", "nki")

# vLLM server processes started through ``server_process`` in this interpreter (the test
# session reports the count with its in-process engines: start-up dominates the suite).
VLLM_SERVER_STARTS: list[str] = []


def random_tree(
    n: int, seed: int, width: int | None = None, max_children: int | None = None
) -> TokenTree:
    """A random topologically ordered tree of ``n`` nodes.

    Node i's parent is uniform among the ``width`` nodes before it (``width=1``: a
    chain; ``None``: any earlier node, bushy trees), redrawn while that parent already
    has ``max_children`` children (None: no limit).
    """
    if n < 1:
        raise ValueError(f"random_tree: n must be >= 1, got {n}")
    if max_children is not None and max_children < 1 and n > 1:
        raise ValueError(f"random_tree: max_children must be >= 1, got {max_children}")
    rng = random.Random(seed)
    parents, kids = [-1], [0] * n
    for i in range(1, n):
        lo = 0 if width is None else max(0, i - width)
        p = rng.randrange(lo, i)
        while max_children is not None and kids[p] >= max_children:
            p = rng.randrange(lo, i)  # i - 1 is always free, so this ends
        kids[p] += 1
        parents.append(p)
    return TokenTree.from_parents(parents)


def tiny_llama_config(
    vocab: int = 64,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 512,
    **extra,
):
    """A small ``LlamaConfig`` (``intermediate`` defaults to ``2 * hidden``; ``extra``:
    any other ``LlamaConfig`` field, e.g. ``eos_token_id``)."""
    from transformers import LlamaConfig

    extra.setdefault("eos_token_id", None)
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden if intermediate is None else intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        **extra,
    )


def tiny_llama(seed: int = 0, **config):
    """A random ``LlamaForCausalLM`` of ``tiny_llama_config(**config)``, eval mode; the
    same seed and config give the same weights."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**config)).eval()


def perturbed(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A copy of ``model`` with Gaussian noise (``scale`` x each weight's std) on every
    weight: a draft that agrees with the model often but not always."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp(min=1e-3))
    return other


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` from Hugging Face ``generate`` (no EOS stop)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),  # else HF masks every token equal to pad_token_id
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def shutdown_engine(llm) -> None:
    """Stop a ``vllm.LLM``'s engine processes now (not at interpreter exit), best effort."""
    import contextlib
    import gc

    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@contextlib.contextmanager
def server_process(
    argv: list[str], log: Path, env: dict[str, str], cwd: Path, timeout_s: float = 600
) -> Iterator[str]:
    """Run ``argv`` (a server with ``--port P``; P found in ``argv``) logging to ``log``;
    yield ``http://127.0.0.1:P`` once ``/health`` answers 200, and stop it afterwards
    (terminate, then kill after 60 s). Fails, with the log's tail, if the process exits
    or ``timeout_s`` passes first."""
    import subprocess
    import time

    import httpx

    port = argv[argv.index("--port") + 1]
    if "vllm" in argv or any("vllm.entrypoints" in a for a in argv):
        VLLM_SERVER_STARTS.append(" ".join(argv[1:4]))
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout_s
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited:\n{log.read_text()[-4000:]}")
            if time.time() > deadline:
                raise AssertionError(f"no /health in {timeout_s}s:\n{log.read_text()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
