"""``kvbench stateblock``: pulling a StateBlock from another host process, against a raw TCP round trip.

    kvbench stateblock [--layers 20] [--bytes-per-token 528] [--window 128] [--iterations N] [--rounds R] [--json]

Processes, all on loopback: a ``kvtier-directory``; host A (its own process: a StateBlockHost holding one
StateBlock of ``layers × (window + 6) × bytes_per_token`` bytes, DeepSeek's 1,415,040 by default); a raw server
(its own process: answers each 16-byte request with a frame head and the StateBlock's bytes from a preallocated
buffer, one blocking ``sendmsg``, as the StateBlock server); and this process as host B. Per round, ``N`` times,
interleaved:

1. *raw*: one round trip to the raw server over a blocking TCP_NODELAY socket, the head and the bytes received
   with one ``recvmsg_into(..., MSG_WAITALL)`` into the same preallocated buffer (the best a socket does: the
   baseline);
2. *pull*: ``Puller.pull_into``: the StateBlock from host A, naming its slot and generation, straight into a
   preallocated buffer;
3. *get*: ``StateBlockHost.get_into`` on host B: directory lookup, then the pull.

Every answer of all three is compared with the StateBlock (outside the timed part). Reports p50/p99 of each (all
rounds) and ``pull_vs_raw_p50`` (target ≤ 2).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster import map as cluster_map
from kvtier.kvstore.wire.protocol import HEADER
from kvtier.kvstore.wire.sockio import sendmsg_all
from kvtier.tools.benchutil import latency_percentiles
from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvbench.common import BenchError, UsageError, VerifyError
from kvtier.transfer.state_protocol import Location
from kvtier.transfer.stateblock import StateBlockHost, stateblock_bytes

REQUEST = 16


def register(commands: Subcommands) -> None:
    p = commands.add("stateblock", "StateBlock pulls between host processes, against a raw TCP round trip", run)
    p.add_argument("--layers", type=int, default=20, help="sliding-window layers (default 20)")
    p.add_argument("--bytes-per-token", type=int, default=528, help="state bytes per token and layer (default 528)")
    p.add_argument("--window", type=int, default=128, help="sliding window (default 128)")
    p.add_argument("--iterations", type=int, default=100, help="pulls per round (default 100)")
    p.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    if min(args.layers, args.bytes_per_token, args.window, args.iterations, args.rounds) <= 0:
        raise UsageError("--layers, --bytes-per-token, --window, --iterations and --rounds must be positive")
    size = stateblock_bytes(args.layers, args.bytes_per_token, args.window)
    with tempfile.TemporaryDirectory(prefix="kvbench-sb-") as tmp:
        config = cluster_mod.load(cluster_mod.write_default(tmp, metrics=False))
        result = _bench(config, size, args)
    print(json.dumps(result, indent=2) if args.json else _text(result))
    return 0


def _child(function: str, *argv: object) -> subprocess.Popen[str]:
    code = f"import sys; from kvtier.tools.kvbench.stateblock import {function} as f; f(*sys.argv[1:])"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *map(str, argv)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    return proc


def _ready(proc: subprocess.Popen[str], what: str) -> list[str]:
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    if not line:
        raise BenchError(f"{what} did not start (exit status {proc.poll()})")
    return line


def _bench(config: cluster_mod.ClusterConfig, size: int, args: argparse.Namespace) -> dict[str, Any]:
    assert config.path is not None
    procs = [
        _child("_directory", config.path),
        _child("_raw_server", size),  # the same bytes as host A's StateBlock: each answer is verified
    ]
    try:
        dir_port = int(_ready(procs[0], "the directory")[1].rsplit(":", 1)[1])
        raw_port = int(_ready(procs[1], "the raw server")[0])
        procs.append(_child("_host_a", config.path, size, dir_port))
        host, port, slot, gen, key_hex = _ready(procs[2], "host A")
        location, key = Location((host, int(port)), int(slot), int(gen)), bytes.fromhex(key_hex)
        expected = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
        shm = f"kvbench-sb-{os.getpid()}-{secrets.token_hex(4)}"
        with (
            StateBlockHost(config, shm, size, size, "host-b", directory=("127.0.0.1", dir_port)) as host_b,
            socket.create_connection(("127.0.0.1", raw_port)) as raw,
        ):
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            samples = _measure(raw, host_b, location, key, size, expected, args)
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    stats = {name: latency_percentiles(values) for name, values in samples.items()}
    return {
        "command": "stateblock",
        "settings": {"stateblock_bytes": size, "iterations": args.iterations, "rounds": args.rounds},
        "raw_ms": stats["raw"],
        "pull_ms": stats["pull"],
        "get_ms": stats["get"],
        "pull_vs_raw_p50": stats["pull"]["p50"] / stats["raw"]["p50"],
        "get_vs_raw_p50": stats["get"]["p50"] / stats["raw"]["p50"],
    }


def _measure(
    raw: socket.socket,
    host_b: StateBlockHost,
    location: Location,
    key: bytes,
    size: int,
    expected: np.ndarray,
    args: argparse.Namespace,
) -> dict[str, list[float]]:
    out = np.empty(size, np.uint8)
    view = memoryview(out)
    head = memoryview(bytearray(HEADER.size))
    request = bytes(REQUEST)
    samples: dict[str, list[float]] = {"raw": [], "pull": [], "get": []}

    def check(name: str, ok: bool) -> None:
        if not ok:
            raise BenchError(f"{name}: a StateBlock host A holds was answered as a miss")
        if not np.array_equal(out, expected):
            raise VerifyError(f"{name}: the bytes received differ from the StateBlock host A holds")
        out[:] = 0

    for r in range(args.rounds + 1):  # round 0 warms up, untimed
        for _ in range(args.iterations):  # the three interleaved, so that load from elsewhere hits all alike
            start = time.perf_counter()
            raw.sendall(request)
            got = raw.recvmsg_into([head, view], 0, socket.MSG_WAITALL)[0]
            samples["raw"].append(time.perf_counter() - start)
            check("raw", got == HEADER.size + size)
            start = time.perf_counter()
            pulled = host_b.puller.pull_into(location, key, view)
            samples["pull"].append(time.perf_counter() - start)
            check("pull", pulled)
            start = time.perf_counter()
            found = host_b.get_into(key, view)
            samples["get"].append(time.perf_counter() - start)
            check("get", found)
        if r == 0:
            samples = {name: [] for name in samples}
    return samples


def _text(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [f"StateBlock of {s['stateblock_bytes']:,} B, {s['rounds']} rounds of {s['iterations']} each"]
    for name, label in (("raw", "raw TCP round trip"), ("pull", "pull from host A"), ("get", "lookup + pull")):
        ms = result[f"{name}_ms"]
        lines.append(f"{label:20s} p50 {ms['p50']:7.3f} ms   p99 {ms['p99']:7.3f} ms")
    lines.append(
        f"pull / raw at p50: {result['pull_vs_raw_p50']:.2f}×   lookup + pull / raw: {result['get_vs_raw_p50']:.2f}×"
    )
    return "\n".join(lines)


# -- child processes (run with ``python -c``) ------------------------------------------------------------


def _directory(config_path: str) -> None:
    from kvtier.transfer import directory

    sys.exit(directory.main(["--config", config_path, "--listen", "127.0.0.1:0"]))


def _raw_server(size: str) -> None:
    payload = memoryview(np.random.default_rng(7).integers(0, 256, int(size), dtype=np.uint8))
    head = memoryview(bytearray(HEADER.size))  # a frame head's worth of bytes, as each pull answer has
    request = bytearray(REQUEST)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        print(listener.getsockname()[1], flush=True)
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while conn.recv_into(request, REQUEST, socket.MSG_WAITALL) == REQUEST:
                sendmsg_all(conn, [head, payload])  # as the StateBlock server sends


def _host_a(config_path: str, size: str, directory_port: str) -> None:
    config = cluster_map.load(Path(config_path))
    n = int(size)
    shm = f"kvbench-sb-{os.getpid()}-{secrets.token_hex(4)}"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # leave through the ``with``: the segment is removed
    with StateBlockHost(config, shm, n, n, "host-a", directory=("127.0.0.1", int(directory_port))) as host:
        key = secrets.token_bytes(16)
        host.put(key, np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8))
        slot = host.pool.lookup(host.tid, key)
        assert slot is not None
        print(host.addr[0], host.addr[1], slot, int(host.pool.gen[slot]), key.hex(), flush=True)
        sys.stdin.read()
