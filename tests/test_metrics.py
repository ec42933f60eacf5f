"""Metrics: exposition-format rendering, label rules, thread safety, and the HTTP endpoint over real sockets."""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvtier.kvstore.metrics import LATENCY_BUCKETS, Metrics, MetricsServer

# One sample line: name, optional {labels}, value (label values may contain escaped quotes).
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Parse exposition text back into {(sample name, labels): value}; fails on any malformed line."""
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* ", line), line
            continue
        match = SAMPLE.match(line)
        assert match, line
        labels = frozenset(
            (k, re.sub(r"\\.", lambda m: UNESCAPE[m.group(0)], v)) for k, v in LABEL.findall(match.group(2) or "")
        )
        samples[match.group(1), labels] = float(match.group(3))
    return samples


def key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset(labels.items())


# --- rendering -------------------------------------------------------------------------------------------


def test_a_small_registry_renders_exactly_the_exposition_format() -> None:
    m = Metrics()
    requests = m.counter("kvtier_node_requests_total", "Requests served, by op.", labels=("op",))
    used = m.gauge("kvtier_node_used_bytes", "Bytes stored.")
    latency = m.histogram("kvtier_node_request_seconds", "Request latency.", buckets=(0.001, 0.1), labels=("op",))
    requests.inc(op="PUT")
    requests.inc(2, op="GET")
    used.set(4096)
    latency.observe(0.0005, op="GET")
    latency.observe(0.25, op="GET")

    assert m.render() == (
        "# HELP kvtier_node_requests_total Requests served, by op.\n"
        "# TYPE kvtier_node_requests_total counter\n"
        'kvtier_node_requests_total{op="GET"} 2\n'
        'kvtier_node_requests_total{op="PUT"} 1\n'
        "# HELP kvtier_node_used_bytes Bytes stored.\n"
        "# TYPE kvtier_node_used_bytes gauge\n"
        "kvtier_node_used_bytes 4096\n"
        "# HELP kvtier_node_request_seconds Request latency.\n"
        "# TYPE kvtier_node_request_seconds histogram\n"
        'kvtier_node_request_seconds_bucket{op="GET",le="0.001"} 1\n'
        'kvtier_node_request_seconds_bucket{op="GET",le="0.1"} 1\n'
        'kvtier_node_request_seconds_bucket{op="GET",le="+Inf"} 2\n'
        'kvtier_node_request_seconds_sum{op="GET"} 0.2505\n'
        'kvtier_node_request_seconds_count{op="GET"} 2\n'
    )


def test_unlabelled_metrics_render_zero_before_any_update() -> None:
    m = Metrics()
    m.counter("c_total", "c")
    m.histogram("h_seconds", "h", buckets=(1.0,))
    assert m.render() == (
        "# HELP c_total c\n# TYPE c_total counter\nc_total 0\n"
        "# HELP h_seconds h\n# TYPE h_seconds histogram\n"
        'h_seconds_bucket{le="1.0"} 0\nh_seconds_bucket{le="+Inf"} 0\nh_seconds_sum 0\nh_seconds_count 0\n'
    )


def test_a_labelled_series_appears_only_once_updated_and_inc_zero_creates_it() -> None:
    m = Metrics()
    errors = m.counter("errors_total", "e", labels=("code",))
    assert "errors_total{" not in m.render()
    errors.inc(0, code="TIMEOUT")
    assert 'errors_total{code="TIMEOUT"} 0\n' in m.render()


def test_special_float_values_render_as_the_spec_spells_them() -> None:
    m = Metrics()
    g = m.gauge("g", "g", labels=("k",))
    g.set(float("inf"), k="a")
    g.set(float("-inf"), k="b")
    g.set(float("nan"), k="c")
    g.set(0.5, k="d")
    text = m.render()
    assert 'g{k="a"} +Inf\n' in text and 'g{k="b"} -Inf\n' in text
    assert 'g{k="c"} NaN\n' in text and 'g{k="d"} 0.5\n' in text


def test_histogram_buckets_are_cumulative_and_end_with_the_count() -> None:
    m = Metrics()
    h = m.histogram("h_seconds", "h", buckets=(0.1, 0.2, 0.5))
    for value in (0.05, 0.1, 0.15, 0.3, 0.3, 9.0):  # 0.1 lands in le=0.1: "less than or equal"
        h.observe(value)
    samples = parse(m.render())
    buckets = [samples[key("h_seconds_bucket", le=le)] for le in ("0.1", "0.2", "0.5", "+Inf")]
    assert buckets == [2, 3, 5, 6]
    assert samples[key("h_seconds_count")] == 6
    assert samples[key("h_seconds_sum")] == pytest.approx(9.9)


def test_default_histogram_buckets_span_50us_to_10s() -> None:
    h = Metrics().histogram("lat_seconds", "l")
    assert h.buckets[0] == 50e-6 and h.buckets[-2] == 10.0 and h.buckets[-1] == float("inf")
    assert h.buckets[:-1] == LATENCY_BUCKETS


def test_label_values_and_help_are_escaped() -> None:
    m = Metrics()
    m.counter("c_total", 'help with \\ and\nnewline and "quotes"', labels=("path",)).inc(path='a\\b"c\nd')
    text = m.render()
    assert '# HELP c_total help with \\\\ and\\nnewline and "quotes"\n' in text
    assert 'c_total{path="a\\\\b\\"c\\nd"} 1\n' in text
    assert parse(text) == {key("c_total", path='a\\b"c\nd'): 1.0}


def test_gauge_function_is_evaluated_at_render_time() -> None:
    m = Metrics()
    state = {"used": 10}
    m.gauge("used_bytes", "u").set_function(lambda: state["used"])
    assert "used_bytes 10\n" in m.render()
    state["used"] = 42
    assert "used_bytes 42\n" in m.render()


def test_a_failing_gauge_function_drops_only_its_sample() -> None:
    m = Metrics()
    g = m.gauge("g", "g", labels=("tier",))
    g.set_function(lambda: 1 / 0, tier="bad")
    g.set(3, tier="good")
    assert parse(m.render()) == {key("g", tier="good"): 3.0}


# --- validation ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "labels",
    [{}, {"opp": "GET"}, {"op": "GET", "extra": "x"}],
    ids=["missing", "misspelled", "extra"],
)
def test_wrong_label_names_raise(labels: dict[str, str]) -> None:
    c = Metrics().counter("c_total", "c", labels=("op",))
    with pytest.raises(ValueError):
        c.inc(**labels)


def test_non_string_label_values_raise() -> None:
    h = Metrics().histogram("h", "h", labels=("op",))
    with pytest.raises(ValueError):
        h.observe(0.1, op=4)  # type: ignore[arg-type]


def test_labels_on_an_unlabelled_metric_raise() -> None:
    with pytest.raises(ValueError):
        Metrics().gauge("g", "g").set(1, op="GET")


@pytest.mark.parametrize("labels", [("le",), ("__x",), ("op", "op"), ("bad-name",), ("amount",)])
def test_invalid_label_names_at_registration_raise(labels: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        Metrics().histogram("h", "h", labels=labels)


def test_invalid_metric_name_raises() -> None:
    with pytest.raises(ValueError):
        Metrics().counter("kvtier-node", "c")


def test_negative_counter_increment_raises() -> None:
    with pytest.raises(ValueError):
        Metrics().counter("c_total", "c").inc(-1)


@pytest.mark.parametrize("buckets", [(1.0, 0.5), (0.5, 0.5), (float("nan"),)])
def test_unsorted_or_nan_buckets_raise(buckets: tuple[float, ...]) -> None:
    with pytest.raises(ValueError):
        Metrics().histogram("h", "h", buckets=buckets)


def test_registering_the_same_metric_twice_returns_it() -> None:
    m = Metrics()
    first = m.counter("c_total", "c", labels=("op",))
    assert m.counter("c_total", "c", labels=("op",)) is first


@pytest.mark.parametrize(
    "again",
    [
        lambda m: m.gauge("x", "x", labels=("op",)),
        lambda m: m.counter("x", "x", labels=("code",)),
        lambda m: m.histogram("x", "x", labels=("op",)),
    ],
    ids=["other-type", "other-labels", "histogram"],
)
def test_re_registering_with_another_shape_raises(again: Callable[[Metrics], Any]) -> None:
    m = Metrics()
    m.counter("x", "x", labels=("op",))
    with pytest.raises(ValueError):
        again(m)


def test_a_name_colliding_with_histogram_samples_raises() -> None:
    m = Metrics()
    m.histogram("lat_seconds", "l")
    with pytest.raises(ValueError):
        m.counter("lat_seconds_count", "c")


# --- concurrency -----------------------------------------------------------------------------------------


def test_concurrent_increments_sum_exactly() -> None:
    m = Metrics()
    c = m.counter("c_total", "c", labels=("op",))
    h = m.histogram("h_seconds", "h")
    threads_n, per_thread = 8, 20_000
    barrier = threading.Barrier(threads_n)

    def work(i: int) -> None:
        barrier.wait()
        op = "GET" if i % 2 else "PUT"
        for _ in range(per_thread):
            c.inc(op=op)
            h.observe(0.001)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    samples = parse(m.render())
    assert samples[key("c_total", op="GET")] == samples[key("c_total", op="PUT")] == threads_n // 2 * per_thread
    assert samples[key("h_seconds_count")] == threads_n * per_thread


# --- HTTP server -----------------------------------------------------------------------------------------


def get(url: str) -> tuple[int, str, bytes]:
    """(status, content type, body) of a GET; HTTP errors are returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.headers["Content-Type"], err.read()


@pytest.fixture
def health_state() -> dict[str, Any]:
    return {"status": "ok", "raise": False}


@pytest.fixture
def server(health_state: dict[str, Any]) -> Iterator[MetricsServer]:
    m = Metrics()
    m.counter("kvtier_node_requests_total", "r", labels=("op",)).inc(5, op="GET")
    m.histogram("kvtier_node_request_seconds", "l", buckets=(0.01,)).observe(0.002)

    def health() -> dict[str, Any]:
        if health_state["raise"]:
            raise RuntimeError("lmdb env closed")
        return {"status": health_state["status"], "used_bytes": 123}

    with MetricsServer(m, "127.0.0.1", 0, health) as srv:
        yield srv


def test_server_on_port_zero_serves_metrics(server: MetricsServer) -> None:
    assert server.port > 0
    status, content_type, body = get(f"{server.url}/metrics")
    assert status == 200
    assert content_type.startswith("text/plain; version=0.0.4")
    samples = parse(body.decode())
    assert samples[key("kvtier_node_requests_total", op="GET")] == 5
    assert samples[key("kvtier_node_request_seconds_bucket", le="0.01")] == 1


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
    srv = MetricsServer(Metrics(), "127.0.0.1", 0).start()
    url = srv.url
    srv.stop()
    srv.stop()
    with pytest.raises(RuntimeError):
        _ = srv.port
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/metrics", timeout=2)
