"""kvtier.gc.policy: the LRU index, watermark eviction planning, TTL expiry and injectable clocks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.gc.policy import LruIndex, ManualClock, expired, plan_eviction
from kvtier.kvstore.node.lru import BlockEntry, TenantLru


def make_index(*keys_sizes: tuple[bytes | int, int], ttl_class: str = "chatbot") -> LruIndex:
    """Index with blocks inserted at times 0, 1, 2, … in argument order (so the first is least recently used)."""
    index = LruIndex()
    for t, (key, size) in enumerate(keys_sizes):
        index.insert(key, size, now=float(t), ttl_class=ttl_class)
    return index


# --- clocks ---


def test_manual_clock_moves_only_when_advanced() -> None:
    clock = ManualClock(100.0)
    assert clock.now() == 100.0
    assert clock.now() == 100.0
    assert clock.advance(5) == 105.0
    assert clock.now() == 105.0
    assert ManualClock().now() == 0.0


def test_manual_clock_refuses_to_go_backwards() -> None:
    clock = ManualClock(10.0)
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-1)
    assert clock.now() == 10.0


# --- LruIndex ---


def test_index_iterates_least_recently_used_first_and_touch_moves_to_most_recent() -> None:
    index = make_index((b"a", 10), (b"b", 20), (b"c", 30))
    assert [e.key for e in index] == [b"a", b"b", b"c"]
    assert index.touch(b"a", now=7.0) is True
    assert [e.key for e in index] == [b"b", b"c", b"a"]
    entry = index.get(b"a")
    assert entry is not None
    assert entry.last_access == 7.0
    assert entry.created == 0.0  # touching does not change when the block was stored


def test_touch_of_an_absent_key_changes_nothing() -> None:
    index = make_index((1, 5))
    assert index.touch(2, now=9.0) is False
    assert [e.key for e in index] == [1]
    assert len(index) == 1


def test_total_bytes_follows_insert_remove_and_replace() -> None:
    index = make_index((1, 100), (2, 50))
    assert index.total_bytes == 150
    removed = index.remove(1)
    assert removed is not None
    assert removed.size_bytes == 100
    assert index.total_bytes == 50
    assert index.remove(1) is None
    index.insert(2, 70, now=5.0, ttl_class="agent", created=4.0)  # re-store replaces the record
    assert index.total_bytes == 70
    entry = index.get(2)
    assert entry is not None
    assert (entry.size_bytes, entry.ttl_class, entry.created, entry.last_access) == (70, "agent", 4.0, 5.0)
    assert len(index) == 1


def test_reinsert_makes_the_block_most_recent() -> None:
    index = make_index((1, 1), (2, 1), (3, 1))
    index.insert(1, 1, now=10.0, ttl_class="chatbot")
    assert [e.key for e in index] == [2, 3, 1]


def test_pop_lru_removes_the_least_recently_used_block() -> None:
    index = make_index((1, 10), (2, 20))
    index.touch(1, now=5.0)
    entry = index.pop_lru()
    assert entry is not None
    assert entry.key == 2
    assert index.total_bytes == 10
    assert index.pop_lru() is not None
    assert index.pop_lru() is None
    assert index.total_bytes == 0


def test_insert_entries_adds_new_blocks_in_order_as_the_most_recent() -> None:
    index = make_index((1, 10))
    index.insert_entries([BlockEntry(2, 20, 5.0, "agent", 4.0), BlockEntry(3, 30, 5.0, "chatbot", 5.0)])
    assert [e.key for e in index] == [1, 2, 3] and index.total_bytes == 60
    entry = index.get(2)
    assert entry is not None and (entry.size_bytes, entry.ttl_class, entry.created) == (20, "agent", 4.0)


def test_insert_entries_replaces_blocks_already_present_as_insert_does() -> None:
    index = make_index((1, 10), (2, 20))
    index.insert_entries([BlockEntry(1, 15, 9.0, "chatbot", 9.0), BlockEntry(3, 30, 9.0, "chatbot", 9.0)])
    assert [e.key for e in index] == [2, 1, 3] and index.total_bytes == 65


def test_insert_entries_rejects_a_negative_size_and_adds_nothing() -> None:
    index = make_index((1, 10))
    with pytest.raises(ValueError, match="negative"):
        index.insert_entries([BlockEntry(2, 5, 1.0, "chatbot", 1.0), BlockEntry(3, -1, 1.0, "chatbot", 1.0)])
    assert len(index) == 1 and index.total_bytes == 10


def test_remove_many_drops_the_keys_present_and_ignores_the_others() -> None:
    index = make_index((1, 10), (2, 20), (3, 30))
    index.remove_many([3, 9, 1])
    assert [e.key for e in index] == [2] and index.total_bytes == 20


def test_insert_rejects_a_negative_size() -> None:
    with pytest.raises(ValueError, match="negative"):
        LruIndex().insert(1, -1, now=0.0, ttl_class="chatbot")


def test_lru_sizes_yields_key_size_pairs_lru_first() -> None:
    index = make_index((b"x", 3), (b"y", 4))
    assert list(index.lru_sizes()) == [(b"x", 3), (b"y", 4)]
    assert b"x" in index
    assert b"z" not in index


# --- plan_eviction ---


# --- TenantLru.live_flags (a node's MATCH) ---


def tenant_lru() -> TenantLru:
    blocks = TenantLru()
    blocks.insert(b"a/" + b"1" * 16, 10, now=5.0, ttl_class="short", created=5.0)
    blocks.insert(b"a/" + b"2" * 16, 10, now=9.0, ttl_class="short", created=9)  # an int time compares as well
    blocks.insert(b"a/" + b"3" * 16, 10, now=1.0, ttl_class="long", created=1.0)
    blocks.insert(b"b/" + b"4" * 16, 10, now=9.0, ttl_class="long", created=9.0)
    return blocks


def test_live_flags_are_one_for_the_tenants_blocks_created_at_or_after_their_classes_oldest_live_time() -> None:
    blob = b"".join(k * 16 for k in (b"1", b"2", b"3", b"4", b"5"))
    oldest = {"short": 5.0, "long": 0.0}
    assert tenant_lru().live_flags(b"a/", blob, 16, oldest) == bytes([1, 1, 1, 0, 0])  # 4 is tenant b's
    assert tenant_lru().live_flags(b"a/", blob, 16, {"short": 6.0, "long": 2.0}) == bytes([0, 1, 0, 0, 0])


def test_live_flags_ask_a_mapping_for_each_class_they_meet_and_pass_on_its_error() -> None:
    asked: list[str] = []

    class Oldest(dict):
        def __missing__(self, ttl_class: str) -> float:
            asked.append(ttl_class)
            if ttl_class == "long":
                raise KeyError(ttl_class)
            return 0.0

    assert tenant_lru().live_flags(b"a/", b"1" * 16 + b"2" * 16, 16, Oldest()) == bytes([1, 1])
    assert asked == ["short"]
    with pytest.raises(KeyError):
        tenant_lru().live_flags(b"a/", b"3" * 16, 16, Oldest())


def test_live_flags_refuse_a_blob_that_is_not_a_whole_number_of_keys() -> None:
    with pytest.raises(ValueError, match="whole number of keys"):
        tenant_lru().live_flags(b"a/", b"1" * 20, 16, {})
    assert tenant_lru().live_flags(b"a/", b"", 16, {}) == b""


def test_nothing_is_evicted_at_or_below_the_high_watermark() -> None:
    consumed: list[int] = []

    def lru() -> Iterator[tuple[int, int]]:
        for key in range(10):
            consumed.append(key)
            yield key, 10

    # 90 used of 100 with high 0.9: exactly at the watermark is not above it.
    assert plan_eviction(90, 100, 0.9, 0.8, lru()) == []
    assert plan_eviction(0, 100, 0.9, 0.8, lru()) == []
    assert consumed == []  # the iterator was not even started


def test_eviction_takes_the_shortest_lru_prefix_that_reaches_the_low_watermark() -> None:
    # used 95 > 90 (high); target <= 80. LRU sizes 4, 6, 3, 50: 95-4=91, -6=85, -3=82, -50=32.
    # 82 is still above 80, so the 50-byte block must go too, and nothing after it.
    lru = [(b"a", 4), (b"b", 6), (b"c", 3), (b"d", 50), (b"e", 1)]
    assert plan_eviction(95, 100, 0.9, 0.8, iter(lru)) == [b"a", b"b", b"c", b"d"]


def test_eviction_stops_at_the_first_block_that_reaches_the_low_watermark_exactly() -> None:
    # used 10 blocks of capacity 10, high 0.9 → evict to <= 8: exactly two 1-sized blocks, not three.
    lru = [(k, 1) for k in range(10)]
    assert plan_eviction(10, 10, 0.9, 0.8, iter(lru)) == [0, 1]


def test_eviction_reads_only_the_prefix_it_needs() -> None:
    consumed: list[int] = []

    def lru() -> Iterator[tuple[int, int]]:
        for key in range(100):
            consumed.append(key)
            yield key, 1

    assert plan_eviction(100, 100, 0.9, 0.5, lru()) == list(range(50))
    assert consumed == list(range(50))


def test_eviction_returns_everything_when_the_index_cannot_cover_the_usage() -> None:
    # 100 used (e.g. pending shards the index does not know about), only 15 bytes evictable.
    assert plan_eviction(100, 100, 0.9, 0.8, iter([(1, 10), (2, 5)])) == [1, 2]


def test_plan_eviction_rejects_inverted_watermarks_and_negative_capacity() -> None:
    with pytest.raises(ValueError, match="watermarks"):
        plan_eviction(10, 10, 0.5, 0.8, iter([]))
    with pytest.raises(ValueError, match="watermarks"):
        plan_eviction(10, 10, 0.9, -0.1, iter([]))
    with pytest.raises(ValueError, match="capacity"):
        plan_eviction(10, -1, 0.9, 0.8, iter([]))


def test_plan_eviction_over_an_lru_index() -> None:
    index = make_index(*((k, 100) for k in range(10)))
    index.touch(0, now=50.0)  # block 0 becomes most recent, so blocks 1 and 2 go first
    victims = plan_eviction(index.total_bytes, 1000, 0.9, 0.8, index.lru_sizes())
    assert victims == [1, 2]
    for key in victims:
        index.remove(key)
    assert index.total_bytes == 800


# --- expired ---


def test_expired_is_strictly_past_created_plus_ttl() -> None:
    index = LruIndex()
    index.insert(1, 1, now=0.0, ttl_class="chatbot")
    index.insert(2, 1, now=5.0, ttl_class="chatbot")
    ttl = {"chatbot": 10.0}
    assert expired(index, ttl, now=10.0) == []  # block 1 at exactly created + ttl still lives
    assert expired(index, ttl, now=10.5) == [1]
    assert expired(index, ttl, now=15.5) == [1, 2]
    assert len(index) == 2  # expired() only reports


def test_touching_does_not_extend_a_blocks_life() -> None:
    index = LruIndex()
    index.insert(1, 1, now=0.0, ttl_class="chatbot")
    index.touch(1, now=9.0)
    assert expired(index, {"chatbot": 10.0}, now=11.0) == [1]


def test_ttl_depends_on_the_class_and_unknown_classes_expire() -> None:
    clock = ManualClock(1000.0)
    index = LruIndex()
    index.insert(b"agent", 1, now=clock.now(), ttl_class="agent")
    index.insert(b"chat", 1, now=clock.now(), ttl_class="chatbot")
    index.insert(b"mystery", 1, now=clock.now(), ttl_class="nope")
    ttl = {"agent": 3 * 86400.0, "chatbot": 7 * 86400.0}
    assert expired(index, ttl, clock.now()) == [b"mystery"]
    clock.advance(4 * 86400)
    assert expired(index, ttl, clock.now()) == [b"agent", b"mystery"]
    clock.advance(4 * 86400)
    assert expired(index, ttl, clock.now()) == [b"agent", b"chat", b"mystery"]


def test_changing_a_class_ttl_applies_to_existing_blocks() -> None:
    index = LruIndex()
    index.insert(1, 1, now=0.0, ttl_class="chatbot")
    assert expired(index, {"chatbot": 100.0}, now=50.0) == []
    assert expired(index, {"chatbot": 10.0}, now=50.0) == [1]


def test_expired_lists_blocks_least_recently_used_first() -> None:
    index = make_index((1, 1), (2, 1), (3, 1))
    index.touch(1, now=10.0)
    assert expired(index, {}, now=0.0) == [2, 3, 1]
