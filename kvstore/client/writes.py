"""The write path: a batch of blocks encoded 10+2 and written in two phases (PENDING on every node of the
block's group, then COMMIT); see docs/design.md §4."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvtier.kvstore import _native
from kvtier.kvstore.client.core import Buffer, ClientCore, _by_node, gather_rows, header_rows, key_rows, node_runs
from kvtier.kvstore.codec import DATA_SHARDS, TOTAL_SHARDS, Codec, addresses
from kvtier.kvstore.keys import Namespace, TokenInput
from kvtier.kvstore.placement import RECORD_HOLDERS
from kvtier.kvstore.wire.protocol import Op, Status
from kvtier.kvstore.wire.transport import Exchange, Pending

log = logging.getLogger("kvtier.client")


class CapacityError(Exception):
    """The cluster refused blocks: a node had no room and nothing could be evicted to make it (every slot
    pinned by reads in flight or held by pending writes), or a node's disk is full.

    ``stored`` says, per block of the failed call, whether it was stored anyway.
    """

    def __init__(self, message: str, stored: list[bool]) -> None:
        super().__init__(message)
        self.stored = stored


class Writes(ClientCore):
    """``put``/``put_from`` and ``write_shards`` (repair writes only the shards that are missing)."""

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
        down); nothing of it is visible. A full cluster makes room by evicting least-recently-used blocks
        at once. Raises ValueError for an unknown TTL class and CapacityError if any block was refused
        because nothing could be evicted (the others are stored as reported by the exception's ``stored``).
        """
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
        if not keys:
            return []
        headers, parents, ns_digest = self._headers(keys, tokens, namespace, headers)
        views = [memoryview(b).cast("B") for b in blocks]
        shard_nodes = self.placement.shard_nodes(keys)
        write = np.ones(shard_nodes.shape, dtype=bool)
        done = self._store(keys, views, ttl_class, shard_nodes, write, headers, parents, ns_digest)
        # taken by their primary, which then answered the COMMIT that it no longer had them: removed between the
        # phases (a full cache evicted the copy its nodes found stored, whose payload the writer then did not send)
        lost = done.vanished & ~done.no_space
        if lost.any():  # stored again, once
            rows = np.flatnonzero(lost)
            again = self._store(
                [keys[b] for b in rows.tolist()],
                [views[b] for b in rows.tolist()],
                ttl_class,
                shard_nodes[rows],
                write[rows],
                [headers[b] for b in rows.tolist()] if headers is not None else None,
                parents,
                ns_digest,
            )
            for mine, retried in zip(done, again, strict=True):
                mine[rows] = retried
        stored, no_space = done.committed, done.no_space
        result = stored.tolist()
        unavailable = ~stored & ~no_space
        if unavailable.any():
            self._refused(shard_nodes[unavailable], done.took[unavailable])
        if (no_space & ~stored).any():
            refused = int((no_space & ~stored).sum())
            raise CapacityError(
                f"{refused} of {len(keys)} blocks were refused: nodes are at capacity and nothing could be evicted "
                "(every slot is pinned by reads in flight or held by pending writes), or a node's disk is full; "
                "retry once reads and writes in flight have finished",
                result,
            )
        return result

    def _refused(self, shard_nodes: np.ndarray, took: np.ndarray) -> None:
        """Blocks refused because too few of their nodes took shards: counted, and said once a call, with the
        nodes that did not take theirs (down, unreachable, or draining)."""
        self.stats["refused_unavailable"] += len(shard_nodes)
        missing = sorted({int(n) for n in np.unique(shard_nodes[~took])})
        log.warning(
            "%d blocks not stored: fewer than %d of their nodes took shards, or their primary did not "
            "(nodes %s down, unreachable or draining)",
            len(shard_nodes),
            self.config.client.min_write_shards,
            ", ".join(map(str, missing)) or "none",
        )

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
    ) -> Stored:
        """Write the shards selected by ``write`` (n × 12) in two phases; see the module docstring.

        A block commits when its primary's shard and ``min_write_shards`` shards are durable, or, for a
        ``repair`` (which writes only missing or corrupt shards, replacing what is there), whenever its
        written shards are. A block that commits short of shards is owed a repair by its primary: the COMMIT names
        the shards no node took, and an ``OWE`` afterwards those whose holder took them but did not commit them.
        """
        stripes = self._stripes(views)
        block_lens = stripes.lens.astype("<u8")
        shard_lens = stripes.sizes.astype("<u4")  # all 12 shards of a block
        put_id = os.urandom(8)  # names this put's pending shards on every node: the COMMIT refers to them
        key_table = key_rows(keys)  # gathered per node with numpy
        header_table = header_rows(headers) if headers is not None else None
        created_at = np.asarray(created, dtype="<f8") if created is not None else None

        # phase 1: shards PENDING on every node. Parity is computed a window of blocks at a time: the first before
        # the requests go out, each next one once the sockets have taken all that is encoded, so the nodes receive
        # while the rest is encoded (64 MiB puts here: 12-30 % more throughput than encoding it all first)
        first = max(1, ENCODE_WINDOW // max(1, int(stripes.lens.max())))  # blocks; then each window doubles them
        starts = [0, *itertools.takewhile(lambda b: b < len(keys), (first << k for k in itertools.count())), len(keys)]
        feeds: list[list[tuple[Pending, _native.Scatter]]] = [[] for _ in range(len(starts) - 1)]
        stripes.encode(self.codec, 0, starts[1])
        exchange = Exchange(self.pool)
        plans = []
        for node_id, entries in _by_node(shard_nodes, write):
            blocks, indices = entries[:, 0], entries[:, 1]
            meta = self._entry_meta(key_table, entries, header_table)
            meta.update(put=put_id, cls=ttl_class, blen=block_lens[blocks].tobytes(), lens=shard_lens[blocks].tobytes())
            if parents:
                meta["ns"] = ns_digest
                meta["par"] = [parents[keys[b]] for b in blocks[indices < RECORD_HOLDERS].tolist()]
            if created_at is not None:
                meta["created"] = created_at[blocks].tobytes()
            if repair:
                meta["replace"] = True
            rows = stripes.pieces.take(blocks * TOTAL_SHARDS + indices, axis=0)
            cuts = np.searchsorted(blocks, starts).tolist()  # this node's rows of each window
            parts = [_native.Scatter(rows[lo:hi], stripes.keep) for lo, hi in itertools.pairwise(cuts)]
            pending = exchange.request(
                node_id, Op.PUT_SHARDS, meta, parts[:1], later=sum(len(part) for part in parts[1:])
            )
            for w, part in enumerate(parts[1:], 1):
                if len(part):
                    feeds[w].append((pending, part))
            plans.append((node_id, entries, pending))

        later = iter(range(1, len(feeds)))

        def encode_next() -> bool:
            w = next(later)
            stripes.encode(self.codec, starts[w], starts[w + 1])
            for pending, part in feeds[w]:
                exchange.extend(pending, part)
            return w + 1 < len(feeds)

        exchange.run(self.config.client.op_timeout_s, work=encode_next if len(feeds) > 1 else None)
        ok = np.zeros(shard_nodes.shape, dtype=bool)
        no_space = np.zeros(len(keys), dtype=bool)
        answered = []
        for node_id, entries, pending in plans:
            statuses = self._flags(pending, "st", len(entries))
            if statuses is None:
                continue
            if (statuses == Status.BAD_CLASS).any():
                raise ValueError(f"unknown TTL class {ttl_class!r}: the cluster defines no such class")
            good = (statuses == Status.OK) | (statuses == Status.EXISTS)
            ok[entries[good, 0], entries[good, 1]] = True
            no_space[entries[statuses == Status.NO_SPACE, 0]] = True
            if good.any():
                answered.append((node_id, entries))
        if repair:
            committable = np.ones(len(keys), dtype=bool)
        else:
            committable = ok[:, 0] & (ok.sum(axis=1) >= self.config.client.min_write_shards)

        # phase 2: one small COMMIT per node naming the put: commit the shards of committable blocks, drop the
        # others' (so they do not wait for GC); the primary's record makes a block visible. A block committed
        # short of shards (a node down) is named to its primary with the shards it lacks: the primary owes
        # their repair
        lacking = write & ~ok
        short = committable & lacking.any(axis=1) & (not repair)
        missing = _bit_masks(lacking) * short if short.any() else None
        exchange = Exchange(self.pool)
        commits = []
        for node_id, entries in answered:
            meta = {"put": put_id, "act": committable[entries[:, 0]].astype(np.uint8).tobytes()}
            if missing is not None and (to_primary := missing[entries[:, 0]] * (entries[:, 1] == 0)).any():
                meta["miss"] = to_primary.astype("<u2").tobytes()
            commits.append((entries, exchange.request(node_id, Op.COMMIT, meta)))
        exchange.run(self.config.client.op_timeout_s)
        durable = np.zeros(shard_nodes.shape, dtype=bool)
        vanished = np.zeros(len(keys), dtype=bool)
        for entries, pending in commits:
            statuses = self._flags(pending, "st", len(entries))
            if statuses is not None:
                committed = entries[statuses == Status.OK]
                durable[committed[:, 0], committed[:, 1]] = True
                vanished[entries[(statuses == Status.MISSING) & (entries[:, 1] == 0), 0]] = True
                no_space[entries[statuses == Status.NO_SPACE, 0]] = True  # no room to record them there
        uncommitted = write & ~durable
        if not repair and uncommitted.any():  # (a put that committed everything costs this one test)
            named = missing if missing is not None else np.zeros(len(keys), dtype=np.uint16)
            self._owe(key_table, shard_nodes, uncommitted, durable[:, 0], named)
        return Stored(durable, durable[:, 0], no_space, ok, vanished & committable)

    def _owe(
        self,
        key_table: np.ndarray,
        shard_nodes: np.ndarray,
        lacking: np.ndarray,
        committed: np.ndarray,
        named: np.ndarray,
    ) -> None:
        """Tell the primaries of committed blocks which shards did not commit beyond those their COMMIT ``named`` (a
        holder took its shard, then failed before or during its COMMIT): each owes those repairs (``OWE``), or the
        block would stay 11 shards with nobody knowing. A primary that does not answer is logged: it failed
        itself, and its own blocks are the rebuild's."""
        masks = _bit_masks(lacking)
        rows = np.flatnonzero(committed & (masks & ~named != 0))
        if not len(rows):
            return
        exchange = Exchange(self.pool)
        asks = []
        order, runs = node_runs(shard_nodes[rows, 0])
        for node_id, lo, hi in runs:
            mine = rows[order[lo:hi]]
            meta = {"keys": gather_rows(key_table, mine), "klen": key_table.shape[1]}
            meta["miss"] = masks[mine].astype("<u2").tobytes()
            asks.append((node_id, len(mine), exchange.request(node_id, Op.OWE, meta)))
        exchange.run(self.config.client.op_timeout_s)
        for node_id, count, pending in asks:
            if not pending.ok:
                log.warning("node %d did not take on repairs of %d blocks committed short of shards", node_id, count)

    put_from = put  # buffers are sent as views either way; the second name matches get_into

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
        blocks' stored header digests. A rewritten shard 0, 1 or 2 re-creates the block record there with
        ``created`` (and the rewritten shards carry it). Returns the (n × 12) shards committed."""
        views = [memoryview(b).cast("B") for b in blocks]
        shard_nodes = self.placement.shard_nodes(keys)
        done = self._store(keys, views, ttl_class, shard_nodes, which, list(headers), created=created, repair=True)
        return done.durable & which

    def _stripes(self, views: Sequence[memoryview]) -> Stripes:
        """The shards of every block as (address, length) pieces, parity not computed yet (``Stripes.encode``).
        Data shards are the block's own bytes; a short last data shard is followed by a piece of a shared zero
        buffer (its padding); the parity of the whole batch lives in one buffer reused across calls (no fresh
        pages to fault in); a block too small for that (its last shard empty) is padded by a copy. No Python
        object per shard."""
        lens = np.fromiter(map(len, views), dtype=np.int64, count=len(views))
        sizes = np.maximum(1, -(-lens // DATA_SHARDS))  # codec.shard_size of every block
        full = lens - (DATA_SHARDS - 1) * sizes  # bytes of the last shard that the block holds
        sources = list(views)
        for b in np.flatnonzero(full <= 0).tolist():  # tiny: its last shards are empty; padding by a copy is free
            sources[b] = memoryview(bytes(views[b]).ljust(DATA_SHARDS * int(sizes[b]), b"\0"))
            full[b] = sizes[b]
        if len(self._parity) < 2 * int(sizes.sum()):
            self._parity = bytearray(2 * int(sizes.sum()))
        parity = memoryview(self._parity)
        zeros = _zeros(int((sizes - full).max(initial=0)))
        zeros_at = int(addresses([zeros])[0]) if len(zeros) else 0
        table = np.empty((len(views), TOTAL_SHARDS), dtype=np.int64)
        table[:, 0] = addresses(sources)
        table[:, 1:DATA_SHARDS] = table[:, :1] + sizes[:, None] * np.arange(1, DATA_SHARDS)
        table[:, DATA_SHARDS] = addresses([parity])[0] + 2 * (np.cumsum(sizes) - sizes)
        table[:, DATA_SHARDS + 1] = table[:, DATA_SHARDS] + sizes
        pieces = np.zeros((len(views), TOTAL_SHARDS, 2, 2), dtype=np.int64)  # per shard: its bytes, its padding
        pieces[:, :, 0, 0] = table
        pieces[:, :, 0, 1] = sizes[:, None]
        pieces[:, DATA_SHARDS - 1, 0, 1] = full
        pieces[:, DATA_SHARDS - 1, 1, 0] = zeros_at
        pieces[:, DATA_SHARDS - 1, 1, 1] = sizes - full
        return Stripes(pieces.reshape(-1, 4), lens, sizes, full, table, zeros_at, (sources, parity, zeros))


ENCODE_WINDOW = 4 << 20
"""Block bytes of a put's first window of parity, sent while the rest is encoded; each later window holds as many
blocks as all before it (few rounds of the send loop, yet the nodes never wait for the whole batch's parity)."""


class Stored(NamedTuple):
    """What a two-phase write achieved: the (n × 12) shards committed, per block whether it committed (its primary
    recorded it) and whether a node refused one of its shards for lack of space, the (n × 12) shards their nodes
    took in the first phase (stored pending, or there already), and per block whether its primary took it in the
    first phase and answered the COMMIT that it no longer had it (removed in between)."""

    durable: np.ndarray
    committed: np.ndarray
    no_space: np.ndarray
    took: np.ndarray
    vanished: np.ndarray


class Stripes(NamedTuple):
    """A batch's shards, ready to send once encoded: ``pieces[block * TOTAL_SHARDS + shard]`` is two (address,
    length) pairs (the shard's bytes, then its zero padding, usually empty), valid while ``keep`` lives; per
    block its length, shard size, bytes of its last data shard, and the addresses of its 12 shards."""

    pieces: np.ndarray
    lens: np.ndarray
    sizes: np.ndarray
    full: np.ndarray
    table: np.ndarray
    zeros_at: int
    keep: object

    def encode(self, codec: Codec, lo: int, hi: int) -> None:
        """Compute the parity of blocks ``lo``..``hi`` - 1: one ISA-L call per block, two when its last shard is
        short (the bytes where every shard has data, then the rest with the zero buffer for the last shard)."""
        table, full, sizes = self.table[lo:hi], self.full[lo:hi], self.sizes[lo:hi]
        codec.encode_parity_at(table, full)
        short = np.flatnonzero(full < sizes)
        if len(short):
            rest = table[short] + full[short, None]
            rest[:, DATA_SHARDS - 1] = self.zeros_at
            codec.encode_parity_at(rest, (sizes - full)[short])


def _bit_masks(shards: np.ndarray) -> np.ndarray:
    """Per row of an (n × 12) bool table, its true columns as the bits of a ``uint16``."""
    return (shards.astype(np.uint16) << np.arange(TOTAL_SHARDS, dtype=np.uint16)).sum(axis=1, dtype=np.uint16)


def _zeros(n: int) -> memoryview:
    """``n`` zero bytes, read-only and shared (never written: they stand for shard padding)."""
    global _ZEROS
    if len(_ZEROS) < n:
        _ZEROS = memoryview(bytes(n))
    return _ZEROS[:n]


_ZEROS = memoryview(bytes(1 << 16))
