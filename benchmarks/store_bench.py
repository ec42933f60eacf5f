"""Single-writer put and single-reader get throughput on a local 12-node cluster, against a raw socket.

    python benchmarks/store_bench.py [--sizes 64KiB,1MiB,4MiB] [--batch 64MiB] [--rounds 5]
                                     [--modes fresh,capacity] [--capacity 256MiB] [--fill-page-cache] [--json]

Two situations, each on its own new cluster, per block size:

- **fresh**: an empty cluster (2 GiB a node). Every round writes new keys, so every put lands in file
  space the nodes have never written: what a user's new cluster does.
- **capacity**: a small cluster (``--capacity`` a node) first filled with twice what it holds, so the
  timed puts find it full and the store must evict (watermark GC, or on demand) to take them: what a
  KV cache does all day. Nothing is deleted by the benchmark; the configured grace time is the default.

Every round: one client (the writer) ``put``s one batch of fresh random 16-byte keys; a second client (the
reader, which never wrote them) reads the batch with ``get_into`` into preallocated caller buffers, then
with ``get`` (kvtier allocates the blocks); every read is checked. Next to each round, in the same run, one
raw Unix stream moves the same number of bytes (blocking ``sendall`` from a preallocated buffer in another
process, ``recv_into`` a preallocated buffer here): the ceiling any Python client on this machine could reach
over the transport a client uses to the nodes of its own machine (their Unix sockets); a raw loopback TCP stream
is reported beside it. Round 0 warms connections and is not counted; results are medians over rounds of each round's
ratio to its raw stream (the load of a shared machine drifts between rounds), with the CPU seconds per GB moved
that this process and the node processes spent (on two idle cores, throughput is about 2 / that). The put
is also given over all rounds together (total bytes / total time, and its ratio to the median raw stream): at
capacity the rounds alternate between puts with and without an eviction pass, so a median of a few rounds
picks one kind or the other, and that sum is the rate a writer keeps up. A put
that a full cluster refused (``CapacityError``) is reported as refused blocks, not hidden. Then it times
``match`` of a 1,200-key chain.

Memory state: on a VM that hands free memory back to its host, the first touch of a page that sat free costs
a host fault, and a fresh put (which fills new page-cache pages) then measures the hypervisor: on the
development VM, 45-70 % of all CPU went to the page-cache copy with 20 GiB free, 9 % with memory full of page
cache. ``--fill-page-cache`` measures the state of a storage host that has been up for a while (memory full
of clean page cache, new pages from reclaim; see :func:`kvtier.tools.benchutil.page_cache_filled`). The free
memory at the start is printed either way, with a warning when it is large and the fill is off.

This is a benchmark, never a test: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from kvtier.kvstore.client import CapacityError, Client
from kvtier.kvstore.keys import Namespace, chain
from kvtier.kvstore.units import format_size, parse_size
from kvtier.tools.benchutil import (
    CpuMeter,
    PageCacheFill,
    memory_free_bytes,
    page_cache_filled,
    raw_stream_gbps,
    temp_cluster,
)

MODES = ("fresh", "capacity")
OPS = ("put", "get_into", "get")
FRESH_CAPACITY = 2 << 30
FILL_FACTOR = 2.0  # the capacity mode writes this many times what the cluster holds before timing
COLD_MEMORY_WARNING = 4 << 30  # free memory above which fresh puts may measure first-touch host faults


class Batch:
    """One call's worth of random blocks, and the caller-owned buffers reads land in."""

    def __init__(self, block_size: int, batch_bytes: int) -> None:
        self.block_size = block_size
        self.n = max(1, batch_bytes // block_size)
        rng = np.random.default_rng(block_size)
        self.blocks = [rng.integers(0, 256, block_size, dtype=np.uint8).tobytes() for _ in range(self.n)]
        self.buffers = [bytearray(block_size) for _ in range(self.n)]

    @property
    def nbytes(self) -> int:
        return self.n * self.block_size

    def fresh_keys(self) -> list[bytes]:
        return [os.urandom(16) for _ in range(self.n)]


def put_fresh(writer: Client, batch: Batch) -> tuple[list[bytes], int]:
    """Put one batch of new keys; (keys, blocks refused for lack of space)."""
    keys = batch.fresh_keys()
    try:
        writer.put(keys, batch.blocks)
        return keys, 0
    except CapacityError as exc:
        return keys, exc.stored.count(False)


def bench_round(writer: Client, reader: Client, batch: Batch, meter: CpuMeter) -> dict[str, float]:
    """One timed round: put of fresh keys, then ``get_into`` and ``get`` of them by the other client, and the raw
    stream; GB/s, ratio to the raw stream of this round, and CPU seconds per GB of each."""
    raw, raw_tcp = raw_stream_gbps(batch.nbytes, unix=True), raw_stream_gbps(batch.nbytes)
    (keys, refused), put_s, put_cpu = meter.timed(lambda: put_fresh(writer, batch))
    found, get_into_s, get_into_cpu = meter.timed(lambda: reader.get_into(keys, batch.buffers))
    stored = [i for i, hit in enumerate(found) if hit]  # type: ignore[attr-defined]
    if len(stored) + refused < batch.n:
        raise RuntimeError(f"{batch.n - refused - len(stored)} stored blocks could not be read back")
    if any(batch.buffers[i] != batch.blocks[i] for i in stored):
        raise RuntimeError("get_into returned wrong bytes")
    got, get_s, get_cpu = meter.timed(lambda: reader.get(keys))
    if any(got[i] != batch.blocks[i] for i in stored):  # type: ignore[index]
        raise RuntimeError("get returned wrong bytes")
    put_gb = (batch.n - refused) * batch.block_size / 1e9
    read_gb = len(stored) * batch.block_size / 1e9  # a refused block is not read: its miss is not counted as speed
    out = {"raw": raw, "raw_tcp": raw_tcp, "refused": refused}
    for op, gb, wall, cpu in (
        ("put", put_gb, put_s, put_cpu),
        ("get_into", read_gb, get_into_s, get_into_cpu),
        ("get", read_gb, get_s, get_cpu),
    ):
        out[op] = gb / wall
        out[f"{op}_ratio"] = out[op] / raw
        out[f"{op}_cpu_s_per_gb"] = cpu / gb if gb else float("nan")
        out[f"{op}_gb"], out[f"{op}_s"], out[f"{op}_cpu_s"] = gb, wall, cpu
    return out


def sustained(samples: list[dict[str, float]], op: str, raw_gbps: float) -> dict[str, float]:
    """``op`` over every timed round together: total GB ÷ total seconds, its ratio to the median raw stream, and
    total CPU seconds ÷ total GB. At capacity the rounds alternate between puts with and without an eviction
    pass, and a median of a few rounds picks one kind or the other; this is the rate a writer keeps up."""
    gb = sum(s[f"{op}_gb"] for s in samples)
    gbps = gb / sum(s[f"{op}_s"] for s in samples)
    cpu = sum(s[f"{op}_cpu_s"] for s in samples) / gb if gb else float("nan")
    return {f"{op}_sustained_gbps": gbps, f"{op}_sustained_ratio": gbps / raw_gbps, f"{op}_sustained_cpu_s_per_gb": cpu}


def fill(writer: Client, batch: Batch, target_bytes: float) -> int:
    """Put fresh batches until ``target_bytes`` of blocks were offered; returns blocks refused."""
    offered = refused = 0
    while offered < target_bytes:
        refused += put_fresh(writer, batch)[1]
        offered += batch.nbytes
    return refused


def bench_size(
    mode: str, block_size: int, batch_bytes: int, rounds: int, capacity: int, page_cache: PageCacheFill | None
) -> dict[str, object]:
    batch = Batch(block_size, batch_bytes)
    node_capacity = FRESH_CAPACITY if mode == "fresh" else capacity
    with (
        temp_cluster(nodes=12, capacity_bytes=node_capacity) as local,
        Client(local.config) as writer,
        Client(local.config) as reader,
    ):
        fill_refused = 0
        if mode == "capacity":
            holds = 12 * node_capacity * 10 / 12  # block bytes the cluster holds (10 data of 12 shards)
            fill_refused = fill(writer, batch, FILL_FACTOR * holds)
        meter = CpuMeter([proc.pid for proc in local.procs.values()])
        samples = []
        for _ in range(rounds + 1):
            if page_cache is not None:
                page_cache.refresh()  # untimed: keep memory as full of page cache as the run started
            samples.append(bench_round(writer, reader, batch, meter))
        samples = samples[1:]
        usage = [info.get("used_bytes", 0) / node_capacity for info in writer.node_info().values()]
    med = {k: statistics.median(s[k] for s in samples) for k in samples[0] if k != "refused"}
    return {
        "mode": mode,
        "block_size": block_size,
        "blocks_per_call": batch.n,
        "node_capacity": node_capacity,
        "raw_stream_gbps": med["raw"],
        "raw_tcp_stream_gbps": med["raw_tcp"],
        **{f"{k}_gbps": med[k] for k in OPS},
        **{f"{k}_ratio": med[f"{k}_ratio"] for k in OPS},  # median of the rounds' ratios: load drifts between rounds
        **{f"{k}_cpu_s_per_gb": med[f"{k}_cpu_s_per_gb"] for k in OPS},
        **{key: value for k in OPS for key, value in sustained(samples, k, med["raw"]).items()},
        "refused_blocks": sum(int(s["refused"]) for s in samples),
        "fill_refused_blocks": fill_refused,
        "max_usage_after": max(usage, default=0.0),
        "rounds": [{k: round(v, 3) for k, v in s.items()} for s in samples],
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
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per size and mode (medians)")
    parser.add_argument("--modes", default=",".join(MODES), help="fresh, capacity or both")
    parser.add_argument("--capacity", default="256MiB", help="node capacity in the capacity mode")
    parser.add_argument("--no-match", action="store_true", help="skip the match latency measurement")
    parser.add_argument(
        "--fill-page-cache",
        action="store_true",
        help="fill free memory with clean page cache for the run (a long-running host's state; see above)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes takes a comma-separated list of {', '.join(MODES)}")
    batch, capacity = parse_size(args.batch), parse_size(args.capacity)
    free_at_start = memory_free_bytes()
    with contextlib.ExitStack() as stack:
        page_cache = stack.enter_context(page_cache_filled(tempfile.gettempdir())) if args.fill_page_cache else None
        results: dict[str, object] = {
            "batch_bytes": batch,
            "memory_free_bytes": free_at_start,
            "results": [
                bench_size(mode, size, batch, args.rounds, capacity, page_cache) for mode in modes for size in sizes
            ],
            "page_cache_filled_bytes": page_cache.bytes if page_cache else 0,
        }
    if not args.no_match:
        with temp_cluster(nodes=12, capacity_bytes=FRESH_CAPACITY) as local, Client(local.config) as client:
            results["codec_backend"] = client.codec.backend
            results["match"] = bench_match(client)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"12-node local cluster, one writer client, one reader client, {format_size(batch)} per call, fresh keys")
    filled = results["page_cache_filled_bytes"]
    print(f"memory free at the start: {format_size(free_at_start)}; page cache filled: {format_size(filled)}")
    if free_at_start > COLD_MEMORY_WARNING and not filled:
        print("warning: much memory is free; on a VM that returns free pages to its host, fresh puts measure")
        print("         first-touch host faults (see --fill-page-cache)")
    print("ratios to the raw Unix stream (median of rounds; the client reaches its machine's nodes by Unix sockets);")
    print("CPU s/GB: client + nodes (raw stream: about 0.3-0.4)")
    print("all rounds: put over every round together, total bytes / total time (at capacity, the sustained rate)")
    print(
        f"{'mode':>8} {'block':>7} {'raw GB/s':>8} {'(TCP)':>6} {'put':>6} {'get_into':>8} {'get':>6}   "
        f"{'CPU s/GB: put':>13} {'get_into':>8} {'get':>5}   {'put, all rounds':>19}   {'refused':>7} {'usage':>5}"
    )
    for r in results["results"]:  # type: ignore[union-attr]
        print(
            f"{r['mode']:>8} {format_size(r['block_size']):>7} {r['raw_stream_gbps']:>8.2f} "
            f"{r['raw_tcp_stream_gbps']:>6.2f} "
            f"{r['put_ratio']:>5.2f}x {r['get_into_ratio']:>7.2f}x {r['get_ratio']:>5.2f}x   "
            f"{r['put_cpu_s_per_gb']:>13.2f} {r['get_into_cpu_s_per_gb']:>8.2f} {r['get_cpu_s_per_gb']:>5.2f}   "
            f"{r['put_sustained_ratio']:>5.2f}x {r['put_sustained_cpu_s_per_gb']:>5.2f} s/GB   "
            f"{r['refused_blocks']:>7} {r['max_usage_after']:>5.0%}"
        )
    if "match" in results:
        m = results["match"]
        print(f"match of a {m['keys']}-key chain: p50 {m['p50_ms']:.2f} ms, p99 {m['p99_ms']:.2f} ms")  # type: ignore[index]
    return 0


if __name__ == "__main__":
    sys.exit(main())
