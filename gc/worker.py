"""The per-node GC worker: TTL expiry, watermark LRU eviction, zombie-write cleanup; repair and scrub beside it.

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
   (``capacity / 12`` of every node): above ``high`` it removes blocks down to ``low``, from the tenants
   furthest over their shares first (:mod:`~kvtier.kvstore.node.quotas`; one tenant: plain LRU). Since every node
   holds one shard of each of the group's blocks, that keeps every node between the watermarks, without
   coordination.
4. **Zombies** (every ``pending_timeout_s / 4``, at least ``interval_s``): pending writes (staged batches, in
   memory) older than ``pending_timeout_s`` belong to a writer that died (or never meant to commit). Ask the
   blocks' primaries: a live record means the writer died mid-commit, so the shard is committed (promoted);
   otherwise it is dropped; a shard whose primary cannot be reached stays pending until the next scan. Committed
   shards past their TTL that no primary removed are dropped every ``write_timeout_s / 4`` (a pass over every
   shard record).
5. **Confirm** (every cycle, and whenever a write finds its tenant's unconfirmed shards at their cap): shards other
   than shard 0s committed here a moment ago are confirmed with their blocks' primaries (one ``MATCH`` per primary
   and tenant); those whose block is not live ``write_timeout_s`` after their commit are orphans, removed
   (:mod:`~kvtier.kvstore.node.unconfirmed`).
6. **Repair** (when asked, e.g. ``kvctl repair``): a full pass of the :class:`~kvtier.gc.repairer.Repairer`,
   outside the cycle's lock (eviction goes on meanwhile). The repairer also runs on its own thread, working
   off the repairs this node owes; the :class:`~kvtier.gc.scrubber.Scrubber` checks every shard's crc32c on
   a third.

Removing a block is the evictor's (record, own shard and intent in one transaction, then every other
node's shards); a removed slot is reused once no reply sending its bytes pins it, so a read that already
passed the primary finishes with the old bytes, or misses cleanly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from kvtier.gc.evictor import Evictor
from kvtier.gc.policy import expired
from kvtier.gc.repairer import Repairer
from kvtier.gc.scrubber import Scrubber
from kvtier.kvstore.client import Client
from kvtier.kvstore.cluster.config import ClusterConfig
from kvtier.kvstore.node.chunks import COMMIT, DROP, KEEP, ChunkEngine, tenant_prefix
from kvtier.kvstore.node.disk import NoSpace
from kvtier.kvstore.node.lru import BlockEntry
from kvtier.kvstore.node.shard_index import table_names
from kvtier.kvstore.wire.protocol import Status

log = logging.getLogger("kvtier.gc")
CONFIRM_AFTER_S = 0.5  # a shard committed this long ago has had its block's COMMIT reach the primary, too


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
        on_restored: Callable[[float], None] | None = None,
    ) -> None:
        """``on_restored``: told, per owed repair finished, how long the block waited for its 12th shard."""
        self.engine = engine
        self.node_id = node_id
        self.config = config
        self.ttl_classes = ttl_classes  # the node's current table: a TTL change applies at the next cycle
        self.clock = clock
        self._wake = threading.Event()
        self._lock = threading.Lock()  # one cycle at a time (timer, watermark wake-up, admin request)
        self.client = Client(config)  # the cluster token: admin, may act for any tenant
        self.evictor = evictor or Evictor(engine, config, node_id)
        self.stats = self.evictor.stats  # one set of counters: the evictor counts on-demand evictions in it
        self.repairer = Repairer(engine, node_id, config, self.evictor, self.stats, clock, on_restored)
        self.scrubber = Scrubber(engine, config, self.repairer, self.stats, lambda c: self.ttl_classes().get(c))
        self._next_zombie_scan = 0.0
        self._next_expiry_scan = 0.0

    def adopt(self, config: ClusterConfig) -> None:
        """A newer cluster map (etcd): its ``[gc]`` settings apply from the next cycle, repair step and scrub step
        (the rates, intervals and watermarks; the worker's clients follow the map themselves)."""
        self.config = self.repairer.config = self.scrubber.config = config
        self.evictor.low_watermark = config.gc.low_watermark

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
            except NoSpace as exc:  # (counted, and logged once, by the engine) retried next time
                self.stats.failing = True
                self.stats.last_error = f"NoSpace: {exc}"
            except Exception as exc:
                self.stats.failing = True
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("GC cycle failed")

    def cycle(self, repair: bool = False, rebuild: bool = False) -> dict[str, float | int | str]:
        """One GC pass (see the module docstring), then with ``repair`` a full repair pass (``rebuild``: and a
        rebuild from every peer's shards); returns the cumulative stats."""
        self._cycle()
        if repair:
            self.repairer.full_pass(rebuild)
        return self.stats.as_dict()

    def scrub(self) -> dict[str, int]:
        """``kvctl scrub``: check every shard's crc32c now and repair what fails (``Scrubber.scrub_now``)."""
        return self.scrubber.scrub_now()

    def _cycle(self) -> None:
        with self._lock:
            start = time.perf_counter()
            self.engine.reap()
            self.engine.flush_access()
            self.stats.removals_pending = self.evictor.replay()
            self._expire()
            self._evict_to_watermark()
            now, gc = self.clock(), self.config.gc
            if now >= self._next_zombie_scan:
                self._reclaim_zombies(now)
                self._next_zombie_scan = now + max(gc.interval_s, gc.pending_timeout_s / 4)
            if now >= self._next_expiry_scan:
                self._drop_expired_shards(now)
                self._next_expiry_scan = now + max(gc.interval_s, gc.write_timeout_s / 4)
            self.confirm_shards()
            self.stats.cycles += 1
            self.stats.last_cycle_s = time.perf_counter() - start

    def make_headroom(self) -> None:
        """Steps 3 and 5 of a cycle alone (after reaping): what a write past the high watermark, or at its tenant's
        cap of unconfirmed shards, wakes the worker for."""
        with self._lock:
            self.engine.reap()
            self._evict_to_watermark()
            self.confirm_shards()

    def confirm_shards(self) -> None:
        """Ask the primaries about the blocks of shards committed here at least ``CONFIRM_AFTER_S`` ago and not
        confirmed yet (their COMMIT has reached the primary by then), per tenant; settle them."""
        now = self.clock()
        for tenant, shards in self.engine.unconfirmed_due(now - CONFIRM_AFTER_S):
            cut = len(tenant_prefix(tenant))
            with self.client.acting_for(tenant):
                live = self.client.liveness(table_names(shards.names[:, cut:-1]))
            orphans = self.engine.settle_unconfirmed(tenant, shards, live, now - self.config.gc.write_timeout_s)
            self.stats.shards_confirmed += int((live == 1).sum())
            self.stats.orphans_reclaimed += orphans

    # -- removal --------------------------------------------------------------------------------------

    def _expire(self) -> None:
        ttl, now = self.ttl_classes(), self.clock()
        self.stats.expirations += self.evictor.remove(lambda: expired(self.engine.lru_entries(), ttl, now))  # type: ignore[arg-type]

    def _evict_to_watermark(self) -> None:
        """Keep this primary's blocks between the watermarks of its budget (its share of every node).

        Every block has one shard on each of the group's 12 nodes, so a node's usage is the sum, over the
        group's primaries, of their blocks' shard sizes. Keeping each primary's blocks (committed and
        pending) between ``low`` and ``high`` of its budget (``placement.primary_budget_bytes``) keeps every
        node between them, with no coordination: the total drops the moment a block is removed. The blocks
        come from the tenants furthest over their shares first, each tenant's least recently used first
        (``ChunkEngine.eviction_candidates``). Writes that come faster than this make room themselves
        (``Evictor.make_room``).
        """
        gc, budget = self.config.gc, self.engine.primary_budget_bytes
        if self.engine.primary_bytes <= gc.high_watermark * budget:
            return
        self.stats.evictions += self.evictor.remove(
            lambda: self.engine.eviction_candidates(needed=int(self.engine.primary_bytes - gc.low_watermark * budget))
        )

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
            evicted = self.evictor.remove(lambda: matching(self.engine.lru_entries()))
            self.stats.evictions += evicted
            return {"matched": evicted, "evicted": evicted}

    # -- zombies --------------------------------------------------------------------------------------

    def _drop_expired_shards(self, now: float) -> None:
        """Committed shards past their TTL that no primary removed (it could not reach this node when it evicted, or
        is itself gone)."""
        ttl = self.ttl_classes()
        for tenant, items in _by_tenant(self.engine.expired_shards(ttl.get)).items():
            self.stats.shards_expired += self.engine.drop_shards(
                tenant, items, still=lambda rec: now > rec.created + ttl.get(rec.ttl_class, 0.0)
            )

    def _reclaim_zombies(self, now: float) -> None:
        """Pending batches not committed ``pending_timeout_s`` after they were staged: committed if their block is
        live at its primary (the writer died mid-commit), else dropped."""
        for tenant, put_id, batch in self.engine.stale_puts(now - self.config.gc.pending_timeout_s):
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


def _by_tenant(items: list[tuple[str, bytes, int]]) -> dict[str, list[tuple[bytes, int]]]:
    out: dict[str, list[tuple[bytes, int]]] = {}
    for tenant, key, index in items:
        out.setdefault(tenant, []).append((key, index))
    return out
