"""Trace replay in simulation mode: what hit ratio a store of a given capacity, GC watermarks and TTLs would reach.

Semantics (one pass over the requests, in trace order; ``block_tokens`` tokens per block):

1. **Expiry.** With ``ttl`` set, every block of class ``c`` whose ``created + ttl[c]`` is strictly before this
   request's timestamp is removed first (as the GC worker would) and counted in ``expirations``. Trace timestamps
   are milliseconds, TTLs seconds. ``created`` is when the block was last *stored*; touching it does not extend it.
2. **Hit.** The request's hit is the longest run of its leading ``hash_ids`` that are stored;
   ``hit tokens = min(hit_blocks × block_tokens, input_length)``.
3. **Store.** Then each of its blocks, in order, is touched (if stored) or stored (counted in ``blocks_written``),
   so its last block ends up most recently used. A stored block takes the request's TTL class.
4. **Capacity.** ``capacity_tokens = N`` holds ``N // block_tokens`` blocks. Without ``watermarks`` the least
   recently used block is evicted as soon as one more is needed. With ``watermarks=(high, low)`` the GC's
   hysteresis is modelled after every store: if the block count passes ``high × capacity_blocks``, least recently
   used blocks go until it is ``<= low × capacity_blocks`` (:func:`kvtier.gc.policy.plan_eviction`, block counts as
   sizes); a store that would still exceed the capacity first evicts one block. Usage never passes the capacity.
   A block evicted or expired and later stored again is a new store. A capacity under one block stores nothing.

``ideal_token_hit_ratio`` is the same trace with infinite capacity and no TTL (the trace's reuse ceiling).
``tools.replay_live`` replays the same semantics against a running cluster; ``kvbench replay`` is the command line
of both.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kvtier.gc.policy import LruIndex, plan_eviction
from kvtier.tools.capacity import Capacity
from kvtier.tools.traces import DEFAULT_BLOCK_TOKENS, DEFAULT_TTL_CLASS, Request


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Counts from one replay. Ratios are 0.0 when their denominator is 0. Bytes count whole blocks:
    ``bytes_written = blocks_written × block_tokens × bytes_per_token``, ``bytes_read`` likewise for hit blocks.
    ``capacity_blocks`` is None for infinite capacity; ``max_blocks_stored`` is the peak occupancy, never above it."""

    requests: int
    token_hit_ratio: float
    block_hit_ratio: float
    ideal_token_hit_ratio: float
    evictions: int
    expirations: int
    blocks_written: int
    blocks_read: int
    bytes_written: int
    bytes_read: int
    input_tokens: int
    hit_tokens: int
    ideal_hit_tokens: int
    total_blocks: int
    capacity_blocks: int | None
    max_blocks_stored: int
    blocks_stored_at_end: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_counts(
        cls,
        *,
        requests: int,
        input_tokens: int,
        hit_tokens: int,
        ideal_hit_tokens: int,
        total_blocks: int,
        hit_blocks: int,
        written: int,
        block_bytes: int,
        evictions: int,
        expirations: int,
        capacity_blocks: int | None,
        max_blocks_stored: int,
        blocks_stored_at_end: int,
    ) -> ReplayResult:
        """The result from raw counts (ratios and bytes derived here, once for every replay mode)."""
        return cls(
            requests=requests,
            token_hit_ratio=hit_tokens / input_tokens if input_tokens else 0.0,
            block_hit_ratio=hit_blocks / total_blocks if total_blocks else 0.0,
            ideal_token_hit_ratio=ideal_hit_tokens / input_tokens if input_tokens else 0.0,
            evictions=evictions,
            expirations=expirations,
            blocks_written=written,
            blocks_read=hit_blocks,
            bytes_written=written * block_bytes,
            bytes_read=hit_blocks * block_bytes,
            input_tokens=input_tokens,
            hit_tokens=hit_tokens,
            ideal_hit_tokens=ideal_hit_tokens,
            total_blocks=total_blocks,
            capacity_blocks=capacity_blocks,
            max_blocks_stored=max_blocks_stored,
            blocks_stored_at_end=blocks_stored_at_end,
        )


class _Partition:
    """One LRU of the simulated store (the whole store, or one primary's share): its index, capacity in blocks
    (None: infinite) and the usage above which the watermark GC runs."""

    __slots__ = ("cap", "high_blocks", "index")

    def __init__(self, cap: int | None, high: float) -> None:
        self.index = LruIndex()
        self.cap = cap
        self.high_blocks = high * cap if cap is not None else math.inf


def replay(
    requests: Iterable[Request | Mapping[str, Any]],
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    capacity_tokens: int | None = None,
    watermarks: tuple[float, float] | None = None,
    ttl: Mapping[str, float] | None = None,
    bytes_per_token: int = 0,
    store: Capacity | None = None,
    per_primary: bool = False,
    salt: bytes = b"",
) -> ReplayResult:
    """Replay ``requests`` (Request objects or decoded trace lines) against a simulated store; see the module doc.

    The capacity is ``capacity_tokens`` (None: infinite; ``watermarks`` are then ignored), or a cluster's
    ``store`` (``tools.capacity``: its blocks, and its watermarks unless ``watermarks`` is given); with
    ``per_primary`` each of its primaries is an LRU of its own, and each block goes to the primary its key
    (``block_key(hash id, salt)``, as ``replay_live`` with that salt stores it) is placed on. ``watermarks`` is
    ``(high, low)`` with ``0 < low <= high <= 1``. ``ttl`` maps TTL class → seconds; None means nothing expires,
    and when it is given every class the trace uses must be in it. Raises ValueError for bad arguments, a request
    of a class ``ttl`` does not define, or a timestamp earlier than the one before it (TraceError for an invalid
    decoded line).
    Time: O(total blocks), about a second per million blocks; memory: O(distinct blocks).
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    if capacity_tokens is not None and capacity_tokens < 0:
        raise ValueError(f"capacity_tokens must not be negative, got {capacity_tokens}")
    if store is not None and capacity_tokens is not None:
        raise ValueError("give capacity_tokens or a cluster's store capacity, not both")
    if per_primary and store is None:
        raise ValueError("per_primary needs a cluster's store capacity (its primaries)")
    if bytes_per_token < 0:
        raise ValueError(f"bytes_per_token must not be negative, got {bytes_per_token}")
    if store is not None and watermarks is None:
        watermarks = store.watermarks
    high = low = 0.0
    if watermarks is not None:
        high, low = watermarks
        if not 0 < low <= high <= 1:
            raise ValueError(f"watermarks must satisfy 0 < low <= high <= 1, got high={high} low={low}")
    if store is None:
        caps: list[int | None] = [None if capacity_tokens is None else capacity_tokens // block_tokens]
    else:
        caps = [store.primaries[n] for n in sorted(store.primaries)] if per_primary else [store.blocks]
    use_watermarks = watermarks is not None and caps[0] is not None
    parts = [_Partition(cap, high) for cap in caps]
    part_of: dict[int, _Partition] = {}  # hash id -> its partition, with several
    ttl_ms: dict[str, float] = {}
    for cls, seconds in (ttl or {}).items():
        if not seconds > 0:
            raise ValueError(f"TTL of class {cls!r} must be positive, got {seconds}")
        ttl_ms[cls] = seconds * 1000.0
    # Per class, (expires_at, key, created) in store order; with time-ordered requests and one TTL per class this
    # is expiry order, so expiry is a pop from the left. Entries of blocks since evicted or re-stored are stale.
    expiry: dict[str, deque[tuple[float, int, float]]] = {cls: deque() for cls in ttl_ms}

    seen: set[int] = set()
    n = input_tokens = hit_tokens = ideal_hit_tokens = total_blocks = hit_blocks = 0
    evictions = expirations = written = max_stored = stored = 0
    last_ts = -math.inf

    for n, request in enumerate(requests, 1):
        if not isinstance(request, Request):
            request = Request.from_dict(request)
        now = request.timestamp
        if now < last_ts:
            raise ValueError(f"request #{n}: timestamp {now} is earlier than the one before ({last_ts})")
        last_ts = now
        cls = request.ttl_class or DEFAULT_TTL_CLASS
        ids = request.hash_ids
        if len(parts) > 1:
            new = [h for h in ids if h not in part_of]
            if new:
                part_of.update(zip(new, [parts[i] for i in store.primary_index(new, salt)], strict=True))  # type: ignore[union-attr]
            where = [part_of[h] for h in ids]
        else:
            where = [parts[0]] * len(ids)
        queue = None
        if ttl_ms:
            queue = expiry.get(cls)
            if queue is None:
                raise ValueError(f"request #{n} has TTL class {cls!r}, which has no TTL; give every class one")
            for qcls, q in expiry.items():
                while q and q[0][0] < now:
                    _, key, created = q.popleft()
                    index = (part_of[key] if len(parts) > 1 else parts[0]).index
                    entry = index.get(key)
                    if entry is not None and entry.created == created and entry.ttl_class == qcls:
                        index.remove(key)
                        stored -= 1
                        expirations += 1

        length = request.input_length
        hit = 0
        for h, part in zip(ids, where, strict=True):
            if h not in part.index:
                break
            hit += 1
        ideal = 0
        for h in ids:
            if h not in seen:
                break
            ideal += 1
        seen.update(ids)
        input_tokens += length
        hit_tokens += min(hit * block_tokens, length)
        ideal_hit_tokens += min(ideal * block_tokens, length)
        hit_blocks += hit
        total_blocks += len(ids)

        for h, part in zip(ids, where, strict=True):
            index = part.index
            if index.touch(h, now):
                continue
            cap = part.cap
            if cap is not None:
                if cap == 0:
                    continue
                if len(index) >= cap:
                    index.pop_lru()
                    stored -= 1
                    evictions += 1
            index.insert(h, 1, now, cls)
            stored += 1
            written += 1
            if queue is not None:
                queue.append((now + ttl_ms[cls], h, now))
            if stored > max_stored:
                max_stored = stored
            if use_watermarks and len(index) > part.high_blocks:
                victims = plan_eviction(len(index), cap, high, low, index.lru_sizes())
                for key in victims:
                    index.remove(key)
                stored -= len(victims)
                evictions += len(victims)

    block_bytes = block_tokens * bytes_per_token
    return ReplayResult.from_counts(
        requests=n,
        input_tokens=input_tokens,
        hit_tokens=hit_tokens,
        ideal_hit_tokens=ideal_hit_tokens,
        total_blocks=total_blocks,
        hit_blocks=hit_blocks,
        written=written,
        block_bytes=block_bytes,
        evictions=evictions,
        expirations=expirations,
        capacity_blocks=None if caps[0] is None else sum(caps),  # type: ignore[arg-type]
        max_blocks_stored=max_stored,
        blocks_stored_at_end=stored,
    )
