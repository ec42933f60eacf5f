"""Nodes on many hosts: real processes in network namespaces (one per host), a 3-member etcd, failures across a
network (a host killed, partitioned, slowed; the etcd leader killed).

Topology (one shared fixture for the module, torn down even when a test fails): storage hosts h0..h5 with two
nodes each (12 nodes, one placement group of 12 slots, two on each host: no host holds more than the 2 shards a
block can lose, docs/design.md §10), a spare host h6 with no nodes (replacements go there), etcd members on
e0..e2, clients on c0 and c1. Tests run in file order and each leaves the cluster serving.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dev.netns import NetCluster, Network, has_netem, netns_unavailable

STORAGE = [f"h{i}" for i in range(6)]
SPARE = "h6"
ELSEWHERE = "h7"  # where the partitioned host's nodes are moved
ETCD = ["e0", "e1", "e2"]
CLIENTS = ["c0", "c1"]
LEASE_TTL_S = 3.0
BLOCKS, SIZE = 48, 64 << 10


class Hosts(NetCluster):
    """The module's cluster (see the module docstring); a wait that times out fails the test."""

    def wait_map(self, condition: Any, timeout_s: float, what: str) -> float:
        try:
            return super().wait_map(condition, timeout_s, what)
        except TimeoutError as exc:
            pytest.fail(str(exc))

    def kvctl(self, *args: str, host: str | None = None) -> subprocess.CompletedProcess[str]:
        done = super().kvctl(*args, host=host)
        assert done.returncode == 0, done.stderr
        return done


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    why = netns_unavailable()
    if why is not None:
        pytest.skip(f"multi-host tests run hosts as network namespaces: {why}")
    work = tmp_path_factory.mktemp("multihost")
    with Network([*STORAGE, SPARE, ELSEWHERE, *ETCD, *CLIENTS]) as net:
        yield Hosts(net, work, STORAGE, ETCD, CLIENTS, spare=[SPARE, ELSEWHERE], lease_ttl_s=LEASE_TTL_S)


def test_a_client_on_another_host_reads_what_a_third_host_wrote(hosts: Hosts) -> None:
    written = hosts.drivers["c0"].ask("put", first=0, count=BLOCKS, size=SIZE)
    assert all(written["stored"])
    read = hosts.drivers["c1"].ask("get", first=0, count=BLOCKS, size=SIZE)
    assert (read["hits"], read["wrong"]) == (BLOCKS, 0)
    assert hosts.drivers["c1"].ask("probe", first=0, count=BLOCKS)["complete"] == BLOCKS


def test_reads_over_a_slow_link_return_within_the_timeout_using_parity(hosts: Hosts) -> None:
    hosts.net.limit("h3", "2mbit")  # h3's two nodes: ~2.4 s to send their shards of one read
    try:
        read = hosts.drivers["c1"].ask("get", first=0, count=BLOCKS, size=SIZE)
    finally:
        hosts.net.unlimit("h3")
    assert (read["hits"], read["wrong"]) == (BLOCKS, 0)
    assert read["s"] < 2.0  # the hedge (1 s) asked the parity holders instead of waiting for h3
    assert read["stats"]["degraded_reads"] > 0


@pytest.mark.skipif(not has_netem(), reason="this kernel has no netem: a link delay cannot be added")
def test_reads_over_a_delayed_link_return_within_the_timeout(hosts: Hosts) -> None:
    hosts.net.limit("h2", "10gbit", delay="1500ms")
    try:
        read = hosts.drivers["c1"].ask("get", first=0, count=BLOCKS, size=SIZE)
    finally:
        hosts.net.unlimit("h2")
    assert (read["hits"], read["wrong"]) == (BLOCKS, 0)
    assert read["s"] < 3.0


def test_a_partitioned_host_is_marked_down_and_rejoins_when_healed(hosts: Hosts) -> None:
    victims = hosts.nodes_on("h2")
    hosts.net.partition("h2")
    try:
        read = hosts.drivers["c0"].ask("get", first=0, count=BLOCKS, size=SIZE)  # the majority side serves
        assert (read["hits"], read["wrong"]) == (BLOCKS, 0)
        took = hosts.wait_map(lambda m: all(m["states"][v] == "down" for v in victims), 30, "h2's nodes down")
        assert took < 4 * LEASE_TTL_S
        read = hosts.drivers["c0"].ask("get", first=0, count=BLOCKS, size=SIZE)
        assert (read["hits"], read["wrong"]) == (BLOCKS, 0)
    finally:
        hosts.net.heal("h2")
    hosts.wait_map(lambda m: all(m["states"][v] == "up" for v in victims), 30, "h2's nodes back up")
    read = hosts.drivers["c1"].ask("get", first=0, count=BLOCKS, size=SIZE)
    assert (read["hits"], read["wrong"]) == (BLOCKS, 0)
    assert hosts.drivers["c1"].ask("probe", first=0, count=BLOCKS)["complete"] == BLOCKS


def test_nodes_moved_off_a_partitioned_host_stay_up_when_it_heals(hosts: Hosts) -> None:
    """Partition a host, wait until its nodes are marked down, move them onto another host as the docs say
    (``kvctl node replace``), wait for the fill, heal: the old processes find their nodes moved and stop without
    taking their membership back; the replacements stay up and every put stores all 12 shards."""
    victims = hosts.nodes_on("h4")
    hosts.net.partition("h4")
    try:
        hosts.wait_map(lambda m: all(m["states"][v] == "down" for v in victims), 30, "h4's nodes down")
        hosts.kvctl("host", "add", ELSEWHERE, hosts.net.addresses[ELSEWHERE])
        for nid in victims:
            hosts.kvctl(
                "node", "replace", nid, "--host", ELSEWHERE, "--data-dir", str(hosts.work / "data" / f"re-{nid}")
            )
        hosts.wait_map(lambda m: all(m["states"][v] == "up" for v in victims), 60, "the replacements up")
        hosts.wait_map(lambda m: not m["filling"], 120, "repair to fill the replacements")
    finally:
        hosts.net.heal("h4")
    for _ in range(int(4 * LEASE_TTL_S / 0.5)):  # long enough for a stolen membership key to lapse
        states = hosts.map()["states"]
        assert all(states[v] == "up" for v in victims), states
        time.sleep(0.5)
    put = hosts.drivers["c0"].ask("put", first=40_000, count=96, size=SIZE)
    assert all(put["stored"])
    assert hosts.drivers["c1"].ask("probe", first=40_000, count=96)["complete"] == 96


def etcd_leader(hosts: Hosts) -> str:
    code = (  # the test process reaches etcd only through a client host
        "from kvtier.kvstore.cluster.etcd import Etcd\n"
        f"e = Etcd({hosts.endpoints!r})\n"
        "s = e.call(lambda c: c.status())\n"
        "print(s.leader.client_urls[0])"
    )
    done = hosts.net.run("c0", [sys.executable, "-c", code])
    assert done.returncode == 0, done.stderr
    address = re.search(r"//([\d.]+):", done.stdout).group(1)  # type: ignore[union-attr]
    return next(h for h in ETCD if hosts.net.addresses[h] == address)


def test_killing_the_etcd_leader_during_writes_loses_no_map_revision(hosts: Hosts) -> None:
    leader = etcd_leader(hosts)
    before = hosts.drivers["c1"].ask("map")["revision"]
    writer = hosts.drivers["c0"]
    writer.send("put_for", seconds=6, size=4096, first=10_000)
    made = []
    for n, ttl in enumerate(["2d", "5d", "6d"]):
        if n == 1:
            hosts.net.kill_host(leader)
        done = hosts.kvctl("ttl", "set", "chatbot", ttl, "--json")
        made.append(json.loads(done.stdout)["revision"])
    written = writer.receive()
    assert written["stored"] == written["tried"] > 0  # the clients kept working on the map they had
    hosts.wait_map(lambda m: m["revision"] >= made[-1], 20, "the last edit at the client")
    for driver in hosts.drivers.values():
        revisions = driver.ask("map")["seen"]
        assert all(r in revisions for r in made), (made, revisions)  # every revision, none skipped
        assert revisions == sorted(revisions) and revisions[-1] >= made[-1] > before


def test_a_fetcher_hit_and_a_stateblock_pull_cross_hosts(hosts: Hosts) -> None:
    net, work = hosts.net, hosts.work
    fetcher = net.spawn(
        "c1",
        [
            sys.executable, "-m", "kvtier.transfer.fetcher", "--config", str(hosts.config), "--shm", f"{net.tag}-pool",
            "--size", "4MiB", "--slot-size", f"{SIZE}B", "--socket", str(work / "fetch.sock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert fetcher.stdout.readline().split()[0] == "ready"  # (the supervisor adds its server's pid)
    c1 = hosts.drivers["c1"]
    first = c1.ask("fetch", socket=str(work / "fetch.sock"), first=0, count=8, size=SIZE)
    assert first == {"statuses": ["FETCHED"] * 8, "wrong": 0}  # from the storage hosts, over the bridge
    again = c1.ask("fetch", socket=str(work / "fetch.sock"), first=0, count=8, size=SIZE)
    assert again == {"statuses": ["HIT"] * 8, "wrong": 0}  # from c1's own host memory

    directory = net.spawn(
        "c0",
        [
            sys.executable, "-m", "kvtier.transfer.directory", "--config", str(hosts.config),
            "--listen", f"{net.addresses['c0']}:0",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    where = directory.stdout.readline().split()[1]
    key = "5b" * 16
    put = hosts.drivers["c0"].ask("sb_put", key=key, seed=7, directory=where, listen=net.addresses["c0"], name="a")
    assert put == {"ok": True}
    pulled = c1.ask("sb_get", key=key, seed=7, directory=where, listen=net.addresses["c1"], name="b")
    assert pulled == {"hit": True, "right": True}  # c1 pulled it from c0's pool across the bridge


def test_killing_a_whole_host_keeps_every_block_readable_and_replacement_restores_redundancy(hosts: Hosts) -> None:
    victims = hosts.nodes_on("h1")
    hosts.net.kill_host("h1")
    read = hosts.drivers["c0"].ask("get", first=0, count=BLOCKS, size=SIZE)
    assert (read["hits"], read["wrong"]) == (BLOCKS, 0)
    hosts.wait_map(lambda m: all(m["states"][v] == "down" for v in victims), 30, "h1's nodes down")
    refused = hosts.drivers["c0"].ask("put", first=20_000, count=16, size=SIZE)
    assert not any(refused["stored"]) and refused["s"] < 5  # refused at once: only 10 of 12 nodes are up
    assert refused["stats"]["refused_unavailable"] >= 16

    hosts.kvctl("host", "add", SPARE, hosts.net.addresses[SPARE])
    for nid in victims:
        hosts.kvctl("node", "replace", nid, "--host", SPARE, "--data-dir", str(hosts.work / "data" / f"new-{nid}"))
    hosts.wait_map(lambda m: all(m["states"][v] == "up" for v in victims), 60, "the replacements up")
    read = hosts.drivers["c1"].ask("get", first=0, count=BLOCKS, size=SIZE)  # correct while they fill
    assert (read["hits"], read["wrong"]) == (BLOCKS, 0)
    hosts.wait_map(lambda m: not m["filling"], 120, "repair to fill the replacements")
    assert hosts.drivers["c1"].ask("probe", first=0, count=BLOCKS)["complete"] == BLOCKS
    assert all(hosts.drivers["c0"].ask("put", first=30_000, count=16, size=SIZE)["stored"])
