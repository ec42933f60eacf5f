"""Admission of connections to kvtier's servers: what a peer may hold of a server before and after it
authenticates, and accepting that survives the kernel running out of descriptors.

Every server that peers reach (storage nodes, the directory and StateBlock servers, the fetcher, the metrics
endpoints) takes connections the same way:

1. **Accept** with :class:`Acceptor`. Out of file descriptors (``EMFILE``/``ENFILE``), it closes a descriptor
   held in reserve for the purpose, accepts the waiting connection, closes it, and takes the reserve again (as
   nginx and libuv do): the peer is turned away and the server keeps running, where an unhandled ``accept``
   error used to end it. Out of kernel memory (``ENOBUFS``/``ENOMEM``), or with no reserve left, the caller
   backs off ``pause_s`` before accepting again. A connection that died in the backlog (``ECONNABORTED``) is
   skipped. Each is logged, rate-limited.
2. **Admit** with :class:`Admission`, by the peer's address (an IP; for a Unix socket the peer's uid). Before
   HELLO a connection holds one of ``max_pre_auth_connections`` slots, at most ``max_pre_auth_per_peer`` of
   them per address; the rest of ``max_connections`` is kept for authenticated connections. A new connection
   finding those full is not refused: it takes the place of the **oldest waiting connection of the address
   that holds the most** (its own, when its address is at its limit), which is closed with ERROR(BUSY). A
   client sends HELLO as soon as it connects and leaves the pre-auth slots within a round trip; a flood's
   connections wait. So however many addresses or processes flood, a new client is closed only if the heaviest
   flooder opens more connections than the slots hold in the time its HELLO takes to arrive, while each
   flooder's connections only ever displace each other (a flood of one address: its own). Refused outright
   only when ``max_connections`` are open and none of them waits for HELLO.
3. **HELLO** by the ticket's ``deadline``: ``hello_timeout_s`` after the accept for the whole of it, however
   slowly its bytes trickle in, with at most ``max_pre_auth_meta_bytes`` of metadata and no payload
   (``Limits.pre_auth``). Then :meth:`Admission.authenticated` (the connection leaves the pre-auth count for its
   tenant's slots: at most ``max_connections_per_tenant``, by default an equal share of the authenticated slots
   among the cluster's tenants, the admin's own connections aside, so that no tenant's connections shut out
   another's) or :meth:`Admission.failed`, which charges the address: beyond ``max_auth_failures_per_peer``
   failures (an allowance refilled over ``auth_failure_window_s``) the refusal is held back until the allowance
   has refilled by one (at most ``hello_timeout_s``). A guesser's rate is then bounded by its pre-auth
   connections, while a client with a good token on the same address (another tenant on a shared host) is never
   refused.
4. **Idle**: an authenticated connection that sends nothing for ``idle_timeout_s`` is closed (by the server).
5. **Close**: :meth:`Admission.release`, once, whatever happened.

Thread-per-connection servers run steps 1, 2 and 4 with :func:`accept_forever` and step 3 with
:func:`recv_hello` and :func:`authenticate`; the fetcher (one epoll) calls the same pieces itself.

Warnings a peer can trigger go through :class:`LogLimiter`, so a fuzzer cannot fill the disk with log lines.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.kvstore.wire.protocol import ErrorCode, Frame, FrameReader, Limits, Op, ProtocolError, encode_error
from kvtier.kvstore.wire.sockio import recv_frame

OUT_OF_DESCRIPTORS = frozenset((errno.EMFILE, errno.ENFILE))
OUT_OF_MEMORY = frozenset((errno.ENOBUFS, errno.ENOMEM))
PEER_GONE = frozenset((errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ECONNRESET, errno.EINTR))
ACCEPT_BACKOFF_S = 0.05  # how long to wait before accepting again when nothing could be dropped
MAX_TRACKED_PEERS = 4096  # failure allowances kept before the full ones are forgotten


class Refused(Exception):
    """A connection is not admitted; the message says why (sent to the peer with ERROR(BUSY))."""


class LogLimiter:
    """Warnings that peers can cause, at most ``burst`` per ``period_s`` of each kind (thread-safe); the rest
    are counted, and the count is logged with the next warning of that kind let through."""

    def __init__(
        self, log: logging.Logger, burst: int = 5, period_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.log = log
        self.burst = burst
        self.period_s = period_s
        self.clock = clock
        self._lock = threading.Lock()
        self._kinds: dict[str, list[float]] = {}  # kind -> [window start, logged in window, suppressed]

    def warning(self, kind: str, message: str, *args: Any) -> None:
        now = self.clock()
        with self._lock:
            window = self._kinds.setdefault(kind, [now, 0, 0])
            if now - window[0] >= self.period_s:
                window[0], window[1] = now, 0
            if window[1] >= self.burst:
                window[2] += 1
                return
            window[1] += 1
            suppressed, window[2] = int(window[2]), 0
        if suppressed:
            message += f" ({suppressed} more like it not logged)"
        self.log.warning(message, *args)


class Acceptor:
    """``accept`` on a listening socket that survives running out of descriptors or memory (step 1 above).

    Not thread-safe: one thread accepts on a listener.
    """

    def __init__(self, listener: socket.socket, log: logging.Logger) -> None:
        self.listener = listener
        self.log = LogLimiter(log)
        self.dropped = 0  # connections closed unserved for lack of descriptors
        self.pause_s = 0.0  # after accept() returned None: wait this long before calling it again
        self._reserve: int | None = None
        self._take_reserve()

    def accept(self) -> tuple[socket.socket, Any] | None:
        """The next connection and its peer address; None when none is waiting (a non-blocking listener, or a
        blocking one's timeout) or when one was turned away. Raises OSError only when the listener itself is
        unusable (closed or shut down)."""
        self.pause_s = 0.0
        if self._reserve is None:
            self._take_reserve()
        try:
            return self.listener.accept()
        except (BlockingIOError, TimeoutError):
            return None
        except OSError as exc:
            if exc.errno in OUT_OF_DESCRIPTORS:
                self._turn_away(exc)
            elif exc.errno in OUT_OF_MEMORY:
                self.pause_s = ACCEPT_BACKOFF_S
                self.log.warning("memory", "accept failed (%s): backing off", exc.strerror)
            elif exc.errno not in PEER_GONE:
                raise
            return None

    def _turn_away(self, exc: OSError) -> None:
        """Accept one waiting connection with the reserve descriptor and close it, so the backlog drains
        instead of waking this loop again and again; back off if there is no reserve to use."""
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None
            with contextlib.suppress(OSError):
                sock, _ = self.listener.accept()
                sock.close()
                self.dropped += 1
            self._take_reserve()
        if self._reserve is None:
            self.pause_s = ACCEPT_BACKOFF_S
        self.log.warning(
            "descriptors",
            "out of file descriptors (%s): turning connections away (%d so far)",
            exc.strerror,
            self.dropped,
        )

    def _take_reserve(self) -> None:
        try:
            self._reserve = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._reserve = None

    def close(self) -> None:
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None


@dataclass(eq=False)
class Ticket:
    """One admitted connection: its peer, when its HELLO must be complete (by ``clock``), its state, and how to close
    it should a newer connection take its place before it authenticates (``evict(reason)``)."""

    peer: str
    deadline: float
    clock: Callable[[], float] = time.monotonic
    evict: Callable[[str], None] | None = None
    authenticated: bool = False
    released: bool = False
    evicted: bool = False
    tenant: str = ""

    def remaining_s(self) -> float:
        """Seconds left to complete HELLO (0 once past the deadline)."""
        return max(0.0, self.deadline - self.clock())

    def recv_timeout_s(self) -> float:
        """How long a receive before HELLO may wait: what is left of the deadline, and past it 1 ms, only to take
        bytes that arrived in time (a server thread that was slow to get to them must not refuse a prompt peer;
        what a peer can still send then is bounded by the pre-auth limits)."""
        return max(self.remaining_s(), 0.001)


def turn_away(sock: socket.socket, message: bytes) -> None:
    """Send ``message`` (a refusal) if the socket takes it at once, never waiting, and close the connection."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        sock.send(message)
    sock.close()


def peer_of(sock: socket.socket, addr: Any) -> str:
    """The address a connection is admitted by: its IP (any port), or for a Unix socket the peer's uid (the kernel's
    unit of trust: processes of one uid can act for each other, so forking more of them buys nothing)."""
    if sock.family == socket.AF_UNIX:
        uid = int.from_bytes(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)[4:8], "little")
        return f"uid {uid}"
    return str(addr[0])


def closer(sock: socket.socket, refusal: Callable[[str], bytes]) -> Callable[[str], None]:
    """How to close ``sock`` from another thread when its ticket is evicted: ``refusal(reason)`` sent if the socket
    takes it at once, then both directions shut (its own thread then sees the end and closes it)."""

    def evict(reason: str) -> None:
        with contextlib.suppress(OSError):
            sock.send(refusal(reason), socket.MSG_DONTWAIT)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    return evict


class Admission:
    """The connection slots of one server and the allowances of its peers (steps 2–5 above; thread-safe).

    ``tenants``: how many tenants share the authenticated slots (a server whose tenants change sets it anew)."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic, tenants: int = 1) -> None:
        self.limits = limits
        self.clock = clock
        self.tenants = tenants
        self._lock = threading.Lock()
        self.open = 0
        self.pre_auth = 0
        self._waiting: dict[str, dict[Ticket, None]] = {}  # peer -> its connections waiting for HELLO, oldest first
        self._by_tenant: dict[str, int] = {}  # authenticated connections per tenant
        self._allowance: dict[str, tuple[float, float]] = {}  # peer -> (failures it may still make, as of when)
        self.refused = 0
        self.timed_out = 0
        self.evicted = 0

    @property
    def share(self) -> int:
        """Authenticated connections one tenant may hold (``max_connections_per_tenant``, or an equal share)."""
        limits = self.limits
        equal = (limits.max_connections - limits.max_pre_auth_connections) // max(1, self.tenants)
        return limits.max_connections_per_tenant or max(1, equal)

    def admit(self, peer: str, evict: Callable[[str], None] | None = None) -> Ticket:
        """A ticket for a new connection from ``peer``, closed with ``evict(reason)`` should a newer one take its
        place before it authenticates; the one whose place this takes, if any, is evicted now. Raises
        :class:`Refused` (with the reason to send) only when every slot is held by an authenticated connection."""
        limits = self.limits
        with self._lock:
            victim = self._victim(peer)
            if victim is None and self.open >= limits.max_connections:
                self.refused += 1
                raise Refused("too many connections; retry later")
            if victim is not None:
                self._evict(victim, peer)
            self.open += 1
            self.pre_auth += 1
            ticket = Ticket(peer, self.clock() + limits.hello_timeout_s, self.clock, evict)
            self._waiting.setdefault(peer, {})[ticket] = None
            return ticket

    def _victim(self, peer: str) -> Ticket | None:
        """The waiting connection a new one from ``peer`` takes the place of: its address's oldest if that address is
        at its limit, else, when the pre-auth slots (or all slots) are full, the oldest of the address holding the
        most; None while there is room."""
        limits = self.limits
        mine = self._waiting.get(peer)
        if mine is not None and len(mine) >= limits.max_pre_auth_per_peer:
            return next(iter(mine))
        if self._waiting and (self.pre_auth >= limits.max_pre_auth_connections or self.open >= limits.max_connections):
            heaviest = max(self._waiting.values(), key=lambda waiting: (len(waiting), -next(iter(waiting)).deadline))
            return next(iter(heaviest))
        return None

    def _evict(self, victim: Ticket, newcomer: str) -> None:
        """With the lock held: ``victim`` gives its slot up now, and is closed."""
        victim.evicted = victim.released = True
        self.open -= 1
        self._leave_pre_auth(victim)
        self.evicted += 1
        if victim.evict is not None:
            victim.evict(
                f"too many connections waiting to authenticate: a newer one (from {newcomer}) took this one's "
                "place; retry and send HELLO at once"
            )

    def authenticated(self, ticket: Ticket, tenant: str, capped: bool = True) -> None:
        """HELLO succeeded for ``tenant``: the connection now holds one of its tenant's slots (``capped``: within
        :attr:`share`; the admin's are not). Raises :class:`Refused` when the tenant holds its share already, or the
        connection's place was taken meanwhile (the caller closes it)."""
        with self._lock:
            if ticket.evicted:
                raise Refused("too many connections waiting to authenticate; retry and send HELLO at once")
            if ticket.authenticated or ticket.released:
                return
            held = self._by_tenant.get(tenant, 0)
            if capped and held >= self.share:
                self.refused += 1
                raise Refused(f"tenant {tenant!r} holds {held} connections here, its share; close some or retry later")
            ticket.authenticated, ticket.tenant = True, tenant
            self._by_tenant[tenant] = held + 1
            self._leave_pre_auth(ticket)

    def failed(self, ticket: Ticket) -> float:
        """HELLO failed (unknown token, another frame, malformed, late): charge the peer's allowance. Returns how
        long to hold the connection before refusing it: 0 while the peer had allowance left, else the time until
        one failure's worth has refilled, at most ``hello_timeout_s`` (step 3 above)."""
        limits = self.limits
        with self._lock:
            left = self._allowance_left(ticket.peer)
            self._allowance[ticket.peer] = (left - 1, self.clock())
            if len(self._allowance) > MAX_TRACKED_PEERS:
                self._forget_full()
        if left >= 1:
            return 0.0
        refill_s = (1 - left) * limits.auth_failure_window_s / limits.max_auth_failures_per_peer
        return min(limits.hello_timeout_s, refill_s)

    def expired(self, ticket: Ticket) -> None:
        """The connection did not complete HELLO by its deadline (counted; :meth:`release` still follows)."""
        with self._lock:
            self.timed_out += 1

    def release(self, ticket: Ticket) -> None:
        """The connection is closed (idempotent)."""
        with self._lock:
            if ticket.released:
                return
            ticket.released = True
            self.open -= 1
            if not ticket.authenticated:
                self._leave_pre_auth(ticket)
                return
            left = self._by_tenant[ticket.tenant] - 1
            if left:
                self._by_tenant[ticket.tenant] = left
            else:
                del self._by_tenant[ticket.tenant]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "connections": self.open,
                "pre_auth_connections": self.pre_auth,
                "connections_refused": self.refused,
                "hello_timeouts": self.timed_out,
                "pre_auth_evicted": self.evicted,
            }

    def _leave_pre_auth(self, ticket: Ticket) -> None:
        self.pre_auth -= 1
        waiting = self._waiting[ticket.peer]
        del waiting[ticket]
        if not waiting:
            del self._waiting[ticket.peer]

    def _allowance_left(self, peer: str) -> float:
        """Failed HELLOs ``peer`` may still make now (refilled at ``max / window`` a second, up to ``max``)."""
        limits = self.limits
        full = float(limits.max_auth_failures_per_peer)
        entry = self._allowance.get(peer)
        if entry is None:
            return full
        left, when = entry
        return min(full, left + (self.clock() - when) * full / limits.auth_failure_window_s)

    def _forget_full(self) -> None:
        """Forget peers whose allowance is whole again; if that is not enough, the longest known (they start
        afresh: memory stays bounded however many addresses fail)."""
        full = self.limits.max_auth_failures_per_peer
        for peer in [p for p in self._allowance if self._allowance_left(p) >= full]:
            del self._allowance[peer]
        for peer in list(self._allowance)[: max(0, len(self._allowance) - MAX_TRACKED_PEERS // 2)]:
            del self._allowance[peer]


def accept_forever(
    acceptor: Acceptor,
    admission: Admission,
    stopping: threading.Event,
    serve: Callable[[socket.socket, Ticket], None],
    refusal: Callable[[str], bytes],
) -> None:
    """Accept until ``stopping`` is set and serve each admitted connection on a thread of its own with
    ``serve(conn, ticket)``; the connection is closed and its ticket released when that returns. A connection not
    admitted is sent ``refusal(reason)`` (if its socket takes it at once) and closed.

    Raises OSError only if the listener fails for another reason than a lack of resources (closed, shut down)
    while ``stopping`` is not set.
    """
    log = acceptor.log
    while not stopping.is_set():
        try:
            accepted = acceptor.accept()
        except OSError:
            if stopping.is_set():
                return
            raise
        if accepted is None:
            stopping.wait(acceptor.pause_s)
            continue
        conn, addr = accepted
        try:
            ticket = admission.admit(peer_of(conn, addr), closer(conn, refusal))
        except Refused as exc:
            turn_away(conn, refusal(str(exc)))
            continue
        except OSError:  # gone already (SO_PEERCRED of a closed socket)
            conn.close()
            continue
        try:
            threading.Thread(target=_serve_one, args=(serve, conn, ticket, admission), daemon=True).start()
        except RuntimeError as exc:  # no thread can be started now
            log.warning("threads", "could not serve a connection from %s: %s", ticket.peer, exc)
            admission.release(ticket)
            conn.close()


def _serve_one(
    serve: Callable[[socket.socket, Ticket], None], conn: socket.socket, ticket: Ticket, admission: Admission
) -> None:
    try:
        with conn:
            serve(conn, ticket)
    finally:
        admission.release(ticket)


def busy(reason: str) -> bytes:
    """The refusal of kvtier's frame servers: ERROR(BUSY) with the reason."""
    return encode_error(0, ErrorCode.BUSY, reason)


def recv_hello(sock: socket.socket, reader: FrameReader, ticket: Ticket, admission: Admission) -> Frame | None:
    """The connection's first frame, received by the ticket's deadline however slowly it trickles in (None: the
    peer closed before sending one). Raises ProtocolError(AUTH_REQUIRED) past the deadline (counted) or for a frame
    other than HELLO (at its header, whatever follows it), and what the socket or the reader raise. Leaves the
    socket with a timeout set: the caller sets its own after HELLO."""

    def by_deadline(_reader: FrameReader) -> None:
        sock.settimeout(ticket.recv_timeout_s())

    reader.expect_hello = True
    try:
        return recv_frame(sock, reader, by_deadline)
    except TimeoutError:
        admission.expired(ticket)
        timeout_s = admission.limits.hello_timeout_s
        raise ProtocolError(
            ErrorCode.AUTH_REQUIRED, f"no complete HELLO within {timeout_s:g} s of connecting"
        ) from None
    finally:
        reader.expect_hello = False


def authenticate(frame: Frame, tenant_for_token: Callable[[str], str | None]) -> str:
    """The tenant a connection's first frame authenticates. Raises ProtocolError: AUTH_REQUIRED if it is not
    HELLO, AUTH_FAILED if its token is not a tenant's (``tenant_for_token`` compares in constant time)."""
    if frame.opcode != Op.HELLO:
        raise ProtocolError(ErrorCode.AUTH_REQUIRED, "the first frame must be HELLO with a token", frame.request_id)
    token = frame.meta.get("token")
    tenant = tenant_for_token(token) if isinstance(token, str) else None
    if tenant is None:
        raise ProtocolError(ErrorCode.AUTH_FAILED, "authentication failed: unknown token", frame.request_id)
    return tenant
