"""``kvtier-directory``: which host holds which StateBlock, in memory only.

    kvtier-directory --config cluster.toml --listen 127.0.0.1:7400 --lease 10s [--max-bytes 256MiB]

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

Every connection authenticates with the cluster or a tenant token; a tenant sees only its own entries and counts
(the cluster token: everyone's). Each tenant's entries and hosts take at most an equal share of ``--max-bytes``
(charged ``ENTRY_BYTES`` an entry and ``HOST_BYTES`` a host, what they cost the process, plus their keys' and names'
bytes): a REGISTER records what fits and answers how many it ``dropped``, and a new host beyond the share is
refused BUSY, so no tenant's entries can crowd out another's or grow the directory without bound.
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

from kvtier.kvstore import logs
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster import map as cluster_map
from kvtier.kvstore.units import parse_duration, parse_size
from kvtier.kvstore.wire import fields as wire
from kvtier.kvstore.wire.protocol import ErrorCode, Frame, ProtocolError
from kvtier.transfer import state_protocol as sp
from kvtier.transfer.conn import FrameConn, PeerError, parse_addr, serve_connections, tcp
from kvtier.transfer.fetch_protocol import Entries, entries_meta, parse_entries
from kvtier.transfer.metrics import admin_only, serve_metrics
from kvtier.transfer.state_protocol import Location, StateOp

log = logging.getLogger("kvtier.directory")
COUNTERS = ("keys_looked_up", "keys_found", "hosts_expired", "full_reports", "entries_dropped")
ENTRY_BYTES = 300  # what an entry costs the directory beside its key (dict slots, tuples; measured: ~300 B)
HOST_BYTES = 1024  # what a host's record costs beside its name
DEFAULT_MAX_BYTES = 256 << 20


class DirectoryError(PeerError):
    """The directory is unreachable or refused a request."""


@dataclass
class _Host:
    addr: tuple[str, int]
    last_seen: float
    keys: set[bytes] = field(default_factory=set)


class Directory:
    """The directory's state and rules, without sockets (thread-safe)."""

    def __init__(
        self,
        lease_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_bytes: int = DEFAULT_MAX_BYTES,
        tenants: int = 1,
    ) -> None:
        """``max_bytes``: what the entries and hosts of all tenants may cost, an equal share each of ``tenants``."""
        self.lease_s = lease_s
        self.clock = clock
        self.share_bytes = max_bytes // max(1, tenants)
        self._lock = threading.Lock()
        self._hosts: dict[tuple[str, str], _Host] = {}  # (tenant, host id)
        self._entries: dict[tuple[str, bytes], tuple[str, int, int]] = {}  # (tenant, key) -> host, slot, gen
        self._bytes: dict[str, int] = {}  # what each tenant's entries and hosts cost
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._counts_by: dict[str, dict[str, int]] = {}  # the same counts, per tenant

    def register(self, tenant: str, host: str, addr: tuple[str, int], entries: Entries, full: bool) -> tuple[bool, int]:
        """Record the host's entries, as many as the tenant's share holds; ``full`` replaces all it had. Returns
        (known, how many entries were dropped for the share). Not known, recording nothing: a partial report from a
        host this directory does not know (it restarted, or the host's lease ran out), which must re-report
        everything it holds (``full``) instead, or its other StateBlocks would never be found. Raises
        ProtocolError(BUSY) for a host new to a tenant whose share is used up."""
        with self._lock:
            self._expire()
            record = self._hosts.get((tenant, host))
            if record is None and not full:
                return False, 0
            if record is None or full:
                self._count(tenant, "full_reports", int(full))
                if record is not None:
                    self._drop_entries(tenant, host, record)
                    self._forget_host(tenant, host)
                self._charge(tenant, len(host) + HOST_BYTES)
                record = self._hosts[(tenant, host)] = _Host(addr, self.clock())
            record.addr, record.last_seen = addr, self.clock()
            room = self.share_bytes - self._bytes.get(tenant, 0)
            dropped = 0
            for key, slot, gen in zip(entries.keys, entries.slots.tolist(), entries.gens.tolist(), strict=True):
                previous = self._entries.get((tenant, key))
                if previous is None:
                    cost = len(key) + ENTRY_BYTES
                    if cost > room:
                        dropped += 1
                        continue
                    room -= cost
                    self._bytes[tenant] = self._bytes.get(tenant, 0) + cost
                elif previous[0] != host:
                    other = self._hosts.get((tenant, previous[0]))
                    if other is not None:
                        other.keys.discard(key)
                self._entries[(tenant, key)] = (host, slot, gen)
                record.keys.add(key)
            self._count(tenant, "entries_dropped", dropped)
            return True, dropped

    def _charge(self, tenant: str, cost: int) -> None:
        """With the lock held: a new host record's cost, or ProtocolError(BUSY) when the share has no room for it."""
        held = self._bytes.get(tenant, 0)
        if held + cost > self.share_bytes:
            raise ProtocolError(
                ErrorCode.BUSY,
                f"tenant {tenant!r} holds {held} B of the directory, its share: no room for another host's entries",
            )
        self._bytes[tenant] = held + cost

    def _forget_host(self, tenant: str, host: str) -> None:
        """With the lock held: the host's record goes (its entries went already)."""
        del self._hosts[(tenant, host)]
        self._bytes[tenant] -= len(host) + HOST_BYTES

    def _count(self, tenant: str, name: str, n: int) -> None:
        self.counts[name] += n
        by = self._counts_by.setdefault(tenant, dict.fromkeys(COUNTERS, 0))
        by[name] += n

    def unregister(self, tenant: str, host: str, entries: Entries) -> None:
        with self._lock:
            record = self._hosts.get((tenant, host))
            for key, slot, gen in zip(entries.keys, entries.slots.tolist(), entries.gens.tolist(), strict=True):
                if self._entries.get((tenant, key)) == (host, slot, gen):
                    self._drop_entry(tenant, key)
                    if record is not None:
                        record.keys.discard(key)

    def _drop_entry(self, tenant: str, key: bytes) -> None:
        del self._entries[(tenant, key)]
        self._bytes[tenant] -= len(key) + ENTRY_BYTES

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
            self._count(tenant, "keys_looked_up", n)
            self._count(tenant, "keys_found", int((hosts >= 0).sum()))
        return sp.lookup_reply(hosts, addrs, slots, gens)

    def stats(self, tenant: str | None = None) -> dict[str, int]:
        """Hosts, entries, the bytes they cost and the counters: of ``tenant``, or of everyone (None)."""
        with self._lock:
            self._expire()
            if tenant is None:
                return {
                    "hosts": len(self._hosts),
                    "entries": len(self._entries),
                    "bytes": sum(self._bytes.values()),
                    **self.counts,
                }
            return {
                "hosts": sum(1 for t, _ in self._hosts if t == tenant),
                "entries": sum(len(r.keys) for (t, _), r in self._hosts.items() if t == tenant),
                "bytes": self._bytes.get(tenant, 0),
                **self._counts_by.get(tenant, dict.fromkeys(COUNTERS, 0)),
            }

    def _expire(self) -> None:
        deadline = self.clock() - self.lease_s
        for (tenant, host), record in list(self._hosts.items()):
            if record.last_seen < deadline:
                log.info("host %s lost its lease: %d entries dropped", host, len(record.keys))
                self._count(tenant, "hosts_expired", 1)
                self._drop_entries(tenant, host, record)
                self._forget_host(tenant, host)

    def _drop_entries(self, tenant: str, host: str, record: _Host) -> None:
        for key in record.keys:
            if self._entries.get((tenant, key), ("",))[0] == host:
                self._drop_entry(tenant, key)
        record.keys.clear()

    def handle(self, tenant: str, frame: Frame, limits_batch: int) -> dict[str, Any]:
        """One request (already authenticated as ``tenant``) → reply metadata; ProtocolError if malformed."""
        meta = frame.meta
        if frame.opcode == StateOp.REGISTER:
            full = meta.get("full") is True
            entries = parse_entries(meta, limits_batch)
            known, dropped = self.register(tenant, sp.host_field(meta), sp.addr_field(meta), entries, full)
            return {"known": known, "dropped": dropped}
        if frame.opcode == StateOp.UNREGISTER:
            self.unregister(tenant, sp.host_field(meta), parse_entries(meta, limits_batch))
            return {}
        if frame.opcode == StateOp.HEARTBEAT:
            return {"known": self.heartbeat(tenant, sp.host_field(meta))}
        if frame.opcode == StateOp.LOOKUP:
            return self.lookup(tenant, wire.unpack_keys(meta, limits_batch))
        if frame.opcode == StateOp.STATS:
            return self.stats(None if tenant == cluster_mod.DEFAULT_TENANT else tenant)
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
    parser.add_argument(
        "--max-bytes", default="256MiB", help="what every tenant's entries may cost, shared equally by the tenants"
    )
    parser.add_argument("--metrics", help="serve /metrics and /health on HOST:PORT")
    args = parser.parse_args(argv)
    try:
        config = cluster_map.load(args.config)
        lease_s = parse_duration(args.lease)
        listener = socket.create_server(parse_addr(args.listen))
        directory = Directory(lease_s, max_bytes=parse_size(args.max_bytes), tenants=len(config.tenants))
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
