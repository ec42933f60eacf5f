"""The metrics endpoint over real sockets: /metrics serves the process's own registry, /health its state."""

from __future__ import annotations

import contextlib
import json
import select
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from kvtier.kvstore.wire.metrics import MetricsServer
from kvtier.kvstore.wire.protocol import Limits

from .rawwire import connect_from


def get(url: str) -> tuple[int, str, bytes]:
    """(status, content type, body) of a GET; HTTP errors are returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.headers["Content-Type"], err.read()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture
def health_state() -> dict[str, Any]:
    return {"status": "ok", "raise": False}


@pytest.fixture
def server(health_state: dict[str, Any]) -> Iterator[MetricsServer]:
    registry = CollectorRegistry()
    Counter("kvtier_node_requests_total", "r", ["op"], registry=registry).labels("GET_SHARDS").inc(5)
    Histogram("kvtier_node_request_seconds", "l", buckets=(0.01,), registry=registry).observe(0.002)

    def health() -> dict[str, Any]:
        if health_state["raise"]:
            raise RuntimeError("lmdb env closed")
        return {"status": health_state["status"], "used_bytes": 123}

    with MetricsServer(registry, "127.0.0.1", 0, health) as srv:
        yield srv


def test_metrics_serves_the_registry_in_the_prometheus_text_format(server: MetricsServer) -> None:
    assert server.port > 0
    status, content_type, body = get(f"{server.url}/metrics")
    assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
    got = samples(body.decode())
    assert got[("kvtier_node_requests_total", frozenset({("op", "GET_SHARDS")}))] == 5
    assert got[("kvtier_node_request_seconds_bucket", frozenset({("le", "0.01")}))] == 1
    assert not any(name.endswith("_created") for name, _ in got)


def test_two_servers_in_one_process_serve_their_own_registries() -> None:
    registries = [CollectorRegistry(), CollectorRegistry()]
    for n, registry in enumerate(registries, 1):
        Counter("kvtier_node_requests_total", "r", registry=registry).inc(n)
    with MetricsServer(registries[0]) as first, MetricsServer(registries[1]) as second:
        for n, srv in enumerate((first, second), 1):
            assert samples(get(f"{srv.url}/metrics")[2].decode())[("kvtier_node_requests_total", frozenset())] == n


def test_health_ok_is_200_json(server: MetricsServer) -> None:
    status, content_type, body = get(f"{server.url}/health")
    assert (status, content_type) == (200, "application/json")
    assert json.loads(body) == {"status": "ok", "used_bytes": 123}


def test_health_not_ok_is_503_json(server: MetricsServer, health_state: dict[str, Any]) -> None:
    health_state["status"] = "degraded"
    status, _, body = get(f"{server.url}/health")
    assert status == 503
    assert json.loads(body)["status"] == "degraded"


def test_unknown_path_is_404(server: MetricsServer) -> None:
    assert get(f"{server.url}/nope")[0] == 404


def test_raising_health_gives_500_and_the_server_keeps_serving(
    server: MetricsServer, health_state: dict[str, Any]
) -> None:
    health_state["raise"] = True
    status, _, body = get(f"{server.url}/health")
    assert status == 500
    assert "lmdb env closed" in json.loads(body)["error"]
    assert get(f"{server.url}/metrics")[0] == 200
    health_state["raise"] = False
    assert get(f"{server.url}/health")[0] == 200


def test_requests_are_not_logged_to_stderr(server: MetricsServer, capfd: pytest.CaptureFixture[str]) -> None:
    for path in ("/metrics", "/health", "/nope"):
        get(f"{server.url}{path}")
    assert capfd.readouterr().err == ""


def test_stop_releases_the_port_and_is_idempotent() -> None:
    srv = MetricsServer(CollectorRegistry(), "127.0.0.1", 0).start()
    url = srv.url
    srv.stop()
    srv.stop()
    with pytest.raises(RuntimeError):
        _ = srv.port
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/metrics", timeout=2)


# -- abuse: the endpoint cannot be held or flooded (it authenticates nobody) --------------------------------


def test_a_request_trickled_byte_by_byte_is_cut_at_the_deadline() -> None:
    limits = Limits(metrics_request_timeout_s=1.0)
    with MetricsServer(CollectorRegistry(), limits=limits) as srv, connect_from(("127.0.0.1", srv.port)) as sock:
        request = b"GET /metrics HTTP/1.1\r\nHost: kvtier\r\nAccept: */*\r\n\r\n"
        opened = time.monotonic()
        for i in range(len(request) - 1):  # one byte every 0.2 s, never the whole request
            with contextlib.suppress(OSError):
                sock.send(request[i : i + 1])
            if select.select([sock], [], [], 0.2)[0]:
                break
        took_s = time.monotonic() - opened
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(4096) == b""
    assert took_s < 5.0, f"cut after {took_s:.1f} s"


def test_silent_connections_holding_every_slot_are_displaced_by_a_scrape() -> None:
    limits = Limits(metrics_max_connections=4, metrics_request_timeout_s=5.0)
    with MetricsServer(CollectorRegistry(), limits=limits) as srv, contextlib.ExitStack() as stack:
        addr = ("127.0.0.1", srv.port)
        silent = [stack.enter_context(connect_from(addr, f"127.9.0.{i // 2 + 1}")) for i in range(4)]
        time.sleep(0.2)
        assert get(f"{srv.url}/health")[0] == 200  # at once: the oldest silent one gave its slot up
        assert silent[0].recv(4096).startswith(b"HTTP/1.1 503 ")


def test_one_address_holds_at_most_half_the_connections() -> None:
    limits = Limits(metrics_max_connections=4, metrics_request_timeout_s=5.0)
    with MetricsServer(CollectorRegistry(), limits=limits) as srv, contextlib.ExitStack() as stack:
        addr = ("127.0.0.1", srv.port)
        first = [stack.enter_context(connect_from(addr, "127.9.1.1")) for _ in range(2)]
        time.sleep(0.2)
        stack.enter_context(connect_from(addr, "127.9.1.1"))  # a third: its address's oldest goes
        assert first[0].recv(4096).startswith(b"HTTP/1.1 503 ")
        assert get(f"{srv.url}/health")[0] == 200  # another address is served
