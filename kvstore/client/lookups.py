"""Metadata lookups, deletes and operator calls: small requests, no payloads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.kvstore.client.core import ClientCore
from kvtier.kvstore.codec import TOTAL_SHARDS
from kvtier.kvstore.placement import RECORD_HOLDERS
from kvtier.kvstore.wire.fields import RecordState, pack_keys
from kvtier.kvstore.wire.protocol import Op
from kvtier.kvstore.wire.transport import Exchange

REBUILDING = 2  # a MATCH answer: the primary is rebuilding its data dir and has no record of the block yet

_ANY_SHARD = 255  # a DELETE's ``idx`` for a key of which the node holds several shards: it looks among all


class Lookups(ClientCore):
    """``match``, ``exists``, ``liveness``, ``delete``, ``stat`` and the admin calls (see ``Client``)."""

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
        """Per key: 1 stored and live, 0 not, -1 unknown (none of the holders of its record answered). Each key's
        primary is asked; where it does not answer, or is rebuilding its data dir and has no record of the block
        yet (it answers 2), the holders of the record's copies (shards 1 and 2) answer for it: live if one keeps
        the record and its shard, not if one answered without them."""
        live = np.full(len(keys), -1, dtype=np.int8)
        if not keys:
            return live
        self._ask_primaries(keys, live)
        unsure = np.flatnonzero((live == REBUILDING) | (live == -1))
        if len(unsure):
            asked = np.zeros((len(unsure), TOTAL_SHARDS), dtype=bool)
            asked[:, 1:RECORD_HOLDERS] = True
            copies = self._probe([keys[b] for b in unsure.tolist()], asked)
            kept = (copies.present[:, 1:RECORD_HOLDERS] & (copies.records[:, 1:] == RecordState.HELD)).any(axis=1)
            answered = copies.answered[:, 1:RECORD_HOLDERS].any(axis=1)
            live[unsure] = np.where(kept, 1, np.where(answered, 0, -1))
        moved = self.moved(keys, np.flatnonzero(live == 0))  # a growth moving blocks: ask where they were before
        if len(moved) and self.previous is not None:
            with self.placed_by(self.previous):
                again = self.liveness([keys[b] for b in moved.tolist()])
            live[moved] = np.where(again == 1, 1, live[moved])
        return live

    def _ask_primaries(self, keys: Sequence[bytes], live: np.ndarray) -> None:
        blob, klen = pack_keys(keys)
        order, runs, rows = self.placement.primary_runs(blob, klen)  # each primary's keys: one run of sorted rows
        exchange = Exchange(self.pool)
        asks = [
            exchange.request(node, Op.MATCH, {"keys": rows[lo * klen : hi * klen], "klen": klen})
            for node, lo, hi in runs
        ]
        exchange.run(self.config.client.op_timeout_s)
        flags = [self._answer(pending, "live", hi - lo) for (_, lo, hi), pending in zip(runs, asks, strict=True)]
        if all(f is not None for f in flags):  # (the usual case: every primary answered, in one pass)
            live[order] = np.frombuffer(b"".join(flags), dtype=np.int8)  # type: ignore[arg-type]
            return
        answers = np.full(len(keys), -1, dtype=np.int8)  # in the sorted order
        for (_, lo, hi), answer in zip(runs, flags, strict=True):
            if answer is not None:
                answers[lo:hi] = np.frombuffer(answer, dtype=np.int8)
        live[order] = answers

    def delete(self, keys: Sequence[bytes], before: float | None = None, primary_done: int | None = None) -> bool:
        """Remove blocks: all 12 nodes of each block's group drop its shards and records (the primary's and
        the copies at shard 1's and 2's holders). Returns whether every one of those nodes answered.

        ``before`` (seconds since the epoch; the GC's evictions pass their time) spares records and shards
        written after it, so a block stored again meanwhile is not harmed. A node that is down keeps its
        shards, which no reader is given once the primary's record is gone; they go when they expire (the
        GC, which removes blocks itself, retries its DELETEs until every node answered).

        ``primary_done``: the node that already removed these blocks' records and shard 0s (their primary, in
        the transaction that wrote its eviction intents): it is asked only about other shards it holds.
        Each node is told which shard each key has there (``idx``), or to look among all of them where it
        holds several.
        """
        if not keys:
            return True
        moved = self.moved(keys, np.arange(len(keys)))
        done = True
        if len(moved) and self.previous is not None:  # a growth moving blocks: where they were before, too
            with self.placed_by(self.previous):
                done = self.delete([keys[b] for b in moved.tolist()], before, primary_done)
        shard_nodes = self.placement.shard_nodes(keys)
        blob, klen = pack_keys(keys)
        table = np.frombuffer(blob, dtype=np.uint8).reshape(len(keys), klen)
        exchange = Exchange(self.pool)
        asks = []
        for node_id in np.unique(shard_nodes).tolist():
            held = shard_nodes == node_id
            count = held.sum(axis=1)
            asked = count - held[:, 0] if node_id == primary_done else count
            positions = np.flatnonzero(asked)
            if not len(positions):
                continue
            index = np.where(count[positions] == 1, held[positions].argmax(axis=1), _ANY_SHARD).astype(np.uint8)
            meta: dict[str, Any] = {"keys": table[positions].tobytes(), "klen": klen, "idx": index.tobytes()}
            if before is not None:
                meta["before"] = float(before)
            asks.append(exchange.request(node_id, Op.DELETE, meta))
        exchange.run(self.config.client.op_timeout_s)
        return done and all(pending.ok for pending in asks)

    def delete_on(self, node_id: int, keys: Sequence[bytes]) -> bool:
        """Drop ``keys``' shards and records on one node, whichever shards of them it holds (a growth's move
        deletes a block's old copies this way, node by node). Whether the node answered."""
        blob, klen = pack_keys(keys)
        exchange = Exchange(self.pool)
        meta = {"keys": blob, "klen": klen, "idx": bytes([_ANY_SHARD]) * len(keys)}
        pending = exchange.request(node_id, Op.DELETE, meta)
        exchange.run(self.config.client.op_timeout_s)
        return pending.ok

    def stat(self, key: bytes) -> dict[str, Any]:
        """Where a block's shards live and what its primary records (for operators)."""
        nodes = self.placement.shard_nodes([key])[0].tolist()
        exchange = Exchange(self.pool)
        asks = {nid: exchange.request(nid, Op.STAT, {"key": key}) for nid in sorted(set(nodes))}
        exchange.run(self.config.client.op_timeout_s)
        out: dict[str, Any] = {"key": key.hex(), "primary": nodes[0], "block": None, "shards": []}
        records: dict[int, dict[str, Any] | None] = {}
        for nid, pending in asks.items():
            if not pending.ok:
                out["shards"].append({"node": nid, "error": pending.error})
                continue
            assert pending.frame is not None
            meta = pending.frame.meta
            records[nid] = meta["block"]
            out["shards"].extend({"node": nid, **s} for s in meta["shards"])
        # the primary's record, else a copy kept by the holder of shard 1 or 2
        out["block"] = next((records[n] for n in nodes[:RECORD_HOLDERS] if records.get(n)), None)
        return out

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
