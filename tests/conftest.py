"""Shared fixtures: real local clusters of node processes in temporary directories."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.kvstore import cluster as cluster_mod
from kvtier.kvstore.local import LocalCluster

ClusterFactory = Callable[..., LocalCluster]


@pytest.fixture(scope="module")
def make_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterFactory]:
    """Start a 12-node cluster: ``make_cluster(capacity_bytes=..., extra_toml=...)``; stopped after the module."""
    started: list[LocalCluster] = []

    def factory(capacity_bytes: int = 256 << 20, extra_toml: str = "", nodes: int = 12, gc: str = "") -> LocalCluster:
        """``gc``: extra lines for the [gc] table; ``extra_toml``: more tables appended to the file."""
        directory = tmp_path_factory.mktemp("cluster")
        path = cluster_mod.write_default(directory, nodes=nodes, capacity_bytes=capacity_bytes)
        text = path.read_text().replace("[gc]\n", f"[gc]\n{gc}")
        path.write_text(text + ("\n" + extra_toml + "\n" if extra_toml else ""))
        local = LocalCluster(path)
        local.start()
        started.append(local)
        return local

    yield factory
    for local in started:
        local.stop()


def cluster_path(local: LocalCluster) -> Path:
    return local.config_path
