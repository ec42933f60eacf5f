"""The ASGI app: thin routes over a :class:`~kvtier.serving.server.Server`.

Every route reads its body, calls the server, and writes what comes back: JSON, an SSE stream, or the one error
shape (``protocol.RequestError``; 429s carry ``Retry-After``). A route that generates watches the connection
while it works: a client that goes away cancels the work, which closes the token generator and so aborts the
request on its worker, whether the response is a stream or one JSON object.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvtier.serving.protocol import RequestError, error_body
from kvtier.serving.server import Server, WorkerError

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the answer was complete."""


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(obj), status, headers, media_type="application/json")


def _error(e: RequestError) -> Response:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s is not None else None
    return _json(e.body(), e.status, headers)


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``work``, cancelled (ClientGone) if the client disconnects first (the body has been read already, so
    the next ASGI message is the disconnect)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone
    finally:
        watch.cancel()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(Response):
    """An SSE response over an async generator whose first chunk is already known (so errors before it were
    HTTP errors). The generator is closed when the client disconnects, when it ends, or on an error."""

    media_type = "text/event-stream"

    def __init__(self, first: bytes, rest: AsyncIterator[bytes]) -> None:
        super().__init__(None, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]  # chunked
        self.first, self.rest = first, rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self.first, "more_body": True})
            async for chunk in self.rest:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        work = asyncio.ensure_future(stream())
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await work
        finally:
            watch.cancel()
            await self.rest.aclose()


def build_app(server: Server) -> Starlette:
    def generating(
        endpoint: str, call: Callable[[bytes], Awaitable[dict[str, Any] | AsyncIterator[bytes]]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            status = 200
            try:
                body = await request.body()
                answer = await _until_disconnect(request, call(body))
                if isinstance(answer, dict):
                    return _json(answer)
                try:
                    first = await _until_disconnect(request, anext(answer))
                except BaseException:
                    await answer.aclose()
                    raise
                return EventStream(first, answer)
            except RequestError as e:
                status = e.status
                return _error(e)
            except WorkerError as e:
                status = 500
                return _json(error_body(str(e), "server_error", None, 500), 500)
            except ClientGone:
                status = 499
                return Response(status_code=499)
            finally:
                server.metrics.requests.labels(endpoint, str(status)).inc()

        return route

    def plain(call: Callable[[bytes], dict[str, Any]]) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            try:
                return _json(call(await request.body()))
            except RequestError as e:
                return _error(e)

        return route

    async def models(_: Request) -> Response:
        return _json(server.models())

    async def health(_: Request) -> Response:
        ok, line = server.ready()
        return _json({"status": "ok" if ok else "starting", "detail": line}, 200 if ok else 503)

    async def metrics(_: Request) -> Response:
        server.collect_metrics()
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/v1/completions", generating("completions", server.completion), methods=["POST"]),
        Route("/v1/chat/completions", generating("chat", server.chat), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", plain(server.tokenize), methods=["POST"]),
        Route("/detokenize", plain(server.detokenize), methods=["POST"]),
    ]
    return Starlette(routes=routes)
