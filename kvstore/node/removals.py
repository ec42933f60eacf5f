"""Removal intents: the blocks a primary removed whose other shards are still being deleted on their group.

A primary removes blocks in two steps (docs/design.md §6): one LMDB transaction deletes their records and
its own shards and writes the intent; then ``DELETE`` goes to the group's other 11 nodes, and the intent is
cleared once every node answered. An intent left by a crash or an unreachable node is resent.

One record per removal, not per block: table ``removals``, key = removal time (big-endian float, so the
table is in time order) + 8 random bytes (two removals in the same clock tick stay apart), value = msgpack
``[tenant, [key, ...]]``. A removal of 300 blocks then writes and clears one record instead of 300 (a B-tree
insert and a delete each: about 2 us a block alone, and several times that on a busy node).

A data dir written before this table kept one record per block (table ``evicting``: tenant/key → removal
time); ``RemovalLog`` moves those into ``removals`` (one record per tenant and time) when it is opened.

Not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import lmdb
import msgpack

_TIME = struct.Struct(">d")


@dataclass(frozen=True, slots=True)
class Removal:
    """A removal whose DELETEs have not reached every node of the group yet. ``when``: the removal's time (a
    ``DELETE``'s ``before``: shards written later are left alone); ``id``: its record's key."""

    id: bytes
    tenant: str
    when: float
    keys: list[bytes]


class RemovalLog:
    """The pending removals of one engine, in LMDB (see the module docstring)."""

    def __init__(self, env: lmdb.Environment, txn: lmdb.Transaction) -> None:
        self.db = env.open_db(b"removals", txn=txn)
        self.removing: set[bytes] = set()  # the blocks (tenant/key) of every pending removal
        if txn.get(b"evicting") is not None:
            self._move_per_block_intents(env, txn)
        for removal in self.pending(txn):
            self.removing.update(_block_keys(removal))

    def add(self, txn: lmdb.Transaction, tenant: str, keys: list[bytes], when: float) -> Removal:
        """Record, in ``txn``, that ``keys`` of ``tenant`` were removed at ``when``."""
        removal = Removal(_TIME.pack(when) + os.urandom(8), tenant, when, keys)
        txn.put(removal.id, msgpack.packb([tenant, keys], use_bin_type=True), db=self.db)
        self.removing.update(_block_keys(removal))
        return removal

    def pending(self, txn: lmdb.Transaction) -> list[Removal]:
        """Every removal not cleared yet, oldest first."""
        out = []
        for rid, raw in txn.cursor(db=self.db):
            tenant, keys = msgpack.unpackb(raw, raw=False)
            if len(rid) != _TIME.size + 8 or not isinstance(tenant, str) or not isinstance(keys, list):
                raise ValueError("a removal intent is not (time + id → tenant, keys)")
            if not all(isinstance(key, bytes) for key in keys):
                raise ValueError("a removal intent names something other than keys")
            out.append(Removal(bytes(rid), tenant, _TIME.unpack_from(rid)[0], keys))
        return out

    def clear(self, txn: lmdb.Transaction, removal: Removal) -> None:
        """Every node answered ``removal``'s DELETE: forget it (a removal cleared already is ignored)."""
        txn.delete(removal.id, db=self.db)
        self.removing.difference_update(_block_keys(removal))

    def _move_per_block_intents(self, env: lmdb.Environment, txn: lmdb.Transaction) -> None:
        old = env.open_db(b"evicting", txn=txn)
        grouped: dict[tuple[str, float], list[bytes]] = {}
        for bkey, raw in txn.cursor(db=old):
            tenant, _, key = bytes(bkey).partition(b"/")
            grouped.setdefault((tenant.decode(), struct.unpack("<d", raw)[0]), []).append(key)
        for (tenant, when), keys in grouped.items():
            self.add(txn, tenant, keys, when)
        txn.drop(old, delete=True)


def _block_keys(removal: Removal) -> list[bytes]:
    prefix = removal.tenant.encode() + b"/"
    return [prefix + key for key in removal.keys]
