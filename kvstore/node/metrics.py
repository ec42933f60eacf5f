"""What a storage node reports on ``/metrics``: requests, bytes, shard lookups, usage, GC and repair.

The metric names are an interface (dashboards use them): ``kvtier_node_requests_total{op}``,
``kvtier_node_request_seconds{op}`` (histogram), ``kvtier_node_bytes_total{direction}``,
``kvtier_node_shard_lookups_total{result}``, the gauges ``kvtier_node_used_bytes``, ``kvtier_node_freeing_bytes``,
``kvtier_node_capacity_bytes``, ``kvtier_node_high_watermark_bytes``, ``kvtier_node_low_watermark_bytes``,
``kvtier_node_primary_blocks``, ``kvtier_node_no_space_total`` (writes refused for lack of disk since start),
``kvtier_node_blocks_under_replicated`` (blocks short of their 12 shards whose repair this node owes),
``kvtier_node_oldest_owed_repair_seconds``, the histogram
``kvtier_node_redundancy_restored_seconds`` (from when a repair was owed to when the block had 12 shards again),
``kvtier_gc_<stat>`` for each GC counter (repair and scrub included), and the connections its server admits
(:mod:`kvtier.kvstore.wire.admission`): ``kvtier_node_connections``, ``kvtier_node_pre_auth_connections``,
``kvtier_node_connections_refused`` and ``kvtier_node_hello_timeouts`` (since start).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier.kvstore.wire.metrics import LATENCY_BUCKETS
from kvtier.kvstore.wire.protocol import Op, Status

if TYPE_CHECKING:
    from kvtier.kvstore.cluster.config import GCConfig
    from kvtier.kvstore.node.chunks import ChunkEngine

_LOOKUP_RESULTS = {
    Status.OK: "hit",
    Status.MISSING: "miss",
    Status.ABSENT: "miss",
    Status.CORRUPT: "corrupt",
    Status.MISMATCH: "mismatch",
}
_GC_STATS = (
    "evictions",
    "evictions_on_demand",
    "removals_pending",
    "expirations",
    "zombies_promoted",
    "zombies_dropped",
    "shards_repaired",
    "blocks_repaired",
    "blocks_reclaimed",
    "repair_bytes",
    "shards_scrubbed",
    "scrub_bytes",
    "scrub_corrupt",
    "scrub_repaired",
    "scrub_passes",
)
REDUNDANCY_BUCKETS = (1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600, float("inf"))


class NodeMetrics:
    """The node's metrics on a registry of its own (:attr:`registry`, served by ``MetricsServer``).

    ``request`` and ``lookups`` are the data path: they update children bound at start-up (a dict lookup and
    a few increments, no label handling). Every op, direction and lookup result is exposed at 0 from the start.
    """

    def __init__(self, engine: ChunkEngine, gc_config: GCConfig, gc_stats: Callable[[], Any]) -> None:
        """``gc_stats``: the node's GC worker's stats, or None while it has none."""
        self.registry = registry = CollectorRegistry()
        self._requests = Counter("kvtier_node_requests_total", "Requests served, by op.", ["op"], registry=registry)
        self._latency = Histogram(
            "kvtier_node_request_seconds",
            "Request service time, by op.",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._by_op: dict[int, tuple[Any, Any]] = {}
        for op in Op:
            if op not in (Op.ERROR, Op.REPLY):
                self._op_children(op)
        payload = Counter("kvtier_node_bytes_total", "Payload bytes, by direction.", ["direction"], registry=registry)
        self._bytes_in, self._bytes_out = payload.labels("in"), payload.labels("out")
        lookups = Counter(
            "kvtier_node_shard_lookups_total", "Shards asked for by readers, by result.", ["result"], registry=registry
        )
        self._lookups = [(int(status), lookups.labels(result)) for status, result in _LOOKUP_RESULTS.items()]

        def gauge(name: str, help_text: str) -> Gauge:
            return Gauge(name, help_text, registry=registry)

        gauge("kvtier_node_used_bytes", "Bytes of slots in use (grace time included).").set_function(
            lambda: engine.used_bytes
        )
        gauge("kvtier_node_freeing_bytes", "Bytes deleted and waiting out their grace time.").set_function(
            lambda: engine.freeing_bytes
        )
        gauge("kvtier_node_capacity_bytes", "Configured capacity.").set(engine.capacity_bytes)
        gauge("kvtier_node_high_watermark_bytes", "GC starts evicting above this.").set(
            gc_config.high_watermark * engine.capacity_bytes
        )
        gauge("kvtier_node_low_watermark_bytes", "GC evicts down to this.").set(
            gc_config.low_watermark * engine.capacity_bytes
        )
        gauge("kvtier_node_primary_blocks", "Blocks this node is primary for.").set_function(lambda: len(engine.lru))
        gauge(
            "kvtier_node_no_space_total", "Writes refused since start because the disk (or its budget) had no room."
        ).set_function(lambda: engine.refusals.count)
        gauge(
            "kvtier_node_blocks_under_replicated", "Blocks below 12 shards whose repair this node owes."
        ).set_function(lambda: engine.owed_summary()[0])

        def oldest_owed() -> float:
            since = engine.owed_summary()[1]
            return time.time() - since if since is not None else 0.0

        gauge(
            "kvtier_node_oldest_owed_repair_seconds", "How long the oldest repair this node owes has waited."
        ).set_function(oldest_owed)
        self._restored = Histogram(
            "kvtier_node_redundancy_restored_seconds",
            "Time from a block found (or written) short of shards to it having 12 again.",
            buckets=REDUNDANCY_BUCKETS,
            registry=registry,
        )

        def gc_stat(stat: str) -> float:
            stats = gc_stats()
            return getattr(stats, stat) if stats is not None else 0

        for stat in _GC_STATS:
            gauge(f"kvtier_gc_{stat}", f"GC worker: {stat.replace('_', ' ')} since start.").set_function(
                lambda stat=stat: gc_stat(stat)
            )

    def connections(self, stats: Callable[[], dict[str, int]]) -> None:
        """Expose the server's admission counts (``Admission.stats``), read at scrape time."""
        for name, help_text in (
            ("connections", "Connections open."),
            ("pre_auth_connections", "Connections open that have not completed HELLO."),
            ("connections_refused", "Connections turned away by a connection limit since start."),
            ("hello_timeouts", "Connections closed for not completing HELLO in time, since start."),
            ("pre_auth_evicted", "Connections closed before HELLO to make room for newer ones, since start."),
        ):
            Gauge(f"kvtier_node_{name}", help_text, registry=self.registry).set_function(lambda n=name: stats()[n])

    def _op_children(self, opcode: int) -> tuple[Any, Any]:
        """The (request counter, latency histogram) children of an opcode, bound on first use."""
        name = Op(opcode).name if opcode in Op._value2member_map_ else "UNKNOWN"
        children = self._by_op[opcode] = (self._requests.labels(name), self._latency.labels(name))
        return children

    def request(self, opcode: int, seconds: float, bytes_in: int, bytes_out: int) -> None:
        """Count one served request: its op, service time and payload bytes each way."""
        count, latency = self._by_op.get(opcode) or self._op_children(opcode)
        count.inc()
        latency.observe(seconds)
        if bytes_in:
            self._bytes_in.inc(bytes_in)
        if bytes_out:
            self._bytes_out.inc(bytes_out)

    def redundancy_restored(self, seconds: float) -> None:
        """An owed repair is done: the block waited ``seconds`` for its 12th shard."""
        self._restored.observe(seconds)

    def lookups(self, statuses: bytes) -> None:
        """Count a GET reply's per-shard statuses (one byte each) by result."""
        for status, child in self._lookups:
            count = statuses.count(status)
            if count:
                child.inc(count)
