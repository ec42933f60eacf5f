"""Shards committed at a node that their block's primary has not confirmed yet: charged to their tenant there.

Every shard takes a slot, but only a shard 0 is charged to a budget (its block's primary's, at that node). The other
eleven are paid for by the block's primary, which keeps its blocks within its budget on every node of the group —
if the block exists. A tenant that committed shards 1-11 of blocks whose shard 0 it never sent took slots nobody
charged, that nothing ever evicted (issue 36: nodes 3 and 4 filled to 100 % that way, after which other tenants
committed 0 of 60 blocks). So a node charges each shard it commits other than a shard 0 to its tenant as
*unconfirmed* until the block's primary confirms the block is live (the GC worker asks, in batches, a second or so
after the commit: ``GCWorker.confirm_shards``):

| what the primary says | the shard |
|---|---|
| live | confirmed: no longer charged here |
| not live, committed less than ``write_timeout_s`` ago | *denied*: still unconfirmed, asked again next pass |
| not live, ``write_timeout_s`` or more ago | an orphan: removed here |
| nothing (unreachable) | still unconfirmed, not denied |

While a tenant's unconfirmed bytes at a node pass ``gc.unconfirmed_share`` of its capacity, its new shards other
than shard 0s wait (at most ``room_wait_s``, the GC worker woken to ask about them); then they are refused
``NO_SPACE`` if its denied bytes alone pass that share. A legitimate writer's shards are confirmed at the first pass
that asks about them, however late it comes on a loaded node, so such a writer is slowed to the pace of the passes
and never refused (a cap on every unconfirmed byte refused a legitimate ``kvbench putget`` whenever the GC worker
fell two seconds behind its writes); an attacker's are denied at that same pass. A request is never refused for its
own size (a legitimate put may be large), so a tenant can strand at most that share of a node plus the shards of
one request (and what it commits while the GC worker is more than ``room_wait_s`` behind), for at most
``write_timeout_s`` (its shards reserved and not yet committed are dropped within
``gc.pending_timeout_s``). Unconfirmed shards are held in
memory: a node restarted meanwhile treats them as confirmed (a rebuild, ``kvctl repair --rebuild``, still reclaims
orphans from their records). A chunk engine with nobody to confirm its shards (no GC worker: tests, tools) charges
them and caps nothing.

Not thread-safe: the chunk engine calls it under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(eq=False)
class Unconfirmed:
    """Shards of one tenant committed at ``at`` (node clock), waiting for their primary's word: their names
    (``tenant/key/index`` rows, ``uint8 [n, width]``), the slot bytes each takes, and whether their primary has
    said it does not know their blocks (``denied``)."""

    names: np.ndarray
    sizes: np.ndarray
    at: float
    denied: bool = False


class UnconfirmedShards:
    """Every tenant's unconfirmed shards at this node and their bytes: reserved (a write's payload arriving, or
    waiting for its COMMIT) and committed, until they are confirmed, given back or removed."""

    def __init__(self) -> None:
        self._waiting: dict[str, list[Unconfirmed]] = {}
        self._reserved: dict[str, int] = {}
        self._bytes: dict[str, int] = {}  # committed, not confirmed yet (those being asked about included)
        self._denied: dict[str, int] = {}  # of those, the ones whose primary said it does not know their block

    def bytes_of(self, tenant: str) -> int:
        """``tenant``'s committed unconfirmed bytes here, asked about or not."""
        return self._bytes.get(tenant, 0)

    def denied_of(self, tenant: str) -> int:
        """``tenant``'s denied bytes here (what the cap applies to)."""
        return self._denied.get(tenant, 0)

    def reserved_of(self, tenant: str) -> int:
        """``tenant``'s reserved bytes here, not committed yet."""
        return self._reserved.get(tenant, 0)

    def reserve(self, tenant: str, size: int) -> None:
        """Slots of ``size`` bytes were reserved for ``tenant``'s shards."""
        _add(self._reserved, tenant, size)

    def release(self, tenant: str, size: int) -> None:
        """Reserved slots of ``size`` bytes were given back (refused, dropped, never committed)."""
        _add(self._reserved, tenant, -size)

    def add(self, tenant: str, shards: Unconfirmed) -> None:
        """Reserved shards were committed: they wait for their primary's word."""
        self._waiting.setdefault(tenant, []).append(shards)
        size = int(shards.sizes.sum())
        _add(self._reserved, tenant, -size)
        _add(self._bytes, tenant, size)

    def due(self, before: float) -> list[tuple[str, Unconfirmed]]:
        """The shards committed before ``before``, taken out to be asked about (still charged until ``settle``)."""
        out = []
        for tenant, waiting in self._waiting.items():
            out += [(tenant, shards) for shards in waiting if shards.at < before]
            waiting[:] = [shards for shards in waiting if shards.at >= before]
        return out

    def settle(self, tenant: str, shards: Unconfirmed, keep: np.ndarray, denied: np.ndarray) -> None:
        """The answer about ``shards`` (from :meth:`due`): rows ``keep`` stay unconfirmed, those of them also in
        ``denied`` counting against the cap; the rest are charged no more (confirmed, or orphans removed)."""
        if shards.denied:
            _add(self._denied, tenant, -int(shards.sizes.sum()))
        for rows, said_no in ((keep & denied, True), (keep & ~denied, False)):
            if rows.any():
                self._waiting.setdefault(tenant, []).append(
                    Unconfirmed(shards.names[rows], shards.sizes[rows], shards.at, said_no)
                )
                if said_no:
                    _add(self._denied, tenant, int(shards.sizes[rows].sum()))
        _add(self._bytes, tenant, -int(shards.sizes[~keep].sum()))


def _add(table: dict[str, int], tenant: str, size: int) -> None:
    if not size:
        return
    left = table.get(tenant, 0) + size
    if left:
        table[tenant] = left
    else:
        table.pop(tenant, None)
