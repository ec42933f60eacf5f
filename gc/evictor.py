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

from kvtier.kvstore.chunks import ChunkEngine
from kvtier.kvstore.client import Client
from kvtier.kvstore.cluster import ClusterConfig
from kvtier.kvstore.lru import BlockEntry
from kvtier.kvstore.removals import Removal

log = logging.getLogger("kvtier.gc")


class Evictor:
    """Removes whole blocks of one primary (see the module docstring). Thread-safe."""

    def __init__(self, engine: ChunkEngine, config: ClusterConfig, node_id: int) -> None:
        self.engine = engine
        self.node_id = node_id
        self.client = Client(config)  # the cluster token: may act for any tenant; used under the lock only
        self.low_watermark = config.gc.low_watermark
        self._lock = threading.Lock()
        self.evicted_on_demand = 0
        self.deletes_replayed = 0

    def make_room(self) -> None:
        """Evict this primary's least recently used unpinned blocks until it is within its budget (or nothing
        evictable is left; the caller refuses what still does not fit), and down to the low watermark, as the
        GC would: one removal (and its DELETE to the 12 nodes) then makes room for many writes, not one.
        Called by the chunk engine, without its lock, when a write's shard 0s take the primary over budget."""
        with self._lock:
            budget = self.engine.primary_budget_bytes
            victims = self.engine.eviction_candidates(headroom=int(budget * (1 - self.low_watermark)))
            if victims:
                self._remove(victims)
                self.evicted_on_demand += len(victims)

    def remove(self, choose: Callable[[list[BlockEntry]], Sequence[bytes]]) -> int:
        """Remove, whole (see the module docstring), the blocks ``choose`` picks from this primary's blocks
        (least recently used first; it returns their keys). It looks at them under the removal lock, so a
        removal on demand cannot take the same blocks meanwhile; returns how many were removed."""
        with self._lock:
            victims = choose(self.engine.lru_entries())
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
