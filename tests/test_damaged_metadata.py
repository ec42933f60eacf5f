"""Damaged metadata: whatever a node's LMDB records hold, the node opens them or stops with one line naming the file
and ``kvstore reset-node`` — never a traceback — and ``kvstore serve`` does not restart it in a loop.

The fuzz damages one record value of each table of a real data dir (written by a chunk engine: shard and block
records, dead-slot marks, owed repairs, a removal intent, settings) in each of several ways and opens it again.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest

from kvtier.kvstore.client import Client
from kvtier.kvstore.node.chunks import ChunkEngine, MetadataError
from kvtier.kvstore.node.owed import Owed
from kvtier.kvstore.placement import Placement

from .conftest import wait_for
from .test_chunks_writes import staged
from .test_node_abuse import kvstore_serve, next_line

TABLES = ["slots", "block_seq", "freed", "owed", "owed_keys", "removals", "settings"]
DAMAGE: dict[str, Callable[[bytes, random.Random], bytes]] = {
    "emptied": lambda value, rng: b"",
    "cut by a byte": lambda value, rng: value[:-1],
    "cut in half": lambda value, rng: value[: len(value) // 2],
    "a byte longer": lambda value, rng: value + b"\xff",
    "text not utf-8": lambda value, rng: value[:-1] + b"\xff",  # a TTL class name, a name's last byte
    "random bytes": lambda value, rng: rng.randbytes(len(value)),
    "ones": lambda value, rng: b"\xff" * len(value),  # every number at its largest: slot 4 billion, class 65,535
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data dir with a record in every table."""
    data_dir = tmp_path_factory.mktemp("pristine") / "node"
    engine = ChunkEngine(data_dir, 64 << 20)  # new: its settings say it is to be rebuilt
    keys = [os.urandom(16) for _ in range(12)]
    engine.commit("default", staged(engine, keys)[0])  # shard and block records
    engine.delete("default", keys[:2])  # dead-slot marks
    engine.remove_blocks("default", keys[2:4])  # a removal intent
    engine.owe([Owed(b"default/" + keys[5], engine.clock(), 0b10)])
    engine.set_setting("draining", b"1")
    engine.set_setting("scrub_at", b"\x00\x05\x00\x00\x00\x02")
    engine.close()
    return data_dir


def damaged_copy(pristine: Path, to: Path, table: str, damage: Callable[[bytes, random.Random], bytes]) -> Path:
    """A copy of ``pristine`` (its metadata compacted, its slab files linked) with the first record of ``table``
    damaged."""
    (to / "meta").mkdir(parents=True)
    with lmdb.open(str(pristine / "meta"), max_dbs=16, readonly=True, lock=False) as env:
        env.copy(str(to / "meta"), compact=True)
    shutil.copytree(pristine / "slabs", to / "slabs", copy_function=os.link)
    with lmdb.open(str(to / "meta"), max_dbs=16) as env:
        db = env.open_db(table.encode())
        with env.begin(write=True, db=db) as txn:
            key, value = next(iter(txn.cursor()))
            txn.put(key, damage(bytes(value), random.Random(key)))
    return to


@pytest.mark.parametrize("table", TABLES)
def test_a_damaged_record_value_opens_or_is_one_metadata_error_never_anything_else(
    pristine: Path, tmp_path: Path, table: str
) -> None:
    refused = []
    for n, (how, damage) in enumerate(DAMAGE.items()):
        data_dir = damaged_copy(pristine, tmp_path / str(n), table, damage)
        try:
            ChunkEngine(data_dir, 64 << 20).close()
        except MetadataError as exc:
            assert str(data_dir / "meta" / "data.mdb") in str(exc) and "\n" not in str(exc), (how, exc)
            refused.append(how)
    # what no value of the table can be is always found (a setting may be empty, a record's last byte may go, a
    # bitmap may be all ones); a shard record's slot of 4 billion among them (it is not in its file)
    assert {"emptied", "cut in half"} <= set(refused) or table == "settings", refused
    assert "ones" in refused or table not in ("slots", "block_seq", "owed"), refused


def test_a_block_records_ttl_class_that_is_not_utf8_is_a_metadata_error(pristine: Path, tmp_path: Path) -> None:
    data_dir = damaged_copy(pristine, tmp_path / "node", "block_seq", DAMAGE["text not utf-8"])
    with pytest.raises(MetadataError, match="UnicodeDecodeError"):
        ChunkEngine(data_dir, 64 << 20)


def test_a_node_with_damaged_metadata_says_so_in_one_line_and_serve_waits_for_its_reset(tmp_path: Path) -> None:
    with kvstore_serve(tmp_path) as (serve, config), Client(config) as client:
        keys = [os.urandom(16) for _ in range(48)]
        data = [os.urandom(20_000) for _ in keys]
        assert all(client.put(keys, data))
        assert (Placement(config.groups).shard_nodes(keys)[:, :3] == 3).any()
        pid = client.node_info([3])[3]["pid"]
        with lmdb.open(str(config.nodes[3].data_dir / "meta"), max_dbs=16) as env:  # beside the running node
            db = env.open_db(b"block_seq")
            with env.begin(write=True, db=db) as txn:
                key, value = next(iter(txn.cursor()))
                txn.put(key, bytes(value)[:-1] + b"\xff")  # its TTL class name, as the issue found it
        os.kill(pid, signal.SIGKILL)
        assert next_line(serve, 30).startswith("node 3 exited with code -9")
        held = next_line(serve, 30)
        assert held.startswith("node 3 is not restarted: node 3: its metadata") and "kvstore reset-node" in held
        log = (config.nodes[3].data_dir / "node.log").read_text()
        assert "Traceback" not in log and log.strip().splitlines()[-1].startswith("kvstore node: node 3:")

        reset = subprocess.run(
            [sys.executable, "-m", "kvtier.kvstore.cluster.cli", "reset-node", str(config.path), "3"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert reset.returncode == 0, reset.stderr  # serve held it: nothing had restarted it meanwhile
        assert next_line(serve, 30).startswith("node 3 has an empty data dir now (reset): starting it")
        assert next_line(serve, 30).startswith("node 3 restarted")
        wait_for(lambda: client.probe(keys).all(), 60, "node 3 to be refilled from its peers")
        assert client.get(keys) == data
