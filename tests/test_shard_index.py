"""The chunk engine's name index of shard records (kvstore/node/shard_index.py over csrc/shard_index.c): a batch of
names in, arrays out, and the same answers as a dict of bytes would give."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from kvtier.kvstore._shard_index import ShardIndexTable
from kvtier.kvstore.node.chunks import ShardRecord
from kvtier.kvstore.node.shard_index import RECORD, ShardIndex, name_table, table_names


def names_of(count: int, prefix: bytes = b"default/") -> np.ndarray:
    keys = os.urandom(16 * count)
    return name_table(prefix, keys, 16, np.arange(count) % 12)


def records_of(count: int, first_slot: int = 0) -> np.ndarray:
    records = np.zeros(count, dtype=RECORD)
    records["slot"] = np.arange(first_slot, first_slot + count)
    records["crc"] = np.arange(count) * 7
    return records


def test_inserts_lookups_and_removes_agree_with_a_dict_through_growth_and_deleted_slots() -> None:
    index, model = ShardIndex(), {}
    rng = random.Random(7)
    for round_ in range(30):
        names = names_of(700)
        records = records_of(700, first_slot=round_ * 1000)
        assert not index.insert(names, records).any()
        model.update(zip(table_names(names), list(records), strict=True))
        gone = rng.sample(sorted(model), 300)
        found, old = index.remove(np.frombuffer(b"".join(gone), dtype=np.uint8).reshape(300, -1))
        assert found.all()
        assert [bytes(r) for r in old] == [bytes(model.pop(name)) for name in gone]
    assert len(index) == len(model) == 30 * 400
    every = np.frombuffer(b"".join(model), dtype=np.uint8).reshape(len(model), -1)
    found, records = index.lookup(every)
    assert found.all() and [bytes(r) for r in records] == [bytes(r) for r in model.values()]
    assert not index.contains(names_of(500)).any()  # names never stored


def test_a_name_already_present_or_repeated_in_the_call_keeps_its_first_record() -> None:
    index = ShardIndex()
    names = names_of(4)
    index.insert(names[:1], records_of(1, first_slot=100))
    again = np.concatenate([names, names[2:3]])  # row 0 stored before; row 4 repeats row 2
    assert index.insert(again, records_of(5)).tolist() == [True, False, False, False, True]
    _, records = index.lookup(names)
    assert records["slot"].tolist() == [100, 1, 2, 3]
    assert len(index) == 4


def test_a_name_removed_twice_in_one_call_is_found_once() -> None:
    index = ShardIndex()
    names = names_of(3)
    index.insert(names, records_of(3))
    found, old = index.remove(np.concatenate([names[1:2], names[1:2]]))
    assert found.tolist() == [True, False] and old["slot"].tolist() == [1, 0]
    assert index.contains(names).tolist() == [True, False, True]


def test_names_of_other_widths_are_kept_apart_and_looked_up_together() -> None:
    index = ShardIndex()
    short, long = names_of(3, b"a/"), names_of(3, b"tenant-b/")
    index.insert(short, records_of(3))
    index.insert(long, records_of(3, first_slot=10))
    mixed = [table_names(long)[0], b"x" * 12, table_names(short)[2]]
    found, records = index.lookup_names(mixed)
    assert found.tolist() == [True, False, True] and records["slot"].tolist() == [10, 0, 2]
    assert sorted(len(names) for names, _ in index.items()) == [3, 3]


def test_a_name_table_of_the_wrong_shape_is_refused_and_changes_nothing() -> None:
    index = ShardIndex()
    names = names_of(2)
    index.insert(names, records_of(2))
    with pytest.raises(ValueError, match="rows"):
        index.insert(names, records_of(3))
    assert len(index) == 2 and index.contains(names).all()


def test_records_from_lmdb_come_back_as_the_same_shard_records() -> None:
    index = ShardIndex()
    stored = [
        ShardRecord(2, 0, 5, 17, 6554, 0xDEADBEEF, 65536, 1234.5, bytes(range(16)), "agent"),
        ShardRecord(2, 11, 9, 3, 100, 7, 1000, 99.0, bytes(16), "chatbot"),
    ]
    names = [b"default/" + bytes(16) + b"\x00", b"t/" + bytes(range(16)) + b"\x0b"]
    index.add_packed(names, [record.pack() for record in stored])
    found, records = index.lookup_names(names)
    assert found.all()
    for record, want in zip(records, stored, strict=True):
        fields = [record[f].item() for f in ("state", "index", "size_class", "slot", "length", "crc", "block_len")]
        assert fields == list(want[:7]) and record["created"] == want.created
        assert record["header"].tobytes() == want.header
        assert index.ttl_classes[int(record["ttl"])] == want.ttl_class


def test_more_than_255_ttl_classes_are_refused() -> None:
    index = ShardIndex()
    for i in range(255):
        assert index.ttl_id(f"class-{i}") == i
    assert index.ttl_id("class-3") == 3
    with pytest.raises(ValueError, match="255"):
        index.ttl_id("one-too-many")


def test_a_table_of_impossible_widths_or_used_before_it_is_made_is_refused() -> None:
    with pytest.raises(ValueError, match="between 1 and 65535"):
        ShardIndexTable(0, 49)
    bare = ShardIndexTable.__new__(ShardIndexTable)
    with pytest.raises(RuntimeError, match="before __init__"):
        bare.contains(bytes(25))
    assert len(bare) == 0


def _agrees(table: ShardIndexTable, model: dict[bytes, bytes]) -> None:
    """Every name of ``model`` is found with its value, ``items`` gives exactly the model, a new name is absent."""
    keys = b"".join(model)
    out = bytearray(len(model) * table.value_width)
    assert table.lookup(keys, out) == b"\x01" * len(model)
    assert bytes(out) == b"".join(model.values())
    names, values = table.items()
    width, value_width = table.key_width, table.value_width
    got = {
        names[i * width : (i + 1) * width]: values[i * value_width : (i + 1) * value_width] for i in range(len(table))
    }
    assert got == model and len(table) == len(model)
    assert table.contains(os.urandom(width)) == b"\x00"


def test_a_growth_moves_entries_a_batch_at_a_time_and_answers_stay_whole_while_it_does() -> None:
    table, model = ShardIndexTable(25, 8), {}
    rng = random.Random(3)

    def insert(count: int) -> None:
        keys, values = os.urandom(25 * count), os.urandom(8 * count)
        assert table.insert(keys, values, False) == bytes(count)
        model.update((keys[i * 25 : (i + 1) * 25], values[i * 8 : (i + 1) * 8]) for i in range(count))

    while table.moving == 0:  # 16 rows an insert drain 128 slots: the first growth (from 1,024 slots) takes several
        insert(16)
    assert 0 < table.moving < len(table)  # both tables hold entries
    _agrees(table, model)
    again = rng.sample(sorted(model), 8)  # names already here, wherever they are: kept, or replaced when asked
    assert table.insert(b"".join(again), bytes(64), False) == b"\x01" * 8
    assert table.insert(b"".join(again[:4]), b"\xff" * 32, True) == b"\x01" * 4
    model.update(dict.fromkeys(again[:4], b"\xff" * 8))
    gone = rng.sample(sorted(model), 40)
    out = bytearray(40 * 8)
    assert table.remove(b"".join(gone), out) == b"\x01" * 40
    assert bytes(out) == b"".join(model.pop(name) for name in gone)
    _agrees(table, model)
    inserts = 0
    while table.moving:
        insert(16)
        inserts += 1
    assert inserts > 1
    _agrees(table, model)
