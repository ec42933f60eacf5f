"""``kvbench putget``: put/get throughput and latency against a real cluster, optionally next to Redis and
Mooncake Store on the same machine, every figure also as a ratio to one raw loopback TCP stream of the same bytes
measured in the same run.

    kvbench [--config PATH] putget [--block-size SIZE] [--concurrency N] [--duration S] [--batch-bytes SIZE]
                                   [--max-bytes SIZE] [--fresh | --at-capacity] [--vs-redis] [--vs-mooncake]
                                   [--degraded K] [--json]

**putget.** Without ``--config`` kvbench starts a temporary local 12-node cluster (real node processes) and stops
and removes it at the end; with ``--config`` it uses the running cluster that file describes (and deletes the
blocks it wrote when done). ``N`` worker threads, one client each, run:

1. *warm-up*: one batched put and get per worker, verified, not timed;
2. *fill* (untimed; ``--fresh`` skips it): the workers put for ``--duration`` seconds, delete it all and wait for
   the store to reuse the space (the temporary cluster's ``[gc] grace_s`` is 0.5 s). The timed puts then land in
   space the store has used and freed before, as in a cache that runs full, not in never-touched memory or file
   space (whose first-touch costs dominate a short run);
3. *put phase*: each worker loops batched puts (``put_from``, views of a preallocated buffer) of fresh random
   16-byte keys, ``--batch-bytes`` per call, for ``--duration`` seconds across the workers, or until ``--max-bytes``
   are stored (warm-up included; a cap that keeps Redis's and Mooncake's memory and the cluster's capacity
   bounded: ``stopped_by`` says which ended the phase);
4. *get phase*: each worker reads back every batch it stored, once, with ``get_into`` into a preallocated buffer
   (kvtier: through a second client that never wrote the blocks), and checks every byte (each block carries its
   key every 4 KiB, or at least once per erasure-code shard); a miss or a wrong byte stops kvbench with
   ``DATA MISMATCH`` and exit status 1;
5. kvtier only, without ``--degraded``: the get phase again with ``get``, which allocates the blocks it returns
   (``get_alloc``), the workers one after another;
6. with ``--degraded K`` (1 or 2; only on the temporary cluster): SIGKILL ``K`` nodes, then the get phase again.

``--fresh`` measures a new cluster (every put lands in file space never written); ``--at-capacity`` (temporary
cluster only) measures a full one: kvtier's cluster is sized so that it holds twice ``--max-bytes``, filled
past its capacity with other blocks first (untimed, instead of step 2), and every timed put must evict to make
room (the evictions fall on the fill's blocks, so every timed block is still there to read back).

Throughput is bytes over *busy time*: the time during which at least one call was in flight (key stamping and
verification between calls are not counted). Latencies are per call (one call moves one batch), nearest-rank
percentiles. Redis (``--vs-redis``: Debian ``redis-server`` on a free loopback port, no persistence, redis-py,
pipelined SET and MGET of the same batches) and Mooncake Store (``--vs-mooncake``: ``mooncake_master`` with its
HTTP metadata server, one store-server process holding the segment, protocol tcp on loopback, zero-copy
``batch_put_from`` / ``batch_get_into`` on registered buffers, client in its own process) run the same phases one
after another, never at the same time.

``--json`` prints one object::

    {"command": "putget",
     "settings": {"block_size", "batch_bytes", "blocks_per_call", "concurrency", "duration_s", "max_bytes",
                  "fill", "degraded"},
     "cluster": {"kind": "temporary" | "config", "path", "nodes", "codec_backend", "killed_nodes", "at_capacity",
                 "node_capacity" (temporary)},
     "kvtier":   {"raw_stream_gbps", "put": PHASE, "get": PHASE, "get_alloc": PHASE (without --degraded),
                  "get_degraded": PHASE (with --degraded)},
     "redis":    {"raw_stream_gbps", "version", "put": PHASE, "get": PHASE}          (with --vs-redis)
     "mooncake": {"raw_stream_gbps", "version", "put": PHASE, "get": PHASE}          (with --vs-mooncake)
     "verified_blocks": every block read back and checked, all systems and get phases}

    PHASE = {"bytes", "blocks", "calls", "busy_s", "wall_s", "gbps", "blocks_per_s", "ratio_to_raw",
             "latency_ms": {"p50", "p99", "p999"}, "stopped_by": "duration" | "max_bytes" (put only)}

Exit status: 0; 1 when a read came back wrong or missing, or a store failed; 2, with one ``kvbench: error:``
line on stderr, for a bad option, a missing or unreachable cluster, or a missing Redis or Mooncake.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvtier.kvstore.codec import DATA_SHARDS, PARITY_SHARDS
from kvtier.kvstore.node.slabs import MAX_SHARD_BYTES
from kvtier.kvstore.units import format_size, parse_duration, parse_size
from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvbench.common import ProgressView, RichProgress, UsageError
from kvtier.tools.kvbench.kvtier_run import run_kvtier
from kvtier.tools.kvbench.mooncake_run import check_mooncake, run_mooncake
from kvtier.tools.kvbench.phases import KEY_BYTES, Spec, verified_blocks
from kvtier.tools.kvbench.redis_run import check_redis, run_redis

MAX_BLOCKS_PER_CALL = 16384
MAX_CONCURRENCY = 64
MAX_BLOCK_BYTES = DATA_SHARDS * MAX_SHARD_BYTES


def register(commands: Subcommands) -> None:
    p = commands.add("putget", "put/get throughput and latency, against a raw loopback stream", putget)
    p.description = (
        "Put/get throughput and latency of kvtier (and optionally Redis and Mooncake Store), each as a ratio to one "
        "raw loopback TCP stream of the same bytes measured in the same run. Without --config, on a temporary local "
        "12-node cluster."
    )
    p.add_argument("--block-size", default="1MiB", metavar="SIZE", help="bytes per block (default 1MiB)")
    p.add_argument("--concurrency", default="1", metavar="N", help="worker threads, one client each (default 1)")
    p.add_argument("--duration", default="5", metavar="S", help="length of the put phase, e.g. 5 or 30s (default 5)")
    p.add_argument("--batch-bytes", default="16MiB", metavar="SIZE", help="bytes per put/get call (default 16MiB)")
    p.add_argument(
        "--max-bytes", default="4GiB", metavar="SIZE", help="stop the put phase once this much is stored (default 4GiB)"
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="skip the untimed fill pass: the timed puts land in space the store never used (first-touch costs)",
    )
    p.add_argument(
        "--at-capacity",
        action="store_true",
        help="kvtier's temporary cluster is first filled past its capacity (untimed), so the timed puts evict",
    )
    p.add_argument("--vs-redis", action="store_true", help="run the same phases against a local redis-server")
    p.add_argument("--vs-mooncake", action="store_true", help="run the same phases against a local Mooncake Store")
    p.add_argument(
        "--degraded", default="0", metavar="K", help="after the put phase, SIGKILL K nodes (1 or 2) and read again"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _spec_from_args(args: argparse.Namespace) -> Spec:
    def size(option: str, text: str) -> int:
        try:
            value = parse_size(text)
        except ValueError as exc:
            raise UsageError(f"{option}: {exc}") from None
        if value <= 0:
            raise UsageError(f"{option} {text!r}: must be positive")
        return value

    def integer(option: str, text: str, low: int, high: int) -> int:
        try:
            value = int(text)
        except ValueError:
            raise UsageError(f"{option} {text!r}: use a whole number") from None
        if not low <= value <= high:
            raise UsageError(f"{option} {text!r}: must be between {low} and {high}")
        return value

    block = size("--block-size", args.block_size)
    if block < KEY_BYTES:
        raise UsageError(f"--block-size {args.block_size!r}: must be at least {KEY_BYTES} B")
    if block > MAX_BLOCK_BYTES:
        raise UsageError(f"--block-size {args.block_size!r}: must be at most {format_size(MAX_BLOCK_BYTES)}")
    batch = size("--batch-bytes", args.batch_bytes)
    per_call = max(1, batch // block)
    if per_call > MAX_BLOCKS_PER_CALL:
        raise UsageError(
            f"--batch-bytes {args.batch_bytes} holds {per_call} blocks of {args.block_size}; at most "
            f"{MAX_BLOCKS_PER_CALL} per call: lower --batch-bytes"
        )
    concurrency = integer("--concurrency", args.concurrency, 1, MAX_CONCURRENCY)
    try:
        duration = parse_duration(args.duration)
    except ValueError as exc:
        raise UsageError(f"--duration: {exc}") from None
    max_bytes = size("--max-bytes", args.max_bytes)
    spec = Spec(block, per_call, concurrency, duration, max_bytes, fill=not (args.fresh or args.at_capacity))
    if max_bytes < 2 * concurrency * spec.batch_bytes:
        raise UsageError(
            f"--max-bytes {args.max_bytes}: must hold at least two batches per worker "
            f"({format_size(2 * concurrency * spec.batch_bytes)})"
        )
    return spec


def putget(args: argparse.Namespace) -> int:
    spec = _spec_from_args(args)
    degraded = int(args.degraded) if args.degraded.strip().isdigit() else -1
    if not 0 <= degraded <= PARITY_SHARDS:
        raise UsageError(
            f"--degraded {args.degraded!r}: must be 1 or 2 (RS(10,2) reads survive at most {PARITY_SHARDS} lost nodes)"
        )
    args.degraded = degraded
    if degraded and args.config is not None:
        raise UsageError(
            "--degraded kills nodes, which kvbench only does to a cluster it started itself; leave out --config"
        )
    if args.at_capacity and args.config is not None:
        raise UsageError("--at-capacity fills a cluster past its capacity, which kvbench only does to one it started")
    redis_exe = check_redis() if args.vs_redis else None
    mooncake_folder = check_mooncake() if args.vs_mooncake else None

    progress: ProgressView = ProgressView()
    if not args.json and sys.stderr.isatty():
        progress = RichProgress()
    try:
        kvtier, cluster = run_kvtier(args, spec, progress)
        report: dict[str, Any] = {
            "command": "putget",
            "settings": {**spec.to_dict(), "degraded": degraded},
            "cluster": cluster,
            "kvtier": kvtier,
        }
        if redis_exe is not None:
            report["redis"] = run_redis(redis_exe, spec, progress)
        if mooncake_folder is not None:
            report["mooncake"] = run_mooncake(mooncake_folder, spec, progress)
    finally:
        progress.close()
    report["verified_blocks"] = sum(verified_blocks(report[s]) for s in ("kvtier", "redis", "mooncake") if s in report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 0


def _print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    settings, cluster = report["settings"], report["cluster"]
    where = (
        f"temporary {cluster['nodes']}-node local cluster"
        if cluster["kind"] == "temporary"
        else f"cluster {cluster['path']} ({cluster['nodes']} nodes)"
    )
    title = (
        f"kvbench putget: {format_size(settings['block_size'])} blocks, {settings['blocks_per_call']} per call "
        f"({format_size(settings['batch_bytes'])}), concurrency {settings['concurrency']}, "
        f"{settings['duration_s']:g} s put phase\n{where}, codec {cluster['codec_backend']}"
    )
    table = Table(title=title)
    for name, justify in (
        ("system / phase", "left"),
        ("GB/s", "right"),
        ("x raw", "right"),
        ("blocks/s", "right"),
        ("p50 ms", "right"),
        ("p99 ms", "right"),
        ("p999 ms", "right"),
        ("calls", "right"),
        ("data", "right"),
        ("raw GB/s", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    killed = cluster["killed_nodes"]
    names = {
        "put": "put",
        "get": "get",
        "get_alloc": "get (allocating)",
        "get_degraded": f"get, node{'s' if len(killed) > 1 else ''} {', '.join(map(str, killed))} killed",
    }
    labels = {"kvtier": "kvtier", "redis": "redis (SET/MGET)", "mooncake": "mooncake (zero-copy)"}
    for system in ("kvtier", "redis", "mooncake"):
        if system not in report:
            continue
        result = report[system]
        for phase in ("put", "get", "get_alloc", "get_degraded"):
            if phase not in result:
                continue
            r = result[phase]
            lat = r["latency_ms"]
            table.add_row(
                f"{labels[system]} {names[phase]}",
                f"{r['gbps']:.2f}",
                f"{r['ratio_to_raw']:.2f}x" if r["ratio_to_raw"] is not None else "-",
                f"{r['blocks_per_s']:,.0f}",
                f"{lat['p50']:.2f}",
                f"{lat['p99']:.2f}",
                f"{lat['p999']:.2f}",
                f"{r['calls']:,}",
                format_size(r["bytes"]),
                f"{result['raw_stream_gbps']:.2f}",
            )
    console = Console(width=None if sys.stdout.isatty() else 140)
    console.print(table)
    notes = []
    capped = [
        s for s in ("kvtier", "redis", "mooncake") if s in report and report[s]["put"]["stopped_by"] == "max_bytes"
    ]
    if capped:
        cap = format_size(settings["max_bytes"])
        notes.append(
            f"put phase stopped before {settings['duration_s']:g} s at --max-bytes ({cap}): {', '.join(capped)}"
        )
    if cluster.get("at_capacity"):
        notes.append(
            f"--at-capacity: kvtier's cluster ({format_size(cluster['node_capacity'])} a node) was filled past its "
            "capacity first; every timed put made room by evicting"
        )
    elif not settings["fill"]:
        notes.append("--fresh: the timed puts went into space the stores had never used")
    notes.append(f"{report['verified_blocks']:,} blocks read back and verified byte for byte")
    notes.append("x raw: GB/s over that of one raw loopback TCP stream of the same bytes, measured in the same run")
    for note in notes:
        console.print(note, highlight=False)
