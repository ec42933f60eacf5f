"""Removing whole blocks this node is primary for: on demand when a write needs room, and for the GC worker.

A removal (docs/design.md §6) is two steps with an intent in between, so a crash anywhere leaves either a
live block or an invisible one whose shards are still being deleted, never a visible block with shards
missing, and never orphan shards once the node is back:

1. ``ChunkEngine.remove_blocks``: one LMDB transaction deletes the block records and this node's shards and
   writes the removal's intent (one record for all its blocks). From here readers get ``ABSENT`` from the
   primary.
2. ``DELETE(before = removal time)`` to the other 11 nodes of each block's group (this node's part was step
   1); when every node answered, the intent is cleared. Otherwise it stays and ``replay`` resends it (at
   start-up, then every GC cycle).

One removal runs at a time (the on-demand path runs in connection threads, the GC in its own), each with a
fresh look at the budget, so two writers needing room never evict twice for the same bytes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from kvtier.gc.stats import GCStats
from kvtier.kvstore.client import Client
from kvtier.kvstore.cluster.config import ClusterConfig
from kvtier.kvstore.node.chunks import ChunkEngine
from kvtier.kvstore.node.removals import Removal

log = logging.getLogger("kvtier.gc")


class Evictor:
    """Removes whole blocks of one primary (see the module docstring). Thread-safe."""

    def __init__(self, engine: ChunkEngine, config: ClusterConfig, node_id: int) -> None:
        self.engine = engine
        self.node_id = node_id
        self.client = Client(config)  # the cluster token: may act for any tenant; used under the lock only
        self.low_watermark = config.gc.low_watermark
        self._lock = threading.Lock()
        self.stats = GCStats()  # the node's GC counters (its worker's too): on-demand evictions counted as they happen
        self.deletes_replayed = 0

    def make_room(self, writer: str, committed: bool) -> None:
        """Evict this primary's unpinned blocks until it is within its budget (or nothing evictable is left; the
        caller refuses what still does not fit), and down to the low watermark, as the GC would: one removal
        (and its DELETE to the 12 nodes) then makes room for many writes, not one. Which blocks, by the
        tenants' shares (``ChunkEngine.eviction_candidates``): before the write is ``committed``, only the
        ``writer``'s own, as far as it holds more than its share; after, others' beyond their shares too.
        Called by the chunk engine, without its lock, when a write's shard 0s take the primary over budget."""
        with self._lock:
            budget = self.engine.primary_budget_bytes
            headroom = int(budget * (1 - self.low_watermark))
            victims = self.engine.eviction_candidates(writer, committed, headroom)
            if victims:
                self._remove(victims)
                self.stats.evictions_on_demand += len(victims)

    def remove(self, choose: Callable[[], Sequence[bytes]]) -> int:
        """Remove, whole (see the module docstring), the blocks ``choose`` picks (keys as in the LRU index). It
        runs under the removal lock, so a removal on demand cannot take the same blocks meanwhile; returns how
        many were removed."""
        with self._lock:
            victims = choose()
            if victims:
                self._remove(victims)
            return len(victims)

    def _remove(self, bkeys: Sequence[bytes]) -> None:
        by_tenant: dict[str, list[bytes]] = {}
        for tenant, key in self.engine.block_keys_to_pairs(bkeys):
            by_tenant.setdefault(tenant, []).append(key)
        for tenant, keys in by_tenant.items():
            removal = self.engine.remove_blocks(tenant, keys)
            log.info("removed %d blocks here; deleting their shards on the group", len(keys))
            self._delete_everywhere(removal)

    def _delete_everywhere(self, removal: Removal) -> bool:
        with self.client.acting_for(removal.tenant):
            done = self.client.delete(removal.keys, before=removal.when, primary_done=self.node_id)
        if done:
            self.engine.clear_removal(removal)
        return done

    def replay(self) -> int:
        """Resend the DELETEs of removals that did not reach every node (a node was down, or this one was
        killed mid-removal); returns how many blocks are still waiting for a node to answer."""
        waiting = 0
        with self._lock:
            for removal in self.engine.removals():
                if self._delete_everywhere(removal):
                    self.deletes_replayed += len(removal.keys)
                else:
                    waiting += len(removal.keys)
        return waiting

    def close(self) -> None:
        self.client.close()
