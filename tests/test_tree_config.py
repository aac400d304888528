"""The one typed tree config (``tree_dev.spec.TreeSettings``): its budget and KV slots, the
rule of which draft runs which tree, and its vLLM dicts, written out here by hand."""

from __future__ import annotations

import dataclasses

import pytest

from tree_dev.spec import TreeSettings, check_draft, draft_slots, parse_tree_spec
from tree_dev.vllm_plugin import config as plugin_config

TOPK = "topk:k=2,depth=4,budget=8"
HYBRID = "hybrid:k=2,depth=3,budget=8"


@pytest.mark.parametrize(
    "spec,budget,slots",
    [
        ("none", 0, 0),
        ("chain:4", 4, 3),  # the leaf is never forwarded
        ("chain:1", 1, 0),
        ("paths:[(0,), (1,), (0, 0)]", 3, 1),  # only node 1 has a child
        (TOPK, 8, 6),  # k * (depth - 1)
        ("topk:k=4,depth=5,budget=8", 8, 16),  # SGLang-shaped: forwards more than its budget
        ("ngram:budget=6", 6, 0),  # the trie forwards nothing through a draft
        (HYBRID, 8, 4),  # its top-K part: 2 * (3 - 1)
    ],
)
def test_draft_budget_and_slots(spec, budget, slots):
    s = TreeSettings.parse(spec)
    assert (s.draft_budget, s.draft_slots) == (budget, slots)
    assert draft_slots(parse_tree_spec(spec)) == slots
    assert plugin_config.draft_slots is draft_slots  # the plugin's name is the core's


@pytest.mark.parametrize(
    "spec,draft,sampling,model,speculative_config,section",
    [
        (
            "chain:4",
            "draft",
            False,
            "/m/draft",
            {"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 4},
            None,  # vLLM's own chain: no plugin
        ),
        (
            "chain:3",
            "ngram",
            False,
            None,
            {"method": "ngram", "num_speculative_tokens": 3},
            None,
        ),
        (
            "chain:4",
            "eagle",
            True,
            "/m/eagle",
            {"method": "eagle", "model": "/m/eagle", "num_speculative_tokens": 4},
            {"tree": "chain:4", "draft_sampling": True},  # sampled drafts: the plugin
        ),
        (
            "paths:[(0,), (1,), (0, 0)]",
            "draft",
            True,
            "d",
            {"method": "draft_model", "model": "d", "num_speculative_tokens": 3},
            {"tree": "paths:[(0,), (1,), (0, 0)]", "draft_sampling": True},
        ),
        (
            TOPK,
            "eagle",
            False,
            "/m/eagle",
            {"method": "eagle", "model": "/m/eagle", "num_speculative_tokens": 8},
            {"tree": "topk:k=2,depth=4,budget=8"},
        ),
        (
            "ngram:budget=8,history=4096",
            "ngram",
            False,
            None,
            {"method": "ngram", "num_speculative_tokens": 8},
            {"tree": "ngram:budget=8,history=4096"},
        ),
        (
            HYBRID,
            "draft",
            False,
            "/m/draft",
            {"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 8},
            {"tree": "hybrid:k=2,depth=3,budget=8"},
        ),
        ("none", None, False, None, None, None),
    ],
)
def test_vllm_dicts(spec, draft, sampling, model, speculative_config, section):
    s = TreeSettings.parse(spec, sampling, draft=draft, builtin_chains=True)
    assert s.vllm_speculative_config(model) == speculative_config
    assert s.uses_plugin == (section is not None)
    assert (s.treespec_section() if s.uses_plugin else None) == section


def test_treespec_section_of_any_tree_and_the_unsaid_draft():
    # a plugin chain of top-ranked drafts (tests and benchmarks run it through the plugin)
    assert TreeSettings.parse("chain:4").treespec_section() == {"tree": "chain:4"}
    assert TreeSettings.parse("none").treespec_section() is None
    # without draft=, an n-gram trie is drafted by "ngram"; a model tree is not said
    assert TreeSettings.parse("ngram:budget=5").draft == "ngram"
    assert TreeSettings.parse("ngram:budget=5").vllm_speculative_config() == {
        "method": "ngram",
        "num_speculative_tokens": 5,
    }
    unsaid = TreeSettings.parse(TOPK)
    assert unsaid.draft is None
    with pytest.raises(ValueError, match=r"tree 'topk:k=2,depth=4,budget=8' needs a draft"):
        unsaid.vllm_speculative_config("/m/eagle")
    with pytest.raises(ValueError, match="'ngram' draft of 'ngram:budget=5' takes no model"):
        TreeSettings.parse("ngram:budget=5").vllm_speculative_config("/m/draft")


@pytest.mark.parametrize(
    "spec,kw,needles",
    [
        # which draft runs which tree
        ("ngram:budget=8", {"draft": "eagle"}, ["'ngram:budget=8'", "not 'eagle'"]),
        ("ngram:budget=8", {"draft": None}, ["'ngram:budget=8'", "none given"]),
        (TOPK, {"draft": "ngram"}, ["'topk:k=2,depth=4,budget=8'", "not 'ngram'"]),
        (TOPK, {"draft": None}, ["'topk:k=2,depth=4,budget=8'", "needs a draft"]),
        (HYBRID, {"draft": "ngram"}, ["'hybrid:k=2,depth=3,budget=8'", "not 'ngram'"]),
        ("chain:4", {"draft": "ngram"}, ["'chain:4'", "not 'ngram'", "ngram:budget=N"]),
        ("none", {"draft": "draft"}, ["'none'", "takes no draft", "'draft'"]),
        ("chain:4", {"draft": "medusa"}, ["draft 'medusa'", "'chain:4'"]),
        # vLLM's own ngram chain takes no sampled drafts
        (
            "chain:4",
            {"draft": "ngram", "builtin_chains": True, "draft_sampling": True},
            ["draft_sampling", "'chain:4'", "no distribution"],
        ),
        # draft sampling
        (TOPK, {"draft_sampling": True}, ["draft_sampling needs a static tree", "'topk:"]),
        ("chain:4", {"draft_sampling": "yes"}, ["draft_sampling = 'yes'"]),
        # the spec's own fields: unknown, repeated, wrong kind
        ("topk:k=2,width=4,budget=8", {}, ["bad field 'width=4'"]),
        ("topk:k=2,k=3,depth=4,budget=8", {}, ["'k' given twice"]),
        ("ngram:budget=x", {}, ["'budget=x'", "not an integer"]),
        ("bushy:3", {}, ["unknown tree spec kind 'bushy'"]),
    ],
)
def test_invalid_settings_name_the_field_and_tree(spec, kw, needles):
    with pytest.raises(ValueError) as e:
        TreeSettings.parse(spec, **kw)
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_the_draft_rule_with_vllms_own_chains():
    check_draft(parse_tree_spec("chain:4"), "ngram", builtin_chains=True)  # vLLM's ngram chain
    with pytest.raises(ValueError, match="on vLLM's own proposer, chain:K"):
        check_draft(parse_tree_spec(TOPK), "ngram", builtin_chains=True)
    for spec, draft in (("chain:4", "draft"), (TOPK, "eagle"), ("ngram:budget=2", "ngram")):
        check_draft(parse_tree_spec(spec), draft)
    check_draft(parse_tree_spec("none"), None)


def test_surfaces_prefix_the_rules_messages():
    with pytest.raises(ValueError, match=r"^argument --tree: tree 'chain:3' needs a draft"):
        TreeSettings.parse("chain:3", draft=None, draft_field="argument --tree")
    with pytest.raises(ValueError, match=r"^argument --draft-sampling: needs a static tree"):
        TreeSettings.parse(TOPK, True, sampling_field="argument --draft-sampling:")


def test_budget_mismatch_names_both_numbers():
    s = TreeSettings.parse(TOPK, draft="draft")
    s.check_num_speculative_tokens(8)
    with pytest.raises(ValueError) as e:
        s.check_num_speculative_tokens(4, field="speculative_config num_speculative_tokens")
    msg = str(e.value)
    assert msg.startswith("speculative_config num_speculative_tokens=4 must equal")
    assert "budget 8" in msg and "'topk:k=2,depth=4,budget=8' (it has 8 draft nodes" in msg


def test_plugin_tree_config_holds_the_settings():
    sc = type("SC", (), {"method": "eagle", "num_speculative_tokens": 4})()
    cfg = plugin_config.parse({"tree": "chain:4", "draft_sampling": True}, sc)
    assert cfg.settings == TreeSettings(parse_tree_spec("chain:4"), True, "eagle")
    assert (cfg.spec, cfg.method, cfg.num_draft_tokens, cfg.draft_sampling) == (
        "chain:4",
        "eagle",
        4,
        True,
    )
    assert cfg.uses_draft_model and cfg.policy is cfg.settings.policy
    # treespec_set_tree's switch: another tree, the same draft and switches
    new = plugin_config.parse({"tree": "paths:[(0,), (1,), (0, 0), (0, 1)]"}, sc)
    switched = cfg.with_policy(new.policy)
    assert (switched.spec, switched.method, switched.draft_sampling) == (new.spec, "eagle", True)
    assert switched.kernel_backend == cfg.kernel_backend
    off = dataclasses.replace(cfg, debug_disable="mask", record_trees=3)
    assert (off.settings, off.debug_disable, off.record_trees) == (cfg.settings, "mask", 3)
