"""The cluster map in etcd on one machine: a real etcd process on loopback, real node processes for membership."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.gc import fill
from kvtier.kvstore.client import connect
from kvtier.kvstore.cluster import map as cluster_map
from kvtier.kvstore.cluster.config import ConfigError, port_range, token_hash
from kvtier.kvstore.cluster.etcd import Etcd
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.kvstore.cluster.map import MapStore, new_map
from kvtier.kvstore.placement import Placement
from kvtier.tools.benchutil import free_port

from .conftest import wait_for

BIN = Path(sys.executable).parent
SIX_HOSTS = ["--hosts", ",".join(f"{h}=10.0.0.{i}" for i, h in enumerate("abcdef", 1))]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One etcd member on loopback (auto-compaction on); its client endpoint."""
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (Debian: etcd-server; `make test` installs it)")
    work = tmp_path_factory.mktemp("etcd")
    client, peer = free_port(), free_port()
    log = open(work / "etcd.log", "wb")  # noqa: SIM115 - the child holds it
    proc = subprocess.Popen(
        [
            "etcd", "--name=e0", f"--data-dir={work / 'data'}",
            f"--listen-client-urls=http://127.0.0.1:{client}", f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}", f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=e0=http://127.0.0.1:{peer}",
            "--auto-compaction-mode=revision", "--auto-compaction-retention=1000",
        ],
        stdout=log,
        stderr=log,
    )  # fmt: skip
    endpoint = f"127.0.0.1:{client}"
    probe = Etcd(endpoint, timeout_s=1.0)
    try:
        wait_for(lambda: _answers(probe), 30, "etcd to serve")
        yield endpoint
    finally:
        probe.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        log.close()


def _answers(etcd: Etcd) -> bool:
    try:
        etcd.call(lambda c: c.status(), timeout_s=1.0)
        return True
    except Exception:
        return False


def free_run(length: int) -> int:
    """A port P with P .. P+length all free now (the map gives node k port P+k, its metrics P+1000+k)."""
    rng = random.SystemRandom()
    low, high = port_range(length)
    while True:
        base = rng.randrange(low, high - length)
        socks = []
        try:
            for port in range(base, base + length):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


def init(etcd: str, directory: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "kvstore"), "init", str(directory), "--etcd", etcd, "--name", name, *extra],
        capture_output=True,
        text=True,
    )


def test_init_writes_the_map_with_token_hashes_and_a_private_file_naming_it(etcd: str, tmp_path: Path) -> None:
    done = init(
        etcd, tmp_path, "hashes", "--hosts", "a=10.0.0.1,b=10.0.0.2,c=10.0.0.3,d=10.0.0.4,e=10.0.0.5,f=10.0.0.6"
    )
    assert done.returncode == 0, done.stderr
    path = tmp_path / "cluster.toml"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    token = cluster_map.read_etcd_file(path)[2]  # type: ignore[index]
    store = MapStore(Etcd(etcd), "hashes")
    doc, revision = store.read()
    raw = json.dumps(doc)
    assert token not in raw and doc["tenants"]["default"] == token_hash(token)  # the hash, never the token
    assert revision > 0 and len(doc["nodes"]) == 12 and len(doc["groups"]) == 1
    config = cluster_map.load(path, watch=False)
    assert config.revision == revision and config.tenant_for_token(token) == "default"
    assert config.tenant_for_token("x" * 48) is None


def test_a_group_with_more_than_two_slots_on_one_host_is_refused_clearly(etcd: str, tmp_path: Path) -> None:
    done = init(etcd, tmp_path, "domains", "--hosts", "a=10.0.0.1,b=10.0.0.2,c=10.0.0.3", "--nodes-per-host", "4")
    assert done.returncode == 2
    assert "4 of its 12 slots on host 'a'" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "cluster.toml").exists()
    with pytest.raises(ConfigError):
        MapStore(Etcd(etcd), "domains").read()  # nothing was written


def test_a_second_init_never_overwrites_a_map(etcd: str, tmp_path: Path) -> None:
    assert init(etcd, tmp_path / "one", "twice", *SIX_HOSTS).returncode == 0
    again = init(etcd, tmp_path / "two", "twice", *SIX_HOSTS)
    assert again.returncode == 2 and "already has a map" in again.stderr


def test_concurrent_edits_are_compare_and_swap_and_none_is_lost(etcd: str) -> None:
    hosts = {h: f"10.0.0.{i}" for i, h in enumerate("abcdef")}
    store, other = MapStore(Etcd(etcd), "cas"), MapStore(Etcd(etcd), "cas")  # two editors
    store.create(new_map("cas", "t" * 32, hosts, 2, 1 << 30, "/srv"))
    raced = []

    def add(name: str, value: float):
        def edit(doc: dict) -> bool:
            if not raced:  # the first attempt: another editor changes the map between its read and its write
                raced.append(other.update(lambda d: d["ttl"].update(other=60.0) or True))
            doc["ttl"][name] = value
            return True

        return edit

    revision = store.update(add("mine", 30.0))
    doc, now = store.read()
    assert now == revision and doc["ttl"]["mine"] == 30.0 and doc["ttl"]["other"] == 60.0  # both changes kept


def test_a_cluster_file_with_an_unreachable_etcd_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(f'[cluster]\nname = "x"\netcd = "127.0.0.1:{free_port()}"\ntoken = "{"t" * 32}"\n')
    path.chmod(0o600)  # it holds a token
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"cannot read the cluster map: etcd at 127\.0\.0\.1"):
        cluster_map.load(path)
    assert time.monotonic() - started < 30


def test_a_token_that_is_no_tenants_is_refused_at_load(etcd: str, tmp_path: Path) -> None:
    assert (
        init(etcd, tmp_path, "tok", "--hosts", ",".join(f"{h}=10.0.0.{i}" for i, h in enumerate("abcdef"))).returncode
        == 0
    )
    path = tmp_path / "cluster.toml"
    text = path.read_text()
    token = cluster_map.read_etcd_file(path)[2]  # type: ignore[index]
    path.write_text(text.replace(token, "u" * 48))
    with pytest.raises(ConfigError, match="is no token of cluster 'tok'"):
        cluster_map.load(path, watch=False)


@pytest.fixture(scope="module")
def loopback_cluster(etcd: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """12 nodes of one host on loopback (2 slots a host cannot hold here: allowed with --max-slots-per-host)."""
    work = tmp_path_factory.mktemp("loop")
    done = init(
        etcd, work, "loop", "--hosts", "h=127.0.0.1", "--nodes-per-host", "12", "--max-slots-per-host", "12",
        "--capacity", "64MiB", "--data-root", str(work / "data"), "--base-port", str(free_run(1012)),
        "--lease-ttl", "2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    local = LocalCluster(work / "cluster.toml", host_id="h")
    with local:
        wait_for(lambda: all(n.state == "up" for n in local.config.nodes.values()), 30, "every node up")
        yield local


def test_a_killed_nodes_lease_lapses_and_it_is_marked_down_then_up_when_back(loopback_cluster: LocalCluster) -> None:
    local = loopback_cluster
    local.kill(3)
    wait_for(lambda: local.config.nodes[3].state == "down", 15, "node 3 marked down")
    with connect(local.config_path) as client:
        keys = [os.urandom(16) for _ in range(48)]
        primaries = Placement(local.config.groups).primaries(keys)
        data = [os.urandom(20_000) for _ in keys]
        stored = client.put(keys, data)
        assert stored == (primaries != 3).tolist()  # a block whose primary is down is refused, at once
        assert client.stats["refused_unavailable"] == int((primaries == 3).sum())
        assert client.get(keys) == [d if s else None for d, s in zip(data, stored, strict=True)]
    local.start([3])
    wait_for(lambda: local.config.nodes[3].state == "up", 15, "node 3 up again")


def test_a_node_whose_membership_key_is_lost_while_its_lease_lives_registers_again(
    loopback_cluster: LocalCluster,
) -> None:
    local, nid = loopback_cluster, 7
    feed = local.config.feed
    pid = local.procs[nid].pid
    key = feed.store.member_key(nid)
    feed.etcd.call(lambda c: c.delete(key))  # its lease still lives: only a check of the key itself notices
    wait_for(lambda: feed.members.get(nid, {}).get("pid") == pid, 10, f"node {nid} to register again")
    wait_for(lambda: local.config.nodes[nid].state == "up", 10, f"node {nid} up")


class LaggingFeed:
    """A feed whose watch has not delivered the newest map yet: it hands out ``stale`` until asked to refresh."""

    def __init__(self, real: cluster_map.MapFeed, stale: object) -> None:
        self.real, self.stale, self.asked = real, stale, []

    def latest(self) -> object:
        return self.stale if not self.asked else self.real.latest()

    def refresh(self, revision: int) -> None:
        self.asked.append(revision)


def test_a_client_on_an_older_map_refreshes_when_a_node_answers_on_a_newer_one(loopback_cluster: LocalCluster) -> None:
    with connect(loopback_cluster.config_path) as client:
        real = client.config.feed
        real.store.update(lambda d: d["ttl"].update(refresh=120.0) or True)
        wait_for(lambda: all(n.state == "up" for n in real.latest().nodes.values()), 10, "the edit to settle")
        newest = real.latest().revision
        stale = dataclasses.replace(client.config, revision=newest - 1)
        lagging = LaggingFeed(real, dataclasses.replace(stale, feed=None))
        client._adopt(dataclasses.replace(stale, feed=lagging))
        client.get([os.urandom(16)])  # the nodes answer on the newer map ...
        assert client.pool.seen_revision >= newest
        client.get([os.urandom(16)])  # ... so the next call asks for it, and adopts it
        assert lagging.asked and lagging.asked[0] >= newest
        assert client.config.revision >= newest and "refresh" in client.config.ttl_classes


def test_a_replacement_made_while_another_fills_does_not_keep_the_first_filling(
    loopback_cluster: LocalCluster,
) -> None:
    """Every peer runs one pass for the first replacement, then one for the second: the second pass's progress
    record must still say the first was covered, or the first stays ``filling`` (read around) for good."""
    local = loopback_cluster
    kvctl = [str(BIN / "kvctl"), "--config", str(local.config_path), "--json"]
    # beside the cluster's own data: the replacements serve the module's later tests (a passing test's tmp_path
    # is removed when it ends, under them)
    data_root = local.config_path.parent / "data"
    with connect(local.config_path) as client:
        feed = client.config.feed
        keys = [os.urandom(16) for _ in range(240)]
        data = [os.urandom(60_000) for _ in keys]
        assert all(client.put(keys, data))
        feed.store.update(lambda d: d["gc"].update(repair_bytes_per_s=400_000) or True)  # a pass takes seconds

        def replace(nid: int) -> str:
            local.kill(nid)
            run = subprocess.run(
                [*kvctl, "node", "replace", str(nid), "--host", "h", "--data-dir", str(data_root / f"new-{nid}")],
                capture_output=True,
                text=True,
            )
            assert run.returncode == 0, run.stderr
            wait_for(lambda: local.config.nodes[nid].filling, 10, f"node {nid} marked filling")
            local.start([nid])
            return str(json.loads(run.stdout)["filling"])

        def passes(token: str) -> list[dict[str, object]]:
            return [p for p in fill.read_progress(feed).values() if token in p.get("fills", [])]

        first = replace(4)
        wait_for(lambda: len(passes(first)) >= 6, 30, "the peers' passes for the first replacement to start")
        replace(5)
        try:
            wait_for(lambda: not any(n.filling for n in local.config.nodes.values()), 90, "both fills to complete")
        finally:
            feed.store.update(lambda d: d["gc"].pop("repair_bytes_per_s", None) is not None)
        assert client.get(keys) == data
        assert client.probe(keys).all()  # the replacements hold their shards again


def test_a_new_group_takes_its_share_of_blocks_by_repair_and_reads_stay_right(loopback_cluster: LocalCluster) -> None:
    local = loopback_cluster
    kvctl = [str(BIN / "kvctl"), "--config", str(local.config_path)]
    with connect(local.config_path) as client:
        keys = [os.urandom(16) for _ in range(96)]
        data = [os.urandom(12_000) for _ in keys]
        assert all(client.put(keys, data))
        run = subprocess.run([*kvctl, "host", "add", "h2", "127.0.0.1"], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        grown = subprocess.run(
            [*kvctl, "group", "add", "--hosts", "h2", "--nodes-per-host", "12", "--base-port", str(free_run(1012))],
            capture_output=True,
            text=True,
        )
        assert grown.returncode == 0, grown.stderr
        wait_for(lambda: len(client.placement.groups) == 2, 10, "the client to see the new group")
        assert client.get(keys) == data  # found where they were: the new group has nothing yet
        second = LocalCluster(local.config_path, host_id="h2")
        with second:
            feed = client.config.feed
            wait_for(lambda: not feed.latest().previous_groups, 120, "the growth's blocks to move")
            client.placement  # noqa: B018 - adopts the map without the old groups
            moved = Placement(client.config.groups).primaries(keys) >= 12
            assert 0 < moved.sum() < len(keys)  # the new group took its share, about half
            assert client.get(keys) == data
            assert client.probe(keys).all()  # all 12 shards of every block, where the map now puts them
            assert client.match(keys) == len(keys)
