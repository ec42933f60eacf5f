"""Chunk engine: one node's shards in size-class slab files, their metadata in LMDB.

Layout of a node's data dir::

    slabs/slab-<class bytes>.dat   slot n of a class lives at offset n * class bytes
    meta/                          LMDB: shard records, block records (primary only), node settings

Contract (every method is safe to call from several threads):

- ``put_pending``  writes shard bytes into a free slot, then records them PENDING. A shard already
  COMMITTED under the same (tenant, key, index) is left as it is (``EXISTS``); a PENDING one is replaced.
  Refuses with ``NO_SPACE`` when the slot would take usage past ``capacity_bytes`` or the disk is full.
- ``commit``       flips PENDING shards to COMMITTED and, for blocks this node is primary for, writes the
  block record that ``match`` and reads consult. A block without a record is invisible.
- ``read``         returns committed, unexpired shards whose crc32c verifies; anything else is an erasure
  (``MISSING``/``CORRUPT``/``MISMATCH``), never wrong bytes.
- ``delete``       removes block records first, then shards; freed slots are reused only after
  ``grace_s``, so a read that already found a slot never sees it overwritten.

Every record is scoped by tenant: the tenant is a prefix of the LMDB key and comes from the connection's
authentication, never from a request. Slots are allocated in memory (free lists rebuilt from LMDB at
open); a crash between a slot write and its record leaves the slot free, which is exactly right.

Durability: LMDB runs without fsync per transaction and is flushed every second by ``sync``; the slab
files rely on the page cache. A killed process loses nothing; a power loss may lose the last second of
writes, and any torn shard fails its crc and is treated as an erasure.
"""

from __future__ import annotations

import bisect
import errno
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import crc32c
import lmdb

from kvtier.kvstore.protocol import Status

PENDING, COMMITTED = 1, 2


def _size_classes() -> list[int]:
    sizes = set()
    for power in range(12, 27):
        for quarter in (4, 5, 6, 7):
            size = (1 << power) * quarter // 4
            if size <= 64 << 20:
                sizes.add(size)
    return sorted(sizes)


SIZE_CLASSES = _size_classes()  # 4 KiB … 64 MiB in quarter-power steps: at most ~20 % slack per shard
MAX_SHARD_BYTES = SIZE_CLASSES[-1]

# state, index, size class, slot, shard length, crc32c, block length, created, header digest; + ttl class
_SHARD = struct.Struct("<BBHIIIQd16s")
# block length, created, last access, header digest, ns digest, parent key length; + parent key, ttl class
_BLOCK = struct.Struct("<Qdd16s32sB")


@dataclass(frozen=True)
class ShardRecord:
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
        return (
            _SHARD.pack(
                self.state,
                self.index,
                self.size_class,
                self.slot,
                self.length,
                self.crc,
                self.block_len,
                self.created,
                self.header,
            )
            + self.ttl_class.encode()
        )

    @classmethod
    def unpack(cls, raw: bytes) -> ShardRecord:
        fields = _SHARD.unpack_from(raw)
        return cls(*fields, ttl_class=bytes(raw[_SHARD.size :]).decode())


@dataclass(frozen=True)
class BlockRecord:
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
    def unpack(cls, raw: bytes) -> BlockRecord:
        block_len, created, last_access, header, ns, parent_len = _BLOCK.unpack_from(raw)
        rest = bytes(raw[_BLOCK.size :])
        return cls(block_len, created, last_access, header, ns, rest[:parent_len], rest[parent_len:].decode())


@dataclass(frozen=True)
class ShardWrite:
    key: bytes
    index: int
    block_len: int
    ttl_class: str
    header: bytes  # 16-byte header digest, or 16 zero bytes when the writer gave no tokens
    data: memoryview


@dataclass(frozen=True)
class BlockCommit:
    key: bytes
    index: int  # the shard this node holds; 0 means this node is the primary and writes the block record
    block_len: int
    ttl_class: str
    header: bytes
    ns: bytes
    parent: bytes


NO_HEADER = bytes(16)


def tenant_prefix(tenant: str) -> bytes:
    return tenant.encode() + b"/"


def shard_key(tenant: str, key: bytes, index: int) -> bytes:
    return tenant_prefix(tenant) + key + bytes((index,))


def block_key(tenant: str, key: bytes) -> bytes:
    return tenant_prefix(tenant) + key


class NoSpace(Exception):
    """The node cannot hold more shard bytes within its capacity (or its disk is full)."""


class _Slabs:
    """Slot allocator over the slab files. Callers hold the engine lock."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.fds: dict[int, int] = {}
        self.next_slot: dict[int, int] = {}  # slots ever handed out per class (the file's length in slots)
        self.free: dict[int, list[int]] = {}
        self.quarantine: deque[tuple[float, int, int]] = deque()  # (release time, class, slot)
        for i, size in enumerate(SIZE_CLASSES):
            path = directory / f"slab-{size}.dat"
            if path.exists():
                self.fds[i] = os.open(path, os.O_RDWR)
                self.next_slot[i] = os.fstat(self.fds[i]).st_size // size

    def fd(self, size_class: int) -> int:
        if size_class not in self.fds:
            path = self.directory / f"slab-{SIZE_CLASSES[size_class]}.dat"
            self.fds[size_class] = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            self.next_slot[size_class] = 0
        return self.fds[size_class]

    def rebuild_free(self, used: dict[int, set[int]]) -> None:
        for size_class, count in self.next_slot.items():
            taken = used.get(size_class, set())
            self.free[size_class] = [s for s in range(count - 1, -1, -1) if s not in taken]

    def allocate(self, size_class: int) -> int:
        free = self.free.setdefault(size_class, [])
        if free:
            return free.pop()
        fd = self.fd(size_class)
        slot = self.next_slot[size_class]
        size = SIZE_CLASSES[size_class]
        try:
            os.posix_fallocate(fd, slot * size, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise NoSpace("disk full") from None
            raise
        self.next_slot[size_class] = slot + 1
        return slot

    def release(self, size_class: int, slot: int, after: float) -> None:
        self.quarantine.append((after, size_class, slot))

    def reap(self, now: float) -> None:
        while self.quarantine and self.quarantine[0][0] <= now:
            _, size_class, slot = self.quarantine.popleft()
            self.free.setdefault(size_class, []).append(slot)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def size_class_for(length: int) -> int:
    if length > MAX_SHARD_BYTES:
        raise ValueError(f"shard of {length} bytes exceeds the largest size class ({MAX_SHARD_BYTES})")
    return bisect.bisect_left(SIZE_CLASSES, length)


class ChunkEngine:
    """One node's shard store. See the module docstring for the contract."""

    def __init__(
        self,
        data_dir: str | Path,
        capacity_bytes: int,
        grace_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.capacity_bytes = capacity_bytes
        self.grace_s = grace_s
        self.clock = clock
        self._lock = threading.Lock()
        (self.data_dir / "meta").mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(
            str(self.data_dir / "meta"), map_size=1 << 36, max_dbs=4, sync=False, metasync=False, lock=True
        )
        self.shards_db = self.env.open_db(b"shards")
        self.blocks_db = self.env.open_db(b"blocks")
        self.settings_db = self.env.open_db(b"settings")
        self.slabs = _Slabs(self.data_dir / "slabs")
        self.used_bytes = 0
        used: dict[int, set[int]] = {}
        with self.env.begin(db=self.shards_db) as txn:
            for _, raw in txn.cursor():
                rec = ShardRecord.unpack(raw)
                used.setdefault(rec.size_class, set()).add(rec.slot)
                self.used_bytes += SIZE_CLASSES[rec.size_class]
        self.slabs.rebuild_free(used)

    # -- writes ---------------------------------------------------------------------------------------

    def put_pending(self, tenant: str, writes: Sequence[ShardWrite]) -> list[Status]:
        """Store shards as PENDING; returns a status per write (OK, EXISTS or NO_SPACE)."""
        now = self.clock()
        statuses: list[Status] = []
        with self._lock:
            self.slabs.reap(now)
            with self.env.begin(db=self.shards_db, write=True) as txn:
                for w in writes:
                    skey = shard_key(tenant, w.key, w.index)
                    old_raw = txn.get(skey)
                    old = ShardRecord.unpack(old_raw) if old_raw is not None else None
                    if old is not None and old.state == COMMITTED:
                        statuses.append(Status.EXISTS)
                        continue
                    size_class = size_class_for(len(w.data))
                    class_bytes = SIZE_CLASSES[size_class]
                    if self.used_bytes + class_bytes > self.capacity_bytes:
                        statuses.append(Status.NO_SPACE)
                        continue
                    try:
                        slot = self.slabs.allocate(size_class)
                    except NoSpace:
                        statuses.append(Status.NO_SPACE)
                        continue
                    self._write_slot(size_class, slot, w.data)
                    crc = crc32c.crc32c(w.data)
                    if old is not None:
                        self._release(old, now)
                    self.used_bytes += class_bytes
                    rec = ShardRecord(
                        PENDING, w.index, size_class, slot, len(w.data), crc, w.block_len, now, w.header, w.ttl_class
                    )
                    txn.put(skey, rec.pack())
                    statuses.append(Status.OK)
        return statuses

    def _write_slot(self, size_class: int, slot: int, data: memoryview) -> None:
        fd = self.slabs.fd(size_class)
        offset = slot * SIZE_CLASSES[size_class]
        view = memoryview(data)
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written

    def _release(self, rec: ShardRecord, now: float) -> None:
        self.used_bytes -= SIZE_CLASSES[rec.size_class]
        self.slabs.release(rec.size_class, rec.slot, now + self.grace_s)

    def commit(self, tenant: str, commits: Sequence[BlockCommit]) -> list[Status]:
        """Mark shards COMMITTED (and write block records at the primary); MISSING if no shard is stored."""
        now = self.clock()
        statuses = []
        with self._lock, self.env.begin(write=True) as txn:
            for c in commits:
                skey = shard_key(tenant, c.key, c.index)
                raw = txn.get(skey, db=self.shards_db)
                if raw is None:
                    statuses.append(Status.MISSING)
                    continue
                rec = ShardRecord.unpack(raw)
                if rec.state != COMMITTED:
                    txn.put(skey, replace(rec, state=COMMITTED).pack(), db=self.shards_db)
                if c.index == 0:
                    bkey = block_key(tenant, c.key)
                    old = txn.get(bkey, db=self.blocks_db)
                    created = BlockRecord.unpack(old).created if old is not None else now
                    block = BlockRecord(c.block_len, created, now, c.header, c.ns, c.parent, c.ttl_class)
                    txn.put(bkey, block.pack(), db=self.blocks_db)
                statuses.append(Status.OK)
        return statuses

    def delete(self, tenant: str, keys: Sequence[bytes], indices: Sequence[int] = range(256)) -> int:
        """Remove block records, then the shards of ``keys``; returns how many shards were removed."""
        now = self.clock()
        removed = 0
        prefix = tenant_prefix(tenant)
        with self._lock, self.env.begin(write=True) as txn:
            for key in keys:
                txn.delete(block_key(tenant, key), db=self.blocks_db)
            cursor = txn.cursor(db=self.shards_db)
            for key in keys:
                base = prefix + key
                if not cursor.set_range(base):
                    continue
                while cursor.key()[: len(base)] == base and len(cursor.key()) == len(base) + 1:
                    rec = ShardRecord.unpack(cursor.value())
                    if rec.index in indices:
                        self._release(rec, now)
                        removed += 1
                        if not cursor.delete():
                            break
                    elif not cursor.next():
                        break
        return removed

    # -- reads ----------------------------------------------------------------------------------------

    def live_blocks(self, tenant: str, keys: Sequence[bytes], ttl_s: Callable[[str], float | None]) -> list[bool]:
        """Whether each key has a block record here that has not expired (metadata only)."""
        now = self.clock()
        out = []
        with self.env.begin(db=self.blocks_db, buffers=True) as txn:
            for key in keys:
                raw = txn.get(block_key(tenant, key))
                out.append(raw is not None and _alive(BlockRecord.unpack(raw), ttl_s, now))
        return out

    def read(
        self,
        tenant: str,
        wanted: Sequence[tuple[bytes, int, bytes | None]],
        ttl_s: Callable[[str], float | None],
        buffer_for: Callable[[int], memoryview],
    ) -> tuple[list[Status], list[int], list[int], int]:
        """Read committed shards ``(key, index, expected header digest or None)`` into one buffer.

        ``buffer_for(total)`` must return a writable buffer of at least ``total`` bytes; shards are laid
        end to end in request order, skipping those whose status is not OK. Returns statuses, the length of
        each OK shard and the length of its block (0 where not OK), and the total.
        """
        now = self.clock()
        found: list[ShardRecord | None] = []
        statuses: list[Status] = []
        with self.env.begin(buffers=True) as txn:
            for key, index, header in wanted:
                raw = txn.get(shard_key(tenant, key, index), db=self.shards_db)
                rec = ShardRecord.unpack(raw) if raw is not None else None
                status = Status.OK
                if rec is None or rec.state != COMMITTED:
                    status = Status.MISSING
                elif index == 0:
                    block_raw = txn.get(block_key(tenant, key), db=self.blocks_db)
                    if block_raw is None or not _alive(BlockRecord.unpack(block_raw), ttl_s, now):
                        status = Status.ABSENT
                elif not _shard_alive(rec, ttl_s, now):
                    status = Status.MISSING
                if status == Status.OK and header is not None and rec.header != header:
                    status = Status.MISMATCH
                statuses.append(status)
                found.append(rec if status == Status.OK else None)
        total = sum(rec.length for rec in found if rec is not None)
        out = buffer_for(total)
        lengths = []
        block_lens = [rec.block_len if rec is not None else 0 for rec in found]
        offset = 0
        for i, rec in enumerate(found):
            if rec is None:
                lengths.append(0)
                continue
            view = out[offset : offset + rec.length]
            got = os.preadv(self.slabs.fds[rec.size_class], [view], rec.slot * SIZE_CLASSES[rec.size_class])
            if got != rec.length or crc32c.crc32c(view) != rec.crc:
                statuses[i] = Status.CORRUPT
                lengths.append(0)
                block_lens[i] = 0
                continue
            lengths.append(rec.length)
            offset += rec.length
        return statuses, lengths, block_lens, offset

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

    def counts(self) -> dict[str, int]:
        with self.env.begin() as txn:
            return {
                "shards": txn.stat(self.shards_db)["entries"],
                "blocks": txn.stat(self.blocks_db)["entries"],
            }

    def sync(self) -> None:
        self.env.sync(True)

    def close(self) -> None:
        with self._lock:
            self.env.sync(True)
            self.env.close()
            self.slabs.close()


def _alive(block: BlockRecord, ttl_s: Callable[[str], float | None], now: float) -> bool:
    ttl = ttl_s(block.ttl_class)
    return ttl is not None and now < block.created + ttl


def _shard_alive(rec: ShardRecord, ttl_s: Callable[[str], float | None], now: float) -> bool:
    ttl = ttl_s(rec.ttl_class)
    return ttl is not None and now < rec.created + ttl
