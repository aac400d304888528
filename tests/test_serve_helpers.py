"""Shared by the server test modules of both engines (no tests of its own).

``mixed_traffic`` sends good and bad requests mixed together from 16 concurrent
clients to a running OpenAI-compatible server and checks every answer: each bad
request gets its own 4xx error body, each good one its full, unchanged greedy output,
a client that disconnects mid-stream disturbs nobody, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import httpx

NEVER = "\x00never-matches\x00"  # a stop string no tokenizer output contains


@dataclass
class Good:
    """A greedy completion whose output token ids are known in advance."""

    prompt: list[int]
    want: list[int]  # the offline engine's greedy ids (exactly max_tokens of them)


def _bad_requests(model: str, max_model_len: int) -> list[tuple[str, object, int]]:
    """``(name, body, expected status)``; bytes bodies are sent raw."""
    return [
        ("malformed JSON", b'{"prompt": [1, 2], "max_tokens": ', 400),
        ("wrong-typed max_tokens", {"model": model, "prompt": [1, 2], "max_tokens": "many"}, 400),
        ("wrong-typed prompt", {"model": model, "prompt": {"a": 1}, "max_tokens": 2}, 400),
        (
            "prompt too long",
            {"model": model, "prompt": [1] * (max_model_len + 8), "max_tokens": 2},
            400,
        ),
        ("unknown model", {"model": "no-such-model", "prompt": [1, 2], "max_tokens": 2}, 404),
    ]


async def _good(cl: httpx.AsyncClient, model: str, g: Good, kind: str) -> str | None:
    """One good request of ``kind`` (plain, stream, stop); an error message or None."""
    body = {
        "model": model,
        "prompt": g.prompt,
        "max_tokens": len(g.want),
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if kind == "stop":
        body["stop"] = [NEVER]
    if kind != "stream":
        r = await cl.post("/v1/completions", json=body)
        if r.status_code != 200:
            return f"{kind}: HTTP {r.status_code} {r.text[:200]}"
        choice = r.json()["choices"][0]
        got, reason = choice["token_ids"], choice["finish_reason"]
    else:
        got, reason = [], None
        async with cl.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return f"stream: HTTP {r.status_code}"
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for c in json.loads(line[6:]).get("choices", []):
                    got += c.get("token_ids") or []
                    reason = c.get("finish_reason") or reason
    if got != g.want:
        return f"{kind}: got {got} want {g.want}"
    if reason != "length":
        return f"{kind}: finish_reason {reason!r}, want 'length'"
    return None


async def _bad(cl: httpx.AsyncClient, name: str, body, status: int) -> str | None:
    if isinstance(body, bytes):
        r = await cl.post(
            "/v1/completions", content=body, headers={"content-type": "application/json"}
        )
    else:
        r = await cl.post("/v1/completions", json=body)
    if r.status_code != status:
        return f"{name}: HTTP {r.status_code}, want {status}: {r.text[:200]}"
    err = r.json().get("error")
    if not isinstance(err, dict) or not err.get("message"):
        return f"{name}: no OpenAI error body: {r.text[:200]}"
    return None


async def _disconnect(cl: httpx.AsyncClient, model: str, prompt: list[int]) -> str | None:
    """Start a long stream, read its first token-carrying chunk, then go away."""
    body = {"model": model, "prompt": prompt, "max_tokens": 64, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    async with cl.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return f"disconnect: HTTP {r.status_code}"
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"text"' in line:
                break
    return None  # leaving the block closes the connection mid-stream


def mixed_traffic(
    base: str, model: str, goods: list[Good], max_model_len: int, clients: int = 16
) -> dict[str, int]:
    """Run ``clients`` concurrent clients over a mixed request list; assert every answer.

    Each client sends, in turn: a good plain / streamed / never-matching-stop request,
    a bad request (malformed JSON, wrong types, prompt too long, unknown model), and
    every fourth client also a stream it abandons after the first chunk. Returns the
    number of requests of each kind that were checked.
    """
    bad = _bad_requests(model, max_model_len)

    async def client(i: int, cl: httpx.AsyncClient) -> list[str]:
        errs = []
        g = goods[i % len(goods)]
        jobs = [
            _good(cl, model, g, ("plain", "stream", "stop")[i % 3]),
            _bad(cl, *bad[i % len(bad)]),
            _good(cl, model, goods[(i + 1) % len(goods)], ("stop", "plain", "stream")[i % 3]),
        ]
        if i % 4 == 0:
            jobs.insert(1, _disconnect(cl, model, g.prompt))
        for job in jobs:
            err = await job
            if err is not None:
                errs.append(f"client {i}: {err}")
        return errs

    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=clients * 2)
        async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as cl:
            res = await asyncio.gather(*(client(i, cl) for i in range(clients)))
            errs = [e for r in res for e in r]
            # afterwards the server still serves, and still gives the same answers
            errs += [e for e in [await _good(cl, model, goods[0], "plain")] if e]
            return errs

    errs = asyncio.run(main())
    assert not errs, "\n".join(errs)
    return {
        "good": 2 * clients + 1,
        "bad": clients,
        "disconnected": len(range(0, clients, 4)),
    }
