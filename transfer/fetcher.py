"""``kvtier-fetcher``: one process per engine host that reads blocks from the store into the host staging pool.

    kvtier-fetcher --config cluster.public.toml --socket PATH [--socket-group GROUP] [--size 8GiB]
                   [--slot-size 1MiB[,64KiB…]] [--shm LABEL] [--write-window 64MiB] [--workers 2]
                   [--metrics HOST:PORT] [--token-file PATH]
    kvtier-fetcher status --config cluster.toml --socket PATH [--json]

It serves every tenant of the file it is given, and holds none of their tokens: give it the client file
(``cluster.public.toml``: the tokens' hashes only), and each engine authenticates with its own tenant's token, which
the fetcher then presents to the store for that tenant's requests (``fetch_server``, "Credentials"). Given the
cluster file it keeps only the hashes too. With ``--token-file`` (or ``$KVTIER_TOKEN``) it serves that token's
tenant alone. ``--socket-group GROUP`` serves engines of other uids, each tenant's under a uid of its own (the
deployment docs/transfer.md §6 asks for); without it, engines run as the fetcher's uid.

Two processes: a **supervisor** (the command itself) and the **server** it runs as its child, as ``kvstore serve``
runs the nodes. A server that dies, whatever killed it, is logged with how it died (its exit code, or the signal
and what it means; a fault also leaves the Python stacks of its threads in the log, ``faulthandler``) and
restarted after a back-off (``children.Backoff``: 1 s, doubling while it keeps dying, up to 60 s); engines
reconnect by themselves. The server ends with its supervisor (``children.ended_with``); SIGTERM to the supervisor stops
both.

The server: its host pool (:class:`~kvtier.transfer.host_pool.HostPool`: segments per tenant and size class, made on
first use, in anonymous memory files that no other process can open by name), the request server
(:class:`~kvtier.transfer.fetch_server.Fetcher`, whose docstring has the procedure), signals, ``/metrics``; and
:class:`LocalFetcher`, which runs one as a child process. The server makes itself non-dumpable, so that another
process of its uid can neither trace it nor open its ``/proc/PID/fd`` or ``/proc/PID/mem``. Its memory goes with
it: a restarted server starts with an empty pool (the blocks are still in the store).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import grp
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from kvtier.kvstore import logs
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster import map as cluster_map
from kvtier.kvstore.cluster.children import Backoff, ended_with, exit_reason
from kvtier.kvstore.units import format_size, parse_size
from kvtier.transfer.conn import parse_addr
from kvtier.transfer.fetch_server import Fetcher
from kvtier.transfer.hardening import not_dumpable
from kvtier.transfer.host_pool import COUNTERS, HostPool
from kvtier.transfer.metrics import admin_only, serve_metrics
from kvtier.transfer.staging import PoolError, check_name

log = logging.getLogger("kvtier.fetcher")
READY = "ready"  # what the server, then the supervisor, prints once engines can connect
STOP_WAIT_S = 10.0  # a server asked to stop that is still running after this is killed


class LocalFetcher:
    """A ``kvtier-fetcher`` (its supervisor and server) as child processes of this one (tests, benchmarks, the demo):
    start, kill, restart."""

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
        self.proc: subprocess.Popen[bytes] | None = None  # the supervisor
        self.server_pid = 0  # its server, as it was when it reported ready

    def start(self, timeout_s: float = 30.0) -> LocalFetcher:
        """Start it and return once it serves; raises RuntimeError with its last log line if it does not."""
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=log_file)
        assert self.proc.stdout is not None
        ready = select.select([self.proc.stdout], [], [], timeout_s)[0]
        said = self.proc.stdout.readline().split() if ready else []
        if said[:1] != [READY.encode()]:
            self.kill()
            tail = self.log_path.read_text(errors="replace").strip()[-500:]
            raise RuntimeError(f"kvtier-fetcher did not start: {tail}")
        self.server_pid = int(said[-1])
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the server and its supervisor and wait for both to end (SIGKILL: nothing is cleaned up,
        as in a crash; SIGTERM: the supervisor stops its server cleanly)."""
        if self.proc is None:
            return
        if sig == signal.SIGKILL and self.server_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.server_pid, sig)
        self.proc.send_signal(sig)
        self.proc.communicate()
        self.proc = None
        while self.server_pid and _alive(self.server_pid):  # (a child of the supervisor: reaped by init)
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop it cleanly (SIGTERM)."""
        self.kill(signal.SIGTERM)

    def __enter__(self) -> LocalFetcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"
    except OSError:
        return False


# -- command line ---------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier-fetcher", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config",
        required=True,
        help="the client file cluster.public.toml (or the cluster file): engines of its tenants authenticate with "
        "their own tokens; status: a file and token to ask with",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        help=f"file holding a tenant token (mode 0600; or ${cluster_mod.TOKEN_ENV}): serve that tenant only",
    )
    parser.add_argument("--socket", required=True, type=Path, help="Unix socket engines connect to")
    parser.add_argument(
        "--socket-group",
        help="serve engines of other uids in this group (name or gid): the socket is made 0660 in that group",
    )
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
    parser.add_argument("--server", type=int, metavar="PID", help=argparse.SUPPRESS)  # the child of supervisor PID
    parser.add_argument("command", nargs="?", choices=["serve", "status"], default="serve")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.server and ended_with(args.server):
        return 0
    try:
        token = cluster_mod.read_token_file(args.token_file) if args.token_file else None
        if args.command == "status":
            return _status(args, cluster_map.load_client(args.config, token))
        config = cluster_map.load_verifier(args.config, token or os.environ.get(cluster_mod.TOKEN_ENV))
        group = _group(args.socket_group)
        _socket_folder(args.socket, group)
        host = _host_pool(args, config)
    except (ValueError, PoolError, OSError) as exc:
        print(f"kvtier-fetcher: {exc}", file=sys.stderr)
        return 2
    if args.server:
        return _serve(args, config, host, group)
    return _supervise(argv)


def _supervise(argv: list[str]) -> int:
    """Run the server as a child and restart it whenever it dies (see the module docstring); returns once stopped
    by SIGTERM or SIGINT, or 2 if the first server does not start (its reason is in the log already)."""
    logs.configure(component="fetcher", role="supervisor")
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    backoff, first = Backoff(), True
    # the server ends with this process (children.ended_with): not a preexec_fn, this process has gRPC threads
    # with an etcd cluster map
    command = [sys.executable, "-m", "kvtier.transfer.fetcher", *argv, "--server", str(os.getpid())]
    while not stopping.is_set():
        server = subprocess.Popen(command, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        backoff.started_now()
        assert server.stdout is not None
        said = server.stdout.readline().split()
        if said[:1] == [READY.encode()] and first:
            print(READY, "pid", server.pid, flush=True)
            first = False
        elif said[:1] == [READY.encode()]:
            log.info("the fetcher's server restarted: pid %d", server.pid)
        elif first:
            server.wait()
            return 2
        while server.poll() is None and not stopping.wait(0.2):
            pass
        if stopping.is_set():
            _stop(server)
            break
        wait = backoff.exited()
        log.error(
            "the fetcher's server (pid %d) %s; restarting it in %g s", server.pid, exit_reason(server.returncode), wait
        )
        stopping.wait(wait)
    return 0


def _stop(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not ended within ``STOP_WAIT_S``."""
    server.terminate()
    try:
        server.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _serve(args: argparse.Namespace, config: cluster_mod.ClusterConfig, host: HostPool, group: int | None) -> int:
    """The server: serve until SIGTERM or SIGINT. A fault dumps every thread's Python stack into the log before the
    process dies of it (the supervisor then logs the signal)."""
    logs.configure(component="fetcher", shm=args.shm)
    faulthandler.enable()
    if not not_dumpable():
        log.warning("could not make the fetcher non-dumpable: other processes of its uid may read its memory")
    try:
        fetcher = Fetcher(config, host, args.socket, max(1, args.workers), group)
    except (PoolError, OSError) as exc:
        print(f"kvtier-fetcher: {exc}", file=sys.stderr)
        return 2
    if args.metrics:
        try:
            counters = frozenset((*COUNTERS, "hits", "misses"))
            admin = admin_only(config)
            serve_metrics("fetcher", parse_addr(args.metrics), fetcher.stats, counters, config.limits, admin)
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
    print(READY, flush=True)
    try:
        fetcher.serve_forever()
    except Exception:
        log.exception("the fetcher's server failed")
        raise
    finally:
        fetcher.close()
    return 0


def _group(name: str | None) -> int | None:
    """The gid ``--socket-group`` names (a group name or a number); ValueError naming it when there is none."""
    if name is None:
        return None
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ValueError(f"--socket-group: no group {name!r} on this host") from None


def _socket_folder(socket_path: Path, group: int | None) -> None:
    """Create the socket's folder when it is missing: mode 0700 (the socket is for this user's engines, as in
    ``/run/kvtier``), or 0750 in ``group`` (its members' engines must reach the socket); ValueError naming the folder
    when it cannot be made."""
    folder = socket_path.parent
    try:
        if not folder.is_dir() and group is not None:
            folder.mkdir(mode=0o750, parents=True)
            os.chown(folder, -1, group)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create the socket's folder {folder}: {exc.strerror or exc}") from None


def _host_pool(args: argparse.Namespace, config: cluster_mod.ClusterConfig) -> HostPool:
    """The pool the command line asks for (nothing is allocated yet: segments are made as tenants use them)."""
    declared = [parse_size(s) for s in args.slot_size.split(",") if s.strip()]
    if any(size <= 0 for size in declared):
        raise ValueError(f"--slot-size takes positive sizes, got {args.slot_size!r}")
    size, window = parse_size(args.size), parse_size(args.write_window)
    if size <= 0 or window <= 0:
        raise ValueError("--size and --write-window must be positive")
    return HostPool(check_name(args.shm), size, list(config.tenants), declared, window)


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
