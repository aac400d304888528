"""Probe for tests/test_tiers.py (not collected by name pattern): two vLLM server start-ups
recorded, as two engine-starting tests would."""


def test_records_two_vllm_server_starts():
    from tree_dev.testing import VLLM_SERVER_STARTS

    VLLM_SERVER_STARTS.extend(["probe serve.py --engine vllm", "probe second"])
