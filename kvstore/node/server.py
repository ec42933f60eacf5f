"""A storage node: one process serving one data dir (chunk engine) over TCP.

Each connection gets a thread running blocking socket calls over the sans-IO
:class:`~kvtier.kvstore.wire.protocol.FrameReader`. A connection is one client's pipeline of batched
requests, so per-connection threads cost nothing in parallelism and let LMDB and file I/O block without an
event loop. Frames' heads and metadata come in through ``sockio.recv_frame`` (shared with the client); a
PUT's payload is received by a compiled loop in cache-sized pieces, checksummed while hot and written to
the slab slots reserved for its shards (``receive_payload``); a GET reply is sent by a compiled loop over
views of the slab mappings, the slots pinned until it is sent.
(Measured in PERF.md, blocking sockets and ``asyncio.BufferedProtocol`` move bytes at the same speed.)

Connections are admitted as :mod:`kvtier.kvstore.wire.admission` says (slots kept for authenticated ones,
per-address limits, one deadline for the whole HELLO, an accept loop that survives running out of
descriptors). Connection state machine:

| state         | frame / event                | action                                        | next          |
|---------------|------------------------------|-----------------------------------------------|---------------|
| (accept)      | over a connection limit      | ERROR(BUSY), close                            | closed        |
| NEW           | HELLO, token good            | reply with node id and tenant                 | AUTHENTICATED |
| NEW           | HELLO, token bad             | ERROR(AUTH_FAILED), close; address charged    | closed        |
| NEW           | anything else                | ERROR(AUTH_REQUIRED), close; address charged  | closed        |
| NEW           | header over pre-auth limits  | ERROR(TOO_LARGE), close (nothing allocated)   | closed        |
| NEW           | ``hello_timeout_s`` passed   | ERROR(AUTH_REQUIRED), close                   | closed        |
| NEW           | HELLO, tenant at its share   | ERROR(BUSY), close                            | closed        |
| NEW           | its place taken (slots full) | ERROR(BUSY), close                            | closed        |
| AUTHENTICATED | a request                    | reply                                         | AUTHENTICATED |
| AUTHENTICATED | silent ``idle_timeout_s``    | close                                         | closed        |
| AUTHENTICATED | admin op or tenant, no admin | ERROR(FORBIDDEN) (a PUT's payload dropped)    | AUTHENTICATED |
| AUTHENTICATED | no disk to record a request  | ERROR(NO_SPACE) (nothing changed)             | AUTHENTICATED |
| any           | malformed frame              | ERROR(BAD_FRAME/TOO_LARGE/BAD_REQUEST), close | closed        |

Other connections never notice a closed one.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import signal
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvtier.kvstore import _native
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster import map as cluster_map
from kvtier.kvstore.codec import TOTAL_SHARDS
from kvtier.kvstore.node.chunks import KEEP, ChunkEngine, WriteBatch, holds_record
from kvtier.kvstore.node.disk import NoSpace
from kvtier.kvstore.node.held_blocks import blocks_held
from kvtier.kvstore.node.metrics import NodeMetrics
from kvtier.kvstore.node.slabs import MAX_SHARD_BYTES
from kvtier.kvstore.placement import Placement, primary_budget_bytes
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
from kvtier.kvstore.wire.fields import (
    bad,
    field,
    unpack_array,
    unpack_header_blob,
    unpack_key_blob,
    unpack_keys,
)
from kvtier.kvstore.wire.metrics import MetricsServer
from kvtier.kvstore.wire.protocol import (
    HEADER_SIZE,
    KEPT_META_BYTES,
    META_LEN_AT,
    ErrorCode,
    Frame,
    FrameReader,
    Op,
    ProtocolError,
    Status,
    TenantBudgets,
    encode_error,
    encode_head,
)
from kvtier.kvstore.wire.requests import NODE_REQUESTS, PAGE_BLOCKS
from kvtier.kvstore.wire.sockio import recv_frame

log = logging.getLogger("kvtier.node")

DRAIN_S = 0.5  # a connection closed with an ERROR is drained at most this long, so the peer reads the error
RECV_PIECE_BYTES = 256 << 10  # a PUT payload is received, checksummed and written in pieces this size (in L2)


class GCService(Protocol):
    """What the node needs of the GC worker it is composed with (``kvtier.gc.worker.GCWorker``)."""

    stats: Any  # ``failing``, ``last_error``, ``as_dict()``

    def cycle(self, repair: bool = False, rebuild: bool = False) -> dict[str, float | int | str]: ...

    def scrub(self) -> dict[str, int]: ...

    def evict_matching(self, ttl_class: str | None, older_than_s: float | None, dry_run: bool) -> dict[str, int]: ...


class Reply:
    """What a handler answers: metadata, optional payload buffers, and what to run once they are sent."""

    __slots__ = ("meta", "on_sent", "payload")

    def __init__(
        self,
        meta: dict[str, Any],
        payload: Sequence[memoryview] = (),
        on_sent: Callable[[], None] | None = None,
    ) -> None:
        self.meta = meta
        self.payload = payload
        self.on_sent = on_sent


class Session:
    """Per-connection state: the authenticated tenant, reusable buffers, a PUT whose payload is arriving."""

    def __init__(self, tenant: str, admin: bool) -> None:
        self.tenant = tenant
        self.admin = admin
        self.scratch = bytearray()
        self.receiving: tuple[int, str, WriteBatch] | None = None  # (request id, tenant, shards) of a PUT
        self.refused: ProtocolError | None = None  # why the PUT being received stores nothing (FORBIDDEN)

    def scratch_view(self, n: int) -> memoryview:
        """A reused buffer of ``n`` bytes that payloads pass through on their way to the slab files."""
        if len(self.scratch) < n:
            self.scratch = bytearray(n)
        return memoryview(self.scratch)[:n]


class StorageNode:
    """Request handlers over a chunk engine; knows nothing about sockets."""

    def __init__(self, config: cluster_mod.ClusterConfig, node_id: int, engine: ChunkEngine) -> None:
        self.config = config
        self.node_id = node_id
        self.engine = engine
        self.placement = Placement(config.groups)
        self.ttl_classes = dict(config.ttl_classes)  # replaced at run time by ADMIN ttl_set
        self.started = time.time()
        self.gc: GCService | None = None  # wired in by the process that composes the node (kvtier.gc.nodeproc)
        self.metrics = NodeMetrics(engine, config.gc, lambda: self.gc.stats if self.gc is not None else None)
        self._scanning = threading.Lock()  # admin blocks_held: a copy of the shard index each
        # set by ``kvctl drain`` (kept across restarts): no new shards, so the node can be replaced
        self.draining = engine.setting("draining") == b"1"
        self.handlers: dict[int, Callable[[Session, Frame], Reply]] = {
            Op.PUT_SHARDS: self.put_shards,
            Op.COMMIT: self.commit,
            Op.GET_SHARDS: self.get_shards,
            Op.MATCH: self.match,
            Op.DELETE: self.delete,
            Op.STAT: self.stat,
            Op.NODE_INFO: self.node_info,
            Op.ADMIN: self.admin,
            Op.OWE: self.owe,
        }

    def health(self) -> dict[str, Any]:
        """``/health``: ok unless the GC worker's last cycle failed."""
        return {
            "status": "degraded" if self.gc is not None and self.gc.stats.failing else "ok",
            "node_id": self.node_id,
            "used_bytes": self.engine.used_bytes,
            "capacity_bytes": self.engine.capacity_bytes,
            "uptime_s": time.time() - self.started,
            "gc_last_error": self.gc.stats.last_error if self.gc is not None else "",
        }

    def ttl_s(self, ttl_class: str) -> float | None:
        return self.ttl_classes.get(ttl_class)

    def authenticate(self, frame: Frame) -> Session:
        """The session a connection's first frame opens; ProtocolError if it is not a HELLO with a known token."""
        tenant = authenticate(frame, self.config.tenant_for_token)
        return Session(tenant, admin=tenant == cluster_mod.DEFAULT_TENANT)

    def handle(self, session: Session, frame: Frame) -> Reply:
        handler = self.handlers.get(frame.opcode)
        if handler is None:
            raise bad(f"unknown opcode {frame.opcode}")
        try:
            reply = handler(session, frame)
        except NoSpace as exc:  # (counted and logged by the engine) the request changed nothing; the connection stays
            raise ProtocolError(ErrorCode.NO_SPACE, f"node {self.node_id}: {exc}", frame.request_id) from None
        if self.config.revision:  # the map this node acts on: a client on an older one reads the map again
            reply.meta["rev"] = self.config.revision
        return reply

    def adopt(self, config: cluster_mod.ClusterConfig) -> None:
        """Act on a newer cluster map (etcd): its placement, TTL table, tenants and this node's share of its group
        (the primary budget). The node's own address and data dir stay what they were when it started."""
        self.config = config
        self.placement = Placement(config.groups)
        self.ttl_classes = dict(config.ttl_classes)
        if any(self.node_id in group for group in config.groups):
            capacities = {nid: n.capacity_bytes for nid, n in config.nodes.items()}
            self.engine.primary_budget_bytes = primary_budget_bytes(config.groups, capacities, self.node_id)

    @staticmethod
    def tenant(session: Session, meta: dict[str, Any]) -> str:
        """The tenant a request acts for: the connection's, or, for the admin only, ``meta["tenant"]``
        (GC and repair work on every tenant's blocks)."""
        if "tenant" not in meta:
            return session.tenant
        if not session.admin:
            raise ProtocolError(ErrorCode.FORBIDDEN, "acting for another tenant needs the cluster (admin) token")
        return field(meta, "tenant", str)

    @staticmethod
    def _require_admin(session: Session, what: str) -> None:
        if not session.admin:
            raise ProtocolError(ErrorCode.FORBIDDEN, f"{what} needs the cluster (admin) token")

    def _entries(self, frame: Frame) -> tuple[list[bytes], np.ndarray]:
        keys = unpack_keys(frame.meta, self.config.limits.max_batch)
        idx = unpack_array(frame.meta, "idx", "u1", len(keys))
        if len(idx) and int(idx.max()) >= TOTAL_SHARDS:
            raise bad(f"shard index out of range 0..{TOTAL_SHARDS - 1}")
        return keys, idx

    def receive_payload(self, session: Session, head: Frame, sock: socket.socket) -> None:
        """Receive a request's payload from ``sock``: a PUT's shards straight into their reserved slab slots.

        The compiled loop (``_native.recv_to_files``) receives in pieces the size of a CPU cache, checksums
        each shard while it is hot and writes runs of adjacent slots whole; refused shards are received and
        dropped. A PUT for another tenant without the admin token is received and dropped whole, and answered
        FORBIDDEN by :meth:`put_shards` (the connection stays usable). Raises what the socket raises (timeout,
        reset): the reservations are then given back by ``abandon_payload``.
        """
        if head.opcode != Op.PUT_SHARDS:
            raise bad(f"opcode {head.opcode} carries no payload")
        batch = self._write_batch(head.meta)
        if int(batch.length.sum()) != head.payload_len:
            raise bad("shard lengths do not add up to the payload")
        try:
            tenant = self.tenant(session, head.meta)
        except ProtocolError as exc:
            if exc.code != ErrorCode.FORBIDDEN:
                raise
            tenant, session.refused = session.tenant, exc
            batch.status[:] = Status.MISSING  # nothing reserved: every shard is received and dropped
        else:
            if batch.ttl_class not in self.ttl_classes:
                batch.status[:] = Status.BAD_CLASS
            elif self.draining:
                batch.status[:] = Status.DRAINING
            else:
                self.engine.reserve(tenant, batch)
        session.receiving = (head.request_id, tenant, batch)
        crcs = _native.recv_to_files(
            sock.fileno(),
            _milliseconds(self.config.gc.write_timeout_s),  # a peer may not stall mid-frame
            batch.plan(self.engine.slabs.fd),
            session.scratch_view(RECV_PIECE_BYTES),
        )
        batch.crc = np.frombuffer(crcs, dtype="<u4")

    def _write_batch(self, meta: dict[str, Any]) -> WriteBatch:
        """A PUT's metadata as a :class:`WriteBatch`; ``bad`` (the connection is closed) for malformed fields."""
        keys, klen, idx, hdr = self._shard_batch(meta)
        n = len(idx)
        lens = unpack_array(meta, "lens", "<u4", n)
        if n and (int(lens.min()) == 0 or int(lens.max()) > MAX_SHARD_BYTES):
            raise bad(f"shard lengths must be between 1 and {MAX_SHARD_BYTES} bytes")
        put_id = field(meta, "put", bytes)
        if not 1 <= len(put_id) <= 32:
            raise bad("field 'put' must be a put id of 1 to 32 bytes")
        ns = meta.get("ns", b"")
        parents = meta.get("par")
        # one per shard 0, 1 or 2; a client from before records were kept on three nodes names shards 0 and 1
        holders = (int(np.count_nonzero(holds_record(idx))), int(np.count_nonzero(idx < 2)))
        if not isinstance(ns, bytes) or len(ns) > 32:
            raise bad("field 'ns' must be a namespace digest of at most 32 bytes")
        if parents is not None and (
            not isinstance(parents, list)
            or len(parents) not in holders
            or not all(isinstance(p, bytes) and len(p) <= 255 for p in parents)
        ):
            raise bad("field 'par' must list one parent key (at most 255 bytes) per shard 0, 1 or 2")
        return WriteBatch(
            keys,
            klen,
            idx,
            lens,
            unpack_array(meta, "blen", "<u8", n),
            field(meta, "cls", str),
            hdr,
            replace=bool(meta.get("replace")),
            ns=ns,
            parents=parents,
            # a rewritten block keeps its age, but never a time ahead of this node's clock: a writer's created ten
            # years ahead would outlive its TTL and never be old enough to reclaim (issue 36)
            created=np.minimum(unpack_array(meta, "created", "<f8", n), self.engine.clock())
            if "created" in meta
            else None,
        )

    def abandon_payload(self, session: Session) -> None:
        """The connection died mid-payload: give the reserved slots back."""
        if session.receiving is not None:
            self.engine.cancel(session.receiving[2])
            session.receiving = None

    def put_shards(self, session: Session, frame: Frame) -> Reply:
        """The PUT's shards are in their slots: they wait, PENDING (in memory), for the writer's COMMIT."""
        if session.receiving is None or session.receiving[0] != frame.request_id:
            raise bad("PUT_SHARDS without shards")
        if session.refused is not None:
            session.receiving, refused, session.refused = None, session.refused, None
            raise refused
        _, tenant, batch = session.receiving
        if batch.holds_any():
            self.engine.stage(tenant, frame.meta["put"], batch)
        session.receiving = None  # staged: from here on the slots belong to the pending batch, not to us
        return Reply({"st": batch.status.tobytes()})

    def commit(self, session: Session, frame: Frame) -> Reply:
        """Settle the PUT named ``put``: per shard of it, in its order, ``act`` says commit (1), drop (0) or
        keep pending (2). Answers per shard OK (committed) or MISSING (not stored here: refused, dropped, or
        the node restarted since the PUT). ``miss`` (optional, ``<u2`` per shard): the shards of each block that
        the writer could not store (a bit each), so that the block's primary owes their repair."""
        put_id = field(frame.meta, "put", bytes)
        action = field(frame.meta, "act", bytes)
        if len(action) > self.config.limits.max_batch or max(action, default=0) > KEEP:
            raise bad("field 'act' must hold one action (0 drop, 1 commit, 2 keep) per shard of the put")
        missing = unpack_array(frame.meta, "miss", "<u2", len(action)) if "miss" in frame.meta else None
        tenant = self.tenant(session, frame.meta)
        try:
            statuses = self.engine.commit(tenant, put_id, np.frombuffer(action, np.uint8), missing)
        except ValueError as exc:
            raise bad(str(exc)) from None
        return Reply({"st": statuses if statuses is not None else bytes([Status.MISSING]) * len(action)})

    def owe(self, session: Session, frame: Frame) -> Reply:
        """The writer of ``keys`` could not commit the shards ``miss`` names (``<u2`` a key, a bit a shard: a holder
        took its shard and then failed before or during the COMMIT): this node, their primary, owes their repair.
        Keys of blocks it is not the live primary of are ignored. Answers how many repairs were taken on."""
        blob, klen = unpack_key_blob(frame.meta, self.config.limits.max_batch)
        missing = unpack_array(frame.meta, "miss", "<u2", len(blob) // klen)
        if len(missing) and int(missing.max()) >= 1 << TOTAL_SHARDS:
            raise bad(f"field 'miss' names shards beyond the {TOTAL_SHARDS} of a block")
        return Reply({"owed": self.engine.owe_short(self.tenant(session, frame.meta), blob, klen, missing)})

    def get_shards(self, session: Session, frame: Frame) -> Reply:
        """Shards by (key, index), sent straight from the slab mappings (pinned until sent), with per-shard
        columns: ``st``, ``lens``, ``blen``, ``ci`` (TTL class, an index into ``classes``), ``hdr``.

        ``client_crc``: the reader checks every shard itself as it arrives, so the node sends each one's stored
        crc32c (a ``crc`` column, ``<u4``) instead of reading the bytes to check them; otherwise a shard whose
        bytes fail their crc is ``CORRUPT``. ``probe``: statuses only, no bytes, no check (for repair scans), and
        ``rec``: per shard 0, 1 or 2 asked, whether this node holds the block record (1), removed the block and
        is still deleting its shards (2), or neither (0).
        """
        keys, _, idx, headers = self._shard_batch(frame.meta)
        tenant = self.tenant(session, frame.meta)
        probe, client_crc = bool(frame.meta.get("probe")), bool(frame.meta.get("client_crc"))
        reads = self.engine.read(tenant, keys, idx, headers, self.ttl_s, probe=probe, verify=not client_crc)
        status_bytes = reads.status.tobytes()
        if probe:
            return Reply({"st": status_bytes, "rec": reads.record_states.tobytes()})  # type: ignore[union-attr]
        self.metrics.lookups(status_bytes)
        records = reads.records
        meta = {
            "st": status_bytes,
            "lens": records["length"].tobytes(),
            "blen": records["block_len"].tobytes(),
            "classes": reads.ttl_classes,
            "ci": reads.ttl.tobytes(),
            "hdr": records["header"].tobytes(),
        }
        if client_crc:
            meta["crc"] = records["crc"].tobytes()
        payload = [reads.payload] if reads.payload is not None else []
        return Reply(meta, payload, on_sent=lambda: self.engine.unpin(reads))  # type: ignore[list-item]

    def _shard_batch(self, meta: dict[str, Any]) -> tuple[bytes, int, np.ndarray, bytes | None]:
        """A PUT's or GET's rows as columns, checked: the keys blob, its key length, shard indices and header
        digests (or None)."""
        keys, klen = unpack_key_blob(meta, self.config.limits.max_batch)
        n = len(keys) // klen
        idx = unpack_array(meta, "idx", "u1", n)
        if n and int(idx.max()) >= TOTAL_SHARDS:
            raise bad(f"shard index out of range 0..{TOTAL_SHARDS - 1}")
        return keys, klen, idx, unpack_header_blob(meta, n)

    def match(self, session: Session, frame: Frame) -> Reply:
        blob, klen = unpack_key_blob(frame.meta, self.config.limits.max_batch)
        return Reply({"live": self.engine.live_flags(self.tenant(session, frame.meta), blob, klen, self.ttl_s)})

    def delete(self, session: Session, frame: Frame) -> Reply:
        """Drop the blocks' records and shards; ``before`` (an eviction's time) spares what was written later."""
        keys = unpack_keys(frame.meta, self.config.limits.max_batch)
        before = frame.meta.get("before")
        if before is not None and (not isinstance(before, float | int) or isinstance(before, bool)):
            raise bad("field 'before' must be a time in seconds")
        if "idx" in frame.meta:  # the shard each key has here, as the sender's map says (a hint: a key whose
            index = unpack_array(frame.meta, "idx", "u1", len(keys))  # shard is not there is searched for)
        else:
            held = self.placement.shard_nodes(keys) == self.node_id  # the shard each key has here, by the map
            index = np.where(held.any(axis=1), held.argmax(axis=1), 0)
        removed = self.engine.delete(self.tenant(session, frame.meta), keys, before=before, index=index)
        return Reply({"removed": removed})

    def stat(self, session: Session, frame: Frame) -> Reply:
        key = field(frame.meta, "key", bytes)
        tenant = self.tenant(session, frame.meta)
        block = self.engine.block_record(tenant, key)
        shards = [
            {"index": r.index, "state": r.state, "length": r.length, "crc": r.crc, "created": r.created}
            for r in [*self.engine.shard_records(tenant, key), *self.engine.pending_shards(tenant, key)]
        ]
        meta: dict[str, Any] = {"shards": shards, "block": None}
        if block is not None:
            ttl = self.ttl_s(block.ttl_class)
            meta["block"] = {
                "block_len": block.block_len,
                "created": block.created,
                "last_access": block.last_access,
                "ttl_class": block.ttl_class,
                "expires": block.created + ttl if ttl is not None else None,
            }
        return Reply(meta)

    def node_info(self, session: Session, frame: Frame) -> Reply:
        self._require_admin(session, "node info")
        gc = self.config.gc
        owed, since = self.engine.owed_summary()  # blocks this node repairs, short of shards
        return Reply(
            {
                "node_id": self.node_id,
                "used_bytes": self.engine.used_bytes,
                "freeing_bytes": self.engine.freeing_bytes,
                "capacity_bytes": self.engine.capacity_bytes,
                "primary_bytes": self.engine.primary_bytes,
                "pending_primary_bytes": self.engine.pending_primary_bytes,
                "primary_budget_bytes": self.engine.primary_budget_bytes,
                "pinned_slots": len(self.engine.slabs.pins),
                "evicting": sum(len(removal.keys) for removal in self.engine.removals()),
                "high_watermark": gc.high_watermark,
                "low_watermark": gc.low_watermark,
                "uptime_s": time.time() - self.started,
                "pid": os.getpid(),
                "ttl": self.ttl_classes,
                "classes": self.engine.blocks_by_class(),
                "draining": self.draining,
                "rebuilding": self.engine.rebuilding,
                "blocks_under_replicated": owed,
                "oldest_owed_s": time.time() - since if since is not None else 0.0,
                "gc": self.gc.stats.as_dict() if self.gc is not None else None,
                **self.engine.counts(),
            }
        )

    def admin(self, session: Session, frame: Frame) -> Reply:
        """Operator actions on this node.

        - ``ttl_set {classes}``: replace the TTL table (seconds per class); applies to stored blocks.
        - ``gc {repair, rebuild}``: run one GC cycle now (with a repair pass if ``repair``, and a rebuild from
          every peer's shards if ``rebuild``); returns GC stats.
        - ``evict {ttl_class, older_than_s, dry_run}``: remove the blocks this node is primary for that are
          of that class and/or were created longer ago than that; returns how many matched/were removed.
        - ``drain {on}``: stop (or resume) taking new shards.
        - ``scrub``: check every committed shard's crc32c now and repair those that fail; returns what it did.
        - ``blocks_held {node, start, limit, before}``: a page of the blocks this node holds a shard of (committed
          before ``before``, if given) that have a shard at ``node`` (what a node rebuilding after its data was
          lost asks; ``kvstore.node.held_blocks``).
        """
        self._require_admin(session, "admin actions")
        action = field(frame.meta, "action", str)
        if action == "drain":
            self.draining = bool(frame.meta.get("on", True))
            self.engine.set_setting("draining", b"1" if self.draining else b"0")
            return Reply({"draining": self.draining})
        if action == "evict":
            if self.gc is None:
                raise bad("this node runs no GC worker")
            ttl_class = frame.meta.get("ttl_class")
            older = frame.meta.get("older_than_s")
            if ttl_class is not None and not isinstance(ttl_class, str):
                raise bad("ttl_class must be a string")
            if older is not None and (not isinstance(older, int | float) or older < 0):
                raise bad("older_than_s must be a non-negative number")
            if ttl_class is None and older is None:
                raise bad("evict needs ttl_class and/or older_than_s")
            return Reply(self.gc.evict_matching(ttl_class, older, dry_run=bool(frame.meta.get("dry_run"))))
        if action == "ttl_set":
            classes = frame.meta.get("classes")
            if not isinstance(classes, dict) or not all(
                isinstance(k, str) and isinstance(v, int | float) and v > 0 for k, v in classes.items()
            ):
                raise bad("ttl_set needs classes = {name: positive seconds}")
            # one assignment, so a concurrent GC cycle sees the old table or the new one, never a mix
            self.ttl_classes = {k: float(v) for k, v in classes.items()}
            return Reply({"ttl": self.ttl_classes})
        if action in ("gc", "scrub"):
            if self.gc is None:
                raise bad("this node runs no GC worker")
            if action == "scrub":
                return Reply(self.gc.scrub())
            return Reply(self.gc.cycle(bool(frame.meta.get("repair")), bool(frame.meta.get("rebuild"))))
        if action == "blocks_held":
            of_node, start = field(frame.meta, "node", int), field(frame.meta, "start", int)
            limit = min(field(frame.meta, "limit", int), PAGE_BLOCKS)
            before = frame.meta.get("before", math.inf)
            if of_node not in self.config.nodes or not 0 <= start < 1 << 64 or limit < 1:
                raise bad("blocks_held needs a node id of the cluster, a start in 0..2**64-1 and a positive limit")
            if not isinstance(before, float | int) or isinstance(before, bool):
                raise bad("field 'before' must be a time in seconds")
            with self._scanning:  # one copy of the shard index at a time, however many peers ask
                tables = self.engine.shard_tables()
                return Reply(blocks_held(tables, self.placement, of_node, start, limit, before))
        raise bad(f"unknown admin action {action!r}")


ACCEPT_WAKE_S = 0.2


class NodeServer:
    """Accepts connections and runs one thread per admitted connection over a :class:`StorageNode`."""

    def __init__(self, node: StorageNode, host: str, port: int, unix_path: Path | None = None) -> None:
        """Listen on ``host:port`` and, with ``unix_path``, on a Unix socket there too: clients on this machine
        connect to that (half the kernel's work of loopback TCP per byte); both admit alike."""
        self.node = node
        self.listeners = [socket.create_server((host, port), reuse_port=False, backlog=128)]
        self.unix_path = unix_path
        if unix_path is not None:
            self.listeners.append(_unix_listener(unix_path))
        for listener in self.listeners:
            # accept() returns this often: the kernel may hand SIGTERM to any thread, and Python runs its handler
            # only on the main thread, between bytecodes; blocked in accept() forever, it never would (a node
            # stopped and continued, then terminated, hung until SIGKILL)
            listener.settimeout(ACCEPT_WAKE_S)
        self.stopping = threading.Event()
        limits = node.config.limits
        self.acceptors = [Acceptor(listener, log) for listener in self.listeners]
        self.admission = Admission(limits, tenants=len(node.config.tenants))
        self.budgets = TenantBudgets(limits.max_buffered_meta_bytes, len(node.config.tenants))
        self.warnings = LogLimiter(log)

    def serve_forever(self) -> None:
        """Accept until :meth:`stop` (the Unix socket on a thread of its own). Never raises for what peers or the
        kernel's limits do (see :mod:`~kvtier.kvstore.wire.admission`)."""
        for acceptor in self.acceptors[1:]:
            args = (acceptor, self.admission, self.stopping, self._serve_connection, busy)
            threading.Thread(target=accept_forever, args=args, daemon=True).start()
        accept_forever(self.acceptors[0], self.admission, self.stopping, self._serve_connection, busy)

    def stop(self) -> None:
        self.stopping.set()
        for listener, acceptor in zip(self.listeners, self.acceptors, strict=True):
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
            acceptor.close()
        if self.unix_path is not None:
            self.unix_path.unlink(missing_ok=True)

    def _serve_connection(self, conn: socket.socket, ticket: Ticket) -> None:
        state = _Conversation()
        reader = FrameReader(self.node.config.limits.pre_auth(), NODE_REQUESTS)  # (its budget: its tenant's)
        try:
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # a vanished client host is noticed
            self._converse(conn, ticket, state, reader)
        except ProtocolError as exc:
            if state.session is None:
                self.warnings.warning("pre-auth", "closing a connection from %s before HELLO: %s", ticket.peer, exc)
                time.sleep(self.admission.failed(ticket))  # (held back once the address's allowance is used up)
            else:
                self.warnings.warning("request", "closing a connection from %s: %s", ticket.peer, exc)
            request_id = exc.request_id if exc.request_id is not None else state.request_id
            _close_with_error(conn, request_id, exc.code, str(exc))
        except (ConnectionError, TimeoutError):
            pass
        except Exception:
            log.exception("internal error serving a connection")
            _close_with_error(conn, state.request_id, ErrorCode.INTERNAL, "internal error; see the node log")
        finally:
            reader.close()
            if state.session is not None:
                self.node.abandon_payload(state.session)

    def _converse(self, conn: socket.socket, ticket: Ticket, state: _Conversation, reader: FrameReader) -> None:
        """Authenticate, then serve the connection's frames in turn. HELLO must arrive whole by the ticket's
        deadline (``limits.hello_timeout_s`` after the connect); after it the connection holds one of its tenant's
        slots (BUSY if the tenant holds its share: ``Admission.authenticated``) and its metadata buffers take from
        its tenant's budget, and the socket blocks with ``SO_RCVTIMEO`` set to the shorter of ``gc.write_timeout_s``
        and ``limits.idle_timeout_s`` (set once: no timeout switch, no poll per receive): a peer may not stall
        mid-frame for the first, nor stay silent between frames for the second."""
        hello = recv_hello(conn, reader, ticket, self.admission)
        if hello is None:
            return
        state.request_id = hello.request_id
        state.session = session = self.node.authenticate(hello)
        config = self.node.config
        self.admission.tenants = len(config.tenants)  # (an etcd map may have changed them)
        try:
            self.admission.authenticated(ticket, session.tenant, capped=not session.admin)
        except Refused as exc:
            raise ProtocolError(ErrorCode.BUSY, str(exc), hello.request_id) from None
        reader.limits = config.limits
        reader.budget = self.budgets.of(session.tenant, len(config.tenants))
        write_timeout_s = config.gc.write_timeout_s
        conn.settimeout(None)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(state.wait_s(config)))
        timeout_ms = _milliseconds(write_timeout_s)
        reply = Reply({"node_id": self.node.node_id, "tenant": session.tenant, "admin": session.admin})
        _native.send_all(conn.fileno(), timeout_ms, [encode_head(Op.HELLO | Op.REPLY, hello.request_id, reply.meta)])
        while (frame := self._next_frame(conn, reader, state)) is not None:
            state.request_id = frame.request_id
            started = time.perf_counter()
            try:
                reply = self.node.handle(session, frame)
            except ProtocolError as exc:
                if exc.code not in (ErrorCode.FORBIDDEN, ErrorCode.NO_SPACE):
                    raise
                _native.send_all(conn.fileno(), timeout_ms, [encode_error(frame.request_id, exc.code, str(exc))])
                continue
            payload_len = sum(len(p) for p in reply.payload)
            head = encode_head(frame.opcode | Op.REPLY, frame.request_id, reply.meta, payload_len)
            try:
                _native.send_all(conn.fileno(), timeout_ms, [head, *reply.payload])
            finally:
                if reply.on_sent is not None:
                    reply.on_sent()
            elapsed = time.perf_counter() - started
            self.node.metrics.request(frame.opcode, elapsed, frame.payload_len, payload_len)

    def _next_frame(self, conn: socket.socket, reader: FrameReader, state: _Conversation) -> Frame | None:
        """The connection's next frame; None when the peer closed it between frames or stayed silent for
        ``limits.idle_timeout_s``. Raises TimeoutError when it stalled mid-frame for ``gc.write_timeout_s`` (a PUT's
        reserved slots would be held)."""

        def before_recv(reader: FrameReader) -> None:
            if reader.needs_sink and state.session is not None:
                assert reader.head is not None
                state.request_id = reader.head.request_id
                self.node.receive_payload(state.session, reader.head, conn)
                reader.payload_received()

        config, waited, was_in_frame = self.node.config, 0.0, reader.in_frame
        while True:
            try:
                if not reader.in_frame:
                    frame = self._next_head(conn, reader)
                    if frame is not None or not reader.in_frame:  # a whole frame, or the peer closed between frames
                        return frame
                return recv_frame(conn, reader, before_recv)  # the rest: a payload, or metadata over 4 KiB
            except BlockingIOError:  # SO_RCVTIMEO passed
                if reader.in_frame != was_in_frame:  # (a frame began during the wait: its stall counts from here)
                    waited, was_in_frame = 0.0, reader.in_frame
                waited += state.wait_s(config)
                if reader.in_frame and waited >= config.gc.write_timeout_s:
                    raise TimeoutError("the peer stalled mid-frame") from None
                if not reader.in_frame and waited >= config.limits.idle_timeout_s:
                    return None

    @staticmethod
    def _next_head(conn: socket.socket, reader: FrameReader) -> Frame | None:
        """Between frames: the next frame's header and its metadata up to ``KEPT_META_BYTES``, received in one compiled
        call (``_native.recv_head``; two receives and the reader's steps in Python cost a small request a third of
        the node's time). Returns the frame when that completes it; otherwise what arrived is in ``reader`` (longer
        metadata goes on growing within the server's budget). Raises BlockingIOError when the receive timeout
        passed (with the reader mid-frame if some of it came), ConnectionResetError when the peer closed mid-frame."""
        head, state = _native.recv_head(conn.fileno(), HEADER_SIZE, META_LEN_AT, KEPT_META_BYTES)
        if state == 1:
            return reader.take_head(head)
        if head:
            reader.feed(head)
        if state == 0:
            raise BlockingIOError
        if state == -1 and head:
            raise ConnectionResetError("the peer closed the connection mid-frame")
        return None


class _Conversation:
    """What a connection's handler knows: who it talks to and which request it is answering."""

    def __init__(self) -> None:
        self.session: Session | None = None
        self.request_id = 0

    @staticmethod
    def wait_s(config: cluster_mod.ClusterConfig) -> float:
        """How long one receive waits (``SO_RCVTIMEO``): the shorter of the stall and idle limits."""
        return min(config.gc.write_timeout_s, config.limits.idle_timeout_s)


def _unix_listener(path: Path) -> socket.socket:
    """A Unix stream socket listening at ``path``, replacing a socket a previous run left there (the node's own
    data dir: nobody else can have put one there). Mode 0600 by the umask at bind: for processes of the node's
    user, as its data dir is."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o177)
    try:
        listener.bind(os.fsencode(path))
    except OSError:
        listener.close()
        raise
    finally:
        os.umask(previous)
    listener.listen(128)
    return listener


def _milliseconds(seconds: float) -> int:
    """A timeout as the compiled socket loops take it."""
    return max(1, int(seconds * 1000))


def _timeval(seconds: float) -> bytes:
    """A timeout as ``SO_RCVTIMEO`` takes it (``struct timeval``); at least 1 us (0 would mean none)."""
    micros = max(1, int(seconds * 1e6))
    return struct.pack("@ll", micros // 1_000_000, micros % 1_000_000)


def _close_with_error(conn: socket.socket, request_id: int, code: ErrorCode, message: str) -> None:
    """Send an ERROR frame, then close gently: shut our side and drain briefly (at most ``DRAIN_S`` in all, so a
    trickling peer cannot hold the thread) so the peer reads the error instead of a reset caused by its own
    unread bytes."""
    with contextlib.suppress(OSError):
        conn.settimeout(DRAIN_S)
        conn.sendall(encode_error(request_id, code, message))
        conn.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + DRAIN_S
        drained = 0
        while drained < 4 << 20 and (left := deadline - time.monotonic()) > 0:
            conn.settimeout(left)
            chunk = conn.recv(1 << 16)
            if not chunk:
                break
            drained += len(chunk)


def open_node(config_path: str, node_id: int, etcd: str | None = None) -> tuple[StorageNode, NodeServer]:
    """Load the cluster (its file, or the map in etcd the file names), open the node's chunk engine and bind its
    listener (not serving yet). ``etcd`` overrides the endpoints the file names.

    Raises ``ConfigError`` (one line) when ``node_id`` is not in the cluster or its address cannot be bound (a port
    in use: the line names the node, the address and the cause).
    """
    config = cluster_map.load(config_path, etcd_endpoints=etcd)
    if node_id not in config.nodes:
        raise cluster_mod.ConfigError(f"node {node_id} is not in {config_path}")
    _return_large_buffers_to_the_kernel()
    node_cfg = config.nodes[node_id]
    capacities = {nid: n.capacity_bytes for nid, n in config.nodes.items()}
    engine = ChunkEngine(
        node_cfg.data_dir,
        node_cfg.capacity_bytes,
        grace_s=config.gc.grace_s,
        high_watermark=config.gc.high_watermark,
        primary_budget_bytes=(
            primary_budget_bytes(config.groups, capacities, node_id)
            if any(node_id in group for group in config.groups)
            else None  # a node no group uses yet (``kvctl group add`` will)
        ),
        room_wait_s=config.gc.room_wait_s,
        quotas=config.quotas,
        max_disk_fraction=config.gc.max_disk_fraction,
        max_headroom_bytes=config.gc.max_headroom_bytes,
        unconfirmed_share=config.gc.unconfirmed_share,
    )
    node = StorageNode(config, node_id, engine)
    try:
        return node, NodeServer(node, node_cfg.host, node_cfg.port, node_cfg.local_socket)
    except OSError as exc:
        engine.close()
        where, cause = f"{node_cfg.host}:{node_cfg.port}", os.strerror(exc.errno) if exc.errno else str(exc)
        raise cluster_mod.ConfigError(
            f"node {node_id} cannot listen on {where} (its port in {config_path}): {cause}"
        ) from None


MMAP_THRESHOLD_BYTES = 256 << 10
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _return_large_buffers_to_the_kernel() -> None:
    """Allocations of ``MMAP_THRESHOLD_BYTES`` or more get mappings of their own, unmapped when freed. glibc's
    default raises that threshold to the size of each large buffer freed, up to 32 MiB, so a request's metadata
    buffer, grown by doubling on a connection thread, then leaves its smaller steps in that thread's arena: 12
    connections filling the 32 MiB metadata budget held ~55 MiB (``limits.max_buffered_meta_bytes`` would not
    bound the node's memory). Fixing the threshold turns that off. No-op where ``mallopt`` is not glibc's."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallopt"):
        libc.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(MMAP_THRESHOLD_BYTES))


def serve(node: StorageNode, server: NodeServer, workers: Sequence[Callable[[threading.Event], None]] = ()) -> None:
    """Serve until SIGTERM/SIGINT, then close the engine cleanly.

    Runs beside the connections: the flush loop (LMDB every ``gc.meta_sync_s``, batched access times every
    ``gc.access_flush_s``), the metrics endpoint, and each of ``workers`` (called with the stop event).
    Prints ``node <id> ready`` once it accepts connections (``kvstore.cluster.local`` waits for that line).
    """
    engine = node.engine
    node_cfg = node.config.nodes[node.node_id]
    access_every = max(0.05, node.config.gc.access_flush_s)
    sync_every = max(0.05, node.config.gc.meta_sync_s)

    def flush() -> None:
        next_sync = next_access = time.monotonic()
        while not server.stopping.wait(min(sync_every, access_every)):
            now = time.monotonic()
            if now >= next_access:
                engine.flush_access()
                next_access = now + access_every
            if now >= next_sync:
                engine.sync()
                next_sync = now + sync_every

    threading.Thread(target=flush, daemon=True).start()
    for work in workers:
        threading.Thread(target=work, args=(server.stopping,), daemon=True).start()
    node.metrics.connections(server.admission.stats)
    if node_cfg.metrics_port:
        limits = node.config.limits
        MetricsServer(node.metrics.registry, node_cfg.metrics_host, node_cfg.metrics_port, node.health, limits).start()

    def on_signal(signum: int, _frame: object) -> None:
        threading.Thread(target=server.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"node {node.node_id} ready on {node_cfg.host}:{node_cfg.port}", flush=True)
    server.serve_forever()
    engine.close()
