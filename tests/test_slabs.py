"""Slab files: slots of every size class map, write and read back across extent boundaries."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import crc32c
import numpy as np
import pytest

from kvtier.kvstore import _native
from kvtier.kvstore.node.disk import DiskBudget
from kvtier.kvstore.node.slabs import EXTENT_BYTES, SIZE_CLASSES, NoSpace, SlabFiles, size_class_for


@pytest.mark.parametrize("size_class", range(len(SIZE_CLASSES)))
def test_every_extent_starts_on_an_mmap_granule(size_class: int) -> None:
    per_extent = SlabFiles.extent_slots(size_class)
    assert per_extent * SIZE_CLASSES[size_class] % mmap.ALLOCATIONGRANULARITY == 0
    assert per_extent * SIZE_CLASSES[size_class] <= max(EXTENT_BYTES, 4 * SIZE_CLASSES[size_class])


@pytest.mark.parametrize("size", [4096, 5120, 7168, 10240, 14336, 1 << 20])
def test_slots_on_both_sides_of_an_extent_boundary_hold_their_bytes(tmp_path: Path, size: int) -> None:
    slabs = SlabFiles(tmp_path)
    size_class = size_class_for(size)
    boundary = SlabFiles.extent_slots(size_class)
    slots = slabs.allocate(size_class, boundary + 2)
    for slot in (0, boundary - 1, boundary, boundary + 1):
        slabs.view(size_class, slots[slot], size, for_write=True)[:] = bytes([slot % 251]) * size
    for slot in (0, boundary - 1, boundary, boundary + 1):
        assert bytes(slabs.view(size_class, slots[slot], size)) == bytes([slot % 251]) * size
    slabs.close()


def test_a_released_slot_is_reused_only_after_its_grace(tmp_path: Path) -> None:
    slabs = SlabFiles(tmp_path)
    (slot,) = slabs.allocate(0, 1)
    assert slabs.release([0], [slot], after=10.0, now=0.0) == 0
    assert slabs.quarantined_bytes == SIZE_CLASSES[0]
    assert slabs.reap(now=9.0) == 0 and slabs.allocate(0, 1) != [slot]
    assert slabs.reap(now=10.0) == SIZE_CLASSES[0]
    assert slabs.allocate(0, 1) == [slot]
    slabs.close()


def test_a_released_slot_without_grace_or_pin_is_free_at_once(tmp_path: Path) -> None:
    slabs = SlabFiles(tmp_path)
    first, second = slabs.allocate(0, 2)
    slabs.pin([0], [second])  # never released here
    assert slabs.release([0, 0], [first, second], after=3.0, now=3.0) == SIZE_CLASSES[0]
    assert slabs.quarantined_bytes == SIZE_CLASSES[0]  # the pinned one waits for its reader
    assert list(slabs.allocate(0, 1)) == [first]
    slabs.close()


def test_a_full_disk_is_no_space_at_allocation(small_disk: Path) -> None:
    slabs = SlabFiles(small_disk)
    (first,) = slabs.allocate(size_class_for(1 << 20), 1)
    slabs.view(size_class_for(1 << 20), first, 1 << 20, for_write=True)[:] = b"x" * (1 << 20)
    with pytest.raises(NoSpace, match="disk full"):
        slabs.allocate(size_class_for(1 << 20), 4)
    assert bytes(slabs.view(size_class_for(1 << 20), first, 4)) == b"xxxx"  # what was stored is intact
    slabs.close()


def slots_until_refused(slabs: SlabFiles, refusal: str) -> int:
    """Allocate 64 KiB slots one at a time until the budget refuses one (``NoSpace`` matching ``refusal``); returns
    how many were taken."""
    size_class = size_class_for(64 << 10)
    taken = 0
    with pytest.raises(NoSpace, match=refusal):
        while True:
            slabs.allocate(size_class, 1)
            taken += 1
    return taken


def test_new_slots_stop_at_the_disks_budget_leaving_the_rest_of_it_free(small_disk: Path) -> None:
    slabs = SlabFiles(small_disk, DiskBudget(small_disk, max_fraction=0.5))
    taken = slots_until_refused(slabs, "max_disk_fraction")
    stats = os.statvfs(small_disk)
    assert taken > 0 and stats.f_bfree / stats.f_blocks >= 0.5  # the rest is the metadata's and the logs'
    slabs.close()


def test_the_headroom_left_free_is_at_most_max_headroom_bytes_on_a_disk_others_filled(small_disk: Path) -> None:
    others = small_disk / "others"
    others.write_bytes(b"x" * (1 << 20))  # half of the disk is someone else's: a share of 0.5 has no room left
    slabs = SlabFiles(small_disk, DiskBudget(small_disk, max_fraction=0.5, max_headroom_bytes=256 << 10))
    taken = slots_until_refused(slabs, "max_headroom_bytes")
    stats = os.statvfs(small_disk)
    assert taken > 0 and stats.f_bavail * stats.f_frsize >= 256 << 10
    slabs.close()


def test_a_pinned_slot_is_not_reused_after_its_grace_until_unpinned(tmp_path: Path) -> None:
    slabs = SlabFiles(tmp_path)
    (slot,) = slabs.allocate(0, 1)
    hold = slabs.pin([0], [slot])  # a reader is still sending it
    assert slabs.release([0], [slot], after=1.0, now=5.0) == 0
    assert slabs.reap(now=5.0) == 0
    assert slot not in slabs.allocate(0, 1)
    slabs.unpin(hold)
    assert slabs.reap(now=5.0) == SIZE_CLASSES[0]
    assert slabs.allocate(0, 1) == [slot]
    slabs.close()


def test_a_slot_pinned_twice_stays_pinned_until_both_pins_are_released(tmp_path: Path) -> None:
    slabs = SlabFiles(tmp_path)
    slots = slabs.allocate(0, 3)
    big = slabs.allocate(size_class_for(1 << 20), 1)
    first = slabs.pin([0, 0, 0, size_class_for(1 << 20)], [slots[0], slots[0], slots[1], big[0]])  # asked twice
    second = slabs.pin([0], [slots[1]])  # another reader
    assert len(slabs.pins) == 3 and (0, slots[0]) in slabs.pins and (0, slots[2]) not in slabs.pins
    assert slabs.pins.pinned(np.asarray([0, 0, 0]), slots).tolist() == [True, True, False]
    slabs.unpin(first)
    assert (0, slots[0]) not in slabs.pins and (0, slots[1]) in slabs.pins and len(slabs.pins) == 1
    assert (size_class_for(1 << 20), big[0]) not in slabs.pins
    slabs.unpin(second)
    slabs.unpin(second)  # (once is enough: a second release changes nothing)
    assert len(slabs.pins) == 0 and (0, slots[1]) not in slabs.pins
    slabs.close()


def test_addresses_point_at_each_slots_bytes_in_its_mapping(tmp_path: Path) -> None:
    slabs = SlabFiles(tmp_path)
    big = size_class_for(1 << 20)
    per_extent = SlabFiles.extent_slots(0)
    small = slabs.allocate(0, per_extent + 2)[[1, per_extent + 1]]  # in two extents
    (large,) = slabs.allocate(big, 1)
    for size_class, slot, fill in ((0, small[0], b"a"), (0, small[1], b"b"), (big, large, b"c")):
        slabs.write(size_class, slot, fill * 100)
    classes = np.asarray([0, big, 0], dtype=np.int64)
    addresses, keep = slabs.addresses(classes, np.asarray([small[1], large, small[0]], dtype=np.int64))
    plan = np.stack([addresses, np.full(3, 100, dtype=np.int64)], axis=1)
    assert _native.crc32c_pieces(plan) == b"".join(
        crc32c.crc32c(fill * 100).to_bytes(4, "little") for fill in (b"b", b"c", b"a")
    )
    assert keep  # the mappings' anchors
    slabs.close()


def test_freed_slots_are_handed_out_in_runs_of_adjacent_slots_longest_first(tmp_path: Path) -> None:
    slabs = SlabFiles(tmp_path)
    slabs.allocate(0, 48)
    every_twelfth = list(range(0, 48, 12))  # one primary's evicted blocks at this node
    slabs.release([0] * 4, every_twelfth, after=0.0, now=0.0)
    slabs.release([0] * 8, list(range(26, 34)), after=0.0, now=0.0)  # others', of the same age
    assert slabs.allocate(0, 6).tolist() == list(range(26, 32))
    assert slabs.allocate(0, 4).tolist() == [0, 12, 32, 33]  # the rest of the run, then single slots in order


def test_free_slots_merge_into_one_run_when_the_gaps_between_them_are_freed(tmp_path: Path) -> None:
    slabs = SlabFiles(tmp_path)
    slabs.allocate(0, 10)
    slabs.release([0] * 5, [0, 2, 4, 6, 8], after=0.0, now=0.0)
    assert slabs.allocate(0, 1).tolist() == [0]  # the runs are ordered now; freeing the gaps must merge them
    slabs.release([0] * 4, [3, 5, 7, 9], after=0.0, now=0.0)
    assert slabs.allocate(0, 8).tolist() == list(range(2, 10))
