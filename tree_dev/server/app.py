"""The local engine's OpenAI-compatible FastAPI app: validation, tokenization, streaming.

``create_app(engine, tokenizer, name, info)`` serves ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health`` and ``/metrics`` over one
``EngineWorker`` thread; ``load_engine(cfg)`` builds the engine of a ``ServeConfig``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tree_dev.server.config import DEFAULT_MODEL_SET, PLAIN_CHAT_TEMPLATE, ServeConfig
from tree_dev.server.protocol import (
    APIError,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    StreamOptions,
    _SamplingFields,
    error_response,
)
from tree_dev.server.worker import EngineWorker, Job, Metrics

DISCONNECT_POLL_S = 0.5  # how often a handler asks whether its client is still there


class TextAssembler:
    """Token ids -> text deltas, with stop strings trimmed and held back.

    Text that could still become a stop string, or that ends in an incomplete
    UTF-8 sequence, is held back until it is safe; a matched stop string and all
    that follows it is never sent.
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.tok = tokenizer
        self.stops = [s for s in stops if s]
        self.ids: list[int] = []
        self.sent = 0
        self.text = ""
        self.stopped = False

    def feed(self, ids: list[int]) -> str:
        """Append tokens; returns the new safe text. Sets ``stopped`` on a stop string."""
        self.ids.extend(ids)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.text = text[: min(hits)]
            return self._take(len(self.text))
        self.text = text
        end = len(text)
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        for k in range(
            min(max((len(s) for s in self.stops), default=1) - 1, end - self.sent), 0, -1
        ):
            if any(s.startswith(text[end - k : end]) for s in self.stops):
                end -= k
                break
        return self._take(end)

    def flush(self) -> str:
        """At the end of the request: everything not sent yet."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out


class Server:
    """The HTTP layer: request validation, tokenization, streaming."""

    def __init__(self, worker: EngineWorker, tokenizer, model_name: str, info: dict):
        self.worker = worker
        self.tok = tokenizer
        self.model_name = model_name
        self.info = info
        self.max_model_len = worker.engine.max_model_len
        self.vocab_size = worker.engine.vocab_size
        self.created = int(time.time())

    # ------------------------------------------------------------------ helpers
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
                type="NotFoundError",
            )

    def _params(self, body: _SamplingFields, max_tokens: int | None, prompt_len: int):
        from tree_dev.engine import SamplingParams

        if body.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(body, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported", param=name)
        if body.logprobs not in (None, False):
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if max_tokens is None:
            max_tokens = self.max_model_len - prompt_len
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        temperature = 1.0 if body.temperature is None else body.temperature
        if not 0 <= temperature:
            raise APIError(400, f"temperature must be >= 0, got {temperature}", "temperature")
        top_p = 1.0 if body.top_p is None else body.top_p
        if not 0 < top_p <= 1:
            raise APIError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
        if body.seed is not None and not 0 <= body.seed < 2**63:
            raise APIError(400, f"seed must be in [0, 2**63), got {body.seed}", param="seed")
        stop_ids = tuple(body.stop_token_ids or ())
        if any(not 0 <= t < self.vocab_size for t in stop_ids):
            raise APIError(400, "stop_token_ids outside the vocabulary", param="stop_token_ids")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=body.seed,
            stop_token_ids=stop_ids,
            ignore_eos=body.ignore_eos,
        )

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if len(ids) >= self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {len(ids)} tokens (at least one output token must fit).",
                param="prompt",
                code="context_length_exceeded",
            )
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"prompt token {bad} outside [0, {self.vocab_size})", "prompt")

    @staticmethod
    def _stops(stop: str | list[str] | None) -> list[str]:
        return [stop] if isinstance(stop, str) else list(stop or [])

    async def _start(self, ids: list[int], params) -> Job:
        loop = asyncio.get_running_loop()
        job = Job(ids, params, loop, asyncio.Queue())
        self.worker.submit(job)
        try:
            event = await job.events.get()
        except asyncio.CancelledError:  # the client left before admission
            self.worker.abort(job)
            raise
        if event[0] == "error":
            raise APIError(400, event[1], param="prompt")
        return job

    async def _events(self, job: Job, request: Request, asm: TextAssembler) -> AsyncIterator:
        """``(text delta, new token ids, finish_reason, stats)`` until the request ends.

        Aborts the engine request when the client goes away (including when this
        generator is cancelled) or when a stop string matches.
        """
        done, checked = False, time.monotonic()
        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), timeout=DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    event = None
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if event is None:
                    continue
                if event[0] == "tokens":
                    if asm.stopped:
                        continue
                    delta = asm.feed(event[1])
                    if asm.stopped:
                        self.worker.abort(job, "stop")
                    yield delta, event[1], None, None
                elif event[0] == "done":
                    done = True
                    reason = "stop" if asm.stopped else event[1]
                    yield asm.flush(), [], reason, event[2]
                    return
                elif event[0] == "error":
                    raise APIError(500, event[1], type="server_error")
        finally:
            if not done:
                self.worker.abort(job)

    def _usage(self, prompt: int, completion: int) -> dict:
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _treespec(self, stats: dict | None) -> dict:
        return {"tree": self.info["tree"], **(stats or {})}

    # ------------------------------------------------------------------ endpoints
    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        if body.echo or (body.best_of not in (None, 1)) or body.suffix:
            raise APIError(400, "echo, best_of > 1 and suffix are not supported", param="echo")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, "batched prompts are not supported: send one", "prompt")
            prompt = prompt[0]
        ids = (
            self.tok.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
        )
        self._check_prompt(list(ids))
        params = self._params(body, body.max_tokens, len(ids))
        return await self._respond(body, request, list(ids), params, chat=False)

    def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        """The tokenizer's chat template, else ``PLAIN_CHAT_TEMPLATE`` (vLLM gets the same)."""
        msgs = []
        for m in messages:
            content = m.content
            if isinstance(content, list):
                if any(p.type != "text" for p in content):
                    raise APIError(400, "only text content parts are supported", "messages")
                content = "".join(p.text for p in content)
            msgs.append({"role": m.role, "content": content or ""})
        if not msgs:
            raise APIError(400, "messages is empty", param="messages")
        template = getattr(self.tok, "chat_template", None) or PLAIN_CHAT_TEMPLATE
        text = self.tok.apply_chat_template(
            msgs, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        return self.tok.encode(text, add_special_tokens=False)

    async def chat(self, body: ChatRequest, request: Request):
        self._check_model(body.model)
        ids = self.chat_prompt(body.messages)
        self._check_prompt(ids)
        max_tokens = body.max_completion_tokens
        max_tokens = body.max_tokens if max_tokens is None else max_tokens
        params = self._params(body, max_tokens, len(ids))
        return await self._respond(body, request, ids, params, chat=True)

    async def _respond(self, body, request: Request, ids: list[int], params, chat: bool):
        asm = TextAssembler(self.tok, self._stops(body.stop))
        job = await self._start(ids, params)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            opts = body.stream_options or StreamOptions()
            gen = self._stream(body, job, request, asm, rid, created, len(ids), chat, opts)
            return StreamingResponse(gen, media_type="text/event-stream")
        reason, stats, parts = None, None, []
        async for delta, _, fin, st in self._events(job, request, asm):
            parts.append(delta)
            reason, stats = fin or reason, st or stats
        text, n_tokens = "".join(parts), len(asm.ids)
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if body.return_token_ids:
            choice["token_ids"] = list(asm.ids)
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [choice],
                "usage": self._usage(len(ids), n_tokens),
                "treespec": self._treespec(stats),
            }
        )

    async def _stream(self, body, job, request, asm, rid, created, n_prompt, chat, opts):
        obj = "chat.completion.chunk" if chat else "text_completion"
        total = 0

        def chunk(delta: str | None, reason: str | None, ids=(), first: bool = False) -> dict:
            if chat:
                d = {"role": "assistant", "content": delta or ""} if first else {}
                if delta and not first:
                    d = {"content": delta}
                c = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
            else:
                c = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
            if body.return_token_ids:
                c["token_ids"] = list(ids)
            out = {"id": rid, "object": obj, "created": created, "model": self.model_name}
            out["choices"] = [c]
            if opts.include_usage and opts.continuous_usage_stats:
                out["usage"] = self._usage(n_prompt, total)
            return out

        def sse(obj: dict) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        try:
            if chat:
                yield sse(chunk("", None, first=True))
            async for delta, ids, reason, stats in self._events(job, request, asm):
                total += len(ids)
                if reason is not None:
                    if delta:
                        yield sse(chunk(delta, None))
                    last = chunk(None, reason)
                    last["treespec"] = self._treespec(stats)
                    yield sse(last)
                    if opts.include_usage:
                        u = {"id": rid, "object": obj, "created": created, "model": self.model_name}
                        yield sse({**u, "choices": [], "usage": self._usage(n_prompt, total)})
                    break
                if delta or ids:
                    yield sse(chunk(delta, None, ids))
        except APIError as e:
            yield sse(
                {"error": {"message": e.message, "type": e.type, "param": None, "code": None}}
            )
        yield "data: [DONE]\n\n"

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "treespec",
                    "root": str(self.info.get("model", "")),
                    "max_model_len": self.max_model_len,
                    "treespec": self.info,
                }
            ],
        }


def _union_tag(part) -> bool:
    """Pydantic names the member of a union in an error location (``str``, ``list[int]``)."""
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool", "none") or "[" in part or part[:1].isupper()
    )


def create_app(engine, tokenizer, model_name: str = "treespec", info: dict | None = None):
    """A FastAPI app serving ``engine``; its worker thread runs during the app's lifespan.

    ``app.state.worker`` is the ``EngineWorker``, ``app.state.metrics`` the ``Metrics``.
    """
    info = {"tree": engine.policy.spec, **(info or {})}
    metrics = Metrics(max_accept=max(engine.policy.max_nodes, 1))
    worker = EngineWorker(engine, metrics)
    server = Server(worker, tokenizer, model_name, info)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="treespec", lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.server = worker, metrics, server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if exc.status < 500:
            with metrics.lock:
                metrics.rejected += 1
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        with metrics.lock:
            metrics.rejected += 1
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _union_tag(p)]
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg = f"malformed JSON body: {first.get('ctx', {}).get('error', msg)}"
        elif loc:
            msg = f"{'.'.join(loc)}: {msg}"
        return error_response(400, msg, param=".".join(loc) or None, code=first.get("type"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), type="invalid_request_error")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await server.chat(body, request)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/health")
    async def health():
        if not worker.alive():
            return error_response(503, "engine thread is not running", type="server_error")
        return {"status": "ok", "running": metrics.running, "waiting": metrics.waiting}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def load_engine(cfg: ServeConfig):
    """Load the models and the tokenizer of ``cfg``; returns ``(engine, tokenizer)``."""
    import torch
    from transformers import AutoTokenizer

    from tree_dev.engine import Engine, load_causal_lm

    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    dtype = getattr(torch, cfg.dtype)
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not (cfg.model / "config.json").is_file():
        hint = ""
        if cfg.model.parent == DEFAULT_MODEL_SET:
            hint = " (train it: python -m tree_dev.models train, or give --model PATH)"
        raise SystemExit(f"serve.py: no model at {cfg.model}{hint}")
    target = load_causal_lm(cfg.model, dtype=dtype).to(device)
    draft = eagle = None
    if cfg.drafter == "draft":
        draft = load_causal_lm(cfg.drafter_path, dtype=dtype).to(device)
    elif cfg.drafter == "eagle":
        from tree_dev.models.eagle import EagleHead

        eagle = EagleHead.from_pretrained(cfg.drafter_path, target=target, torch_dtype=dtype)
        eagle = eagle.to(device)
    tok_dir = cfg.tokenizer
    if tok_dir is None:
        for cand in (cfg.model, cfg.model.parent / "tokenizer"):
            if (cand / "tokenizer.json").is_file() or (cand / "tokenizer_config.json").is_file():
                tok_dir = cand
                break
    if tok_dir is None:
        raise SystemExit(f"serve.py: no tokenizer next to {cfg.model}; give --tokenizer PATH")
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    engine = Engine(
        target,
        draft=draft,
        eagle=eagle,
        tree=cfg.tree,
        max_batch=cfg.max_batch,
        max_model_len=cfg.max_model_len,
        kernel_backend=cfg.kernel_backend,
        eos_token_id=tokenizer.eos_token_id if target.config.eos_token_id is None else None,
        draft_sampling=cfg.draft_sampling,
    )
    return engine, tokenizer
