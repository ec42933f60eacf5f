"""A long prompt's prefix read back whole with ``get_into``, in 1 to 8 lanes, against raw loopback streams.

    python benchmarks/prefix_read_bench.py [--blocks 1168] [--block-size 2MiB] [--lanes 1,2,4,8,0] [--rounds 3]
                                           [--capacity 4GiB] [--json]

The 8 B checkpoint's 77,824-token prompt at a 96 % hit is 1,168 blocks of 2 MiB (2.45 GB): an engine reading it
through the store client waits for one ``get_into`` of them. On a host with more cores than the client's one
Python thread can use, ``[client] read_lanes`` splits such a read into runs of blocks read at once, each on a thread
with connections of its own (``0``: the client's own choice for this host). A 12-node local cluster (its data where
``TMPDIR`` points: on the GPU host, tmpfs) holds the blocks; each round reads them with every lane count in turn,
then runs the baselines of the same round: one raw Unix stream of the same bytes (``benchutil``; the client reaches
the nodes of its machine by their Unix sockets), and as many streams at once as the largest lane count (the host's
Unix sockets at that parallelism). Reported: GB/s per lane
count (median of the rounds) and its ratio to the single raw stream of each round (median of those ratios).

A benchmark, never a test: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import numpy as np

from kvtier.kvstore.client import Client
from kvtier.kvstore.units import format_size, parse_size
from kvtier.tools.benchutil import CpuMeter, raw_stream_gbps, raw_streams_gbps, temp_cluster

PUT_BYTES = 256 << 20  # per put call: within the nodes' payload limit


def read_rate(client: Client, keys: list[bytes], buffers: list[memoryview], meter: CpuMeter) -> tuple[float, ...]:
    """GB/s of one ``get_into`` of ``keys``, and the CPU seconds per GB it cost this process and the nodes."""
    client_cpu, total_cpu = time.process_time(), meter.read()
    start = time.perf_counter()
    found = client.get_into(keys, buffers)
    elapsed = time.perf_counter() - start
    client_cpu, total_cpu = time.process_time() - client_cpu, meter.read() - total_cpu
    if not all(found):
        raise SystemExit(f"prefix_read_bench: {found.count(False)} of {len(keys)} blocks just stored were missed")
    gb = sum(map(len, buffers)) / 1e9
    return gb / elapsed, client_cpu / gb, (total_cpu - client_cpu) / gb


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1168)
    parser.add_argument("--block-size", default="2MiB")
    parser.add_argument("--lanes", default="1,2,4,8,0", help="lane counts to compare (0: the client's default)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--capacity", default="4GiB", help="each node's capacity")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    size, lanes = parse_size(args.block_size), [int(n) for n in args.lanes.split(",")]
    total = args.blocks * size
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (args.blocks, size), dtype=np.uint8)
    keys = [os.urandom(16) for _ in range(args.blocks)]
    out = np.ones_like(data)  # touched: the reads land in resident memory, as an engine's staging buffers are
    buffers = [memoryview(row) for row in out]
    rates: dict[int, list[float]] = {n: [] for n in lanes}
    cpu: dict[int, list[tuple[float, float]]] = {n: [] for n in lanes}
    ratios: dict[int, list[float]] = {n: [] for n in lanes}
    raw, raw_parallel = [], []
    with temp_cluster(capacity_bytes=parse_size(args.capacity)) as local:
        step = max(1, PUT_BYTES // size)
        with Client(local.config) as writer:
            for start in range(0, args.blocks, step):
                part = slice(start, start + step)
                if not all(writer.put(keys[part], [memoryview(row) for row in data[part]])):
                    raise SystemExit("prefix_read_bench: the cluster refused blocks: raise --capacity")
        meter = CpuMeter([proc.pid for proc in local.procs.values()])
        clients = {}
        for n in lanes:
            settings = dataclasses.replace(local.config.client, read_lanes=n)
            clients[n] = Client(dataclasses.replace(local.config, client=settings))
            read_rate(clients[n], keys, buffers, meter)  # connections opened, lanes made
        if not np.array_equal(out, data):
            raise SystemExit("prefix_read_bench: the blocks read back differ from those stored")
        for _ in range(args.rounds):
            for n in lanes:
                gbps, client_s, nodes_s = read_rate(clients[n], keys, buffers, meter)
                rates[n].append(gbps)
                cpu[n].append((client_s, nodes_s))
            raw.append(raw_stream_gbps(total, unix=True))
            raw_parallel.append(raw_streams_gbps(total, max(max(lanes), 1), unix=True))
            for n in lanes:
                ratios[n].append(rates[n][-1] / raw[-1])
        for client in clients.values():
            client.close()
    result = {
        "blocks": args.blocks,
        "block_bytes": size,
        "bytes": total,
        "cpus": os.cpu_count(),
        "raw_stream_gbps": statistics.median(raw),
        f"raw_{max(max(lanes), 1)}_streams_gbps": statistics.median(raw_parallel),
        "lanes": {
            str(n): {
                "gbps": statistics.median(rates[n]),
                "vs_raw_stream": statistics.median(ratios[n]),
                "client_cpu_s_per_gb": statistics.median(c for c, _ in cpu[n]),
                "nodes_cpu_s_per_gb": statistics.median(d for _, d in cpu[n]),
            }
            for n in lanes
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"get_into of {args.blocks} blocks of {format_size(size)} ({total / 1e9:.2f} GB), {os.cpu_count()} cores, "
          f"medians of {args.rounds} rounds")  # fmt: skip
    print(f"raw Unix sockets: one stream {result['raw_stream_gbps']:.2f} GB/s, {max(max(lanes), 1)} streams "
          f"{statistics.median(raw_parallel):.2f} GB/s")  # fmt: skip
    for n in lanes:
        line = result["lanes"][str(n)]
        print(f"lanes {n or 'auto':>4}: {line['gbps']:6.2f} GB/s {line['vs_raw_stream']:.2f}x raw, CPU s/GB "
              f"client {line['client_cpu_s_per_gb']:.2f} nodes {line['nodes_cpu_s_per_gb']:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
