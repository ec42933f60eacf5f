"""GC and TTL: watermark LRU eviction, hard capacity, TTL classes, zombie writes and repair.

Real node processes with fast GC settings (cycles every 0.2 s, 0.3 s grace, 1 s write timeout), plus
in-process checks with a manual clock for TTLs measured in days.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from kvtier.gc.policy import ManualClock
from kvtier.gc.worker import GCWorker
from kvtier.kvstore import cluster as cluster_mod
from kvtier.kvstore.chunks import BlockCommit, ChunkEngine, ShardWrite
from kvtier.kvstore.client import CapacityError, Client, connect
from kvtier.kvstore.local import LocalCluster
from kvtier.kvstore.placement import Placement
from kvtier.kvstore.protocol import Status
from kvtier.kvstore.slabs import SIZE_CLASSES, size_class_for

from .test_store import WRITER, shard_status, wait_reachable

CAPACITY = 16 << 20
BLOCK = 64 << 10
SLOT = SIZE_CLASSES[size_class_for(-(-BLOCK // 10))]  # bytes one block takes on every node
GROUP = 12
# Each primary keeps its blocks within capacity / 12 (see gc.worker); with ~170 blocks per primary the
# hash spreads them within about ±10 %, so fill to 75 % (no primary crosses 90 %), then add 20 %.
FILL, EXTRA = 0.75, 0.20
FAST_GC = "interval_s = 0.2\ngrace_s = 0.1\nwrite_timeout_s = 1.0\naccess_flush_s = 0.2\n"


@pytest.fixture
def cluster(make_cluster):
    local = make_cluster(capacity_bytes=CAPACITY, gc=FAST_GC)
    yield local
    local.stop()


def blocks(n: int) -> tuple[list[bytes], list[bytes]]:
    return [os.urandom(16) for _ in range(n)], [os.urandom(BLOCK) for _ in range(n)]


def put_in_batches(client: Client, n: int, batch: int = 200) -> list[bytes]:
    """Store ``n`` fresh blocks, oldest first; returns their keys."""
    keys = []
    for start in range(0, n, batch):
        batch_keys, data = blocks(min(batch, n - start))
        client.put(batch_keys, data)
        keys += batch_keys
    return keys


def usage(client: Client) -> list[int]:
    return [info["used_bytes"] for info in client.node_info().values()]


def settle(client: Client) -> None:
    """Let every node finish a GC cycle and its grace time."""
    time.sleep(0.8)
    client.admin("gc")
    time.sleep(0.5)
    client.admin("gc")


def test_usage_never_exceeds_capacity_and_settles_between_watermarks(cluster: LocalCluster) -> None:
    with Client(cluster.config) as client:
        refused = 0
        peak = 0
        for _ in range(80):  # 80 × 100 blocks: about 4× what fits
            keys, data = blocks(100)
            try:
                client.put(keys, data)
            except CapacityError:
                refused += 1  # allowed: the put was refused cleanly, the cluster keeps serving
            peak = max(peak, *usage(client))
            assert peak <= CAPACITY
        settle(client)
        final = usage(client)
        assert all(0.75 * CAPACITY <= u <= 0.9 * CAPACITY for u in final), final
        assert refused <= 4
        assert client.get(keys[-5:]) == [bytearray(d) for d in data[-5:]]


def test_eviction_is_lru_and_takes_what_is_needed(cluster: LocalCluster) -> None:
    with Client(cluster.config) as client:
        fill = int(FILL * CAPACITY) // SLOT
        old_keys = put_in_batches(client, fill)
        hot = old_keys[:300]
        client.get(hot)  # recently used: must survive
        time.sleep(0.3)
        new_keys, new_data = blocks(int(EXTRA * CAPACITY) // SLOT)
        client.put(new_keys, new_data)
        total = fill + len(new_keys)
        settle(client)
        assert all(client.exists(hot))
        assert all(client.exists(new_keys))
        # each primary keeps its blocks within its share (capacity / 12) of every node: one that crossed
        # its high mark ends exactly at its low mark (no over- or under-eviction); the others evict nothing
        low = int(0.8 * CAPACITY / GROUP) // SLOT
        high = int(0.9 * CAPACITY / GROUP) // SLOT
        info = client.node_info().values()
        for primary in info:
            count = sum(primary["classes"].values())
            if primary["gc"]["evictions"]:
                assert count == low, (count, low)
            else:
                assert count <= high
        evicted = total - sum(client.exists(old_keys)) - len(new_keys)
        assert evicted == sum(p["gc"]["evictions"] for p in info)
        cold = old_keys[300:]
        gone = [not e for e in client.exists(cold)]
        assert sum(gone[: len(gone) // 2]) >= 0.9 * sum(gone)  # the oldest half of the cold blocks went first


def test_changing_a_ttl_applies_to_stored_blocks_and_expired_blocks_are_misses(cluster: LocalCluster) -> None:
    with Client(cluster.config) as client:
        keys, data = blocks(20)
        client.put(keys[:10], data[:10], ttl_class="agent")
        client.put(keys[10:], data[10:], ttl_class="chatbot")
        replies = client.admin("ttl_set", classes={"agent": 1.0, "chatbot": 7 * 86400.0})
        assert all(r["ttl"]["agent"] == 1.0 for r in replies.values())
        time.sleep(1.3)
        assert client.get(keys[:10]) == [None] * 10  # expired: a miss even before GC ran
        assert client.match(keys[:10]) == 0
        assert client.match(keys[10:]) == 10
        settle(client)
        info = client.node_info()
        assert sum(i["gc"]["expirations"] for i in info.values()) == 10
        assert sum(i["blocks"] for i in info.values()) == 2 * 10  # records and their shard-1 copies


def test_put_with_an_unknown_ttl_class_is_refused(cluster: LocalCluster) -> None:
    with Client(cluster.config) as client, pytest.raises(ValueError, match="unknown TTL class"):
        client.put(*blocks(1), ttl_class="forever")


def test_a_restarted_node_keeps_lru_order(cluster: LocalCluster) -> None:
    with Client(cluster.config) as client:
        keys = put_in_batches(client, int(FILL * CAPACITY) // SLOT)
        hot = keys[:300]
        client.get(hot)
        time.sleep(0.6)  # access times reach disk in batches
        for nid in list(cluster.procs):
            cluster.kill(nid)
        cluster.start()
        wait_reachable(client)
        client.put(*blocks(int(EXTRA * CAPACITY) // SLOT))
        settle(client)
        assert all(client.exists(hot))


def test_pending_shards_of_a_killed_writer_are_reclaimed(cluster: LocalCluster) -> None:
    with Client(cluster.config) as client:
        keys = [os.urandom(16) for _ in range(4)]
        proc = subprocess.run(
            [sys.executable, "-c", WRITER, str(cluster.config_path), ",".join(k.hex() for k in keys)],
            capture_output=True,
            timeout=60,
        )
        assert proc.returncode == -signal.SIGKILL
        assert all(len(client.stat(k)["shards"]) == 12 for k in keys)
        time.sleep(1.2)  # past write_timeout_s
        settle(client)
        assert all(client.stat(k)["shards"] == [] for k in keys)
        assert sum(i["gc"]["zombies_dropped"] for i in client.node_info().values()) == 4 * 12


def test_a_wiped_node_is_rebuilt_by_repair(cluster: LocalCluster) -> None:
    with Client(cluster.config) as client:
        keys, data = blocks(30)
        client.put(keys, data)
        victim = 5
        cluster.kill(victim)
        shutil.rmtree(cluster.config.nodes[victim].data_dir)
        cluster.start([victim])
        wait_reachable(client)
        assert not client.probe(keys).all()
        client.admin("gc", repair=True)
        assert client.probe(keys).all()  # full redundancy again, records of the wiped primary included
        nodes = Placement(cluster.config.groups).shard_nodes(keys)
        for b, key in enumerate(keys[:5]):
            index = int(list(nodes[b]).index(victim))
            assert shard_status(client, victim, key, index) == Status.OK
        assert [bytes(g) for g in client.get(keys)] == data


def test_a_corrupt_shard_is_rewritten_when_read(cluster: LocalCluster) -> None:
    with connect(cluster.config_path) as client:
        keys, data = blocks(2)
        client.put(keys, data)
        holder = int(Placement(cluster.config.groups).shard_nodes(keys)[0, 2])
        cluster.kill(holder)
        engine = ChunkEngine(cluster.config.nodes[holder].data_dir, capacity_bytes=CAPACITY)
        rec = next(r for r in engine.shard_records("default", keys[0]) if r.index == 2)
        engine.close()
        slab = cluster.config.nodes[holder].data_dir / "slabs" / f"slab-{SIZE_CLASSES[rec.size_class]}.dat"
        with open(slab, "r+b") as f:
            f.seek(rec.slot * SIZE_CLASSES[rec.size_class])
            f.write(b"\0" * 32)
        cluster.start([holder])
        wait_reachable(client)
        assert shard_status(client, holder, keys[0], 2) == Status.CORRUPT
        assert client.get(keys) == [bytearray(d) for d in data]
        assert client.stats["shards_repaired"] >= 1
        assert shard_status(client, holder, keys[0], 2) == Status.OK


# -- TTLs of days, with an injected clock ----------------------------------------------------------


def test_ttls_of_days_expire_on_an_injected_clock(tmp_path) -> None:
    clock = ManualClock(1_000_000.0)
    path = cluster_mod.write_default(tmp_path, capacity_bytes=CAPACITY)
    config = cluster_mod.load(path)
    engine = ChunkEngine(tmp_path / "engine", CAPACITY, clock=clock.now)
    worker = GCWorker(engine, 0, config, lambda: config.ttl_classes, clock=clock.now)
    for key, ttl_class in ((b"a" * 16, "agent"), (b"c" * 16, "chatbot")):
        engine.put_pending("default", [ShardWrite(key, 0, 8, 80, ttl_class, bytes(16))], [memoryview(b"x" * 8)])
        engine.commit("default", [BlockCommit(key, 0, 80, ttl_class, bytes(16), bytes(32), b"")])
    ttl = config.ttl_classes.get
    clock.advance(3 * 86400 - 1)
    assert engine.live_blocks("default", [b"a" * 16, b"c" * 16], ttl) == [True, True]
    clock.advance(2)
    assert engine.live_blocks("default", [b"a" * 16, b"c" * 16], ttl) == [False, True]
    worker.cycle()
    assert engine.block_record("default", b"a" * 16) is None and worker.stats.expirations == 1
    clock.advance(4 * 86400)
    worker.cycle()
    assert len(engine.lru) == 0 and worker.stats.expirations == 2
    engine.close()
