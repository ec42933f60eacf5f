"""The fetcher's Unix-socket protocol, sans-IO: request and reply metadata to and from dicts. No sockets here.

Block bytes never cross the socket: they sit in shared-memory segments, one per tenant and size class (a block of
``length`` bytes lives in the smallest class it fits; a class is made for a larger block on its first use), and
the replies name a segment by id and slots in it. A client maps a segment it does not know yet with MAP, whose reply
carries the segments' descriptors (``SCM_RIGHTS``): read-only ones for cache segments, read-write ones for the
tenant's outboxes (the slots ALLOC gives out). A connection is one tenant and only ever sees that tenant's segments.

Frames are the store's (:mod:`kvtier.kvstore.wire.protocol`: header + msgpack metadata; no payload). Batches travel as
packed arrays (:mod:`kvtier.kvstore.wire.fields`), so a 1,200-key fetch is a few numpy calls to encode.

    HELLO     token                                      → instance, hash, fetcher pid, tenant
    MAP       seg u32[n]                                 → segs [[id, kind, slot_bytes, stride, slots, offset,
                                                           epoch, name], …] + one descriptor each, live [ids]
    FETCH     keys, klen, length, [hdr], prio            → seg, st u8[n], slot u32[n], gen u64[n], [errors]
    PREFETCH  same as FETCH; nothing is pinned           → same
    RELEASE   seg u32[n], slot u32[n], gen u64[n]        → released
    ALLOC     n, length                                  → seg (an outbox), st (ALLOCATED / FULL), slot, gen
    PUT       seg, keys, klen, length, slot, gen, ttl,   → st (STORED / ERROR / ALLOCATED: refused, still
              [hdr]                                        the caller's), [errors]
    STATS                                                → the tenant's pool and counters (all: the cluster token)

A request the fetcher cannot parse is answered with an ERROR frame and the connection closed.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.kvstore.keys import HEADER_DIGEST_BYTES
from kvtier.kvstore.wire import fields as wire
from kvtier.kvstore.wire.protocol import UNSET, Hello, Op, Request, Schemas, Unset

MAX_PRIORITY = 1 << 16
MAX_BLOCK_BYTES = (1 << 32) - 1  # a slot table's length column is 32 bits
CACHE, OUTBOX = "cache", "outbox"  # the kinds of segment MAP hands out


class FetchOp(enum.IntEnum):
    HELLO = Op.HELLO  # the store's HELLO: the first frame of every connection
    FETCH = 32
    PREFETCH = 33
    RELEASE = 34
    ALLOC = 35
    PUT = 36
    STATS = 37
    MAP = 38


class BlockStatus(enum.IntEnum):
    """Per-block answer. HIT and FETCHED name a slot; the others do not."""

    HIT = 0  # already in the host pool: no storage node was asked
    FETCHED = 1  # read from the store straight into the slot
    MISS = 2  # the store does not hold it (or holds another block under that key: header mismatch)
    FULL = 3  # no slot could be had: every slot is pinned or being filled
    ERROR = 4  # the store could not be asked (see the reply's errors)
    STORED = 5  # PUT: committed to the store and cached in the pool
    ALLOCATED = 6  # ALLOC: a FILLING slot the caller may write, then PUT


OK_STATUSES = (BlockStatus.HIT, BlockStatus.FETCHED)


class _Slots(Request):
    slot: bytes | Unset = UNSET
    gen: bytes | Unset = UNSET


class Release(_Slots):
    seg: bytes | Unset = UNSET


class Map(Request):
    seg: bytes | Unset = UNSET


class Fetch(Request):
    keys: bytes | Unset = UNSET
    klen: int | Unset = UNSET
    length: int | Unset = UNSET
    hdr: bytes | Unset = UNSET
    prio: int | Unset = UNSET


class Alloc(Request):
    n: int | Unset = UNSET
    length: int | Unset = UNSET


class Put(_Slots):
    seg: int | Unset = UNSET
    keys: bytes | Unset = UNSET
    klen: int | Unset = UNSET
    length: int | Unset = UNSET
    hdr: bytes | Unset = UNSET
    ttl: str | Unset = UNSET


class Stats(Request):
    pass


FETCH_REQUESTS = Schemas(
    {
        FetchOp.HELLO: Hello,
        FetchOp.FETCH: Fetch,
        FetchOp.PREFETCH: Fetch,
        FetchOp.RELEASE: Release,
        FetchOp.ALLOC: Alloc,
        FetchOp.PUT: Put,
        FetchOp.STATS: Stats,
        FetchOp.MAP: Map,
    }
)
"""The typed metadata of the fetcher's requests (:class:`~kvtier.kvstore.wire.protocol.Schemas`)."""


@dataclass
class FetchRequest:
    keys: list[bytes]
    length: int
    headers: list[bytes | None]
    priority: int
    rows: np.ndarray  # the keys as they came: uint8 [n, klen]


@dataclass
class Entries:
    """A batch of keys, each with a slot and the slot's generation (PUT here; the StateBlock directory too)."""

    keys: list[bytes]
    slots: np.ndarray
    gens: np.ndarray


def entries_meta(keys: Sequence[bytes], slots: Sequence[int], gens: Sequence[int]) -> dict[str, Any]:
    if not len(keys) == len(slots) == len(gens):
        raise ValueError(f"{len(keys)} keys, {len(slots)} slots, {len(gens)} generations")
    blob, klen = wire.pack_keys(keys)
    return {"keys": blob, "klen": klen, **_slot_gens(slots, gens)}


def _slot_gens(slots: Sequence[int], gens: Sequence[int]) -> dict[str, bytes]:
    return {"slot": np.asarray(slots, "<u4").tobytes(), "gen": np.asarray(gens, "<u8").tobytes()}


def _split_keys(meta: dict[str, Any], max_batch: int) -> list[bytes]:
    """The request's keys (checked as ``wire.unpack_keys`` does), split in C: no Python frame per key."""
    blob, klen = wire.unpack_key_blob(meta, max_batch)
    return split(blob, klen)


def _headers(meta: dict[str, Any], n: int) -> list[bytes | None]:
    """The request's header digests (checked as ``wire.unpack_headers`` does), split in C; Nones if none."""
    blob = wire.unpack_header_blob(meta, n)
    return [None] * n if blob is None else split(blob, HEADER_DIGEST_BYTES)  # type: ignore[return-value]


def split(blob: bytes, width: int) -> list[bytes]:
    """``blob`` cut into ``width``-byte pieces, in C (numpy's void items are bytes; 3x faster than
    ``struct.iter_unpack``, which makes a tuple a piece)."""
    return np.frombuffer(blob, f"V{width}").tolist()


def parse_entries(meta: dict[str, Any], max_batch: int) -> Entries:
    keys = _split_keys(meta, max_batch)
    n = len(keys)
    return Entries(keys, wire.unpack_array(meta, "slot", "<u4", n), wire.unpack_array(meta, "gen", "<u8", n))


@dataclass
class PutRequest:
    seg: int  # the outbox the slots are in
    entries: Entries
    length: int
    ttl_class: str
    headers: list[bytes | None]


def _headers_meta(headers: Sequence[bytes] | None, n: int) -> dict[str, bytes]:
    if headers is None:
        return {}
    if len(headers) != n or any(len(h) != HEADER_DIGEST_BYTES for h in headers):
        raise ValueError(f"headers= needs one {HEADER_DIGEST_BYTES}-byte digest per key")
    return {"hdr": b"".join(headers)}


def fetch_meta(keys: Sequence[bytes], length: int, headers: Sequence[bytes] | None, priority: int) -> dict[str, Any]:
    """Metadata of a FETCH/PREFETCH; raises ValueError for arguments the fetcher would refuse."""
    if length <= 0:
        raise ValueError(f"block length must be positive, got {length}")
    if not 0 <= priority < MAX_PRIORITY:
        raise ValueError(f"priority must be in 0..{MAX_PRIORITY - 1} (lower is served first), got {priority}")
    blob, klen = wire.pack_keys(keys)
    return {"keys": blob, "klen": klen, "length": length, "prio": priority, **_headers_meta(headers, len(keys))}


def _length(meta: dict[str, Any]) -> int:
    length = wire.field(meta, "length", int)
    if not 0 < length <= MAX_BLOCK_BYTES:
        raise wire.bad(f"block length {length} is outside 1..{MAX_BLOCK_BYTES}")
    return length


def parse_fetch(meta: dict[str, Any], max_batch: int) -> FetchRequest:
    blob, klen = wire.unpack_key_blob(meta, max_batch)
    keys = split(blob, klen)
    priority = wire.field(meta, "prio", int)
    if not 0 <= priority < MAX_PRIORITY:
        raise wire.bad(f"priority {priority} out of range")
    headers = _headers(meta, len(keys))
    rows = np.frombuffer(blob, np.uint8).reshape(len(keys), klen)
    return FetchRequest(keys, _length(meta), headers, priority, rows)


def slots_meta(
    seg: int, status: np.ndarray, slots: np.ndarray, gens: np.ndarray, errors: dict[int, str]
) -> dict[str, Any]:
    """Reply to FETCH, PREFETCH and ALLOC: the slots are in segment ``seg``. ``errors``: block index → message (for
    ERROR blocks, and FULL ones the pool can never take)."""
    meta: dict[str, Any] = {
        "seg": seg,
        "st": status.astype(np.uint8).tobytes(),
        "slot": slots.astype("<u4").tobytes(),
        "gen": gens.astype("<u8").tobytes(),
    }
    if errors:
        meta["errors"] = {str(i): message for i, message in errors.items()}
    return meta


def parse_slots(meta: dict[str, Any], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, str]]:
    """(status, slot, generation, errors) of a FETCH/PREFETCH/ALLOC/PUT reply for ``n`` blocks."""
    errors = {int(i): str(m) for i, m in (meta.get("errors") or {}).items()}
    return (
        wire.unpack_array(meta, "st", "u1", n),
        wire.unpack_array(meta, "slot", "<u4", n),
        wire.unpack_array(meta, "gen", "<u8", n),
        errors,
    )


def size_class(slot_sizes: Sequence[int], length: int) -> int | None:
    """Index of the smallest slot size (ascending list) that holds ``length`` bytes; None if none does."""
    for i, size in enumerate(slot_sizes):
        if length <= size:
            return i
    return None


def release_meta(segs: Sequence[int], slots: Sequence[int], gens: Sequence[int]) -> dict[str, Any]:
    return {"seg": np.asarray(segs, "<u4").tobytes(), **_slot_gens(slots, gens)}


def parse_release(meta: dict[str, Any], max_batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(segment, slot, generation) arrays of a RELEASE."""
    n = len(wire.field(meta, "slot", bytes)) // 4
    if n > max_batch:
        raise wire.bad(f"batch of {n} slots exceeds the limit of {max_batch}")
    return (
        wire.unpack_array(meta, "seg", "<u4", n),
        wire.unpack_array(meta, "slot", "<u4", n),
        wire.unpack_array(meta, "gen", "<u8", n),
    )


def map_meta(segs: Sequence[int]) -> dict[str, Any]:
    return {"seg": np.asarray(segs, "<u4").tobytes()}


def parse_map(meta: dict[str, Any], max_segments: int) -> list[int]:
    """The segment ids a MAP asks for (at most ``max_segments``: a descriptor each)."""
    n = len(wire.field(meta, "seg", bytes)) // 4
    if n > max_segments:
        raise wire.bad(f"MAP of {n} segments exceeds the limit of {max_segments}")
    return wire.unpack_array(meta, "seg", "<u4", n).tolist()


@dataclass
class Segment:
    """A segment as MAP describes it (its descriptor travels beside the reply)."""

    id: int
    kind: str  # CACHE (read-only, with a slot table) or OUTBOX (writable, slots only)
    slot_bytes: int
    stride: int
    slots: int
    data_offset: int
    epoch: bytes
    name: str

    def row(self) -> list[Any]:
        return [self.id, self.kind, self.slot_bytes, self.stride, self.slots, self.data_offset, self.epoch, self.name]


def mapped_meta(segments: Sequence[Segment], live: Sequence[int]) -> dict[str, Any]:
    """Reply to MAP: the segments (their descriptors, in this order, beside it) and the ids of every segment the
    tenant has now (a client drops its mappings of the others)."""
    return {"segs": [s.row() for s in segments], "live": list(live)}


def parse_mapped(meta: dict[str, Any]) -> tuple[list[Segment], set[int]]:
    try:
        segments = [Segment(*row) for row in meta["segs"]]
        live = {int(i) for i in meta["live"]}
    except (KeyError, TypeError, ValueError) as exc:
        raise wire.bad(f"malformed MAP reply ({exc})") from None
    if any(s.kind not in (CACHE, OUTBOX) for s in segments):
        raise wire.bad("MAP reply names an unknown kind of segment")
    return segments, live


def alloc_meta(n: int, length: int) -> dict[str, Any]:
    if n < 0 or length <= 0:
        raise ValueError(f"alloc needs n >= 0 and a positive length, got {n}, {length}")
    return {"n": n, "length": length}


def parse_alloc(meta: dict[str, Any], max_batch: int) -> tuple[int, int]:
    n = wire.field(meta, "n", int)
    if not 0 <= n <= max_batch:
        raise wire.bad(f"alloc of {n} slots is outside 0..{max_batch}")
    return n, _length(meta)


def put_meta(
    seg: int,
    keys: Sequence[bytes],
    length: int,
    slots: Sequence[int],
    gens: Sequence[int],
    ttl_class: str,
    headers: Sequence[bytes] | None,
) -> dict[str, Any]:
    meta = entries_meta(keys, slots, gens)
    return {**meta, "seg": seg, "length": length, "ttl": ttl_class, **_headers_meta(headers, len(keys))}


def parse_put(meta: dict[str, Any], max_batch: int) -> PutRequest:
    entries = parse_entries(meta, max_batch)
    return PutRequest(
        wire.field(meta, "seg", int),
        entries,
        _length(meta),
        wire.field(meta, "ttl", str),
        _headers(meta, len(entries.keys)),
    )
