"""Engines' side of the fetcher: :class:`FetchClient` (blocking) and :class:`AsyncFetchClient` (asyncio).

Both speak :mod:`~kvtier.transfer.fetch_protocol` over the fetcher's Unix socket and map the segments of the host
pool that hold their tenant's blocks, so the blocks they return are views of slot memory: numpy (``Block.array``)
or torch (``Block.tensor``, when torch is importable), never copies. Cache segments are mapped **read-only** (the
fetcher hands out sealed descriptors: no mapping of them can ever be made writable); the slots ``alloc`` gives out
are in the tenant's outbox, mapped writable. A reply naming a segment this client has not mapped yet is followed by
a MAP on a short second connection, which brings the descriptors (``SCM_RIGHTS``).

Contract:

- ``fetch`` answers every key: HIT / FETCHED blocks name a slot that is **pinned for this connection** until
  ``release`` (or leaving the ``with`` block, or the connection closing); MISS, FULL and ERROR are answers
  too, never exceptions (a FULL block the pool can never take carries the reason in ``Block.error``).
- A call made on a connection that turns out to be dead (the fetcher restarted since the last call) is sent again,
  once, on a new connection: a restart costs no call. :class:`FetcherError` is raised when the fetcher cannot be
  reached, refuses the request, or dies while the request is outstanding; the next call reconnects. Blocks handed
  out earlier stay mapped; their pins died with the fetcher, and ``Block.valid()`` is False once a slot has been
  reused (a miss, never other bytes).
- A wrong token raises :class:`~kvtier.kvstore.AuthError`. The token is this engine's tenant's: the fetcher
  presents it to the store for this tenant's requests and keeps no token of its own.
- Mapping the tenant's segments makes the process non-dumpable (:mod:`~kvtier.transfer.hardening`), so that no other
  process of its uid reads them out of ``/proc/PID/mem``.
"""

from __future__ import annotations

import asyncio
import itertools
import mmap
import os
import socket
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import numpy as np

from kvtier.kvstore.wire.protocol import ErrorCode, Frame, FrameReader, Op, ProtocolError, encode_head
from kvtier.kvstore.wire.transport import AuthError
from kvtier.transfer import fetch_protocol as fp
from kvtier.transfer.conn import FrameConn, PeerError
from kvtier.transfer.fetch_protocol import OK_STATUSES, BlockStatus, FetchOp
from kvtier.transfer.hardening import not_dumpable
from kvtier.transfer.staging import PoolError, Region, SlotMap

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
_STATUSES = {int(s): s for s in BlockStatus}  # by value, without the enum's per-call cost
_SLOTTED = frozenset(int(s) for s in (*OK_STATUSES, BlockStatus.ALLOCATED))
_SLOTTED_TABLE = np.isin(np.arange(256), sorted(_SLOTTED))  # by status value: an index, cheaper than isin a call
_ids = itertools.count(1)


class FetcherError(PeerError):
    """The fetcher is unreachable, refused the request, or died while it was outstanding."""


class _Gone(FetcherError):
    """The connection died under a request (the request may be sent again on a new one)."""


@dataclass(eq=False, slots=True)
class Block:
    """One key's answer. ``ok`` blocks name a slot of the host pool (``slot``, ``generation``)."""

    key: bytes
    status: BlockStatus
    slot: int = -1
    generation: int = 0
    length: int = 0
    error: str = ""
    pinned: bool = False  # this connection holds a pin (or, for ALLOCATED, the slot itself)
    segment: int = 0  # the id of the segment that holds the slot
    _map: Region | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        """The slot holds this block (HIT, FETCHED) or is this caller's to fill (ALLOCATED)."""
        return self.status in OK_STATUSES or self.status == BlockStatus.ALLOCATED

    def view(self) -> memoryview:
        """The block's bytes in the slot: read-only for HIT / FETCHED, writable for ALLOCATED (filled through it)."""
        if not self.ok or self._map is None:
            raise ValueError(f"block {self.key.hex()} has no slot ({self.status.name})")
        return self._map.view(self.slot, self.length)

    def array(self) -> np.ndarray:
        """numpy uint8 view of the block's bytes (no copy)."""
        return np.frombuffer(self.view(), dtype=np.uint8)

    def tensor(self) -> torch.Tensor:
        """torch uint8 view of the block's bytes (no copy); needs torch."""
        import torch

        with warnings.catch_warnings():  # (a HIT's view is read-only: torch cannot mark its tensor so, and says it)
            warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
            return torch.frombuffer(self.view(), dtype=torch.uint8)

    def valid(self) -> bool:
        """The slot still holds this block. Check it after reading the bytes of a block no longer pinned."""
        if not self.ok or self._map is None:
            return False
        if isinstance(self._map, SlotMap):
            return self._map.valid(self.slot, self.generation)
        return self.pinned and not self._map.gone  # ALLOCATED: still this caller's, from this fetcher


class Blocks(Sequence[Block]):
    """The answers of one call, in key order; a context manager that releases their pins on exit.

    The answers are kept as columns, one row per key: ``status`` (``uint8`` BlockStatus values), ``slots``
    (``uint32``) and ``generations`` (``uint64``), plus :meth:`ok` and :meth:`valid` as ``bool`` arrays, so that a
    caller handling a batch at once (the engine's swap-in) makes no Python object per block. The slots are all in
    one segment, ``segment`` (its mapping; None when no block has a slot). The :class:`Block` objects are made at
    the first access by index or iteration; from then on they hold the pins (``Block.pinned``).
    """

    def __init__(
        self,
        keys: Sequence[bytes],
        columns: tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, str]],
        length: int,
        seg: int,
        segment: Region | None,
        pinned: bool,
        release: Callable[[Blocks], Any],
    ) -> None:
        self.keys = keys
        self.status, self.slots, self.generations, self.errors = columns
        self.length, self.seg, self.segment = length, seg, segment
        self._pinned = self.ok() if pinned else np.zeros(len(keys), dtype=bool)  # until Blocks are made
        self._blocks: list[Block] | None = None
        self._release = release

    def ok(self) -> np.ndarray:
        """Per block whether its slot holds it (HIT, FETCHED) or is this caller's to fill (ALLOCATED)."""
        return _SLOTTED_TABLE[self.status]

    def valid(self) -> np.ndarray:
        """Per block :meth:`Block.valid`, for the whole batch in a few array operations."""
        if isinstance(self.segment, SlotMap):
            return self.segment.valid_many(self.slots, self.generations) & self.ok()
        if self.segment is None or self.segment.gone:
            return np.zeros(len(self), dtype=bool)
        if self._blocks is not None:
            return np.array([b.valid() for b in self._blocks], dtype=bool)
        return self._pinned & self.ok()  # ALLOCATED: those still this caller's

    def leading(self, good: np.ndarray) -> int:
        """How many leading blocks ``good`` (a ``bool`` array such as :meth:`ok`) holds true for."""
        return len(good) if good.all() else int(np.argmin(good))

    def pins(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(segment, slot, generation) of every pin this connection still holds on these blocks, now given up
        here (the caller sends them in a RELEASE)."""
        if self._blocks is None:
            held = np.flatnonzero(self._pinned)
            self._pinned[:] = False
            return np.full(len(held), self.seg, np.uint32), self.slots[held], self.generations[held]
        return _given_up(self._blocks)

    def _made(self) -> list[Block]:
        if self._blocks is None:
            cls, segment, length, errors = self.seg, self.segment, self.length, self.errors
            columns = self.status.tolist(), self.slots.tolist(), self.generations.tolist(), self._pinned.tolist()
            rows = zip(self.keys, *columns, strict=True)
            self._blocks = [  # one comprehension: at 1,024 blocks a call the per-block cost shows
                Block(key, _STATUSES[st], slot, gen, length, errors.get(i, ""), pin, cls, segment)
                if st in _SLOTTED
                else Block(key, _STATUSES[st], error=errors.get(i, ""))
                for i, (key, st, slot, gen, pin) in enumerate(rows)
            ]
        return self._blocks

    def __len__(self) -> int:
        return len(self.status)

    @overload
    def __getitem__(self, index: int) -> Block: ...

    @overload
    def __getitem__(self, index: slice) -> list[Block]: ...

    def __getitem__(self, index: int | slice) -> Block | list[Block]:
        return self._made()[index]

    def __iter__(self) -> Iterator[Block]:
        return iter(self._made())

    def __add__(self, other: Sequence[Block]) -> list[Block]:
        return [*self, *other]

    def __radd__(self, other: Sequence[Block]) -> list[Block]:
        return [*other, *self]

    def __repr__(self) -> str:
        return f"Blocks({self._made()!r})"

    def __enter__(self) -> Blocks:
        return self

    def __exit__(self, *exc: object) -> None:
        result = self._release(self)
        if asyncio.iscoroutine(result):
            result.close()
            raise TypeError("use `async with` for blocks of an AsyncFetchClient")

    async def __aenter__(self) -> Blocks:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._release(self)


def _given_up(blocks: Sequence[Block]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(segment, slot, generation) of the pins ``blocks`` hold, given up here (to be sent in a RELEASE)."""
    held = [b for b in blocks if b.pinned]
    for block in held:
        block.pinned = False
    return (
        np.array([b.segment for b in held], np.uint32),
        np.array([b.slot for b in held], np.uint32),
        np.array([b.generation for b in held], np.uint64),
    )


@dataclass
class _Call(Generic[T]):
    """One request and how to turn its reply into the caller's result (shared by both clients)."""

    opcode: FetchOp
    meta: dict[str, Any]
    finish: Callable[[dict[str, Any]], T]


class _Protocol:
    """What both clients share: requests, replies to blocks, and the segments' mappings."""

    def __init__(self, socket_path: str | Path, token: str, timeout_s: float) -> None:
        self.socket_path = str(socket_path)
        self.token = token
        self.timeout_s = timeout_s
        self.segments: dict[int, Region] = {}  # by id, of the fetcher process this client last spoke to
        self.instance = b""  # which fetcher process that is (a restarted one has new segments)
        self.hash_algo = ""
        self.tenant = ""

    @property
    def what(self) -> str:
        return f"the fetcher at {self.socket_path}"

    def _unix(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        return sock

    def _adopt(self, hello: dict[str, Any]) -> None:
        """A connection's HELLO reply: a fetcher process other than the last one has none of its segments."""
        if hello["instance"] != self.instance:
            for region in self.segments.values():
                region.gone = True  # (blocks handed out keep their mapping; outbox slots are no longer theirs)
            self.segments = {}  # unmapped once no block handed out views them
            self.instance = hello["instance"]
        self.hash_algo, self.tenant = hello["hash"], hello["tenant"]

    def _lost(self, why: object) -> FetcherError:
        return _Gone(f"{self.what} went away ({why})")

    def _unmapped(self, reply: dict[str, Any]) -> list[int]:
        """The segment a reply names, if this client has not mapped it yet."""
        seg = reply.get("seg", 0)
        return [seg] if seg and seg not in self.segments else []

    def _map(self, ids: list[int]) -> None:
        """Map segments ``ids`` (MAP on a connection of its own, blocking: the reply brings their descriptors).
        Raises FetcherError if the fetcher refuses (none of them is this tenant's any more) or went away. The process
        is made non-dumpable first (:mod:`~kvtier.transfer.hardening`): its tenant's blocks are about to be in it."""
        not_dumpable()
        conn = FrameConn(self._unix, self.token, self.what, FetcherError)
        sock = conn.open()
        fds: list[int] = []
        try:
            if conn.hello["instance"] != self.instance:
                raise _Gone(f"{self.what} went away (it restarted)")
            sock.sendall(encode_head(FetchOp.MAP, next(_ids), fp.map_meta(ids)))
            reader, frames = FrameReader(), []
            while not frames:
                data, got, _flags, _ = socket.recv_fds(sock, 1 << 16, 64)
                fds += got
                if not data:
                    raise _Gone(f"{self.what} closed the connection during MAP")
                frames = reader.feed(data)
            if frames[0].opcode == Op.ERROR:
                raise FetcherError(f"{self.what} refused to map segments {ids}: {frames[0].meta.get('message', '')}")
            described, live = fp.parse_mapped(frames[0].meta)
            if len(described) != len(fds):
                raise FetcherError(f"{self.what} sent {len(fds)} descriptors for {len(described)} segments")
            for segment, fd in zip(described, fds, strict=True):
                self.segments[segment.id] = _region(segment, fd)
            for gone in set(self.segments) - live:  # dropped by the fetcher: unmapped once no block views them
                region = self.segments.pop(gone, None)  # (an async client's other MAP may have taken it)
                if region is not None:
                    region.gone = True
        except (OSError, ProtocolError, PoolError, ValueError) as exc:
            raise FetcherError(f"{self.what}: mapping segments {ids} failed ({exc})") from None
        finally:
            conn.close()
            for fd in fds:
                os.close(fd)  # (a mapping needs no descriptor)

    def _slot_blocks(self, keys: Sequence[bytes], length: int, meta: dict[str, Any], pinned: bool) -> Blocks:
        seg = int(meta.get("seg", 0))
        columns = fp.parse_slots(meta, len(keys))
        return Blocks(keys, columns, length, seg, self.segments.get(seg), pinned, self.release)  # type: ignore[attr-defined]

    # -- calls (each public method of both clients is one of these) --------------------------------------

    def _fetch_call(
        self, keys: Sequence[bytes], length: int, headers: Sequence[bytes] | None, priority: int, pin: bool
    ) -> _Call[Blocks]:
        op = FetchOp.FETCH if pin else FetchOp.PREFETCH
        meta = fp.fetch_meta(keys, length, headers, priority)
        return _Call(op, meta, lambda reply: self._slot_blocks(keys, length, reply, pin))

    def _release_call(self, blocks: Sequence[Block]) -> _Call[int]:
        segs, slots, gens = blocks.pins() if isinstance(blocks, Blocks) else _given_up(blocks)
        meta = fp.release_meta(segs, slots, gens)
        return _Call(FetchOp.RELEASE, meta, lambda reply: int(reply.get("released", 0)))

    def _alloc_call(self, n: int, length: int) -> _Call[Blocks]:
        return _Call(
            FetchOp.ALLOC,
            fp.alloc_meta(n, length),
            lambda reply: self._slot_blocks([b""] * n, length, reply, True),
        )

    def _put_call(
        self, keys: Sequence[bytes], blocks: Sequence[Block], ttl_class: str, headers: Sequence[bytes] | None
    ) -> _Call[list[bool]]:
        if len(keys) != len(blocks) or any(b.status != BlockStatus.ALLOCATED or not b.pinned for b in blocks):
            raise ValueError("put needs one ALLOCATED, unreleased block per key (from alloc)")
        length = blocks[0].length if blocks else 1
        seg = blocks[0].segment if blocks else 0
        if any(b.length != length or b.segment != seg for b in blocks):
            raise ValueError("blocks of one put must have one length (and come from one alloc's segment)")
        slots, gens = [b.slot for b in blocks], [b.generation for b in blocks]
        meta = fp.put_meta(seg, keys, length, slots, gens, ttl_class, headers)

        def finish(reply: dict[str, Any]) -> list[bool]:
            status, _, _, errors = fp.parse_slots(reply, len(keys))
            for i, (key, block) in enumerate(zip(keys, blocks, strict=True)):
                block.key, block.status, block.error = key, BlockStatus(int(status[i])), errors.get(i, "")
                block.pinned = block.status == BlockStatus.ALLOCATED  # refused before the store: still the caller's
            return [int(s) == BlockStatus.STORED for s in status]

        return _Call(FetchOp.PUT, meta, finish)

    def _stats_call(self) -> _Call[dict[str, Any]]:
        return _Call(FetchOp.STATS, {}, dict)


def _region(segment: fp.Segment, fd: int) -> Region:
    """Map a segment MAP described: a cache segment read-only (with its table), an outbox writable."""
    if segment.kind == fp.CACHE:
        region: Region = SlotMap.open(fd, segment.name)
        if region.epoch != segment.epoch:  # type: ignore[attr-defined]
            raise PoolError(f"segment {segment.name} is not the one described")
        return region
    size = segment.data_offset + segment.slots * segment.stride
    mapping = mmap.mmap(fd, size)
    return Region(segment.name, mapping, segment.slot_bytes, segment.stride, segment.slots, segment.data_offset)


class FetchClient(_Protocol):
    """Blocking client: one request at a time on one connection (use one per thread). See the module docstring.

    ``connect=False``: connect at the first call instead of now (an engine may start before its fetcher)."""

    def __init__(self, socket_path: str | Path, token: str, timeout_s: float = 60.0, connect: bool = True) -> None:
        super().__init__(socket_path, token, timeout_s)
        # idempotent: a request that finds a kept connection dead is sent once more on a new one (every request is:
        # what a dead connection held, pins and allocations, died with it)
        self._conn = FrameConn(self._unix, token, self.what, FetcherError, idempotent=True)
        self._hello: dict[str, Any] | None = None
        if connect:
            self.connect()

    def connect(self) -> None:
        """Connect and authenticate now, if not connected. FetcherError if the fetcher cannot be reached; AuthError
        if it refuses the token."""
        if self._conn.sock is None:
            self._conn.open()
        self._adopted()

    def _adopted(self) -> None:
        if self._conn.hello is not self._hello:  # a new connection (maybe to a restarted fetcher)
            self._adopt(self._conn.hello)
            self._hello = self._conn.hello

    def _run(self, call: _Call[T]) -> T:
        """One request; FetcherError (connection closed, to be reopened by the next call) on any failure."""
        self.connect()
        reply = self._conn.call(call.opcode, call.meta).meta
        self._adopted()
        unmapped = self._unmapped(reply)
        if unmapped:
            try:
                self._map(unmapped)
            except FetcherError:
                self._conn.close()  # (the pins of this reply go with the connection)
                raise
        return call.finish(reply)

    def fetch(
        self, keys: Sequence[bytes], block_bytes: int, *, headers: Sequence[bytes] | None = None, priority: int = 0
    ) -> Blocks:
        """Every key's block into the host pool (pinned for this connection); see :class:`Block`.

        ``headers``: the store's header digests (``kvstore.keys.header_digests``) so that a key collision is a
        MISS; ``priority``: lower is served first.
        """
        return self._run(self._fetch_call(keys, block_bytes, headers, priority, pin=True))

    def prefetch(
        self, keys: Sequence[bytes], block_bytes: int, *, headers: Sequence[bytes] | None = None, priority: int = 0
    ) -> Blocks:
        """Bring blocks into the pool behind every fetch, pinning nothing; answered when done."""
        return self._run(self._fetch_call(keys, block_bytes, headers, priority, pin=False))

    def release(self, blocks: Sequence[Block]) -> int:
        """Drop this connection's pins on ``blocks`` (and give back ALLOCATED slots not put); how many."""
        call = self._release_call(blocks)
        return self._run(call) if self._conn.sock is not None else 0

    def release_later(self, blocks: Sequence[Block]) -> None:
        """:meth:`release` without waiting for the reply (a round trip, ~1 ms, off a request's critical path): the
        fetcher has dropped the pins before it serves this client's next request, or at once if the connection
        ends; another connection may still find them held for a moment."""
        call = self._release_call(blocks)
        self._conn.post(call.opcode, call.meta)

    def alloc(self, n: int, block_bytes: int) -> Blocks:
        """Up to ``n`` slots of the tenant's outbox to write blocks of ``block_bytes`` into (ALLOCATED, writable;
        FULL past the outbox's free slots)."""
        return self._run(self._alloc_call(n, block_bytes))

    def put(
        self,
        keys: Sequence[bytes],
        blocks: Sequence[Block],
        ttl_class: str = "chatbot",
        *,
        headers: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """Store ALLOCATED slots under ``keys`` (the fetcher copies them into its cache and stores them from there);
        per key whether it is committed. Stored blocks stay in the pool as hits; the slots are no longer this
        caller's."""
        return self._run(self._put_call(keys, blocks, ttl_class, headers))

    def stats(self) -> dict[str, Any]:
        """This tenant's pool usage, hit ratio, blocks in flight and counters (the cluster token: everyone's)."""
        return self._run(self._stats_call())

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> FetchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Replies(asyncio.Protocol):
    """One connection's replies, matched to the requests waiting for them. A connection that fails fails its own
    requests only (a client that reconnected meanwhile is not touched)."""

    def __init__(self, owner: AsyncFetchClient) -> None:
        self.owner = owner
        self.reader = FrameReader()
        self.transport: asyncio.Transport | None = None
        self.waiting: dict[int, asyncio.Future[Frame]] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.reader.feed(data)
        except ProtocolError as exc:
            self.fail(exc)
            return
        for frame in frames:
            future = self.waiting.pop(frame.request_id, None)
            if future is None and frame.opcode == Op.ERROR and self.waiting:  # an error about no one request
                future = self.waiting.pop(next(iter(self.waiting)))
            if future is not None and not future.done():
                future.set_result(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(exc or "connection closed")

    def fail(self, why: object) -> None:
        if self.transport is not None:
            self.transport.close()
        waiting, self.waiting = self.waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(self.owner._lost(why))
        if self.owner._conn is self:
            self.owner._conn = None


class AsyncFetchClient(_Protocol):
    """asyncio client: the same calls as coroutines, any number in flight on one connection.

    Create it with ``await AsyncFetchClient.connect(path, token)``.
    """

    def __init__(self, socket_path: str | Path, token: str, timeout_s: float = 60.0) -> None:
        super().__init__(socket_path, token, timeout_s)
        self._conn: _Replies | None = None
        self._opening = asyncio.Lock()

    @classmethod
    async def connect(cls, socket_path: str | Path, token: str, timeout_s: float = 60.0) -> AsyncFetchClient:
        client = cls(socket_path, token, timeout_s)
        await client._open()
        return client

    async def _open(self) -> _Replies:
        async with self._opening:  # calls that find no connection open one together
            if self._conn is not None:
                return self._conn
            loop = asyncio.get_running_loop()
            try:
                _, conn = await loop.create_unix_connection(lambda: _Replies(self), self.socket_path)
            except OSError as exc:
                raise FetcherError(
                    f"cannot reach the fetcher at {self.socket_path} ({exc}): is kvtier-fetcher running?"
                ) from None
            try:
                frame = await self._exchange(conn, FetchOp.HELLO, {"token": self.token})
                if frame.opcode == Op.ERROR:
                    message = f"{self.what}: {frame.meta.get('message', '')}"
                    if frame.meta.get("code") in (ErrorCode.AUTH_FAILED, ErrorCode.AUTH_REQUIRED):
                        raise AuthError(message)
                    raise FetcherError(message)
                self._adopt(frame.meta)
            except BaseException:
                conn.fail("HELLO failed")
                raise
            self._conn = conn
            return conn

    async def _exchange(self, conn: _Replies, opcode: int, meta: dict[str, Any]) -> Frame:
        assert conn.transport is not None
        request_id = next(_ids)
        future = asyncio.get_running_loop().create_future()
        conn.waiting[request_id] = future
        conn.transport.write(encode_head(opcode, request_id, meta))
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            conn.waiting.pop(request_id, None)
            raise FetcherError(f"{self.what} did not answer in {self.timeout_s:g} s") from None

    async def _run(self, call: _Call[T]) -> T:
        kept = self._conn
        conn = kept or await self._open()
        try:
            frame = await self._exchange(conn, call.opcode, call.meta)
        except _Gone:
            if kept is None:
                raise
            frame = await self._exchange(await self._open(), call.opcode, call.meta)  # a dead kept connection: once
        if frame.opcode == Op.ERROR:
            (self._conn or conn).fail("the fetcher refused a request")
            raise FetcherError(f"{self.what} refused the request: {frame.meta.get('message', '')}")
        unmapped = self._unmapped(frame.meta)
        if unmapped:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._map, unmapped)
            except FetcherError:
                if self._conn is not None:
                    self._conn.fail("mapping failed")  # (the pins of this reply go with the connection)
                raise
        return call.finish(frame.meta)

    async def fetch(
        self, keys: Sequence[bytes], block_bytes: int, *, headers: Sequence[bytes] | None = None, priority: int = 0
    ) -> Blocks:
        """See :meth:`FetchClient.fetch`."""
        return await self._run(self._fetch_call(keys, block_bytes, headers, priority, pin=True))

    async def prefetch(
        self, keys: Sequence[bytes], block_bytes: int, *, headers: Sequence[bytes] | None = None, priority: int = 0
    ) -> Blocks:
        """See :meth:`FetchClient.prefetch`."""
        return await self._run(self._fetch_call(keys, block_bytes, headers, priority, pin=False))

    async def release(self, blocks: Sequence[Block]) -> int:
        """See :meth:`FetchClient.release`."""
        call = self._release_call(blocks)
        return await self._run(call) if self._conn is not None else 0

    async def alloc(self, n: int, block_bytes: int) -> Blocks:
        """See :meth:`FetchClient.alloc`."""
        return await self._run(self._alloc_call(n, block_bytes))

    async def put(
        self,
        keys: Sequence[bytes],
        blocks: Sequence[Block],
        ttl_class: str = "chatbot",
        *,
        headers: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """See :meth:`FetchClient.put`."""
        return await self._run(self._put_call(keys, blocks, ttl_class, headers))

    async def stats(self) -> dict[str, Any]:
        """See :meth:`FetchClient.stats`."""
        return await self._run(self._stats_call())

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.fail("closed")

    async def __aenter__(self) -> AsyncFetchClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
