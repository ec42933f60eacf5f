"""The per-node GC worker: TTL expiry, watermark LRU eviction, zombie-write cleanup and repair.

One worker runs in every node process (composed in :mod:`kvtier.gc.nodeproc`), over the blocks that node is
*primary* for (its LRU index), and talks to the other nodes of its group through an admin
:class:`~kvtier.kvstore.client.Client` that acts for each tenant in turn. It keeps headroom so that few
writes have to make room themselves (:class:`~kvtier.gc.evictor.Evictor`, the on-demand backstop). A cycle
runs every ``gc.interval_s``; a write that pushes usage past the high watermark wakes the worker at once for
step 3 alone (after reaping): at capacity that is every few puts, and steps 2 and 4 walk every block.

1. **Reap and flush**: slots whose grace time has passed become free; batched last-access times are
   written; removals whose DELETEs did not reach every node (a node was down, or this one crashed) are
   resent (the first cycle runs at start-up).
2. **Expire**: blocks past ``created + ttl[class]`` (the node's current TTL table, so a changed TTL
   applies to blocks already stored) are removed like evictions.
3. **Evict**: each primary keeps its own blocks' shards between the watermarks of its budget
   (``capacity / 12`` of every node; ``gc.policy.plan_eviction`` over its LRU index): above ``high`` it
   removes least-recently-used blocks down to ``low``. Since every node holds one shard of each of the
   group's blocks, that keeps every node between the watermarks, without coordination.
4. **Zombies** (every ``write_timeout_s / 4``): pending writes (staged batches, in memory) older than
   ``write_timeout_s`` belong to a writer that died. Ask the blocks' primaries: a live record means the
   writer died mid-commit, so the shard is committed (promoted); otherwise it is dropped; a shard whose
   primary cannot be reached stays pending until the next scan.
5. **Repair** (when asked, e.g. ``kvctl repair``): for every block record held here, probe the 12 holders;
   a block with missing shards but at least 10 present is read (decoded) and the missing shards rewritten,
   the primary's record included, at most ``repair_bytes_per_s``.

Removing a block is the evictor's (record, own shard and intent in one transaction, then every other
node's shards); a removed slot is reused once no reply sending its bytes pins it, so a read that already
passed the primary finishes with the old bytes, or misses cleanly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from kvtier.gc.evictor import Evictor
from kvtier.gc.policy import expired, plan_eviction
from kvtier.kvstore.chunks import COMMIT, DROP, KEEP, ChunkEngine
from kvtier.kvstore.client import Client
from kvtier.kvstore.cluster import ClusterConfig
from kvtier.kvstore.lru import BlockEntry
from kvtier.kvstore.protocol import Status

log = logging.getLogger("kvtier.gc")

REPAIR_BATCH = 64


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
    shards_repaired: int = 0
    repair_bytes: int = 0
    last_cycle_s: float = 0.0
    last_error: str = ""
    failing: bool = False  # the last cycle raised (``last_error`` says why)

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


class GCWorker:
    """See the module docstring. ``cycle()`` is also callable directly (admin ``gc`` action, tests)."""

    def __init__(
        self,
        engine: ChunkEngine,
        node_id: int,
        config: ClusterConfig,
        ttl_classes: Callable[[], dict[str, float]],
        clock: Callable[[], float] = time.time,
        evictor: Evictor | None = None,
    ) -> None:
        self.engine = engine
        self.node_id = node_id
        self.config = config
        self.ttl_classes = ttl_classes  # the node's current table: a TTL change applies at the next cycle
        self.clock = clock
        self.stats = GCStats()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # one cycle at a time (timer, watermark wake-up, admin request)
        self.client = Client(config)  # the cluster token: admin, may act for any tenant
        self.evictor = evictor or Evictor(engine, config, node_id)
        self._next_zombie_scan = 0.0

    def wake(self) -> None:
        """Evict down to the low watermark soon (a write took usage past the high one). Called on every such
        write: costs a flag test while the worker is awake already."""
        if not self._wake.is_set():
            self._wake.set()

    def run(self, stopping: threading.Event) -> None:
        """Finish removals a crash interrupted, then cycle every ``interval_s`` until ``stopping`` is set, and
        evict to the watermark whenever woken in between; a failing pass is logged and retried next time."""
        next_cycle = 0.0  # the first cycle runs at once
        while not stopping.is_set():
            self._wake.wait(max(0.0, next_cycle - time.monotonic()))
            self._wake.clear()
            if stopping.is_set():
                break
            try:
                if time.monotonic() >= next_cycle:
                    next_cycle = time.monotonic() + self.config.gc.interval_s
                    self.cycle()
                else:
                    self.make_headroom()
                self.stats.failing = False
            except Exception as exc:
                self.stats.failing = True
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("GC cycle failed")

    def cycle(self, repair: bool = False) -> dict[str, float | int | str]:
        """One GC pass (see the module docstring); returns the cumulative stats."""
        with self._lock:
            start = time.perf_counter()
            self.engine.reap()
            self.engine.flush_access()
            self.stats.removals_pending = self.evictor.replay()
            self._expire()
            self._evict_to_watermark()
            now = self.clock()
            if now >= self._next_zombie_scan:
                self._reclaim_zombies(now)
                self._next_zombie_scan = now + max(self.config.gc.interval_s, self.config.gc.write_timeout_s / 4)
            if repair:
                self._repair()
            self.stats.evictions_on_demand = self.evictor.evicted_on_demand
            self.stats.cycles += 1
            self.stats.last_cycle_s = time.perf_counter() - start
            return self.stats.as_dict()

    def make_headroom(self) -> None:
        """Step 3 of a cycle alone (after reaping): what a write past the high watermark wakes the worker for."""
        with self._lock:
            self.engine.reap()
            self._evict_to_watermark()

    # -- removal --------------------------------------------------------------------------------------

    def _expire(self) -> None:
        ttl, now = self.ttl_classes(), self.clock()
        self.stats.expirations += self.evictor.remove(lambda entries: expired(entries, ttl, now))  # type: ignore[arg-type]

    def _evict_to_watermark(self) -> None:
        """Keep this primary's blocks between the watermarks of its budget (its share of every node).

        Every block has one shard on each of the group's 12 nodes, so a node's usage is the sum, over the
        group's primaries, of their blocks' shard sizes. Keeping each primary's blocks (committed and
        pending) between ``low`` and ``high`` of its budget (``placement.primary_budget_bytes``) keeps every
        node between them, with no coordination: the total drops the moment a block is removed. Writes that
        come faster than this make room themselves (``Evictor.make_room``).
        """
        gc, budget = self.config.gc, self.engine.primary_budget_bytes
        if self.engine.primary_bytes <= gc.high_watermark * budget:
            return

        def over_high(entries: list[BlockEntry]) -> list[bytes]:
            return plan_eviction(  # type: ignore[return-value]
                self.engine.primary_bytes,
                budget,
                gc.high_watermark,
                gc.low_watermark,
                ((entry.key, entry.size_bytes) for entry in entries),
            )

        self.stats.evictions += self.evictor.remove(over_high)

    def evict_matching(self, ttl_class: str | None, older_than_s: float | None, dry_run: bool) -> dict[str, int]:
        """Operator eviction (``kvctl evict``) of this node's primary blocks by class and/or creation age."""
        now = self.clock()

        def matching(entries: list[BlockEntry]) -> list[bytes]:
            return [
                entry.key  # type: ignore[misc]
                for entry in entries
                if (ttl_class is None or entry.ttl_class == ttl_class)
                and (older_than_s is None or now - entry.created > older_than_s)
            ]

        with self._lock:
            if dry_run:
                return {"matched": len(matching(self.engine.lru_entries())), "evicted": 0}
            evicted = self.evictor.remove(matching)
            self.stats.evictions += evicted
            return {"matched": evicted, "evicted": evicted}

    # -- zombies --------------------------------------------------------------------------------------

    def _reclaim_zombies(self, now: float) -> None:
        """Dead writers' pending batches, and committed shards past their TTL that no primary removed
        (it could not reach this node when it evicted, or is itself gone)."""
        ttl = self.ttl_classes()
        for tenant, items in _by_tenant(self.engine.expired_shards(ttl.get)).items():
            self.stats.shards_expired += self.engine.drop_shards(
                tenant, items, still=lambda rec: now > rec.created + ttl.get(rec.ttl_class, 0.0)
            )
        for tenant, put_id, batch in self.engine.stale_puts(now - self.config.gc.write_timeout_s):
            rows = np.flatnonzero(batch.status == Status.OK)
            with self.client.acting_for(tenant):
                live = self.client.liveness([batch.key(i) for i in rows.tolist()])
            # 1: committed at the primary (the writer died mid-commit); 0: never committed; -1: the primary
            # is unreachable, so nobody can tell yet: keep the shard for the next scan
            action = np.full(batch.n, DROP, dtype=np.uint8)
            action[rows] = np.select([live == 1, live == 0], [COMMIT, DROP], KEEP)
            self.engine.commit(tenant, put_id, action)
            self.stats.zombies_promoted += int((live == 1).sum())
            self.stats.zombies_dropped += int((live == 0).sum())

    # -- repair ---------------------------------------------------------------------------------------

    def _repair(self) -> None:
        """Restore full redundancy of every block whose record is held here (primary or shard-1 copy)."""
        rate = self.config.gc.repair_bytes_per_s
        by_tenant: dict[str, list[tuple[bytes, float, str, bool]]] = {}
        for bkey, record in self.engine.records_held():
            ((tenant, key),) = self.engine.block_keys_to_pairs([bkey])
            primary = bkey in self.engine.lru
            by_tenant.setdefault(tenant, []).append((key, record.created, record.ttl_class, primary))
        for tenant, blocks in by_tenant.items():
            with self.client.acting_for(tenant):
                for start in range(0, len(blocks), REPAIR_BATCH):
                    began = time.perf_counter()
                    moved = self._repair_batch(blocks[start : start + REPAIR_BATCH])
                    budget = moved / rate if rate > 0 else 0.0
                    time.sleep(max(0.0, budget - (time.perf_counter() - began)))

    def _repair_batch(self, blocks: list[tuple[bytes, float, str, bool]]) -> int:
        """Repair one batch; a block's primary repairs it, and the holder of the record's copy (shard 1)
        only when the primary itself lost the block (so no shard is rewritten twice)."""
        keys = [key for key, _, _, _ in blocks]
        present = self.client.probe(keys)
        missing = ~present
        mine = np.asarray([primary for _, _, _, primary in blocks]) | missing[:, 0]
        damaged = np.flatnonzero(mine & missing.any(axis=1) & (present.sum(axis=1) >= 10))
        if not len(damaged):
            return 0
        keys = [keys[b] for b in damaged]
        decoded = self.client.read_for_repair(keys)
        moved = 0
        by_class: dict[str, list[int]] = {}
        for j, b in enumerate(damaged.tolist()):
            if decoded[j] is not None:
                by_class.setdefault(blocks[b][2], []).append(j)
        for ttl_class, rows in by_class.items():
            found = [decoded[j] for j in rows]
            written = self.client.write_shards(
                [keys[j] for j in rows],
                [data for data, _ in found],  # type: ignore[misc]
                ttl_class,
                missing[damaged[rows]],
                [header for _, header in found],  # type: ignore[misc]
                created=[blocks[damaged[j]][1] for j in rows],
            )
            self.stats.shards_repaired += written
            moved += sum(len(data) for data, _ in found)  # type: ignore[misc]
        self.stats.repair_bytes += moved
        return moved


def _by_tenant(items: list[tuple[str, bytes, int]]) -> dict[str, list[tuple[bytes, int]]]:
    out: dict[str, list[tuple[bytes, int]]] = {}
    for tenant, key, index in items:
        out.setdefault(tenant, []).append((key, index))
    return out
