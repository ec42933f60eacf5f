"""The host pool split by tenant, without a fetcher around it: quotas, size classes made on first use, idle
segments dropped for their memory, segments named only by their tenant."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.transfer.host_pool import MAX_CLASSES, Cache, HostPool

SLOT = 4096


@pytest.fixture
def host() -> Iterator[HostPool]:
    pool = HostPool("kvt-test", 16 * SLOT, ["alice", "bob"], [SLOT], 4 * SLOT)  # 8 slots of SLOT each
    yield pool
    pool.close()


def fill(host: HostPool, cache: Cache, n: int) -> np.ndarray:
    """``n`` blocks reserved and published in ``cache`` (unpinned); their slots."""
    slots, _ = host.reserve(cache, n, owner_pid=1)
    keys = [int(i).to_bytes(16, "little") for i in range(len(slots))]
    pins = np.zeros(len(slots), np.uint32)
    cache.pool.publish_many(slots, cache.tenant.tid, keys, cache.pool.slot_bytes, [None] * len(slots), pins)
    return slots


def test_a_tenants_segments_together_touch_at_most_its_quota(host: HostPool) -> None:
    alice = host.tenants["alice"]
    small = host.cache(alice, SLOT)
    assert isinstance(small, Cache) and len(fill(host, small, 20)) == 8  # 8 slots, then evictions
    assert alice.touched() == alice.quota == 8 * SLOT
    big = host.cache(alice, 2 * SLOT)  # a class of its own; the small one's memory is needed: dropped (idle)
    assert isinstance(big, Cache) and big.pool.slot_bytes == 2 * SLOT
    assert len(fill(host, big, 4)) == 4 and alice.touched() == 8 * SLOT
    assert SLOT not in alice.caches and small.id not in host.segments


def test_a_pinned_segment_is_never_dropped_for_another_class(host: HostPool) -> None:
    alice = host.tenants["alice"]
    small = host.cache(alice, SLOT)
    assert isinstance(small, Cache)
    host.reserve(small, 8, owner_pid=1)  # all FILLING: not idle
    big = host.cache(alice, 2 * SLOT)
    assert isinstance(big, Cache) and len(host.reserve(big, 1, owner_pid=1)[0]) == 0
    assert small.id in host.segments


def test_one_tenants_use_leaves_anothers_share_whole(host: HostPool) -> None:
    alice, bob = host.tenants["alice"], host.tenants["bob"]
    a, b = host.cache(alice, SLOT), host.cache(bob, SLOT)
    assert isinstance(a, Cache) and isinstance(b, Cache) and a.pool is not b.pool
    fill(host, a, 100)
    assert len(fill(host, b, 8)) == 8  # bob's eight slots are bob's whatever alice did
    assert host.owned(bob, [a.id]) is None and host.owned(bob, [b.id]) == [b]  # alice's segment is not bob's to name


def test_blocks_no_share_can_hold_and_classes_past_the_limit_in_use_are_refused_with_a_reason() -> None:
    host = HostPool("kvt-test", 256 * SLOT, ["alice"], [], SLOT)
    try:
        alice = host.tenants["alice"]
        assert "start kvtier-fetcher with a larger --size" in str(host.cache(alice, 257 * SLOT))
        assert "start kvtier-fetcher with a larger --size" in str(host.outbox(alice, 257 * SLOT))
        made = [host.cache(alice, k * SLOT + 1) for k in range(1, MAX_CLASSES + 1)]  # each a class of its own
        for cache in made:
            assert isinstance(cache, Cache) and len(host.reserve(cache, 1, owner_pid=1)[0]) == 1  # (FILLING: in use)
        assert f"beyond the {MAX_CLASSES}" in str(host.cache(alice, (MAX_CLASSES + 1) * SLOT + 1))
    finally:
        host.close()


def test_a_tenants_idle_size_classes_retire_so_a_new_size_always_gets_one() -> None:
    """A tenant that went through 16 block sizes used to be answered FULL for every new size, for good."""
    host = HostPool("kvt-test", 64 * SLOT, ["alice"], [SLOT], SLOT)
    try:
        alice = host.tenants["alice"]
        made = [host.cache(alice, k * SLOT + 1) for k in range(1, MAX_CLASSES)]  # with the declared one: 16
        assert all(isinstance(c, Cache) for c in made) and len(alice.classes) == MAX_CLASSES
        host.cache(alice, SLOT + 1)  # the first one made is used again: the second is the least recently used now
        newest = host.cache(alice, MAX_CLASSES * SLOT + 1)
        assert isinstance(newest, Cache) and len(alice.classes) == MAX_CLASSES
        assert SLOT in alice.classes and 2 * SLOT in alice.classes and 3 * SLOT not in alice.classes
        assert made[1].id not in host.segments  # type: ignore[union-attr]
    finally:
        host.close()


def test_segment_ids_tell_a_tenant_nothing_of_anothers_segments(host: HostPool) -> None:
    """Ids were one counter for everyone: the gap between two of bob's segments counted alice's."""
    alice, bob = host.tenants["alice"], host.tenants["bob"]
    ids = []
    for k in range(1, 7):
        host.cache(alice, k * SLOT + 1)
        ids.append(host.cache(bob, k * SLOT + 1).id)  # type: ignore[union-attr]
    assert len(set(ids)) == len(ids) and max(ids) - min(ids) > 1 << 20
