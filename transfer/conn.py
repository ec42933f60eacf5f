"""One blocking, authenticated connection speaking the store's frames: what the fetcher, directory and
StateBlock clients share (connect, HELLO + token, one request at a time, payloads straight into the caller's
buffers). Servers of the same kind share :func:`serve_connections`."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.wire.admission import (
    Acceptor,
    Admission,
    LogLimiter,
    Refused,
    Ticket,
    accept_forever,
    authenticate,
    busy,
    recv_hello,
)
from kvtier.kvstore.wire.protocol import (
    ErrorCode,
    Frame,
    FrameReader,
    Limits,
    Op,
    ProtocolError,
    Schemas,
    TenantBudgets,
    encode_error,
    encode_head,
)
from kvtier.kvstore.wire.sockio import recv_frame, sendmsg_all
from kvtier.kvstore.wire.transport import AuthError

_ids = itertools.count(1)
Sink = Callable[[Frame], Sequence[memoryview] | None]


class PeerError(Exception):
    """The peer is unreachable, closed the connection, or refused a request; the message names it."""


class FrameConn:
    """A lazily opened connection; ``call`` reconnects after a failure. Not thread-safe."""

    def __init__(
        self,
        connect: Callable[[], socket.socket],
        token: str,
        what: str,
        error: type[PeerError] = PeerError,
        idempotent: bool = False,
    ) -> None:
        self._connect = connect
        self.idempotent = idempotent  # requests may be sent again on a fresh connection if a kept one was stale
        self.token = token
        self.what = what  # "the fetcher at PATH": for messages
        self.error = error
        self.sock: socket.socket | None = None
        self.reader = FrameReader()
        self.hello: dict[str, Any] = {}
        self.owed = 0  # replies not read yet, of requests sent by :meth:`post`

    def open(self) -> socket.socket:
        """Connect and authenticate (once). Raises AuthError for a refused token, ``error`` otherwise."""
        if self.sock is not None:
            return self.sock
        try:
            sock = self._connect()
        except OSError as exc:
            raise self.error(f"cannot reach {self.what} ({exc}): is it running?") from None
        self.reader = FrameReader()
        try:
            sock.sendall(encode_head(Op.HELLO, 0, {"token": self.token}))
            frame = recv_frame(sock, self.reader)
        except (OSError, ProtocolError) as exc:
            sock.close()
            raise self.error(f"{self.what} failed during HELLO ({exc})") from None
        if frame is None or frame.opcode == Op.ERROR:
            sock.close()
            message = f"{self.what}: {frame.meta.get('message', '') if frame else 'closed during HELLO'}"
            if frame is not None and frame.meta.get("code") in (ErrorCode.AUTH_FAILED, ErrorCode.AUTH_REQUIRED):
                raise AuthError(message)
            raise self.error(message)
        self.sock, self.hello = sock, frame.meta
        return sock

    def call(
        self, opcode: int, meta: dict[str, Any], payload: Sequence[memoryview] = (), sink: Sink | None = None
    ) -> Frame:
        """Send one request and return its reply. ``sink(head)`` may point the reply's payload at the caller's
        buffers. Raises ``error`` if the connection fails (then closed) or the peer answers ERROR.

        With ``idempotent``, a request that fails on a connection kept from before (the peer closed it while idle,
        or restarted) is sent once more on a new one."""
        kept = self.sock is not None
        try:
            frame = self._exchange(opcode, meta, payload, sink)
        except (OSError, ProtocolError) as exc:
            self.close()
            if not (kept and self.idempotent):
                raise self.error(f"{self.what} went away ({exc})") from None
            try:
                frame = self._exchange(opcode, meta, payload, sink)
            except (OSError, ProtocolError) as again:
                self.close()
                raise self.error(f"{self.what} went away ({again})") from None
        if frame.opcode == Op.ERROR:
            self.close()
            raise self.error(f"{self.what} refused the request: {frame.meta.get('message', '')}")
        return frame

    def post(self, opcode: int, meta: dict[str, Any]) -> None:
        """Send a request whose reply nobody waits for: it is read (and dropped) before the next request is sent,
        so the peer has served it before it serves the next one. Nothing happens without a connection, and a
        connection that fails now is closed quietly: for the requests posted (RELEASE), a connection's end does
        what they ask. An ERROR reply to one fails the next request."""
        if self.sock is None:
            return
        try:
            self.sock.sendall(encode_head(opcode, next(_ids), meta))
        except OSError:
            self.close()
            return
        self.owed += 1

    def _settle(self, sock: socket.socket) -> None:
        """Read the replies owed for posted requests."""
        while self.owed:
            frame = recv_frame(sock, self.reader)
            if frame is None:
                raise ConnectionResetError("connection closed")
            self.owed -= 1
            if frame.opcode == Op.ERROR:
                self.close()
                raise self.error(f"{self.what} refused an earlier request: {frame.meta.get('message', '')}")

    def _exchange(self, opcode: int, meta: dict[str, Any], payload: Sequence[memoryview], sink: Sink | None) -> Frame:
        sock = self.open()
        self._settle(sock)
        head = encode_head(opcode, next(_ids), meta, sum(len(p) for p in payload))
        sendmsg_all(sock, [head, *payload])
        frame = recv_frame(sock, self.reader, None if sink is None else _sinker(sink))
        if frame is None:
            raise ConnectionResetError("connection closed")
        return frame

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.owed = 0


def _sinker(sink: Sink) -> Callable[[FrameReader], None]:
    def before_recv(reader: FrameReader) -> None:
        if reader.needs_sink and reader.head is not None:
            buffers = sink(reader.head)
            if buffers is not None:
                reader.sink(buffers)

    return before_recv


def parse_addr(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``:PORT`` means 127.0.0.1). Raises ValueError saying what is expected."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"bad address {text!r}: use HOST:PORT")
    return host or "127.0.0.1", int(port)


def requests_only(limits: Limits) -> Limits:
    """The servers here take requests without payloads: a frame announcing one is refused before any allocation."""
    return dataclasses.replace(limits, max_payload_bytes=0)


def tcp(addr: tuple[str, int], timeout_s: float) -> Callable[[], socket.socket]:
    def connect() -> socket.socket:
        sock = socket.create_connection(addr, timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    return connect


Handler = Callable[[str, Frame, socket.socket], tuple[dict[str, Any], Sequence[memoryview]] | None]


def serve_connections(
    listener: socket.socket,
    config: cluster_mod.ClusterConfig,
    schemas: Schemas,
    handle: Handler,
    stopping: threading.Event,
    log: logging.Logger,
) -> None:
    """Accept on ``listener`` until ``stopping``; a thread per admitted connection (``config.limits``, as
    :mod:`kvtier.kvstore.wire.admission` says: slots kept for authenticated connections, a share of them per tenant,
    pre-auth slots no flood can fill, HELLO whole within ``hello_timeout_s``, failed HELLOs charged to their
    address): HELLO with a token of ``config`` (constant-time compare), then ``handle(tenant, frame, sock)`` per
    request (its metadata decoded by ``schemas``, buffered within its tenant's share of the metadata budget), which
    returns (reply meta, payload) or None if it replied itself. A malformed request gets an ERROR frame and the
    connection closes; so does one idle for ``limits.idle_timeout_s``. Returns when the listener is closed."""
    listener.settimeout(0.2)  # how soon the loop notices ``stopping``
    acceptor = Acceptor(listener, log)
    admission = Admission(config.limits, tenants=len(config.tenants))
    budgets = TenantBudgets(config.limits.max_buffered_meta_bytes, len(config.tenants))
    warnings = LogLimiter(log)

    def serve(sock: socket.socket, ticket: Ticket) -> None:
        reader = FrameReader(config.limits.pre_auth(), schemas)  # (its budget: its tenant's, once it has one)
        try:
            _session(sock, ticket, admission, reader, config, handle, warnings, budgets)
        finally:
            reader.close()

    try:
        accept_forever(acceptor, admission, stopping, serve, busy)
    except OSError:
        return
    finally:
        acceptor.close()


def _session(
    sock: socket.socket,
    ticket: Ticket,
    admission: Admission,
    reader: FrameReader,
    config: cluster_mod.ClusterConfig,
    handle: Handler,
    warnings: LogLimiter,
    budgets: TenantBudgets,
) -> None:
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    tenant = None
    try:
        frame = recv_hello(sock, reader, ticket, admission)
        if frame is None:
            return
        tenant = authenticate(frame, config.tenant_for_token)
        try:
            admission.authenticated(ticket, tenant, capped=tenant != cluster_mod.DEFAULT_TENANT)
        except Refused as exc:
            raise ProtocolError(ErrorCode.BUSY, str(exc), frame.request_id) from None
        reader.limits = requests_only(config.limits)
        reader.budget = budgets.of(tenant)
        sock.settimeout(config.limits.idle_timeout_s)
        sock.sendall(encode_head(Op.HELLO | Op.REPLY, frame.request_id, {"tenant": tenant}))
        while (frame := recv_frame(sock, reader)) is not None:
            reply = handle(tenant, frame, sock)
            if reply is not None:
                meta, payload = reply
                head = encode_head(frame.opcode | Op.REPLY, frame.request_id, meta, sum(len(p) for p in payload))
                sendmsg_all(sock, [head, *payload])
    except ProtocolError as exc:
        if tenant is None:
            warnings.warning("pre-auth", "refused a connection from %s: %s", ticket.peer, exc)
            time.sleep(admission.failed(ticket))  # (held back once the address's allowance is used up)
        with contextlib.suppress(OSError):
            sock.settimeout(1.0)
            sock.sendall(encode_error(exc.request_id or 0, exc.code, str(exc)))
    except OSError:
        pass
