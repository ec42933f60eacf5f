"""``kvtier-fetcher``: one process per engine host that reads blocks from the store into the host staging pool.

    kvtier-fetcher --config cluster.toml --socket PATH [--size 8GiB] [--slot-size 1MiB[,64KiB…]] [--shm LABEL]
                   [--write-window 64MiB] [--workers 2] [--metrics HOST:PORT] [--token-file PATH]
    kvtier-fetcher status --config cluster.toml --socket PATH [--json]

Given the cluster file it serves every tenant; given the client file (``cluster.public.toml``, no tokens) and a
tenant token (``--token-file``, ``$KVTIER_TOKEN``) it serves that tenant alone and never sees the others' tokens.

The process: its host pool (:class:`~kvtier.transfer.host_pool.HostPool`: segments per tenant and size class, made
on first use, in anonymous memory files that no other process can open by name), the server
(:class:`~kvtier.transfer.fetch_server.Fetcher`, whose docstring has the procedure), signals, ``/metrics``; and
:class:`LocalFetcher`, which runs one as a child process. The process makes itself non-dumpable, so that another
process of its uid can neither trace it nor open its ``/proc/PID/fd`` or ``/proc/PID/mem``. Its memory goes with it:
a restarted fetcher starts with an empty pool (the blocks are still in the store).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import select
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from kvtier.kvstore import cluster as cluster_mod
from kvtier.kvstore import cluster_map, logs
from kvtier.kvstore.units import format_size, parse_size
from kvtier.transfer.conn import parse_addr
from kvtier.transfer.fetch_server import Fetcher
from kvtier.transfer.host_pool import COUNTERS, HostPool
from kvtier.transfer.metrics import serve_metrics
from kvtier.transfer.staging import PoolError, check_name

log = logging.getLogger("kvtier.fetcher")
_PR_SET_DUMPABLE = 4


class LocalFetcher:
    """A ``kvtier-fetcher`` child process (tests, benchmarks, the demo): start, kill, restart."""

    def __init__(
        self,
        config_path: Path,
        shm: str,
        socket_path: Path,
        size: str,
        slot_size: str | None = None,
        workers: int = 2,
        extra_args: Sequence[str] = (),
    ) -> None:
        """``slot_size``: declared size classes (``--slot-size``); None: every class made for the blocks asked."""
        self.argv = [
            sys.executable, "-m", "kvtier.transfer.fetcher", "--config", str(config_path), "--shm", shm,
            "--size", size, "--socket", str(socket_path), "--workers", str(workers),
            *(["--slot-size", slot_size] if slot_size else []), *extra_args,
        ]  # fmt: skip
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
        """Stop it cleanly (SIGTERM)."""
        self.kill(signal.SIGTERM)

    def __enter__(self) -> LocalFetcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- command line ---------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier-fetcher", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config",
        required=True,
        help="cluster file (serves every tenant), or its client file cluster.public.toml with a tenant token "
        f"(--token-file or ${cluster_mod.TOKEN_ENV}: serves that tenant only)",
    )
    parser.add_argument("--token-file", type=Path, help="file holding a tenant token (mode 0600)")
    parser.add_argument("--socket", required=True, type=Path, help="Unix socket engines connect to")
    parser.add_argument(
        "--shm", default="kvtier-fetcher", help="label of the pool's memory files (none is made in /dev/shm)"
    )
    parser.add_argument(
        "--size", default="1GiB", help="pool capacity, e.g. 8GiB, shared equally by the cluster file's tenants"
    )
    parser.add_argument(
        "--slot-size",
        default="",
        help="size classes, e.g. 64KiB,1MiB: a block takes the smallest that holds it (default: none; a larger "
        "block gets a class of its own size on first use)",
    )
    parser.add_argument(
        "--write-window", default="64MiB", help="per tenant and size class: slots engines write blocks to store into"
    )
    parser.add_argument("--workers", type=int, default=2, help="threads calling the store")
    parser.add_argument("--metrics", help="serve /metrics and /health on HOST:PORT")
    parser.add_argument("--json", action="store_true", help="status: print JSON")
    parser.add_argument("command", nargs="?", choices=["serve", "status"], default="serve")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        token = cluster_mod.read_token_file(args.token_file) if args.token_file else None
        config = cluster_map.load_client(args.config, token)
        if args.command == "status":
            return _status(args, config)
        _socket_folder(args.socket)
        host = _host_pool(args, config)
    except (ValueError, PoolError, OSError) as exc:
        print(f"kvtier-fetcher: {exc}", file=sys.stderr)
        return 2
    logs.configure(component="fetcher", shm=args.shm)
    _not_dumpable()
    try:
        fetcher = Fetcher(config, host, args.socket, max(1, args.workers))
    except (PoolError, OSError) as exc:
        print(f"kvtier-fetcher: {exc}", file=sys.stderr)
        return 2
    if args.metrics:
        try:
            counters = frozenset((*COUNTERS, "hits", "misses"))
            serve_metrics("fetcher", parse_addr(args.metrics), fetcher.stats, counters, config.limits)
        except (ValueError, OSError) as exc:
            print(f"kvtier-fetcher: --metrics: {exc}", file=sys.stderr)
            fetcher.close()
            return 2
    signal.signal(signal.SIGTERM, lambda *_: fetcher.stop())
    signal.signal(signal.SIGINT, lambda *_: fetcher.stop())
    tenants = len(host.tenants)
    classes = ", ".join(format_size(s) for s in host.declared) or "made for the blocks asked"
    log.info(
        "serving on %s: %s for %d tenants (%s each), size classes %s",
        args.socket,
        format_size(host.size_bytes),
        tenants,
        format_size(host.size_bytes // tenants),
        classes,
    )
    print("ready", flush=True)
    fetcher.serve_forever()
    fetcher.close()
    return 0


def _socket_folder(socket_path: Path) -> None:
    """Create the socket's folder when it is missing (mode 0700: the socket is for this user's engines, as in
    ``/run/kvtier``); ValueError naming the folder when it cannot be made."""
    try:
        socket_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create the socket's folder {socket_path.parent}: {exc.strerror or exc}") from None


def _host_pool(args: argparse.Namespace, config: cluster_mod.ClusterConfig) -> HostPool:
    """The pool the command line asks for (nothing is allocated yet: segments are made as tenants use them)."""
    declared = [parse_size(s) for s in args.slot_size.split(",") if s.strip()]
    if any(size <= 0 for size in declared):
        raise ValueError(f"--slot-size takes positive sizes, got {args.slot_size!r}")
    size, window = parse_size(args.size), parse_size(args.write_window)
    if size <= 0 or window <= 0:
        raise ValueError("--size and --write-window must be positive")
    return HostPool(check_name(args.shm), size, list(config.tenants), declared, window)


def _not_dumpable() -> None:
    """Refuse other processes of this uid ``ptrace`` and ``/proc/PID/{fd,mem}`` (the segments' descriptors)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        log.warning("could not make the fetcher non-dumpable (errno %d)", ctypes.get_errno())


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
    print(
        f"pool      {format_size(stats['used_bytes'])} of blocks held: {stats['ready']} ready, {stats['pinned']} "
        f"pinned, {stats['filling']} filling; {format_size(stats['touched_bytes'])} of "
        f"{format_size(stats['capacity_bytes'])} touched, {stats['segments']} segments"
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
