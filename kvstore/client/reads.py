"""The read path: shards received straight into the caller's buffers, decoded around lost ones, and lost
shards of live blocks rewritten before the call returns; see docs/design.md §5."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from kvtier.kvstore import _native
from kvtier.kvstore.client.core import Buffer, _by_node, header_rows, key_rows
from kvtier.kvstore.client.read_watch import Landing, LaneWatch, ReadWatch
from kvtier.kvstore.client.writes import Writes
from kvtier.kvstore.cluster.config import MAX_READ_LANES
from kvtier.kvstore.codec import DATA_SHARDS, TOTAL_SHARDS, shard_size
from kvtier.kvstore.keys import HEADER_DIGEST_BYTES, NO_HEADER, Namespace, TokenInput
from kvtier.kvstore.wire.protocol import Frame, Op, Status
from kvtier.kvstore.wire.transport import Exchange, ReceivePlan

_OK = int(Status.OK)  # a plain int: numpy probes an IntEnum operand for array protocols (~3 us a comparison)
# How long after its first reply's head a read's round of requests waits for the heads not begun before it receives
# the payloads already coming (docs/design.md §9). Alone: 1 ms. The nodes of a machine with fewer cores than nodes
# answer one after another, and waiting for the last head idled the client while the first replies' payloads stood in
# full socket buffers (5 ms from the round's start cost a 64 MiB get_into of 1 MiB blocks 24.6 against 22.5 ms).
# In lanes: 5 ms. While one lane waits the others use the cores, and a head left to the poll loop is one more
# return to Python for lanes that contend for the interpreter (the round cut a 2.45 GB read in 8 lanes on the H200
# from 151.3 to 139.5 ms).
HEADS_QUIET_MS = 1
LANE_HEADS_QUIET_MS = 5


class BlockLayout:
    """How block ``b`` of length ``L`` maps onto its 10 data shards of ``S`` bytes (the tail is padded)."""

    __slots__ = ("length", "shard")

    def __init__(self, length: int) -> None:
        self.length = length
        self.shard = shard_size(length)

    def region(self, buf: memoryview, index: int) -> memoryview:
        """The part of the block that data shard ``index`` covers (shorter than S for the tail, maybe empty)."""
        start = min(index * self.shard, self.length)
        return buf[start : min(start + self.shard, self.length)]


class ReadState:
    """Book-keeping of one batched read: where each shard goes and which blocks can be decoded. ``allocate``: every
    buffer is None and a block gets one at its first shard (``get``); otherwise every buffer is the caller's."""

    def __init__(self, n: int, buffers: list[memoryview | None], allocate: bool, trust_primary: bool) -> None:
        self.buffers = buffers
        self.allocate = allocate
        self.trust_primary = trust_primary
        self.valid = np.zeros((n, TOTAL_SHARDS), dtype=bool)
        self.asked = np.zeros((n, TOTAL_SHARDS), dtype=bool)
        self.lost = np.zeros((n, TOTAL_SHARDS), dtype=bool)  # a node answered MISSING or CORRUPT: repairable
        self.absent = np.zeros(n, dtype=bool)
        self.mismatch = np.zeros(n, dtype=bool)
        self.corrupt = 0  # shards whose bytes failed their stored crc32c here, at the reader
        self.replies: list[tuple[np.ndarray, dict[str, Any]]] = []  # (entries, meta) of every GET reply
        self.primary_ok = np.zeros(n, dtype=bool)  # the primary answered OK: the block is live
        self.parity: dict[tuple[int, int], memoryview] = {}
        self.receiving: dict[int, Landing] = {}  # request id -> the shards its payload brings
        # where replies land, by address (a plan per reply: see Reads._sink): each destination block's start and
        # length (-1: none yet), and the scratch memory each reply's plan points into, kept until the read ends
        self.base = np.zeros(n, dtype=np.int64)
        self.length = np.full(n, -1, dtype=np.int64)
        self.scratch: dict[int, bytearray] = {}
        self.arrivals = 0  # GET replies complete so far
        self._decodable = (-1, False)  # (arrivals, whether every block was decodable then)
        self.watched = False  # a ReadWatch asks how far replies have landed: their plans report progress
        if not allocate:  # get_into: every destination known from the start
            self._place(range(n), np.fromiter(map(len, buffers), dtype=np.int64, count=n))  # type: ignore[arg-type]

    def arrived(self, frame: Frame, entries: np.ndarray) -> None:
        """A GET reply for ``entries`` is complete: its shards are in place, its verdicts known. A shard whose
        bytes do not match the crc32c the node stored for it is an erasure, like one the node found corrupt."""
        self.arrivals += 1
        statuses = frame.meta.get("st")
        if isinstance(statuses, bytes) and len(statuses) == len(entries):
            st = np.frombuffer(statuses, dtype=np.uint8)
            ok = st == _OK
            if not ok.all():  # the usual reply is all OK: nothing absent, mismatched or lost
                if self.trust_primary:
                    self.absent[entries[st == Status.ABSENT, 0]] = True
                self.mismatch[entries[st == Status.MISMATCH, 0]] = True
                lost = entries[(st == Status.MISSING) | (st == Status.CORRUPT)]
                self.lost[lost[:, 0], lost[:, 1]] = True
            self.primary_ok[entries[ok & (entries[:, 1] == 0), 0]] = True
            self.replies.append((entries, frame.meta))
        landing = self.receiving.pop(frame.request_id, None)
        if landing is None or not len(landing.shards):
            return
        good = landing.shards
        if landing.crcs is not None:
            bad = landing.crcs != landing.expected
            if bad.any():
                self.corrupt += int(bad.sum())
                self.lost[good[bad, 0], good[bad, 1]] = True
                good = good[~bad]
        self.valid[good[:, 0], good[:, 1]] = True

    def stored_as(self, blocks: Sequence[int]) -> list[tuple[str | None, bytes]]:
        """TTL class and header digest of ``blocks`` as stored (a repair writes them back unchanged), from
        the replies that carried them; worked out only when a repair needs them, not on every read."""
        wanted = np.zeros(len(self.valid), dtype=bool)
        wanted[list(blocks)] = True
        ttl_class: dict[int, str] = {}
        header: dict[int, bytes] = {}
        for entries, meta in self.replies:
            names, ci, hdr, st = meta.get("classes"), meta.get("ci"), meta.get("hdr"), meta.get("st")
            for j in np.flatnonzero(wanted[entries[:, 0]]).tolist():
                b = int(entries[j, 0])
                classes_ok = isinstance(names, list) and isinstance(ci, bytes) and len(ci) == len(entries)
                if classes_ok and ci[j] < len(names) and isinstance(names[ci[j]], str):
                    ttl_class[b] = names[ci[j]]
                if isinstance(hdr, bytes) and len(hdr) == HEADER_DIGEST_BYTES * len(entries) and st[j] == Status.OK:
                    header[b] = hdr[j * HEADER_DIGEST_BYTES : (j + 1) * HEADER_DIGEST_BYTES]
        return [(ttl_class.get(b), header.get(b, NO_HEADER)) for b in blocks]

    def _place(self, blocks: Sequence[int], lengths: Sequence[int] | np.ndarray) -> None:
        """Record where ``blocks`` land; the buffers stay exported by ``self.buffers``, so they cannot move."""
        rows = slice(None) if isinstance(blocks, range) else blocks  # range(n): all of them, without an index pass
        self.base[rows] = np.frombuffer(_native.addresses([self.buffers[b] for b in blocks]), dtype=np.int64)
        self.length[rows] = lengths

    def destinations(self, blocks: np.ndarray, block_lens: np.ndarray) -> np.ndarray:
        """Per shard of a reply: whether its block has a destination of the block length the node reported. A
        ``get`` allocates a block at its first shard (not zeroed: a block is returned only once every byte
        landed); a later reply that disagrees about its length goes to scratch."""
        if self.allocate:
            fresh = self.length[blocks] < 0
            new, first = np.unique(blocks[fresh], return_index=True)
            if len(new):
                lengths = block_lens[fresh][first].tolist()
                for b, length in zip(new.tolist(), lengths, strict=True):
                    self.buffers[b] = memoryview(_native.bytearray_uninit(length))
                self._place(new.tolist(), lengths)
        return self.length[blocks] == block_lens

    def decodable(self) -> bool:
        """Whether every block is decodable or known missing (worked out again only after a reply arrived)."""
        if self._decodable[0] != self.arrivals:
            have = self.valid.sum(axis=1)
            self._decodable = (self.arrivals, bool(np.all((have >= DATA_SHARDS) | self.absent | self.mismatch)))
        return self._decodable[1]


class Reads(Writes):
    """``get``/``get_into``; reading repairs what it found lost, hence the write path beneath it."""

    def get(
        self,
        keys: Sequence[bytes],
        *,
        tokens: TokenInput | None = None,
        namespace: Namespace | None = None,
        headers: Sequence[bytes] | None = None,
    ) -> list[bytearray | None]:
        """Read whole blocks; ``None`` for a miss. The returned buffers are the caller's to keep."""
        buffers: list[memoryview | None] = [None] * len(keys)
        found = self._read_moving(keys, buffers, True, self._headers(keys, tokens, namespace, headers)[0])
        return [buf.obj if hit and buf is not None else None for hit, buf in zip(found, buffers, strict=True)]

    def get_into(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Buffer],
        *,
        tokens: TokenInput | None = None,
        namespace: Namespace | None = None,
        headers: Sequence[bytes] | None = None,
        on_landed: Callable[[int, int], None] | None = None,
        watch: ReadWatch | None = None,
    ) -> list[bool]:
        """Read blocks into caller-owned writable buffers, each exactly the block's length.

        Returns per block whether it was read; a miss (including a stored block of another length) leaves
        that buffer's contents unspecified. ``on_landed(lo, hi)``: told as soon as blocks ``lo..hi-1`` are
        done (read or missed; nothing writes into their buffers any more), before this returns: once for the
        whole read, or once per lane, from the thread that read it (lanes run at once: it must be thread-safe).
        A lane that raised is not told. ``watch``: another thread may ask it, while this runs, which leading
        blocks of each lane are already in place (``kvstore.client.read_watch``).
        """
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        views: list[memoryview | None] = [memoryview(b).cast("B") for b in buffers]
        if any(v.readonly for v in views):  # type: ignore[union-attr]
            raise ValueError("get_into needs writable buffers")
        digests = self._headers(keys, tokens, namespace, headers)[0]
        lengths = np.fromiter(map(len, views), dtype=np.int64, count=len(views))  # type: ignore[arg-type]
        lanes = self.lane_count(int(lengths.sum()))
        if lanes > 1:
            return self._read_in_lanes(keys, views, digests, lengths, lanes, on_landed, watch)
        found = self._read_moving(keys, views, False, digests, watch.lane(0) if watch is not None else None)
        if on_landed is not None:
            on_landed(0, len(keys))
        return found

    def lane_count(self, total_bytes: int) -> int:
        """How many lanes a read of ``total_bytes`` runs in: ``[client] read_lanes`` (0: one per two cores),
        each carrying at least ``read_lane_min_bytes``."""
        settings = self.config.client
        lanes = settings.read_lanes or min(MAX_READ_LANES, max(1, (os.cpu_count() or 1) // 2))
        return max(1, min(lanes, total_bytes // settings.read_lane_min_bytes))

    def _read_in_lanes(
        self,
        keys: Sequence[bytes],
        views: list[memoryview | None],
        headers: list[bytes] | None,
        lengths: np.ndarray,
        lanes: int,
        on_landed: Callable[[int, int], None] | None,
        watch: ReadWatch | None,
    ) -> list[bool]:
        """A ``get_into`` split into ``lanes`` runs of consecutive blocks of about equal bytes, read at once: the
        first by this client on this thread, each other by a lane client (its own connections, so every node
        serves each lane on a thread of its own) on a thread of this client's. The compiled receive releases the
        GIL, so the lanes' copies and checksums run on as many cores. Returns when every lane is done, also when
        one raised (no lane writes into the caller's buffers after this returns)."""
        cuts = np.searchsorted(np.cumsum(lengths), np.arange(1, lanes) * (lengths.sum() / lanes)).tolist()
        bounds = list(zip([0, *cuts], [*cuts, len(keys)], strict=True))
        helpers, threads = self._lane_clients(lanes - 1)
        running: list[Future[list[bool]]] = []

        def lane(reads: Reads, lo: int, hi: int) -> list[bool]:
            found = reads._read_moving(
                keys[lo:hi],
                views[lo:hi],
                False,
                headers[lo:hi] if headers is not None else None,
                watch.lane(lo) if watch is not None else None,
                in_lanes=True,
            )
            if on_landed is not None:
                on_landed(lo, hi)
            return found

        try:
            for helper, (lo, hi) in zip(helpers, bounds[1:], strict=True):
                helper.pool.act_as = self.pool.act_as
                running.append(threads.submit(lane, helper, lo, hi))
            found = lane(self, *bounds[0])
        finally:
            results = [future.exception() or future.result() for future in running]  # waits for every lane
            for helper in helpers:
                for name, count in helper.stats.items():
                    self.stats[name] += count
                    helper.stats[name] = 0
        for result in results:
            if isinstance(result, BaseException):
                raise result
            found += result
        return found

    def _lane_clients(self, count: int) -> tuple[list[Reads], ThreadPoolExecutor]:
        """``count`` lane clients of this one (same cluster, token, namespace and codec) and the threads they run
        on, made on first use and kept (their connections stay open) until ``close``."""
        while len(self.lanes) < count:
            lane = type(self)(self.config, token=self.pool.token, namespace=self.namespace, codec=self.codec)
            self.lanes.append(lane)
        if self._lane_threads is None:  # threads start as lanes first need them
            self._lane_threads = ThreadPoolExecutor(MAX_READ_LANES - 1, thread_name_prefix="kvtier-read-lane")
        return self.lanes[:count], self._lane_threads  # type: ignore[return-value]

    def _read_moving(
        self,
        keys: Sequence[bytes],
        buffers: list[memoryview | None],
        allocate: bool,
        headers: list[bytes] | None,
        watch: LaneWatch | None = None,
        in_lanes: bool = False,
    ) -> list[bool]:
        """``_read``, and while a growth moves blocks (docs/design.md §10), the misses its new groups took read
        again from where they were before: a block is found in its old group until it has moved. ``watch``: the
        first read is watched (the misses read again never settle early). ``in_lanes``: a lane of a larger read."""
        found = self._read(keys, buffers, allocate, headers, watch=watch, in_lanes=in_lanes)
        retry = self.moved(keys, np.flatnonzero(~np.asarray(found, dtype=bool)))
        if len(retry) and self.previous is not None:
            rows = retry.tolist()
            again = [buffers[b] for b in rows]
            with self.placed_by(self.previous):
                hits = self._read(
                    [keys[b] for b in rows],
                    again,
                    allocate,
                    [headers[b] for b in rows] if headers else None,
                    in_lanes=in_lanes,
                )
            for b, hit, buf in zip(rows, hits, again, strict=True):
                found[b], buffers[b] = hit, buf
        return found

    def _read(
        self,
        keys: Sequence[bytes],
        buffers: list[memoryview | None],
        allocate: bool,
        headers: list[bytes] | None,
        state: ReadState | None = None,
        repair: bool = True,
        watch: LaneWatch | None = None,
        in_lanes: bool = False,
    ) -> list[bool]:
        """The read procedure of docs/design.md §5. A ``state`` made with ``trust_primary=False`` (repair
        of a wiped primary) reads a block from its shards even where the primary has no record. ``watch``: told
        the read's state, which another thread then asks how far the replies have landed. ``in_lanes``: a lane of
        a larger read (its round waits longer for heads: ``LANE_HEADS_QUIET_MS``)."""
        if not keys:
            return []
        shard_nodes = self.placement.shard_nodes(keys)
        if state is None:
            state = ReadState(len(keys), buffers, allocate, trust_primary=True)
        if watch is not None:
            watch.attach(state)
        settings = self.config.client
        deadline = time.monotonic() + settings.op_timeout_s
        first = np.broadcast_to(np.arange(TOTAL_SHARDS) < settings.read_fanout, shard_nodes.shape)
        skip = np.isin(shard_nodes, list(self.unreadable)) if self.unreadable else None
        if skip is not None and skip.any():  # nodes the map says are down or being filled: parity in their place
            state.asked |= skip
            first = ~skip & (np.cumsum(~skip, axis=1) <= settings.read_fanout)
        exchange = Exchange(self.pool)
        key_table, header_table = key_rows(keys), header_rows(headers) if headers is not None else None  # once
        self._ask(exchange, key_table, header_table, shard_nodes, state, first)
        hedge = settings.hedge_after_s if settings.hedge_after_s > 0 else settings.op_timeout_s
        quiet_ms = LANE_HEADS_QUIET_MS if in_lanes else HEADS_QUIET_MS
        exchange.run(min(hedge, settings.op_timeout_s), until=state.decodable, keep=True, heads_quiet_ms=quiet_ms)
        # blocks still short of 10 shards (lost, or not arrived by the hedge time) ask every holder not asked yet
        short = (state.valid.sum(axis=1) < DATA_SHARDS) & ~state.absent & ~state.mismatch
        if short.any():
            self._ask(exchange, key_table, header_table, shard_nodes, state, ~state.asked & short[:, None])
        exchange.run(max(0.0, deadline - time.monotonic()), until=state.decodable, heads_quiet_ms=quiet_ms)
        self.stats["corrupt_shards"] += state.corrupt
        state.corrupt = 0
        found = self._assemble(state)
        if repair and state.lost.any():
            self._repair_on_read(keys, shard_nodes, state, found)
        return found

    def _repair_on_read(
        self, keys: Sequence[bytes], shard_nodes: np.ndarray, state: ReadState, found: list[bool]
    ) -> None:
        """Rewrite the shards that nodes reported missing or corrupt, for the blocks this read decoded and
        whose primary answered that they are live (never bring back a block the primary no longer has)."""
        lost = state.lost & (np.asarray(found) & state.primary_ok)[:, None]
        damaged = np.flatnonzero(lost.any(axis=1)).tolist()
        by_class: dict[str, list[tuple[int, bytes]]] = {}
        for b, (ttl_class, header) in zip(damaged, state.stored_as(damaged), strict=True):
            if ttl_class is not None and state.buffers[b] is not None:
                by_class.setdefault(ttl_class, []).append((b, header))
        for ttl_class, stored in by_class.items():
            blocks = [b for b, _ in stored]
            written = self.write_shards(
                [keys[b] for b in blocks],
                [state.buffers[b] for b in blocks],  # type: ignore[misc]
                ttl_class,
                lost[blocks],
                [h for _, h in stored],
            )
            self.stats["shards_repaired"] += int(written.sum())

    def _ask(
        self,
        exchange: Exchange,
        key_table: np.ndarray,
        header_table: np.ndarray | None,
        shard_nodes: np.ndarray,
        state: ReadState,
        wanted: np.ndarray,
    ) -> None:
        """Queue one GET_SHARDS per node for the ``wanted`` shards (replies land by ``_sink``)."""
        for node_id, entries in _by_node(shard_nodes, wanted):
            state.asked[entries[:, 0], entries[:, 1]] = True
            meta = self._entry_meta(key_table, entries, header_table)
            meta["client_crc"] = True  # the node sends stored crcs and does not read the bytes to check them
            exchange.request(
                node_id,
                Op.GET_SHARDS,
                meta,
                sink=lambda frame, e=entries: self._sink(frame, e, state),
                on_reply=lambda frame, e=entries: state.arrived(frame, e),
            )

    def _sink(self, frame: Frame, entries: np.ndarray, state: ReadState) -> ReceivePlan | None:
        """Where each OK shard of a GET reply goes, as a plan of (address, length, shard) pieces that the transport
        receives into in compiled code, checksumming every shard while it is hot: a data shard at its place in
        the destination block (the zero padding of a tail shard into scratch), a parity shard or one that does
        not fit its block into scratch (parity is kept for decoding; a shard that does not fit is dropped)."""
        meta = frame.meta
        raw = [meta.get("st"), meta.get("lens"), meta.get("blen")]
        n = len(entries)
        if not all(isinstance(r, bytes) for r in raw) or [len(r) for r in raw] != [n, 4 * n, 8 * n]:
            return None
        stored_crc = meta.get("crc")
        if stored_crc is not None and (not isinstance(stored_crc, bytes) or len(stored_crc) != 4 * n):
            return None
        # rows are picked with a slice where all qualify (the usual reply): no mask or index pass per column
        ok = _rows(np.frombuffer(raw[0], dtype=np.uint8) == _OK)
        lens = np.frombuffer(raw[1], dtype="<u4")[ok].astype(np.int64)
        block_lens = np.frombuffer(raw[2], dtype="<u8")[ok].astype(np.int64)
        blocks, index = entries[ok, 0], entries[ok, 1]
        fits = state.destinations(blocks, block_lens) & (lens == np.maximum(1, -(-block_lens // DATA_SHARDS)))
        # one pass in compiled code: data shards at their place in their block (the zero padding of a tail shard into
        # scratch, apart for each shard: a piece's crc is taken after it lands), the others whole into scratch
        pieces, scratch, parked = _native.reply_plan(
            np.ascontiguousarray(blocks), np.ascontiguousarray(index), lens, fits, state.base, state.length, DATA_SHARDS
        )
        state.scratch[frame.request_id] = scratch
        parity = fits & (index >= DATA_SHARDS)  # what fits its block but is not a data shard: kept for decoding
        if parity.any():
            view = memoryview(scratch)
            for b, i, at, length in zip(
                blocks[parity].tolist(),
                index[parity].tolist(),
                np.frombuffer(parked, dtype=np.int64)[parity].tolist(),
                lens[parity].tolist(),
                strict=True,
            ):
                state.parity[(b, i)] = view[at : at + length]
        crcs = expected = ends = progress = None
        landed = _rows(fits)
        plan = np.frombuffer(pieces, dtype=np.int64).reshape(-1, 3)
        if stored_crc is not None:
            crcs = np.zeros(int(fits.sum()), dtype=np.uint32)  # filled in by the receive, shard by shard
            expected = np.frombuffer(stored_crc, dtype="<u4")[ok][landed]
            if state.watched:  # where each shard's last byte is in the payload, and a cell the receive counts in
                checked = plan[:, 2] >= 0
                ends = np.zeros(len(crcs), dtype=np.int64)
                np.maximum.at(ends, plan[checked, 2], np.cumsum(plan[:, 1])[checked])
                progress = np.zeros(1, dtype=np.int64)
        state.receiving[frame.request_id] = Landing(entries[ok][landed], crcs, expected, ends, progress)
        return ReceivePlan(plan if crcs is not None else np.ascontiguousarray(plan[:, :2]), crcs, progress)

    def _assemble(self, state: ReadState) -> list[bool]:
        """Per block whether it was read; blocks missing a data shard are decoded from the others in place."""
        hit = (state.valid.sum(axis=1) >= DATA_SHARDS) & ~state.absent & ~state.mismatch & (state.length >= 0)
        self.stats["hits"] += int(hit.sum())
        self.stats["misses"] += int((~hit).sum())
        self.stats["header_mismatches"] += int((~hit & state.mismatch).sum())
        for b in np.flatnonzero(hit & ~state.valid[:, :DATA_SHARDS].all(axis=1)).tolist():
            valid = np.flatnonzero(state.valid[b])
            missing = np.flatnonzero(~state.valid[b, :DATA_SHARDS]).tolist()
            self._reconstruct(b, BlockLayout(int(state.length[b])), valid[:DATA_SHARDS].tolist(), missing, state)
            self.stats["degraded_reads"] += 1
        return hit.tolist()

    def _reconstruct(self, b: int, layout: BlockLayout, use: list[int], missing: list[int], state: ReadState) -> None:
        buf = state.buffers[b]
        assert buf is not None
        present: dict[int, memoryview] = {}
        for i in use:
            if i >= DATA_SHARDS:
                present[i] = state.parity[(b, i)]
                continue
            region = layout.region(buf, i)
            if len(region) == layout.shard:
                present[i] = region
            else:
                padded = bytearray(layout.shard)  # pad bytes were zero when the block was encoded
                padded[: len(region)] = region
                present[i] = memoryview(padded)
        want: dict[int, memoryview] = {}
        tails: dict[int, memoryview] = {}
        for i in missing:
            region = layout.region(buf, i)
            if len(region) == layout.shard:
                want[i] = region
            else:
                tails[i] = want[i] = memoryview(bytearray(layout.shard))
        self.codec.reconstruct(present, want)
        for i, scratch in tails.items():
            region = layout.region(buf, i)
            region[:] = scratch[: len(region)]


def _rows(mask: np.ndarray) -> slice | np.ndarray:
    """The rows a mask selects, as a slice when it selects all or none (indexing then costs no pass)."""
    if mask.all():
        return slice(None)
    return np.flatnonzero(mask) if mask.any() else slice(0, 0)
