"""Repairs a node owes: blocks it knows to be short of shards and has taken on to bring back to 12.

A block enters the list when its primary commits it with fewer than 12 shards (the writer's COMMIT says which
are missing: ``min_write_shards`` lets a put commit with a node down), or when a repair pass finds it damaged
and cannot finish it now (a holder is down). The GC's repairer works the list off, oldest first, at
``repair_bytes_per_s``, and drops an entry once the block has all 12 shards again or is gone (docs/design.md
§6). The list is durable, so a restarted node still owes what it owed.

Two LMDB tables: ``owed``, key = time it was owed (big-endian float: oldest first) + block key (tenant/key),
value = ``<HBd``: the shards missing when it was recorded (a bit each; 0: unknown), flags (``ORPHAN``: no
holder has the block's record, it is rebuilt from its shards; ``CORRUPT``: the missing ones held here are
there but corrupt, found by the scrubber), the block's creation time (where known);
``owed_keys``, block key → its key in ``owed``, so a block is owed once.

Not thread-safe: the engine calls it under its lock, in its transactions.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import NamedTuple

import lmdb

from kvtier.kvstore.codec import TOTAL_SHARDS

_SINCE = struct.Struct(">d")
_VALUE = struct.Struct("<HBd")
ORPHAN, CORRUPT = 1, 2


class Owed(NamedTuple):
    """One owed repair: the block (tenant/key), since when, which shards were missing (a bit each; 0 unknown),
    ``flags`` (``ORPHAN``, ``CORRUPT``), and its creation time where known (else 0)."""

    bkey: bytes
    since: float
    missing: int = 0
    flags: int = 0
    created: float = 0.0


class OwedRepairs:
    """The owed repairs of one engine, in LMDB (see the module docstring)."""

    def __init__(self, env: lmdb.Environment, txn: lmdb.Transaction) -> None:
        self.db = env.open_db(b"owed", txn=txn)
        self.keys_db = env.open_db(b"owed_keys", txn=txn)

    def add(self, txn: lmdb.Transaction, items: Iterable[Owed]) -> int:
        """Record, in ``txn``, the repairs ``items`` (a block owed already keeps its entry); returns how many are
        new."""
        added = 0
        for item in items:
            if txn.get(item.bkey, db=self.keys_db) is not None:
                continue
            key = _SINCE.pack(item.since) + item.bkey
            txn.put(key, _VALUE.pack(item.missing, item.flags, item.created), db=self.db)
            txn.put(item.bkey, key, db=self.keys_db)
            added += 1
        return added

    def oldest(self, txn: lmdb.Transaction, limit: int) -> list[Owed]:
        """Up to ``limit`` owed repairs, oldest first."""
        out = []
        for key, value in txn.cursor(db=self.db):
            out.append(Owed(bytes(key[_SINCE.size :]), _SINCE.unpack_from(key)[0], *_VALUE.unpack(value)))
            if len(out) >= limit:
                break
        return out

    def settle(self, txn: lmdb.Transaction, bkeys: Iterable[bytes]) -> dict[bytes, float]:
        """Forget the repairs of ``bkeys`` (done, or the block is gone); returns since when each one that was owed
        was owed."""
        since = {}
        for bkey in bkeys:
            key = txn.pop(bkey, db=self.keys_db)
            if key is not None:
                txn.delete(key, db=self.db)
                since[bkey] = _SINCE.unpack_from(key)[0]
        return since

    def check(self, txn: lmdb.Transaction) -> None:
        """Decode every entry (at open: a damaged one is found then, not by the repairer later); ValueError or
        struct.error for one that does not decode."""
        for key, value in txn.cursor(db=self.db):
            if len(key) <= _SINCE.size or len(value) != _VALUE.size:
                raise ValueError("an owed repair is not (time + block key → missing, flags, created)")
            missing, flags, _ = _VALUE.unpack(value)
            if missing >> TOTAL_SHARDS or flags & ~(ORPHAN | CORRUPT):
                raise ValueError(f"an owed repair names shards {missing:#x} and flags {flags:#x}")
        for bkey, key in txn.cursor(db=self.keys_db):
            if len(key) != _SINCE.size + len(bkey) or key[_SINCE.size :] != bkey:
                raise ValueError("an owed repair's index entry does not name it")

    def count(self, txn: lmdb.Transaction) -> int:
        return int(txn.stat(self.keys_db)["entries"])

    def oldest_since(self, txn: lmdb.Transaction) -> float | None:
        """Since when the oldest owed repair is owed (None: nothing is owed)."""
        cursor = txn.cursor(db=self.db)
        return _SINCE.unpack_from(cursor.key())[0] if cursor.first() else None
