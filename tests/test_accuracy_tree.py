"""Tree-aware capture metadata and pairing of tree nodes with dense reference steps."""

from __future__ import annotations

import io
import os
import sys

import pytest
import torch

from accuracy import (
    CaptureWriter,
    ModelCapture,
    TreeMetadata,
    compare_tree_with_dense,
    errors_by_depth,
    pair_tree_nodes_with_dense_steps,
    print_tree_report,
)
from accuracy.plots import plot_tree_errors
from accuracy.tensor_io import read

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

# Tree at seq_len 10:      0 (tok 50, pos 10)
#                         /                \
#            1 (tok 61, pos 11)      2 (tok 62, pos 11)
#                  |                        |
#            3 (tok 71, pos 12)      4 (tok 72, pos 12)
PARENTS = [-1, 0, 0, 1, 2]
TOKENS = [50, 61, 62, 71, 72]
POS = [10, 11, 11, 12, 12]
PATH = [50, 61, 71]  # dense decoding along the accepted path 0 -> 1 -> 3


def _value(pos: int, tok: int) -> torch.Tensor:
    return torch.full((4,), float(pos * 1000 + tok))


def _write(tmp_path, kv_cache: bool, corrupt_node: int | None = None):
    prompt = list(range(100, 110))
    tree_w = CaptureWriter(str(tmp_path / "tree"))
    tree_w.enable()
    rows = torch.stack([_value(p, t) for p, t in zip(POS, TOKENS, strict=True)])
    if corrupt_node is not None:
        rows[corrupt_node] += 500.0  # ~4% of the values
    tree_w.write(
        [rows.unsqueeze(0)],
        ["layer"],
        ["req"],
        POS,
        False,
        tree=TreeMetadata(parents=PARENTS, tokens=TOKENS),
    )
    dense_w = CaptureWriter(str(tmp_path / "dense"))
    dense_w.enable()
    seq = prompt + PATH
    dense_w.write(
        [torch.stack([_value(p, t) for p, t in enumerate(prompt)])],
        ["layer"],
        ["d"],
        list(range(10)),
        True,
        token_ids=prompt,
    )
    for end in range(11, 14):
        if kv_cache:  # one new row per step
            pos = [end - 1]
        else:  # HF recompute: all rows, the last is new
            pos = list(range(end))
        t = torch.stack([_value(p, seq[p]) for p in pos])
        dense_w.write([t], ["layer"], ["d"], pos, False, token_ids=[seq[p] for p in pos])
    return read(str(tmp_path / "tree"))[0], read(str(tmp_path / "dense"))


@pytest.mark.parametrize("kv_cache", [True, False])
def test_pairing_follows_root_to_node_paths(tmp_path, kv_cache):
    tree, dense = _write(tmp_path, kv_cache)
    pairs = pair_tree_nodes_with_dense_steps(tree, dense)
    got = [(p.node, p.depth, p.position, p.dense_index, p.dense_slot) for p in pairs]
    if kv_cache:
        assert got == [(0, 0, 10, 1, 0), (1, 1, 11, 2, 0), (3, 2, 12, 3, 0)]
    else:
        assert got == [(0, 0, 10, 1, 10), (1, 1, 11, 2, 11), (3, 2, 12, 3, 12)]
    assert pair_tree_nodes_with_dense_steps(tree, dense, accepted_nodes=[0, 1, 3]) == pairs
    rows = compare_tree_with_dense(tree, dense, pairs)
    assert [r.result.name for r in rows] == ["layer/node0", "layer/node1", "layer/node3"]
    assert all(r.result.max_abs == 0.0 for r in rows)


def test_corrupted_node_is_reported_at_its_depth(tmp_path):
    tree, dense = _write(tmp_path, True, corrupt_node=1)
    rows = compare_tree_with_dense(tree, dense)
    bad = [r.pair.node for r in rows if r.result.max_abs > 0]
    assert bad == [1]
    assert errors_by_depth(rows)["layer"][0] == 0.0 and errors_by_depth(rows)["layer"][1] > 0
    buf = io.StringIO()
    assert print_tree_report(rows, file=buf) == 1
    assert "layer/node1" in buf.getvalue() and "SUMMARY: 1 deviation(s)" in buf.getvalue()
    png = plot_tree_errors(errors_by_depth(rows), str(tmp_path / "depth.png"))
    assert open(png, "rb").read(4) == b"\x89PNG"


def test_pairing_bad_input(tmp_path):
    tree, dense = _write(tmp_path, True)
    with pytest.raises(ValueError, match="accepted node 4 is not a child of 1"):
        pair_tree_nodes_with_dense_steps(tree, dense, accepted_nodes=[0, 1, 4])
    with pytest.raises(ValueError, match="accepted node 2 has token 62"):
        pair_tree_nodes_with_dense_steps(tree, dense, accepted_nodes=[0, 2])
    with pytest.raises(ValueError, match="no tree metadata"):
        pair_tree_nodes_with_dense_steps(dense[1], dense)


def test_tiny_llama_tree_nodes_match_dense_decoding_on_their_paths(tmp_path):
    """Per-node hidden states of a tree (each node run on prompt + its path, as a
    correct tree attention would produce them) against dense KV decoding along the
    accepted path: paired nodes agree to fp32 precision; pairing an off-path node by
    position alone would not."""
    sys.path.insert(0, os.path.dirname(__file__))
    from _accuracy_llama import tiny_llama

    model = tiny_llama()
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    mods = ["model.layers.0-2"]
    cap = ModelCapture(model, mods, str(tmp_path / "node_runs"))
    rows: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for s in range(len(PARENTS)):
            path, n = [], s
            while n != -1:
                path.append(TOKENS[n])
                n = PARENTS[n]
            cap.clear()
            cap.setup_tensor_capture()
            model(torch.tensor([prompt + path[::-1]]))
            cap.save_tensor_captures(None, True)
            for name, t in cap.registry.get_all():
                rows.setdefault(name, []).append(t[0, -1])
    tw = CaptureWriter(str(tmp_path / "tree"))
    tw.enable()
    names = list(rows)
    tw.write(
        [torch.stack(rows[n])[None] for n in names],
        names,
        ["req"],
        POS,
        False,
        tree=TreeMetadata(parents=PARENTS, tokens=TOKENS),
    )
    dense_cap = ModelCapture(model, mods, str(tmp_path / "dense"))
    dense_cap.enable()
    with torch.no_grad():
        dense_cap.setup_tensor_capture()
        out = model(torch.tensor([prompt]), use_cache=True)
        dense_cap.save_tensor_captures(list(range(10)), True, ["d"], token_ids=prompt)
        pkv = out.past_key_values
        for i, tok in enumerate(PATH):
            dense_cap.clear()
            dense_cap.setup_tensor_capture()
            out = model(torch.tensor([[tok]]), past_key_values=pkv, use_cache=True)
            pkv = out.past_key_values
            dense_cap.save_tensor_captures([10 + i], False, ["d"], token_ids=[tok])
    tree = read(str(tmp_path / "tree"))[0]
    dense = read(str(tmp_path / "dense"))
    res = compare_tree_with_dense(tree, dense)
    assert sorted({r.pair.node for r in res}) == [0, 1, 3]
    assert len(res) == 3 * 3 and max(r.result.linf_rel for r in res) < 1e-5
    # node 2 sits at position 11 like node 1 but on another path: forcing that pair fails
    p1 = next(r.pair for r in res if r.pair.node == 1)
    from accuracy import TreeNodePair

    wrong = TreeNodePair(0, 2, 1, 11, 2, p1.dense_index, p1.dense_slot)
    off = compare_tree_with_dense(tree, dense, pairs=[wrong])
    assert min(r.result.linf_rel for r in off) > 1e-2


def test_cli_tree_command(tmp_path, capsys):
    from accuracy.__main__ import main

    _write(tmp_path / "ok", True)
    args = ["tree", str(tmp_path / "ok" / "dense"), str(tmp_path / "ok" / "tree")]
    assert main(args + ["--plot", str(tmp_path / "d.png")]) == 0
    out = capsys.readouterr().out
    assert "layer/node3" in out and "layer/node2" not in out
    assert (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"
    _write(tmp_path / "bad", True, corrupt_node=3)
    bad = ["tree", str(tmp_path / "bad" / "dense"), str(tmp_path / "bad" / "tree")]
    assert main(bad + ["--accepted", "0,1,3"]) == 1
    assert "SUMMARY: 1 deviation(s)" in capsys.readouterr().out
    assert main(["tree", str(tmp_path / "ok" / "dense"), str(tmp_path / "ok" / "dense")]) == 2
    assert "no pass carries tree metadata" in capsys.readouterr().err
