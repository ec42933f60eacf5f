"""The block store end to end: real node processes, real sockets, real files, nodes killed with SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import crc32c
import pytest

from kvtier.kvstore.client import CapacityError, Client, connect
from kvtier.kvstore.client import writes as client_writes
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.kvstore.keys import Namespace, chain, header_digests
from kvtier.kvstore.node.chunks import ChunkEngine
from kvtier.kvstore.node.slabs import SIZE_CLASSES
from kvtier.kvstore.placement import RECORD_HOLDERS, Placement
from kvtier.kvstore.wire.protocol import Op, Status
from kvtier.kvstore.wire.transport import Exchange

from .conftest import wait_for

SIZES = [1, 7, 10, 11, 1000, 4096, 65537, 1 << 20]


def rand_keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def rand_blocks(n: int, size: int = 64 << 10) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)]


def shard_reply(client: Client, node_id: int, key: bytes, index: int, **flags: bool) -> dict:
    """Ask one node directly for one shard; the metadata of its reply."""
    exchange = Exchange(client.pool)
    meta = {"keys": key, "klen": len(key), "idx": bytes([index]), **flags}
    pending = exchange.request(node_id, Op.GET_SHARDS, meta)
    exchange.run(10)
    assert pending.frame is not None
    return pending.frame.meta


def shard_status(client: Client, node_id: int, key: bytes, index: int) -> Status:
    """Ask one node directly for one shard, as a reader that leaves the crc check to the node."""
    return Status(shard_reply(client, node_id, key, index)["st"][0])


def store_with_a_corrupt_shard(local: LocalCluster, client: Client) -> tuple[list[bytes], list[bytes], int, int]:
    """Store 4 blocks of 200 kB, then overwrite 64 bytes of data shard 3 of the first in its slab file (its node
    stopped meanwhile): (keys, blocks, the node holding that shard, the crc32c it stored for it)."""
    keys, blocks = rand_keys(4), rand_blocks(4, 200_000)
    client.put(keys, blocks)
    victim = int(Placement(local.config.groups).shard_nodes(keys)[0, 3])
    local.kill(victim)
    engine = ChunkEngine(local.config.nodes[victim].data_dir, capacity_bytes=1 << 30)
    rec = next(r for r in engine.shard_records("default", keys[0]) if r.index == 3)
    engine.close()
    slab = local.config.nodes[victim].data_dir / "slabs" / f"slab-{SIZE_CLASSES[rec.size_class]}.dat"
    with open(slab, "r+b") as f:
        f.seek(rec.slot * SIZE_CLASSES[rec.size_class] + 100)
        f.write(b"\xff" * 64)
    local.start([victim])
    wait_reachable(client)
    return keys, blocks, victim, rec.crc


def wait_reachable(client: Client) -> None:
    """Wait until every node answers this client (a node that refused a connection while it was down is
    retried only after ``retry_down_after_s``)."""
    wait_for(
        lambda: all("error" not in reply for reply in client.node_info().values()),
        10 + client.config.client.retry_down_after_s,
        "every node to answer",
    )


@pytest.fixture(scope="module")
def store(make_cluster) -> LocalCluster:
    return make_cluster()


@pytest.fixture
def client(store: LocalCluster):
    with connect(store.config_path) as c:
        yield c


def test_blocks_of_any_size_round_trip(client: Client) -> None:
    keys = rand_keys(len(SIZES))
    blocks = [os.urandom(n) for n in SIZES]
    assert client.put(keys, blocks) == [True] * len(keys)
    assert [bytes(b) for b in client.get(keys)] == blocks


def test_a_put_encoded_window_by_window_round_trips(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_writes, "ENCODE_WINDOW", 100_000)  # windows of 1, 1, 2, 4, 8, ... blocks
    blocks = [os.urandom(n) for n in [*SIZES[:-1], 65_536, 100_003] * 4]  # tiny, short last shards, exact
    keys = rand_keys(len(blocks))
    assert client.put(keys, blocks) == [True] * len(keys)
    assert [bytes(b) for b in client.get(keys)] == blocks
    for key, block in zip(keys, blocks, strict=True):  # parity too: what every node stored is the codec's shards
        stored = {shard["index"]: shard["crc"] for shard in client.stat(key)["shards"]}
        assert stored == {i: crc32c.crc32c(shard) for i, shard in enumerate(client.codec.encode(block))}


def test_get_into_fills_caller_buffers(client: Client) -> None:
    keys, blocks = rand_keys(8), rand_blocks(8, 100_003)
    client.put_from(keys, [memoryview(b) for b in blocks])
    buffers = [bytearray(100_003) for _ in keys]
    assert client.get_into(keys, buffers) == [True] * 8
    assert buffers == [bytearray(b) for b in blocks]


def test_get_into_a_buffer_of_the_wrong_size_is_a_miss(client: Client) -> None:
    keys, blocks = rand_keys(1), rand_blocks(1, 5000)
    client.put(keys, blocks)
    assert client.get_into(keys, [bytearray(4000)]) == [False]


def test_unknown_keys_are_misses_not_errors(client: Client) -> None:
    keys = rand_keys(3)
    assert client.get(keys) == [None, None, None]
    assert client.get_into(keys, [bytearray(10)] * 3) == [False] * 3
    assert client.exists(keys) == [False] * 3


def test_match_counts_leading_present_keys(client: Client) -> None:
    keys = rand_keys(40)
    client.put(keys[:25], rand_blocks(25, 4096))
    assert client.match(keys) == 25
    client.put(keys[30:], rand_blocks(10, 4096))
    assert client.match(keys) == 25
    assert client.match(keys[30:]) == 10
    assert client.match([]) == 0


def test_match_of_a_1200_key_chain(client: Client) -> None:
    ns = Namespace("m", "bf16", 64, "L")
    keys = chain(ns, list(range(1200 * 64)))
    assert all(client.put(keys[:1100], rand_blocks(1100, 1024)))  # over IOV_MAX shards per node request
    assert client.match(keys) == 1100


def test_delete_removes_blocks(client: Client) -> None:
    keys = rand_keys(5)
    client.put(keys, rand_blocks(5, 2048))
    client.delete(keys[:2])
    assert client.exists(keys) == [False, False, True, True, True]
    assert client.get(keys[:2]) == [None, None]


def test_put_is_idempotent(client: Client) -> None:
    keys, blocks = rand_keys(3), rand_blocks(3, 3000)
    assert client.put(keys, blocks) == [True] * 3
    assert client.put(keys, blocks) == [True] * 3
    assert [bytes(b) for b in client.get(keys)] == blocks


def test_unknown_ttl_class_is_refused(client: Client) -> None:
    with pytest.raises(ValueError, match="unknown TTL class"):
        client.put(rand_keys(1), rand_blocks(1), ttl_class="forever")


def test_header_mismatch_is_a_counted_miss(client: Client) -> None:
    ns = Namespace("m", "bf16", 4, "L")
    tokens_a, tokens_b = list(range(8)), list(range(100, 108))
    keys_a = chain(ns, tokens_a)
    blocks = rand_blocks(2, 4096)
    client.put(keys_a, blocks, tokens=tokens_a, namespace=ns)
    assert [bytes(b) for b in client.get(keys_a, tokens=tokens_a, namespace=ns)] == blocks
    # the same keys presented with another prompt's header digests: as if xxh3 had collided
    other = header_digests(ns, tokens_b, chain(ns, tokens_b))
    before = client.stats["header_mismatches"]
    assert client.get(keys_a, headers=other) == [None, None]
    assert client.stats["header_mismatches"] == before + 2


def test_async_client_has_the_same_api(store: LocalCluster) -> None:
    import asyncio

    from kvtier.kvstore.client import connect_async

    async def scenario() -> None:
        async with await connect_async(store.config_path) as c:
            keys, blocks = rand_keys(4), rand_blocks(4, 8192)
            results = await asyncio.gather(c.put(keys[:2], blocks[:2]), c.put(keys[2:], blocks[2:]))
            assert results == [[True, True], [True, True]]
            assert await c.match(keys) == 4
            got = await c.get(keys)
            assert [bytes(b) for b in got] == blocks
            assert (await c.stat(keys[0]))["block"]["block_len"] == 8192

    asyncio.run(scenario())


# -- failures ---------------------------------------------------------------------------------------


def test_two_nodes_down_every_block_reads_back(make_cluster) -> None:
    local = make_cluster()
    with connect(local.config_path) as client:
        keys, blocks = rand_keys(48), rand_blocks(48, 50_001)
        assert all(client.put(keys, blocks))
        primaries = Placement(local.config.groups).primaries(keys).tolist()
        victims = [primaries[0], next(p for p in primaries if p != primaries[0])]  # include primaries
        for nid in victims:
            local.kill(nid)
        assert [bytes(b) for b in client.get(keys)] == blocks
        assert client.stats["degraded_reads"] > 0
        local.kill(next(n for n in local.alive()))
        got = client.get(keys)  # three down: misses, never an exception or wrong bytes
        assert any(g is None for g in got)
        assert all(g is None or bytes(g) == b for g, b in zip(got, blocks, strict=True))


def test_liveness_asks_the_record_copies_of_a_block_whose_primary_does_not_answer(own_cluster) -> None:
    """A block's record is kept by the holders of its shards 0, 1 and 2: with its primary down, the other two
    answer for it (held, or not), and it is unknown (-1) only when none of the three answers."""
    local = own_cluster()
    placement = Placement(local.config.groups)
    with connect(local.config_path) as client:
        keys = rand_keys(24)
        assert all(client.put(keys, rand_blocks(24, 4096)))
        victim = int(placement.primaries(keys)[0])
        absent = next(k for k in iter(lambda: os.urandom(16), None) if placement.primaries([k])[0] == victim)
        local.kill(victim)
        assert client.match(keys) == 24
        assert client.liveness([*keys, absent]).tolist() == [1] * 24 + [0]
        holders = placement.shard_nodes(keys[:1])[0, :RECORD_HOLDERS].tolist()
        for nid in holders[1:]:
            local.kill(nid)
        assert client.liveness(keys[:1]).tolist() == [-1]


def test_three_nodes_down_reads_are_misses(make_cluster) -> None:
    local = make_cluster()
    with connect(local.config_path) as client:
        keys, blocks = rand_keys(24), rand_blocks(24, 20_000)
        client.put(keys, blocks)
        for nid in (1, 5, 9):
            local.kill(nid)
        assert client.get(keys) == [None] * 24
        assert client.get_into(keys, [bytearray(20_000) for _ in keys]) == [False] * 24


def test_restarted_nodes_serve_everything_committed(make_cluster) -> None:
    local = make_cluster()
    with connect(local.config_path) as client:
        keys, blocks = rand_keys(30), rand_blocks(30, 70_000)
        client.put(keys, blocks)
        for nid in list(local.procs):
            local.kill(nid)  # SIGKILL every node: no clean shutdown
        local.start()
        wait_reachable(client)
        assert [bytes(b) for b in client.get(keys)] == blocks
        assert client.match(keys) == 30


def test_a_node_down_during_writes_does_not_block_them(make_cluster) -> None:
    local = make_cluster()
    with connect(local.config_path) as client:
        keys = rand_keys(40)
        primaries = Placement(local.config.groups).primaries(keys).tolist()
        local.kill(4)
        stored = client.put(keys, rand_blocks(40, 4096))
        # min_write_shards = 11: blocks whose primary is alive are stored; the others are refused
        assert stored == [p != 4 for p in primaries]


def test_a_put_refused_for_a_down_primary_names_the_down_node_only(make_cluster, caplog) -> None:
    local = make_cluster()
    with connect(local.config_path) as client:
        keys = rand_keys(40)
        while not (Placement(local.config.groups).primaries(keys) == 4).any():
            keys = rand_keys(40)
        local.kill(4)
        with caplog.at_level("WARNING", logger="kvtier.client"):
            client.put(keys, rand_blocks(40, 4096))
    [refusal] = [r.getMessage() for r in caplog.records if "not stored" in r.getMessage()]
    assert refusal.endswith("(nodes 4 down, unreachable or draining)"), refusal


WRITER = textwrap.dedent(
    """
    import os, signal, sys
    from kvtier.kvstore import client as client_mod
    from kvtier.kvstore.wire.protocol import Op
    from kvtier.kvstore.wire.transport import Exchange

    original = Exchange.request
    def request(self, node_id, opcode, *args, **kwargs):
        if opcode == Op.COMMIT:
            print("pending-written", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # die between the two phases
        return original(self, node_id, opcode, *args, **kwargs)
    Exchange.request = request
    c = client_mod.connect(sys.argv[1])
    keys = [bytes.fromhex(k) for k in sys.argv[2].split(",")]
    c.put(keys, [os.urandom(30000) for _ in keys])
    """
)


def test_a_writer_killed_between_phases_leaves_nothing_visible(store: LocalCluster, client: Client) -> None:
    keys = rand_keys(6)
    proc = subprocess.run(
        [sys.executable, "-c", WRITER, str(store.config_path), ",".join(k.hex() for k in keys)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL and "pending-written" in proc.stdout
    assert client.match(keys) == 0
    assert client.exists(keys) == [False] * 6
    assert client.get(keys) == [None] * 6
    counts = [client.stat(k) for k in keys]
    assert all(len(s["shards"]) == 12 and s["block"] is None for s in counts)  # the shards are there, pending


def test_a_corrupt_shard_on_disk_is_an_erasure(make_cluster) -> None:
    local = make_cluster()
    with connect(local.config_path) as client:
        keys, blocks, victim, _ = store_with_a_corrupt_shard(local, client)
        assert shard_status(client, victim, keys[0], 3) == Status.CORRUPT  # reported, not returned
        assert [bytes(b) for b in client.get(keys)] == blocks


def test_a_corrupt_shard_is_caught_by_the_reader_as_it_arrives_and_read_around(make_cluster) -> None:
    local = make_cluster()
    with connect(local.config_path) as client:
        keys, blocks, victim, stored_crc = store_with_a_corrupt_shard(local, client)
        # asked by a reader that checks shards itself, the node sends the bytes as stored, with their crc, unread
        reply = shard_reply(client, victim, keys[0], 3, client_crc=True)
        assert reply["st"][0] == Status.OK and int.from_bytes(reply["crc"], "little") == stored_crc
        out = [bytearray(200_000) for _ in keys]
        assert client.get_into(keys, out) == [True] * 4
        assert out == blocks  # decoded around the shard the reader caught
        assert client.stats["corrupt_shards"] == 1 and client.stats["degraded_reads"] == 1


def test_puts_beyond_capacity_are_refused_with_a_clear_error(make_cluster) -> None:
    local = make_cluster(capacity_bytes=2 << 20)
    with connect(local.config_path) as client:
        keys = rand_keys(40)
        with pytest.raises(CapacityError, match="at capacity") as info:
            client.put(keys, rand_blocks(40, 1 << 20))
        stored = info.value.stored
        assert 0 < sum(stored) < 40
        survivors = [k for k, s in zip(keys, stored, strict=True) if s]
        assert all(g is not None for g in client.get(survivors))  # the cluster keeps serving


def test_a_node_whose_disk_fills_refuses_cleanly_and_the_cluster_keeps_serving(make_cluster) -> None:
    from .conftest import tmpfs

    local = make_cluster(capacity_bytes=1 << 30)  # the configured capacity is larger than the disk
    victim = 6
    local.kill(victim)
    with tmpfs(local.config.nodes[victim].data_dir / "slabs", "3m"), connect(local.config_path) as client:
        local.start([victim])
        wait_reachable(client)
        placement = Placement(local.config.groups)
        candidates = rand_keys(400)  # 60 keys, 10 of them with the full node as primary (random ones may have none)
        on_victim = placement.primaries(candidates) == victim
        mine = [k for k, p in zip(candidates, on_victim.tolist(), strict=True) if p]
        others = [k for k, p in zip(candidates, on_victim.tolist(), strict=True) if not p]
        keys, blocks = mine[:10] + others[:50], rand_blocks(60, 1 << 20)
        primaries = placement.primaries(keys).tolist()
        with pytest.raises(CapacityError, match="at capacity") as info:
            client.put(keys, blocks)
        stored = info.value.stored
        # blocks whose primary is the full node are refused; the others commit with 11 shards
        assert [s for s, p in zip(stored, primaries, strict=True) if p != victim] == [True] * sum(
            p != victim for p in primaries
        )
        assert not all(stored)
        survivors = [k for k, s in zip(keys, stored, strict=True) if s]
        assert [bytes(b) for b in client.get(survivors)] == [b for b, s in zip(blocks, stored, strict=True) if s]
        local.kill(victim)


def test_a_cancelled_async_read_leaves_the_buffer_alone_afterwards(store: LocalCluster) -> None:
    import asyncio

    from kvtier.kvstore.client import connect_async

    keys, blocks = rand_keys(32), rand_blocks(32, 1 << 20)

    async def scenario() -> None:
        async with await connect_async(store.config_path) as c:
            await c.put(keys, blocks)
            buffers = [bytearray(1 << 20) for _ in keys]
            task = asyncio.ensure_future(c.get_into(keys, buffers))
            await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for b in buffers:
                b[:] = bytes(len(b))  # the caller reuses its buffers at once
            assert await c.exists(keys[:2]) == [True, True]  # the pooled client is usable and idle
            assert all(not any(b) for b in buffers)

    asyncio.run(scenario())


def test_a_shard_repaired_on_read_keeps_the_blocks_header(client: Client, store: LocalCluster) -> None:
    ns = Namespace("m", "bf16", 4, "L")
    tokens = list(range(300, 308))
    keys = chain(ns, tokens)
    blocks = rand_blocks(2, 30_000)
    client.put(keys, blocks, tokens=tokens, namespace=ns)
    holder = int(Placement(store.config.groups).shard_nodes(keys[:1])[0, 4])
    exchange = Exchange(client.pool)
    exchange.request(holder, Op.DELETE, {"keys": keys[0], "klen": len(keys[0])})  # shard 4 of block 0 is lost
    exchange.run(10)
    assert not client.probe(keys[:1])[0, 4]
    before = client.stats["header_mismatches"]
    assert [bytes(b) for b in client.get(keys, tokens=tokens, namespace=ns)] == blocks  # repairs shard 4
    assert client.probe(keys[:1])[0, 4]
    assert [bytes(b) for b in client.get(keys, tokens=tokens, namespace=ns)] == blocks
    assert client.stats["header_mismatches"] == before


def test_a_call_too_large_for_the_limits_is_refused_before_sending(store: LocalCluster) -> None:
    from dataclasses import replace

    config = replace(store.config, limits=replace(store.config.limits, max_batch=8))
    with Client(config) as small:
        with pytest.raises(ValueError, match="split the call"):
            small.match(rand_keys(200))  # ~17 keys per primary
        assert small.match(rand_keys(3)) == 0  # the client is still usable


def test_a_node_whose_connects_time_out_is_retried_ever_less_often(store: LocalCluster) -> None:
    import socket
    from dataclasses import replace

    # a listener that never accepts, with its queue full: further connects time out (SYNs are dropped)
    black_hole = socket.create_server(("127.0.0.1", 0), backlog=0)
    queued = [socket.socket() for _ in range(4)]
    for s in queued:
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(black_hole.getsockname())
    try:
        nodes = dict(store.config.nodes)
        # node 0 at the black hole, by TCP only (a data dir with no node.sock: no Unix socket to reach it by)
        nodes[0] = replace(nodes[0], port=black_hole.getsockname()[1], data_dir=store.config_path.parent / "none")
        client_config = replace(store.config.client, connect_timeout_s=0.3, retry_down_after_s=0.5)
        with Client(replace(store.config, nodes=nodes, client=client_config)) as client:
            keys, blocks = rand_keys(4), rand_blocks(4, 4096)
            conn = client.pool.conns[0]
            client.get(keys)
            assert conn.timeouts == 1
            retry_at = conn.down_until
            client.get(keys)  # within the back-off: no second connect attempt (it would time out and count)
            assert conn.timeouts == 1 and conn.down_until == retry_at and conn.sock is None
            wait_for(lambda: time.monotonic() > retry_at, 5, "the back-off to pass")
            client.get(keys)
            assert conn.timeouts == 2 and conn.down_until - time.monotonic() > 0.8  # 0.5 s, doubled
            assert any(client.put(keys, blocks))  # the other nodes keep serving
    finally:
        for s in queued:
            s.close()
        black_hole.close()


def test_a_delete_whose_shard_index_hint_is_wrong_still_removes_the_shard(client: Client, store: LocalCluster) -> None:
    keys, blocks = rand_keys(1), rand_blocks(1, 30_000)
    client.put(keys, blocks)
    holder = int(Placement(store.config.groups).shard_nodes(keys)[0, 4])
    exchange = Exchange(client.pool)
    pending = exchange.request(holder, Op.DELETE, {"keys": keys[0], "klen": len(keys[0]), "idx": bytes([7])})
    exchange.run(10)
    assert pending.frame is not None and pending.frame.meta["removed"] == 1  # idx is a hint: shard 4 was found
    assert not client.probe(keys)[0, 4]


def test_a_delete_after_the_primarys_own_removal_leaves_no_shard_anywhere(client: Client, store: LocalCluster) -> None:
    keys, blocks = rand_keys(3), rand_blocks(3, 30_000)
    client.put(keys, blocks)
    primary = int(Placement(store.config.groups).primaries(keys[:1])[0])
    assert client.delete(keys[:1], primary_done=primary)  # the primary is asked only about other shards it holds
    assert client.probe(keys[:1])[0, 1:].sum() == 0  # every other holder dropped its shard
    assert client.probe(keys[:1])[0, 0]  # the primary's own shard is its own removal's to delete (not done here)
    assert [bytes(b) for b in client.get(keys[1:])] == blocks[1:]
