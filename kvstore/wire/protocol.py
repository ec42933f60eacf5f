"""The kvtier wire protocol, sans-IO: bytes in, frames out, and frames to bytes. No sockets here.

A frame is a fixed 32-byte header, then ``meta_len`` bytes of msgpack metadata (always a map), then
``payload_len`` raw payload bytes::

    offset size field
    0      4    magic        b"KVT\\x01"
    4      1    version      PROTOCOL_VERSION
    5      1    opcode       Op
    6      2    flags        0 (reserved)
    8      8    request_id   echoed by the reply
    16     4    meta_len     <= Limits.max_meta_bytes
    20     8    payload_len  <= Limits.max_payload_bytes
    28     4    header_crc   crc32c of bytes 0..27

All integers little-endian. Limits are checked on the header, before anything is allocated for the body; the
metadata buffer then grows as its bytes arrive (``META_STEP_BYTES`` first, doubling), so a header that announces
megabytes and sends nothing costs nothing, and a server may cap what all its connections buffer at once
(:class:`MetaBudget`); a buffer of at most ``KEPT_META_BYTES`` is kept for the reader's next frame. A server
decodes each request's metadata against that opcode's typed schema (:class:`Schemas`): a field of the wrong type
or an unknown field is refused as it is met, so decoding costs a small multiple of the frame's size whatever the
bytes are (nested containers where a ``bin`` belongs are never built).

:class:`FrameReader` never copies payloads: the I/O layer asks it where the next bytes go (``writable()``,
a list of buffers for ``recv_into``/``recvmsg_into``), reports how many arrived (``advance``), and takes
complete frames (``next_frame``). Once a frame's header and metadata are parsed (``head``), the owner may
point the payload at its own buffers (``sink``), e.g. straight into the destination blocks of a read.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import crc32c
import msgpack
import msgspec

MAGIC = b"KVT\x01"
PROTOCOL_VERSION = 2  # 2: PUT_SHARDS names its put (`put`), COMMIT settles it by name (`act`); no ABORT
HEADER = struct.Struct("<4sBBHQIQI")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 32
META_LEN_AT = 16  # where the header's meta_len lies (for compiled receives that take a frame's head whole)
META_STEP_BYTES = 64 << 10  # a metadata buffer starts this large (or at its frame's size) and doubles as bytes arrive
KEPT_META_BYTES = 4 << 10  # a metadata buffer this small is kept for the next frame (small requests allocate nothing)
_MSGPACK_MAPS = frozenset((*range(0x80, 0x90), 0xDE, 0xDF))  # first bytes of a msgpack map


class Op(enum.IntEnum):
    """Opcodes. A reply carries the request's opcode with REPLY set, or ERROR."""

    HELLO = 1
    PUT_SHARDS = 2
    COMMIT = 3
    GET_SHARDS = 4
    MATCH = 5
    DELETE = 6
    STAT = 7
    NODE_INFO = 8
    ADMIN = 9
    OWE = 10  # a writer tells blocks' primary which of their shards did not commit: the primary owes their repair
    ERROR = 0x7F
    REPLY = 0x80


class Status(enum.IntEnum):
    """Per-entry outcome inside a batched reply."""

    OK = 0
    MISSING = 1  # no committed shard (never written, pending, deleted, expired)
    CORRUPT = 2  # crc mismatch on disk: an erasure, repaired later
    MISMATCH = 3  # header digest differs from the reader's: a key collision, served as a miss
    NO_SPACE = 4  # the node cannot fit the shard within its capacity
    EXISTS = 5  # a committed shard with this key is already stored (put is idempotent)
    ABSENT = 6  # primary only: no live block record, so the block is not visible
    BAD_CLASS = 7  # unknown TTL class
    DRAINING = 8  # the node is being drained: it takes no new shards


class ErrorCode(enum.IntEnum):
    BAD_FRAME = 1
    TOO_LARGE = 2
    AUTH_REQUIRED = 3
    AUTH_FAILED = 4
    BAD_REQUEST = 5
    FORBIDDEN = 6
    INTERNAL = 7
    BUSY = 8  # the node serves as many connections as it allows; try again later
    NO_SPACE = 9  # the node's disk has no room to record the request: nothing was changed (the connection stays)


class ProtocolError(Exception):
    """The peer sent something the protocol does not allow; the connection must be closed.

    ``request_id``: the request it was about, when the frame's header had named one (the ERROR echoes it)."""

    def __init__(self, code: ErrorCode, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id


MAX_BATCH = 1 << 16
"""The most a cluster may set ``limits.max_batch`` to: request schemas bound their lists by it when they are decoded,
before anything of the request is looked at (a list of millions of tiny entries would otherwise be built whole)."""


@dataclass(frozen=True)
class Limits:
    """The ``[limits]`` of the cluster file: upper bounds on frames (enforced on every header, before
    allocation) and on what peers may hold of a server (:mod:`kvtier.kvstore.wire.admission`). One place for their
    defaults; every server of the cluster (nodes, directory, StateBlock servers, fetchers, metrics endpoints)
    applies them."""

    max_meta_bytes: int = 8 << 20
    max_payload_bytes: int = 2 << 30
    max_batch: int = MAX_BATCH  # entries a request may carry; at most MAX_BATCH (request schemas bound lists by it)
    max_connections: int = 1024  # per server: each has a thread; more are refused with ERROR(BUSY)
    # authenticated connections one tenant may hold at a server (the admin's aside); 0: an equal share of the
    # slots not kept for pre-auth connections among the cluster's tenants, so that none shuts another out
    max_connections_per_tenant: int = 0
    idle_timeout_s: float = 300.0  # an authenticated connection that sends nothing this long is closed
    # before HELLO: at most this many connections at once (the rest of max_connections is kept for
    # authenticated ones), this many from one address, HELLO complete within this long of the connect, and
    # at most this much metadata in it (no payload at all)
    max_pre_auth_connections: int = 256
    max_pre_auth_per_peer: int = 16
    hello_timeout_s: float = 5.0
    max_pre_auth_meta_bytes: int = 4 << 10
    # an address whose HELLOs failed this many times is refused for a while: the allowance refills over the window
    max_auth_failures_per_peer: int = 20
    auth_failure_window_s: float = 60.0
    # metadata being received, all connections of a server together: each tenant may hold an equal share of it
    max_buffered_meta_bytes: int = 256 << 20
    # metrics endpoints (/metrics, /health): connections at once, and the time a request may take to arrive
    metrics_max_connections: int = 16
    metrics_request_timeout_s: float = 5.0

    def pre_auth(self) -> Limits:
        """The limits of a connection that has not authenticated yet: small metadata, no payload."""
        return dataclasses.replace(self, max_meta_bytes=self.max_pre_auth_meta_bytes, max_payload_bytes=0, max_batch=16)


class Request(msgspec.Struct, forbid_unknown_fields=True):
    """Base of the typed request metadata that servers declare per op (:class:`Schemas`): fields the op does not
    have are refused. Declare each field ``T | Unset = UNSET`` and let the handler say which it needs."""


Unset = msgspec.UnsetType
UNSET = msgspec.UNSET


class Hello(msgspec.Struct):
    """HELLO's metadata, the same for every kvtier server. The token may arrive as anything (a wrong type is a
    failed authentication, not a malformed frame); fields it does not know are skipped (newer clients), which is
    cheap because pre-auth metadata is at most ``max_pre_auth_meta_bytes``."""

    token: Any = msgspec.UNSET
    client: str | msgspec.UnsetType = msgspec.UNSET


class MetaBudget:
    """Bytes of metadata buffers that a server's connections hold at once (thread-safe).

    :class:`FrameReader` takes from it as a buffer grows and gives back once the metadata is decoded (or
    the reader is closed); a reader that cannot take raises ERROR(BUSY), which closes that connection. A
    buffer of at most ``KEPT_META_BYTES`` stays with its reader (and charged) for the next frame, until the
    reader is closed: a connection's small requests allocate and charge nothing.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.used_bytes + n > self.limit_bytes:
                return False
            self.used_bytes += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used_bytes -= n


class TenantBudgets:
    """The metadata budget of a server split by tenant (thread-safe): each tenant's connections take from a
    :class:`MetaBudget` of their own, an equal share of ``limit_bytes`` among ``tenants``, so that one tenant's
    half-sent requests can hold its own share and nobody else's. Connections before HELLO take from none: their
    metadata is at most ``max_pre_auth_meta_bytes`` each, and their number is bounded."""

    def __init__(self, limit_bytes: int, tenants: int = 1) -> None:
        self.limit_bytes = limit_bytes
        self._tenants = max(1, tenants)
        self._budgets: dict[str, MetaBudget] = {}
        self._lock = threading.Lock()

    def of(self, tenant: str, tenants: int | None = None) -> MetaBudget:
        """``tenant``'s budget; ``tenants``: how many tenants the server has now (a share is recomputed if that
        changed)."""
        with self._lock:
            if tenants is not None and max(1, tenants) != self._tenants:
                self._tenants = max(1, tenants)
                for budget in self._budgets.values():
                    budget.limit_bytes = self.limit_bytes // self._tenants
            budget = self._budgets.get(tenant)
            if budget is None:
                budget = self._budgets[tenant] = MetaBudget(self.limit_bytes // self._tenants)
            return budget


class Schemas:
    """The typed metadata of each request opcode a server takes, decoded by msgspec into the op's
    ``msgspec.Struct`` and handed on as a dict of the fields present (fields default to ``msgspec.UNSET``).

    Validation happens while decoding: a value of the wrong type, or a field the op does not have, is refused
    where it is met (``BAD_REQUEST``), so no container is built that the op does not declare. Undecodable
    bytes are ``BAD_FRAME``; an opcode without a schema is ``BAD_REQUEST``.
    """

    def __init__(self, structs: Mapping[int, type[msgspec.Struct]]) -> None:
        self._decoders = {int(op): msgspec.msgpack.Decoder(kind) for op, kind in structs.items()}
        self._fields = {int(op): kind.__struct_fields__ for op, kind in structs.items()}
        self._names = {int(op): getattr(op, "name", str(op)) for op in structs}

    def __or__(self, other: Schemas) -> Schemas:
        merged = Schemas({})
        for table in (self, other):
            merged._decoders.update(table._decoders)
            merged._fields.update(table._fields)
            merged._names.update(table._names)
        return merged

    def decode(self, opcode: int, data: bytes | memoryview) -> dict[str, Any]:
        decoder = self._decoders.get(opcode)
        if decoder is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown opcode {opcode}")
        if not len(data):
            data = b"\x80"  # no metadata: an empty map, so required fields are still missed
        elif data[0] not in _MSGPACK_MAPS:
            raise ProtocolError(ErrorCode.BAD_FRAME, "metadata must be a map")
        try:
            value = decoder.decode(data)
        except msgspec.ValidationError as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"malformed {self._names[opcode]} request: {exc}") from None
        except (msgspec.DecodeError, RecursionError) as exc:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"malformed metadata: {exc}") from None
        return {name: v for name in self._fields[opcode] if (v := getattr(value, name)) is not msgspec.UNSET}


@dataclass
class Frame:
    opcode: int
    request_id: int
    meta: dict[str, Any]
    payload_len: int
    payload: memoryview | None = field(default=None, repr=False)


_HEADER_FIELDS = struct.Struct(HEADER.format[:-1])  # the header up to its checksum
_ENCODER = msgspec.msgpack.Encoder()  # (keeps no state between calls: any thread may use it)


def encode_head(opcode: int, request_id: int, meta: dict[str, Any], payload_len: int = 0) -> bytes:
    """Header plus metadata of one frame; the caller sends ``payload_len`` payload bytes after it."""
    body = _ENCODER.encode(meta)
    head = _HEADER_FIELDS.pack(MAGIC, PROTOCOL_VERSION, opcode, 0, request_id, len(body), payload_len)
    return head + crc32c.crc32c(head).to_bytes(4, "little") + body


def encode_error(request_id: int, code: ErrorCode, message: str) -> bytes:
    return encode_head(Op.ERROR, request_id, {"code": int(code), "message": message})


def parse_header(data: bytes | memoryview, limits: Limits, hello_only: bool = False) -> tuple[int, int, int, int, int]:
    """Validate a 32-byte header; returns (opcode, flags, request_id, meta_len, payload_len). ``hello_only`` (a
    connection not authenticated yet): any other opcode is AUTH_REQUIRED, whatever the rest of the frame holds."""
    magic, version, opcode, flags, request_id, meta_len, payload_len, crc = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"bad magic {bytes(magic)!r}: not a kvtier peer")
    if crc != crc32c.crc32c(data[:28]):
        raise ProtocolError(ErrorCode.BAD_FRAME, "frame header checksum mismatch")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"protocol version {version}, this peer speaks {PROTOCOL_VERSION}")
    if hello_only and opcode != Op.HELLO:
        raise ProtocolError(ErrorCode.AUTH_REQUIRED, "the first frame must be HELLO with a token", request_id)
    if meta_len > limits.max_meta_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"metadata of {meta_len} bytes exceeds {limits.max_meta_bytes}")
    if payload_len > limits.max_payload_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"payload of {payload_len} bytes exceeds {limits.max_payload_bytes}")
    return opcode, flags, request_id, meta_len, payload_len


def parse_meta(data: bytes | memoryview, limits: Limits) -> dict[str, Any]:
    try:
        meta = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_array_len=limits.max_batch,
            max_map_len=1024,
            max_bin_len=limits.max_meta_bytes,
            max_str_len=1 << 16,
        )
    except Exception as exc:  # msgpack raises several unrelated types for malformed input
        raise ProtocolError(ErrorCode.BAD_FRAME, f"malformed metadata: {exc}") from None
    if not isinstance(meta, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "metadata must be a map")
    return meta


class FrameReader:
    """Incremental frame parser over caller-driven receives (see the module docstring).

    ``schemas``: decode each frame's metadata by its opcode's schema (servers); without, any msgpack map within
    the limits (clients reading replies). ``budget``: charge metadata buffers to it; a reader with a budget must
    be closed (:meth:`close`) when its connection ends.
    """

    _HEADER, _META, _PAYLOAD = range(3)

    def __init__(
        self, limits: Limits | None = None, schemas: Schemas | None = None, budget: MetaBudget | None = None
    ) -> None:
        self.limits = limits or Limits()
        self.schemas = schemas
        self.budget = budget
        self.expect_hello = False  # a server's connection before authentication: only HELLO is allowed
        self._header = bytearray(HEADER_SIZE)
        self._state = self._HEADER
        self._filled = 0
        self._meta_buf = bytearray()
        self._meta_len = 0
        self._charged = 0  # bytes of the metadata buffer taken from ``budget``
        self._frame: Frame | None = None
        self._sink: list[memoryview] | None = None
        self._sink_index = 0
        self._plan: Any = None  # an (address, length) int64 array chosen by sink_plan, instead of _sink views
        self._ready: Frame | None = None

    @property
    def head(self) -> Frame | None:
        """The frame whose payload is being received: metadata parsed, payload not yet complete."""
        return self._frame if self._state == self._PAYLOAD else None

    @property
    def in_frame(self) -> bool:
        """Some bytes of a frame have arrived and the rest have not."""
        return self._ready is None and (self._state != self._HEADER or self._filled > 0)

    @property
    def needs_sink(self) -> bool:
        """A frame's payload is about to arrive and nobody has said where it goes yet."""
        return self.head is not None and self._sink is None

    def sink(self, buffers: Sequence[memoryview]) -> None:
        """Receive the current frame's payload into ``buffers`` (their lengths must add up to it)."""
        frame = self.head
        if frame is None or self._sink is not None:
            raise RuntimeError("sink() is only allowed before any payload byte of a frame arrived")
        views = []
        total = 0
        for buffer in buffers:
            view = buffer if isinstance(buffer, memoryview) and buffer.format == "B" else memoryview(buffer).cast("B")
            if view.nbytes:
                views.append(view)
                total += view.nbytes
        if total != frame.payload_len:
            raise ValueError("sink buffers do not add up to the payload length")
        self._sink = views
        self._sink_index = 0

    def sink_plan(self, plan: Any) -> None:
        """Receive the current frame's payload into raw memory: ``plan`` is an int64 array of (address, length)
        rows, in payload order, adding up to the payload; the I/O layer receives with ``scatter`` (compiled
        code, no Python object per piece). The owner keeps every address valid until the frame completes or
        ``discard_payload`` redirects it."""
        frame = self.head
        if frame is None or self._sink is not None:
            raise RuntimeError("sink_plan() is only allowed before any payload byte of a frame arrived")
        if int(plan[:, 1].sum()) != frame.payload_len or (len(plan) and int(plan[:, 1].min()) < 0):
            raise ValueError("sink plan does not add up to the payload length")
        self._plan, self._sink, self._sink_index, self._filled = plan, [], 0, 0

    @property
    def scatter(self) -> tuple[Any, int] | None:
        """(plan, bytes of it already received) while a ``sink_plan`` payload is arriving, else None."""
        return (self._plan, self._filled) if self._plan is not None else None

    def payload_received(self) -> None:
        """The owner received the current frame's whole payload itself (e.g. straight into files, in compiled
        code): the frame is complete, with no ``payload`` of its own."""
        if self.head is None or self._sink is not None:
            raise RuntimeError("payload_received() is only allowed before any payload byte of a frame arrived")
        self._finish_frame()

    def discard_payload(self, scratch: memoryview) -> None:
        """Send the rest of the current payload into ``scratch`` (reused over and over) and drop it.

        Used when the owner abandons a reply whose sink pointed at memory it no longer owns.
        """
        frame = self.head
        if frame is None:
            return
        if self._plan is not None:
            remaining, self._plan = frame.payload_len - self._filled, None
        elif self._sink is None:
            remaining = frame.payload_len
        else:
            remaining = sum(len(v) for v in self._sink[self._sink_index :]) - self._filled
        self._sink = [scratch[: min(len(scratch), remaining - off)] for off in range(0, remaining, len(scratch))]
        self._sink_index = 0
        self._filled = 0

    def writable(self) -> list[memoryview]:
        """Where the next received bytes must go, in order; never beyond the end of the current frame."""
        if self._ready is not None:
            return []
        if self._state == self._HEADER:
            return [memoryview(self._header)[self._filled :]]
        if self._state == self._META:
            return [memoryview(self._meta_buf)[self._filled : self._meta_len]]
        if self._plan is not None:
            raise RuntimeError("this payload goes to a sink plan: receive it with scatter")
        if self._sink is None:  # nobody claimed the payload: it gets a buffer of its own
            assert self._frame is not None
            buf = memoryview(bytearray(self._frame.payload_len))
            self._frame.payload = buf
            self._sink = [buf]
        views = self._sink[self._sink_index :]
        if views and self._filled:
            views = [views[0][self._filled :], *views[1:]]
        return views

    def advance(self, n: int) -> None:
        """``n`` bytes were written into the buffers from ``writable()``; may raise ProtocolError."""
        while n:
            if self._state == self._PAYLOAD:
                n = self._advance_payload(n)
                continue
            buf = self._header if self._state == self._HEADER else self._meta_buf
            end = len(buf) if buf is self._header else min(len(buf), self._meta_len)
            take = min(n, end - self._filled)
            self._filled += take
            n -= take
            if self._filled < end:
                continue
            if buf is self._meta_buf and self._filled < self._meta_len:
                self._grow_meta(min(self._meta_len, 2 * len(buf)))
            else:
                self._stage_done()

    def _advance_payload(self, n: int) -> int:
        if self._plan is not None:
            assert self._frame is not None
            take = min(n, self._frame.payload_len - self._filled)
            self._filled += take
            if self._filled == self._frame.payload_len:
                self._finish_frame()
            return n - take
        assert self._sink is not None
        while n and self._sink_index < len(self._sink):
            current = self._sink[self._sink_index]
            take = min(n, len(current) - self._filled)
            self._filled += take
            n -= take
            if self._filled == len(current):
                self._sink_index += 1
                self._filled = 0
        if self._sink_index == len(self._sink):
            self._finish_frame()
        return n

    def _grow_meta(self, size: int) -> None:
        """Make the metadata buffer ``size`` bytes, keeping what arrived (charged to the budget first)."""
        if self.budget is not None:
            if not self.budget.take(size - self._charged):
                request_id = self._frame.request_id if self._frame is not None else None
                raise ProtocolError(
                    ErrorCode.BUSY, "the server is receiving too much request metadata at once; retry later", request_id
                )
            self._charged = size
        grown = bytearray(size)
        grown[: self._filled] = memoryview(self._meta_buf)[: self._filled]
        self._meta_buf = grown

    def _drop_meta(self) -> None:
        """Let the metadata buffer go (and its charge), unless it is small enough to keep for the next frame."""
        if len(self._meta_buf) <= KEPT_META_BYTES:
            return
        self._release_meta()

    def _release_meta(self) -> None:
        self._meta_buf = bytearray()
        if self.budget is not None and self._charged:
            self.budget.give(self._charged)
        self._charged = 0

    def close(self) -> None:
        """The connection is over: give back what its metadata buffer holds of the budget (idempotent)."""
        self._release_meta()

    def _stage_done(self) -> None:
        if self._state == self._HEADER:
            meta_len = self._open_frame(self._header)
            self._state, self._filled = self._META, 0
            if meta_len > len(self._meta_buf):  # (a kept buffer that holds it is reused as it is)
                self._release_meta()
                self._grow_meta(min(meta_len, META_STEP_BYTES))
            elif not meta_len:
                self._stage_done()
        elif self._state == self._META:
            try:
                self._decoded(memoryview(self._meta_buf)[: self._meta_len])
            finally:
                self._drop_meta()

    def _open_frame(self, header: bytes | bytearray | memoryview) -> int:
        """A frame's header has arrived: checked, it opens the frame; returns its metadata's length."""
        opcode, _flags, request_id, meta_len, payload_len = parse_header(header, self.limits, self.expect_hello)
        self._frame = Frame(opcode, request_id, {}, payload_len)
        self._meta_len = meta_len
        return meta_len

    def _decoded(self, meta: memoryview) -> None:
        """The open frame's metadata has arrived: decoded, the frame waits for its payload, or is complete."""
        frame = self._frame
        assert frame is not None
        try:
            if self.schemas is not None:
                frame.meta = self.schemas.decode(frame.opcode, meta)
            else:
                frame.meta = parse_meta(meta, self.limits) if len(meta) else {}
        except ProtocolError as exc:
            exc.request_id = frame.request_id
            raise
        self._state, self._filled = self._PAYLOAD, 0
        self._sink, self._sink_index = None, 0
        if not frame.payload_len:
            self._finish_frame()

    def take_head(self, data: bytes) -> Frame | None:
        """A frame's header and metadata that the I/O layer received whole itself (``_native.recv_heads``), between
        frames: parsed as ``advance`` would; returns the frame if that completes it (else its payload follows
        through ``writable``/``advance``). Raises ProtocolError as ``advance`` does, and BAD_FRAME when ``data``
        holds other than the header's metadata length."""
        if self.in_frame or self._ready is not None:
            raise RuntimeError("take_head() is only allowed between frames")
        view = memoryview(data)
        meta_len = self._open_frame(view[:HEADER_SIZE])
        if len(view) != HEADER_SIZE + meta_len:
            request_id = self._frame.request_id if self._frame is not None else None
            raise ProtocolError(ErrorCode.BAD_FRAME, "a frame's head does not hold its metadata", request_id)
        self._decoded(view[HEADER_SIZE:])
        return self.next_frame()

    def _finish_frame(self) -> None:
        self._ready, self._frame = self._frame, None
        self._state, self._filled = self._HEADER, 0
        self._sink, self._sink_index, self._plan = None, 0, None

    def next_frame(self) -> Frame | None:
        """The frame completed by the last ``advance``, once; None while one is still in progress."""
        frame, self._ready = self._ready, None
        return frame

    def feed(self, data: bytes) -> list[Frame]:
        """Copy ``data`` in and return every frame it completes (for tests and small control traffic)."""
        frames = []
        view = memoryview(data)
        while True:
            frame = self.next_frame()
            if frame is not None:
                frames.append(frame)
            if not view:
                break
            for target in self.writable():
                take = min(len(target), len(view))
                target[:take] = view[:take]
                view = view[take:]
                self.advance(take)
                if self._ready is not None or not view:
                    break
        return frames
