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

from kvtier.kvstore.slabs import by_class

CHUNK_SLOTS = 4096  # slots per bitmap record (512 bytes)
_SHIFT = CHUNK_SLOTS.bit_length() - 1
_KEY = struct.Struct(">HI")  # size class, chunk


class DeadSlots:
    """The marks of one engine (see the module docstring)."""

    def __init__(self, db: lmdb._Database) -> None:
        self.db = db
        self._bits: dict[tuple[int, int], np.ndarray] = {}  # (size class, chunk) -> bool per slot

    def mark(self, txn: lmdb.Transaction, size_class: int, slots: np.ndarray) -> None:
        """The records in ``slots`` (of ``size_class``) are dead: their shards were deleted."""
        for chunk, offsets in _by_chunk(slots):
            bits = self._bits.get((size_class, chunk))
            if bits is None:
                bits = self._bits[(size_class, chunk)] = np.zeros(CHUNK_SLOTS, dtype=bool)
            bits[offsets] = True
            txn.put(_KEY.pack(size_class, chunk), np.packbits(bits).tobytes(), db=self.db)

    def clear(self, txn: lmdb.Transaction, size_class: int, slots: np.ndarray) -> None:
        """New records are being written in ``slots``: whatever was marked there is live again."""
        if not self._bits:
            return
        for chunk, offsets in _by_chunk(slots):
            bits = self._bits.get((size_class, chunk))
            if bits is None or not bits[offsets].any():
                continue
            bits[offsets] = False
            key = _KEY.pack(size_class, chunk)
            if bits.any():
                txn.put(key, np.packbits(bits).tobytes(), db=self.db)
            else:
                del self._bits[(size_class, chunk)]
                txn.delete(key, db=self.db)

    def take_all(self, txn: lmdb.Transaction) -> set[tuple[int, int]]:
        """Every (size class, slot) marked in LMDB, and the marks cleared: the caller (at open, before any
        ``mark``) deletes those records in ``txn``."""
        out = set()
        for key, raw in txn.cursor(db=self.db):
            size_class, chunk = _KEY.unpack(key)
            offsets = np.flatnonzero(np.unpackbits(np.frombuffer(raw, dtype=np.uint8), count=CHUNK_SLOTS))
            out.update((size_class, chunk << _SHIFT | offset) for offset in offsets.tolist())
        self._bits.clear()
        txn.drop(self.db, delete=False)
        return out


def _by_chunk(slots: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``slots`` grouped by bitmap record: (chunk, offsets within it)."""
    return [
        (chunk, slots[mine] & (CHUNK_SLOTS - 1)) for chunk, mine in by_class(slots >> _SHIFT, np.arange(len(slots)))
    ]
