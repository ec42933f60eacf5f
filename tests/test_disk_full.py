"""A full disk is a refusal, never a crash: slabs and LMDB keep within the filesystem's budget, every ENOSPC is a
NO_SPACE that is logged once and counted, a node starts on a full disk and serves reads, and log lines its full disk
cannot take go to the stderr of whoever started it.

Real node processes whose data dir is a small tmpfs (mounting one needs root: CI runs as root; elsewhere these
tests skip, saying why).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.kvstore.client import CapacityError, Client, connect
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.kvstore.node.chunks import ChunkEngine
from kvtier.kvstore.node.disk import NoSpace
from kvtier.kvstore.placement import Placement
from kvtier.kvstore.wire.protocol import Status

from .conftest import tmpfs
from .test_chunks_writes import TTL, batch, staged
from .test_node_metrics import metrics
from .test_store import rand_blocks, rand_keys, shard_status, wait_reachable

VICTIM = 6


@contextlib.contextmanager
def data_dir_on_a_small_disk(local: LocalCluster, node_id: int, size: str) -> Iterator[Path]:
    """Stop the node (of a cluster that stored nothing yet), give it an empty data dir (metadata, slabs, log) on a
    tmpfs of ``size``, start it again."""
    local.kill(node_id)
    data_dir = local.config.nodes[node_id].data_dir
    shutil.rmtree(data_dir)
    with tmpfs(data_dir, size):
        local.start([node_id])
        yield data_dir
        with contextlib.suppress(KeyError):
            local.kill(node_id)


def fill_up(path: Path) -> Path:
    """Write a file in ``path`` until its filesystem has no block left, and the node's log until the rest of its last
    block is taken too; returns the file."""
    filler = path / "filler"
    for name, piece in ((filler, 64 << 10), (path / "node.log", 1)):
        with open(name, "ab", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\n" * piece)
    return filler


def put_many(client: Client, rounds: int) -> list[bytes]:
    """``rounds`` puts of 16 blocks of 1 MiB; returns the keys stored (refusals for capacity are expected)."""
    stored: list[bytes] = []
    for _ in range(rounds):
        keys = rand_keys(16)
        try:
            done = client.put(keys, rand_blocks(16, 1 << 20))
        except CapacityError as refused:
            done = refused.stored
        stored += [k for k, s in zip(keys, done, strict=True) if s]
    return stored


def test_a_node_whose_disk_fills_refuses_writes_stays_up_serves_reads_and_starts_again_full(
    make_cluster, capfd
) -> None:
    local = make_cluster(capacity_bytes=1 << 30)  # the configured capacity is far larger than the disk
    with data_dir_on_a_small_disk(local, VICTIM, "24m") as data_dir, connect(local.config_path) as client:
        wait_reachable(client)
        stored = put_many(client, 20)  # ~34 MiB of shards for the node: its slabs reach the disk's budget
        assert local.procs[VICTIM].poll() is None, "the node died as its disk filled"
        refused = metrics(local, VICTIM)[("kvtier_node_no_space_total", frozenset())]
        assert refused > 0
        filler = fill_up(data_dir)  # and now nothing is left, not even for its metadata or its log
        assert client.delete(stored[: len(stored) // 3])  # slots free again, but no block of the disk
        stored = stored[len(stored) // 3 :] + put_many(client, 6)  # into those slots: records the metadata must hold
        assert local.procs[VICTIM].poll() is None, "the node died once its metadata could not grow"
        held = [k for k in stored if VICTIM in Placement(local.config.groups).shard_nodes([k])[0]]
        index = int(list(Placement(local.config.groups).shard_nodes([held[0]])[0]).index(VICTIM))
        assert shard_status(client, VICTIM, held[0], index) == Status.OK  # it serves what it holds

        local.kill(VICTIM)
        local.start([VICTIM])  # on a disk with no block free
        wait_reachable(client)
        assert shard_status(client, VICTIM, held[0], index) == Status.OK
        assert [bytes(b) is not None for b in client.get(stored[:16])] == [True] * len(stored[:16])

        filler.unlink()  # room again: writes whose primary is the node are taken again
        keys = [k for k in rand_keys(400) if Placement(local.config.groups).primaries([k])[0] == VICTIM][:8]
        assert client.put(keys, rand_blocks(len(keys), 64 << 10)) == [True] * len(keys)
    # its log file could not take what it said on the full disk: that went to the stderr of who started it
    err = capfd.readouterr().err
    assert '"node": 6' in err and "disk" in err, err[-2000:]


def read_statuses(engine: ChunkEngine, keys: list[bytes]) -> list[int]:
    reads = engine.read("default", b"".join(keys), np.zeros(len(keys), dtype=np.uint8), None, TTL, verify=False)
    engine.unpin(reads)
    return reads.status.tolist()


def test_a_data_dir_opened_on_a_full_disk_without_room_for_its_metadata_serves_reads_and_refuses_writes(
    tmp_path: Path,
) -> None:
    with tmpfs(tmp_path / "disk", "8m") as disk:
        engine = ChunkEngine(disk / "node", 64 << 20)
        engine.rebuilt()  # (a node past its first rebuild: a block it has no record of is ABSENT)
        keys = [os.urandom(16) for _ in range(24)]
        engine.commit("default", staged(engine, keys)[0])
        engine.delete("default", keys[:8])  # dead records left in LMDB, marked
        engine.close()
        data = disk / "node" / "meta" / "data.mdb"
        # as a data dir written before its metadata was allocated ahead: nothing allocated past its pages
        subprocess.run(["cp", "--sparse=always", str(data), str(data) + ".new"], check=True)
        os.replace(str(data) + ".new", data)
        filler = fill_up(disk)

        engine = ChunkEngine(disk / "node", 64 << 20)  # no room for its clean-up at open: it opens as it is
        assert engine.refusals.count >= 1
        assert read_statuses(engine, keys) == [Status.ABSENT] * 8 + [Status.OK] * 16
        more = [os.urandom(16) for _ in range(4)]
        refused = batch(more)
        engine.reserve("default", refused)
        assert refused.status.tolist() == [Status.NO_SPACE] * 4  # before its payload comes
        with pytest.raises(NoSpace):
            engine.delete("default", keys[8:10])
        assert read_statuses(engine, keys[8:10]) == [Status.OK] * 2  # nothing of the refused delete happened

        filler.unlink()  # room again: the marks it kept still name the dead records, and writes go on
        engine.commit("default", staged(engine, more)[0])
        engine.close()
        engine = ChunkEngine(disk / "node", 64 << 20)
        assert read_statuses(engine, keys + more) == [Status.ABSENT] * 8 + [Status.OK] * 20
        assert engine.counts()["shards"] == 20
        engine.close()
