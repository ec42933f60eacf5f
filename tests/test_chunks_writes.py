"""The chunk engine's write path in one process: a PUT's shards wait in memory for their COMMIT, so a put that
is never committed (a writer that died, a node that crashed) leaves nothing visible and no slot used."""

from __future__ import annotations

import os
from pathlib import Path

import lmdb
import numpy as np
import pytest

from kvtier.kvstore.node.chunks import COMMIT, DROP, ChunkEngine, WriteBatch, _unpack_slot_value
from kvtier.kvstore.node.slabs import SIZE_CLASSES, size_class_for
from kvtier.kvstore.wire.protocol import Status

CAPACITY = 64 << 20
SHARD = 6554
SLOT = SIZE_CLASSES[size_class_for(SHARD)]
TTL = {"chatbot": 86400.0}.get


def batch(keys: list[bytes], index: int = 0) -> WriteBatch:
    n = len(keys)
    return WriteBatch(b"".join(keys), 16, np.full(n, index), np.full(n, SHARD), np.full(n, 10 * SHARD), "chatbot")


def staged(engine: ChunkEngine, keys: list[bytes], index: int = 0) -> tuple[bytes, WriteBatch]:
    """A put whose shards are in their slots, waiting for its COMMIT (what a node holds between the phases)."""
    put_id, shards = os.urandom(8), batch(keys, index)
    engine.reserve("default", shards)
    for i in shards.rows(Status.OK).tolist():
        engine.slabs.write(int(shards.size_class[i]), int(shards.slot[i]), bytes([i % 256]) * SHARD)
    engine.stage("default", put_id, shards)
    return put_id, shards


@pytest.fixture
def engine(tmp_path: Path):
    engine = ChunkEngine(tmp_path, CAPACITY)
    yield engine
    engine.close()


def test_a_put_that_is_never_committed_frees_its_slots_when_dropped(engine: ChunkEngine) -> None:
    keys = [os.urandom(16) for _ in range(8)]
    put_id, shards = staged(engine, keys)
    assert engine.used_bytes == 8 * SLOT and engine.pending_primary_bytes == 8 * SLOT
    assert engine.live_blocks("default", keys, TTL) == [False] * 8  # pending: invisible
    ((_, stale_id, _),) = engine.stale_puts(engine.clock() + 1)
    assert stale_id == put_id
    assert engine.commit("default", put_id, np.full(8, DROP, dtype=np.uint8)) == bytes([Status.MISSING]) * 8
    assert engine.used_bytes == 0 and engine.pending_primary_bytes == 0 and engine.stale_puts(engine.clock() + 1) == []
    _, again = staged(engine, keys)
    assert sorted(again.slot.tolist()) == sorted(shards.slot.tolist())  # the slots were free again


def test_a_crash_between_put_and_commit_leaves_nothing_visible_and_no_slot_used(tmp_path: Path) -> None:
    keys = [os.urandom(16) for _ in range(8)]
    engine = ChunkEngine(tmp_path, CAPACITY)
    staged(engine, keys)
    engine.close()  # the process dies here: nothing of a staged put is in LMDB
    engine = ChunkEngine(tmp_path, CAPACITY)
    assert engine.used_bytes == 0 and engine.counts() == {"shards": 0, "blocks": 0}
    assert engine.live_blocks("default", keys, TTL) == [False] * 8
    assert engine.commit("default", os.urandom(8)) is None  # the writer's COMMIT finds no such put
    _, shards = staged(engine, keys)
    assert sorted(shards.slot.tolist()) == list(range(8))  # nothing leaked: the first slots are handed out again
    engine.close()


def test_a_committed_put_is_visible_and_its_resent_commit_gets_the_same_answer(engine: ChunkEngine) -> None:
    keys = [os.urandom(16) for _ in range(4)]
    put_id, _ = staged(engine, keys)
    action = np.asarray([COMMIT, COMMIT, COMMIT, DROP], dtype=np.uint8)
    answer = engine.commit("default", put_id, action)
    assert answer == bytes([Status.OK, Status.OK, Status.OK, Status.MISSING])
    assert engine.live_blocks("default", keys, TTL) == [True, True, True, False]
    assert engine.used_bytes == 3 * SLOT and engine.pending_primary_bytes == 0
    assert engine.commit("default", put_id, action) == answer


def test_a_commit_naming_the_wrong_number_of_shards_changes_nothing(engine: ChunkEngine) -> None:
    keys = [os.urandom(16) for _ in range(3)]
    put_id, _ = staged(engine, keys)
    with pytest.raises(ValueError, match="holds 3 shards"):
        engine.commit("default", put_id, np.ones(4, dtype=np.uint8))
    assert engine.commit("default", put_id) == bytes([Status.OK]) * 3


def test_a_shard_another_writer_committed_first_wins_and_the_second_copy_is_given_back(engine: ChunkEngine) -> None:
    key = os.urandom(16)
    first, _ = staged(engine, [key], index=2)
    second, _ = staged(engine, [key], index=2)
    assert engine.used_bytes == 2 * SLOT
    assert engine.commit("default", first) == engine.commit("default", second) == bytes([Status.OK])
    assert engine.used_bytes == SLOT and len(list(engine.shard_records("default", key))) == 1


def test_a_put_of_a_committed_shard_is_exists_and_takes_no_slot(engine: ChunkEngine) -> None:
    key = os.urandom(16)
    put_id, _ = staged(engine, [key])
    engine.commit("default", put_id)
    _, again = staged(engine, [key])
    assert again.status.tolist() == [Status.EXISTS] and engine.used_bytes == SLOT


def test_a_data_dir_with_shard_records_keyed_by_name_opens_with_its_shards(tmp_path: Path) -> None:
    keys = [os.urandom(16) for _ in range(3)]
    engine = ChunkEngine(tmp_path, CAPACITY)
    put_id, _ = staged(engine, keys)
    engine.commit("default", put_id)
    with engine.env.begin(db=engine.slots_db) as txn:
        records = [_unpack_slot_value(raw) for _, raw in txn.cursor()]
    engine.close()
    env = lmdb.open(str(tmp_path / "meta"), max_dbs=5)  # rewrite them as an older node kept them: by name
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"slots", txn=txn), delete=True)
        txn.cursor(db=env.open_db(b"shards", txn=txn)).putmulti(records)
    env.close()
    engine = ChunkEngine(tmp_path, CAPACITY)
    assert engine.live_blocks("default", keys, TTL) == [True] * 3
    assert engine.used_bytes == 3 * SLOT and engine.counts() == {"shards": 3, "blocks": 3}
    assert [r.index for k in keys for r in engine.shard_records("default", k)] == [0, 0, 0]
    engine.close()


def test_a_read_of_shard_0_makes_the_block_most_recently_used_and_a_read_of_shard_1_does_not(
    engine: ChunkEngine,
) -> None:
    keys = [os.urandom(16) for _ in range(3)]
    for key in keys:  # stored oldest first; shard 0 here: this node is their primary
        put_id, _ = staged(engine, [key], index=0)
        engine.commit("default", put_id)
    read_at = engine.clock() + 100.0
    engine.clock = lambda: read_at
    reads = engine.read("default", keys[0], np.zeros(1, dtype=np.uint8), None, TTL, verify=False)
    engine.unpin(reads)
    assert [entry.key[-16:] for entry in engine.lru] == [keys[1], keys[2], keys[0]]
    assert engine.lru.get(b"default/" + keys[0]).last_access == read_at  # type: ignore[union-attr]
    assert engine.flush_access() == 1  # the access reaches the block record at the next flush
    reads = engine.read("default", keys[1], np.ones(1, dtype=np.uint8), None, TTL, verify=False)
    engine.unpin(reads)  # shard 1 is not held here: nothing read, nothing touched
    assert [entry.key[-16:] for entry in engine.lru] == [keys[1], keys[2], keys[0]]


def test_a_flushed_access_rewrites_only_the_last_access_of_the_block_record_and_outlives_a_restart(
    tmp_path: Path,
) -> None:
    engine = ChunkEngine(tmp_path, CAPACITY)
    keys = [os.urandom(16) for _ in range(3)]
    put_id, _ = staged(engine, keys, index=0)
    engine.commit("default", put_id)
    stored = [engine.block_record("default", key) for key in keys]
    read_at = engine.clock() + 100.0
    engine.clock = lambda: read_at
    reads = engine.read("default", b"".join(keys[:2]), np.zeros(2, dtype=np.uint8), None, TTL, verify=False)
    engine.unpin(reads)
    assert engine.flush_access() == 2
    engine.close()
    engine = ChunkEngine(tmp_path, CAPACITY)
    records = [engine.block_record("default", key) for key in keys]
    assert records == [stored[0]._replace(last_access=read_at), stored[1]._replace(last_access=read_at), stored[2]]
    engine.close()


def test_a_commit_whose_lmdb_write_fails_leaves_the_shards_unseen_and_can_be_committed_again(
    engine: ChunkEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [os.urandom(16) for _ in range(4)]
    put_id, _ = staged(engine, keys, index=2)

    def disk_full(*args: object) -> None:
        raise lmdb.MapFullError("no room for the records")

    with monkeypatch.context() as patch:
        patch.setattr(engine.dead_slots, "clear", disk_full)
        with pytest.raises(lmdb.MapFullError):
            engine.commit("default", put_id)
    assert engine.counts()["shards"] == 0  # the name index did not take names LMDB has no records for
    assert [list(engine.shard_records("default", key)) for key in keys] == [[]] * 4
    assert engine.commit("default", put_id) == bytes([Status.OK]) * 4  # still pending: the retry commits
    assert [len(list(engine.shard_records("default", key))) for key in keys] == [1] * 4


# -- shards other than shard 0s, unconfirmed (kvstore.node.unconfirmed) ----------------------------------------


def committed_beyond_the_unconfirmed_cap(engine: ChunkEngine, tenant: str = "default") -> list[bytes]:
    """Commit shards 1 of fresh blocks for ``tenant`` until its unconfirmed bytes pass the cap; their keys."""
    keys: list[bytes] = []
    while engine.unconfirmed.bytes_of(tenant) <= engine.unconfirmed_cap_bytes:
        put_id, shards = os.urandom(8), batch(fresh := [os.urandom(16) for _ in range(64)], index=1)
        engine.reserve(tenant, shards)
        engine.stage(tenant, put_id, shards)
        assert engine.commit(tenant, put_id) == bytes([Status.OK]) * 64
        keys += fresh
    return keys


def primaries_deny_every_block(engine: ChunkEngine) -> None:
    """A GC pass in which every block's primary says it does not know the block (none is an orphan yet)."""
    for tenant, shards in engine.unconfirmed_due(engine.clock() + 1):
        engine.settle_unconfirmed(tenant, shards, np.zeros(len(shards.names), dtype=np.int8), orphan_before=0.0)


@pytest.fixture
def confirmed_by_nobody(tmp_path: Path):
    """An engine whose GC worker is woken for confirmations and never answers (one that has fallen behind)."""
    engine = ChunkEngine(tmp_path, CAPACITY, room_wait_s=0.2)
    engine.on_unconfirmed = lambda: None
    yield engine
    engine.close()


def test_a_writer_the_gc_has_not_asked_about_yet_waits_past_the_cap_and_is_not_refused(
    confirmed_by_nobody: ChunkEngine,
) -> None:
    """A cap on every unconfirmed byte refused a legitimate writer whenever the GC worker was room_wait_s behind it
    (kvbench putget on a loaded machine: 256 of 256 blocks refused)."""
    committed_beyond_the_unconfirmed_cap(confirmed_by_nobody)
    shards = batch([os.urandom(16) for _ in range(8)], index=1)
    confirmed_by_nobody.reserve("default", shards)
    assert shards.rows(Status.OK).size == 8


def test_a_tenant_whose_shards_primaries_denied_past_the_cap_is_refused_and_another_is_not(
    confirmed_by_nobody: ChunkEngine,
) -> None:
    engine = confirmed_by_nobody
    committed_beyond_the_unconfirmed_cap(engine)
    primaries_deny_every_block(engine)
    assert engine.unconfirmed.denied_of("default") > engine.unconfirmed_cap_bytes
    refused, other = (batch([os.urandom(16) for _ in range(8)], index=1) for _ in range(2))
    engine.reserve("default", refused)
    engine.reserve("ta", other)
    assert refused.rows(Status.OK).size == 0 and other.rows(Status.OK).size == 8


def test_shards_removed_before_their_primary_was_asked_count_against_no_cap(confirmed_by_nobody: ChunkEngine) -> None:
    """Blocks evicted by their primary (not live when asked) whose shards were then removed here counted as
    unconfirmed until the write timeout: kvbench putget at capacity was refused 256 of 256 blocks."""
    engine = confirmed_by_nobody
    keys = committed_beyond_the_unconfirmed_cap(engine)
    assert engine.drop_shards("default", [(key, 1) for key in keys]) == len(keys)  # the primary's eviction reached here
    primaries_deny_every_block(engine)
    assert engine.unconfirmed.bytes_of("default") == engine.unconfirmed.denied_of("default") == 0
    shards = batch([os.urandom(16) for _ in range(8)], index=1)
    engine.reserve("default", shards)
    assert shards.rows(Status.OK).size == 8
