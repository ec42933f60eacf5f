"""Client-side transport: one connection per node, many requests in flight at once, no copies.

An :class:`Exchange` sends a batch of requests (at most one per node is the common case) over
non-blocking sockets and drives them all from one ``poll`` loop: each request with a payload starts going out as it
is queued (as far as its socket takes it, so a node starts on it while the next is built), with ``sendmsg``
over the caller's buffers or ``_native.Scatter`` pieces (gather, in compiled code: ``_native.send_some``;
a payload may follow in parts, ``Exchange.extend``, while ``run(work=)`` prepares them), replies come in
with ``recvmsg_into`` straight into buffers the caller chooses once it has seen the reply's metadata
(scatter); a round of requests without payloads (MATCH to every primary, a read's GET_SHARDS to each node) is
sent, and its replies' headers and metadata received, in one compiled call (``_native.recv_heads``) before the
loop. The protocol itself is the sans-IO
:class:`~kvtier.kvstore.wire.protocol.FrameReader`.

Failure contract: a node that refuses the connection, resets it, closes it, or does not answer before the
deadline is reported per request as ``Pending.error`` (``"down"``, ``"timeout"``, or the node's error
message); the exchange never raises for it. The one exception is authentication: a node that rejects the
token raises :class:`AuthError`, because retrying cannot help. A node that missed a deadline is, like one that
refused a connection, not tried again for ``retry_down_after_s``: a hung node costs one deadline, not one per
exchange.

A reply the caller no longer wants (``run(until=...)`` returned early) is drained into a scratch buffer on
the next use of that connection, so memory handed back to the caller is never written afterwards.
"""

from __future__ import annotations

import errno
import itertools
import math
import os
import select
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvtier.kvstore import _native
from kvtier.kvstore.wire.protocol import (
    HEADER_SIZE,
    META_LEN_AT,
    ErrorCode,
    Frame,
    FrameReader,
    Limits,
    Op,
    ProtocolError,
    encode_head,
)
from kvtier.kvstore.wire.sockio import recv_frame

_SCRATCH = memoryview(bytearray(1 << 20))
# what a receive must look at: data, and a failed socket (the receive meets the error)
_READABLE = select.POLLIN | select.POLLERR | select.POLLHUP | select.POLLNVAL
# buffers offered to one recvmsg_into: a call acquires every buffer it is given, however few bytes are waiting
# (offering a 1,000-shard reply's whole remaining list on every call made receiving 6.5 KiB shards 20 % slower)
RECV_IOV = 64
MAX_BACKOFF_S = 30.0
_request_ids = itertools.count(1)


class AuthError(Exception):
    """A node rejected this client's token: wrong token for the cluster, or an unknown tenant."""


class ReceivePlan(NamedTuple):
    """Where a reply's payload lands in raw memory (``FrameReader.sink_plan``): int64 rows (address, length), or
    (address, length, shard) with ``crcs``, a uint32 per shard into which the receive folds each piece's bytes
    as they land (shard -1: not checked). ``progress``: an int64 cell the receive stores the payload bytes landed
    so far into while it runs (the plan's pieces before that point are in place and checksummed), for another
    thread to watch. The sink keeps every address valid until the reply completes."""

    plan: np.ndarray
    crcs: np.ndarray | None = None
    progress: np.ndarray | None = None


# what a request sends: bytes, or (address, length) pieces sent in compiled code, no Python object per piece
Outgoing = bytes | memoryview | _native.Scatter

# where a reply's payload goes: buffers, a ReceivePlan, or None (a buffer of its own)
Sink = Callable[[Frame], "Sequence[memoryview] | ReceivePlan | None"]


@dataclass(eq=False)
class Pending:
    """One request and, once it completes, its reply (``frame``) or why there is none (``error``)."""

    node_id: int
    request_id: int
    sink: Sink | None = None
    on_reply: Callable[[Frame], None] | None = None
    frame: Frame | None = None
    error: str | None = None
    abandoned: bool = False
    sunk: bool = False
    wire: list[Outgoing] = field(default_factory=list, repr=False)  # the request, kept for one resend
    resent: bool = False
    sock: socket.socket | None = field(default=None, repr=False)  # the connection its bytes are queued on
    landing: ReceivePlan | None = field(default=None, repr=False)  # the plan its reply lands by

    @property
    def done(self) -> bool:
        return self.frame is not None or self.error is not None

    @property
    def ok(self) -> bool:
        return self.frame is not None and self.frame.opcode != Op.ERROR


@dataclass(eq=False)
class NodeConn:
    node_id: int
    address: tuple[str, int]
    local: str | None = None  # the node's Unix socket on this machine (tried before ``address``)
    sock: socket.socket | None = None
    reader: FrameReader = field(default_factory=FrameReader)
    outgoing: list[Outgoing] = field(default_factory=list)
    sent: int = 0  # bytes of outgoing[0] already sent
    inflight: dict[int, Pending] = field(default_factory=dict)
    down_until: float = 0.0
    timeouts: int = 0  # connection attempts that timed out in a row

    def close(self, error: str) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.outgoing.clear()
        self.sent = 0
        for pending in self.inflight.values():
            if not pending.done:
                pending.error = error
        self.inflight.clear()


class ConnectionPool:
    """Lazily opened, authenticated connections to the nodes of one cluster."""

    def __init__(
        self,
        addresses: dict[int, tuple[str, int]],
        token: str,
        limits: Limits,
        connect_timeout_s: float = 2.0,
        retry_down_after_s: float = 1.0,
    ) -> None:
        self.token = token
        self.limits = limits
        self.connect_timeout_s = connect_timeout_s
        self.retry_down_after_s = retry_down_after_s
        self.conns = {nid: NodeConn(nid, addr) for nid, addr in addresses.items()}
        self.hello: dict[int, dict[str, Any]] = {}
        self.act_as: str | None = None  # admin only: every request acts for this tenant
        self.unavailable: frozenset[int] = frozenset()  # nodes the cluster map says are down: never tried
        self.seen_revision = 0  # the newest cluster map revision a node answered on (its replies' ``rev``)

    def update(
        self,
        addresses: dict[int, tuple[str, int]],
        unavailable: frozenset[int],
        local: dict[int, str] | None = None,
    ) -> None:
        """Follow a new cluster map: nodes that moved are reconnected at their new address, new nodes added,
        removed ones closed; ``unavailable`` nodes are reported down without being tried. ``local``: the Unix
        sockets of nodes on this machine, connected to instead of their TCP address where they answer."""
        local = local or {}
        for nid in set(self.conns) - set(addresses):
            self.conns.pop(nid).close("removed from the cluster map")
        for nid, address in addresses.items():
            conn = self.conns.get(nid)
            if conn is None or conn.address != address or conn.local != local.get(nid):
                if conn is not None:
                    conn.close("moved")
                self.conns[nid] = NodeConn(nid, address, local.get(nid))
        self.unavailable = unavailable

    def get(self, node_id: int, retry_now: bool = False) -> NodeConn | None:
        """An open, authenticated connection, or None while the node is down.

        A node that could not be reached is not tried again for ``retry_down_after_s`` unless
        ``retry_now``. A refused connection is cheap to retry; a connect that *timed out* (a host that
        drops packets) is not, so that wait doubles with each timeout up to ``MAX_BACKOFF_S``.
        """
        conn = self.conns[node_id]
        if conn.sock is not None:
            return conn
        if node_id in self.unavailable:
            return None
        if time.monotonic() < conn.down_until and not retry_now:
            return None
        try:
            sock = self._open(conn)
        except OSError as exc:
            return self._down(conn, timed_out=isinstance(exc, TimeoutError))
        try:
            reply = _handshake(sock, self.token, self.limits, self.connect_timeout_s)
        except OSError as exc:
            sock.close()
            return self._down(conn, timed_out=isinstance(exc, TimeoutError))
        except ProtocolError as exc:
            sock.close()
            if exc.code in (ErrorCode.AUTH_FAILED, ErrorCode.AUTH_REQUIRED):
                raise AuthError(f"node {node_id} at {conn.address[0]}:{conn.address[1]}: {exc}") from None
            return self._down(conn, timed_out=False)
        sock.setblocking(False)
        conn.sock = sock
        conn.reader = FrameReader(self.limits)
        conn.timeouts = 0
        self.hello[node_id] = reply
        return conn

    def _open(self, conn: NodeConn) -> socket.socket:
        """A socket connected to the node: its Unix socket on this machine when it answers there (an older node, or
        one of another user, does not: TCP then), else TCP to its address."""
        if conn.local is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(self.connect_timeout_s)
                sock.connect(conn.local)
                return sock
            except OSError:
                sock.close()
        sock = socket.create_connection(conn.address, timeout=self.connect_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def connect(self, node_ids: Iterable[int] | None = None) -> None:
        """Open connections to nodes (default: all) that have none and are not backing off, all at once: returns
        within ``connect_timeout_s`` however many nodes are slow to answer (``get`` connects one at a time).
        Raises AuthError if a node rejects the token."""
        now = time.monotonic()
        ids = self.conns if node_ids is None else node_ids
        todo = [nid for nid in ids if self.conns[nid].sock is None and now >= self.conns[nid].down_until]
        if len(todo) > 1:
            with ThreadPoolExecutor(len(todo), thread_name_prefix="kvtier-connect") as pool:
                list(pool.map(self.get, todo))  # each thread opens a different node's connection

    def _down(self, conn: NodeConn, timed_out: bool) -> None:
        conn.timeouts = conn.timeouts + 1 if timed_out else 0
        backoff = min(MAX_BACKOFF_S, self.retry_down_after_s * 2 ** max(0, conn.timeouts - 1))
        conn.down_until = time.monotonic() + backoff
        return None

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close("closed")


def _handshake(sock: socket.socket, token: str, limits: Limits, timeout_s: float) -> dict[str, Any]:
    sock.settimeout(timeout_s)
    sock.sendall(encode_head(Op.HELLO, 0, {"token": token, "client": "kvtier"}))
    frame = recv_frame(sock, FrameReader(limits))
    if frame is None:
        raise ConnectionResetError("node closed the connection during HELLO")
    if frame.opcode == Op.ERROR:
        code = frame.meta.get("code")
        known = ErrorCode(code) if code in ErrorCode._value2member_map_ else ErrorCode.INTERNAL
        raise ProtocolError(known, str(frame.meta.get("message", "")))
    return frame.meta


class _Failures:
    """``Exchange._failures_of``: a class, not a generator (entered twice a request: a generator's context costs
    three times as much)."""

    __slots__ = ("conn", "exchange")

    def __init__(self, exchange: Exchange, conn: NodeConn) -> None:
        self.exchange, self.conn = exchange, conn

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if kind is None:
            return False
        if issubclass(kind, ProtocolError):
            self.conn.close(f"bad reply: {exc}")
            return True
        if issubclass(kind, OSError):
            self.exchange._connection_lost(self.conn, "down")
            return True
        return False


class Exchange:
    """A set of requests driven together to completion, failure or deadline."""

    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool
        self.pendings: list[Pending] = []

    def request(
        self,
        node_id: int,
        opcode: Op,
        meta: dict[str, Any],
        payload: Sequence[Outgoing] = (),
        sink: Sink | None = None,
        on_reply: Callable[[Frame], None] | None = None,
        later: int = 0,
    ) -> Pending:
        """Queue a request to ``node_id``.

        ``payload`` items are buffers or ``_native.Scatter`` pieces, which stay valid until ``run`` returns;
        ``later`` more payload bytes follow through ``extend`` (the head announces them).
        ``sink(head)`` chooses where the reply's payload goes (None: a buffer of its own);
        ``on_reply(frame)`` runs as soon as a non-error reply is complete, before ``run`` returns.
        """
        pending = Pending(node_id, next(_request_ids), sink, on_reply)
        self.pendings.append(pending)
        try:
            conn = self.pool.get(node_id)
        except BaseException:
            self.abandon()
            raise
        if conn is None:
            pending.error = "down"
            return pending
        size = sum(len(p) for p in payload) + later if payload else later
        if self.pool.act_as is not None:
            meta = {**meta, "tenant": self.pool.act_as}
        head = encode_head(opcode, pending.request_id, meta, size)
        self._check_limits(meta, len(head), size)
        wire = pending.wire
        wire.append(head)
        if payload:
            wire.extend(p if isinstance(p, _native.Scatter) else memoryview(p).cast("B") for p in payload if len(p))
        conn.outgoing.extend(wire)
        conn.inflight[pending.request_id] = pending
        pending.sock = conn.sock
        if not size:
            return pending  # no payload: sent by ``run`` with the others (``_round_trip_heads``)
        try:
            with self._failures_of(conn):  # out at once, as far as the socket takes it: the node starts on it
                self._send(conn)  # while the caller queues the next node's request
        except BaseException:  # (a reconnect that found the token refused): as ``run`` does
            self.abandon()
            raise
        return pending

    def extend(self, pending: Pending, payload: _native.Scatter) -> None:
        """Send ``payload`` after what ``pending`` queued so far: bytes its ``request`` announced as ``later``
        (on the connection its head went out on; a resend sends them again). Valid until ``run`` returns."""
        pending.wire.append(payload)
        conn = self.pool.conns[pending.node_id]
        if pending.sock is not None and pending.sock is conn.sock:
            conn.outgoing.append(payload)

    def _connection_lost(self, conn: NodeConn, reason: str) -> None:
        """Close a broken connection; resend, once, the requests no reply byte had arrived for.

        Every request kvtier sends is idempotent, and a pooled connection may have died while idle (the
        node restarted), so one resend on a fresh connection turns that into a non-event.
        """
        retry = [p for p in conn.inflight.values() if not p.sunk and not p.abandoned and not p.resent]
        retry_ids = {p.request_id for p in retry}
        if conn.reader.head is not None:
            retry_ids.discard(conn.reader.head.request_id)
        retry = [p for p in retry if p.request_id in retry_ids]
        for pending in retry:
            conn.inflight.pop(pending.request_id)
        conn.close(reason)
        if not retry:
            return
        fresh = self.pool.get(conn.node_id, retry_now=True)
        for pending in retry:
            pending.resent = True
            if fresh is None:
                pending.error = reason
                continue
            fresh.outgoing.extend(pending.wire)
            fresh.inflight[pending.request_id] = pending
            pending.sock = fresh.sock

    def run(
        self,
        timeout_s: float,
        until: Callable[[], bool] | None = None,
        work: Callable[[], bool] | None = None,
        keep: bool = False,
        heads_quiet_ms: int = -1,
    ) -> None:
        """Drive every queued request until all are done, ``until()`` holds, or ``timeout_s`` passes.

        ``work()`` is a step of the caller's own work (e.g. encoding what it ``extend``s requests with next), run
        whenever the sockets have taken everything queued; it returns False once nothing is left to do.
        ``keep``: requests still unanswered stay in flight (the caller queues more and runs again); otherwise
        they are given up (see ``_finish``). ``heads_quiet_ms`` (without ``work``; -1: none): how long after the
        first whole head the round of requests and heads (``_round_trip_heads``) waits for heads not begun before
        it leaves them to the poll loop, which receives the payloads already coming meanwhile.
        """
        try:
            self._run(timeout_s, until, work, keep, heads_quiet_ms)
        except BaseException:
            self.abandon()
            raise

    def _check_limits(self, meta: dict[str, Any], head_bytes: int, payload_bytes: int) -> None:
        """Refuse, before sending, a request the nodes would reject for its size (they would close the
        connection): the caller must split the call."""
        limits = self.pool.limits
        entries = len(meta.get("keys", b"")) // max(1, int(meta.get("klen", 16)))
        too_big = (
            entries > limits.max_batch or head_bytes > limits.max_meta_bytes or payload_bytes > limits.max_payload_bytes
        )
        if too_big:
            self.abandon()
            raise ValueError(
                f"a request of {entries} entries and {payload_bytes} payload bytes for one node exceeds the "
                f"cluster's limits (max_batch {limits.max_batch}, max_payload_bytes {limits.max_payload_bytes}): "
                "split the call"
            )

    def abandon(self) -> None:
        """Give up on every unfinished request of this exchange after an error: their connections are
        closed, so no queued request is sent later and no reply lands in memory the caller owns."""
        for pending in self.pendings:
            if not pending.done:
                self.pool.conns[pending.node_id].close("abandoned")

    def _run(
        self,
        timeout_s: float,
        until: Callable[[], bool] | None,
        work: Callable[[], bool] | None,
        keep: bool,
        heads_quiet_ms: int,
    ) -> None:
        deadline = time.monotonic() + timeout_s
        if work is None:
            self._round_trip_heads(deadline, heads_quiet_ms)
        poller = select.poll()  # no syscall to (un)register: an exchange is short-lived
        watched: dict[int, tuple[NodeConn, socket.socket, int]] = {}  # by descriptor: (conn, its socket, mask)
        early = False
        while True:
            active = [c for c in self.pool.conns.values() if c.sock is not None and (c.inflight or c.outgoing)]
            if not any(not p.done for p in self.pendings):
                break
            if until is not None and until():
                early = True
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not active:
                break
            all_sent = not any(c.outgoing for c in active)
            if work is not None and all_sent:
                work = work if work() else None
                continue
            if all_sent and self._receive_payloads(active, min(remaining, 1.0)):
                continue
            self._watch(poller, watched, active)
            for fd, events in poller.poll(max(1, int(min(remaining, 1.0) * 1000))):
                conn = watched[fd][0]
                if conn.sock is None:
                    continue
                with self._failures_of(conn):
                    if events & select.POLLOUT:
                        self._send(conn)
                    if events & _READABLE:
                        self._receive(conn)
        if not keep:
            self._finish(early)

    @staticmethod
    def _watch(
        poller: select.poll, watched: dict[int, tuple[NodeConn, socket.socket, int]], active: list[NodeConn]
    ) -> None:
        """Make ``poller`` watch exactly the active connections (sockets may have been replaced)."""
        wanted: dict[int, NodeConn] = {}
        for conn in active:
            assert conn.sock is not None
            wanted[conn.sock.fileno()] = conn
        for fd, (conn, sock, _mask) in list(watched.items()):
            if wanted.get(fd) is not conn or conn.sock is not sock:
                poller.unregister(fd)
                del watched[fd]
        for fd, conn in wanted.items():
            mask = select.POLLIN | (select.POLLOUT if conn.outgoing else 0)
            current = watched.get(fd)
            if current is None or current[2] != mask:
                poller.register(fd, mask)  # (registering a watched descriptor again changes its mask)
                watched[fd] = (conn, conn.sock, mask)  # type: ignore[assignment]

    def _round_trip_heads(self, deadline: float, quiet_ms: int) -> None:
        """When every unfinished request is alone on its connection, with no payload going out (a round of MATCH or
        EXISTS, a read's GET_SHARDS): send the requests still queued and receive each reply's header and metadata in
        one compiled call without the GIL (``_native.recv_heads``): per request in Python this cost more than the
        nodes' answers, and a lane of a large read on the H200 spent ~30 of its ~140 ms sending 12 requests and
        taking 12 heads one at a time, its threads contending for the interpreter (139.5 against 151.3 ms for a
        2.45 GB ``get_into`` in 8 lanes). A reply's payload follows its head in the loop. The poll loop goes on with
        what is left: a lost connection (resent once, on a fresh one), a head that has not begun ``quiet_ms`` after
        the first head was whole (when given: a read goes on receiving what came) or by the deadline (the loop ends the
        exchange at the deadline itself: the call's clock counts whole milliseconds)."""
        conns: list[NodeConn] = []
        sends: list[bytes | None] = []
        for pending in self.pendings:
            if pending.done:
                continue
            conn = self.pool.conns[pending.node_id]
            if conn.sock is not pending.sock or len(conn.inflight) != 1 or conn.reader.in_frame:
                return
            queued = conn.outgoing
            if queued and (len(queued) != 1 or conn.sent):
                return
            conns.append(conn)
            sends.append(queued[0] if queued else None)  # type: ignore[arg-type]
        if not conns or len(conns) > _native.MAX_SOCKETS:
            return
        for conn in conns:
            conn.outgoing.clear()  # sent by the call (a send that fails closes the connection, and resends)
            conn.sent = 0
        timeout_ms = max(1, math.ceil((deadline - time.monotonic()) * 1000))
        fds = [conn.sock.fileno() for conn in conns]  # type: ignore[union-attr]
        limit = self.pool.limits.max_meta_bytes
        heads = _native.recv_heads(fds, timeout_ms, HEADER_SIZE, META_LEN_AT, limit, sends, quiet_ms)
        for conn, head in zip(conns, heads, strict=True):
            if isinstance(head, bytes):
                with self._failures_of(conn):
                    frame = conn.reader.take_head(head)
                    if frame is not None:
                        self._completed(conn, frame)
            elif head == errno.ETIMEDOUT:
                self._timed_out(conn)  # part of a request or reply went: the stream is out of step
            elif head is not None:
                self._connection_lost(conn, "down")

    def _timed_out(self, conn: NodeConn) -> None:
        """A node that missed a deadline: slow or hung, so not retried before its back-off (by this call's next
        exchange either), and its connection closed."""
        conn.down_until = max(conn.down_until, time.monotonic() + self.pool.retry_down_after_s)
        conn.close("timeout")

    def _finish(self, early: bool) -> None:
        """Fail what did not complete.

        After an early stop (``until`` held) unwanted replies are drained later into scratch memory, so
        the connection survives; after a deadline the node is slow or hung and its connection is closed.
        """
        for pending in self.pendings:
            if pending.done:
                continue
            conn = self.pool.conns[pending.node_id]
            if not early:
                self._timed_out(conn)
                continue
            if conn.outgoing:  # a request only partly sent cannot be resumed safely either
                conn.close("timeout")
                continue
            pending.abandoned = True
            pending.error = "abandoned"
            head = conn.reader.head
            if head is not None and head.request_id == pending.request_id and pending.sunk:
                conn.reader.discard_payload(_SCRATCH)

    @staticmethod
    def _send(conn: NodeConn) -> None:
        """Send what the socket takes now (compiled: it stops once the socket is full)."""
        assert conn.sock is not None
        try:
            sent = conn.sent + _native.send_some(conn.sock.fileno(), conn.outgoing, conn.sent)
        except BlockingIOError:
            return
        outgoing = conn.outgoing
        whole = 0
        while whole < len(outgoing) and sent >= len(outgoing[whole]):
            sent -= len(outgoing[whole])
            whole += 1
        del outgoing[:whole]
        conn.sent = sent

    def _receive(self, conn: NodeConn) -> None:
        """Receive what ``conn``'s socket holds now, frame by frame (headers and metadata into the reader's own
        buffers, payloads where their request's sink says)."""
        assert conn.sock is not None
        reader = conn.reader
        while True:
            checks = self._sink(conn)
            scatter = reader.scatter
            try:
                if scatter is not None:  # compiled, checksumming as it lands: no Python object per shard
                    n = _native.recv_scatter(conn.sock.fileno(), *scatter, *checks)
                else:
                    n = conn.sock.recvmsg_into(reader.writable()[:RECV_IOV])[0]
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            if n == 0:
                raise ConnectionResetError("node closed the connection")
            self._landed(conn, n)
            if not conn.inflight and not reader.in_frame:  # nothing more is owed: no receive to find it empty
                return

    def _receive_payloads(self, active: list[NodeConn], timeout_s: float) -> bool:
        """While replies' payloads arrive: receive on every one of ``active`` at once in compiled code, until a
        reply is whole, a socket without a payload under way (a header or metadata to parse) is readable, a
        socket fails, or ``timeout_s``. Returns False, receiving nothing, when no payload is under way."""
        if all(conn.reader.head is None for conn in active):  # small replies (MATCH, EXISTS): headers only
            return False
        items: list[tuple[Any, ...]] = []
        for conn in active:
            assert conn.sock is not None
            checks = self._sink(conn)
            scatter = conn.reader.scatter
            items.append(
                (conn.sock.fileno(), *scatter, *checks) if scatter is not None else (conn.sock.fileno(), None, 0, None)
            )
        if all(item[1] is None for item in items):
            return False
        results = _native.recv_many(items, max(1, int(timeout_s * 1000)))
        for conn, (n, err) in zip(active, results, strict=True):
            if conn.sock is None:
                continue
            with self._failures_of(conn):
                if n:
                    self._landed(conn, n)
                if err:
                    raise (
                        ConnectionResetError("node closed the connection")
                        if err < 0
                        else OSError(err, os.strerror(err))
                    )
                if conn.reader.scatter is None:  # a watched socket, or a payload completed: a header may follow
                    self._receive(conn)
        return True

    def _failures_of(self, conn: NodeConn) -> _Failures:
        """Within the block: a bad reply closes ``conn``; a failed socket is lost (its requests resent once)."""
        return _Failures(self, conn)

    def _sink(self, conn: NodeConn) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Once a reply's head has arrived: tell the reader where its payload goes (its request's sink), once.
        Returns the crc32c array the payload's receive plan checks into and the cell it reports progress in, each
        None where there is none."""
        reader = conn.reader
        head = reader.head
        pending = conn.inflight.get(head.request_id) if head is not None else None
        if head is None or pending is None:
            return None, None
        if not pending.sunk:
            pending.sunk = True
            if pending.abandoned:
                reader.discard_payload(_SCRATCH)
            elif pending.sink is not None and head.opcode != Op.ERROR:
                where = pending.sink(head)
                if isinstance(where, ReceivePlan):
                    reader.sink_plan(where.plan)
                    pending.landing = where
                elif where is not None:
                    reader.sink(where)
        landing = pending.landing
        return (landing.crcs, landing.progress) if landing is not None else (None, None)

    def _landed(self, conn: NodeConn, n: int) -> None:
        """``n`` bytes landed where ``conn``'s reader said: advance it, and act on a frame they completed."""
        reader = conn.reader
        reader.advance(n)
        frame = reader.next_frame()
        if frame is not None:
            self._completed(conn, frame)

    def _completed(self, conn: NodeConn, frame: Frame) -> None:
        """A reply is whole on ``conn``: hand it to its request (unless abandoned), noting the node's map revision."""
        revision = frame.meta.get("rev")  # the node's map: a newer one than ours makes the client refresh
        if isinstance(revision, int) and revision > self.pool.seen_revision:
            self.pool.seen_revision = revision
        pending = conn.inflight.pop(frame.request_id, None)
        if pending is None or pending.abandoned:
            return
        pending.frame = frame
        if frame.opcode == Op.ERROR:
            pending.error = str(frame.meta.get("message", "error"))
        elif pending.on_reply is not None:
            pending.on_reply(frame)
