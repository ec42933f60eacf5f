"""etcd from threaded code: one asyncio loop in a daemon thread, calls with deadlines, fail-over between members.

kvtier's nodes and clients are thread-based; the etcd client (``aetcd``) is asyncio. An :class:`Etcd` owns one
event loop in a thread of its own: ``call`` runs a coroutine there and waits for it (from any thread);
``spawn`` starts a long-lived task (a watch, a lease's keep-alive).

Fail-over: every request goes to one member at a time and carries ``hasleader`` (etcd answers it only while that
member has a leader: a member cut off from the majority refuses instead of serving stale data or hanging). A request
that fails for the connection (refused, no leader, or no answer within ``ATTEMPT_S``: a partitioned host) is
retried on the next member until its deadline.

Promises: ``call`` returns the coroutine's result or raises :class:`EtcdUnavailable` (one line naming the
endpoints) once ``timeout_s`` has passed without a member answering; errors of the request itself (a compacted
revision, a bad argument) are raised as they are.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import aetcd

log = logging.getLogger("kvtier.etcd")

_T = TypeVar("_T")
ATTEMPT_S = 2.0  # one member gets this long to answer before the next is tried


def _aetcd() -> ModuleType:
    """``aetcd`` (and gRPC under it), imported on first use: a process whose cluster file names its nodes (no
    etcd) never loads them."""
    for module in ("aetcd.exceptions", "aetcd.rpc", "aetcd.utils"):
        importlib.import_module(module)
    return importlib.import_module("aetcd")


def _retry_on() -> tuple[type[BaseException], ...]:
    """Failures of the connection to one member, not of the request: worth retrying on another member."""
    exceptions = _aetcd().exceptions
    return (
        exceptions.ConnectionFailedError,
        exceptions.ConnectionTimeoutError,
        exceptions.InternalError,
        TimeoutError,
        ConnectionError,
    )


class WatchEvent(NamedTuple):
    key: bytes
    deleted: bool
    value: bytes
    mod_revision: int


class Compacted(Exception):
    """A watch asked for revisions etcd has compacted away: read everything again."""


class EtcdUnavailable(RuntimeError):
    """No etcd member answered before the deadline (down, partitioned away, or without a leader)."""


def stopping() -> bool:
    """Whether the running task is being cancelled (the loop is stopping), as opposed to one of its gRPC calls being
    cancelled because ``fail_over`` closed that call's channel: gRPC raises ``CancelledError`` for both."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def parse_endpoints(text: str | Sequence[str]) -> list[tuple[str, int]]:
    """``"http://10.0.0.1:2379,10.0.0.2:2379"`` (or a list of them) as (host, port) pairs; ValueError if empty or
    malformed."""
    items = text.split(",") if isinstance(text, str) else list(text)
    endpoints = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        parts = urlsplit(item if "://" in item else f"http://{item}")
        if parts.scheme not in ("http", "") or not parts.hostname:
            raise ValueError(f"etcd endpoint {item!r} is not host:port or http://host:port (TLS is not supported)")
        endpoints.append((parts.hostname, parts.port or 2379))
    if not endpoints:
        raise ValueError("no etcd endpoint given")
    return endpoints


class Etcd:
    """A connection to one etcd cluster from threaded code (see the module docstring). Thread-safe."""

    def __init__(self, endpoints: str | Sequence[str], timeout_s: float = 10.0) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.timeout_s = timeout_s
        self._current = 0
        self._client: aetcd.Client | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="etcd", daemon=True)
        self._thread.start()
        self._closed = False
        self._closing: set[asyncio.Future[None]] = set()

    def __repr__(self) -> str:
        return f"Etcd({','.join(f'{h}:{p}' for h, p in self.endpoints)})"

    @property
    def where(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def call(self, request: Callable[[aetcd.Client], Awaitable[_T]], timeout_s: float | None = None) -> _T:
        """Run ``request(client)`` in the loop, failing over between members, and return its result (see the module
        docstring for what is raised)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("Etcd.call from the etcd thread itself would wait forever: await Etcd.run there")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        future = asyncio.run_coroutine_threadsafe(self.run(request, timeout), self._loop)
        try:
            return future.result(timeout + ATTEMPT_S + 1.0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise EtcdUnavailable(f"etcd at {self.where} did not answer within {timeout:g} s") from None

    def spawn(self, coroutine: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Start a long-lived task in the loop (it must end when the Etcd closes: ``closed`` turns true)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def call_soon(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` in the loop soon (from any thread; e.g. to set an ``asyncio.Event``)."""
        self._loop.call_soon_threadsafe(callback)

    @property
    def closed(self) -> bool:
        return self._closed

    async def run(self, request: Callable[[aetcd.Client], Awaitable[_T]], timeout_s: float) -> _T:
        """In the loop: ``request`` on the current member, then on the next ones, until ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        failures = 0
        while True:
            client = await self.client()
            try:
                try:
                    return await asyncio.wait_for(request(client), ATTEMPT_S)
                except asyncio.CancelledError:
                    if stopping():
                        raise
                    raise ConnectionError("the call's channel was closed (another request failed over)") from None
            except _retry_on() as exc:
                failures += 1
                await self.fail_over(client, exc)
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise EtcdUnavailable(
                        f"etcd at {self.where} did not answer within {timeout_s:g} s ({type(exc).__name__}: {exc})"
                    ) from None
                if failures % len(self.endpoints) == 0:  # every member failed once: let them recover a little
                    await asyncio.sleep(min(left, 0.2))

    async def client(self) -> aetcd.Client:
        """The client of the member in use, connected on first use."""
        if self._client is None:
            host, port = self.endpoints[self._current]
            # no gRPC keep-alive pings (etcd answers pings more often than every 5 s with GOAWAY): a silent member
            # is noticed by the requests' own deadlines (the map feed checks every 2 s) and left for the next
            options = {"grpc.initial_reconnect_backoff_ms": 100, "grpc.max_reconnect_backoff_ms": 1000}
            client = _aetcd().Client(host=host, port=port, timeout=ATTEMPT_S, options=options)
            await client.connect()
            # a member without a leader refuses instead of hanging
            client.metadata = (("hasleader", "true"),)
            self._client = client
        return self._client

    async def fail_over(self, client: aetcd.Client, why: BaseException | None = None) -> None:
        """``client`` failed: use the next member (unless another task moved on already)."""
        if client is not self._client:
            return
        host, port = self.endpoints[self._current]
        log.info("etcd member %s:%d failed (%s); trying the next", host, port, why)
        self._client = None
        self._current = (self._current + 1) % len(self.endpoints)
        # closed in the background: aetcd's close swallows the cancellation a timeout would send, so awaiting it
        # here could hang every task of the loop behind a dead connection
        closing = asyncio.ensure_future(self._close_quietly(client))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    @staticmethod
    async def _close_quietly(client: aetcd.Client) -> None:
        with contextlib.suppress(Exception):  # closing the channel cancels its calls (a watch on it ends)
            await client.channel.close()

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncIterator[WatchEvent]:
        """Every change under ``prefix`` from ``start_revision`` on, in order, from the member in use: a gRPC
        watch stream of its own (aetcd's watcher can hang a loop when a member goes silent). Ends by raising
        :class:`Compacted` when that revision is compacted away, or ``ConnectionError`` when the stream breaks
        (the member died or lost its leader, or ``fail_over`` closed its channel); the caller watches again."""
        client = await self.client()
        rpc = _aetcd().rpc
        create = rpc.WatchCreateRequest(
            key=prefix, range_end=_aetcd().utils.prefix_range_end(prefix), start_revision=start_revision
        )
        requests: asyncio.Queue[Any] = asyncio.Queue()
        requests.put_nowait(rpc.WatchRequest(create_request=create))

        async def outgoing() -> AsyncIterator[Any]:
            while (request := await requests.get()) is not None:
                yield request

        call = rpc.WatchStub(client.channel).Watch(outgoing(), metadata=client.metadata)
        try:
            async for response in call:
                if response.compact_revision:
                    raise Compacted(response.compact_revision)
                if not response.canceled:
                    for event in response.events:
                        kv = event.kv
                        yield WatchEvent(kv.key, event.type == rpc.Event.DELETE, kv.value, kv.mod_revision)
                    continue
                await self.fail_over(client, ConnectionError(response.cancel_reason))
                raise ConnectionError(f"etcd cancelled the watch: {response.cancel_reason}")
        except rpc.AioRpcError as exc:
            await self.fail_over(client, exc)  # nothing if it was fail_over that closed the channel
            raise ConnectionError(f"the watch stream broke: {exc.code().name} {exc.details()}") from None
        except asyncio.CancelledError:
            if stopping():
                raise
            raise ConnectionError("the watch's channel was closed (a request failed over)") from None
        finally:
            requests.put_nowait(None)  # ends outgoing(): gRPC's task feeding it finishes instead of being dropped
            call.cancel()
        raise ConnectionError("the watch stream ended")

    async def repeat(
        self,
        step: Callable[[], Awaitable[object]],
        period_s: Callable[[], float],
        wake: asyncio.Event,
        failed: Callable[[Exception], None],
    ) -> None:
        """In the loop, until the Etcd closes: run ``step`` every ``period_s()`` seconds, or at once when ``wake`` is
        set; a step that raises is reported to ``failed`` and runs again next time (a call of it cancelled because
        another request failed over its channel included)."""
        while not self._closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), period_s())
            wake.clear()
            try:
                await step()
            except asyncio.CancelledError:
                if stopping():
                    return
            except Exception as exc:
                failed(exc)

    def close(self) -> None:
        """Stop the loop (tasks from ``spawn`` see ``closed`` and end) and close the connection."""
        if self._closed:
            return
        self._closed = True

        async def shutdown() -> None:
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=1.0)
            if self._client is not None:
                await self._close_quietly(self._client)
            await self._loop.shutdown_asyncgens()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(3.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(3.0)
