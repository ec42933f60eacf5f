"""A watched ``get_into``: another thread learns which leading blocks of each lane are in place while the read runs."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

from kvtier.kvstore.client import Client
from kvtier.kvstore.client.read_watch import Landing, ReadWatch
from kvtier.kvstore.client.reads import ReadState
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.kvstore.codec import DATA_SHARDS
from tests.test_read_lanes import BLOCK, lane_client, stored

SHARD = 100  # the in-memory checks' shard length


@pytest.fixture(scope="module")
def store(make_cluster) -> LocalCluster:
    return make_cluster()


def patient_client(local: LocalCluster, lanes: int) -> Client:
    """A lane client (``test_read_lanes``) that waits for a slow node: no hedge within the test."""
    return lane_client(local, lanes, hedge_after_s=30.0, op_timeout_s=60.0)


def test_blocks_settle_while_a_node_holding_later_blocks_has_not_answered(store: LocalCluster) -> None:
    keys, blocks = stored(store, 8)
    with patient_client(store, 1) as client:
        nodes = client.placement.shard_nodes(keys)
        late = int(nodes[0, DATA_SHARDS])  # holds only parity of block 0, data of some later block
        assert late in nodes[1:, :DATA_SHARDS]
        buffers = [bytearray(BLOCK) for _ in keys]
        assert client.get_into(keys, buffers) == [True] * len(keys)  # connected: the stopped node is not down
        buffers = [bytearray(BLOCK) for _ in keys]
        watch = ReadWatch()
        found: list[list[bool]] = []
        reader = threading.Thread(target=lambda: found.append(client.get_into(keys, buffers, watch=watch)))
        store.procs[late].send_signal(signal.SIGSTOP)
        try:
            reader.start()
            deadline = time.monotonic() + 20
            while not any(hi > lo for lo, hi in watch.settled()) and time.monotonic() < deadline:
                time.sleep(0.005)
            ((lo, hi),) = watch.settled()
            assert hi > lo == 0 and not found  # told while the read still waits for the stopped node
            assert buffers[:hi] == blocks[:hi]
            assert hi < len(keys)  # a block with a data shard on the stopped node has not settled
        finally:
            store.procs[late].send_signal(signal.SIGCONT)
            reader.join()
    assert found == [[True] * len(keys)] and buffers == blocks
    assert watch.settled() == [(0, len(keys))]


def test_every_lane_is_watched_and_what_it_tells_holds_the_stored_bytes(store: LocalCluster) -> None:
    keys, blocks = stored(store, 40)  # 8 MB: four lanes
    with patient_client(store, 4) as client:
        buffers = [bytearray(BLOCK) for _ in keys]
        watch = ReadWatch()
        wrong: list[int] = []
        done = threading.Event()

        def ask() -> None:  # as an engine's copying thread does, as often as it can
            while not done.is_set():
                for lo, hi in watch.settled():
                    wrong.extend(b for b in range(lo, hi) if buffers[b] != blocks[b])

        asker = threading.Thread(target=ask)
        asker.start()
        try:
            assert client.get_into(keys, buffers, watch=watch) == [True] * len(keys)
        finally:
            done.set()
            asker.join()
    spans = sorted(watch.settled())
    assert wrong == [] and len(spans) == 4
    assert [lo for lo, _ in spans] == [0, *[hi for _, hi in spans[:-1]]] and spans[-1][1] == len(keys)


def watched_state(blocks: int) -> tuple[ReadWatch, ReadState]:
    state = ReadState(blocks, [memoryview(bytearray(DATA_SHARDS * SHARD)) for _ in range(blocks)], False, True)
    watch = ReadWatch()
    watch.lane(0).attach(state)
    return watch, state


def under_way(state: ReadState, request_id: int, shard: int, blocks: int, bad: int | None = None) -> np.ndarray:
    """A reply under way bringing data shard ``shard`` of ``blocks`` blocks in order (``bad``: that block's shard
    lands with the wrong crc); returns its progress cell."""
    crcs = np.arange(blocks, dtype=np.uint32)
    expected = crcs.copy()
    if bad is not None:
        expected[bad] += 1
    shards = np.column_stack([np.arange(blocks), np.full(blocks, shard)])
    progress = np.zeros(1, dtype=np.int64)
    ends = np.arange(1, blocks + 1, dtype=np.int64) * SHARD
    state.receiving[request_id] = Landing(shards, crcs, expected, ends, progress)
    return progress


def test_a_block_settles_once_all_its_data_shards_are_whole_in_every_reply() -> None:
    watch, state = watched_state(3)
    cells = [under_way(state, shard, shard, 3) for shard in range(DATA_SHARDS)]
    for cell in cells[1:]:
        cell[0] = 2 * SHARD  # blocks 0 and 1 whole in every reply but the first
    cells[0][0] = 2 * SHARD - 1  # the first reply is one byte short of block 1
    assert watch.settled() == [(0, 1)]
    cells[0][0] = 3 * SHARD
    assert watch.settled() == [(0, 2)]  # block 2 still lacks its shards from the other replies


def test_a_shard_that_fails_its_crc_keeps_its_block_and_those_after_back() -> None:
    watch, state = watched_state(3)
    cells = [under_way(state, shard, shard, 3, bad=1 if shard == 4 else None) for shard in range(DATA_SHARDS)]
    for cell in cells:
        cell[0] = 3 * SHARD
    assert watch.settled() == [(0, 1)]


def test_replies_already_complete_count_and_a_lane_not_started_is_not_told() -> None:
    watch, state = watched_state(2)
    state.valid[:, :DATA_SHARDS] = True  # every reply arrived (``ReadState.arrived``)
    watch.lane(2)  # a second lane whose read has not begun
    assert watch.settled() == [(0, 2), (2, 2)]
