"""Block records in commit order (kvstore.node.block_table): looked up by name, stored by sequence number, the index
rebuilt at open; records of an older data dir (keyed by name) are moved in once."""

from __future__ import annotations

import os
from pathlib import Path

import lmdb

from kvtier.kvstore.node.block_table import BlockTable
from kvtier.kvstore.node.chunks import ChunkEngine, block_key
from tests.test_chunks_deletes import committed, reopened
from tests.test_chunks_writes import CAPACITY


def opened(path: Path) -> tuple[lmdb.Environment, BlockTable]:
    env = lmdb.open(str(path), max_dbs=4)
    with env.begin(write=True) as txn:
        return env, BlockTable.open(env, txn)[0]


def test_records_are_found_by_name_and_kept_in_commit_order(tmp_path: Path) -> None:
    env, table = opened(tmp_path)
    names = [os.urandom(16) for _ in range(5)]  # random names: their order is not the commit order
    with env.begin(write=True) as txn:
        table.put_many(txn, [(n, b"rec-%d" % i) for i, n in enumerate(names)])
    with env.begin() as txn:
        assert [name for name, _ in table.records(txn)] == names
        assert table.get(txn, names[3]) == b"rec-3" and table.get(txn, b"absent") is None
        assert table.get_many(txn, [names[0], b"absent", names[4]]) == {names[0]: b"rec-0", names[4]: b"rec-4"}


def test_a_record_stored_again_is_updated_in_place(tmp_path: Path) -> None:
    env, table = opened(tmp_path)
    a, b = b"tenant/a", b"tenant/b"
    with env.begin(write=True) as txn:
        table.put_many(txn, [(a, b"old"), (b, b"b")])
        table.put_many(txn, [(a, b"new")])
    with env.begin() as txn:
        assert list(table.records(txn)) == [(a, b"new"), (b, b"b")] and len(table) == 2


def test_the_index_is_rebuilt_at_open_and_numbers_continue_after_the_last(tmp_path: Path) -> None:
    env, table = opened(tmp_path)
    with env.begin(write=True) as txn:
        table.put_many(txn, [(b"t/a", b"1"), (b"t/b", b"2"), (b"t/c", b"3")])
        assert table.delete_many(txn, [b"t/a", b"t/x"]) == [b"t/a"] and table.delete_many(txn, [b"t/a"]) == []
    env.close()
    env, table = opened(tmp_path)
    with env.begin(write=True) as txn:
        assert table.get(txn, b"t/b") == b"2" and table.get(txn, b"t/a") is None
        table.put_many(txn, [(b"t/d", b"4")])
    with env.begin() as txn:
        assert [name for name, _ in table.records(txn)] == [b"t/b", b"t/c", b"t/d"]


def test_block_records_keyed_by_name_in_an_older_data_dir_are_moved_at_open(tmp_path: Path) -> None:
    engine = ChunkEngine(tmp_path, CAPACITY)
    keys = [os.urandom(16) for _ in range(4)]
    committed(engine, keys, index=0)
    stored = {key: engine.block_record("default", key) for key in keys}
    with engine.env.begin(write=True) as txn:  # what the previous version kept: name -> record
        old = engine.env.open_db(b"blocks", txn=txn)
        for name, packed in list(engine.block_table.records(txn)):
            txn.put(name, packed, db=old)
        txn.drop(engine.block_table.db, delete=False)
    engine = reopened(engine, tmp_path)
    assert {key: engine.block_record("default", key) for key in keys} == stored
    assert sorted(e.key for e in engine.lru_entries()) == sorted(block_key("default", k) for k in keys)
    with engine.env.begin() as txn:
        assert txn.get(b"blocks") is None  # moved once: the old table is gone
    engine.close()


def test_records_put_as_tables_are_stored_once_each_new_again_or_twice_in_one_call(tmp_path: Path) -> None:
    import numpy as np

    env, table = opened(tmp_path)
    names = [os.urandom(16) for _ in range(4)]

    def rows(items: list[bytes]) -> np.ndarray:
        return np.frombuffer(b"".join(items), dtype=np.uint8).reshape(len(items), -1)

    with env.begin(write=True) as txn:
        table.put_rows(txn, rows(names[:3]), rows([b"r0", b"r1", b"r2"]))  # new: appended in order
        table.put_rows(txn, rows([names[1], names[3]]), rows([b"R1", b"r3"]))  # one stored before: updated
        table.put_rows(txn, rows([names[0], names[0]]), rows([b"x0", b"X0"]))  # twice in one call: the last
    with env.begin() as txn:
        assert list(table.records(txn)) == [(names[0], b"X0"), (names[1], b"R1"), (names[2], b"r2"), (names[3], b"r3")]
    env.close()
    env, again = opened(tmp_path)  # rebuilt at open: one number per name
    with env.begin() as txn:
        assert len(again) == 4 and again.get(txn, names[0]) == b"X0"
