"""A process's metrics endpoint: Prometheus ``GET /metrics`` (``prometheus_client``) and ``GET /health`` beside it.

A long-running kvtier process (a storage node; later the fetcher and the engine) keeps its own
:class:`prometheus_client.CollectorRegistry`, registers its Counters, Gauges and Histograms on it once at start-up
(binding ``.labels(...)`` children ahead of the data path) and serves it with :class:`MetricsServer`. A registry
per process object, never the library's global one, so that two of them in one process (tests, tools) do not
collide. Series are exposed without the ``*_created`` samples (``disable_created_metrics``): kvtier's dashboards
use the totals, and a created timestamp per labelled child is memory and scrape bytes for nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote

from prometheus_client import CollectorRegistry, disable_created_metrics, make_wsgi_app

from kvtier.kvstore.wire.admission import Acceptor, Admission, Ticket, accept_forever
from kvtier.kvstore.wire.protocol import Limits

__all__ = ["LATENCY_BUCKETS", "MetricsServer"]

log = logging.getLogger("kvtier.metrics")

disable_created_metrics()

LATENCY_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Histogram bounds for request latencies, in seconds: 50 µs to 10 s in 1-2.5-5 steps (``+Inf`` is added)."""

MAX_REQUEST_HEAD_BYTES = 8 << 10  # request line and headers; a scrape sends a few hundred bytes
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"

_Environ = dict[str, Any]
_StartResponse = Callable[..., Any]


class BadRequest(ValueError):
    """Not an HTTP request this endpoint serves; the message is the status line to answer."""


def parse_request_head(head: bytes) -> _Environ:
    """A WSGI environ (the keys the apps here read) from an HTTP request's head, up to its blank line.

    Raises :class:`BadRequest` for anything that is not an HTTP/1.x request line followed by headers.
    """
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest("400 Bad Request")
    method, target, _version = parts
    path, _, query = target.partition("?")
    environ: _Environ = {"REQUEST_METHOD": method, "PATH_INFO": unquote(path), "QUERY_STRING": query}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise BadRequest("400 Bad Request")
        environ["HTTP_" + name.strip().upper().replace("-", "_")] = value.strip()
    return environ


class MetricsServer:
    """``GET /metrics`` and ``GET /health`` over HTTP, served from a daemon thread, one thread per connection.

    - ``/metrics``: the registry in the Prometheus text format (prometheus_client's WSGI app: content
      negotiation, gzip when asked), status 200.
    - ``/health``: ``health()`` as JSON; 200 if its ``"status"`` is ``"ok"``, else 503. If ``health()`` raises or
      returns something that is not a dict: 500 with a JSON ``{"status": "error", "error": ...}``; the server keeps
      serving.
    - any other path: 404. Requests are logged at DEBUG only, never to stderr.
    - with ``authorize``, ``/metrics`` answers only a request whose ``Authorization: Bearer TOKEN`` it accepts (else
      401): for a process whose totals tell of every tenant (the fetcher's, the directory's), the admin token.

    Peers cannot exhaust it (``limits``): at most ``metrics_max_connections`` connections at once (half of them
    from one address); beyond that a new one takes the place of the oldest of the address holding the most (its own
    address's, at its half), which is answered 503 (``kvstore.wire.admission``); a request must arrive whole within
    ``metrics_request_timeout_s`` of the connect (a trickle is cut there), its head at most
    ``MAX_REQUEST_HEAD_BYTES``; one request per connection; the accept loop survives running out of descriptors
    (:mod:`kvtier.kvstore.wire.admission`). It binds ``host``, by default loopback only: nothing authenticates a scrape.

    ``health`` defaults to ``lambda: {"status": "ok"}``. ``start()`` binds (``port=0`` picks a free port, read
    back from :attr:`port`; OSError when the port cannot be bound); ``stop()`` closes the socket and joins the
    thread; both are idempotent and the server is also a context manager.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str = "127.0.0.1",
        port: int = 0,
        health: Callable[[], dict[str, Any]] | None = None,
        limits: Limits | None = None,
        authorize: Callable[[str], bool] | None = None,
    ) -> None:
        self.registry = registry
        self.authorize = authorize
        self.host = host
        self._requested_port = port
        self.health: Callable[[], dict[str, Any]] = health or (lambda: {"status": "ok"})
        self._metrics_app = make_wsgi_app(registry)
        limits = limits or Limits()
        most = limits.metrics_max_connections
        self.limits = dataclasses.replace(
            limits,
            max_connections=most,
            max_pre_auth_connections=most,  # nothing authenticates: every connection counts as waiting for it
            max_pre_auth_per_peer=max(1, most // 2),
            hello_timeout_s=limits.metrics_request_timeout_s,
        )
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def port(self) -> int:
        """The bound port (the real one when constructed with port 0). RuntimeError before :meth:`start`."""
        listener = self._listener
        if listener is None:
            raise RuntimeError("MetricsServer is not running")
        return listener.getsockname()[1]

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def app(self, environ: _Environ, start_response: _StartResponse) -> Iterable[bytes]:
        """The WSGI application: ``/metrics``, ``/health``, 404 for the rest."""
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            if self.authorize is not None and not self._authorized(environ):
                start_response("401 Unauthorized", [("WWW-Authenticate", 'Bearer realm="kvtier"')])
                return [b"a bearer token is required\n"]
            return self._metrics_app(environ, start_response)
        if path == "/health":
            status, body = self._health()
            start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found\n"]

    def _authorized(self, environ: _Environ) -> bool:
        scheme, _, token = str(environ.get("HTTP_AUTHORIZATION", "")).partition(" ")
        return scheme.lower() == "bearer" and self.authorize is not None and self.authorize(token.strip())

    def _health(self) -> tuple[str, bytes]:
        try:
            result = self.health()
            if not isinstance(result, dict):
                raise TypeError(f"health() returned {type(result).__name__}, not dict")
        except Exception as exc:
            log.warning("metrics server: health check failed", exc_info=True)
            error = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
            return "500 Internal Server Error", json.dumps(error).encode()
        ok = result.get("status") == "ok"
        return ("200 OK" if ok else "503 Service Unavailable"), json.dumps(result, default=str).encode()

    def start(self) -> MetricsServer:
        """Bind and start serving; returns ``self``."""
        with self._lock:
            if self._listener is not None:
                return self
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            listener = socket.create_server((self.host, self._requested_port), family=family)
            listener.settimeout(0.25)  # how soon the accept loop notices stop()
            self._stopping.clear()
            thread = threading.Thread(target=self._serve, args=(listener,), name="kvtier-metrics", daemon=True)
            thread.start()
            self._listener, self._thread = listener, thread
            return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, close the socket and join the serving thread (in-flight requests may finish)."""
        with self._lock:
            listener, thread = self._listener, self._thread
            self._listener = self._thread = None
        if listener is None:
            return
        self._stopping.set()
        if thread is not None:
            thread.join(timeout)
        listener.close()

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self, listener: socket.socket) -> None:
        acceptor = Acceptor(listener, log)
        try:
            accept_forever(acceptor, Admission(self.limits), self._stopping, self._answer, lambda _reason: _BUSY)
        finally:
            acceptor.close()

    def _answer(self, conn: socket.socket, ticket: Ticket) -> None:
        """Read one request by the ticket's deadline and answer it."""
        try:
            try:
                environ = parse_request_head(_read_head(conn, ticket))
                status, headers, body = self._call(environ)
            except BadRequest as exc:
                status, headers, body = str(exc), [], b""
            _send(conn, status, headers, body, self.limits.metrics_request_timeout_s)
        except OSError as exc:  # timed out, or the peer went away
            log.debug("metrics server: dropped a connection from %s: %s", ticket.peer, exc)
        except Exception:
            log.exception("metrics server: request failed")

    def _call(self, environ: _Environ) -> tuple[str, list[tuple[str, str]], bytes]:
        response: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
            response[:] = [status, headers]

        body = b"".join(self.app(environ, start_response))
        return response[0], response[1], body


def _read_head(conn: socket.socket, ticket: Ticket) -> bytes:
    """The request's head (up to and without its blank line), received by the ticket's deadline.

    Raises TimeoutError past the deadline, ConnectionError if the peer closes first, BadRequest for a head over
    ``MAX_REQUEST_HEAD_BYTES``."""
    data = bytearray()
    while (end := data.find(b"\r\n\r\n")) < 0:
        if len(data) > MAX_REQUEST_HEAD_BYTES:
            raise BadRequest("431 Request Header Fields Too Large")
        conn.settimeout(ticket.recv_timeout_s())
        chunk = conn.recv(4096)
        if not chunk:
            raise ConnectionResetError("the peer closed before its request was complete")
        data += chunk
    return bytes(data[:end])


def _send(conn: socket.socket, status: str, headers: list[tuple[str, str]], body: bytes, timeout_s: float) -> None:
    """Send a whole response within ``timeout_s`` (a peer that reads slower is dropped) and close our side: one
    request per connection."""
    fields = [(k, v) for k, v in headers if k.lower() not in ("content-length", "connection")]
    fields += [("Content-Length", str(len(body))), ("Connection", "close")]
    head = f"HTTP/1.1 {status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields) + "\r\n"
    conn.settimeout(timeout_s)
    conn.sendall(head.encode("latin-1") + body)
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
