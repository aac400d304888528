"""Probe for tests/test_tiers.py (not collected by name pattern): a real-model test
without the ``full`` mark."""


def test_asks_for_the_real_model_unmarked(smollm2_dir):
    raise AssertionError("never runs: collection refuses it")
