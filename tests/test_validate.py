"""``bench.validate``: the engine's tree verification against dense decoding, per layer.

Tiny random Llama models (2 layers). The validation must pass for the real engine
(fp32 two-way; bf16 three-way against an fp32 baseline), and must fail, naming
layer 0's attention as the first divergent layer, when the tree mask is broken.
"""

from __future__ import annotations

import json

import pytest

import kernels
from bench.validate import capture_modules, main, make_prompts, tiny_random_pair, validate

TREE = "topk:k=2,depth=3,budget=6"


@pytest.fixture(scope="module")
def pair():
    return tiny_random_pair(0)


def _broken_mask(tree, bug: str):
    """A copy of ``tree`` (TreeBatch) with a wrong packed mask.

    ``"sibling"``: node i (local, > 0) also sees node i-1; in a chain (the prefill)
    that is the parent, so nothing changes, in a real tree a node whose predecessor
    is a sibling or cousin sees a token off its path. ``"no_ancestors"``: every node
    sees only itself (and the prefix), in every forward.
    """
    bad = tree.to(tree.device)
    mask = bad.packed_mask.clone()
    cu = tree.cu_nodes.tolist()
    for r in range(len(cu) - 1):
        for local in range(cu[r + 1] - cu[r]):
            row = cu[r] + local
            if bug == "sibling" and local > 0:
                mask[row, (local - 1) // 64] |= 1 << ((local - 1) % 64)
            elif bug == "no_ancestors":
                mask[row] = 0
                mask[row, local // 64] = 1 << (local % 64)
    bad.packed_mask = mask
    return bad


def _sees_wrong_token(parents: list[int], node: int, bug: str) -> bool:
    if bug == "sibling":
        return node >= 1 and not _is_ancestor(parents, node - 1, node)
    return parents[node] >= 0  # no_ancestors: every non-root node misses its ancestors


def _is_ancestor(parents: list[int], a: int, n: int) -> bool:
    while n >= 0:
        if n == a:
            return True
        n = parents[n]
    return False


def test_cli_passes_on_the_real_engine(tmp_path, capsys):
    out = tmp_path / "fp32"
    rc = main(["--random", "--tree", TREE, "--prompts", "2", "--steps", "2", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text[-3000:]
    assert "VERDICT: PASS (two-way)" in text
    data = json.loads((out / "report.json").read_text())
    assert data["passed"] and data["first_divergence"] is None and not data["greedy_mismatches"]
    # every node of every verified tree was paired and compared
    assert data["nodes_compared"] == sum(len(r["parents"]) for s in data["steps"] for r in s)
    assert max(data["max_linf_rel_per_module"].values()) < 1e-5  # fp32: summation order only
    assert set(data["max_linf_rel_per_module"]) == set(capture_modules(2))
    # the trees were real trees (branching, depth > 1), not chains
    trees = [r["parents"] for s in data["steps"] for r in s]
    assert any(len(p) - len(set(p)) > 0 for p in trees)
    assert max(int(d) for v in data["max_linf_rel_per_depth"].values() for d in v) >= 2
    assert (out / "errors.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("backend", ["triton", "nki"])
def test_other_kernel_backends_pass(pair, tmp_path, backend):
    """The engine on the Triton (CPU interpreter) and NKI (NumPy executor) kernels."""
    target, draft = pair
    res = validate(
        target, draft, make_prompts(2), tree=TREE, steps=1, out_dir=tmp_path, kernel_backend=backend
    )
    assert res.passed, res.first_divergence
    assert max(res.per_module().values()) < 1e-5


@pytest.mark.parametrize(
    "dtype, bug", [("fp32", "sibling"), ("fp32", "no_ancestors"), ("bf16", "sibling")]
)
def test_broken_tree_mask_fails_at_layer_0_attention(pair, tmp_path, monkeypatch, dtype, bug):
    target, draft = pair
    real = kernels.tree_attention

    def broken(q, k, v, tree, *args, **kwargs):
        return real(q, k, v, _broken_mask(tree, bug), *args, **kwargs)

    monkeypatch.setattr(kernels, "tree_attention", broken)
    res = validate(
        target, draft, make_prompts(2), tree=TREE, dtype=dtype, steps=2, out_dir=tmp_path
    )
    assert not res.passed
    first = res.first_divergence
    assert first is not None and first.module == "model.layers.0.self_attn", first
    # the node named really sees a wrong token
    assert _sees_wrong_token(res.steps[first.step][first.request].parents, first.node, bug)
    if dtype == "bf16":  # three-way: the pooled ratio is far beyond 1.5
        assert res.aggregate["model_layers_0_self_attn"].linf_ratio > 5
        return
    # at layer 0's attention exactly the nodes that see a wrong token diverge
    wrong = right = 0
    for s, rows in res.rows.items():
        for row in rows:
            if row.module != "model.layers.0.self_attn":
                continue
            if _sees_wrong_token(res.steps[s][row.pair.request].parents, row.pair.node, bug):
                wrong += 1
                assert row.result.linf_rel > 1e-2, row.result
            else:
                right += 1
                assert row.result.linf_rel < 1e-5, row.result
    assert wrong and right


def test_bf16_engine_passes_three_way(pair, tmp_path):
    target, draft = pair
    res = validate(
        target, draft, make_prompts(2), tree=TREE, dtype="bf16", steps=2, out_dir=tmp_path
    )
    assert res.mode == "three-way"
    assert res.passed, res.first_divergence
    assert set(res.aggregate) == {m.replace(".", "_") for m in capture_modules(2)}
    for a in res.aggregate.values():
        assert a.linf_ratio < 1.5 and a.l2_ratio < 1.5 and a.bc >= 0.99, a
    # bf16 really differs from fp32 (the baseline error is not zero), so the ratios mean something
    assert all(a.max_base_linf > 1e-4 for a in res.aggregate.values())


def test_cli_fails_and_names_the_layer_on_a_broken_mask(tmp_path, monkeypatch, capsys):
    real = kernels.tree_attention
    monkeypatch.setattr(
        kernels,
        "tree_attention",
        lambda q, k, v, tree, *a, **kw: real(q, k, v, _broken_mask(tree, "sibling"), *a, **kw),
    )
    out = tmp_path / "broken"
    rc = main(["--random", "--tree", TREE, "--prompts", "2", "--steps", "1", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 1
    assert "VERDICT: FAIL (two-way): first divergent layer: model.layers.0.self_attn" in text
    data = json.loads((out / "report.json").read_text())
    assert not data["passed"] and data["first_divergence"]["module"] == "model.layers.0.self_attn"
