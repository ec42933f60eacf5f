"""The kvtier client: batched, erasure-coded block reads and writes against a cluster.

Promises, for every method:

- **Batched.** One call sends at most one request per node per phase, whatever the number of keys.
- **Misses are not errors.** A block that is absent, expired, evicted, unreadable (fewer than 10 good
  shards) or whose header does not match the caller's tokens is a miss: ``None`` / ``False`` /
  a shorter ``match``. Exceptions mean a caller error (bad arguments, unknown TTL class), a wrong token
  (:class:`~kvtier.kvstore.transport.AuthError`) or a full cluster (:class:`CapacityError`).
- **Never wrong bytes.** Shards are crc-checked on the node; a read decodes around up to two lost or
  corrupt shards and is a miss beyond that.
- **Zero-copy.** ``get_into`` receives each node's shards straight into the caller's buffers;
  ``put_from`` sends shards as views of the caller's buffers. The caller must not modify buffers while a
  call runs; once it returns, kvtier holds no reference to them.
- **Two-phase writes.** Shards are written PENDING on every node of the block's group, then COMMITTED;
  the block becomes visible when its primary records it. A writer that dies mid-put leaves only pending
  shards, which no reader is ever given and GC reclaims.

Collision safety: pass ``tokens=`` (the token array the keys were chained from) and ``namespace=`` (or
connect with a default namespace) to ``put``/``get``: the block's header digest is stored and checked, and
a mismatch is a miss counted in ``stats["header_mismatches"]``. ``headers=`` passes precomputed digests
(:func:`~kvtier.kvstore.keys.header_digests`) instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.kvstore import cluster as cluster_mod
from kvtier.kvstore.codec import DATA_SHARDS, TOTAL_SHARDS, Codec, default_codec, shard_size
from kvtier.kvstore.keys import HEADER_DIGEST_BYTES, NO_HEADER, Namespace, TokenInput, chain, header_digests
from kvtier.kvstore.placement import Placement
from kvtier.kvstore.protocol import Frame, Op, Status
from kvtier.kvstore.transport import ConnectionPool, Exchange, Pending
from kvtier.kvstore.wire import pack_keys

Buffer = bytes | bytearray | memoryview


class CapacityError(Exception):
    """The cluster refused blocks because nodes are at capacity (even after eviction).

    ``stored`` says, per block of the failed call, whether it was stored anyway.
    """

    def __init__(self, message: str, stored: list[bool]) -> None:
        super().__init__(message)
        self.stored = stored


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


class _ReadState:
    """Book-keeping of one batched read: where each shard goes and which blocks can be decoded."""

    def __init__(self, n: int, buffers: list[memoryview | None], allocate: bool, trust_primary: bool) -> None:
        self.buffers = buffers
        self.allocate = allocate
        self.trust_primary = trust_primary
        self.layouts: list[BlockLayout | None] = [BlockLayout(len(b)) if b is not None else None for b in buffers]
        self.valid = np.zeros((n, TOTAL_SHARDS), dtype=bool)
        self.asked = np.zeros((n, TOTAL_SHARDS), dtype=bool)
        self.lost = np.zeros((n, TOTAL_SHARDS), dtype=bool)  # a node answered MISSING or CORRUPT: repairable
        self.absent = np.zeros(n, dtype=bool)
        self.mismatch = np.zeros(n, dtype=bool)
        self.ttl_class: list[str | None] = [None] * n
        self.header: list[bytes] = [NO_HEADER] * n  # as stored: repair must write it back unchanged
        self.primary_ok = np.zeros(n, dtype=bool)  # the primary answered OK: the block is live
        self.parity: dict[tuple[int, int], memoryview] = {}
        self.receiving: dict[int, np.ndarray] = {}  # request id -> (block, shard) entries in its payload

    def arrived(self, frame: Frame, entries: np.ndarray) -> None:
        """A GET reply for ``entries`` is complete: its shards are in place, its verdicts known."""
        statuses = frame.meta.get("st")
        if isinstance(statuses, bytes) and len(statuses) == len(entries):
            st = np.frombuffer(statuses, dtype=np.uint8)
            if self.trust_primary:
                self.absent[entries[st == Status.ABSENT, 0]] = True
            self.mismatch[entries[st == Status.MISMATCH, 0]] = True
            lost = entries[(st == Status.MISSING) | (st == Status.CORRUPT)]
            self.lost[lost[:, 0], lost[:, 1]] = True
            self.primary_ok[entries[(st == Status.OK) & (entries[:, 1] == 0), 0]] = True
            names, ci, hdr = frame.meta.get("classes"), frame.meta.get("ci"), frame.meta.get("hdr")
            if isinstance(names, list) and isinstance(ci, bytes) and len(ci) == len(entries):
                for (b, _), c in zip(entries.tolist(), ci, strict=True):
                    if c < len(names) and isinstance(names[c], str):
                        self.ttl_class[b] = names[c]
            if isinstance(hdr, bytes) and len(hdr) == HEADER_DIGEST_BYTES * len(entries):
                for j in np.flatnonzero(st == Status.OK).tolist():
                    self.header[entries[j, 0]] = hdr[j * HEADER_DIGEST_BYTES : (j + 1) * HEADER_DIGEST_BYTES]
        landed = self.receiving.pop(frame.request_id, None)
        if landed is not None and len(landed):
            self.valid[landed[:, 0], landed[:, 1]] = True

    def layout_for(self, b: int, block_len: int) -> BlockLayout | None:
        layout = self.layouts[b]
        if layout is None and self.allocate:
            self.buffers[b] = memoryview(bytearray(block_len))
            layout = self.layouts[b] = BlockLayout(block_len)
        if layout is None or layout.length != block_len:
            return None
        return layout

    def decodable(self) -> bool:
        have = self.valid.sum(axis=1)
        return bool(np.all((have >= DATA_SHARDS) | self.absent | self.mismatch))


class Client:
    """Synchronous client. Not thread-safe: use one per thread, or :class:`AsyncClient`."""

    def __init__(
        self,
        config: cluster_mod.ClusterConfig,
        token: str | None = None,
        namespace: Namespace | None = None,
        codec: Codec | None = None,
    ) -> None:
        self.config = config
        self.namespace = namespace
        self.codec = codec or default_codec()
        self.placement = Placement(config.groups)
        addresses = {nid: (n.host, n.port) for nid, n in config.nodes.items()}
        self.pool = ConnectionPool(
            addresses,
            token or config.token,
            config.limits,
            config.client.connect_timeout_s,
            config.client.retry_down_after_s,
        )
        self._parity = bytearray()  # parity of the current put; a call's sends finish before it returns
        self.stats = {"header_mismatches": 0, "degraded_reads": 0, "misses": 0, "hits": 0, "shards_repaired": 0}

    # -- lifecycle ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def acting_for(self, tenant: str) -> Iterator[None]:
        """Within the block, act for ``tenant`` (the cluster token only: nodes refuse anyone else)."""
        previous, self.pool.act_as = self.pool.act_as, tenant
        try:
            yield
        finally:
            self.pool.act_as = previous

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- metadata -------------------------------------------------------------------------------------

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are all stored and live (metadata only: asks each key's primary)."""
        live = self._live(keys)
        misses = np.flatnonzero(~live)
        return int(misses[0]) if len(misses) else len(keys)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored and live (metadata only). A down primary reads as absent."""
        return self._live(keys).tolist()

    def _live(self, keys: Sequence[bytes]) -> np.ndarray:
        return self.liveness(keys) == 1

    def liveness(self, keys: Sequence[bytes]) -> np.ndarray:
        """Per key: 1 stored and live, 0 not (its primary said so), -1 unknown (primary unreachable)."""
        live = np.full(len(keys), -1, dtype=np.int8)
        if not keys:
            return live
        primaries = self.placement.primaries(keys)
        blob, klen = pack_keys(keys)
        table = np.frombuffer(blob, dtype=np.uint8).reshape(len(keys), klen)
        exchange = Exchange(self.pool)
        asks = []
        for node_id in np.unique(primaries).tolist():
            positions = np.flatnonzero(primaries == node_id)
            meta = {"keys": table[positions].tobytes(), "klen": klen}
            asks.append((positions, exchange.request(node_id, Op.MATCH, meta)))
        exchange.run(self.config.client.op_timeout_s)
        for positions, pending in asks:
            flags = self._flags(pending, "live", len(positions))
            if flags is not None:
                live[positions] = flags.astype(bool)
        return live

    def delete(self, keys: Sequence[bytes]) -> None:
        """Remove blocks: every node of each block's group drops its shards; primaries drop the record.

        A node that is down keeps its shards until GC finds they have no block record.
        """
        if not keys:
            return
        shard_nodes = self.placement.shard_nodes(keys)
        exchange = Exchange(self.pool)
        for node_id in np.unique(shard_nodes).tolist():
            positions = np.flatnonzero((shard_nodes == node_id).any(axis=1))
            blob, klen = pack_keys([keys[i] for i in positions])
            exchange.request(node_id, Op.DELETE, {"keys": blob, "klen": klen})
        exchange.run(self.config.client.op_timeout_s)

    def stat(self, key: bytes) -> dict[str, Any]:
        """Where a block's shards live and what its primary records (for operators)."""
        nodes = self.placement.shard_nodes([key])[0].tolist()
        exchange = Exchange(self.pool)
        asks = {nid: exchange.request(nid, Op.STAT, {"key": key}) for nid in sorted(set(nodes))}
        exchange.run(self.config.client.op_timeout_s)
        out: dict[str, Any] = {"key": key.hex(), "primary": nodes[0], "block": None, "shards": []}
        for nid, pending in asks.items():
            if not pending.ok:
                out["shards"].append({"node": nid, "error": pending.error})
                continue
            assert pending.frame is not None
            meta = pending.frame.meta
            # the primary's record, else the copy kept by the holder of shard 1
            if nid == nodes[0] or (nid == nodes[1] and out["block"] is None):
                out["block"] = meta["block"] or out["block"]
            out["shards"].extend({"node": nid, **s} for s in meta["shards"])
        return out

    # -- operators ------------------------------------------------------------------------------------

    def admin(self, action: str, node_ids: Sequence[int] | None = None, **meta: Any) -> dict[int, dict[str, Any]]:
        """Run an admin action (cluster token only) on nodes (default: all); per node its reply or
        ``{"error": why}`` (``"down"`` for an unreachable node)."""
        return self._each_node(Op.ADMIN, {"action": action, **meta}, node_ids)

    def node_info(self, node_ids: Sequence[int] | None = None) -> dict[int, dict[str, Any]]:
        """Usage, capacity, watermarks, counts, TTL table and GC state of nodes (cluster token only)."""
        return self._each_node(Op.NODE_INFO, {}, node_ids)

    def _each_node(self, op: Op, meta: dict[str, Any], node_ids: Sequence[int] | None) -> dict[int, dict[str, Any]]:
        exchange = Exchange(self.pool)
        ids = sorted(self.config.nodes) if node_ids is None else list(node_ids)
        asks = {nid: exchange.request(nid, op, meta) for nid in ids}
        exchange.run(self.config.client.op_timeout_s)
        return {
            nid: dict(p.frame.meta) if p.ok and p.frame is not None else {"error": p.error or "no reply"}
            for nid, p in asks.items()
        }

    # -- headers --------------------------------------------------------------------------------------

    def _headers(
        self,
        keys: Sequence[bytes],
        tokens: TokenInput | None,
        namespace: Namespace | None,
        headers: Sequence[bytes] | None,
    ) -> tuple[list[bytes] | None, dict[bytes, bytes], bytes]:
        """Header digests for ``keys`` (given, or from the tokens they were chained from) and their parents."""
        if headers is not None:
            if tokens is not None:
                raise ValueError("pass tokens= or headers=, not both")
            if len(headers) != len(keys) or any(len(h) != HEADER_DIGEST_BYTES for h in headers):
                raise ValueError(f"headers= needs one {HEADER_DIGEST_BYTES}-byte digest per key")
            return list(headers), {}, b""
        if tokens is None:
            return None, {}, b""
        ns = namespace or self.namespace
        if ns is None:
            raise ValueError("tokens= needs namespace= (or a client connected with a default namespace)")
        full = chain(ns, tokens, self.config.hash_algo)
        digests = dict(zip(full, header_digests(ns, tokens, full), strict=True))
        parents = dict(zip(full, [ns.digest, *full[:-1]], strict=True))
        missing = [k for k in keys if k not in digests]
        if missing:
            raise ValueError(f"{len(missing)} keys are not blocks of the given tokens in this namespace")
        return [digests[k] for k in keys], parents, ns.digest

    # -- writes ---------------------------------------------------------------------------------------

    def put(
        self,
        keys: Sequence[bytes],
        blocks: Sequence[Buffer],
        ttl_class: str = "chatbot",
        *,
        tokens: TokenInput | None = None,
        namespace: Namespace | None = None,
        headers: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """Store blocks; returns per block whether it is now committed (True if it already was).

        Blocks may have different lengths. False means too few nodes took its shards (or its primary is
        down); nothing of it is visible. Raises ValueError for an unknown TTL class and CapacityError if any
        block was refused for lack of space (the others are stored as reported by the exception's
        ``stored``).
        """
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
        if not keys:
            return []
        headers, parents, ns_digest = self._headers(keys, tokens, namespace, headers)
        views = [memoryview(b).cast("B") for b in blocks]
        shard_nodes = self.placement.shard_nodes(keys)
        write = np.ones(shard_nodes.shape, dtype=bool)
        _, stored, no_space = self._store(keys, views, ttl_class, shard_nodes, write, headers, parents, ns_digest)
        result = stored.tolist()
        if (no_space & ~stored).any():
            refused = int((no_space & ~stored).sum())
            raise CapacityError(f"{refused} of {len(keys)} blocks were refused: nodes are at capacity", result)
        return result

    def _store(
        self,
        keys: Sequence[bytes],
        views: Sequence[memoryview],
        ttl_class: str,
        shard_nodes: np.ndarray,
        write: np.ndarray,
        headers: list[bytes] | None = None,
        parents: dict[bytes, bytes] | None = None,
        ns_digest: bytes = b"",
        created: Sequence[float] | None = None,
        repair: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Write the shards selected by ``write`` (n × 12) in two phases; see the module docstring.

        A block commits when its primary's shard and ``min_write_shards`` shards are durable, or, for a
        ``repair`` (which writes only missing or corrupt shards, replacing what is there), whenever its
        written shards are.
        Returns the (n × 12) shards now durable, per block whether it committed (its primary recorded it),
        and per block whether a node refused a shard for lack of space.
        """
        shards = self._encode(views)
        block_lens = np.asarray([len(v) for v in views], dtype="<u8")
        shard_lens = np.asarray([shard_size(len(v)) for v in views], dtype="<u4")  # all 12 shards of a block

        def block_meta(entries: np.ndarray) -> dict[str, Any]:
            return {"blen": block_lens[entries[:, 0]].tobytes(), "cls": ttl_class}

        # phase 1: shards PENDING on every node
        exchange = Exchange(self.pool)
        plans = []
        for node_id, entries in _by_node(shard_nodes, write):
            meta = {**self._entry_meta(keys, entries, headers), **block_meta(entries)}
            meta["lens"] = shard_lens[entries[:, 0]].tobytes()
            if repair:
                meta["replace"] = True
            payload = [segment for b, i in entries.tolist() for segment in shards[b][i]]
            plans.append((entries, exchange.request(node_id, Op.PUT_SHARDS, meta, payload)))
        exchange.run(self.config.client.op_timeout_s)
        ok = np.zeros(shard_nodes.shape, dtype=bool)
        no_space = np.zeros(len(keys), dtype=bool)
        for entries, pending in plans:
            statuses = self._flags(pending, "st", len(entries))
            if statuses is None:
                continue
            if (statuses == Status.BAD_CLASS).any():
                raise ValueError(f"unknown TTL class {ttl_class!r}: the cluster defines no such class")
            good = (statuses == Status.OK) | (statuses == Status.EXISTS)
            ok[entries[good, 0], entries[good, 1]] = True
            no_space[entries[statuses == Status.NO_SPACE, 0]] = True
        if repair:
            committable = np.ones(len(keys), dtype=bool)
        else:
            committable = ok[:, 0] & (ok.sum(axis=1) >= self.config.client.min_write_shards)
            self._abort(keys, shard_nodes, ok & write & ~committable[:, None])

        # phase 2: COMMIT where enough shards are durable; the primary's record makes the block visible
        exchange = Exchange(self.pool)
        commits = []
        for node_id, entries in _by_node(shard_nodes, ok & write & committable[:, None]):
            meta = {**self._entry_meta(keys, entries, headers), **block_meta(entries)}
            pairs = entries.tolist()
            if parents:
                meta["ns"] = ns_digest
                meta["parents"] = [parents[keys[b]] if i in (0, 1) else b"" for b, i in pairs]
            if created is not None:
                meta["created"] = np.asarray([created[b] for b, _ in pairs], dtype="<f8").tobytes()
            commits.append((entries, exchange.request(node_id, Op.COMMIT, meta)))
        exchange.run(self.config.client.op_timeout_s)
        stored = np.zeros(len(keys), dtype=bool)
        for entries, pending in commits:
            statuses = self._flags(pending, "st", len(entries))
            if statuses is not None:
                primary = (entries[:, 1] == 0) & (statuses == Status.OK)
                stored[entries[primary, 0]] = True
        return ok, stored, no_space

    put_from = put  # buffers are sent as views either way; the second name matches get_into

    # -- repair ---------------------------------------------------------------------------------------

    def probe(self, keys: Sequence[bytes]) -> np.ndarray:
        """(n × 12) whether each shard of each block is stored, committed and (shard 0) recorded.

        Metadata only; an unreachable node's shards read as absent.
        """
        shard_nodes = self.placement.shard_nodes(keys)
        present = np.zeros(shard_nodes.shape, dtype=bool)
        exchange = Exchange(self.pool)
        asks = []
        for node_id, entries in _by_node(shard_nodes, np.ones(shard_nodes.shape, dtype=bool)):
            meta = {**self._entry_meta(keys, entries, None), "probe": True}
            asks.append((entries, exchange.request(node_id, Op.GET_SHARDS, meta)))
        exchange.run(self.config.client.op_timeout_s)
        for entries, pending in asks:
            statuses = self._flags(pending, "st", len(entries))
            if statuses is not None:
                ok = entries[statuses == Status.OK]
                present[ok[:, 0], ok[:, 1]] = True
        return present

    def read_for_repair(self, keys: Sequence[bytes]) -> list[tuple[bytearray, bytes] | None]:
        """Whole blocks decoded from their shards, even where the primary lost its record, each with the
        header digest its shards carry (a repair writes it back unchanged)."""
        buffers: list[memoryview | None] = [None] * len(keys)
        state = _ReadState(len(keys), buffers, True, trust_primary=False)
        found = self._read(keys, buffers, True, None, state=state, repair=False)
        return [
            (buf.obj, state.header[b]) if hit and buf is not None else None
            for b, (hit, buf) in enumerate(zip(found, buffers, strict=True))
        ]

    def write_shards(
        self,
        keys: Sequence[bytes],
        blocks: Sequence[Buffer],
        ttl_class: str,
        which: np.ndarray,
        headers: Sequence[bytes],
        created: Sequence[float] | None = None,
    ) -> int:
        """Write only the shards ``which`` (n × 12) of whole ``blocks`` and commit them (repair), with the
        blocks' stored header digests. A rewritten shard 0 or 1 re-creates the block record with
        ``created``. Returns shards written."""
        views = [memoryview(b).cast("B") for b in blocks]
        shard_nodes = self.placement.shard_nodes(keys)
        ok, _, _ = self._store(keys, views, ttl_class, shard_nodes, which, list(headers), created=created, repair=True)
        return int((ok & which).sum())

    def _encode(self, views: Sequence[memoryview]) -> list[list[list[memoryview]]]:
        """The 12 shards of every block, each as the buffer segments to send, all views: data shards are
        slices of the block; the zero padding of a short last shard is a shared zero buffer; the parity
        of the whole batch lives in one buffer reused across calls (no fresh pages to fault in)."""
        sizes = [shard_size(len(view)) for view in views]
        if len(self._parity) < 2 * sum(sizes):
            self._parity = bytearray(2 * sum(sizes))
        parity_pool = memoryview(self._parity)
        out = []
        for view, size in zip(views, sizes, strict=True):
            parity = [parity_pool[:size], parity_pool[size : 2 * size]]
            parity_pool = parity_pool[2 * size :]
            data = [view[i * size : (i + 1) * size] for i in range(DATA_SHARDS)]
            full = len(data[-1])  # bytes of the last shard that the block holds (the rest is zero padding)
            if full == size:
                self.codec.encode_parity(data, parity)
                out.append([[d] for d in data] + [[p] for p in parity])
            elif len(view) >= (DATA_SHARDS - 1) * size:
                # two passes over byte ranges: [0, full) where every shard has data, [full, size) where the
                # last shard is zeros: ISA-L reads only real bytes and the shared zero buffer, nothing copied
                zeros = _zeros(size - full)
                self.codec.encode_parity([d[:full] for d in data], [p[:full] for p in parity])
                self.codec.encode_parity([d[full:] for d in data[:-1]] + [zeros], [p[full:] for p in parity])
                out.append([[d] for d in data[:-1]] + [[data[-1], zeros]] + [[p] for p in parity])
            else:  # a tiny block whose last shards are empty: pad copies cost nothing here
                padded = [bytes(d).ljust(size, b"\0") for d in data]
                self.codec.encode_parity(padded, parity)
                out.append([[memoryview(d)] for d in padded] + [[p] for p in parity])
        return out

    def _abort(self, keys: Sequence[bytes], shard_nodes: np.ndarray, which: np.ndarray) -> None:
        """Drop the PENDING shards of blocks that will not commit, so they do not wait for GC."""
        if not which.any():
            return
        exchange = Exchange(self.pool)
        for node_id, entries in _by_node(shard_nodes, which):
            exchange.request(node_id, Op.ABORT, self._entry_meta(keys, entries, None))
        exchange.run(self.config.client.op_timeout_s)

    @staticmethod
    def _entry_meta(keys: Sequence[bytes], entries: np.ndarray, headers: list[bytes] | None) -> dict[str, Any]:
        rows = entries[:, 0].tolist()
        blob, klen = pack_keys([keys[b] for b in rows])
        meta: dict[str, Any] = {"keys": blob, "klen": klen, "idx": entries[:, 1].astype(np.uint8).tobytes()}
        if headers is not None:
            meta["hdr"] = b"".join([headers[b] for b in rows])
        return meta

    @staticmethod
    def _flags(pending: Pending, name: str, n: int) -> np.ndarray | None:
        """A reply's per-entry byte array ``name``, or None if the node failed or answered malformed."""
        if not pending.ok:
            return None
        assert pending.frame is not None
        raw = pending.frame.meta.get(name)
        if not isinstance(raw, bytes) or len(raw) != n:
            return None
        return np.frombuffer(raw, dtype=np.uint8)

    # -- reads ----------------------------------------------------------------------------------------

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
        found = self._read(keys, buffers, True, self._headers(keys, tokens, namespace, headers)[0])
        return [buf.obj if hit and buf is not None else None for hit, buf in zip(found, buffers, strict=True)]

    def get_into(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Buffer],
        *,
        tokens: TokenInput | None = None,
        namespace: Namespace | None = None,
        headers: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """Read blocks into caller-owned writable buffers, each exactly the block's length.

        Returns per block whether it was read; a miss (including a stored block of another length) leaves
        that buffer's contents unspecified.
        """
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        views: list[memoryview | None] = [memoryview(b).cast("B") for b in buffers]
        if any(v.readonly for v in views if v is not None):
            raise ValueError("get_into needs writable buffers")
        return self._read(keys, views, False, self._headers(keys, tokens, namespace, headers)[0])

    def _read(
        self,
        keys: Sequence[bytes],
        buffers: list[memoryview | None],
        allocate: bool,
        headers: list[bytes] | None,
        state: _ReadState | None = None,
        repair: bool = True,
    ) -> list[bool]:
        """The read procedure of docs/design.md §5. A ``state`` made with ``trust_primary=False`` (repair
        of a wiped primary) reads a block from its shards even where the primary has no record."""
        if not keys:
            return []
        shard_nodes = self.placement.shard_nodes(keys)
        if state is None:
            state = _ReadState(len(keys), buffers, allocate, trust_primary=True)
        fanout = self.config.client.read_fanout
        self._read_round(keys, shard_nodes, headers, state, np.arange(TOTAL_SHARDS) < fanout, early=True)
        # second round: blocks still short of 10 shards ask every holder not asked yet
        short = (state.valid.sum(axis=1) < DATA_SHARDS) & ~state.absent & ~state.mismatch
        if short.any():
            wanted = ~state.asked & short[:, None]
            self._read_round(keys, shard_nodes, headers, state, wanted, early=False)
        found = self._assemble(state)
        if repair:
            self._repair_on_read(keys, shard_nodes, state, found)
        return found

    def _repair_on_read(
        self, keys: Sequence[bytes], shard_nodes: np.ndarray, state: _ReadState, found: list[bool]
    ) -> None:
        """Rewrite the shards that nodes reported missing or corrupt, for the blocks this read decoded and
        whose primary answered that they are live (never bring back a block the primary no longer has)."""
        lost = state.lost & (np.asarray(found) & state.primary_ok)[:, None]
        by_class: dict[str, list[int]] = {}
        for b in np.flatnonzero(lost.any(axis=1)).tolist():
            if state.ttl_class[b] is not None and state.buffers[b] is not None:
                by_class.setdefault(state.ttl_class[b], []).append(b)
        for ttl_class, blocks in by_class.items():
            views = [state.buffers[b] for b in blocks]
            self.stats["shards_repaired"] += self.write_shards(
                [keys[b] for b in blocks],
                views,  # type: ignore[arg-type]
                ttl_class,
                lost[blocks],
                [state.header[b] for b in blocks],
            )

    def _read_round(
        self,
        keys: Sequence[bytes],
        shard_nodes: np.ndarray,
        headers: list[bytes] | None,
        state: _ReadState,
        wanted: np.ndarray,
        early: bool,
    ) -> None:
        wanted = np.broadcast_to(wanted, shard_nodes.shape)
        exchange = Exchange(self.pool)
        for node_id, entries in _by_node(shard_nodes, wanted):
            state.asked[entries[:, 0], entries[:, 1]] = True
            meta = self._entry_meta(keys, entries, headers)
            exchange.request(
                node_id,
                Op.GET_SHARDS,
                meta,
                sink=lambda frame, e=entries: self._sink(frame, e, state),
                on_reply=lambda frame, e=entries: state.arrived(frame, e),
            )
        exchange.run(self.config.client.op_timeout_s, until=state.decodable if early else None)

    def _sink(self, frame: Frame, entries: np.ndarray, state: _ReadState) -> list[memoryview] | None:
        """Where each OK shard of a GET reply goes: its place in the destination block, or scratch."""
        meta = frame.meta
        raw = [meta.get("st"), meta.get("lens"), meta.get("blen")]
        n = len(entries)
        if not all(isinstance(r, bytes) for r in raw) or [len(r) for r in raw] != [n, 4 * n, 8 * n]:
            return None
        statuses = np.frombuffer(raw[0], dtype=np.uint8)
        ok = np.flatnonzero(statuses == Status.OK)
        lens = np.frombuffer(raw[1], dtype="<u4").tolist()
        blens = np.frombuffer(raw[2], dtype="<u8").tolist()
        pairs = entries.tolist()
        parity_bytes = sum(lens[j] for j in ok.tolist() if pairs[j][1] >= DATA_SHARDS)
        parity_pool = memoryview(bytearray(parity_bytes))
        sinks: list[memoryview] = []
        landed: list[int] = []
        for j in ok.tolist():
            b, i = pairs[j]
            length = lens[j]
            layout = state.layout_for(b, blens[j])
            buf = state.buffers[b]
            if layout is None or buf is None or length != layout.shard:
                sinks.append(_scratch(length))
                continue
            if i < DATA_SHARDS:
                start = min(i * length, layout.length)
                end = min(start + length, layout.length)
                sinks.append(buf[start:end])
                if end - start < length:  # the zero padding of the tail shard is not needed
                    sinks.append(_PAD[: length - (end - start)])
            else:
                state.parity[(b, i)] = parity_pool[:length]
                sinks.append(parity_pool[:length])
                parity_pool = parity_pool[length:]
            landed.append(j)
        state.receiving[frame.request_id] = entries[landed]
        return sinks

    def _assemble(self, state: _ReadState) -> list[bool]:
        out = []
        for b, layout in enumerate(state.layouts):
            buf = state.buffers[b]
            valid = np.flatnonzero(state.valid[b])
            if state.absent[b] or state.mismatch[b] or layout is None or buf is None or len(valid) < DATA_SHARDS:
                if state.mismatch[b]:
                    self.stats["header_mismatches"] += 1
                self.stats["misses"] += 1
                out.append(False)
                continue
            missing_data = [i for i in range(DATA_SHARDS) if not state.valid[b, i]]
            if missing_data:
                self._reconstruct(b, layout, buf, valid[:DATA_SHARDS].tolist(), missing_data, state)
                self.stats["degraded_reads"] += 1
            self.stats["hits"] += 1
            out.append(True)
        return out

    def _reconstruct(
        self,
        b: int,
        layout: BlockLayout,
        buf: memoryview,
        use: list[int],
        missing: list[int],
        state: _ReadState,
    ) -> None:
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


def _by_node(shard_nodes: np.ndarray, selected: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """Per node holding any selected shard: its (block, shard index) entries, one request's worth."""
    for node_id in np.unique(shard_nodes[selected]).tolist():
        yield node_id, np.argwhere((shard_nodes == node_id) & selected)


def _zeros(n: int) -> memoryview:
    """``n`` zero bytes, read-only and shared (never written: they stand for shard padding)."""
    global _ZEROS
    if len(_ZEROS) < n:
        _ZEROS = memoryview(bytes(n))
    return _ZEROS[:n]


_ZEROS = memoryview(bytes(1 << 16))


def _scratch(n: int) -> memoryview:
    return memoryview(bytearray(n))


_PAD = memoryview(bytearray(DATA_SHARDS))  # a tail shard is padded by fewer than 10 bytes


def connect(path: str | Path, token: str | None = None, namespace: Namespace | None = None) -> Client:
    """A client for the cluster described by the cluster file at ``path`` (use it as a context manager).

    ``token`` selects the tenant (default: the cluster token, tenant "default").
    """
    return Client(cluster_mod.load(path), token=token, namespace=namespace)


class AsyncClient:
    """The same API for asyncio code: each call runs a pooled synchronous client in a worker thread.

    The data path releases the GIL in socket calls and in the codec, so concurrent calls overlap.
    Cancelling a call waits for its thread to finish before the cancellation propagates: once the
    awaiting coroutine is cancelled, nothing writes into its buffers any more, and a client returns to
    the pool only when it is idle.
    """

    def __init__(self, config: cluster_mod.ClusterConfig, token: str | None = None, namespace: Namespace | None = None):
        self._factory = lambda: Client(config, token=token, namespace=namespace)
        self._idle: list[Client] = []
        self._all: list[Client] = []

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        client = self._idle.pop() if self._idle else None
        if client is None:
            client = self._factory()
            self._all.append(client)
        call = functools.partial(getattr(client, name), *args, **kwargs)
        running = asyncio.ensure_future(asyncio.to_thread(call))
        running.add_done_callback(lambda _: self._idle.append(client))
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await running  # the thread cannot be stopped: let it finish before we give up its buffers
            raise

    async def put(
        self, keys: Sequence[bytes], blocks: Sequence[Buffer], ttl_class: str = "chatbot", **kw: Any
    ) -> list[bool]:
        return await self._call("put", keys, blocks, ttl_class, **kw)

    async def put_from(
        self, keys: Sequence[bytes], buffers: Sequence[Buffer], ttl_class: str = "chatbot", **kw: Any
    ) -> list[bool]:
        return await self._call("put_from", keys, buffers, ttl_class, **kw)

    async def get(self, keys: Sequence[bytes], **kw: Any) -> list[bytearray | None]:
        return await self._call("get", keys, **kw)

    async def get_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer], **kw: Any) -> list[bool]:
        return await self._call("get_into", keys, buffers, **kw)

    async def match(self, keys: Sequence[bytes]) -> int:
        return await self._call("match", keys)

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return await self._call("exists", keys)

    async def delete(self, keys: Sequence[bytes]) -> None:
        return await self._call("delete", keys)

    async def close(self) -> None:
        for client in self._all:
            client.close()
        self._all.clear()
        self._idle.clear()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def connect_async(path: str | Path, token: str | None = None, namespace: Namespace | None = None) -> AsyncClient:
    return AsyncClient(cluster_mod.load(path), token=token, namespace=namespace)
