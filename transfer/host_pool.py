"""The fetcher's host pool, split by tenant: each tenant's blocks in segments of its own, within its quota.

Why: every engine on a host runs as the fetcher's uid (the socket admits no other), so anything reachable by name
(a file in ``/dev/shm``) is reachable by every tenant. Here nothing has a name: a segment is an anonymous memory
file, and a tenant gets descriptors only of its own segments, over its authenticated connection (MAP). A tenant's
**cache** segments (one per size class) are sealed, so the descriptors it gets map read-only whatever it does; its
**outboxes** (one per size class, the slots ALLOC gives out) are writable by its engines and hold no table. The
fetcher's index, LRU order, pins and allocations are its own memory.

Budget: ``size_bytes`` shared equally by the tenants of the cluster file (``quota``), each a hard cap on the cache
memory that tenant's segments touch. Per-tenant quotas rather than one LRU over everyone: a tenant can neither evict
another's blocks nor learn of them by timing its own evictions, and one tenant's burst never empties another's
cache; the price is that a share an idle tenant does not use stays unused (untouched memory costs nothing, but no
other tenant may take it). Outboxes are outside the quota: ``window_bytes`` each (at least one slot).

Size classes: ``declared`` slot sizes (``--slot-size``); a block of ``length`` bytes lives in the tenant's smallest
class that holds it, and a larger block gets a class of its own size (rounded up to 4 KiB) on first use. A class's
segment is as large as the quota (virtual: pages are touched as slots are first used); the tenant's segments
together touch at most the quota. When a class needs memory and has nothing to evict, the tenant's other segments
that nobody pins or fills are dropped whole, least recently used first (their blocks are forgotten; their memory
goes once the engines that map them let go). A tenant has at most ``MAX_CLASSES``: one more size retires the least
recently used class made for a size whose segments nobody pins, fills or holds outbox slots of.

Segment ids are drawn at random (31 bits, never one issued before): a counter shared by every tenant told each of
them, by the gaps between its own ids, how many segments the others made.
"""

from __future__ import annotations

import collections
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import TypeVar

import numpy as np

from kvtier.transfer import fetch_protocol as fp
from kvtier.transfer.staging import Outbox, PoolError, PoolStats, StagingPool, stride_of, tenant_id

MAX_CLASSES = 16  # size classes per tenant (each a segment): a bound on what one tenant can make the fetcher hold
COUNTERS = (
    "requests", "blocks_hit", "blocks_fetched", "blocks_missed", "blocks_failed", "blocks_full", "blocks_put",
    "bytes_fetched",
)  # fmt: skip


@dataclass(eq=False)
class Cache:
    """A tenant's cache segment of one size class."""

    id: int
    tenant: Tenant
    pool: StagingPool
    used: int = 0  # when a request last used it (a clock): the least recently used idle segment is dropped first
    # whole-slot views, made the first time a slot is read into and kept (slicing 1,024 a request cost ~0.12 ms);
    # store calls in flight never share a slot, so they fill these without the lock
    views: list[memoryview | None] = field(default_factory=list)
    viewed: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    def __post_init__(self) -> None:
        self.views = [None] * self.pool.slots
        self.viewed = np.zeros(self.pool.slots, dtype=bool)

    def slot_views(self, slots: np.ndarray, length: int) -> list[memoryview]:
        """Views of the first ``length`` bytes of ``slots``."""
        pool = self.pool
        if length != pool.slot_bytes:
            return [pool.buffer[start : start + length] for start in (pool.data_offset + slots * pool.stride).tolist()]
        for slot in slots[~self.viewed[slots]].tolist():
            self.views[slot] = pool.view(slot)
        self.viewed[slots] = True
        return list(map(self.views.__getitem__, slots.tolist()))  # type: ignore[arg-type]

    def describe(self) -> fp.Segment:
        p = self.pool
        return fp.Segment(self.id, fp.CACHE, p.slot_bytes, p.stride, p.slots, p.data_offset, p.epoch, p.name)

    def close(self) -> None:
        self.views.clear()  # (the pool unmaps once no view is left)
        self.pool.close()


@dataclass(eq=False)
class Box:
    """A tenant's outbox of one size class."""

    id: int
    tenant: Tenant
    outbox: Outbox

    def describe(self) -> fp.Segment:
        o = self.outbox
        return fp.Segment(self.id, fp.OUTBOX, o.slot_bytes, o.stride, o.slots, o.data_offset, o.epoch, o.name)

    def close(self) -> None:
        self.outbox.close()


@dataclass(eq=False)
class Tenant:
    """One tenant's share of the pool: its size classes, segments, outboxes and counters."""

    name: str
    quota: int
    classes: list[int]  # slot sizes, ascending: the declared ones, then those made for larger blocks
    caches: dict[int, Cache] = field(default_factory=dict)  # by slot size
    boxes: dict[int, Box] = field(default_factory=dict)  # by slot size
    counters: collections.Counter[str] = field(default_factory=lambda: collections.Counter(dict.fromkeys(COUNTERS, 0)))
    tid: int = 0  # the id that scopes its blocks in a table
    lengths: dict[int, int] = field(default_factory=dict)  # block length -> slot size, as found before

    def __post_init__(self) -> None:
        self.tid = tenant_id(self.name)

    def touched(self) -> int:
        return sum(c.pool.touched_bytes for c in self.caches.values())

    def segments(self) -> list[Cache | Box]:
        return [*self.caches.values(), *self.boxes.values()]


S = TypeVar("S", Cache, Box)


class HostPool:
    """Segments by tenant and size class, made on first use. Not thread-safe: the fetcher calls it under its lock.

    ``cache(tenant, length)`` and ``outbox(tenant, length)`` answer the segment blocks of ``length`` bytes go to, or
    a one-line reason why there is none (the block can never fit this tenant's share: the fix is in the message)."""

    def __init__(
        self, label: str, size_bytes: int, tenants: Sequence[str], declared: Sequence[int], window_bytes: int
    ) -> None:
        if not tenants:
            raise ValueError("a host pool needs at least one tenant")
        self.label, self.size_bytes, self.window_bytes = label, size_bytes, window_bytes
        self.declared = sorted(set(declared))
        quota = size_bytes // len(tenants)
        self.tenants = {name: Tenant(name, quota, list(self.declared)) for name in tenants}
        self.segments: dict[int, Cache | Box] = {}  # by id (never reused: a stale id names nothing)
        self._issued: set[int] = set()  # every id given out
        self._clock = count(1)

    def _new_id(self) -> int:
        """A segment id never given out before, at random (it says nothing of other tenants' segments)."""
        while (new := secrets.randbits(31)) in self._issued or not new:
            pass
        self._issued.add(new)
        return new

    def _class(self, tenant: Tenant, length: int) -> int | str:
        """The slot size blocks of ``length`` live in for ``tenant`` (a class made for them if none holds them), or
        why they cannot be held."""
        known = tenant.lengths.get(length)
        if known is not None:  # (every request after the first of a length)
            return known
        at = fp.size_class(tenant.classes, length)
        slot_bytes = tenant.classes[at] if at is not None else stride_of(length)
        share = f"the share of tenant {tenant.name!r} in the host pool ({tenant.quota} B: --size {self.size_bytes} B "
        share += f"shared by {len(self.tenants)} tenants)"
        if stride_of(slot_bytes) > tenant.quota:
            return f"blocks of {length} B do not fit {share}; start kvtier-fetcher with a larger --size"
        if at is None:
            if len(tenant.classes) >= MAX_CLASSES and not self._retire(tenant):
                return (
                    f"blocks of {length} B would need a size class beyond the {MAX_CLASSES} of {share}, all of them "
                    "in use"
                )
            tenant.classes = sorted([*tenant.classes, slot_bytes])
            tenant.lengths.clear()  # (a new class may hold lengths an older, larger one held)
        if len(tenant.lengths) < 4096:
            tenant.lengths[length] = slot_bytes
        return slot_bytes

    def _retire(self, tenant: Tenant) -> bool:
        """Retire ``tenant``'s least recently used class made for a size (not declared) that nobody uses now: its
        segments dropped, its size no longer a class. Whether one could be."""
        idle = [
            size
            for size in tenant.classes
            if size not in self.declared
            and (size not in tenant.caches or tenant.caches[size].pool.idle())
            and (size not in tenant.boxes or not tenant.boxes[size].outbox.out.any())
        ]
        if not idle:
            return False
        size = min(idle, key=lambda s: tenant.caches[s].used if s in tenant.caches else 0)
        if size in tenant.caches:
            self._drop(tenant.caches[size])
        box = tenant.boxes.pop(size, None)
        if box is not None:
            del self.segments[box.id]
            box.close()
        tenant.classes.remove(size)
        return True

    def cache(self, tenant: Tenant, length: int) -> Cache | str:
        """``tenant``'s cache segment for blocks of ``length`` bytes (made now if it has none), or why there is none."""

        def make(name: str, slot_bytes: int) -> Cache:
            return Cache(self._new_id(), tenant, StagingPool.create(name, tenant.quota, slot_bytes))

        cache = self._segment(tenant, length, tenant.caches, make)
        if isinstance(cache, Cache):
            cache.used = next(self._clock)
        return cache

    def outbox(self, tenant: Tenant, length: int) -> Box | str:
        """``tenant``'s outbox for blocks of ``length`` bytes (made now if it has none), or why there is none."""

        def make(name: str, slot_bytes: int) -> Box:
            slots = max(1, min(self.window_bytes, tenant.quota) // stride_of(slot_bytes))
            return Box(self._new_id(), tenant, Outbox(f"{name}.out", slot_bytes, slots))

        return self._segment(tenant, length, tenant.boxes, make)

    def _segment(self, tenant: Tenant, length: int, held: dict[int, S], make: Callable[[str, int], S]) -> S | str:
        """The segment of ``held`` (``tenant``'s caches or outboxes, by slot size) for blocks of ``length`` bytes,
        made by ``make(name, slot_bytes)`` if there is none; or why there can be none."""
        slot_bytes = self._class(tenant, length)
        if isinstance(slot_bytes, str):
            return slot_bytes
        segment = held.get(slot_bytes)
        if segment is None:
            try:
                segment = held[slot_bytes] = make(f"{self.label}.{tenant.tid:016x}.{slot_bytes}", slot_bytes)
            except (PoolError, OSError) as exc:
                return f"no segment for blocks of {length} B: {exc}"
            self.segments[segment.id] = segment
        return segment

    def reserve(self, cache: Cache, n: int, owner_pid: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``n`` slots of ``cache`` to fill: free ones, never-used ones while the tenant's quota allows, then
        its least recently used blocks evicted; if that is not enough, the tenant's other idle segments are dropped
        for their memory. (slots, generations)."""
        slots, gens = cache.pool.reserve_many(n, owner_pid, self._fresh(cache))
        if len(slots) < n and self._drop_idle(cache, (n - len(slots)) * cache.pool.stride):
            more, more_gens = cache.pool.reserve_many(n - len(slots), owner_pid, self._fresh(cache))
            slots, gens = np.concatenate([slots, more]), np.concatenate([gens, more_gens])
        return slots, gens

    def _fresh(self, cache: Cache) -> int:
        """Never-used slots ``cache`` may take now: what its tenant's quota leaves."""
        return max(0, cache.tenant.quota - cache.tenant.touched()) // cache.pool.stride

    def _drop_idle(self, cache: Cache, wanted: int) -> bool:
        """Drop ``cache``'s tenant's other segments that nobody pins or fills, least recently used first, until the
        quota leaves ``wanted`` bytes; whether any was dropped."""
        tenant, dropped = cache.tenant, False
        for other in sorted(tenant.caches.values(), key=lambda c: c.used):
            if tenant.quota - tenant.touched() >= wanted:
                break
            if other is not cache and other.pool.idle():
                self._drop(other)
                dropped = True
        return dropped

    def _drop(self, cache: Cache) -> None:
        del cache.tenant.caches[cache.pool.slot_bytes]
        del self.segments[cache.id]
        cache.close()

    def owned(self, tenant: Tenant, ids: Sequence[int]) -> list[Cache | Box] | None:
        """The segments ``ids`` if every one is ``tenant``'s; None if any is not (another tenant's, or none)."""
        found = [self.segments.get(i) for i in ids]
        if any(s is None or s.tenant is not tenant for s in found):
            return None
        return found  # type: ignore[return-value]

    def stats(self, tenant: Tenant | None = None) -> dict[str, int | float]:
        """Pool counts and counters of ``tenant`` (None: of every tenant)."""
        tenants = list(self.tenants.values()) if tenant is None else [tenant]
        caches = [c for t in tenants for c in t.caches.values()]
        counters = collections.Counter(dict.fromkeys(COUNTERS, 0))
        for t in tenants:
            counters.update(t.counters)  # (``+`` would drop the zeros)
        return {
            **PoolStats.total([c.pool.stats() for c in caches]).as_dict(),
            "capacity_bytes": sum(t.quota for t in tenants),
            "touched_bytes": sum(t.touched() for t in tenants),
            "segments": len(caches),
            "allocated": sum(int(b.outbox.out.sum()) for t in tenants for b in t.boxes.values()),  # outbox slots out
            **counters,
        }

    def close(self) -> None:
        for segment in list(self.segments.values()):
            segment.close()
        self.segments.clear()
