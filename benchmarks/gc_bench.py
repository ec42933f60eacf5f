"""Write throughput into a full cluster vs an empty one, and eviction accuracy, on local 12-node clusters.

    python benchmarks/gc_bench.py [--capacity 64MiB] [--block-size 64KiB] [--load 4] [--rounds 5] [--json]

Same run, same client, fresh keys every put: (1) an empty cluster, big enough that nothing is ever evicted;
(2) a cluster of ``--capacity`` per node, filled twice over first, so every put evicts (watermark GC and
on-demand eviction). Both run side by side; each round writes ``--load / --rounds`` capacities into one and
then the other, so machine load hits both alike, and the ratio is the median of the rounds'. Usage is
sampled after every put (the node's accounting, and the slab files' bytes on disk at the end) against the
capacity; refused blocks are counted. Eviction accuracy: fill to 85 % of capacity, write 10 % more, and
compare the blocks GC removed with the blocks it needed to remove to reach the low watermark. A benchmark,
never a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from kvtier.kvstore.client import CapacityError, Client
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.kvstore.node.slabs import SIZE_CLASSES, size_class_for
from kvtier.kvstore.units import format_size, parse_size

GC_SETTINGS = "interval_s = 0.2\n"
BATCH_BYTES = 8 << 20  # per put: well inside the 10 % headroom between the high watermark and capacity


def start(tmp: str, name: str, capacity: int) -> LocalCluster:
    path = cluster_mod.write_default(os.path.join(tmp, name), capacity_bytes=capacity, metrics=False)
    path.write_text(path.read_text().replace("[gc]\n", f"[gc]\n{GC_SETTINGS}"))
    local = LocalCluster(path)
    local.start()
    return local


def batch_of(block_size: int) -> int:
    return max(1, BATCH_BYTES // block_size)


def write(client: Client, block_size: int, total_bytes: int, capacity: int) -> dict[str, float]:
    """Put ``total_bytes`` of fresh blocks; GB/s, the highest node usage seen (fraction of capacity), refusals."""
    batch = batch_of(block_size)
    blocks = [os.urandom(block_size) for _ in range(batch)]
    written = refused = 0
    peak = 0.0
    elapsed = 0.0
    while written < total_bytes:
        keys = [os.urandom(16) for _ in range(batch)]
        start = time.perf_counter()
        try:
            client.put(keys, blocks)
        except CapacityError as exc:
            refused += batch - sum(exc.stored)
        elapsed += time.perf_counter() - start
        written += batch * block_size
        peak = max(peak, max(i["used_bytes"] for i in client.node_info().values()) / capacity)
    return {"put_gbps": written / elapsed / 1e9, "peak_usage": peak, "refused_blocks": refused}


def slab_bytes_on_disk(local: LocalCluster) -> int:
    """The largest node's slab files, in bytes allocated on disk."""
    return max(
        sum(f.stat().st_blocks * 512 for f in (node.data_dir / "slabs").glob("slab-*.dat"))
        for node in local.config.nodes.values()
    )


def eviction_accuracy(client: Client, block_size: int, capacity: int) -> dict[str, float]:
    slot = SIZE_CLASSES[size_class_for(-(-block_size // 10))]
    batch = batch_of(block_size)
    blocks = [os.urandom(block_size) for _ in range(batch)]
    fill = int(0.85 * capacity) // slot
    keys = [os.urandom(16) for _ in range(fill)]
    for i in range(0, fill, batch):
        client.put(keys[i : i + batch], blocks[: len(keys[i : i + batch])])
    # one put crosses the high watermark: a single eviction episode, whose size is then known exactly
    extra = [os.urandom(16) for _ in range(int(0.1 * capacity) // slot)]
    before = {nid: i["gc"]["evictions"] for nid, i in client.node_info().items()}
    client.put(extra, [blocks[i % batch] for i in range(len(extra))])
    client.admin("gc")  # a cycle on every node now: what the watermarks ask for is removed when it returns
    total = fill + len(extra)
    remaining = sum(client.exists(keys)) + sum(client.exists(extra))
    nodes = client.node_info()
    budget = capacity // 12  # each primary's share of every node (see gc.worker)
    high, low = int(0.9 * budget) // slot, int(0.8 * budget) // slot  # blocks per primary at the marks
    # the primaries that evicted in this episode (hash imbalance can make one evict during the fill too)
    evicting = [
        (sum(i["classes"].values()), i["gc"]["evictions"] - before[nid])
        for nid, i in nodes.items()
        if i["gc"]["evictions"] > before[nid]
    ]
    final = [i["used_bytes"] / capacity for i in nodes.values()]
    return {
        "blocks_written": total,
        "blocks_evicted": total - remaining,
        "primaries_over_high": len(evicting),
        "primary_blocks_at_low_watermark": low,
        "primary_blocks_at_high_watermark": high,
        # a primary over its high mark must end exactly at its low mark: anything below is over-eviction
        "over_evicted_blocks": sum(max(0, low - c) for c, _ in evicting),
        "under_evicted_blocks": sum(max(0, c - low) for c, _ in evicting),
        "final_usage_min": min(final),
        "final_usage_max": max(final),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacity", default="64MiB", help="per node, for the evicting cluster")
    parser.add_argument("--block-size", default="64KiB")
    parser.add_argument("--load", type=float, default=4.0, help="bytes written, in multiples of capacity")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    capacity, block_size = parse_size(args.capacity), parse_size(args.block_size)
    slot = SIZE_CLASSES[size_class_for(-(-block_size // 10))]
    per_round = int(args.load / args.rounds * capacity / slot) * block_size  # block bytes per round and cluster
    results: dict[str, object] = {"capacity": capacity, "block_size": block_size, "load": args.load}
    rounds: dict[str, list[dict[str, float]]] = {"empty": [], "full": []}
    with tempfile.TemporaryDirectory(prefix="kvtier-gcbench-") as tmp:
        empty = start(tmp, "empty", 64 * capacity)
        full = start(tmp, "full", capacity)
        try:
            with Client(empty.config) as into_empty, Client(full.config) as into_full:
                write(into_full, block_size, 2 * int(capacity / slot) * block_size, capacity)  # fill it twice over
                for _ in range(args.rounds):
                    rounds["empty"].append(write(into_empty, block_size, per_round, 64 * capacity))
                    rounds["full"].append(write(into_full, block_size, per_round, capacity))
            disk = slab_bytes_on_disk(full)
        finally:
            empty.stop()
            full.stop()
        local = start(tmp, "accuracy", capacity)
        try:
            with Client(local.config) as client:
                results["accuracy"] = eviction_accuracy(client, block_size, capacity)
        finally:
            local.stop()
    ratios = [f["put_gbps"] / e["put_gbps"] for e, f in zip(rounds["empty"], rounds["full"], strict=True)]
    results["empty"] = {"put_gbps": statistics.median(r["put_gbps"] for r in rounds["empty"])}
    results["full"] = {
        "put_gbps": statistics.median(r["put_gbps"] for r in rounds["full"]),
        "peak_usage": max(r["peak_usage"] for r in rounds["full"]),
        "refused_blocks": sum(r["refused_blocks"] for r in rounds["full"]),
        "slab_bytes_on_disk": disk / capacity,
    }
    results["full_vs_empty"] = statistics.median(ratios)
    results["round_ratios"] = ratios
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    empty_r, full_r, acc = results["empty"], results["full"], results["accuracy"]
    print(f"{format_size(block_size)} blocks, {args.load:g}x a capacity of {format_size(capacity)} per node")
    print(f"put into an empty cluster: {empty_r['put_gbps']:.2f} GB/s (median of {args.rounds} rounds)")  # type: ignore[index]
    print(
        f"put into a full cluster: {full_r['put_gbps']:.2f} GB/s; median ratio {results['full_vs_empty']:.2f}x "  # type: ignore[index]
        f"(rounds {', '.join(f'{r:.2f}' for r in ratios)}); peak usage {full_r['peak_usage']:.1%} of capacity, "  # type: ignore[index]
        f"slab files {full_r['slab_bytes_on_disk']:.1%} of it on disk, {full_r['refused_blocks']} blocks refused"  # type: ignore[index]
    )
    print(
        f"eviction accuracy: {acc['primaries_over_high']} of 12 primaries crossed their high mark "  # type: ignore[index]
        f"({acc['primary_blocks_at_high_watermark']} blocks) and evicted {acc['blocks_evicted']} blocks; "  # type: ignore[index]
        f"over-evicted {acc['over_evicted_blocks']}, under-evicted {acc['under_evicted_blocks']} "  # type: ignore[index]
        f"(target {acc['primary_blocks_at_low_watermark']} each); node usage after "  # type: ignore[index]
        f"{acc['final_usage_min']:.1%}..{acc['final_usage_max']:.1%} (watermarks 80%/90%)"  # type: ignore[index]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
