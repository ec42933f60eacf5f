"""How long a local cluster waits for a starting node: as long as the node is getting somewhere (running, or
runnable and waiting for a core of a loaded machine), and ``ready_timeout_s`` once it is not."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.local import LocalCluster, NodeStartError

# run by every Python process started while it is on PYTHONPATH (``site`` imports it), before the node's own code
BUSY = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"
ASLEEP = "import time\ntime.sleep({s})\n"


def start_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prelude: str, ready_timeout_s: float, path: Path | None = None
) -> None:
    """Start node 0 of a new cluster (or of ``path``), every Python process first running ``prelude``."""
    path = path or cluster_mod.write_default(tmp_path / "cluster", capacity_bytes=64 << 20)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(prelude)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    local = LocalCluster(path, ready_timeout_s=ready_timeout_s)
    try:
        local.start([0])
    finally:
        local.stop()


def test_a_node_that_runs_for_longer_than_the_ready_timeout_is_waited_for(tmp_path, monkeypatch) -> None:
    """A node starved on a loaded machine takes minutes of wall time to start, but runs or waits to run all along
    (what ``ready_timeout_s`` of wall time failed for: "node 0 did not report ready in 30s" at load 40)."""
    start_node(tmp_path, monkeypatch, BUSY.format(s=4), ready_timeout_s=1)


def test_a_node_that_gets_nowhere_is_reported_after_the_ready_timeout(tmp_path, monkeypatch) -> None:
    started = time.monotonic()
    with pytest.raises(NodeStartError, match=r"node 0 did not report ready: it has not run for 2 s"):
        start_node(tmp_path, monkeypatch, ASLEEP.format(s=600), ready_timeout_s=2)
    assert time.monotonic() - started < 60


def test_a_node_whose_port_is_taken_once_it_runs_exits_with_that_error(tmp_path, monkeypatch) -> None:
    """The thread that watches a node's stdin held the buffered stdin's lock, so a node that could not bind its
    metrics port (taken after the cluster file was written) aborted at interpreter shutdown (exit -6, "<no Python
    frame>"), and a test's retry on fresh ports never saw the bind error it retries on."""
    path = cluster_mod.write_default(tmp_path / "cluster", capacity_bytes=64 << 20)
    node = cluster_mod.load(path).nodes[0]
    taken = f"import socket\nTAKEN = socket.create_server(({node.metrics_host!r}, {node.metrics_port}))\n"
    with pytest.raises(NodeStartError, match=r"node 0 cannot start: .*Address already in use"):
        start_node(tmp_path, monkeypatch, taken, ready_timeout_s=30, path=path)
