"""Helpers shared by kvtier's benchmarks: the raw loopback baseline, latency statistics, temporary clusters.

- :func:`raw_stream_gbps`: one raw loopback TCP stream of a given number of bytes (blocking ``sendall`` from a
  preallocated buffer in another process, ``recv_into`` a preallocated buffer here): the ceiling any Python
  client on this machine could reach, and the baseline every kvtier figure is reported against.
- :func:`latency_percentiles` and :func:`busy_seconds`: per-call latency percentiles and the time during which
  at least one call was in flight (the denominator of a throughput).
- :func:`temp_cluster`: a local cluster of real node processes in a temporary directory, stopped and removed
  on exit.
- :func:`free_port`: a loopback port the kernel hands out right now.
- :func:`memory_free_bytes` and :func:`page_cache_filled`: the machine's free memory, and a way to fill it with
  clean page cache for the length of a run, as on a storage host that has been up for a while.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.local import LocalCluster

T = TypeVar("T")

CHUNK = 4 << 20
ACCEPT_TIMEOUT_S = 60.0


def _raw_sender(address: str, total: int) -> None:
    """Send ``total`` bytes to ``address``: a loopback TCP port, or a Unix socket's path."""
    buf = memoryview(bytearray(os.urandom(CHUNK)))
    if address.isdigit():
        s = socket.create_connection(("127.0.0.1", int(address)))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    else:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(address)
    with s:
        sent = 0
        while sent < total:
            n = min(CHUNK, total - sent)
            s.sendall(buf[:n])
            sent += n


def raw_stream_gbps(total: int, unix: bool = False) -> float:
    """One loopback TCP stream of ``total`` bytes (``unix``: a Unix stream socket, how a client reaches the nodes
    of its own machine), sender in another process; GB/s seen by the receiver.

    The clock starts at the first bytes received, so process start-up is not counted. The sender is a fresh
    interpreter (not multiprocessing), so callers need no ``if __name__ == "__main__"`` guard.
    """
    return raw_streams_gbps(total, 1, unix)


def raw_streams_gbps(total: int, streams: int, unix: bool = False) -> float:
    """``streams`` loopback TCP (``unix``: Unix) streams at once carrying ``total`` bytes between them, each from
    its own sender process into its own receiving thread here (``recv_into`` releases the GIL); GB/s over all of
    them, from the first bytes received to the last. One stream is :func:`raw_stream_gbps`."""
    if total <= 0 or streams < 1:
        raise ValueError(f"raw streams need positive bytes and streams, got {total} bytes, {streams} streams")
    shares = [total // streams + (i < total % streams) for i in range(streams)]
    with contextlib.ExitStack() as stack:
        if unix:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-raw-"))
            address = os.path.join(folder, "raw.sock")
            listener = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            listener.bind(address)
            listener.listen(streams)
        else:
            listener = stack.enter_context(socket.create_server(("127.0.0.1", 0), backlog=streams))
            address = str(listener.getsockname()[1])
        listener.settimeout(ACCEPT_TIMEOUT_S)
        code = "import sys; from kvtier.tools.benchutil import _raw_sender as s; s(sys.argv[1], int(sys.argv[2]))"
        procs = [
            subprocess.Popen([sys.executable, "-c", code, address, str(share)], stdin=subprocess.DEVNULL)
            for share in shares
        ]
        conns = []
        try:
            for _ in procs:
                conns.append(listener.accept()[0])
        except TimeoutError:
            for proc in procs:
                proc.kill()
                proc.wait()
            raise RuntimeError(f"the raw streams' senders did not connect within {ACCEPT_TIMEOUT_S:.0f} s") from None
        got = [0] * streams
        first: list[float] = []
        threads = [threading.Thread(target=_raw_receive, args=(c, got, i, first)) for i, c in enumerate(conns)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - min(first, default=time.perf_counter())
        for proc in procs:
            proc.wait()
    if sum(got) < total:
        raise RuntimeError(f"the raw streams' senders stopped after {sum(got)} of {total} bytes")
    return total / max(elapsed, 1e-9) / 1e9


def _raw_receive(conn: socket.socket, got: list[int], i: int, first: list[float]) -> None:
    """Receive one raw stream to its end into a buffer of its own; the time of its first bytes into ``first``."""
    conn.settimeout(None)
    buf = memoryview(bytearray(CHUNK))
    with conn:
        n = conn.recv_into(buf)
        first.append(time.perf_counter())
        while n:
            got[i] += n
            n = conn.recv_into(buf)


class CpuMeter:
    """CPU seconds (user + system) used by this process and the cluster's node processes: on a shared machine a
    truer cost than wall time, since the store's throughput on two idle cores is about 2 / (CPU s per GB).

    Node time is summed over every thread from ``/proc/PID/task/TID/schedstat`` (nanoseconds): ``/proc/PID/stat``
    counts in 10 ms ticks, which over 12 nodes is an error of up to 0.12 s on a 30 ms round. A thread that exits
    between two readings loses its time since the first (the nodes' threads live as long as their connections).
    """

    def __init__(self, node_pids: list[int]) -> None:
        self.node_pids = node_pids
        self._seen: dict[tuple[int, int], int] = {}  # (pid, tid) -> ns on CPU at the last reading
        self._nodes_ns = 0

    def read(self) -> float:
        for pid in self.node_pids:
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        ns = int(f.read().split()[0])
                except (FileNotFoundError, ProcessLookupError):
                    continue  # the thread exited meanwhile
                key = (pid, int(tid))
                self._nodes_ns += ns - self._seen.get(key, 0)
                self._seen[key] = ns
        return time.process_time() + self._nodes_ns / 1e9

    def timed(self, call: Callable[[], T]) -> tuple[T, float, float]:
        """``call()``'s result, its wall seconds, and the CPU seconds this process and the nodes spent on it."""
        cpu, start = self.read(), time.perf_counter()
        result = call()
        return result, time.perf_counter() - start, self.read() - cpu


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0 < q <= 100) of already sorted values; NaN when there are none."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(round(q * len(sorted_values) / 100.0, 9)))  # round: 99.9 % of 1000 is 999, not 1000
    return sorted_values[min(rank, len(sorted_values)) - 1]


def latency_percentiles(seconds: Iterable[float]) -> dict[str, float]:
    """p50, p99 and p999 (nearest rank) of per-call latencies given in seconds, in milliseconds.

    With fewer than 1,000 calls p999 is the slowest call; with fewer than 100, so is p99.
    """
    values = sorted(seconds)
    return {
        "p50": percentile(values, 50) * 1e3,
        "p99": percentile(values, 99) * 1e3,
        "p999": percentile(values, 99.9) * 1e3,
    }


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: the time during which at least one call was in flight."""
    total = 0.0
    cur_start = cur_end = None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start  # type: ignore[operator]
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
    if cur_end is not None:
        total += cur_end - cur_start  # type: ignore[operator]
    return total


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now, below the kernel's ephemeral range (``cluster_mod.free_ports``): another process may
    still bind it first, but no process's outgoing connection takes it (a port the kernel handed out for the asking
    was the local end of another test's connection before the server that was to listen on it started)."""
    return cluster_mod.free_ports(1, host)[0]


def start_serve(
    options: Sequence[str], prog: str, timeout_s: float = 600, stdout: Any = None
) -> tuple[subprocess.Popen, str]:
    """``kvtier-engine serve`` on a free port with ``options``, once its ``/health`` answers 200: (process, base
    URL). SystemExit naming ``prog`` if it exits or is not healthy within ``timeout_s`` (it is then stopped)."""
    import urllib.request

    port = free_port()
    argv = [sys.executable, "-m", "kvtier.serving.cli", "serve", "--port", str(port), *options]
    proc = subprocess.Popen(argv, stdout=stdout)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{prog}: the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit(f"{prog}: the server did not become healthy in {timeout_s:.0f} s")


def memory_free_bytes() -> int:
    """``MemFree`` of ``/proc/meminfo`` in bytes (0 where there is no such file)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemFree:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


FILL_CHUNK = 8 << 20
FILL_DISK_RESERVE = 4 << 30  # disk space a fill never takes
REREAD_S = 30.0  # a fill is read whole again at most this often (DAMON pages out what sat idle for 60 s)


class PageCacheFill:
    """An unlinked file whose pages are kept in the page cache: see :func:`page_cache_filled`."""

    def __init__(self, fd: int, leave_free: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.fd = fd
        self.leave_free = leave_free
        self.bytes = 0
        self.clock = clock
        self._read_at = -REREAD_S  # when the whole file was last read
        self._chunk = bytearray(FILL_CHUNK)

    def refresh(self) -> int:
        """Grow the file until only about ``leave_free`` bytes of memory are free (reading what it adds, so the
        new pages are cached), and read all of it again once ``REREAD_S`` have passed since the last time: its
        pages count as recently used before an idle-page reclaimer could take them, and pages the kernel
        dropped come back. Returns the bytes cached. Reading 20 GiB takes tens of seconds and sweeps the CPU
        caches, so it is not done between measurements that follow each other closely."""
        stat = os.fstatvfs(self.fd)
        room = stat.f_bavail * stat.f_frsize - FILL_DISK_RESERVE
        grow = min(memory_free_bytes() - self.leave_free, room) // FILL_CHUNK * FILL_CHUNK
        start = self.bytes
        if grow > 0:
            os.posix_fallocate(self.fd, self.bytes, grow)
            self.bytes += grow
        if self.clock() - self._read_at >= REREAD_S:
            start, self._read_at = 0, self.clock()
        for offset in range(start, self.bytes, FILL_CHUNK):
            os.preadv(self.fd, [self._chunk], offset)
        return self.bytes


@contextlib.contextmanager
def page_cache_filled(directory: str, leave_free: int = 2 << 30) -> Iterator[PageCacheFill]:
    """Fill free memory with clean page cache, down to about ``leave_free`` bytes, until the block exits.

    Why: a virtual machine whose balloon driver reports free pages to its host (``virtio_balloon`` free page
    reporting) pays a host fault the first time a page that sat free is touched. A page-cache write into such
    memory runs at a fraction of memory speed, so a put into an empty cluster on a freshly booted VM measures
    the hypervisor. A storage host that has been up for a while has its memory full of page cache, and new pages
    come from reclaim, already touched. This makes that state: an unlinked file in ``directory``, allocated with
    ``posix_fallocate`` (no data is written) and read, so its pages are cached and clean; closing it at the end
    frees them, and the file never outlives the process. A VM that also pages out idle memory (DAMON
    ``pageout``) drops such pages after a minute unused: call :meth:`PageCacheFill.refresh` between measurements.
    Fills less where the file system has less room, and nothing where memory is already short of free pages.
    """
    fd, path = tempfile.mkstemp(dir=directory, prefix="kvtier-page-cache-fill-")
    try:
        os.unlink(path)
        fill = PageCacheFill(fd, leave_free)
        fill.refresh()
        yield fill
    finally:
        os.close(fd)


@contextlib.contextmanager
def temp_cluster(
    nodes: int = 12,
    capacity_bytes: int = 2 << 30,
    grace_s: float | None = None,
    extra_toml: str = "",
    prefix: str = "kvtier-bench-",
) -> Iterator[LocalCluster]:
    """A local cluster of ``nodes`` node processes in a fresh temporary directory, started and ready.

    ``grace_s`` sets ``[gc] grace_s``: how soon a deleted block's slots are reused (a short grace lets a benchmark
    write into slots it freed, the steady state of a full cache). ``extra_toml`` is appended to the cluster file.
    On exit every node is stopped (SIGTERM, then SIGKILL) and the directory removed. Raises
    :class:`~kvtier.kvstore.cluster.local.NodeStartError` if a node fails to start.
    """
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        path = cluster_mod.write_default(tmp, nodes=nodes, capacity_bytes=capacity_bytes, metrics=False)
        if grace_s is not None:
            path.write_text(path.read_text().replace("[gc]\n", f"[gc]\ngrace_s = {float(grace_s)}\n", 1))
        if extra_toml:
            path.write_text(path.read_text() + "\n" + extra_toml + "\n")
        local = LocalCluster(path)
        try:
            local.start()
            yield local
        finally:
            local.stop()
