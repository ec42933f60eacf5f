"""Process metrics: a thread-safe registry and an HTTP endpoint in the Prometheus text format 0.0.4.

Standard library only. A long-running kvtier process (a storage node; later the fetcher and the engine)
keeps one :class:`Metrics`, registers its metrics once at start-up and updates them on the data path::

    metrics = Metrics()
    requests = metrics.counter("kvtier_node_requests_total", "Requests served, by op.", labels=("op",))
    latency = metrics.histogram("kvtier_node_request_seconds", "Request latency, by op.", labels=("op",))
    requests.inc(op="GET_SHARDS")
    latency.observe(0.0012, op="GET_SHARDS")
    print(metrics.render())

:class:`MetricsServer` serves ``GET /metrics`` (the rendering) and ``GET /health`` (JSON from a callable)
on a :class:`http.server.ThreadingHTTPServer` in a daemon thread.

Cost contract: ``Counter.inc``, ``Gauge.set``/``inc``/``dec`` and ``Histogram.observe`` take one lock and
update one dict entry (a histogram also bisects its bounds). Labels are validated once per new label set;
after that an update builds a tuple of the label values and nothing else. No string is formatted until
:meth:`Metrics.render`.

Series semantics, as in the official clients: a metric without labels exposes its one series (at 0) from
registration on; a labelled metric exposes a series once it is first updated, so call ``inc(0, op=...)``
at start-up for series that must show up as 0 before any event.

Rendering: metrics in registration order, series sorted by label values; integers render as integers,
floats with :func:`repr` (``0.5``, ``1e-05``), infinities as ``+Inf``/``-Inf``, NaN as ``NaN``; histogram
``le`` values render the same way (``le="0.005"``, ``le="1.0"``, ``le="+Inf"``).
"""

from __future__ import annotations

import json
import logging
import math
import re
import socket
import threading
from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import pairwise
from operator import itemgetter
from typing import Any, ClassVar, TypeVar

__all__ = [
    "BYTES_BUCKETS",
    "CONTENT_TYPE",
    "LATENCY_BUCKETS",
    "Counter",
    "Gauge",
    "Histogram",
    "Metrics",
    "MetricsServer",
]

log = logging.getLogger("kvtier.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The ``Content-Type`` of the Prometheus text exposition format 0.0.4."""

LATENCY_BUCKETS: tuple[float, ...] = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Default histogram bounds, in seconds: 50 µs to 10 s in 1-2.5-5 steps (``+Inf`` is always added)."""

BYTES_BUCKETS: tuple[float, ...] = tuple(float(1 << shift) for shift in range(10, 31, 2))
"""Size bounds, in bytes: 1 KiB to 1 GiB in powers of 4, for ``*_bytes`` histograms."""

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# Keyword parameters of the update methods; a label with one of these names could not be passed.
_RESERVED_LABELS = frozenset({"amount", "value", "fn", "self"})

LabelKey = tuple[str, ...]
_M = TypeVar("_M", bound="_Metric")


def _format_value(value: float) -> str:
    """A sample value as the exposition format writes it (Go ``ParseFloat`` reads it back)."""
    if type(value) is int:
        return str(value)
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def _escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _label_text(names: Sequence[str], values: Sequence[str]) -> str:
    """``{a="x",b="y"}``, or ``""`` without labels."""
    if not names:
        return ""
    return "{" + ",".join(f'{n}="{_escape_label_value(v)}"' for n, v in zip(names, values, strict=True)) + "}"


class _Metric(ABC):
    """Shared machinery: name/label validation, the per-metric lock, label-key lookup.

    Subclasses keep their series in ``self._series`` (label-value tuple -> state), read and written only
    under ``self._lock``.
    """

    type_name: ClassVar[str] = ""
    reserved_labels: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, name: str, help: str, labels: Iterable[str] = ()) -> None:
        if not isinstance(name, str) or not _METRIC_NAME.fullmatch(name):
            raise ValueError(f"invalid metric name {name!r}")
        if not isinstance(help, str):
            raise ValueError(f"help for {name} must be a str")
        labelnames = tuple(labels)
        for label in labelnames:
            if not isinstance(label, str) or not _LABEL_NAME.fullmatch(label) or label.startswith("__"):
                raise ValueError(f"{name}: invalid label name {label!r}")
            if label in _RESERVED_LABELS or label in self.reserved_labels:
                raise ValueError(f"{name}: label name {label!r} is reserved")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"{name}: duplicate label names in {labelnames!r}")
        self.name = name
        self.help = help
        self.labelnames: tuple[str, ...] = labelnames
        self._label_count = len(labelnames)
        # C-level lookup of the label values in declaration order (a bare value for one label).
        self._get_labels: Callable[[Mapping[str, object]], Any] = itemgetter(*labelnames) if labelnames else len
        self._lock = threading.Lock()
        self._series: dict[LabelKey, Any] = {}

    def _key(self, labels: Mapping[str, object]) -> LabelKey:
        """The label-value tuple for ``labels`` (names checked; values are checked on first use)."""
        count = self._label_count
        if len(labels) != count:
            raise self._label_error(labels)
        if count == 0:
            return ()
        try:
            values = self._get_labels(labels)
        except KeyError:
            raise self._label_error(labels) from None
        return (values,) if count == 1 else values

    def _new_key(self, key: tuple[object, ...]) -> LabelKey:
        """Validate the values of a label set seen for the first time; plain ``str`` copies of them."""
        for name, value in zip(self.labelnames, key, strict=True):
            if not isinstance(value, str):
                raise ValueError(f"{self.name}: label {name}={value!r} must be a str")
        return tuple(str.__str__(v) for v in key)  # type: ignore[arg-type]

    def _label_error(self, labels: Mapping[str, object]) -> ValueError:
        return ValueError(f"{self.name}: expected labels {sorted(self.labelnames)}, got {sorted(labels)}")

    def sample_names(self) -> tuple[str, ...]:
        """The sample names this metric writes (a histogram writes several)."""
        return (self.name,)

    def _same_shape(self, other: _Metric) -> bool:
        return type(self) is type(other) and self.labelnames == other.labelnames

    def _render(self, out: list[str]) -> None:
        out.append(f"# HELP {self.name} {_escape_help(self.help)}\n")
        out.append(f"# TYPE {self.name} {self.type_name}\n")
        self._render_samples(out)

    @abstractmethod
    def _render_samples(self, out: list[str]) -> None:
        """Append this metric's sample lines."""

    def _snapshot(self) -> list[tuple[LabelKey, Any]]:
        with self._lock:
            return sorted(self._series.items())


class Counter(_Metric):
    """A monotonically increasing total (``*_total``); one value per label set."""

    type_name = "counter"

    def __init__(self, name: str, help: str, labels: Iterable[str] = ()) -> None:
        super().__init__(name, help, labels)
        if not self.labelnames:
            self._series[()] = 0

    def inc(self, amount: float = 1, **labels: str) -> None:
        """Add ``amount`` (>= 0; ``0`` just creates the series) to the series for ``labels``.

        Raises ValueError for a negative or NaN amount, or labels that are not exactly the metric's label
        names with ``str`` values.
        """
        if not amount >= 0:
            raise ValueError(f"{self.name}: counter increment must be >= 0, got {amount!r}")
        key = self._key(labels)
        with self._lock:
            current = self._series.get(key)
            if current is None:
                key = self._new_key(key)
                current = 0
            self._series[key] = current + amount

    def value(self, **labels: str) -> float:
        """The current total for ``labels`` (0 for a series never updated). For tests and diagnostics."""
        key = self._key(labels)
        with self._lock:
            return self._series.get(key, 0)

    def _render_samples(self, out: list[str]) -> None:
        for key, value in self._snapshot():
            out.append(f"{self.name}{_label_text(self.labelnames, key)} {_format_value(value)}\n")


class Gauge(_Metric):
    """A value that goes up and down; either set by the program or computed by a function at scrape time."""

    type_name = "gauge"

    def __init__(self, name: str, help: str, labels: Iterable[str] = ()) -> None:
        super().__init__(name, help, labels)
        # Functions live beside the values; a series has one or the other, never both.
        self._functions: dict[LabelKey, Callable[[], float]] = {}
        if not self.labelnames:
            self._series[()] = 0

    def set(self, value: float, **labels: str) -> None:
        """Set the series for ``labels`` to ``value`` (a real number), replacing any function it had."""
        value = value if type(value) is int else float(value)
        key = self._key(labels)
        with self._lock:
            if key not in self._series:
                key = self._new_key(key)
            self._functions.pop(key, None)
            self._series[key] = value

    def inc(self, amount: float = 1, **labels: str) -> None:
        """Add ``amount`` (may be negative) to the series for ``labels``.

        Raises ValueError if the series is computed by a function (see :meth:`set_function`).
        """
        amount = amount if type(amount) is int else float(amount)
        key = self._key(labels)
        with self._lock:
            if self._functions and key in self._functions:
                raise ValueError(f"{self.name}: series {key!r} is computed by a function")
            current = self._series.get(key)
            if current is None:
                key = self._new_key(key)
                current = 0
            self._series[key] = current + amount

    def dec(self, amount: float = 1, **labels: str) -> None:
        """Subtract ``amount`` from the series for ``labels``; same contract as :meth:`inc`."""
        self.inc(-amount, **labels)

    def set_function(self, fn: Callable[[], float], **labels: str) -> None:
        """Compute the series for ``labels`` by calling ``fn()`` at every render, replacing any value.

        ``fn`` runs on the scraping thread, outside every metrics lock, so it may take the caller's own
        locks; it should be quick. If it raises or returns something that is not a real number, that one
        sample is left out of the rendering (and a warning logged); the rest of the scrape is unaffected.
        """
        if not callable(fn):
            raise ValueError(f"{self.name}: set_function needs a callable, got {fn!r}")
        key = self._key(labels)
        with self._lock:
            if key not in self._series:
                key = self._new_key(key)
            self._functions[key] = fn
            self._series[key] = 0  # placeholder: keeps the series known and in the sort order

    def value(self, **labels: str) -> float:
        """The current value for ``labels`` (calls the function for a computed series; 0 if never set)."""
        key = self._key(labels)
        with self._lock:
            fn = self._functions.get(key)
            value = self._series.get(key, 0)
        return fn() if fn is not None else value

    def _render_samples(self, out: list[str]) -> None:
        with self._lock:
            items = sorted(self._series.items())
            functions = dict(self._functions)
        for key, value in items:
            fn = functions.get(key)
            if fn is not None:
                try:
                    result = fn()
                    value = result if type(result) is int else float(result)
                except Exception:
                    log.warning(
                        "metric %s%s: gauge function failed; sample left out",
                        self.name,
                        _label_text(self.labelnames, key),
                        exc_info=True,
                    )
                    continue
            out.append(f"{self.name}{_label_text(self.labelnames, key)} {_format_value(value)}\n")


class Histogram(_Metric):
    """Observations counted into buckets by upper bound, plus their sum and count.

    Each series stores one non-cumulative count per bucket and the sum; rendering makes the counts
    cumulative (``le`` is "less than or equal"), always ending with ``le="+Inf"`` equal to ``_count``.
    """

    type_name = "histogram"
    reserved_labels = frozenset({"le"})

    def __init__(
        self, name: str, help: str, buckets: Sequence[float] = LATENCY_BUCKETS, labels: Iterable[str] = ()
    ) -> None:
        super().__init__(name, help, labels)
        bounds = [float(b) for b in buckets]
        if bounds and bounds[-1] == math.inf:
            bounds.pop()
        if any(math.isnan(b) or math.isinf(b) for b in bounds):
            raise ValueError(f"{name}: bucket bounds must be finite (+Inf is added), got {list(buckets)!r}")
        if any(a >= b for a, b in pairwise(bounds)):
            raise ValueError(f"{name}: bucket bounds must be strictly increasing, got {list(buckets)!r}")
        bounds.append(math.inf)
        self.buckets: tuple[float, ...] = tuple(bounds)
        if not self.labelnames:
            self._series[()] = self._empty()

    def _empty(self) -> list[float]:
        # [count in bucket 0, ..., count in the +Inf bucket, sum]
        return [0] * (len(self.buckets) + 1)

    def observe(self, value: float, **labels: str) -> None:
        """Count ``value`` into the first bucket whose bound is >= ``value`` and add it to the sum.

        Raises ValueError for NaN or wrong labels.
        """
        if value != value:
            raise ValueError(f"{self.name}: cannot observe NaN")
        index = bisect_left(self.buckets, value)
        key = self._key(labels)
        with self._lock:
            state = self._series.get(key)
            if state is None:
                key = self._new_key(key)
                state = self._series[key] = self._empty()
            state[index] += 1
            state[-1] += value

    def counts(self, **labels: str) -> tuple[list[int], float, int]:
        """(cumulative bucket counts, sum, count) for ``labels``. For tests and diagnostics."""
        key = self._key(labels)
        with self._lock:
            state = list(self._series.get(key) or self._empty())
        cumulative, running = [], 0
        for count in state[:-1]:
            running += count
            cumulative.append(running)
        return cumulative, state[-1], running

    def sample_names(self) -> tuple[str, ...]:
        return (self.name, f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")

    def _same_shape(self, other: _Metric) -> bool:
        return super()._same_shape(other) and isinstance(other, Histogram) and self.buckets == other.buckets

    def _snapshot(self) -> list[tuple[LabelKey, Any]]:
        with self._lock:
            return sorted((key, list(state)) for key, state in self._series.items())

    def _render_samples(self, out: list[str]) -> None:
        names = (*self.labelnames, "le")
        les = [_format_value(b) for b in self.buckets]
        for key, state in self._snapshot():
            running = 0
            for le, count in zip(les, state, strict=False):
                running += count
                out.append(f"{self.name}_bucket{_label_text(names, (*key, le))} {running}\n")
            plain = _label_text(self.labelnames, key)
            out.append(f"{self.name}_sum{plain} {_format_value(state[-1])}\n")
            out.append(f"{self.name}_count{plain} {running}\n")


class Metrics:
    """A registry of metrics, rendered together in the Prometheus text format.

    Registration is idempotent: asking again for a name returns the registered metric when the type, the
    label names and (for histograms) the bounds are the same; anything else raises ValueError, as does a
    name whose samples would collide with another metric's (``x_count`` against histogram ``x``). The help
    text of the first registration wins. All methods are thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[str, _Metric] = {}
        self._sample_owner: dict[str, str] = {}

    def counter(self, name: str, help: str, labels: Iterable[str] = ()) -> Counter:
        """Register (or get) a counter. Name it ``*_total``."""
        return self._register(Counter(name, help, labels))

    def gauge(self, name: str, help: str, labels: Iterable[str] = ()) -> Gauge:
        """Register (or get) a gauge."""
        return self._register(Gauge(name, help, labels))

    def histogram(
        self, name: str, help: str, buckets: Sequence[float] = LATENCY_BUCKETS, labels: Iterable[str] = ()
    ) -> Histogram:
        """Register (or get) a histogram; ``buckets`` are finite, strictly increasing upper bounds."""
        return self._register(Histogram(name, help, buckets, labels))

    def _register(self, metric: _M) -> _M:
        with self._lock:
            existing = self._metrics.get(metric.name)
            if existing is not None:
                if not existing._same_shape(metric):
                    raise ValueError(
                        f"metric {metric.name} is already registered as a {existing.type_name} "
                        f"with labels {existing.labelnames!r}"
                    )
                return existing  # type: ignore[return-value]
            for sample in metric.sample_names():
                owner = self._sample_owner.get(sample)
                if owner is not None:
                    raise ValueError(f"metric {metric.name}: sample name {sample} is already used by {owner}")
            self._metrics[metric.name] = metric
            for sample in metric.sample_names():
                self._sample_owner[sample] = metric.name
            return metric

    def render(self) -> str:
        """Every metric in registration order, as Prometheus text format 0.0.4 (``""`` when empty)."""
        with self._lock:
            metrics = list(self._metrics.values())
        out: list[str] = []
        for metric in metrics:
            metric._render(out)
        return "".join(out)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], metrics: Metrics, health: Callable[[], dict[str, Any]]) -> None:
        self.metrics = metrics
        self.health = health
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Default prints a traceback to stderr; a dropped scrape connection is not worth that.
        log.debug("metrics server: error handling a request from %s", client_address, exc_info=True)


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    server_version = "kvtier-metrics"
    timeout = 10.0  # a stalled client frees its thread after this long

    def do_GET(self) -> None:
        try:
            status, content_type, body = self._route(self.path.split("?", 1)[0])
        except Exception as exc:
            log.warning("metrics server: GET %s failed", self.path, exc_info=True)
            status, content_type = HTTPStatus.INTERNAL_SERVER_ERROR, "application/json"
            body = json.dumps({"status": "error", "error": f"{type(exc).__name__}: {exc}"}).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the client went away

    def _route(self, path: str) -> tuple[HTTPStatus, str, bytes]:
        if path == "/metrics":
            return HTTPStatus.OK, CONTENT_TYPE, self.server.metrics.render().encode()
        if path == "/health":
            result = self.server.health()
            if not isinstance(result, dict):
                raise TypeError(f"health() returned {type(result).__name__}, not dict")
            body = json.dumps(result, default=str).encode()
            ok = result.get("status") == "ok"
            return (HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE), "application/json", body
        return HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", b"not found\n"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics server: %s - " + format, self.address_string(), *args)


class MetricsServer:
    """``GET /metrics`` and ``GET /health`` over HTTP, served from a daemon thread.

    - ``/metrics``: ``metrics.render()`` as ``text/plain; version=0.0.4``, status 200.
    - ``/health``: ``health()`` as JSON; 200 if its ``"status"`` is ``"ok"``, else 503.
    - any other path: 404; other methods: 501.
    - an exception while answering (``health()`` raising, returning a non-dict, a failing render): 500 with
      a JSON error body; the server keeps serving. Requests are logged at DEBUG only, never to stderr.

    ``health`` defaults to ``lambda: {"status": "ok"}``. Each request gets its own thread, so a slow
    ``health()`` does not hold up scrapes. ``start()`` binds (``port=0`` picks a free port, read back from
    :attr:`port`); ``stop()`` closes the socket and joins the thread; both are idempotent and the server
    is also a context manager.
    """

    def __init__(
        self,
        metrics: Metrics,
        host: str = "127.0.0.1",
        port: int = 0,
        health: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.metrics = metrics
        self.host = host
        self._requested_port = port
        self.health: Callable[[], dict[str, Any]] = health or (lambda: {"status": "ok"})
        self._lock = threading.Lock()
        self._server: _HTTPServer | None = None
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

    def start(self) -> MetricsServer:
        """Bind and start serving; returns ``self``. Raises OSError if the port cannot be bound."""
        with self._lock:
            if self._server is not None:
                return self
            server_class = _HTTPServer6 if ":" in self.host else _HTTPServer
            server = server_class((self.host, self._requested_port), self.metrics, self.health)
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
