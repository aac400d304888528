"""serve.py through real clients: the official ``openai`` package and ``httpx``.

The server runs in a thread (uvicorn on a socket bound to 127.0.0.1:0) over tiny
random Llama models: a target, and a draft LM that is a copy of the target (so
drafts are accepted and several tokens arrive per step). Expected outputs come
from a separate offline ``Engine`` over the same models.
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

import tree_dev.server as server
from tests.factories import tiny_llama
from tests.test_serve_helpers import Good, mixed_traffic
from tree_dev.server import app as server_app
from tree_dev.server import config, gates, protocol, worker
from tree_dev.server.auto_metrics import parse_samples

ROOT = Path(__file__).resolve().parents[1]
TREE = "topk:k=2,depth=3,budget=6"
MAX_LEN = 192
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nimport sys\nprint(os.getcwd(), sys.argv)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
]


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def threads():
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny models are faster single-threaded
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tokenizer():
    from tree_dev.models.data import train_tokenizer

    return train_tokenizer(TEXTS * 4, vocab_size=320)


def _tiny_target(vocab: int, eos: int, seed: int = 0):
    return tiny_llama(
        seed, vocab=vocab, hidden=64, eos_token_id=eos, bos_token_id=eos, pad_token_id=eos
    )


@pytest.fixture(scope="module")
def models(tokenizer, threads):
    target = _tiny_target(len(tokenizer), tokenizer.eos_token_id)
    return target, copy.deepcopy(target)


class _Running:
    def __init__(self, app, port, server, thread):
        self.app, self.port, self.server, self.thread = app, port, server, thread
        self.base = f"http://127.0.0.1:{port}"

    @property
    def engine(self):
        return self.app.state.worker.engine


def _start(app) -> _Running:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.02)
    return _Running(app, port, server, thread)


@pytest.fixture(scope="module")
def srv(models, tokenizer):
    from tree_dev.engine import Engine

    target, draft = models
    engine = Engine(target, draft=draft, tree=TREE, max_batch=8, max_model_len=MAX_LEN)
    app = server_app.create_app(engine, tokenizer, "tiny")
    running = _start(app)
    yield running
    running.server.should_exit = True
    running.thread.join(10)


@pytest.fixture(scope="module")
def offline(models):
    """Greedy outputs of a separate engine, one request at a time."""
    from tree_dev.engine import Engine, SamplingParams

    target, draft = models
    eng = Engine(target, draft=draft, tree=TREE, max_batch=1, max_model_len=MAX_LEN)

    def run(prompt: list[int], max_tokens: int) -> list[int]:
        return eng.generate([prompt], SamplingParams(max_tokens=max_tokens))[0]

    return run


def _client(srv, **kw):
    import openai

    return openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, **kw)


def _wait_idle(srv, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while srv.engine.has_work() or srv.app.state.worker._jobs:
        assert time.time() < deadline, "engine still busy"
        time.sleep(0.02)


# --------------------------------------------------------------------------- endpoints
def test_completion_matches_offline_engine(srv, offline, tokenizer):
    client = _client(srv)
    prompt = tokenizer.encode(TEXTS[0])
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    want = offline(prompt, 12)
    assert r.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len(want) == 12
    assert r.choices[0].finish_reason == "length"
    ext = r.model_extra["treespec"]
    assert ext["tree"] == TREE
    # the draft is a copy of the target: every draft token is accepted, so steps < tokens
    assert ext["steps"] < 12 and ext["mean_accepted_length"] > 1
    assert ext["mean_accepted_length"] == pytest.approx(12 / ext["steps"])
    depths = ext["acceptance_per_depth"]
    assert 1 <= len(depths) <= 3 and depths[0] == 1.0  # greedy draft == target at depth 1


def test_text_prompt_and_token_ids(srv, offline, tokenizer):
    client = _client(srv)
    r = client.completions.create(
        model="tiny",
        prompt=TEXTS[1],
        max_tokens=10,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    want = offline(tokenizer.encode(TEXTS[1]), 10)
    assert r.choices[0].model_extra["token_ids"] == want
    assert r.usage.prompt_tokens == len(tokenizer.encode(TEXTS[1]))


def test_streaming_completion_equals_non_streaming(srv, tokenizer):
    client = _client(srv)
    prompt = tokenizer.encode(TEXTS[2])
    kw = dict(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["treespec"]["steps"] >= 1
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.prompt_tokens == len(
        prompt
    )


def test_raw_sse_ends_with_done(srv, tokenizer):
    body = {"prompt": TEXTS[0], "max_tokens": 5, "temperature": 0, "stream": True}
    r = httpx.post(srv.base + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.text.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")


def test_chat_plain_template_stream_and_not(srv, offline, tokenizer):
    client = _client(srv)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    # the tokenizer has no chat template: the documented plain format applies
    prompt_text = "system: be brief\nuser: hi\nassistant:"
    ids = tokenizer.encode(prompt_text)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tokenizer.decode(
        offline(ids, 8), skip_special_tokens=True
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=8, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content


def test_chat_uses_tokenizer_template(models, tokenizer):
    from tree_dev.engine import Engine

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[bot]"
    eng = Engine(models[0], tree="none", max_model_len=MAX_LEN)
    server = server_app.Server(worker.EngineWorker(eng, worker.Metrics(1)), tok, "tiny", {})
    ids = server.chat_prompt([protocol.ChatMessage(role="user", content="hey")])
    assert ids == tok.encode("[user]hey[bot]")


def test_stop_string_is_trimmed(srv, tokenizer):
    client = _client(srv)
    prompt = tokenizer.encode(TEXTS[3])
    kw = dict(model="tiny", prompt=prompt, max_tokens=40, temperature=0)
    full = client.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0].text
    assert len(full) > 6
    stop = full[3:5]  # a stop string known to occur in the greedy output
    want = full[: full.index(stop)]
    r = client.completions.create(stop=[stop, "\x00never"], extra_body={"ignore_eos": True}, **kw)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    _wait_idle(srv)


def test_text_assembler_holds_back_stop_prefixes():
    class CharTok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    asm = server_app.TextAssembler(CharTok(), ["END"])
    assert asm.feed([ord("a"), ord("E")]) == "a"  # "E" may start "END": held back
    assert asm.feed([ord("N")]) == ""
    assert asm.feed([ord("x")]) == "ENx"  # not a stop after all
    assert asm.feed([ord(c) for c in "yEND tail"]) == "y" and asm.stopped
    assert asm.flush() == ""
    asm = server_app.TextAssembler(CharTok(), [])
    assert asm.feed([ord("a"), 0xFFFD]) == "a"  # incomplete UTF-8 held back
    assert asm.flush() == "\ufffd"


def test_models_health_metrics(srv):
    r = httpx.get(srv.base + "/v1/models", timeout=10).json()
    assert [m["id"] for m in r["data"]] == ["tiny"]
    assert r["data"][0]["max_model_len"] == MAX_LEN
    assert _client(srv).models.list().data[0].id == "tiny"
    assert httpx.get(srv.base + "/health", timeout=10).json()["status"] == "ok"
    before = httpx.get(srv.base + "/metrics", timeout=10).text
    _client(srv).completions.create(model="tiny", prompt="x = 1", max_tokens=4, temperature=0)
    text = httpx.get(srv.base + "/metrics", timeout=10).text

    def value(body: str, name: str) -> float:
        lines = [ln for ln in body.splitlines() if ln.startswith(name + " ")]
        return float(lines[0].split()[-1]) if lines else 0.0

    assert (
        value(text, "treespec_generation_tokens_total")
        >= value(before, "treespec_generation_tokens_total") + 1
    )
    assert value(text, "treespec_step_latency_seconds_count") > value(
        before, "treespec_step_latency_seconds_count"
    )
    assert value(text, 'treespec_accepted_length_bucket{le="+Inf"}') == value(
        text, "treespec_accepted_length_count"
    )
    for name in ("treespec_requests_total", "treespec_acceptance_per_depth", "# TYPE"):
        assert name in text
    depth1 = [
        ln for ln in text.splitlines() if ln.startswith('treespec_acceptance_per_depth{depth="1"}')
    ]
    assert depth1 and 0.0 < float(depth1[0].split()[-1]) <= 1.0


# --------------------------------------------------------------------------- concurrency
def test_16_concurrent_clients_match_offline(srv, offline, tokenizer):
    import openai

    prompts = []
    for i in range(16):
        text = TEXTS[i % 4] * (1 + i % 3)
        prompts.append(tokenizer.encode(text)[: 8 + 5 * i])
    max_tokens = [6 + (i % 5) * 2 for i in range(16)]
    want = [offline(p, m) for p, m in zip(prompts, max_tokens)]

    async def client_task(cl, i):
        outs = []
        for rep in range(3):
            if rep == 1:  # streaming in the middle
                stream = await cl.completions.create(
                    model="tiny",
                    prompt=prompts[i],
                    max_tokens=max_tokens[i],
                    temperature=0,
                    stream=True,
                    extra_body={"return_token_ids": True},
                )
                ids = []
                async for c in stream:
                    ids += c.choices[0].model_extra.get("token_ids", [])
                outs.append(ids)
            else:
                r = await cl.completions.create(
                    model="tiny",
                    prompt=prompts[i],
                    max_tokens=max_tokens[i],
                    temperature=0,
                    extra_body={"return_token_ids": True},
                )
                outs.append(r.choices[0].model_extra["token_ids"])
        return outs

    async def main():
        cl = openai.AsyncOpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0)
        async with cl:
            return await asyncio.gather(*(client_task(cl, i) for i in range(16)))

    got = asyncio.run(main())
    for i, outs in enumerate(got):
        for rep, ids in enumerate(outs):
            assert ids == want[i], f"client {i} request {rep}"
    _wait_idle(srv)
    assert (
        srv.app.state.metrics.requests.get("length", 0)
        + srv.app.state.metrics.requests.get("stop", 0)
        >= 48
    )


# --------------------------------------------------------------------------- bad requests
BAD = [
    ("malformed JSON", b'{"prompt": "x", "max_tokens": ', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("missing prompt", {"max_tokens": 4}, 400, "prompt"),
    ("wrong-typed max_tokens", {"prompt": "x", "max_tokens": "4"}, 400, "max_tokens"),
    ("wrong-typed temperature", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("wrong-typed prompt", {"prompt": 3.5}, 400, "prompt"),
    ("max_tokens zero", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("prompt too long", {"prompt": list(range(MAX_LEN)), "max_tokens": 2}, 400, "prompt"),
    ("token outside vocabulary", {"prompt": [1, 10**6], "max_tokens": 2}, 400, "prompt"),
    ("empty prompt", {"prompt": [], "max_tokens": 2}, 400, "prompt"),
    ("unknown model", {"model": "gpt-9", "prompt": "x", "max_tokens": 2}, 404, "model"),
    ("top_p zero", {"prompt": "x", "top_p": 0.0}, 400, "top_p"),
    ("n > 1", {"prompt": "x", "n": 2}, 400, "n"),
    ("seed out of range", {"prompt": "x", "seed": -1}, 400, "seed"),
    ("stream not a bool", {"prompt": "x", "stream": "yes"}, 400, "stream"),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_completion_request_gets_4xx_then_server_serves(srv, name, body, status, param):
    url = srv.base + "/v1/completions"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    ok = httpx.post(url, json={"prompt": "x = 1", "max_tokens": 3, "temperature": 0}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_bad_chat_requests(srv):
    url = srv.base + "/v1/chat/completions"
    for body, param in (
        ({"max_tokens": 3}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x" * 400}]}, "prompt"),
    ):
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param
    r = httpx.post(
        url, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=30
    )
    assert r.status_code == 200


def test_openai_client_raises_on_4xx(srv):
    import openai

    client = _client(srv)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)


def test_sampling_with_seed_is_reproducible(srv, tokenizer):
    client = _client(srv)
    kw = dict(model="tiny", prompt=TEXTS[2], max_tokens=12, temperature=1.0, top_p=0.9)
    ids = [
        client.completions.create(seed=s, extra_body={"return_token_ids": True}, **kw)
        .choices[0]
        .model_extra["token_ids"]
        for s in (7, 7, 8)
    ]
    assert ids[0] == ids[1]
    assert ids[0] != ids[2]  # 12 tokens from a near-uniform random model: a clash is ~impossible


def test_engine_failure_fails_the_batch_not_the_server(srv, monkeypatch):
    _wait_idle(srv)
    engine = srv.engine
    step = engine.step

    def broken():
        monkeypatch.setattr(engine, "step", step)  # fail once
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "step", broken)
    r = httpx.post(srv.base + "/v1/completions", json={"prompt": "a", "max_tokens": 3}, timeout=30)
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
    _wait_idle(srv)
    assert not engine.requests and engine.runner.cache.free_blocks == engine.runner.cache.num_blocks
    r = httpx.post(srv.base + "/v1/completions", json={"prompt": "a", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200
    assert httpx.get(srv.base + "/health", timeout=10).status_code == 200


# --------------------------------------------------------------------------- disconnect
def _slow_steps(monkeypatch, engine, seconds: float = 0.03) -> None:
    """Make each engine step take a while, so a long request is surely still running."""
    step = engine.step

    def slow():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine, "step", slow)


def test_disconnecting_non_streaming_client_frees_its_request(srv, monkeypatch):
    _wait_idle(srv)
    engine = srv.engine
    _slow_steps(monkeypatch, engine)
    aborted = srv.app.state.metrics.requests.get("abort", 0)
    body = {"prompt": TEXTS[1], "max_tokens": MAX_LEN - 40, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.base + "/v1/completions", json=body, timeout=0.5)
    _wait_idle(srv, timeout=10)
    assert srv.app.state.metrics.requests.get("abort", 0) == aborted + 1
    assert not engine.running and not engine.requests
    assert engine.runner.cache.free_blocks == engine.runner.cache.num_blocks


def test_disconnecting_stream_frees_its_request(srv, monkeypatch):
    _wait_idle(srv)
    engine = srv.engine
    _slow_steps(monkeypatch, engine)
    free_before = engine.runner.cache.free_blocks
    aborted = srv.app.state.metrics.requests.get("abort", 0)
    body = {
        "prompt": TEXTS[0],
        "max_tokens": MAX_LEN - 20,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=30) as cl:
        with cl.stream("POST", srv.base + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                got += line.startswith("data: ")
                if got >= 2:
                    break
            assert engine.running, "the request should still be running"
        # leaving the block closes the connection mid-stream
    _wait_idle(srv)
    assert srv.app.state.metrics.requests.get("abort", 0) == aborted + 1
    assert not engine.running and not engine.waiting and not engine.requests
    assert engine.runner.cache.free_blocks == free_before == engine.runner.cache.num_blocks
    assert engine.draft_runner.cache.free_blocks == engine.draft_runner.cache.num_blocks
    r = httpx.post(srv.base + "/v1/completions", json={"prompt": "y", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200


# --------------------------------------------------------------------------- flags
def _local(argv) -> list[str]:
    """The local engine's flags (the default engine is vllm where vLLM is installed)."""
    return list(argv) if "--engine" in argv else ["--engine", "local", *argv]


def _cfg(*argv: str):
    return config.resolve_config(_local(argv))


def _fails(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        config.resolve_config(_local(argv))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_flags_tree_and_drafts(tmp_path):
    c = _cfg("--model", str(tmp_path), "--draft-model", "d", "--tree", "chain:3")
    assert (c.tree, c.drafter, c.drafter_path, c.tree_source) == (
        "chain:3",
        "draft",
        Path("d"),
        "--tree",
    )
    c = _cfg("--model", str(tmp_path))
    assert (c.tree, c.drafter) == ("none", None)
    c = _cfg("--model", str(tmp_path), "--eagle-head", "e", "--port", "9", "--max-batch", "3")
    assert c.drafter == "eagle" and c.port == 9 and c.max_batch == 3 and c.host == "127.0.0.1"
    assert c.tree == config.DEFAULT_TREE == "auto"
    # a draft without a tree: auto over it, in both engines (vLLM's n-gram: its tries)
    for engine in ("local", "vllm"):
        for flag, drafter in (
            (["--draft-model", "d"], "draft"),
            (["--speculative-config", '{"method": "ngram"}'], "ngram"),
        ):
            c = _cfg("--engine", engine, "--model", str(tmp_path), *flag)
            assert (c.tree, c.drafter) == ("auto", drafter), (engine, flag)
            assert c.tree_source == f"default with the {drafter} draft"


def test_flags_model_set_default(tmp_path):
    for sub in ("target", "eagle", "draft", "tokenizer"):
        (tmp_path / sub).mkdir()
    c = _cfg("--model", str(tmp_path))
    assert c.model == tmp_path / "target" and c.tokenizer == tmp_path / "tokenizer"
    assert (c.drafter, c.drafter_path) == ("eagle", tmp_path / "eagle")
    assert c.served_model_name == tmp_path.name
    c = _cfg("--model", str(tmp_path), "--tree", "none")
    assert (c.tree, c.drafter) == ("none", None)
    c = _cfg()  # no arguments: the project's trained set, target + EAGLE head, best tree
    assert c.model == config.DEFAULT_MODEL_SET / "target"
    assert (c.drafter, c.drafter_path) == ("eagle", config.DEFAULT_MODEL_SET / "eagle")
    assert c.tree == config.DEFAULT_TREE and c.tokenizer.name == "tokenizer"


def test_model_set_serves_a_measured_policy_only_from_tree_from(tmp_path, capsys):
    for sub in ("target", "eagle", "draft", "tokenizer"):
        (tmp_path / sub).mkdir()
    report = tmp_path / "e2e.json"
    report.write_text(json.dumps({"best_policy": {"tree": "chain:3", "drafter": "draft"}}))
    # a report lying where bench.e2e writes it changes nothing: the defaults are code
    c = _cfg("--model", str(tmp_path))
    assert (c.tree, c.drafter) == (config.DEFAULT_TREE, "eagle")
    c = _cfg("--model", str(tmp_path), "--tree-from", str(report))
    assert (c.tree, c.drafter, c.drafter_path) == ("chain:3", "draft", tmp_path / "draft")
    assert c.tree_source == f"best_policy of {report}"
    report.write_text(json.dumps({"best_policy": "topk:k=2,depth=2,budget=3"}))
    c = _cfg("--model", str(tmp_path), "--tree-from", str(report))
    assert (c.tree, c.drafter) == ("topk:k=2,depth=2,budget=3", "eagle")
    report.write_text(json.dumps({"best_policy": "ngram:budget=4"}))
    c = _cfg("--model", str(tmp_path), "--tree-from", str(report))
    assert (c.tree, c.drafter) == ("ngram:budget=4", "ngram")


@pytest.mark.parametrize(
    "content, extra, named",
    [
        (None, [], "no such report"),
        ("{}", [], "no valid best_policy"),
        ('{"best_policy": "bogus:1"}', [], "bogus"),
        ('{"best_policy": "chain:2"}', ["--tree", "chain:3"], "not allowed with --tree"),
        ('{"best_policy": "chain:2"}', ["--draft-model", "d"], "not allowed with --draft-model"),
    ],
)
def test_tree_from_errors_name_the_report(tmp_path, capsys, content, extra, named):
    report = tmp_path / "e2e.json"
    if content is not None:
        report.write_text(content)
    err = _fails(capsys, "--tree-from", str(report), *extra)
    assert "--tree-from" in err and named in err, err


def test_tree_from_on_a_plain_checkpoint_needs_a_draft_free_tree(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    report = tmp_path / "e2e.json"
    report.write_text(json.dumps({"best_policy": "ngram:budget=4"}))
    c = _cfg("--model", str(tmp_path), "--tree-from", str(report))
    assert (c.tree, c.drafter) == ("ngram:budget=4", "ngram")
    report.write_text(json.dumps({"best_policy": "chain:2"}))
    err = _fails(capsys, "--model", str(tmp_path), "--tree-from", str(report))
    assert "needs a draft" in err and "plain checkpoint" in err, err


def test_best_policy_file(tmp_path):
    p = tmp_path / "e2e.json"
    with pytest.raises(ValueError, match="no such report"):
        config.read_best_policy(p)
    p.write_text(json.dumps({"best_policy": "chain:2"}))
    assert config.read_best_policy(p)[0] == "chain:2"
    p.write_text(json.dumps({"best_policy": {"tree": "topk:k=2,depth=2,budget=4", "tau": 2.0}}))
    assert config.read_best_policy(p)[0] == "topk:k=2,depth=2,budget=4"
    assert config.read_best_drafter(p) is None
    p.write_text(json.dumps({"best_policy": {"tree": "chain:3", "drafter": "draft"}}))
    assert config.read_best_policy(p)[0] == "chain:3" and config.read_best_drafter(p) == "draft"
    p.write_text(json.dumps({"best_policy": "bogus:1"}))
    with pytest.raises(ValueError, match="no valid best_policy"):
        config.read_best_policy(p)


@pytest.mark.parametrize(
    "sc,tree,drafter",
    [
        ({"method": "eagle", "model": "h", "num_speculative_tokens": 4}, "chain:4", ("eagle", "h")),
        (
            {"method": "eagle3", "model": "h", "num_speculative_tokens": 1},
            "chain:1",
            ("eagle", "h"),
        ),
        ({"model": "d", "num_speculative_tokens": 2}, "chain:2", ("draft", "d")),
        (
            {
                "method": "draft_model",
                "model": "d",
                "speculative_token_tree": "[(0,), (1,), (0, 0)]",
            },
            "paths:[(0,), (1,), (0, 0)]",
            ("draft", "d"),
        ),
        (
            {
                "method": "eagle",
                "model": "h",
                "num_speculative_tokens": 2,
                "speculative_token_tree": [[0], [1], [0, 0]],
            },
            "paths:[(0,), (1,), (0, 0)]",
            ("eagle", "h"),
        ),
    ],
)
def test_vllm_speculative_config_mapping(tmp_path, sc, tree, drafter):
    c = _cfg("--model", str(tmp_path), "--speculative-config", json.dumps(sc))
    assert c.tree == tree and (c.drafter, str(c.drafter_path)) == drafter
    assert c.tree_source == "--speculative-config"


@pytest.mark.parametrize(
    "argv,tree",
    [
        (["--speculative-eagle-topk", "4", "--speculative-num-steps", "5",
          "--speculative-num-draft-tokens", "33"], "topk:k=4,depth=5,budget=32"),
        (["--speculative-eagle-topk", "2", "--speculative-num-steps", "3"],
         "topk:k=2,depth=3,budget=6"),
        (["--speculative-eagle-topk", "1", "--speculative-num-steps", "3",
          "--speculative-num-draft-tokens", "4"], "chain:3"),
        (["--speculative-num-draft-tokens", "5"], "chain:4"),
    ],
)  # fmt: skip
def test_sglang_flag_mapping(tmp_path, argv, tree):
    c = _cfg("--model", str(tmp_path), "--speculative-algorithm", "EAGLE",
             "--speculative-draft-model-path", "h", *argv)  # fmt: skip
    assert (c.tree, c.drafter, c.drafter_path) == (tree, "eagle", Path("h"))


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--tree", "chain:2",
          "--speculative-config", '{"model": "d", "num_speculative_tokens": 3}'],
         ["--speculative-config", "--tree"]),
        (["--tree", "chain:2", "--speculative-eagle-topk", "2", "--speculative-num-steps", "2"],
         ["--speculative-eagle-topk", "--tree"]),
        (["--draft-model", "d", "--eagle-head", "e"], ["--eagle-head", "--draft-model"]),
        (["--draft-model", "d", "--speculative-config", '{"model": "x", "method": "eagle"}'],
         ["--speculative-config", "--draft-model"]),
        (["--eagle-head", "e", "--tree", "none"], ["--eagle-head", "--tree"]),
        (["--speculative-config", '{"model": "h", "num_speculative_tokens": 3}',
          "--speculative-num-steps", "2", "--speculative-draft-model-path", "h"],
         ["--speculative-num-steps", "--speculative-config"]),
        (["--speculative-config", '{"model": "h", "num_speculative_tokens": 3, '
          '"speculative_token_tree": "[(0,), (0, 0)]"}'],
         ["num_speculative_tokens", "speculative_token_tree"]),
        (["--speculative-eagle-topk", "1", "--speculative-num-steps", "3",
          "--speculative-num-draft-tokens", "6", "--speculative-draft-model-path", "h"],
         ["--speculative-num-draft-tokens", "--speculative-num-steps"]),
        (["--tree", "chain:3"], ["--tree", "needs a draft"]),
        (["--tree", "bogus:1", "--draft-model", "d"], ["--tree", "bogus"]),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
         ["--speculative-config", "ngram"]),
        (["--speculative-config", "{not json"], ["--speculative-config", "JSON"]),
        (["--speculative-algorithm", "MEDUSA"], ["--speculative-algorithm", "MEDUSA"]),
    ],
)  # fmt: skip
def test_contradictory_flags_exit_2_naming_both(tmp_path, capsys, argv, named):
    err = _fails(capsys, "--model", str(tmp_path), *argv)
    for n in named:
        assert n in err, err


# --------------------------------------------------------------------------- gates
def test_gate_warnings():
    assert len(gates.gate_warnings(None, "chain:2")) == 4
    assert {w.split("'")[1] for w in gates.gate_warnings(None, "none")} == {"kernels", "serve"}
    report = {
        "stages": [
            {"name": "kernels", "passed": True, "measured": 1.0, "threshold": 1.0},
            {"name": "verify", "passed": False, "measured": 0.9, "threshold": 1.0},
            {"name": "propose", "passed": True, "measured": 1.3, "threshold": 1.0},
        ],
        "config": {"tree": "chain:2"},
    }
    w = gates.gate_warnings(report, "chain:2")
    assert len(w) == 2
    assert "verify" in w[0] and "FAILED" in w[0] and "0.9" in w[0]
    assert "serve" in w[1] and "never ran" in w[1]
    assert gates.gate_warnings(report, "none")[1:] == [w[1]]  # + the tree mismatch warning
    w = gates.gate_warnings(report, "topk:k=2,depth=2,budget=4")
    assert any("tree='chain:2'" in x for x in w)
    report["stages"] += [{"name": "serve", "passed": True}]
    report["stages"][1]["passed"] = True
    assert gates.gate_warnings(report, "chain:2") == []


def test_main_logs_gate_warning(tmp_path, caplog, monkeypatch):
    bad = {"stages": [{"name": "kernels", "passed": False, "measured": 2, "threshold": 1}]}
    (tmp_path / "gates.json").write_text(json.dumps(bad))
    monkeypatch.setattr(
        server_app, "load_engine", lambda cfg: (_ for _ in ()).throw(RuntimeError("stop"))
    )
    with caplog.at_level("WARNING", logger="treespec.serve"), pytest.raises(RuntimeError):
        server.main(
            [
                "--engine",
                "local",
                "--model",
                str(tmp_path),
                "--gates-report",
                str(tmp_path / "gates.json"),
            ]
        )
    text = caplog.text
    assert "gate 'kernels' FAILED" in text and "gate 'serve' never ran" in text


# --------------------------------------------------------------------------- from disk
def test_serve_py_command_line_with_eagle_model_set(tmp_path, models, tokenizer):
    """``python serve.py --model DIR`` loads target + EAGLE head + tokenizer from a model
    set directory and serves greedy output identical to plain decoding of the target."""
    import subprocess

    from tree_dev.engine import Engine, SamplingParams
    from tree_dev.models.eagle import EagleHead

    target = models[0]
    target.save_pretrained(tmp_path / "target")
    head = EagleHead.from_target(target, seed=1)
    head.target_path = "../target"
    head.save_pretrained(tmp_path / "eagle")
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    gates = {"stages": [{"name": "verify", "passed": False, "measured": 0, "threshold": 1}]}
    (tmp_path / "gates.json").write_text(json.dumps(gates))
    argv = ["--model", str(tmp_path), "--tree", "chain:2", "--max-model-len", "64"]
    argv += ["--gates-report", str(tmp_path / "gates.json")]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "serve.py"), "--engine", "local", "--port", str(port)]
        + ["--torch-threads", "1"]
        + argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "serve.py did not start"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        info = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]
        assert info["id"] == tmp_path.name and info["max_model_len"] == 64
        assert info["treespec"]["tree"] == "chain:2" and info["treespec"]["drafter"] == "eagle"
        prompt = tokenizer.encode(TEXTS[0])
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(
            base + "/v1/completions", json={**body, "return_token_ids": True}, timeout=60
        )
        assert r.status_code == 200, r.text
        ref = Engine(target, tree="none", max_model_len=64)
        want = ref.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
        assert r.json()["choices"][0]["token_ids"] == want
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert "gate 'verify' FAILED" in out and "gate 'serve' never ran" in out, out


# --------------------------------------------------------------------------- mixed traffic
def test_bad_requests_under_16_clients(srv, offline, tokenizer):
    """Good and bad requests mixed, 16 clients: every answer is its own (both engines
    run this check: tests/test_serve_vllm.py)."""
    goods = []
    for i in range(8):
        prompt = tokenizer.encode(TEXTS[i % 4] * (1 + i % 2))[: 6 + 3 * i]
        goods.append(Good(prompt, offline(prompt, 8 + 2 * (i % 4))))
    counts = mixed_traffic(srv.base, "tiny", goods, MAX_LEN, clients=16)
    assert counts["bad"] == 16 and counts["disconnected"] == 4
    _wait_idle(srv)
    assert srv.app.state.metrics.requests.get("abort", 0) >= 4  # the abandoned streams


# --------------------------------------------------------------------------- vLLM flags
def _vllm(*argv: str):
    return config.resolve_config(["--engine", "vllm", *argv])


def _arg(cmd: list[str], flag: str):
    return json.loads(cmd[cmd.index(flag) + 1]) if flag in cmd else None


def test_tensor_parallel_size_goes_to_vllm_with_a_core_group_per_rank(tmp_path, capsys):
    from tree_dev.server import vllm_front

    for sub in ("target", "eagle", "draft", "tokenizer"):
        (tmp_path / sub).mkdir()
    c = _vllm("--model", str(tmp_path), "--tree", "ngram:budget=8", "--tensor-parallel-size", "2")
    cmd = config.vllm_argv(c)
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert config.vllm_engine_kwargs(c)["tensor_parallel_size"] == 2
    env = vllm_front.vllm_env(c, base={})
    assert len(env["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == 2
    kept = vllm_front.vllm_env(c, base={"VLLM_CPU_OMP_THREADS_BIND": "0-3|4-7"})
    assert kept["VLLM_CPU_OMP_THREADS_BIND"] == "0-3|4-7"  # the user's binding wins
    plain = _vllm("--model", str(tmp_path), "--tree", "ngram:budget=8")
    assert "--tensor-parallel-size" not in config.vllm_argv(plain)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_front.vllm_env(plain, base={})
    assert vllm_front.rank_core_groups(2, [0, 1]) == "0|1"
    assert vllm_front.rank_core_groups(2, list(range(8))) == "0,1,2,3|4,5,6,7"
    with pytest.raises(ValueError, match="only 1 CPU cores"):
        vllm_front.rank_core_groups(2, [0])
    err = _fails(capsys, "--engine", "local", "--tensor-parallel-size", "2")
    assert "--tensor-parallel-size" in err and "--engine vllm" in err
    err = _fails(capsys, "--engine", "vllm", "--tensor-parallel-size", "0")
    assert "--tensor-parallel-size" in err and ">= 1" in err


def test_vllm_mapping_chain_tree_ngram(tmp_path):
    for sub in ("target", "eagle", "draft", "tokenizer"):
        (tmp_path / sub).mkdir()
    d = str(tmp_path / "draft")
    cmd = config.vllm_argv(_vllm("--model", str(tmp_path), "--draft-model", d, "--tree", "chain:4"))
    assert _arg(cmd, "--speculative-config") == {
        "method": "draft_model",
        "model": d,
        "num_speculative_tokens": 4,
    }
    assert _arg(cmd, "--additional-config") is None
    assert "--chat-template" in cmd  # the empty tokenizer dir has none: the plain one
    tree = "topk:k=2,depth=3,budget=6"
    c = _vllm("--model", str(tmp_path), "--tree", tree)  # a model set: its EAGLE head
    cmd = config.vllm_argv(c)
    assert _arg(cmd, "--speculative-config") == {
        "method": "eagle",
        "model": str(tmp_path / "eagle"),
        "num_speculative_tokens": 6,
    }
    assert _arg(cmd, "--additional-config") == {"treespec": {"tree": tree}}
    # vLLM's own words give the same config
    sc = json.dumps({"method": "eagle", "model": str(tmp_path / "eagle")})
    ac = json.dumps({"treespec": {"tree": tree}})
    c2 = _vllm("--model", str(tmp_path), "--speculative-config", sc, "--additional-config", ac)
    assert config.vllm_argv(c2) == cmd
    # n-gram: vLLM's chain, and the plugin's trie (no model, in either engine)
    c = _vllm(
        "--model",
        str(tmp_path),
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}',
    )
    assert (c.tree, c.drafter, c.drafter_path) == ("chain:3", "ngram", None)
    assert _arg(config.vllm_argv(c), "--speculative-config") == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
    }
    c = _vllm("--model", str(tmp_path), "--tree", "ngram:budget=5")
    assert c.drafter == "ngram"
    cmd = config.vllm_argv(c)
    assert _arg(cmd, "--speculative-config")["num_speculative_tokens"] == 5
    assert _cfg("--model", str(tmp_path), "--tree", "ngram:budget=5").drafter == "ngram"
    # --tree none: no speculation at all; words after -- go to vLLM last
    cmd = config.vllm_argv(_vllm("--model", str(tmp_path), "--tree", "none", "--", "--seed", "3"))
    assert "--speculative-config" not in cmd and cmd[-2:] == ["--seed", "3"]


def test_draft_sampling_flag_maps_to_both_engines(tmp_path, capsys):
    for sub in ("target", "eagle", "draft", "tokenizer"):
        (tmp_path / sub).mkdir()
    m = str(tmp_path)
    c = _vllm("--model", m, "--tree", "chain:3", "--draft-sampling")
    # a chain with sampled drafts needs the plugin (vLLM's own chains take top-ranked drafts)
    ac = {"treespec": {"tree": "chain:3", "draft_sampling": True}}
    assert _arg(config.vllm_argv(c), "--additional-config") == ac
    assert c.info()["draft_sampling"] is True
    # vLLM's own words give the same config
    sc = json.dumps({"method": "eagle", "model": str(tmp_path / "eagle")})
    c2 = _vllm("--model", m, "--speculative-config", sc, "--additional-config", json.dumps(ac))
    assert config.vllm_argv(c2) == config.vllm_argv(c)
    assert _cfg("--model", m, "--tree", "chain:3", "--draft-sampling").draft_sampling
    assert not _cfg("--model", m, "--tree", "chain:3").draft_sampling
    for argv, word in (
        (["--tree", "topk:k=2,depth=3,budget=6"], "static tree"),
        (["--tree", "ngram:budget=4"], "static tree"),
    ):
        err = _fails(capsys, "--engine", "local", "--model", m, *argv, "--draft-sampling")
        assert "--draft-sampling" in err and word in err, err
    bad = '{"treespec": {"tree": "chain:2", "draft_sampling": "yes"}}'
    err = _fails(capsys, "--engine", "local", "--additional-config", bad)
    assert "draft_sampling" in err


def test_vllm_defaults_serve_the_committed_set():
    c = _vllm()
    assert c.model == config.DEFAULT_MODEL_SET / "target" and c.max_model_len == 512
    assert c.served_model_name == "stdlib-v1" and c.engine == "vllm"
    assert (c.drafter, c.drafter_path) == ("eagle", config.DEFAULT_MODEL_SET / "eagle")
    assert (c.tree, c.draft_sampling) == ("auto", False)
    assert _arg(config.vllm_argv(c), "--additional-config") == {"treespec": {"tree": "auto"}}


@pytest.mark.parametrize("engine", ["local", "vllm"])
def test_max_model_len_above_max_position_embeddings_is_a_startup_error(capsys, engine):
    err = _fails(capsys, "--engine", engine, "--max-model-len", "1024")
    assert "1024" in err and "max_position_embeddings 512" in err
    assert _cfg("--engine", engine, "--max-model-len", "300").max_model_len == 300


@pytest.mark.parametrize(
    "argv,named",
    [
        (
            [
                "--speculative-config",
                '{"method": "draft_model", "model": "d", "num_speculative_tokens": 4}',
                "--additional-config",
                '{"treespec": {"tree": "topk:k=2,depth=3,budget=6"}}',
            ],
            ["num_speculative_tokens=4", "budget 6"],
        ),
        (["--additional-config", '{"treespec": {"tree": "bogus:1"}}'], ["--additional-config"]),
        (["--additional-config", '{"treespec": {"tre": "chain:2"}}'], ["treespec"]),
        (["--speculative-config", '{"method": "ngram", "model": "d"}'], ["ngram"]),
        (["--tree", "chain:2", "--", "--seed", "1"], ["--"]),
    ],
)
def test_vllm_flag_errors_name_the_field(capsys, argv, named):
    err = _fails(capsys, "--engine", "local", *argv)
    for word in named:
        assert word in err, err


def test_vllm_benchmark_client_completes_without_failures(srv, tokenizer, tmp_path):
    """vLLM's own load client (``vllm bench serve``, random dataset) against the local
    engine's server at concurrency 4, greedy and sampled: every request completes with all
    its tokens."""
    import argparse

    from bench.serve_load import vllm_bench_serve

    tokenizer.save_pretrained(tmp_path)
    a = argparse.Namespace(input_len=16, output_len=8, num_prompts=8, seed=0)
    for temperature in (0.0, 0.8):
        r = vllm_bench_serve(srv.base, "tiny", tmp_path, 4, a, temperature)
        assert (r["completed"], r["failed"], r["temperature"]) == (8, 0, temperature)
        assert r["total_output_tokens"] == 64 and r["output_throughput"] > 0


def test_best_vllm_policy_from_the_vllm_e2e_report(tmp_path):
    p = tmp_path / "vllm_e2e.json"
    with pytest.raises(ValueError, match="no such report"):
        config.read_best_vllm_policy(p)
    # no --tree-from: the code's default, auto; a model set with no draft: over its tries
    for sub in ("target", "tokenizer"):
        (tmp_path / sub).mkdir()
    c = _vllm("--model", str(tmp_path))
    assert (c.drafter, c.tree) == ("ngram", "auto")
    assert _arg(config.vllm_argv(c), "--additional-config") == {"treespec": {"tree": "auto"}}

    def summary(tree_ratio: float, builtin_ratio: float) -> dict:
        s = {
            "best_tree": "tree draft_model topk:k=2,depth=4,budget=8",
            "best_tree_ratio": tree_ratio,
            "best_builtin": "vllm eagle chain k=4",
            "best_builtin_ratio": builtin_ratio,
        }
        return {"summary": {"batch1 T=0.0": s, "conc4 T=0.0": {}}}

    p.write_text(json.dumps(summary(1.6, 1.2)))  # bench.vllm_e2e's own format
    assert config.read_best_vllm_policy(p)[:2] == ("draft", "topk:k=2,depth=4,budget=8")
    p.write_text(json.dumps(summary(1.1, 1.2)))
    assert config.read_best_vllm_policy(p)[:2] == ("eagle", "chain:4")
    p.write_text(json.dumps({"best_policy": {"method": "ngram", "tree": "ngram:budget=8"}}))
    assert config.read_best_vllm_policy(p)[:2] == ("ngram", "ngram:budget=8")
    p.write_text(json.dumps({"best_policy": {"method": "medusa", "tree": "chain:2"}}))
    with pytest.raises(ValueError, match="medusa"):
        config.read_best_vllm_policy(p)
    # serve.py --engine vllm --tree-from REPORT serves it, with the model set's draft
    for sub in ("eagle", "draft"):
        (tmp_path / sub).mkdir()
    p.write_text(json.dumps(summary(1.6, 1.2)))
    assert _vllm("--model", str(tmp_path)).tree == "auto"  # not without the flag
    c = _vllm("--model", str(tmp_path), "--tree-from", str(p))
    assert (c.drafter, c.drafter_path, c.tree) == (
        "draft",
        tmp_path / "draft",
        "topk:k=2,depth=4,budget=8",
    )
    assert c.tree_source == f"best measured in {p}"
    assert not c.draft_sampling
    # a sampled-draft chain that won: served through the plugin with draft_sampling
    sampled = summary(1.6, 1.2)
    sampled["summary"]["batch1 T=0.0"]["best_tree"] = "tree eagle chain:4 sampled drafts"
    p.write_text(json.dumps(sampled))
    assert config.read_best_vllm_policy(p) == ("eagle", "chain:4", f"best measured in {p}", True)
    c = _vllm("--model", str(tmp_path), "--tree-from", str(p))
    assert (c.drafter, c.tree, c.draft_sampling) == ("eagle", "chain:4", True)
    ac = {"treespec": {"tree": "chain:4", "draft_sampling": True}}
    assert _arg(config.vllm_argv(c), "--additional-config") == ac


def test_serve_load_ratios_are_paired_per_round():
    """The load benchmark's ratio is the median of same-round ratios, not a ratio of
    medians: a server that is always 2x the base in its round reads 2.0 however the
    machine's load drifts between rounds."""
    from bench.serve_load import _median_round, _paired_ratios

    base = {"output_throughput_rounds": {"1": [100.0, 50.0, 200.0], "4": [10.0]}}
    run = {"output_throughput_rounds": {"1": [200.0, 100.0, 400.0], "4": [0.0]}}
    assert _paired_ratios(run, base) == {"1": 2.0}  # a failed round (0 tok/s) is no ratio
    rounds = [{"output_throughput": x, "id": i} for i, x in enumerate([5.0, 9.0, 7.0])]
    assert _median_round(rounds)["id"] == 2


def test_serve_load_servers_take_turns_level_by_level(monkeypatch):
    """Every level is run by each server in turn before the next level (a ratio is of runs
    a level apart, not a whole round apart); a server that fails is left out of every
    later run and the others go on."""
    import argparse
    import types

    from bench import serve_load

    calls = []

    def bench(base, model, target, c, a, t):
        calls.append((base, c, t))
        if base == "b" and len(calls) > 3:
            raise RuntimeError("server b died")
        return {"level": serve_load.level_key(c, t), "output_throughput": 1.0}

    monkeypatch.setattr(serve_load, "vllm_bench_serve", bench)

    class Srv:
        def __init__(self, base):
            self.base = base

    live = [({"name": n, "model_id": "m", "rounds": {}}, Srv(n)) for n in ("a", "b")]
    levels = [(4, 0.0), (4, 0.8)]

    bar = types.SimpleNamespace(set_postfix=lambda **_: None, update=lambda: None)
    serve_load._measure_rounds(live, levels, None, argparse.Namespace(rounds=2), bar)
    assert calls == [
        ("a", 4, 0.0),
        ("b", 4, 0.0),
        ("a", 4, 0.8),
        ("b", 4, 0.8),  # round 1
        ("a", 4, 0.0),
        ("a", 4, 0.8),  # round 2: b failed at its second level
    ]
    assert "server b died" in live[1][0]["error"]
    assert live[0][0]["rounds"]["c4 T=0.8"] == [{"level": "c4 T=0.8", "output_throughput": 1.0}] * 2


def test_serve_load_reads_autos_choices_per_level_from_metrics():
    """The load benchmark reads back what the server's ``/metrics`` renders
    (``auto_metrics_lines``): its ``treespec_auto_*`` samples only, and per level the
    request-steps per chosen tree as the growth of the cumulative counters since the
    previous scrape."""
    from bench.serve_load import choices_per_level
    from tree_dev.server.auto_metrics import auto_metrics_lines

    def page(none: int, chain: int) -> str:
        stats = {"steps": none + chain, "choices_by_class": {"sampled": {"none": none}}}
        stats["choices_by_class"]["greedy"] = {"chain:4": chain}
        return "\n".join(["vllm:num_requests_running 3", *auto_metrics_lines(stats)])

    def read(text: str) -> dict[str, float]:
        return parse_samples(text, "treespec_auto_")  # as serve_load reads /metrics

    first = read(page(10, 4))
    assert first["treespec_auto_steps_total"] == 14.0
    assert not any(k.startswith("vllm:") for k in first)
    scrapes = [{"level": "c4 T=0.0", **first}, {"level": "c4 T=0.8", **read(page(25, 6))}]
    scrapes.append({"level": "c4 T=0.0", **read(page(26, 9))})  # a second round
    per = choices_per_level(scrapes)
    assert per["c4 T=0.8"] == {
        'class="greedy",tree="chain:4"': 2.0,
        'class="sampled",tree="none"': 15.0,
    }
    assert per["c4 T=0.0"] == {
        'class="greedy",tree="chain:4"': 7.0,
        'class="sampled",tree="none"': 11.0,
    }


def test_serve_load_finds_a_named_models_committed_eagle_head(tmp_path):
    """``--model smollm2-135m --vllm-tree auto@eagle``: the named model's directory has no
    ``eagle/``, so the vllm-tree server gets its committed head; a model set's own
    ``eagle/`` wins; a directory that is neither keeps ``eagle/`` (loading then says what
    is missing)."""
    from bench.serve_load import _draft_dir
    from tree_dev.models.named import EAGLE_HEADS, model_dir

    head = EAGLE_HEADS["smollm2-135m"]
    assert _draft_dir(model_dir("smollm2-135m"), "eagle") == head
    own = _model_set(tmp_path / "set")
    assert _draft_dir(own, "eagle") == own / "eagle"
    assert _draft_dir(tmp_path / "other", "eagle") == tmp_path / "other" / "eagle"
    assert _draft_dir(model_dir("smollm2-135m"), "draft") == model_dir("smollm2-135m") / "draft"


# --------------------------------------------------------------------------- tree: auto
def _model_set(root: Path) -> Path:
    for sub in ("target", "eagle", "draft", "tokenizer"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    return root


def _plain_checkpoint(root: Path) -> Path:
    """A pretrained model's directory: no draft model, no EAGLE head."""
    root.mkdir(exist_ok=True)
    (root / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    return root


def _largest_budget(candidates) -> int:
    """Draft nodes of the largest candidate (``+sampled`` stripped): vLLM's
    ``num_speculative_tokens`` for ``auto``."""
    from tree_dev.spec import parse_tree_spec

    return max(parse_tree_spec(c.split("+")[0]).draft_budget for c in candidates)


def test_tree_auto_flags_resolve_per_draft_kind_for_both_engines(tmp_path):
    """``--tree auto``, each draft kind the server takes: the model set's EAGLE head, a draft
    LM, and no model (a plain checkpoint: its n-gram tries), on both engines; vLLM gets
    the draft's method, num_speculative_tokens = the largest candidate's draft nodes, the
    plugin's ``treespec`` key, and the /metrics middleware (auto only)."""
    from tree_dev.spec import AUTO_MODEL_CANDIDATES, AUTO_TRIE_CANDIDATES, TreeSettings

    ms, plain = _model_set(tmp_path / "set"), _plain_checkpoint(tmp_path / "plain")
    draft = str(ms / "draft")
    cases = [  # (flags, drafter, drafter path, candidates)
        (["--model", str(ms)], "eagle", ms / "eagle", AUTO_MODEL_CANDIDATES),
        (["--model", str(ms), "--draft-model", draft], "draft", Path(draft), AUTO_MODEL_CANDIDATES),
        (["--model", str(plain)], "ngram", None, AUTO_TRIE_CANDIDATES),
    ]
    method = {"eagle": "eagle", "draft": "draft_model", "ngram": "ngram"}
    for flags, drafter, path, cands in cases:
        for engine in ("local", "vllm"):
            c = config.resolve_config(["--engine", engine, *flags, "--tree", "auto"])
            assert (c.tree, c.drafter, c.drafter_path) == ("auto", drafter, path), (engine, flags)
            assert c.tree_source == "--tree" and not c.draft_sampling
            settings = TreeSettings.parse(c.tree, draft=c.drafter)
            assert settings.policy.names == list(cands), (engine, flags)
        sc = {"method": method[drafter], "num_speculative_tokens": _largest_budget(cands)}
        if path is not None:
            sc["model"] = str(path)
        cmd = config.vllm_argv(c)
        assert _arg(cmd, "--speculative-config") == sc
        assert _arg(cmd, "--additional-config") == {"treespec": {"tree": "auto"}}
        middleware = [cmd[i + 1] for i, w in enumerate(cmd) if w == "--middleware"]
        assert middleware == [config.VLLM_MODELS_MIDDLEWARE, config.VLLM_METRICS_MIDDLEWARE]
    # given candidates: the budget is the largest one's; tries only: no model is loaded
    c = _vllm("--model", str(ms), "--draft-model", draft, "--tree", "auto:chain:2;ngram:budget=4")
    assert _arg(config.vllm_argv(c), "--speculative-config")["num_speculative_tokens"] == 4
    tries = "auto:ngram:budget=4;ngram:budget=8"
    for engine in ("local", "vllm"):
        c = config.resolve_config(["--engine", engine, "--model", str(ms), "--tree", tries])
        assert (c.drafter, c.drafter_path) == ("ngram", None)
    assert config.vllm_speculative_config(c) == {"method": "ngram", "num_speculative_tokens": 8}
    # vLLM's own words give the same server
    sc = json.dumps({"method": "eagle", "model": str(ms / "eagle"), "num_speculative_tokens": 16})
    ac = json.dumps({"treespec": {"tree": "auto"}})
    c2 = _vllm("--model", str(ms), "--speculative-config", sc, "--additional-config", ac)
    assert config.vllm_argv(c2) == config.vllm_argv(_vllm("--model", str(ms), "--tree", "auto"))
    ngram = '{"method": "ngram"}'
    c = _vllm("--model", str(plain), "--speculative-config", ngram, "--tree", "auto")
    want = {"method": "ngram", "num_speculative_tokens": _largest_budget(AUTO_TRIE_CANDIDATES)}
    assert config.vllm_speculative_config(c) == want
    # a fixed tree: no auto metrics middleware
    cmd = config.vllm_argv(_vllm("--model", str(ms), "--tree", "chain:3"))
    assert config.VLLM_METRICS_MIDDLEWARE not in cmd
    # a measured auto policy serves a plain checkpoint with its tries
    report = tmp_path / "e2e.json"
    report.write_text(json.dumps({"best_policy": "auto"}))
    c = _cfg("--model", str(plain), "--tree-from", str(report))
    assert (c.tree, c.drafter) == ("auto", "ngram")


AUTO_ERRORS = [
    # (flags after --model, model kind, words the error names)
    (["--tree", "auto:chain:4"], "plain", ["argument --tree", "chain:4", "needs a draft"]),
    (["--tree", "auto", "--draft-sampling"], "set", ["argument --draft-sampling", "auto"]),
    (
        ["--additional-config", '{"treespec": {"tree": "auto", "draft_sampling": true}}'],
        "set",
        ["argument --additional-config", "auto"],
    ),
    (
        ["--tree", "auto:chain:4", "--speculative-config", '{"method": "ngram"}'],
        "plain",
        ["argument --speculative-config", "chain:4", "'ngram'"],
    ),
    (["--tree", "auto:ngram:budget=8", "--eagle-head", "e"], "set", ["--eagle-head", "--tree"]),
    (["--tree", "auto:none"], "set", ["argument --tree", "no candidate"]),
    (["--tree", "auto:bogus:1"], "set", ["argument --tree", "bogus"]),
    (["--tree", "auto:topk:k=2,depth=3,budget=6+sampled"], "set", ["argument --tree", "static"]),
    (
        [
            "--speculative-config",
            '{"method": "draft_model", "model": "d", "num_speculative_tokens": 4}',
            "--additional-config",
            '{"treespec": {"tree": "auto"}}',
        ],
        "set",
        ["argument --speculative-config", "num_speculative_tokens=4", "budget 16"],
    ),
]


@pytest.mark.parametrize("engine", ["local", "vllm"])
@pytest.mark.parametrize("argv,model,named", AUTO_ERRORS, ids=[str(i) for i in range(9)])
def test_tree_auto_bad_combinations_exit_2_naming_the_flag(
    tmp_path, capsys, engine, argv, model, named
):
    root = _model_set(tmp_path) if model == "set" else _plain_checkpoint(tmp_path / "plain")
    err = _fails(capsys, "--engine", engine, "--model", str(root), *argv)
    for word in named:
        assert word in err, err


def test_auto_metrics_lines_render_prometheus_text():
    from tree_dev.server.auto_metrics import auto_metrics_lines

    stats = {
        "steps": 3,
        "choices": {"chain:4": 2, "none": 4},
        "choices_by_class": {"greedy": {"chain:4": 2, "none": 1}, "sampled": {"none": 3}},
        "measured_steps": 3,
        "mean_predicted_s": 0.01,
        "mean_measured_s": 0.012,
        "mean_abs_rel_error": 0.2,
        "last_predicted_s": 0.011,
        "last_measured_s": 0.013,
        "correction": 1.1,
        "cost_model": {"a": 0.01, "b": 0.001, "c": 0.0, "d": 0.0},
        "cost_model_measured": True,
        "candidates": ["chain:4"],
        "trie_shadows": 5,
        "rested": 7,
        "weighted_steps": 2,
    }
    text = "\n".join(auto_metrics_lines(stats))
    samples = parse_samples(text)
    assert samples["treespec_auto_steps_total"] == 3
    assert samples['treespec_auto_choices_total{class="greedy",tree="chain:4"}'] == 2
    assert samples['treespec_auto_choices_total{class="sampled",tree="none"}'] == 3
    assert samples["treespec_auto_predicted_step_seconds"] == 0.01
    assert samples["treespec_auto_measured_step_seconds"] == 0.012
    assert samples["treespec_auto_cost_model_measured"] == 1
    assert samples['treespec_auto_cost_model_coefficient{name="a"}'] == 0.01
    assert samples["treespec_auto_trie_shadows_total"] == 5
    assert samples["treespec_auto_rested_total"] == 7
    assert samples["treespec_auto_weighted_steps_total"] == 2
    for name in ("treespec_auto_steps_total", "treespec_auto_choices_total"):
        assert f"# TYPE {name} counter" in text
    # a tree name is an escaped label value
    odd = auto_metrics_lines({"choices_by_class": {"greedy": {'pa"th\\': 1}}})
    assert 'treespec_auto_choices_total{class="greedy",tree="pa\\"th\\\\"} 1' in odd


@pytest.mark.parametrize("gzipped", [False, True])
def test_vllm_metrics_middleware_appends_auto_stats(gzipped):
    """``treespec_metrics`` on an app shaped like vLLM's server (no engine started): vLLM's
    /metrics text is kept, auto's statistics of the first worker follow; an engine without
    auto, or whose RPC fails, leaves vLLM's text as it is."""
    import gzip as gz

    from fastapi import FastAPI
    from fastapi.responses import Response
    from fastapi.testclient import TestClient

    from tree_dev.server import vllm_front

    vllm_text = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"

    class Client:  # vLLM's engine client: collective_rpc returns one result per worker
        def __init__(self, result):
            self.result, self.calls = result, []

        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            self.calls.append(method)
            if isinstance(self.result, Exception):
                raise self.result
            return self.result

    app = FastAPI()
    app.middleware("http")(vllm_front.treespec_metrics)

    @app.get("/metrics")
    async def metrics():
        if gzipped:
            body = gz.compress(vllm_text.encode())
            return Response(body, headers={"Content-Encoding": "gzip"}, media_type="text/plain")
        return Response(vllm_text, media_type="text/plain; version=0.0.4")

    auto = {"steps": 2, "choices_by_class": {"greedy": {"none": 1}, "sampled": {"chain:2": 1}}}
    auto |= {"mean_predicted_s": 0.5, "mean_measured_s": 0.25, "cost_model_measured": False}
    rank = {"tree": "auto", "auto": auto}
    with TestClient(app) as http:
        app.state.engine_client = Client([rank, rank])
        r = http.get("/metrics")
        assert r.status_code == 200 and r.text.startswith(vllm_text), r.text
        assert r.headers["content-type"].startswith("text/plain")
        s = parse_samples(r.text)
        assert s['treespec_auto_choices_total{class="sampled",tree="chain:2"}'] == 1
        assert s["treespec_auto_predicted_step_seconds"] == 0.5
        assert s["treespec_auto_measured_step_seconds"] == 0.25
        assert s["treespec_auto_cost_model_measured"] == 0
        assert app.state.engine_client.calls == ["treespec_tree_stats"]
        for result in ([{"tree": "chain:4"}], [{}], RuntimeError("engine dead")):
            app.state.engine_client = Client(result)
            r = http.get("/metrics")
            assert r.status_code == 200 and r.text == vllm_text, r.text


@pytest.fixture(scope="module")
def auto_srv(threads):
    """``serve.py --engine local --tree auto`` in-process on the committed tiny set (EAGLE
    head): the flags, ``load_engine`` (auto's cost model measured at start-up, cached in
    the session's ``TREESPEC_CACHE_DIR``) and the app, on a free port."""
    cfg = config.resolve_config(
        ["--engine", "local", "--tree", "auto", "--max-batch", "4", "--max-model-len", "256"]
    )
    engine, tok = server_app.load_engine(cfg)
    app = server_app.create_app(engine, tok, cfg.served_model_name, cfg.info())
    running = _start(app)
    running.tok = tok
    yield running
    running.server.should_exit = True
    running.thread.join(10)


def test_local_server_with_tree_auto_serves_and_shows_its_choices(auto_srv, srv):
    """Greedy and T=0.8 completions together: the greedy ones equal the target's plain
    greedy output; /metrics shows auto's choices for both classes, summing to the
    requests-steps the engine verified, and its predicted and measured step seconds."""
    from concurrent.futures import ThreadPoolExecutor

    from tree_dev.engine import Engine, SamplingParams

    tok, base = auto_srv.tok, auto_srv.base
    prompts = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    card = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]
    assert (card["treespec"]["tree"], card["treespec"]["drafter"]) == ("auto", "eagle")

    def complete(i: int) -> dict:
        body = {"prompt": prompts[i % 4], "max_tokens": 12, "ignore_eos": True}
        body |= {"temperature": 0 if i % 2 == 0 else 0.8, "seed": i, "return_token_ids": True}
        r = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(complete, range(6)))
    _wait_idle(auto_srv)
    for out in outs:
        assert len(out["choices"][0]["token_ids"]) == 12
        assert out["treespec"]["tree"] == "auto"
    plain = Engine(auto_srv.engine.target, tree="none", max_model_len=256)
    for i in range(0, 6, 2):
        want = plain.generate([prompts[i % 4]], SamplingParams(max_tokens=12, ignore_eos=True))
        assert outs[i]["choices"][0]["token_ids"] == want[0], i
    s = parse_samples(httpx.get(base + "/metrics", timeout=10).text)
    choices = {k: v for k, v in s.items() if k.startswith("treespec_auto_choices_total{")}
    assert sum(choices.values()) == s["treespec_accepted_length_count"] > 0, choices
    assert {k.split('class="')[1].split('"')[0] for k in choices} == {"greedy", "sampled"}
    assert sum(v for k, v in choices.items() if 'tree="none"' not in k) > 0, choices
    steps = s["treespec_auto_steps_total"]
    assert 0 < steps == s["treespec_auto_measured_steps_total"]
    assert steps <= s["treespec_step_latency_seconds_count"]
    assert s["treespec_auto_predicted_step_seconds"] > 0
    assert s["treespec_auto_measured_step_seconds"] > 0
    stats = auto_srv.engine.auto_stats()  # the engine's own count agrees (it is idle)
    assert sum(stats["choices"].values()) == sum(choices.values())
    # a fixed tree's server shows no auto metrics
    assert "treespec_auto_" not in httpx.get(srv.base + "/metrics", timeout=10).text
