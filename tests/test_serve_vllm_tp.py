"""``serve.py --engine vllm`` serving a tree with the target sharded over two ranks (issue 18).

vLLM's own OpenAI server (``python serve.py --engine vllm ... -- --tensor-parallel-size 2``:
vLLM's flags go after ``--``, see docs/serve.md) on the committed tiny set, the committed
draft LM grown into a top-K tree by the plugin, one core per rank
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``), eager mode, 1 GiB of KV cache. Its greedy
completions through the openai client must equal the offline TP=1 greedy output (the
project's engine decoding the target plainly, the reference of test_serve_vllm.py). vLLM's
development endpoints (``VLLM_SERVER_DEV_MODE=1``) let the test ask both ranks for the
plugin's statistics (``/collective_rpc``): two ranks, the same trees, accepted drafts.

Marked slow (127 s here, nearly all the TP=2 server's start): the default run covers its
parts, trees under TP=2 (test_vllm_tp.py), serving trees (test_serve_vllm.py) and the words
after ``--`` reaching vLLM (test_serve.py). Run it with
``pytest -m slow tests/test_serve_vllm_tp.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup installs it)")

from tests.test_serve_vllm import (  # noqa: E402
    MAX_LEN,
    NAME,
    ROOT,
    SET,
    START_TIMEOUT_S,
    TEXTS,
    TREE,
    _client,
    _free_port,
    offline,  # noqa: F401 - the fixture
)

TP = 2
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tpsrv(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm_tp") / "server.log"
    argv = [sys.executable, str(ROOT / "serve.py"), "--engine", "vllm", "--port", str(port)]
    argv += ["--model", str(SET), "--draft-model", str(SET / "draft"), "--tree", TREE]
    argv += ["--max-model-len", str(MAX_LEN), "--max-batch", "4", "--enforce-eager"]
    argv += ["--log-level", "warning", "--", "--tensor-parallel-size", str(TP)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc: the ranks' plugin statistics
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"serve.py exited:\n{log.read_text()[-4000:]}"
            assert time.time() < deadline, f"no /health in {START_TIMEOUT_S}s:\n{log.read_text()}"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
