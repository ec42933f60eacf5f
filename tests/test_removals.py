"""A primary's removal intents in one process: one record per removal, kept until it is cleared, across
reopens; intents an older data dir kept per block are moved into it at open."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import lmdb

from kvtier.kvstore.node.chunks import ChunkEngine, block_key
from tests.test_chunks_deletes import committed, reopened
from tests.test_chunks_writes import CAPACITY


def test_a_removal_is_one_intent_that_outlives_a_reopen_until_cleared(tmp_path: Path) -> None:
    engine = ChunkEngine(tmp_path, CAPACITY)
    keys = [os.urandom(16) for _ in range(300)]
    committed(engine, keys, index=0)
    removal = engine.remove_blocks("default", keys)
    assert not any(engine.live_blocks("default", keys, {"chatbot": 86400.0}.get))  # invisible at once
    with engine.env.begin(db=engine.removal_log.db) as txn:
        assert txn.stat(engine.removal_log.db)["entries"] == 1  # one record for 300 blocks
    engine = reopened(engine, tmp_path)
    (pending,) = engine.removals()
    assert (pending.tenant, pending.when, pending.keys) == ("default", removal.when, keys)
    engine.clear_removal(pending)
    engine = reopened(engine, tmp_path)
    assert engine.removals() == []
    engine.close()


def test_two_removals_in_the_same_clock_tick_stay_apart(tmp_path: Path) -> None:
    engine = ChunkEngine(tmp_path, CAPACITY, clock=lambda: 1_000.0)
    first, second = [os.urandom(16) for _ in range(3)], [os.urandom(16) for _ in range(2)]
    committed(engine, first + second, index=0)
    one, two = engine.remove_blocks("default", first), engine.remove_blocks("default", second)
    assert sorted(len(r.keys) for r in engine.removals()) == [2, 3]
    engine.clear_removal(one)
    assert engine.removals() == [two]
    engine.close()


def test_per_block_intents_of_an_older_data_dir_are_moved_into_one_removal_per_tenant_and_time(tmp_path: Path) -> None:
    ChunkEngine(tmp_path, CAPACITY).close()
    a, b, c = (os.urandom(16) for _ in range(3))
    env = lmdb.open(str(tmp_path / "meta"), max_dbs=8)
    old = env.open_db(b"evicting")
    with env.begin(write=True, db=old) as txn:  # what a node of the previous version left mid-removal
        for tenant, key, when in (("default", a, 5.0), ("default", b, 5.0), ("acme", c, 7.0)):
            txn.put(block_key(tenant, key), struct.pack("<d", when))
    env.close()
    engine = ChunkEngine(tmp_path, CAPACITY)
    moved = {(r.tenant, r.when): sorted(r.keys) for r in engine.removals()}
    assert moved == {("default", 5.0): sorted([a, b]), ("acme", 7.0): [c]}
    with engine.env.begin() as txn:
        assert txn.get(b"evicting") is None  # the old table is gone: nothing is replayed twice
    engine.close()
