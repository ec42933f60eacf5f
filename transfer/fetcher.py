"""``kvtier-fetcher``: one process per engine host that reads blocks from the store into the host staging pool.

    kvtier-fetcher --config cluster.toml --shm NAME --size 8GiB --slot-size 1MiB[,64KiB…] --socket PATH
                   [--workers 2] [--metrics HOST:PORT]
    kvtier-fetcher status --config cluster.toml --socket PATH [--json]

The process: its segments (one per size class), the server (:class:`~kvtier.transfer.fetch_server.Fetcher`, whose
docstring has the procedure), signals, ``/metrics``; and :class:`LocalFetcher`, which runs one as a child process.
A clean stop (SIGTERM, SIGINT) removes the segments; after a crash the next fetcher takes them over.
"""

from __future__ import annotations

import argparse
import json
import logging
import select
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from kvtier.kvstore import cluster as cluster_mod
from kvtier.kvstore import logs
from kvtier.kvstore.units import format_size, parse_size
from kvtier.transfer import staging
from kvtier.transfer.conn import parse_addr
from kvtier.transfer.fetch_server import COUNTERS, Fetcher
from kvtier.transfer.metrics import serve_metrics
from kvtier.transfer.staging import PoolError, StagingPool, class_names

log = logging.getLogger("kvtier.fetcher")


class LocalFetcher:
    """A ``kvtier-fetcher`` child process (tests, benchmarks, the demo): start, kill, restart."""

    def __init__(
        self,
        config_path: Path,
        shm: str,
        socket_path: Path,
        size: str,
        slot_size: str,
        workers: int = 2,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.argv = [
            sys.executable, "-m", "kvtier.transfer.fetcher", "--config", str(config_path), "--shm", shm,
            "--size", size, "--slot-size", slot_size, "--socket", str(socket_path), "--workers", str(workers),
            *extra_args,
        ]  # fmt: skip
        self.shm = shm
        self.slot_sizes = sorted({parse_size(s) for s in slot_size.split(",")})
        self.socket_path = socket_path
        self.log_path = socket_path.with_name(socket_path.name + ".log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> LocalFetcher:
        """Start it and return once it serves; raises RuntimeError with its last log line if it does not."""
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=log_file)
        assert self.proc.stdout is not None
        ready = select.select([self.proc.stdout], [], [], timeout_s)[0]
        if not ready or self.proc.stdout.readline().strip() != b"ready":
            self.kill()
            tail = self.log_path.read_text(errors="replace").strip()[-500:]
            raise RuntimeError(f"kvtier-fetcher did not start: {tail}")
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` and wait for the process to end (SIGKILL: nothing is cleaned up, as in a crash)."""
        if self.proc is not None:
            self.proc.send_signal(sig)
            self.proc.communicate()
            self.proc = None

    def stop(self) -> None:
        """Stop it cleanly (SIGTERM) and remove its segments (also when it had died: they outlive a crash)."""
        self.kill(signal.SIGTERM)
        for segment in class_names(self.shm, self.slot_sizes):
            staging.unlink(segment)

    def __enter__(self) -> LocalFetcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- command line ---------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier-fetcher", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="cluster file (the store, and the tokens engines present)")
    parser.add_argument("--socket", required=True, type=Path, help="Unix socket engines connect to")
    parser.add_argument("--shm", help="shared-memory segment name (under /dev/shm)")
    parser.add_argument("--size", default="1GiB", help="pool capacity, e.g. 8GiB (shared equally by the size classes)")
    parser.add_argument(
        "--slot-size", default="1MiB", help="slot size, or size classes (64KiB,1MiB): a block takes the smallest fit"
    )
    parser.add_argument("--workers", type=int, default=2, help="threads calling the store")
    parser.add_argument("--metrics", help="serve /metrics and /health on HOST:PORT")
    parser.add_argument("--json", action="store_true", help="status: print JSON")
    parser.add_argument("command", nargs="?", choices=["serve", "status"], default="serve")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = cluster_mod.load(args.config)
        if args.command == "status":
            return _status(args, config)
        if not args.shm:
            raise ValueError("--shm NAME is required to serve")
        pools = _own_pools(args.shm, parse_size(args.size), args.slot_size)
    except (ValueError, PoolError, OSError) as exc:
        print(f"kvtier-fetcher: {exc}", file=sys.stderr)
        return 2
    logs.configure(component="fetcher", shm=args.shm)
    try:
        fetcher = Fetcher(config, pools, args.socket, max(1, args.workers))
    except (PoolError, OSError) as exc:
        print(f"kvtier-fetcher: {exc}", file=sys.stderr)
        _give_back(pools, created_only=True)
        return 2
    if args.metrics:
        try:
            serve_metrics("fetcher", parse_addr(args.metrics), fetcher.stats, frozenset((*COUNTERS, "hits", "misses")))
        except (ValueError, OSError) as exc:
            print(f"kvtier-fetcher: --metrics: {exc}", file=sys.stderr)
            fetcher.close()
            _give_back(pools, created_only=True)
            return 2
    signal.signal(signal.SIGTERM, lambda *_: fetcher.stop())
    signal.signal(signal.SIGINT, lambda *_: fetcher.stop())
    for pool in pools:
        log.info(
            "serving %s on %s: %d slots of %s (%d reclaimed)",
            pool.name,
            args.socket,
            pool.slots,
            format_size(pool.slot_bytes),
            pool.reclaimed,
        )
    print("ready", flush=True)
    fetcher.serve_forever()
    fetcher.close()
    _give_back(pools)  # a clean stop gives the memory back; after a crash the next fetcher takes it over
    return 0


def _give_back(pools: list[StagingPool], created_only: bool = False) -> None:
    """Close the segments this process owns and unlink them: all of them (a clean stop), or, for a start that
    failed, only those it created (a dead writer's segment it took over keeps its cached blocks)."""
    for pool in pools:
        pool.close()
        if pool.created or not created_only:
            staging.unlink(pool.name)


def _own_pools(name: str, capacity_bytes: int, slot_sizes: str) -> list[StagingPool]:
    """One segment per size class (``--slot-size 64KiB,1MiB``), each with an equal share of the capacity."""
    sizes = sorted({parse_size(s) for s in slot_sizes.split(",")})
    if len(sizes) > 255:
        raise ValueError("at most 255 size classes")
    pools: list[StagingPool] = []
    try:
        for segment, size in zip(class_names(name, sizes), sizes, strict=True):
            pools.append(StagingPool.own(segment, capacity_bytes // len(sizes), size))
    except BaseException:
        for pool in pools:
            pool.close()
        raise
    return pools


def _status(args: argparse.Namespace, config: cluster_mod.ClusterConfig) -> int:
    from kvtier.transfer.fetch_client import FetchClient, FetcherError

    try:
        with FetchClient(args.socket, config.token) as client:
            stats = client.stats()
    except FetcherError as exc:
        print(f"kvtier-fetcher: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    used = stats["slots"] - stats["free"]
    print(
        f"pool      {used}/{stats['slots']} slots of {', '.join(format_size(s) for s in stats['slot_sizes'])} "
        f"({format_size(stats['used_bytes'])} held): {stats['ready']} ready, {stats['pinned']} pinned, "
        f"{stats['filling']} filling"
    )
    print(
        f"hits      {stats['hits']} of {stats['hits'] + stats['misses']} blocks "
        f"(hit ratio {stats['hit_ratio']:.1%}), {stats['evictions']} evictions"
    )
    print(
        f"in flight {stats['in_flight']} blocks, {stats['queued_jobs']} store calls queued, "
        f"{stats['sessions']} engine connections"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
