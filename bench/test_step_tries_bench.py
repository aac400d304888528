"""``tree: auto``'s per-step tries (pytest-benchmark): every n-gram trie candidate of one
request built in one call (``shapes.step_tries``: ``proposer.ngram_tries``, one match
scan, one trie per distinct match set) beside the same tries built one at a time
(``proposer.ngram_trie`` per candidate), on three contexts of 190 tokens.

    pytest bench/test_step_tries_bench.py --benchmark-only --benchmark-group-by=param:case

Each case's tries are checked equal between the two ways once, before timing. The
engines call this for every request on every step, so its microseconds are per
request-step.
"""

from __future__ import annotations

import random

import pytest

from tree_dev.auto.shapes import make_candidates, step_tries
from tree_dev.proposer import ngram_trie
from tree_dev.spec import AUTO_MODEL_CANDIDATES, AUTO_TRIE_CANDIDATES, NgramPolicy


def contexts() -> dict[str, list[int]]:
    """A prompt followed by a 11-token loop (greedy on a small model), by novel text,
    and 190 tokens of a 20-token vocabulary (many short matches)."""
    rng = random.Random(0)
    prompt = [rng.randrange(40) for _ in range(96)]
    loop = [rng.randrange(40) for _ in range(11)]
    return {
        "loop": prompt + loop * 8 + loop[:6],
        "novel": prompt + [rng.randrange(300) for _ in range(94)],
        "small_vocab": [rng.randrange(20) for _ in range(190)],
    }


CASES = [(c, s) for c in contexts() for s in ("model", "tries")]
CANDIDATES = {"model": AUTO_MODEL_CANDIDATES, "tries": AUTO_TRIE_CANDIDATES}


def one_at_a_time(ctx: list[int], cands) -> dict:
    out = {}
    for c in cands:
        if isinstance(c.policy, NgramPolicy):
            tree, tokens = ngram_trie(ctx, c.policy)
            out[c.name] = (tree, tokens) if tree.num_nodes > 1 else None
    return out


@pytest.mark.parametrize("way", ["shared", "one_at_a_time"])
@pytest.mark.parametrize("case,cands", CASES)
def test_step_tries(benchmark, case, cands, way):
    ctx = contexts()[case]
    cs = make_candidates(CANDIDATES[cands])
    shared, alone = step_tries(ctx, cs), one_at_a_time(ctx, cs)
    assert shared.keys() == alone.keys()
    for name, t in shared.items():
        a = alone[name]
        assert (t is None) == (a is None), name
        if t is not None:
            assert t.tokens == a[1] and t.tree.parents.tolist() == a[0].parents.tolist()
    fn = step_tries if way == "shared" else one_at_a_time
    benchmark(fn, ctx, cs)
