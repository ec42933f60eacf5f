"""Dead-slot marks: which shard records in LMDB name a shard that was deleted.

Shard records are keyed by where their bytes are (size class, slot). Deleting a shard does not delete its
record: it sets the slot's bit here, and the record stays in place until the slot is reused, when the new
shard's record overwrites it (same LMDB key) and the bit is cleared in the same transaction. An eviction
then writes a few bitmap pages instead of one B-tree delete per shard (a delete cost 1.4 us a shard alone,
and 10-15 us on a busy node, where it was the largest part of a put at capacity).

The bits are kept in LMDB (table ``freed``: size class, chunk of ``CHUNK_SLOTS`` slots → a bitmap) and
mirrored in memory. Every change is made inside the caller's write transaction, so a crash leaves marks
and records consistent: a record whose bit is set is dead, whatever else is in it. At open the engine
deletes the dead records and drops every mark (``take_all``).

Not thread-safe: the engine calls it under its lock, inside an LMDB write transaction.
"""

from __future__ import annotations

import struct

import lmdb
import numpy as np

CHUNK_SLOTS = 4096  # slots per bitmap record (512 bytes)
_SHIFT = CHUNK_SLOTS.bit_length() - 1
_KEY = struct.Struct(">HI")  # size class, chunk


class DeadSlots:
    """The marks of one engine (see the module docstring)."""

    def __init__(self, db: lmdb._Database) -> None:
        self.db = db
        self._bits: dict[int, np.ndarray] = {}  # size class -> bool per slot (whole chunks), grown on demand

    def mark(self, txn: lmdb.Transaction, size_class: int, slots: np.ndarray) -> None:
        """The records in ``slots`` (of ``size_class``) are dead: their shards were deleted."""
        if not len(slots):
            return
        bits = self._grown(size_class, int(slots.max()))
        bits[slots] = True
        self._write(txn, size_class, bits, slots)

    def clear(self, txn: lmdb.Transaction, size_class: int, slots: np.ndarray) -> None:
        """New records are being written in ``slots``: whatever was marked there is live again."""
        bits = self._bits.get(size_class)
        if bits is None or not len(slots):
            return
        inside = slots[slots < len(bits)]
        marked = inside[bits[inside]]
        if not len(marked):
            return
        bits[marked] = False
        self._write(txn, size_class, bits, marked)

    def _grown(self, size_class: int, slot: int) -> np.ndarray:
        bits = self._bits.get(size_class)
        if bits is None or slot >= len(bits):
            grown = np.zeros(((slot >> _SHIFT) + 1) * CHUNK_SLOTS, dtype=bool)
            if bits is not None:
                grown[: len(bits)] = bits
            bits = self._bits[size_class] = grown
        return bits

    def _write(self, txn: lmdb.Transaction, size_class: int, bits: np.ndarray, changed: np.ndarray) -> None:
        """Store the bitmap records of the chunks ``changed`` lies in (a chunk left with no mark is deleted)."""
        for chunk in np.flatnonzero(np.bincount(changed >> _SHIFT)).tolist():  # np.unique: ~30x the time
            page = bits[chunk << _SHIFT : (chunk + 1) << _SHIFT]
            key = _KEY.pack(size_class, chunk)
            if page.any():
                txn.put(key, np.packbits(page).tobytes(), db=self.db)
            else:
                txn.delete(key, db=self.db)

    def take_all(self, txn: lmdb.Transaction) -> set[tuple[int, int]]:
        """Every (size class, slot) marked in LMDB, and the marks cleared: the caller (at open, before any
        ``mark``) deletes those records in ``txn``."""
        out = self.read_all(txn)
        self._bits.clear()
        txn.drop(self.db, delete=False)
        return out

    def read_all(self, txn: lmdb.Transaction) -> set[tuple[int, int]]:
        """Every (size class, slot) marked in LMDB, the marks kept, here too (at open, on a disk with no room to
        delete those records: later writes of a chunk then keep its old marks)."""
        out = set()
        for key, raw in txn.cursor(db=self.db):
            if len(raw) != CHUNK_SLOTS // 8:
                raise ValueError("a dead-slot bitmap is not one chunk long")
            size_class, chunk = _KEY.unpack(key)
            page = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), count=CHUNK_SLOTS).astype(bool)
            out.update((size_class, chunk << _SHIFT | offset) for offset in np.flatnonzero(page).tolist())
            self._grown(size_class, (chunk + 1 << _SHIFT) - 1)[chunk << _SHIFT : chunk + 1 << _SHIFT] = page
        return out
