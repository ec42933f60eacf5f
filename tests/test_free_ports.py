"""Ports for servers the tools and tests start are picked below the kernel's ephemeral range, where no process's
outgoing connection can take one before the server binds it (``Address already in use`` for a test's
``kvtier-engine serve`` on a port that was, a moment later, another test's connection's local end)."""

from __future__ import annotations

from pathlib import Path

from kvtier.kvstore.cluster import config as cluster_mod
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
