"""The fetcher's server: threads that wait on one epoll for engines' requests, answer them and call the store.

The process around it (command line, ``LocalFetcher``) is :mod:`kvtier.transfer.fetcher`. The server owns the
host pool (:class:`~kvtier.transfer.host_pool.HostPool`: segments per tenant and size class, the single writer of
their slot tables) and store clients per tenant. Engines talk to it over a Unix socket (mode 0600 and peers of
another uid refused; or, with a socket group, mode 0660 in that group and peers of any uid the kernel let connect,
their uid recorded), then HELLO with the cluster or a tenant token (:mod:`~kvtier.transfer.fetch_protocol`); a
connection is that tenant and is handed descriptors (MAP) of that tenant's segments only.

**Credentials.** The fetcher holds no tenant's token at rest: it knows the tokens' hashes only
(``cluster.verifier``), so that its files (the client file) give no engine another tenant's token. An engine's
HELLO token is checked against them; the fetcher then keeps that token in memory, and its store calls for that
tenant authenticate with it: it acts as the tenant for that tenant's engines only, never with more authority than
they have. When the tenant's last connection closes, its token and store clients are forgotten.

How a FETCH is answered, per block:

1. In the tenant's segment of the size class the length fits (made on first use), with the same length and, when
   one is given, the same header digest: pinned, answered HIT at once.
2. Already being read for another request: waits for that read (one store read per block however many ask).
3. Otherwise a slot is reserved (a free one, else the least recently used unpinned one) and the block joins this
   request's store read: one ``get_into`` for all of them, straight into the slots, by a worker thread, in
   priority order (PREFETCH after FETCH). FETCHED, MISS or ERROR when it returns; FULL if no slot could be had
   (with a message when the tenant's share can never hold such a block).

The reply goes out when every block of the request has its answer. Pins belong to the connection: RELEASE drops
them, and so does the connection closing (an engine that dies loses nothing and leaks nothing).

A PUT stores blocks an engine wrote into the tenant's outbox (slots ALLOC gave this connection): the fetcher first
copies them into cache slots (its own, sealed: what it stores is then what it caches, whatever the engine writes
afterwards), stores them from there, and publishes them as hits.

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

import array
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.kernels import _hostcopy
from kvtier.kvstore.client import CapacityError, Client
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.wire.admission import (
    Acceptor,
    Admission,
    LogLimiter,
    Refused,
    Ticket,
    authenticate,
    busy,
    closer,
    peer_of,
    turn_away,
)
from kvtier.kvstore.wire.protocol import (
    ErrorCode,
    Frame,
    FrameReader,
    Op,
    ProtocolError,
    TenantBudgets,
    encode_error,
    encode_head,
)
from kvtier.transfer import fetch_protocol as fp
from kvtier.transfer.conn import requests_only
from kvtier.transfer.fetch_protocol import BlockStatus, FetchOp
from kvtier.transfer.host_pool import Box, Cache, HostPool, Tenant
from kvtier.transfer.staging import PoolError, read_only

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
_PEERCRED = struct.Struct("3i")


@dataclass(eq=False)
class Session:
    """One engine connection: what it has pinned and what it is filling."""

    sock: socket.socket
    pid: int
    uid: int  # the peer process's, as the kernel says (SO_PEERCRED)
    reader: FrameReader = field(default_factory=FrameReader)
    ticket: Ticket | None = None  # its admission (the HELLO deadline, the slot it holds)
    tenant: Tenant | None = None  # set by HELLO
    token: str = ""  # the one it authenticated with: what store calls for its tenant present
    active: float = field(default_factory=time.monotonic)  # when it last sent something (idle ones are closed)
    out: bytearray = field(default_factory=bytearray)
    # per cache segment (by id), the pins this connection holds on each slot (a pinned slot keeps its generation)
    pins: dict[int, np.ndarray] = field(default_factory=dict)
    allocs: set[tuple[int, int, int]] = field(default_factory=set)  # (outbox id, slot, generation) given out
    closed: bool = False

    def pins_of(self, cache: Cache) -> np.ndarray:
        held = self.pins.get(cache.id)
        if held is None:
            held = self.pins[cache.id] = np.zeros(cache.pool.slots, np.uint32)
        return held


@dataclass(eq=False)
class Answer:
    """A request waiting for its blocks; replied to when ``remaining`` reaches zero."""

    session: Session
    request_id: int
    pin: bool
    seg: int  # the segment the slots are in
    status: np.ndarray
    slots: np.ndarray
    gens: np.ndarray
    remaining: int
    errors: dict[int, str] = field(default_factory=dict)

    @classmethod
    def of(cls, session: Session, request_id: int, n: int, pin: bool, seg: int) -> Answer:
        status, slots, gens = np.full(n, BlockStatus.ERROR, np.uint8), np.zeros(n, "<u4"), np.zeros(n, "<u8")
        return cls(session, request_id, pin, seg, status, slots, gens, n)

    @property
    def pins(self) -> bool:
        """Whether blocks answered to this request are pinned for its connection."""
        return self.pin and not self.session.closed


@dataclass(eq=False)
class Job:
    """One store call for a batch of blocks, each read into (or written from) a slot, run by a worker.

    Block ``j`` answers position ``index[j]`` of the request that asked first (``answer``); other requests that
    wait for the same block (a later FETCH of it, or the same key twice in one request) are in ``extra[j]``.
    A read fills ``slots`` of ``cache``. A put stores from ``box``'s slots ``src``: the first ``len(slots)`` blocks
    are first copied into ``slots`` of ``cache`` (stored from there and cached), the rest stored from the outbox.
    """

    put: bool
    cache: Cache
    length: int
    keys: list[bytes]
    hdrs: list[bytes | None]  # header digests the store checks (None: no check)
    slots: np.ndarray  # int64
    gens: np.ndarray  # uint64
    answer: Answer
    index: np.ndarray  # int64
    ttl_class: str = ""
    box: Box | None = None
    src: np.ndarray | None = None  # a put's outbox slots (int64) and their generations
    src_gens: np.ndarray | None = None
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
        self,
        config: cluster_mod.ClusterConfig,
        host: HostPool,
        socket_path: Path,
        workers: int = 2,
        group: int | None = None,
    ) -> None:
        """``config``: its tenants' tokens as hashes (``cluster.verifier``); ``group``: the socket is that group's
        (mode 0660) and engines of any uid in it are served, else the socket is 0600 and other uids are refused."""
        if workers < 1:
            raise ValueError("the fetcher needs at least one worker thread")
        self.group = group
        self._tokens: dict[str, str] = {}  # tenant -> the token of one of its live connections (store calls use it)
        self._uids_seen: set[tuple[int, str]] = set()  # (uid, tenant) of other uids, logged once each
        self.config = config
        self.host = host
        self.instance = os.urandom(16)  # names this process to clients: a restarted fetcher's segments are new
        self.socket_path = socket_path
        self.epoll = select.epoll()
        self._watched: dict[int, Session | str] = {}  # descriptor -> its session, "listen" or "wake"
        # store reads under way, by (tenant id, length), oldest first: a request for one of their blocks waits for
        # that read (a job's keys are indexed only when another request looks for them: most never are)
        self.flights: dict[tuple[int, int], list[Job]] = {}
        self.jobs: list[tuple[int, int, Job]] = []  # a heap: (priority, sequence, job), under the lock
        self.seq = itertools.count()
        self.sessions: set[Session] = set()
        self._lock = threading.RLock()  # everything but a store call in progress happens under it
        self._waiting = 0  # threads waiting on the epoll
        # store clients not in use, by tenant, the most recently used last: a store call takes that one, whose
        # connections are warm (rotating over one client per thread cost ~1.7 ms more CPU a 64 MiB read)
        self._idle_clients: dict[str, list[Client]] = {}
        self._next_sweep = time.monotonic() + PEER_SWEEP_S
        self.stopping = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.listener = self._listen(socket_path, group)
        self.acceptor = Acceptor(self.listener, log)
        self.admission = Admission(config.limits, tenants=len(config.tenants))
        self.budgets = TenantBudgets(config.limits.max_buffered_meta_bytes, len(config.tenants))
        self.warnings = LogLimiter(log)
        self._listen_paused = False  # accepting failed for lack of resources: the next sweep arms it again
        self._watch(self.listener.fileno(), "listen")
        self._watched[self._wake_r.fileno()] = "wake"  # level-triggered and never drained: stop wakes every thread
        self.epoll.register(self._wake_r.fileno(), select.EPOLLIN)
        self.workers = [threading.Thread(target=self._take_turns, daemon=True) for _ in range(workers)]
        for worker in self.workers:
            worker.start()

    @staticmethod
    def _listen(path: Path, group: int | None) -> socket.socket:
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
        old = os.umask(0o177 if group is None else 0o117)  # created 0600 (same uid only) or 0660 (the group's)
        try:
            sock.bind(str(path))
            if group is not None:
                os.chown(path, -1, group)
        except OSError:
            sock.close()
            raise
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
                for fd, events in ready:
                    self._dispatch(fd, events)
                if time.monotonic() >= self._next_sweep:  # (after: a HELLO that arrived in time is taken)
                    self._sweep_dead_peers()
                    self._next_sweep = time.monotonic() + PEER_SWEEP_S

    def _dispatch(self, fd: int, events: int) -> None:
        """Handle one epoll event (under the lock) and arm the descriptor again."""
        what = self._watched.get(fd)  # None: closed since the event was reported
        if what == "listen":
            self._accept()
            if not self._listen_paused:
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
        pins and allocated slots go back to the pool, as when the socket closes. Close those that did not complete
        HELLO in time, and those silent for ``limits.idle_timeout_s``. Accept again if that was paused."""
        idle_since = time.monotonic() - self.config.limits.idle_timeout_s
        for session in list(self.sessions):
            if session.pid > 0 and not _alive(session.pid):
                log.info("pid %d is gone but its connection stayed open: releasing what it held", session.pid)
                self._close(session)
            elif session.tenant is not None and session.active < idle_since and not session.out:
                self._close(session)
            elif session.tenant is None and session.ticket is not None and not session.ticket.remaining_s():
                self.admission.expired(session.ticket)
                late = f"no complete HELLO within {self.config.limits.hello_timeout_s:g} s of connecting"
                self._refuse(session, 0, ErrorCode.AUTH_REQUIRED, late)
        if self._listen_paused:
            self._listen_paused = False
            self._arm(self.listener.fileno(), select.EPOLLIN)

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
            self.host.close()
        self.epoll.close()
        self.listener.close()
        self.acceptor.close()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    def _accept(self) -> None:
        """Take every waiting connection (same uid only, unless the socket is a group's; admitted as
        :mod:`kvtier.kvstore.wire.admission` says, by the peer's uid) and read its HELLO at once if it came with the
        connect, as an engine's does: it leaves the pre-auth slots before any flood can take its place. Out of
        descriptors or memory, the listener stays unarmed until the next sweep."""
        while (accepted := self.acceptor.accept()) is not None or self.acceptor.pause_s:
            if accepted is None:
                self._listen_paused = True
                return
            sock, _ = accepted
            try:
                pid, uid, _gid = _PEERCRED.unpack(
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
                )
            except OSError:  # gone already
                sock.close()
                continue
            if self.group is None and uid not in (os.getuid(), 0):
                self.warnings.warning("uid", "refused a connection from uid %d (pid %d)", uid, pid)
                sock.close()
                continue
            sock.setblocking(False)
            try:
                ticket = self.admission.admit(peer_of(sock, None), closer(sock, busy))
            except Refused as exc:
                turn_away(sock, busy(str(exc)))
                continue
            reader = FrameReader(self.config.limits.pre_auth(), fp.FETCH_REQUESTS)  # (a budget once it has a tenant)
            session = Session(sock, pid, uid, reader, ticket)
            self.sessions.add(session)
            self._watch(sock.fileno(), session)
            self._receive(session)

    def _receive(self, session: Session) -> None:
        session.active = time.monotonic()
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
            if session.tenant is None and session.ticket is not None:  # (refused at once: the epoll threads hold
                self.admission.failed(session.ticket)  # nothing back, and a peer's connections wait anyway)
                self.warnings.warning("pre-auth", "refused pid %d (uid %d): %s", session.pid, session.uid, exc)
            self._refuse(session, exc.request_id or 0, exc.code, str(exc))
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
        session.reader.close()
        if session.ticket is not None:
            self.admission.release(session.ticket)
        fd = session.sock.fileno()
        if self._watched.get(fd) is session:
            del self._watched[fd]
            with contextlib.suppress(OSError, ValueError):
                self.epoll.unregister(fd)
        session.sock.close()
        tenant = session.tenant
        if tenant is not None and not any(s.tenant is tenant for s in self.sessions):
            self._forget(tenant.name)
        for seg, held in session.pins.items():
            cache = self.host.segments.get(seg)
            if isinstance(cache, Cache):  # (a dropped segment had no pins)
                slots = np.flatnonzero(held)
                repeated = np.repeat(slots, held[slots])
                cache.pool.unpin_many(repeated, cache.pool.gen[repeated])
        for seg, slot, gen in session.allocs:
            self._give_back(seg, np.array([slot]), np.array([gen], np.uint64))
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
            FetchOp.MAP: self._map,
        }
        handler = handlers.get(frame.opcode)
        if handler is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown opcode {frame.opcode}")
        handler(session, frame)

    def _reply(self, session: Session, frame: Frame, meta: dict[str, Any]) -> None:
        self._send(session, encode_head(frame.opcode | Op.REPLY, frame.request_id, meta))

    def _forget(self, tenant: str) -> None:
        """No connection of ``tenant`` is left: forget its token and close its idle store clients (one in a store call
        now is closed when the call returns)."""
        self._tokens.pop(tenant, None)
        for client in self._idle_clients.pop(tenant, []):
            client.close()

    def _hello(self, session: Session, frame: Frame) -> None:
        tenant = authenticate(frame, self.config.tenant_for_token)
        session.tenant = self.host.tenants[tenant]
        if session.ticket is not None:
            try:
                self.admission.authenticated(session.ticket, tenant, capped=tenant != cluster_mod.DEFAULT_TENANT)
            except Refused as exc:
                raise ProtocolError(ErrorCode.BUSY, str(exc), frame.request_id) from None
        session.token = self._tokens[tenant] = frame.meta["token"]
        session.reader.budget = self.budgets.of(tenant)
        if session.uid != os.getuid() and (session.uid, tenant) not in self._uids_seen and len(self._uids_seen) < 4096:
            self._uids_seen.add((session.uid, tenant))
            log.info("uid %d (pid %d) connected as tenant %s", session.uid, session.pid, tenant)
        session.reader.limits = requests_only(self.config.limits)
        self._reply(
            session,
            frame,
            {"instance": self.instance, "hash": self.config.hash_algo, "pid": os.getpid(), "tenant": tenant},
        )

    def _map(self, session: Session, frame: Frame) -> None:
        """Hand the connection descriptors of segments it names, all of them its tenant's (cache segments
        read-only; outboxes read-write), beside the reply (``SCM_RIGHTS``). Naming another tenant's segment, or one
        that is gone, is refused. The reply must be the connection's only output in flight (it is sent at once)."""
        assert session.tenant is not None
        ids = fp.parse_map(frame.meta, 64)
        found = self.host.owned(session.tenant, ids)
        if found is None:
            raise ProtocolError(ErrorCode.FORBIDDEN, f"no segments {ids} of tenant {session.tenant.name!r} here")
        if session.out:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "MAP while replies are still unread")
        live = [s.id for s in session.tenant.segments()]
        meta = fp.mapped_meta([s.describe() for s in found], live)
        head = encode_head(frame.opcode | Op.REPLY, frame.request_id, meta)
        fds = [read_only(s.pool.fd) if isinstance(s, Cache) else os.dup(s.outbox.fd) for s in found]
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        try:
            sent = session.sock.sendmsg([head], rights)
        except OSError:
            self._close(session)
            return
        finally:
            for fd in fds:
                os.close(fd)
        session.out += head[sent:]  # (the descriptors went with the first byte)
        if session.out:
            self._arm_session(session)

    def _fetch(self, session: Session, frame: Frame) -> None:
        request = fp.parse_fetch(frame.meta, self.config.limits.max_batch)
        tenant = session.tenant
        assert tenant is not None
        pin = frame.opcode == FetchOp.FETCH
        tenant.counters["requests"] += 1
        cache = self.host.cache(tenant, request.length)
        if isinstance(cache, str):  # the tenant's share can never hold such a block: FULL, saying why
            self._unplaceable(session, frame, len(request.keys), cache)
            return
        tid, pool = tenant.tid, cache.pool
        priority = request.priority + (0 if pin else PREFETCH_PENALTY)
        answer = Answer.of(session, frame.request_id, len(request.keys), pin, cache.id)
        found = pool.find(tid, request.keys, request.length, request.headers)
        hit = np.flatnonzero(found >= 0)
        if len(hit):
            slots = found[hit]
            if pin:
                gens = pool.pin_many(slots)
                np.add.at(session.pins_of(cache), slots, 1)
            else:
                gens = pool.gen[slots]
                for slot in slots.tolist():
                    pool.touch(slot)
            answer.status[hit], answer.slots[hit], answer.gens[hit] = BlockStatus.HIT, slots, gens
            answer.remaining -= len(hit)
        missed = np.flatnonzero(found < 0)
        if len(missed):
            self._read(session, answer, request, missed, cache, priority)
        pool.count(len(hit), len(request.keys) - len(hit))
        tenant.counters["blocks_hit"] += len(hit)
        if answer.remaining == 0:
            self._answer(answer, frame.opcode)

    def _unplaceable(self, session: Session, frame: Frame, n: int, why: str) -> None:
        """Answer every block of a request FULL with ``why`` (no segment of the tenant can take such blocks)."""
        assert session.tenant is not None
        session.tenant.counters["blocks_full"] += n
        answer = Answer.of(session, frame.request_id, n, False, 0)
        answer.status[:] = BlockStatus.FULL
        answer.errors = dict.fromkeys(range(n), why)
        self._answer(answer, frame.opcode)

    def _read(
        self,
        session: Session,
        answer: Answer,
        request: fp.FetchRequest,
        missed: np.ndarray,
        cache: Cache,
        priority: int,
    ) -> None:
        """The blocks of ``request`` at positions ``missed`` (not in the pool): each waits for a read already under
        way, or joins this request's one store call into freshly reserved slots (FULL when none is left)."""
        keys, hdrs = request.keys, request.headers
        tid = cache.tenant.tid
        flying = self.flights.setdefault((tid, request.length), [])
        wanted = missed.tolist()
        wanted_keys = keys if len(wanted) == len(keys) else list(map(keys.__getitem__, wanted))
        twice: list[tuple[int, int]] = []  # (block of this request's read, position): the same block asked again
        if flying or len(set(wanted_keys)) != len(wanted_keys):
            wanted, twice = self._join(answer, keys, hdrs, wanted, flying, priority)
            wanted_keys = list(map(keys.__getitem__, wanted))
        slots, gens = self.host.reserve(cache, len(wanted), os.getpid())
        got = len(slots)
        if got:
            job = Job(
                False, cache, request.length, wanted_keys[:got],
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
            cache.tenant.counters["blocks_full"] += len(full)
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

    def _answer(self, answer: Answer, opcode: int) -> None:
        meta = fp.slots_meta(answer.seg, answer.status, answer.slots, answer.gens, answer.errors)
        self._send(answer.session, encode_head(opcode | Op.REPLY, answer.request_id, meta))

    def _release(self, session: Session, frame: Frame) -> None:
        segs, slots, gens = fp.parse_release(frame.meta, self.config.limits.max_batch)
        released = 0
        rest = np.ones(len(slots), dtype=bool)  # not a pin of this connection's: maybe a slot it allocated
        for seg, held in session.pins.items():  # only pins this connection holds: another's are not its to drop
            cache = self.host.segments.get(seg)
            if not isinstance(cache, Cache):
                continue
            pool = cache.pool
            mine = np.flatnonzero((segs == seg) & (slots < pool.slots))
            s = slots[mine].astype(np.int64)
            pinned = (held[s] > 0) & (pool.gen[s] == gens[mine])
            rest[mine[pinned]] = False  # (a slot pinned here is not one it allocated: those are in outboxes)
            asked, count = np.unique(s[pinned], return_counts=True)
            take = np.minimum(count, held[asked])  # never more than it holds
            held[asked] -= take.astype(np.uint32)
            released += pool.unpin_many(np.repeat(asked, take), np.repeat(pool.gen[asked], take))
        for i in np.flatnonzero(rest).tolist():
            ref = (int(segs[i]), int(slots[i]), int(gens[i]))
            if ref in session.allocs:
                session.allocs.discard(ref)
                released += self._give_back(ref[0], slots[i : i + 1].astype(np.int64), gens[i : i + 1])
        self._reply(session, frame, {"released": released})

    def _give_back(self, seg: int, slots: np.ndarray, gens: np.ndarray) -> int:
        """Outbox slots of segment ``seg`` given out at ``gens`` come back; how many did."""
        box = self.host.segments.get(seg)
        return box.outbox.give_back(slots, gens) if isinstance(box, Box) else 0

    def _alloc(self, session: Session, frame: Frame) -> None:
        assert session.tenant is not None
        n, length = fp.parse_alloc(frame.meta, self.config.limits.max_batch)
        box = self.host.outbox(session.tenant, length)
        if isinstance(box, str):
            self._unplaceable(session, frame, n, box)
            return
        status = np.full(n, BlockStatus.FULL, np.uint8)
        slots, gens = np.zeros(n, "<u4"), np.zeros(n, "<u8")
        given, generations = box.outbox.take(n)
        got = len(given)
        status[:got], slots[:got], gens[:got] = BlockStatus.ALLOCATED, given, generations
        session.allocs.update(zip(itertools.repeat(box.id), given.tolist(), generations.tolist()))
        self._reply(session, frame, fp.slots_meta(box.id, status, slots, gens, {}))

    def _put(self, session: Session, frame: Frame) -> None:
        request = fp.parse_put(frame.meta, self.config.limits.max_batch)
        tenant = session.tenant
        assert tenant is not None
        entries = request.entries
        answer = Answer.of(session, frame.request_id, len(entries.keys), False, request.seg)
        if request.ttl_class not in self.config.ttl_classes:  # nothing is lost: the slots stay the caller's
            known = ", ".join(sorted(self.config.ttl_classes))
            answer.errors = dict.fromkeys(
                range(len(entries.keys)), f"unknown TTL class {request.ttl_class!r} ({known})"
            )
            answer.status[:], answer.slots[:], answer.gens[:] = BlockStatus.ALLOCATED, entries.slots, entries.gens
            self._answer(answer, frame.opcode)
            return
        ok: list[int] = []
        for i, ref in enumerate(zip(itertools.repeat(request.seg), entries.slots.tolist(), entries.gens.tolist())):
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
        box, cache = self.host.segments.get(request.seg), self.host.cache(tenant, request.length)
        if ok and isinstance(box, Box) and isinstance(cache, Cache) and box.outbox.slot_bytes >= request.length:
            slots, gens = self.host.reserve(cache, len(ok), os.getpid())  # where the blocks are cached (may be fewer)
            job = Job(
                True, cache, request.length, [entries.keys[i] for i in ok], [request.headers[i] for i in ok],
                slots, gens, answer, np.array(ok, dtype=np.int64), request.ttl_class, box=box,
                src=entries.slots[ok].astype(np.int64), src_gens=entries.gens[ok],
            )  # fmt: skip
            heapq.heappush(self.jobs, (0, next(self.seq), job))
        elif ok:  # (allocated here, so only a block longer than its slots gets here)
            answer.status[ok], answer.slots[ok], answer.gens[ok] = (
                BlockStatus.ERROR,
                entries.slots[ok],
                entries.gens[ok],
            )
            answer.errors.update(dict.fromkeys(ok, f"blocks of {request.length} B do not fit these slots"))
            answer.remaining -= len(ok)
            self._give_back(request.seg, entries.slots[ok].astype(np.int64), entries.gens[ok])
        if answer.remaining == 0:
            self._answer(answer, frame.opcode)

    def _stats(self, session: Session, frame: Frame) -> None:
        assert session.tenant is not None
        everyone = session.tenant.name == cluster_mod.DEFAULT_TENANT  # the cluster (admin) token sees all
        self._reply(session, frame, self._counted(None if everyone else session.tenant))

    def stats(self) -> dict[str, Any]:
        """Pool and server counters of every tenant (any thread: ``/metrics`` asks from its own)."""
        with self._lock:
            return self._counted(None)

    def _counted(self, tenant: Tenant | None) -> dict[str, Any]:
        """Counts of ``tenant``'s part (None: all): pool slots by state, counters, blocks in flight."""
        tids = {t.tid for t in self.host.tenants.values()} if tenant is None else {tenant.tid}
        return {
            **self.host.stats(tenant),
            "slot_sizes": self.host.declared if tenant is None else tenant.classes,
            "in_flight": sum(len(j.keys) for (tid, _), flying in self.flights.items() if tid in tids for j in flying),
            "queued_jobs": len({job for _, _, job in self.jobs if not job.started and job.cache.tenant.tid in tids}),
            "sessions": sum(1 for s in self.sessions if s.tenant is not None and s.tenant.tid in tids),
            "pid": os.getpid(),
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
        """Run ``job``'s store call without the lock (held on entry and on return), then complete it. It authenticates
        with the token of one of its tenant's connections (none left: the job fails, and nobody waits for it)."""
        tenant = job.cache.tenant.name
        idle = self._idle_clients.get(tenant)
        client = idle.pop() if idle else None
        token = self._tokens.get(tenant)
        self._lock.release()
        try:
            client = self._store_call(job, client, token)
        finally:
            self._lock.acquire()
        if client is not None and tenant in self._tokens:
            self._idle_clients.setdefault(tenant, []).append(client)
        elif client is not None:
            client.close()
        try:
            self._complete(job)
        except Exception:  # a bug must not stop the thread (its requests' connections see no answer)
            log.exception("completing a store call failed")

    def _store_call(self, job: Job, client: Client | None, token: str | None) -> Client | None:
        """``get_into`` the job's slots, or ``put`` from them, with ``client`` (or a new one authenticated with
        ``token``, returned for the next call); a failure is recorded in ``job``, never raised."""
        if client is None and token is None:
            job.error = f"no engine of tenant {job.cache.tenant.name!r} is connected any more"
            return None
        try:
            if client is None:
                client = Client(self.config, token=token)
            views = job.cache.slot_views(job.slots, job.length)
            if job.put:
                views += self._take_in(job)
                job.result = client.put(job.keys, views, job.ttl_class, headers=job.headers)
            else:
                job.result = client.get_into(job.keys, views, headers=job.headers)
        except CapacityError as exc:
            job.result, job.error = exc.stored, str(exc)
        except Exception as exc:  # any store failure becomes a per-block ERROR answer, never a crash
            log.warning("store call failed: %s", exc)
            job.error = f"{type(exc).__name__}: {exc}"
        return client

    @staticmethod
    def _take_in(job: Job) -> list[memoryview]:
        """A put's blocks copied from the outbox into its cache slots (no GIL held), and views of the outbox slots
        of those that got none (stored from there)."""
        assert job.box is not None and job.src is not None
        box, pool, n = job.box.outbox, job.cache.pool, len(job.slots)
        _hostcopy.copy_rows(pool.address, pool.stride, job.slots, box.address, box.stride, job.src[:n], job.length)
        return [box.view(slot, job.length) for slot in job.src[n:].tolist()]

    def _complete(self, job: Job) -> None:
        """The store call of ``job`` is over (under the lock): its slots published (pinned once per waiting FETCH)
        or freed, every request waiting for it answered, then its blocks no longer in flight."""
        n = len(job.keys)
        ok = np.zeros(n, dtype=bool) if job.result is None else np.fromiter(job.result, bool, n)
        tenant, pool = job.cache.tenant, job.cache.pool
        cached = len(job.slots)  # all of a read's blocks; a put's first ones
        # pins: one per waiting FETCH whose connection is still there (a PUT's slot is left unpinned)
        pins = np.full(cached, 0 if job.put else int(job.answer.pins), dtype=np.uint32)
        for j, waiters in job.extra.items():
            pins[j] += sum(a.pins for a, _ in waiters)
        stored, failed = np.flatnonzero(ok[:cached]), np.flatnonzero(~ok[:cached])
        # the table now (what engines read), the pool's index once the answers are out (``settle`` below)
        rows = job.rows
        if len(stored) == n:
            pool.publish_many(job.slots, tenant.tid, job.keys, job.length, job.hdrs, pins, later=True, rows=rows)
        elif len(stored):
            at = stored.tolist()
            keys, hdrs = list(map(job.keys.__getitem__, at)), list(map(job.hdrs.__getitem__, at))
            rows = None if rows is None else rows[stored]
            slots = job.slots[stored]
            pool.publish_many(slots, tenant.tid, keys, job.length, hdrs, pins[stored], later=True, rows=rows)
        if len(failed):
            pool.abandon_many(job.slots[failed], job.gens[failed])
        if job.put:
            assert job.box is not None and job.src is not None and job.src_gens is not None
            job.box.outbox.give_back(job.src, job.src_gens)  # (the store no longer reads them)
            good, bad = BlockStatus.STORED, BlockStatus.ERROR
            error = job.error or "the store did not commit the block (too few nodes took it)"
            tenant.counters["blocks_put"] += int(ok.sum())
            tenant.counters["blocks_failed"] += n - int(ok.sum())
        else:
            good, bad = BlockStatus.FETCHED, BlockStatus.MISS if job.error is None else BlockStatus.ERROR
            error = job.error or ""
            tenant.counters["bytes_fetched"] += len(stored) * job.length
            tenant.counters["blocks_fetched"] += len(stored)
            tenant.counters["blocks_missed" if job.error is None else "blocks_failed"] += len(failed)
        self._settle(job, job.answer, job.index, ok, good, bad, error)
        for j, waiters in job.extra.items():
            for answer, i in waiters:
                self._settle(job, answer, np.array([i]), ok[j : j + 1], good, bad, error, j)
        if not job.put:
            self._land(job, tenant.tid)
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
        answer.status[index] = np.where(ok, good, bad)
        if job.put:  # a PUT's answer names its outbox slot either way
            assert job.src is not None and job.src_gens is not None
            answer.slots[index], answer.gens[index] = job.src[blocks], job.src_gens[blocks]
        else:  # a failed read names none
            slots, gens = job.slots[blocks], job.gens[blocks]
            answer.slots[index] = np.where(ok, slots, 0)
            answer.gens[index] = np.where(ok, gens, 0)
            if answer.pins:  # a job's slots are distinct
                answer.session.pins_of(job.cache)[slots[ok]] += np.uint32(1)
        if bad == BlockStatus.ERROR and not ok.all():
            answer.errors.update(dict.fromkeys(index[~ok].tolist(), error))
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
