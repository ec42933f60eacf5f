"""``kvtier-directory``: which host holds which StateBlock, in memory only.

    kvtier-directory --config cluster.toml --listen 127.0.0.1:7400 --lease 10s

State: ``(tenant, state key) → (host, slot, generation)`` and, per host, its pull address and the time of its
last heartbeat. Rules:

1. A host REGISTERs what it holds (``full`` on first contact: replaces anything known for it) and heartbeats
   every ``lease / 3``. A partial REGISTER from a host the directory does not know is answered ``known = False``
   and recorded nowhere: the host re-reports everything.
2. A host silent for longer than the lease loses all its entries (it died, or its network did); its next
   heartbeat is answered ``known = False`` and it re-reports everything it still holds.
3. A restarted directory knows nothing; hosts learn it from ``known = False`` and re-report, so it is rebuilt
   within one heartbeat period. Nothing is on disk.
4. An entry may be stale (the slot was reused since): the pull then answers a miss, never other bytes, because
   it names the generation. Directory answers are hints; the holder's generation check is the truth.

Every connection authenticates with the cluster or a tenant token; a tenant sees only its own entries.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.kvstore import cluster as cluster_mod
from kvtier.kvstore import cluster_map, logs, wire
from kvtier.kvstore.protocol import ErrorCode, Frame, ProtocolError
from kvtier.kvstore.units import parse_duration
from kvtier.transfer import state_protocol as sp
from kvtier.transfer.conn import FrameConn, PeerError, parse_addr, serve_connections, tcp
from kvtier.transfer.fetch_protocol import Entries, entries_meta, parse_entries
from kvtier.transfer.metrics import admin_only, serve_metrics
from kvtier.transfer.state_protocol import Location, StateOp

log = logging.getLogger("kvtier.directory")
COUNTERS = ("keys_looked_up", "keys_found", "hosts_expired", "full_reports")


class DirectoryError(PeerError):
    """The directory is unreachable or refused a request."""


@dataclass
class _Host:
    addr: tuple[str, int]
    last_seen: float
    keys: set[bytes] = field(default_factory=set)


class Directory:
    """The directory's state and rules, without sockets (thread-safe)."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self.clock = clock
        self._lock = threading.Lock()
        self._hosts: dict[tuple[str, str], _Host] = {}  # (tenant, host id)
        self._entries: dict[tuple[str, bytes], tuple[str, int, int]] = {}  # (tenant, key) -> host, slot, gen
        self.counts = dict.fromkeys(COUNTERS, 0)

    def register(self, tenant: str, host: str, addr: tuple[str, int], entries: Entries, full: bool) -> bool:
        """Record the host's entries; ``full`` replaces all it had. False, recording nothing: a partial report
        from a host this directory does not know (it restarted, or the host's lease ran out), which must re-report
        everything it holds (``full``) instead, or its other StateBlocks would never be found."""
        with self._lock:
            self._expire()
            record = self._hosts.get((tenant, host))
            if record is None and not full:
                return False
            if record is None or full:
                self.counts["full_reports"] += full
                if record is not None:
                    self._drop_entries(tenant, host, record)
                record = self._hosts[(tenant, host)] = _Host(addr, self.clock())
            record.addr, record.last_seen = addr, self.clock()
            for key, slot, gen in zip(entries.keys, entries.slots.tolist(), entries.gens.tolist(), strict=True):
                previous = self._entries.get((tenant, key))
                if previous is not None and previous[0] != host:
                    other = self._hosts.get((tenant, previous[0]))
                    if other is not None:
                        other.keys.discard(key)
                self._entries[(tenant, key)] = (host, slot, gen)
                record.keys.add(key)
            return True

    def unregister(self, tenant: str, host: str, entries: Entries) -> None:
        with self._lock:
            record = self._hosts.get((tenant, host))
            for key, slot, gen in zip(entries.keys, entries.slots.tolist(), entries.gens.tolist(), strict=True):
                if self._entries.get((tenant, key)) == (host, slot, gen):
                    del self._entries[(tenant, key)]
                    if record is not None:
                        record.keys.discard(key)

    def heartbeat(self, tenant: str, host: str) -> bool:
        """Renew the host's lease; False if the directory does not know it (it must re-report)."""
        with self._lock:
            self._expire()
            record = self._hosts.get((tenant, host))
            if record is None:
                return False
            record.last_seen = self.clock()
            return True

    def lookup(self, tenant: str, keys: list[bytes]) -> dict[str, Any]:
        n = len(keys)
        hosts, slots, gens = np.full(n, -1, np.int16), np.zeros(n, np.uint32), np.zeros(n, np.uint64)
        addrs: list[tuple[str, int]] = []
        index: dict[str, int] = {}
        with self._lock:
            self._expire()
            for i, key in enumerate(keys):
                entry = self._entries.get((tenant, key))
                if entry is None:
                    continue
                host, slots[i], gens[i] = entry
                if host not in index:
                    index[host] = len(addrs)
                    addrs.append(self._hosts[(tenant, host)].addr)
                hosts[i] = index[host]
            self.counts["keys_looked_up"] += n
            self.counts["keys_found"] += int((hosts >= 0).sum())
        return sp.lookup_reply(hosts, addrs, slots, gens)

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._expire()
            return {"hosts": len(self._hosts), "entries": len(self._entries), **self.counts}

    def _expire(self) -> None:
        deadline = self.clock() - self.lease_s
        for (tenant, host), record in list(self._hosts.items()):
            if record.last_seen < deadline:
                log.info("host %s lost its lease: %d entries dropped", host, len(record.keys))
                self.counts["hosts_expired"] += 1
                self._drop_entries(tenant, host, record)
                del self._hosts[(tenant, host)]

    def _drop_entries(self, tenant: str, host: str, record: _Host) -> None:
        for key in record.keys:
            if self._entries.get((tenant, key), ("",))[0] == host:
                del self._entries[(tenant, key)]
        record.keys.clear()

    def handle(self, tenant: str, frame: Frame, limits_batch: int) -> dict[str, Any]:
        """One request (already authenticated as ``tenant``) → reply metadata; ProtocolError if malformed."""
        meta = frame.meta
        if frame.opcode == StateOp.REGISTER:
            full = meta.get("full") is True
            entries = parse_entries(meta, limits_batch)
            return {"known": self.register(tenant, sp.host_field(meta), sp.addr_field(meta), entries, full)}
        if frame.opcode == StateOp.UNREGISTER:
            self.unregister(tenant, sp.host_field(meta), parse_entries(meta, limits_batch))
            return {}
        if frame.opcode == StateOp.HEARTBEAT:
            return {"known": self.heartbeat(tenant, sp.host_field(meta))}
        if frame.opcode == StateOp.LOOKUP:
            return self.lookup(tenant, wire.unpack_keys(meta, limits_batch))
        if frame.opcode == StateOp.STATS:
            return self.stats()
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown opcode {frame.opcode}")


class DirectoryClient:
    """A host's or engine's connection to the directory. Raises :class:`DirectoryError` when it is down."""

    def __init__(self, addr: tuple[str, int], token: str, timeout_s: float = 5.0) -> None:
        where = f"the directory at {addr[0]}:{addr[1]}"
        self.conn = FrameConn(tcp(addr, timeout_s), token, where, DirectoryError, idempotent=True)

    def register(
        self, host: str, addr: tuple[str, int], keys: list[bytes], slots: list[int], gens: list[int], full: bool
    ) -> bool:
        """True if recorded; False: the directory does not know this host, so a partial report (``full=False``)
        was dropped and the host must re-register everything (``full=True``)."""
        meta = {"host": host, "addr": list(addr), "full": full, **entries_meta(keys, slots, gens)}
        return bool(self.conn.call(StateOp.REGISTER, meta).meta.get("known"))

    def unregister(self, host: str, keys: list[bytes], slots: list[int], gens: list[int]) -> None:
        self.conn.call(StateOp.UNREGISTER, {"host": host, **entries_meta(keys, slots, gens)})

    def heartbeat(self, host: str) -> bool:
        """True if the directory knows this host; False: re-register everything (``full=True``)."""
        return bool(self.conn.call(StateOp.HEARTBEAT, {"host": host}).meta.get("known"))

    def lookup(self, keys: list[bytes]) -> list[Location | None]:
        """Where each key's StateBlock is, per key (None: no host reported it)."""
        blob, klen = wire.pack_keys(keys)
        return sp.parse_lookup(self.conn.call(StateOp.LOOKUP, {"keys": blob, "klen": klen}).meta, len(keys))

    def stats(self) -> dict[str, int]:
        return dict(self.conn.call(StateOp.STATS, {}).meta)

    def close(self) -> None:
        self.conn.close()


def serve(
    config: cluster_mod.ClusterConfig, listener: socket.socket, directory: Directory, stopping: threading.Event
) -> None:
    batch = config.limits.max_batch

    def handle(tenant: str, frame: Frame, _sock: socket.socket) -> tuple[dict[str, Any], tuple[()]]:
        return directory.handle(tenant, frame, batch), ()

    serve_connections(listener, config, sp.DIRECTORY_REQUESTS, handle, stopping, log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier-directory", description="Where StateBlocks are (in memory).")
    parser.add_argument("--config", required=True, help="cluster file: the tokens hosts and engines present")
    parser.add_argument("--listen", default="127.0.0.1:7400", help="HOST:PORT (port 0: any free port)")
    parser.add_argument("--lease", default="10s", help="a host silent this long loses its entries")
    parser.add_argument("--metrics", help="serve /metrics and /health on HOST:PORT")
    args = parser.parse_args(argv)
    try:
        config = cluster_map.load(args.config)
        lease_s = parse_duration(args.lease)
        listener = socket.create_server(parse_addr(args.listen))
        directory = Directory(lease_s)
        if args.metrics:
            counters, admin = frozenset(COUNTERS), admin_only(config)
            serve_metrics("directory", parse_addr(args.metrics), directory.stats, counters, config.limits, admin)
    except (ValueError, OSError) as exc:
        print(f"kvtier-directory: {exc}", file=sys.stderr)
        return 2
    logs.configure(component="directory")
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    host, port = listener.getsockname()[:2]
    print(f"ready {host}:{port}", flush=True)
    serve(config, listener, directory, stopping)
    listener.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
