"""Host staging pool: shared-memory segments cut into fixed-size slots, each with its slot table inside.

A segment is an anonymous memory file (``memfd``): it has no name in ``/dev/shm`` that another process could open.
Its writer (the fetcher, or a StateBlock host) maps it read-write, then **seals** it (``F_SEAL_FUTURE_WRITE``, and no
growing or shrinking): from then on nobody, the writer included, can map it writable again, ``write`` to it, punch
holes in it or resize it, whatever descriptor they hold; the writer's own mapping, made before the seal, stays
writable. Readers get a descriptor from the writer (the fetcher passes it over its Unix socket, ``SCM_RIGHTS``, only
to the tenant whose blocks the segment holds) and map it read-only: :class:`SlotMap`. A reader can therefore neither
change a block nor the table, however it tries (``mprotect``, a writable ``mmap``, reopening the descriptor
read-write through ``/proc``: the seal refuses each).

Layout of a segment (all little-endian; every column 64-byte aligned, slot data 4 KiB aligned)::

    header   magic, version, writer pid, slot_bytes, slot stride, slots, data offset, epoch, LRU clock,
             eviction / hit / miss counters
    columns  gen u64 · lru u64 · tenant u64 · state u32 · pins u32 · owner u32 · length u32 · klen u32 · key 32 B ·
             hdr 16 B
    data     slot i at data_offset + i × stride

The writer alone changes states, keys and generations (:class:`StagingPool`); readers read slot bytes in place,
without copies and without locks: a slot's generation is a seqlock. It changes before a slot's bytes are reused,
so ``gen before == gen after == expected`` around a read proves the bytes read were that block's
(``SlotMap.valid``). Memory is touched lazily: slots are handed out lowest first (``touched_bytes``), so a segment
larger than what its tenant may use costs only what it used.

An :class:`Outbox` is the other kind of segment: slots an engine writes blocks into before they are stored (the
fetcher's ALLOC/PUT). It is not sealed (its tenant's engines map it writable) and holds no table: which slots are
given out, and their generations, is the fetcher's own memory, so nothing written there can mislead the fetcher.

Slot states (see docs/transfer.md for the transition table and failure cases):

    FREE     holds nothing                                  → FILLING (reserve)
    FILLING  being written by the writer                    → READY (done) · FREE (failed, owner gone)
    READY    holds a block, cached under its key, evictable → PINNED (pin) · FILLING (evicted and reused)
    PINNED   READY and pinned by ≥ 1 reader: never evicted  → READY (last unpin)
"""

from __future__ import annotations

import collections
import enum
import fcntl
import functools
import hashlib
import mmap
import os
import re
import secrets
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice, repeat

import numpy as np

MAGIC = b"KVTSTAGE"
VERSION = 2
KEY_BYTES = 32  # keys of 16 or 32 bytes, zero-padded
HDR_BYTES = 16
PAGE = 4096
_HEADER = struct.Struct("<8sIIQQQQ16sQQQQ")  # magic version writer_pid slot_bytes stride slots data_off epoch clock..
_HEADER_BYTES = PAGE
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
F_SEAL_FUTURE_WRITE = 0x10  # (Linux ≥ 5.1; not in Python's fcntl before 3.12)
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
# an outbox stays writable (engines fill it) but keeps its size: a file shrunk under the fetcher's mapping would
# fault its copy out of the slots (SIGBUS), and take every tenant's fetcher with it
OUTBOX_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_COLUMNS = (
    ("gen", np.uint64, 1),
    ("lru", np.uint64, 1),
    ("tenant", np.uint64, 1),
    ("state", np.uint32, 1),
    ("pins", np.uint32, 1),
    ("owner", np.uint32, 1),
    ("length", np.uint32, 1),
    ("klen", np.uint32, 1),
    ("key", np.uint8, KEY_BYTES),
    ("hdr", np.uint8, HDR_BYTES),
)


class SlotState(enum.IntEnum):
    FREE = 0
    FILLING = 1
    READY = 2
    PINNED = 3


# the same as plain ints: enum member access costs a microsecond in CPython 3.11, on the per-block path
FREE, FILLING, READY, PINNED = (int(s) for s in SlotState)


class PoolError(Exception):
    """A segment cannot be made or mapped; the message says why and what to do."""


@functools.lru_cache(maxsize=1024)
def tenant_id(tenant: str) -> int:
    """The 64-bit id that scopes a tenant's blocks in a pool's table."""
    return int.from_bytes(hashlib.blake2b(tenant.encode(), digest_size=8).digest(), "little")


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def stride_of(slot_bytes: int) -> int:
    """Bytes a slot of ``slot_bytes`` takes in a segment (whole pages, so that slots can be mapped and pinned)."""
    return _align(slot_bytes, PAGE)


def _each(function: Callable[..., object], items: Iterable[object], *args: object) -> None:
    """``function(item, *args)`` for every item, the loop in C (a batch of dict changes without a Python frame each)."""
    collections.deque(map(function, items, *map(repeat, args)), maxlen=0)


def _geometry(slot_bytes: int, slots: int) -> tuple[int, int, dict[str, int]]:
    """(stride, data offset, column offsets) for a pool of ``slots`` slots of ``slot_bytes``."""
    offsets = {}
    at = _HEADER_BYTES
    for name, dtype, width in _COLUMNS:
        offsets[name] = at
        at = _align(at + slots * np.dtype(dtype).itemsize * width, 64)
    return stride_of(slot_bytes), _align(at, PAGE), offsets


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise PoolError(f"bad segment name {name!r}: use letters, digits, '.', '_' or '-'")
    return name


def memory_file(name: str, size: int) -> int:
    """A new anonymous memory file of ``size`` bytes (``memfd``, sealable, close-on-exec): its descriptor."""
    try:
        fd = os.memfd_create(check_name(name), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        raise PoolError(f"cannot make the memory file {name!r}: {exc}") from None
    try:
        os.ftruncate(fd, size)
    except OSError as exc:
        os.close(fd)
        raise PoolError(f"cannot size the memory file {name!r} to {size} B: {exc}") from None
    return fd


def read_only(fd: int) -> int:
    """A new descriptor of the same memory file, opened read-only: what the fetcher hands a reader."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def _entries(
    tenants: np.ndarray, klens: np.ndarray, keys: np.ndarray
) -> list[tuple[int, list[bytes], np.ndarray | None]]:
    """Table rows (``tenant``, ``klen`` and ``key`` columns) grouped by tenant and key length, as (tenant, keys,
    positions in the rows; None for all of them, the usual case): the keys split in C, no Python frame per row."""
    if (tenants == tenants[0]).all() and (klens == klens[0]).all():
        groups = [(int(tenants[0]), int(klens[0]), None)]
    else:
        pairs = sorted(set(zip(tenants.tolist(), klens.tolist(), strict=True)))
        groups = [(t, k, np.flatnonzero((tenants == t) & (klens == k))) for t, k in pairs]
    entries = []
    for tenant, klen, at in groups:
        rows = keys if at is None else keys[at]
        names = np.ascontiguousarray(rows[:, :klen]).view(f"V{klen}")  # one bytes object a row
        entries.append((tenant, names.ravel().tolist(), at))
    return entries


@dataclass(frozen=True)
class PoolStats:
    slots: int
    slot_bytes: int
    free: int
    filling: int
    ready: int
    pinned: int
    used_bytes: int  # bytes of blocks held in READY and PINNED slots
    hits: int
    misses: int
    evictions: int
    writer_pid: int
    capacity_bytes: int

    @property
    def hit_ratio(self) -> float:
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0

    @classmethod
    def total(cls, parts: Sequence[PoolStats]) -> PoolStats:
        """The pools of several segments counted as one (``slot_bytes``: the largest; none: all zero)."""
        summed = {f: sum(getattr(p, f) for p in parts) for f in cls.__dataclass_fields__ if f != "slot_bytes"}
        summed["writer_pid"] = parts[0].writer_pid if parts else os.getpid()
        return cls(slot_bytes=max((p.slot_bytes for p in parts), default=0), **summed)

    def as_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = dict(self.__dict__)
        out["hit_ratio"] = self.hit_ratio
        return out


class Region:
    """A mapping of a segment's slots: ``view(slot)`` is a slot's memory (writable only in a writable mapping)."""

    def __init__(
        self, name: str, mapping: mmap.mmap, slot_bytes: int, stride: int, slots: int, data_offset: int
    ) -> None:
        if len(mapping) < data_offset + slots * stride:
            raise PoolError(f"segment {name} is shorter than its {slots} slots of {stride} B")
        self.name = name
        self._mmap = mapping
        self.buffer = memoryview(mapping)
        self.slot_bytes, self.stride, self.slots, self.data_offset = slot_bytes, stride, slots, data_offset
        self.writable = not self.buffer.readonly
        self.gone = False  # a client's mark: the fetcher that made it is gone, or dropped it
        self.address = np.frombuffer(mapping, np.uint8).ctypes.data + data_offset  # slot 0, for C loops

    def view(self, slot: int, length: int | None = None) -> memoryview:
        """The slot's bytes (``length`` of them; default the whole slot). No copy."""
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range 0..{self.slots - 1}")
        start = self.data_offset + slot * self.stride
        return self.buffer[start : start + (self.slot_bytes if length is None else length)]

    def close(self) -> None:
        """Unmap, once no view handed out is alive any more (until then the mapping stays, harmlessly)."""
        try:
            self.buffer.release()
            self._mmap.close()
        except BufferError:
            pass


class SlotMap(Region):
    """A mapping of a cache segment: slot bytes and the table. Readers map it read-only (:meth:`open`)."""

    def __init__(self, name: str, mapping: mmap.mmap) -> None:
        magic, version, _pid, slot_bytes, stride, slots, data_offset, epoch, *_ = _HEADER.unpack_from(mapping, 0)
        if magic != MAGIC or version != VERSION:
            raise PoolError(f"segment {name} is not a kvtier staging pool (version {VERSION})")
        _, expected_offset, offsets = _geometry(slot_bytes, slots)
        if expected_offset != data_offset:
            raise PoolError(f"segment {name} has an inconsistent header")
        super().__init__(name, mapping, slot_bytes, stride, slots, data_offset)
        self.epoch: bytes = epoch
        cols = {}
        for col, dtype, width in _COLUMNS:
            shape = (slots, width) if width > 1 else (slots,)
            cols[col] = np.ndarray(shape, dtype=dtype, buffer=mapping, offset=offsets[col])
        self.gen, self.lru, self.tenant = cols["gen"], cols["lru"], cols["tenant"]
        self.state, self.pins, self.owner, self.length = cols["state"], cols["pins"], cols["owner"], cols["length"]
        self.klen = cols["klen"]
        self.keys, self.hdrs = cols["key"], cols["hdr"]
        self._counters = np.ndarray((4,), dtype=np.uint64, buffer=mapping, offset=_HEADER.size - 32)

    @classmethod
    def open(cls, fd: int, name: str = "segment") -> SlotMap:
        """Map the segment behind ``fd`` read-only (a reader: an engine, ``kvtier-fetcher status``). The caller keeps
        ``fd`` (and closes it: the mapping needs no descriptor). Raises PoolError if it is not a staging pool."""
        try:
            mapping = mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise PoolError(f"cannot map segment {name}: {exc}") from None
        try:
            return cls(name, mapping)
        except BaseException:
            mapping.close()
            raise

    def valid(self, slot: int, generation: int) -> bool:
        """Whether ``slot`` holds a block (READY or PINNED) at ``generation``.

        The reader's side of the seqlock: take the generation while the slot is READY/PINNED, read the bytes, then
        call this; True proves nothing overwrote them meanwhile (the writer marks a slot FILLING, then bumps its
        generation, then writes; x86 keeps both orders).
        """
        return 0 <= slot < self.slots and int(self.gen[slot]) == generation and int(self.state[slot]) in (READY, PINNED)

    def filling(self, slot: int, generation: int) -> bool:
        """Whether ``slot`` is still being filled under ``generation``."""
        return 0 <= slot < self.slots and int(self.gen[slot]) == generation and int(self.state[slot]) == FILLING

    def valid_many(self, slots: np.ndarray, gens: np.ndarray) -> np.ndarray:
        """:meth:`valid` of a batch, as a ``bool`` array (the generations are read before the states, as there)."""
        inside = (slots >= 0) & (slots < self.slots)
        at = np.where(inside, slots, 0)
        same = self.gen[at] == gens
        state = self.state[at]
        return inside & same & ((state == READY) | (state == PINNED))

    def filling_many(self, slots: np.ndarray, gens: np.ndarray) -> np.ndarray:
        """:meth:`filling` of a batch, as a ``bool`` array."""
        inside = (slots >= 0) & (slots < self.slots)
        at = np.where(inside, slots, 0)
        same = self.gen[at] == gens
        return inside & same & (self.state[at] == FILLING)

    @property
    def writer_pid(self) -> int:
        return struct.unpack_from("<I", self._mmap, 12)[0]

    def stats(self) -> PoolStats:
        counts = np.bincount(self.state, minlength=4)
        held = (self.state == READY) | (self.state == PINNED)
        return PoolStats(
            slots=self.slots,
            slot_bytes=self.slot_bytes,
            free=int(counts[FREE]),
            filling=int(counts[FILLING]),
            ready=int(counts[READY]),
            pinned=int(counts[PINNED]),
            used_bytes=int(self.length[held].sum(dtype=np.uint64)),
            hits=int(self._counters[2]),
            misses=int(self._counters[3]),
            evictions=int(self._counters[1]),
            writer_pid=self.writer_pid,
            capacity_bytes=self.slots * self.slot_bytes,
        )

    def close(self) -> None:
        del self.gen, self.lru, self.tenant, self.state, self.pins, self.owner, self.length, self.klen
        del self.keys, self.hdrs, self._counters
        super().close()


class _Lru:
    """Slots, least recently used first: a dict's insertion order, so that batches are added and taken in C.

    (An ``OrderedDict`` costs ~250 ns a slot to add; a dict ~35.) A dict leaves a hole where an entry was deleted, and
    iterating from the front walks over the holes, so it is rebuilt once it has had as many deletions as it holds
    entries: every operation stays O(1) amortized however the slots come and go.
    """

    __slots__ = ("_holes", "_order")

    def __init__(self) -> None:
        self._order: dict[int, None] = {}
        self._holes = 0

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, slot: int) -> bool:
        return slot in self._order

    def add(self, slots: Iterable[int]) -> None:
        """Add ``slots`` as the most recently used, in order (one already held keeps its place)."""
        self._order.update(dict.fromkeys(slots))

    def discard(self, slots: Iterable[int]) -> None:
        before = len(self._order)
        _each(self._order.pop, slots, None)
        self._deleted(before - len(self._order))

    def take_oldest(self, n: int) -> list[int]:
        """Remove and return the ``n`` least recently used slots (at most ``len``)."""
        oldest = list(islice(self._order, n))
        if 2 * len(oldest) < len(self._order):
            _each(self._order.__delitem__, oldest)
            self._deleted(len(oldest))
        else:  # most of them: the rest copied is cheaper than deleting these one by one (all of them: nothing)
            self._order = dict.fromkeys(islice(self._order, len(oldest), None))
            self._holes = 0
        return oldest

    def move_to_end(self, slot: int) -> None:
        """``slot`` (held) is now the most recently used."""
        del self._order[slot]
        self._order[slot] = None
        self._deleted(1)

    def _deleted(self, n: int) -> None:
        self._holes += n
        if self._holes > len(self._order) + 64:
            self._order = dict.fromkeys(self._order)  # rebuilt without holes
            self._holes = 0


class StagingPool(SlotMap):
    """The writer's side of a cache segment: reserve, fill, pin, evict. Made by :meth:`create`; the only process
    that changes the segment (readers cannot: it is sealed).

    Thread-safe (one internal lock); every method is O(1) amortized. Keys are scoped by a 64-bit tenant id: a lookup
    never returns another tenant's block. Slots are handed out lowest first: ``hwm`` slots have ever been used
    (``touched_bytes`` of memory), and :meth:`reserve_many` takes a never-used slot only within the limit it is given.
    """

    def __init__(self, name: str, fd: int, mapping: mmap.mmap) -> None:
        super().__init__(name, mapping)
        self.fd = fd  # kept to hand read-only descriptors out (``read_only``)
        self._lock = threading.RLock()
        # tenant -> key -> READY/PINNED slot (the reverse is the table's tenant and key columns): one dict a
        # tenant, so that a batch of keys is looked up, added or removed in C without a tuple per key
        self._index: dict[int, dict[bytes, int]] = {}
        self._later: list[Callable[[], None]] = []  # index changes of ``publish_many(later=True)``, in order
        self._evictable = _Lru()  # READY slots, oldest first
        self._free: list[int] = []  # FREE slots below ``hwm`` (their memory touched)
        self.hwm = 0  # slots ``0 … hwm-1`` have been handed out at least once
        self._detached: set[int] = set()  # superseded by a newer copy of their key: freed at last unpin
        # called (under the pool's lock) with (tenant, key, slot, generation) of each block evicted by reserve
        self.on_evict: Callable[[int, bytes, int, int], None] | None = None

    def close(self) -> None:
        """Unmap (as :meth:`SlotMap.close`) and close the descriptor; the memory goes once no reader maps it."""
        super().close()
        os.close(self.fd)

    @classmethod
    def create(cls, name: str, capacity_bytes: int, slot_bytes: int) -> StagingPool:
        """A new sealed segment of ``capacity_bytes // stride`` slots of ``slot_bytes`` (at least one), all FREE.
        ``name`` only labels it (``/proc/PID/maps`` shows ``/memfd:NAME``). Raises PoolError if it cannot be made."""
        if slot_bytes <= 0 or capacity_bytes < slot_bytes:
            raise PoolError(f"capacity {capacity_bytes} B must hold at least one slot of {slot_bytes} B")
        slots = capacity_bytes // stride_of(slot_bytes) or 1
        stride, data_offset, _ = _geometry(slot_bytes, slots)
        size = data_offset + slots * stride
        fd = memory_file(name, size)
        try:
            mapping = mmap.mmap(fd, size)
            _HEADER.pack_into(
                mapping, 0, MAGIC, VERSION, os.getpid(), slot_bytes, stride, slots, data_offset,
                secrets.token_bytes(16), 0, 0, 0, 0,
            )  # fmt: skip
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)  # this mapping stays writable; no other ever can be
            return cls(name, fd, mapping)
        except BaseException:
            os.close(fd)
            raise

    @property
    def touched_bytes(self) -> int:
        """Memory the slots handed out so far occupy (the rest of the segment was never touched)."""
        return self.hwm * self.stride

    def idle(self) -> bool:
        """No slot is pinned or being filled: the segment may be dropped whole (its blocks forgotten)."""
        with self._lock:
            state = self.state[: self.hwm]
            return not ((state == PINNED) | (state == FILLING)).any()

    def _key(self, slot: int) -> bytes:
        return bytes(self.keys[slot, : self.klen[slot]])

    def _keys_of(self, tenant: int) -> dict[bytes, int]:
        """``tenant``'s part of the index (made at its first block)."""
        index = self._index.get(tenant)
        if index is None:
            index = self._index[tenant] = {}
        return index

    def settle(self) -> None:
        """Make the index changes ``publish_many(later=True)`` left for later (every other method does so first)."""
        with self._lock:
            self._settle()

    def _settle(self) -> None:
        while self._later:
            later, self._later = self._later, []
            for change in later:
                change()

    @staticmethod
    def _checked(key: bytes) -> bytes:
        if len(key) not in (16, 32):
            raise ValueError(f"keys are 16 or 32 bytes, got {len(key)}")
        return key

    def _tick(self, slot: int) -> None:
        self._counters[0] += np.uint64(1)
        self.lru[slot] = self._counters[0]

    def _to_free(self, slot: int) -> None:
        self.state[slot] = FREE  # the state first, then the generation: see ``valid``
        self.gen[slot] += np.uint64(1)  # holders of the old generation now see a miss
        self.pins[slot] = 0
        self.owner[slot] = 0
        self.length[slot] = 0
        self._free.append(slot)

    # -- lookups ----------------------------------------------------------------------------------------

    def lookup(self, tenant: int, key: bytes, hdr: bytes | None = None, length: int | None = None) -> int | None:
        """The READY/PINNED slot holding ``key`` for ``tenant`` (and, when given, that header and length)."""
        with self._lock:
            self._settle()
            slot = self._index.get(tenant, {}).get(self._checked(key))
            if slot is None:
                return None
            if length is not None and self.length[slot] != length:
                return None
            if hdr is not None and bytes(self.hdrs[slot]) != hdr:
                return None
            return slot

    def find(self, tenant: int, keys: Sequence[bytes], length: int, hdrs: Sequence[bytes | None]) -> np.ndarray:
        """:meth:`lookup` for a batch (keys already checked): per key its slot, or -1."""
        with self._lock:  # the lookups run in C (map): no Python frame per key
            self._settle()
            slots = np.fromiter(map(self._index.get(tenant, {}).get, keys, repeat(-1)), np.int64, len(keys))
        held = np.flatnonzero(slots >= 0)
        found = slots[held]
        ok = self.length[found] == length
        if None not in hdrs:  # a digest for every key (the engine's requests): one join, no Python frame per key
            picked = hdrs if len(held) == len(hdrs) else list(map(hdrs.__getitem__, held.tolist()))
            wanted = np.frombuffer(b"".join(picked), np.uint8).reshape(-1, HDR_BYTES)  # type: ignore[arg-type]
            ok &= (self.hdrs[found] == wanted).all(axis=1)
        elif any(hdrs) and (checked := [i for i, j in enumerate(held.tolist()) if hdrs[j] is not None]):
            wanted = np.frombuffer(b"".join(hdrs[j] for j in held[checked].tolist()), np.uint8).reshape(-1, HDR_BYTES)
            ok[checked] &= (self.hdrs[found[checked]] == wanted).all(axis=1)
        slots[held[~ok]] = -1
        return slots

    def pin_many(self, slots: np.ndarray) -> np.ndarray:
        """:meth:`pin` for slots :meth:`find` just returned on this thread; returns their generations."""
        with self._lock:
            self._settle()
            self._evictable.discard(slots.tolist())
            np.add.at(self.pins, slots, 1)
            self.state[slots] = PINNED
            clock = int(self._counters[0])
            self.lru[slots] = np.arange(clock + 1, clock + 1 + len(slots), dtype=np.uint64)
            self._counters[0] = clock + len(slots)
            return self.gen[slots].copy()

    def unpin_many(self, slots: np.ndarray, gens: np.ndarray) -> int:
        """:meth:`unpin` for a batch (a slot may appear as often as it is pinned); how many pins were dropped."""
        with self._lock:
            self._settle()
            ok = (self.gen[slots] == gens) & (self.state[slots] == PINNED)
            held, asked = np.unique(slots[ok], return_counts=True)
            take = np.minimum(asked, self.pins[held]).astype(np.uint32)  # never more pins than there are
            self.pins[held] -= take
            unpinned = held[self.pins[held] == 0]
            if self._detached.isdisjoint(unpinned.tolist()):  # the usual case: all READY again, most recent last
                self.state[unpinned] = READY
                self._evictable.add(unpinned.tolist())
            else:
                for slot in unpinned.tolist():
                    self._unpinned(slot)
            return int(take.sum())

    def _unpinned(self, slot: int) -> None:
        """No pin is left on ``slot``: READY and evictable again, or FREE if a newer copy superseded it."""
        if slot in self._detached:
            self._detached.discard(slot)
            self._to_free(slot)
        else:
            self.state[slot] = READY
            self._evictable.add((slot,))

    def count(self, hits: int, misses: int) -> None:
        """Add to the pool's hit/miss counters (what ``stats().hit_ratio`` reports)."""
        self._counters[2] += np.uint64(hits)
        self._counters[3] += np.uint64(misses)

    # -- transitions ------------------------------------------------------------------------------------

    def reserve(self, owner_pid: int) -> tuple[int, int] | None:
        """A slot to fill, as (slot, generation): a free one, else a never-used one, else the least recently used
        READY one (evicted: its old generation becomes a miss). None when every slot is FILLING or PINNED."""
        slots, gens = self.reserve_many(1, owner_pid)
        return (int(slots[0]), int(gens[0])) if len(slots) else None

    def reserve_many(self, n: int, owner_pid: int, fresh: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`reserve` for up to ``n`` slots (fewer when the rest are FILLING or PINNED): (slots, generations).
        At most ``fresh`` never-used slots are taken (None: any number), so that a caller can bound the memory its
        segments touch; past that, slots are reused by eviction."""
        with self._lock:
            self._settle()
            take = self._free[len(self._free) - min(n, len(self._free)) :]
            del self._free[len(self._free) - len(take) :]
            new = min(n - len(take), self.slots - self.hwm, self.slots if fresh is None else max(0, fresh))
            if new:
                take += range(self.hwm, self.hwm + new)
                self.hwm += new
            evict = min(n - len(take), len(self._evictable))
            if evict:
                evicted = self._evictable.take_oldest(evict)
                at = np.array(evicted, dtype=np.int64)
                # their index entries go at the next settle (before any other call reads the index), from copies of
                # their rows: a publish may rewrite the rows first
                rows = self.tenant[at], self.klen[at], self.keys[at], self.gen[at]
                self._later.append(functools.partial(self._unindex, evicted, *rows))
                self._counters[1] += np.uint64(evict)
                take += evicted
            slots = np.array(take, dtype=np.int64)
            self.state[slots] = FILLING  # the state first, then the generation: see ``valid``
            self.gen[slots] += np.uint64(1)
            self.owner[slots] = owner_pid
            self.length[slots] = 0
            return slots, self.gen[slots]

    def publish(self, slot: int, tenant: int, key: bytes, length: int, hdr: bytes | None, pins: int) -> None:
        """FILLING → READY (``pins`` = 0) or PINNED: the slot now holds ``key``'s block of ``length`` bytes.

        A READY copy of the same key is superseded (freed now, or at its last unpin if pinned).
        """
        self.publish_many(np.array([slot]), tenant, [key], length, [hdr], np.array([pins]))

    def publish_many(
        self,
        slots: np.ndarray,
        tenant: int,
        keys: Sequence[bytes],
        length: int,
        hdrs: Sequence[bytes | None],
        pins: np.ndarray,
        later: bool = False,
        rows: np.ndarray | None = None,
    ) -> None:
        """:meth:`publish` for a batch of distinct slots and keys.

        ``rows``: the same keys as a ``uint8`` array ``[n, 16 or 32]``, when the caller has them that way (a
        request's keys as they came): then they are neither joined nor checked one by one.

        With ``later``, only the table (what readers see) is written now: the slots are READY/PINNED with their
        keys when this returns, and the writer's index learns of them at :meth:`settle` or at the start of the next
        other call (so that a fetcher answers first). Until then a lookup by this process would not find them,
        and a newer copy of a key would keep superseding the old one only then."""
        if rows is None:
            lengths = set(map(len, keys))
            if not lengths <= {16, 32}:
                for key in keys:
                    self._checked(key)  # raises for the first key of another length
            if len(lengths) == 1:  # one key length (the usual case): no per-key padding
                rows = np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), -1)
        elif rows.ndim != 2 or len(rows) != len(keys) or rows.shape[1] not in (16, 32):
            raise ValueError(f"key rows of shape {rows.shape} for {len(keys)} keys of 16 or 32 bytes")
        with self._lock:
            if not later:
                self._settle()
            if (self.state[slots] != FILLING).any():
                raise ValueError(f"slots {slots[self.state[slots] != FILLING].tolist()} are not FILLING")
            self._write_rows(slots, tenant, keys, rows, length, hdrs, pins)
            change = functools.partial(self._index_published, slots, tenant, keys, pins)
            if later:
                self._later.append(change)
            else:
                change()

    def _index_published(self, slots: np.ndarray, tenant: int, keys: Sequence[bytes], pins: np.ndarray) -> None:
        """The index side of :meth:`publish_many` (the table is written): a newer copy of a key supersedes the older
        one, and slots published unpinned join the LRU order."""
        index = self._keys_of(tenant)
        slot_list = slots.tolist()
        if len(set(keys)) == len(keys):
            olds = list(map(index.get, keys))
            if olds.count(None) < len(olds):  # newer copies of keys the pool holds: the old ones go
                for slot, old in zip(slot_list, olds, strict=True):
                    if old is not None and old != slot:
                        self._detach(old)
            index.update(zip(keys, slot_list, strict=True))
        else:  # a key twice (two header digests): one at a time, so the last copy supersedes the first
            for slot, key in zip(slot_list, keys, strict=True):
                old = index.get(key)
                if old is not None and old != slot:
                    self._detach(old)
                index[key] = slot
        ready = slots[pins == 0].tolist()
        if self._detached.isdisjoint(ready):
            self._evictable.add(ready)
        else:  # one superseded within this batch is freed at once
            for slot in ready:
                self._unpinned(slot)

    def _write_rows(
        self,
        slots: np.ndarray,
        tenant: int,
        keys: Sequence[bytes],
        rows: np.ndarray | None,
        length: int,
        hdrs: Sequence[bytes | None],
        pins: np.ndarray,
    ) -> None:
        """The table side of :meth:`publish_many`: the rows of ``slots`` hold their blocks, READY or PINNED last.
        ``rows``: the keys as an array when they have one length, else None."""
        self.tenant[slots] = tenant
        if rows is not None:
            padded = np.zeros((len(rows), KEY_BYTES), np.uint8)
            padded[:, : rows.shape[1]] = rows
            self.keys[slots] = padded  # one row write a slot, the padding with it
            self.klen[slots] = rows.shape[1]
        else:
            padded = b"".join(key.ljust(KEY_BYTES, b"\0") for key in keys)
            self.keys[slots] = np.frombuffer(padded, dtype=np.uint8).reshape(-1, KEY_BYTES)
            self.klen[slots] = np.fromiter(map(len, keys), np.uint32, len(keys))
        if None not in hdrs:  # a digest for every block (the engine's requests): joined in C
            self.hdrs[slots] = np.frombuffer(b"".join(hdrs), dtype=np.uint8).reshape(-1, HDR_BYTES)  # type: ignore[arg-type]
        elif any(hdrs):
            hdr_bytes = b"".join(hdr or bytes(HDR_BYTES) for hdr in hdrs)
            self.hdrs[slots] = np.frombuffer(hdr_bytes, dtype=np.uint8).reshape(-1, HDR_BYTES)
        else:  # no header digests: no bytes object per block
            self.hdrs[slots] = 0
        self.length[slots] = length
        self.pins[slots] = pins
        clock = int(self._counters[0])
        self.lru[slots] = np.arange(clock + 1, clock + 1 + len(slots), dtype=np.uint64)
        self._counters[0] = clock + len(slots)
        self.state[slots] = np.where(pins > 0, PINNED, READY)  # last: the bytes and the table are in place

    def _unindex(
        self, slots: list[int], tenants: np.ndarray, klens: np.ndarray, keys: np.ndarray, gens: np.ndarray
    ) -> None:
        """The index entries of evicted ``slots`` dropped (unless a newer copy of a key owns its entry), and
        ``on_evict`` told; the other arguments are the slots' table rows when they were evicted."""
        for tenant, names, at in _entries(tenants, klens, keys):
            index, held = self._index[tenant], slots if at is None else [slots[i] for i in at.tolist()]
            if list(map(index.get, names)) == held:  # the usual case: no newer copy owns an entry
                _each(index.__delitem__, names)
            else:
                for key in [k for k, s in zip(names, held, strict=True) if index.get(k) == s]:
                    del index[key]
            if self.on_evict is not None:
                generations = (gens if at is None else gens[at]).tolist()
                for key, slot, gen in zip(names, held, generations, strict=True):
                    self.on_evict(tenant, key, slot, gen)

    def _detach(self, slot: int) -> None:
        index = self._index.get(int(self.tenant[slot]), {})
        key = self._key(slot)
        if index.get(key) == slot:  # (unless a newer copy of the key owns the entry)
            del index[key]
        if self.state[slot] == READY:
            self._evictable.discard((slot,))
            self._to_free(slot)
        else:
            self._detached.add(slot)

    def abandon(self, slot: int, generation: int) -> bool:
        """FILLING → FREE (the fill failed or its owner went away). False if ``generation`` is stale."""
        return self.abandon_many(np.array([slot], dtype=np.int64), np.array([generation], dtype=np.uint64)) == 1

    def abandon_many(self, slots: np.ndarray, gens: np.ndarray) -> int:
        """:meth:`abandon` for a batch of distinct slots; how many were freed (the others were stale)."""
        with self._lock:
            self._settle()
            mine = slots[(self.gen[slots] == gens) & (self.state[slots] == FILLING)]
            self.state[mine] = FREE  # the state first, then the generation: see ``valid``
            self.gen[mine] += np.uint64(1)  # holders of the old generation now see a miss
            self.pins[mine] = 0
            self.owner[mine] = 0
            self.length[mine] = 0
            self._free += mine.tolist()
            return len(mine)

    def pin(self, slot: int, generation: int, tenant: int | None = None, key: bytes | None = None) -> bool:
        """Pin a READY/PINNED slot at ``generation`` (so it is never evicted); False if it no longer holds it
        (or, when given, holds another tenant's or another key's block)."""
        with self._lock:
            self._settle()
            if not 0 <= slot < self.slots or int(self.gen[slot]) != generation:
                return False
            if self.state[slot] not in (READY, PINNED):
                return False
            if (tenant is not None and self.tenant[slot] != tenant) or (key is not None and self._key(slot) != key):
                return False
            self._evictable.discard((slot,))
            self.pins[slot] += np.uint32(1)
            self.state[slot] = PINNED
            self._tick(slot)
            return True

    def unpin(self, slot: int, generation: int) -> bool:
        """Drop one pin; the last one makes the slot READY (evictable, most recently used) again."""
        return self.unpin_many(np.array([slot]), np.array([generation], dtype=np.uint64)) == 1

    def touch(self, slot: int) -> None:
        """Mark a READY slot most recently used."""
        with self._lock:
            self._settle()
            if slot in self._evictable:
                self._evictable.move_to_end(slot)
                self._tick(slot)

    def drop(self, tenant: int, key: bytes) -> bool:
        """Forget ``key`` (freed now, or at its last unpin). False if the pool does not hold it."""
        with self._lock:
            self._settle()
            slot = self._index.get(tenant, {}).get(self._checked(key))
            if slot is None:
                return False
            self._detach(slot)
            return True

    def cached(self) -> list[tuple[int, bytes, int, int]]:
        """(tenant, key, slot, generation) of every READY/PINNED slot, least recently used first."""
        with self._lock:
            self._settle()
            slots = sorted(
                (s for index in self._index.values() for s in index.values()), key=lambda s: int(self.lru[s])
            )
            return [(int(self.tenant[s]), self._key(s), s, int(self.gen[s])) for s in slots]


class Outbox(Region):
    """Slots engines fill with blocks to store (the fetcher's ALLOC, then PUT): a memory file of its own, writable
    through the descriptor handed out but sealed against shrinking and growing (``OUTBOX_SEALS``), so the fetcher's
    copy out of it can never fault; holes punched in it read as zeros. It holds no table: which slots are given out,
    and their generations, live in this object (the fetcher's private memory), so nothing an engine writes here can
    mislead the fetcher. Not thread-safe: the fetcher calls it under its lock."""

    def __init__(self, name: str, slot_bytes: int, slots: int) -> None:
        stride = stride_of(slot_bytes)
        self.fd = memory_file(name, slots * stride)
        try:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, OUTBOX_SEALS)
            mapping = mmap.mmap(self.fd, slots * stride)
        except BaseException:
            os.close(self.fd)
            raise
        super().__init__(name, mapping, slot_bytes, stride, slots, 0)
        self.epoch = secrets.token_bytes(16)
        self.gen = np.zeros(slots, np.uint64)
        self.out = np.zeros(slots, dtype=bool)
        self._free: list[int] = []  # slots given back (their memory touched)
        self.hwm = 0

    @property
    def touched_bytes(self) -> int:
        return self.hwm * self.stride

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``n`` slots to give out (fewer when the rest are out), slots given back before first: (slots,
        generations)."""
        got = self._free[len(self._free) - min(n, len(self._free)) :]
        del self._free[len(self._free) - len(got) :]
        new = min(n - len(got), self.slots - self.hwm)
        got += range(self.hwm, self.hwm + new)
        self.hwm += new
        slots = np.array(got, dtype=np.int64)
        self.gen[slots] += np.uint64(1)
        self.out[slots] = True
        return slots, self.gen[slots].copy()

    def give_back(self, slots: np.ndarray, gens: np.ndarray) -> int:
        """Slots given out at generations ``gens`` come back; how many did (the others were not out at those)."""
        inside = (slots >= 0) & (slots < self.slots)
        at = slots[inside]
        mine = at[self.out[at] & (self.gen[at] == gens[inside])]
        self.out[mine] = False
        self._free += mine.tolist()
        return len(mine)

    def close(self) -> None:
        super().close()
        os.close(self.fd)
