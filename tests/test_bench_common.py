"""bench.common: the engine helper's arguments and the environment it starts under."""

from __future__ import annotations

import os

import pytest

from bench.common import TARGET, bench_llm, distinct_ratio, environ


def test_environ_sets_then_restores_and_removes(monkeypatch):
    monkeypatch.setenv("TREESPEC_T_KEEP", "old")
    monkeypatch.delenv("TREESPEC_T_NEW", raising=False)
    with pytest.raises(RuntimeError):
        with environ({"TREESPEC_T_KEEP": "new", "TREESPEC_T_NEW": "1"}):
            assert os.environ["TREESPEC_T_KEEP"] == "new"
            assert os.environ["TREESPEC_T_NEW"] == "1"
            raise RuntimeError("the engine failed to start")
    assert os.environ["TREESPEC_T_KEEP"] == "old"
    assert "TREESPEC_T_NEW" not in os.environ


def test_bench_llm_maps_a_config_to_llm_arguments(monkeypatch):
    import vllm  # installed by scripts/setup wherever the suite runs

    seen = {}

    class FakeLLM:
        def __init__(self, **kw):
            seen.update(kw, env=os.environ.get("TREESPEC_DRAFT_ATTENTION"))

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.delenv("TREESPEC_DRAFT_ATTENTION", raising=False)
    spec = {"method": "eagle", "model": "/e", "num_speculative_tokens": 4}
    cfg = {"spec": spec, "tree": "chain:4", "draft_sampling": True}
    llm, startup = bench_llm(cfg, {"TREESPEC_DRAFT_ATTENTION": "tree"}, enforce_eager=True)
    assert isinstance(llm, FakeLLM) and startup >= 0
    assert seen["model"] == str(TARGET) and seen["dtype"] == "float32"
    assert seen["speculative_config"] == spec and seen["speculative_config"] is not spec
    assert seen["additional_config"] == {"treespec": {"tree": "chain:4", "draft_sampling": True}}
    assert seen["enforce_eager"] is True and seen["env"] == "tree"
    assert "TREESPEC_DRAFT_ATTENTION" not in os.environ
    seen.clear()
    bench_llm({"spec": None, "tree": None})
    assert "speculative_config" not in seen and "additional_config" not in seen


def test_distinct_ratio():
    assert distinct_ratio([[1, 2, 3, 4], [5, 5, 5, 5]]) == pytest.approx((1.0 + 0.25) / 2)
    assert distinct_ratio([]) == 0.0


def test_vllm_e2e_gives_every_scenario_and_rep_fresh_prompts():
    from bench.vllm_e2e import SCENARIOS, prompt_sets

    prompts = [[i] for i in range(len(SCENARIOS) * 3 * 4)]
    sets = prompt_sets(prompts, per=4, reps=3)
    assert [len(row) for row in sets] == [3] * len(SCENARIOS)
    flat = [tuple(p) for row in sets for s in row for p in s]
    assert len(flat) == len(set(flat)) == len(prompts)  # no request met twice
    short = prompt_sets(prompts[:5], per=4, reps=3)  # fewer prompts than slots: they cycle
    assert short[0][1] == [[4], [0], [1], [2]]


def test_queue_cells_spread_output_lengths_and_get_three_prompts_a_slot():
    """A queue cell's requests: lengths evenly over [mean / 2, 3 mean / 2], their mean
    the run's ``--max-tokens``, the same order every call (every engine and rep runs the
    same lengths), shuffled (not sorted: a queue of rising lengths would end in one wave);
    ``bench.auto_policy`` gives a queue8 cell 24 prompts a rep, other cells their
    concurrency."""
    from bench.auto_policy import SCENARIOS, prompt_sets
    from bench.vllm_e2e import cell_prompts, queue_lengths

    got = queue_lengths(24, 64)
    assert got == queue_lengths(24, 64)
    assert (min(got), max(got), sum(got)) == (32, 96, 24 * 64)
    assert got != sorted(got) and len(set(got)) == 24
    assert queue_lengths(1, 64) == [32]
    with pytest.raises(ValueError, match="n=0"):
        queue_lengths(0, 64)
    assert [cell_prompts(s, c, 2) for s, c, _ in SCENARIOS] == [2, 2, 4, 4, 8, 8, 4, 24, 24]
    sets = prompt_sets([[i] for i in range(400)], batch1=2, reps=3)
    assert [len(row[0]) for row in sets] == [2, 2, 4, 4, 8, 8, 4, 24, 24]


def test_trie_replay_walks_the_deepest_matching_path():
    from bench.trie_replay import accepted_length

    parents, tokens = (-1, 0, 0, 1, 2), [9, 5, 6, 7, 8]
    assert accepted_length(parents, tokens, [6, 8, 1]) == 2  # root -> 6 -> 8
    assert accepted_length(parents, tokens, [5, 8]) == 1  # 5 has no child 8
    assert accepted_length(parents, tokens, [1]) == 0
    assert accepted_length(parents, tokens, []) == 0


def test_auto_choices_of_a_cell_are_the_counts_it_added():
    from bench.vllm_e2e import choices_since

    before = {"greedy": {"none": 3, "chain:2": 1}, "sampled": {"none": 5}}
    after = {"greedy": {"none": 3, "chain:2": 4, "ngram:budget=8": 2}, "sampled": {"none": 5}}
    assert choices_since(before, after) == {"greedy": {"chain:2": 3, "ngram:budget=8": 2}}


def test_trie_replay_batch_ratio_by_hand():
    """Two steps of one request: a 2-draft trie accepted whole (3 tokens), then no trie (1
    token). At 10 ms a step and 1 ms a row, batch 1: plain 4 x 11 ms against 13 + 11 ms;
    batch 8: plain 4 x 2.25 ms against 4.25 + 2.25 ms."""
    from bench.trie_replay import batch_ratio

    runs = [{"tokens": 4, "drafts_per_step": [2, 0]}]
    assert batch_ratio(runs, 1, 0.010, 0.001) == pytest.approx(0.044 / 0.024)
    assert batch_ratio(runs, 8, 0.010, 0.001) == pytest.approx(0.009 / 0.0065)
    # a trie every step that is never accepted: only slower, the more so in a batch
    waste = [{"tokens": 2, "drafts_per_step": [4, 4]}]
    assert batch_ratio(waste, 8, 0.010, 0.001) < batch_ratio(waste, 1, 0.010, 0.001) < 1


def test_trie_replay_plain_lockstep_by_hand():
    """Requests of 3, 1 and 2 tokens, 2 at a time: steps of 2, 2 and 2 requests (the
    third joins when the second ends)."""
    from bench.trie_replay import _plain_steps

    assert _plain_steps([3, 1, 2], 2) == [2, 2, 2]
    assert _plain_steps([3, 1, 2], 1) == [1] * 6


def test_trie_replay_lockstep_agrees_with_the_sequential_replay():
    """A fixed trie replayed 3 requests at a time takes each request through the same
    steps as replaying it alone (``replay``), and a planner that never drafts is plain
    decoding exactly (ratio 1)."""
    from bench.trie_replay import _Fixed, replay, replay_batch
    from tree_dev.spec import parse_tree_spec

    prompts = [[1, 2, 3, 1, 2], [4, 5, 4, 5, 4], [7, 8, 9], [1, 1, 1, 1]]
    outputs = [[3, 1, 2, 3, 1, 2, 9], [5, 4, 5, 4, 6], [7, 8, 9, 7, 8], [1, 1, 2, 1]]
    pol = parse_tree_spec("ngram:budget=4")
    alone = [replay(pol, p, o) for p, o in zip(prompts, outputs)]
    got = replay_batch(_Fixed(pol), prompts, outputs, 3, (0.010, 0.001))
    steps = sum(v["steps"] for v in got["ran"].values())
    assert steps == sum(r["steps"] for r in alone)
    assert got["ran"][pol.spec]["accepted"] == sum(sum(r["accepted_per_depth"]) for r in alone)
    assert got["tokens"] == sum(map(len, outputs))

    class Never(_Fixed):
        def plan(self, contexts):
            return {r: ("none", None) for r in contexts}

    plain = replay_batch(Never(pol), prompts, outputs, 3, (0.010, 0.001))
    assert plain["ratio"] == pytest.approx(1.0)
    assert got["ratio"] > 1.0  # these texts repeat: the trie pays
