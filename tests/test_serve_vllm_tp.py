"""``serve.py --engine vllm`` serving a tree with the target sharded over two ranks (issue 18).

vLLM's own OpenAI server (``python serve.py --engine vllm ... --tensor-parallel-size 2``)
on the committed tiny set, the committed draft LM grown into a top-K tree by the plugin,
one core per rank (``VLLM_CPU_OMP_THREADS_BIND`` unset: serve.py binds a core group per
rank), eager mode, 1 GiB of KV cache. Its greedy
completions through the openai client must equal the offline TP=1 greedy output (the
project's engine decoding the target plainly, the reference of test_serve_vllm.py). vLLM's
development endpoints (``VLLM_SERVER_DEV_MODE=1``) let the test ask both ranks for the
plugin's statistics (``/collective_rpc``): two ranks, the same trees, accepted drafts.

In ``make test-all`` only (``full``: nearly all its time is the TP=2 server's start); the
fast tier covers its parts: the ``--tensor-parallel-size`` flag and core binding reaching
vLLM (test_serve.py).
"""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup installs it)")

from tests.test_serve_vllm import (  # noqa: E402
    NAME,
    TEXTS,
    _client,
    offline,  # noqa: F401 - the fixture
    serve_vllm,
)

TP = 2
pytestmark = pytest.mark.full  # make test-all only: a TP=2 vLLM server


@pytest.fixture(scope="module")
def tpsrv(tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm_tp") / "server.log"
    env = {
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc: the ranks' plugin statistics
        "VLLM_CPU_OMP_THREADS_BIND": None,  # serve.py's default: a core group per rank
    }
    with serve_vllm(log, "--max-batch", "4", "--tensor-parallel-size", str(TP), env=env) as base:
        yield base


def _rank_stats(base: str) -> list[dict]:
    r = httpx.post(base + "/collective_rpc", json={"method": "treespec_tree_stats"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["results"]


def test_tp2_server_completions_equal_offline_tp1_greedy(tpsrv, offline):  # noqa: F811
    tok, greedy = offline
    client = _client(tpsrv)
    before = _rank_stats(tpsrv)
    assert len(before) == TP, f"one plugin per rank expected: {before}"
    for text in TEXTS[:3]:
        prompt = tok.encode(text, add_special_tokens=False)
        want = greedy(prompt, 24)
        extra = {"ignore_eos": True, "return_token_ids": True}
        r = client.completions.create(
            model=NAME, prompt=prompt, max_tokens=24, temperature=0, extra_body=extra
        )
        assert r.choices[0].model_extra["token_ids"] == want, text
        assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
    stats = _rank_stats(tpsrv)
    for k in ("tree_steps", "tokens_per_step", "depth_tried", "depth_accepted"):
        assert stats[1][k] == stats[0][k], f"ranks disagree on {k}: {stats}"
    assert stats[0]["tree_steps"] > before[0].get("tree_steps", 0)
    assert stats[0]["tokens_per_step"] > 1.0, stats[0]
