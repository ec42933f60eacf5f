"""Children that must not outlive the process that started them (the serving front door's StateBlock directory, a
local cluster's nodes)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from .conftest import wait_for

PARENT = textwrap.dedent(
    """
    import sys, time
    from kvtier.engine.worker import WorkerProcess
    # a child that prints a ready line and never reads its stdin, as the StateBlock directory does
    child = WorkerProcess([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(600)"],
                          with_parent=sys.argv[1] == "1").wait_ready()
    print(child.proc.pid, flush=True)
    time.sleep(600)
    """
)


def _child_of_killed_parent(with_parent: bool) -> int:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(int(with_parent))], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)  # no finally block, no signal handler runs
    parent.wait()
    return child


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_child_started_with_its_parent_ends_when_the_parent_is_killed() -> None:
    child = _child_of_killed_parent(with_parent=True)
    wait_for(lambda: not _alive(child), 10, "the child to end with its parent")


def test_a_child_started_without_it_outlives_a_killed_parent() -> None:  # what the serving directory did
    child = _child_of_killed_parent(with_parent=False)
    try:
        assert _alive(child)
    finally:
        os.kill(child, signal.SIGKILL)


CLUSTER_PARENT = textwrap.dedent(
    """
    import sys, time
    from kvtier.kvstore.cluster import config
    from kvtier.kvstore.cluster.local import LocalCluster
    local = LocalCluster(config.write_default(sys.argv[1], capacity_bytes=64 << 20))
    local.start([0, 1])
    print(*(proc.pid for proc in local.procs.values()), flush=True)
    time.sleep(600)
    """
)


def test_the_nodes_of_a_local_cluster_end_when_the_process_that_started_them_is_killed(tmp_path: Path) -> None:
    """A test killed by its timeout, or a Ctrl-C'd benchmark, leaves no node running on as an orphan."""
    parent = subprocess.Popen([sys.executable, "-c", CLUSTER_PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    nodes = [int(pid) for pid in parent.stdout.readline().split()]
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    try:
        assert len(nodes) == 2
        wait_for(lambda: not any(map(_alive, nodes)), 30, "the nodes to end with the process that started them")
    finally:
        for pid in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
