"""Chunk engine: one node's shards in size-class slab files, their metadata in LMDB.

Layout of a node's data dir::

    slabs/slab-<class bytes>.dat   slot n of a class lives at offset n * class bytes
    meta/                          LMDB: shard records, block records (primary + shard-1 copy), settings

Contract (every method is safe to call from several threads):

- ``reserve``         sets aside a slot per announced shard (the node writes the payload straight into
  it). A shard already COMMITTED under the same (tenant, key, index) is left as it is (``EXISTS``). A shard 0
  (this node is the block's primary) is charged to the primary budget; over budget, ``make_room`` (the GC's
  evictor) evicts least-recently-used unpinned blocks at once. ``NO_SPACE`` only when nothing more could be
  evicted, when the node stays full for ``room_wait_s``, or when the disk is full. ``cancel`` gives
  reservations back.
- ``record_pending``  records the received shards PENDING with the CRC-32C computed as they arrived
  (replacing a PENDING one).
- ``commit``          flips PENDING shards to COMMITTED and, at the primary (and shard 1's holder), writes
  the block record that ``match`` and reads consult. A block without a record is invisible.
- ``read``            returns committed, unexpired shards whose crc32c verifies, pinned until ``unpin``;
  anything else is an erasure (``MISSING``/``CORRUPT``/``MISMATCH``/``ABSENT``), never wrong bytes.
- ``delete``          removes block records first, then shards; a freed slot is reused once no reader pins
  it (and after ``grace_s``, default none). ``remove_blocks`` is the primary's side of an eviction: records,
  its shards and an eviction intent in one transaction (``intents``/``clear_intents`` track the rest).

Every record is scoped by tenant: the tenant is a prefix of the LMDB key and comes from the connection's
authentication, never from a request. Slots are allocated in memory (free lists rebuilt from LMDB at
open); a crash between a slot write and its record leaves the slot free, which is exactly right.

Durability: LMDB runs without fsync per transaction and is flushed every second by ``sync``; the slab
files rely on the page cache. A killed process loses nothing; a power loss may lose the last second of
writes, and any torn shard fails its crc and is treated as an erasure.
"""

from __future__ import annotations

import math
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import lmdb

from kvtier.kvstore import _native
from kvtier.kvstore.lru import BlockEntry, LruIndex
from kvtier.kvstore.protocol import Status
from kvtier.kvstore.slabs import SIZE_CLASSES, NoSpace, SlabFiles, size_class_for

PENDING, COMMITTED = 1, 2


# state, index, size class, slot, shard length, crc32c, block length, created, header digest; + ttl class
_SHARD = struct.Struct("<BBHIIIQd16s")
# block length, created, last access, header digest, ns digest, parent key length; + parent key, ttl class
_BLOCK = struct.Struct("<Qdd16s32sB")


class ShardRecord(NamedTuple):
    """A shard's metadata as stored in LMDB (a NamedTuple: decoded on every read, so it must be cheap)."""

    state: int
    index: int
    size_class: int
    slot: int
    length: int
    crc: int
    block_len: int
    created: float
    header: bytes
    ttl_class: str

    def pack(self) -> bytes:
        return _SHARD.pack(*self[:9]) + self.ttl_class.encode()

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> ShardRecord:
        return cls._make((*_SHARD.unpack_from(raw), bytes(raw[_SHARD.size :]).decode()))


class BlockRecord(NamedTuple):
    """A block's record at its primary (and the copy at the holder of shard 1)."""

    block_len: int
    created: float
    last_access: float
    header: bytes
    ns: bytes
    parent: bytes
    ttl_class: str

    def pack(self) -> bytes:
        return (
            _BLOCK.pack(self.block_len, self.created, self.last_access, self.header, self.ns, len(self.parent))
            + self.parent
            + self.ttl_class.encode()
        )

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> BlockRecord:
        block_len, created, last_access, header, ns, parent_len = _BLOCK.unpack_from(raw)
        rest = bytes(raw[_BLOCK.size :])
        return cls(block_len, created, last_access, header, ns, rest[:parent_len], rest[parent_len:].decode())


@dataclass(frozen=True)
class ShardWrite:
    """One shard a writer announces; its bytes arrive later at ``Reservation.fd``/``offset``."""

    key: bytes
    index: int
    length: int
    block_len: int
    ttl_class: str
    header: bytes  # 16-byte header digest, or 16 zero bytes when the writer gave no tokens


@dataclass
class Reservation:
    """A slot set aside for one shard; the shard exists only once ``record_pending`` ran.

    Whoever fills the slot writes the shard at ``offset`` of the slab file ``fd`` and sets ``crc`` to its
    CRC-32C (computed while the bytes were in hand: the engine does not read them back).
    """

    write: ShardWrite
    size_class: int
    slot: int
    fd: int
    offset: int
    crc: int = 0


@dataclass(frozen=True)
class BlockCommit:
    key: bytes
    index: int  # the shard this node holds; 0 means this node is the primary and writes the block record
    block_len: int
    ttl_class: str
    header: bytes
    ns: bytes
    parent: bytes
    created: float | None = None  # repair re-creates a record with the block's original creation time


# The primary (data shard 0) keeps the block record; the holder of shard 1 keeps a copy, so a wiped
# primary's blocks can be found and its record rebuilt by repair.
RECORD_HOLDERS = (0, 1)


def tenant_prefix(tenant: str) -> bytes:
    return tenant.encode() + b"/"


def shard_key(tenant: str, key: bytes, index: int) -> bytes:
    return tenant_prefix(tenant) + key + bytes((index,))


def block_key(tenant: str, key: bytes) -> bytes:
    return tenant_prefix(tenant) + key


class ChunkEngine:
    """One node's shard store. See the module docstring for the contract."""

    def __init__(
        self,
        data_dir: str | Path,
        capacity_bytes: int,
        grace_s: float = 0.0,
        clock: Callable[[], float] = time.time,
        high_watermark: float = 0.9,
        primary_budget_bytes: int | None = None,
        room_wait_s: float = 2.0,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.capacity_bytes = capacity_bytes
        # what the blocks this node is primary for may take on every node of its group (capacity / 12)
        self.primary_budget_bytes = capacity_bytes // 12 if primary_budget_bytes is None else primary_budget_bytes
        self.grace_s = grace_s
        self.room_wait_s = room_wait_s
        self.high_watermark = high_watermark
        self.on_high_watermark: Callable[[], None] | None = None  # wakes the GC worker
        # evicts this primary's least recently used unpinned blocks until it is within its budget (the GC's
        # evictor); called without the lock when a write takes the primary over its budget
        self.make_room: Callable[[], None] | None = None
        self.clock = clock
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified whenever used bytes may have dropped
        (self.data_dir / "meta").mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(
            str(self.data_dir / "meta"), map_size=1 << 36, max_dbs=4, sync=False, metasync=False, lock=True
        )
        self.shards_db = self.env.open_db(b"shards")
        self.blocks_db = self.env.open_db(b"blocks")
        self.settings_db = self.env.open_db(b"settings")
        self.intents_db = self.env.open_db(b"evicting")  # tenant/key -> removal time, until every holder deleted
        self.slabs = SlabFiles(self.data_dir / "slabs")
        self.used_bytes = 0  # slots holding shards, reserved, or in their grace time after a delete
        self.lru = LruIndex()  # block records this node is primary for, least recently used first
        self._accessed: dict[bytes, float] = {}  # last-access times not yet written to LMDB
        # shard 0s reserved or PENDING here (blocks this node will be primary for once committed), by shard key:
        # charged to the primary budget from reservation on, so concurrent writers see each other
        self._pending_primary: dict[bytes, int] = {}
        self.pending_primary_bytes = 0
        used: dict[int, set[int]] = {}
        with self.env.begin() as txn:
            for skey, raw in txn.cursor(db=self.shards_db):
                rec = ShardRecord.unpack(raw)
                used.setdefault(rec.size_class, set()).add(rec.slot)
                self.used_bytes += SIZE_CLASSES[rec.size_class]
                if rec.state == PENDING and rec.index == 0:
                    self._charge(bytes(skey), SIZE_CLASSES[rec.size_class])
            blocks = [(bytes(k), BlockRecord.unpack(raw)) for k, raw in txn.cursor(db=self.blocks_db)]
            for bkey, block in sorted(blocks, key=lambda kb: kb[1].last_access):
                own = txn.get(bkey + b"\x00", db=self.shards_db)
                if own is not None:  # primary here (a record without shard 0 is shard 1's copy)
                    size = SIZE_CLASSES[ShardRecord.unpack(own).size_class]
                    self.lru.insert(bkey, size, block.last_access, block.ttl_class, block.created)
        self.slabs.rebuild(used)

    # -- writes ---------------------------------------------------------------------------------------

    def reserve(self, tenant: str, writes: Sequence[ShardWrite], replace: bool = False) -> list[Reservation | Status]:
        """Set aside a slot per shard; the caller fills each slot (and its ``crc``), then calls ``record_pending``.

        Per write: a Reservation, ``EXISTS`` (a committed shard is already stored; nothing to do, unless
        ``replace``: repair rewriting a corrupt one) or ``NO_SPACE``. Reserved bytes count as used until
        recorded or cancelled.

        Making room (docs/design.md §6): a shard 0 makes this node the block's primary, so it is charged to
        the primary budget at once; a charge that takes the budget over calls ``make_room`` (evicts this
        primary's least recently used unpinned blocks, whole). Shard 0s still over the budget afterwards are
        ``NO_SPACE``: nothing more could be evicted. Then, when the node itself has no room, the call waits
        (at most ``room_wait_s``) for removals under way to free it; what still does not fit is ``NO_SPACE``.
        """
        plan = self._plan(tenant, writes, replace)
        if self.primary_excess() > 0 and self.make_room is not None:
            self.make_room()
        with self._lock:
            excess = self.primary_excess()
            for i in reversed(range(len(writes))):  # the budget is over only if nothing more could be evicted
                if excess <= 0:
                    break
                if writes[i].index == 0 and not isinstance(plan[i], Status):
                    excess -= self._refuse(tenant, writes[i], plan, i)
            self._wait_for_room(sum(SIZE_CLASSES[p] for p in plan if not isinstance(p, Status)))
            for i, p in enumerate(plan):
                if isinstance(p, Status):
                    continue
                if self.used_bytes + SIZE_CLASSES[p] > self.capacity_bytes:
                    self._refuse(tenant, writes[i], plan, i)
                else:
                    self.used_bytes += SIZE_CLASSES[p]
            slots: dict[int, list[int]] = {}
            for size_class in {p for p in plan if not isinstance(p, Status)}:
                count = sum(1 for p in plan if p == size_class and not isinstance(p, Status))
                try:
                    slots[size_class] = self.slabs.allocate(size_class, count)[::-1]
                except NoSpace:  # the disk under the slabs is full
                    self.used_bytes -= count * SIZE_CLASSES[size_class]
                    for i, p in enumerate(plan):
                        if p == size_class and not isinstance(p, Status):
                            self._refuse(tenant, writes[i], plan, i)
            over_high = self.used_bytes - self.freeing_bytes > self.capacity_bytes * self.high_watermark
            if over_high and self.on_high_watermark is not None:
                self.on_high_watermark()
            out: list[Reservation | Status] = []
            for w, p in zip(writes, plan, strict=True):
                if isinstance(p, Status):
                    out.append(p)
                else:
                    slot = slots[p].pop()
                    out.append(Reservation(w, p, slot, *self.slabs.location(p, slot)))
        return out

    def _plan(self, tenant: str, writes: Sequence[ShardWrite], replace: bool) -> list[int | Status]:
        """Per write its size class, or EXISTS; shard 0s are charged to the primary budget."""
        plan: list[int | Status] = []
        with self._lock, self.env.begin(db=self.shards_db, buffers=True) as txn:
            for w in writes:
                skey = shard_key(tenant, w.key, w.index)
                raw = txn.get(skey)
                if raw is not None and raw[0] == COMMITTED and not replace:
                    plan.append(Status.EXISTS)
                    continue
                size_class = size_class_for(w.length)
                plan.append(size_class)
                if w.index == 0:
                    self._charge(skey, SIZE_CLASSES[size_class])
        return plan

    def _refuse(self, tenant: str, write: ShardWrite, plan: list[int | Status], i: int) -> int:
        """Mark ``plan[i]`` NO_SPACE, giving back its primary charge; returns the bytes given back."""
        plan[i] = Status.NO_SPACE
        return self._uncharge(shard_key(tenant, write.key, write.index)) if write.index == 0 else 0

    def _charge(self, skey: bytes, size: int) -> None:
        self.pending_primary_bytes += size - self._pending_primary.get(skey, 0)
        self._pending_primary[skey] = size

    def _uncharge(self, skey: bytes) -> int:
        size = self._pending_primary.pop(skey, 0)
        self.pending_primary_bytes -= size
        return size

    @property
    def primary_bytes(self) -> int:
        """What the blocks this node is primary for take on each node: committed ones and pending writes."""
        return self.lru.total_bytes + self.pending_primary_bytes

    def primary_excess(self) -> int:
        """Bytes by which this primary's blocks exceed its budget (zero or less: within it)."""
        return self.primary_bytes - self.primary_budget_bytes

    def _wait_for_room(self, needed: int) -> None:
        """With the lock held: wait until ``needed`` more bytes fit, at most ``room_wait_s`` (removals under way
        elsewhere, slots pinned by replies being sent, or slots in their grace time free room)."""
        deadline = time.monotonic() + self.room_wait_s
        while True:
            self.used_bytes -= self.slabs.reap(self.clock())
            remaining = deadline - time.monotonic()
            if self.used_bytes + needed <= self.capacity_bytes or remaining <= 0:
                return
            if self.on_high_watermark is not None:
                self.on_high_watermark()
            next_free = self.slabs.quarantine[0][0] - self.clock() if self.slabs.quarantine else remaining
            self._room.wait(min(remaining, max(next_free, 0.001)))

    def record_pending(self, tenant: str, reservations: Sequence[Reservation], replace: bool = False) -> None:
        """The reserved slots hold their shards now: record them PENDING with their ``crc``.

        A PENDING shard of the same (tenant, key, index) is replaced (a COMMITTED one only if ``replace``);
        the old slot is released after grace.
        """
        now = self.clock()
        with self._lock, self.env.begin(db=self.shards_db, write=True) as txn:
            for r in reservations:
                w = r.write
                skey = shard_key(tenant, w.key, w.index)
                old = txn.get(skey)
                if old is not None:
                    old_rec = ShardRecord.unpack(old)
                    if old_rec.state == COMMITTED and not replace:  # a concurrent writer committed first
                        self._release_slot(r.size_class, r.slot, now)
                        if w.index == 0:
                            self._uncharge(skey)
                        continue
                    self._release(old_rec, now)
                rec = ShardRecord(
                    PENDING, w.index, r.size_class, r.slot, w.length, r.crc, w.block_len, now, w.header, w.ttl_class
                )
                txn.put(skey, rec.pack())

    def cancel(self, tenant: str, reservations: Sequence[Reservation]) -> None:
        """Give back reserved slots whose shards never arrived (the writer went away)."""
        with self._lock:
            for r in reservations:
                self.used_bytes -= SIZE_CLASSES[r.size_class]
                self.slabs.release_now(r.size_class, r.slot)
                if r.write.index == 0:
                    self._uncharge(shard_key(tenant, r.write.key, 0))
            self._room.notify_all()

    def put_pending(self, tenant: str, writes: Sequence[ShardWrite], data: Sequence[memoryview]) -> list[Status]:
        """``reserve`` + copy + ``record_pending`` in one call, for shards already in memory (repair, tests)."""
        reserved = self.reserve(tenant, writes)
        done = []
        statuses = []
        for r, payload in zip(reserved, data, strict=True):
            if isinstance(r, Reservation):
                self.slabs.write(r.size_class, r.slot, payload)
                r.crc = _native.crc32c(payload)
                done.append(r)
                statuses.append(Status.OK)
            else:
                statuses.append(r)
        self.record_pending(tenant, done)
        return statuses

    def _release(self, rec: ShardRecord, now: float) -> None:
        self._release_slot(rec.size_class, rec.slot, now)

    def _release_slot(self, size_class: int, slot: int, now: float) -> None:
        """With the lock held. The slot stays counted as used until its grace time (``grace_s``, default none)
        has passed and no reply pins it; writers waiting for room are woken."""
        self.slabs.release(size_class, slot, now + self.grace_s)
        self._room.notify_all()

    def reap(self) -> None:
        """Return slots whose grace time has passed to the free lists."""
        with self._lock:
            self.used_bytes -= self.slabs.reap(self.clock())

    @property
    def freeing_bytes(self) -> int:
        """Used bytes already deleted and waiting out their grace time."""
        return self.slabs.quarantined_bytes

    def commit(self, tenant: str, commits: Sequence[BlockCommit]) -> list[Status]:
        """Mark shards COMMITTED (and write block records at the primary); MISSING if no shard is stored."""
        now = self.clock()
        statuses = []
        indexed = []  # LRU entries to add once the transaction has committed (a failure rolls both back)
        with self._lock:
            with self.env.begin(write=True) as txn:
                for c in commits:
                    statuses.append(self._commit_one(txn, tenant, c, now, indexed))
            for entry in indexed:
                self._uncharge(entry[0] + b"\x00")  # shard 0's pending charge moves into the LRU index
                self.lru.insert(*entry)
        return statuses

    def _commit_one(
        self, txn: lmdb.Transaction, tenant: str, c: BlockCommit, now: float, indexed: list[tuple]
    ) -> Status:
        skey = shard_key(tenant, c.key, c.index)
        raw = txn.get(skey, db=self.shards_db)
        if raw is None:
            return Status.MISSING
        if raw[0] != COMMITTED:  # the state is the record's first byte
            txn.put(skey, bytes((COMMITTED,)) + raw[1:], db=self.shards_db)
        if c.index in RECORD_HOLDERS:
            rec = ShardRecord.unpack(raw)
            bkey = block_key(tenant, c.key)
            old = txn.get(bkey, db=self.blocks_db)
            if old is not None:
                created = BlockRecord.unpack(old).created
            else:
                created = c.created if c.created is not None else now
            block = BlockRecord(c.block_len, created, now, c.header, c.ns, c.parent, c.ttl_class)
            txn.put(bkey, block.pack(), db=self.blocks_db)
            if c.index == 0:
                indexed.append((bkey, SIZE_CLASSES[rec.size_class], now, c.ttl_class, created))
        return Status.OK

    def delete(self, tenant: str, keys: Sequence[bytes], before: float | None = None) -> int:
        """Remove the block records of ``keys`` (the primary's, or shard 1's copy), then their shards; returns
        how many shards were removed. With ``before`` (an eviction's time), records and shards written later
        are left alone: a block stored again since it was evicted is not touched by the eviction's DELETE."""
        with self._lock, self.env.begin(write=True) as txn:
            return self._delete_locked(txn, tenant, keys, before)

    def _delete_locked(self, txn: lmdb.Transaction, tenant: str, keys: Sequence[bytes], before: float | None) -> int:
        now = self.clock()
        removed = 0
        for key in keys:
            bkey = block_key(tenant, key)
            raw = txn.get(bkey, db=self.blocks_db)
            if raw is None or (before is not None and BlockRecord.unpack(raw).created > before):
                continue
            txn.delete(bkey, db=self.blocks_db)
            self.lru.remove(bkey)
            self._accessed.pop(bkey, None)
        cursor = txn.cursor(db=self.shards_db)
        for key in keys:
            base = tenant_prefix(tenant) + key
            if not cursor.set_range(base):
                continue
            while cursor.key()[: len(base)] == base and len(cursor.key()) == len(base) + 1:
                rec = ShardRecord.unpack(cursor.value())
                if before is not None and rec.created > before:
                    if not cursor.next():
                        break
                    continue
                if rec.index == 0 and rec.state == PENDING:
                    self._uncharge(base + b"\x00")
                self._release(rec, now)
                removed += 1
                if not cursor.delete():
                    break
        return removed

    def remove_blocks(self, tenant: str, keys: Sequence[bytes]) -> float:
        """The primary's half of removing blocks (eviction, expiry): in one transaction, delete the records and
        this node's shards and write an eviction intent per block. The blocks are invisible from here on;
        the caller then has every other holder delete its shard (``before`` the returned time) and clears the
        intents (``clear_intents``) once all of them answered. Intents left by a crash are replayed."""
        with self._lock, self.env.begin(write=True) as txn:
            now = self.clock()
            self._delete_locked(txn, tenant, keys, None)
            stamp = struct.pack("<d", now)
            for key in keys:
                txn.put(block_key(tenant, key), stamp, db=self.intents_db)
        return now

    def intents(self) -> dict[str, dict[float, list[bytes]]]:
        """Removals whose DELETEs have not reached every holder yet: per tenant, per removal time, the keys."""
        out: dict[str, dict[float, list[bytes]]] = {}
        with self.env.begin(db=self.intents_db) as txn:
            for bkey, raw in txn.cursor():
                ((tenant, key),) = self.block_keys_to_pairs([bytes(bkey)])
                out.setdefault(tenant, {}).setdefault(struct.unpack("<d", raw)[0], []).append(key)
        return out

    def clear_intents(self, tenant: str, keys: Sequence[bytes]) -> None:
        with self._lock, self.env.begin(db=self.intents_db, write=True) as txn:
            for key in keys:
                txn.delete(block_key(tenant, key))

    def eviction_candidates(self) -> list[bytes]:
        """This primary's least recently used blocks (keys as in the LRU index) whose removal brings it within
        its budget, skipping blocks whose shard 0 a reply is sending (pinned): their bytes could not be reused
        now anyway, and a block being read is not cold. Fewer than needed when too many are pinned; none
        when within budget. Blocks of pending writes are not in the index and are never candidates."""
        with self._lock, self.env.begin(db=self.shards_db, buffers=True) as txn:
            excess = self.primary_excess()
            out = []
            for entry in self.lru:
                if excess <= 0:
                    break
                raw = txn.get(entry.key + b"\x00")  # type: ignore[operator]
                if raw is not None and (_SHARD.unpack_from(raw)[2:4]) in self.slabs.pins:
                    continue
                out.append(entry.key)  # type: ignore[arg-type]
                excess -= entry.size_bytes
        return out

    # -- GC support -----------------------------------------------------------------------------------

    def touch(self, tenant: str, keys: Sequence[bytes]) -> None:
        """Record a read of blocks this node is primary for: in memory now, in LMDB at the next flush."""
        now = self.clock()
        with self._lock:
            for key in keys:
                bkey = block_key(tenant, key)
                if self.lru.touch(bkey, now):
                    self._accessed[bkey] = now

    def flush_access(self) -> int:
        """Write the batched last-access times into the block records; returns how many."""
        with self._lock:
            accessed, self._accessed = self._accessed, {}
            if not accessed:
                return 0
            with self.env.begin(db=self.blocks_db, write=True) as txn:
                for bkey, when in accessed.items():
                    raw = txn.get(bkey)
                    if raw is not None:
                        txn.put(bkey, BlockRecord.unpack(raw)._replace(last_access=when).pack())
        return len(accessed)

    def lru_entries(self) -> list[BlockEntry]:
        """A snapshot of the primary blocks, least recently used first (readers touch the index meanwhile)."""
        with self._lock:
            return list(self.lru)

    def blocks_by_class(self) -> dict[str, int]:
        """How many blocks this node is primary for, per TTL class."""
        with self._lock:
            counts: dict[str, int] = {}
            for entry in self.lru:
                counts[entry.ttl_class] = counts.get(entry.ttl_class, 0) + 1
        return counts

    def block_keys_to_pairs(self, bkeys: Sequence[bytes]) -> list[tuple[str, bytes]]:
        """LRU keys (tenant prefix + key) back to (tenant, key)."""
        out = []
        for bkey in bkeys:
            cut = bkey.index(b"/")
            out.append((bkey[:cut].decode(), bkey[cut + 1 :]))
        return out

    def scan_shards(
        self, pending_cutoff: float, ttl_s: Callable[[str], float | None]
    ) -> tuple[list[tuple[str, bytes, int]], list[tuple[str, bytes, int]]]:
        """One pass over every shard record (call it rarely): (PENDING shards written before
        ``pending_cutoff``, COMMITTED shards past their class's TTL), each as (tenant, key, index)."""
        now = self.clock()
        stale, expired = [], []
        with self.env.begin(db=self.shards_db, buffers=True) as txn:
            for skey, raw in txn.cursor():
                rec = ShardRecord.unpack(raw)
                if rec.state == PENDING and rec.created < pending_cutoff:
                    target = stale
                elif rec.state == COMMITTED and not _shard_alive(rec, ttl_s, now):
                    target = expired
                else:
                    continue
                raw_key = bytes(skey)
                cut = raw_key.index(b"/")
                target.append((raw_key[:cut].decode(), raw_key[cut + 1 : -1], raw_key[-1]))
        return stale, expired

    def promote(self, tenant: str, items: Sequence[tuple[bytes, int]]) -> int:
        """Mark still-PENDING shards COMMITTED (their block was committed at its primary)."""
        with self._lock, self.env.begin(db=self.shards_db, write=True) as txn:
            found = list(_shards_in_state(txn, tenant, items, PENDING))
            for skey, raw in found:
                txn.put(skey, bytes((COMMITTED,)) + raw[1:])
        return len(found)

    def drop_shards(
        self,
        tenant: str,
        items: Sequence[tuple[bytes, int]],
        state: int = PENDING,
        still: Callable[[ShardRecord], bool] | None = None,
    ) -> int:
        """Remove shards still in ``state`` (default PENDING: a dead writer's) and, if given, for which
        ``still(record)`` holds when looked at again under the lock (a shard written since the caller
        decided is left alone); others are left alone."""
        now = self.clock()
        with self._lock, self.env.begin(db=self.shards_db, write=True) as txn:
            found = [(skey, ShardRecord.unpack(raw)) for skey, raw in _shards_in_state(txn, tenant, items, state)]
            found = [(skey, rec) for skey, rec in found if still is None or still(rec)]
            for skey, rec in found:
                self._release(rec, now)
                txn.delete(skey)
                if rec.index == 0 and rec.state == PENDING:
                    self._uncharge(skey)
        return len(found)

    # -- reads ----------------------------------------------------------------------------------------

    def live_blocks(self, tenant: str, keys: Sequence[bytes], ttl_s: Callable[[str], float | None]) -> list[bool]:
        """Whether each key is a block this node is primary for and that has not expired.

        Answered from the in-memory LRU index, which mirrors the primary's block records (inserted at
        commit, removed with the record, rebuilt from LMDB at start-up): ``match`` never touches disk.
        """
        now = self.clock()
        prefix = tenant_prefix(tenant)
        return [self._record_alive(prefix + key, ttl_s, now) for key in keys]

    def _record_alive(self, bkey: bytes, ttl_s: Callable[[str], float | None], now: float) -> bool:
        entry = self.lru.get(bkey)
        if entry is None:
            return False
        ttl = ttl_s(entry.ttl_class)
        return ttl is not None and now <= entry.created + ttl

    def read(
        self,
        tenant: str,
        wanted: Sequence[tuple[bytes, int, bytes | None]],
        ttl_s: Callable[[str], float | None],
        probe: bool = False,
    ) -> tuple[list[Status], list[memoryview | None], list[ShardRecord | None]]:
        """Look up committed shards ``(key, index, expected header digest or None)``.

        Returns per shard a status, a view of its bytes in the slab file (None unless OK) and its record
        (None unless OK). A shard whose crc32c does not verify is ``CORRUPT``: an erasure, never returned.
        The slots of OK shards are *pinned*: however long the caller takes to send them, they are not
        reused, even after a delete; the caller must ``unpin(records)`` when done.
        ``probe`` skips the bytes and the crc check (a repair scan asking only what is there).
        """
        now = self.clock()
        statuses: list[Status] = []
        views: list[memoryview | None] = []
        records: list[ShardRecord | None] = []
        # the per-shard loop runs for every shard a read moves (10,000 of them for 64 MiB of 64 KiB blocks):
        # the key prefix, the TTL cut-offs and the status values are worked out once, outside it
        prefix = tenant_prefix(tenant)
        cutoffs = _ExpiryCutoffs(ttl_s, now)
        ok_, absent, missing, mismatch = Status.OK, Status.ABSENT, Status.MISSING, Status.MISMATCH
        view, shards_db, block_entry = self.slabs.view, self.shards_db, self.lru.get
        # Look up and pin under the lock that deletes and slot reuse take: a slot found here cannot be
        # reused before it is unpinned, however long the checks and the send take.
        with self._lock, self.env.begin(buffers=True) as txn:
            get = txn.get
            for key, index, header in wanted:
                raw = get(prefix + key + _INDEX_BYTES[index], db=shards_db)
                rec = ShardRecord.unpack(raw) if raw is not None else None
                status = ok_
                entry = block_entry(prefix + key) if index == 0 else None
                if index == 0 and (entry is None or entry.created < cutoffs[entry.ttl_class]):
                    status = absent  # no live record: the block is gone, whatever shards remain
                elif rec is None or rec.state != COMMITTED or rec.created < cutoffs[rec.ttl_class]:
                    status = missing
                elif header is not None and rec.header != header:
                    status = mismatch
                statuses.append(status)
                if status is ok_:
                    records.append(rec)
                    views.append(None if probe else view(rec.size_class, rec.slot, rec.length))  # type: ignore[union-attr]
                else:
                    records.append(None)
                    views.append(None)
            if not probe:
                self.slabs.pin([(r.size_class, r.slot) for r in records if r is not None])
        held = [i for i, view in enumerate(views) if view is not None]
        crcs = _native.crc32c_many([views[i] for i in held])  # one call, without the GIL
        for i, crc in zip(held, crcs, strict=True):
            if crc != records[i].crc:  # type: ignore[union-attr]
                statuses[i], views[i] = Status.CORRUPT, None
                self.unpin([records[i]])
                records[i] = None
        return statuses, views, records

    def unpin(self, records: Sequence[ShardRecord | None]) -> None:
        """Release the pins ``read`` took."""
        with self._lock:
            self.slabs.unpin([(r.size_class, r.slot) for r in records if r is not None])
            if self.slabs.quarantine:
                self._room.notify_all()  # a removed slot whose reply was in flight may be free now

    def records_held(self) -> list[tuple[bytes, BlockRecord]]:
        """Every block record here (as primary or as shard 1's copy), keyed by tenant prefix + key."""
        with self.env.begin(db=self.blocks_db) as txn:
            return [(bytes(k), BlockRecord.unpack(raw)) for k, raw in txn.cursor()]

    def shard_records(self, tenant: str, key: bytes) -> Iterator[ShardRecord]:
        base = tenant_prefix(tenant) + key
        with self.env.begin(db=self.shards_db) as txn:
            cursor = txn.cursor()
            if cursor.set_range(base):
                for k, raw in cursor:
                    if k[: len(base)] != base or len(k) != len(base) + 1:
                        break
                    yield ShardRecord.unpack(raw)

    def block_record(self, tenant: str, key: bytes) -> BlockRecord | None:
        with self.env.begin(db=self.blocks_db) as txn:
            raw = txn.get(block_key(tenant, key))
        return BlockRecord.unpack(raw) if raw is not None else None

    def setting(self, name: str) -> bytes | None:
        """A node setting persisted with the data (e.g. the drain flag)."""
        with self.env.begin(db=self.settings_db) as txn:
            return txn.get(name.encode())

    def set_setting(self, name: str, value: bytes) -> None:
        with self._lock, self.env.begin(db=self.settings_db, write=True) as txn:
            txn.put(name.encode(), value)

    def counts(self) -> dict[str, int]:
        with self.env.begin() as txn:
            return {
                "shards": txn.stat(self.shards_db)["entries"],
                "blocks": txn.stat(self.blocks_db)["entries"],
            }

    def sync(self) -> None:
        self.env.sync(True)

    def close(self) -> None:
        self.flush_access()
        with self._lock:
            self.env.sync(True)
            self.env.close()
            self.slabs.close()


def _shards_in_state(
    txn: lmdb.Transaction, tenant: str, items: Sequence[tuple[bytes, int]], state: int
) -> Iterator[tuple[bytes, bytes]]:
    """(LMDB key, record) of the shards among ``items`` whose state is ``state``."""
    for key, index in items:
        skey = shard_key(tenant, key, index)
        raw = txn.get(skey)
        if raw is not None and raw[0] == state:
            yield skey, raw


_INDEX_BYTES = [bytes((i,)) for i in range(256)]  # the last byte of a shard's LMDB key


class _ExpiryCutoffs(dict[str, float]):
    """Per TTL class, the creation time before which a shard has expired at ``now`` (an unknown class: all)."""

    def __init__(self, ttl_s: Callable[[str], float | None], now: float) -> None:
        super().__init__()
        self.ttl_s, self.now = ttl_s, now

    def __missing__(self, ttl_class: str) -> float:
        ttl = self.ttl_s(ttl_class)
        cutoff = self[ttl_class] = math.inf if ttl is None else self.now - ttl
        return cutoff


def _shard_alive(rec: ShardRecord, ttl_s: Callable[[str], float | None], now: float) -> bool:
    ttl = ttl_s(rec.ttl_class)
    return ttl is not None and now <= rec.created + ttl
