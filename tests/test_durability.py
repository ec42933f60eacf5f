"""Durability: any two node losses keep every committed block, and redundancy comes back by itself.

Real 12-node clusters of node processes; nodes are killed with SIGKILL and their data wiped as an operator
recovering a failed disk would (metadata and slabs removed, node restarted empty); ``kvctl`` runs as a process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.kvstore.client import Client
from kvtier.kvstore.cluster.local import LocalCluster, NodeStartError
from kvtier.kvstore.node.chunks import ChunkEngine
from kvtier.kvstore.node.slabs import SIZE_CLASSES
from kvtier.kvstore.placement import Placement
from kvtier.kvstore.wire.protocol import Op, Status
from kvtier.kvstore.wire.transport import Exchange

from .conftest import wait_for
from .test_node_metrics import metrics
from .test_store import shard_status, wait_reachable

FAST_GC = "interval_s = 0.2\naccess_flush_s = 0.2\n"
BLOCK = 20_000


def blocks(n: int, size: int = BLOCK) -> tuple[list[bytes], list[bytes]]:
    return [os.urandom(16) for _ in range(n)], [os.urandom(size) for _ in range(n)]


def stored_blocks(client: Client, n: int) -> tuple[list[bytes], list[bytes]]:
    """``n`` new blocks, every one committed: (keys, blocks)."""
    keys, data = blocks(n)
    assert all(client.put(keys, data))
    return keys, data


def confirmed_shards(client: Client) -> int:
    """Shards other than shard 0s whose block's primary confirmed it, over every node."""
    return sum(info["gc"]["shards_confirmed"] for info in client.node_info().values())


def kvctl(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVTIER_CONFIG", "COLUMNS")}
    cmd = [sys.executable, "-m", "kvtier.tools.kvctl", "--config", str(path), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def wipe(local: LocalCluster, node_ids: list[int]) -> None:
    """SIGKILL the nodes, remove their metadata and slabs (a lost disk), start them again, empty."""
    for nid in node_ids:
        local.kill(nid)
    for nid in node_ids:
        data_dir = local.config.nodes[nid].data_dir
        shutil.rmtree(data_dir / "meta")
        shutil.rmtree(data_dir / "slabs")
    local.start(node_ids)


def test_every_block_reads_back_after_two_adjacent_nodes_are_wiped_and_repaired(own_cluster) -> None:
    local = own_cluster(capacity_bytes=64 << 20, gc=FAST_GC)
    with Client(local.config) as client:
        keys, data = stored_blocks(client, 360)
        wipe(local, [5, 6])
        wait_reachable(client)
        done = kvctl(local.config_path, "repair")
        assert done.returncode == 0, done.stderr
        assert client.probe(keys).all()  # every shard back, the records of both wiped nodes included
        assert [bytes(b) for b in client.get(keys)] == data


def test_blocks_committed_while_a_node_was_down_get_their_twelfth_shard_back_on_their_own(own_cluster) -> None:
    local = own_cluster(gc=FAST_GC)
    placement = Placement(local.config.groups)
    with Client(local.config) as client:
        local.kill(2)
        keys, data = blocks(50)
        while not (placement.primaries(keys) == 2).any():  # (random keys miss node 2 one time in 77)
            keys, data = blocks(50)
        stored = client.put(keys, data)
        assert stored == (placement.primaries(keys) != 2).tolist()  # node 2's blocks refused; the others: 11 shards
        keys = [k for k, s in zip(keys, stored, strict=True) if s]
        data = [d for d, s in zip(data, stored, strict=True) if s]
        local.start([2])
        wait_reachable(client)
        wait_for(lambda: client.probe(keys).all(), 60, "the GC to restore every block's 12th shard by itself")
        for nid in (7, 8):
            local.kill(nid)
        assert [bytes(b) if b is not None else None for b in client.get(keys)] == data


def test_a_holder_killed_between_put_and_commit_is_owed_and_every_block_survives_two_more_losses(
    own_cluster, monkeypatch
) -> None:
    local = own_cluster(gc=FAST_GC)
    victim = 3
    with Client(local.config) as client:
        keys, data = blocks(80)
        others = Placement(local.config.groups).primaries(keys) != victim  # (its own blocks would not commit)
        keys, data = [keys[b] for b in np.flatnonzero(others)], [data[b] for b in np.flatnonzero(others)]
        request = Exchange.request

        def die_before_commit(exchange: Exchange, node_id: int, opcode: int, *args, **kwargs):
            if opcode == Op.COMMIT and victim in local.procs:
                local.kill(victim)  # it took its shards; it never hears the COMMIT
            return request(exchange, node_id, opcode, *args, **kwargs)

        monkeypatch.setattr(Exchange, "request", die_before_commit)
        assert all(client.put(keys, data))
        monkeypatch.undo()
        owed = [info["blocks_under_replicated"] for nid, info in client.node_info().items() if nid != victim]
        assert sum(owed) == len(keys)  # every block is 11 shards, and its primary knows it
        local.start([victim])
        wait_reachable(client)
        wait_for(lambda: client.probe(keys).all(), 60, "the GC to restore every block's 12th shard by itself")
        for nid in (7, 8):
            local.kill(nid)
        assert [bytes(b) if b is not None else None for b in client.get(keys)] == data


def test_blocks_below_twelve_shards_are_reported_until_repaired_with_their_time_to_redundancy(own_cluster) -> None:
    local = own_cluster(gc=FAST_GC)
    placement = Placement(local.config.groups)
    with Client(local.config) as client:
        local.kill(2)
        keys, data = blocks(30)
        stored = client.put(keys, data)
        primaries = placement.primaries(keys).tolist()
        expected = {nid: sum(1 for p, s in zip(primaries, stored, strict=True) if s and p == nid) for nid in range(12)}
        del expected[2]
        # node 2 is down: the repairs cannot be made, and each primary reports the blocks it owes them for
        owed = {nid: info["blocks_under_replicated"] for nid, info in client.node_info().items() if nid != 2}
        assert owed == expected and sum(owed.values()) >= 20
        assert sum(metrics(local, nid)[("kvtier_node_blocks_under_replicated", frozenset())] for nid in owed) == sum(
            owed.values()
        )
        local.start([2])
        wait_reachable(client)
        wait_for(
            lambda: all(i["blocks_under_replicated"] == 0 for i in client.node_info().values()),
            60,
            "the owed repairs to be made",
        )
        assert client.probe([k for k, s in zip(keys, stored, strict=True) if s]).all()
        # every repair a node owed is observed there once done (at least: a loaded CI machine once counted 41 for
        # 27 owed, cause not found; a repair never observed is what this catches)
        restored = {
            nid: metrics(local, nid)[("kvtier_node_redundancy_restored_seconds_count", frozenset())] for nid in owed
        }
        assert all(restored[nid] >= count for nid, count in owed.items()), (restored, owed)


def test_blocks_a_repair_pass_restored_are_no_longer_counted_under_replicated_when_it_ends(own_cluster) -> None:
    local = own_cluster(gc="interval_s = 2.0\n")  # the owed repairs wait 4 s, then 8 s, while node 2 is down
    with Client(local.config) as client:
        local.kill(2)
        keys, data = blocks(40)
        keys = [k for k, s in zip(keys, client.put(keys, data), strict=True) if s]
        assert sum(i.get("blocks_under_replicated", 0) for i in client.node_info().values()) == len(keys)
        time.sleep(3.0)
        local.start([2])
        wait_reachable(client)
        done = kvctl(local.config_path, "repair")  # a pass as a replacement's fill runs it
        assert done.returncode == 0, done.stderr
        assert client.probe(keys).all()
        assert {nid: i["blocks_under_replicated"] for nid, i in client.node_info().items()} == dict.fromkeys(
            range(12), 0
        )


def flip_a_bit(local: LocalCluster, key: bytes, index: int) -> int:
    """Flip one bit of shard ``index`` of ``key`` in its slab file (its node stopped meanwhile, then started
    again); returns the node holding it."""
    holder = int(Placement(local.config.groups).shard_nodes([key])[0, index])
    local.kill(holder)
    engine = ChunkEngine(local.config.nodes[holder].data_dir, capacity_bytes=1 << 30)
    record = next(r for r in engine.shard_records("default", key) if r.index == index)
    engine.close()
    slab = local.config.nodes[holder].data_dir / "slabs" / f"slab-{SIZE_CLASSES[record.size_class]}.dat"
    with open(slab, "r+b") as f:
        f.seek(record.slot * SIZE_CLASSES[record.size_class] + record.length // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    local.start([holder])
    return holder


def test_kvctl_scrub_finds_a_flipped_bit_and_rewrites_the_shard(own_cluster) -> None:
    local = own_cluster(gc=FAST_GC)
    with Client(local.config) as client:
        keys, data = stored_blocks(client, 8)
        holder = flip_a_bit(local, keys[0], 11)  # a parity shard: no read would ever ask for it
        wait_reachable(client)
        assert shard_status(client, holder, keys[0], 11) == Status.CORRUPT  # the node checks, no client crc
        done = kvctl(local.config_path, "--json", "scrub")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["corrupt"] == 1 and report["repaired"] == 1 and report["shards_checked"] >= 8 * 12
        assert shard_status(client, holder, keys[0], 11) == Status.OK  # rewritten from the other 11
        assert [bytes(b) for b in client.get(keys)] == data


def test_the_scrubber_finds_and_rewrites_a_flipped_bit_by_itself(own_cluster) -> None:
    local = own_cluster(gc=FAST_GC + 'scrub_period_s = "2s"\n')
    with Client(local.config) as client:
        keys, _ = stored_blocks(client, 8)
        holder = flip_a_bit(local, keys[3], 10)
        wait_reachable(client)
        wait_for(
            lambda: shard_status(client, holder, keys[3], 10) == Status.OK,
            30,
            "the scrubber to find the corrupt shard and rewrite it",
            poll_s=0.2,
        )
        stats = client.node_info([holder])[holder]["gc"]
        # rewritten by the scrubber's own repair, or, where that timed out on a loaded machine, from the owed list
        assert stats["scrub_corrupt"] >= 1 and stats["shards_repaired"] >= 1, stats


# -- blocks whose records were lost everywhere ---------------------------------------------------------------


def drop_block_records(local: LocalCluster, node_id: int, keys: list[bytes]) -> None:
    """Remove the block records (not the shards) of ``keys`` at a stopped node, as a node that kept records on
    two holders only (before there were three) never wrote them at shard 2's holder."""
    engine = ChunkEngine(local.config.nodes[node_id].data_dir, capacity_bytes=1 << 30)
    with engine.env.begin(write=True) as txn:
        engine.block_table.delete_many(txn, [b"default/" + k for k in keys])
    engine.close()


def test_a_wiped_node_rebuilding_from_its_peers_lets_every_block_be_read_and_matched_meanwhile(own_cluster) -> None:
    local = own_cluster(gc=FAST_GC + "repair_bytes_per_s = 20000\n")  # its rebuild takes minutes
    with Client(local.config) as client:
        keys, data = stored_blocks(client, 120)
        assert (Placement(local.config.groups).primaries(keys) == 4).sum() >= 3
        wipe(local, [4])
        wait_reachable(client)
        assert client.node_info([4])[4]["rebuilding"]
        assert client.match(keys) == len(keys)  # its own blocks too: their records are kept by two other nodes
        assert [bytes(b) if b is not None else None for b in client.get(keys)] == data  # decoded around it
        out = [bytearray(BLOCK) for _ in keys]
        assert client.get_into(keys, out) == [True] * len(keys) and out == data


def test_blocks_whose_every_record_was_lost_are_rebuilt_from_their_shards(own_cluster) -> None:
    local = own_cluster(gc=FAST_GC + "write_timeout_s = 1.0\n")
    placement = Placement(local.config.groups)
    with Client(local.config) as client:
        keys, data = stored_blocks(client, 120)
        # every shard confirmed by its block's primary first: shards whose block no record names before that are
        # an orphan's (kvstore.node.unconfirmed), as a put that never committed would leave them
        wait_for(lambda: confirmed_shards(client) >= 11 * len(keys), 60, "the shards' blocks confirmed")
        recorded_at = placement.shard_nodes(keys)[:, :3].tolist()
        orphans = [k for k, holders in zip(keys, recorded_at, strict=True) if holders == [5, 6, 7]]
        assert orphans
        local.kill(7)
        drop_block_records(local, 7, orphans)  # their third record, as blocks written before there were three
        local.start([7])
        wipe(local, [5, 6])  # ... and the other two went with two disks
        wait_reachable(client)
        time.sleep(1.0)  # older than write_timeout_s: an orphan younger may be a put still committing (waits)
        done = kvctl(local.config_path, "repair", "--rebuild")
        assert done.returncode == 0, done.stderr
        assert client.probe(keys).all()
        assert [bytes(b) for b in client.get(keys)] == data


def test_blocks_that_lost_three_shards_are_reclaimed_everywhere_not_kept_until_their_ttl(own_cluster) -> None:
    local = own_cluster(gc=FAST_GC + "write_timeout_s = 1.0\n")
    with Client(local.config) as client:
        keys, _ = stored_blocks(client, 60)
        wipe(local, [5, 6, 7])  # three shards of every block: none can be decoded
        wait_reachable(client)
        time.sleep(1.0)  # older than write_timeout_s: no longer a put that may still be committing
        done = kvctl(local.config_path, "repair", "--rebuild")
        assert done.returncode == 0, done.stderr
        assert client.get(keys) == [None] * len(keys)
        assert not client.probe(keys).any()  # no shard of them holds space anywhere
        assert all(info["blocks"] == 0 for info in client.node_info().values())  # nor any record
        assert sum(info["gc"]["blocks_reclaimed"] for info in client.node_info().values()) >= len(keys)


# -- corrupt metadata ------------------------------------------------------------------------------------------


def damage(path: Path, how: str) -> None:
    if how == "truncated":
        os.truncate(path, 8192)  # its two meta pages: the B-trees they point to are gone
    else:
        with open(path, "r+b") as f:
            f.write(os.urandom(8192))


@pytest.mark.parametrize("how", ["truncated", "overwritten"])
def test_a_node_whose_metadata_is_damaged_says_which_file_and_what_to_do(own_cluster, how: str) -> None:
    local = own_cluster()
    with Client(local.config) as client:
        stored_blocks(client, 24)
    local.kill(4)
    data_mdb = local.config.nodes[4].data_dir / "meta" / "data.mdb"
    damage(data_mdb, how)
    with pytest.raises(NodeStartError) as refused:
        local.start([4])
    message = str(refused.value)
    assert str(data_mdb) in message and f"kvstore reset-node {local.config_path} 4" in message
    assert "Traceback" not in local.log_path(4).read_text()


def test_kvstore_reset_node_moves_the_data_aside_and_the_node_is_refilled_by_itself(own_cluster) -> None:
    local = own_cluster(gc=FAST_GC)
    with Client(local.config) as client:
        keys, data = stored_blocks(client, 120)
        cmd = [sys.executable, "-m", "kvtier.kvstore.cluster.cli", "reset-node", str(local.config_path), "4"]
        running = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert running.returncode == 2 and "node 4 is running" in running.stderr  # refused: nothing moved
        local.kill(4)
        damage(local.config.nodes[4].data_dir / "meta" / "data.mdb", "overwritten")
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        aside = list(local.config.nodes[4].data_dir.parent.glob("node-4.aside-*"))
        assert len(aside) == 1 and (aside[0] / "meta" / "data.mdb").exists()
        local.start([4])
        wait_reachable(client)
        wait_for(lambda: client.probe(keys).all(), 60, "the node to rebuild its shards from its peers by itself")
        assert [bytes(b) for b in client.get(keys)] == data


def test_a_rebuild_pages_through_every_block_a_peer_holds_each_once() -> None:
    from kvtier.kvstore.node.held_blocks import blocks_held
    from kvtier.kvstore.node.shard_index import RECORD, name_table

    keys = [os.urandom(16) for _ in range(1000)]
    tables = []
    for tenant, part in (("default", keys[:600]), ("teamb", keys[600:])):
        # two shards of some blocks (a group that lists a node twice): still one entry per block
        rows = part + part[:50]
        names = name_table(f"{tenant}/".encode(), b"".join(rows), 16, np.arange(len(rows)) % 12)
        records = np.zeros(len(rows), dtype=RECORD)
        records["created"] = np.arange(len(rows), dtype=np.float64)
        tables.append((names, records))
    placement = Placement([list(range(12)), list(range(12, 24))])
    in_group = [k for k in keys if 5 in placement.shard_nodes([k])[0]]
    seen: list[bytes] = []
    start: int | None = 0
    while start is not None:
        page = blocks_held(tables, placement, 5, start, 64)
        seen += [g["keys"][i : i + 16] for g in page["groups"] for i in range(0, len(g["keys"]), 16)]
        start = page["next"]
    assert sorted(seen) == sorted(in_group) and len(seen) == len(set(seen))
    early = blocks_held(tables, placement, 5, 0, 10_000, before=100.0)  # shards committed before then only
    first = set(keys[:100] + keys[600:700])  # each tenant's first 100 rows
    assert sum(len(g["keys"]) // 16 for g in early["groups"]) == len(first.intersection(in_group))
