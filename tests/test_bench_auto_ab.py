"""bench.auto_ab: its settings (parsed, checked against the objects they set) and the
paired wave-by-wave summary. The A/B itself runs a vLLM engine: a benchmark, not a test."""

from __future__ import annotations

import pytest

from bench.auto_ab import check_setting, paired_summary, parse_setting
from tree_dev.auto import AutoPolicy, CostModel


def test_parse_setting_reads_numbers_tuples_and_a_forced_tree_with_its_commas():
    got = parse_setting("force=ngram:budget=4,min=3,longest_rest=8,cost.drafted_bounds=0.5:2")
    assert got == {
        "force": "ngram:budget=4,min=3",
        "longest_rest": 8,
        "cost.drafted_bounds": (0.5, 2.0),
    }
    assert parse_setting("rest_above=0.01, force=none") == {"rest_above": 0.01, "force": "none"}
    assert parse_setting(" ") == {}


@pytest.mark.parametrize("bad", ["longest_rest", "=3", "longest_rest=", "longest_rest=eight"])
def test_parse_setting_names_the_item_it_cannot_read(bad):
    with pytest.raises(ValueError, match="longest_rest|=3"):
        parse_setting(bad)


def test_check_setting_names_an_attribute_that_is_not_there():
    policy = AutoPolicy(["chain:2"], CostModel(a=0.01, b=0.0, c=0.001, d=0.0))
    check_setting(parse_setting("longest_rest=8,cost.drafted_bounds=0.5:2"), policy)
    with pytest.raises(ValueError, match="longest_rests"):
        check_setting({"longest_rests": 8}, policy)
    with pytest.raises(ValueError, match="CostModel has no 'drafted_bound'"):
        check_setting({"cost.drafted_bound": (1.0, 2.0)}, policy)


def test_paired_summary_is_the_median_of_same_wave_ratios():
    """A B that is 1.1x A in every wave reads 1.1 however much the waves' prompts move
    the throughput; the first wave (what auto explored first) is also left out once."""
    a = [100.0, 300.0, 50.0, 200.0]
    b = [60.0, 330.0, 55.0, 220.0]  # the first wave 0.6x, then 1.1x
    got = paired_summary(a, b)
    assert got["ratios"] == pytest.approx([0.6, 1.1, 1.1, 1.1])
    assert got["median"] == pytest.approx(1.1)
    assert got["median_after_first"] == pytest.approx(1.1)
    assert paired_summary([1.0, 1.0], [2.0, 3.0])["median_after_first"] is None
    with pytest.raises(ValueError, match="2 A waves and 1 B waves"):
        paired_summary([1.0, 1.0], [1.0])
