"""A process's metrics endpoint: Prometheus ``GET /metrics`` (``prometheus_client``) and ``GET /health`` beside it.

A long-running kvtier process (a storage node; later the fetcher and the engine) keeps its own
:class:`prometheus_client.CollectorRegistry`, registers its Counters, Gauges and Histograms on it once at start-up
(binding ``.labels(...)`` children ahead of the data path) and serves it with :class:`MetricsServer`. A registry
per process object, never the library's global one, so that two of them in one process (tests, tools) do not
collide. Series are exposed without the ``*_created`` samples (``disable_created_metrics``): kvtier's dashboards
use the totals, and a created timestamp per labelled child is memory and scrape bytes for nothing.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, disable_created_metrics, make_wsgi_app

__all__ = ["LATENCY_BUCKETS", "MetricsServer"]

log = logging.getLogger("kvtier.metrics")

disable_created_metrics()

LATENCY_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Histogram bounds for request latencies, in seconds: 50 µs to 10 s in 1-2.5-5 steps (``+Inf`` is added)."""

_Environ = dict[str, Any]
_StartResponse = Callable[..., Any]


class _Handler(WSGIRequestHandler):
    timeout = 10.0  # a stalled client frees its thread after this long

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics server: %s - " + format, self.address_string(), *args)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # The default prints a traceback to stderr; a dropped scrape connection is not worth that.
        log.debug("metrics server: error handling a request from %s", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """``GET /metrics`` and ``GET /health`` over HTTP, served from a daemon thread, one thread per request.

    - ``/metrics``: the registry in the Prometheus text format (prometheus_client's WSGI app: content
      negotiation, gzip when asked), status 200.
    - ``/health``: ``health()`` as JSON; 200 if its ``"status"`` is ``"ok"``, else 503. If ``health()`` raises or
      returns something that is not a dict: 500 with a JSON ``{"status": "error", "error": ...}``; the server keeps
      serving.
    - any other path: 404. Requests are logged at DEBUG only, never to stderr.

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
    ) -> None:
        self.registry = registry
        self.host = host
        self._requested_port = port
        self.health: Callable[[], dict[str, Any]] = health or (lambda: {"status": "ok"})
        self._metrics_app = make_wsgi_app(registry)
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (the real one when constructed with port 0). RuntimeError before :meth:`start`."""
        server = self._server
        if server is None:
            raise RuntimeError("MetricsServer is not running")
        return server.server_address[1]

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def app(self, environ: _Environ, start_response: _StartResponse) -> Iterable[bytes]:
        """The WSGI application: ``/metrics``, ``/health``, 404 for the rest."""
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if path == "/health":
            status, body = self._health()
            start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found\n"]

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
            if self._server is not None:
                return self
            server_class = _Server6 if ":" in self.host else _Server
            server = make_server(self.host, self._requested_port, self.app, server_class, _Handler)
            thread = threading.Thread(
                target=server.serve_forever, kwargs={"poll_interval": 0.25}, name="kvtier-metrics", daemon=True
            )
            thread.start()
            self._server, self._thread = server, thread
            return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, close the socket and join the serving thread (in-flight requests may finish)."""
        with self._lock:
            server, thread = self._server, self._thread
            self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout)

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
