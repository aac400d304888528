"""The plugin's start-up checks of ``additional_config["treespec"]`` (no engine needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup installs it)")

from tree_dev.vllm_plugin import config  # noqa: E402


def spec(method="draft_model", n=8):
    return SimpleNamespace(method=method, num_speculative_tokens=n)


def test_valid_configs_parse():
    cfg = config.parse({"tree": "topk:k=2,depth=4,budget=8"}, spec())
    assert (cfg.method, cfg.num_draft_tokens, cfg.kernel_backend) == ("draft_model", 8, "torch")
    assert config.parse({"tree": "chain:5"}, spec("eagle", 5)).num_draft_tokens == 5
    paths = "paths:[(0,), (1,), (0, 0)]"
    assert config.parse({"tree": paths}, spec(n=3)).num_draft_tokens == 3
    assert config.parse({"tree": "ngram:budget=6"}, spec("ngram", 6)).method == "ngram"
    assert not config.parse({"tree": "chain:5"}, spec("eagle", 5)).draft_sampling
    sampled = {"tree": "chain:5", "draft_sampling": True}
    assert config.parse(sampled, spec("eagle", 5)).draft_sampling


def test_auto_objective_defaults_to_tokens():
    assert config.parse({"tree": "auto"}, spec(n=16)).auto_objective == "tokens"
    section = {"tree": "auto", "auto_objective": "makespan"}
    assert config.parse(section, spec(n=16)).auto_objective == "makespan"


def test_trie_takes_vllms_prompt_lookup_range_unless_the_spec_gives_one():
    sc = SimpleNamespace(
        method="ngram", num_speculative_tokens=8, prompt_lookup_min=2, prompt_lookup_max=4
    )
    got = config.parse({"tree": "ngram:budget=8"}, sc).policy
    assert (got.min_n, got.max_n) == (2, 4)  # vLLM's fields, as its own ngram uses them
    mine = config.parse({"tree": "ngram:budget=8,min=1,max=3"}, sc).policy
    assert (mine.min_n, mine.max_n) == (1, 3)  # the spec's own range wins
    bare = config.parse({"tree": "ngram:budget=8"}, spec("ngram", 8)).policy
    assert (bare.min_n, bare.max_n) == (1, 3)  # no range in either: the trie's default
    filled = SimpleNamespace(**{**vars(sc), "prompt_lookup_min": 5, "prompt_lookup_max": 5})
    got = config.parse({"tree": "ngram:budget=8"}, filled).policy
    assert (got.min_n, got.max_n) == (1, 3)  # vLLM's fill-in when neither is given
    five = config.parse({"tree": "ngram:budget=8,min=5,max=5"}, filled).policy
    assert (five.min_n, five.max_n) == (5, 5)
    bad = SimpleNamespace(**{**vars(sc), "prompt_lookup_min": 4, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="prompt_lookup_min = 4 exceeds"):
        config.parse({"tree": "ngram:budget=8"}, bad)


@pytest.mark.parametrize(
    "section, sc, needle",
    [
        ({"tree": "topk:k=2,depth=4,budget=8"}, spec(n=4), "num_speculative_tokens=4"),
        ({"tree": "chain:3"}, spec(n=4), "has 3 draft nodes"),
        ({"tree": "bogus:3"}, spec(), "['tree']"),
        ({"tree": "topk:k=2,depth=x,budget=8"}, spec(), "depth=x"),
        ({"tree": 7}, spec(), "tree spec string"),
        ({"tree": "chain:4"}, None, "needs a speculative_config"),
        ({"tree": "chain:4"}, spec("medusa", 4), "method 'medusa'"),
        ({"tree": "ngram:budget=4"}, spec("draft_model", 4), "method 'draft_model'"),
        ({"tree": "chain:4"}, spec("ngram", 4), "method 'ngram'"),
        ({"tree": "hybrid:k=2,depth=3,budget=8"}, spec("ngram", 8), "method 'ngram'"),
        ({"tree": "hybrid:k=2,depth=3,budget=8"}, spec(n=6), "has 8 draft nodes"),
        ({"tree": "topk:k=2,k=3,depth=4,budget=8"}, spec(), "'k' given twice"),
        ({"tree": "chain:4", "kernel_backend": "cuda"}, spec(n=4), "kernel_backend"),
        ({"tree": "chain:4", "debug_disable": "walk"}, spec(n=4), "debug_disable"),
        ({"tree": "none"}, spec(n=4), "'none'"),
        ({"tree": "chain:4", "draft_sampling": 1}, spec(n=4), "['draft_sampling'] = 1"),
        ({"tree": "auto", "auto_objective": "speed"}, spec(n=16), "['auto_objective'] = 'speed'"),
        ({"tree": "chain:4", "auto_objective": "makespan"}, spec(n=4), "is for tree 'auto'"),
        (
            {"tree": "topk:k=2,depth=4,budget=8", "draft_sampling": True},
            spec(),
            "['draft_sampling'] needs a static tree",
        ),
    ],
)
def test_bad_configs_name_the_field(section, sc, needle):
    with pytest.raises(ValueError) as e:
        config.parse(section, sc)
    assert needle in str(e.value)


def test_fp8_cache_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8'"):
        config.parse({"tree": "chain:4"}, spec(n=4), kv_cache_dtype="fp8")


def test_section_lookup():
    assert config.tree_section(None) is None
    assert config.tree_section({}) is None
    # the accuracy tooling's keys alone do not turn trees on
    assert config.tree_section({"treespec": {"tensor_capture": {}}}) is None
    assert config.tree_section({"treespec": {"tree": "chain:2"}}) == {"tree": "chain:2"}
    with pytest.raises(ValueError, match="must be a dict"):
        config.tree_section({"treespec": "chain:2"})


def test_lookahead_covers_every_forwarded_draft_node():
    """vLLM reserves ``num_speculative_tokens`` KV slots past the scheduled tokens; the
    plugin raises that to the tree's forwarded nodes + 1 (a chain needs vLLM's own K)."""
    deep = {"tree": "topk:k=4,depth=5,budget=8"}  # SGLang-like: forwards 16 nodes
    assert config.parse(deep, spec()).num_draft_tokens == 8
    assert config.lookahead_slots(deep, spec()) == 17
    assert config.lookahead_slots({"tree": "chain:5"}, spec(n=5)) == 5
    assert config.lookahead_slots({"tree": "ngram:budget=8"}, spec("ngram")) == 0
    # a hybrid tree forwards its top-K part; the trie's nodes are verified, not drafted
    hybrid = {"tree": "hybrid:k=2,depth=3,budget=8"}
    assert config.parse(hybrid, spec(n=8)).num_draft_tokens == 8
    assert config.lookahead_slots(hybrid, spec(n=8)) == 2 * 2 + 1
    assert config.lookahead_slots({"tree": "bogus"}, spec()) == 0  # parse names the error


def test_vllm_config_reserves_the_trees_lookahead():
    """The patched ``VllmConfig.num_lookahead_tokens`` (what vLLM's scheduler reserves)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins
    from vllm_engines import DRAFT, TARGET

    load_general_plugins()

    def lookahead(**kw) -> int:
        sc = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 8}
        args = EngineArgs(model=TARGET, max_model_len=512, speculative_config=sc, **kw)
        return args.create_engine_config().num_lookahead_tokens

    assert lookahead() == 8  # without the key: vLLM's own
    deep = {"treespec": {"tree": "topk:k=4,depth=5,budget=8"}}
    assert lookahead(additional_config=deep) == 17


def test_draft_slots():
    from tree_dev.spec import parse_tree_spec

    assert config.draft_slots(parse_tree_spec("topk:k=2,depth=4,budget=8")) == 6
    assert config.draft_slots(parse_tree_spec("chain:4")) == 3  # the leaf is never forwarded
    assert config.draft_slots(parse_tree_spec("paths:[(0,), (1,), (0, 0)]")) == 1


def test_engine_start_up_refuses_a_mismatch():
    """Through ``LLM(...)``: the check runs where vLLM builds its config, before any load."""
    from vllm import LLM
    from vllm_engines import DRAFT, TARGET, load_tree_plugin

    load_tree_plugin()  # as vLLM does at this process's first engine, if it is the first
    with pytest.raises(ValueError, match="num_speculative_tokens=4"):
        LLM(
            model=TARGET,
            max_model_len=512,
            speculative_config={
                "method": "draft_model",
                "model": DRAFT,
                "num_speculative_tokens": 4,
            },
            additional_config={"treespec": {"tree": "topk:k=2,depth=4,budget=8"}},
        )
