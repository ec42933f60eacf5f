"""Every node serves Prometheus /metrics and /health; scraped from real node processes."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.kvstore import connect
from kvtier.kvstore.cluster.local import LocalCluster

# The names dashboards use: a rename is a breaking change.
EXPOSED = {
    "kvtier_node_requests_total",
    "kvtier_node_request_seconds_bucket",
    "kvtier_node_request_seconds_sum",
    "kvtier_node_request_seconds_count",
    "kvtier_node_bytes_total",
    "kvtier_node_shard_lookups_total",
    "kvtier_node_used_bytes",
    "kvtier_node_freeing_bytes",
    "kvtier_node_capacity_bytes",
    "kvtier_node_high_watermark_bytes",
    "kvtier_node_low_watermark_bytes",
    "kvtier_node_primary_blocks",
    "kvtier_node_no_space_total",
    "kvtier_gc_evictions",
    "kvtier_gc_evictions_on_demand",
    "kvtier_gc_removals_pending",
    "kvtier_gc_expirations",
    "kvtier_gc_zombies_promoted",
    "kvtier_gc_zombies_dropped",
    "kvtier_gc_shards_repaired",
    "kvtier_gc_repair_bytes",
    "kvtier_node_connections",
    "kvtier_node_pre_auth_connections",
    "kvtier_node_connections_refused",
    "kvtier_node_hello_timeouts",
    "kvtier_node_pre_auth_evicted",
    "kvtier_node_blocks_under_replicated",
    "kvtier_node_oldest_owed_repair_seconds",
    "kvtier_node_redundancy_restored_seconds_bucket",
    "kvtier_node_redundancy_restored_seconds_sum",
    "kvtier_node_redundancy_restored_seconds_count",
    "kvtier_gc_blocks_repaired",
    "kvtier_gc_blocks_reclaimed",
    "kvtier_gc_shards_scrubbed",
    "kvtier_gc_scrub_bytes",
    "kvtier_gc_scrub_corrupt",
    "kvtier_gc_scrub_repaired",
    "kvtier_gc_scrub_passes",
}


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


def metrics(local: LocalCluster, node_id: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    status, text = scrape(local, node_id, "/metrics")
    assert status == 200
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[name, frozenset(labels.items())]


def test_every_node_exposes_the_dashboard_metric_names(local: LocalCluster) -> None:
    for node_id in local.config.nodes:
        assert {name for name, _ in metrics(local, node_id)} == EXPOSED


def test_metrics_count_requests_bytes_lookups_and_usage(local: LocalCluster) -> None:
    keys = [os.urandom(16) for _ in range(8)]
    with connect(local.config_path) as client:
        client.put(keys, [os.urandom(10_000) for _ in keys])
        client.get(keys)
        client.get([os.urandom(16)])
    scraped = [metrics(local, node_id) for node_id in local.config.nodes]
    for samples in scraped:
        assert value(samples, "kvtier_node_requests_total", op="PUT_SHARDS") >= 1
        assert value(samples, "kvtier_node_request_seconds_count", op="PUT_SHARDS") >= 1
        assert value(samples, "kvtier_node_bytes_total", direction="in") >= 8 * 1000
        assert value(samples, "kvtier_node_used_bytes") > 0
        assert value(samples, "kvtier_node_capacity_bytes") == 64 << 20
        assert value(samples, "kvtier_node_high_watermark_bytes") == pytest.approx(0.9 * (64 << 20))
        assert value(samples, "kvtier_gc_evictions") == 0
    assert sum(value(s, "kvtier_node_shard_lookups_total", result="hit") for s in scraped) >= 8 * 10
    assert sum(value(s, "kvtier_node_shard_lookups_total", result="miss") for s in scraped) >= 1


def test_health_reports_ok_with_usage(local: LocalCluster) -> None:
    status, body = scrape(local, 3, "/health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok" and health["node_id"] == 3
    assert health["capacity_bytes"] == 64 << 20


def test_unknown_paths_are_404(local: LocalCluster) -> None:
    assert scrape(local, 0, "/nope")[0] == 404
