"""The fetcher's server: threads that wait on one epoll for engines' requests, answer them and call the store.

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
them, and so does the connection closing (an engine that dies loses nothing and leaks nothing).

Threads: ``workers + 1`` threads, each either waiting on one epoll (every descriptor armed one-shot, so an event
wakes one thread and no other thread sees it until it is handled) or working. A thread woken by a request handles
it; if that queued a job and another thread still waits on the epoll, it runs the most urgent job itself: the store
call (no lock held: it only fills slot bytes), then the slots' publication and the answers of every request that
waited for it. So a fetch is read from the store and answered by the thread that received it: no hand-off between
threads, and no thread to wake. At most ``workers`` store calls run at once (one thread always waits on the epoll
while others work), and a queued job is taken by the next thread that finds another one waiting. Every change to
the tables, pins and connections happens under one lock.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import os
import select
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
    # per size class, the pins this connection holds on each slot (a pinned slot keeps its generation)
    pins: dict[int, np.ndarray] = field(default_factory=dict)
    allocs: set[tuple[int, int, int]] = field(default_factory=set)
    closed: bool = False

    def pins_of(self, cls: int, slots: int) -> np.ndarray:
        held = self.pins.get(cls)
        if held is None:
            held = self.pins[cls] = np.zeros(slots, np.uint32)
        return held


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

    @property
    def pins(self) -> bool:
        """Whether blocks answered to this request are pinned for its connection."""
        return self.pin and not self.session.closed


@dataclass(eq=False)
class Job:
    """One store call for a batch of blocks, each read into (or written from) a slot, run by a worker.

    Block ``j`` answers position ``index[j]`` of the request that asked first (``answer``); other requests that
    wait for the same block (a later FETCH of it, or the same key twice in one request) are in ``extra[j]``.
    """

    put: bool
    tenant: str
    length: int
    pool: int
    keys: list[bytes]
    hdrs: list[bytes | None]  # header digests the store checks (None: no check)
    slots: np.ndarray  # int64
    gens: np.ndarray  # uint64
    answer: Answer
    index: np.ndarray  # int64
    ttl_class: str = ""
    rows: np.ndarray | None = None  # a read's keys as they came in the request: uint8 [n, klen]
    priority: int = 0
    started: bool = False  # taken by a worker (a job may sit in the queue twice: see ``_hurry``)
    result: list[bool] | None = None
    error: str | None = None
    extra: dict[int, list[tuple[Answer, int]]] = field(default_factory=dict)
    _positions: dict[bytes, int] | None = None

    @property
    def headers(self) -> list[bytes] | None:
        """A request carries header digests for all its blocks or for none."""
        return None if self.hdrs[0] is None else self.hdrs  # type: ignore[return-value]

    def position(self, key: bytes) -> int | None:
        """Which block of this job ``key`` is (the last, if twice); None if it holds no such block."""
        if self._positions is None:
            self._positions = dict(zip(self.keys, range(len(self.keys)), strict=True))
        return self._positions.get(key)

    def wait(self, j: int, answer: Answer, i: int) -> None:
        self.extra.setdefault(j, []).append((answer, i))


class Fetcher:
    """The server: ``workers + 1`` threads (the caller of :meth:`serve_forever` one of them) take turns to wait for
    requests and to run store calls (see the module docstring)."""

    def __init__(
        self, config: cluster_mod.ClusterConfig, pools: Sequence[StagingPool], socket_path: Path, workers: int = 2
    ) -> None:
        if workers < 1:
            raise ValueError("the fetcher needs at least one worker thread")
        self.config = config
        self.pools = sorted(pools, key=lambda p: p.slot_bytes)  # size classes, smallest first
        self.slot_sizes = [p.slot_bytes for p in self.pools]
        self.socket_path = socket_path
        self.epoll = select.epoll()
        self._watched: dict[int, Session | str] = {}  # descriptor -> its session, "listen" or "wake"
        # store reads under way, by (tenant id, length), oldest first: a request for one of their blocks waits for
        # that read (a job's keys are indexed only when another request looks for them: most never are)
        self.flights: dict[tuple[int, int], list[Job]] = {}
        self.jobs: list[tuple[int, int, Job]] = []  # a heap: (priority, sequence, job), under the lock
        self.seq = itertools.count()
        self.counters = collections.Counter(dict.fromkeys(COUNTERS, 0))  # every key present: scraped from a thread
        self.sessions: set[Session] = set()
        self._lock = threading.RLock()  # everything but a store call in progress happens under it
        self._waiting = 0  # threads waiting on the epoll
        # store clients not in use, by tenant, the most recently used last: a store call takes that one, whose
        # connections are warm (rotating over one client per thread cost ~1.7 ms more CPU a 64 MiB read)
        self._idle_clients: dict[str, list[Client]] = {}
        # whole-slot views, made the first time a slot is read into and kept (slicing 1,024 a request cost ~0.12 ms);
        # store calls in flight never share a slot, so they fill these without the lock
        self._views: list[list[memoryview | None]] = [[None] * pool.slots for pool in self.pools]
        self._viewed = [np.zeros(pool.slots, dtype=bool) for pool in self.pools]
        self._next_sweep = time.monotonic() + PEER_SWEEP_S
        self.stopping = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.listener = self._listen(socket_path)
        self._watch(self.listener.fileno(), "listen")
        self._watched[self._wake_r.fileno()] = "wake"  # level-triggered and never drained: stop wakes every thread
        self.epoll.register(self._wake_r.fileno(), select.EPOLLIN)
        self.workers = [threading.Thread(target=self._take_turns, daemon=True) for _ in range(workers)]
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
        """Serve on this thread too until :meth:`stop`."""
        self._take_turns()

    def _take_turns(self) -> None:
        """One thread's loop: run the most urgent queued job while another thread waits on the epoll; else wait on
        the epoll and handle what it reports."""
        with self._lock:
            while not self.stopping:
                if self.jobs and self._waiting:
                    job = heapq.heappop(self.jobs)[2]
                    if not job.started:  # (a job hurried along sits in the heap twice)
                        job.started = True
                        self._run(job)
                    continue
                self._waiting += 1
                self._lock.release()
                try:
                    ready = self.epoll.poll(0.5)
                finally:
                    self._lock.acquire()
                    self._waiting -= 1
                if time.monotonic() >= self._next_sweep:
                    self._sweep_dead_peers()
                    self._next_sweep = time.monotonic() + PEER_SWEEP_S
                for fd, events in ready:
                    self._dispatch(fd, events)

    def _dispatch(self, fd: int, events: int) -> None:
        """Handle one epoll event (under the lock) and arm the descriptor again."""
        what = self._watched.get(fd)  # None: closed since the event was reported
        if what == "listen":
            self._accept()
            self._arm(fd, select.EPOLLIN)
        elif isinstance(what, Session):
            if events & ~select.EPOLLOUT and not what.closed:  # readable, hung up or failed: recv tells which
                self._receive(what)
            if events & select.EPOLLOUT and not what.closed:
                self._flush(what)
            if not what.closed:
                self._arm_session(what)

    def _watch(self, fd: int, what: Session | str) -> None:
        self._watched[fd] = what
        self.epoll.register(fd, select.EPOLLIN | select.EPOLLONESHOT)

    def _arm(self, fd: int, events: int) -> None:
        with contextlib.suppress(OSError):  # (closed meanwhile)
            self.epoll.modify(fd, events | select.EPOLLONESHOT)

    def _arm_session(self, session: Session) -> None:
        """Watch ``session`` for requests, and for room to write while its output waits."""
        self._arm(session.sock.fileno(), select.EPOLLIN | (select.EPOLLOUT if session.out else 0))

    def _sweep_dead_peers(self) -> None:
        """Close connections whose process is gone although the socket lives on (a child inherited it): their
        pins and allocated slots go back to the pool, as when the socket closes."""
        for session in list(self.sessions):
            if session.pid > 0 and not _alive(session.pid):
                log.info("pid %d is gone but its connection stayed open: releasing what it held", session.pid)
                self._close(session)

    def stop(self) -> None:
        """Make :meth:`serve_forever` return soon (a signal handler may call it)."""
        self.stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def close(self) -> None:
        """After :meth:`serve_forever` returned: every connection closed, the socket removed."""
        self.stop()  # (threads still waiting on the epoll leave)
        with self._lock:
            for session in list(self.sessions):
                self._close(session)
            for clients in self._idle_clients.values():
                for client in clients:
                    client.close()
            self._views.clear()  # (the pools unmap once no view is left)
        self.epoll.close()
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
            self._watch(sock.fileno(), session)

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
        if session.out:  # (the usual reply goes out whole: no system call here)
            self._arm_session(session)

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
        fd = session.sock.fileno()
        if self._watched.get(fd) is session:
            del self._watched[fd]
            with contextlib.suppress(OSError, ValueError):
                self.epoll.unregister(fd)
        session.sock.close()
        for cls, held in session.pins.items():
            pool = self.pools[cls]
            slots = np.flatnonzero(held)
            repeated = np.repeat(slots, held[slots])
            pool.unpin_many(repeated, pool.gen[repeated])
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
                np.add.at(session.pins_of(cls, pool.slots), slots, 1)
            else:
                gens = pool.gen[slots]
                for slot in slots.tolist():
                    pool.touch(slot)
            answer.status[hit], answer.slots[hit], answer.gens[hit] = BlockStatus.HIT, slots, gens
            answer.remaining -= len(hit)
        missed = np.flatnonzero(found < 0)
        if len(missed):
            self._read(session, answer, request, missed, tid, cls, priority)
        pool.count(len(hit), len(request.keys) - len(hit))
        self.counters["blocks_hit"] += len(hit)
        self.counters["requests"] += 1
        if answer.remaining == 0:
            self._answer(answer, frame.opcode)

    def _read(
        self,
        session: Session,
        answer: Answer,
        request: fp.FetchRequest,
        missed: np.ndarray,
        tid: int,
        cls: int,
        priority: int,
    ) -> None:
        """The blocks of ``request`` at positions ``missed`` (not in the pool): each waits for a read already under
        way, or joins this request's one store call into freshly reserved slots (FULL when none is left)."""
        keys, hdrs = request.keys, request.headers
        flying = self.flights.setdefault((tid, request.length), [])
        wanted = missed.tolist()
        wanted_keys = keys if len(wanted) == len(keys) else list(map(keys.__getitem__, wanted))
        twice: list[tuple[int, int]] = []  # (block of this request's read, position): the same block asked again
        if flying or len(set(wanted_keys)) != len(wanted_keys):
            wanted, twice = self._join(answer, keys, hdrs, wanted, flying, priority)
            wanted_keys = list(map(keys.__getitem__, wanted))
        slots, gens = self.pools[cls].reserve_many(len(wanted), os.getpid())
        got = len(slots)
        if got:
            job = Job(
                False, session.tenant or "", request.length, cls, wanted_keys[:got],
                hdrs[:got] if wanted_keys is keys else list(map(hdrs.__getitem__, wanted[:got])),
                slots, gens, answer, np.arange(got) if wanted_keys is keys else np.array(wanted[:got], np.int64),
                rows=request.rows[:got] if wanted_keys is keys else request.rows[wanted[:got]], priority=priority,
            )  # fmt: skip
            flying.append(job)
            heapq.heappush(self.jobs, (priority, next(self.seq), job))  # one store call: splitting it was slower
        full = wanted[got:] + [i for j, i in twice if j >= got]  # no slot left: every one is pinned or filling
        for j, i in twice:
            if j < got:
                job.wait(j, answer, i)
        if full:
            answer.status[full] = BlockStatus.FULL
            answer.remaining -= len(full)
            self.counters["blocks_full"] += len(full)
        if not flying:
            del self.flights[(tid, request.length)]

    def _join(
        self,
        answer: Answer,
        keys: list[bytes],
        hdrs: list[bytes | None],
        wanted: list[int],
        flying: list[Job],
        priority: int,
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Positions that wait for another request's read (at this request's priority), and of the rest, those
        still to be read and those that name a block twice; returns (to read, [(block to read, position)])."""
        to_read: list[int] = []
        twice: list[tuple[int, int]] = []
        first: dict[tuple[bytes, bytes | None], int] = {}
        hurried: set[Job] = set()
        for i in wanted:
            key, hdr = keys[i], hdrs[i]
            job, j = _reading(flying, key, hdr)
            if job is not None:
                job.wait(j, answer, i)
                if job not in hurried:
                    hurried.add(job)
                    self._hurry(job, priority)
                continue
            j = first.setdefault((key, hdr), len(to_read))
            if j == len(to_read):
                to_read.append(i)
            else:
                twice.append((j, i))
        return to_read, twice

    def _class_of(self, length: int) -> int:
        cls = fp.size_class(self.slot_sizes, length)
        assert cls is not None  # the parsers refused lengths beyond the largest slot
        return cls

    def _answer(self, answer: Answer, opcode: int) -> None:
        meta = fp.slots_meta(answer.status, answer.slots, answer.gens, answer.errors)
        self._send(answer.session, encode_head(opcode | Op.REPLY, answer.request_id, meta))

    def _release(self, session: Session, frame: Frame) -> None:
        pools, slots, gens = fp.parse_release(frame.meta, self.config.limits.max_batch)
        released = 0
        rest = np.ones(len(slots), dtype=bool)  # not a pin of this connection's: maybe a slot it allocated
        for cls, held in session.pins.items():  # only pins this connection holds: another's are not its to drop
            pool = self.pools[cls]
            mine = np.flatnonzero((pools == cls) & (slots < pool.slots))
            s = slots[mine].astype(np.int64)
            pinned = (held[s] > 0) & (pool.gen[s] == gens[mine])
            rest[mine[pinned]] = False  # (a slot pinned here is not one it allocates: FILLING is never pinned)
            asked, count = np.unique(s[pinned], return_counts=True)
            take = np.minimum(count, held[asked])  # never more than it holds
            held[asked] -= take.astype(np.uint32)
            released += pool.unpin_many(np.repeat(asked, take), np.repeat(pool.gen[asked], take))
        for i in np.flatnonzero(rest).tolist():
            ref = (int(pools[i]), int(slots[i]), int(gens[i]))
            if ref in session.allocs:
                session.allocs.discard(ref)
                released += self.pools[ref[0]].abandon(ref[1], ref[2])
        self._reply(session, frame, {"released": released})

    def _alloc(self, session: Session, frame: Frame) -> None:
        n, length = fp.parse_alloc(frame.meta, self.slot_sizes[-1], self.config.limits.max_batch)
        cls = self._class_of(length)
        status = np.full(n, BlockStatus.FULL, np.uint8)
        slots, gens = np.zeros(n, "<u4"), np.zeros(n, "<u8")
        reserved, generations = self.pools[cls].reserve_many(n, session.pid)
        got = len(reserved)
        status[:got], slots[:got], gens[:got] = BlockStatus.ALLOCATED, reserved, generations
        session.allocs.update(zip(itertools.repeat(cls), reserved.tolist(), generations.tolist()))
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
        ok: list[int] = []
        for i, ref in enumerate(zip(itertools.repeat(cls), entries.slots.tolist(), entries.gens.tolist())):
            if ref in session.allocs:
                session.allocs.discard(ref)
                ok.append(i)
            else:
                answer.errors[i] = (
                    f"slot {ref[1]} generation {ref[2]} was not allocated to this connection (or is stale)"
                )
        refused = answer.errors.keys()
        if refused:
            at = list(refused)
            answer.status[at], answer.slots[at], answer.gens[at] = (
                BlockStatus.ERROR,
                entries.slots[at],
                entries.gens[at],
            )
            answer.remaining -= len(at)
        if ok:
            assert session.tenant is not None
            job = Job(
                True, session.tenant, request.length, cls, [entries.keys[i] for i in ok],
                [request.headers[i] for i in ok], entries.slots[ok].astype(np.int64), entries.gens[ok], answer,
                np.array(ok, dtype=np.int64), request.ttl_class,
            )  # fmt: skip
            heapq.heappush(self.jobs, (0, next(self.seq), job))
        if answer.remaining == 0:
            self._answer(answer, frame.opcode)

    def _stats(self, session: Session, frame: Frame) -> None:
        self._reply(session, frame, self.stats())

    def stats(self) -> dict[str, Any]:
        """Pool and server counters (any thread: ``/metrics`` asks from its own)."""
        with self._lock:
            return self._counted()

    def _counted(self) -> dict[str, Any]:
        return {
            **PoolStats.total([p.stats() for p in self.pools]).as_dict(),
            "slot_sizes": self.slot_sizes,
            "in_flight": sum(len(job.keys) for flying in self.flights.values() for job in flying),
            "queued_jobs": len({job for _, _, job in self.jobs if not job.started}),
            "sessions": len(self.sessions),
            "pid": os.getpid(),
            **self.counters,
        }

    # -- store calls ------------------------------------------------------------------------------------

    def _hurry(self, job: Job, priority: int) -> None:
        """A request of higher priority waits for ``job``: queue it again at that priority (a FETCH joining a
        PREFETCH's read must not wait behind every other fetch). Whichever entry is taken first runs it."""
        if job.started or priority >= job.priority:
            return
        job.priority = priority
        heapq.heappush(self.jobs, (priority, next(self.seq), job))

    def _run(self, job: Job) -> None:
        """Run ``job``'s store call without the lock (held on entry and on return), then complete it."""
        idle = self._idle_clients.setdefault(job.tenant, [])
        client = idle.pop() if idle else None
        self._lock.release()
        try:
            client = self._store_call(job, client)
        finally:
            self._lock.acquire()
        if client is not None:
            idle.append(client)
        try:
            self._complete(job)
        except Exception:  # a bug must not stop the thread (its requests' connections see no answer)
            log.exception("completing a store call failed")

    def _store_call(self, job: Job, client: Client | None) -> Client | None:
        """``get_into`` the job's slots, or ``put`` from them, with ``client`` (or a new one of the job's tenant,
        returned for the next call); a failure is recorded in ``job``, never raised."""
        try:
            if client is None:
                client = Client(self.config, token=self.config.tenants[job.tenant])
            views = self._slot_views(job.pool, job.slots, job.length)
            if job.put:
                job.result = client.put(job.keys, views, job.ttl_class, headers=job.headers)
            else:
                job.result = client.get_into(job.keys, views, headers=job.headers)
        except CapacityError as exc:
            job.result, job.error = exc.stored, str(exc)
        except Exception as exc:  # any store failure becomes a per-block ERROR answer, never a crash
            log.warning("store call failed: %s", exc)
            job.error = f"{type(exc).__name__}: {exc}"
        return client

    def _slot_views(self, cls: int, slots: np.ndarray, length: int) -> list[memoryview]:
        """Views of the first ``length`` bytes of ``slots`` in size class ``cls``."""
        pool = self.pools[cls]
        if length != pool.slot_bytes:
            return [pool.buffer[start : start + length] for start in (pool.data_offset + slots * pool.stride).tolist()]
        cache, viewed = self._views[cls], self._viewed[cls]
        for slot in slots[~viewed[slots]].tolist():
            cache[slot] = pool.view(slot)
        viewed[slots] = True
        return list(map(cache.__getitem__, slots.tolist()))  # type: ignore[arg-type]

    def _complete(self, job: Job) -> None:
        """The store call of ``job`` is over (under the lock): its slots published (pinned once per waiting FETCH)
        or freed, every request waiting for it answered, then its blocks no longer in flight."""
        n = len(job.keys)
        ok = np.zeros(n, dtype=bool) if job.result is None else np.fromiter(job.result, bool, n)
        tid, pool = tenant_id(job.tenant), self.pools[job.pool]
        # pins: one per waiting FETCH whose connection is still there (a PUT's slot is left unpinned)
        pins = np.full(n, 0 if job.put else int(job.answer.pins), dtype=np.uint32)
        for j, waiters in job.extra.items():
            pins[j] += sum(a.pins for a, _ in waiters)
        stored, failed = np.flatnonzero(ok), np.flatnonzero(~ok)
        # the table now (what engines read), the pool's index once the answers are out (``settle`` below)
        rows = job.rows
        if len(stored) == n:
            pool.publish_many(job.slots, tid, job.keys, job.length, job.hdrs, pins, later=True, rows=rows)
        elif len(stored):
            at = stored.tolist()
            keys, hdrs = list(map(job.keys.__getitem__, at)), list(map(job.hdrs.__getitem__, at))
            rows = None if rows is None else rows[stored]
            pool.publish_many(job.slots[stored], tid, keys, job.length, hdrs, pins[stored], later=True, rows=rows)
        if len(failed):
            pool.abandon_many(job.slots[failed], job.gens[failed])
        if job.put:
            good, bad = BlockStatus.STORED, BlockStatus.ERROR
            error = job.error or "the store did not commit the block (too few nodes took it)"
        else:
            good, bad = BlockStatus.FETCHED, BlockStatus.MISS if job.error is None else BlockStatus.ERROR
            error = job.error or ""
            self.counters["bytes_fetched"] += len(stored) * job.length
        self.counters[_COUNTER_OF[(job.put, good)]] += len(stored)
        self.counters[_COUNTER_OF[(job.put, bad)]] += len(failed)
        self._settle(job, job.answer, job.index, ok, good, bad, error)
        for j, waiters in job.extra.items():
            for answer, i in waiters:
                self._settle(job, answer, np.array([i]), ok[j : j + 1], good, bad, error, j)
        if not job.put:
            self._land(job, tid)
        pool.settle()

    def _land(self, job: Job, tid: int) -> None:
        """The job's reads are over: later requests for its blocks no longer wait for it."""
        flying = self.flights.get((tid, job.length))
        if flying is not None and job in flying:
            flying.remove(job)
            if not flying:
                del self.flights[(tid, job.length)]

    def _settle(
        self,
        job: Job,
        answer: Answer,
        index: np.ndarray,
        ok: np.ndarray,
        good: BlockStatus,
        bad: BlockStatus,
        error: str,
        first: int = 0,
    ) -> None:
        """Answer positions ``index`` of ``answer`` with what the store call did for blocks ``first …`` of ``job``."""
        blocks = slice(first, first + len(index))
        slots, gens = job.slots[blocks], job.gens[blocks]
        keep = ok | job.put  # a PUT's answer names its slot either way; a failed read names none
        answer.status[index] = np.where(ok, good, bad)
        answer.slots[index] = np.where(keep, slots, 0)
        answer.gens[index] = np.where(keep, gens, 0)
        if bad == BlockStatus.ERROR and not ok.all():
            answer.errors.update(dict.fromkeys(index[~ok].tolist(), error))
        if not job.put and answer.pins:  # a job's slots are distinct
            answer.session.pins_of(job.pool, self.pools[job.pool].slots)[slots[ok]] += np.uint32(1)
        answer.remaining -= len(index)
        if answer.remaining == 0:
            self._answer(answer, FetchOp.PUT if job.put else FetchOp.FETCH if answer.pin else FetchOp.PREFETCH)


def _reading(flying: list[Job], key: bytes, hdr: bytes | None) -> tuple[Job | None, int]:
    """The newest of ``flying`` that reads ``key`` with header digest ``hdr``, and which of its blocks it is."""
    for job in reversed(flying):
        j = job.position(key)
        if j is not None and job.hdrs[j] == hdr:
            return job, j
    return None, -1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, as another user
    return True
