"""Ports for servers the tools and tests start are picked below the kernel's ephemeral range, where no process's
outgoing connection can take one before the server binds it (``Address already in use`` for a test's
``kvtier-engine serve`` on a port that was, a moment later, another test's connection's local end)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.config import ConfigError
from kvtier.tools.benchutil import free_port


def ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def test_a_free_port_for_a_server_is_below_the_kernels_ephemeral_range() -> None:
    low, _ = ephemeral_range()
    assert all(free_port() < low for _ in range(50))


def test_a_clusters_free_ports_are_distinct_and_below_the_ephemeral_range() -> None:
    ports = cluster_mod.free_ports(24)
    assert len(set(ports)) == 24 and max(ports) < ephemeral_range()[0]


def test_free_ports_stay_within_the_range_this_process_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cluster_mod.PORT_RANGE_ENV, "21000-21100")
    assert all(21000 <= port < 21100 for port in cluster_mod.free_ports(40)) and 21000 <= free_port() < 21100


@pytest.mark.parametrize("given", ["21000", "21100-21000", "80-2000", "21000-21010", "a-b"])
def test_a_malformed_port_range_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, given: str) -> None:
    monkeypatch.setenv(cluster_mod.PORT_RANGE_ENV, given)
    with pytest.raises(ConfigError, match=f"KVTIER_PORT_RANGE='{given}' is no port range with room for 24"):
        cluster_mod.free_ports(24)


def test_a_range_with_no_free_port_left_is_an_error_not_a_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    held = socket.create_server(("127.0.0.1", 0))
    port = held.getsockname()[1]
    monkeypatch.setenv(cluster_mod.PORT_RANGE_ENV, f"{port}-{port + 1}")
    with held, pytest.raises(ConfigError, match=f"no 1 free ports between {port} and {port + 1}"):
        cluster_mod.free_ports(1)


def test_free_ports_within_a_range_given_by_the_caller_stay_in_it() -> None:
    low, _ = cluster_mod.port_range(1)
    assert all(low <= port < low + 100 for port in cluster_mod.free_ports(20, within=(low, low + 100)))
