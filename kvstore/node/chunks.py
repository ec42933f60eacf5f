"""Chunk engine: one node's shards in size-class slab files, their metadata in LMDB.

Layout of a node's data dir::

    slabs/slab-<class bytes>.dat   slot n of a class lives at offset n * class bytes
    meta/                          LMDB: shard records, block records (at the holders of shards 0, 1 and 2;
                                   block_table), removal intents, owed repairs (owed), settings

Shard records are keyed in LMDB by where their bytes are (size class, slot; the value carries the name): a
put's shards take adjacent slots, so its records fill a few neighbouring B-tree pages, and an eviction's
deletes do the same, instead of one random page per shard (a random-key insert cost 1.5-2.5 us a shard, an
in-order one 0.2-0.3 us). Lookups by name (tenant/key/index) go to an in-memory index of the committed
records, rebuilt from LMDB at open and changed only under the engine lock, with the LMDB transaction.

Contract (every method is safe to call from several threads):

- ``reserve``         sets aside a slot per shard of a :class:`WriteBatch` (one PUT's shards, as columns; the
  node writes the payload straight into the slots). A shard already COMMITTED under the same (tenant, key,
  index) is left as it is (``EXISTS``). A shard 0 (this node is the block's primary) is charged to the
  primary budget; over budget, ``make_room`` (the GC's evictor) evicts least-recently-used unpinned blocks
  of the writer's own tenant beyond its share at once (:mod:`~kvtier.kvstore.node.quotas`). ``NO_SPACE`` when
  the node stays full for ``room_wait_s``, or when the disk is full. ``cancel`` gives the slots back.
- ``stage``           keeps the received batch PENDING, in memory only, under the writer's put id: nothing
  of it is in LMDB, so a crash before the COMMIT leaves its slots free, which is exactly right. Shard 0s
  that leave the writer over its own share of the budget, with nothing of its own left to evict, are
  ``NO_SPACE``. ``stale_puts`` lists batches whose writer never settled them (the GC settles them after
  ``gc.pending_timeout_s``). A pending write counts in its own tenant's decisions only: nobody else's blocks
  make room for it until it commits (:mod:`~kvtier.kvstore.node.charges`).
- ``commit``          settles a staged batch in one LMDB transaction: COMMITTED shard records (one
  ``putmulti``) and, at the holders of shards 0, 1 and 2, the block record that ``match`` and reads consult
  (the primary's; any two lost nodes leave a copy); rows the writer gives up on are dropped. A block without
  a record is invisible. A block committed short of shards is owed a repair by its primary (``owe``). Its
  blocks now count for everyone: still over the budget, ``make_room`` takes from other tenants' blocks
  beyond their shares, then from the writer's.
- ``read``            returns committed, unexpired shards whose crc32c verifies, pinned until ``unpin``;
  anything else is an erasure (``MISSING``/``CORRUPT``/``MISMATCH``/``ABSENT``), never wrong bytes.
- ``delete``          removes block records first, then shards; a freed slot is reused once no reader pins
  it (and after ``grace_s``, default none). A deleted shard's record stays in LMDB, marked dead
  (:mod:`~kvtier.kvstore.node.dead_slots`), until its slot's next record overwrites it. ``remove_blocks`` is the
  primary's side of an eviction: records, its shards and the removal's intent in one transaction
  (``removals``/``clear_removal`` track the rest; :mod:`~kvtier.kvstore.node.removals`).
- ``scrub``           reads committed shards in slot order and checks their crc32c (the GC's scrubber).

Every record is scoped by tenant: the tenant is a prefix of the LMDB key and comes from the connection's
authentication, never from a request. Slots are allocated in memory (free lists rebuilt from LMDB at
open); a crash between a slot write and its record leaves the slot free, which is exactly right.

Durability: LMDB runs without fsync per transaction and is flushed every ``gc.meta_sync_s`` (5 s) by ``sync``;
the slab files rely on the page cache. A killed process loses nothing; a power loss may lose the last few
seconds of writes, and any torn shard fails its crc and is treated as an erasure.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import lmdb
import numpy as np

from kvtier.kvstore import _native
from kvtier.kvstore.codec import TOTAL_SHARDS
from kvtier.kvstore.keys import HEADER_DIGEST_BYTES as HEADER_BYTES
from kvtier.kvstore.node.block_table import BlockTable
from kvtier.kvstore.node.charges import Charges
from kvtier.kvstore.node.dead_slots import DeadSlots
from kvtier.kvstore.node.disk import DiskBudget, MetaRoom, NoSpace, Refusals
from kvtier.kvstore.node.lru import BlockEntry, TenantLru
from kvtier.kvstore.node.owed import Owed, OwedRepairs
from kvtier.kvstore.node.quotas import TenantShares, plan_removals
from kvtier.kvstore.node.removals import Removal, RemovalLog
from kvtier.kvstore.node.shard_index import RECORD, ShardIndex, every_shard, name_table, table_names, tables_by_width
from kvtier.kvstore.node.slabs import SIZE_CLASSES, SlabFiles, by_class
from kvtier.kvstore.node.unconfirmed import Unconfirmed, UnconfirmedShards
from kvtier.kvstore.placement import RECORD_HOLDERS
from kvtier.kvstore.wire.fields import RecordState
from kvtier.kvstore.wire.protocol import Status

PENDING, COMMITTED = 1, 2  # PENDING: only in memory (a staged batch), and in LMDB of nodes older than that
SETTLED_KEPT = 256  # settled puts whose COMMIT answer is kept, for a COMMIT resent after a lost connection
# setting: while a new (or wiped) data dir has not yet asked its peers what it should hold, when it was made
REBUILD = "rebuild_since"
SCRUB_AT = "scrub_at"  # setting: the place (size class, slot) the scrubber's running pass has checked up to
_TIME = struct.Struct("<d")


_TXN_BYTES = 256 << 10  # room in the metadata a small write transaction may need
_OLD_TABLES = (b"shards", b"blocks", b"evicting")  # tables of an older data dir, moved (written) at open


def _txn_bytes(rows: int) -> int:
    """Room in the metadata a write transaction of ``rows`` records may need (pages copied and added, generously)."""
    return _TXN_BYTES + rows * 1024


def _disk_full(exc: lmdb.Error) -> bool:
    """Whether LMDB failed for lack of disk (it reports the OS error in its message)."""
    return "No space left" in str(exc) or "Disk quota" in str(exc)


class MetadataError(Exception):
    """The node's LMDB cannot be read: corrupt, truncated, or not an LMDB file (``path`` names the file)."""

    def __init__(self, path: Path, cause: Exception) -> None:
        super().__init__(f"its metadata {path} is unreadable ({type(cause).__name__}: {cause})")
        self.path = path


# state, index, size class, slot, shard length, crc32c, block length, created, header digest; + ttl class
_SHARD = struct.Struct("<BBHIIIQd16s")
# block length, created, last access, header digest, ns digest, parent key length; + parent key, ttl class
_BLOCK = struct.Struct("<Qdd16s32sB")
_BLOCK_DTYPE = np.dtype(  # _BLOCK as a numpy row
    {
        "names": ["block_len", "created", "last_access", "header", "ns", "parent_len"],
        "formats": ["<u8", "<f8", "<f8", "V16", "V32", "u1"],
    }
)
assert _BLOCK_DTYPE.itemsize == _BLOCK.size
_LAST_ACCESS_AT = _BLOCK_DTYPE.fields["last_access"][1]  # where a packed block record keeps its last access


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
    """A block's record at its primary (and the copies at the holders of shards 1 and 2)."""

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
        """Raises ValueError (or struct.error) for bytes that are not a block record."""
        block_len, created, last_access, header, ns, parent_len = _BLOCK.unpack_from(raw)
        rest = bytes(raw[_BLOCK.size :])
        if len(rest) < parent_len:
            raise ValueError("a block record is shorter than its parent key")
        return cls(block_len, created, last_access, header, ns, rest[:parent_len], rest[parent_len:].decode())


class WriteBatch:
    """The shards of one ``PUT_SHARDS`` request at this node, as columns: row ``i`` is the ``i``-th shard of
    the payload. No Python object per shard: a 64 KiB-block put brings a thousand shards to every node.

    The request gives ``keys`` (``n × klen`` bytes), shard ``index``, shard ``length``, ``block_len``,
    16-byte header ``digests`` (``n × 16`` bytes, zeros when the writer gave no tokens), the TTL class, and
    for the block records: the namespace digest ``ns`` and one ``parents`` entry per row holding a record
    (index 0 or 1), in row order; ``created`` per row when repair re-creates a record. ``reserve`` fills
    ``status`` (OK, EXISTS, NO_SPACE, …), ``size_class`` and ``slot``; the receiver fills ``crc``.
    """

    def __init__(
        self,
        keys: bytes,
        klen: int,
        index: np.ndarray,
        length: np.ndarray,
        block_len: np.ndarray,
        ttl_class: str,
        digests: bytes | None = None,
        *,
        replace: bool = False,
        ns: bytes = b"",
        parents: Sequence[bytes] | None = None,
        created: np.ndarray | None = None,
    ) -> None:
        n = len(index)
        self.n, self.keys, self.klen = n, keys, klen
        self.index = np.asarray(index, dtype=np.uint8)
        self.length = np.asarray(length, dtype=np.int64)
        self.block_len = np.asarray(block_len, dtype=np.int64)
        self.ttl_class = ttl_class
        self.digests = digests if digests is not None else bytes(HEADER_BYTES * n)
        self.replace = replace
        self.ns = ns.ljust(32, b"\0")
        holders = np.flatnonzero(holds_record(self.index)).tolist()
        self.parents = dict.fromkeys(holders, b"")
        if parents is not None:  # a client from before records were kept on three nodes names shards 0 and 1
            named = holders if len(parents) == len(holders) else np.flatnonzero(self.index < 2).tolist()
            self.parents.update(zip(named, parents, strict=True))
        self.created = created
        self.status = np.zeros(n, dtype=np.uint8)  # Status.OK
        self.size_class = np.searchsorted(_CLASS_BYTES, self.length)
        self.slot = np.zeros(n, dtype=np.int64)
        self.crc = np.zeros(n, dtype="<u4")
        self.name_rows = np.zeros((n, 0), dtype=np.uint8)  # shard names (tenant/key/index), a row each: ``reserve``
        self.tenant = ""  # whose shards they are: ``reserve``
        self.charged = np.zeros(0, dtype=np.int64)  # rows of shard 0s charged to the primary budget: ``reserve``
        self.charged_names: list[bytes] = []  # and their names
        self.staged_at = 0.0

    def key(self, i: int) -> bytes:
        return self.keys[i * self.klen : (i + 1) * self.klen]

    def rows(self, status: int) -> np.ndarray:
        return np.flatnonzero(self.status == int(status))  # a plain int: numpy probes an IntEnum (~3 us)

    def holds_any(self) -> bool:
        """Whether any row is reserved (OK) or already stored (EXISTS): the batch has something to commit."""
        return bool(((self.status == _OK) | (self.status == _EXISTS)).any())

    def name_shards(self, tenant: str) -> None:
        """Set ``tenant`` and ``name_rows``: tenant/key/index of every row, as one table."""
        self.tenant = tenant
        self.name_rows = name_table(tenant_prefix(tenant), self.keys, self.klen, self.index)

    def shard_name(self, i: int) -> bytes:
        """Row ``i``'s shard name (for a shard 0, its key in the primary budget's charges)."""
        return self.name_rows[i].tobytes()

    def plan(self, fd_of: Callable[[int], int]) -> np.ndarray:
        """Where each shard's bytes go, as ``_native.recv_to_files`` takes it: (fd, offset, length, stride)
        rows; shards not reserved (fd -1) are received and dropped."""
        plan = np.zeros((self.n, 4), dtype=np.int64)
        plan[:, 0] = -1
        plan[:, 2] = plan[:, 3] = self.length
        for size_class, rows in by_class(self.size_class, self.rows(_OK)):
            plan[rows, 0] = fd_of(size_class)
            plan[rows, 1] = self.slot[rows] * SIZE_CLASSES[size_class]
            plan[rows, 3] = SIZE_CLASSES[size_class]
        return plan

    def slot_records(self, rows: np.ndarray, now: float, ttl_id: int) -> tuple[np.ndarray, zip]:
        """The COMMITTED shard records of ``rows`` as the name index keeps them (``RECORD``, TTL class ``ttl_id``),
        in row order, and what ``slots`` gets for them: (LMDB key, ``_slot_value``) pairs in slot order (a put's
        records land in neighbouring B-tree pages). One table (name length, name, record) a call; after
        ``name_shards``."""
        cls = self.ttl_class.encode()
        width = self.name_rows.shape[1]
        table = np.zeros(len(rows), dtype=_slot_value_dtype(width, len(cls)))
        table["len"] = width
        table["name"] = self.name_rows[rows]
        rec = table["rec"]
        rec["state"] = COMMITTED
        rec["index"] = self.index[rows]
        rec["size_class"] = classes = self.size_class[rows]
        rec["slot"] = slots = self.slot[rows]
        rec["length"] = self.length[rows]
        rec["crc"] = self.crc[rows]
        rec["block_len"] = self.block_len[rows]
        # a repair rewrites a shard with its block's creation time: it expires with the block, and a removal's
        # DELETE (``before`` its time) takes it
        rec["created"] = self.created[rows] if self.created is not None else now
        rec["header"] = np.frombuffer(self.digests, dtype=np.uint8).reshape(self.n, HEADER_BYTES)[rows]
        rec["ttl"] = np.frombuffer(cls, dtype=np.uint8)
        records = np.empty(len(rows), dtype=RECORD)
        for field in _SHARD_FIELDS:
            records[field] = rec[field]
        records["ttl"] = ttl_id
        place = classes << 32 | slots
        if (place[1:] < place[:-1]).any():  # usually in order already: slots are handed out ascending
            order = np.argsort(place, kind="stable")
            table, classes, slots = table[order], classes[order], slots[order]
        return records, zip(_slot_keys(classes, slots), table.view(f"V{table.dtype.itemsize}").tolist(), strict=True)

    def pending_record(self, i: int) -> ShardRecord:
        """Row ``i`` as the record it becomes at COMMIT (``stat`` shows pending shards this way)."""
        header = self.digests[i * HEADER_BYTES : (i + 1) * HEADER_BYTES]
        return ShardRecord(
            PENDING, int(self.index[i]), int(self.size_class[i]), int(self.slot[i]), int(self.length[i]),
            int(self.crc[i]), int(self.block_len[i]), self.staged_at, header, self.ttl_class,
        )  # fmt: skip


@functools.cache
def _shard_dtype(ttl_len: int) -> np.dtype:
    """``_SHARD`` + the TTL class name as a numpy record (packed, little-endian): the name index's ``RECORD``
    with the name in place of its id; made once per length."""
    kinds = [RECORD.fields[field][0] for field in _SHARD_FIELDS]
    return np.dtype({"names": [*_SHARD_FIELDS, "ttl"], "formats": [*kinds, (np.uint8, ttl_len)]})


def holds_record(index: np.ndarray) -> np.ndarray:
    """Per shard index, whether its holder keeps the block record (``RECORD_HOLDERS``: shards 0, 1 and 2), by
    one comparison (``np.isin`` costs ~25 us on a small array)."""
    return index < RECORD_HOLDERS


@functools.cache
def _slot_value_dtype(name_len: int, ttl_len: int) -> np.dtype:
    """``_slot_value`` as a numpy record: the name's length, the name, the packed shard record."""
    return np.dtype([("len", "<u2"), ("name", np.uint8, (name_len,)), ("rec", _shard_dtype(ttl_len))])


# what a COMMIT asks per row of its PUT
DROP, COMMIT, KEEP = 0, 1, 2
_CLASS_BYTES = np.asarray(SIZE_CLASSES, dtype=np.int64)


class _OldestLive(dict[str, float]):
    """Per TTL class, the oldest creation time still live at ``now`` (+inf for a class without a TTL: nothing
    of an unknown class is live), worked out once per class a call meets."""

    def __init__(self, now: float, ttl_s: Callable[[str], float | None]) -> None:
        super().__init__()
        self.now, self.ttl_s = now, ttl_s

    def __missing__(self, ttl_class: str) -> float:
        ttl = self.ttl_s(ttl_class)
        self[ttl_class] = oldest = self.now - ttl if ttl is not None else math.inf
        return oldest


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
        quotas: Mapping[str, float] | None = None,
        max_disk_fraction: float = 1.0,
        max_headroom_bytes: int | None = None,
        unconfirmed_share: float = 0.1,
    ) -> None:
        """Open (or create) the data dir. Raises ``MetadataError`` when its LMDB cannot be read (corrupt,
        truncated, not LMDB): nothing is changed then; ``NoSpace`` when the disk is full and the data dir needs
        writing to be opened (a new one, or one of an older layout). On a full disk an existing data dir opens with
        writes refused (``kvstore.node.disk``), its reads served. ``max_disk_fraction``, ``max_headroom_bytes``:
        the headroom the slab files leave free (:class:`~kvtier.kvstore.node.disk.DiskBudget`).
        ``unconfirmed_share``: of the capacity, what one tenant's shards other than shard 0s may take while their
        primary has not confirmed them (:mod:`~kvtier.kvstore.node.unconfirmed`)."""
        self.data_dir = Path(data_dir)
        self.capacity_bytes = capacity_bytes
        # what the blocks this node is primary for may take on every node of its group (capacity / 12)
        self.primary_budget_bytes = capacity_bytes // 12 if primary_budget_bytes is None else primary_budget_bytes
        self.shares = TenantShares(quotas or {})  # each tenant's share of that budget
        self.grace_s = grace_s
        self.room_wait_s = room_wait_s
        self.high_watermark = high_watermark
        self.on_high_watermark: Callable[[], None] | None = None  # wakes the GC worker
        self.unconfirmed_cap_bytes = int(capacity_bytes * unconfirmed_share)
        self.on_unconfirmed: Callable[[], None] | None = None  # wakes the GC worker to have shards confirmed
        # makes room within this primary's budget by evicting unpinned blocks (the GC's evictor), called without
        # the lock as make_room(writer tenant, committed): while a write is pending only the writer's own blocks
        # may go, once it is committed others' beyond their shares too (quotas)
        self.make_room: Callable[[str, bool], None] | None = None
        self.clock = clock
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified whenever used bytes may have dropped
        meta = self.data_dir / "meta"
        meta.mkdir(parents=True, exist_ok=True)
        self.refusals = Refusals(self.data_dir)  # writes refused for lack of disk: counted, logged once
        self.disk = DiskBudget(self.data_dir, max_disk_fraction, max_headroom_bytes)
        # a data dir without metadata is new (or was wiped): the blocks it should hold are rebuilt from its peers
        self.fresh = not (meta / "data.mdb").exists()
        try:
            self._open(meta)
        except lmdb.Error as exc:
            if _disk_full(exc):
                raise NoSpace(f"no room on the disk to open its metadata {meta / 'data.mdb'}") from None
            raise MetadataError(meta / "data.mdb", exc) from None
        except _DAMAGED as exc:  # a record that does not decode, or says what cannot be
            raise MetadataError(meta / "data.mdb", exc) from None

    def _open(self, meta: Path) -> None:
        # writemap: a transaction writes its pages in the map instead of copying them into malloc'd pages and
        # writing those at commit (half the cost of a put-sized batch of random keys); a killed process still
        # loses nothing, since the map's pages are the page cache's
        self.env = lmdb.open(
            str(meta),
            map_size=1 << 36,
            max_dbs=16,  # 7 tables, and up to 3 of an older data dir while they are moved
            sync=False,
            metasync=False,
            lock=True,
            writemap=True,
        )
        try:
            self.meta_room = MetaRoom(self.env, meta / "data.mdb")
            self._load()
        except (lmdb.Error, NoSpace, *_DAMAGED):
            self.env.close()
            raise

    def _load(self) -> None:
        """Open the tables and rebuild the in-memory state from them (reading every record: a corrupt page
        shows up here, at open)."""
        # shard records keyed by where their bytes are (size class, slot), so that a put's records, which take
        # adjacent slots, go into a few neighbouring B-tree pages instead of one random page each; the name ->
        # record index lives in memory (``_index``, rebuilt from this table at open)
        self.slots_db = self.env.open_db(b"slots")
        self.settings_db = self.env.open_db(b"settings")
        freed_db = self.env.open_db(b"freed")  # marks of shard records left in place after a delete
        self.used_bytes = 0  # slots holding shards, reserved, or in their grace time after a delete
        self.lru = TenantLru()  # block records this node is primary for, each tenant's least recently used first
        self._accessed: dict[bytes, float] = {}  # last-access times not yet written to LMDB
        # shard 0s reserved or PENDING here (blocks this node will be primary for once committed): charged to their
        # tenant's use of the primary budget from reservation on (kvstore.node.charges)
        self._charges = Charges()
        # shards other than shard 0s, reserved or committed here, that their primary has not confirmed yet
        self.unconfirmed = UnconfirmedShards()
        self._pending: dict[tuple[str, bytes], WriteBatch] = {}  # staged batches by (tenant, put id)
        self._settled: OrderedDict[tuple[str, bytes], bytes] = OrderedDict()  # recent COMMIT answers
        # committed shard records by name (tenant/key/index): what ``slots`` holds
        self._index = ShardIndex()
        used: dict[int, set[int]] = {}
        names: list[bytes] = []
        packed: list[bytes] = []
        # dead records (their shards were deleted; see dead_slots), and PENDING records an older node left in
        # LMDB (writes that were never committed): deleted now, so every record left is a live shard
        abandoned = []
        # on a disk with no room for the clean-up below (nor for the writes that would fail at once anyway) the data
        # dir opens as it is: dead and abandoned records stay until a start with room, and reads are served
        try:
            self.meta_room.ensure(_TXN_BYTES)
            writable = True
        except NoSpace as exc:
            writable = False
            self.refusals.refused("writes", str(exc))
        with self.env.begin(write=True) as txn:
            if not writable and (self.fresh or any(txn.get(old) is not None for old in _OLD_TABLES)):
                raise NoSpace(f"no room on the disk to prepare its metadata {self.data_dir / 'meta'}")
            self._move_named_records(txn)
            self.removal_log = RemovalLog(self.env, txn)  # removals whose DELETEs not every holder answered yet
            self.owed = OwedRepairs(self.env, txn)  # blocks short of shards that this node repairs
            self.owed.check(txn)
            _check_settings(txn, self.settings_db)
            self.block_table, held = BlockTable.open(self.env, txn)  # block records (primary, and the copies)
            self.dead_slots = DeadSlots(freed_db)
            dead = self.dead_slots.take_all(txn) if writable else self.dead_slots.read_all(txn)
            for where, raw in txn.cursor(db=self.slots_db):
                name, raw_record = _unpack_slot_value(raw)
                rec = ShardRecord.unpack(raw_record)
                _check_shard(bytes(where), name, rec)
                if rec.state == PENDING or (dead and (rec.size_class, rec.slot) in dead):
                    abandoned.append(bytes(where))
                    continue
                names.append(name)
                packed.append(raw_record)
                used.setdefault(rec.size_class, set()).add(rec.slot)
                self.used_bytes += SIZE_CLASSES[rec.size_class]
            for where in abandoned if writable else ():
                txn.delete(where, db=self.slots_db)
            if self.fresh:
                txn.put(REBUILD.encode(), _TIME.pack(self.clock()), db=self.settings_db)  # until rebuilt
            self._index.add_packed(names, packed)
            blocks = sorted(((bkey, BlockRecord.unpack(raw)) for bkey, raw in held), key=lambda kb: kb[1].last_access)
            own, shard_0 = self._index.lookup_names([bkey + b"\x00" for bkey, _ in blocks])
            sizes = _CLASS_BYTES[shard_0["size_class"]].tolist()
            for (bkey, block), primary, size in zip(blocks, own.tolist(), sizes, strict=True):
                if primary:  # primary here (a record without shard 0 is a copy: shard 1's or 2's holder)
                    self.lru.insert(bkey, size, block.last_access, block.ttl_class, block.created)
        self.slabs = SlabFiles(self.data_dir / "slabs", self.disk)
        _check_slots_in_files(self.slabs.directory, used)
        self.slabs.rebuild(used)
        self._rebuilding = self.rebuild_pending() is not None
        if writable:  # (a start without room for the metadata said so already)
            try:
                self.disk.check(0)
            except NoSpace as exc:  # said at start: new shards will be refused until there is room
                self.refusals.refused("new shards", str(exc))

    def _move_named_records(self, txn: lmdb.Transaction) -> None:
        """Shard records of a data dir written before they were keyed by slot (a ``shards`` table keyed by
        name) move into ``slots``, once."""
        if txn.get(b"shards") is None:
            return
        named = self.env.open_db(b"shards", txn=txn)
        moved = [(_where(bytes(raw)), _slot_value(bytes(name), bytes(raw))) for name, raw in txn.cursor(db=named)]
        txn.cursor(db=self.slots_db).putmulti(moved)
        txn.drop(named, delete=True)

    # -- writes ---------------------------------------------------------------------------------------

    def reserve(self, tenant: str, batch: WriteBatch) -> None:
        """Set aside a slot for every shard of ``batch`` (filling its ``status``, ``size_class``, ``slot``); the
        caller fills the slots (``batch.plan``) and their ``crc``, then calls ``stage`` (or ``cancel``).

        Per row: OK (a slot is reserved; its bytes count as used until committed or given back), ``EXISTS``
        (a committed shard is already stored; nothing to write, unless ``batch.replace``: repair rewriting a
        corrupt one) or ``NO_SPACE``.

        Making room (docs/design.md §6): a shard 0 makes this node the block's primary, so it is charged to
        the writer's use of the primary budget at once. The write is not committed, so a charge that takes the
        budget over makes room (``make_room``) only from the writer's own least recently used blocks, and only as
        far as the writer holds more than its share: a PUT never committed evicts nothing of another tenant. The
        rest of the room is made at ``commit``. Then, when the node itself has no room, the call waits (at most
        ``room_wait_s``) for removals under way to free it; what still does not fit is ``NO_SPACE``.
        """
        batch.name_shards(tenant)
        with self._lock:
            if not batch.replace:
                batch.status[self._index.contains(batch.name_rows)] = _EXISTS
            batch.charged = np.flatnonzero((batch.index == 0) & (batch.status == _OK))
            batch.charged_names = table_names(batch.name_rows[batch.charged])
            sizes = _CLASS_BYTES[batch.size_class[batch.charged]].tolist()
            self._charges.charge(tenant, batch.charged_names, sizes)
        if self.primary_excess(tenant) > 0 and self.make_room is not None:
            self.make_room(tenant, False)
        with self._lock:
            self._charge_unconfirmed(tenant, batch)
            rows = batch.rows(_OK)
            sizes = _CLASS_BYTES[batch.size_class[rows]]
            needed = int(sizes.sum())
            self._wait_for_room(needed)
            if self.used_bytes + needed > self.capacity_bytes:
                fits = self.used_bytes + np.cumsum(sizes) <= self.capacity_bytes
                for i in rows[~fits].tolist():
                    self._refuse(batch, i)
                rows = rows[fits]
                needed = int(sizes[fits].sum())
            try:  # its COMMIT's records must fit in the metadata: refused now, before the payload, if not
                self.meta_room.ensure(_txn_bytes(len(rows)))
            except NoSpace as exc:
                self.refusals.refused("writes", str(exc))
                for i in rows.tolist():
                    self._refuse(batch, i)
                rows, needed = rows[:0], 0
            self.used_bytes += needed
            for size_class, mine in by_class(batch.size_class, rows):
                try:
                    batch.slot[mine] = self.slabs.allocate(size_class, len(mine))
                except NoSpace as exc:  # the disk under the slabs is full, or as full as it may be
                    self.refusals.refused("new shards", str(exc))
                    self.used_bytes -= len(mine) * SIZE_CLASSES[size_class]
                    for i in mine.tolist():
                        self._refuse(batch, i)
                else:
                    self.refusals.room()
            over_high = self.used_bytes - self.freeing_bytes > self.capacity_bytes * self.high_watermark
            if over_high and self.on_high_watermark is not None:
                self.on_high_watermark()

    def _refuse(self, batch: WriteBatch, i: int) -> None:
        """Mark row ``i`` NO_SPACE, giving back its charge (a primary's, or as unconfirmed)."""
        batch.status[i] = _NO_SPACE
        if batch.index[i] == 0:
            self._charges.uncharge(batch.tenant, [batch.shard_name(i)])
        else:
            self.unconfirmed.release(batch.tenant, SIZE_CLASSES[int(batch.size_class[i])])

    def _charge_unconfirmed(self, tenant: str, batch: WriteBatch) -> None:
        """With the lock held: charge the batch's shards other than shard 0s to ``tenant`` as unconfirmed. While its
        unconfirmed shards pass the cap, wait (at most ``room_wait_s``, the GC worker woken to ask about them); then
        refuse those shards NO_SPACE if its denied shards alone pass the cap (:mod:`~kvtier.kvstore.node.unconfirmed`:
        a writer the GC worker has fallen behind waits, and is not refused). Nothing is capped without a GC worker
        to confirm shards (``on_unconfirmed``)."""
        rows = np.flatnonzero((batch.status == _OK) & (batch.index != 0))
        cap, wake, held = self.unconfirmed_cap_bytes, self.on_unconfirmed, self.unconfirmed
        if len(rows) and wake is not None and held.bytes_of(tenant) > cap:
            deadline = time.monotonic() + self.room_wait_s
            while held.bytes_of(tenant) > cap and (left := deadline - time.monotonic()) > 0:
                wake()
                self._room.wait(min(left, 0.05))
            if held.denied_of(tenant) > cap:
                batch.status[rows] = _NO_SPACE
                return
        held.reserve(tenant, int(_CLASS_BYTES[batch.size_class[rows]].sum()))

    def tenant_usage(self, writer: str | None = None) -> dict[str, int]:
        """With the lock held: bytes per tenant of the blocks this node is primary for, and the ``writer``'s writes
        in flight (``kvstore.node.charges``: nobody else's)."""
        usage = self.lru.usage()
        if writer is not None:
            usage[writer] = usage.get(writer, 0) + self._charges.pending(writer)
        return usage

    @property
    def pending_primary_bytes(self) -> int:
        """Charges of writes in flight to this primary, every tenant's."""
        return self._charges.total

    @property
    def primary_bytes(self) -> int:
        """What the committed blocks this node is primary for take on each node (what the watermarks look at)."""
        return self.lru.total_bytes

    def primary_excess(self, writer: str | None = None) -> int:
        """Bytes by which this primary's blocks exceed its budget (zero or less: within it), as ``writer`` sees it:
        with its own writes in flight, not others'."""
        own = self._charges.pending(writer) if writer is not None else 0
        return self.primary_bytes + own - self.primary_budget_bytes

    def _over_share(self, writer: str) -> int:
        """With the lock held: bytes by which ``writer``'s blocks and writes in flight exceed its share of the
        budget (zero or less: within it)."""
        usage = self.tenant_usage(writer)
        return usage[writer] - int(self.shares.entitled(self.primary_budget_bytes, usage)[writer])

    def _wait_for_room(self, needed: int) -> None:
        """With the lock held: wait until ``needed`` more bytes fit, at most ``room_wait_s`` (removals under way
        elsewhere, slots pinned by replies being sent, or slots in their grace time free room)."""
        if self.slabs.quarantine:
            self.used_bytes -= self.slabs.reap(self.clock())
        if self.used_bytes + needed <= self.capacity_bytes:
            return
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

    def stage(self, tenant: str, put_id: bytes, batch: WriteBatch) -> None:
        """The batch's shards are in their slots (``crc`` set): they wait, PENDING, for the writer's COMMIT.

        Pending writes live in memory only: a node that restarts before the COMMIT has simply not stored
        them (their slots were never recorded, so they are free), and the writer's COMMIT answers MISSING.
        A pending batch of the same ``put_id`` (a resent PUT) is replaced and its slots given back.

        Shard 0s that leave the writer over the budget and over its own share, after the reservation made what
        room it could from the writer's own blocks, are ``NO_SPACE`` (nothing more of its own could be evicted:
        every slot pinned by reads in flight or held by its pending writes) and their slots are given back. A
        writer within its share keeps them: room is made from other tenants' blocks beyond their shares when the
        write commits, not before.
        """
        batch.staged_at = self.clock()
        primaries = batch.charged[batch.status[batch.charged] == _OK]  # refused ones are uncharged already
        with self._lock:
            excess = min(self.primary_excess(tenant), self._over_share(tenant)) if len(primaries) else 0
            if excess > 0:
                refused = []
                for i in reversed(primaries[batch.status[primaries] == _OK].tolist()):
                    refused.append(i)
                    excess -= self._charges.size_of(batch.shard_name(i))
                    if excess <= 0:
                        break
                self._give_back(batch, np.asarray(refused, dtype=np.int64))
                batch.status[refused] = _NO_SPACE
            old = self._pending.pop((tenant, put_id), None)
            if old is not None:
                self._give_back(old, old.rows(_OK))
            self._pending[(tenant, put_id)] = batch

    def cancel(self, batch: WriteBatch) -> None:
        """Give back the slots of a batch whose shards never arrived (the writer went away)."""
        with self._lock:
            self._give_back(batch, batch.rows(_OK))

    def _give_back(self, batch: WriteBatch, rows: np.ndarray) -> None:
        """With the lock held: free reserved slots that no record names (never visible: reusable at once)."""
        if not len(rows):
            return
        for i in rows.tolist():
            size_class = int(batch.size_class[i])
            self.used_bytes -= SIZE_CLASSES[size_class]
            self.slabs.release_now(size_class, int(batch.slot[i]))
            if batch.index[i] == 0:
                self._charges.uncharge(batch.tenant, [batch.shard_name(i)])
            else:
                self.unconfirmed.release(batch.tenant, SIZE_CLASSES[size_class])
        batch.status[rows] = _MISSING
        self._room.notify_all()

    def commit(
        self, tenant: str, put_id: bytes, action: np.ndarray | None = None, missing: np.ndarray | None = None
    ) -> bytes | None:
        """Settle a staged batch: per row, ``COMMIT`` (the default for every row), ``DROP`` or ``KEEP``
        (still pending; the GC asks again later). Returns per row ``OK`` (committed: the shard record is
        written, and at the holders of shards 0, 1 and 2 the block record, the primary's making the block
        visible) or ``MISSING``; None when no batch ``put_id`` is pending. Raises ValueError, changing nothing,
        when ``action`` or ``missing`` does not have a row per shard of the batch.

        ``missing`` (per row, a bit for each of the block's 12 shards that the writer could not store): the
        primary owes the repair of a block it commits short of shards (``owed_repairs``).

        All records go in one LMDB transaction. A shard committed meanwhile under the same name by another
        writer is kept and this batch's copy given back; ``batch.replace`` (repair) replaces it instead.
        """
        now = self.clock()
        indexed: list[BlockEntry] = []
        with self._lock:
            batch = self._pending.get((tenant, put_id))
            if batch is None:
                return self._settled.get((tenant, put_id))
            if action is None:
                action = np.full(batch.n, COMMIT, dtype=np.uint8)
            for named in (action, missing):
                if named is not None and len(named) != batch.n:
                    raise ValueError(f"the put holds {batch.n} shards here, the commit names {len(named)}")
            status, committing = batch.status, action == COMMIT
            out = np.full(batch.n, _MISSING, dtype=np.uint8)
            write = np.flatnonzero((status == _OK) & committing)
            again = np.flatnonzero((status == _EXISTS) & committing)
            try:
                room = self._writing(_txn_bytes(batch.n))
            except NoSpace:  # nothing of it can be recorded: every shard given back, NO_SPACE to the writer
                self._give_back(batch, batch.rows(_OK))
                return self._settle(tenant, put_id, np.full(batch.n, _NO_SPACE, dtype=np.uint8))
            with room as txn:
                if len(write):
                    self._write_shards(txn, batch, write, now)
                    self._await_confirmation(tenant, batch, write[status[write] == _OK], now)
                    out[write] = _OK
                if len(again):  # already committed at PUT time: still there?
                    out[again[self._index.contains(batch.name_rows[again])]] = _OK
                holders = np.flatnonzero((out == _OK) & holds_record(batch.index))
                if len(holders):
                    self._write_block_records(txn, tenant, batch, holders, now, indexed)
                if missing is not None:
                    short = np.flatnonzero((out == _OK) & (batch.index == 0) & (missing != 0))
                    prefix = tenant_prefix(tenant)
                    owed = [Owed(prefix + batch.key(i), now, int(missing[i])) for i in short.tolist()]
                    self.owed.add(txn, owed)
            if indexed:  # shard 0s' pending charges move into the LRU index
                self._charges.uncharge(tenant, [entry.key + b"\x00" for entry in indexed])  # type: ignore[operator]
                self.lru.insert_entries(tenant, indexed)
            over = bool(indexed) and self.primary_excess() > 0
            status[write] = _MISSING  # the records own these slots now
            pending = status == _OK  # rows left reserved: dropped or kept
            if pending.any():
                self._give_back(batch, np.flatnonzero(pending & (action == DROP)))
                pending &= action == KEEP
            answer = out.tobytes() if pending.any() else self._settle(tenant, put_id, out)
        if over and self.make_room is not None:  # committed: it counts for everyone now, and takes its room
            self.make_room(tenant, True)
        return answer

    def _writing(self, need_bytes: int = _TXN_BYTES) -> lmdb.Transaction:
        """With the lock held: a write transaction, once LMDB's file has room for ``need_bytes`` more of its pages
        (``disk.MetaRoom``: LMDB stores into its mapped file, and a page the disk has no block for is a SIGBUS).
        NoSpace, counted and logged once an episode, when it has not: nothing is written."""
        try:
            self.meta_room.ensure(need_bytes)
        except NoSpace as exc:
            self.refusals.refused("writes", str(exc))
            raise
        return self.env.begin(write=True)

    def _settle(self, tenant: str, put_id: bytes, out: np.ndarray) -> bytes:
        """With the lock held: the put is settled with the answers ``out`` (kept for a COMMIT resent later)."""
        del self._pending[(tenant, put_id)]
        self._settled[(tenant, put_id)] = answer = out.tobytes()
        while len(self._settled) > SETTLED_KEPT:
            self._settled.popitem(last=False)
        return answer

    def _await_confirmation(self, tenant: str, batch: WriteBatch, committed: np.ndarray, now: float) -> None:
        """With the lock held: the batch's shards other than shard 0s committed now, charged as unconfirmed since
        their reservation, wait for their primary's word (``settle_unconfirmed``)."""
        rows = committed[batch.index[committed] != 0]
        if len(rows):
            sizes = _CLASS_BYTES[batch.size_class[rows]].astype(np.int64)
            self.unconfirmed.add(tenant, Unconfirmed(batch.name_rows[rows].copy(), sizes, now))

    def unconfirmed_due(self, before: float) -> list[tuple[str, Unconfirmed]]:
        """Shards committed before ``before`` that their primary has not confirmed yet, per tenant, to be asked about
        (``GCWorker.confirm_shards``) and settled (``settle_unconfirmed``)."""
        with self._lock:
            return self.unconfirmed.due(before)

    def settle_unconfirmed(self, tenant: str, shards: Unconfirmed, live: np.ndarray, orphan_before: float) -> int:
        """What the primaries said of ``shards``' blocks (``live``: 1 live, 0 not, -1 unknown, per row): live ones
        are confirmed, those not live and committed before ``orphan_before`` are orphans and removed, those removed
        here meanwhile (an evicted block's) are charged no more, the rest wait for the next pass (denied, when the
        primaries said not live). Returns how many orphans were removed."""
        with self._lock:
            # a shard removed here meanwhile (its block evicted, deleted or dropped) takes no room any more
            present = self._index.contains(shards.names)
            orphan = present & (live == 0) & (shards.at < orphan_before)
            self.unconfirmed.settle(tenant, shards, keep=present & (live != 1) & ~orphan, denied=live == 0)
            self._room.notify_all()
        if not orphan.any():
            return 0
        cut = len(tenant_prefix(tenant))
        names = shards.names[orphan]
        return self.drop_shards(tenant, list(zip(table_names(names[:, cut:-1]), names[:, -1].tolist(), strict=True)))

    def _write_shards(self, txn: lmdb.Transaction, batch: WriteBatch, rows: np.ndarray, now: float) -> None:
        """Shard records of ``rows`` in one ``putmulti``, in slot order; a record another writer committed
        meanwhile (or an earlier row of this batch of the same name) wins and this row's slot is given back,
        unless the batch replaces (repair: the old record goes and its slot is released). The name index
        changes only if the LMDB writes succeed."""
        names = batch.name_rows[rows]
        if batch.replace:
            self._free_records(txn, names)
        ttl = self._index.ttl_id(batch.ttl_class)
        records, items = batch.slot_records(rows, now, ttl)
        lost = self._index.insert(names, records)
        try:
            if lost.any():
                self._give_back(batch, rows[lost])
                rows = rows[~lost]
                _, items = batch.slot_records(rows, now, ttl)
            for size_class, mine in by_class(batch.size_class, rows):
                self.dead_slots.clear(txn, size_class, batch.slot[mine].astype(np.int64))
            txn.cursor(db=self.slots_db).putmulti(items)  # a dead record in a reused slot is overwritten
        except BaseException:
            self._index.remove(names[~lost])
            raise

    def _write_block_records(
        self,
        txn: lmdb.Transaction,
        tenant: str,
        batch: WriteBatch,
        rows: np.ndarray,
        now: float,
        indexed: list[BlockEntry],
    ) -> None:
        """Block records of ``rows`` (shard 0, 1 or 2 held here); a re-put keeps the block's ``created``. Shard 0s
        are added to ``indexed`` for the LRU index (inserted once the transaction has committed). The records are
        packed as one table per parent length (per row in Python it cost ~13 us a row on a busy node, and
        4 us a row alone before they were one table with their LMDB values: 0.86 against 0.4 ms for a 64 KiB
        put's 255 records at a node)."""
        picked = rows.tolist()
        bkeys = table_names(batch.name_rows[rows, :-1])  # tenant/key
        old = {bkey: _BLOCK.unpack_from(raw)[1] for bkey, raw in self.block_table.get_many(txn, bkeys).items()}
        given = batch.created[rows].tolist() if batch.created is not None else [now] * len(picked)
        created = [old.get(bkey, c) for bkey, c in zip(bkeys, given, strict=True)] if old else given
        parents = [batch.parents[i] for i in picked]
        table = np.empty(len(picked), dtype=_BLOCK_DTYPE)
        table["block_len"] = batch.block_len[rows]
        table["created"] = created
        table["last_access"] = now
        table["header"] = np.frombuffer(batch.digests, dtype=_BLOCK_DTYPE["header"])[rows]
        table["ns"] = np.frombuffer(batch.ns, dtype=_BLOCK_DTYPE["ns"])
        table["parent_len"] = list(map(len, parents))
        cls = np.frombuffer(batch.ttl_class.encode(), dtype=np.uint8)
        fixed = table.view(np.uint8).reshape(len(picked), _BLOCK.size)
        lengths = table["parent_len"]
        for length in np.unique(lengths).tolist():  # one or two: a chain's first block has the ns as parent
            same = np.flatnonzero(lengths == length)
            values = np.empty((len(same), _BLOCK.size + length + len(cls)), dtype=np.uint8)
            values[:, : _BLOCK.size] = fixed[same]
            values[:, _BLOCK.size : _BLOCK.size + length] = np.frombuffer(
                b"".join(parents[j] for j in same.tolist()), dtype=np.uint8
            ).reshape(len(same), length)
            values[:, _BLOCK.size + length :] = cls
            self.block_table.put_rows(txn, batch.name_rows[rows[same], :-1], values)
        sizes = _CLASS_BYTES[batch.size_class[rows]].tolist()
        for j in np.flatnonzero(batch.index[rows] == 0).tolist():
            indexed.append(BlockEntry(bkeys[j], sizes[j], now, batch.ttl_class, float(created[j])))

    def store(self, tenant: str, batch: WriteBatch, payloads: Sequence[bytes | memoryview]) -> bytes:
        """``reserve``, write, ``stage`` and ``commit`` in one call, for shards already in memory; returns the
        commit's statuses (EXISTS rows count as OK when still stored)."""
        self.reserve(tenant, batch)
        for i in batch.rows(_OK).tolist():
            self.slabs.write(int(batch.size_class[i]), int(batch.slot[i]), payloads[i])
            batch.crc[i] = _native.crc32c(payloads[i])
        put_id = os.urandom(8)
        self.stage(tenant, put_id, batch)
        return self.commit(tenant, put_id) or b""

    def stale_puts(self, before: float) -> list[tuple[str, bytes, WriteBatch]]:
        """Pending batches staged before ``before`` (their writer died, or never committed): (tenant, put id,
        batch); the GC asks their primaries and settles them with ``commit``."""
        with self._lock:
            return [(t, p, b) for (t, p), b in self._pending.items() if b.staged_at < before]

    def pending_shards(self, tenant: str, key: bytes) -> list[ShardRecord]:
        """The shards of ``key`` waiting here for a COMMIT, as the records they would become (for ``stat``)."""
        with self._lock:
            batches = [b for (t, _), b in self._pending.items() if t == tenant]
        return [b.pending_record(i) for b in batches for i in b.rows(Status.OK).tolist() if b.key(i) == key]

    def _release_slots(self, classes: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray) -> None:
        """With the lock held: (``classes[i]``, ``slots[i]``) no record names any more. A slot stays counted as used
        until its grace time (``grace_s``, default none) has passed and no reply pins it (without either it is free
        at once); writers waiting for room are woken."""
        now = self.clock()
        self.used_bytes -= self.slabs.release(classes, slots, now + self.grace_s, now)
        if len(slots):
            self._room.notify_all()

    def reap(self) -> None:
        """Return slots whose grace time has passed to the free lists."""
        with self._lock:
            self.used_bytes -= self.slabs.reap(self.clock())

    @property
    def freeing_bytes(self) -> int:
        """Used bytes already deleted and waiting out their grace time."""
        return self.slabs.quarantined_bytes

    def delete(
        self, tenant: str, keys: Sequence[bytes], before: float | None = None, index: np.ndarray | None = None
    ) -> int:
        """Remove the block records of ``keys`` (the primary's, or a copy), then their shards; returns
        how many shards were removed. With ``before`` (an eviction's time), records and shards written later
        are left alone: a block stored again since it was evicted is not touched by the eviction's DELETE.
        ``index`` (per key, the shard this node holds by the placement) makes it one batched lookup; a key
        whose shard is not found there is searched among all its shards here. NoSpace (nothing removed) when the
        metadata has no room to record it."""
        with self._lock, self._writing(_txn_bytes(len(keys))) as txn:
            return self._delete_locked(txn, tenant, keys, before, index)

    def _delete_locked(
        self,
        txn: lmdb.Transaction,
        tenant: str,
        keys: Sequence[bytes],
        before: float | None,
        index: np.ndarray | None = None,
    ) -> int:
        prefix = tenant_prefix(tenant)
        tables: list[np.ndarray] = []  # shard names to look up, a table per key length
        if index is not None and len(set(map(len, keys))) == 1:  # one lookup per key, at the placement's index
            names = name_table(prefix, b"".join(keys), len(keys[0]), index)
            found = self._index.contains(names)
            tables.append(names[found])
            # block records are kept only where shard 0 or 1 is (and wherever a shard is not where expected)
            holders = [prefix + keys[j] for j in np.flatnonzero(holds_record(index)).tolist()]
            unsure = [keys[j] for j in np.flatnonzero(~found).tolist()]
            holders += [prefix + key for key in unsure]
        else:
            unsure = list(keys)
            holders = [prefix + key for key in keys]
        for klen in sorted(set(map(len, unsure))):  # any shard such a key has here
            tables.append(every_shard(prefix, [key for key in unsure if len(key) == klen]))
        if holders:
            self._delete_block_records(txn, tenant, holders, before)
        removed = 0
        for names in tables:
            if before is not None:  # not shards written after the removal (a re-put since)
                present, records = self._index.lookup(names)
                names = names[present & (records["created"] <= before)]
            removed += self._free_records(txn, names)
        return removed

    def _free_records(self, txn: lmdb.Transaction, names: np.ndarray) -> int:
        """With the lock held, in ``txn``: the committed shards among ``names`` (a name table) are deleted: out of
        the index, their records marked dead (left in LMDB until their slots are reused), their slots released.
        Returns how many there were (a name listed twice counts once)."""
        found, records = self._index.remove(names)
        records = records[found]
        classes, slots = records["size_class"].astype(np.int64), records["slot"].astype(np.int64)
        for size_class, mine in by_class(classes, np.arange(len(slots))):
            self.dead_slots.mark(txn, size_class, slots[mine])
        self._release_slots(classes, slots)
        return len(records)

    def _delete_block_records(
        self, txn: lmdb.Transaction, tenant: str, bkeys: list[bytes], before: float | None
    ) -> None:
        """With the lock held: delete the block records ``bkeys`` of ``tenant`` that are here (and not created
        after ``before``), and their LRU entries."""
        table = self.block_table
        if before is not None:  # not those created after the removal (a re-put since)
            stored = table.get_many(txn, bkeys)
            bkeys = [bkey for bkey, raw in stored.items() if _BLOCK.unpack_from(raw)[1] <= before]
        gone = table.delete_many(txn, bkeys)
        self.lru.remove_many(tenant, gone)  # type: ignore[arg-type]
        for bkey in gone:
            self._accessed.pop(bkey, None)

    def remove_blocks(self, tenant: str, keys: Sequence[bytes]) -> Removal:
        """The primary's half of removing blocks (eviction, expiry): in one transaction, delete the records and
        this node's shards and write the removal's intent (one record for all of ``keys``). The blocks are
        invisible from here on; the caller then has every other holder delete its shard (``before`` the
        removal's time) and clears the intent (``clear_removal``) once all of them answered. Intents left by
        a crash are replayed (``removals``). NoSpace (nothing removed) when the metadata has no room for it."""
        with self._lock, self._writing(_txn_bytes(len(keys))) as txn:
            now = self.clock()
            self._delete_locked(txn, tenant, keys, None, np.zeros(len(keys), dtype=np.int64))
            return self.removal_log.add(txn, tenant, list(keys), now)

    def removals(self) -> list[Removal]:
        """Removals whose DELETEs have not reached every holder yet, oldest first."""
        with self.env.begin() as txn:
            return self.removal_log.pending(txn)

    def clear_removal(self, removal: Removal) -> None:
        """Every holder answered ``removal``'s DELETE: forget its intent."""
        with self._lock, self._writing() as txn:
            self.removal_log.clear(txn, removal)

    def eviction_candidates(
        self, writer: str | None = None, committed: bool = True, headroom: int = 0, needed: int | None = None
    ) -> list[bytes]:
        """Blocks this primary should remove (keys as in the LRU index) to free ``needed`` bytes of its budget
        (default: what it is over by) and ``headroom`` more, chosen by the tenants' shares
        (:mod:`~kvtier.kvstore.node.quotas`), each tenant's least recently used first, skipping blocks whose shard 0 a
        reply is sending (pinned): their bytes could not be reused now anyway, and a block being read is not
        cold. Fewer than needed when too many are pinned or protected by their shares; none when nothing is
        needed. Blocks of pending writes are not in the index and are never candidates.

        ``writer``: room for a write of that tenant. Before it is ``committed``, only its own blocks, and only as
        far as it holds more than its share; after, other tenants' blocks beyond their shares first, then its own.
        None (the GC keeping headroom): from whoever is furthest over their share.
        """
        with self._lock:
            budget = self.primary_budget_bytes
            needed = self.primary_excess(writer) if needed is None else needed
            if needed <= 0:
                return []
            needed += headroom
            usage = self.tenant_usage(writer)
            entitled = self.shares.entitled(budget, [*usage, *([writer] if writer is not None else [])])
            if writer is None:
                return plan_removals(needed, usage, entitled, self._unpinned, usage, beyond_share=False)
            if not committed:
                own = min(needed, usage.get(writer, 0) - entitled[writer] + headroom * entitled[writer] / budget)
                return plan_removals(int(own), usage, entitled, self._unpinned, [writer], beyond_share=False)
            others = [tenant for tenant in usage if tenant != writer]
            victims = plan_removals(needed, usage, entitled, self._unpinned, others, beyond_share=True)
            needed -= sum(self.lru.get(key).size_bytes for key in victims)  # type: ignore[union-attr]
            return victims + plan_removals(needed, usage, entitled, self._unpinned, [writer], beyond_share=False)

    def _unpinned(self, tenant: str) -> Iterator[tuple[bytes, int]]:
        """With the lock held: (key, size) of the tenant's blocks, least recently used first, except those whose
        shard 0 is pinned (looked up a chunk at a time)."""
        entries = iter(self.lru.tenant(tenant))
        while chunk := list(itertools.islice(entries, _CANDIDATES_LOOKED_UP)):
            found, records = self._index.lookup_names([entry.key + b"\x00" for entry in chunk])  # type: ignore[operator]
            size_class, slot = records["size_class"].astype(np.int64), records["slot"].astype(np.int64)
            pinned = found & self.slabs.pins.pinned(size_class, slot)
            for entry, skip in zip(chunk, pinned.tolist(), strict=True):
                if not skip:
                    yield entry.key, entry.size_bytes  # type: ignore[misc]

    # -- GC support -----------------------------------------------------------------------------------

    def _touch(self, tenant: str, live: list[BlockEntry], ok: np.ndarray, now: float) -> None:
        """With the lock held: the blocks of ``tenant`` in ``live`` whose shard 0 was read (``ok``, a bool each)
        were used at ``now``: in the LRU index now, in LMDB at the next flush."""
        if not live:
            return
        used = live if ok.all() else list(itertools.compress(live, ok.tolist()))
        self.lru.touch_entries(tenant, used, now)
        self._accessed.update(dict.fromkeys([entry.key for entry in used], now))  # type: ignore[misc]

    def flush_access(self) -> int:
        """Write the batched last-access times into the block records; returns how many."""
        with self._lock:
            accessed, self._accessed = self._accessed, {}
            if not accessed:
                return 0
            try:
                room = self._writing(_txn_bytes(len(accessed)))
            except NoSpace:  # (counted and logged) these times are lost; the LRU order in memory stays right
                return 0
            with room as txn:
                self.block_table.stamp_many(txn, accessed, _LAST_ACCESS_AT)
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

    def expired_shards(self, ttl_s: Callable[[str], float | None]) -> list[tuple[str, bytes, int]]:
        """One pass over every shard record (call it rarely): the shards past their class's TTL, each as
        (tenant, key, index)."""
        now = self.clock()
        expired = []
        with self._lock:
            tables = list(self._index.items())
            classes = list(self._index.ttl_classes)
        ttls = [ttl_s(name) for name in classes]  # created before this: expired (an unknown class: everything)
        cutoff = np.asarray([math.inf if ttl is None else now - ttl for ttl in ttls] + [math.inf])
        for names, records in tables:
            for name in table_names(names[records["created"] < cutoff[records["ttl"]]]):
                cut = name.index(b"/")
                expired.append((name[:cut].decode(), name[cut + 1 : -1], name[-1]))
        return expired

    def drop_shards(
        self, tenant: str, items: Sequence[tuple[bytes, int]], still: Callable[[ShardRecord], bool] | None = None
    ) -> int:
        """Remove the committed shards ``items`` for which ``still(record)`` holds when looked at again under the
        lock (a shard written since the caller decided is left alone); returns how many."""
        with self._lock, self._writing(_txn_bytes(len(items))) as txn:
            names = list(dict.fromkeys(shard_key(tenant, key, index) for key, index in items))
            present, records = self._index.lookup_names(names)
            chosen = [
                name
                for name, here, record in zip(names, present.tolist(), records, strict=True)
                if here and (still is None or still(self._shard_record(record)))
            ]
            return sum(self._free_records(txn, table) for _, table in tables_by_width(chosen))

    # -- reads ----------------------------------------------------------------------------------------

    def live_blocks(self, tenant: str, keys: Sequence[bytes], ttl_s: Callable[[str], float | None]) -> list[bool]:
        """Whether each key (all of one length) is a block this node is primary for and that has not expired."""
        flags = self.live_flags(tenant, b"".join(keys), len(keys[0]) if keys else 16, ttl_s)
        return [flag == 1 for flag in flags]

    def live_flags(self, tenant: str, blob: bytes, klen: int, ttl_s: Callable[[str], float | None]) -> bytes:
        """``live_blocks`` of the keys of ``blob`` (``klen`` bytes each, concatenated, as MATCH carries them): a
        byte per key, 1 or 0. Raises ValueError when ``blob`` is not a whole number of keys.

        Answered from the in-memory LRU index, which mirrors the primary's block records (inserted at
        commit, removed with the record, rebuilt from LMDB at start-up): ``match`` never touches disk. While the
        node is ``rebuilding`` a key it has no record of is 2 (unknown: the record may not be back yet).
        """
        prefix = tenant_prefix(tenant)
        flags = self.lru.live_flags(prefix, blob, klen, _OldestLive(self.clock(), ttl_s))
        if not self.rebuilding or all(flags):
            return flags
        return bytes(
            flag or (2 if prefix + blob[i * klen : (i + 1) * klen] not in self.lru else 0)
            for i, flag in enumerate(flags)
        )

    def read(
        self,
        tenant: str,
        keys: bytes,
        index: np.ndarray,
        headers: bytes | None,
        ttl_s: Callable[[str], float | None],
        *,
        probe: bool = False,
        verify: bool = True,
    ) -> ShardReads:
        """Look up committed shards, given as columns: row ``i`` asks for key ``i`` of ``keys`` (all of one length,
        concatenated), shard ``index[i]``, and when ``headers`` is given (16 bytes a row) that header digest.

        Per row a status: ``OK``; ``ABSENT`` (shard 0 asked of its primary, which has no live block record: the
        block is gone, whatever shards remain); ``MISSING`` (absent, not committed, expired); ``MISMATCH``
        (another header digest); ``CORRUPT`` (``verify`` and the bytes fail their crc32c: an erasure, never
        returned). OK rows are *pinned*: however long the caller takes to send them, their slots are not
        reused, even after a delete; the caller must ``unpin(reads)`` when done. A shard 0 the lookup finds
        (before ``verify`` reads its bytes) is a read of a block this node is primary for: the block becomes the
        most recently used in the LRU index now, and its record's last access is written at the next
        ``flush_access``. ``verify=False`` leaves the
        check to the reader, which gets each shard's stored crc32c (``reads.records["crc"]``) and checks the
        bytes as they arrive, so the node never reads them itself (end to end: docs/design.md §5). ``probe``:
        statuses only — no bytes, no pins, no check (a repair scan asking what is there).
        """
        n = len(index)
        klen = len(keys) // n if n else 16
        prefix = tenant_prefix(tenant)
        names = name_table(prefix, keys, klen, index)
        now = self.clock()
        # Look up and pin under the lock that deletes and slot reuse take: a slot found here cannot be
        # reused before it is unpinned, however long the checks and the send take.
        with self._lock:
            present, records = self._index.lookup(names)
            reads = ShardReads(present, records, self._index.ttl_classes, _ExpiryCutoffs(ttl_s, now), headers)
            live: list[BlockEntry] = []  # blocks asked for their shard 0 here whose record is live, and their rows
            live_rows: list[int] = []
            primary = np.flatnonzero(index == 0)
            # asked of the primary: is the block live? (the block record's key: the shard's without its index)
            for row, bkey in zip(primary.tolist(), table_names(names[primary, :-1]), strict=True):
                entry = self.lru.get(bkey)
                if entry is None and self.rebuilding:  # its record may not be back yet: an erasure, read around
                    reads.status[row] = Status.MISSING
                elif entry is None or entry.created < reads.cutoffs[entry.ttl_class]:
                    reads.status[row] = Status.ABSENT
                else:
                    live.append(entry)
                    live_rows.append(row)
            reads.settle()
            if probe:
                reads.record_states = self._record_states(names, index)
            else:
                reads.pin(self.slabs)
                self._touch(tenant, live, reads.status[live_rows] == _OK, now)
        if verify and not probe and len(reads.pins[1]) and reads.check():
            with self._lock:
                reads.repin(self.slabs)  # the corrupt shards leave the payload: no longer pinned
        return reads

    def _record_states(self, names: np.ndarray, index: np.ndarray) -> np.ndarray:
        """With the lock held: per row asked (a name table), for a shard 0, 1 or 2 (their holders keep the block
        record), the record's ``RecordState`` here; ``NONE`` for other shards."""
        out = np.full(len(index), RecordState.NONE, dtype=np.uint8)
        rows = np.flatnonzero(holds_record(index))
        removing = self.removal_log.removing
        for row, bkey in zip(rows.tolist(), table_names(names[rows, :-1]), strict=True):
            if bkey in self.block_table:
                out[row] = RecordState.HELD
            elif bkey in removing:
                out[row] = RecordState.REMOVING
        return out

    def unpin(self, reads: ShardReads) -> None:
        """Release the pins ``read`` took."""
        with self._lock:
            self.slabs.unpin(reads.hold)
            if self.slabs.quarantine:
                self._room.notify_all()  # a removed slot whose reply was in flight may be free now

    def records_held(self) -> list[tuple[bytes, BlockRecord]]:
        """Every block record here (as primary or as the copy at shard 1's or 2's holder), keyed by tenant prefix
        + key."""
        with self.env.begin() as txn:
            return [(bkey, BlockRecord.unpack(raw)) for bkey, raw in self.block_table.records(txn)]

    def block_records(self, bkeys: list[bytes]) -> dict[bytes, BlockRecord]:
        """The block records of those ``bkeys`` (tenant prefix + key) held here."""
        with self.env.begin() as txn:
            return {bkey: BlockRecord.unpack(raw) for bkey, raw in self.block_table.get_many(txn, bkeys).items()}

    def shard_tables(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every committed shard here, as (names table, ``RECORD`` rows) pairs, one per name width: a snapshot
        (a copy of the whole index: for rare scans, e.g. a peer rebuilding after a wipe)."""
        with self._lock:
            return [(names.copy(), records.copy()) for names, records in self._index.items()]

    # -- owed repairs (kvstore.node.owed) ------------------------------------------------------------------

    def owe(self, items: Sequence[Owed]) -> int:
        """Take on the repair of blocks (a block owed already keeps its entry); returns how many are new."""
        with self._lock, self._writing(_txn_bytes(len(items))) as txn:
            return self.owed.add(txn, items)

    def owe_short(self, tenant: str, blob: bytes, klen: int, missing: np.ndarray) -> int:
        """Take on the repair of the blocks of ``tenant`` among the keys of ``blob`` (``klen`` bytes each) that this
        node is the live primary of, each missing the shards ``missing`` names (a bit each; rows of 0 are skipped).
        Returns how many repairs are new."""
        prefix, now = tenant_prefix(tenant), self.clock()
        with self._lock, self._writing(_txn_bytes(len(missing))) as txn:
            short = [
                Owed(bkey, now, mask)
                for i, mask in enumerate(missing.tolist())
                if mask and (bkey := prefix + blob[i * klen : (i + 1) * klen]) in self.lru
            ]
            return self.owed.add(txn, short)

    def owed_repairs(self, limit: int) -> list[Owed]:
        """Up to ``limit`` owed repairs, oldest first."""
        with self.env.begin() as txn:
            return self.owed.oldest(txn, limit)

    def settle_owed(self, bkeys: Sequence[bytes]) -> dict[bytes, float]:
        """The repairs of ``bkeys`` are done (or their blocks gone); returns since when each was owed."""
        with self._lock, self._writing() as txn:
            return self.owed.settle(txn, bkeys)

    def owed_summary(self) -> tuple[int, float | None]:
        """How many repairs are owed, and since when the oldest is (None: none)."""
        with self.env.begin() as txn:
            return self.owed.count(txn), self.owed.oldest_since(txn)

    # -- scrubbing ------------------------------------------------------------------------------------

    def scrub(self, after: bytes | None, max_bytes: int, ttl_s: Callable[[str], float | None]) -> ScrubStep:
        """Check committed shards' bytes against their crc32c, in the order of their places (size class, slot:
        the slab files read front to back), starting just after place ``after`` (None: the first), until about
        ``max_bytes`` are checked. Each shard is looked up and pinned under the lock (its slot cannot be reused
        while it is read) and read outside it. Returns where to go on from (None: the pass is complete), what was
        checked, and the shards that failed as (tenant, key, index, created): erasures for repair to rewrite.
        """
        names: list[bytes] = []
        places: list[tuple[int, int]] = []
        position = after
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self.slots_db)
            more = cursor.set_range(after + b"\0") if after is not None else cursor.first()
            total = 0
            while more and total < max_bytes:
                where = bytes(cursor.key())
                name, raw = _unpack_slot_value(cursor.value())
                names.append(name)
                places.append(_SLOT_KEY.unpack(where))
                total += ShardRecord.unpack(raw).length
                position = where
                more = cursor.next()
        if not names:
            return ScrubStep(None, 0, 0, [])
        where_at = np.asarray(places, dtype=np.int64).reshape(-1, 2)
        with self._lock:
            present, records = self._index.lookup_names(names)
            # a record still in LMDB after its shard was deleted (dead_slots), or one whose name has moved on
            current = present & (records["size_class"] == where_at[:, 0]) & (records["slot"] == where_at[:, 1])
            lengths = records["length"].astype(np.int64)  # ShardReads clears the rows it does not serve
            created = records["created"].tolist()
            reads = ShardReads(current, records, self._index.ttl_classes, _ExpiryCutoffs(ttl_s, self.clock()), None)
            reads.settle()
            reads.pin(self.slabs)
        if len(reads.pins[1]):
            reads.check()
        self.unpin(reads)
        corrupt = []
        for row in np.flatnonzero(reads.status == Status.CORRUPT).tolist():
            name = names[row]
            cut = name.index(b"/")
            corrupt.append((name[:cut].decode(), name[cut + 1 : -1], name[-1], created[row]))
        checked = current & (reads.status != _MISSING)
        scanned = int(lengths[checked].sum())
        return ScrubStep(position if more else None, int(checked.sum()), scanned, corrupt)

    def shard_records(self, tenant: str, key: bytes) -> Iterator[ShardRecord]:
        with self._lock:
            present, records = self._index.lookup(every_shard(tenant_prefix(tenant), [key]))
            found = [self._shard_record(record) for record in records[present]]
        yield from found

    def _shard_record(self, record: np.void) -> ShardRecord:
        """A ``RECORD`` row of the name index as a ``ShardRecord``."""
        fields = [record[field].item() for field in _SHARD_FIELDS[:-1]]
        return ShardRecord(*fields, record["header"].tobytes(), self._index.ttl_classes[int(record["ttl"])])

    def block_record(self, tenant: str, key: bytes) -> BlockRecord | None:
        with self.env.begin() as txn:
            raw = self.block_table.get(txn, block_key(tenant, key))
        return BlockRecord.unpack(raw) if raw is not None else None

    def setting(self, name: str) -> bytes | None:
        """A node setting persisted with the data (e.g. the drain flag)."""
        with self.env.begin(db=self.settings_db) as txn:
            return txn.get(name.encode())

    def set_setting(self, name: str, value: bytes) -> None:
        with self._lock, self._writing() as txn:
            txn.put(name.encode(), value, db=self.settings_db)

    def rebuild_pending(self) -> float | None:
        """When this data dir was made, while it has not yet been rebuilt from its peers (None: it has been, or
        it predates rebuilds): blocks committed before then may have shards here that it never received."""
        raw = self.setting(REBUILD)
        return _TIME.unpack(raw)[0] if raw else None

    @property
    def rebuilding(self) -> bool:
        """Whether this data dir is being rebuilt from its peers (``rebuild_pending``): reads of shard 0 it has no
        record of are erasures (``MISSING``), not ``ABSENT``, so readers decode around it meanwhile."""
        return self._rebuilding

    def rebuilt(self) -> None:
        """Every peer has told what this data dir should hold (``rebuild_pending`` is None from now on)."""
        self.set_setting(REBUILD, b"")
        self._rebuilding = False

    def counts(self) -> dict[str, int]:
        return {"shards": len(self._index), "blocks": len(self.block_table)}

    def sync(self) -> None:
        self.env.sync(True)

    def close(self) -> None:
        self.flush_access()
        with self._lock:
            self.env.sync(True)
            self.env.close()
            self.slabs.close()


_INDEX_BYTES = [bytes((i,)) for i in range(256)]  # the last byte of a shard's name
_SLOT_KEY = struct.Struct(">HI")  # a shard record's LMDB key: size class, slot (big-endian: sorted by place)
_SLOT_KEY_DTYPE = np.dtype([("class", ">u2"), ("slot", ">u4")])  # the same key, as a numpy row
_PLACE = struct.Struct("<2xHI")  # size class and slot, read from a packed shard record
_NAME_LEN = struct.Struct("<H")
_SHARD_FIELDS = RECORD.names[:-1]  # a shard record's fields, the TTL class aside
_CANDIDATES_LOOKED_UP = 256  # LRU entries whose shard 0 one lookup checks for pins (eviction_candidates)


def _where(packed: bytes) -> bytes:
    """The LMDB key of a packed shard record: where its bytes are."""
    return _SLOT_KEY.pack(*_PLACE.unpack_from(packed))


def _slot_value(name: bytes, packed: bytes) -> bytes:
    """What ``slots`` holds for a shard: its name (tenant/key/index, for the index rebuilt at open), its record."""
    return _NAME_LEN.pack(len(name)) + name + packed


def _slot_keys(classes: np.ndarray, slots: np.ndarray) -> list[bytes]:
    """The LMDB keys of shard records in ``slots`` (size class, slot; big-endian), built as one array."""
    where = np.empty(len(slots), dtype=_SLOT_KEY_DTYPE)
    where["class"], where["slot"] = classes, slots
    return where.view(f"V{_SLOT_KEY.size}").ravel().tolist()


def _unpack_slot_value(raw: bytes) -> tuple[bytes, bytes]:
    (n,) = _NAME_LEN.unpack_from(raw)
    if len(raw) < 2 + n:
        raise ValueError("a shard record is shorter than its name")
    return bytes(raw[2 : 2 + n]), bytes(raw[2 + n :])


_DAMAGED = (ValueError, struct.error, IndexError, KeyError, TypeError)  # what damaged records raise as they decode


def _check_shard(where: bytes, name: bytes, rec: ShardRecord) -> None:
    """ValueError unless a shard record read at open says what can be: a known state, shard index and size class, a
    length within its slot, its LMDB key its place, its name ending with its index."""
    if rec.state not in (PENDING, COMMITTED) or rec.index >= TOTAL_SHARDS or rec.size_class >= len(SIZE_CLASSES):
        raise ValueError(f"a shard record has state {rec.state}, index {rec.index}, size class {rec.size_class}")
    if not 0 < rec.length <= SIZE_CLASSES[rec.size_class] or where != _SLOT_KEY.pack(rec.size_class, rec.slot):
        raise ValueError("a shard record's length or place does not fit its slot")
    if not name or name[-1] != rec.index or b"/" not in name:
        raise ValueError("a shard record's name is not tenant/key/index")


def _check_slots_in_files(directory: Path, used: dict[int, set[int]]) -> None:
    """ValueError unless every slot a record names lies within its slab file (a damaged slot number would
    otherwise make the free lists billions of slots long)."""
    for size_class, slots in used.items():
        path = directory / f"slab-{SIZE_CLASSES[size_class]}.dat"
        size = path.stat().st_size if path.exists() else 0
        if (max(slots) + 1) * SIZE_CLASSES[size_class] > size:
            raise ValueError(f"a shard record names slot {max(slots)}, beyond the end of {path}")


def _check_settings(txn: lmdb.Transaction, db: lmdb._Database) -> None:
    """ValueError unless the node's settings are what it writes: the drain flag 0 or 1, the rebuild's time 8 bytes
    (or none), the scrubber's place a shard record's key (or none)."""
    lengths = {b"draining": (1,), REBUILD.encode(): (0, _TIME.size), SCRUB_AT.encode(): (0, _SLOT_KEY.size)}
    for name, value in txn.cursor(db=db):
        if len(value) not in lengths.get(bytes(name), (len(value),)):
            raise ValueError(f"setting {bytes(name)!r} holds {len(value)} bytes")
    if txn.get(b"draining", db=db) not in (None, b"0", b"1"):
        raise ValueError("the drain flag is neither 0 nor 1")


class ScrubStep(NamedTuple):
    """What one ``ChunkEngine.scrub`` call checked: where the next goes on from (None: the pass is complete), how
    many shards and bytes were checked, and the shards whose bytes failed their crc32c (tenant, key, index, when
    the shard was committed)."""

    position: bytes | None
    shards: int
    bytes: int
    corrupt: list[tuple[str, bytes, int, float]]


class _ExpiryCutoffs(dict[str, float]):
    """Per TTL class, the creation time before which a shard has expired at ``now`` (an unknown class: all)."""

    def __init__(self, ttl_s: Callable[[str], float | None], now: float) -> None:
        super().__init__()
        self.ttl_s, self.now = ttl_s, now

    def __missing__(self, ttl_class: str) -> float:
        ttl = self.ttl_s(ttl_class)
        cutoff = self[ttl_class] = math.inf if ttl is None else self.now - ttl
        return cutoff


_OK = int(Status.OK)  # a plain int: numpy probes an IntEnum operand for array protocols (~3 us a comparison)
_EXISTS, _MISSING, _NO_SPACE = int(Status.EXISTS), int(Status.MISSING), int(Status.NO_SPACE)
_NONE = np.zeros(0, dtype=np.int64)


class ShardReads:
    """What ``ChunkEngine.read`` found, as columns over the rows asked (no Python object per shard: a 64 KiB-block
    read asks every node for about a thousand).

    ``status`` per row (``Status`` values). For OK rows, the shard ``records`` (``shard_index.RECORD``: ``length``,
    ``block_len``, ``crc``, ``header`` …) and ``ttl`` (an index into ``ttl_classes``); zero (``ttl`` 255) elsewhere.
    ``payload``: the OK shards' bytes in row order, a ``_native.Scatter`` over the slab mappings that keeps them
    mapped (None until pinned). ``pins``: the (size classes, slots) of the payload, as two int64 arrays, pinned
    under ``hold`` (``SlabFiles.pin``).
    """

    def __init__(
        self,
        present: np.ndarray,
        records: np.ndarray,
        ttl_classes: list[str],
        cutoffs: _ExpiryCutoffs,
        headers: bytes | None,
    ) -> None:
        """``records``: the name index's ``RECORD`` rows of the rows asked (zeros where not ``present``), their TTL
        class an id into ``ttl_classes``."""
        n = len(present)
        self.records = records
        self.ttl_classes = list(ttl_classes)
        self.ttl = np.where(present, records["ttl"], 255).astype(np.uint8)
        self.cutoffs = cutoffs  # per TTL class, the creation time before which a shard has expired
        cutoff = np.asarray([cutoffs[name] for name in self.ttl_classes] + [math.inf])  # absent rows: the last
        expired = records["created"] < cutoff[np.minimum(self.ttl, len(self.ttl_classes))]
        missing = ~present | (records["state"] != COMMITTED) | expired
        self.status = np.full(n, _OK, dtype=np.uint8)
        if headers is not None:
            asked = np.frombuffer(headers, dtype=np.uint8).reshape(n, HEADER_BYTES)
            self.status[(records["header"] != asked).any(axis=1)] = Status.MISMATCH
        if missing.any():
            self.status[missing] = Status.MISSING
        self.payload: _native.Scatter | None = None
        self.record_states: np.ndarray | None = None  # a probe's: per row, the block record's state here
        self.pins: tuple[np.ndarray, np.ndarray] = (_NONE, _NONE)
        self.hold = 0  # pins nothing
        self._plan = np.zeros((0, 2), dtype=np.int64)
        self._keep: list[memoryview] = []

    def settle(self) -> None:
        """The statuses are final: clear the columns of rows that are not OK."""
        other = self.status != _OK
        if other.any():
            self.records[other] = 0
            self.ttl[other] = 255

    @property
    def ok(self) -> np.ndarray:
        return np.flatnonzero(self.status == _OK)

    def pin(self, slabs: SlabFiles) -> None:
        """With the engine lock held: pin the OK rows' slots and point the payload at them in the slab mappings."""
        ok = self.ok
        size_class = self.records["size_class"][ok].astype(np.int64)
        slot = self.records["slot"][ok].astype(np.int64)
        self.pins = (size_class, slot)
        self.hold = slabs.pin(size_class, slot)
        if not len(ok):
            return
        addresses, self._keep = slabs.addresses(size_class, slot)
        self._plan = np.empty((len(ok), 2), dtype=np.int64)
        self._plan[:, 0] = addresses
        self._plan[:, 1] = self.records["length"][ok]
        self.payload = _native.Scatter(self._plan, self._keep)

    def check(self) -> int:
        """Checksum the pinned shards in the slab files; those that fail become ``CORRUPT`` and leave the payload
        and ``pins`` (``repin`` then releases them). Returns how many failed."""
        ok = self.ok
        bad = np.frombuffer(_native.crc32c_pieces(self._plan), dtype="<u4") != self.records["crc"][ok]
        if not bad.any():
            return 0
        self.status[ok[bad]] = Status.CORRUPT
        self.settle()
        classes, slots = self.pins
        self.pins = (classes[~bad], slots[~bad])
        self._plan = np.ascontiguousarray(self._plan[~bad])
        self.payload = _native.Scatter(self._plan, self._keep)
        return int(bad.sum())

    def repin(self, slabs: SlabFiles) -> None:
        """With the engine lock held: pin ``pins`` alone (after ``check`` took shards out)."""
        old, self.hold = self.hold, slabs.pin(*self.pins)
        slabs.unpin(old)
