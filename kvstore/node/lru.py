"""The chunk engine's index of block records: least-recently-used order and a running byte total, no I/O.

The chunk engine keeps one entry per block it is primary for (inserted at commit, removed with the record,
rebuilt from LMDB at open); GC policy (``kvtier.gc.policy``) and the trace-replay simulator read the same
structure, so what is evicted is decided over one index everywhere.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from kvtier.kvstore import _native

Key = bytes | int
"""A block key: the 16-byte chain hash in the store, an int hash id in traces."""


@dataclass(slots=True)
class BlockEntry:
    """One block's record as policy sees it. ``created`` is when it was (last) stored, ``last_access`` its last use."""

    key: Key
    size_bytes: int
    last_access: float
    ttl_class: str
    created: float


class LruIndex:
    """Blocks by key, kept in least-recently-used-first order, with a running byte total.

    ``insert``, ``touch``, ``remove``, ``get``, ``pop_lru`` and membership are O(1). Iteration yields entries least
    recently used first. The index never reads a clock: every call that changes recency takes ``now`` explicitly.
    Mutating the index while iterating it raises ``RuntimeError`` (as for any ``OrderedDict``); collect keys first,
    as :func:`plan_eviction` and :func:`expired` do.
    """

    __slots__ = ("_entries", "_total_bytes")

    def __init__(self) -> None:
        self._entries: OrderedDict[Key, BlockEntry] = OrderedDict()
        self._total_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[BlockEntry]:
        """Entries, least recently used first."""
        return iter(self._entries.values())

    @property
    def total_bytes(self) -> int:
        """Sum of ``size_bytes`` over the blocks held now."""
        return self._total_bytes

    def get(self, key: Key) -> BlockEntry | None:
        """The block's entry, or None if absent. Does not change recency."""
        return self._entries.get(key)

    def insert(self, key: Key, size_bytes: int, now: float, ttl_class: str, created: float | None = None) -> None:
        """Store ``key`` as the most recently used block, accessed at ``now``, created at ``created`` (default ``now``).

        Inserting a key that is already present replaces its record (size, class, created): that is a re-store,
        e.g. after expiry. Raises ValueError for a negative size.
        """
        if size_bytes < 0:
            raise ValueError(f"block size must not be negative, got {size_bytes}")
        old = self._entries.pop(key, None)
        if old is not None:
            self._total_bytes -= old.size_bytes
        self._entries[key] = BlockEntry(key, size_bytes, now, ttl_class, now if created is None else created)
        self._total_bytes += size_bytes

    def insert_entries(self, entries: list[BlockEntry]) -> None:
        """``insert`` of each entry in turn (the last becomes the most recently used), as one dict update when
        none of their keys is present yet (a put's new blocks). The entries are taken as they are, not copied."""
        keys = [entry.key for entry in entries]
        if not self._entries.keys().isdisjoint(keys) or len(set(keys)) < len(keys):
            for entry in entries:
                self.insert(entry.key, entry.size_bytes, entry.last_access, entry.ttl_class, entry.created)
            return
        if any(entry.size_bytes < 0 for entry in entries):
            raise ValueError("block size must not be negative")
        self._entries.update(zip(keys, entries, strict=True))
        self._total_bytes += sum(entry.size_bytes for entry in entries)

    def touch(self, key: Key, now: float) -> bool:
        """Mark ``key`` used at ``now`` (most recent). Returns False, changing nothing, if the key is absent."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        entry.last_access = now
        self._entries.move_to_end(key)
        return True

    def touch_entries(self, entries: list[BlockEntry], now: float) -> None:
        """``touch`` of blocks by their entries as ``get`` returned them (present: the caller holds whatever lock
        guards the index), in order: the last becomes the most recently used."""
        move = self._entries.move_to_end
        for entry in entries:
            entry.last_access = now
            move(entry.key)

    def remove(self, key: Key) -> BlockEntry | None:
        """Drop ``key``; returns its entry, or None if it was absent."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._total_bytes -= entry.size_bytes
        return entry

    def remove_many(self, keys: list[Key]) -> None:
        """``remove`` of each key (those absent are ignored)."""
        pop = self._entries.pop
        removed = [pop(key, None) for key in keys]
        self._total_bytes -= sum(entry.size_bytes for entry in removed if entry is not None)

    def pop_lru(self) -> BlockEntry | None:
        """Remove and return the least recently used block, or None if the index is empty."""
        if not self._entries:
            return None
        _, entry = self._entries.popitem(last=False)
        self._total_bytes -= entry.size_bytes
        return entry

    def lru_sizes(self) -> Iterator[tuple[Key, int]]:
        """``(key, size_bytes)`` pairs least recently used first: the ``lru_iter`` :func:`plan_eviction` takes."""
        return ((entry.key, entry.size_bytes) for entry in self._entries.values())


class TenantLru:
    """A primary's block records as one :class:`LruIndex` per tenant: each tenant's blocks in least-recently-used
    order and its byte total, so eviction can take from one tenant without walking the others' blocks (per-tenant
    quotas, docs/design.md §6). Lookups by block key (``tenant/`` + key) go to one dict over all of them.

    Calls that change an index name the tenant (a put, a read, a delete are each of one tenant), so no key is
    parsed on the data path; ``insert`` (at open) takes the tenant from the key. Iteration yields every entry,
    tenant after tenant, each least recently used first.
    """

    __slots__ = ("_entries", "_tenants")

    def __init__(self) -> None:
        self._entries: dict[Key, BlockEntry] = {}
        self._tenants: dict[str, LruIndex] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[BlockEntry]:
        for index in list(self._tenants.values()):
            yield from index

    @property
    def total_bytes(self) -> int:
        return sum(index.total_bytes for index in self._tenants.values())

    def get(self, key: Key) -> BlockEntry | None:
        return self._entries.get(key)

    def live_flags(self, prefix: bytes, blob: bytes, klen: int, oldest: Mapping[str, float]) -> bytes:
        """Per key of ``blob`` (keys of ``klen`` bytes, concatenated) 1 if ``prefix`` + key is here and was created at
        or after ``oldest[its ttl_class]``, else 0: one compiled loop (``_native.live_flags``), no Python per key.
        Raises ValueError when ``blob`` is not a whole number of keys."""
        return _native.live_flags(self._entries, prefix, blob, klen, oldest)

    def tenant(self, tenant: str) -> LruIndex:
        """The tenant's blocks (an empty index for a tenant with none); read it under the caller's lock."""
        return self._tenants.get(tenant) or LruIndex()

    def usage(self) -> dict[str, int]:
        """Bytes per tenant holding blocks here."""
        return {tenant: index.total_bytes for tenant, index in self._tenants.items() if len(index)}

    def insert(self, key: bytes, size_bytes: int, now: float, ttl_class: str, created: float | None = None) -> None:
        """``LruIndex.insert`` into the tenant the key names (``tenant/`` + key)."""
        tenant = key[: key.index(b"/")].decode()
        index = self._tenants.setdefault(tenant, LruIndex())
        index.insert(key, size_bytes, now, ttl_class, created)
        self._entries[key] = index.get(key)  # type: ignore[assignment]

    def insert_entries(self, tenant: str, entries: list[BlockEntry]) -> None:
        """``LruIndex.insert_entries`` of blocks of ``tenant``."""
        index = self._tenants.setdefault(tenant, LruIndex())
        index.insert_entries(entries)
        self._entries.update((entry.key, index.get(entry.key)) for entry in entries)  # type: ignore[misc]

    def touch_entries(self, tenant: str, entries: list[BlockEntry], now: float) -> None:
        """``LruIndex.touch_entries`` of blocks of ``tenant`` (entries as ``get`` returned them)."""
        self._tenants[tenant].touch_entries(entries, now)

    def remove_many(self, tenant: str, keys: list[Key]) -> None:
        """Drop blocks of ``tenant`` (those absent are ignored)."""
        index = self._tenants.get(tenant)
        if index is None:
            return
        index.remove_many(keys)
        pop = self._entries.pop
        for key in keys:
            pop(key, None)
        if not len(index):
            del self._tenants[tenant]
