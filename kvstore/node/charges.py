"""The shard 0s of writes in flight, charged to their primary's budget from the moment they are reserved.

A write's shard 0s count against the primary's budget before they are committed, so that two concurrent writes
of one tenant see each other and never both take its last room. A pending charge counts only in its own tenant's
decisions (its eviction of its own blocks to make room, its share): until a write is committed nobody else's
blocks make room for it, neither at once nor when the GC keeps headroom, and its payload is dropped within
``gc.pending_timeout_s`` if the COMMIT never comes. So a tenant's uncommitted payload can cost only that tenant
(issue 19: a PUT header never followed by its payload made others evict; issue 36: a payload sent and never
committed held 98 % of a primary's budget, and the GC evicted another tenant within its quota to make up for it).
Room from other tenants' blocks is taken when a write commits (docs/design.md §6, quotas).

Not thread-safe: the chunk engine calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable


class Charges:
    """Charged shard 0s by shard key (tenant/key/0), and their bytes per tenant."""

    def __init__(self) -> None:
        self._sizes: dict[bytes, int] = {}
        self._by: dict[str, int] = {}
        self.total = 0  # every tenant's pending charges together (node_info: ``pending_primary_bytes``)

    def pending(self, tenant: str) -> int:
        """``tenant``'s charges: what its writes in flight add to its usage, in its own decisions only."""
        return self._by.get(tenant, 0)

    def size_of(self, skey: bytes) -> int:
        return self._sizes.get(skey, 0)

    def charge(self, tenant: str, skeys: list[bytes], sizes: list[int]) -> None:
        """Charge ``sizes`` for shard 0s of ``tenant``; one charged already is charged anew."""
        if not self._sizes.keys().isdisjoint(skeys):
            self.uncharge(tenant, skeys)
        self._sizes.update(zip(skeys, sizes, strict=True))
        self._add(tenant, sum(sizes))

    def uncharge(self, tenant: str, skeys: Iterable[bytes]) -> int:
        """Drop the charges of ``skeys`` (committed, refused or given back); returns their bytes."""
        size = sum(self._sizes.pop(skey, 0) for skey in skeys)
        self._add(tenant, -size)
        return size

    def _add(self, tenant: str, size: int) -> None:
        if not size:
            return
        left = self._by.get(tenant, 0) + size
        if left:
            self._by[tenant] = left
        else:
            self._by.pop(tenant, None)
        self.total += size
