"""The chunk engine's deletes in one process: a deleted shard's record stays in LMDB, marked dead, until its slot
is reused (the new record overwrites it); a reopened node sees exactly the live shards either way."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvtier.kvstore.node.chunks import ChunkEngine, WriteBatch
from kvtier.kvstore.wire.protocol import Status
from tests.test_chunks_writes import CAPACITY, SHARD, SLOT, batch, staged


def committed(engine: ChunkEngine, keys: list[bytes], index: int = 2) -> WriteBatch:
    put_id, shards = staged(engine, keys, index)
    assert engine.commit("default", put_id) == bytes([Status.OK]) * len(keys)
    return shards


def slot_records(engine: ChunkEngine) -> int:
    with engine.env.begin(db=engine.slots_db) as txn:
        return txn.stat(engine.slots_db)["entries"]


def reopened(engine: ChunkEngine, path: Path) -> ChunkEngine:
    engine.close()
    return ChunkEngine(path, CAPACITY)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path


def test_deleted_shards_stay_deleted_when_the_node_reopens(path: Path) -> None:
    engine = ChunkEngine(path, CAPACITY)
    keys = [os.urandom(16) for _ in range(8)]
    committed(engine, keys)
    assert engine.delete("default", keys[:5]) == 5
    assert engine.used_bytes == 3 * SLOT
    engine = reopened(engine, path)
    assert [len(list(engine.shard_records("default", k))) for k in keys] == [0] * 5 + [1] * 3
    assert engine.used_bytes == 3 * SLOT and engine.counts()["shards"] == 3
    assert slot_records(engine) == 3  # the dead records went at open
    engine.close()


def test_a_slot_reused_after_a_delete_holds_the_new_shard_after_reopen(path: Path) -> None:
    engine = ChunkEngine(path, CAPACITY)
    old, new = os.urandom(16), os.urandom(16)
    first = committed(engine, [old])
    engine.delete("default", [old])
    second = committed(engine, [new])
    assert second.slot.tolist() == first.slot.tolist()  # the freed slot, its dead record overwritten
    engine = reopened(engine, path)
    assert [r.slot for r in engine.shard_records("default", new)] == first.slot.tolist()
    assert list(engine.shard_records("default", old)) == []
    assert engine.used_bytes == SLOT and slot_records(engine) == 1
    engine.close()


def test_a_shard_deleted_twice_across_a_reopen_frees_its_slot_once(path: Path) -> None:
    engine = ChunkEngine(path, CAPACITY)
    key = os.urandom(16)
    committed(engine, [key])
    engine.delete("default", [key])
    engine = reopened(engine, path)
    assert engine.delete("default", [key]) == 0 and engine.used_bytes == 0
    engine.close()


def test_a_repaired_shard_replaces_its_record_and_the_old_one_is_gone_after_reopen(path: Path) -> None:
    engine = ChunkEngine(path, CAPACITY)
    key = os.urandom(16)
    first = committed(engine, [key])
    repair = batch([key], 2)
    repair.replace = True
    put_id = os.urandom(8)
    engine.reserve("default", repair)
    engine.slabs.write(int(repair.size_class[0]), int(repair.slot[0]), b"r" * SHARD)
    engine.stage("default", put_id, repair)
    assert engine.commit("default", put_id) == bytes([Status.OK])
    assert repair.slot.tolist() != first.slot.tolist() and engine.used_bytes == SLOT
    engine = reopened(engine, path)
    assert [r.slot for r in engine.shard_records("default", key)] == repair.slot.tolist()
    assert engine.used_bytes == SLOT and slot_records(engine) == 1
    engine.close()


def test_dropped_expired_shards_stay_dropped_after_reopen(path: Path) -> None:
    engine = ChunkEngine(path, CAPACITY)
    keys = [os.urandom(16) for _ in range(4)]
    committed(engine, keys)
    assert engine.drop_shards("default", [(k, 2) for k in keys[:2]]) == 2
    engine = reopened(engine, path)
    assert [len(list(engine.shard_records("default", k))) for k in keys] == [0, 0, 1, 1]
    assert engine.used_bytes == 2 * SLOT
    engine.close()


def test_marks_over_several_bitmap_pages_keep_exactly_the_live_shards_across_a_reopen(path: Path) -> None:
    engine = ChunkEngine(path, CAPACITY)
    keys = [os.urandom(16) for _ in range(CAPACITY // SLOT)]  # every slot: the marks span two pages
    first = committed(engine, keys)
    engine.delete("default", keys[::2])
    again = committed(engine, [os.urandom(16) for _ in range(len(keys) // 4)])
    assert np.isin(again.slot, first.slot[::2]).all()  # reused slots, their dead records overwritten
    live = len(keys) // 2 + again.n
    engine = reopened(engine, path)
    assert engine.used_bytes == live * SLOT and slot_records(engine) == engine.counts()["shards"] == live
    assert [len(list(engine.shard_records("default", k))) for k in keys[:4]] == [0, 1, 0, 1]
    engine.close()
