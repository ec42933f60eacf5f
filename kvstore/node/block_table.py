"""Block records in commit order: LMDB table ``block_seq`` keyed by a sequence number, the name index in memory.

A block record (at the block's primary, and the copies at the holders of shards 1 and 2) is looked up by name, but
names are random hashes: keyed by name, every put's records landed in random B-tree leaves, one page copy
each, and every eviction deleted from random leaves again (alone, 1.97 us a key to insert and 2.04 to
delete, against 0.28 and 0.85 in order; several times that on a busy node). Here a record's LMDB key is a
big-endian sequence number given at its first commit, so a put's records are appended and an eviction,
which takes the least recently used (mostly the oldest), deletes from neighbouring leaves. The value is
the name (2-byte length, then the name) followed by the packed record; the name → sequence index lives in
memory and is rebuilt from the table at open. A record stored again keeps its sequence number (updated in
place). A running node never reuses a number; at open the next is one past the last in the table.

A data dir written before this table kept block records keyed by name (table ``blocks``); they move here,
once, when the table is opened.

Not thread-safe for writes: the engine calls ``put_many`` and ``delete_many`` under its lock, in its write
transaction. ``get`` may be called without it (a record deleted meanwhile reads as absent).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping

import lmdb
import numpy as np

_SEQ = struct.Struct(">Q")
_NAME_LEN = struct.Struct("<H")
_TIME = struct.Struct("<d")


class BlockTable:
    """Block records of one engine by name, stored in commit order (see the module docstring)."""

    def __init__(self, db: lmdb._Database) -> None:
        self.db = db
        self._seq: dict[bytes, bytes] = {}  # name -> LMDB key (packed sequence number)
        self._next = 0

    @classmethod
    def open(cls, env: lmdb.Environment, txn: lmdb.Transaction) -> tuple[BlockTable, list[tuple[bytes, bytes]]]:
        """The table of ``env`` (records of an older data dir moved in first), and every (name, packed record) in
        it, read in the same pass that rebuilds the index: what the engine rebuilds its LRU index from."""
        table = cls(env.open_db(b"block_seq", txn=txn))
        if txn.get(b"blocks") is not None:
            old = env.open_db(b"blocks", txn=txn)
            cursor = txn.cursor(db=table.db)
            table._next = _SEQ.unpack(cursor.key())[0] + 1 if cursor.last() else 0
            table.put_many(txn, [(bytes(name), bytes(packed)) for name, packed in txn.cursor(db=old)])
            txn.drop(old, delete=True)
        held = []
        for key, value in txn.cursor(db=table.db):  # in key order: the last is the highest number
            name, packed = _split(value)
            table._seq[name] = bytes(key)
            table._next = _SEQ.unpack(key)[0] + 1
            held.append((name, packed))
        return table, held

    def __len__(self) -> int:
        return len(self._seq)

    def __contains__(self, name: object) -> bool:
        return name in self._seq

    def records(self, txn: lmdb.Transaction) -> Iterator[tuple[bytes, bytes]]:
        """Every (name, packed record), in commit order."""
        return map(_split, txn.cursor(db=self.db).iternext(keys=False, values=True))

    def get(self, txn: lmdb.Transaction, name: bytes) -> bytes | None:
        """The packed record of ``name``, or None."""
        key = self._seq.get(name)
        value = txn.get(key, db=self.db) if key is not None else None
        return _split(value)[1] if value is not None else None

    def get_many(self, txn: lmdb.Transaction, names: list[bytes]) -> dict[bytes, bytes]:
        """The packed records of those ``names`` that are here, by name."""
        keys = [key for key in map(self._seq.get, names) if key is not None]
        return dict(_split(value) for _, value in txn.cursor(db=self.db).getmulti(keys)) if keys else {}

    def put_many(self, txn: lmdb.Transaction, items: list[tuple[bytes, bytes]]) -> None:
        """Store (name, packed record) pairs: a name already here is updated in place, a new one appended."""
        seq, new, again = self._seq, [], []
        for name, packed in items:
            key = seq.get(name)
            if key is None:
                key = seq[name] = _SEQ.pack(self._next)
                self._next += 1
                new.append((key, _NAME_LEN.pack(len(name)) + name + packed))
            else:
                again.append((key, _NAME_LEN.pack(len(name)) + name + packed))
        cursor = txn.cursor(db=self.db)
        if again:
            cursor.putmulti(again)
        if new:
            cursor.putmulti(new, append=True)

    def stamp_many(self, txn: lmdb.Transaction, times: Mapping[bytes, float], at: int) -> int:
        """Write each name's time (a little-endian double) over bytes ``at``..``at`` + 7 of its packed record, in
        place; names not here are skipped. Returns how many records were written. No record is unpacked: one
        ``getmulti``, one slice and join a record, one ``putmulti`` (unpacking and packing each whole record cost ~5
        us a record, more than the read that touched it)."""
        seq = self._seq
        stamped = {key: time for key, time in zip(map(seq.get, times), times.values(), strict=True) if key is not None}
        if not stamped:
            return 0
        cursor = txn.cursor(db=self.db)
        items = []
        for key, value in cursor.getmulti(list(stamped)):
            cut = _NAME_LEN.size + _NAME_LEN.unpack_from(value)[0] + at
            items.append((key, b"".join((value[:cut], _TIME.pack(stamped[key]), value[cut + _TIME.size :]))))
        cursor.putmulti(items)
        return len(items)

    def put_rows(self, txn: lmdb.Transaction, names: np.ndarray, packed: np.ndarray) -> None:
        """``put_many`` of names and packed records given as tables (a row each, each table of one width): the
        LMDB values are built as one table and the new names' numbers as one array, so a put's records cost no
        Python per record when they are all new (a re-put falls back to ``put_many``)."""
        n, width = names.shape
        values = np.empty((n, _NAME_LEN.size + width + packed.shape[1]), dtype=np.uint8)
        values[:, : _NAME_LEN.size] = np.frombuffer(_NAME_LEN.pack(width), dtype=np.uint8)
        values[:, _NAME_LEN.size : _NAME_LEN.size + width] = names
        values[:, _NAME_LEN.size + width :] = packed
        rows = values.view(f"V{values.shape[1]}").ravel().tolist()
        listed = np.ascontiguousarray(names).view(f"V{width}").ravel().tolist()
        if not self._seq.keys().isdisjoint(listed) or len(set(listed)) < n:  # stored before, or twice in the call
            self.put_many(txn, [(name, row[_NAME_LEN.size + width :]) for name, row in zip(listed, rows, strict=True)])
            return
        numbers = np.arange(self._next, self._next + n, dtype=">u8").view("V8").tolist()
        self._next += n
        self._seq.update(zip(listed, numbers, strict=True))
        txn.cursor(db=self.db).putmulti(zip(numbers, rows, strict=True), append=True)

    def delete_many(self, txn: lmdb.Transaction, names: list[bytes]) -> list[bytes]:
        """Delete the records of ``names`` (in table order: neighbouring leaves one after another); returns the
        names that were here."""
        pop, found = self._seq.pop, []
        for name in names:
            key = pop(name, None)
            if key is not None:
                found.append((key, name))
        found.sort()
        for key, _ in found:
            txn.delete(key, db=self.db)
        return [name for _, name in found]


def _split(value: bytes) -> tuple[bytes, bytes]:
    """A stored value as (name, packed record)."""
    n = _NAME_LEN.unpack_from(value)[0]
    if len(value) < 2 + n:
        raise ValueError("a block record is shorter than its name")
    return value[2 : 2 + n], value[2 + n :]
