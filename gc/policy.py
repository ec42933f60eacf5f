"""Eviction and expiry policy: pure logic over an in-memory LRU index, no I/O.

Shared by the per-node GC worker (which feeds it the block records it is primary for) and by the trace-replay
simulator (``kvtier.tools.replay``), so the two cannot disagree on what gets evicted or expired.

Rules (DESIGN.md, "GC and TTL"):

1. **Expiry.** A block expires once ``now > created + ttl[ttl_class]``; touching a block does not extend its life.
   A block whose class has no configured TTL is expired (an unknown class is a misconfiguration, and keeping the
   block forever would leak space).
2. **Eviction.** Nothing is evicted while ``used <= high_watermark × capacity``. Above it, the least recently used
   blocks go, oldest access first, and eviction stops at the first block whose removal brings usage to
   ``<= low_watermark × capacity`` (hysteresis, so the worker does not wake for every put).

Times are plain floats in whatever unit the caller uses consistently (the GC worker: seconds since the epoch; the
replay: trace milliseconds). Injectable clocks (:class:`SystemClock`, :class:`ManualClock`) keep tests deterministic.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

Key = bytes | int
"""A block key: the 16-byte chain hash in the store, an int hash id in traces."""


@runtime_checkable
class Clock(Protocol):
    """A source of the current time, injected wherever policy needs ``now``."""

    def now(self) -> float:
        """The current time in seconds; never decreases between calls on one clock."""
        ...


class SystemClock:
    """Wall-clock time (``time.time()``), because block ``created`` times are persisted and outlive the process."""

    def now(self) -> float:
        return time.time()


class ManualClock:
    """A clock that moves only when told to: ``ManualClock(100.0).advance(5)`` → ``now() == 105.0``."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move time forward by ``seconds`` (>= 0) and return the new time. Raises ValueError for a negative step."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go backwards (advance by {seconds})")
        self._now += seconds
        return self._now


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

    def touch(self, key: Key, now: float) -> bool:
        """Mark ``key`` used at ``now`` (most recent). Returns False, changing nothing, if the key is absent."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        entry.last_access = now
        self._entries.move_to_end(key)
        return True

    def remove(self, key: Key) -> BlockEntry | None:
        """Drop ``key``; returns its entry, or None if it was absent."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._total_bytes -= entry.size_bytes
        return entry

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


def plan_eviction(
    used_bytes: int,
    capacity_bytes: int,
    high_watermark: float,
    low_watermark: float,
    lru_iter: Iterable[tuple[Key, int]],
) -> list[Key]:
    """Keys to evict, least recently used first, to bring usage from above the high watermark to the low one.

    Contract:
    - ``used_bytes <= high_watermark × capacity_bytes`` → ``[]`` (``lru_iter`` is not consumed).
    - Otherwise the shortest LRU-first prefix of ``lru_iter`` whose sizes, subtracted from ``used_bytes``, leave
      ``<= low_watermark × capacity_bytes``; no block beyond the first one that gets there is taken.
    - If ``lru_iter`` runs out first (``used_bytes`` counts space the index does not hold, e.g. pending shards),
      every key it yielded is returned: the best policy can do.
    - ``lru_iter`` yields ``(key, size)`` pairs (:meth:`LruIndex.lru_sizes`); only the prefix needed is read, so
      the caller may pass a lazy iterator but must not mutate the index until it has the returned list.
    - Sizes may be any unit consistent with ``used_bytes`` and ``capacity_bytes`` (the replay uses block counts).

    Raises ValueError unless ``0 <= low_watermark <= high_watermark`` and ``capacity_bytes >= 0``.
    """
    if not 0 <= low_watermark <= high_watermark:
        raise ValueError(f"watermarks must satisfy 0 <= low <= high, got high={high_watermark} low={low_watermark}")
    if capacity_bytes < 0:
        raise ValueError(f"capacity must not be negative, got {capacity_bytes}")
    if used_bytes <= high_watermark * capacity_bytes:
        return []
    target = low_watermark * capacity_bytes
    remaining = used_bytes
    victims: list[Key] = []
    for key, size in lru_iter:
        victims.append(key)
        remaining -= size
        if remaining <= target:
            break
    return victims


def expired(index: LruIndex, ttl_by_class: Mapping[str, float], now: float) -> list[Key]:
    """Keys of blocks past their TTL at ``now``, least recently used first; the index is not changed.

    A block is expired when ``now > created + ttl_by_class[ttl_class]`` (strictly past: at exactly
    ``created + ttl`` it still lives). A block whose class is missing from ``ttl_by_class`` is expired.
    ``ttl_by_class`` holds durations in the same unit as ``now`` and ``created``. O(number of blocks).
    """
    out: list[Key] = []
    for entry in index:
        ttl = ttl_by_class.get(entry.ttl_class)
        if ttl is None or now > entry.created + ttl:
            out.append(entry.key)
    return out
