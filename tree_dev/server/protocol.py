"""OpenAI request schemas and error bodies of the local engine's server (pydantic v2).

Every 4xx body is OpenAI's ``{"error": {"message", "type", "param", "code"}}``. The
request models are strict (``"4"`` is not an integer) and ignore unknown fields.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM extension: usage in every chunk


class _SamplingFields(_Strict):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: Any = None
    ignore_eos: bool = False  # vLLM extension
    stop_token_ids: list[int] | None = None  # vLLM extension
    return_token_ids: bool = False  # vLLM extension: generated ids in each choice


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatTextPart(_Strict):
    type: str
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[ChatTextPart] | None = None


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None


class APIError(Exception):
    """An OpenAI-style error response."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type,
        )

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.type)


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    type: str = "invalid_request_error",
) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)
