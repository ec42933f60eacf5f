"""The OpenAI wire shapes, in one place: request models (decoded and validated with msgspec), the response and
stream-chunk objects, and the one error shape.

A request that cannot be served as asked raises :class:`RequestError`, which the app answers with
``{"error": {"message", "type", "param", "code"}}`` and its HTTP status. Fields this server does not implement
but OpenAI clients send by default are accepted and ignored; those that would change the answer (``n`` > 1,
``logprobs``, ``echo``, ``suffix``, ``best_of``) are refused with a 400 rather than silently dropped.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar

import msgspec


class RequestError(Exception):
    """A request this server refuses: ``status`` 400 (bad input), 404 (unknown model), 429 (overloaded, with
    ``retry_after_s``), 503 (not ready)."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "invalid_request_error",
        404: "not_found_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }

    def __init__(self, status: int, message: str, param: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after_s = status, message, param, retry_after_s

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.TYPES.get(self.status, "server_error"), self.param, self.status)


def error_body(message: str, kind: str, param: str | None = None, code: int | str | None = None) -> dict[str, Any]:
    """The one error shape, for HTTP bodies and for an SSE error event after a stream began."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = 1
    logprobs: Any = None
    user: str | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]  # a string, token ids, or a list of one of either (checked by the server)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(msgspec.Struct):
    type: str
    text: str = ""


class Message(msgspec.Struct):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text":
                raise RequestError(400, f"message content of type {part.type!r} is not supported", "messages")
        return "".join(part.text for part in self.content)


class ChatRequest(_Common, kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None


def decode(body: bytes, model: Any) -> Any:
    """``body`` as ``model``; RequestError 400 naming the field for malformed JSON or a field of the wrong type."""
    try:
        return msgspec.json.decode(body, type=model)
    except msgspec.ValidationError as e:
        param = str(e).rpartition("at `$.")[2].rstrip("`") or None
        raise RequestError(400, f"invalid request: {e}", param) from None
    except msgspec.DecodeError as e:
        raise RequestError(400, f"malformed JSON: {e}") from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion(rid: str, model: str, text: str, finish_reason: str | None, use: dict[str, Any] | None) -> dict:
    """A ``text_completion`` object, or one chunk of its stream (``text`` the delta; ``use`` None)."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    out: dict[str, Any] = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model}
    out["choices"] = [choice]
    if use is not None:
        out["usage"] = use
    return out


def chat_completion(rid: str, model: str, text: str, finish_reason: str | None, use: dict[str, Any]) -> dict:
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def chat_chunk(rid: str, model: str, delta: dict[str, Any] | None, finish_reason: str | None) -> dict:
    """One ``chat.completion.chunk``; ``delta`` None is the usage-only chunk (empty ``choices``)."""
    out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    out["choices"] = (
        [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    )
    return out


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or ``data: [DONE]``) and a blank line."""
    data = obj if isinstance(obj, str) else msgspec.json.encode(obj).decode()
    return f"data: {data}\n\n".encode()
