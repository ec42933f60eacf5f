"""The shard 0s of writes in flight, charged to their primary's budget from the moment they are reserved.

A write's shard 0s count against the primary's budget before they are committed, so that concurrent writers
see each other and two of them never both take the last room. A charge is *reserved* while the write's
payload has not arrived, and *landed* once it has (the shards wait in their slots for the COMMIT). Landed
charges count for everyone. Reserved ones count only for their own tenant's decisions (its eviction of its own
blocks to make room): a PUT header whose payload never comes makes nobody else evict anything, neither at
once nor when the GC next keeps headroom (docs/design.md §6, quotas).

Not thread-safe: the chunk engine calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable


class Charges:
    """Charged shard 0s by shard key (tenant/key/0), and their bytes per tenant, reserved or landed."""

    def __init__(self) -> None:
        self._reserved: dict[bytes, int] = {}
        self._landed: dict[bytes, int] = {}
        self._reserved_by: dict[str, int] = {}
        self._landed_by: dict[str, int] = {}
        self.landed_bytes = 0
        self.reserved_bytes = 0

    @property
    def total(self) -> int:
        """Every charge, reserved or landed."""
        return self.landed_bytes + self.reserved_bytes

    def reserved(self, tenant: str) -> int:
        return self._reserved_by.get(tenant, 0)

    def landed_by_tenant(self) -> dict[str, int]:
        return dict(self._landed_by)

    def size_of(self, skey: bytes) -> int:
        return self._reserved.get(skey) or self._landed.get(skey, 0)

    def charge(self, tenant: str, skeys: list[bytes], sizes: list[int]) -> None:
        """Reserve ``sizes`` for shard 0s of ``tenant``; one charged already is charged anew."""
        if not (self._reserved.keys().isdisjoint(skeys) and self._landed.keys().isdisjoint(skeys)):
            self.uncharge(tenant, skeys)
        self._reserved.update(zip(skeys, sizes, strict=True))
        self._add(tenant, sum(sizes), landed=False)

    def land(self, tenant: str, skeys: Iterable[bytes]) -> None:
        """The payload of these reserved shard 0s has arrived (those not charged, or landed already, are
        ignored)."""
        reserved = self._reserved
        moved = [(skey, reserved.pop(skey)) for skey in skeys if skey in reserved]
        self._landed.update(moved)
        size = sum(size for _, size in moved)
        self._add(tenant, -size, landed=False)
        self._add(tenant, size, landed=True)

    def uncharge(self, tenant: str, skeys: Iterable[bytes]) -> int:
        """Drop the charges of ``skeys`` (committed, refused or given back); returns their bytes."""
        reserved = landed = 0
        for skey in skeys:
            size = self._reserved.pop(skey, None)
            if size is not None:
                reserved += size
            else:
                landed += self._landed.pop(skey, 0)
        self._add(tenant, -reserved, landed=False)
        self._add(tenant, -landed, landed=True)
        return reserved + landed

    def _add(self, tenant: str, size: int, landed: bool) -> None:
        if not size:
            return
        by = self._landed_by if landed else self._reserved_by
        left = by.get(tenant, 0) + size
        if left:
            by[tenant] = left
        else:
            by.pop(tenant, None)
        if landed:
            self.landed_bytes += size
        else:
            self.reserved_bytes += size
