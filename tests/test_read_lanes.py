"""A large ``get_into`` read in lanes: threads with connections of their own, each reading a run of the blocks."""

from __future__ import annotations

import dataclasses
import os

import pytest

from kvtier.kvstore.client import Client
from kvtier.kvstore.cluster.local import LocalCluster

BLOCK = 200_000


@pytest.fixture(scope="module")
def store(make_cluster) -> LocalCluster:
    return make_cluster()


def lane_client(local: LocalCluster, lanes: int, **client: float) -> Client:
    """A client whose reads of 1 MB or more run in ``lanes`` lanes (``client``: more ``[client]`` settings)."""
    settings = dataclasses.replace(local.config.client, read_lanes=lanes, read_lane_min_bytes=1 << 20, **client)
    return Client(dataclasses.replace(local.config, client=settings))


def stored(local: LocalCluster, n: int) -> tuple[list[bytes], list[bytes]]:
    keys, blocks = [os.urandom(16) for _ in range(n)], [os.urandom(BLOCK) for _ in range(n)]
    with Client(local.config) as writer:
        assert all(writer.put(keys, blocks))
    return keys, blocks


def test_a_large_read_in_lanes_fills_every_buffer_and_each_lane_has_its_own_connections(store: LocalCluster) -> None:
    keys, blocks = stored(store, 40)  # 8 MB: four lanes of 2 MB
    with lane_client(store, 4) as client:
        buffers = [bytearray(BLOCK) for _ in keys]
        assert client.get_into(keys, buffers) == [True] * len(keys)
        assert buffers == blocks
        assert len(client.lanes) == 3
        sockets = {id(conn.sock) for c in (client, *client.lanes) for conn in c.pool.conns.values() if conn.sock}
        assert len(sockets) == 4 * 12  # data shards rotate over all 12 nodes: each lane reaches all on its own


def test_each_lane_says_when_its_blocks_have_landed_before_the_read_returns(store: LocalCluster) -> None:
    keys, blocks = stored(store, 40)
    with lane_client(store, 4) as client:
        buffers = [bytearray(BLOCK) for _ in keys]
        seen: list[tuple[int, int, bool]] = []

        def landed(lo: int, hi: int) -> None:  # the lane's buffers are final when it is told
            seen.append((lo, hi, buffers[lo:hi] == blocks[lo:hi]))

        assert client.get_into(keys, buffers, on_landed=landed) == [True] * len(keys)
    spans = sorted(seen)
    assert len(spans) == 4 and all(whole for _, _, whole in spans)
    assert [lo for lo, _, _ in spans] == [0, *[hi for _, hi, _ in spans[:-1]]] and spans[-1][1] == len(keys)


def test_a_read_too_small_for_two_lanes_stays_on_one_thread(store: LocalCluster) -> None:
    keys, blocks = stored(store, 4)  # 800 kB: below one lane's minimum
    with lane_client(store, 4) as client:
        buffers = [bytearray(BLOCK) for _ in keys]
        assert client.get_into(keys, buffers) == [True] * len(keys)
        assert buffers == blocks
        assert client.lanes == []


def test_lanes_read_around_two_nodes_down_and_their_counters_add_up_in_the_client(make_cluster) -> None:
    local = make_cluster()
    keys, blocks = stored(local, 30)
    local.kill(3)
    local.kill(4)
    with lane_client(local, 3) as client:
        buffers = [bytearray(BLOCK) for _ in keys]
        misses = [os.urandom(16) for _ in range(3)]
        assert client.get_into(keys + misses, buffers + [bytearray(BLOCK) for _ in misses]) == [True] * 30 + [False] * 3
        assert buffers == blocks
        assert client.stats["hits"] == 30 and client.stats["misses"] == 3
        assert client.stats["degraded_reads"] > 0  # blocks with a data shard on node 3 or 4, decoded in a lane
        assert all(lane.stats["hits"] == 0 for lane in client.lanes)
