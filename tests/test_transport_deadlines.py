"""Hung nodes (stopped, connections open but never answering) cost a client one deadline, not one per exchange or
per node: what lets the engine adapters promise an answer within their ``timeout_s``."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Iterator

import pytest

from kvtier.kvstore.client import Client
from kvtier.kvstore.cluster.local import LocalCluster

OP_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def cluster(make_cluster) -> LocalCluster:
    return make_cluster(capacity_bytes=32 << 20)


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[Client]:
    settings = dataclasses.replace(
        cluster.config.client,
        op_timeout_s=OP_TIMEOUT_S,
        connect_timeout_s=OP_TIMEOUT_S,
        retry_down_after_s=60.0,  # the back-off outlasts a loaded machine's pauses between the test's calls
    )
    with Client(dataclasses.replace(cluster.config, client=settings)) as made:
        yield made


def stopped(cluster: LocalCluster, node_ids: list[int]):
    class Stopped:
        def __enter__(self) -> None:
            for nid in node_ids:
                cluster.procs[nid].send_signal(signal.SIGSTOP)

        def __exit__(self, *exc: object) -> None:
            for nid in node_ids:
                cluster.procs[nid].send_signal(signal.SIGCONT)

    return Stopped()


def test_a_node_that_missed_a_deadline_is_skipped_by_the_next_calls(cluster: LocalCluster, client: Client) -> None:
    keys = [os.urandom(16) for _ in range(24)]
    assert all(client.put(keys, [os.urandom(4096) for _ in keys]))
    with stopped(cluster, [0]):
        client.exists(keys)  # node 0 is the primary of some keys: this call waits out its deadline
        started = time.monotonic()
        assert client.get_into(keys, [bytearray(4096) for _ in keys]) == [True] * len(keys)
        assert time.monotonic() - started < OP_TIMEOUT_S  # node 0 is not asked (or reconnected to) again


def test_connecting_to_many_hung_nodes_takes_one_connect_timeout(cluster: LocalCluster, client: Client) -> None:
    client.pool.close()  # no connection open: the next call must connect to every node
    with stopped(cluster, sorted(cluster.procs)):
        started = time.monotonic()
        client.pool.connect()
        assert time.monotonic() - started < 3 * OP_TIMEOUT_S  # not 12 connect timeouts one after the other
    assert all(conn.sock is None for conn in client.pool.conns.values())


def test_nodes_stopped_and_continued_with_connections_waiting_exit_at_once_on_sigterm(make_cluster) -> None:
    local = make_cluster()
    with Client(local.config) as client:
        client.pool.close()
        for proc in local.procs.values():
            proc.send_signal(signal.SIGSTOP)
        client.pool.connect()  # connections wait in the stopped nodes' backlogs, then threads serve them
        for proc in local.procs.values():
            proc.send_signal(signal.SIGCONT)
    for proc in local.procs.values():  # the kernel may hand SIGTERM to any of a node's threads
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    for proc in local.procs.values():
        proc.wait(max(0.1, deadline - time.monotonic()))  # TimeoutExpired: a node did not stop
