"""Test factories, one definition each (in ``tree_dev.testing``, shared with the benchmarks).

from tests.factories import BACKENDS, random_tree, tiny_llama, tiny_llama_config
"""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from tree_dev.testing import (
    KERNEL_BACKENDS,
    hf_greedy,
    perturbed,
    random_tree,
    tiny_llama,
    tiny_llama_config,
)

BACKENDS = list(KERNEL_BACKENDS)  # every kernel test runs these against kernels.reference


def engine_models():
    """The local-engine tests' models: ``(target, reference, draft)``: a tiny Llama, an
    untouched copy of it (the greedy reference), and the draft: the target with weights
    perturbed (accepted paths of every length, rejections and bonus tokens all occur)."""
    return tiny_llama(0), tiny_llama(0), perturbed(tiny_llama(0), 0.3, seed=1)


def prompts_with_greedy(reference, n: int = 50, vocab: int = 64, max_tokens: int = 12):
    """``(prompts, greedy outputs)``: ``n`` seeded random prompts of 1-39 tokens and the
    reference's HF greedy continuation of each (``max_tokens``)."""
    gen = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(0, vocab, (int(k),), generator=gen).tolist()
        for k in torch.randint(1, 40, (n,), generator=gen)
    ]
    return prompts, [hf_greedy(reference, p, max_tokens) for p in prompts]


def engine_tau(engine, depths: int = 4) -> tuple[float, list[float]]:
    """``(tau, acceptance per depth)`` over a local ``Engine``'s requests: tokens per
    target step, and accepted / tried drafts at each of the first ``depths`` depths."""
    reqs = list(engine.requests.values())
    tau = sum(len(r.output) for r in reqs) / sum(r.steps for r in reqs)
    tried = [sum(r.depth_tried[d] for r in reqs if len(r.depth_tried) > d) for d in range(depths)]
    acc = [
        sum(r.depth_accepted[d] for r in reqs if len(r.depth_accepted) > d) for d in range(depths)
    ]
    return tau, [a / t for a, t in zip(acc, tried) if t]


def break_tree_mask(monkeypatch) -> None:
    """Verify every tree under a causal chain mask (each node sees every earlier node,
    siblings too), on both of the local engine's verify paths: the tree kernel's
    (``_batch_of``) and the row path's (``_visible``). A lossless proof must then fail."""
    import tree_dev.model_runner as runner_mod
    from tree_dev.tree import TokenTree, TreeBatch

    def chain_masks(trees, device):
        return TreeBatch([TokenTree.chain(t.num_nodes - 1) for t in trees], device=device)

    def chain_mask(tree):
        return torch.ones(tree.num_nodes, tree.num_nodes, dtype=torch.bool).tril()

    monkeypatch.setattr(runner_mod, "_batch_of", chain_masks)
    monkeypatch.setattr(runner_mod, "_visible", chain_mask)


def first_token_counts(
    engine, prompt: list[int], draws: int, temperature: float = 1.0
) -> torch.Tensor:
    """Counts over the vocabulary of the first output token of ``draws`` seeded requests
    (seeds ``0..draws-1``) of ``prompt`` at ``temperature`` on a local ``Engine``."""
    from tree_dev.engine import SamplingParams

    counts = torch.zeros(engine.vocab_size)
    params = [SamplingParams(max_tokens=2, temperature=temperature, seed=s) for s in range(draws)]
    ids = [engine.add_request(prompt, sp) for sp in params]
    while engine.has_work():
        engine.step()
    for i in ids:
        counts[engine.requests[i].output[0]] += 1
    return counts


def chisquare_pvalue(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's chi-square p-value of ``counts`` against probabilities ``p``, tokens with
    fewer than 5 expected draws pooled into one cell (the test's validity condition)."""
    expected = (p.double() * float(counts.sum())).numpy()
    keep = expected >= 5
    obs = list(counts.numpy()[keep]) + [float(counts.numpy()[~keep].sum())]
    exp = list(expected[keep]) + [float(expected[~keep].sum())]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)


__all__ = [
    "BACKENDS",
    "chisquare_pvalue",
    "engine_models",
    "first_token_counts",
    "hf_greedy",
    "perturbed",
    "prompts_with_greedy",
    "random_tree",
    "tiny_llama",
    "tiny_llama_config",
]
