"""The ASGI app: thin routes over a :class:`~kvtier.serving.server.Server`.

Every route checks the API key (all but ``/health`` and ``/metrics``, when the server has one: ``Authorization:
Bearer KEY``, compared in constant time; 401 otherwise), reads its body (at most ``max_request_bytes``: 413
otherwise, before more is read), calls the server, and writes what comes back: JSON, an SSE stream, or the one error
shape (``protocol.RequestError``; 429s carry ``Retry-After``), for unknown routes and methods too. An
``X-Request-Id`` the client sends is echoed (and names the answer: ``cmpl-ID``); otherwise one is made. A route that
generates watches the connection while it works: a client that goes away cancels the work, which closes the token
generators and so aborts its requests on the workers, whether the response is a stream or one JSON object; so does
the end of the shutdown grace (``Server.cut``), which ends a stream with an error event and ``[DONE]``. One access
log line per request (logger ``kvtier.serving.access``): method, path, status, tokens made, TTFT, seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvtier.serving.protocol import RequestError, error_body, sse
from kvtier.serving.server import Answer, Job, Server, WorkerError

T = TypeVar("T")
access = logging.getLogger("kvtier.serving.access")
OPEN = ("/health", "/metrics")  # routes that need no API key
MAX_REQUEST_BYTES = 32 << 20


class ClientGone(Exception):
    """The client closed the connection before the answer was complete."""


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(obj), status, headers, media_type="application/json")


def _error(e: RequestError) -> Response:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s is not None else None
    return _json(e.body(), e.status, headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body; RequestError 413 as soon as it is known to pass ``limit`` bytes (its Content-Length,
    else what arrived), without reading the rest."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _too_large(size, limit)
        parts.append(part)
    return b"".join(parts)


def _too_large(size: int, limit: int) -> RequestError:
    return RequestError(413, f"the request body of {size}+ bytes passes the limit of {limit} (--max-request-bytes)")


async def _until_disconnect(request: Request, work: Awaitable[T], cut: asyncio.Event | None) -> T:
    """``work``, cancelled if the client disconnects first (ClientGone) or the shutdown grace ends (RequestError
    503). The body has been read already, so the next ASGI message is the disconnect."""
    task = asyncio.ensure_future(work)
    watches = {asyncio.ensure_future(_disconnected(request.receive))}
    if cut is not None:
        watches.add(asyncio.ensure_future(cut.wait()))
    try:
        done, _ = await asyncio.wait({task, *watches}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if cut is not None and cut.is_set():
            raise RequestError(503, "the server is shutting down")
        raise ClientGone
    finally:
        for w in watches:
            w.cancel()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(Response):
    """An SSE response over an async generator whose first chunk is already known (so errors before it were
    HTTP errors). The generator is closed when the client disconnects, when it ends, on an error, or when the
    shutdown grace ends (``cut``: an error event and ``[DONE]`` end the stream first)."""

    media_type = "text/event-stream"

    def __init__(
        self, first: bytes, rest: AsyncIterator[bytes], cut: asyncio.Event | None, headers: dict[str, str]
    ) -> None:
        super().__init__(None, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]  # chunked
        self.first, self.rest, self.cut = first, rest, cut
        self.ended: Callable[[int], None] = lambda status: None  # told once the stream is over (the access log)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self.first, "more_body": True})
            async for chunk in self.rest:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        work = asyncio.ensure_future(stream())
        watches = {asyncio.ensure_future(_disconnected(receive))}
        if self.cut is not None:
            watches.add(asyncio.ensure_future(self.cut.wait()))
        status = 200
        try:
            await asyncio.wait({work, *watches}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                status = 499
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await work
            if self.cut is not None and self.cut.is_set() and status == 499:
                status = 503
                ending = sse(error_body("the server is shutting down", "service_unavailable", None, 503))
                with contextlib.suppress(OSError):
                    await send({"type": "http.response.body", "body": ending + sse("[DONE]"), "more_body": False})
        finally:
            for w in watches:
                w.cancel()
            await self.rest.aclose()
            self.ended(status)


def build_app(server: Server, api_key: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES) -> Starlette:
    """The routes over ``server``; ``api_key``: the key every route but :data:`OPEN` needs."""

    def log_access(request: Request, status: int, jobs: list[Job], began: float) -> None:
        tokens = sum(len(j.generated) for j in jobs)
        firsts = [j.first_at - j.arrival for j in jobs if j.first_at is not None]
        ttft = f"{min(firsts) * 1e3:.1f}ms" if firsts else "-"
        client = request.client.host if request.client else "-"
        access.info(
            '%s "%s %s" %d tokens=%d ttft=%s %.3fs',
            client, request.method, request.url.path, status, tokens, ttft, time.monotonic() - began,
        )  # fmt: skip

    def generating(
        endpoint: str, call: Callable[[bytes, str], Awaitable[Answer]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            began, status, jobs = time.monotonic(), 200, []
            rid = request.headers.get("x-request-id") or uuid.uuid4().hex
            headers = {"X-Request-Id": rid}
            stream: EventStream | None = None
            try:
                body = await read_body(request, max_request_bytes)
                answer = await _until_disconnect(request, call(body, rid), server.cut)
                jobs = answer.jobs
                if answer.body is not None:
                    return _json(answer.body, headers=headers)
                assert answer.stream is not None
                try:
                    first = await _until_disconnect(request, anext(answer.stream), server.cut)
                except BaseException:
                    await answer.stream.aclose()
                    raise
                stream = EventStream(first, answer.stream, server.cut, headers)

                def ended(final: int) -> None:
                    server.metrics.requests.labels(endpoint, str(final)).inc()
                    log_access(request, final, jobs, began)

                stream.ended = ended
                return stream
            except RequestError as e:
                status = e.status
                return _with(_error(e), headers)
            except WorkerError as e:
                status = 500
                return _json(error_body(str(e), "server_error", None, 500), 500, headers)
            except ClientGone:
                status = 499
                return Response(status_code=499)
            finally:
                if stream is None:
                    server.metrics.requests.labels(endpoint, str(status)).inc()
                    log_access(request, status, jobs, began)

        return route

    def plain(call: Callable[[bytes], Awaitable[dict[str, Any]]]) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            began, status = time.monotonic(), 200
            try:
                return _json(await call(await read_body(request, max_request_bytes)))
            except RequestError as e:
                status = e.status
                return _error(e)
            finally:
                log_access(request, status, [], began)

        return route

    async def models(_: Request) -> Response:
        return _json(server.models())

    async def health(_: Request) -> Response:
        ok, line = server.ready()
        return _json({"status": "ok" if ok else "unavailable", "detail": line}, 200 if ok else 503)

    async def metrics(_: Request) -> Response:
        server.collect_metrics()
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def show_version(_: Request) -> Response:
        try:
            return _json({"version": version("kvtier")})
        except PackageNotFoundError:
            return _json({"version": "unknown"})

    async def http_error(_: Request, e: Exception) -> Response:
        assert isinstance(e, HTTPException)
        return _error(RequestError(e.status_code, str(e.detail)))

    routes = [
        Route("/v1/completions", generating("completions", server.completion), methods=["POST"]),
        Route("/v1/chat/completions", generating("chat", server.chat), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/version", show_version, methods=["GET"]),
        Route("/tokenize", plain(server.tokenize), methods=["POST"]),
        Route("/detokenize", plain(server.detokenize), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    return Authenticated(app, api_key) if api_key else app


def _with(response: Response, headers: dict[str, str]) -> Response:
    response.headers.update(headers)
    return response


class Authenticated:
    """ASGI middleware: every HTTP route but :data:`OPEN` needs ``Authorization: Bearer KEY`` (compared in constant
    time); 401 in OpenAI's error shape otherwise."""

    def __init__(self, app: Starlette, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN:
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                error = RequestError(401, "a valid API key is needed: Authorization: Bearer KEY")
                await _error(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
