"""Single-client put/get throughput and match latency on a local 12-node cluster, against a raw socket.

    python benchmarks/store_bench.py [--sizes 64KiB,1MiB,4MiB] [--batch 64MiB] [--rounds 5] [--json]

For every block size it times ``put`` (fresh keys each round) and ``get_into`` (into preallocated
buffers) of one batch, and next to each, in the same run, one raw loopback TCP stream moving the same
number of bytes (blocking ``sendall`` from a preallocated buffer in another process, ``recv_into`` a
preallocated buffer here): the ceiling any Python client on this machine could reach. Results are
medians over rounds and are reported as ratios to that stream. Then it times ``match`` of a 1,200-key
chain. This is a benchmark, never a test: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from kvtier.kvstore import cluster as cluster_mod
from kvtier.kvstore.client import Client
from kvtier.kvstore.keys import Namespace, chain
from kvtier.kvstore.local import LocalCluster
from kvtier.kvstore.units import format_size, parse_size
from kvtier.tools.benchutil import raw_stream_gbps

GRACE_S = 0.5


def bench_size(client: Client, block_size: int, batch_bytes: int, rounds: int) -> dict[str, float]:
    n = max(1, batch_bytes // block_size)
    blocks = [np.random.default_rng(i).integers(0, 256, block_size, dtype=np.uint8).tobytes() for i in range(n)]
    buffers = [bytearray(block_size) for _ in range(n)]
    put_rates, get_rates, raw_rates = [], [], []
    for round_ in range(rounds + 1):  # round 0 fills fresh slots and is not counted
        keys = [os.urandom(16) for _ in range(n)]
        start = time.perf_counter()
        stored = client.put(keys, blocks)
        if round_:
            put_rates.append(n * block_size / (time.perf_counter() - start) / 1e9)
        if not all(stored):
            raise RuntimeError("a put was refused: give the nodes more capacity")
        client.get_into(keys, buffers)  # first read of fresh data warms the nodes' buffers
        start = time.perf_counter()
        found = client.get_into(keys, buffers)
        if round_:
            get_rates.append(n * block_size / (time.perf_counter() - start) / 1e9)
        if not all(found) or buffers[0] != blocks[0]:
            raise RuntimeError("a read came back wrong")
        raw_rates.append(raw_stream_gbps(n * block_size))
        client.delete(keys)
        time.sleep(GRACE_S)
    put, get, raw = statistics.median(put_rates), statistics.median(get_rates), statistics.median(raw_rates)
    return {
        "block_size": block_size,
        "blocks_per_call": n,
        "put_gbps": put,
        "get_gbps": get,
        "raw_stream_gbps": raw,
        "put_ratio": put / raw,
        "get_ratio": get / raw,
    }


def bench_match(client: Client, rounds: int = 200) -> dict[str, float]:
    ns = Namespace("bench", "bf16", 64, "paged")
    keys = chain(ns, np.arange(1200 * 64) % 32000)
    client.put(keys, [b"x" * 64] * len(keys))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        hit = client.match(keys)
        times.append((time.perf_counter() - start) * 1e3)
    assert hit == len(keys)
    client.delete(keys)
    times.sort()
    return {"keys": len(keys), "p50_ms": times[len(times) // 2], "p99_ms": times[int(len(times) * 0.99)]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64KiB,1MiB,4MiB")
    parser.add_argument("--batch", default="64MiB", help="bytes moved per put/get call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    batch = parse_size(args.batch)
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        path = cluster_mod.write_default(tmp, nodes=12, capacity_bytes=8 << 30, metrics=False)
        # a KV cache runs full, so its writes land in slots that evictions freed, not in fresh file space:
        # a short grace lets each round reuse the slots the previous round deleted (steady state)
        path.write_text(path.read_text().replace("[gc]\n", f"[gc]\ngrace_s = {GRACE_S}\n"))
        with LocalCluster(path) as local, Client(local.config) as client:
            results["codec_backend"] = client.codec.backend
            results["sizes"] = [bench_size(client, size, batch, args.rounds) for size in sizes]
            results["match"] = bench_match(client)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"12-node local cluster, one client, codec {results['codec_backend']}, {format_size(batch)} per call")
    print(f"{'block':>9} {'blocks':>7} {'raw GB/s':>9} {'put GB/s':>9} {'put/raw':>8} {'get GB/s':>9} {'get/raw':>8}")
    for r in results["sizes"]:  # type: ignore[union-attr]
        print(
            f"{format_size(r['block_size']):>9} {r['blocks_per_call']:>7} {r['raw_stream_gbps']:>9.2f} "
            f"{r['put_gbps']:>9.2f} {r['put_ratio']:>7.2f}x {r['get_gbps']:>9.2f} {r['get_ratio']:>7.2f}x"
        )
    m = results["match"]
    print(f"match of a {m['keys']}-key chain: p50 {m['p50_ms']:.2f} ms, p99 {m['p99_ms']:.2f} ms")  # type: ignore[index]
    return 0


if __name__ == "__main__":
    sys.exit(main())
