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
from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

from kvtier.kvstore.node.lru import BlockEntry, Key, LruIndex

__all__ = ["BlockEntry", "Clock", "Key", "LruIndex", "ManualClock", "SystemClock", "expired", "plan_eviction"]


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
