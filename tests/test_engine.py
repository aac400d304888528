"""The local tree spec-decode engine: lossless greedy and sampling, batching, bad input.

Tiny random Llama models keep this fast. The draft is the target with perturbed
weights, so it agrees with the target often but not always: accepted paths of
every length, rejections and bonus tokens all occur.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.factories import (
    break_tree_mask,
    chisquare_pvalue,
    engine_models,
    engine_tau,
    first_token_counts,
    hf_greedy,
    perturbed,
    prompts_with_greedy,
    tiny_llama,
)
from tree_dev.engine import Engine, SamplingParams

VOCAB = 64
POLICIES = [
    "none",
    "chain:4",
    "paths:[(0,),(1,),(0,0),(0,1),(1,0),(0,0,0)]",
    "medusa:mc_sim_7b_63",
    "topk:k=3,depth=4,budget=12",
    "topk:k=2,depth=5,budget=8,temp=0.4",
    "ngram:budget=8",
    "ngram:budget=6,min=2,matches=2",
    "ngram:budget=8,history=256",
    "hybrid:k=2,depth=3,budget=10,ngram=6",
    "hybrid:k=3,depth=2,budget=6,temp=0.4,p=0.2",
]


@pytest.fixture(scope="module")
def models():
    return engine_models()


@pytest.fixture(scope="module")
def prompts_and_greedy(models):
    return prompts_with_greedy(models[1])


@pytest.mark.parametrize("spec", POLICIES)
def test_greedy_is_lossless_on_50_prompts(models, prompts_and_greedy, spec):
    target, _, draft = models
    prompts, want = prompts_and_greedy
    engine = Engine(target, None if spec == "none" else draft, tree=spec, max_batch=16)
    got = engine.generate(prompts, SamplingParams(max_tokens=12))
    mismatches = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not mismatches, f"{spec}: prompts {mismatches[:5]} differ from the target's greedy"
    if spec != "none":
        accepted = sum(r.accepted_drafts for r in engine.requests.values())
        assert accepted > 0, "the draft never got a token accepted: the test proves nothing"
    # every block is back in the free list once all requests have finished
    assert engine.runner.cache.free_blocks == engine.runner.cache.num_blocks
    if engine.draft_runner is not None:
        assert engine.draft_runner.cache.free_blocks == engine.draft_runner.cache.num_blocks


@pytest.mark.parametrize("spec", ["none", "topk:k=3,depth=4,budget=12", "ngram:budget=8"])
def test_step_events_report_each_tree_and_its_accepted_path(models, prompts_and_greedy, spec):
    """``Engine.on_step``: every event's accepted nodes are a root-first path of the tree
    the target scored, the emitted tokens are those nodes' drafts plus one bonus, and a
    request's emitted tokens over its steps are its output (cut at max_tokens)."""
    target, _, draft = models
    prompts, _ = prompts_and_greedy
    engine = Engine(target, None if spec == "none" else draft, tree=spec, max_batch=4)
    events = []
    engine.on_step(events.append)
    got = engine.generate(prompts[:6], SamplingParams(max_tokens=12))
    emitted: dict[int, list[int]] = {}
    for ev in events:
        assert set(ev.timings) == {"draft", "verify", "walk"} and min(ev.timings.values()) >= 0
        for rec in ev.requests:
            assert len(rec.context) == rec.prefix_len + 1 and len(rec.parents) == len(rec.tokens)
            path = rec.accepted
            assert path[0] == 0 and all(rec.parents[b] == a for a, b in zip(path, path[1:]))
            assert len(rec.emitted) == len(path)
            assert rec.emitted[:-1] == [rec.tokens[n] for n in path[1:]]
            emitted.setdefault(rec.req_id, []).extend(rec.emitted)
    assert [emitted[i][:12] for i in range(6)] == got
    if spec != "none":
        assert any(len(rec.accepted) > 1 for ev in events for rec in ev.requests)


def test_accepts_long_paths_when_draft_equals_target(models, prompts_and_greedy):
    target, reference, _ = models
    prompts, want = prompts_and_greedy
    engine = Engine(target, copy.deepcopy(reference), tree="chain:4", max_batch=4)
    got = engine.generate(prompts[:8], SamplingParams(max_tokens=12))
    assert got == want[:8]
    for rid in range(8):
        st = engine.requests[rid].stats()
        # an identical draft is always right: 4 drafts + 1 bonus per step (bar the last step)
        assert st["acceptance_per_depth"][0] == 1.0
        assert st["mean_accepted_length"] >= 4.0 - 1e-9 or st["steps"] <= 3


def test_eagle_head_is_lossless():
    from tree_dev.models.eagle import EagleHead

    target, reference = tiny_llama(3), tiny_llama(3)
    eagle = EagleHead.from_target(target).eval()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (1, 2, 9, 30)]
    want = [hf_greedy(reference, p, 10) for p in prompts]
    for spec in ("chain:3", "topk:k=2,depth=3,budget=6"):
        engine = Engine(target, eagle=eagle, tree=spec, max_batch=3)
        assert engine.generate(prompts, SamplingParams(max_tokens=10)) == want, spec


def test_eagle_draft_vocabulary_is_lossless_and_the_engine_drafts_inside_it():
    """The committed toy head over a draft vocabulary (``EagleHead.restrict_vocab``):
    lossless whatever the vocabulary; over every token the target emits here it accepts
    at least what the full head accepts (an argmax inside it is the argmax over it); over
    none of them no draft is ever accepted (tau exactly 1), so the engine drafts from
    the restricted logits, not the full ones."""
    from safetensors.torch import load_file

    from tree_dev.models import DEFAULT_CHECKPOINT, load

    ms = load()
    windows = load_file(str(DEFAULT_CHECKPOINT / "eval_slice.safetensors"))["windows"]
    prompts = [windows[r, s : s + 32].tolist() for r in range(windows.shape[0]) for s in (0, 64)]
    want = [hf_greedy(ms.target, p, 24) for p in prompts]
    emitted = torch.tensor(sorted({t for w in want for t in w}))
    others = torch.tensor(sorted(set(range(ms.target.config.vocab_size)) - set(emitted.tolist())))
    taus = {}
    for name, ids in (("full", None), ("emitted", emitted), ("others", others)):
        head = copy.deepcopy(ms.eagle)
        if ids is not None:
            head.restrict_vocab(ids)
        for spec in ("chain:4", "topk:k=2,depth=3,budget=6"):
            engine = Engine(ms.target, eagle=head, tree=spec, max_batch=4)
            got = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
            assert got == want, (name, spec)
            taus[name, spec] = engine_tau(engine)[0]
    for spec in ("chain:4", "topk:k=2,depth=3,budget=6"):
        assert taus["full", spec] > 1.5, taus
        assert taus["emitted", spec] >= taus["full", spec] - 0.05, taus
        assert taus["others", spec] == 1.0, taus


def test_max_tokens_stop_tokens_and_length_limits(models):
    target, reference, draft = models
    prompt = [1, 2, 3, 4]
    full = hf_greedy(reference, prompt, 10)
    engine = Engine(target, draft, tree="chain:4", max_batch=2, max_model_len=64)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=3))
    stop_at = full[5]
    first = full.index(stop_at)
    rid2 = engine.add_request(prompt, SamplingParams(max_tokens=10, stop_token_ids=(stop_at,)))
    while engine.has_work():
        engine.step()
    assert engine.requests[rid].output == full[:3]
    assert engine.requests[rid].finish_reason == "length"
    assert engine.requests[rid2].output == full[: first + 1]
    assert engine.requests[rid2].finish_reason == "stop"
    short = Engine(target, draft, tree="chain:4", max_model_len=8)
    out = short.generate([prompt], SamplingParams(max_tokens=50))[0]
    assert len(prompt) + len(out) == 8 and out == full[:4]


def test_abort_frees_blocks(models):
    target, _, draft = models
    engine = Engine(target, draft, tree="chain:2", max_batch=2)
    a = engine.add_request([1, 2, 3], SamplingParams(max_tokens=30))
    b = engine.add_request([4, 5], SamplingParams(max_tokens=4))
    engine.step()
    engine.abort(a)
    assert engine.requests[a].finish_reason == "abort"
    while engine.has_work():
        engine.step()
    assert engine.requests[b].finished and len(engine.requests[b].output) == 4
    assert engine.runner.cache.free_blocks == engine.runner.cache.num_blocks


@pytest.mark.parametrize(
    "spec,draft_sampling,max_batch",
    [
        ("chain:3", False, 128),  # target_only verification of top-ranked drafts
        ("topk:k=3,depth=2,budget=6", False, 128),
        ("paths:[(0,),(1,),(2,),(0,0),(1,0)]", True, 128),  # draft_probs: sampled children
        # the root (1) occurred before: the trie's first level holds 4, 5 and 9
        ("ngram:budget=6", False, 128),
        ("hybrid:k=2,depth=2,budget=6,ngram=4,p=0.3", False, 128),
        # steps of at most 256 nodes: the CPU walks them in Python (both sampling rules)
        ("topk:k=3,depth=2,budget=6", False, 32),
        ("chain:3", True, 32),
    ],
)
def test_sampling_first_token_matches_target_distribution(spec, draft_sampling, max_batch):
    vocab = 12
    target = tiny_llama(11, vocab=vocab)
    draft = perturbed(target, 0.5, seed=2)
    prompt = [3, 1, 4, 1, 5, 1, 9, 1]
    with torch.no_grad():
        p = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), -1)
    engine = Engine(target, draft, tree=spec, max_batch=max_batch, draft_sampling=draft_sampling)
    draws = 3000
    counts = first_token_counts(engine, prompt, draws)
    accepted = sum(r.accepted_drafts for r in engine.requests.values())
    assert accepted > draws // 10, "drafts were rarely accepted: the test would prove little"
    assert chisquare_pvalue(counts, p) > 1e-3


def test_seeded_sampling_is_reproducible(models):
    target, _, draft = models
    outs = []
    for _ in range(2):
        engine = Engine(target, draft, tree="topk:k=2,depth=3,budget=6")
        outs.append(
            engine.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0.8, seed=42))
        )
    assert outs[0] == outs[1]


def test_bad_input_fails_before_any_work(models):
    target, _, draft = models
    with pytest.raises(ValueError, match="unknown tree spec"):
        Engine(target, draft, tree="bushy:7")
    with pytest.raises(ValueError, match="draft_sampling needs a static tree"):
        Engine(target, draft, tree="topk:k=2,depth=2,budget=4", draft_sampling=True)
    with pytest.raises(ValueError, match="needs a draft model"):
        Engine(target, tree="chain:3")
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(target, tiny_llama(0, vocab=VOCAB + 1), tree="chain:3")
    with pytest.raises(ValueError, match="supports at most 256"):
        Engine(target, draft, tree="topk:k=4,depth=5,budget=300", kernel_backend="triton")
    engine = Engine(target, draft, tree="chain:3", max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len is 16"):
        engine.add_request(list(range(16)))
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([VOCAB])
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request([1], SamplingParams(max_tokens=0))
    assert not engine.has_work()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_target_logits_name_the_request(models, monkeypatch, bad: float):
    """A NaN or infinite logit at any tree node of one request stops the step with a
    ``RuntimeError`` naming that request (the walk would pick garbage), not another."""
    target, _, draft = models
    engine = Engine(target, draft, tree="chain:3", max_batch=2)
    ids = [engine.add_request([1, 2, 3]), engine.add_request([4, 5, 6, 7])]
    real = engine.runner.forward

    def poisoned(*args, **kw):
        hidden, logits = real(*args, **kw)
        if logits is not None and logits.shape[0] == 8:  # the verify: 2 trees x 4 nodes
            logits = logits.clone()
            logits[6, 17] = bad  # node 2 of the second request's tree
        return hidden, logits

    monkeypatch.setattr(engine.runner, "forward", poisoned)
    with pytest.raises(RuntimeError, match=rf"non-finite logits for requests \[{ids[1]}\]"):
        engine.step()


# route -> (the engine's default probe, the flag, the flag of the other route, the
# attribute a switched layer carries)
LINEAR_ROUTES = {
    "onednn": ("onednn_faster", "onednn_linear", "narrow_linear", "_onednn_min_rows"),
    "narrow": ("narrow_available", "narrow_linear", "onednn_linear", "_narrow_max_rows"),
}


@pytest.mark.parametrize("default", [True, False])
@pytest.mark.parametrize("route", sorted(LINEAR_ROUTES))
def test_linear_routes_switched_by_default_where_they_help(monkeypatch, route, default):
    """By default the engine switches the models' fp32 linears to oneDNN exactly where
    ``onednn_faster()`` (AVX-512 CPUs) and to the few-row GEMM exactly where
    ``narrow_available()``; ``onednn_linear`` / ``narrow_linear`` = True / False force
    each on / off (a torch or CPU that cannot run a route leaves the layers alone)."""
    import tree_dev.engine_setup as setup_mod
    from tree_dev.narrow_linear import narrow_available
    from tree_dev.onednn_linear import onednn_available

    probe, flag, other, marker = LINEAR_ROUTES[route]
    monkeypatch.setattr(setup_mod, probe, lambda: default)
    can = {"onednn": onednn_available, "narrow": narrow_available}[route]()

    def switched(**flags) -> tuple[int, int]:
        target, draft = tiny_llama(0), perturbed(tiny_llama(0), 0.3, seed=1)
        Engine(target, draft, tree="chain:2", max_batch=1, max_model_len=64, **flags)
        return tuple(sum(marker in x.__dict__ for x in m.modules()) for m in (target, draft))

    n_linear = sum(isinstance(x, torch.nn.Linear) for x in tiny_llama(0).modules())
    assert n_linear > 0
    assert switched(**{flag: False, other: False}) == (0, 0)
    want = n_linear if default and can else 0
    assert switched(**{other: False}) == (want, want)
    want = n_linear if can else 0
    assert switched(**{flag: True, other: False}) == (want, want)


def test_plain_decoding_runs_no_tree_kernel(models, prompts_and_greedy, monkeypatch):
    """A root-only step is a plain decode: no tree attention, walk or compaction."""
    import kernels

    target, reference, _ = models
    prompts, want = prompts_and_greedy
    engine = Engine(target, tree="none", max_batch=4)
    engine.generate(prompts[:1], SamplingParams(max_tokens=2))  # prefill path warmed
    calls = {"tree_attention": 0, "tree_walk": 0, "kv_compact": 0}
    for name in calls:
        real = getattr(kernels, name)

        def counting(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(kernels, name, counting)
    rid = engine.add_request(prompts[3], SamplingParams(max_tokens=12))
    engine.step()  # admission: the prompt's prefill runs tree attention (a causal chain)
    prefill_calls = calls["tree_attention"]
    while engine.has_work():
        engine.step()
    assert engine.requests[rid].output == want[3]
    assert calls == {"tree_attention": prefill_calls, "tree_walk": 0, "kv_compact": 0}
    # a sampled plain decode draws what the walk would draw from the same generator
    sp = SamplingParams(max_tokens=12, temperature=0.9, seed=5)
    monkeypatch.undo()
    plain = Engine(target, tree="none").generate([prompts[3]], sp)[0]
    assert plain == _walk_only_plain(reference, prompts[3], sp)


def _walk_only_plain(model, prompt, sp):
    """Plain sampling by ``kernels.tree_walk`` on root-only trees, full recompute."""
    import kernels
    from tree_dev.tree import TokenTree, TreeBatch

    gen = torch.Generator().manual_seed(sp.seed)
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(sp.max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1:]
            res = kernels.tree_walk(
                logits.float(),
                torch.tensor([ids[-1]]),
                TreeBatch([TokenTree.chain(0)]),
                "target_only",
                uniforms=torch.rand(1, 2, generator=gen),
                temperature=torch.tensor([sp.temperature]),
                top_p=torch.tensor([sp.top_p]),
            )
            out.append(int(res.output_tokens[0, 0]))
            ids.append(out[-1])
    return out


def test_decode_attention_equals_tree_attention_on_paged_blocks():
    """The decode shortcut (SDPA over the request's cached tokens, a view or a gather)
    gives tree attention's output for a one-node step, on consecutive and scattered blocks."""
    from tree_dev.attention import TreeForward, treespec_attention
    from tree_dev.kv_cache import PagedKVCache
    from tree_dev.tree import TokenTree, TreeBatch

    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(1, 16, 4, 2, 8)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    cache.reserve(0, 9)  # blocks 0, 1, 2: consecutive
    cache.reserve(1, 3)  # block 3
    cache.reserve(0, 13)  # block 4 after the gap: request 0 is now scattered
    cache.reserve(2, 6)  # blocks 5, 6
    lens = [13, 3, 6]
    kv = [cache.causal_slots(r, n) for r, n in enumerate(lens)]
    assert isinstance(kv[0], torch.Tensor) and kv[0].tolist() == list(range(12)) + [16]
    assert kv[1] == slice(12, 15) and kv[2] == slice(20, 26)
    q = torch.randn(1, 4, 3, 8, generator=gen)
    k_new = torch.randn(1, 2, 3, 8, generator=gen)
    v_new = torch.randn(1, 2, 3, 8, generator=gen)
    slots = torch.tensor([cache.slot(r, n - 1) for r, n in enumerate(lens)])
    layer = torch.nn.Module()
    layer.layer_idx = 0
    fast = TreeForward(cache, None, None, None, slots, None, "torch", [(x, None) for x in kv])
    got, _ = treespec_attention(layer, q, k_new, v_new, None, 0.3, tree_ctx=fast)
    tree = TreeForward(
        cache,
        TreeBatch([TokenTree.chain(0)] * 3),
        torch.tensor([n - 1 for n in lens]),
        cache.block_table([0, 1, 2]),
        slots,
        None,
        "reference",
    )
    want, _ = treespec_attention(layer, q, k_new, v_new, None, 0.3, tree_ctx=tree)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["ngram:budget=8,matches=4", "hybrid:k=2,depth=3,budget=10"])
def test_greedy_proof_fails_without_the_tree_mask(models, prompts_and_greedy, spec, monkeypatch):
    """The 50-prompt proof can fail: verify trees under a causal chain mask (each node
    sees every earlier node, siblings too) and the outputs leave the target's greedy."""
    target, _, draft = models
    prompts, want = prompts_and_greedy
    break_tree_mask(monkeypatch)
    engine = Engine(target, draft, tree=spec, max_batch=16)
    got = engine.generate(prompts, SamplingParams(max_tokens=12))
    assert sum(g != w for g, w in zip(got, want)) > 0


def test_small_forward_rows_equal_tree_attention(monkeypatch):
    """The row path (one masked SDPA call per request over its prefix + tree) computes
    what the tree-attention kernel computes: draft levels (a few new nodes below
    cached ones) and, on the CPU's torch backend, whole verify trees of up to
    ``ROW_PATH_TREE_NODES`` nodes; the kernel runs only when the path is forced."""
    import kernels
    from tree_dev.model_runner import ROW_PATH_TREE_NODES, Runner
    from tree_dev.testing import random_tree

    model = tiny_llama(4)
    runner = Runner(model, 2, 2, 16, 64, 4, "torch")
    assert runner.row_nodes == ROW_PATH_TREE_NODES
    from tree_dev.attention import register

    register()
    model.set_attn_implementation("treespec")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 14)]
    runner.prefill([0, 1], [0, 0], prompts)
    small = [tree_of_parents((-1, 0, 0, 1, 1)), tree_of_parents((-1, 0, 1, 1))]
    big = [random_tree(23, seed=3), random_tree(ROW_PATH_TREE_NODES, seed=4)]
    cases = [
        # root + first level, and a whole small tree; then the next level below them
        (small, [[0, 1, 2], [0, 1, 2, 3]]),
        (small, [[3, 4], [3]]),
        (big, None),  # verify forwards of whole trees
    ]
    calls = []
    real = kernels.tree_attention
    monkeypatch.setattr(kernels, "tree_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    for trees, new_nodes in cases:
        n_new = [t.num_nodes for t in trees] if new_nodes is None else list(map(len, new_nodes))
        tokens = torch.randint(0, VOCAB, (sum(n_new),), generator=gen).tolist()
        runner.row_nodes = ROW_PATH_TREE_NODES
        h_rows, l_rows = runner.forward([0, 1], [9, 14], trees, new_nodes, tokens)
        assert calls == []  # the row path
        runner.row_nodes = 0  # force the tree kernel
        h_tree, l_tree = runner.forward([0, 1], [9, 14], trees, new_nodes, tokens)
        assert calls
        calls.clear()
        # fp32 attention over <= 100 keys, then 2 layers: summation-order rounding ~1e-6
        torch.testing.assert_close(h_rows, h_tree, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(l_rows, l_tree, rtol=1e-4, atol=1e-4)
    assert Runner(model, 2, 2, 16, 8, 4, "reference").row_nodes < ROW_PATH_TREE_NODES


def tree_of_parents(parents):
    from tree_dev.tree import TokenTree

    return TokenTree(parents)
