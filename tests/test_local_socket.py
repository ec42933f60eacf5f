"""Nodes on the client's machine are reached through the Unix socket in their data dir, not loopback TCP."""

from __future__ import annotations

import os
import socket
import stat
from dataclasses import replace

import pytest

from kvtier.kvstore.client import Client
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.kvstore.wire.transport import AuthError


@pytest.fixture(scope="module")
def store(make_cluster) -> LocalCluster:
    return make_cluster()


def families(client: Client) -> set[int]:
    return {conn.sock.family for conn in client.pool.conns.values() if conn.sock is not None}


def test_a_client_on_the_nodes_machine_talks_to_them_over_their_unix_sockets(store: LocalCluster) -> None:
    keys, blocks = [os.urandom(16) for _ in range(8)], [os.urandom(50_000) for _ in range(8)]
    with Client(store.config) as client:
        assert all(client.put(keys, blocks)) and client.get(keys) == blocks
        assert families(client) == {socket.AF_UNIX}
    for node in store.config.nodes.values():
        assert node.local_socket is not None
        mode = node.local_socket.stat().st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) & 0o077 == 0  # for the node's user only


def test_the_unix_socket_authenticates_like_the_tcp_port(store: LocalCluster) -> None:
    with pytest.raises(AuthError), Client(store.config, token="x" * 64) as intruder:
        intruder.match([os.urandom(16)])


def test_a_node_without_a_unix_socket_here_is_reached_by_tcp(store: LocalCluster) -> None:
    nodes = {nid: replace(n, data_dir=store.config_path.parent / "elsewhere") for nid, n in store.config.nodes.items()}
    with Client(replace(store.config, nodes=nodes)) as client:
        keys = [os.urandom(16)]
        assert client.put(keys, [b"tcp" * 1000]) == [True]
        assert families(client) == {socket.AF_INET}


def test_a_node_killed_and_restarted_replaces_the_socket_it_left_behind(make_cluster) -> None:
    local = make_cluster()
    path = local.config.nodes[5].local_socket
    assert path is not None
    local.kill(5)
    assert path.exists()  # SIGKILL: nothing was cleaned up
    local.start([5])
    with Client(local.config) as client:
        assert client.node_info([5])[5].get("error") is None
        assert client.pool.conns[5].sock.family == socket.AF_UNIX
