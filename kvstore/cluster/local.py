"""Running the nodes of a cluster on this machine, one process each (``kvstore serve``, tests, demo): the loopback
nodes of a cluster file, or the nodes the etcd map puts on this host (``host_id``); and resetting one whose data is
lost (``kvstore reset-node``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster import map as cluster_map
from kvtier.kvstore.cluster.children import Backoff, exit_reason
from kvtier.kvstore.cluster.config import LOCAL_HOSTS

NODE_ERROR_PREFIX = "kvstore node: "  # how a node process starts the one line it exits with (gc.nodeproc)
NEEDS_RESET_EXIT = 3  # a node's exit status when its metadata is damaged: only `kvstore reset-node` gets it going


READY_LIMIT = 20  # a node running all along but not ready after this many times ready_timeout_s is reported


class NodeStartError(RuntimeError):
    """A node process exited or stayed silent instead of reporting ready."""


class _Progress:
    """When a process last ran or waited to run: its threads' time on a core and in the run queue
    (``/proc/PID/task/*/schedstat``). Where that cannot be read, the time it was first asked stands."""

    def __init__(self, pid: int, now: float) -> None:
        self.tasks = Path(f"/proc/{pid}/task")
        self.seen = self._read()
        self.at = now

    def last(self, now: float) -> float:
        value = self._read()
        if value is not None and value != self.seen:
            self.seen, self.at = value, now
        return self.at

    def _read(self) -> int | None:
        total = 0
        try:
            for task in self.tasks.iterdir():
                with contextlib.suppress(FileNotFoundError):  # a thread that just ended
                    run_ns, wait_ns, _ = (task / "schedstat").read_text().split()
                    total += int(run_ns) + int(wait_ns)
        except (OSError, ValueError):
            return None
        return total


class LocalCluster:
    """Starts, stops, kills and restarts the local nodes of one cluster file. The nodes end with the process that
    started them, however it ends (a test killed by its timeout, a Ctrl-C'd benchmark): each node watches its stdin,
    a pipe from here that the kernel closes when this process dies, and stops when it ends."""

    def __init__(
        self,
        config_path: str | Path,
        ready_timeout_s: float = 30.0,
        host_id: str | None = None,
        etcd: str | None = None,
    ) -> None:
        """``host_id``: this host's name in the etcd map the cluster file names (its nodes are the local ones, and
        the map is followed: ``config`` is the newest); ``etcd`` overrides the file's etcd endpoints."""
        self.config_path = Path(config_path)
        self.host_id = host_id
        self.etcd = etcd
        self._config = cluster_map.load(self.config_path, etcd_endpoints=etcd, watch=host_id is not None)
        if host_id is not None and self._config.feed is None:
            raise cluster_mod.ConfigError(f"--host-id needs a cluster file that names etcd; {config_path} does not")
        self.ready_timeout_s = ready_timeout_s
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def config(self) -> cluster_mod.ClusterConfig:
        return self._config.feed.latest() if self._config.feed is not None else self._config

    @property
    def local_ids(self) -> list[int]:
        if self.host_id is not None:
            return sorted(nid for nid, n in self.config.nodes.items() if n.host_id == self.host_id)
        return sorted(nid for nid, n in self.config.nodes.items() if n.host in LOCAL_HOSTS)

    def log_path(self, node_id: int) -> Path:
        return self.config.nodes[node_id].data_dir / "node.log"

    def start(self, node_ids: list[int] | None = None) -> None:
        """Start nodes (default: every local one) and return once each has reported ready."""
        ids = self.local_ids if node_ids is None else node_ids
        for nid in ids:
            data_dir = self.config.nodes[nid].data_dir
            data_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_path(nid), "ab") as log, _own_stderr() as fallback:
                override = ["--etcd", self.etcd] if self.etcd else []
                # what the node's log (its disk full) cannot take goes to this process's stderr
                divert = ["--fallback-log-fd", str(fallback)] if fallback is not None else []
                argv = [str(self.config_path), str(nid), "--end-with-stdin", *override, *divert]
                self.procs[nid] = subprocess.Popen(
                    [sys.executable, "-m", "kvtier.gc.nodeproc", *argv],
                    stdout=subprocess.PIPE,
                    stderr=log,
                    stdin=subprocess.PIPE,  # its other end is held here until the node is stopped, or this process ends
                    pass_fds=(fallback,) if fallback is not None else (),
                )
        for nid in ids:
            self._await_ready(nid)

    def _await_ready(self, node_id: int) -> None:
        """Wait for the node's ready line while it gets somewhere: a node that has neither run nor waited to run for
        ``ready_timeout_s`` is stuck (a loaded machine starves a starting node, but it stays runnable), and one not
        ready after ``READY_LIMIT`` times that is reported however busy it was."""
        proc = self.procs[node_id]
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        buf = b""
        since = time.monotonic()
        progress = _Progress(proc.pid, since)
        while b"ready" not in buf:
            if proc.poll() is not None:
                raise NodeStartError(self._exit_reason(node_id, proc.returncode))
            now = time.monotonic()
            if now - progress.last(now) > self.ready_timeout_s:
                raise NodeStartError(
                    f"node {node_id} did not report ready: it has not run for {self.ready_timeout_s:g} s"
                    f" (log: {self.log_path(node_id)})"
                )
            if now - since > READY_LIMIT * self.ready_timeout_s:
                raise NodeStartError(f"node {node_id} did not report ready in {now - since:.0f} s of running")
            chunk = proc.stdout.read()
            if chunk:
                buf += chunk
            else:
                time.sleep(0.01)

    def _exit_reason(self, node_id: int, code: int) -> str:
        """One line on why a starting node exited: its own one-line error (``kvstore node: ...``, which names the
        node), or the last line it logged (a traceback's exception) with the log's path."""
        log = self.log_path(node_id)
        lines = log.read_text(errors="replace").strip().splitlines()
        last = lines[-1].strip() if lines else "nothing logged"
        if last.startswith(NODE_ERROR_PREFIX):
            return last.removeprefix(NODE_ERROR_PREFIX)
        return f"node {node_id} exited with code {code}: {last} (log: {log})"

    def kill(self, node_id: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to a node and wait for it to exit (SIGKILL: no clean-up happens)."""
        proc = self.procs.pop(node_id)
        proc.send_signal(sig)
        proc.wait()
        _close_pipes(proc)

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
            _close_pipes(proc)
        self.procs.clear()

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self._config.feed is not None:
            self._config.feed.close()


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    """Close this end of an exited node's stdin and stdout."""
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):  # (a write end whose reader is gone)
                pipe.close()


@contextlib.contextmanager
def _own_stderr() -> Iterator[int | None]:
    """A copy of this process's stderr descriptor for a child to inherit, closed here afterwards (None: it has no
    stderr)."""
    try:
        fd = os.dup(2)
    except OSError:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def reset_node(config_path: str | Path, node_id: int) -> Path:
    """Move a stopped node's data dir aside (renamed ``<dir>.aside-<time>``, nothing deleted) and give it an
    empty one: started again, the node rebuilds what it should hold from its peers (docs/design.md §6). For a
    node whose metadata is corrupt or whose disk was replaced. Returns where the old data went.

    Raises ConfigError (one line) for a node not in the file, one that is running (its port answers), or one
    with no data dir.
    """
    config = cluster_mod.load(config_path)
    node = config.nodes.get(node_id)
    if node is None:
        raise cluster_mod.ConfigError(f"node {node_id} is not in {config_path}")
    with contextlib.suppress(OSError), socket.create_connection((node.host, node.port), timeout=1):
        raise cluster_mod.ConfigError(
            f"node {node_id} is running (it answers on {node.host}:{node.port}); stop it first"
        )
    if not node.data_dir.is_dir():
        raise cluster_mod.ConfigError(f"node {node_id} has no data dir at {node.data_dir}")
    aside = node.data_dir.with_name(f"{node.data_dir.name}.aside-{time.strftime('%Y%m%d-%H%M%S')}")
    node.data_dir.rename(aside)
    node.data_dir.mkdir()
    return aside


def serve(config_path: str | Path, host_id: str | None = None, etcd: str | None = None) -> int:
    """``kvstore serve``: run every local node until SIGINT/SIGTERM, restarting any that exits on its own.

    A node that exits (a crash, a kill, a fatal error) is reported with its exit code and log, then restarted after
    a back-off: 1 s, doubling with each exit that follows a short run, up to 60 s; a node that stayed up
    ``STABLE_S`` starts from 1 s again. Every exit and restart is one line on stdout. With ``host_id`` (an etcd map)
    the map is followed: a node it moves to this host is started, one it moves away is stopped.
    """
    cluster = LocalCluster(config_path, host_id=host_id, etcd=etcd)
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
    where = f"host {host_id} of the etcd map" if host_id else f"cluster file {cluster.config_path}"
    print(f"all {len(ids)} nodes ready ({where}); Ctrl-C stops them", flush=True)
    if host_id and not ids:
        print(f"the map puts no node on host {host_id!r} yet: waiting for `kvctl node replace` or `group add`")
    supervisor = Supervisor(cluster)
    while not stopping:
        supervisor.check()
        if host_id is not None:
            _follow(cluster, supervisor)
        time.sleep(0.2)
    cluster.stop()
    print("all nodes stopped", flush=True)
    return 0


def _follow(cluster: LocalCluster, supervisor: Supervisor) -> None:
    """Start the nodes the map newly puts on this host, stop those it moved elsewhere (the supervisor restarts
    a node that fails to start, as any that exits)."""
    wanted = set(cluster.local_ids)
    for nid in sorted(set(cluster.procs) - wanted):
        print(f"node {nid} moved to another host: stopping it here", flush=True)
        supervisor.forget(nid)
        cluster.kill(nid, signal.SIGTERM)
    new = sorted(wanted - set(cluster.procs))
    if new:
        print(f"the map puts nodes {new} on this host: starting them", flush=True)
        supervisor.started_now(new)
        try:
            cluster.start(new)
        except NodeStartError as exc:
            print(f"kvstore serve: {exc}", file=sys.stderr, flush=True)


class Supervisor:
    """Restarts the nodes of a :class:`LocalCluster` that exit, with back-off (see :func:`serve`). A node that exits
    because its metadata is damaged (``NEEDS_RESET_EXIT``) is not restarted (it would fail the same way, again and
    again): it is said once, and the node starts again once ``kvstore reset-node`` has given it an empty data dir."""

    def __init__(self, cluster: LocalCluster, clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster = cluster
        self.clock = clock
        self.backoff = {nid: Backoff(clock) for nid in cluster.procs}  # node -> its restart back-off
        self.restart_at: dict[int, float] = {}  # nodes down, waiting to be restarted -> when
        self.held: set[int] = set()  # nodes whose metadata is damaged, until they are reset

    def check(self) -> None:
        """Notice nodes that exited and restart those whose wait is over; never raises for a node's failure."""
        now = self.clock()
        for nid, proc in list(self.cluster.procs.items()):
            if proc.poll() is not None and nid not in self.restart_at and nid not in self.held:
                self._exited(nid, proc.returncode, now)
        for nid in list(self.held):
            if not (self.cluster.config.nodes[nid].data_dir / "meta" / "data.mdb").exists():
                self.held.discard(nid)
                print(f"node {nid} has an empty data dir now (reset): starting it", flush=True)
                self._restart(nid)
        for nid, when in list(self.restart_at.items()):
            if now >= when:
                del self.restart_at[nid]
                self._restart(nid)

    def forget(self, nid: int) -> None:
        """``nid`` leaves this host (stopped on purpose): never restart it."""
        self.backoff.pop(nid, None)
        self.restart_at.pop(nid, None)

    def started_now(self, nids: list[int]) -> None:
        """``nids`` are being started (nodes new to this host)."""
        for nid in nids:
            self.backoff[nid] = Backoff(self.clock)

    def _exited(self, nid: int, code: int, now: float) -> None:
        if code == NEEDS_RESET_EXIT:
            self._hold(nid)
            return
        wait = self.backoff.setdefault(nid, Backoff(self.clock)).exited()
        self.restart_at[nid] = now + wait
        log = self.cluster.log_path(nid)
        print(f"node {nid} exited with code {code}: {exit_reason(code)} (log: {log}); restarting it in {wait:g} s")
        sys.stdout.flush()

    def _hold(self, nid: int) -> None:
        """``nid`` exited for damaged metadata: said once, not restarted until it is reset."""
        self.held.add(nid)
        print(f"node {nid} is not restarted: {self.cluster._exit_reason(nid, NEEDS_RESET_EXIT)}", flush=True)

    def _restart(self, nid: int) -> None:
        exited = self.cluster.procs.pop(nid)
        exited.wait()
        _close_pipes(exited)
        self.backoff[nid].started_now()
        try:
            self.cluster.start([nid])
        except NodeStartError as exc:  # exited again (the next check schedules another try) or not ready yet
            if self.cluster.procs[nid].poll() == NEEDS_RESET_EXIT:
                self._hold(nid)
            else:
                print(f"node {nid} did not restart: {exc}", flush=True)
            return
        print(f"node {nid} restarted (pid {self.cluster.procs[nid].pid})", flush=True)
