"""Per-tenant quotas: each tenant's share of a primary's budget, and which blocks a removal takes.

A quota (``[tenants.NAME] quota = 0.5`` in the cluster file) is a tenant's share of every primary's budget.
Tenants without one share what the quotas leave, equally among those holding or writing blocks at that
primary (with no quotas at all, the one tenant writing gets the whole budget: a single-tenant cluster is
unchanged). A share is a guarantee, not a cap: space nobody else uses is free to take, and a tenant gives it
back when one under its share needs it (docs/design.md §6):

- a tenant over its share makes room from its own blocks only;
- a tenant within its share may take room from others' blocks, but only from the part of a tenant beyond
  that tenant's share, and only once the payload of its write has arrived (a PUT header alone evicts
  nothing of anyone else);
- the watermark GC takes from whoever is furthest over their share first.

Pure logic, no I/O: the chunk engine feeds it byte totals and per-tenant LRU iterators.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping

from kvtier.kvstore.node.lru import Key


class TenantShares:
    """The quotas of a cluster file, as shares of one primary's budget."""

    def __init__(self, quotas: Mapping[str, float]) -> None:
        self.quotas = dict(quotas)
        self.rest = max(0.0, 1.0 - sum(self.quotas.values()))  # what tenants without a quota share

    def entitled(self, budget: int, active: Iterable[str]) -> dict[str, float]:
        """Bytes of ``budget`` each tenant may hold whatever the others do: its quota, or an equal part of the
        rest among the ``active`` tenants that have none."""
        tenants = set(active) | set(self.quotas)
        unquoted = [t for t in tenants if t not in self.quotas]
        part = self.rest * budget / len(unquoted) if unquoted else 0.0
        return {t: self.quotas[t] * budget if t in self.quotas else part for t in tenants}


def plan_removals(
    needed: int,
    usage: Mapping[str, int],
    entitled: Mapping[str, float],
    blocks: Callable[[str], Iterator[tuple[Key, int]]],
    tenants: Iterable[str],
    beyond_share: bool,
) -> list[Key]:
    """Blocks whose removal frees at least ``needed`` bytes (fewer when not enough are allowed), taken from
    ``tenants`` one block at a time, always from the tenant furthest over its share (``usage - entitled``), each
    tenant's blocks in the order ``blocks(tenant)`` yields them as (key, size) (least recently used first).

    ``beyond_share``: take from a tenant only while it holds more than its share. With a single tenant this
    is plain LRU. ``usage`` is not changed.
    """
    left = dict(usage)
    heap = [(entitled.get(t, 0.0) - left.get(t, 0), t) for t in set(tenants) if left.get(t, 0) > 0]
    heapq.heapify(heap)
    sources: dict[str, Iterator[tuple[Key, int]]] = {}
    out: list[Key] = []
    while needed > 0 and heap:
        under, tenant = heapq.heappop(heap)
        if beyond_share and under >= 0:
            break  # the furthest over is within its share: so is everyone else
        found = next(sources.setdefault(tenant, blocks(tenant)), None)
        if found is None:
            continue  # nothing more of this tenant may go
        key, size = found
        out.append(key)
        needed -= size
        left[tenant] -= size
        heapq.heappush(heap, (entitled.get(tenant, 0.0) - left[tenant], tenant))
    return out
