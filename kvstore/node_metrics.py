"""What a storage node reports on ``/metrics``: requests, bytes, shard lookups, usage, GC and repair."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.kvstore.metrics import Metrics
from kvtier.kvstore.protocol import Op, Status

if TYPE_CHECKING:
    from kvtier.kvstore.node import StorageNode

_LOOKUP_RESULTS = {
    Status.OK: "hit",
    Status.MISSING: "miss",
    Status.ABSENT: "miss",
    Status.CORRUPT: "corrupt",
    Status.MISMATCH: "mismatch",
}
_GC_STATS = ("evictions", "expirations", "zombies_promoted", "zombies_dropped", "shards_repaired", "repair_bytes")


class NodeMetrics:
    """The node's metric families, registered once; ``request``/``lookups`` are called on the data path."""

    def __init__(self, node: StorageNode) -> None:
        self.registry = m = Metrics()
        self._requests = m.counter("kvtier_node_requests_total", "Requests served, by op.", labels=("op",))
        self._latency = m.histogram("kvtier_node_request_seconds", "Request service time, by op.", labels=("op",))
        self._bytes = m.counter("kvtier_node_bytes_total", "Payload bytes, by direction.", labels=("direction",))
        self._lookups = m.counter(
            "kvtier_node_shard_lookups_total", "Shards asked for by readers, by result.", labels=("result",)
        )
        for op in Op:
            if op not in (Op.ERROR, Op.REPLY):
                self._requests.inc(0, op=op.name)
        for direction in ("in", "out"):
            self._bytes.inc(0, direction=direction)
        for result in set(_LOOKUP_RESULTS.values()):
            self._lookups.inc(0, result=result)
        engine, gc_config = node.engine, node.config.gc
        m.gauge("kvtier_node_used_bytes", "Bytes of slots in use (grace time included).").set_function(
            lambda: engine.used_bytes
        )
        m.gauge("kvtier_node_freeing_bytes", "Bytes deleted and waiting out their grace time.").set_function(
            lambda: engine.freeing_bytes
        )
        m.gauge("kvtier_node_capacity_bytes", "Configured capacity.").set(engine.capacity_bytes)
        m.gauge("kvtier_node_high_watermark_bytes", "GC starts evicting above this.").set(
            gc_config.high_watermark * engine.capacity_bytes
        )
        m.gauge("kvtier_node_low_watermark_bytes", "GC evicts down to this.").set(
            gc_config.low_watermark * engine.capacity_bytes
        )
        m.gauge("kvtier_node_primary_blocks", "Blocks this node is primary for.").set_function(lambda: len(engine.lru))
        for stat in _GC_STATS:
            m.gauge(f"kvtier_gc_{stat}", f"GC worker: {stat.replace('_', ' ')} since start.").set_function(
                lambda stat=stat: getattr(node.gc.stats, stat) if node.gc is not None else 0
            )

    def request(self, opcode: int, seconds: float, bytes_in: int, bytes_out: int) -> None:
        name = Op(opcode).name if opcode in Op._value2member_map_ else "UNKNOWN"
        self._requests.inc(op=name)
        self._latency.observe(seconds, op=name)
        if bytes_in:
            self._bytes.inc(bytes_in, direction="in")
        if bytes_out:
            self._bytes.inc(bytes_out, direction="out")

    def lookups(self, statuses: bytes) -> None:
        """Count a GET reply's per-shard statuses (one byte each) by result."""
        counts: dict[str, int] = {}
        for status, result in _LOOKUP_RESULTS.items():
            counts[result] = counts.get(result, 0) + statuses.count(status)
        for result, count in counts.items():
            if count:
                self._lookups.inc(count, result=result)
