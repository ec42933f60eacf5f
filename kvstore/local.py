"""Running the nodes of a cluster file on this machine, one process each (``kvstore serve``, tests, demo)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvtier.kvstore import cluster as cluster_mod

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


class NodeStartError(RuntimeError):
    """A node process exited or stayed silent instead of reporting ready."""


class LocalCluster:
    """Starts, stops, kills and restarts the local nodes of one cluster file."""

    def __init__(self, config_path: str | Path, ready_timeout_s: float = 30.0) -> None:
        self.config_path = Path(config_path)
        self.config = cluster_mod.load(self.config_path)
        self.ready_timeout_s = ready_timeout_s
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def local_ids(self) -> list[int]:
        return sorted(nid for nid, n in self.config.nodes.items() if n.host in LOCAL_HOSTS)

    def log_path(self, node_id: int) -> Path:
        return self.config.nodes[node_id].data_dir / "node.log"

    def start(self, node_ids: list[int] | None = None) -> None:
        """Start nodes (default: every local one) and return once each has reported ready."""
        ids = self.local_ids if node_ids is None else node_ids
        for nid in ids:
            data_dir = self.config.nodes[nid].data_dir
            data_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_path(nid), "ab") as log:
                self.procs[nid] = subprocess.Popen(
                    [sys.executable, "-m", "kvtier.gc.nodeproc", str(self.config_path), str(nid)],
                    stdout=subprocess.PIPE,
                    stderr=log,
                    stdin=subprocess.DEVNULL,
                )
        deadline = time.monotonic() + self.ready_timeout_s
        for nid in ids:
            self._await_ready(nid, deadline)

    def _await_ready(self, node_id: int, deadline: float) -> None:
        proc = self.procs[node_id]
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        buf = b""
        while b"ready" not in buf:
            if proc.poll() is not None:
                tail = self.log_path(node_id).read_text(errors="replace").strip().splitlines()[-3:]
                raise NodeStartError(f"node {node_id} exited with code {proc.returncode}: {' | '.join(tail)}")
            if time.monotonic() > deadline:
                raise NodeStartError(f"node {node_id} did not report ready in {self.ready_timeout_s:.0f}s")
            chunk = proc.stdout.read()
            if chunk:
                buf += chunk
            else:
                time.sleep(0.01)

    def kill(self, node_id: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to a node and wait for it to exit (SIGKILL: no clean-up happens)."""
        proc = self.procs.pop(node_id)
        proc.send_signal(sig)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    def restart(self, node_id: int) -> None:
        if node_id in self.procs:
            self.kill(node_id, signal.SIGTERM)
        self.start([node_id])

    def alive(self) -> list[int]:
        return sorted(nid for nid, p in self.procs.items() if p.poll() is None)

    def stop(self) -> None:
        """SIGTERM every node, then SIGKILL whatever is still running after 10 s."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.procs.clear()

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(config_path: str | Path) -> int:
    """``kvstore serve``: run every local node until SIGINT/SIGTERM; report nodes that exit on their own."""
    cluster = LocalCluster(config_path)
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster.start()
    except NodeStartError as exc:
        cluster.stop()
        print(f"kvstore serve: {exc}", file=sys.stderr)
        return 1
    ids = cluster.local_ids
    print(f"all {len(ids)} nodes ready (cluster file {cluster.config_path}); Ctrl-C stops them", flush=True)
    reported: set[int] = set()
    while not stopping:
        for nid, proc in list(cluster.procs.items()):
            if proc.poll() is not None and nid not in reported:
                reported.add(nid)
                print(f"node {nid} exited with code {proc.returncode} (log: {cluster.log_path(nid)})", flush=True)
        time.sleep(0.2)
    cluster.stop()
    print("all nodes stopped", flush=True)
    return 0
