"""``match`` latency on a local 12-node cluster, against the same requests sent by raw sockets.

    python benchmarks/match_bench.py [--keys 1,12,100,1200] [--calls 400] [--json]

A chain of the largest ``--keys`` 64-token keys is stored once; then, alternating twice, ``Client.match`` of
its first ``n`` keys for each ``n`` (``--calls`` calls each), and the **raw fan-out**: the very MATCH frames the
client sends for the whole chain (one per primary), written to the client's own authenticated connections with
``socket.send`` and read back with ``select`` and ``recv``, no kvtier code between: what the nodes alone cost.
Reported: p50 and p99 per call, and the CPU milliseconds per call of this process and of the node processes
(``CpuMeter``): on two cores a call cannot take less than (client + nodes) / 2 of wall time.

This is a benchmark, never a test: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import time
from collections.abc import Callable

import numpy as np

from kvtier.kvstore.client import Client
from kvtier.kvstore.keys import Namespace, chain
from kvtier.kvstore.wire.fields import pack_keys
from kvtier.kvstore.wire.protocol import Op, encode_head
from kvtier.tools.benchutil import CpuMeter, latency_percentiles, temp_cluster

BLOCK_TOKENS = 64


def measure(call: Callable[[], object], calls: int, meter: CpuMeter) -> dict[str, float]:
    """Latency percentiles of ``calls`` calls, and CPU ms per call here and on the nodes."""
    seconds = []
    cpu, mine = meter.read(), time.process_time()
    for _ in range(calls):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    client_s = time.process_time() - mine
    nodes_s = meter.read() - cpu - client_s
    pct = latency_percentiles(seconds)
    return {"p50_ms": pct["p50"], "p99_ms": pct["p99"], "client_cpu_ms": client_s / calls * 1e3,
            "nodes_cpu_ms": nodes_s / calls * 1e3}  # fmt: skip


def raw_fan_out(client: Client, keys: list[bytes]) -> Callable[[], None]:
    """One MATCH frame per primary of ``keys``, sent and answered over the client's connections, nothing else."""
    primaries = client.placement.primaries(keys)
    frames: list[tuple[socket.socket, bytes]] = []
    for node in np.unique(primaries).tolist():
        conn = client.pool.get(node)
        assert conn is not None and conn.sock is not None, f"node {node} is down"
        blob, klen = pack_keys([keys[i] for i in np.flatnonzero(primaries == node).tolist()])
        frames.append((conn.sock, encode_head(Op.MATCH, 1 << 40, {"keys": blob, "klen": klen})))

    def call() -> None:
        for sock, frame in frames:
            sock.send(frame)
        waiting = {sock for sock, _ in frames}
        while waiting:
            readable, _, _ = select.select(list(waiting), [], [])
            for sock in readable:
                sock.recv(1 << 16)  # a reply of ~100 flags is one small segment
                waiting.discard(sock)

    return call


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", default="1,12,100,1200", help="chain lengths to match")
    parser.add_argument("--calls", type=int, default=400, help="calls per measurement")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    lengths = [int(n) for n in args.keys.split(",")]
    results: dict[str, list[dict[str, float]]] = {}
    with temp_cluster(nodes=12) as local, Client(local.config) as client:
        keys = chain(Namespace("bench", "bf16", BLOCK_TOKENS, "paged"), np.arange(max(lengths) * BLOCK_TOKENS) % 32000)
        client.put(keys, [b"x" * 64] * len(keys))
        meter = CpuMeter([proc.pid for proc in local.procs.values()])
        for _ in range(2):
            for n in lengths:
                results.setdefault(f"match {n}", []).append(
                    measure(lambda n=n: client.match(keys[:n]), args.calls, meter)
                )
            results.setdefault(f"raw fan-out {len(keys)}", []).append(
                measure(raw_fan_out(client, keys), args.calls, meter)
            )
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'':>18} {'p50 ms':>14} {'p99 ms':>14} {'client CPU ms':>14} {'nodes CPU ms':>14}   (two alternations)")
    for name, runs in results.items():
        cells = [" / ".join(f"{r[k]:.2f}" for r in runs) for k in ("p50_ms", "p99_ms", "client_cpu_ms", "nodes_cpu_ms")]
        print(f"{name:>18} " + " ".join(f"{c:>14}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
