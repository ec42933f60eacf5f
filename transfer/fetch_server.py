"""The fetcher's server: a selectors loop that answers engines, worker threads that call the store.

The process around it (command line, ``LocalFetcher``) is :mod:`kvtier.transfer.fetcher`. The server owns the
pools (:class:`~kvtier.transfer.staging.StagingPool`, one per size class; the single writer of their slot tables)
and one store client per worker thread and tenant. Engines talk to it over a Unix socket (mode 0600, peers of another
uid refused, then the cluster or a tenant token in HELLO; :mod:`~kvtier.transfer.fetch_protocol`).

How a FETCH is answered, per block:

1. In the pool (of the size class the length fits) for this tenant, with the same length and, when one is given,
   the same header digest: pinned, answered HIT at once.
2. Already being read for another request: waits for that read (one store read per block however many ask).
3. Otherwise a slot is reserved (a free one, else the least recently used unpinned one) and the block joins this
   request's store read: one ``get_into`` for all of them, straight into the slots, by a worker thread, in
   priority order (PREFETCH after FETCH). FETCHED, MISS or ERROR when it returns; FULL if no slot could be had.

The reply goes out when every block of the request has its answer. Pins belong to the connection: RELEASE drops
them, and so does the connection closing (an engine that dies loses nothing and leaks nothing). All table
changes happen on the main thread; workers only fill slot bytes and call the store.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import queue
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.kvstore import cluster as cluster_mod
from kvtier.kvstore.client import CapacityError, Client
from kvtier.kvstore.protocol import ErrorCode, Frame, FrameReader, Op, ProtocolError, encode_error, encode_head
from kvtier.transfer import fetch_protocol as fp
from kvtier.transfer.conn import requests_only
from kvtier.transfer.fetch_protocol import BlockStatus, FetchOp
from kvtier.transfer.staging import PoolError, PoolStats, StagingPool, tenant_id

log = logging.getLogger("kvtier.fetcher")
PREFETCH_PENALTY = fp.MAX_PRIORITY  # a prefetch waits behind every fetch
PEER_SWEEP_S = 1.0  # how often the pids of connected engines are checked
_COUNTER_OF = {
    (False, BlockStatus.FETCHED): "blocks_fetched",
    (False, BlockStatus.MISS): "blocks_missed",
    (False, BlockStatus.ERROR): "blocks_failed",
    (True, BlockStatus.STORED): "blocks_put",
    (True, BlockStatus.ERROR): "blocks_failed",
}
COUNTERS = (
    "requests", "blocks_hit", "blocks_fetched", "blocks_missed", "blocks_failed", "blocks_full", "blocks_put",
    "bytes_fetched",
)  # fmt: skip
_PEERCRED = struct.Struct("3i")


@dataclass(eq=False)
class Session:
    """One engine connection: what it has pinned and what it is filling."""

    sock: socket.socket
    pid: int
    reader: FrameReader = field(default_factory=FrameReader)
    tenant: str | None = None
    out: bytearray = field(default_factory=bytearray)
    pins: collections.Counter[tuple[int, int, int]] = field(default_factory=collections.Counter)  # pool, slot, gen
    allocs: set[tuple[int, int, int]] = field(default_factory=set)
    closed: bool = False


@dataclass(eq=False)
class Answer:
    """A request waiting for its blocks; replied to when ``remaining`` reaches zero."""

    session: Session
    request_id: int
    pin: bool
    status: np.ndarray
    slots: np.ndarray
    gens: np.ndarray
    remaining: int
    errors: dict[int, str] = field(default_factory=dict)

    @classmethod
    def of(cls, session: Session, request_id: int, n: int, pin: bool) -> Answer:
        return cls(
            session, request_id, pin, np.full(n, BlockStatus.ERROR, np.uint8), np.zeros(n, "<u4"), np.zeros(n, "<u8"), n
        )


@dataclass(eq=False)
class Flight:
    """One block being read from (or written to) the store through a slot."""

    key: bytes
    hdr: bytes | None  # header digest the store checks (None: no check)
    pool: int  # size class
    slot: int
    gen: int
    waiters: list[tuple[Answer, int]] = field(default_factory=list)
    job: Job | None = None


@dataclass(eq=False)
class Job:
    """One store call for a batch of flights, run by a worker."""

    put: bool
    tenant: str
    length: int
    pool: int
    flights: list[Flight]
    ttl_class: str = ""
    priority: int = 0
    started: bool = False  # taken by a worker (a job may sit in the queue twice: see ``_hurry``)
    result: list[bool] | None = None
    error: str | None = None

    @property
    def headers(self) -> list[bytes] | None:
        """A request carries header digests for all its blocks or for none."""
        if self.flights[0].hdr is None:
            return None
        return [f.hdr for f in self.flights if f.hdr is not None]


class Fetcher:
    """The server: a selectors loop on the main thread, store calls on ``workers`` threads."""

    def __init__(
        self, config: cluster_mod.ClusterConfig, pools: Sequence[StagingPool], socket_path: Path, workers: int = 2
    ) -> None:
        self.config = config
        self.pools = sorted(pools, key=lambda p: p.slot_bytes)  # size classes, smallest first
        self.slot_sizes = [p.slot_bytes for p in self.pools]
        self.socket_path = socket_path
        self.selector = selectors.DefaultSelector()
        self.flights: dict[tuple[int, bytes, bytes | None, int], Flight] = {}
        self.jobs: queue.PriorityQueue[tuple[int, int, Job | None]] = queue.PriorityQueue()
        self.done: collections.deque[Job] = collections.deque()
        self.seq = itertools.count()
        self.counters = collections.Counter(dict.fromkeys(COUNTERS, 0))  # every key present: scraped from a thread
        self.sessions: set[Session] = set()
        self._take_lock = threading.Lock()
        self.stopping = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.listener = self._listen(socket_path)
        self.selector.register(self.listener, selectors.EVENT_READ, "listen")
        self.selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.workers = [threading.Thread(target=self._work, daemon=True) for _ in range(workers)]
        for worker in self.workers:
            worker.start()

    @staticmethod
    def _listen(path: Path) -> socket.socket:
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise PoolError(f"{path} exists and is not a socket; choose another --socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink()  # left by a fetcher that died
            else:
                raise PoolError(f"{path} is served by a running fetcher; stop it or choose another --socket")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is created 0600: same uid only
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        sock.listen(128)
        sock.setblocking(False)
        return sock

    # -- loop -------------------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        next_sweep = time.monotonic() + PEER_SWEEP_S
        while not self.stopping:
            if time.monotonic() >= next_sweep:
                self._sweep_dead_peers()
                next_sweep = time.monotonic() + PEER_SWEEP_S
            for key, events in self.selector.select(timeout=0.5):
                if key.data == "listen":
                    self._accept()
                elif key.data == "wake":
                    with contextlib.suppress(BlockingIOError):
                        while self._wake_r.recv(4096):
                            pass
                    self._complete()
                else:
                    session: Session = key.data
                    if events & selectors.EVENT_READ:
                        self._receive(session)
                    if events & selectors.EVENT_WRITE and not session.closed:
                        self._flush(session)

    def _sweep_dead_peers(self) -> None:
        """Close connections whose process is gone although the socket lives on (a child inherited it): their
        pins and allocated slots go back to the pool, as when the socket closes."""
        for session in list(self.sessions):
            if session.pid > 0 and not _alive(session.pid):
                log.info("pid %d is gone but its connection stayed open: releasing what it held", session.pid)
                self._close(session)

    def stop(self) -> None:
        self.stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def close(self) -> None:
        for session in list(self.sessions):
            self._close(session)
        for _ in self.workers:
            self.jobs.put((-1, -1, None))
        self.selector.close()
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            if uid not in (os.getuid(), 0):
                log.warning("refused a connection from uid %d (pid %d)", uid, pid)
                sock.close()
                continue
            sock.setblocking(False)
            session = Session(sock, pid, FrameReader(requests_only(self.config.limits)))
            self.sessions.add(session)
            self.selector.register(sock, selectors.EVENT_READ, session)

    def _receive(self, session: Session) -> None:
        try:
            while not session.closed:
                n = session.sock.recv_into(session.reader.writable()[0])
                if n == 0:
                    self._close(session)
                    return
                session.reader.advance(n)
                while (frame := session.reader.next_frame()) is not None:
                    self._handle(session, frame)
        except BlockingIOError:
            return
        except ProtocolError as exc:
            self._refuse(session, 0, exc.code, str(exc))
        except OSError:
            self._close(session)
        except Exception as exc:  # a bug must cost one connection, never the fetcher
            log.exception("request failed")
            self._refuse(session, 0, ErrorCode.INTERNAL, f"internal error: {exc}")

    def _send(self, session: Session, data: bytes) -> None:
        if session.closed:
            return
        session.out += data
        self._flush(session)

    def _flush(self, session: Session) -> None:
        try:
            sent = session.sock.send(session.out)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._close(session)
            return
        del session.out[:sent]
        self.selector.modify(
            session.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if session.out else 0), session
        )

    def _refuse(self, session: Session, request_id: int, code: ErrorCode, message: str) -> None:
        with contextlib.suppress(OSError):
            session.sock.setblocking(True)
            session.sock.settimeout(1.0)
            session.sock.sendall(bytes(session.out) + encode_error(request_id, code, message))
        self._close(session)

    def _close(self, session: Session) -> None:
        """The connection is gone: its pins are dropped and the slots it was filling freed."""
        if session.closed:
            return
        session.closed = True
        self.sessions.discard(session)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(session.sock)
        session.sock.close()
        for (pool, slot, gen), count in session.pins.items():
            for _ in range(count):
                self.pools[pool].unpin(slot, gen)
        for pool, slot, gen in session.allocs:
            self.pools[pool].abandon(slot, gen)
        session.pins.clear()
        session.allocs.clear()

    # -- requests ---------------------------------------------------------------------------------------

    def _handle(self, session: Session, frame: Frame) -> None:
        if session.tenant is None:
            self._hello(session, frame)
            return
        handlers = {
            FetchOp.FETCH: self._fetch,
            FetchOp.PREFETCH: self._fetch,
            FetchOp.RELEASE: self._release,
            FetchOp.ALLOC: self._alloc,
            FetchOp.PUT: self._put,
            FetchOp.STATS: self._stats,
        }
        handler = handlers.get(frame.opcode)
        if handler is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown opcode {frame.opcode}")
        handler(session, frame)

    def _reply(self, session: Session, frame: Frame, meta: dict[str, Any]) -> None:
        self._send(session, encode_head(frame.opcode | Op.REPLY, frame.request_id, meta))

    def _hello(self, session: Session, frame: Frame) -> None:
        if frame.opcode != FetchOp.HELLO:
            raise ProtocolError(ErrorCode.AUTH_REQUIRED, "the first frame must be HELLO with a token")
        token = frame.meta.get("token")
        tenant = self.config.tenant_for_token(token) if isinstance(token, str) else None
        if tenant is None:
            log.warning("refused pid %d: unknown token", session.pid)
            raise ProtocolError(ErrorCode.AUTH_FAILED, "authentication failed: unknown token")
        session.tenant = tenant
        self._reply(
            session,
            frame,
            {
                "pools": [[p.name, p.epoch, p.slot_bytes] for p in self.pools],
                "hash": self.config.hash_algo,
                "pid": os.getpid(),
                "tenant": tenant,
            },
        )

    def _fetch(self, session: Session, frame: Frame) -> None:
        request = fp.parse_fetch(frame.meta, self.slot_sizes[-1], self.config.limits.max_batch)
        assert session.tenant is not None
        tid = tenant_id(session.tenant)
        cls = self._class_of(request.length)
        pool = self.pools[cls]
        pin = frame.opcode == FetchOp.FETCH
        priority = request.priority + (0 if pin else PREFETCH_PENALTY)
        answer = Answer.of(session, frame.request_id, len(request.keys), pin)
        found = pool.find(tid, request.keys, request.length, request.headers)
        hit = np.flatnonzero(found >= 0)
        if len(hit):
            slots = found[hit]
            if pin:
                gens = pool.pin_many(slots)
                session.pins.update((cls, s, g) for s, g in zip(slots.tolist(), gens.tolist(), strict=True))
            else:
                gens = pool.gen[slots]
                for slot in slots.tolist():
                    pool.touch(slot)
            answer.status[hit], answer.slots[hit], answer.gens[hit] = BlockStatus.HIT, slots, gens
            answer.remaining -= len(hit)
        wanted: dict[tuple[int, bytes, bytes | None, int], list[int]] = {}  # blocks no read is under way for
        for i in np.flatnonzero(found < 0).tolist():
            block = (tid, request.keys[i], request.headers[i], request.length)
            flight = self.flights.get(block)
            if flight is None:
                wanted.setdefault(block, []).append(i)
                continue
            if flight.job is not None:  # another request's read: wait for it, at this request's priority
                self._hurry(flight.job, priority)
            flight.waiters.append((answer, i))
        slots, gens = pool.reserve_many(len(wanted), os.getpid())
        new: list[Flight] = []
        for (block, indices), slot, gen in zip(wanted.items(), slots.tolist(), gens.tolist(), strict=False):
            flight = self.flights[block] = Flight(block[1], block[2], cls, slot, gen, [(answer, i) for i in indices])
            new.append(flight)
        for _, indices in list(wanted.items())[len(slots) :]:  # no slot left: every one is pinned or filling
            for i in indices:
                self._settle(answer, i, BlockStatus.FULL)
                self.counters["blocks_full"] += 1
        pool.count(len(hit), len(request.keys) - len(hit))
        self.counters["blocks_hit"] += len(hit)
        self.counters["requests"] += 1
        if new:  # one store call: measured, splitting it over the workers was slower (GIL, more requests per node)
            job = Job(False, session.tenant, request.length, cls, new, priority=priority)
            for flight in new:
                flight.job = job
            self.jobs.put((priority, next(self.seq), job))
        if answer.remaining == 0:
            self._answer(answer, frame.opcode)

    def _class_of(self, length: int) -> int:
        cls = fp.size_class(self.slot_sizes, length)
        assert cls is not None  # the parsers refused lengths beyond the largest slot
        return cls

    def _settle(self, answer: Answer, i: int, status: BlockStatus, slot: int = 0, gen: int = 0) -> None:
        answer.status[i], answer.slots[i], answer.gens[i] = status, slot, gen
        answer.remaining -= 1

    def _answer(self, answer: Answer, opcode: int) -> None:
        meta = fp.slots_meta(answer.status, answer.slots, answer.gens, answer.errors)
        self._send(answer.session, encode_head(opcode | Op.REPLY, answer.request_id, meta))

    def _release(self, session: Session, frame: Frame) -> None:
        pools, slots, gens = fp.parse_release(frame.meta, self.config.limits.max_batch)
        pinned = np.zeros(len(slots), dtype=bool)
        released = 0
        for i, ref in enumerate(zip(pools.tolist(), slots.tolist(), gens.tolist(), strict=True)):
            if session.pins[ref] > 0:  # only pins this connection holds: another's are not its to drop
                session.pins[ref] -= 1
                if not session.pins[ref]:
                    del session.pins[ref]
                pinned[i] = True
            elif ref in session.allocs:
                session.allocs.discard(ref)
                released += self.pools[ref[0]].abandon(ref[1], ref[2])
        for cls, pool in enumerate(self.pools):
            mine = pinned & (pools == cls)
            if mine.any():
                released += pool.unpin_many(slots[mine].astype(np.int64), gens[mine])
        self._reply(session, frame, {"released": released})

    def _alloc(self, session: Session, frame: Frame) -> None:
        n, length = fp.parse_alloc(frame.meta, self.slot_sizes[-1], self.config.limits.max_batch)
        cls = self._class_of(length)
        status = np.full(n, BlockStatus.FULL, np.uint8)
        slots, gens = np.zeros(n, "<u4"), np.zeros(n, "<u8")
        for i in range(n):
            reserved = self.pools[cls].reserve(session.pid)
            if reserved is None:
                break
            status[i], (slots[i], gens[i]) = BlockStatus.ALLOCATED, reserved
            session.allocs.add((cls, *reserved))
        self._reply(session, frame, fp.slots_meta(status, slots, gens, {}))

    def _put(self, session: Session, frame: Frame) -> None:
        request = fp.parse_put(frame.meta, self.slot_sizes[-1], self.config.limits.max_batch)
        cls = self._class_of(request.length)
        entries = request.entries
        answer = Answer.of(session, frame.request_id, len(entries.keys), False)
        if request.ttl_class not in self.config.ttl_classes:  # nothing is lost: the slots stay the caller's
            known = ", ".join(sorted(self.config.ttl_classes))
            answer.errors = dict.fromkeys(
                range(len(entries.keys)), f"unknown TTL class {request.ttl_class!r} ({known})"
            )
            answer.status[:], answer.slots[:], answer.gens[:] = BlockStatus.ALLOCATED, entries.slots, entries.gens
            self._answer(answer, frame.opcode)
            return
        flights = []
        rows = zip(entries.keys, request.headers, entries.slots.tolist(), entries.gens.tolist(), strict=True)
        for i, (key, hdr, slot, gen) in enumerate(rows):
            if (cls, slot, gen) not in session.allocs:
                answer.errors[i] = f"slot {slot} generation {gen} was not allocated to this connection (or is stale)"
                self._settle(answer, i, BlockStatus.ERROR, slot, gen)
                continue
            session.allocs.discard((cls, slot, gen))
            flights.append(Flight(key, hdr, cls, slot, gen, [(answer, i)]))
        if flights:
            assert session.tenant is not None
            job = Job(True, session.tenant, request.length, cls, flights, request.ttl_class)
            self.jobs.put((0, next(self.seq), job))
        if answer.remaining == 0:
            self._answer(answer, frame.opcode)

    def _stats(self, session: Session, frame: Frame) -> None:
        self._reply(session, frame, self.stats())

    def stats(self) -> dict[str, Any]:
        return {
            **PoolStats.total([p.stats() for p in self.pools]).as_dict(),
            "slot_sizes": self.slot_sizes,
            "in_flight": len(self.flights),
            "queued_jobs": self.jobs.qsize(),
            "sessions": len(self.sessions),
            "pid": os.getpid(),
            **self.counters,
        }

    # -- workers ----------------------------------------------------------------------------------------

    def _hurry(self, job: Job, priority: int) -> None:
        """A request of higher priority waits for ``job``: queue it again at that priority (a FETCH joining a
        PREFETCH's read must not wait behind every other fetch). Whichever entry a worker takes first runs it."""
        with self._take_lock:
            if job.started or priority >= job.priority:
                return
            job.priority = priority
        self.jobs.put((priority, next(self.seq), job))

    def _work(self) -> None:
        clients: dict[str, Client] = {}
        while True:
            _, _, job = self.jobs.get()
            if job is None:
                break
            with self._take_lock:
                if job.started:
                    continue
                job.started = True
            try:
                client = clients.get(job.tenant)
                if client is None:
                    client = clients[job.tenant] = Client(self.config, token=self.config.tenants[job.tenant])
                keys = [f.key for f in job.flights]
                views = [self.pools[job.pool].view(f.slot, job.length) for f in job.flights]
                if job.put:
                    job.result = client.put(keys, views, job.ttl_class, headers=job.headers)
                else:
                    job.result = client.get_into(keys, views, headers=job.headers)
            except CapacityError as exc:
                job.result, job.error = exc.stored, str(exc)
            except Exception as exc:  # any store failure becomes a per-block ERROR answer, never a crash
                log.warning("store call failed: %s", exc)
                job.error = f"{type(exc).__name__}: {exc}"
            self.done.append(job)
            with contextlib.suppress(BlockingIOError):
                self._wake_w.send(b"x")
        for client in clients.values():
            client.close()

    def _complete(self) -> None:
        while self.done:
            job = self.done.popleft()
            ok = job.result if job.result is not None else [False] * len(job.flights)
            stored = [f for f, done in zip(job.flights, ok, strict=True) if done]
            if not job.put:
                for flight in job.flights:
                    self.flights.pop((tenant_id(job.tenant), flight.key, flight.hdr, job.length), None)
            # pins: one per waiting FETCH whose connection is still there (a PUT's slot is left unpinned)
            pins = np.array([sum(a.pin and not a.session.closed for a, _ in f.waiters) for f in stored], np.uint32)
            pool = self.pools[job.pool]
            if stored:
                slots = np.array([f.slot for f in stored], dtype=np.int64)
                hdrs = [f.hdr for f in stored]
                pool.publish_many(slots, tenant_id(job.tenant), [f.key for f in stored], job.length, hdrs, pins)
            for flight, done in zip(job.flights, ok, strict=True):
                if not done:
                    pool.abandon(flight.slot, flight.gen)
                self._settle_flight(job, flight, done)

    def _settle_flight(self, job: Job, flight: Flight, done: bool) -> None:
        """Answer every request waiting for ``flight`` with what the store call did for it."""
        if job.put:
            status = BlockStatus.STORED if done else BlockStatus.ERROR
            error = job.error or "the store did not commit the block (too few nodes took it)"
        else:
            status = BlockStatus.FETCHED if done else BlockStatus.MISS if job.error is None else BlockStatus.ERROR
            error = job.error or ""
        self.counters[_COUNTER_OF[(job.put, status)]] += 1
        if done and not job.put:
            self.counters["bytes_fetched"] += job.length
        for answer, i in flight.waiters:
            if done and answer.pin and not answer.session.closed:
                answer.session.pins[(job.pool, flight.slot, flight.gen)] += 1
            if status == BlockStatus.ERROR:
                answer.errors[i] = error
            keep = done or job.put
            self._settle(answer, i, status, flight.slot if keep else 0, flight.gen if keep else 0)
            if answer.remaining == 0:
                self._answer(answer, FetchOp.PUT if job.put else FetchOp.FETCH if answer.pin else FetchOp.PREFETCH)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, as another user
    return True
