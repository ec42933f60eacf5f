"""The OpenAI wire shapes, in one place: request models (decoded and validated with msgspec), the response and
stream-chunk objects, and the one error shape.

A request that cannot be served as asked raises :class:`RequestError`, which the app answers with
``{"error": {"message", "type", "param", "code"}}`` and its HTTP status. Fields OpenAI clients send by default
and that change nothing here (``user``, ``stream_options``, ``parallel_tool_calls``, …) are accepted; fields that
would change the answer and are not implemented (:data:`REFUSED`) are refused with a 400 naming the field, never
silently dropped. ``null`` means "the default" for every field, as in vLLM.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar

import msgspec

UNSET: Any = msgspec.UNSET


class RequestError(Exception):
    """A request this server refuses: ``status`` 400 (bad input), 401 (no or a wrong API key), 404 (unknown model
    or route), 405, 413 (body too large), 429 (overloaded, with ``retry_after_s``), 500, 503 (not ready)."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "invalid_request_error",
        401: "invalid_request_error",
        404: "invalid_request_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
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
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


# Fields that would change the answer and that this server does not implement, with the values that mean "not
# used" (accepted). Anything else in them is a 400 naming the field.
REFUSED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "prompt_logprobs": (None,),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "truncate_prompt_tokens": (None,),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "web_search_options": (None,),
    "return_tokens_as_token_ids": (None, False),
    "priority": (None, 0),
}


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    user: str | None = None
    # REFUSED's fields, kept as sent so that a used one is named in its 400
    tools: Any = UNSET
    tool_choice: Any = UNSET
    functions: Any = UNSET
    function_call: Any = UNSET
    response_format: Any = UNSET
    guided_json: Any = UNSET
    guided_regex: Any = UNSET
    guided_choice: Any = UNSET
    guided_grammar: Any = UNSET
    structured_outputs: Any = UNSET
    prompt_logprobs: Any = UNSET
    echo: Any = UNSET
    best_of: Any = UNSET
    use_beam_search: Any = UNSET
    length_penalty: Any = UNSET
    bad_words: Any = UNSET
    allowed_token_ids: Any = UNSET
    include_stop_str_in_output: Any = UNSET
    skip_special_tokens: Any = UNSET
    truncate_prompt_tokens: Any = UNSET
    return_tokens_as_token_ids: Any = UNSET
    priority: Any = UNSET

    def refused(self) -> str | None:
        """The first field of :data:`REFUSED` set to a value that would change the answer, if any."""
        for name, harmless in REFUSED.items():
            value = getattr(self, name, UNSET)
            if value is not UNSET and value not in harmless:
                return name
        return None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[int | str | list[int]]  # a string, token ids, or a list of one of either
    logprobs: int | None = None  # alternatives to report with each token (0: the token's own logprob only)
    suffix: Any = UNSET


class TokenIdsRequest(CompletionRequest, kw_only=True):
    """A completion whose prompt is one list of token ids, decoded as such (no check of each id's type after)."""

    prompt: list[int]


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
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, str | int | float | bool | None] | None = None
    continue_final_message: Any = UNSET
    chat_template: Any = UNSET
    prediction: Any = UNSET
    audio: Any = UNSET
    modalities: Any = UNSET
    web_search_options: Any = UNSET


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_generation_prompt: bool | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


def decode(body: bytes, model: Any) -> Any:
    """``body`` as ``model``; RequestError 400 for malformed JSON (``param`` None), a field of the wrong type
    (``param`` the field), or JSON nested too deeply to decode."""
    try:
        return msgspec.json.decode(body, type=model)
    except msgspec.ValidationError as e:
        where = str(e).rpartition(" - at `$.")[2].rstrip("`")
        param = where.split("[")[0].split(".")[0] or None
        raise RequestError(400, f"invalid request: {e}", param) from None
    except msgspec.DecodeError as e:
        raise RequestError(400, f"malformed JSON: {e}") from None
    except RecursionError:
        raise RequestError(400, "the JSON is nested too deeply") from None


def new_id(prefix: str, request_id: str | None = None) -> str:
    return f"{prefix}-{request_id or uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _head(rid: str, kind: str, model: str) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}


def completion(rid: str, model: str, choices: list[dict[str, Any]], use: dict[str, Any] | None) -> dict:
    """A ``text_completion`` object, or one chunk of its stream (``use`` None)."""
    out = {**_head(rid, "text_completion", model), "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: Any = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_completion(rid: str, model: str, choices: list[dict[str, Any]], use: dict[str, Any]) -> dict:
    return {**_head(rid, "chat.completion", model), "choices": choices, "usage": use}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: Any = None) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk(rid: str, model: str, choices: list[dict[str, Any]]) -> dict:
    """One ``chat.completion.chunk``; no ``choices`` is the usage-only chunk."""
    return {**_head(rid, "chat.completion.chunk", model), "choices": choices}


def chat_delta(index: int, delta: dict[str, Any], finish_reason: str | None, logprobs: Any = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or ``data: [DONE]``) and a blank line."""
    data = obj.encode() if isinstance(obj, str) else msgspec.json.encode(obj)
    return b"data: " + data + b"\n\n"
