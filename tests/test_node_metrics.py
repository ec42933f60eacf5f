"""Every node serves Prometheus /metrics and /health; scraped from real node processes."""

from __future__ import annotations

import json
import os
import re
import urllib.request

import pytest

from kvtier.kvstore import connect
from kvtier.kvstore.local import LocalCluster


@pytest.fixture(scope="module")
def local(make_cluster) -> LocalCluster:
    return make_cluster(capacity_bytes=64 << 20)


def scrape(local: LocalCluster, node_id: int, path: str) -> tuple[int, str]:
    node = local.config.nodes[node_id]
    try:
        with urllib.request.urlopen(f"http://{node.host}:{node.metrics_port}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def sample(text: str, name: str, **labels: str) -> float:
    label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(f"{name}{{{label_text}}}" if labels else name) + r" (\S+)"
    match = re.search(rf"^{pattern}$", text, re.MULTILINE)
    assert match, f"{name} {labels} not in /metrics"
    return float(match.group(1))


def test_metrics_count_requests_bytes_lookups_and_usage(local: LocalCluster) -> None:
    keys = [os.urandom(16) for _ in range(8)]
    with connect(local.config_path) as client:
        client.put(keys, [os.urandom(10_000) for _ in keys])
        client.get(keys)
        client.get([os.urandom(16)])
    for node_id in local.config.nodes:
        status, text = scrape(local, node_id, "/metrics")
        assert status == 200
        assert sample(text, "kvtier_node_requests_total", op="PUT_SHARDS") >= 1
        assert sample(text, "kvtier_node_bytes_total", direction="in") >= 8 * 1000
        assert sample(text, "kvtier_node_used_bytes") > 0
        assert sample(text, "kvtier_node_capacity_bytes") == 64 << 20
        assert sample(text, "kvtier_node_high_watermark_bytes") == pytest.approx(0.9 * (64 << 20))
        assert sample(text, "kvtier_gc_evictions") == 0
        assert "kvtier_node_request_seconds_bucket" in text
    hits = sum(
        sample(scrape(local, n, "/metrics")[1], "kvtier_node_shard_lookups_total", result="hit") for n in range(12)
    )
    misses = sum(
        sample(scrape(local, n, "/metrics")[1], "kvtier_node_shard_lookups_total", result="miss") for n in range(12)
    )
    assert hits >= 8 * 10 and misses >= 1


def test_health_reports_ok_with_usage(local: LocalCluster) -> None:
    status, body = scrape(local, 3, "/health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok" and health["node_id"] == 3
    assert health["capacity_bytes"] == 64 << 20


def test_unknown_paths_are_404(local: LocalCluster) -> None:
    assert scrape(local, 0, "/nope")[0] == 404
