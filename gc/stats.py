"""The GC's counters, shared by the worker, its evictor's callers, the repairer and the scrubber of one node
(``node_info``'s ``gc`` and the ``kvtier_gc_*`` metrics)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class GCStats:
    cycles: int = 0
    evictions: int = 0
    expirations: int = 0
    evictions_on_demand: int = 0  # blocks evicted at once because a write needed room
    removals_pending: int = 0  # removed blocks whose DELETE has not reached every node yet (retried)
    zombies_promoted: int = 0
    zombies_dropped: int = 0
    shards_expired: int = 0
    shards_confirmed: int = 0  # shards other than shard 0s whose block its primary confirmed live (node.unconfirmed)
    orphans_reclaimed: int = 0  # shards whose block no primary knew write_timeout_s after their commit, removed
    shards_repaired: int = 0
    blocks_repaired: int = 0  # blocks brought back to 12 shards
    blocks_reclaimed: int = 0  # blocks that lost more than 2 shards, removed everywhere by repair
    repair_bytes: int = 0
    shards_scrubbed: int = 0  # shards whose bytes the scrubber checked against their crc32c
    scrub_bytes: int = 0
    scrub_corrupt: int = 0  # shards the scrubber found corrupt
    scrub_repaired: int = 0  # of those, rewritten
    scrub_passes: int = 0  # complete passes over every shard
    last_cycle_s: float = 0.0
    last_error: str = ""
    failing: bool = False  # the last cycle raised (``last_error`` says why)

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)
