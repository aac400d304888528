"""``serve.py --engine vllm`` through real clients: vLLM's own OpenAI server, one per module.

The server is ``python serve.py --engine vllm`` in a subprocess on the committed tiny
set (``checkpoints/stdlib-v1``) with a top-K tree of the committed draft LM (vLLM's
``draft_model`` proposer grown into a tree by the project's plugin), eager mode, 1 GiB
of KV cache (a chain is vLLM's own proposer; its mapping is checked in test_serve.py).
Expected outputs come from the project's offline engine decoding the target plainly
(greedy speculation is lossless, and vLLM and Hugging Face agree token for token on
this target).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.test_serve_helpers import Good, mixed_traffic
from tree_dev.testing import server_process

pytestmark = pytest.mark.full  # make test-all only: a vLLM server

ROOT = Path(__file__).resolve().parents[1]
SET = ROOT / "checkpoints" / "stdlib-v1"
MAX_LEN = 256
NAME = "stdlib-v1"
TREE = "topk:k=2,depth=3,budget=6"
START_TIMEOUT_S = 420
TEXTS = [
    "def add(a, b):\n    return a + b\n\n\ndef",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self",
    "    for i in range(10):\n        if i % 2 == 0:\n",
    'def parse(text):\n    """Split',
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_vllm(log: Path, *flags: str, env: dict[str, str | None] | None = None):
    """``python serve.py --engine vllm --port P ... FLAGS`` in a subprocess, logging to
    ``log``; yields its base URL once ``/health`` answers, stops it afterwards. ``env``
    overrides this environment (None: the variable unset)."""
    port = _free_port()
    argv = [sys.executable, str(ROOT / "serve.py"), "--engine", "vllm", "--port", str(port)]
    argv += ["--model", str(SET), "--draft-model", str(SET / "draft"), "--tree", TREE]
    argv += ["--max-model-len", str(MAX_LEN), "--enforce-eager", "--log-level", "warning"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}
    with server_process([*argv, *flags], log, env, ROOT, START_TIMEOUT_S) as base:
        yield base


@pytest.fixture(scope="module")
def vsrv(tmp_path_factory):
    with serve_vllm(tmp_path_factory.mktemp("vllm") / "server.log", "--max-batch", "16") as base:
        yield base


@pytest.fixture(scope="module")
def offline():
    """``(tokenizer, greedy(prompt ids, n) -> ids)``: plain decoding of the target."""
    import torch
    from transformers import AutoTokenizer

    from tree_dev.engine import Engine, SamplingParams, load_causal_lm

    tok = AutoTokenizer.from_pretrained(str(SET / "tokenizer"), local_files_only=True)
    eng = Engine(load_causal_lm(SET / "target", dtype=torch.float32), tree="none")
    cache: dict[tuple, list[int]] = {}

    def greedy(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            params = SamplingParams(max_tokens=n, ignore_eos=True)
            cache[key] = eng.generate([list(prompt)], params)[0]
        return cache[key]

    return tok, greedy


def _client(base: str):
    import openai

    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)


def test_models_say_engine_tree_and_draft(vsrv):
    card = httpx.get(vsrv + "/v1/models", timeout=10).json()["data"][0]
    assert card["id"] == NAME and card["max_model_len"] == MAX_LEN
    assert card["owned_by"] == "vllm"  # vLLM's own server answers
    ts = card["treespec"]
    assert (ts["engine"], ts["tree"], ts["drafter"]) == ("vllm", TREE, "draft")
    assert ts["drafter_path"] == str(SET / "draft")


def test_completions_greedy_equal_offline_stream_and_not(vsrv, offline):
    tok, greedy = offline
    client = _client(vsrv)
    for text in TEXTS:
        prompt = tok.encode(text, add_special_tokens=False)
        want = greedy(prompt, 24)
        extra = {"ignore_eos": True, "return_token_ids": True}
        r = client.completions.create(
            model=NAME, prompt=prompt, max_tokens=24, temperature=0, extra_body=extra
        )
        assert r.choices[0].model_extra["token_ids"] == want
        assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
        assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"
        # a text prompt is tokenized as the offline engine's was
        t = client.completions.create(
            model=NAME, prompt=text, max_tokens=24, temperature=0, extra_body=extra
        )
        assert t.choices[0].text == r.choices[0].text
        stream = client.completions.create(
            model=NAME, prompt=prompt, max_tokens=24, temperature=0, stream=True, extra_body=extra
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
        assert chunks[-1].choices[0].finish_reason == "length"
    # the drafts were really accepted: more than one token per target forward
    counters = _spec_counters(vsrv)
    assert counters["num_drafts"] > 0
    assert counters["num_accepted_tokens"] / counters["num_drafts"] > 0.5


def _spec_counters(base: str) -> dict[str, float]:
    """vLLM's ``vllm:spec_decode_*_total`` counters from ``/metrics``."""
    out: dict[str, float] = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:spec_decode_num_") and "_total" in line.split()[0]:
            name = line.split("{")[0].split()[0].removeprefix("vllm:spec_decode_")
            if "per_pos" not in name:
                out[name.removesuffix("_total")] = out.get(
                    name.removesuffix("_total"), 0.0
                ) + float(line.split()[-1])
    return out


def test_chat_stream_and_not_equal_offline(vsrv, offline):
    from tree_dev.server.config import PLAIN_CHAT_TEMPLATE

    tok, greedy = offline
    client = _client(vsrv)
    messages = [
        {"role": "system", "content": "Python source."},
        {"role": "user", "content": "def fib(n):"},
    ]
    text = tok.apply_chat_template(
        messages, chat_template=PLAIN_CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert text == "system: Python source.\nuser: def fib(n):\nassistant:"
    want = tok.decode(greedy(tok.encode(text, add_special_tokens=False), 20))
    extra = {"ignore_eos": True}
    r = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=20, temperature=0, extra_body=extra
    )
    assert r.choices[0].message.content == want and r.usage.completion_tokens == 20
    stream = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=20, temperature=0, stream=True, extra_body=extra
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_openai_client_raises_on_errors(vsrv):
    import openai

    client = _client(vsrv)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt=[1] * (MAX_LEN + 1), max_tokens=2)


def test_bad_requests_under_16_clients(vsrv, offline):
    tok, greedy = offline
    goods = []
    for i, text in enumerate(TEXTS * 2):
        prompt = tok.encode(text, add_special_tokens=False)[: 6 + 3 * i]
        goods.append(Good(prompt, greedy(prompt, 8 + 2 * (i % 4))))
    counts = mixed_traffic(vsrv, NAME, goods, MAX_LEN, clients=16)
    assert counts["bad"] == 16 and counts["disconnected"] == 4
    # vLLM's own metrics: nothing is left running or waiting once the storm is over
    deadline = time.time() + 30
    while True:
        text = httpx.get(vsrv + "/metrics", timeout=10).text
        running = [ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_running")]
        if running and all(float(ln.split()[-1]) == 0 for ln in running):
            break
        assert time.time() < deadline, running
        asyncio.run(asyncio.sleep(0.5))


def test_vllm_argv_is_what_the_server_runs(vsrv):
    """The command line serve.py built is vLLM's server module with the mapped config."""
    from tree_dev.server.config import resolve_config
    from tree_dev.server.vllm_front import vllm_command

    cfg = resolve_config(
        ["--engine", "vllm", "--model", str(SET), "--draft-model", str(SET / "draft")]
        + ["--tree", TREE, "--max-model-len", str(MAX_LEN)]
    )
    cmd = vllm_command(cfg)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    sc = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert sc == {"method": "draft_model", "model": str(SET / "draft"), "num_speculative_tokens": 6}
    ac = json.loads(cmd[cmd.index("--additional-config") + 1])
    assert ac == {"treespec": {"tree": TREE}}  # the plugin's key: num_speculative_tokens = budget


def test_vllm_benchmark_client_completes_without_failures(vsrv):
    """vLLM's own load client (``vllm bench serve``, random dataset) at concurrency 4."""
    import argparse

    from bench.serve_load import vllm_bench_serve

    a = argparse.Namespace(input_len=16, output_len=8, num_prompts=8, seed=0)
    r = vllm_bench_serve(vsrv, NAME, SET / "target", 4, a)
    assert (r["completed"], r["failed"]) == (8, 0)
    assert r["total_output_tokens"] == 64 and r["output_throughput"] > 0
