"""Host staging pool: slot states, LRU eviction around pins, generations as seqlocks, sealed anonymous segments."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvtier.transfer.staging import Outbox, PoolError, SlotMap, SlotState, StagingPool, memory_file, read_only

SLOT = 4096
TENANT = 7


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture
def shm_name() -> str:
    return "kvt-test"  # only a label: a segment has no name anyone could open


def fill(pool: StagingPool, i: int, pins: int = 0) -> tuple[int, int]:
    reserved = pool.reserve(owner_pid=1)
    assert reserved is not None
    slot, gen = reserved
    pool.view(slot)[:8] = i.to_bytes(8, "little")
    pool.publish(slot, TENANT, key(i), SLOT, None, pins)
    return slot, gen


def reader_of(pool: StagingPool) -> SlotMap:
    """A reader's mapping of ``pool``: from a read-only descriptor, as the fetcher hands them out."""
    fd = read_only(pool.fd)
    try:
        return SlotMap.open(fd)
    finally:
        os.close(fd)


def run_child(code: str, fd: int) -> subprocess.Popen[str]:
    """A real second process running ``code`` with descriptor ``fd`` (a reader's); it prints 'ready' once its setup
    is done."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        pass_fds=[fd],
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", line
    return proc


def test_a_published_block_is_found_by_key_and_tenant_only(shm_name: str) -> None:
    pool = StagingPool.create(shm_name, 4 * SLOT, SLOT)
    slot, _ = fill(pool, 1)
    assert pool.lookup(TENANT, key(1)) == slot
    assert pool.lookup(TENANT + 1, key(1)) is None
    assert pool.lookup(TENANT, key(1), length=SLOT - 1) is None
    assert pool.lookup(TENANT, key(1), hdr=b"x" * 16) is None
    pool.close()


def test_eviction_takes_the_least_recently_used_ready_slot_and_never_a_pinned_one(shm_name: str) -> None:
    pool = StagingPool.create(shm_name, 3 * SLOT, SLOT)
    pinned, pinned_gen = fill(pool, 0, pins=1)
    oldest, _ = fill(pool, 1)
    newer, newer_gen = fill(pool, 2)
    assert pool.pin(newer, newer_gen) and pool.unpin(newer, newer_gen)  # touched: now the most recent
    reserved = pool.reserve(owner_pid=1)
    assert reserved is not None and reserved[0] == oldest
    assert pool.lookup(TENANT, key(1)) is None
    assert pool.reserve(owner_pid=1) is not None  # takes `newer`
    assert pool.reserve(owner_pid=1) is None  # only the pinned slot and two FILLING ones are left
    assert pool.valid(pinned, pinned_gen) and pool.state[pinned] == SlotState.PINNED
    pool.close()


def test_eviction_order_holds_over_many_turnovers_of_the_pool(shm_name: str) -> None:
    pool = StagingPool.create(shm_name, 8 * SLOT, SLOT)
    held = {i: fill(pool, i) for i in range(8)}  # block i in slot held[i][0]
    for i in range(8, 400):  # each new block evicts the least recently used one; a touch moves one to the end
        touched = i - 7 + (i % 3)  # one of the oldest few, so the order is not plain insertion order
        if touched in held and touched != i - 8:
            assert pool.pin(*held[touched]) and pool.unpin(*held[touched])
        oldest = min(held, key=lambda b: int(pool.lru[held[b][0]]))
        held[i] = fill(pool, i)
        assert held[i][0] == held.pop(oldest)[0] and pool.lookup(TENANT, key(oldest)) is None
    assert sorted(pool.lookup(TENANT, key(b)) for b in held) == sorted(slot for slot, _ in held.values())
    pool.close()


def test_a_reader_holding_a_reused_slot_sees_a_miss_in_another_process(shm_name: str) -> None:
    pool = StagingPool.create(shm_name, 1 * SLOT, SLOT)
    slot, gen = fill(pool, 1)
    fd = read_only(pool.fd)
    reader = run_child(
        f"""
        from kvtier.transfer.staging import SlotMap
        m = SlotMap.open({fd})
        print("ready", flush=True)
        input()
        view = m.view({slot}, 8)
        print(int.from_bytes(view, "little"), m.valid({slot}, {gen}), flush=True)
        """,
        fd,
    )
    pool.reserve(owner_pid=1)  # evicts block 1: the slot is being refilled under a new generation
    pool.view(slot)[:8] = (99).to_bytes(8, "little")
    out, _ = reader.communicate("go\n", timeout=30)
    assert out.split() == ["99", "False"]  # it read the slot's new bytes, and knows they are not block 1's
    os.close(fd)
    pool.close()


def test_readers_see_the_writers_bytes_without_copies(shm_name: str) -> None:
    pool = StagingPool.create(shm_name, 2 * SLOT, SLOT)
    slot, gen = fill(pool, 5)
    reader = reader_of(pool)
    assert int.from_bytes(reader.view(slot, 8), "little") == 5 and reader.valid(slot, gen)
    pool.view(slot)[:8] = (6).to_bytes(8, "little")
    assert int.from_bytes(reader.view(slot, 8), "little") == 6
    assert reader.stats().ready == 1 and reader.stats().writer_pid == pool.writer_pid
    reader.close()
    pool.close()


def test_a_segment_has_no_name_anyone_could_open(shm_name: str) -> None:
    before = set(os.listdir("/dev/shm"))
    pool = StagingPool.create(shm_name, 4 * SLOT, SLOT)
    assert set(os.listdir("/dev/shm")) == before
    assert os.readlink(f"/proc/self/fd/{pool.fd}") == f"/memfd:{shm_name} (deleted)"
    pool.close()


def test_a_readers_mapping_is_read_only_and_no_descriptor_can_make_one_writable(shm_name: str) -> None:
    pool = StagingPool.create(shm_name, 4 * SLOT, SLOT)
    slot, gen = fill(pool, 3)
    reader = reader_of(pool)
    with pytest.raises(TypeError):
        reader.view(slot)[0] = 1
    with pytest.raises(ValueError, match="read-only"):
        reader.gen[slot] = 0  # the table too
    address = reader.address - reader.data_offset
    assert ctypes.CDLL(None, use_errno=True).mprotect(ctypes.c_void_p(address), 4096, 3) == -1
    fd = pool.fd  # even the writer's own read-write descriptor: the seal binds every holder
    with pytest.raises(PermissionError):
        mmap.mmap(fd, os.fstat(fd).st_size)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)
    with pytest.raises(PermissionError):
        os.pwrite(fd, b"x", reader.data_offset)
    pool.view(slot)[:8] = (4).to_bytes(8, "little")  # the writer's mapping, made before the seal, still writes
    assert int.from_bytes(reader.view(slot, 8), "little") == 4 and reader.valid(slot, gen)
    reader.close()
    pool.close()


def test_never_used_slots_are_taken_only_within_the_limit_given(shm_name: str) -> None:
    pool = StagingPool.create(shm_name, 8 * SLOT, SLOT)
    slots, _ = pool.reserve_many(3, owner_pid=1, fresh=2)
    assert slots.tolist() == [0, 1] and pool.touched_bytes == 2 * SLOT  # the lowest first; memory touched by them
    pool.publish_many(slots, TENANT, [key(0), key(1)], SLOT, [None, None], np.zeros(2, np.uint32))
    again, _ = pool.reserve_many(1, owner_pid=1, fresh=0)  # no fresh slot allowed: the oldest block is evicted
    assert again.tolist() == [0] and pool.lookup(TENANT, key(0)) is None and pool.touched_bytes == 2 * SLOT
    assert not pool.idle()  # a slot is being filled
    pool.abandon(int(again[0]), int(pool.gen[again[0]]))
    assert pool.idle()
    pool.close()


def test_a_memory_file_that_is_not_a_pool_is_refused(shm_name: str) -> None:
    fd = memory_file(shm_name, 3 * SLOT)
    os.pwrite(fd, b"someone else's data", 0)
    with pytest.raises(PoolError, match="not a kvtier staging pool"):
        SlotMap.open(fd)
    os.close(fd)


def test_an_outbox_gives_slots_out_once_and_takes_back_only_what_it_gave(shm_name: str) -> None:
    box = Outbox(shm_name, SLOT, 2)
    slots, gens = box.take(3)
    assert slots.tolist() == [0, 1] and box.take(1)[0].size == 0  # two slots: the third is not there
    box.view(0)[:3] = b"abc"  # writable: engines fill it
    assert box.give_back(slots, gens + 1) == 0  # stale generations take nothing back
    assert box.give_back(slots[:1], gens[:1]) == 1 and box.give_back(slots[:1], gens[:1]) == 0  # not twice
    again, new_gens = box.take(2)
    assert again.tolist() == [0] and new_gens[0] == gens[0] + 1  # the slot given back, at a new generation
    box.close()


def test_a_superseded_pinned_copy_is_freed_at_its_last_unpin(shm_name: str) -> None:
    pool = StagingPool.create(shm_name, 4 * SLOT, SLOT)
    old, old_gen = fill(pool, 1, pins=1)
    new, _ = fill(pool, 1)
    assert pool.lookup(TENANT, key(1)) == new
    assert pool.valid(old, old_gen)  # the pinned reader keeps its bytes
    pool.unpin(old, old_gen)
    assert pool.state[old] == SlotState.FREE and not pool.valid(old, old_gen)
    pool.close()


def test_batch_lookups_pins_and_unpins_match_the_single_ones(shm_name: str) -> None:
    pool = StagingPool.create(shm_name, 4 * SLOT, SLOT)
    slot0, _ = fill(pool, 0)
    reserved = pool.reserve(owner_pid=1)
    assert reserved is not None
    pool.publish(reserved[0], TENANT, key(1), SLOT, b"h" * 16, 0)
    found = pool.find(TENANT, [key(0), key(1), key(1), key(2), key(0)], SLOT, [None, b"h" * 16, b"x" * 16, None, None])
    assert found.tolist() == [slot0, reserved[0], -1, -1, slot0]
    gens = pool.pin_many(found[[0, 4]])
    assert pool.pins[slot0] == 2 and pool.state[slot0] == SlotState.PINNED
    assert pool.unpin_many(found[[0]], gens[:1]) == 1 and pool.state[slot0] == SlotState.PINNED
    assert pool.unpin_many(found[[0, 0]], gens) == 1  # only one pin was left: the stale second is refused
    assert pool.state[slot0] == SlotState.READY and pool.pins[slot0] == 0
    pool.close()


def test_a_reader_racing_slot_reuse_never_accepts_torn_bytes(shm_name: str) -> None:
    """The writer refills two slots with one byte value each, again and again; a reader process reads them in a
    loop and keeps only reads whose generation held across the read: every one of those is a single value."""
    pool = StagingPool.create(shm_name, 2 * SLOT * 16, SLOT * 16)
    fill(pool, 0)
    fd = read_only(pool.fd)
    reader = run_child(
        f"""
        import time
        import numpy as np
        from kvtier.transfer.staging import READY, SlotMap
        m = SlotMap.open({fd})
        print("ready", flush=True)
        kept = torn = rejected = 0
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            for slot in range(m.slots):
                gen = int(m.gen[slot])
                if int(m.state[slot]) != READY:
                    continue
                data = np.frombuffer(m.view(slot), np.uint8).copy()
                if not m.valid(slot, gen):
                    rejected += 1
                elif (data == data[0]).all():
                    kept += 1
                else:
                    torn += 1
        print(kept, torn, rejected, flush=True)
        """,
        fd,
    )
    value = 0
    while reader.poll() is None:
        value = (value + 1) % 251
        reserved = pool.reserve(owner_pid=1)
        if reserved is None:
            continue
        pool.view(reserved[0])[:] = bytes([value]) * pool.slot_bytes
        pool.publish(reserved[0], TENANT, key(value % 2), pool.slot_bytes, None, 0)
    out, _ = reader.communicate(timeout=30)
    kept, torn, rejected = map(int, out.split())
    assert torn == 0 and kept > 0 and rejected > 0, (kept, torn, rejected)
    os.close(fd)
    pool.close()


def test_a_batch_that_publishes_one_key_twice_keeps_the_last_copy(shm_name: str) -> None:
    pool = StagingPool.create(shm_name, 4 * SLOT, SLOT)
    slots, _ = pool.reserve_many(2, owner_pid=1)
    pool.publish_many(slots, TENANT, [key(1), key(1)], SLOT, [b"a" * 16, b"b" * 16], np.zeros(2, np.uint32))
    assert pool.lookup(TENANT, key(1), hdr=b"b" * 16) == slots[1]
    assert pool.state[slots[0]] == SlotState.FREE
    stats = pool.stats()
    assert (stats.ready, stats.free) == (1, pool.slots - 1)
    assert len(pool.reserve_many(pool.slots, owner_pid=1)[0]) == pool.slots  # all reusable, nothing dangling
    pool.close()


def test_a_batch_published_for_later_is_visible_to_readers_at_once_and_indexed_before_any_other_call(
    shm_name: str,
) -> None:
    pool = StagingPool.create(shm_name, 4 * SLOT, SLOT)
    old, _ = fill(pool, 1)
    slots, gens = pool.reserve_many(2, owner_pid=1)
    pool.publish_many(slots, TENANT, [key(1), key(2)], SLOT, [None, None], np.array([1, 0], np.uint32), later=True)
    reader = reader_of(pool)
    assert reader.valid_many(slots, gens).tolist() == [True, True]  # the table is written: readers see the blocks
    assert pool.state[old] == SlotState.READY  # the copy the new one supersedes goes once the index learns of it
    assert pool.find(TENANT, [key(1), key(2)], SLOT, [None, None]).tolist() == slots.tolist()  # settled first
    assert pool.state[old] == SlotState.FREE
    evictable = set(range(pool.slots)) - {int(slots[0])}  # the unpinned one is in the LRU order, the pinned one not
    assert set(pool.reserve_many(pool.slots, owner_pid=1)[0].tolist()) == evictable
    reader.close()
    pool.close()


def test_batch_validity_matches_the_single_checks(shm_name: str) -> None:
    pool = StagingPool.create(shm_name, 4 * SLOT, SLOT)
    ready, ready_gen = fill(pool, 1)
    pinned, pinned_gen = fill(pool, 2, pins=1)
    filling, filling_gen = pool.reserve(owner_pid=1)  # type: ignore[misc]
    slots = np.array([ready, pinned, filling, ready, pool.slots + 3], np.uint32)
    gens = np.array([ready_gen, pinned_gen, filling_gen, ready_gen + 1, 0], np.uint64)
    assert pool.valid_many(slots, gens).tolist() == [
        pool.valid(int(s), int(g)) for s, g in zip(slots, gens, strict=True)
    ]
    assert pool.valid_many(slots, gens).tolist() == [True, True, False, False, False]
    assert pool.filling_many(slots, gens).tolist() == [False, False, True, False, False]
    pool.close()


def test_an_evicted_key_is_never_found_again_whatever_its_slot_holds_by_then(shm_name: str) -> None:
    pool = StagingPool.create(shm_name, 2 * SLOT, SLOT)
    evicted: list[bytes] = []
    pool.on_evict = lambda tenant, k, slot, gen: evicted.append(k)
    fill(pool, 1)
    fill(pool, 2)
    slots, _ = pool.reserve_many(1, owner_pid=1)  # evicts key 1; the index forgets it at the next settle
    pool.publish_many(slots, TENANT, [key(3)], SLOT, [None], np.zeros(1, np.uint32), later=True)  # same slot
    found = pool.find(TENANT, [key(1), key(2), key(3)], SLOT, [None] * 3)
    assert found.tolist() == [-1, int(slots[0]) ^ 1, int(slots[0])] and evicted == [key(1)]
    pool.close()


def test_keys_published_as_rows_are_found_as_bytes_and_rows_of_another_shape_are_refused(shm_name: str) -> None:
    pool = StagingPool.create(shm_name, 4 * SLOT, SLOT)
    slots, _ = pool.reserve_many(2, owner_pid=1)
    keys = [key(1), bytes(31) + b"\x01"]  # (one of each length: the rows must be one width)
    with pytest.raises(ValueError, match="key rows of shape"):
        pool.publish_many(
            slots, TENANT, keys, SLOT, [None] * 2, np.zeros(2, np.uint32), rows=np.zeros((2, 8), np.uint8)
        )
    rows = np.frombuffer(key(1) + key(2), np.uint8).reshape(2, 16)
    pool.publish_many(slots, TENANT, [key(1), key(2)], SLOT, [None] * 2, np.zeros(2, np.uint32), rows=rows)
    assert pool.find(TENANT, [key(2), key(1)], SLOT, [None] * 2).tolist() == slots[::-1].tolist()
    pool.close()


def test_a_batch_with_a_digest_for_every_key_finds_only_the_blocks_stored_with_it(shm_name: str) -> None:
    pool = StagingPool.create(shm_name, 4 * SLOT, SLOT)
    slots, _ = pool.reserve_many(2, owner_pid=1)
    pool.publish_many(slots, TENANT, [key(1), key(2)], SLOT, [b"a" * 16, b"b" * 16], np.zeros(2, np.uint32))
    found = pool.find(TENANT, [key(1), key(2), key(3)], SLOT, [b"a" * 16, b"x" * 16, b"a" * 16])
    assert found.tolist() == [slots[0], -1, -1]
    assert pool.find(TENANT, [key(2), key(1)], SLOT, [b"b" * 16, b"a" * 16]).tolist() == slots[::-1].tolist()
    pool.close()
