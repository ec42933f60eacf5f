"""Helpers shared by kvtier's benchmarks: the raw loopback baseline, latency statistics, temporary clusters.

- :func:`raw_stream_gbps`: one raw loopback TCP stream of a given number of bytes (blocking ``sendall`` from a
  preallocated buffer in another process, ``recv_into`` a preallocated buffer here): the ceiling any Python
  client on this machine could reach, and the baseline every kvtier figure is reported against.
- :func:`latency_percentiles` and :func:`busy_seconds`: per-call latency percentiles and the time during which
  at least one call was in flight (the denominator of a throughput).
- :func:`temp_cluster`: a local cluster of real node processes in a temporary directory, stopped and removed
  on exit.
- :func:`free_port`: a loopback port the kernel hands out right now.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence

from kvtier.kvstore import cluster as cluster_mod
from kvtier.kvstore.local import LocalCluster

CHUNK = 4 << 20
ACCEPT_TIMEOUT_S = 60.0


def _raw_sender(port: int, total: int) -> None:
    buf = memoryview(bytearray(os.urandom(CHUNK)))
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sent = 0
        while sent < total:
            n = min(CHUNK, total - sent)
            s.sendall(buf[:n])
            sent += n


def raw_stream_gbps(total: int) -> float:
    """One loopback TCP stream of ``total`` bytes, sender in another process; GB/s seen by the receiver.

    The clock starts at the first bytes received, so process start-up is not counted. The sender is a fresh
    interpreter (not multiprocessing), so callers need no ``if __name__ == "__main__"`` guard.
    """
    if total <= 0:
        raise ValueError(f"a raw stream needs a positive number of bytes, got {total}")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(ACCEPT_TIMEOUT_S)
        port = listener.getsockname()[1]
        code = "import sys; from kvtier.tools.benchutil import _raw_sender as s; s(int(sys.argv[1]), int(sys.argv[2]))"
        proc = subprocess.Popen([sys.executable, "-c", code, str(port), str(total)], stdin=subprocess.DEVNULL)
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the raw stream's sender did not connect within {ACCEPT_TIMEOUT_S:.0f} s") from None
        conn.settimeout(None)
        buf = memoryview(bytearray(CHUNK))
        got = 0
        with conn:
            n = conn.recv_into(buf)
            start = time.perf_counter()
            got += n
            while got < total:
                n = conn.recv_into(buf)
                if n == 0:
                    break
                got += n
            elapsed = time.perf_counter() - start
        proc.wait()
    if got < total:
        raise RuntimeError(f"the raw stream's sender stopped after {got} of {total} bytes")
    return got / max(elapsed, 1e-9) / 1e9


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
    """A port the kernel hands out right now (another process may take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
    :class:`~kvtier.kvstore.local.NodeStartError` if a node fails to start.
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
